"""Running one cell: build, apply the precision, run the fix, judge it against the reference.

What the harness guarantees a fix (the contract in ``docs/writing-a-case.md``): the RNG is
seeded before ``build``; the workload arrives with the cell's device and precision; the
fix runs under ``torch.no_grad()`` unless the case ``needs_grad``, and inside
``torch.autocast`` in the autocast modes. The correctness phase calls a fix once on a fresh
workload; the timing phase calls it many times on one workload.
"""

from __future__ import annotations

import dataclasses
import io
import random
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from harness.measure import flash_kernels, registry, torch_state
from harness.measure.case import Case, RunContext, Workload
from harness.measure.numerics import Yardsticks, judge_leaves, relative_error, within_tolerance
from harness.measure.perf import perf_figures
from harness.measure.precision import (
    autocast_region,
    cast_inputs,
    cast_model,
    drift_flag,
    dtype_name,
    dtype_of,
    no_autocast_flag,
    not_half_flag,
    output_leaves,
    output_leaves_or_none,
    split_kept,
    undone_upcast_flag,
)
from harness.measure.rounding import noise_source, round_inputs, round_model
from harness.measure.timing import Stopwatch, measure_interleaved, stopwatch_for
from harness.measure.trail import (
    HARNESS_DIR,
    DtypeTracer,
    Names,
    PythonWatch,
    shown_path,
    tracing,
    watch_python,
)
from harness.schema.axes import CONTROL_DTYPE, Cell
from harness.schema.config import TimingConfig
from harness.schema.records import CellRecord, CrashKind, Flag, Numerics, Outcome
from harness.schema.trail_records import Drift, Trail

#: Every cell of a case builds from the same seed, so all fixes and the reference see the
#: same weights and inputs.
SEED = 0
MAX_MESSAGE = 4000
#: How many of the case's own frames a failure keeps (the innermost ones).
MAX_FRAMES = 3
CONTRACT_NOTE = (
    "flash-attn-contract: flash-attn 2's input contract and error messages enforced, "
    "computed with SDPA; not the real flash-attn kernel"
)
REFERENCE_BACKENDS = ("sdpa", "eager")

Leaves = dict[str, torch.Tensor]


def seed_everything(seed: int = SEED) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def reference_backend(case: Case) -> str:
    """The backend the CPU reference and baseline use: plain SDPA or eager if declared."""
    return next((b for b in REFERENCE_BACKENDS if b in case.backends), case.backends[0])


def context_for(case: Case, cell: Cell, observe: bool = True) -> RunContext:
    """What the fix sees of its cell (a ``float64`` cell is the reference)."""
    return RunContext(
        torch.device(cell.device),
        dtype_of(cell.dtype),
        cell.mode,
        cell.backend,
        observe=observe,
        managed_by_case=case.manages_precision,
        size=cell.size,
        dims=case.dims(cell.size),
    )


def plain_cell(case: Case, dtype: str, size: str, device: str = "cpu", backend: str = "") -> Cell:
    """The reference fix run plainly (mode ``half``) at ``size``: in float64 on the CPU it
    is the reference, in a cell's dtype on the cell's device the baseline."""
    backend = backend or reference_backend(case)
    return Cell(case.name, case.reference_fix, device, dtype, "half", backend, size=size)


def apply_precision(workload: Workload, ctx: RunContext, keep: tuple[str, ...] = ()) -> Workload:
    """The cell's device and precision put on a float32 workload (see harness.measure.precision);
    the parts and inputs ``keep`` names stay float32 where the mode casts."""
    precision = ctx.precision
    if not precision.casts_model or precision.managed_by_case:
        keep = ()
    model_keep, input_keep = split_kept(keep, workload.inputs)
    device, dtype, wide = precision.device, precision.compute_dtype, precision.upcast_dtype
    return Workload(
        model=cast_model(workload.model, device, dtype, model_keep, wide),
        inputs=cast_inputs(workload.inputs, device, dtype, input_keep, wide),
    )


