"""float16 training without a GradScaler: a small loss term's gradients flush to zero."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness import Case, FailureSignature, RunContext, Symptom, Upstream, Workload, fix, register
from harness.measure.authoring.recipes import Recipe

AUX_WEIGHT = 1e-4  # an auxiliary loss, weighted down as multi-task training does


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(32, 32), nn.GELU())
        self.main = nn.Linear(32, 8)
        self.aux = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        hidden = self.trunk(x)
        return {"main": self.main(hidden), "aux": self.aux(hidden)}


def sgd(params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """Upstream's optimizer (a fit steps with AdamW unless the recipe names another)."""
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


@register
class Fp16SmallGradients(Case):
    name = "guide-fp16-small-gradients"
    title = "Guide example: float16 autocast training with no GradScaler loses small gradients"
    upstream = Upstream(repo="example/guide", file="docs/writing-a-case.md", commit="-")
    failure = FailureSignature(silent=(Symptom.BEYOND_YARDSTICK,))
    reference_fix = "none"
    dtypes = ("float16",)
    modes = ("autocast", "fp32")
    backends = ("eager",)
    stages = ("forward", "train", "fit")
    # upstream's loop: SGD, trained with a GradScaler ("dynamic") and without one ("none")
    recipe = Recipe(sgd, lr=0.05, scalers=("dynamic", "none"))

    def build(self, ctx: RunContext) -> Workload:
        x, main, aux = torch.randn(64, 32), torch.randn(64, 8), torch.randn(64, 8)
        return Workload(model=TwoHeads(), inputs={"x": x, "targets": {"main": main, "aux": aux}})

    def loss(self, output: Any, workload: Workload, ctx: RunContext) -> torch.Tensor:
        targets = workload.inputs["targets"]
        main = F.mse_loss(output["main"], targets["main"].to(output["main"].dtype))
        aux = F.mse_loss(output["aux"], targets["aux"].to(output["aux"].dtype))
        return main + AUX_WEIGHT * aux

    @fix("none", rationale="the two heads as upstream trains them")
    def none(self, w: Workload, ctx: RunContext) -> dict[str, torch.Tensor]:
        return w.model(w.inputs["x"])
