"""Each cell in a process of its own: a crash, a hang or a memory blow-up costs only that cell.

Children are forked from the worker (as pytest-forked does), which has everything a cell
needs loaded and warm: the case modules, and the float64 reference and low-precision
baselines of each case, computed once per case, size and device (every dtype) in a forked
child of their own (on the cells' thread count) and handed back part by part, so a
reference fix that crashes or changes torch's global settings never reaches the worker, and
a baseline that crashes in one dtype costs only that dtype's yardstick. A worker that never
starts a thread pool is safe to fork (forking a process whose OpenMP pool is running can
hang the child); the child then sets its own thread count. A new cell process starts in
milliseconds. The worker's torch settings are put back as they were at its start before
each cell (``settle_worker``), and a child dies with its worker (``die_with_parent``).

The parent waits for the child's record up to the cell's time limit; a child that outlives
it is killed and recorded as ``timeout``, one that dies without a record is ``crashed`` with
its signal or exit code. An optional memory limit (``RLIMIT_DATA``) makes an allocation
beyond it fail inside the child as an ordinary out-of-memory error, recorded with its type.
The forked child itself, its time limit and how it failed, is ``harness.runner.forked``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, TypeVar

import torch

from harness.measure import execute
from harness.measure.authoring import registry
from harness.measure.figures import cell_timing, perf
from harness.measure.host import caches, torch_state
from harness.measure.judge import references
from harness.measure.judge.references import Baseline
from harness.measure.running import crashes, errors, training
from harness.measure.tracing import trail
from harness.runner.forked import Forked, ForkedStream, run_forked
from harness.schema.axes import Cell
from harness.schema.config import Limits, TimingConfig
from harness.schema.records import CellRecord, CrashKind, Note, NoteKind, Outcome
from harness.schema.stages import stage_of


def limits_for(cell: Cell, limits: Limits) -> Limits:
    """The run's limits, with the case's own time limit where it declares one."""
    case = registry.find(cell.case)
    own = case.timeout_s if case else None
    return replace(limits, timeout_s=own) if own else limits


Item = TypeVar("Item")
Result = TypeVar("Result")
#: Who a timing child is, in its failures' words.
TIMING_PROCESS = "the timing process"


@dataclass(frozen=True)
class Fork:
    """How a child is forked: its thread count, its memory limit, and who it is in its
    failures' words."""

    threads: int
    memory_bytes: int | None
    whose: str = "the cell's process"


def streamed(
    items: Sequence[Item],
    child: Callable[[Callable[[Any], None]], None],
    fork: Fork,
    *,
    limit: Callable[[Item], float],
    took: Callable[[Item, Any], Result],
    lost: Callable[[Item, Forked], Result],
    after_loss: Callable[[Sequence[Item]], Iterable[Result]],
    whose: Callable[[Item], str] | None = None,
) -> Generator[Result, None, None]:
    """The one loop that streams results back from a forked child, for cells, timed
    columns and a case's shared figures alike: ``child(send)`` computes ``items`` in order
    in one child, sending one value per item, and each is read within the item's own time
    limit (``limit``) and made a result as it comes (``took``), so one fork serves them
    all. The item whose child dies or overruns is ``lost``, which costs only that item:
    the items after it are handed to ``after_loss`` (each in a child of its own, say). A
    reader that stops reading ends the child. ``whose`` names the child by the item it is
    computing, where the fork's ``whose`` does not say enough."""
    done = len(items)
    with ForkedStream(child, fork.threads, fork.memory_bytes, fork.whose) as stream:
        for n, item in enumerate(items):
            got = stream.next(limit(item), whose(item) if whose else None)
            if got.failure is not None:
                yield lost(item, got)
                done = n + 1
                break
            yield took(item, got.value)
    if done < len(items):
        yield from after_loss(items[done:])


#: The worker's torch settings when it started, before any case module was imported; put
#: back before each cell or column is forked (see ``settle_worker``).
_WORKER_STATE: torch_state.State | None = None


def remember_worker_state() -> None:
    """Called once as the worker starts. It computes single-threaded (see ``warm_parent``)."""
    global _WORKER_STATE
    _WORKER_STATE = {**torch_state.snapshot(), "threads": 1}


