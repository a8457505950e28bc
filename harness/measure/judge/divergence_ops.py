"""Where inside the first module beyond its rounding (or inside the fix's own code, where no
module is) a failing cell left float64: the op, and the line of source that called it.

Once the profile (:mod:`harness.measure.judge.divergence`) has a module, that module is run
three times more on the same inputs, each under a dispatch mode that sees its ops in order:

1. in float64, on float64's own inputs (the float64 run's module, a copy without its hooks):
   each op's floating outputs are kept, on the CPU (the module is one module: small);
2. as the rounding yardstick's module (weights rounded, computed in float64) on those
   inputs rounded to the cell's dtype, nothing rounded inside: each op's error over float64
   is kept, its output rounded to the dtype the cell holds it in (one figure an op);
3. as the cell runs it (its dtype, device and autocast) on the inputs rounded: each op's
   error over float64 is compared, as it is made, with the yardstick's.

The three are one program, so their ops pair by position and name (a cast, ``_to_copy``,
which autocast adds in the cell only, is left out of all three); where they do not pair,
nothing is named and the reason says where they parted.

**The op named.** Where the module's output went non-finite: the first op that made inf or
NaN from finite inputs (the cell's own inputs to that op finite, its output non-finite where
float64's is finite). Else the first op whose ratio, ``error / max(rounding, eps(dtype) /
factor)``, crosses the cell's factor: the module's own rule, with the yardstick's error
along the same ops as ``rounding``. That yardstick, rather than ``factor x eps(dtype)``,
because an op's error is not its output's rounding alone: a softmax over logits of 10
carries ten times the logits' rounding, in the yardstick as in the cell; what the cell adds
beyond it is what the cell's ops did in its dtype that float64 on the same rounded inputs
did not (a variance ``E[x^2] - E[x]^2`` whose ``E[x^2]`` was stored in half, a product that
overflowed). The yardstick keeps its intermediates unrounded, or it would carry the same
cancellation. Ops with no floating tensor input (a ``full``, an ``arange``) make the
program's constants, which may differ by design (``finfo(dtype).min``), and ops that draw
random numbers differ by draw: neither is judged, nor is an op whose float64 output the
cell's dtype cannot hold (the rounding itself is beyond the range there). Measured by the
tests of ``tests/test_divergence_ops.py``: the healthy ops of the modules named stay under
the factor, the injected one crosses it.

**The fix's own code.** Where no module crossed (a mask summed in the fix, outside any
module), the same three runs are taken of the whole fix, its ops kept only while the fix's
own function is running (not the harness's around it), its float64 outputs bounded to
``LIMIT_MIB``: a fix that makes more is not searched, and the reason says so.

The line named is the innermost frame outside torch, the harness and the standard library
(:func:`~harness.measure.tracing.source_sites.user_location`): the model's or the case's.
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import _disable_current_modes

from harness.measure.authoring.case import Case
from harness.measure.judge.numerics import DTYPE_FLOOR
from harness.measure.judge.references import (
    float64_run,
    float64_workload,
    plain_cell,
    rounded_workload,
    workpiece,
)
from harness.measure.precision.dtypes import TORCH_DTYPES
from harness.measure.precision.modes import Precision, autocast_region
from harness.measure.running.fix_run import context_for, prepared_workload, run_fix_checked
from harness.measure.tracing.dispatch_mode import LazyDynamoMode
from harness.measure.tracing.source_sites import user_location
from harness.schema.axes import Cell
from harness.schema.divergence import Divergence

Tensors = list[torch.Tensor]

#: What the float64 outputs of a whole fix's ops may take, kept for the cell's run to meet.
LIMIT_MIB = 256

#: Casts: autocast adds them to the cell's run only; they compute nothing.
CASTS = frozenset({"aten::_to_copy"})


@dataclass(frozen=True)
class FoundOp:
    """The op named (``aten::mm``, its overload packet's name) and the ``file:line`` that
    called it, its ratio (infinite where it made inf or NaN) and the ratio of the op judged
    before it; or, where none is named, ``why``."""

    op: str | None
    location: str | None = None
    ratio: float = math.nan
    ratio_before: float | None = None
    why: str | None = None

    def named(self) -> str | None:
        """``aten::sub (model.py:41)``, None where no op is named."""
        if self.op is None:
            return None
        return f"{self.op} ({self.location})" if self.location else self.op


def op_name(func: Any) -> str:
    """``aten::mm`` for ``aten.mm.default``: the overload packet's name."""
    return str(func.overloadpacket._qualified_op_name)


def floating(value: Any) -> Tensors:
    leaves = pytree.tree_leaves(value)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def judged(func: Any, args: Any, kwargs: Any) -> bool:
    """An op that computes from floating data: one floating tensor in, deterministic."""
    if torch.Tag.nondeterministic_seeded in func.tags:
        return False
    return bool(floating((args, kwargs)))


def error_of(output: torch.Tensor, reference: torch.Tensor) -> float:
    """``max|output - reference| / max|reference|`` over the reference's finite values
    (infinite where the output is non-finite there); NaN for another shape."""
    if output.shape != reference.shape:
        return math.nan
    got, want = output.detach().double().cpu(), reference.double()
    finite = torch.isfinite(want)
    if not finite.any():
        return 0.0
    got, want = got[finite], want[finite]
    if not torch.isfinite(got).all():
        return math.inf
    scale = float(want.abs().max())
    worst = float((got - want).abs().max())
    return worst / scale if scale > 0 else worst


def errors_of(outputs: Tensors, reference: Tensors) -> float:
    if len(outputs) != len(reference):
        return math.nan
    return max((error_of(o, r) for o, r in zip(outputs, reference, strict=True)), default=0.0)


def beyond_range(reference: Tensors, outputs: Tensors) -> bool:
    """A finite float64 value the cell's dtype (of each output) cannot hold."""
    for want, got in zip(reference, outputs, strict=False):
        largest = torch.finfo(got.dtype).max
        if bool((want.isfinite() & (want.abs() > largest)).any()):
            return True
    return False


def made_non_finite(inputs: Tensors, outputs: Tensors, reference: Tensors) -> bool:
    """Finite inputs, and an output non-finite where float64's is finite."""
    if not all(bool(t.isfinite().all()) for t in inputs):
        return False
    for got, want in zip(outputs, reference, strict=False):
        if got.shape == want.shape:
            made = ~got.detach().cpu().isfinite() & want.isfinite()
            if bool(made.any()):
                return True
    return False


@dataclass
class Ops:
    """One run's ops, in order: their names, and in the float64 run their outputs (on the
    CPU), in the yardstick's run their errors."""

    names: list[str] = field(default_factory=list)
    outputs: list[Tensors | None] = field(default_factory=list)
    errors: list[float] = field(default_factory=list)
    kept_bytes: int = 0
    over: bool = False


class OpMode(LazyDynamoMode):
    """Each op (casts left out) passed to ``seen`` with its position, while ``within``
    says the op is the code under study (the whole fix: while its function runs)."""

    def __init__(
        self,
        seen: Callable[[int, Any, Any, Any, Any, Tensors], None],
        within: Callable[[], bool] | None = None,
    ) -> None:
        super().__init__()
        self.seen = seen
        self.within = within
        self.count = 0
        #: Where ``empty`` tensors lie: their values are no input (``baddbmm``'s, beta=0).
        self.uninitialized: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if op_name(func) in CASTS or (self.within is not None and not self.within()):
            return func(*args, **kwargs)
        inputs = [t for t in floating((args, kwargs)) if t.data_ptr() not in self.uninitialized]
        if func._schema.is_mutable:  # its inputs as they were before it changed them
            inputs = [t.detach().clone() for t in inputs]
        output = func(*args, **kwargs)
        index, self.count = self.count, self.count + 1
        if "empty" in op_name(func):
            self.uninitialized |= {t.data_ptr() for t in floating(output)}
        self.seen(index, func, args, kwargs, output, inputs)
        return output


def recorder(ops: Ops, limit_bytes: int | None) -> Callable[..., None]:
    """float64's ops: their outputs kept on the CPU, up to ``limit_bytes``."""

    def seen(index: int, func: Any, args: Any, kwargs: Any, output: Any, inputs: Tensors) -> None:
        ops.names.append(op_name(func))
        outputs = [t.detach().cpu().clone() for t in floating(output)]
        size = sum(t.numel() * t.element_size() for t in outputs)
        if limit_bytes is not None and ops.kept_bytes + size > limit_bytes:
            ops.over = True
            ops.outputs.append(None)
            return
        ops.kept_bytes += size
        ops.outputs.append(outputs if judged(func, args, kwargs) else None)

    return seen


@dataclass
class Pairing:
    """The ops of a run paired with float64's, by position and name."""

    reference: Ops
    why: str | None = None

    def reference_of(self, index: int, func: Any) -> Tensors | None:
        """float64's outputs of the op at ``index``; None where it is not judged, or the
        runs parted (``why`` then says where)."""
        if self.why is not None:
            return None
        name = op_name(func)
        if index >= len(self.reference.names) or self.reference.names[index] != name:
            there = self.reference.names[index] if index < len(self.reference.names) else "end"
            self.why = f"the runs part at op {index}: {name} in the cell's, {there} in float64's"
            return None
        return self.reference.outputs[index]


def stick_errors(pairing: Pairing, errors: list[float], dtype: torch.dtype) -> Callable[..., None]:
    """The yardstick's error at each op, its outputs rounded to ``dtype`` as measured."""

    def seen(index: int, func: Any, args: Any, kwargs: Any, output: Any, inputs: Tensors) -> None:
        reference = pairing.reference_of(index, func)
        outputs = [t.to(dtype) for t in floating(output)]
        errors.append(math.nan if reference is None else errors_of(outputs, reference))

    return seen


@dataclass
class Judge:
    """The cell's run, op by op against float64's and the yardstick's: the first op beyond
    the factor (``non_finite``: the first that made inf or NaN from finite inputs)."""

    pairing: Pairing
    rounding: list[float]
    floor: float
    factor: float
    non_finite: bool
    found: FoundOp | None = None
    last_ratio: float | None = None

    def seen(
        self, index: int, func: Any, args: Any, kwargs: Any, output: Any, inputs: Tensors
    ) -> None:
        if self.found is not None:
            return
        reference = self.pairing.reference_of(index, func)
        if reference is None:
            return
        outputs = floating(output)
        if self.non_finite:
            ratio = math.inf if made_non_finite(inputs, outputs, reference) else 0.0
        elif beyond_range(reference, outputs):
            return
        else:
            ratio = self.ratio(errors_of(outputs, reference), index)
        if not math.isnan(ratio) and ratio > self.factor:
            where = user_location(sys._getframe())
            self.found = FoundOp(op_name(func), where, ratio, self.last_ratio)
        elif not self.non_finite and not math.isnan(ratio):
            self.last_ratio = ratio

    def ratio(self, error: float, index: int) -> float:
        rounding = self.rounding[index] if index < len(self.rounding) else math.nan
        if not math.isfinite(rounding):
            return math.nan
        return error / max(rounding, self.floor)


def first_op(
    float64: Callable[[], Any],
    stick: Callable[[], Any],
    cell: Callable[[], Any],
    dtype: str,
    factor: float,
    non_finite: bool,
    within: Callable[[], bool] | None = None,
    limit_bytes: int | None = None,
) -> FoundOp:
    """The first op of ``cell``'s run beyond the factor against ``float64``'s and the
    yardstick's (``stick``) runs of the same program (see the module docstring): each a
    call, run out of the dispatch modes around it under one that sees its ops; ``within``:
    whether an op belongs to the code under study."""
    reference, rounding = Ops(), list[float]()
    with _disable_current_modes(), torch.no_grad():
        with OpMode(recorder(reference, limit_bytes), within):
            float64()
        if reference.over:
            return FoundOp(None, why=f"the fix's ops take more than {LIMIT_MIB} MiB in float64")
        pairing = Pairing(reference)
        with OpMode(stick_errors(pairing, rounding, TORCH_DTYPES[dtype]), within):
            stick()
        floor = DTYPE_FLOOR[TORCH_DTYPES[dtype]] / factor
        judge = Judge(Pairing(reference), rounding, floor, factor, non_finite)
        with OpMode(judge.seen, within):
            cell()
    if judge.found is not None:
        return judge.found
    why = judge.pairing.why or pairing.why or "no op went beyond its rounding"
    return FoundOp(None, why=why)


class Twins(Protocol):
    """What the search of a module takes of the profile's twins
    (:class:`harness.measure.judge.divergence.Twins`)."""

    cell: dict[str, nn.Module]
    stick: nn.Module
    precision: Precision
    dtype: str

    def as_cell(self, module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]: ...


def module_first_op(
    twins: Twins, path: str, module: nn.Module, inputs: Any, factor: float, non_finite: bool
) -> FoundOp:
    """The first op beyond the factor in the module at ``path`` (``module``: float64's, its
    ``inputs`` float64's): float64's copy of it without the profile's hooks, the
    yardstick's and the cell's twins, each on those inputs (the twins' rounded)."""
    args, kwargs = inputs
    mine = twins.cell[path]
    try:
        own = unhooked_copy(module)
    except Exception as error:  # a module that cannot be copied is not searched
        return FoundOp(None, why=f"float64's module not copied: {type(error).__name__}")
    as_cell = twins.as_cell(mine)
    dtype = TORCH_DTYPES[twins.dtype]

    def rounded(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).double() if t.is_floating_point() else t

    with _disable_current_modes(), torch.no_grad():  # made before the runs: not their ops
        stick_in = pytree.tree_map_only(torch.Tensor, rounded, (args, kwargs))
        cell_in = pytree.tree_map_only(torch.Tensor, as_cell, (args, kwargs))

    def on_float64() -> Any:
        return own(*args, **kwargs)

    def on_stick() -> Any:
        return twins.stick.get_submodule(path)(*stick_in[0], **stick_in[1])

    def on_cell() -> Any:
        with autocast_region(twins.precision):
            return mine(*cell_in[0], **cell_in[1])

    try:  # the module's figures stand whatever the search does
        return first_op(on_float64, on_stick, on_cell, twins.dtype, factor, non_finite)
    except Exception as error:
        return FoundOp(None, why=f"the ops not searched: {type(error).__name__}")


def unhooked_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose modules have no hooks (the profile's would measure it)."""
    with _disable_current_modes():
        own = copy.deepcopy(module)
    for inner in own.modules():
        inner._forward_hooks.clear()
        inner._forward_pre_hooks.clear()
    return own


def fix_first_op(case: Case, cell: Cell, factor: float, non_finite: bool) -> FoundOp:
    """The first op beyond the factor in the fix's own code: the fix run in float64, as
    the yardstick and as the cell, each on its workload, its ops kept while the fix's
    function runs (``LIMIT_MIB`` of float64 outputs at most)."""
    keep = case.kept_by(cell.fix)
    ctx = context_for(case, cell, observe=False)
    piece = workpiece(cell)._replace(fix=cell.fix)
    float64_ctx = context_for(
        case, plain_cell(case, "float64", cell.size, backend=piece.backend, stage=cell.stage)
    )

    def on_float64() -> Any:
        return float64_run(piece, float64_workload(piece), record=False)

    def on_stick() -> Any:
        stick = rounded_workload(case, float64_ctx, cell.dtype, keep)
        return run_fix_checked(
            case, cell.fix, float64_ctx, trace=False, workload=stick, record=False
        )

    def on_cell() -> Any:
        ready = prepared_workload(case, ctx, keep)
        return run_fix_checked(case, cell.fix, ctx, trace=False, workload=ready, record=False)

    code = fix_code(case.fixes[cell.fix].func)
    found = first_op(
        on_float64,
        on_stick,
        on_cell,
        cell.dtype,
        factor,
        non_finite,
        within=lambda: running(code, sys._getframe()),
        limit_bytes=LIMIT_MIB * 2**20,
    )
    return found


def in_the_fix(case: Case, cell: Cell, factor: float, non_finite: bool) -> Divergence | None:
    """Where no module crossed: the op of the fix's own code that did, as a divergence
    (``module=""``, ``kind="the fix's own code"``, ``location``: the op's call); None where
    none is found (or the search fails: the profile's note stands)."""
    try:
        found = fix_first_op(case, cell, factor, non_finite)
    except Exception:
        return None
    if found.op is None:
        return None
    return Divergence(
        module="",
        kind=FIX_CODE,
        location=found.location,
        op=found.op,
        ratio=found.ratio,
        ratio_before=found.ratio_before,
        factor=factor,
    )


#: The kind of a divergence made between modules, in the fix itself.
FIX_CODE = "the fix's own code"


def fix_code(func: Any) -> CodeType | None:
    """The code object of a fix's function (None where it has none: not searched)."""
    inner = getattr(func, "__func__", func)
    while hasattr(inner, "__wrapped__"):
        inner = inner.__wrapped__
    return getattr(inner, "__code__", None)


def running(code: CodeType | None, frame: FrameType | None) -> bool:
    """Whether ``code`` is running in ``frame`` or a frame that called it."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
