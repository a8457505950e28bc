"""Dia decoder self-attention: float32 query against half K/V from the KV cache.

Upstream: nari-labs/dia, ``dia/layers.py`` and ``dia/state.py`` at d4790dd; issues #108,
#113, #158. ``DecoderLayer`` builds ``pre_sa_norm = RMSNorm(..., dtype=torch.float32)``
while the projections (``DenseGeneral``, a tensordot that returns its input's dtype), the
embeddings and the decoder's self-attention ``KVCache`` are in ``compute_dtype``. Where an
fp32-weight RMSNorm given half input returns float32 (torch 2.4.1), the query is float32:
``DenseGeneral`` and RoPE (``sin``/``cos`` cast to the input dtype) keep it so. Prefill runs
SDPA on the fresh float32 K/V and only writes the cache; the first decode step gets
``cache.update()``'s half slices and ``F.scaled_dot_product_attention`` refuses the mix.

The block below is one decoder self-attention sublayer as upstream runs it for inference:
a CFG pair (batch 2), GQA heads, RoPE, ``scale=1.0``, causal prefill of ``dims.prefill``
tokens, then ``dims.decode`` single-token steps through ``cache.update()``. The output
compared is the self-attention output (``o_proj``, before the residual add) of prefill and
decode steps, concatenated along the sequence. Two departures, neither touching dtypes: the cache's
``prefill`` sets ``current_idx`` to the prefill length (the next write goes after it), and
on torch without SDPA's ``enable_gqa`` (< 2.5) K/V heads are repeated before the call.

No ``train`` stage: the failure needs the KV cache, which only generation has. A training
forward (teacher forcing over the whole sequence) computes K and V from the same
``pre_sa_norm`` output as the query and attends to them directly, so q, k and v always share a
dtype and the refusal cannot arise (it is the prefill step, which passes on every release);
a train cell would measure a different code path, not
this pattern's. The repository ships inference code (``dia/model.py``'s ``generate``, the
app and the CLI); no training script was found in what was read.
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
    Upstream,
    Workload,
    fix,
)
from harness.measure.authoring.registry import register


@dataclass(frozen=True)
class Dims:
    """The sublayer's dimensions and the tokens one generation step sees."""

    #: Upstream's CFG pair: unconditional and conditional.
    batch: int
    embed_dim: int
    query_heads: int
    kv_heads: int
    head_dim: int
    prefill: int
    decode: int


SMALL = Dims(batch=2, embed_dim=128, query_heads=4, kv_heads=2, head_dim=32, prefill=12, decode=4)
#: Dia-1.6B's decoder; a 43-frame audio prompt (about half a second at 86 frames per second)
#: and 8 decode steps: real dimensions, a short generation (float16 on a CPU is slow).
UPSTREAM = Dims(
    batch=2, embed_dim=2048, query_heads=16, kv_heads=4, head_dim=128, prefill=43, decode=8
)
UPSTREAM_SOURCE = (
    "nari-labs/dia dia/config.py @ d4790dd (DecoderConfig), values from the config.json of "
    "nari-labs/Dia-1.6B: decoder n_embd=2048, gqa_query_heads=16, kv_heads=4, "
    "gqa_head_dim=128; CFG batch of 2 from dia/model.py; prompt and decode lengths chosen"
)
NORM_EPS = 1e-5
ROPE_MIN_TIMESCALE = 1
ROPE_MAX_TIMESCALE = 10_000
#: Upstream calls SDPA with ``scale=1.0``; the query weights are scaled so that logits
#: have a standard deviation of about LOGIT_GAIN (peaked rows, nothing near overflow).
LOGIT_GAIN = 2.0

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: How a fix lines up q, k, v (and the cache dtype) right before SDPA.
Align = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.dtype], QKV]


