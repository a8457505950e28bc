"""What every cell of a case at one size is judged against, computed once per process: the
float64 reference, the trusted fix's error in a low-precision dtype (the baseline) and the
rounding yardstick; and their serialisation in parts (the reference with its rounding
yardsticks, then each dtype's baseline), so a runner computes them in a forked child and
holds them in the worker that forks the cells, and a part that kills its process costs only
itself (see ``harness.runner.isolation``).
"""

from __future__ import annotations

import dataclasses
import io
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from harness.measure.authoring import registry
from harness.measure.authoring.case import Case, RunContext, Workload
from harness.measure.host import caches
from harness.measure.judge.numerics import relative_error
from harness.measure.judge.rounding import (
    noise_source,
    round_inputs,
    round_model,
    rounds_activations,
    stored_rounding,
)
from harness.measure.precision.casting import split_kept
from harness.measure.precision.dtypes import dtype_name
from harness.measure.precision.outputs import output_leaves
from harness.measure.running.errors import (
    MAX_MESSAGE,
    ReferenceFailed,
    WorkloadFailed,
    error_text,
)
from harness.measure.running.fix_run import (
    FixRun,
    context_for,
    judged_output,
    prepared_workload,
    run_fix_checked,
)
from harness.measure.running.replay import Recorded, Replay, ReplayPlan, run_replayed
from harness.measure.running.training import held_scaled
from harness.measure.tracing.backward_sites import all_finite
from harness.schema.axes import (
    CONTROL_DTYPE,
    CONTROL_MODE,
    FORWARD_STAGE,
    Cell,
)
from harness.schema.devices import CUDA, device_kind
from harness.schema.stages import stage_of

REFERENCE_BACKENDS = ("sdpa", "eager")

Leaves = dict[str, torch.Tensor]


class Workpiece(NamedTuple):
    """What a reference and its yardsticks belong to: a case at one workload size with the
    backend its reference runs on (the case's reference backend, or the cell's own where
    the case's reference is per backend), at one stage, run by one fix (the case's
    reference fix, or a fit cell's own: see ``workpiece``)."""

    case: str
    size: str
    backend: str
    stage: str
    fix: str


@dataclass(frozen=True)
class Baseline:
    """A yardstick's error per leaf, or why it could not be computed."""

    rel_errs: dict[str, float]
    error: str | None = None


# Computed once per process, or received from the forked child that computed them
# (``remember_reference_figures``, ``remember_baseline``).
#: The float64 reference, as named leaves, by workpiece.
_REFERENCES: dict[Workpiece, Leaves] = caches.keyed(f"{__name__}._REFERENCES")
#: What the reference fix raised in float64, by workpiece: every cell asking for that
#: reference is told, and none computes it again.
_REFERENCE_FAILURES: dict[Workpiece, BaseException] = caches.keyed(
    f"{__name__}._REFERENCE_FAILURES"
)
#: What the float64 reference drew at random and chose, by workpiece (a forward's or a
#: training step's; see :mod:`harness.measure.running.replay`).
_REFERENCE_RECORDS: dict[Workpiece, Recorded] = caches.keyed(f"{__name__}._REFERENCE_RECORDS")
#: The trusted fix's error, computed on the cell's device, by (*workpiece, device, dtype).
_BASELINES: dict[tuple[str, str, str, str, str, str, str], Baseline] = caches.keyed(
    f"{__name__}._BASELINES"
)
#: The rounding yardstick, by (*workpiece, dtype or ``tf32``, parts kept in float32,
#: whether the activations are rounded too).
_ROUNDINGS: dict[tuple[str, str, str, str, str, str, tuple[str, ...], bool], Baseline] = (
    caches.keyed(f"{__name__}._ROUNDINGS")
)


def reference_backend(case: Case) -> str:
    """The backend a case's reference and baselines run on (unless its reference is per
    backend, see ``workpiece``): SDPA where the case has it, else eager, else its first."""
    return next((b for b in REFERENCE_BACKENDS if b in case.backends), case.backends[0])


def plain_cell(
    case: Case,
    dtype: str,
    size: str,
    device: str = "cpu",
    backend: str = "",
    stage: str = FORWARD_STAGE,
    fix: str = "",
) -> Cell:
    """The reference fix (or ``fix``) run plainly (mode ``half``) at ``size``, at ``stage``:
    in float64 on the CPU it is the reference, in a cell's dtype on the cell's device the
    baseline."""
    backend = backend or reference_backend(case)
    fix = fix or case.reference_fix
    return Cell(case.name, fix, device, dtype, "half", backend, size=size, stage=stage)


