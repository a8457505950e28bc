"""Additive masks made of ``torch.finfo(dtype).min`` overflow to ``-inf`` in float16.

Upstream: huggingface/transformers PR #17306 ("Fix -1e4 as attn mask"), which moved the
attention masks of many models from ``-1e4`` to ``torch.finfo(dtype).min`` and, because
``finfo(float16).min`` plus any score below -16 rounds to ``-inf``, clamped the masked
scores with ``torch.max(attn_weights, torch.tensor(torch.finfo(attn_weights.dtype).min))``
before the softmax. Without the clamp, a query row whose every key is masked (the pad
token of a left-padded batch once the padding plane masks pad queries too) becomes a row
of ``-inf`` and the softmax turns it into NaN. NVIDIA-NeMo/Automodel PR #2658 hit the
other overflow: a causal plane and a padding plane, each ``finfo.min`` where it masks, are
summed, and ``min + min`` is ``-inf`` in any dtype; its fix composes the planes with
``torch.where`` (one ``finfo.min`` per cell), which still overflows once the scores are
added. pytorch#103749 and transformers PR #35647 (``_unmask_unattended``): the same mask
plus a position bias handed to SDPA as ``attn_mask`` gives fully ``-inf`` rows, on which
torch 2.4.1's CPU kernel returns NaN and later versions return zeros.

The block below is an encoder self-attention with a learned relative-position bias
(strongly negative, like the ALiBi/position bias of the repro, so the pad row's scores are
below -16), run on a left-padded batch: causal plane, padding plane, softmax, ``@ v``,
the output projection, then the masked mean pooling a sentence encoder applies. The
pooling multiplies pad positions by zero, so the garbage of the pad row does not matter
unless it is NaN, which ``0 * NaN`` carries into the pooled embedding, as in practice.

Two sizes: ``SMALL`` (3 tokens, one of them a pad) and ``UPSTREAM``, OPT-125m's attention
(the ``OPTConfig`` defaults: hidden 768, 12 heads) on a batch of 128-token sequences, the
first with 32 left pads. The bias (``BIAS_MEAN``, ``BIAS_STD``) does not depend on the size:
the scores ``q . k / sqrt(head_dim)`` stay near zero at either size, so every pad query row
still sits below -16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
from harness.measure.authoring.registry import register


@dataclass(frozen=True)
class Dims:
    """The attention block's dimensions and its left-padded batch."""

    batch: int
    tokens: int
    hidden: int
    heads: int
    #: How many left pad tokens each sequence of the batch has (the first must have one).
    left_pads: tuple[int, ...]

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


#: [pad, tok, tok] and a full sequence.
SMALL = Dims(batch=2, tokens=3, hidden=16, heads=2, left_pads=(1, 0))
#: OPT-125m's attention; 128-token sequences, the first a quarter left padding.
UPSTREAM = Dims(batch=2, tokens=128, hidden=768, heads=12, left_pads=(32, 0))
UPSTREAM_SOURCE = (
    "huggingface/transformers src/transformers/models/opt/configuration_opt.py @ 014674d "
    "(OPTConfig defaults): d_model=768, num_attention_heads=12 (head_dim 64), the "
    "facebook/opt-125m shape (that checkpoint's config.json not checked: UNVERIFIED); "
    "batch 2 of 128 tokens with left pads (32, 0) chosen, not from a config; the "
    "relative-position bias is the repro's, not OPT's"
)
#: The learned relative-position bias sits around this value (the repro's -20): the pad
#: row's scores are then below -16, where ``finfo(float16).min + score`` overflows.
BIAS_MEAN = -20.0
BIAS_STD = 1.0

#: A fix's softmax input: scores (B, H, N, N), causal plane (N, N), padding plane
#: (B, 1, N, N), both planes ``finfo(dtype).min`` where they mask, 0 elsewhere.
Logits = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class BiasedSelfAttention(nn.Module):
    """Encoder self-attention with a learned per-head relative-position bias."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.dims = dims
        hidden = dims.hidden
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)
        bias = BIAS_MEAN + BIAS_STD * torch.randn(dims.heads, 2 * dims.tokens - 1)
        self.rel_bias = nn.Parameter(bias)
        self.scale = dims.head_dim**-0.5

    def heads(self, x: torch.Tensor, proj: nn.Linear) -> torch.Tensor:
        b, n, _ = x.shape
        return proj(x).view(b, n, self.dims.heads, self.dims.head_dim).transpose(1, 2)

    def position_bias(self, n: int) -> torch.Tensor:
        """(1, H, n, n): the bias of key j for query i, ``rel_bias[:, j - i + n - 1]``."""
        pos = torch.arange(n, device=self.rel_bias.device)
        relative = pos[None, :] - pos[:, None] + n - 1
        return self.rel_bias[:, relative].unsqueeze(0)

    def finish(self, attn: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        """Merge heads, project, then the masked mean pooling over the real tokens."""
        b, _, n, _ = attn.shape
        out = self.out_proj(attn.transpose(1, 2).reshape(b, n, self.dims.hidden))
        keep = (~padding).to(out.dtype).unsqueeze(-1)
        return (out * keep).sum(dim=1) / keep.sum(dim=1)


def planes(padding: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal plane (N, N) and the 2D padding plane (B, 1, N, N), each ``finfo.min``
    where it masks: the padding plane masks pad keys and pad queries alike."""
    n = padding.shape[-1]
    low = torch.finfo(dtype).min
    causal = torch.triu(torch.full((n, n), low, dtype=dtype, device=padding.device), 1)
    pad_pair = padding[:, None, :] | padding[:, :, None]
    zeros = torch.zeros(pad_pair.shape, dtype=dtype, device=padding.device)
    return causal, zeros.masked_fill(pad_pair, low).unsqueeze(1)


