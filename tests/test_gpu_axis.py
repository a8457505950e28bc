"""The GPU as a named axis of the environment: what a run records of each GPU, how a GPU
is named (``H100 80GB HBM3 (sm90)``), and runs from an A100 runner and an H100 runner
side by side in the report, the Markdown and terminal summaries and ``compare``. The runs
are the stored CPU run with its cells moved to ``cuda:0`` and an ``env.json`` per GPU."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import cli
from harness.measure.host import cuda_facts, environment, flash_kernels
from harness.measure.host.cuda_facts import CudaFacts, DeviceFacts
from harness.report import aggregate
from harness.report.compare import pair_runs
from harness.report.markdown import render_markdown
from harness.report.writing import render_report
from harness.results import storage
from harness.results.summary import render_summary
from harness.schema import gpus
from harness.schema.records import CellRecord, Outcome

STORED = Path(__file__).parent / "data" / "runs" / "torch-2.13.0"
A100 = {"device": "cuda:0", "name": "NVIDIA A100-SXM4-40GB", "capability": "8.0",
        "memory_bytes": 42_298_834_944, "driver": "550.54.15", "cuda_runtime": "12.4"}  # fmt: skip
H100 = {"device": "cuda:0", "name": "NVIDIA H100 80GB HBM3", "capability": "9.0",
        "memory_bytes": 85_045_493_760, "driver": "550.54.15", "cuda_runtime": "12.4"}  # fmt: skip
A100_NAME, H100_NAME = "A100-SXM4-40GB (sm80)", "H100 80GB HBM3 (sm90)"


def on_gpu(record: CellRecord) -> CellRecord:
    return dataclasses.replace(record, cell=dataclasses.replace(record.cell, device="cuda:0"))


def gpu_run(folder: Path, gpu: dict[str, Any], host: str, broken: int | None = None) -> Path:
    """The stored run's cells on ``cuda:0`` of a machine with ``gpu``; the record at index
    ``broken``, where given, raises instead of what it did."""
    env = dataclasses.replace(storage.read_env(STORED), gpus=[gpu], hostname=host)
    folder.mkdir(parents=True)
    storage.write_env(folder, env)
    for index, record in enumerate(storage.read_records(STORED)):
        moved = on_gpu(record)
        if index == broken:
            moved = dataclasses.replace(
                moved, outcome=Outcome.RAISES, error_type="RuntimeError", perf=None
            )
        storage.append_record(folder, moved)
    return folder


@pytest.fixture
def a100_h100(tmp_path: Path) -> tuple[Path, Path]:
    """An A100 runner's run and an H100 runner's of the same code; on the H100 the first
    passing cell raises."""
    first_pass = next(
        i for i, r in enumerate(storage.read_records(STORED)) if r.outcome is Outcome.PASSES
    )
    return (
        gpu_run(tmp_path / "a100" / "run", A100, "runner-a100"),
        gpu_run(tmp_path / "h100" / "run", H100, "runner-h100", broken=first_pass),
    )


@pytest.mark.parametrize(
    ("gpu", "name"),
    [
        (H100, H100_NAME),
        (A100, A100_NAME),
        ({"name": "Tesla T4", "capability": "7.5"}, "Tesla T4 (sm75)"),
        ({"name": "NVIDIA GeForce RTX 4090", "capability": "8.9"}, "GeForce RTX 4090 (sm89)"),
        ({"name": "NVIDIA B200", "capability": "10.0"}, "B200 (sm100)"),
        ({"name": "NVIDIA L4"}, "L4"),  # a run from before capability was recorded
    ],
)
def test_a_gpu_is_named_as_people_name_it(gpu: dict[str, Any], name: str) -> None:
    assert gpus.gpu_name(gpu) == name


def test_a_device_label_is_its_gpu_and_the_cpu_is_cpu() -> None:
    assert gpus.device_label([H100], "cuda:0") == H100_NAME
    assert gpus.device_label([H100], "cuda") == H100_NAME
    assert gpus.device_label([H100], "cpu") == "cpu"
    assert gpus.device_label([], "cuda:0") == "cuda:0"  # nothing recorded: the device
    two = [H100, {**H100, "device": "cuda:1"}]
    assert gpus.device_label(two, "cuda:1") == f"{H100_NAME} cuda:1"  # twins told apart
    mixed = [A100, {**H100, "device": "cuda:1"}]
    assert gpus.device_label(mixed, "cuda:1") == H100_NAME
    assert gpus.environment_label("2.11.0+cu124", H100_NAME) == f"torch 2.11.0 · {H100_NAME}"
    assert gpus.gpus_text(two) == f"2x {H100_NAME}"
    assert gpus.gpus_text(None) == "no GPU"


def test_a_run_records_each_gpu_it_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    """Model, capability, memory, driver and CUDA runtime per GPU, from a faked CUDA."""
    devices = (
        DeviceFacts("NVIDIA A100-SXM4-40GB", 8, 0, 42_298_834_944, 108),
        DeviceFacts("NVIDIA H100 80GB HBM3", 9, 0, 85_045_493_760, 132),
    )
    monkeypatch.setattr(cuda_facts, "facts", lambda: CudaFacts(devices, 90100))
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    smi: list[list[str]] = []

    def nvidia_smi(argv: list[str]) -> str:
        smi.append(argv)
        return "550.54.15\n550.54.15"

    monkeypatch.setattr(environment, "command_output", nvidia_smi)
    facts = environment.gpu_facts()
    assert facts == [
        {"device": "cuda:0", "name": "NVIDIA A100-SXM4-40GB", "capability": "8.0",
         "memory_bytes": 42_298_834_944, "multiprocessors": 108, "driver": "550.54.15",
         "cuda_runtime": "12.4"},
        {"device": "cuda:1", "name": "NVIDIA H100 80GB HBM3", "capability": "9.0",
         "memory_bytes": 85_045_493_760, "multiprocessors": 132, "driver": "550.54.15",
         "cuda_runtime": "12.4"},
    ]  # fmt: skip
    assert smi and smi[0][0] == "nvidia-smi"
    assert [gpus.device_label(facts, d) for d in ("cuda:0", "cuda:1")] == [A100_NAME, H100_NAME]


def test_without_cuda_a_run_records_no_gpu_and_asks_no_driver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cuda_facts, "facts", CudaFacts)
    monkeypatch.setattr(environment, "command_output", pytest.fail)
    assert environment.gpu_facts() == []


def fake_gpu(monkeypatch: pytest.MonkeyPatch, major: int, minor: int, name: str) -> None:
    gpu = CudaFacts((DeviceFacts(name, major, minor, 0, 0),))
    monkeypatch.setattr(cuda_facts, "facts", lambda: gpu)


def test_skip_reasons_name_the_capability_and_the_gpu_that_lacked_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(flash_kernels, "installed_version", {"flash-attn-4": "4.0.0b36"}.get)
    fake_gpu(monkeypatch, 8, 0, "NVIDIA A100-SXM4-40GB")
    assert environment.backend_skip_reason("cuda:0", "flash-attn") == (
        "flash-attn 4 needs sm90+ (cuda:0 is sm80, A100-SXM4-40GB) and flash-attn 2 is not "
        "installed"
    )
    assert environment.dtype_skip_reason("cuda:0", "bfloat16") is None
    fake_gpu(monkeypatch, 7, 5, "Tesla T4")
    assert environment.dtype_skip_reason("cuda:0", "bfloat16") == (
        "bfloat16 needs sm80+ (cuda:0 is sm75, Tesla T4)"
    )
    assert environment.dtype_skip_reason("cuda:0", "float16") is None


def test_an_a100_run_and_an_h100_run_are_two_columns_named_by_their_gpus(
    a100_h100: tuple[Path, Path],
) -> None:
    runs = aggregate.load_runs(list(a100_h100))
    frame = aggregate.records_frame(runs)
    assert sorted(frame["env"].unique()) == [f"torch 2.13.0 · {A100_NAME}",
                                             f"torch 2.13.0 · {H100_NAME}"]  # fmt: skip
    assert set(frame["host"]) == {""}  # the GPUs tell them apart: no host named
    columns = aggregate.summary_matrix(frame).columns.get_level_values(0)
    assert set(columns) == set(frame["env"])
    html = render_report(runs)
    assert f"torch 2.13.0 · {A100_NAME}" in html and f"torch 2.13.0 · {H100_NAME}" in html
    markdown = render_markdown(runs)
    assert f"| torch 2.13.0 · {A100_NAME} |" in markdown
    assert f"| torch 2.13.0 · {H100_NAME} |" in markdown


def test_runs_on_the_same_gpu_from_two_hosts_keep_the_host(tmp_path: Path) -> None:
    runs = aggregate.load_runs(
        [gpu_run(tmp_path / "a", H100, "host-a"), gpu_run(tmp_path / "b", H100, "host-b")]
    )
    envs = set(aggregate.records_frame(runs)["env"])
    assert envs == {f"torch 2.13.0 · {H100_NAME} · host-a", f"torch 2.13.0 · {H100_NAME} · host-b"}


def test_compare_of_two_runs_that_differ_only_in_gpu_names_both_and_lists_what_differs(
    a100_h100: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    a100, h100 = a100_h100
    code = cli.main(["compare", str(a100), str(h100)])
    out = capsys.readouterr().out
    assert f"  base: torch 2.13.0 · {A100_NAME} on runner-a100" in out
    assert f"  head: torch 2.13.0 · {H100_NAME} on runner-h100" in out
    assert f"speed on {A100_NAME} -> {H100_NAME} judged against" in out
    regressed = [line for line in out.splitlines() if line.rstrip().endswith("REGRESSION")]
    assert len(regressed) == 1 and "outcome" in regressed[0] and "cuda:0" in regressed[0]
    assert code == 1


def test_results_folders_of_two_gpus_pair_by_gpu_and_say_which_had_no_partner(
    a100_h100: tuple[Path, Path],
) -> None:
    """Folders pair runs of the same release and GPUs (whichever host of a runner pool ran
    them); across GPUs, two run folders are compared explicitly (as the test above does)."""
    a100, h100 = a100_h100
    pairing = pair_runs(a100.parent, h100.parent)
    assert pairing.pairs == []
    assert pairing.unpaired_bases == [a100]
    assert any(f"no run of torch 2.13.0+cpu · {A100_NAME} in" in line
               for line in pairing.left_out)  # fmt: skip


def test_runs_of_one_gpu_kind_pair_whichever_host_ran_them(
    a100_h100: tuple[Path, Path], tmp_path: Path
) -> None:
    """A nightly's GPU jobs land on any runner of their kind: last night's A100 run on
    one host pairs with tonight's on another."""
    a100, _ = a100_h100
    tonight = tmp_path / "tonight"
    moved = tonight / a100.name
    shutil.copytree(a100, moved)
    env = json.loads((moved / "env.json").read_text())
    env["hostname"] = "runner-a100-2"
    (moved / "env.json").write_text(json.dumps(env))
    assert pair_runs(a100.parent, tonight).pairs == [(a100, moved)]


def test_the_terminal_summary_names_the_gpu(a100_h100: tuple[Path, Path]) -> None:
    a100, _ = a100_h100
    records = storage.read_records(a100)
    summary = render_summary(records, {"cuda:0": A100_NAME})
    assert summary.splitlines()[0] == f"ran on: torch 2.13.0 · {A100_NAME}"
    mixed = records + storage.read_records(STORED)  # the CPU's cells beside the GPU's
    table = render_summary(mixed, {"cuda:0": A100_NAME, "cpu": "cpu"})
    assert f"{A100_NAME}/float16/half" in table and "cpu/float16/half" in table


def test_a_finished_run_names_its_devices_from_env_json(a100_h100: tuple[Path, Path]) -> None:
    """What ``show_run`` gives the summary: each device of the records by its GPU."""
    from harness.cli.output import device_names

    records = storage.read_records(a100_h100[0]) + storage.read_records(STORED)
    assert device_names(a100_h100[0], records) == {"cuda:0": A100_NAME, "cpu": "cpu"}
    assert device_names(a100_h100[0].parent, records) == {}  # no env.json: none named