class DenseGeneral(nn.Module):
    """Upstream's flax-style projection: tensordot in the weight dtype, input dtype out."""

    def __init__(self, in_shapes: tuple[int, ...], out_features: tuple[int, ...]) -> None:
        super().__init__()
        self.axis = tuple(range(-len(in_shapes), 0))
        self.weight = nn.Parameter(torch.empty(in_shapes + out_features))
        nn.init.normal_(self.weight, std=torch.Size(in_shapes).numel() ** -0.5)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        norm_axis = tuple(ax + inputs.ndim for ax in self.axis)
        contract = tuple(range(len(norm_axis)))
        output = torch.tensordot(
            inputs.to(self.weight.dtype), self.weight, dims=(norm_axis, contract)
        )
        return output.to(inputs.dtype)


class RotaryEmbedding(nn.Module):
    """Upstream's RoPE over halves of the head dim, with an fp32 ``timescale`` buffer."""

    timescale: torch.Tensor

    def __init__(self, embedding_dims: int) -> None:
        super().__init__()
        fraction = 2.0 * torch.arange(0, embedding_dims // 2) / embedding_dims
        ratio = ROPE_MAX_TIMESCALE / ROPE_MIN_TIMESCALE
        self.register_buffer("timescale", ROPE_MIN_TIMESCALE * ratio**fraction, persistent=False)

    def sin_cos(self, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sinusoid_inp = position.unsqueeze(-1).unsqueeze(-1) / self.timescale
        return torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)

    def forward(self, inputs: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """d4790dd: ``sin``/``cos`` cast to the input dtype, which the output keeps."""
        sin, cos = (t.to(inputs.dtype) for t in self.sin_cos(position))
        first, second = torch.chunk(inputs, 2, dim=-1)
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)

    def forward_upcast(
        self, inputs: torch.Tensor, position: torch.Tensor, up: torch.dtype, out: torch.dtype
    ) -> torch.Tensor:
        """4a9e29b: rotate in fp32 (``up``), return ``compute_dtype`` (``out``)."""
        sin, cos = self.sin_cos(position)
        first, second = torch.chunk(inputs.to(up), 2, dim=-1)
        first_part = (first * cos - second * sin).to(out)
        second_part = (second * cos + first * sin).to(out)
        return torch.cat((first_part, second_part), dim=-1)


class SelfAttention(nn.Module):
    """The decoder's GQA self-attention projections and RoPE, laid out as upstream."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.num_gqa_groups = dims.query_heads // dims.kv_heads
        self.q_proj = DenseGeneral((dims.embed_dim,), (dims.query_heads, dims.head_dim))
        self.k_proj = DenseGeneral((dims.embed_dim,), (dims.kv_heads, dims.head_dim))
        self.v_proj = DenseGeneral((dims.embed_dim,), (dims.kv_heads, dims.head_dim))
        self.o_proj = DenseGeneral((dims.query_heads, dims.head_dim), (dims.embed_dim,))
        self.rotary_emb = RotaryEmbedding(dims.head_dim)
        with torch.no_grad():
            self.q_proj.weight.mul_(LOGIT_GAIN * dims.head_dim**-0.5)


class DecoderSelfAttentionBlock(nn.Module):
    """``DecoderLayer``'s self-attention sublayer: the fp32 ``pre_sa_norm``, then attention."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.pre_sa_norm = nn.RMSNorm(dims.embed_dim, eps=NORM_EPS, dtype=torch.float32)
        self.self_attention = SelfAttention(dims)
        with torch.no_grad():
            self.pre_sa_norm.weight.uniform_(0.5, 1.5)


class KVCache:
    """Upstream's preallocated self-attention cache in ``compute_dtype``."""

    def __init__(self, dims: Dims, max_len: int, dtype: torch.dtype, device: torch.device):
        shape = (dims.batch, dims.kv_heads, max_len, dims.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.current_idx = 0

    def prefill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        prefill_len = k.shape[2]
        self.k[:, :, :prefill_len, :] = k
        self.v[:, :, :prefill_len, :] = v
        self.current_idx = prefill_len

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k[:, :, self.current_idx : self.current_idx + 1, :] = k
        self.v[:, :, self.current_idx : self.current_idx + 1, :] = v
        self.current_idx += 1
        return self.k[:, :, : self.current_idx, :], self.v[:, :, : self.current_idx, :]


@dataclass(frozen=True)
class Variant:
    """What a fix changes in the upstream step; the defaults are the d4790dd code."""

    #: 4a9e29b: ``pre_sa_norm(x).to(compute_dtype)``.
    norm_out: torch.dtype | None = None
    #: 4a9e29b: RoPE rotates in the first dtype and returns the second.
    rope: tuple[torch.dtype, torch.dtype] | None = None
    align: Align | None = None


def keep_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _: torch.dtype) -> QKV:
    return q, k, v


def cast_kv_to_q(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, _: torch.dtype) -> QKV:
    """PR #45: ``target_dtype = q.dtype; k = k.to(target_dtype); v = v.to(target_dtype)``."""
    return q, k.to(q.dtype), v.to(q.dtype)


def cast_qkv_to_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.dtype
) -> QKV:
    """#158: bring q, k and v to the KV cache's dtype."""
    return q.to(cache), k.to(cache), v.to(cache)