def workpiece(cell: Cell) -> Workpiece:
    """The reference a cell is judged against: its case's at its size, on the case's
    reference backend, or on the cell's own where the case builds a different model per
    backend (a model of yours whose factory reads ``ctx.backend``). A fit is judged against
    the float64 fit of its own fix (its optimizer, learning rate and data: only the
    precision differs); every other stage against the case's reference fix."""
    case = registry.get(cell.case)
    backend = cell.backend if case.reference_per_backend else reference_backend(case)
    fix = cell.fix if stage_of(cell.stage).own_reference else case.reference_fix
    return Workpiece(cell.case, cell.size, backend, cell.stage, fix)


def reference_leaves(piece: Workpiece) -> Leaves:
    """The case's reference fix in float64 on the CPU, as named float64 leaves; raises
    ``ReferenceFailed`` (each time it is asked) where that fix fails in float64."""
    if piece in _REFERENCE_FAILURES:
        raise ReferenceFailed(_REFERENCE_FAILURES[piece])
    if piece not in _REFERENCES:
        try:
            _REFERENCES[piece] = compute_reference(piece)
        except ReferenceFailed as failure:
            _REFERENCE_FAILURES[piece] = failure.error
            raise
    return _REFERENCES[piece]


def float64_run(piece: Workpiece, workload: Workload | None = None, record: bool = True) -> FixRun:
    """The workpiece's fix run plainly in float64 on the CPU (raises ``WorkloadFailed``
    where its workload cannot be built), on ``workload`` where given (its float64
    workload, prepared: :func:`float64_workload`); ``record``: keep what it drew and
    chose (a replayed run needs none)."""
    case = registry.get(piece.case)
    ctx = context_for(case, float64_cell(case, piece))
    return run_fix_checked(case, piece.fix, ctx, trace=False, workload=workload, record=record)


def float64_cell(case: Case, piece: Workpiece) -> Cell:
    return plain_cell(case, "float64", piece.size, "cpu", piece.backend, piece.stage, piece.fix)


def float64_workload(piece: Workpiece) -> Workload:
    """The workpiece's workload as its float64 run takes it."""
    case = registry.get(piece.case)
    ctx = context_for(case, float64_cell(case, piece))
    return prepared_workload(case, ctx, case.kept_by(piece.fix))


def compute_reference(piece: Workpiece) -> Leaves:
    try:
        workload = float64_workload(piece)
        run = float64_run(piece, workload)
    except WorkloadFailed as failure:
        raise ReferenceFailed(failure.error) from failure
    if run.error is not None:
        raise ReferenceFailed(run.error)
    unusable = unusable_reference(workload.model, output_leaves(judged_output(run.output)))
    if unusable is not None:
        raise ReferenceFailed(unusable)
    if run.recorded is not None:
        _REFERENCE_RECORDS[piece] = run.recorded
    return float64_leaves(judged_output(run.output))


class UnusableReference(ArithmeticError):
    """The reference fix ran in float64 but gave no float64 reference: the model's own
    failure, whatever precision a cell runs in (never the precision's, never the
    harness's)."""


def unusable_reference(model: Any, leaves: Leaves) -> UnusableReference | None:
    """Why a float64 run's result is no float64 reference, or None: a model that cast
    itself to another dtype (``.to(torch.bfloat16)`` in its forward) computed its
    reference in that dtype, and a cell's yardsticks with it; a model whose float64 output,
    loss or gradient is not finite fails in every precision."""
    moved = {
        name: dtype_name(p.dtype)
        for name, p in trainable_or_all(model).items()
        if p.is_floating_point() and p.dtype != torch.float64
    }
    leaf_dtypes = {
        name: dtype_name(t.dtype)
        for name, t in leaves.items()
        if t.is_floating_point() and torch.finfo(t.dtype).bits < 32
    }
    if moved or leaf_dtypes:
        found_at = [f"parameter {n} is {d}" for n, d in moved.items()] + [
            f"{leaf_label(n)} is {d}" for n, d in leaf_dtypes.items()
        ]
        more = f" and {len(found_at) - 3} more" if len(found_at) > 3 else ""
        where = ", ".join(found_at[:3]) + more
        found = sorted({*moved.values(), *leaf_dtypes.values()})
        return UnusableReference(
            f"the float64 reference computed in {' and '.join(found)}: {where} "
            "(the model casts itself to another dtype; cast the inputs instead, or follow "
            "the dtype of its weights)"
        )
    not_finite = [n for n, t in leaves.items() if t.is_floating_point() and not all_finite([t])]
    if not_finite:
        which = "" if not_finite == ["output"] else f" ({', '.join(not_finite)})"
        return UnusableReference(
            f"the float64 reference's output is not finite{which}: the model fails in "
            "float64 too, whatever the precision"
        )
    return None


def trainable_or_all(model: Any) -> dict[str, torch.Tensor]:
    """A model's parameters by name (a model that is one tensor: ``model``)."""
    if isinstance(model, torch.nn.Module):
        return dict(model.named_parameters())
    return {"model": model} if isinstance(model, torch.Tensor) else {}


