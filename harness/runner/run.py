"""The run pipeline: discover -> expand -> select -> run -> time -> store.

Each step is a small function taking the previous one's output. Cells run as pytest items
(see ``harness.runner.cell_items``) so pytest-xdist can spread them over worker processes;
where one worker would be all, from this process instead (``harness.runner.in_process``).

Two phases: correctness runs in parallel; then the cells that ran are timed with nothing
else on their device: each device's cells one after another (``xdist_group``: one worker
per device on a GPU box; a run on one device times from its own process), the columns of
one case in one forked process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from harness.measure import execute
from harness.measure.authoring import model_case, registry
from harness.measure.authoring.case import Case
from harness.measure.authoring.registry import CaseContractError
from harness.measure.host import torch_state
from harness.measure.host.environment import capture_environment, now_iso
from harness.measure.running import fitting
from harness.results import storage
from harness.runner.in_process import interrupted, run_batches_here, stopped, time_batches_here
from harness.runner.matrix import Plan, expand
from harness.schema.axes import FIT_STAGE, SIZES, SMALL_SIZE, TIMED_SIZE, Cell, rank
from harness.schema.config import RunConfig, TimingConfig
from harness.schema.records import CellRecord, Outcome
from harness.schema.releases import torch_release
from harness.schema.run_files import RunPlan
from harness.schema.selection import SelectionError, check_selection

if TYPE_CHECKING:  # pytest is imported where workers run the cells
    from harness.runner.cell_items import Controller


def discover_cases(cases_dirs: Sequence[Path]) -> list[Case]:
    registry.discover(cases_dirs, probe=True)
    return registry.all_cases()


def cases_of_run(config: RunConfig) -> list[Case]:
    """The run's cases: its case folders, and the models ``check`` names."""
    cases = discover_cases(config.cases_dirs)
    return cases + model_case.registered_models(config)


def plan_run(config: RunConfig) -> Plan:
    cases = cases_of_run(config)
    report_import_changes(registry.import_changes())
    check_selection(cases, config.selection)
    plan = expand(cases, config.selection)
    if not plan.total:
        raise SelectionError("the selection matches no cell (each name exists, no combination)")
    return plan


def start_run_dir(config: RunConfig) -> Path:
    run_dir = storage.create_run_dir(config.results_root, storage.new_run_id(torch.__version__))
    env = capture_environment(list(config.command))
    changed = registry.import_changes()
    if changed:
        env = replace(env, import_changes={path: list(c) for path, c in changed.items()})
    storage.write_env(run_dir, env)
    storage.write_cases(run_dir, [case.metadata() for case in registry.all_cases()])
    return run_dir


def record_skipped(run_dir: Path, plan: Plan) -> None:
    for cell, reason in plan.skipped:
        storage.append_record(run_dir, execute.skipped_record(cell, reason))


def report_import_changes(changed: dict[str, tuple[str, ...]]) -> None:
    """Say once what the run's modules changed of torch's settings as they were imported:
    put back at once, so every cell starts from torch's own settings (env.json keeps it)."""
    for path, changes in changed.items():
        print(
            f"ampmatrix: warning: {path} {torch_state.describe(list(changes))} as it was "
            "imported: put back, no cell starts from them",
            file=sys.stderr,
            flush=True,
        )


def write_plan(run_dir: Path, name: str, **items: Any) -> Path:
    """A plan file for pytest: the items to run; the settings come from the run's config
    in ``run-plan.json``."""
    path = run_dir / name
    data = {"run_dir": str(run_dir.resolve()), **items}
    storage.write_atomic(path, json.dumps(data, indent=1) + "\n")
    return path


def worker_count(workers: str, cells: Sequence[Cell], batch: int = 1) -> int:
    """Worker processes for the correctness phase, never more than there are batches.
    ``auto``: one per GPU (each GPU's batches go to one worker), and the other cores for
    the CPU's batches (at least one); none where that makes one worker: the cells then run
    from this process (each batch still in a forked child), since a worker's interpreter
    costs more to start and stop (2 s) than it saves."""
    batches = batches_of(cells, batch)
    if workers != "auto":
        return max(0, min(int(workers), len(batches)))
    gpus = len({b[0].device for b in batches if b[0].device.startswith("cuda")})
    cpu_batches = sum(b[0].device == "cpu" for b in batches)
    cpu_workers = min(cpu_batches, max(1, (os.cpu_count() or 1) - gpus))
    wanted = gpus + cpu_workers
    return wanted if wanted > 1 else 0


#: pytest plugins the cell run does without: no cache files in the results directory, and
#: the harness prints its own progress lines instead of pytest's.
DISABLED_PLUGINS = ("cacheprovider", "terminal")
NO_AUTOLOAD = "PYTEST_DISABLE_PLUGIN_AUTOLOAD"


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


