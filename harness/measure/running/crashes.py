"""Building a cell's record where the cell has no outcome of its own: it crashed, overran or
killed its process, or the harness failed on it; and the notes a record carries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from harness.measure.authoring.case import Case
from harness.measure.host import flash_kernels, torch_state
from harness.measure.running.errors import MAX_MESSAGE, case_root, error_fields, own_frames
from harness.measure.tracing.source_sites import HARNESS_DIR
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, CrashKind, Note, NoteKind, Outcome, SettingChange

CONTRACT_NOTE = (
    "flash-attn-contract: flash-attn 2's input contract and error messages enforced, "
    "computed with SDPA; not the real flash-attn kernel"
)


def backend_note(cell: Cell) -> Note | None:
    """What stood in for, or really ran as, flash-attn in a cell of a flash-attn backend."""
    if cell.backend == "flash-attn-contract":
        return Note(NoteKind.BACKEND, CONTRACT_NOTE)
    text = flash_kernels.backend_note(cell.device) if cell.backend == "flash-attn" else None
    return Note(NoteKind.BACKEND, text) if text else None


def changed_note(changed: Sequence[SettingChange]) -> Note | None:
    """A cell whose code changed torch's global settings says so: elsewhere than in its own
    process, that change would reach every cell after it."""
    if not changed:
        return None
    text = f"the cell's code {torch_state.describe(torch_state.worded(changed))}"
    return Note(NoteKind.SETTINGS_CHANGED, text)


def with_changes(record: CellRecord, changed: Sequence[SettingChange]) -> CellRecord:
    """The record of a cell whose own code changed torch's global settings ``changed``:
    the changes, typed, and the note that names them."""
    if not changed:
        return record
    return replace(record, settings_changes=tuple(changed)).noted(changed_note(changed))


def crashed(record: CellRecord, kind: CrashKind, error: BaseException, case: Case) -> CellRecord:
    """A cell with no outcome of its own; the frames shown are the case's, or the harness's
    where the error never passed through the case's code."""
    fields = error_fields(error, case_root(case))
    if not fields["error_frames"]:
        fields["error_frames"] = own_frames(error, HARNESS_DIR)
    return replace(record, outcome=Outcome.CRASHED, crash_kind=kind, **fields)


def limit_record(
    cell: Cell,
    outcome: Outcome,
    error_type: str,
    message: str,
    worker: str | None,
    crash_kind: CrashKind | None = None,
) -> CellRecord:
    """A cell that produced no record of its own: it crashed or ran out of time."""
    return CellRecord(
        cell=cell,
        torch_version=torch.__version__,
        outcome=outcome,
        error_type=error_type,
        error_message=message[:MAX_MESSAGE],
        crash_kind=crash_kind,
        worker=worker,
    )


def harness_failure(cell: Cell, error: BaseException, worker: str | None) -> CellRecord:
    """The record of a cell on which the harness itself failed, with the real error."""
    return replace(
        limit_record(cell, Outcome.CRASHED, "", "", worker, CrashKind.HARNESS),
        **error_fields(error, HARNESS_DIR),
    )
