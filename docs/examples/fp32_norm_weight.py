"""An RMSNorm whose weight stays float32 in a half model feeds a half Linear."""

from __future__ import annotations

import torch
from torch import nn

from harness import Case, FailureSignature, RunContext, Upstream, Workload, fix, register


class RMSNorm(nn.Module):
    """LLaMA-style RMSNorm: normalise in fp32, scale by the weight."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, cast_back: bool) -> torch.Tensor:
        hidden = x.float()
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
        out = self.weight * hidden.to(x.dtype)  # an fp32 weight makes this fp32
        return out.to(x.dtype) if cast_back else out


class Block(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.norm = RMSNorm(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cast_back: bool = False) -> torch.Tensor:
        return self.proj(self.norm(x, cast_back))


@register
class Fp32NormWeight(Case):
    name = "guide-fp32-norm-weight"
    title = "Guide example: an fp32 norm weight in a half model promotes the activations"
    upstream = Upstream(repo="example/guide", file="docs/writing-a-case.md", commit="-")
    failure = FailureSignature(
        "RuntimeError", r"mat1 and mat2 must have the same dtype|expected .* same dtype"
    )
    reference_fix = "cast-back"
    devices = ("cpu", "cuda")
    modes = ("half", "half-autocast", "autocast", "fp32")
    backends = ("eager",)
    keep_fp32 = ("norm",)  # as transformers' _keep_in_fp32_modules would

    def build(self, ctx: RunContext) -> Workload:
        return Workload(model=Block().eval(), inputs={"x": torch.randn(4, 16, 64)})

    @fix("none", rationale="the norm's fp32 output goes straight into the half Linear")
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return w.model(w.inputs["x"])

    @fix("cast-back", rationale="the norm returns its input's dtype")
    def cast_back(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return w.model(w.inputs["x"], cast_back=True)
