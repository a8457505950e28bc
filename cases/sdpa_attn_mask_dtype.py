"""An additive ``attn_mask`` whose dtype is neither bool, float32 nor the query's.

Upstream: PyTorch's attention entry points, ``F.scaled_dot_product_attention`` (its input
check in ``aten/src/ATen/native/transformers/attention.cpp``) and ``nn.MultiheadAttention``
(``F.multi_head_attention_forward`` in ``torch/nn/functional.py``, which hands SDPA its
merged mask). SDPA takes a mask that is bool, float32, or the query's dtype; anything else
raises ``Expected attn_mask dtype to be bool or float or to match query dtype``.

* Comfy-Org/ComfyUI#8118: a regional-prompting node builds its attention mask in bfloat16
  while the model runs in float16 (or the other way round) and passes it to SDPA: raises.
  The fix is ``mask.to(q.dtype)`` (foundation-model-stack PR #215 moved to a bool mask).
* foundation-model-stack PR #215: ``mask = torch.ones(qlen, klen)`` (float32) with a
  bfloat16 query. SDPA accepts a float32 mask with any query dtype, so this runs.
* pytorch#99012, mlfoundations/open_clip#484: a float32 ``nn.MultiheadAttention`` (the
  open_clip text tower) with its float32 causal mask under CPU autocast. torch 2.0.0
  refused the fp32 mask once the MHA slow path moved to SDPA; the check now also takes
  float32 masks, so this runs on the torch versions tested here (2.4.1, 2.13.0).
* pytorch PR #92733, baudm/parseq#130: a bool ``key_padding_mask`` next to a float
  ``attn_mask`` (parseq's ``-inf`` triangle, built in float32) on a half
  ``nn.MultiheadAttention`` runs, with the deprecation warning "Support for mismatched
  key_padding_mask and attn_mask is deprecated".

Every fix computes the same function: causal self-attention through one
``nn.MultiheadAttention``'s weights on a right-padded batch (padded keys masked). The SDPA
fixes project with the module's ``in_proj``/``out_proj`` themselves and fold the padding
into the float mask; the MHA fixes call the module. In the float32 control the ``none``
mask is bfloat16 (the node's own dtype), so the control raises too.

Two sizes: ``SMALL`` (6 tokens) and ``UPSTREAM``, the text tower of open_clip's ViT-B-32
(width 512, 8 heads, the 77-token context) on two captions: one filling the context and a
20-token one, padded to 77 as open_clip's tokenizer pads every caption. Right padding under
a causal mask leaves key 0 visible to every query, so no row is fully masked at either size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
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
    """The attention module's dimensions and its right-padded batch."""

    batch: int
    tokens: int
    embed_dim: int
    heads: int
    #: Real tokens per sequence of the batch; the rest are right padding.
    lengths: tuple[int, ...]

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.heads


SMALL = Dims(batch=2, tokens=6, embed_dim=16, heads=2, lengths=(6, 4))
#: open_clip ViT-B-32's text tower; a caption filling the context and a 20-token one.
UPSTREAM = Dims(batch=2, tokens=77, embed_dim=512, heads=8, lengths=(77, 20))
UPSTREAM_SOURCE = (
    "mlfoundations/open_clip src/open_clip/model_configs/ViT-B-32.json @ 7bbd90e (the text "
    "tower of pytorch/pytorch#99012, open_clip#484): text_cfg width=512, heads=8 (head_dim "
    "64), context_length=77; batch 2 and caption lengths (77, 20) chosen, 20 tokens as a "
    "typical caption length UNVERIFIED"
)


def other_half(dtype: torch.dtype) -> torch.dtype:
    """The half dtype a mask built "for the other model" has: bfloat16 for a float16 model,
    float16 for a bfloat16 one (and bfloat16, the node's own choice, for anything else)."""
    return torch.float16 if dtype == torch.bfloat16 else torch.bfloat16


