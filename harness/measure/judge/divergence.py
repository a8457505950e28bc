"""Where a failing cell left float64: the divergence profile, module by module.

A cell that ran and was judged ``inaccurate`` (beyond its tolerance, or non-finite) is
profiled by one more run, taken only then (never in a cell that passes, never in a timed
run): the cell's own fix run in float64 on the CPU, with a hook on every module of its
model. Where a module returns, the same module of two twins of the model is called on
that module's float64 inputs, rounded to the cell's dtype: the cell's twin (its dtype,
mode and device, under its autocast) and the rounding yardstick's twin (the float64
model with its weights rounded, and, where the cell's weights are in the dtype, what each
module returns rounded: :mod:`harness.measure.judge.rounding`). For each module, in the
order the modules return, what is kept is figures, never tensors (memory stays what the
module in hand and the inputs of the modules around it take):

* ``error``: ``max|cell - float64| / max|float64|`` of the floating tensors it returns;
* ``rounding``: the same for the yardstick's twin;
* ``ratio``: ``error / max(rounding, eps(dtype) / factor)``: beyond the cell's factor
  exactly where ``error > max(factor * rounding, eps(dtype))``, the rule a cell's own
  output is judged by (:func:`harness.measure.judge.numerics.deciding`).

The first module whose ratio crosses the factor, or whose output is non-finite where
float64's is finite, is the cell's :class:`~harness.schema.divergence.Divergence`. The
factor is the one the cell's verdict used where the rounding decided it (10); a cell
judged against a trusted fix's error (factor 3) is profiled against the rounding with the
rounding's factor, since the profile's yardstick is the rounding. With ``--profile``
(``run_cell(profile=True)``) a passing cell is profiled too: its series kept, its
divergence None. Where the first module crosses, the op inside it that did is named
(:mod:`harness.measure.judge.divergence_ops`); where none does, the fix's own code is
searched for one.

**Backward.** In a training cell the float64 step's backward is profiled too. Each
module's inputs are kept as it is entered, and a hook on each floating tensor it returns
waits for float64's gradient there; once every one has it, the module's twins are called
on float64's forward inputs rounded and their backward fed that gradient rounded to the
cell's dtype at the scale the cell's recipe holds it (none, static, or the largest power
of two a dynamic scaler reaches: :class:`Scaling`), the yardstick's as a scaled step in the
dtype holds it (:func:`~harness.measure.judge.rounding.round_gradient`). Compared with
float64's own module fed the same gradient: the gradient of each input and each parameter
the module trains, each over its own scale, the worst ratio the module's. The backward
series is in the order backward finishes the modules (a module after those inside it);
the record's divergence is the forward one where forward crossed, else the backward one.

**Attribution: each module on float64's inputs, not the ratio's growth along the run.**
The issue named two ways to charge an error to the module that made it and not to
everything downstream: (a) feed each module float64's inputs rounded to the cell's dtype
(what this module does), or (b) run the cell, float64 and the yardstick each end to end,
compare each module's output along the way, and report the growth of the ratio across
the module. Measured by ``python benchmarks/bench_divergence.py`` (CPU, torch 2.13.0), on
the 12-layer toy of ``tests/test_divergence.py`` with a variance computed as
``E[x^2] - E[x]^2`` in block 2's first norm, and on ``t5-wo-keep-fp32`` (fix ``none``),
both float16 ``half``; the ratio of each module, in the order they return:

  ===================  ==========================  =========================  ===========
  toy, module          (a) on float64's inputs     (b) along the run          (b) growth
  ===================  ==========================  =========================  ===========
  blocks.1 (before)    1.31                        1.88                       1.14
  blocks.2.norm1 (bug) 4.11e4                      1.5e4                      7.95e3
  blocks.2.attn.q/k/v  1, 1, 1                     2.02e4, 1.32e4, 1.67e4     1.35, 0.66
  blocks.2.attn.out    1                           non-finite                 undefined
  the 96 modules after 1 to 1.93 (blocks.2 and    non-finite, every one      undefined
                       the model, on their own
                       code, 1.26 and 1)
  ===================  ==========================  =========================  ===========

  t5-wo-keep-fp32: ff.layer_norm, wi, act: (a) 1, 1, 1; (b) 1.3, 1.74, 1; both then name
  ``ff.DenseReluDense.wo`` (non-finite: 73000 is beyond float16), the module whose
  ``_keep_in_fp32_modules`` entry is upstream's fix.

Both name the injected module first. (a) names nothing else: the modules after it meet
float64's own inputs, so the error the norm made is not theirs, and the largest ratio of a
healthy module is 1.93 (a norm; linears read 1.0), 5.2 times under the factor. (b) reads
every module after the bug as beyond its rounding (the error carried along, here non-finite
from the attention's output on), so it says nothing past the first crossing (a fix that
moves a second bug is hidden behind the first), and its growth across a module is a
ratio of two large or infinite numbers (0.66 to 1.35 on the projections that follow,
undefined after), which a norm shrinks and a residual sum grows with no bug of their own.
(a) also keeps memory bounded without running three processes
in lockstep: (b) must hold float64's output of every module until the cell's run reaches
it. What (a) cannot see: an error made between modules, in the fix's own code (a mask
summed outside any module: no module is charged, and the record says so in a note), and
one that builds up over many modules each within its rounding (the same).

**A module on its own code.** A module that calls others is measured on its own code:
inside its twins, the modules it calls replay float64's outputs
(:mod:`harness.measure.judge.divergence_replay`), and it is judged where its own code
leaves float64 the most, at what it returns or at what it passes a module it calls. So the
cancelling norm of the toy reads 4.4e4 and its block and the model about 1 (measured
whole, they read non-finite after it), and an attention whose logits overflow in its own
``forward`` is named while its output projection, fed float64's input, reads 1. Backward
measures a module with everything inside it.

**Cost.** With the modules inside replayed, each twin computes every op once, so the
profile costs the forward three more times (float64 with its hooks, the cell's twin, the
yardstick's) plus its bookkeeping per module; a training cell's, its backward too. What
is not the measurement is kept out of it: a ``forward``'s source line is read once per
function; the yardstick's twin runs under a ``StaysFloat64`` of its own only inside the
modules whose own code cast narrower in float64's run (a Python dispatch mode costs each
op); the modules a cell calls are found by running its fix only up to its first call of
the prepared model itself (where that is what it calls); the run's dispatch modes are
stood aside without torch's ``_disable_current_modes``; the yardstick rounds a value with
one pass over it where all is finite; and the garbage collector leaves the objects made
before the profile alone while it runs. ``python benchmarks/bench_divergence.py --cost``
prints what a failing cell costs with its profile against without (``nox -s bench``).
"""