def sdpa_supports_gqa() -> bool:
    return "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int, causal: bool
) -> torch.Tensor:
    """Upstream's SDPA call (``scale=1.0``, ``enable_gqa``), with a GQA shim for torch < 2.5."""
    if groups == 1:
        return F.scaled_dot_product_attention(q, k, v, scale=1.0, is_causal=causal)
    if sdpa_supports_gqa():
        return F.scaled_dot_product_attention(
            q, k, v, scale=1.0, is_causal=causal, enable_gqa=True
        )
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, scale=1.0, is_causal=causal)


def rotate(
    attn: SelfAttention, x: torch.Tensor, position: torch.Tensor, variant: Variant
) -> torch.Tensor:
    if variant.rope is None:
        return attn.rotary_emb(x, position)
    return attn.rotary_emb.forward_upcast(x, position, *variant.rope)


def self_attention_step(
    model: DecoderSelfAttentionBlock,
    x: torch.Tensor,
    position: torch.Tensor,
    cache: KVCache,
    variant: Variant,
    ctx: RunContext,
) -> torch.Tensor:
    """One prefill (``x`` longer than one token) or decode step of the sublayer."""
    prefill = x.shape[1] > 1
    x_norm = model.pre_sa_norm(x)
    if variant.norm_out is not None:
        x_norm = x_norm.to(variant.norm_out)
    attn = model.self_attention
    original_dtype = x_norm.dtype
    q = rotate(attn, attn.q_proj(x_norm), position, variant).transpose(1, 2)
    k = rotate(attn, attn.k_proj(x_norm), position, variant).transpose(1, 2)
    v = attn.v_proj(x_norm).transpose(1, 2)
    if prefill:
        attn_k, attn_v = k, v
        cache.prefill(attn_k, attn_v)
    else:
        attn_k, attn_v = cache.update(k, v)
    q, attn_k, attn_v = (variant.align or keep_dtypes)(q, attn_k, attn_v, cache.k.dtype)
    with ctx.attention_core():
        out = sdpa(q, attn_k, attn_v, attn.num_gqa_groups, causal=prefill)
    return attn.o_proj(out.transpose(1, 2).contiguous()).to(original_dtype)


def run_decoder(w: Workload, ctx: RunContext, variant: Variant) -> torch.Tensor:
    """Prefill, then single-token decode steps; the sublayer outputs along the sequence.
    The KV cache is in ``compute_dtype``, the dtype the decoder's input was given in."""
    model: DecoderSelfAttentionBlock = w.model
    x: torch.Tensor = w.inputs["x"]
    dims: Dims = ctx.dims
    tokens = dims.prefill + dims.decode
    cache = KVCache(dims, tokens, x.dtype, x.device)
    positions = torch.arange(tokens, device=x.device).unsqueeze(0).expand(x.shape[0], -1)
    steps = [slice(0, dims.prefill)] + [slice(t, t + 1) for t in range(dims.prefill, tokens)]
    outputs = [
        self_attention_step(model, x[:, step], positions[:, step], cache, variant, ctx)
        for step in steps
    ]
    return torch.cat(outputs, dim=1)


