"""Launching the cell run's own pytest session: the plan file it collects, its arguments,
the environment variables its workers inherit, and how many workers and threads it gets.

The pipeline (``harness.runner.run``) decides what runs; this module starts pytest on it
(the items are ``harness.runner.cell_items``'s) and gives back pytest's exit code. The
records the workers write reach ``cells.jsonl`` only: the pipeline reads them from there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.results import storage
from harness.schema.axes import Cell
from harness.schema.devices import CPU, CUDA, device_kind, known_device
from harness.schema.records import CellRecord

if TYPE_CHECKING:  # pytest is imported where workers run the cells
    from harness.runner.cell_items import Controller

#: pytest plugins the cell run does without: no cache files in the results directory, and
#: the harness prints its own progress lines instead of pytest's.
DISABLED_PLUGINS = ("cacheprovider", "terminal")
NO_AUTOLOAD = "PYTEST_DISABLE_PLUGIN_AUTOLOAD"

#: A batch of timing columns: each column's name and its cells' records.
TimingBatch = dict[str, list[CellRecord]]


def on_gpu(device: str) -> bool:
    known = known_device(device)
    return known is not None and known.kind == CUDA


def worker_count(workers: str, batches: Sequence[Sequence[Cell]]) -> int:
    """Worker processes for the correctness phase, never more than there are batches.
    ``auto``: one per GPU (each GPU's batches go to one worker), and the other cores for
    the CPU's batches (at least one); none where that makes one worker: the cells then run
    from this process (each batch still in a forked child), since a worker's interpreter
    costs more to start and stop (2 s) than it saves."""
    if workers != "auto":
        return max(0, min(int(workers), len(batches)))
    gpus = len({b[0].device for b in batches if on_gpu(b[0].device)})
    cpu_batches = sum(device_kind(b[0].device) == CPU for b in batches)
    cpu_workers = min(cpu_batches, max(1, (os.cpu_count() or 1) - gpus))
    wanted = gpus + cpu_workers
    return wanted if wanted > 1 else 0


def timing_workers(devices: set[str]) -> int:
    """One worker per device; none where there is one device: its columns are timed from
    this process (each in a forked child), with no worker to wait for (4-5 s on a 2-core
    CPU before the first column) or to stop."""
    return len(devices) if len(devices) > 1 else 0


def threads_per_worker(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def timing_threads(devices: set[str]) -> int:
    """Every core where only the CPU is timed; else each device's worker its share."""
    return (os.cpu_count() or 1) if devices == {"cpu"} else threads_per_worker(len(devices))


def write_plan(run_dir: Path, name: str, **items: Any) -> Path:
    """A plan file for pytest: the items to run; the settings come from the run's config
    in ``run-plan.json``."""
    path = run_dir / name
    data = {"run_dir": str(run_dir.resolve()), **items}
    storage.write_atomic(path, json.dumps(data, indent=1) + "\n")
    return path


def pytest_args(plan_path: Path, workers: int, grouped: bool = False, items: int = 0) -> list[str]:
    """The cell run's own pytest session. Plugins installed in the environment are not
    loaded (``run_pytest`` turns autoload off): measured on a GPU box with pytest-timeout,
    -benchmark, -cov and -mock installed, a worker crash in the timing phase was retried
    until the session gave up, with nothing recorded."""
    args = [str(plan_path), "-c", os.devnull, "--rootdir", str(plan_path.parent)]
    args += ["-p", "harness.runner.cell_items", "--assert=plain"]
    for plugin in DISABLED_PLUGINS:
        args += ["-p", f"no:{plugin}"]
    if workers > 0:  # even one worker runs in its own process, so a crash costs one cell
        # a worker that dies costs its item only: replace every one, up to one per item
        args += ["-p", "xdist.plugin", "-n", str(workers), "--max-worker-restart", str(items)]
        if grouped:
            args += ["--dist", "loadgroup"]
    return args


def run_pytest(args: list[str], controller: Controller, threads: int) -> int:
    """pytest's exit code; a record that could not be written stops the run here, with
    the reason and how to finish it."""
    import pytest

    from harness.runner.cell_items import THREADS_VARIABLE
    from harness.runner.in_process import stopped

    os.environ[THREADS_VARIABLE] = str(threads)
    autoload = os.environ.get(NO_AUTOLOAD)
    os.environ[NO_AUTOLOAD] = "1"  # inherited by the xdist workers
    try:
        code = int(pytest.main(args, plugins=[controller]))
    finally:
        if autoload is None:
            del os.environ[NO_AUTOLOAD]
        else:
            os.environ[NO_AUTOLOAD] = autoload
    if controller.not_written:
        raise stopped(controller.run_dir, controller.not_written)
    if code == pytest.ExitCode.INTERRUPTED:  # pytest took the Ctrl-C: the run stops too
        raise KeyboardInterrupt
    return code


def launch_cells(run_dir: Path, batches: list[list[Cell]], workers: int) -> int:
    """The correctness phase's batches as pytest items on ``workers`` workers, each GPU's
    on one worker; returns pytest's exit code."""
    from harness.runner.cell_items import Controller, cell_crashes

    plan_path = write_plan(
        run_dir,
        storage.PLAN_FILE,
        batches=[[cell.to_dict() for cell in batch] for batch in batches],
    )
    units = sum(len(batch) for batch in batches)
    controller = Controller(run_dir, cell_crashes(run_dir, batches), units)
    grouped = any(on_gpu(batch[0].device) for batch in batches)
    args = pytest_args(plan_path, workers, grouped, items=len(batches))
    return run_pytest(args, controller, threads_per_worker(workers))


def launch_timing(run_dir: Path, batches: list[TimingBatch], workers: int, threads: int) -> int:
    """The timing phase's batches of columns as pytest items, one worker per device;
    returns pytest's exit code."""
    from harness.runner.cell_items import Controller, timing_crashes

    plan_path = write_plan(
        run_dir,
        storage.TIMING_PLAN_FILE,
        timing_batches=[
            {name: [r.to_dict() for r in column] for name, column in batch.items()}
            for batch in batches
        ],
    )
    columns = sum(len(batch) for batch in batches)
    controller = Controller(run_dir, timing_crashes(run_dir, batches), units=columns)
    args = pytest_args(plan_path, workers, grouped=True, items=len(batches))
    return run_pytest(args, controller, threads)
