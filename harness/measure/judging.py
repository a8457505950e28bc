"""Judging a fix's run: the outcome and its evidence, either the error it raised (and whether
that is the case's known failure) or its output's error against the float64 reference,
within a tolerance from yardsticks that are not the code under test (the rule is in
:mod:`harness.measure.numerics`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from harness.measure.case import Case
from harness.measure.cell_record import crashed
from harness.measure.errors import case_root, error_fields
from harness.measure.fix_run import FixRun
from harness.measure.numerics import Yardsticks, judge_leaves, within_tolerance
from harness.measure.precision import dtype_name, dtype_of, output_leaves
from harness.measure.references import (
    Baseline,
    Leaves,
    Workpiece,
    baseline,
    reference_leaves,
    rounding,
    structure_problem,
    workpiece,
)
from harness.schema.axes import CONTROL_DTYPE, Cell
from harness.schema.records import CellRecord, CrashKind, Note, NoteKind, Numerics, Outcome
from harness.schema.trail_records import Trail


def classify(case: Case, cell: Cell, run: FixRun, record: CellRecord) -> CellRecord:
    """Fill in the outcome and its evidence: the error, or the figures against the reference."""
    record = replace(record, flags=run.flags, trail=run.trail, warnings=run.warnings).noted(
        run.note
    )
    if run.error is not None:
        return raised(case, run.error, record)
    try:
        leaves = output_leaves(run.output)
        check_has_values(leaves)
    except TypeError as error:
        return crashed(record, CrashKind.CONTRACT, error, case)
    return judged(case, cell, leaves, record)


def check_has_values(leaves: Leaves) -> None:
    """A leaf with no values (a ``meta`` tensor) cannot be compared: the fix broke the
    contract of returning computed tensors."""
    for name, tensor in leaves.items():
        if tensor.is_meta:
            raise TypeError(f"{name} is a meta tensor: it has no values to compare")


def raised(case: Case, error: BaseException, record: CellRecord) -> CellRecord:
    """A cell whose fix raised. It reproduces when the error (or a class it derives from,
    so Dynamo's ``TorchRuntimeError`` counts as a ``RuntimeError``) and message match."""
    fields = error_fields(error, case_root(case))
    known = case.known_failures
    kinds = [k.__name__ for k in type(error).__mro__]
    return replace(
        record,
        outcome=Outcome.RAISES,
        # a model checked by the user has no known failure: its errors are just errors
        reproduces=any(
            failure.matches(kind, fields["error_message"]) for failure in known for kind in kinds
        )
        if known
        else None,
        compile_error=from_compiler(error) if record.cell.compile != "eager" else None,
        **fields,
    )


def from_compiler(error: BaseException) -> bool:
    """Raised by ``torch.compile`` itself (Dynamo, fake-tensor tracing or Inductor)."""
    return type(error).__module__.startswith(("torch._dynamo", "torch._inductor"))


def judged(case: Case, cell: Cell, leaves: Leaves, record: CellRecord) -> CellRecord:
    """A cell that ran: ``passes`` or ``inaccurate``, with the worst leaf's figures (and
    each leaf's, where the output has several) and the yardsticks they were judged by."""
    piece = workpiece(cell)
    reference = reference_leaves(piece)
    out_dtype = "+".join(dict.fromkeys(dtype_name(t.dtype) for t in leaves.values()))
    problem = structure_problem(leaves, reference)
    if problem:
        return replace(
            record, outcome=Outcome.INACCURATE, out_dtype=out_dtype, error_message=problem
        )
    sticks = yardsticks(case, cell, piece, record.trail)
    per_leaf = judge_leaves(
        leaves,
        reference,
        dtype_of(cell.dtype),
        sticks.fix.rel_errs,
        sticks.rounding.rel_errs,
        sticks.names,
    )
    worst = worst_leaf(per_leaf)
    passed = all(within_tolerance(n) for n in per_leaf.values())
    return replace(
        record,
        outcome=Outcome.PASSES if passed else Outcome.INACCURATE,
        out_dtype=out_dtype,
        numerics=worst if len(per_leaf) > 1 else replace(worst, leaf=None),
        leaves=per_leaf if len(per_leaf) > 1 else None,
        baseline_error=sticks.error,
    ).noted(sticks.note)


def worst_leaf(per_leaf: dict[str, Numerics]) -> Numerics:
    """The leaf furthest from passing: non-finite first, then by error over tolerance."""
    return max(per_leaf.values(), key=lambda n: (not n.finite, n.rel_err / n.tolerance))


@dataclass(frozen=True)
class CellYardsticks:
    """What a cell is judged against: the trusted fix's errors (empty for a cell of that
    fix), the rounding's, their names, and a note where the choice needs saying."""

    fix: Baseline
    rounding: Baseline
    names: Yardsticks
    note: Note | None = None

    @property
    def error(self) -> str | None:
        failures = [
            f"{name}: {b.error}"
            for name, b in (
                (self.names.fix_name, self.fix),
                (self.names.rounding_name, self.rounding),
            )
            if b.error
        ]
        return "; ".join(failures) or None


def yardsticks(case: Case, cell: Cell, piece: Workpiece, trail: Trail | None) -> CellYardsticks:
    """The independent yardsticks of a cell: a different, trusted fix in the cell's dtype
    where there is one (never the cell's own fix), and the rounding of its data always."""
    fix = (
        Baseline({})
        if cell.fix == case.reference_fix
        else baseline(piece, cell.device, cell.dtype)
    )
    tf32 = tf32_setting(cell, trail)
    dtype = "tf32" if tf32 else cell.dtype
    names = Yardsticks(fix_name=f"fix {case.reference_fix}", rounding_name=f"rounding to {dtype}")
    tf32_note = f"float32 matmuls computed in TF32 ({tf32}): judged against TF32 rounding"
    note = Note(NoteKind.TF32, tf32_note) if tf32 else None
    return CellYardsticks(fix, rounding(piece, dtype, case.kept_by(cell.fix)), names, note)


def tf32_setting(cell: Cell, trail: Trail | None) -> str | None:
    """The setting that makes a float32 cell's GPU matmuls or convolutions TF32, or None."""
    if cell.dtype != CONTROL_DTYPE or torch.device(cell.device).type != "cuda":
        return None
    if trail is not None and "matmul" not in trail.compute_dtypes:
        return None
    precision = torch.get_float32_matmul_precision()
    if precision != "highest":  # what torch.backends.cuda.matmul.allow_tf32 sets
        return f"torch.get_float32_matmul_precision() == {precision!r}"
    if torch.backends.cudnn.allow_tf32 and torch.backends.cudnn.enabled:
        return "torch.backends.cudnn.allow_tf32"
    return None
