"""Judging a fix's run: the outcome and its evidence, either the error it raised (and whether
that is the case's known failure) or its output's error against the float64 reference,
within a tolerance from yardsticks that are not the code under test (the rule is in
:mod:`harness.measure.judge.numerics`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from harness.measure.authoring.case import Case, Symptom
from harness.measure.host import torch_state
from harness.measure.judge.numerics import Yardsticks, judge_leaves, within_tolerance
from harness.measure.judge.references import (
    Baseline,
    Leaves,
    Workpiece,
    baseline,
    leaf_label,
    reference_along,
    reference_leaves,
    reference_record,
    rounding,
    structure_problem,
    workpiece,
)
from harness.measure.judge.rounding import rounds_activations
from harness.measure.precision.dtypes import dtype_name, dtype_of
from harness.measure.precision.outputs import output_leaves
from harness.measure.running.crashes import crashed
from harness.measure.running.errors import WorkloadFailed, case_root, error_fields
from harness.measure.running.fitting import (
    FitRun,
    fit_figures,
    shortfall_numerics,
    stall_reason,
)
from harness.measure.running.fitting import evidence as fit_evidence
from harness.measure.running.fix_run import FixRun, context_for, run_fix_checked
from harness.measure.running.replay import Recorded, plan_replay, replay_note
from harness.schema.axes import CONTROL_DTYPE, EAGER, Cell
from harness.schema.devices import CUDA, device_kind
from harness.schema.kernel_kinds import MATMUL
from harness.schema.records import (
    CellRecord,
    CrashKind,
    FlagKind,
    Note,
    NoteKind,
    Numerics,
    Outcome,
)
from harness.schema.stages import stage_of
from harness.schema.trail_records import Trail


def classify(case: Case, cell: Cell, run: FixRun, record: CellRecord) -> CellRecord:
    """Fill in the outcome and its evidence: the error, or the figures against the reference."""
    record = replace(record, flags=run.flags, trail=run.trail, warnings=run.warnings).noted(
        run.note
    )
    if run.error is not None:
        require_reference(cell)
        return raised(case, run.error, record)
    result = ran(case, cell, run, record)
    return replace(result, reproduces=reproduces(case, result))


def ran(case: Case, cell: Cell, run: FixRun, record: CellRecord) -> CellRecord:
    """A cell whose fix returned, judged as its stage says (:meth:`Stage.verdict
    <harness.schema.stages.Stage.verdict>`): its output, or its fit, against the reference."""
    verdict: CellRecord = stage_of(cell.stage).verdict(RunJudge(case, cell, run, record))
    return verdict


@dataclass(frozen=True)
class RunJudge:
    """The verdicts a stage may give a run that returned (see
    :class:`~harness.schema.stages.StageJudge`)."""

    case: Case
    cell: Cell
    run: FixRun
    record: CellRecord

    def outputs(self) -> CellRecord:
        """Its output, leaf by leaf, against the reference within the yardstick."""
        try:
            leaves = output_leaves(self.run.output)
            check_has_values(leaves)
        except TypeError as error:
            return crashed(self.record, CrashKind.CONTRACT, error, self.case)
        return judged(self.case, self.cell, leaves, self.record, self.run.recorded)

    def fit(self) -> CellRecord:
        """Its fit, by where its loss ends beside the same fix's float64 fit."""
        if not isinstance(self.run.output, FitRun):
            raise TypeError(f"a {self.cell.stage} cell returned no fit to judge")
        return judged_fit(self.cell, self.run.output, self.record, self.run.recorded)


#: The outcomes that are a verdict on the cell's code: it raised, or ran and was judged.
VERDICTS = (Outcome.RAISES, Outcome.PASSES, Outcome.INACCURATE)


def reproduces(case: Case, record: CellRecord, error: BaseException | None = None) -> bool | None:
    """Whether a cell showed its case's known failure, raised or silent: True where it
    raised the known error (``error``'s type, or a class it derives from, so Dynamo's
    ``TorchRuntimeError`` counts as a ``RuntimeError``, and its message) or ran showing one
    of the declared symptoms; False where its verdict shows none of them (it passes, or
    raises something else); None for a model you check (no known failure: its errors are
    just errors) and for a cell with no verdict (skipped, crashed, timed out)."""
    known = case.known_failures
    if not known or record.outcome not in VERDICTS:
        return None
    if record.outcome is Outcome.RAISES:
        kinds = [k.__name__ for k in type(error).__mro__] if error else [record.error_type]
        message = record.error_message or ""
        return any(f.matches(kind or "", message) for f in known for kind in kinds)
    shown = symptoms_shown(record)
    return any(failure.shown_by(shown) for failure in known)


def symptoms_shown(record: CellRecord) -> frozenset[Symptom]:
    """The silent symptoms a cell that ran shows: an output not finite, or finite and
    beyond its tolerance (``inaccurate``), and a ``drift`` flag (computed wider)."""
    drift = any(f.kind is FlagKind.DRIFT for f in record.flags)
    shown = {Symptom.WIDER_DTYPE} if drift else set()
    numerics = record.numerics
    if record.outcome is Outcome.INACCURATE and numerics is not None:
        shown.add(Symptom.BEYOND_YARDSTICK if numerics.finite else Symptom.NON_FINITE)
    return frozenset(shown)