def settle_worker() -> Note | None:
    """Put the worker's torch settings back as they were at its start (a case module's
    import, say, changed them); returns a note naming what had changed, or None."""
    if _WORKER_STATE is None:
        return None
    return torch_state.settled_note(_WORKER_STATE, "the worker's")


#: (workpiece, device) -> why the process computing its reference and baselines gave no
#: result, or None once they are known (or raised, which each cell then records).
_SHARED: dict[tuple[references.Workpiece, str], str | None] = caches.keyed(f"{__name__}._SHARED")


def warm_parent(cell: Cell, limits: Limits, threads: int, trace: bool = True) -> str | None:
    """Compute (and keep) what every cell of this case and size shares, in one forked child,
    before forking the cells: they inherit it instead of each recomputing it, and a
    reference fix that kills its process or changes torch's global settings cannot reach
    the worker. Returns why that child gave no result, if it did not. The worker itself
    stays single-threaded (its children start their own thread pools); where cells are
    traced, the dtype tracer's first use is made here too, and where cells train, the
    optimizers' (whose first construction imports torch._dynamo: a second in every batch)."""
    torch.set_num_threads(1)
    if trace:
        trail.warm_up()
    if stage_of(cell.stage).trains:
        training.warm_up()
    key = (references.workpiece(cell), cell.device)
    if key not in _SHARED:
        _SHARED[key] = compute_shared(*key, limits, threads)
    return _SHARED[key]


def compute_shared(
    piece: references.Workpiece, device: str, limits: Limits, threads: int
) -> str | None:
    """The reference and baselines, computed with the cells' thread count: at model sizes
    float32 rounding depends on how a matmul is split over threads, so a baseline computed
    on one thread can be more exact than the same code on two (the tolerance derives from
    the baseline).

    One forked child computes them part by part (``shared_parts``), each part with its own
    time limit, sending each as it is done: one fork when all goes well. A part whose child
    dies or overruns costs only itself. Where it is the reference, no cell can be judged:
    returns why. Where it is a dtype's baseline (a model that crashes only in float16, say),
    that dtype's baseline is the failure, its cells are judged by the rounding yardstick,
    and the parts after it are computed in a fresh child."""
    with closing(shared_results(piece, device, shared_parts(piece), limits, threads)) as results:
        for result in results:
            if result.stop:
                return result.failure
    return None


#: The part of the shared figures that is the float64 reference (with its rounding
#: yardsticks); every other part is the dtype of a baseline.
REFERENCE_PART = "float64"


def shared_parts(piece: references.Workpiece) -> tuple[str, ...]:
    """What is computed for a workpiece on a device, in order: the reference first (the
    baselines are errors against it), then the baseline in each dtype."""
    return (REFERENCE_PART, *references.baseline_dtypes(piece))


def computing(part: str) -> str:
    """Who failed, in a failure's words: the process computing ``part``."""
    if part == REFERENCE_PART:
        return "the process computing the case's float64 reference"
    return f"the process computing the {part} baseline"


@dataclass(frozen=True)
class SharedPart:
    """What came of one part of the shared figures, held here as it came: whether no part
    after it is computed, and why no cell can be judged, where none can (a reference that
    raised stops the parts with no failure: each cell then records what it raised)."""

    stop: bool = False
    failure: str | None = None


def shared_results(
    piece: references.Workpiece, device: str, parts: Sequence[str], limits: Limits, threads: int
) -> Generator[SharedPart, None, None]:
    """``parts`` computed in order in one forked child (``streamed``), each held here as it
    comes. A baseline whose child died or overran is held as that baseline's failure, and
    the parts after it are computed in a fresh child."""
    return streamed(
        parts,
        partial(shared_parts_in_child, piece, device, tuple(parts)),
        Fork(threads, limits.memory_bytes),
        limit=lambda _: limits.timeout_s,
        took=partial(took_part, piece, device),
        lost=partial(lost_part, piece, device),
        after_loss=lambda rest: shared_results(piece, device, rest, limits, threads),
        whose=computing,
    )


def took_part(piece: references.Workpiece, device: str, part: str, value: Any) -> SharedPart:
    if part != REFERENCE_PART:
        references.remember_baseline(piece, device, part, Baseline(**value))
        return SharedPart()
    if value is None:
        return SharedPart(stop=True)
    references.remember_reference_figures(piece, value)
    return SharedPart()


