"""Models with silent precision bugs, each beside its healthy twin.

Each bug runs, stays finite and looks plausible in half precision, and loses far more than
rounding the weights and inputs costs; its twin is the same model with the precision-safe
form of the same computation (the form upstream libraries use). They calibrate the
tolerance rule (``benchmarks/bench_verdicts.py``) and test it (``tests/test_verdicts.py``):
a bug must never read as a plain ``passes`` where it costs more than ten times the rounding,
a twin must read as a plain ``passes`` everywhere.

The four kinds:

* **angles**: rotary angles ``position * inv_freq`` computed in the activations' dtype at
  positions around 1500 (the twin: in float64, cast after cos/sin; float32 angles, as
  Llama's RoPE computes them, are healthy in half precision but lose 190 times float32's
  rounding at these positions, so the float32 control would call them inaccurate);
* **cancellation**: a norm whose variance is ``E[x^2] - E[x]^2`` on activations of mean 40
  (the twin: ``E[(x - mean)^2]``);
* **long sum**: a linear-attention state accumulated token by token in the activations'
  dtype over 2048 tokens (the twin: a float32 cumulative sum, cast once);
* **norm underflow**: an RMSNorm whose mean square is taken in the activations' dtype on
  activations of about 1e-3, where float16's squares are subnormal (the twin: in float32,
  as transformers' ``LlamaRMSNorm``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

WIDTH = 64
HEADS = 4
HEAD_DIM = WIDTH // HEADS
BATCH = 2

Factory = Callable[[], tuple[Any, ...]]


class Rotary(nn.Module):
    """Project, rotate the features by their positions' angles, project back."""

    def __init__(self, safe: bool, first_position: int = 1500) -> None:
        super().__init__()
        self.safe = safe
        self.first_position = first_position
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def angles(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of ``position * inv_freq``, made from integers in the forward pass
        (so rounding the model's weights and inputs never touches them)."""
        start, tokens = self.first_position, like.shape[-2]
        steps = torch.arange(0, WIDTH, 2, device=like.device)
        positions = torch.arange(start, start + tokens, device=like.device)
        # the twin: float64, cast after cos/sin (float32 angles at position 1500 are off by
        # 1.8e-4 rad, 190 times what rounding costs in float32: its control would be
        # inaccurate, rightly)
        wide = torch.float64 if self.safe else like.dtype
        inv_freq = 1.0 / (10000 ** (steps.to(wide) / WIDTH))
        angles = positions.to(wide)[:, None] * inv_freq[None, :]
        return angles.cos().to(like.dtype), angles.sin().to(like.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        cos, sin = self.angles(h)
        even, odd = h[..., 0::2], h[..., 1::2]
        rotated = torch.cat((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
        return self.out(rotated)


class MeanShiftedNorm(nn.Module):
    """Activations that sit around 40 (its inputs), normalised, then projected."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.safe = safe
        self.weight = nn.Parameter(torch.ones(WIDTH))
        self.out = nn.Linear(WIDTH, WIDTH)

    def variance(self, h: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        if self.safe:
            return (h - mean).pow(2).mean(-1, keepdim=True)
        return (h * h).mean(-1, keepdim=True) - mean * mean  # cancels: both terms ~1600

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = self.variance(x, mean).clamp_min(0.0)
        return self.out((x - mean) * torch.rsqrt(var + 1e-5) * self.weight)


class RunningLinearAttention(nn.Module):
    """Causal linear attention (positive feature maps), read as a running mean of the
    key-value outer products."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.safe = safe
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        with torch.no_grad():
            self.qkv.bias[2 * WIDTH :].fill_(1.0)  # positive values: the sums grow with t
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)

    def states(self, kv: torch.Tensor) -> torch.Tensor:
        """(batch, tokens, heads, d, d): the running sums of the outer products."""
        if self.safe:
            return torch.cumsum(kv, dim=1, dtype=torch.float32).to(kv.dtype)
        state = torch.zeros_like(kv[:, 0])
        sums = []
        for t in range(kv.shape[1]):  # one add per token, each rounded to kv's dtype
            state = state + kv[:, t]
            sums.append(state)
        return torch.stack(sums, dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k, v = self.qkv(x).view(batch, tokens, 3, HEADS, HEAD_DIM).unbind(2)
        q, k = nn.functional.elu(q) + 1, nn.functional.elu(k) + 1
        states = self.states(k[..., :, None] * v[..., None, :])
        counts = torch.arange(1, tokens + 1, device=x.device).to(x.dtype)
        read = torch.einsum("bthd,bthde->bthe", q, states) / counts[None, :, None, None]
        return self.out(read.reshape(batch, tokens, WIDTH))


class SmallActivationRMSNorm(nn.Module):
    """A linear layer on small inputs (about 1e-3), RMS-normalised, projected back."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.safe = safe
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.weight = nn.Parameter(torch.ones(WIDTH))
        self.out = nn.Linear(WIDTH, WIDTH)

    def normed(self, h: torch.Tensor) -> torch.Tensor:
        if self.safe:  # as transformers' LlamaRMSNorm
            wide = h.to(torch.float32)
            return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-12)).to(h.dtype)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.normed(self.proj(x)) * self.weight)


def tokens_of(tokens: int, batch: int = BATCH, scale: float = 1.0, shift: float = 0.0) -> Any:
    def inputs() -> dict[str, torch.Tensor]:
        return {"x": torch.randn(batch, tokens, WIDTH) * scale + shift}

    return inputs


@dataclass(frozen=True)
class Pair:
    """A silent bug and its healthy twin, with what kind of bug it is."""

    kind: str
    bug: Factory
    twin: Factory


def pair(
    kind: str,
    make: Callable[[bool], nn.Module],
    inputs: Callable[[], Any],
    label: str = "silent bug",
) -> Pair:
    """A bug (``make(False)``) and its healthy twin (``make(True)``) on the same inputs,
    each a factory whose docstring says which it is (``label``: what kind of bug)."""

    def bug() -> tuple[Any, ...]:
        return make(False).eval(), inputs()

    def twin() -> tuple[Any, ...]:
        return make(True).eval(), inputs()

    bug.__doc__ = f"{label}: {kind}"
    twin.__doc__ = f"healthy twin of the {kind} {label.removeprefix('silent ')}"
    return Pair(kind, bug, twin)


#: Every silent bug with its twin, by name.
PAIRS = {
    "angles-in-half": pair("positions or angles in half precision", Rotary, tokens_of(32)),
    "variance-by-cancellation": pair("cancellation", MeanShiftedNorm, tokens_of(32, shift=40.0)),
    "state-summed-in-half": pair(
        "a long sum accumulated in half", RunningLinearAttention, tokens_of(2048, batch=1)
    ),
    "rmsnorm-underflow": pair(
        "a normalisation that loses precision", SmallActivationRMSNorm, tokens_of(32, scale=1e-3)
    ),
}