def reference_record(piece: Workpiece) -> Recorded:
    """What the float64 reference drew at random and chose (nothing for a fit)."""
    reference_leaves(piece)
    return _REFERENCE_RECORDS.get(piece, Recorded())


def reference_along(
    piece: Workpiece, plan: ReplayPlan, dtype: str
) -> tuple[Leaves, Replay] | None:
    """The float64 reference taken again with a cell's random draws and its choices within
    the band of the other outcome (see :mod:`harness.measure.running.replay`), and the
    replay (what it moved); None where the run turned out not to draw or choose as the
    cell did (another op or shape at some place). Its workload is built before the replay
    starts: what building it draws is its own."""
    try:
        workload = float64_workload(piece)
        run, replay = run_replayed(lambda: float64_run(piece, workload, record=False), plan, dtype)
    except WorkloadFailed:
        return None
    if run.error is not None or not replay.fits:
        return None
    return float64_leaves(judged_output(run.output)), replay


def float64_leaves(output: Any) -> Leaves:
    return {
        name: t.detach().to(device="cpu", dtype=torch.float64)
        for name, t in output_leaves(output).items()
    }


def baseline(piece: Workpiece, device: str, dtype: str) -> Baseline:
    """Error of the trusted fix computed plainly in ``dtype`` on ``device`` (reference fix,
    mode half): on the cell's own device, as PyTorch's SDPA tests compute their
    low-precision reference, since a GPU sums in another order than a CPU (at model sizes a
    float32 control on a GPU differs from the CPU's float32 by more than 3x the CPU's
    error)."""
    key = (*piece, device, dtype)
    if key not in _BASELINES:
        _BASELINES[key] = compute_baseline(piece, device, dtype)
    return _BASELINES[key]


def compute_baseline(piece: Workpiece, device: str, dtype: str) -> Baseline:
    case_name, size, backend, stage, _ = piece
    case = registry.get(case_name)
    ctx = context_for(case, plain_cell(case, dtype, size, device, backend, stage))
    try:
        with held_scaled():
            run = run_fix_checked(case, case.reference_fix, ctx, trace=False, record=False)
    except WorkloadFailed as failure:
        run = FixRun(error=failure.error)
    return errors_against_reference(run, piece)


def errors_against_reference(run: FixRun, piece: Workpiece) -> Baseline:
    """A yardstick run's error per leaf against the reference, or why there is none."""
    if run.error is not None:
        return Baseline({}, f"{type(run.error).__name__}: {error_text(run.error)}"[:MAX_MESSAGE])
    reference = reference_leaves(piece)
    leaves = output_leaves(judged_output(run.output))
    problem = structure_problem(leaves, reference)
    if problem:
        return Baseline({}, problem)
    return Baseline({leaf: relative_error(t, reference[leaf])[1] for leaf, t in leaves.items()})


def structure_problem(leaves: Leaves, reference: Leaves) -> str | None:
    """Why an output cannot be compared with the reference leaf by leaf, or None:
    ``the output has shape (4, 8), the float64 reference's (2, 8)``."""
    if leaves.keys() != reference.keys():
        return (
            f"the output has leaves {sorted(leaves)}, the float64 reference's {sorted(reference)}"
        )
    for name, t in leaves.items():
        if t.shape != reference[name].shape:
            return (
                f"{leaf_label(name)} has shape {tuple(t.shape)}, the float64 reference's "
                f"{tuple(reference[name].shape)}"
            )
    return None


def leaf_label(name: str) -> str:
    """``the output`` for an output of one tensor, else ``output <leaf>``."""
    return "the output" if name == "output" else f"output {name}"


def rounding(
    piece: Workpiece, dtype: str, keep: tuple[str, ...], activations: bool = False
) -> Baseline:
    """The rounding yardstick: the reference computation on the weights and inputs rounded
    to ``dtype`` (what ``keep`` names left float32), with ``activations`` each module's
    output too, in float64 on the CPU (see :mod:`harness.measure.judge.rounding`)."""
    key = (*piece, dtype, keep, activations)
    if key not in _ROUNDINGS:
        _ROUNDINGS[key] = compute_rounding(piece, dtype, keep, activations)
    return _ROUNDINGS[key]


def compute_rounding(
    piece: Workpiece, dtype: str, keep: tuple[str, ...], activations: bool = False
) -> Baseline:
    case_name, size, backend, stage, _ = piece
    case = registry.get(case_name)
    ctx = context_for(case, plain_cell(case, "float64", size, backend=backend, stage=stage))
    try:
        workload = rounded_workload(case, ctx, dtype, keep)
        model_keep = split_kept(keep, workload.inputs)[0]
        with (
            stored_rounding(workload.model, dtype, model_keep, activations, stage),
            float64_choices(piece, dtype),
        ):
            run = run_fix_checked(
                case, case.reference_fix, ctx, trace=False, workload=workload, record=False
            )
    except WorkloadFailed as failure:
        run = FixRun(error=failure.error)
    return errors_against_reference(run, piece)