from __future__ import annotations

import functools
import gc
import inspect
import math
import time
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.hooks import RemovableHandle

from harness.measure.authoring.case import Case, RunContext, Workload
from harness.measure.host import torch_state
from harness.measure.judge.divergence_ops import in_the_fix, module_first_op
from harness.measure.judge.divergence_replay import (
    Calls,
    ChildCall,
    NotReplayed,
    Replay,
    as_held,
    as_is,
    floating_dtypes,
    forwards_replaced,
    replaying,
)
from harness.measure.judge.numerics import DTYPE_FLOOR, ROUNDING_FACTOR, as_float64_cpu
from harness.measure.judge.references import (
    float64_run,
    float64_workload,
    plain_cell,
    rounded_workload,
    workpiece,
)
from harness.measure.judge.rounding import (
    held_scale,
    noise_source,
    round_gradient,
    round_stored,
    rounds_activations,
    stored_rounding,
)
from harness.measure.precision.casting import is_kept, map_tensors, split_kept
from harness.measure.precision.dtypes import TORCH_DTYPES
from harness.measure.precision.modes import Precision, autocast_region
from harness.measure.running.errors import MAX_MESSAGE, error_text
from harness.measure.running.fix_run import (
    FixCall,
    context_for,
    prepared_workload,
    run_fix_checked,
)
from harness.measure.running.recipe_steps import scaler_policy
from harness.measure.running.stays_float64 import StaysFloat64
from harness.measure.tracing.dispatch_mode import out_of_modes
from harness.schema.axes import (
    DYNAMIC_SCALER,
    EAGER,
    FORWARD_STAGE,
    STATIC_SCALER,
    TRAIN_STAGE,
    Cell,
)
from harness.schema.divergence import Divergence, ModuleRatio, Profile
from harness.schema.records import CellRecord, Note, NoteKind, Numerics, Outcome

Tensors = list[torch.Tensor]


@dataclass(frozen=True)
class ModuleFigures:
    """One module's return, measured on float64's inputs: its path, class and ``forward``'s
    site, the cell's error, the yardstick's, their ratio (infinite where the cell's output
    went non-finite and float64's did not)."""

    path: str
    kind: str
    location: str | None
    error: float
    rounding: float
    ratio: float
    #: The op inside it that crossed, and its call's line (only of the first to cross).
    op: str | None = None

    @property
    def finite(self) -> bool:
        """False where the cell's output went non-finite (a ratio of NaN is a module not
        measurable: its inputs or its yardstick beyond the dtype's range)."""
        return not math.isinf(self.ratio)


@dataclass(frozen=True)
class ProfileFigures:
    """Every module's figures in the order they returned, the factor they are held to,
    and the modules that could not be measured (``path: why``)."""

    modules: tuple[ModuleFigures, ...]
    factor: float
    unmeasured: tuple[str, ...] = ()
    #: In a training step, each module's input gradient, in backward order.
    backward: tuple[ModuleFigures, ...] = ()

    def series(self) -> tuple[ModuleRatio, ...]:
        """Each module's ratio, in order: what the record keeps of the profile."""
        return ratios(self.modules)

    def recorded(self) -> Profile:
        """The record's profile: each module's ratio, forward and backward."""
        return Profile(self.factor, forward=self.series(), backward=ratios(self.backward))

    def first_beyond(self) -> Divergence | None:
        """The first module beyond its rounding by more than the factor, or non-finite:
        in forward, else (a training step) in backward."""
        return first_beyond(self.modules, self.factor, "forward") or first_beyond(
            self.backward, self.factor, "backward"
        )


def ratios(modules: tuple[ModuleFigures, ...]) -> tuple[ModuleRatio, ...]:
    return tuple(ModuleRatio(m.path, m.ratio) for m in modules)


def first_beyond(
    modules: tuple[ModuleFigures, ...], factor: float, direction: str
) -> Divergence | None:
    """The first of ``modules`` beyond the factor, or non-finite, as a divergence."""
    for index, figures in enumerate(modules):
        if not beyond(figures, factor):
            continue
        before = modules[index - 1].ratio if index else None
        return Divergence(
            module=figures.path,
            kind=figures.kind,
            location=figures.location,
            op=figures.op,
            ratio=figures.ratio,
            ratio_before=before,
            factor=factor,
            direction=direction,
        )
    return None


def beyond(figures: ModuleFigures, factor: float) -> bool:
    """Non-finite, or beyond the factor (a module not measurable is neither)."""
    return not figures.finite or figures.ratio > factor


def profiled(
    case: Case,
    cell: Cell,
    record: CellRecord,
    every: bool = False,
    within_s: float | None = None,
    model_elements: int = 0,
) -> CellRecord:
    """``record`` with its profile (every module's ratio) and its divergence where it is a
    cell the profile is for (:func:`wants_profile`; with ``every``, a passing cell's
    profile too, ``--profile``: its series kept, its divergence None); a profile that
    fails, runs past ``within_s`` seconds, or finds no module, leaves the verdict as it is
    and says why in one note, as does a model too large to profile (``model_elements``:
    the floating elements of the cell's model as it ran)."""
    if not wants_profile(cell, record, every) or record.numerics is None:
        return record
    too_large = too_large_note(8 * model_elements)
    if too_large is not None:
        return record.noted(too_large)
    try:
        with torch_state.restored([]), old_objects_frozen():
            taken = profile(case, cell, profile_factor(record.numerics), within_s=within_s)
        found = taken.first_beyond()
    except Exception as error:  # the verdict stands whatever the profile does
        text = f"{type(error).__name__}: {error_text(error)}".splitlines()[0]
        return record.noted(
            Note(NoteKind.DIVERGENCE, f"no divergence profile: {text}"[:MAX_MESSAGE])
        )
    record = replace(record, profile=taken.recorded())
    if record.outcome is Outcome.PASSES:
        return record
    if found is None:  # between modules: the op in the fix's own code, if one did
        non_finite = record.numerics is not None and not record.numerics.finite
        found = in_the_fix(case, cell, taken.factor, non_finite)
    if found is None:
        return record.noted(Note(NoteKind.DIVERGENCE, NO_MODULE))
    return replace(record, divergence=found)