#: Upstream runs Dia in ``compute_dtype`` with no autocast; users also wrap it in autocast.
HALF_MODES = ("half", "half-autocast")


@register
class DiaSdpaKvCache(Case):
    name = "dia-sdpa-kv-cache"
    title = "Dia decoder: fp32 RMSNorm makes the query float32, the KV cache stays half"
    upstream = Upstream(
        repo="nari-labs/dia",
        file="dia/layers.py",
        commit="d4790dd911311481ee98739ca5071b3822f9bd82",
        issues=("nari-labs/dia#108", "nari-labs/dia#113", "nari-labs/dia#158"),
        url="https://github.com/nari-labs/dia/issues/108",
    )
    failure = FailureSignature(
        error_type="RuntimeError",
        message=(
            r"Expected query, key, and value to have the same dtype, but got "
            r"query\.dtype: float,? key\.dtype: (?:struct )?c10::(?:Half|BFloat16),? "
            r"and value\.dtype: (?:struct )?c10::(?:Half|BFloat16) instead"
        ),
    )
    reference_fix = "norm-to-compute-dtype"
    #: Dia builds its norms with ``nn.RMSNorm``, new in torch 2.4.
    min_torch = "2.4"
    devices = ("cpu", "cuda")
    dtypes = ("float16", "bfloat16")
    modes = (*HALF_MODES, "fp32")
    backends = ("sdpa",)
    #: Upstream builds the norm with ``dtype=torch.float32``; the RoPE timescale is fp32.
    keep_fp32 = ("pre_sa_norm", "self_attention.rotary_emb")
    sizes = (Size("small", SMALL, "toy dimensions"), Size("upstream", UPSTREAM, UPSTREAM_SOURCE))

    def build(self, ctx: RunContext) -> Workload:
        dims: Dims = ctx.dims
        model = DecoderSelfAttentionBlock(dims).eval()
        x = torch.randn(dims.batch, dims.prefill + dims.decode, dims.embed_dim)
        return Workload(model=model, inputs={"x": x})

    @fix("none", rationale="upstream d4790dd: fp32 pre_sa_norm, KV cache in compute_dtype")
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return run_decoder(w, ctx, Variant())

    @fix(
        "cast-kv-to-q",
        rationale="cast the cached K/V to the query's dtype right before SDPA",
        upstream="nari-labs/dia PR #45 (9d0e434)",
        modes=HALF_MODES,
    )
    def cast_kv_to_q(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return run_decoder(w, ctx, Variant(align=cast_kv_to_q))

    @fix(
        "cast-qkv-to-cache",
        rationale="cast q, k and v to the KV cache's dtype before SDPA",
        upstream="nari-labs/dia#158",
        modes=HALF_MODES,
    )
    def cast_qkv_to_cache(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return run_decoder(w, ctx, Variant(align=cast_qkv_to_cache))

    @fix(
        "norm-to-compute-dtype",
        rationale="norm output cast to compute_dtype; RoPE rotates in fp32, returns compute_dtype",
        upstream="nari-labs/dia 4a9e29b (PR #127)",
        modes=HALF_MODES,
    )
    def norm_to_compute_dtype(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        compute = ctx.compute_dtype
        variant = Variant(norm_out=compute, rope=(ctx.upcast_dtype, compute))
        return run_decoder(w, ctx, variant)

    @fix(
        "fp32",
        rationale="run the model, its inputs and the KV cache in float32; output stays float32",
        modes=HALF_MODES,
    )
    def fp32(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        up = ctx.upcast_dtype
        model: DecoderSelfAttentionBlock = w.model.to(dtype=up)
        return run_decoder(
            Workload(model=model, inputs={"x": w.inputs["x"].to(up)}), ctx, Variant()
        )
