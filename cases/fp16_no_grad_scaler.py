"""float16 training without a GradScaler: small gradients flush to zero, silently.

Upstream: PyTorch's AMP guide, "Gradient Scaling" (docs/source/amp.rst, and the recipe in
docs/source/notes/amp_examples.rst): "If the forward pass for a particular op has float16
inputs, the backward pass for that op will produce float16 gradients. Gradient values with
small magnitudes may not be representable in float16. These values will flush to zero
('underflow'), so the update for the corresponding parameters will be lost." Loss scaling
comes from mixed-precision training as NVIDIA introduced it (Micikevicius et al., "Mixed
Precision Training", ICLR 2018, section 3.2: with a loss scale, the gradients of a model's
small terms stay representable).

The model has a main head and an auxiliary head whose loss is weighted 1e-4 (a multi-task
weighting, a load-balancing or regularising term): under float16 autocast the auxiliary
head's activation gradients come to about 1e-7, below float16's smallest normal number
(6.1e-5) and partly below its smallest subnormal (6e-8), so its weight's gradient is mostly
lost. Nothing raises; only a gradient judged against float64 shows it. bfloat16 has
float32's range and needs no scaler. The one fix trains scaled and unscaled, two rows of
one column (its recipe's ``scalers``), where two fixes once repeated the same code. The
case runs under autocast only: the GradScaler recipe keeps float32 weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
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
from harness.measure.authoring.recipes import Recipe
from harness.measure.authoring.registry import register

#: The auxiliary loss's weight.
AUX_WEIGHT = 1e-4


@dataclass(frozen=True)
class Dims:
    batch: int
    width: int
    classes: int


SMALL = Dims(batch=64, width=64, classes=16)


class TwoHeads(nn.Module):
    """A trunk, a main head and an auxiliary head."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(dims.width, dims.width), nn.GELU())
        self.main_head = nn.Linear(dims.width, dims.classes)
        self.aux_head = nn.Linear(dims.width, dims.classes)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.trunk(x)
        return {"main": self.main_head(hidden), "aux": self.aux_head(hidden)}


@register
class Fp16NoGradScaler(Case):
    name = "fp16-no-grad-scaler"
    title = "float16 training without a GradScaler: a small loss term's gradients underflow"
    upstream = Upstream(
        repo="pytorch/pytorch",
        file="docs/source/amp.rst",
        commit="",
        issues=("Micikevicius et al. 2018, Mixed Precision Training, section 3.2",),
        url="https://pytorch.org/docs/stable/amp.html#gradient-scaling",
    )
    #: The pattern is silent: gradients flushed to zero, finite and beyond the tolerance, no
    #: error; torch would only raise this were a fix to mix dtypes in its matmuls.
    failure = FailureSignature(
        "RuntimeError",
        r"(m1 and m2|mat1 and mat2) to have the same dtype",
        silent=(Symptom.BEYOND_YARDSTICK,),
    )
    reference_fix = "none"
    #: Every cell trained as the AMP recipe trains (a GradScaler) and without it.
    recipe = Recipe(scalers=("dynamic", "none"))
    modes = ("autocast", "fp32")
    backends = ("eager",)
    stages = ("forward", "train")
    sizes = (Size("small", SMALL, ""),)

    def build(self, ctx: RunContext) -> Workload:
        dims: Dims = ctx.dims
        x = torch.randn(dims.batch, dims.width)
        targets = {
            "main": torch.randn(dims.batch, dims.classes),
            "aux": torch.randn(dims.batch, dims.classes),
        }
        return Workload(model=TwoHeads(dims), inputs={"x": x, "targets": targets})

    def loss(self, output: Any, workload: Workload, ctx: RunContext) -> Any:
        """The main head's error, and the auxiliary head's weighted 1e-4."""
        targets = workload.inputs["targets"]
        main = F.mse_loss(output["main"], targets["main"].to(output["main"].dtype))
        aux = F.mse_loss(output["aux"], targets["aux"].to(output["aux"].dtype))
        return main + AUX_WEIGHT * aux

    @fix(
        "none",
        rationale="the model trained as it is: with torch.amp.GradScaler (the AMP recipe: the "
        "loss scaled up before backward, the gradients unscaled before the step) and without",
        upstream="docs/source/notes/amp_examples.rst, Typical Mixed Precision Training",
    )
    def none(self, w: Workload, ctx: RunContext) -> dict[str, torch.Tensor]:
        return w.model(w.inputs["x"])