def lost_part(piece: references.Workpiece, device: str, part: str, lost: Forked) -> SharedPart:
    if part == REFERENCE_PART:
        return SharedPart(stop=True, failure=lost.failure)
    references.remember_baseline(piece, device, part, Baseline({}, lost.failure))
    return SharedPart()


def shared_parts_in_child(
    piece: references.Workpiece, device: str, parts: tuple[str, ...], send: Callable[[Any], None]
) -> None:
    """In the child: each part's figures, sent as soon as they exist; nothing after a
    reference that raised."""
    for part in parts:
        if part != REFERENCE_PART:
            send(references.baseline_figures(piece, device, part))
            continue
        figures = references.reference_figures(piece, device)
        send(figures)
        if figures is None:
            return


def run_cell_isolated(
    cell: Cell,
    worker: str,
    limits: Limits,
    threads: int,
    trace: bool = True,
    profile: bool = False,
) -> CellRecord:
    """Run one cell in a child process, within its limits; always returns a record."""
    cells = run_cells_isolated([cell], worker, lambda _: limits, threads, trace, profile)
    with closing(cells) as one:
        return next(one)


def run_cells_isolated(
    cells: list[Cell],
    worker: str,
    limits_of: Callable[[Cell], Limits],
    threads: int,
    trace: bool = True,
    profile: bool = False,
) -> Generator[CellRecord, None, None]:
    """Run cells of one case in order, all in one forked child, each record coming back as
    its cell ends: one fork instead of one per cell. Each cell has its own time limit.
    When a cell kills the child or overruns, it is recorded as such and every cell after it
    runs in a child of its own (``run_cell_isolated``). ``profile``: every cell that ran
    profiled, passing ones too (``--profile``)."""
    settled = settle_worker()
    shared_failure = warm_parent(cells[0], limits_of(cells[0]), threads, trace)
    if shared_failure is not None:
        for cell in cells:
            yield shared_failed(cell, shared_failure, worker)
        return

    def took(cell: Cell, value: Any) -> CellRecord:
        record = CellRecord.from_dict(value)
        return replace(record, notes=(settled, *record.notes)) if settled else record

    yield from streamed(
        cells,
        lambda send: run_cells_in_child(cells, worker, trace, send, profile),
        Fork(threads, limits_of(cells[0]).memory_bytes),
        limit=lambda cell: limits_of(cell).timeout_s,
        took=took,
        lost=lambda cell, lost: failed_cell(cell, lost, worker),
        after_loss=lambda rest: (
            run_cell_isolated(cell, worker, limits_of(cell), threads, trace, profile)
            for cell in rest
        ),
    )


def batch_records(
    cells: list[Cell],
    worker: str,
    limits_of: Callable[[Cell], Limits],
    threads: int,
    trace: bool = True,
    profile: bool = False,
) -> Iterator[CellRecord]:
    """Each cell's record as it ends (``run_cells_isolated``); where the harness itself
    failed around the cells, a record of each cell left that says why."""
    done = 0
    try:
        for record in run_cells_isolated(cells, worker, limits_of, threads, trace, profile):
            done += 1
            yield record
    except Exception as error:  # the harness failed around the cells: record why
        for cell in cells[done:]:
            yield crashes.harness_failure(cell, error, worker)


def run_cells_in_child(
    cells: list[Cell],
    worker: str,
    trace: bool,
    send: Callable[[Any], None],
    profile: bool = False,
) -> None:
    for cell in cells:
        send(execute.run_cell(cell, worker, trace, profile).to_dict())


def shared_failed(cell: Cell, failure: str, worker: str) -> CellRecord:
    return crashes.limit_record(
        cell, Outcome.CRASHED, "ReferenceFailed", failure, worker, CrashKind.REFERENCE_FAILED
    )


def failed_cell(cell: Cell, forked: Forked, worker: str) -> CellRecord:
    """The record of a cell whose process gave no record: it overran, or died."""
    assert forked.failure is not None
    if forked.timed_out:
        return crashes.limit_record(cell, Outcome.TIMEOUT, "Timeout", forked.failure, worker)
    return crashes.limit_record(
        cell, Outcome.CRASHED, "ProcessDied", forked.failure, worker, CrashKind.PROCESS_DIED
    )