class CaseCodeFailed(Exception):
    """Something the case's code does before a cell can be judged raised ``error``."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error_text(error)}")
        self.error = error


class WorkloadFailed(CaseCodeFailed):
    """The case's ``build()`` raised, or its precision could not be applied."""


def prepared_workload(case: Case, ctx: RunContext, keep: tuple[str, ...]) -> Workload:
    seed_everything()
    try:
        return apply_precision(case.build(ctx), ctx, keep)
    except Exception as error:
        raise WorkloadFailed(error) from error


def call_fix(
    case: Case, fix: str, workload: Workload, ctx: RunContext, compiled: Any = None
) -> Any:
    """One call of a fix, with the gradient mode and autocast the cell asks for; through
    ``compiled`` (the fix under ``torch.compile``) in a compiled cell."""
    grad = torch.enable_grad() if case.needs_grad else torch.no_grad()
    with grad, autocast_region(ctx.precision):
        if compiled is not None:
            return compiled(case, workload, ctx)
        return case.fixes[fix].func(case, workload, ctx)


def compiled_fix(case: Case, fix: str, compile_mode: str) -> Any:
    """The fix function under ``torch.compile`` for a compiled cell, else None. The whole
    fix is compiled: Dynamo traces into the model calls it makes."""
    if compile_mode == "eager":
        return None
    return torch.compile(case.fixes[fix].func, backend=compile_mode)


@dataclass(frozen=True)
class FixRun:
    """A fix's checked run: its output (or error), its dtype trail, and what the mode
    promised but the run did not do."""

    output: Any = None
    error: BaseException | None = None
    flags: tuple[Flag, ...] = ()
    trail: Trail | None = None
    #: Warnings the fix raised (``Category: first line``), recorded on the cell.
    warnings: tuple[str, ...] = ()
    #: What the checks found worth saying but not worth a flag (a small float32 island).
    note: str | None = None


def run_fix_checked(
    case: Case,
    fix: str,
    ctx: RunContext,
    trace: bool = True,
    compile_mode: str = "eager",
    workload: Workload | None = None,
) -> FixRun:
    """Build, apply the precision, call the fix once under the dtype tracer; then check that
    the precision took and that the computation kept the mode's promise. A compiled run is
    neither traced nor watched (both would see Dynamo's work, not the model's). ``workload``
    is one already prepared (the rounding yardstick's)."""
    keep = case.kept_by(fix)
    if workload is None:
        workload = prepared_workload(case, ctx, keep)
    compiled = compiled_fix(case, fix, compile_mode)
    watch = PythonWatch(ctx.device.type)
    # the tracer needs the watch's autocast state; the no-autocast check needs its finding
    watched = compiled is None and (trace or ctx.precision.uses_autocast)
    tracer = None
    if trace and compiled is None:
        names = Names.of_workload(workload.model, workload.inputs, keep)
        tracer = DtypeTracer(ctx.dtype, names, watch, root=workload.model)
    output, error = None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with (
                watch_python(watch) if watched else nullcontext(),
                tracing(tracer) if tracer is not None else nullcontext(),
            ):
                output = call_fix(case, fix, workload, ctx, compiled)
        except Exception as raised:  # every failure of the code under test is a result
            error = raised
    trail = tracer.trail(error) if tracer is not None else None
    drift = tracer.drift(output_leaves_or_none(output)) if tracer is not None else Drift()
    if trail is not None and drift.island is not None:
        trail = replace(trail, island=drift.island)
    drifted, island_note = (
        (None, None) if error else drift_flag(drift, output, ctx.precision, trail)
    )
    found = (
        no_autocast_flag(watch.seen, ctx.precision) if watched else None,
        not_half_flag(
            workload.model, ctx.precision, keep, tracer.names.unused if tracer else no_tensor
        ),
        drifted,
        undone_upcast_flag(tracer.undone_upcast() if tracer is not None else None),
    )
    return FixRun(
        output, error, tuple(f for f in found if f), trail, warning_texts(caught), island_note
    )