@contextmanager
def old_objects_frozen() -> Iterator[None]:
    """While it lasts, the objects made before it are left out of the cyclic garbage
    collector's passes (``gc.freeze``): the profile makes many small objects, and each
    full pass would otherwise walk every module and tensor of torch and the model (a
    tenth of a 48-layer profile's time on the CPU). What it makes is collected as ever;
    where something else froze the heap already, it is left as it is."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


#: The share of the memory available that the profile's float64 copy of a model may take
#: (it holds three models beside it: the cell's twin, the yardstick's, and the run's own).
MEMORY_SHARE = 0.25


def too_large_note(needed: int) -> Note | None:
    """``too large to profile: N GiB in float64`` where a model whose float64 copy takes
    ``needed`` bytes would take more than ``MEMORY_SHARE`` of the memory available; None
    where it fits or where the memory available is not known. (The size comes from the
    cell's own run: a second build of the model, even on the meta device, costs more than
    a small cell, as the meta device's first factory call imports sympy.)"""
    free = available_bytes()
    if free is None or needed <= MEMORY_SHARE * free:
        return None
    return Note(NoteKind.DIVERGENCE, f"too large to profile: {needed / 2**30:.1f} GiB in float64")


def available_bytes() -> int | None:
    """The memory the system has available (``MemAvailable`` of ``/proc/meminfo``), None
    where it does not say."""
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


NO_MODULE = (
    "no module went beyond its rounding on float64's inputs: the error is made between "
    "modules (in the fix's own code), or builds up over many"
)


#: The stages a profile is taken of: a forward pass, and a training step (its backward too).
PROFILED_STAGES = (FORWARD_STAGE, TRAIN_STAGE)


def wants_profile(cell: Cell, record: CellRecord, every: bool = False) -> bool:
    """A forward or training cell, eager, that ran and was judged inaccurate on its
    output's values (a misshapen output has none to compare module by module); with
    ``every``, one that passed too."""
    judged = (Outcome.INACCURATE, Outcome.PASSES) if every else (Outcome.INACCURATE,)
    return (
        cell.stage in PROFILED_STAGES
        and cell.compile == EAGER
        and record.outcome in judged
        and record.numerics is not None
        and record.error_type is None
    )


def profile_factor(numerics: Numerics) -> float:
    """The factor the cell's verdict held it to, where the rounding decided it; else the
    rounding's own factor (the profile's yardstick is always the rounding)."""
    by_rounding = (numerics.decided_by or "").startswith("rounding")
    return numerics.factor if by_rounding and numerics.factor else ROUNDING_FACTOR


def profile(
    case: Case, cell: Cell, factor: float, whole: bool = True, within_s: float | None = None
) -> ProfileFigures:
    """Each module of the cell's fix, in float64 on the CPU, against its cell's and its
    yardstick's twin on the same inputs (see the module docstring); without ``whole``,
    those up to the first beyond the factor (the rest of the run measures nothing).
    ``ProfileTimeout`` once ``within_s`` seconds have passed (checked as each module is
    entered)."""
    deadline = None if within_s is None else time.monotonic() + within_s
    keep = case.kept_by(cell.fix)
    ctx = context_for(case, cell, observe=False)
    piece = workpiece(cell)._replace(fix=cell.fix)
    reference = float64_workload(piece)
    if not isinstance(reference.model, nn.Module):
        raise TypeError("the workload's model is not an nn.Module: it has no modules to profile")
    float64_ctx = context_for(
        case, plain_cell(case, "float64", cell.size, backend=piece.backend, stage=cell.stage)
    )
    stick = rounded_workload(case, float64_ctx, cell.dtype, keep)
    model_keep = split_kept(keep, reference.inputs)[0]
    twins = Twins(
        cell=modules_called(case, cell.fix, ctx, prepared_workload(case, ctx, keep)),
        stick=stick.model,
        precision=ctx.precision,
        dtype=cell.dtype,
        keep=model_keep,
        activations=rounds_activations(cell.mode),
        stage=cell.stage,
        scaling=cell_scaling(case, cell, ctx),
    )
    measuring = Measuring(twins, factor, whole)
    backward = BackwardMeasuring(twins, factor) if cell.stage == TRAIN_STAGE else None
    with hooked(reference.model, *both(measuring, backward, deadline)):
        run = float64_run(piece, reference, record=False)
    if run.error is not None:
        raise run.error
    unmeasured = measuring.unmeasured + (backward.unmeasured if backward else [])
    return ProfileFigures(
        tuple(measuring.figures),
        factor,
        tuple(unmeasured),
        backward=backward.in_backward_order() if backward else (),
    )


class ProfileTimeout(TimeoutError):
    """The profile ran past the time it was given (the cell's limit is the whole cell's)."""


def both(
    forward: Measuring, backward: BackwardMeasuring | None, deadline: float | None = None
) -> tuple[Entered, Returned]:
    """The hooks of the float64 run: the forward's, and the backward's where it is a
    training step; none while the backward's measuring calls a module of the run again.
    A module entered past ``deadline`` (``time.monotonic``) stops the run."""

    def entered(path: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        if deadline is not None and time.monotonic() > deadline:
            raise ProfileTimeout("the profile ran past its share of the cell's time limit")
        if backward is None:
            forward.entered(path, module, args, kwargs)
        elif not backward.busy:
            forward.entered(path, module, args, kwargs)
            backward.entered(path, module, args, kwargs)

    def returned(path: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        if backward is None:
            forward.returned(path, module, args, kwargs, output)
        elif not backward.busy:
            forward.returned(path, module, args, kwargs, output)
            backward.returned(path, module, args, kwargs, output)

    return entered, returned


@dataclass(frozen=True)
class Scaling:
    """The loss scale a cell's gradients are held at: none (``1``), a fixed one
    (``static``), or the one a dynamic scaler settles on (``dynamic``: for each gradient,
    :func:`~harness.measure.judge.rounding.held_scale`, the largest power of two up to
    the GradScaler's initial scale at which it does not overflow; a step's own scale,
    the smallest over all its gradients, is at most that)."""

    policy: str = "none"
    static: float = 1.0

    def scale_for(self, grad: torch.Tensor, dtype: str) -> float:
        if self.policy == DYNAMIC_SCALER:
            return held_scale(grad, dtype)
        return self.static if self.policy == STATIC_SCALER else 1.0


def cell_scaling(case: Case, cell: Cell, ctx: RunContext) -> Scaling:
    """The loss scaling the cell's recipe runs (:func:`scaler_policy`; the scale a
    harness holds for float16 half weights is a dynamic one), none in a forward."""
    if cell.stage != TRAIN_STAGE:
        return Scaling()
    policy = scaler_policy(ctx.precision, ctx.scaler)
    return Scaling(policy, case.recipe_of(cell.fix).static_scale)


def modules_called(
    case: Case, fix: str, ctx: RunContext, workload: Workload
) -> dict[str, nn.Module]:
    """The modules the cell's own run calls, by path: a fix may call a copy of its model
    (``Workload.fresh_model``) and change it (T5's ``wo`` cast to half in a copy), so its
    twin is the module the cell ran, which a run of the cell finds (its hooks go with a
    deep copy); a module it did not call is the prepared model's. The run stops as the
    first module is entered where that is the prepared model itself (the fix calls the
    model it was given: its modules are the prepared model's, and the rest of a forward in
    the cell's dtype would only cost time). In a training step, its forward alone
    (:func:`forward_once`)."""
    assert isinstance(workload.model, nn.Module)
    called = dict(workload.model.named_modules())
    first = True

    def entered(path: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        nonlocal first
        if first and not path and module is workload.model:
            raise ModelItself
        first = False
        called[path] = module

    try:
        with hooked(workload.model, entered, None):
            if ctx.stage == TRAIN_STAGE:
                forward_once(case, fix, ctx, workload)
            else:
                run_fix_checked(case, fix, ctx, trace=False, workload=workload, record=False)
    except ModelItself:
        pass
    return called


class ModelItself(BaseException):
    """The fix's first module call is of the prepared model itself: stop its run there (a
    ``BaseException``, which a fix's ``except Exception`` around a fallback lets by)."""


def forward_once(case: Case, fix: str, ctx: RunContext, workload: Workload) -> None:
    """The fix called once as a training step calls it (the cell's context, under its
    autocast), no gradient kept: the modules a step calls are those its forward calls,
    and the step's backward, and the rerun that locates a non-finite gradient in anomaly
    mode, would only cost time here. What it raises or warns is the cell's, already
    recorded."""
    call = FixCall(case, fix, workload, ctx, case.fixes[fix].func)
    with warnings.catch_warnings(), torch.no_grad(), autocast_region(ctx.precision):
        warnings.simplefilter("ignore")
        try:
            call.call()
        except Exception:  # the modules it entered before are found all the same
            return


Entered = Callable[[str, nn.Module, Any, Any], None]
Returned = Callable[[str, nn.Module, Any, Any, Any], None]


@contextmanager
def hooked(model: nn.Module, entered: Entered, returned: Returned | None) -> Iterator[None]:
    """While it lasts, ``entered`` (and ``returned``) called with each module's path as a
    module of ``model`` is entered (and returns); a scripted module takes no hooks. The
    hooks are closures, which a deep copy of the model shares (``copy.deepcopy`` keeps a
    function as it is): a copy the fix makes calls them with the same paths. Those of a
    copy stay on it (a copy made in the run is dropped with it)."""
    handles: list[RemovableHandle] = []
    try:
        for path, module in model.named_modules():
            if isinstance(module, torch.jit.ScriptModule):
                continue
            handles.append(
                module.register_forward_pre_hook(on_entry(path, entered), with_kwargs=True)
            )
            if returned is not None:
                handles.append(
                    module.register_forward_hook(on_return(path, returned), with_kwargs=True)
                )
        yield
    finally:
        for handle in handles:
            handle.remove()


def on_entry(path: str, entered: Entered) -> Callable[[nn.Module, Any, Any], None]:
    def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        entered(path, module, args, kwargs)

    return hook


def on_return(path: str, returned: Returned) -> Callable[[nn.Module, Any, Any, Any], None]:
    def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        returned(path, module, args, kwargs, output)

    return hook


@dataclass
class Twins:
    """The cell's model and the yardstick's, whose modules are called on float64's inputs."""

    cell: dict[str, nn.Module]
    stick: nn.Module
    precision: Precision
    dtype: str
    keep: tuple[str, ...]
    activations: bool
    stage: str
    scaling: Scaling = field(default_factory=Scaling)
    noise: torch.Generator = field(default_factory=noise_source)

    def cell_output(
        self, path: str, args: Any, kwargs: Any, calls: Sequence[ChildCall] = ()
    ) -> tuple[Any, Replay]:
        """The cell's module on the inputs rounded to the cell's dtype, as the cell holds
        them (its compute dtype; float32 inside a part kept in float32), on its device,
        under its autocast, out of the float64 run's dispatch modes, the modules it calls
        replaying ``calls`` (:mod:`.divergence_replay`); and what it passed them."""
        module = self.cell[path]
        held = held_dtype(module, self.precision.compute_dtype)
        dtype, device = TORCH_DTYPES[self.dtype], self.precision.device

        def as_cell(tensor: torch.Tensor) -> torch.Tensor:
            if not tensor.is_floating_point():
                return tensor.to(device)
            return tensor.to(dtype).to(device=device, dtype=held)

        with out_of_modes(), torch.no_grad(), autocast_region(self.precision):
            inputs = map_tensors((args, kwargs), as_cell, same_module)
            replayed = replaying(calls, self.cell.__getitem__, as_held(device), cloned, inputs)
            with replayed as replay:
                output = module(*inputs[0], **inputs[1])
        return output, replay

    def as_cell(self, module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """A float64 tensor as the cell holds it before ``module``: rounded to the cell's
        dtype, in the module's held dtype, on the cell's device, its ``requires_grad``."""
        held = held_dtype(module, self.precision.compute_dtype)
        dtype, device = TORCH_DTYPES[self.dtype], self.precision.device

        def cast(tensor: torch.Tensor) -> torch.Tensor:
            if not tensor.is_floating_point():
                return tensor.to(device)
            cast = tensor.detach().to(dtype).to(device=device, dtype=held)
            return cast.requires_grad_(tensor.requires_grad)

        return cast

    def cell_gradients(
        self, path: str, inputs: Any, params: tuple[str, ...], grads: Grads
    ) -> Tensors:
        """The cell's module on float64's inputs rounded (as :meth:`cell_output`), under
        its autocast, its backward fed float64's gradient at its output rounded to the
        cell's dtype at the scale its recipe holds it: its inputs' and its parameters'
        gradients, unscaled."""
        module = self.cell[path]
        scale = self.scaling.scale_for(largest_of(grads), self.dtype)

        def fed(grad: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
            rounded = (grad * scale).to(TORCH_DTYPES[self.dtype])
            return rounded.to(device=output.device, dtype=output.dtype)

        with out_of_modes():
            mine = pytree.tree_map_only(torch.Tensor, self.as_cell(module), inputs)
            found = gradients_of(module, mine, params, grads, fed, autocast_region(self.precision))
            return [g.double().cpu() / scale for g in found]

    def stick_gradients(
        self, path: str, inputs: Any, params: tuple[str, ...], grads: Grads
    ) -> Tensors:
        """The yardstick's module on float64's inputs rounded, its backward fed float64's
        gradient at its output rounded as a scaled step holds it
        (:func:`~harness.measure.judge.rounding.round_gradient`), under the yardstick's
        rounding: its inputs' and its parameters' gradients."""
        module = self.stick.get_submodule(path)

        def rounded(tensor: torch.Tensor) -> torch.Tensor:
            out = round_stored(tensor.detach(), self.dtype, self.noise)
            return out.requires_grad_(tensor.requires_grad) if out.is_floating_point() else out

        def fed(grad: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
            return round_gradient(grad, self.dtype, self.noise).to(output.dtype)

        with out_of_modes():
            mine = pytree.tree_map_only(torch.Tensor, rounded, inputs)
            return gradients_of(module, mine, params, grads, fed, self.rounding(path, module))

    def stick_output(
        self,
        path: str,
        args: Any,
        kwargs: Any,
        casts: CastsSeen | None = None,
        calls: Sequence[ChildCall] = (),
        keep_at: Collection[int] = (),
    ) -> tuple[Any, Replay]:
        """The yardstick's module on the inputs rounded to the cell's dtype, in float64,
        rounding what it and the modules in it return as the yardstick's run does, under
        the float64 run's modes where float64's own call of it cast narrower
        (:meth:`float64_modes`; ``casts`` None where not known), the modules it calls
        replaying ``calls``; and what it passed those ``keep_at`` names, stored as the
        yardstick stores a value between modules."""

        def rounded(tensor: torch.Tensor) -> torch.Tensor:
            return round_stored(tensor, self.dtype, self.noise)

        def passed(value: Any) -> Any:
            value = cloned(value)
            return map_tensors(value, rounded, same_module) if self.activations else value

        inputs = map_tensors((args, kwargs), rounded, same_module)
        module = self.stick.get_submodule(path)
        replayed = replaying(calls, self.stick.get_submodule, as_is, passed, keep_at=keep_at)
        with self.float64_modes(casts), self.rounding(path, module), replayed as replay:
            output = module(*inputs[0], **inputs[1])
        return output, replay

    def float64_modes(self, casts: CastsSeen | None) -> AbstractContextManager[Any]:
        """What the yardstick's module runs under: the float64 run's dispatch modes, which
        keep its narrowing casts float64 as the yardstick's own run does. Where those are
        ``StaysFloat64`` alone (a plain float64 run), only what it does, and only where
        float64's own call cast narrower: around the whole module where its own code did,
        else around each module inside it whose own code did (the same code on the same
        shapes casts nothing elsewhere, and a dispatch mode in Python costs each op of a
        deep module's twin)."""
        if casts is None:
            return nullcontext()
        stack = ExitStack()
        stack.enter_context(out_of_modes())
        if casts.own:
            stack.enter_context(StaysFloat64())
        else:
            inside = [self.stick.get_submodule(p) for p in casts.inside]
            stack.enter_context(each_under(inside, StaysFloat64))
        return stack

    def rounding(self, path: str, module: nn.Module) -> AbstractContextManager[Any]:
        """The yardstick's rounding of what ``module`` (at ``path``) and those in it
        return: none in a part kept in float32."""
        if is_kept(path, self.keep):
            return nullcontext()
        inside = tuple(
            k[len(path) + 1 :] if path else k
            for k in self.keep
            if not path or k.startswith(path + ".")
        )
        return stored_rounding(module, self.dtype, inside, self.activations, self.stage)


def held_dtype(module: nn.Module, compute: torch.dtype) -> torch.dtype:
    """The dtype a module's inputs are held in: its own floating weights' (a part kept in
    float32, a part a fix cast), else the cell's compute dtype."""
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return compute


def beyond_range(inputs: Any, dtype: str) -> bool:
    """Whether a finite floating input is beyond ``dtype``'s range: the cell cannot hold
    its inputs, and the module is not measurable (the overflow was upstream's)."""
    largest = torch.finfo(TORCH_DTYPES[dtype]).max
    tensors = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    with out_of_modes():
        return any(
            largest_finite(t) > largest for t in tensors if t.is_floating_point() and t.numel()
        )


def same_module(module: nn.Module) -> nn.Module:
    return module


@dataclass
class Entry:
    """A module entered and not yet returned: its inputs (cloned: its forward may change
    them in place), the float64 run's count of narrowing casts then (:func:`casts_so_far`;
    None where not known), the casts made inside the modules it has called since, and
    those calls, which its twins replay."""

    module: nn.Module
    inputs: Any
    casts: int | None
    casts_inside: int = 0
    calls: Calls = field(default_factory=Calls)


@dataclass(frozen=True)
class CastsSeen:
    """Where float64's call of a module cast to a narrower dtype: in its own code, and in
    which modules inside it (their own code)."""

    own: bool
    inside: tuple[str, ...] = ()


@dataclass
class Measuring:
    """The hooks of the float64 run: each module's inputs kept as it is entered, and, as it
    returns, its twins called on them and compared with what it returned. A module that
    cannot be measured (its twin raises, or returns other tensors) is named in
    ``unmeasured``; the hooks never raise."""

    twins: Twins
    factor: float
    #: Measure every module; else stop at the first beyond the factor.
    whole: bool = True
    figures: list[ModuleFigures] = field(default_factory=list)
    unmeasured: list[str] = field(default_factory=list)
    #: Each module entered and not yet returned, innermost last.
    entered_with: list[Entry] = field(default_factory=list)
    #: The modules whose own code cast narrower in the float64 run.
    casting: list[str] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return not self.whole and bool(self.figures) and beyond(self.figures[-1], self.factor)

    def entered(self, path: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.done:
            return
        with out_of_modes():
            kept = cloned((args, kwargs))
        self.entered_with.append(Entry(module, kept, casts_so_far()))

    def returned(self, path: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        entry = None if self.done else self.entry_of(module)
        if entry is None:
            return
        casts = self.casts_seen(path, entry)
        dtypes: tuple[torch.dtype, ...] | None = None
        try:
            measured, dtypes = self.measured(path, module, entry, output, casts)
        except Exception as error:
            self.unmeasured.append(f"{path or 'the model'}: {type(error).__name__}")
            measured = None
        if measured is not None:
            self.figures.append(measured)
        if self.entered_with:
            self.entered_with[-1].calls.add(path, entry.inputs, output, dtypes)

    def entry_of(self, module: nn.Module) -> Entry | None:
        """The entry ``module`` was entered with (those of a module that raised before
        returning dropped)."""
        while self.entered_with:
            entry = self.entered_with.pop()
            if entry.module is module:
                return entry
        return None

    def casts_seen(self, path: str, entry: Entry) -> CastsSeen | None:
        """Where the module that returned cast narrower (None where not known); its
        casts counted in the module that called it."""
        now = casts_so_far()
        if entry.casts is None or now is None:
            return None
        made = now - entry.casts
        if self.entered_with:
            self.entered_with[-1].casts_inside += made
        own = made > entry.casts_inside
        if own:
            self.casting.append(path)
        inside = dict.fromkeys(p for p in self.casting if p.startswith(path + ".") or not path)
        return CastsSeen(own, tuple(p for p in inside if p != path))

    def measured(
        self, path: str, module: nn.Module, entry: Entry, output: Any, casts: CastsSeen | None
    ) -> tuple[ModuleFigures | None, tuple[torch.dtype, ...] | None]:
        """The module's figures, and the dtypes of the floating tensors its cell's twin
        returned (None where its twin was not called); measured on its own code, the
        modules it called replayed, where they can be, else whole."""
        reference = floating(output)
        if not reference:
            return None, ()  # nothing floating returned: nothing to compare
        site = (path, type(module).__name__, forward_site(module))
        if beyond_range(entry.inputs, self.twins.dtype):
            return ModuleFigures(*site, math.nan, math.nan, math.nan), None
        try:
            worst, dtypes = self.worst_point(path, entry, reference, casts, entry.calls.replayed())
        except NotReplayed:
            worst, dtypes = self.worst_point(path, entry, reference, casts, ())
        figures = ModuleFigures(*site, *worst)
        if beyond(figures, self.factor) and not any(beyond(f, self.factor) for f in self.figures):
            inputs = entry.inputs
            op = module_first_op(self.twins, path, module, inputs, self.factor, not figures.finite)
            figures = replace(figures, op=op.named())
        return figures, dtypes

    def worst_point(
        self,
        path: str,
        entry: Entry,
        reference: Tensors,
        casts: CastsSeen | None,
        calls: Sequence[ChildCall],
    ) -> tuple[tuple[float, float, float], tuple[torch.dtype, ...]]:
        """The error, rounding and ratio where the module's twins leave float64 the most:
        at what it returns, or at what it passed a module it called (:mod:`.divergence_replay`);
        not measurable (NaN) where a module it called returned what the cell's dtype cannot
        hold (the overflow is that module's); and the dtypes of what the cell's twin
        returned."""
        args, kwargs = entry.inputs
        mine, mine_passed = self.twins.cell_output(path, args, kwargs, calls)
        fed = mine_passed.fed()
        stick, stick_passed = self.twins.stick_output(path, args, kwargs, casts, calls, fed)
        points = [(floating(mine), floating(stick), reference)]
        for index in fed:
            cell_in, stick_in = mine_passed.passed[index], stick_passed.passed[index]
            points.append((floating(cell_in), floating(stick_in), floating(calls[index].inputs)))
        floor = DTYPE_FLOOR[TORCH_DTYPES[self.twins.dtype]] / self.factor
        figures = [point_figures(*point, floor) for point in points if point[2]]
        if len(figures) > 1 and any(math.isnan(f[0]) for f in figures[1:]):
            raise NotReplayed("a module was passed other tensors than float64 passed it")
        if any(beyond_range(call.output, self.twins.dtype) for call in calls):
            return (math.nan, math.nan, math.nan), floating_dtypes(mine)  # as for its inputs
        return worst_of(figures), floating_dtypes(mine)


def point_figures(
    cell: Tensors, stick: Tensors, truth: Tensors, floor: float
) -> tuple[float, float, float]:
    """Error, rounding and ratio of the twins' tensors at one point (NaN error where they
    are other tensors than float64's there)."""
    try:
        scale = scale_of(truth)
        error, rounding = compared(cell, truth, scale), compared(stick, truth, scale)
    except ValueError:
        return math.nan, math.nan, math.nan
    ratio = error / max(rounding, floor) if math.isfinite(rounding) else math.nan
    return error, rounding, ratio


def worst_of(figures: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """The point of the largest ratio (infinite first; one not measurable, NaN, only where
    none is)."""
    measured = [f for f in figures if not math.isnan(f[2])]
    return max(measured, key=lambda f: f[2]) if measured else figures[0]


def cloned(value: Any) -> Any:
    """Copies of the tensors in ``value`` (a module may change what it was passed)."""
    return map_tensors(value, lambda t: t.detach().clone(), same_module)


@contextmanager
def each_under(
    modules: list[nn.Module], mode: Callable[[], AbstractContextManager[Any]]
) -> Iterator[None]:
    """While it lasts, each of ``modules`` runs its ``forward`` under a fresh ``mode()``
    (its hooks outside it)."""
    with forwards_replaced((m, under(mode, m.forward)) for m in modules):
        yield


def under(
    mode: Callable[[], AbstractContextManager[Any]], forward: Callable[..., Any]
) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with mode():
            return forward(*args, **kwargs)

    return call


def casts_so_far() -> int | None:
    """The narrowing casts the float64 run's ``StaysFloat64`` has kept float64 so far; None
    where the dispatch modes about are not that mode alone."""
    stack = _get_current_dispatch_mode_stack()
    if len(stack) == 1 and isinstance(stack[0], StaysFloat64):
        return stack[0].casts
    return None


def floating(output: Any) -> Tensors:
    """The floating tensors in what a module returned, in pytree order."""
    leaves = pytree.tree_leaves(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def compared(outputs: Tensors, reference: Tensors, scale: float | None = None) -> float:
    """``max|output - reference| / max|reference|`` over all the tensors (the reference's
    finite values; ``scale``, where given, is that denominator), infinite where an output
    is non-finite and the reference is not there (the same infinity in both is no error);
    ``ValueError`` for other tensors than the reference's."""
    if len(outputs) != len(reference):
        raise ValueError(f"returned {len(outputs)} tensors, float64 {len(reference)}")
    worst = 0.0
    with out_of_modes():
        for output, expected in zip(outputs, reference, strict=True):
            if output.shape != expected.shape:
                raise ValueError(
                    f"returned shape {tuple(output.shape)}, float64 {tuple(expected.shape)}"
                )
            if expected.numel():
                worst = max(
                    worst, largest_difference(as_float64_cpu(output), as_float64_cpu(expected))
                )
        scale = scale_of(reference) if scale is None else scale
    if not math.isfinite(worst):
        return math.inf
    return worst / scale if scale > 0 else worst


def scale_of(reference: Tensors) -> float:
    """``max|reference|`` over the finite values of all the tensors."""
    with out_of_modes():
        return max(
            (largest_finite(as_float64_cpu(t)) for t in reference if t.numel()), default=0.0
        )


def largest_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want|``: infinite where ``got`` is non-finite and ``want`` is not the
    same infinity there (one pass where all is finite, the common case)."""
    quick = float(torch.sub(got, want).abs_().amax())
    if math.isfinite(quick):
        return quick
    diff = torch.where(got == want, 0.0, (got - want).abs()).nan_to_num(math.inf, math.inf)
    return float(diff.max())


def largest_finite(tensor: torch.Tensor) -> float:
    """``max|tensor|`` over its finite values (0 where it has none)."""
    least, largest = (float(t) for t in torch.aminmax(tensor))
    quick = max(-least, largest)
    if math.isfinite(quick):
        return quick
    finite = tensor[torch.isfinite(tensor)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def forward_site(module: nn.Module) -> str | None:
    """Where ``module``'s ``forward`` is defined, ``file.py:LINE``; None without source."""
    return defined_at(inspect.unwrap(type(module).forward))


@functools.cache
def defined_at(forward: Callable[..., Any]) -> str | None:
    """``file.py:LINE`` of a function, read once (a deep model has hundreds of modules of a
    few classes, and reading the source is most of what the profile's bookkeeping costs)."""
    try:
        source = inspect.getsourcefile(forward)
        line = inspect.getsourcelines(forward)[1]
    except (OSError, TypeError):
        return None
    return f"{Path(source).name}:{line}" if source else None


#: Float64's gradient at each floating tensor a module returned (None: none reached it).
Grads = list["torch.Tensor | None"]


def largest_of(grads: Grads) -> torch.Tensor:
    """The gradient of the largest magnitude (the one a scale must not overflow)."""
    found = [g for g in grads if g is not None and g.numel()]
    return max(found, key=lambda g: float(g.abs().max())) if found else torch.zeros(1)


def gradients_of(
    module: nn.Module,
    inputs: Any,
    params: tuple[str, ...],
    grads: Grads,
    fed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    region: AbstractContextManager[Any] | None = None,
) -> Tensors:
    """``module`` called on ``inputs`` (leaves; copies of them, which it may change in
    place), under ``region``, its outputs' backward fed ``fed(grad, output)``: the
    gradients of the inputs that require one and of the parameters named (zeros where
    none reached one)."""
    own = dict(module.named_parameters())
    wanted = [t for t in pytree.tree_leaves(inputs) if is_differentiable(t)]
    wanted += [own[name].requires_grad_(True) for name in params]
    with torch.enable_grad():  # a backward hook runs without it
        args, kwargs = pytree.tree_map_only(torch.Tensor, copied, inputs)
        with region or nullcontext():
            outputs = floating(module(*args, **kwargs))
        if len(outputs) != len(grads):
            raise ValueError(f"returned {len(outputs)} tensors, float64 {len(grads)}")
        pairs = [
            (out, fed(grad, out))
            for out, grad in zip(outputs, grads, strict=True)
            if grad is not None and out.requires_grad
        ]
        if not pairs or not wanted:
            return [torch.zeros_like(t) for t in wanted]
        found = torch.autograd.grad(
            [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
        )
    return [torch.zeros_like(t) if g is None else g for g, t in zip(found, wanted, strict=True)]


def is_differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def copied(tensor: torch.Tensor) -> torch.Tensor:
    """A leaf that requires a gradient as a module is given it: a copy it may change in
    place, whose backward reaches the leaf."""
    return tensor.clone() if tensor.requires_grad else tensor


def trained_names(module: nn.Module) -> tuple[str, ...]:
    """The names of ``module``'s parameters that float64 trains."""
    return tuple(n for n, p in module.named_parameters() if p.requires_grad)


@dataclass
class Call:
    """One call of a module in the float64 step: where it was entered (its index, in
    forward order), its inputs (cloned leaves, each requiring a gradient where float64's
    did), and the gradient each floating tensor it returned received in backward."""

    index: int
    path: str
    module: nn.Module
    inputs: Any
    grads: Grads = field(default_factory=list)
    waiting: int = 0


@dataclass
class BackwardMeasuring:
    """The float64 step's hooks for backward: each module's inputs kept as it is entered,
    and a hook on each floating tensor it returns; once float64's gradient has reached
    every one of them, the module's twins are fed it (:meth:`Twins.cell_gradients`,
    :meth:`Twins.stick_gradients`) and float64's own module again, and compared, and its
    inputs dropped: what is kept is figures. Ordered as backward finishes the modules
    (the reverse of the order they were entered: a module after those inside it)."""

    twins: Twins
    factor: float
    #: Entered and not yet returned (innermost last).
    open: list[Call] = field(default_factory=list)
    #: Returned, their gradients not all in.
    waiting: list[Call] = field(default_factory=list)
    entered_count: int = 0
    figures: list[tuple[int, ModuleFigures]] = field(default_factory=list)
    unmeasured: list[str] = field(default_factory=list)
    #: Set while a module of the float64 run is called again (its hooks stand aside).
    busy: bool = False

    def entered(self, path: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        self.entered_count += 1
        with out_of_modes():
            kept = map_tensors(
                (args, kwargs),
                lambda t: t.detach().clone().requires_grad_(t.requires_grad),
                same_module,
            )
        self.open.append(Call(self.entered_count, path, module, kept))

    def returned(self, path: str, module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        call = None
        while self.open and call is None:  # those of a module that raised are dropped
            last = self.open.pop()
            call = last if last.module is module else None
        outputs = floating(output)
        if call is None or not any(t.requires_grad for t in outputs):
            return
        call.grads = [None] * len(outputs)
        for position, tensor in enumerate(outputs):
            if tensor.requires_grad:
                call.waiting += 1
                tensor.register_hook(self.on_gradient(call, position))
        self.waiting.append(call)

    def on_gradient(self, call: Call, position: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            call.grads[position] = grad.detach()
            call.waiting -= 1
            if not call.waiting:
                self.measure(call)

        return hook

    def measure(self, call: Call) -> None:
        """``call``'s figures, its inputs and gradients then dropped; never raises."""
        self.waiting = [c for c in self.waiting if c is not call]
        try:
            figures = self.measured(call)
        except Exception as error:
            where = call.path or "the model"
            self.unmeasured.append(f"{where} (backward): {type(error).__name__}")
            return
        finally:
            call.inputs, call.grads = None, []
        if figures is not None:
            self.figures.append((call.index, figures))

    def measured(self, call: Call) -> ModuleFigures | None:
        site = (call.path, type(call.module).__name__, forward_site(call.module))
        if beyond_range(call.inputs, self.twins.dtype):
            return ModuleFigures(*site, math.nan, math.nan, math.nan)
        params = trained_names(call.module)
        truth = self.float64_gradients(call, params)
        if not truth:
            return None
        cell = self.twins.cell_gradients(call.path, call.inputs, params, call.grads)
        stick = self.twins.stick_gradients(call.path, call.inputs, params, call.grads)
        floor = DTYPE_FLOOR[TORCH_DTYPES[self.twins.dtype]] / self.factor
        return ModuleFigures(*site, *gradient_ratio(cell, stick, truth, floor))

    def float64_gradients(self, call: Call, params: tuple[str, ...]) -> Tensors:
        """float64's own gradients of ``call``'s inputs and parameters, its module called
        again on its inputs (its hooks stand aside) and fed float64's gradient."""
        self.busy = True
        try:
            with out_of_modes():
                return gradients_of(call.module, call.inputs, params, call.grads, same_gradient)
        finally:
            self.busy = False

    def in_backward_order(self) -> tuple[ModuleFigures, ...]:
        """The figures, a module after those inside it and after those it feeds; a module
        some of whose outputs no gradient reached measured with what reached it."""
        for call in list(self.waiting):
            if any(g is not None for g in call.grads):
                self.measure(call)
        self.waiting.clear()
        return tuple(f for _, f in sorted(self.figures, key=lambda pair: -pair[0]))


def same_gradient(grad: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    return grad


def gradient_ratio(
    cell: Tensors, stick: Tensors, truth: Tensors, floor: float
) -> tuple[float, float, float]:
    """The error, rounding and ratio of the worst of a module's gradients (of each input
    and each parameter, each over its own scale: a weight's gradient and an activation's
    differ by orders of magnitude); NaN where none could be measured."""
    worst = (math.nan, math.nan, math.nan)
    for got, held, want in zip(cell, stick, truth, strict=True):
        error, rounding = compared([got], [want]), compared([held], [want])
        if not math.isfinite(rounding):
            continue
        ratio = error / max(rounding, floor)
        if math.isnan(worst[2]) or ratio > worst[2]:
            worst = (error, rounding, ratio)
    return worst
