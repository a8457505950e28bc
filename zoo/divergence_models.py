"""Models for the divergence profile's acceptance (issue 40): a bug injected at a chosen
depth of a healthy model, which the profile must name exactly, and the healthy twin, which
passes and is never profiled.

**The pre-norm transformer** (:func:`transformer`), written the way people write one: blocks
of a LayerNorm, multi-head self-attention with rotary positions (RoPE at positions 3000 and
up, its angles in float32 outside autocast, as Llama computes them), a residual add, a
LayerNorm, a GELU MLP, a residual add; a final LayerNorm. Widths are small (16 wide, 2
heads, 8 tokens, batch 2) so the 48-layer model's forward takes milliseconds on a CPU. Each
bug comes with what makes it a bug (:class:`Bug`), which its healthy twin has too, and
which the twin passes with: an input around 100 (``OFFSET``), as activations with a large
shared mean are, or a ``hot`` block, whose query and key biases of 100 make ``q . k`` about
80000, beyond float16's 65504 unless scaled first (and attention peaked, so where a query
looks depends on its rotary angle). The bugs, each in the block at ``depth`` alone:

* ``cancelling-variance`` (input around 100): that block's first norm takes its variance
  as ``E[x^2] - E[x]^2``, which cancels in half (float16's spacing at 10000 is 8, bfloat16's
  64; the variance is a few units, at 40 the deeper blocks' variance outgrew float16's
  spacing and the bug cost less than the tolerance of 48 layers); the module named:
  ``blocks.D.norm1`` (:class:`LayerNorm`);
* ``logits-scaled-after`` (hot): that block's attention scales its logits after the product,
  ``(q @ k^T) * scale``, so the hot block's 80000 overflows float16 (bfloat16 holds it: no
  bug there); the module named: ``blocks.D.attn`` (:class:`Attention`);
* ``half-positions`` (hot): that block's rotary positions are a float buffer, which ``.half()``
  rounds with the model (float16 holds integers exactly to 2048, bfloat16 to 256: position
  3001 becomes 3000 in float16, 3008 in bfloat16); the module named: ``blocks.D.attn.rope``
  (:class:`Rotary`). The rounding yardstick leaves such a buffer as it is (it holds
  counts), so it never reproduces the bug.

**A real model** (:func:`gpt2_with_cancelling_norm`): transformers' GPT-2, 12 layers, built
from its config with random weights (nothing downloaded), fed embeddings around 100 (its
pre-norm residual stream keeps that mean), with one layer's ``ln_1`` made a
:class:`CancellingLayerNorm` (its class swapped on the instance, the way a patched norm
enters a model). Imports transformers only when called.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@contextmanager
def one_thread() -> Iterator[None]:
    """torch on one thread while it lasts, as a ``check`` worker runs a cell (float16 on two
    threads of a shared CPU is many times slower), the thread count restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


WIDTH, HEADS, TOKENS, BATCH = 16, 2, 8, 2
HEAD_DIM = WIDTH // HEADS
#: The shared mean of the input, which the pre-norm residual stream keeps: at 100, ``x * x``
#: (10000) is where float16's spacing (8) is beyond the variance of every block's input.
OFFSET = 100.0
#: The hot block's query and key bias: ``q . k`` about ``HEAD_DIM * 100**2`` = 80000.
HOT_BIAS = 100.0
#: The first rotary position: beyond 2048, where float16 stops holding every integer.
FIRST_POSITION = 3000


@dataclass(frozen=True)
class Bug:
    """Where a bug is (the module's path under ``blocks.D``, its class) and what makes it a
    bug, which its healthy twin has too: the input's shared mean, and whether the block at
    its depth is hot."""

    module: str
    kind: str
    offset: float = 0.0
    hot: bool = False


BUGS: dict[str, Bug] = {
    "cancelling-variance": Bug("norm1", "LayerNorm", offset=OFFSET),
    "logits-scaled-after": Bug("attn", "Attention", hot=True),
    "half-positions": Bug("attn.rope", "Rotary", hot=True),
}

Factory = Callable[[], tuple[Any, ...]]


class LayerNorm(nn.Module):
    """LayerNorm as people write it; ``cancelling``: the variance as ``E[x^2] - E[x]^2``."""

    def __init__(self, width: int = WIDTH, cancelling: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))
        self.cancelling = cancelling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        if self.cancelling:
            var = (x * x).mean(-1, keepdim=True) - mean * mean
        else:
            var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * self.weight + self.bias


