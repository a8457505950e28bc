"""Stable Diffusion 2.1 attention: half ``q @ k^T * scale`` overflows float16, softmax gives NaN.

Upstream: huggingface/diffusers, ``src/diffusers/models/attention.py``, ``CrossAttention``
(0.10/0.11). Its ``get_attention_scores`` computes the logits with ``torch.baddbmm`` (an
empty input, ``beta=0``, ``alpha=scale``) in the dtype of q and k, optionally upcasts them
to float32 before the softmax (``upcast_softmax``), and casts the probabilities back to the
query's dtype for ``bmm`` with v. SD 2.1 (768 px) has attention logits beyond 65504: in a
float16 pipeline they become ``inf``, the softmax row ``inf - inf`` is NaN, and the output is
a black image with no error (diffusers#1614, InvokeAI#2329 / PR #2365). Upcasting only the
softmax is too late (the logits are already ``inf``). The fix is ``upcast_attention``
(diffusers PR #1590, the SD 2.1 UNet config): q and k go to float32 so the logit matmul and
the softmax run in float32 (Stability-AI's ``ATTN_PRECISION="fp32"`` does the same). The
later default processor, ``AttnProcessor2_0``, calls ``F.scaled_dot_product_attention``;
whether an SDPA kernel overflows in float16 depends on the kernel and the torch version
(pytorch#119131: NaNs from the math backend, not from the memory-efficient one). On the
CPU, the fused kernel of torch 2.4.1 overflows on the unscaled ``q.k``; 2.13.0's does not.

The workload is the attention core on (batch*heads, tokens, head_dim) q, k, v (``Dims``;
the ``upstream`` size is SD 2.1-768's UNet attention at its 1280-channel level: a CFG batch
of 2 times 20 heads of 64, over 24x24 = 576 latent tokens) with one large activation pair
(query token 0 and key token 3 set to ``hot``), at two scales computed by every fix:
``hot=36`` (raw ``q.k`` = 82944 exceeds 65504, the scaled logit 10368 does not) and
``hot=100`` (the scaled logit 80000 itself exceeds 65504). The output is the attention
output at both scales, compared leaf by leaf (``hot36``, ``hot100``), so a cell is judged
on both at once: one non-finite scale makes it ``inaccurate``. ``upcast-attention``
computes the logit matmul in float32 by design; in ``half`` cells the harness flags that as
drift.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from harness import Case, FailureSignature, RunContext, Size, Upstream, Workload, fix, register
from harness.measure.authoring.case import Symptom


@dataclass(frozen=True)
class Dims:
    """The attention core's q, k, v shape: (batch_heads, tokens, head_dim)."""

    batch_heads: int
    tokens: int
    #: 64 at both sizes: the hot scales' logits (below) are worked out for it.
    head_dim: int


SMALL = Dims(batch_heads=2, tokens=16, head_dim=64)
UPSTREAM = Dims(batch_heads=40, tokens=576, head_dim=64)
UPSTREAM_SOURCE = (
    "Stability-AI/stablediffusion configs/stable-diffusion/v2-inference-v.yaml (SD 2.1-768 "
    "UNet): model_channels=320, channel_mult=[1,2,4,4], num_head_channels=64, "
    "attention_resolutions=[4,2,1]; 768 px -> 96x96 latent. The 1280-channel level (ds 4) "
    "has 1280/64 = 20 heads over 24x24 = 576 tokens; a CFG batch of 2 -> batch_heads=40. "
    "Values read from a copy of the yaml (invoke-ai/InvokeAI "
    "configs/stable-diffusion/v2-inference-v.yaml @25b3be05); which level overflowed in "
    "diffusers#1614 is not stated there: unverified."
)
HOT_QUERY = 0
HOT_KEY = 3
#: Values of the large activation pair: (name of the output leaf, value).
HOT_SCALES = (("hot36", 36.0), ("hot100", 100.0))

QKV = list[torch.Tensor]


class CrossAttentionCore(nn.Module):
    """The attention math of diffusers' ``CrossAttention`` (projections left out: the
    workload's q, k, v are their outputs, already split into heads)."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.scale = dims.head_dim**-0.5

    def get_attention_scores(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        upcast_attention: bool,
        upcast_softmax: bool,
        upcast: torch.dtype,
    ) -> torch.Tensor:
        """Upstream's ``get_attention_scores``; ``upcast`` is what it means by ``.float()``."""
        dtype = query.dtype
        if upcast_attention:
            query, key = query.to(upcast), key.to(upcast)
        shape = (query.shape[0], query.shape[1], key.shape[1])
        scores = torch.baddbmm(
            torch.empty(shape, dtype=query.dtype, device=query.device),
            query,
            key.transpose(-1, -2),
            beta=0,
            alpha=self.scale,
        )
        if upcast_softmax:
            scores = scores.to(upcast)
        return scores.softmax(dim=-1).to(dtype)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        upcast_attention: bool,
        upcast_softmax: bool,
        upcast: torch.dtype,
    ) -> torch.Tensor:
        """``CrossAttentionProcessor``: probabilities, then ``bmm`` with v."""
        probs = self.get_attention_scores(query, key, upcast_attention, upcast_softmax, upcast)
        return torch.bmm(probs, value)


