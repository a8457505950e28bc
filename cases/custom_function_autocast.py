"""A custom ``torch.autograd.Function`` under autocast without ``custom_fwd``/``custom_bwd``:
its forward runs, its backward raises.

Upstream: PyTorch's AMP guide, "Autocast and Custom Autograd Functions" (docs/source/notes/
amp_examples.rst): "If your custom function's forward runs under autocast, decorate it with
``custom_fwd`` and its backward with ``custom_bwd``"; fused ops written as autograd Functions
follow it (flash-attn's ``FusedDenseFunc`` in ``flash_attn/ops/fused_dense.py``, apex's fused
layer norm, mamba's selective scan). Where the decorators are missing, as in mmcv's
``RoIAlignFunction`` (pytorch#47906) and the Functions of pytorch#87979, the forward runs
inside the autocast region, so its ``F.linear(x, weight, bias)`` is autocast to half and the
output is half; autograd then calls the backward outside autocast, where the half gradient of that
output meets the float32 weight the forward saved, and the matmul refuses the mix
(``expected m1 and m2 to have the same dtype, but got: c10::Half != float``). A forward-only
check passes; only a training step shows it.

The model is one fused linear layer (``FusedDenseFunc``'s forward and backward without its
CUDA kernels: ``F.linear(x, w, b)``, its gradients by hand) between a LayerNorm and a head.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.measure.authoring.case import (
    Case,
    FailureSignature,
    RunContext,
    Size,
    Upstream,
    Workload,
    fix,
)
from harness.measure.authoring.registry import register


@dataclass(frozen=True)
class Dims:
    batch: int
    tokens: int
    width: int


SMALL = Dims(batch=2, tokens=16, width=32)


class FusedDenseFunc(torch.autograd.Function):
    """``FusedDenseFunc`` as upstream writes it, without the decorators."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> Any:
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight  # half gradient, float32 weight: refused
        grad_w = grad_out.flatten(0, -2).t() @ x.flatten(0, -2)
        return grad_x, grad_w, grad_out.flatten(0, -2).sum(0)


class CastGradFunc(FusedDenseFunc):
    """The hand fix: the backward casts the incoming gradient to the saved weight's dtype."""

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        grad_out = grad_out.to(weight.dtype)
        grad_x = grad_out @ weight
        grad_w = grad_out.flatten(0, -2).t() @ x.to(weight.dtype).flatten(0, -2)
        return grad_x.to(x.dtype), grad_w, grad_out.flatten(0, -2).sum(0)


@functools.cache
def decorated(device_type: str, cast_inputs: torch.dtype | None) -> type[torch.autograd.Function]:
    """``FusedDenseFunc`` with the decorators upstream uses: the forward's autocast state is
    kept for the backward (``custom_bwd``); with ``cast_inputs``, the forward runs with
    autocast off on its inputs cast to that dtype."""
    custom_fwd = torch.amp.custom_fwd(device_type=device_type, cast_inputs=cast_inputs)
    custom_bwd = torch.amp.custom_bwd(device_type=device_type)

    class DecoratedFunc(torch.autograd.Function):
        @staticmethod
        @custom_fwd
        def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> Any:
            return FusedDenseFunc.forward(ctx, x, weight, bias)

        @staticmethod
        @custom_bwd
        def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
            return FusedDenseFunc.backward(ctx, grad_out)

    return DecoratedFunc


Apply = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Block(nn.Module):
    """LayerNorm, the fused linear layer, GELU and a head."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.dense = nn.Linear(width, width)
        self.head = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, dense: Apply) -> torch.Tensor:
        hidden = dense(self.norm(x), self.dense.weight, self.dense.bias)
        return self.head(torch.nn.functional.gelu(hidden))


@register
class CustomFunctionAutocast(Case):
    name = "custom-function-autocast"
    title = "A custom autograd.Function without custom_fwd/bwd: forward runs, backward raises"
    upstream = Upstream(
        repo="pytorch/pytorch",
        file="docs/source/notes/amp_examples.rst",
        commit="",
        issues=("pytorch/pytorch#47906", "pytorch/pytorch#87979"),
        url="https://pytorch.org/docs/stable/notes/amp_examples.html#autocast-and-custom-autograd-functions",
    )
    failure = FailureSignature(
        "RuntimeError", r"(m1 and m2|mat1 and mat2) to have the same dtype|expected scalar type"
    )
    reference_fix = "custom-fwd-bwd"
    modes = ("autocast", "half", "half-autocast", "fp32")
    backends = ("eager",)
    stages = ("forward", "train")
    sizes = (Size("small", SMALL, ""),)

    def build(self, ctx: RunContext) -> Workload:
        dims: Dims = ctx.dims
        x = torch.randn(dims.batch, dims.tokens, dims.width)
        return Workload(model=Block(dims.width), inputs={"x": x})

    def skip_reason(self, cell: Any) -> str | None:
        if cell.fix.startswith("custom-fwd") and not hasattr(torch.amp, "custom_fwd"):
            return "torch.amp.custom_fwd(device_type=...) needs torch 2.4+"
        return None

    @fix("none", rationale="FusedDenseFunc without custom_fwd/custom_bwd, as upstream forgot")
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return w.model(w.inputs["x"], FusedDenseFunc.apply)

    @fix(
        "custom-fwd-bwd",
        rationale="decorate forward with custom_fwd and backward with custom_bwd: the backward "
        "runs under the forward's autocast state",
        upstream="flash_attn/ops/fused_dense.py FusedDenseFunc (@custom_fwd / @custom_bwd)",
    )
    def custom_fwd_bwd(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        function = decorated(ctx.device.type, None)
        return w.model(w.inputs["x"], function.apply)

    @fix(
        "custom-fwd-cast-inputs",
        rationale="custom_fwd(cast_inputs=torch.float32): the Function runs in float32 with "
        "autocast off, as the AMP guide advises for ops that need float32",
        upstream="amp_examples.rst: custom_fwd(cast_inputs=torch.float32)",
    )
    def custom_fwd_cast_inputs(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        function = decorated(ctx.device.type, torch.float32)
        return w.model(w.inputs["x"], function.apply)

    @fix(
        "cast-grad-to-saved",
        rationale="by hand: the backward casts the gradient to the saved weight's dtype",
    )
    def cast_grad_to_saved(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return w.model(w.inputs["x"], CastGradFunc.apply)