class Rotary(nn.Module):
    """Rotary position embedding of queries and keys at positions from ``FIRST_POSITION``,
    the angles Llama's: ``inv_freq`` and the positions in float32, outside autocast.
    ``half_positions``: the positions a float buffer (``.half()`` rounds it), else an
    integer one (``.half()`` leaves it alone)."""

    positions: torch.Tensor

    def __init__(
        self, half_positions: bool = False, tokens: int = TOKENS, head_dim: int = HEAD_DIM
    ) -> None:
        super().__init__()
        positions = torch.arange(FIRST_POSITION, FIRST_POSITION + tokens)
        self.register_buffer("positions", positions.float() if half_positions else positions)
        self.head_dim = head_dim

    def angles(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        steps = torch.arange(0, self.head_dim, 2, device=like.device, dtype=torch.int64)
        inv_freq = 1.0 / (10000 ** (steps.float() / self.head_dim))
        with torch.autocast(like.device.type, enabled=False):
            angles = self.positions.float()[:, None] * inv_freq[None, :]
            return angles.cos().to(like.dtype), angles.sin().to(like.dtype)

    def rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.cat((even * cos - odd * sin, even * sin + odd * cos), dim=-1)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.angles(q)
        return self.rotated(q, cos, sin), self.rotated(k, cos, sin)


class Attention(nn.Module):
    """Multi-head self-attention with RoPE; ``hot``: query and key biases of ``HOT_BIAS``;
    ``scaled_after``: the logits scaled after ``q @ k^T`` (else the queries before it)."""

    def __init__(
        self,
        hot: bool = False,
        scaled_after: bool = False,
        half_positions: bool = False,
        width: int = WIDTH,
        tokens: int = TOKENS,
    ) -> None:
        super().__init__()
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.head_dim = width // HEADS
        self.rope = Rotary(half_positions, tokens, self.head_dim)
        self.scaled_after = scaled_after
        if hot:
            with torch.no_grad():
                self.q.bias.add_(HOT_BIAS)
                self.k.bias.add_(HOT_BIAS)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, HEADS, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.rope(self.heads(self.q(x)), self.heads(self.k(x)))
        v = self.heads(self.v(x))
        scale = self.head_dim**-0.5
        if self.scaled_after:
            logits = (q @ k.transpose(-1, -2)) * scale
        else:
            logits = (q * scale) @ k.transpose(-1, -2)
        mixed = logits.softmax(-1) @ v
        b, _, n, _ = mixed.shape
        return self.out(mixed.transpose(1, 2).reshape(b, n, HEADS * self.head_dim))


class Mlp(nn.Module):
    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """A pre-LayerNorm transformer block."""

    def __init__(self, norm1: LayerNorm, attn: Attention, width: int = WIDTH) -> None:
        super().__init__()
        self.norm1 = norm1
        self.attn = attn
        self.norm2 = LayerNorm(width)
        self.mlp = Mlp(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, blocks: list[Block], width: int = WIDTH) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.norm = LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def block(bug: str | None, hot: bool, width: int = WIDTH, tokens: int = TOKENS) -> Block:
    """One block, with ``bug`` in it (None: healthy), ``hot`` or not."""
    return Block(
        LayerNorm(width, cancelling=bug == "cancelling-variance"),
        Attention(
            hot=hot,
            scaled_after=bug == "logits-scaled-after",
            half_positions=bug == "half-positions",
            width=width,
            tokens=tokens,
        ),
        width,
    )


def transformer(
    layers: int,
    bug: str,
    depth: int,
    healthy: bool = False,
    width: int = WIDTH,
    tokens: int = TOKENS,
) -> Factory:
    """A factory of the ``layers``-deep model with ``bug`` in the block at ``depth``, or,
    ``healthy``, its twin: what makes it a bug (:class:`Bug`) without the bug's code;
    ``width`` and ``tokens`` its residual stream's (the bugs are calibrated at the
    defaults: a wider model's numbers are its own)."""
    if bug not in BUGS:
        raise ValueError(f"unknown bug {bug!r} (known: {', '.join(BUGS)})")
    spec = BUGS[bug]

    def factory() -> tuple[Any, ...]:
        blocks = [
            block(None if healthy or i != depth else bug, spec.hot and i == depth, width, tokens)
            for i in range(layers)
        ]
        inputs = {"x": torch.randn(BATCH, tokens, width) + spec.offset}
        return Transformer(blocks, width), inputs

    return factory


def injected(bug: str, depth: int) -> str:
    """The path of the module ``bug`` is in, at ``depth``: what the profile must name."""
    return f"blocks.{depth}.{BUGS[bug].module}"


# -- a real model ------------------------------------------------------------------------

GPT2_LAYERS, GPT2_WIDTH, GPT2_TOKENS = 12, 64, 16


class CancellingLayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose variance is ``E[x^2] - E[x]^2``, in the activations' dtype:
    the bug, swapped in for one layer's norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean
        normed = (x - mean) / torch.sqrt(var + self.eps)
        return normed * self.weight + self.bias


def embedded_logits(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    return model(**inputs, use_cache=False).logits


def gpt2_with_cancelling_norm(layer: int | None) -> Factory:
    """A factory of GPT-2 (pre-LayerNorm, GELU MLP, learned positions), 12 layers, 64
    wide, fed embeddings around ``OFFSET``; ``layer``: the layer whose ``ln_1`` cancels
    (None: the healthy model)."""

    def factory() -> tuple[Any, ...]:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=128, n_positions=64, n_embd=GPT2_WIDTH, n_layer=GPT2_LAYERS, n_head=4,
            n_inner=4 * GPT2_WIDTH, bos_token_id=0, eos_token_id=0, use_cache=False,
        )  # fmt: skip
        config._attn_implementation = "sdpa"
        model = GPT2LMHeadModel(config).eval()
        if layer is not None:
            model.transformer.h[layer].ln_1.__class__ = CancellingLayerNorm
        embeds = torch.randn(BATCH, GPT2_TOKENS, GPT2_WIDTH) + OFFSET
        return model, {"inputs_embeds": embeds}, embedded_logits

    return factory


def gpt2_injected(layer: int) -> str:
    """The path of the norm :func:`gpt2_with_cancelling_norm` swaps at ``layer``."""
    return f"transformer.h.{layer}.ln_1"