def float64_choices(piece: Workpiece, dtype: str) -> Replay | nullcontext[None]:
    """In a rounding yardstick, every discrete choice within the band of the other outcome
    takes float64's (see :mod:`harness.measure.running.replay`); its random draws are
    float64's own (a float64 run from the same seed)."""
    choices = reference_record(piece).choices
    kinks = stage_of(piece.stage).replays_kinks
    return Replay(None, choices, dtype, kinks) if choices else nullcontext()


def rounded_workload(case: Case, ctx: RunContext, dtype: str, keep: tuple[str, ...]) -> Workload:
    """The reference's float64 workload with its values rounded to ``dtype``."""
    workload = prepared_workload(case, ctx, keep)
    model_keep, input_keep = split_kept(keep, workload.inputs)
    noise = noise_source()
    try:
        return Workload(
            model=round_model(workload.model, dtype, model_keep, noise),
            inputs=round_inputs(workload.inputs, dtype, input_keep, noise),
        )
    except Exception as error:
        raise WorkloadFailed(error) from error


def rounding_kinds(case: Case, device: str, stage: str) -> tuple[tuple[str, bool], ...]:
    """(dtype, whether the activations are rounded too) of every rounding yardstick the
    case's cells on ``device`` ask for: its dtypes in each of its modes, and the float32
    control's, with TF32 on a GPU (which may compute float32 matmuls in it); none for a
    fit, judged by the float64 fit's curve alone."""
    if not stage_of(stage).yardsticks:
        return ()
    control = (CONTROL_DTYPE, "tf32") if device_kind(device) == CUDA else (CONTROL_DTYPE,)
    return tuple(
        dict.fromkeys(
            (dtype, rounds_activations(mode))
            for mode in dict.fromkeys((*case.modes, CONTROL_MODE))
            for dtype in (control if mode == CONTROL_MODE else case.dtypes)
        )
    )


def kept_sets(case: Case) -> tuple[tuple[str, ...], ...]:
    """Every distinct set of parts a fix of the case keeps in float32."""
    return tuple(dict.fromkeys(case.kept_by(fix) for fix in case.fixes))


def baseline_dtypes(piece: Workpiece) -> tuple[str, ...]:
    """The dtypes a case's baselines are computed in on each device: its own, and the
    float32 control's (none for a fit, judged by the float64 fit's curve alone)."""
    if not stage_of(piece[3]).yardsticks:
        return ()
    return tuple(dict.fromkeys((*registry.get(piece[0]).dtypes, CONTROL_DTYPE)))


def reference_figures(piece: Workpiece, device: str) -> bytes | None:
    """The case's reference at one size and its rounding yardsticks for ``device`` (all
    float64, on the CPU), serialised for the process that forked this one; None where the
    reference fix raised (each cell is then told, see ``reference_leaves``)."""
    case = registry.get(piece[0])
    try:
        reference = reference_leaves(piece)
        roundings = [
            (dtype, keep, activations, rounding(piece, dtype, keep, activations))
            for dtype, activations in rounding_kinds(case, device, piece[3])
            for keep in kept_sets(case)
        ]
    except Exception:
        return None
    buffer = io.BytesIO()
    torch.save(
        {
            "reference": reference,
            "record": reference_record(piece).to_data(),
            "roundings": [(d, list(k), a, dataclasses.asdict(b)) for d, k, a, b in roundings],
        },
        buffer,
    )
    return buffer.getvalue()


def remember_reference_figures(piece: Workpiece, data: bytes) -> None:
    """Hold what ``reference_figures`` computed in another process."""
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    _REFERENCES[piece] = loaded["reference"]
    _REFERENCE_RECORDS[piece] = Recorded.from_data(loaded["record"])
    for dtype, keep, activations, figures in loaded["roundings"]:
        _ROUNDINGS[(*piece, dtype, tuple(keep), activations)] = Baseline(**figures)


def baseline_figures(piece: Workpiece, device: str, dtype: str) -> dict[str, Any]:
    """The trusted fix's error in ``dtype`` on ``device``, as plain data for the process
    that forked this one (which holds the reference already)."""
    return dataclasses.asdict(baseline(piece, device, dtype))


def remember_baseline(piece: Workpiece, device: str, dtype: str, figures: Baseline) -> None:
    """Hold a baseline computed in another process, or why none came from it."""
    _BASELINES[(*piece, device, dtype)] = figures
