"""The run pipeline's planning pieces: timing groups, worker layout, per-device timers."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness.measure.figures.timing import ClockStopwatch, CudaEventStopwatch, stopwatch_for
from harness.results import storage
from harness.runner import forked, pytest_launch, run
from harness.runner.cell_items import Controller
from harness.schema.axes import Cell
from harness.schema.config import RunConfig
from harness.schema.records import CellRecord, Outcome
from harness.schema.run_files import RunPlan


def ran(fix: str, device: str, dtype: str = "float16") -> CellRecord:
    return CellRecord(Cell("c", fix, device, dtype, "half", "sdpa"), "2.13.0", Outcome.PASSES)


def test_cells_compared_with_each_other_are_timed_together() -> None:
    records = [ran("a", "cpu"), ran("b", "cpu"), ran("a", "cuda:0"), ran("a", "cpu", "bfloat16")]
    columns = run.timing_columns(records)
    assert {name: [r.cell.fix for r in rs] for name, rs in columns.items()} == {
        "c[cpu,float16,half]": ["a", "b"],
        "c[cuda:0,float16,half]": ["a"],
        "c[cpu,bfloat16,half]": ["a"],
    }


def test_timing_runs_one_worker_per_device_grouped_by_device(tmp_path: Path) -> None:
    args = pytest_launch.pytest_args(tmp_path / "timing-plan.json", workers=3, grouped=True)
    assert args[args.index("-n") + 1] == "3"
    assert args[args.index("--dist") + 1] == "loadgroup"
    assert "--dist" not in pytest_launch.pytest_args(tmp_path / "plan.json", workers=2)
    assert "-n" not in pytest_launch.pytest_args(tmp_path / "plan.json", workers=0)


def test_the_cell_run_loads_no_plugin_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Users' pytest plugins (timeouts, reruns, benchmarks) stay out of the cell run; xdist
    is named explicitly, and the caller's setting comes back afterwards."""
    seen: list[str | None] = []
    monkeypatch.setenv(pytest_launch.NO_AUTOLOAD, "0")

    def main(*args: object, **kwargs: object) -> int:
        seen.append(os.environ.get(pytest_launch.NO_AUTOLOAD))
        return 0

    monkeypatch.setattr(pytest, "main", main)
    args = pytest_launch.pytest_args(tmp_path / "plan.json", workers=2)
    assert pytest_launch.run_pytest(args, Controller(tmp_path, {}), threads=1) == 0
    assert seen == ["1"] and os.environ[pytest_launch.NO_AUTOLOAD] == "0"
    assert args[args.index("xdist.plugin") - 1] == "-p"


def test_worker_count_never_exceeds_cells() -> None:
    cells = [ran(f"f{i}", "cpu").cell for i in range(3)]
    assert pytest_launch.worker_count("8", run.batches_of(cells, 1)) == 3
    assert pytest_launch.worker_count("0", run.batches_of(cells, 1)) == 0
    assert pytest_launch.worker_count("auto", run.batches_of(cells * 400, 1)) >= 1


def test_auto_workers_give_every_gpu_its_own_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    cells = [
        ran(f"f{i}", device).cell
        for i in range(4)
        for device in ("cpu", "cuda:0", "cuda:1", "cuda:2")
    ]
    assert (
        pytest_launch.worker_count("auto", run.batches_of(cells, 1)) == 4
    )  # three GPUs and the CPU, on 2 cores


def test_auto_workers_are_none_where_one_would_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """One batch, or one GPU's batches only: the cells run from the calling process, with
    no worker interpreter to start; explicit counts are kept."""
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    one_batch = [ran(f"f{i}", "cpu").cell for i in range(5)]
    assert pytest_launch.worker_count("auto", run.batches_of(one_batch, 16)) == 0
    assert pytest_launch.worker_count("1", run.batches_of(one_batch, 16)) == 1
    models_on_one_gpu = [replace(ran("none", "cuda:0").cell, case=f"m{i}") for i in range(14)]
    assert pytest_launch.worker_count("auto", run.batches_of(models_on_one_gpu, 16)) == 0
    assert (
        pytest_launch.worker_count("auto", run.batches_of(models_on_one_gpu + one_batch * 4, 1))
        == 16
    )


def test_timing_runs_from_this_process_where_there_is_one_device() -> None:
    assert pytest_launch.timing_workers({"cpu"}) == 0
    assert pytest_launch.timing_workers({"cuda:0"}) == 0
    assert pytest_launch.timing_workers({"cpu", "cuda:0", "cuda:1"}) == 3


def test_gpu_cells_are_grouped_per_device_in_the_correctness_phase(
    pytester: pytest.Pytester,
) -> None:
    cells = [ran("none", d).cell.to_dict() for d in ("cpu", "cuda:0", "cuda:1")]
    storage.write_json_atomic(
        pytester.path / storage.RUN_PLAN_FILE,
        {"config": RunConfig().to_dict(), "cells": cells, "skipped": []},
    )
    plan = pytester.path / storage.PLAN_FILE
    batches = [[cell] for cell in cells]
    plan.write_text(json.dumps({"run_dir": str(pytester.path), "batches": batches}))
    items, _ = pytester.inline_genitems(str(plan), "-p", "harness.runner.cell_items")
    groups = {item.name: [m.args[0] for m in item.iter_markers("xdist_group")] for item in items}
    assert groups == {
        "c[none,cpu,float16,half,sdpa]": [],
        "c[none,cuda:0,float16,half,sdpa]": ["cuda:0"],
        "c[none,cuda:1,float16,half,sdpa]": ["cuda:1"],
    }


