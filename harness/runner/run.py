"""The run pipeline: discover -> expand -> select -> run -> time -> store.

Each step is a small function taking the previous one's output. Cells run as pytest items
(see ``harness.runner.cell_items``) so pytest-xdist can spread them over worker processes;
where one worker would be all, from this process instead (``harness.runner.in_process``).

Two phases: correctness runs in parallel; then the cells that ran are timed with nothing
else on their device: each device's cells one after another (``xdist_group``: one worker
per device on a GPU box; a run on one device times from its own process), the columns of
one case in one forked process.

Every record is appended to ``cells.jsonl`` as its cell ends (the run's source of truth,
which ``--resume`` reads); between the phases, the records pass in memory (``Recorded``),
read back from the file only after a phase pytest workers ran (their records reach this
process no other way). pytest itself is started by ``harness.runner.pytest_launch``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from harness.measure import execute
from harness.measure.authoring import model_case, registry
from harness.measure.authoring.case import Case
from harness.measure.authoring.registry import CaseContractError
from harness.measure.host import torch_state
from harness.measure.host.environment import capture_environment, now_iso
from harness.measure.running import fitting
from harness.results import storage
from harness.runner.in_process import interrupted, run_batches_here, time_batches_here
from harness.runner.matrix import Plan, expand
from harness.runner.pytest_launch import (
    launch_cells,
    launch_timing,
    threads_per_worker,
    timing_threads,
    timing_workers,
    worker_count,
)
from harness.schema.axes import AXES, SIZES, SMALL_SIZE, TIMED_SIZE, Cell, rank
from harness.schema.config import RunConfig, TimingConfig
from harness.schema.devices import known_device
from harness.schema.records import CellRecord, Outcome
from harness.schema.releases import torch_release
from harness.schema.run_files import RunPlan
from harness.schema.selection import Selection, SelectionError, check_selection
from harness.schema.stages import stage_of
from harness.schema.text import one_line


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


def record_skipped(run_dir: Path, plan: Plan) -> list[CellRecord]:
    records = [execute.skipped_record(cell, reason) for cell, reason in plan.skipped]
    for record in records:
        storage.append_record(run_dir, record)
    return records


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


def batch_key(cell: Cell) -> tuple[str, str, str, str, str]:
    """Cells that may share a forked process: one case on one device at one size and
    stage (they share a reference), and for a fit one fix (judged by its own float64 fit)."""
    fix = cell.fix if stage_of(cell.stage).own_reference else ""
    return cell.case, cell.device, cell.size, cell.stage, fix


class Recorded:
    """The run's records as its phases produce them, one per cell, a later one for a cell
    (its timed record) replacing the earlier, as when ``cells.jsonl`` is read. Every record
    is appended to ``cells.jsonl`` as its cell ends, and the file stays the source of
    truth (``--resume`` reads it); this is what the run's own process knows of it, passed
    from phase to phase instead of reading the file again."""

    def __init__(self, records: Iterable[CellRecord] = ()) -> None:
        self.by_cell: dict[Cell, CellRecord] = {}
        self.add(records)

    def add(self, records: Iterable[CellRecord]) -> None:
        for record in records:
            self.by_cell.pop(record.cell, None)
            self.by_cell[record.cell] = record

    def reread(self, run_dir: Path) -> None:
        """After a phase run by pytest workers: their records are in ``cells.jsonl`` only
        (the workers are other processes), so it is read once, here, as the phase ends."""
        self.by_cell = {}
        self.add(storage.read_records(run_dir, problems=[]))

    def __contains__(self, cell: Cell) -> bool:
        return cell in self.by_cell

    def get(self, cell: Cell) -> CellRecord | None:
        return self.by_cell.get(cell)

    def records(self) -> list[CellRecord]:
        return list(self.by_cell.values())


def execute_cells(
    run_dir: Path, plan: Plan, workers: int, config: RunConfig, recorded: Recorded
) -> int:
    """Correctness phase: run the cells as pytest items, a batch of one case's cells to an
    item; cells a dead worker left without a record get a second pass, one to an item.
    Returns pytest's exit code."""
    if not plan.to_run:
        return 0
    batches = batches_of(plan.to_run, config.batch)
    code = run_batches(run_dir, batches, workers, config, recorded)
    left = [cell for cell in plan.to_run if cell not in recorded]
    if left and config.batch > 1:
        retry = [[cell] for cell in left]
        code = max(code, run_batches(run_dir, retry, workers, config, recorded))
    return code