def threads_per_worker(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def run_pytest(args: list[str], controller: Controller, threads: int) -> int:
    """pytest's exit code; a record that could not be written stops the run here, with
    the reason and how to finish it."""
    import pytest

    from harness.runner.cell_items import THREADS_VARIABLE

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


def batches_of(cells: Sequence[Cell], size: int) -> list[list[Cell]]:
    """Consecutive cells of one case, device and workload size, at most ``size`` to a batch:
    a batch runs in one forked process (see ``isolation.run_cells_isolated``)."""
    batches: list[list[Cell]] = []
    for cell in cells:
        last = batches[-1] if batches else None
        if last and batch_key(last[0]) == batch_key(cell) and len(last) < size:
            last.append(cell)
        else:
            batches.append([cell])
    return batches


def batch_key(cell: Cell) -> tuple[str, str, str, str]:
    """Cells that may share a forked process: one case on one device at one size and
    stage (they share a reference)."""
    return cell.case, cell.device, cell.size, cell.stage


def execute_cells(run_dir: Path, plan: Plan, workers: int, config: RunConfig) -> int:
    """Correctness phase: run the cells as pytest items, a batch of one case's cells to an
    item; cells a dead worker left without a record get a second pass, one to an item.
    Returns pytest's exit code."""
    if not plan.to_run:
        return 0
    code = run_batches(run_dir, batches_of(plan.to_run, config.batch), workers, config)
    recorded = {r.cell for r in storage.read_records(run_dir, problems=[])}
    left = [cell for cell in plan.to_run if cell not in recorded]
    if left and config.batch > 1:
        code = max(code, run_batches(run_dir, [[cell] for cell in left], workers, config))
    return code


def run_batches(run_dir: Path, batches: list[list[Cell]], workers: int, config: RunConfig) -> int:
    workers = min(workers, len(batches))
    fitting.use_steps(config.fit_steps)
    if workers == 0:
        threads = threads_per_worker(0)
        return run_batches_here(run_dir, batches, config.limits, threads, config.trace)
    from harness.runner.cell_items import Controller, cell_crashes

    plan_path = write_plan(
        run_dir,
        storage.PLAN_FILE,
        batches=[[cell.to_dict() for cell in batch] for batch in batches],
    )
    units = sum(len(batch) for batch in batches)
    controller = Controller(run_dir, cell_crashes(run_dir, batches), units)
    grouped = any(batch[0].device.startswith("cuda") for batch in batches)
    args = pytest_args(plan_path, workers, grouped, items=len(batches))
    return run_pytest(args, controller, threads_per_worker(workers))


def needs_timing(record: CellRecord) -> bool:
    """A cell that ran and has no figures yet (nor a note that timing it failed); a fit is
    not timed (its step is the train stage's)."""
    return (
        record.outcome in execute.TIMED_OUTCOMES
        and record.cell.stage != FIT_STAGE
        and record.perf is None
        and record.timing_error is None
    )


def cells_to_time(run_dir: Path) -> list[CellRecord]:
    """Cells to time, at the size timed on their device, in a fixed order: what ran before
    a timed call (allocator and cache state) must be the same from run to run."""
    records = storage.read_records(run_dir)
    timed = timed_sizes(records)
    return sorted(
        (r for r in records if needs_timing(r) and r.cell.size == timed[size_key(r.cell)]),
        key=lambda r: r.cell,
    )


def size_key(cell: Cell) -> tuple[str, str]:
    return cell.case, cell.device


def timed_sizes(records: Sequence[CellRecord]) -> dict[tuple[str, str], str]:
    """The one workload size timed for each case and device: the device kind's
    ``TIMED_SIZE`` where the run has cells of it there, else the smallest size it has."""
    present: dict[tuple[str, str], set[str]] = {}
    for r in records:
        if r.outcome != Outcome.SKIPPED:
            present.setdefault(size_key(r.cell), set()).add(r.cell.size)
    return {key: timed_size(key[1], sizes) for key, sizes in present.items()}


def timed_size(device: str, sizes: set[str]) -> str:
    preferred = TIMED_SIZE.get(device.split(":")[0], SMALL_SIZE)
    return preferred if preferred in sizes else min(sizes, key=lambda s: rank(SIZES, s))


def timing_columns(records: Sequence[CellRecord]) -> dict[str, list[CellRecord]]:
    """Cells compared with each other (one case, device, dtype, mode) are timed together."""
    columns: dict[str, list[CellRecord]] = {}
    for r in records:
        columns.setdefault(r.cell.column.id, []).append(r)
    return columns


@dataclasses.dataclass(frozen=True)
class TimingPhase:
    """How the timing phase spent its wall time: ``measured_s`` inside timed calls (the
    samples' blocks), the rest starting processes, building workloads, warming up,
    counting FLOPs and memory."""

    cells: int
    wall_s: float
    measured_s: float

    @property
    def measured_share(self) -> float:
        return self.measured_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"cells": self.cells, "wall_s": self.wall_s, "measured_s": self.measured_s}

    def line(self) -> str:
        return (
            f"ampmatrix: timed {self.cells} cells in {self.wall_s:.1f} s, "
            f"{self.measured_share:.0%} of it in measured calls"
        )


