"""Timing the cells that ran: each cell's fix as a call on a workload prepared once, checked
by a first call, then the cells of one column timed side by side and given their FLOPs,
throughput and memory.

The timing phase calls a fix many times on one workload (the correctness phase calls it
once, on a fresh one), with the same precision, gradient mode and autocast.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from harness.measure.authoring import registry
from harness.measure.figures.perf import perf_figures
from harness.measure.figures.timing import (
    Stop,
    Stopwatch,
    Timing,
    measure_interleaved,
    samples_needed,
    stopwatch_for,
)
from harness.measure.host import torch_state
from harness.measure.precision.outputs import output_leaves
from harness.measure.running.crashes import changed_note
from harness.measure.running.errors import MAX_MESSAGE, error_text
from harness.measure.running.fix_run import (
    call_fix,
    compiled_fix,
    context_for,
    prepared_workload,
    step_parts,
)
from harness.schema.axes import Cell
from harness.schema.config import TimingConfig
from harness.schema.devices import CUDA
from harness.schema.records import CellRecord, Note, NoteKind, SettingChange

NOT_RERUNNABLE = "output changed between repeated calls: the timed work is not the checked work"
RESTORED_NOTE = "timed with torch's settings put back after each call"


def prepare_call(cell: Cell) -> tuple[Callable[[], Any], torch.device]:
    """The cell's fix as a zero-argument call on a workload prepared once (seeded as always),
    with the same precision, gradient mode and autocast as its correctness run."""
    case = registry.get(cell.case)
    device = torch.device(cell.device)
    if device.type == CUDA:
        torch.cuda.set_device(device)
    ctx = context_for(case, cell, observe=False)
    workload = prepared_workload(case, ctx, case.kept_by(cell.fix))
    compiled = compiled_fix(case, cell.fix, cell.compile)
    return (lambda: call_fix(case, cell.fix, workload, ctx, compiled)), device


def same_output(first: Any, second: Any) -> bool:
    """Whether two calls computed the same: the same leaves, each of the same shape and
    values (an output that grows from call to call is not the same, and no error); of a
    training step, its loss and gradients."""
    a, b = output_leaves(step_parts(first)[0]), output_leaves(step_parts(second)[0])
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape
        and (torch.equal(a[k], b[k]) or torch.allclose(a[k], b[k], rtol=0, atol=0, equal_nan=True))
        for k in a
    )


class RepeatedCall:
    """The call, holding its latest output: the timed calls' last output is compared with
    the first call's, so no further call is spent on the check."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.last: Any = None

    def __call__(self) -> None:
        self.last = self.call()


@dataclass(frozen=True)
class TimedCall:
    record: CellRecord
    call: RepeatedCall
    device: torch.device
    #: The first call's output, and its per-call time where it sizes the blocks.
    first: Any
    estimate: float


def checked_call(
    record: CellRecord, stopwatch: Stopwatch, min_block_s: float
) -> TimedCall | CellRecord:
    """The cell's call after its first call (the warm-up, timed on ``stopwatch``; a call
    quicker than a block is timed once more, warm, to size the blocks); or its record with
    why it cannot be timed. A call that changes torch's global settings has them put back
    after every call, so the fixes timed beside it run as they would alone."""
    changed: list[SettingChange] = []
    try:
        with torch_state.restored(changed):
            call, device = prepare_call(record.cell)
            repeated = RepeatedCall(call)
            estimate = stopwatch.time_block(repeated, 1)
            first = repeated.last
            if estimate < min_block_s:
                estimate = stopwatch.time_block(repeated, 1)
    except Exception as error:
        failure = f"{type(error).__name__}: {error_text(error)}"
        return replace(record, timing_error=failure[:MAX_MESSAGE])
    if changed:
        repeated = RepeatedCall(restoring(call))
    noted = record.noted(restored_note(changed, record.notes))
    return TimedCall(noted, repeated, device, first, estimate)


def rerun_note(timed: TimedCall) -> Note | None:
    """After the timed calls: whether they computed what the first call did."""
    if same_output(timed.first, timed.call.last):
        return None
    return Note(NoteKind.NOT_RERUNNABLE, NOT_RERUNNABLE)


#: What ended a noisy timing's sampling, in words (``{target}``: the precision aimed at,
#: ``{needed}``: the samples it would have taken, ``{rounds}``: ``plateau_rounds``).
STOPPED = {
    Stop.PRECISE: "that is within the target of {target:.0%}: more samples would not move it",
    Stop.OUT_OF_REACH: "within {target:.0%} would take about {needed:.0f} samples, more than "
    "the budget leaves: left noisy",
    Stop.NOT_SHRINKING: "its median's interval did not shrink over the last {rounds} rounds: "
    "left noisy",
    Stop.CAPPED: "a hard cap on samples or time came first",
}


def noise_note(timing: Timing, config: TimingConfig) -> Note | None:
    """Why a timing is noisy, from its samples and its stop: the spread (IQR / median)
    it reached against the threshold, how well the samples know their median (half its
    95% interval), the samples and time taken, and what ended the sampling."""
    if not timing.noisy:
        return None
    reason = STOPPED[timing.stop].format(
        target=config.precision,
        needed=samples_needed(timing.count, timing.precision, config.precision),
        rounds=config.plateau_rounds,
    )
    seconds = sum(timing.samples) * timing.block
    return Note(
        NoteKind.NOISY,
        f"timing did not settle: IQR {timing.spread:.1%} of the median (settled: under "
        f"{config.iqr_threshold:.0%}), its median known within {timing.precision:.1%} after "
        f"{timing.count} samples of {timing.block} calls ({seconds:.2f} s); {reason}",
    )


def restored_note(changed: list[SettingChange], notes: tuple[Note, ...]) -> Note | None:
    if not changed:
        return None
    known = changed_note(changed) in notes  # the correctness run's note already names them
    detail = "" if known else f": the fix {torch_state.describe(torch_state.worded(changed))}"
    return Note(NoteKind.SETTINGS_RESTORED, RESTORED_NOTE + detail)


def restoring(call: Callable[[], Any]) -> Callable[[], Any]:
    """``call`` that puts torch's global settings back after itself."""

    def call_and_restore() -> Any:
        state = torch_state.snapshot()
        try:
            return call()
        finally:
            torch_state.restore(state)

    return call_and_restore


def time_column(
    records: Sequence[CellRecord], config: TimingConfig, worker: str | None = None
) -> list[CellRecord]:
    """Time cells that will be compared (one case, device, dtype and mode) side by side,
    then add FLOPs, throughput and memory to each record."""
    stopwatch = stopwatch_for(torch.device(records[0].cell.device), config.flush_l2)
    checked = [checked_call(r, stopwatch, config.min_block_s) for r in records]
    calls = [c for c in checked if isinstance(c, TimedCall)]
    if not calls:
        return [c for c in checked if isinstance(c, CellRecord)]
    timings = measure_interleaved(
        [c.call for c in calls], config, stopwatch, estimates=[c.estimate for c in calls]
    )
    timed = iter(
        replace(
            c.record.noted(rerun_note(c), noise_note(timing, config)),
            perf=replace(
                perf_figures(c.call, c.device, c.record.cell.dtype, timing), timing_worker=worker
            ),
        )
        for c, timing in zip(calls, timings, strict=True)
    )
    return [next(timed) if isinstance(c, TimedCall) else c for c in checked]


def time_cell(record: CellRecord, config: TimingConfig, worker: str | None = None) -> CellRecord:
    """Add speed, throughput and memory to the record of one cell that ran."""
    return time_column([record], config, worker)[0]