def run_batches(
    run_dir: Path, batches: list[list[Cell]], workers: int, config: RunConfig, recorded: Recorded
) -> int:
    workers = min(workers, len(batches))
    fitting.use_steps(config.fit_steps)
    if workers == 0:
        threads = threads_per_worker(0)
        records = run_batches_here(
            run_dir, batches, config.limits, threads, config.trace, config.profile
        )
        recorded.add(records)
        return 0
    code = launch_cells(run_dir, batches, workers)
    recorded.reread(run_dir)
    return code


def needs_timing(record: CellRecord) -> bool:
    """A cell that ran and has no figures yet (nor a note that timing it failed); a fit is
    not timed (its step is the train stage's)."""
    return (
        record.outcome in execute.TIMED_OUTCOMES
        and stage_of(record.cell.stage).timed
        and record.perf is None
        and record.timing_error is None
    )


def cells_to_time(records: Sequence[CellRecord]) -> list[CellRecord]:
    """Cells to time, at the size timed on their device, in a fixed order: what ran before
    a timed call (allocator and cache state) must be the same from run to run."""
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
    known = known_device(device)
    preferred = TIMED_SIZE[known.kind] if known else SMALL_SIZE
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


def time_cells(
    run_dir: Path, config: RunConfig, recorded: Recorded
) -> tuple[int, TimingPhase | None]:
    """Timing phase: each device's columns one at a time. Returns the exit code (pytest's,
    where workers ran) and what the phase spent its time on (None: nothing timed)."""
    if config.timing is None:
        return 0, None
    records = cells_to_time(recorded.records())
    if not records:
        return 0, None
    started = time.monotonic()
    code = time_columns(run_dir, records, config, config.timing, recorded)
    timed = [recorded.get(r.cell) for r in records]
    phase = TimingPhase(
        cells=len(records),
        wall_s=time.monotonic() - started,
        measured_s=sum(measured_seconds(r) for r in timed if r is not None),
    )
    print(phase.line(), flush=True)
    return code, phase


def time_columns(
    run_dir: Path,
    records: list[CellRecord],
    config: RunConfig,
    timing: TimingConfig,
    recorded: Recorded,
) -> int:
    columns = timing_columns(records)
    batches = timing_batches(columns)
    print(
        f"ampmatrix: timing {len(records)} cells in {len(columns)} groups, "
        "each device's one after another",
        flush=True,
    )
    devices = {r.cell.device for r in records}
    threads = timing_threads(devices)
    workers = timing_workers(devices)
    if workers == 0:
        recorded.add(time_batches_here(run_dir, batches, timing, config.limits, threads))
        return 0
    code = launch_timing(run_dir, batches, workers, threads)
    recorded.reread(run_dir)
    return code


def timing_batches(columns: dict[str, list[CellRecord]]) -> list[dict[str, list[CellRecord]]]:
    """The columns of one case on one device, timed in one forked process."""
    batches: dict[tuple[str, str, str, str, str], dict[str, list[CellRecord]]] = {}
    for name, column in columns.items():
        batches.setdefault(batch_key(column[0].cell), {})[name] = column
    return list(batches.values())


def finish_run(
    run_dir: Path,
    exit_code: int,
    workers: int,
    config: RunConfig,
    records: Sequence[CellRecord],
    timing_phase: TimingPhase | None = None,
) -> None:
    env = storage.read_env(run_dir)
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


def run_cells(
    run_dir: Path, plan: Plan, config: RunConfig, recorded: Recorded | None = None
) -> Path:
    """Record the skipped cells, run the others, time what ran, and close the run; the
    records pass from phase to phase in ``recorded`` (a resumed run's: those it had).
    Ctrl-C stops it with how to finish it (``interrupted``)."""
    try:
        return run_and_time(run_dir, plan, config, recorded or Recorded())
    except KeyboardInterrupt:
        raise interrupted(run_dir) from None


