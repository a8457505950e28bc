"""Running one cell end to end: build, apply the precision, run the fix, judge it against
the reference; every cell of a plan gets a record, run (``run_cell``) or not
(``skipped_record``).

The steps live in modules of their own: running the fix (:mod:`harness.measure.running.fix_run`),
the shared reference and yardsticks (:mod:`harness.measure.judge.references`), judging
(:mod:`harness.measure.judge.judging`), the records of cells with no outcome of their own
(:mod:`harness.measure.running.crashes`), and timing the cells that ran
(:mod:`harness.measure.figures.cell_timing`).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from harness.measure.authoring import registry
from harness.measure.host import torch_state
from harness.measure.judge.divergence import profiled
from harness.measure.judge.judging import classify
from harness.measure.running.crashes import backend_note, crashed, with_changes
from harness.measure.running.errors import ReferenceFailed, WorkloadFailed
from harness.measure.running.fix_run import context_for, run_fix_checked
from harness.schema.axes import Cell
from harness.schema.config import DEFAULT_TIMEOUT_S
from harness.schema.records import CellRecord, CrashKind, Outcome, SettingChange

#: The outcomes of cells that ran, which the timing phase then times.
TIMED_OUTCOMES = (Outcome.PASSES, Outcome.INACCURATE)


def run_cell(
    cell: Cell, worker: str | None = None, trace: bool = True, profile: bool = False
) -> CellRecord:
    """Run one cell and return its record. Exceptions of the code under test are outcomes;
    a failing reference or harness makes the cell ``crashed`` with the real error. A cell
    judged inaccurate (with ``profile``, any that ran) is profiled within half the time its
    limit has left (:func:`~harness.measure.judge.divergence.profiled`)."""
    case = registry.get(cell.case)
    started = time.perf_counter()
    record = CellRecord(
        cell=cell,
        torch_version=torch.__version__,
        outcome=Outcome.CRASHED,  # replaced by classify()
        worker=worker,
    ).noted(backend_note(cell))
    ctx = context_for(case, cell)
    changed: list[SettingChange] = []
    try:
        with torch_state.restored(changed):
            run = run_fix_checked(case, cell.fix, ctx, trace, cell.compile)
        record = replace(record, attn_dtypes=ctx.observation.summary())
        record = classify(case, cell, run, record)
        left_s = (case.timeout_s or DEFAULT_TIMEOUT_S) - (time.perf_counter() - started)
        record = profiled(
            case,
            cell,
            record,
            every=profile,
            within_s=max(left_s, 0.0) / 2,
            model_elements=run.model_elements,
        )
    except ReferenceFailed as failure:
        record = crashed(record, CrashKind.REFERENCE_FAILED, failure.error, case)
    except WorkloadFailed as failure:
        record = crashed(record, CrashKind.WORKLOAD_FAILED, failure.error, case)
    except Exception as error:  # the harness itself failed on this cell
        record = crashed(record, CrashKind.HARNESS, error, case)
    duration_s = round(time.perf_counter() - started, 6)
    return with_changes(replace(record, duration_s=duration_s), changed)


def skipped_record(cell: Cell, reason: str) -> CellRecord:
    """The record of a cell that is not run here, with why."""
    return CellRecord(
        cell=cell, torch_version=torch.__version__, outcome=Outcome.SKIPPED, skip_reason=reason
    )