def require_reference(cell: Cell) -> None:
    """Raise ``ReferenceFailed`` where the cell's float64 reference fails: a fix that raises
    in every precision, float64 included, has no half-precision bug to show, and the cell
    says that the reference failed rather than ``raises`` (which would read as one)."""
    reference_leaves(workpiece(cell))


def check_has_values(leaves: Leaves) -> None:
    """A leaf with no values (a ``meta`` tensor) cannot be compared: the fix broke the
    contract of returning computed tensors."""
    for name, tensor in leaves.items():
        if tensor.is_meta:
            raise TypeError(f"{name} is a meta tensor: it has no values to compare")


def raised(case: Case, error: BaseException, record: CellRecord) -> CellRecord:
    """A cell whose fix raised, and whether that is its case's known failure
    (:func:`reproduces`)."""
    fields = error_fields(error, case_root(case))
    record = replace(
        record,
        outcome=Outcome.RAISES,
        compile_error=from_compiler(error) if record.cell.compile != EAGER else None,
        **fields,
    )
    return replace(record, reproduces=reproduces(case, record, error))


def from_compiler(error: BaseException) -> bool:
    """Raised by ``torch.compile`` itself (Dynamo, fake-tensor tracing or Inductor)."""
    return type(error).__module__.startswith(("torch._dynamo", "torch._inductor"))


def judged(
    case: Case,
    cell: Cell,
    leaves: Leaves,
    record: CellRecord,
    recorded: Recorded | None = None,
) -> CellRecord:
    """A cell that ran: ``passes`` or ``inaccurate``, with the worst leaf's figures (and
    each leaf's, where the output has several) and the yardsticks they were judged by; a
    computation along its own random draws and choices (``recorded``)."""
    piece = workpiece(cell)
    reference, replay_said = reference_for(piece, cell, recorded)
    record = record.noted(replay_said)
    out_dtypes = leaf_dtypes(leaves)
    problem = structure_problem(leaves, reference)
    if problem:
        return misshapen(case, cell, leaves, reference, replace(record, out_dtypes=out_dtypes))
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
        out_dtypes=out_dtypes,
        numerics=worst if len(per_leaf) > 1 else replace(worst, leaf=None),
        leaves=per_leaf if len(per_leaf) > 1 else None,
        baseline_error=sticks.error,
    ).noted(sticks.note)


def reference_for(
    piece: Workpiece, cell: Cell, recorded: Recorded | None
) -> tuple[Leaves, Note | None]:
    """The float64 reference a cell is judged against: the case's, or, where the cell drew
    other random numbers than float64 or made a choice otherwise within rounding of the
    other outcome, the reference taken again along the cell's draws and choices, with a
    note saying what was replayed (see :mod:`harness.measure.running.replay`). A compiled
    cell's draws are its eager twin's (``fix_run.eager_twin_draws``), and its kinks and
    picks, which Inductor's kernels make out of sight, keep float64's."""
    reference = reference_leaves(piece)
    compiled = cell.compile != EAGER
    if recorded is None:
        return reference, compiled_draws_note(reference_record(piece).draws) if compiled else None
    dtype = band_dtype(cell)
    stage = stage_of(cell.stage)
    kinks, picks = (False, False) if compiled else (stage.replays_kinks, stage.replays_picks)
    plan = plan_replay(reference_record(piece), recorded, dtype, kinks, picks)
    if plan is None:
        return reference, None
    along = reference_along(piece, plan, dtype) if plan.draws or plan.choices else None
    leaves, replay = along if along is not None else (reference, None)
    text = replay_note(replay, plan)
    return leaves, Note(NoteKind.REPLAYED, text) if text else None


def compiled_draws_note(draws: Sequence[object]) -> Note | None:
    """A compiled cell's random draws are Inductor's, out of the recorder's sight: where
    float64 drew, a note says they were not replayed."""
    if not draws:
        return None
    return Note(
        NoteKind.REPLAYED,
        f"compiled: the cell's random draws cannot be replayed (float64 drew {len(draws)} "
        "time(s)); judged against float64's own",
    )


def band_dtype(cell: Cell) -> str:
    """Whose resolution a cell's choices are judged by: its dtype's (TF32's for a
    float32 control on a GPU, which may compute its matmuls in it)."""
    control_on_gpu = cell.dtype == CONTROL_DTYPE and device_kind(cell.device) == CUDA
    return "tf32" if control_on_gpu else cell.dtype


#: The error type of a cell whose output changed from one call to the next, and of one
#: whose output, the same on every call, has other leaves or shapes than the reference's.
OUTPUT_CHANGED = "OutputChanged"
OUTPUT_MISMATCH = "OutputMismatch"