def test_cells_are_batched_by_case_and_device_in_plan_order() -> None:
    def cell(case: str, fix: str, device: str = "cpu") -> Cell:
        return Cell(case, fix, device, "float16", "half", "sdpa")

    cells = [cell("a", f) for f in "pqrst"] + [cell("a", "p", "cuda:0"), cell("b", "p")]
    batches = run.batches_of(cells, size=2)
    assert [[c.fix for c in batch] for batch in batches] == [
        ["p", "q"],
        ["r", "s"],
        ["t"],
        ["p"],
        ["p"],
    ]
    assert [batch[0].device for batch in batches[3:]] == ["cuda:0", "cpu"]
    assert run.batches_of(cells, size=1) == [[c] for c in cells]


def test_cuda_devices_are_timed_with_events_and_cpu_with_the_host_clock() -> None:
    assert isinstance(stopwatch_for(torch.device("cpu")), ClockStopwatch)
    assert isinstance(stopwatch_for(torch.device("cuda:1")), CudaEventStopwatch)


def test_measured_peaks_collect_per_device_and_dtype() -> None:
    from harness.schema.records import Perf

    def with_peak(record: CellRecord, peak: float) -> CellRecord:
        perf = Perf([1.0], 1, 1.0, 0.0, 1.0, 1, False, "t", 1, 0, None, peak, None, 0, "m")
        return CellRecord(record.cell, record.torch_version, record.outcome, perf=perf)

    peaks = run.measured_peaks(
        [with_peak(ran("a", "cpu"), 5.0), with_peak(ran("a", "cpu", "bfloat16"), 7.0)]
    )
    assert peaks == {"cpu": {"float16": 5.0, "bfloat16": 7.0}}


def test_a_crash_is_described_by_pytests_message_not_its_report_objects() -> None:
    from types import SimpleNamespace

    from harness.runner.cell_items import crash_message

    crash = SimpleNamespace(message="worker 'gw0' crashed while running 'cell'")
    report = SimpleNamespace(longrepr=SimpleNamespace(reprcrash=crash))
    assert crash_message(report) == "worker 'gw0' crashed while running 'cell'"  # type: ignore[arg-type]
    assert crash_message(SimpleNamespace(longrepr="plain text")) == "plain text"  # type: ignore[arg-type]


def test_the_run_config_round_trips_and_reads_older_run_plans(tmp_path: Path) -> None:
    from harness.schema.config import Limits, TimingConfig
    from harness.schema.selection import Selection

    config = RunConfig(
        selection=Selection(cases=("a",), modes=("half-autocast",)),
        cases_dirs=(tmp_path,),
        workers="2",
        command=("python -m harness", "run"),
        timing=TimingConfig(budget_s=0.5),
        limits=Limits(timeout_s=9.0, memory_bytes=2**30),
    )
    assert RunConfig.from_dict(config.to_dict()) == config
    assert RunConfig.from_dict(RunConfig(timing=None).to_dict()).timing is None
    older = {"cases_dirs": [str(tmp_path)], "limits": {"timeout_s": 5.0}, "timing": None}
    legacy = RunPlan.from_dict({**older, "cells": [], "skipped": []}).config
    assert (legacy.cases_dirs, legacy.limits.timeout_s, legacy.timing) == ((tmp_path,), 5.0, None)


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text")


def raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt("pressed in a fix")


def raise_unprintable() -> None:
    raise Unprintable()


@pytest.mark.parametrize(
    ("work", "cause"),
    [
        (raise_keyboard_interrupt, "KeyboardInterrupt: pressed in a fix"),
        (raise_unprintable, "Unprintable: <str() of the exception failed: RuntimeError>"),
        (lambda: sys.exit(5), "SystemExit: 5"),
    ],
)
def test_a_child_that_fails_in_python_says_why(work: Callable[[], None], cause: str) -> None:
    child = forked.run_forked(work, timeout_s=30, threads=1)
    assert child.failure == f"the cell's process failed without a result: {cause}"
    assert not child.timed_out


def test_a_child_value_comes_back() -> None:
    assert forked.run_forked(lambda: {"a": 1}, timeout_s=30, threads=1).value == {"a": 1}


def test_the_columns_of_one_case_and_device_are_timed_in_one_process() -> None:
    records = [
        replace(ran(fix, device), cell=replace(ran(fix, device).cell, dtype=dtype))
        for fix in ("none", "cast")
        for device in ("cpu", "cuda:0")
        for dtype in ("float16", "bfloat16")
    ]
    batches = run.timing_batches(run.timing_columns(records))
    assert [len(batch) for batch in batches] == [2, 2]  # two dtypes' columns per device
    assert {next(iter(b.values()))[0].cell.device for b in batches} == {"cpu", "cuda:0"}
    assert all(len(column) == 2 for b in batches for column in b.values())  # both fixes


def test_an_item_whose_record_could_not_be_written_stops_the_run_and_records_nothing(
    tmp_path: Path,
) -> None:
    """The item says why in a property of its report (a full disk), not in its text: the
    controller stops the run and writes no crash record for it."""
    from harness.runner.cell_items import NOT_WRITTEN_KEY

    crashed: list[str] = []

    def on_crash(message: str, worker: str) -> list[CellRecord]:
        crashed.append(message)
        return []

    controller = Controller(tmp_path, {"item": on_crash})
    report = pytest.TestReport(
        "plan.json::item", ("plan.json", None, "item"), {}, "failed", "an unrelated message",
        "call", user_properties=[(NOT_WRITTEN_KEY, "cells.jsonl could not be written")],
    )  # fmt: skip
    controller.pytest_runtest_logreport(report)
    assert controller.not_written == "cells.jsonl could not be written" and not crashed