def run_and_time(run_dir: Path, plan: Plan, config: RunConfig, recorded: Recorded) -> Path:
    recorded.add(record_skipped(run_dir, plan))
    workers = worker_count(config.workers, batches_of(plan.to_run, config.batch))
    exit_code = execute_cells(run_dir, plan, workers, config, recorded)
    timing_code, timing_phase = time_cells(run_dir, config, recorded)
    exit_code = max(exit_code, timing_code)
    finish_run(run_dir, exit_code, workers, config, recorded.records(), timing_phase)
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
    saved = saved_state(run_dir)
    config, plan = replace(saved.config, workers=workers), saved.plan
    untimed = config.timing and cells_to_time(saved.recorded.records())
    if not plan.to_run and not plan.skipped and not untimed:
        print(f"ampmatrix: {run_dir} is complete: nothing left to run or time", flush=True)
        return run_dir
    dropped = storage.drop_partial_last_line(run_dir)
    env = storage.read_env(run_dir)
    resumed = {"at": now_iso(), "dropped_partial_line": dropped, "cells_left": len(plan.to_run)}
    storage.write_env(run_dir, replace(env, resumed=[*(env.resumed or []), resumed]))
    print(
        f"ampmatrix: resuming {run_dir}: {len(plan.to_run)} of {saved.planned} cells left to run",
        flush=True,
    )
    return run_cells(run_dir, plan, config, saved.recorded)


@dataclasses.dataclass(frozen=True)
class SavedRun:
    """What ``--resume`` reads of a stopped run before it runs anything."""

    config: RunConfig
    #: The cells still without a record.
    plan: Plan
    #: How many cells the run planned.
    planned: int
    #: The records the stopped run left, which its phases go on from.
    recorded: Recorded


def check_plan(cases: Sequence[Case], plan: RunPlan) -> None:
    """A stored plan names only what the run's cases declare, checked as ``run`` checks a
    selection (``check_selection``): its selection, and each of its cells, to run or
    skipped. A plan edited by hand (an unknown case, a ``float8``) is refused naming its
    first bad entry (``SelectionError``), before any cell runs on it."""
    check_selection(cases, plan.config.selection)
    checked: set[tuple[str, str, str]] = set()
    entries = [(f"cells[{i}]", cell) for i, cell in enumerate(plan.cells)]
    entries += [(f"skipped[{i}]", cell) for i, (cell, _) in enumerate(plan.skipped)]
    for where, cell in entries:
        try:
            check_planned_cell(cases, cell, checked)
        except SelectionError as error:
            raise SelectionError(f"{where} ({cell.id}): {error}") from None


def check_planned_cell(
    cases: Sequence[Case], cell: Cell, checked: set[tuple[str, str, str]]
) -> None:
    """Each of a cell's values among those its case declares on that axis; ``checked``
    holds the (case, axis, value) found good so far (a plan repeats them cell after cell)."""
    for spec in AXES:
        value = getattr(cell, spec.name)
        if (cell.case, spec.name, value) in checked:
            continue
        wanted = {AXES[0].plural: [cell.case], spec.plural: [value]}
        check_selection(cases, Selection(**wanted))
        checked.add((cell.case, spec.name, value))


def warn_unread(problems: Sequence[str]) -> None:
    """The lines of ``cells.jsonl`` a resume could not read (each naming the file and the
    line), one warning line each as the other readers give them: their cells have no
    record, so they run again, and the user is told why."""
    for problem in problems:
        print(f"ampmatrix: warning: {one_line(problem)}", file=sys.stderr, flush=True)


def saved_state(run_dir: Path) -> SavedRun:
    """The stopped run's configuration, its cells still without a record and the records
    it left (``cells.jsonl`` read once, here: a line the stopped run left cut off is no
    record). Only reads; a run plan or env.json that cannot be used raises ``ResultsError``
    naming the file."""
    saved = storage.read_run_plan(run_dir)
    check_same_torch(run_dir)
    config = replace(saved.config, results_root=run_dir.parent)
    try:
        check_plan(cases_of_run(config), saved)
    except (CaseContractError, model_case.ModelCheckError, SelectionError) as error:
        raise storage.ResultsError(f"{run_dir / storage.RUN_PLAN_FILE}: {error}") from error
    unread: list[str] = []
    recorded = Recorded(storage.read_records(run_dir, unread))
    warn_unread(unread)
    plan = Plan(
        to_run=[c for c in saved.cells if c not in recorded],
        skipped=[(c, reason) for c, reason in saved.skipped if c not in recorded],
    )
    return SavedRun(config, plan, len(saved.cells), recorded)