Column = list[CellRecord]


def time_columns_isolated(
    columns: list[Column], config: TimingConfig, worker: str, limits: Limits, threads: int
) -> Generator[list[CellRecord], None, None]:
    """Time columns of one case in order, all in one forked child, each column's records
    coming back as it ends: the child's start (fork, thread pool, the profiler's first use,
    a CUDA context) is paid once, not per column. The cells of a column that kills the
    child or overruns are then timed each alone, and every column after it in a child of
    its own (``time_column_isolated``)."""
    settle_worker()
    perf.warm_up()
    yield from streamed(
        columns,
        lambda send: time_columns_in_child(columns, config, worker, send),
        Fork(threads, limits.memory_bytes, TIMING_PROCESS),
        limit=lambda column: limits.timeout_s * len(column),
        took=lambda column, value: timed_records(value),
        lost=lambda column, lost: timed_alone(column, config, worker, limits, threads),
        after_loss=lambda rest: (
            time_column_isolated(column, config, worker, limits, threads) for column in rest
        ),
    )


def timed_columns(
    columns: list[Column], config: TimingConfig, worker: str, limits: Limits, threads: int
) -> Iterator[list[CellRecord]]:
    """Each column's records as it ends (``time_columns_isolated``); where the harness
    itself failed, the columns left stand with their correctness records and why timing
    failed."""
    done = 0
    try:
        for timed in time_columns_isolated(columns, config, worker, limits, threads):
            done += 1
            yield timed
    except Exception as error:  # each correctness record stands: say why timing failed
        failure = f"{type(error).__name__}: {error}"[: errors.MAX_MESSAGE]
        for column in columns[done:]:
            yield [replace(r, timing_error=failure) for r in column]


def time_columns_in_child(
    columns: list[Column], config: TimingConfig, worker: str, send: Callable[[Any], None]
) -> None:
    for column in columns:
        send([r.to_dict() for r in cell_timing.time_column(column, config, worker)])


def time_column_isolated(
    records: list[CellRecord], config: TimingConfig, worker: str, limits: Limits, threads: int
) -> list[CellRecord]:
    """Time a column in a child process. If the child dies or overruns, each cell is timed
    again alone, so a fix that kills its process costs only its own figures."""
    settle_worker()
    perf.warm_up()
    forked = run_forked(
        lambda: [r.to_dict() for r in cell_timing.time_column(records, config, worker)],
        limits.timeout_s * len(records),
        threads,
        limits.memory_bytes,
        whose=TIMING_PROCESS,
    )
    if forked.failure is None:
        return timed_records(forked.value)
    if len(records) == 1:
        failure = f"timing failed: {forked.failure}"[: errors.MAX_MESSAGE]
        return [replace(records[0], timing_error=failure)]
    return timed_alone(records, config, worker, limits, threads)


def timed_alone(
    column: Column, config: TimingConfig, worker: str, limits: Limits, threads: int
) -> list[CellRecord]:
    """Each cell of a column whose shared timing process failed, timed in a child of its
    own; a cell then timed says so where another fix shared that process (a column of one
    cell was alone already, and a cell that fails alone too was not timed at all)."""
    timed = [time_column_isolated([r], config, worker, limits, threads)[0] for r in column]
    if len(column) == 1:
        return timed
    return [r if r.timing_error else alone_note(r) for r in timed]


def alone_note(record: CellRecord) -> CellRecord:
    return record.noted(Note(NoteKind.TIMED_ALONE, TIMED_ALONE))


TIMED_ALONE = "timed alone: another fix of its column killed the shared timing process"


def timed_records(values: list[Any]) -> list[CellRecord]:
    """A column's records as its timing process sent them, its peaks held here."""
    timed = [CellRecord.from_dict(data) for data in values]
    remember_peaks(timed)
    return timed


def remember_peaks(records: list[CellRecord]) -> None:
    """The device peaks a child measured, held in this process so later children (forked
    from it) reuse them instead of measuring the large GEMM again."""
    for record in records:
        if record.perf and record.perf.peak_gflops:
            measured_at = record.perf.peak_measured_at or ""
            perf.remember_peak(
                record.cell.device, record.cell.dtype, record.perf.peak_gflops, measured_at
            )
