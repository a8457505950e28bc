"""The CLI end to end, as a user runs it: real processes, real pytest-xdist workers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from harness.cli import main
from harness.cli.listing import describe_case
from harness.measure.authoring.case import Case, FailureSignature, Upstream
from harness.measure.authoring.model_case import Matrix, model_case
from harness.results import storage
from harness.runner.matrix import concrete_stages
from harness.schema.axes import STAGES
from harness.schema.records import CrashKind, NoteKind, Outcome
from tests.conftest import BROKEN_CASES, FIXTURES, TOY_CASES, harness, only_run_dir


def test_run_toy_case_end_to_end(tmp_path: Path) -> None:
    result = harness(
        "run",
        "--cases-dir",
        str(TOY_CASES),
        "--case",
        "toy-mixed-matmul",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        "-n",
        "2",
    )
    assert result.returncode == 0, result.stderr
    run_dir = only_run_dir(tmp_path)
    records = storage.read_records(run_dir)
    by_fix = {(r.cell.fix, r.cell.dtype, r.cell.device): r for r in records}
    assert by_fix["none", "float16", "cpu"].outcome is Outcome.RAISES
    assert by_fix["none", "float16", "cpu"].reproduces
    assert by_fix["cast-input", "bfloat16", "cpu"].outcome is Outcome.PASSES
    assert by_fix["noisy", "float16", "cpu"].outcome is Outcome.INACCURATE
    assert by_fix["none", "float32", "cpu"].outcome is Outcome.PASSES
    ran = [r for r in records if r.outcome is not Outcome.SKIPPED]
    assert len(ran) == 15 and {r.worker for r in ran} <= {"gw0", "gw1"}  # 5 fixes' controls
    assert {r.cell.fix for r in ran if r.cell.mode == "fp32"} == {r.cell.fix for r in ran}
    env = storage.read_env(run_dir)
    assert env.torch_version and env.command and env.command[1] == "run"
    assert env.finished_at is not None
    assert "raises:repro" in result.stdout and "raises:OTHER" in result.stdout
    assert str(run_dir / "cells.jsonl") in result.stdout


def test_cells_that_ran_are_timed_serially_on_the_cpu(tmp_path: Path) -> None:
    result = harness(
        "run",
        "--cases-dir",
        str(TOY_CASES),
        "--case",
        "toy-mixed-matmul",
        "--fix",
        "none,cast-input,noisy",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        "--time-budget",
        "0.05",
    )
    assert result.returncode == 0, result.stderr
    run_dir = only_run_dir(tmp_path)
    records = storage.read_records(run_dir)
    timed = [r for r in records if r.perf is not None]
    assert {r.outcome for r in timed} == {Outcome.PASSES, Outcome.INACCURATE}
    assert all(r.outcome is Outcome.RAISES for r in records if r.perf is None)
    for record in timed:
        perf = record.perf
        assert perf is not None and perf.time_count == len(perf.time_samples) >= 7
        assert perf.flops == 2 * 4 * 16 * 16 and perf.peak_mem_bytes > 0
        assert perf.peak_gflops and perf.threads >= 1
    # one correctness line, then one timed line per timed cell: a log, folded on reading
    lines = storage.read_record_lines(run_dir)
    assert len(lines) == len(records) + len(timed)
    # one device: the CPU is timed serially, from the run's own process (no worker)
    assert {r.perf.timing_worker for r in timed if r.perf} == {"main"}
    env = storage.read_env(run_dir)
    phase = env.timing_phase
    assert phase and phase["cells"] == len(timed) and 0 < phase["measured_s"] < phase["wall_s"]
    assert f"ampmatrix: timed {len(timed)} cells in" in result.stdout
    assert env.peak_gflops and set(env.peak_gflops["cpu"]) == {"float16", "bfloat16", "float32"}
    assert "time per call" in result.stdout


def test_a_crashing_cell_costs_only_itself(tmp_path: Path) -> None:
    crash_cases = str(FIXTURES / "crash_cases")
    result = harness(
        "run",
        "--cases-dir",
        crash_cases,
        "--case",
        "toy-abort",
        "--fix",
        "none,abort,abort-when-timed",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        "-n",
        "2",
        "--time-budget",
        "0.05",
    )
    assert result.returncode == 0, result.stderr
    records = {r.cell.fix: r for r in storage.read_records(only_run_dir(tmp_path))}
    assert records["abort"].outcome is Outcome.CRASHED
    assert records["abort"].crash_kind is CrashKind.PROCESS_DIED
    assert "signal 6 (SIGABRT)" in str(records["abort"].error_message)
    assert records["none"].outcome is Outcome.PASSES
    # a crash while timing keeps what the correctness phase measured, with why timing failed
    when_timed = records["abort-when-timed"]
    assert when_timed.outcome is Outcome.PASSES and when_timed.numerics is not None
    assert when_timed.perf is None and "died" in str(when_timed.timing_error)
    # its column was timed in a process of its own: the others are timed alone instead
    assert records["none"].perf is not None
    told = [n.kind for n in records["none"].notes if n.kind is not NoteKind.NOISY]
    assert told == [NoteKind.TIMED_ALONE]  # whether its timing settled is the load's


def test_seed_case_reproduces_through_the_cli(tmp_path: Path) -> None:
    result = harness(
        "run",
        "--case",
        "sana-softmax-float",
        "--mode",
        "half",
        "--device",
        "cpu",
        "--out",
        str(tmp_path),
        "-n",
        "0",
        "--no-timing",
        "--stage",
        "forward",
    )
    assert result.returncode == 0, result.stderr
    lines = (only_run_dir(tmp_path) / "cells.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    nones = [r for r in records if r["fix"] == "none"]
    assert {r["dtype"] for r in nones} == {"float16", "bfloat16"}
    assert all(r["outcome"] == "raises" and r["reproduces"] for r in nones)
    assert all(r["outcome"] == "passes" for r in records if r["fix"] != "none")


def test_list_shows_cases_fixes_and_links() -> None:
    result = harness("list", "--cases-dir", str(TOY_CASES))
    assert result.returncode == 0, result.stderr
    assert "toy-mixed-matmul: Toy: fp32 activations times a half weight" in result.stdout
    assert "sana-softmax-float" in result.stdout and "cast-input" in result.stdout
    assert "github.com/NVlabs/Sana" in result.stdout


class EveryStage(Case):
    """A case declaring every stage (never registered: only its declaration is read)."""

    name = "every-stage"
    title = "Declares forward, train and fit"
    upstream = Upstream(repo="example/every", file="every.py", commit="-")
    failure = FailureSignature("RuntimeError", "never")
    stages = tuple(STAGES)


def help_of(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    """``COMMAND --help`` as one line of words (argparse wraps it to the terminal)."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_the_stage_flags_help_names_the_stages_a_run_covers_without_it(
    capsys: pytest.CaptureFixture[str], clean_registry: None
) -> None:
    """``run`` covers forward and train unless ``--stage`` says otherwise, ``check`` the
    forward pass: each help says so, read from what each runs without the flag."""
    run_default = concrete_stages(EveryStage(), ())
    checked = model_case("every-stage-model", lambda: None, Matrix(), __file__)
    check_default = concrete_stages(checked, ())
    assert run_default != check_default  # the two differ, so the help must tell them apart
    for command in ("run", "check"):
        said = re.search(r"--stage NAME .*?\(default: (.*?), those .*?; in check: (.*?)\)",
                         help_of(command, capsys))  # fmt: skip
        assert said is not None
        assert said.group(1).split(" and ") == list(run_default)
        assert said.group(2).split(" and ") == list(check_default)