def no_tensor(tensor: torch.Tensor) -> bool:
    """Without a tracer nothing is known unused."""
    return False


#: At most this many distinct warnings are kept per cell, each cut to its first line.
MAX_WARNINGS = 5


def warning_texts(caught: list[warnings.WarningMessage]) -> tuple[str, ...]:
    """The distinct warnings a fix raised, ``Category: first line``, in order."""
    texts = (
        f"{w.category.__name__}: {str(w.message).strip().splitlines()[0][:300]}"
        for w in caught
        if str(w.message).strip()
    )
    return tuple(dict.fromkeys(texts))[:MAX_WARNINGS]


class ReferenceFailed(CaseCodeFailed):
    """The case's reference fix failed in float64: no cell of the case can be judged."""


def float64_leaves(output: Any) -> Leaves:
    return {
        name: t.detach().to(device="cpu", dtype=torch.float64)
        for name, t in output_leaves(output).items()
    }


#: A case at one workload size, with the backend its reference runs on: what a reference
#: and its yardsticks belong to.
Workpiece = tuple[str, str, str]

#: What is computed once per process and shared by every cell of a case at one size: the
#: float64 reference by (case, size, backend), the trusted fix's low-precision error by
#: (piece, device, dtype), and the rounding yardstick by (piece, dtype, parts kept). A
#: worker fills them from a forked process (``remember_shared``), so a reference fix that
#: crashes or changes torch's global settings cannot reach the worker.
_REFERENCES: dict[Workpiece, Leaves] = {}
_BASELINES: dict[tuple[str, str, str, str, str], Baseline] = {}
_ROUNDINGS: dict[tuple[str, str, str, str, tuple[str, ...]], Baseline] = {}


def workpiece(cell: Cell) -> Workpiece:
    """The reference a cell is judged against: its case's at its size, on the case's
    reference backend, or on the cell's own where the case builds a different model per
    backend (a model of yours whose factory reads ``ctx.backend``)."""
    case = registry.get(cell.case)
    backend = cell.backend if case.reference_per_backend else reference_backend(case)
    return cell.case, cell.size, backend


def reference_leaves(piece: Workpiece) -> Leaves:
    """The case's reference fix in float64 on the CPU, as named float64 leaves."""
    if piece not in _REFERENCES:
        _REFERENCES[piece] = compute_reference(piece)
    return _REFERENCES[piece]


def compute_reference(piece: Workpiece) -> Leaves:
    case_name, size, backend = piece
    case = registry.get(case_name)
    ctx = context_for(case, plain_cell(case, "float64", size, backend=backend))
    try:
        run = run_fix_checked(case, case.reference_fix, ctx, trace=False)
    except WorkloadFailed as failure:
        raise ReferenceFailed(failure.error) from failure
    if run.error is not None:
        raise ReferenceFailed(run.error)
    return float64_leaves(run.output)


@dataclass(frozen=True)
class Baseline:
    """A yardstick's error per leaf, or why it could not be computed."""

    rel_errs: dict[str, float]
    error: str | None = None


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
    case_name, size, backend = piece
    case = registry.get(case_name)
    ctx = context_for(case, plain_cell(case, dtype, size, device, backend))
    try:
        run = run_fix_checked(case, case.reference_fix, ctx, trace=False)
    except WorkloadFailed as failure:
        run = FixRun(error=failure.error)
    return errors_against_reference(run, piece)


def errors_against_reference(run: FixRun, piece: Workpiece) -> Baseline:
    """A yardstick run's error per leaf against the reference, or why there is none."""
    if run.error is not None:
        return Baseline({}, f"{type(run.error).__name__}: {error_text(run.error)}"[:MAX_MESSAGE])
    reference = reference_leaves(piece)
    leaves = output_leaves(run.output)
    problem = structure_problem(leaves, reference)
    if problem:
        return Baseline({}, problem)
    return Baseline({leaf: relative_error(t, reference[leaf])[1] for leaf, t in leaves.items()})