def causal_mask(n: int, dtype: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """The additive causal mask, ``-inf`` above the diagonal (open_clip, parseq); created
    with torch's default dtype (float32) unless ``dtype`` says otherwise."""
    return torch.triu(torch.full((n, n), float("-inf"), dtype=dtype, device=device), 1)


def padded_mask(causal: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
    """The causal mask with padded keys folded in, (B, 1, N, N), in the causal mask's dtype."""
    keys = padding[:, None, None, :]
    return causal.expand(padding.shape[0], 1, -1, -1).masked_fill(keys, float("-inf"))


class MaskedSelfAttention(nn.Module):
    """One ``nn.MultiheadAttention``, and its projections laid out for direct SDPA calls."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.dims = dims
        self.attn = nn.MultiheadAttention(dims.embed_dim, dims.heads, batch_first=True)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``in_proj`` as ``F.multi_head_attention_forward`` applies it, as (B, H, N, D)."""
        b, n, _ = x.shape
        packed = F.linear(x, self.attn.in_proj_weight, self.attn.in_proj_bias)
        heads = packed.view(b, n, 3, self.dims.heads, self.dims.head_dim)
        q, k, v = heads.permute(2, 0, 3, 1, 4).unbind(0)
        return q, k, v

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = out.shape
        merged = out.transpose(1, 2).reshape(b, n, self.dims.embed_dim)
        return self.attn.out_proj(merged)


def sdpa_attention(w: Workload, ctx: RunContext, mask_dtype: torch.dtype | None) -> torch.Tensor:
    """SDPA on the module's projections with the padded causal mask built in ``mask_dtype``
    (None: torch's default, float32)."""
    model: MaskedSelfAttention = w.model
    x, padding = w.inputs["x"], w.inputs["padding"]
    q, k, v = model.qkv(x)
    mask = padded_mask(causal_mask(x.shape[1], mask_dtype, x.device), padding)
    with ctx.attention_core():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return model.project_out(out)


@register
class SdpaAttnMaskDtype(Case):
    name = "sdpa-attn-mask-dtype"
    title = "attn_mask dtype vs query dtype at F.scaled_dot_product_attention / MHA"
    upstream = Upstream(
        repo="pytorch/pytorch",
        file="aten/src/ATen/native/transformers/attention.cpp",
        commit="v2.0.0 (pytorch#99012)",
        issues=(
            "pytorch/pytorch#99012",
            "mlfoundations/open_clip#484",
            "foundation-model-stack/foundation-model-stack#215",
            "Comfy-Org/ComfyUI#8118",
            "pytorch/pytorch#92733",
            "baudm/parseq#130",
        ),
        url="https://github.com/pytorch/pytorch/issues/99012",
    )
    failure = FailureSignature(
        error_type="RuntimeError",
        message=(
            r"Expected attn_mask dtype to be bool (?:or float )?or to match query dtype, "
            r"but got attn_mask\.dtype: (?:struct )?(?:c10::)?\w+ and\s+"
            r"query\.dtype: (?:struct )?(?:c10::)?\w+ instead"
        ),
    )
    reference_fix = "sdpa-mask-cast-to-q"
    devices = ("cpu", "cuda")
    dtypes = ("float16", "bfloat16")
    modes = ("half", "autocast", "half-autocast", "fp32")
    backends = ("sdpa",)
    sizes = (Size("small", SMALL, "toy dimensions"), Size("upstream", UPSTREAM, UPSTREAM_SOURCE))

    def build(self, ctx: RunContext) -> Workload:
        dims: Dims = ctx.dims
        padding = torch.zeros(dims.batch, dims.tokens, dtype=torch.bool)
        for row, length in enumerate(dims.lengths):
            padding[row, length:] = True
        return Workload(
            model=MaskedSelfAttention(dims).eval(),
            inputs={"x": torch.randn(dims.batch, dims.tokens, dims.embed_dim), "padding": padding},
        )

    @fix(
        "none",
        rationale="sdpa-other-half-mask: the mask is built in the other half dtype than the "
        "model's and goes to SDPA as is",
        upstream="Comfy-Org/ComfyUI#8118",
    )
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return sdpa_attention(w, ctx, other_half(ctx.dtype))

    @fix(
        "sdpa-mask-cast-to-q",
        rationale="the mask, whatever dtype it was built in, cast to the query's dtype",
        upstream="Comfy-Org/ComfyUI#8118 (mask.to(q.dtype)); fms PR #215 (a bool mask)",
    )
    def sdpa_mask_cast_to_q(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        model: MaskedSelfAttention = w.model
        x, padding = w.inputs["x"], w.inputs["padding"]
        q, k, v = model.qkv(x)
        mask = padded_mask(causal_mask(x.shape[1], other_half(ctx.dtype), x.device), padding)
        with ctx.attention_core():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))
        return model.project_out(out)

    @fix(
        "sdpa-fp32-mask",
        rationale="the mask created with torch's default dtype (float32): SDPA accepts a "
        "float32 mask with a half query",
        upstream="foundation-model-stack/foundation-model-stack#215",
    )
    def sdpa_fp32_mask(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return sdpa_attention(w, ctx, None)

    @fix(
        "mha-cpu-autocast-fp32-mask",
        rationale="the float32 module called with a float32 mask (padding folded in) under "
        "autocast, as open_clip's text tower",
        upstream="pytorch/pytorch#99012, mlfoundations/open_clip#484",
        modes=("autocast",),
    )
    def mha_cpu_autocast_fp32_mask(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        model: MaskedSelfAttention = w.model
        x, padding = w.inputs["x"], w.inputs["padding"]
        mask = padded_mask(causal_mask(x.shape[1], None, x.device), padding)
        heads = model.dims.heads
        per_head = mask.expand(-1, heads, -1, -1).reshape(-1, x.shape[1], x.shape[1])
        with ctx.attention_core():
            out, _ = model.attn(x, x, x, attn_mask=per_head, need_weights=False)
        return out

    @fix(
        "mha-bool-kpm-float-mask",
        rationale="the module called with a bool key_padding_mask and a float32 -inf causal "
        "attn_mask: runs, with the mismatched-masks deprecation warning",
        upstream="baudm/parseq#130, pytorch/pytorch#92733",
    )
    def mha_bool_kpm_float_mask(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        model: MaskedSelfAttention = w.model
        x, padding = w.inputs["x"], w.inputs["padding"]
        causal = causal_mask(x.shape[1], None, x.device)
        with ctx.attention_core():
            out, _ = model.attn(
                x, x, x, attn_mask=causal, key_padding_mask=padding, need_weights=False
            )
        return out