def test_list_shows_each_cases_stages_and_which_run_only_on_request() -> None:
    lines = describe_case(EveryStage())
    assert "  stages:   forward, train; on request (--stage): fit" in lines
    result = harness("list")
    assert result.returncode == 0, result.stderr
    described = result.stdout.split("\n\n")
    staged = next(text for text in described if text.startswith("bf16-pure-weights:"))
    assert "  stages:   forward, train; on request (--stage): fit\n" in staged
    cases = [text for text in described if re.match(r"[a-z0-9-]+: ", text)]
    assert staged in cases and all("\n  stages:   forward" in text for text in cases)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("run", "--case", "sana-softmax-flaot"), "did you mean sana-softmax-float"),
        (
            ("run", "--case", "sana-softmax-float", "--fix", "cast-atn-to-v"),
            "did you mean cast-attn-to-v",
        ),
        (("run", "--cases-dir", str(BROKEN_CASES)), "no_none_fix.py"),
        (("run", "--timeout", "nan"), "'nan' is not a positive finite number"),
        (("run", "--timeout", "inf"), "'inf' is not a positive finite number"),
        (("run", "--timeout", "1e400"), "'1e400' is not a positive finite number"),
        (("run", "--time-budget", "nan"), "'nan' is not a positive finite number"),
        (("run", "--memory-limit", "inf"), "'inf' is not a positive finite number"),
        (("run", "--memory-limit", "1e-12"), "too small a memory limit"),
        (("run", "--timeout", "1e12"), "'1e12' seconds is longer than a run can wait"),
        (("run", "--time-budget", "3e6"), "'3e6' seconds is longer than a run can wait"),
        (("run", "--memory-limit", "1e12"), "is more memory than this machine has"),
        (("run", "-n", "100000"), "'100000' is not 'auto' or a number of workers from 0 to"),
        (("check", "m:f", "-n", "-1"), "'-1' is not 'auto' or a number of workers"),
        (("run", "--case", ""), "--case was given no name"),
        (("run", "--device", "cuda:abc"), "unknown device 'cuda:abc'"),
        (
            ("run", "--case", "sana-softmax-float", "--mode", "fp32", "--dtype", "float16"),
            "the selection matches no cell",
        ),
    ],
)
def test_bad_input_is_refused_clearly(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    result = harness(*args, "--out", str(tmp_path))
    assert result.returncode == 2
    assert message in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--alpha", "5", "'5' is not a probability between 0 and 1"),
        ("--alpha", "1", "'1' is not a probability between 0 and 1"),
        ("--min-ratio", "0.5", "'0.5' is not a speed ratio above 1"),
        ("--min-ratio", "nan", "'nan' is not a positive finite number"),
    ],
)
def test_compare_refuses_thresholds_that_mean_nothing(
    capsys: pytest.CaptureFixture[str], option: str, value: str, message: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "base", "head", option, value])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