def rounding(piece: Workpiece, dtype: str, keep: tuple[str, ...]) -> Baseline:
    """The rounding yardstick: the reference computation on the weights and inputs rounded
    to ``dtype`` (what ``keep`` names left float32), in float64 on the CPU (see
    :mod:`harness.measure.rounding`)."""
    key = (*piece, dtype, keep)
    if key not in _ROUNDINGS:
        _ROUNDINGS[key] = compute_rounding(piece, dtype, keep)
    return _ROUNDINGS[key]


def compute_rounding(piece: Workpiece, dtype: str, keep: tuple[str, ...]) -> Baseline:
    case_name, size, backend = piece
    case = registry.get(case_name)
    ctx = context_for(case, plain_cell(case, "float64", size, backend=backend))
    try:
        run = run_fix_checked(
            case,
            case.reference_fix,
            ctx,
            trace=False,
            workload=rounded_workload(case, ctx, dtype, keep),
        )
    except WorkloadFailed as failure:
        run = FixRun(error=failure.error)
    return errors_against_reference(run, piece)


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


def rounding_dtypes(case: Case, device: str) -> tuple[str, ...]:
    """The dtypes a case's rounding yardsticks are computed for on ``device``: its own, the
    float32 control's, and TF32 on a GPU (which may compute float32 matmuls in it)."""
    extra = ("tf32",) if torch.device(device).type == "cuda" else ()
    return tuple(dict.fromkeys((*case.dtypes, CONTROL_DTYPE, *extra)))


def kept_sets(case: Case) -> tuple[tuple[str, ...], ...]:
    """Every distinct set of parts a fix of the case keeps in float32."""
    return tuple(dict.fromkeys(case.kept_by(fix) for fix in case.fixes))


def shared_figures(piece: Workpiece, device: str) -> bytes | None:
    """The case's reference at one size, the trusted fix's error on ``device`` in each of its
    dtypes and the rounding yardsticks, serialised for the process that forked this one;
    None when the reference fix raised (each cell then records why)."""
    case = registry.get(piece[0])
    try:
        reference = reference_leaves(piece)
        dtypes = dict.fromkeys((*case.dtypes, CONTROL_DTYPE))  # the fp32 control's too
        baselines = {dtype: baseline(piece, device, dtype) for dtype in dtypes}
        roundings = [
            (dtype, keep, rounding(piece, dtype, keep))
            for dtype in rounding_dtypes(case, device)
            for keep in kept_sets(case)
        ]
    except Exception:
        return None
    buffer = io.BytesIO()
    torch.save(
        {
            "reference": reference,
            "baselines": {d: dataclasses.asdict(b) for d, b in baselines.items()},
            "roundings": [(d, list(k), dataclasses.asdict(b)) for d, k, b in roundings],
        },
        buffer,
    )
    return buffer.getvalue()


def remember_shared(piece: Workpiece, device: str, data: bytes) -> None:
    """Keep what ``shared_figures`` computed in another process."""
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    _REFERENCES[piece] = loaded["reference"]
    for dtype, figures in loaded["baselines"].items():
        _BASELINES[(*piece, device, dtype)] = Baseline(**figures)
    for dtype, keep, figures in loaded["roundings"]:
        _ROUNDINGS[(*piece, dtype, tuple(keep))] = Baseline(**figures)


def forget_shared() -> None:
    _REFERENCES.clear()
    _BASELINES.clear()
    _ROUNDINGS.clear()


