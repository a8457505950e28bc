"""Pure bfloat16 weights lose their updates: Adam's steps are below half an ulp of the weights.

Upstream: training with the weights themselves in bfloat16 (Lightning's ``bf16-true``,
``model.to(torch.bfloat16)`` before the optimizer is built) and ``torch.optim.AdamW``
stepping them. Adam's update is about the learning rate in size, whatever the gradient's
scale; a bfloat16 weight of magnitude 0.1 has an ulp of 2**-11 (4.9e-4), so an update of
1e-4 rounds away and the weight never moves. Nothing raises, every single step's gradients
are right (the ``forward`` and ``train`` cells pass); only the fit shows it: "when I
forcibly put the entire model in bf16, the loss decreases much more slowly"
(hp-l33/AiM#10); "When using Adam optimizer and setting the model to bfloat16, the loss does
not decrease" (tensorflow/tensorflow#58138, reproduced there in PyTorch); the "stale
weights problem" that bf16-fused-adam names. The fixes are upstream's:

- ``fp32-master-weights``: the optimizer steps float32 copies of the weights and copies
  them back (mixed-precision training's master weights: apex's ``FP16_Optimizer``,
  DeepSpeed's bf16 optimizer, Lightning's ``bf16-mixed``);
- ``kahan-summation``: AdamW whose update is added with Kahan summation, a bfloat16
  buffer carrying what each rounding dropped into the next step (``AnyPrecisionAdamW``,
  huggingface/transformers#21312 "pure bf16 training w/ AnyPrecisionAdamW and Kahan
  summation"; torch-optimi's optimizers).

The fit's learning rate is 1e-4 (the issue's measurement: 200 AdamW steps end at loss 9.37
in bfloat16 where float32 reaches 4.03). The case runs in ``half`` (the weights in the
dtype) and the float32 control; bfloat16 only (float16 weights under AdamW meet another
failure first: its ``eps`` of 1e-8 is zero in float16).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.measure.authoring.case import (
    Case,
    FailureSignature,
    RunContext,
    Size,
    Symptom,
    Upstream,
    Workload,
    fix,
)
from harness.measure.authoring.registry import register

LEARNING_RATE = 1e-4
BETAS = (0.9, 0.999)
EPS = 1e-8


@dataclass(frozen=True)
class Dims:
    batch: int
    width: int
    hidden: int


SMALL = Dims(batch=64, width=64, hidden=128)


class Block(nn.Module):
    """A feed-forward block with a LayerNorm (whose unit weights hold the largest ulps)."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.up = nn.Linear(dims.width, dims.hidden)
        self.norm = nn.LayerNorm(dims.hidden)
        self.down = nn.Linear(dims.hidden, dims.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.norm(self.up(x))))


def wider(dtype: torch.dtype) -> torch.dtype:
    """The master weights' dtype: float32, or the weights' own where they are wider."""
    return torch.promote_types(dtype, torch.float32)


class MasterWeightsAdamW(torch.optim.Optimizer):
    """AdamW stepping float32 copies of the weights, each copied back after the step."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float) -> None:
        self.weights = list(params)
        super().__init__(self.weights, {"lr": lr})
        self.masters = [w.detach().to(wider(w.dtype)).clone() for w in self.weights]
        self.inner = torch.optim.AdamW(
            self.masters, lr=lr, betas=BETAS, eps=EPS, weight_decay=0.0, foreach=False
        )

    def held_weights(self) -> list[torch.Tensor]:
        """What holds the weights' values between steps: the masters (the harness's fit
        measures the updates they receive)."""
        return self.masters

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for weight, master in zip(self.weights, self.masters, strict=True):
            master.grad = None if weight.grad is None else weight.grad.to(master.dtype)
        self.inner.step()
        for weight, master in zip(self.weights, self.masters, strict=True):
            weight.copy_(master)


class KahanAdamW(torch.optim.Optimizer):
    """AdamW with its states in the weights' dtype and the update added by Kahan
    summation, as ``AnyPrecisionAdamW(use_kahan_summation=True)`` does it."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float) -> None:
        super().__init__(list(params), {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for weight in group["params"]:
                if weight.grad is not None:
                    self.update(weight, group["lr"])

    def update(self, weight: torch.Tensor, lr: float) -> None:
        state = self.state[weight]
        if not state:
            state["step"] = 0
            for name in ("exp_avg", "exp_avg_sq", "compensation"):
                state[name] = torch.zeros_like(weight)
        state["step"] += 1
        step, grad = state["step"], weight.grad
        state["exp_avg"].mul_(BETAS[0]).add_(grad, alpha=1 - BETAS[0])
        state["exp_avg_sq"].mul_(BETAS[1]).addcmul_(grad, grad, value=1 - BETAS[1])
        bias1, bias2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
        denom = (state["exp_avg_sq"].sqrt() / bias2**0.5).add_(EPS)
        compensation = state["compensation"]
        compensation.addcdiv_(state["exp_avg"], denom, value=-lr / bias1)
        before = weight.detach().clone()
        weight.add_(compensation)
        compensation.add_(before.sub_(weight))  # what the rounding of the add dropped


@register
class Bf16PureWeights(Case):
    name = "bf16-pure-weights"
    title = "Pure bfloat16 weights: AdamW's updates round away and the fit stalls"
    upstream = Upstream(
        repo="huggingface/transformers",
        file="",
        commit="",
        issues=(
            "huggingface/transformers#21312",
            "hp-l33/AiM#10",
            "tensorflow/tensorflow#58138",
        ),
        url="https://github.com/huggingface/transformers/pull/21312",
    )
    #: The pattern is silent: updates rounded away, the fit stalls short of float64's (a
    #: finite loss beyond the fit's tolerance), no error; torch would only raise this were a
    #: fix to mix dtypes in its matmuls.
    failure = FailureSignature(
        "RuntimeError",
        r"(m1 and m2|mat1 and mat2) to have the same dtype",
        silent=(Symptom.BEYOND_YARDSTICK,),
    )
    reference_fix = "fp32-master-weights"
    dtypes = ("bfloat16",)
    modes = ("half", "fp32")
    backends = ("eager",)
    stages = ("forward", "train", "fit")
    fit_lr = LEARNING_RATE
    sizes = (Size("small", SMALL, ""),)

    def build(self, ctx: RunContext) -> Workload:
        dims: Dims = ctx.dims
        return Workload(model=Block(dims), inputs={"x": torch.randn(dims.batch, dims.width)})

    @fix("none", rationale="torch.optim.AdamW stepping the bfloat16 weights (bf16-true)")
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return w.model(w.inputs["x"])

    @fix(
        "fp32-master-weights",
        rationale="AdamW steps float32 copies of the weights, copied back after each step",
        upstream="apex FP16_Optimizer; DeepSpeed bf16 optimizer; Lightning bf16-mixed",
        optimizer=MasterWeightsAdamW,
    )
    def fp32_master_weights(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return w.model(w.inputs["x"])

    @fix(
        "kahan-summation",
        rationale="AdamW in bfloat16 adding its update by Kahan summation (a compensation "
        "buffer keeps what each rounding dropped)",
        upstream="AnyPrecisionAdamW(use_kahan_summation=True), huggingface/transformers#21312",
        optimizer=KahanAdamW,
    )
    def kahan_summation(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return w.model(w.inputs["x"])
