"""Where a gradient jumps: the units that rounding carries across a ReLU's kink.

A ReLU's derivative is a step. A unit whose input lies within rounding distance of zero is
on in one computation and off in another, and the gradient of every weight before it moves
by that unit's whole contribution, however small the rounding was: one unit of 256 in a
two-layer T5 feed-forward (its float64 input 6e-5, its tensor's largest 3.3) put off by a
float16 step moves the step's ``wi`` gradient 24% from float64's, 348 times what rounding
the data costs. Which units cross is chance; that some may is not. Such a unit's side is
below the dtype's resolution: neither side is the right one.

So a training step is judged along its own sides of the kinks. Its ReLU inputs are recorded
(:class:`KinkRecorder`), and where it put a unit on the other side than float64's while
float64's input is within ``KINK_WIDTH`` eps of the kink (relative to its tensor's largest
input), the float64 reference is taken again with every unit within that band on the cell's
side (:class:`KinkReplay`; every value in it is still float64's, and a unit nudged into the
band by a crossing upstream follows the cell too). A unit further from the kink keeps
float64's side: a computation that put it across is judged as it is. The rounding
yardstick, which has chance crossings of its own, is taken with float64's sides within the
same band: it measures the smooth cost of rounding, as for a model without kinks.

Measured (CPU, torch 2.13.0; T5 and ``nn.TransformerEncoder`` with ReLU, 2 to 48 layers,
post- and pre-LN, float16 and bfloat16, ``autocast`` and ``half``): a cell's ReLU inputs
differ from float64's by at most 4.0 eps of their tensor's largest; ``KINK_WIDTH`` is twice
that. A forward output moves continuously through a kink: only training steps need this,
and only a step that crossed pays for it (one more float64 step of the model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from harness.measure.precision.dtypes import TORCH_DTYPES

#: How near the kink (in the dtype's eps, relative to the tensor's largest input) a unit's
#: side is below the dtype's resolution: twice the largest distance measured (4.0 eps).
KINK_WIDTH = 8.0
#: The machine epsilon of the simulated roundings (see :mod:`harness.measure.judge.rounding`).
SIMULATED_EPS = {"float32": 2.0**-23, "tf32": 2.0**-10}

#: torch's ReLU entry points (``nn.ReLU`` calls ``F.relu``); in-place ones, and whether
#: each is a leaky ReLU (its slope its second argument, or ``negative_slope``).
RELUS = {F.relu, torch.relu, torch.Tensor.relu, torch.relu_, torch.Tensor.relu_, F.leaky_relu}
IN_PLACE = {torch.relu_, torch.Tensor.relu_}


def dtype_eps(dtype: str) -> float:
    if dtype in SIMULATED_EPS:
        return SIMULATED_EPS[dtype]
    return float(torch.finfo(TORCH_DTYPES[dtype]).eps)


@dataclass(frozen=True)
class ReluCall:
    """One ReLU call of a computation: the function, its input, its negative slope, and
    whether it works in place."""

    func: Any
    x: torch.Tensor
    slope: float
    in_place: bool

    @staticmethod
    def of(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ReluCall | None:
        """The call, or None where it is not one of a floating tensor."""
        if func not in RELUS or not args:
            return None
        x = args[0]
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return None
        return ReluCall(func, x, leaky_slope(func, args, kwargs), is_in_place(func, args, kwargs))


def is_in_place(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if func in IN_PLACE:
        return True
    position = 2 if func is F.leaky_relu else 1
    return bool(args[position] if len(args) > position else kwargs.get("inplace", False))


def leaky_slope(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> float:
    """The negative slope of a ReLU call: 0, or a leaky ReLU's (default 0.01)."""
    if func is not F.leaky_relu:
        return 0.0
    if len(args) > 1:
        return float(args[1])
    return float(kwargs.get("negative_slope", 0.01))


class KinkRecorder(TorchFunctionMode):
    """While active, keeps the input of every ReLU call, in order, and changes nothing: no
    op is run (a dtype tracer beneath sees the computation as it is), so an in-place call's
    input is kept as the call leaves it (its sides are the same: ``relu(x) > 0`` where
    ``x > 0``), unless ``keep_values`` (an untraced run, the reference): a copy first."""

    def __init__(self, keep_values: bool = False) -> None:
        super().__init__()
        self.keep_values = keep_values
        self.inputs: list[torch.Tensor] = []

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        call = ReluCall.of(func, args, kwargs)
        if call is not None:
            copied = call.in_place and self.keep_values
            self.inputs.append(call.x.detach().clone() if copied else call.x)
        return func(*args, **kwargs)


def sides(inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Each ReLU call's units that were on (input above the kink), on the CPU."""
    return tuple((x.detach() > 0).cpu() for x in inputs)


class KinkReplay(TorchFunctionMode):
    """While active, the i-th ReLU call's units within the band of the kink (by its own
    input, see :func:`near_kink`) take the sides ``sides[i]`` gives, in forward and
    backward; the others their own. ``fits`` is False once a call is not one of those
    recorded (another count or shape): it is then left as it is."""

    def __init__(self, sides: Sequence[torch.Tensor], dtype: str) -> None:
        super().__init__()
        self.sides = list(sides)
        self.dtype = dtype
        self.calls = 0
        self.fits = True

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        call = ReluCall.of(func, args, kwargs)
        if call is None:
            return func(*args, **kwargs)
        index, self.calls = self.calls, self.calls + 1
        if index >= len(self.sides) or self.sides[index].shape != call.x.shape:
            self.fits = False
        if not self.fits:
            return func(*args, **kwargs)
        x = call.x.detach()
        on = torch.where(near_kink(x, self.dtype), self.sides[index].to(x.device), x > 0)
        out = SidedRelu.apply(call.x, on, call.slope)
        return call.x.copy_(out) if call.in_place else out


class SidedRelu(torch.autograd.Function):
    """A (leaky) ReLU whose units are on where ``on`` says, in forward and backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, on: torch.Tensor, slope: float) -> torch.Tensor:
        ctx.save_for_backward(on)
        ctx.slope = slope
        return torch.where(on, x, x * slope)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (on,) = ctx.saved_tensors
        return torch.where(on, grad, grad * ctx.slope), None, None


def near_kink(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """The units of a float64 ReLU input whose side is below ``dtype``'s resolution."""
    scale = x.abs().amax() if x.numel() else x.new_zeros(())
    return x.abs() <= KINK_WIDTH * dtype_eps(dtype) * scale


def crossings(reference: Sequence[torch.Tensor], cell: Sequence[torch.Tensor], dtype: str) -> int:
    """How many units a cell put on the other side of a kink than float64's while float64's
    input is within the band (0 where the calls do not match: another computation than the
    reference's)."""
    if len(reference) != len(cell) or any(
        x.shape != on.shape for x, on in zip(reference, cell, strict=True)
    ):
        return 0
    return sum(
        int((near_kink(x, dtype) & (on != (x > 0))).sum().item())
        for x, on in zip(reference, cell, strict=True)
    )