def classify(case: Case, cell: Cell, run: FixRun, record: CellRecord) -> CellRecord:
    """Fill in the outcome and its evidence: the error, or the figures against the reference."""
    record = replace(
        record,
        flags=run.flags,
        trail=run.trail,
        warnings=run.warnings,
        note=join_notes(record.note, run.note),
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


@dataclass(frozen=True)
class CellYardsticks:
    """What a cell is judged against: the trusted fix's errors (empty for a cell of that
    fix), the rounding's, their names, and a note where the choice needs saying."""

    fix: Baseline
    rounding: Baseline
    names: Yardsticks
    note: str | None = None

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
    note = (
        f"float32 matmuls computed in TF32 ({tf32}): judged against TF32 rounding"
        if tf32
        else None
    )
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


def judged(case: Case, cell: Cell, leaves: Leaves, record: CellRecord) -> CellRecord:
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
        note=join_notes(record.note, sticks.note),
    )


def worst_leaf(per_leaf: dict[str, Numerics]) -> Numerics:
    """The leaf furthest from passing: non-finite first, then by error over tolerance."""
    return max(per_leaf.values(), key=lambda n: (not n.finite, n.rel_err / n.tolerance))


def structure_problem(leaves: Leaves, reference: Leaves) -> str | None:
    """Why an output cannot be compared with the reference leaf by leaf, or None."""
    if leaves.keys() != reference.keys():
        return f"output leaves {sorted(leaves)} != reference leaves {sorted(reference)}"
    for name, t in leaves.items():
        if t.shape != reference[name].shape:
            return (
                f"output {name} has shape {tuple(t.shape)}, the reference "
                f"{tuple(reference[name].shape)}"
            )
    return None


def own_frames(error: BaseException, root: Path) -> tuple[str, ...]:
    """The innermost frames of the traceback in files under ``root``, as ``file:line in f``."""
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if Path(frame.filename).resolve().is_relative_to(root)
    ]
    return tuple(
        f"{shown_path(frame.filename)}:{frame.lineno} in {frame.name}"
        for frame in frames[-MAX_FRAMES:]
    )


def case_root(case: Case) -> Path:
    return Path(case.source_file).resolve().parent


def error_fields(error: BaseException, root: Path) -> dict[str, Any]:
    return {
        "error_type": type(error).__name__,
        "error_message": error_text(error)[:MAX_MESSAGE],
        "error_frames": own_frames(error, root),
    }


def error_text(error: BaseException) -> str:
    """``str(error)``, or what stopped it when an exception's ``__str__`` itself fails."""
    try:
        return str(error)
    except Exception as broken:
        return f"<str() of the exception failed: {type(broken).__name__}>"


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


def crashed(record: CellRecord, kind: CrashKind, error: BaseException, case: Case) -> CellRecord:
    """A cell with no outcome of its own; the frames shown are the case's, or the harness's
    where the error never passed through the case's code."""
    fields = error_fields(error, case_root(case))
    if not fields["error_frames"]:
        fields["error_frames"] = own_frames(error, HARNESS_DIR)
    return replace(record, outcome=Outcome.CRASHED, crash_kind=kind, **fields)


def run_cell(cell: Cell, worker: str | None = None, trace: bool = True) -> CellRecord:
    """Run one cell and return its record. Exceptions of the code under test are outcomes;
    a failing reference or harness makes the cell ``crashed`` with the real error."""
    case = registry.get(cell.case)
    started = time.perf_counter()
    record = CellRecord(
        cell=cell,
        torch_version=torch.__version__,
        outcome=Outcome.CRASHED,  # replaced by classify()
        note=backend_note(cell),
        worker=worker,
    )
    ctx = context_for(case, cell)
    changed: list[str] = []
    try:
        with torch_state.kept(changed):
            run = run_fix_checked(case, cell.fix, ctx, trace, cell.compile)
        record = replace(record, attn_dtype=ctx.observation.summary())
        record = classify(case, cell, run, record)
    except ReferenceFailed as failure:
        record = crashed(record, CrashKind.REFERENCE_FAILED, failure.error, case)
    except WorkloadFailed as failure:
        record = crashed(record, CrashKind.WORKLOAD_FAILED, failure.error, case)
    except Exception as error:  # the harness itself failed on this cell
        record = crashed(record, CrashKind.HARNESS, error, case)
    return replace(
        record,
        duration_s=round(time.perf_counter() - started, 6),
        note=join_notes(record.note, changed_note(changed)),
    )