def measured_seconds(record: CellRecord) -> float:
    """Time spent inside the cell's timed blocks of calls."""
    perf = record.perf
    return sum(perf.time_samples) * perf.time_block if perf else 0.0


def time_cells(run_dir: Path, config: RunConfig) -> tuple[int, TimingPhase | None]:
    """Timing phase: each device's columns one at a time. Returns the exit code (pytest's,
    where workers ran) and what the phase spent its time on (None: nothing timed)."""
    records = cells_to_time(run_dir)
    if not records or config.timing is None:
        return 0, None
    started = time.monotonic()
    code = time_columns(run_dir, records, config, config.timing)
    timed = {r.cell: r for r in storage.read_records(run_dir, problems=[])}
    phase = TimingPhase(
        cells=len(records),
        wall_s=time.monotonic() - started,
        measured_s=sum(measured_seconds(timed[r.cell]) for r in records if r.cell in timed),
    )
    print(phase.line(), flush=True)
    return code, phase


def time_columns(
    run_dir: Path, records: list[CellRecord], config: RunConfig, timing: TimingConfig
) -> int:
    columns = timing_columns(records)
    batches = timing_batches(columns)
    print(
        f"ampmatrix: timing {len(records)} cells in {len(columns)} groups, "
        "each device's one after another",
        flush=True,
    )
    devices = {r.cell.device for r in records}
    threads = (os.cpu_count() or 1) if devices == {"cpu"} else threads_per_worker(len(devices))
    workers = timing_workers(devices)
    if workers == 0:
        return time_batches_here(run_dir, batches, timing, config.limits, threads)
    from harness.runner.cell_items import Controller, timing_crashes

    plan_path = write_plan(
        run_dir,
        storage.TIMING_PLAN_FILE,
        timing_batches=[
            {name: [r.to_dict() for r in column] for name, column in batch.items()}
            for batch in batches
        ],
    )
    controller = Controller(run_dir, timing_crashes(run_dir, batches), units=len(columns))
    args = pytest_args(plan_path, workers, grouped=True, items=len(batches))
    return run_pytest(args, controller, threads)


def timing_batches(columns: dict[str, list[CellRecord]]) -> list[dict[str, list[CellRecord]]]:
    """The columns of one case on one device, timed in one forked process."""
    batches: dict[tuple[str, str, str, str], dict[str, list[CellRecord]]] = {}
    for name, column in columns.items():
        batches.setdefault(batch_key(column[0].cell), {})[name] = column
    return list(batches.values())


def timing_workers(devices: set[str]) -> int:
    """One worker per device; none where there is one device: its columns are timed from
    this process (each in a forked child), with no worker to wait for (4-5 s on a 2-core
    CPU before the first column) or to stop."""
    return len(devices) if len(devices) > 1 else 0


def finish_run(
    run_dir: Path,
    exit_code: int,
    workers: int,
    config: RunConfig,
    timing_phase: TimingPhase | None = None,
) -> None:
    env = storage.read_env(run_dir)
    records = storage.read_records(run_dir)
    env = replace(
        env,
        finished_at=now_iso(),
        runner_exit_code=exit_code,
        workers=workers,
        threads_per_worker=threads_per_worker(workers),
        timing=dataclasses.asdict(config.timing) if config.timing else None,
        timing_phase=timing_phase.to_dict() if timing_phase else None,
        peak_gflops=measured_peaks(records),
        peak_measured_at=peak_dates(records),
        load_average=list(os.getloadavg()),
    )
    storage.write_env(run_dir, env)


def measured_peaks(records: Sequence[CellRecord]) -> dict[str, dict[str, float]]:
    """The peak matmul throughput measured per device and dtype in this run."""
    peaks: dict[str, dict[str, float]] = {}
    for record in records:
        if record.perf and record.perf.peak_gflops:
            peaks.setdefault(record.cell.device, {})[record.cell.dtype] = record.perf.peak_gflops
    return peaks


def peak_dates(records: Sequence[CellRecord]) -> dict[str, dict[str, str]]:
    """When each peak of ``measured_peaks`` was measured (peaks are cached per machine)."""
    dates: dict[str, dict[str, str]] = {}
    for record in records:
        if record.perf and record.perf.peak_measured_at:
            dates.setdefault(record.cell.device, {})[record.cell.dtype] = (
                record.perf.peak_measured_at
            )
    return dates