def eager_attention(w: Workload, ctx: RunContext, logits: Logits) -> torch.Tensor:
    """Scores plus bias, the fix's masking, softmax in the scores' dtype, ``@ v``."""
    model: BiasedSelfAttention = w.model
    x, padding = w.inputs["x"], w.inputs["padding"]
    q, k, v = (model.heads(x, p) for p in (model.q_proj, model.k_proj, model.v_proj))
    with ctx.attention_core():
        scores = torch.matmul(q, k.transpose(-1, -2)) * model.scale
        scores = scores + model.position_bias(x.shape[1])
        causal, pad_plane = planes(padding, scores.dtype)
        probs = F.softmax(logits(scores, causal, pad_plane), dim=-1)
        attn = torch.matmul(probs, v)
    return model.finish(attn, padding)


def single_min_mask(causal: torch.Tensor, pad_plane: torch.Tensor) -> torch.Tensor:
    """The planes merged with ``masked_fill``: one ``finfo.min`` per masked cell."""
    low = torch.finfo(causal.dtype).min
    return causal.masked_fill(pad_plane.bool(), low)


@register
class MaskFinfoMinOverflow(Case):
    name = "mask-finfo-min-overflow"
    title = "finfo(dtype).min masks overflow to -inf in float16: fully masked rows turn NaN"
    upstream = Upstream(
        repo="huggingface/transformers",
        file="src/transformers/models/opt/modeling_opt.py",
        commit="4.20 (PR #17306)",
        issues=(
            "huggingface/transformers#17306",
            "NVIDIA-NeMo/Automodel#2658",
            "pytorch/pytorch#103749",
            "huggingface/transformers#35647",
        ),
        url="https://github.com/huggingface/transformers/pull/17306",
    )
    #: The pattern fails silently (NaN), never with an exception. The raised signature is
    #: its loud sibling, the reason upstream moved to finfo.min: a -1e4/-1e9 fill that a
    #: half tensor cannot hold.
    failure = FailureSignature(
        error_type="RuntimeError",
        message=(
            r"value cannot be converted to type (?:at|c10)::(?:Half|BFloat16) "
            r"without overflow"
        ),
        silent=(Symptom.NON_FINITE,),
    )
    reference_fix = "clamp-fix"
    devices = ("cpu", "cuda")
    dtypes = ("float16", "bfloat16")
    modes = ("half", "autocast", "half-autocast", "fp32")
    backends = ("eager", "sdpa")
    sizes = (Size("small", SMALL, "toy dimensions"), Size("upstream", UPSTREAM, UPSTREAM_SOURCE))

    def build(self, ctx: RunContext) -> Workload:
        dims: Dims = ctx.dims
        model = BiasedSelfAttention(dims).eval()
        padding = torch.zeros(dims.batch, dims.tokens, dtype=torch.bool)
        for row, pads in enumerate(dims.left_pads):
            padding[row, :pads] = True
        x = torch.randn(dims.batch, dims.tokens, dims.hidden)
        return Workload(model=model, inputs={"x": x, "padding": padding})

    @fix(
        "none",
        rationale="hf-add-mask: the planes merged into one finfo.min per cell, added to the "
        "scores with no clamp (float16: the pad row's min + score is -inf, softmax NaN)",
        upstream="huggingface/transformers#17306 (the masks before its clamp)",
        backends=("eager",),
    )
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        def logits(s: torch.Tensor, causal: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
            return s + single_min_mask(causal, pad)

        return eager_attention(w, ctx, logits)

    @fix(
        "sum-two-planes",
        rationale="causal and padding planes summed: min + min is -inf where both mask",
        upstream="NVIDIA-NeMo/Automodel#2658 (the bug)",
        backends=("eager",),
    )
    def sum_two_planes(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        def logits(s: torch.Tensor, causal: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
            return s + (causal + pad)

        return eager_attention(w, ctx, logits)

    @fix(
        "clamp-fix",
        rationale="torch.max(scores + mask, finfo.min) before the softmax: no -inf survives",
        upstream="huggingface/transformers#17306",
        backends=("eager",),
    )
    def clamp_fix(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        def logits(s: torch.Tensor, causal: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
            low = torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype, device=s.device)
            return torch.max(s + (causal + pad), low)

        return eager_attention(w, ctx, logits)

    @fix(
        "where-fix",
        rationale="planes composed with torch.where (one finfo.min per cell); adding the "
        "scores still overflows in float16",
        upstream="NVIDIA-NeMo/Automodel#2658 (the fix)",
        backends=("eager",),
    )
    def where_fix(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        def logits(s: torch.Tensor, causal: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
            zero = torch.zeros((), dtype=s.dtype, device=s.device)
            low = torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype, device=s.device)
            return s + torch.where((causal == 0) & (pad == 0), zero, low)

        return eager_attention(w, ctx, logits)

    @fix(
        "sdpa-mask-plus-bias",
        rationale="the single-min mask plus the position bias as SDPA's attn_mask (float16: "
        "masked cells are -inf, the pad row fully so)",
        upstream="pytorch/pytorch#103749, huggingface/transformers#35647",
        backends=("sdpa",),
    )
    def sdpa_mask_plus_bias(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        model: BiasedSelfAttention = w.model
        x, padding = w.inputs["x"], w.inputs["padding"]
        q, k, v = (model.heads(x, p) for p in (model.q_proj, model.k_proj, model.v_proj))
        causal, pad_plane = planes(padding, q.dtype)
        mask = single_min_mask(causal, pad_plane) + model.position_bias(x.shape[1])
        with ctx.attention_core():
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=model.scale)
        return model.finish(attn, padding)