def backend_note(cell: Cell) -> str | None:
    """What stood in for, or really ran as, flash-attn in a cell of a flash-attn backend."""
    if cell.backend == "flash-attn-contract":
        return CONTRACT_NOTE
    if cell.backend == "flash-attn":
        return flash_kernels.backend_note(cell.device)
    return None


def changed_note(changed: list[str]) -> str | None:
    """A cell whose code changed torch's global settings says so: elsewhere than in its own
    process, that change would reach every cell after it."""
    return f"the cell's code {torch_state.describe(changed)}" if changed else None


def skipped_record(cell: Cell, reason: str) -> CellRecord:
    return CellRecord(
        cell=cell, torch_version=torch.__version__, outcome=Outcome.SKIPPED, skip_reason=reason
    )


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


TIMED_OUTCOMES = (Outcome.PASSES, Outcome.INACCURATE)


def prepare_call(cell: Cell) -> tuple[Callable[[], Any], torch.device]:
    """The cell's fix as a zero-argument call on a workload prepared once (seeded as always),
    with the same precision, gradient mode and autocast as its correctness run."""
    case = registry.get(cell.case)
    device = torch.device(cell.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = context_for(case, cell, observe=False)
    workload = prepared_workload(case, ctx, case.kept_by(cell.fix))
    compiled = compiled_fix(case, cell.fix, cell.compile)
    return (lambda: call_fix(case, cell.fix, workload, ctx, compiled)), device


def same_output(first: Any, second: Any) -> bool:
    a, b = output_leaves(first), output_leaves(second)
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) or torch.allclose(a[k], b[k], rtol=0, atol=0, equal_nan=True)
        for k in a
    )


NOT_RERUNNABLE = "output changed between repeated calls: the timed work is not the checked work"


class KeepingLast:
    """The call, keeping its latest output: the timed calls' last output is compared with
    the first call's, so no further call is spent on the check."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call = call
        self.last: Any = None

    def __call__(self) -> None:
        self.last = self.call()


@dataclass(frozen=True)
class TimedCall:
    record: CellRecord
    call: KeepingLast
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
    changed: list[str] = []
    try:
        with torch_state.kept(changed):
            call, device = prepare_call(record.cell)
            keeping = KeepingLast(call)
            estimate = stopwatch.time_block(keeping, 1)
            first = keeping.last
            if estimate < min_block_s:
                estimate = stopwatch.time_block(keeping, 1)
    except Exception as error:
        failure = f"{type(error).__name__}: {error_text(error)}"
        return replace(record, timing_error=failure[:MAX_MESSAGE])
    if changed:
        keeping = KeepingLast(restoring(call))
    note = join_notes(record.note, restored_note(changed, record.note))
    return TimedCall(replace(record, note=note), keeping, device, first, estimate)


def rerun_note(timed: TimedCall) -> str | None:
    """After the timed calls: whether they computed what the first call did."""
    return None if same_output(timed.first, timed.call.last) else NOT_RERUNNABLE


def restored_note(changed: list[str], note: str | None) -> str | None:
    if not changed:
        return None
    changes = torch_state.describe(changed)
    known = changes in (note or "")  # the correctness run's note already names them
    return RESTORED_NOTE + ("" if known else f": the fix {changes}")


RESTORED_NOTE = "timed with torch's settings put back after each call"


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
            c.record,
            note=join_notes(c.record.note, rerun_note(c)),
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


def join_notes(*notes: str | None) -> str | None:
    kept = [n for n in notes if n]
    return "; ".join(kept) if kept else None