def missing_cells(run_dir: Path, records: Sequence[CellRecord] | None = None) -> list[Cell]:
    """The cells of the run's plan (to run or skipped) that have no record; ``records``
    when the caller has read them already."""
    saved = storage.read_run_plan(run_dir)
    if records is None:
        records = storage.read_records(run_dir, problems=[])
    recorded = {record.cell for record in records}
    planned = [*saved.cells, *(cell for cell, _ in saved.skipped)]
    return [cell for cell in planned if cell not in recorded]


def check_same_torch(run_dir: Path) -> None:
    """Records of another torch must not join a run recorded under this one."""
    recorded = storage.read_env(run_dir).torch_version
    if recorded and recorded != torch.__version__:
        raise storage.ResultsError(
            f"{run_dir / storage.ENV_FILE}: the run was recorded under torch {recorded}; "
            f"this environment has torch "
            f"{torch.__version__}: resume it from {recorded}'s environment "
            f"(nox -s \"matrix(torch='{torch_release(recorded)}')\" -- --resume {run_dir})"
        )


def write_run_plan(run_dir: Path, plan: Plan, config: RunConfig) -> None:
    """Everything ``--resume`` needs to finish this run as it was started."""
    storage.write_run_plan(run_dir, RunPlan(config, tuple(plan.to_run), tuple(plan.skipped)))


def run_cells(run_dir: Path, plan: Plan, config: RunConfig) -> Path:
    """Record the skipped cells, run the others, time what ran, and close the run. Ctrl-C
    stops it with how to finish it (``interrupted``)."""
    try:
        return run_and_time(run_dir, plan, config)
    except KeyboardInterrupt:
        raise interrupted(run_dir) from None


def run_and_time(run_dir: Path, plan: Plan, config: RunConfig) -> Path:
    record_skipped(run_dir, plan)
    workers = worker_count(config.workers, plan.to_run, config.batch)
    exit_code = execute_cells(run_dir, plan, workers, config)
    timing_code, timing_phase = time_cells(run_dir, config)
    finish_run(run_dir, max(exit_code, timing_code), workers, config, timing_phase)
    return run_dir


def run(config: RunConfig) -> Path:
    """Run the selected matrix; returns the run directory."""
    plan = plan_run(config)
    run_dir = start_run_dir(config)
    with storage.run_lock(run_dir):
        write_run_plan(run_dir, plan, config)
        print(
            f"ampmatrix: {len(plan.to_run)} cells to run, {len(plan.skipped)} skipped here; "
            f"results in {run_dir}",
            flush=True,
        )
        return run_cells(run_dir, plan, config)


def resume(run_dir: Path, workers: str = "auto") -> Path:
    """Finish a run that was stopped: only the cells without a record run (and, if the run
    times cells, only the cells without figures are timed). One process at a time, under
    the torch the run was recorded with; a finished run is left as it is."""
    with storage.run_lock(run_dir):
        return resume_locked(run_dir, workers)


def resume_locked(run_dir: Path, workers: str) -> Path:
    config, plan, planned = saved_state(run_dir)
    config = replace(config, workers=workers)
    if not plan.to_run and not plan.skipped and not (config.timing and cells_to_time(run_dir)):
        print(f"ampmatrix: {run_dir} is complete: nothing left to run or time", flush=True)
        return run_dir
    dropped = storage.drop_partial_last_line(run_dir)
    env = storage.read_env(run_dir)
    resumed = {"at": now_iso(), "dropped_partial_line": dropped, "cells_left": len(plan.to_run)}
    storage.write_env(run_dir, replace(env, resumed=[*(env.resumed or []), resumed]))
    print(
        f"ampmatrix: resuming {run_dir}: {len(plan.to_run)} of {planned} cells left to run",
        flush=True,
    )
    return run_cells(run_dir, plan, config)


def saved_state(run_dir: Path) -> tuple[RunConfig, Plan, int]:
    """What ``--resume`` reads before it runs anything: the run's configuration, the cells
    still without a record, and how many cells the run planned. Only reads; a run plan or
    env.json that cannot be used raises ``ResultsError`` naming the file."""
    saved = storage.read_run_plan(run_dir)
    check_same_torch(run_dir)
    config = replace(saved.config, results_root=run_dir.parent)
    try:
        cases_of_run(config)
    except (CaseContractError, model_case.ModelCheckError) as error:
        raise storage.ResultsError(f"{run_dir / storage.RUN_PLAN_FILE}: {error}") from error
    done = {record.cell for record in storage.read_records(run_dir, problems=[])}
    plan = Plan(
        to_run=[c for c in saved.cells if c not in done],
        skipped=[(c, reason) for c, reason in saved.skipped if c not in done],
    )
    return config, plan, len(saved.cells)