def hot_inputs(base: QKV, hot: float) -> QKV:
    """q, k, v with query token HOT_QUERY and key token HOT_KEY set to ``hot``."""
    query, key, value = (t.clone() for t in base)
    query[:, HOT_QUERY] = hot
    key[:, HOT_KEY] = hot
    return [query, key, value]


def eager(
    w: Workload, ctx: RunContext, upcast_attention: bool, upcast_softmax: bool
) -> dict[str, torch.Tensor]:
    model: CrossAttentionCore = w.model
    out = {}
    for leaf, _ in HOT_SCALES:
        query, key, value = w.inputs[leaf]
        with ctx.attention_core():
            out[leaf] = model(
                query, key, value, upcast_attention, upcast_softmax, ctx.upcast_dtype
            )
    return out


@register
class Fp16AttnOverflow(Case):
    name = "fp16-attn-overflow"
    title = "SD 2.1 attention logits overflow float16: inf, then NaN from the softmax"
    upstream = Upstream(
        repo="huggingface/diffusers",
        file="src/diffusers/models/attention.py",
        commit="v0.11.0",
        issues=(
            "huggingface/diffusers#1614",
            "huggingface/diffusers#1590",
            "invoke-ai/InvokeAI#2329",
            "invoke-ai/InvokeAI#2365",
            "pytorch/pytorch#119131",
        ),
        url="https://github.com/huggingface/diffusers/issues/1614",
    )
    #: The pattern is silent: the overflowed logits give NaN outputs and no error. Should a
    #: variant ever mix dtypes in its matmuls (half probabilities against float32 v, say),
    #: torch would raise this.
    failure = FailureSignature(
        "RuntimeError",
        r"expected scalar type (?:Half|BFloat16|Float) but found (?:Half|BFloat16|Float)"
        r"|expected (?:m1|mat1) and (?:m2|mat2) to have the same dtype"
        r"|Input dtypes must be the same",
        silent=(Symptom.NON_FINITE,),
    )
    reference_fix = "upcast-attention"
    devices = ("cpu", "cuda")
    dtypes = ("float16", "bfloat16")
    modes = ("half", "autocast", "half-autocast", "fp32")
    backends = ("eager",)
    sizes = (Size("small", SMALL, "toy dimensions"), Size("upstream", UPSTREAM, UPSTREAM_SOURCE))

    def build(self, ctx: RunContext) -> Workload:
        dims: Dims = ctx.dims
        base = [torch.randn(dims.batch_heads, dims.tokens, dims.head_dim) for _ in range(3)]
        inputs = {leaf: hot_inputs(base, hot) for leaf, hot in HOT_SCALES}
        return Workload(model=CrossAttentionCore(dims).eval(), inputs=inputs)

    @fix("none", rationale="logits, softmax and bmm in the model dtype (no upcast flags)")
    def none(self, w: Workload, ctx: RunContext) -> dict[str, torch.Tensor]:
        return eager(w, ctx, upcast_attention=False, upcast_softmax=False)

    @fix(
        "upcast-softmax-only",
        rationale="the half logits are upcast to fp32 for the softmax: after they overflowed",
        upstream="CrossAttention(upcast_softmax=True)",
    )
    def upcast_softmax_only(self, w: Workload, ctx: RunContext) -> dict[str, torch.Tensor]:
        return eager(w, ctx, upcast_attention=False, upcast_softmax=True)

    @fix(
        "upcast-attention",
        rationale="q and k upcast to fp32: logit matmul and softmax in fp32, probs cast back",
        upstream="diffusers PR #1590 (upcast_attention, SD 2.1 UNet config)",
    )
    def upcast_attention(self, w: Workload, ctx: RunContext) -> dict[str, torch.Tensor]:
        return eager(w, ctx, upcast_attention=True, upcast_softmax=False)

    @fix(
        "sdpa-fused",
        rationale="F.scaled_dot_product_attention on the half q, k, v with the same scale",
        upstream="diffusers AttnProcessor2_0",
    )
    def sdpa_fused(self, w: Workload, ctx: RunContext) -> dict[str, torch.Tensor]:
        model: CrossAttentionCore = w.model
        out = {}
        for leaf, _ in HOT_SCALES:
            query, key, value = (t.unsqueeze(0) for t in w.inputs[leaf])  # one batch, heads
            with ctx.attention_core():
                attn = F.scaled_dot_product_attention(query, key, value, scale=model.scale)
            out[leaf] = attn.squeeze(0)
        return out