def misshapen(
    case: Case, cell: Cell, leaves: Leaves, reference: Leaves, record: CellRecord
) -> CellRecord:
    """A cell whose output cannot be compared with the reference leaf by leaf. Its fix is
    called once more to tell why: an output that changes from call to call (a model that
    keeps state between calls: a counter, a cache that grows) breaks the contract that a
    cell's call is repeatable, and is ``crashed`` (contract), which no one reads as a
    precision bug; one that comes out the same again is ``inaccurate``: misshapen in this
    precision."""
    again = output_again(case, cell)
    changed = structure_change(leaves, again, reference) if again is not None else None
    if changed:
        return replace(
            record,
            outcome=Outcome.CRASHED,
            crash_kind=CrashKind.CONTRACT,
            error_type=OUTPUT_CHANGED,
            error_message=f"output shape changed between calls: {changed}",
        )
    problem = structure_problem(leaves, reference)
    return replace(
        record, outcome=Outcome.INACCURATE, error_type=OUTPUT_MISMATCH, error_message=problem
    )


def output_again(case: Case, cell: Cell) -> Leaves | None:
    """The cell's fix called again, on a workload built afresh, as its output's leaves;
    None where that call fails. Torch's settings are put back after it, as after the
    cell's own call."""
    try:
        with torch_state.restored([]):
            run = run_fix_checked(
                case, cell.fix, context_for(case, cell), trace=False, compile_mode=cell.compile
            )
        return output_leaves(run.output) if run.error is None else None
    except (WorkloadFailed, TypeError):  # no workload, or no tensors: nothing to compare
        return None


def structure_change(first: Leaves, again: Leaves, reference: Leaves) -> str | None:
    """How a second call's output differs in its leaves or shapes from the first's, or
    None: ``the output had shape (4, 8), then (6, 8); the float64 reference's is (2, 8)``."""
    if first.keys() != again.keys():
        return f"the output had leaves {sorted(first)}, then {sorted(again)}"
    for name, t in first.items():
        if t.shape != again[name].shape:
            shapes = (
                f"{leaf_label(name)} had shape {tuple(t.shape)}, then {tuple(again[name].shape)}"
            )
            if name not in reference:
                return shapes
            return f"{shapes}; the float64 reference's is {tuple(reference[name].shape)}"
    return None


def judged_fit(
    cell: Cell, run: FitRun, record: CellRecord, recorded: Recorded | None = None
) -> CellRecord:
    """A fit that ran: ``passes``, or ``inaccurate`` where it stalled (its loss not finite,
    or ending beyond the same fix's float64 fit's, taken again with the fit's draws where
    they differ: ``reference_for``), with its figures; the updates it lost and the steps
    its GradScaler skipped are said beside, as evidence."""
    reference, replay_said = reference_for(workpiece(cell), cell, recorded)
    figures = fit_figures(run, reference["loss"])
    stalled = stall_reason(figures)
    said = "; ".join(t for t in (stalled, fit_evidence(figures)) if t)
    return replace(
        record,
        outcome=Outcome.INACCURATE if stalled else Outcome.PASSES,
        out_dtypes=forward_dtypes(run.forward_output),
        numerics=shortfall_numerics(figures),
        fit=figures,
    ).noted(replay_said, new_fit_note(record, said))


def new_fit_note(record: CellRecord, said: str) -> Note | None:
    """What the fit's verdict says, unless a note of the record says it already (the run's
    own note, which :func:`classify` has put on it: ``the fit's loss is not finite from
    step 1: AdamW's eps ...`` holds ``the fit's loss is not finite from step 1``)."""
    if not said or any(said in note.text for note in record.notes):
        return None
    return Note(NoteKind.FIT, said)


def forward_dtypes(output: object) -> tuple[str, ...]:
    """The dtypes of a forward output's leaves (``("float16", "float32")``), none where it
    has none."""
    try:
        return leaf_dtypes(output_leaves(output))
    except TypeError:
        return ()


def leaf_dtypes(leaves: Leaves) -> tuple[str, ...]:
    """The distinct dtypes of ``leaves`` in order first seen: ``("float16", "float32")``."""
    return tuple(dict.fromkeys(dtype_name(t.dtype) for t in leaves.values()))


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
    stored = rounding(piece, dtype, case.kept_by(cell.fix), rounds_activations(cell.mode))
    return CellYardsticks(fix, stored, names, note)


def tf32_setting(cell: Cell, trail: Trail | None) -> str | None:
    """The setting that makes a float32 cell's GPU matmuls or convolutions TF32, or None."""
    if cell.dtype != CONTROL_DTYPE or device_kind(cell.device) != CUDA:
        return None
    if trail is not None and MATMUL not in trail.compute_dtypes:
        return None
    precision = torch.get_float32_matmul_precision()
    if precision != "highest":  # what torch.backends.cuda.matmul.allow_tf32 sets
        return f"torch.get_float32_matmul_precision() == {precision!r}"
    if torch.backends.cudnn.allow_tf32 and torch.backends.cudnn.enabled:
        return "torch.backends.cudnn.allow_tf32"
    return None
