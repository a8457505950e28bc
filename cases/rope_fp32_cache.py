"""GPT-NeoX rotary cache kept in float32 by a half model promotes q and k to float32.

Upstream: huggingface/transformers 4.30, ``models/gpt_neox/modeling_gpt_neox.py``, issue
#24261 (PR #24262). ``GPTNeoXRotaryEmbedding.__init__`` builds ``cos_cached`` and
``sin_cached`` in float32 and keeps them as plain attributes, not buffers, so
``model.half()`` never casts them. ``apply_rotary_pos_emb`` multiplies the half q and k by
them: both come out float32. ``GPTNeoXAttention._attn`` then allocates its score buffer as
``torch.zeros(..., dtype=query.dtype)``, runs ``baddbmm``, the causal ``torch.where`` and
the softmax in float32, and casts the probabilities to ``value.dtype`` for the last matmul:
the output is half and nothing fails, but the attention silently ran in float32. Handed to
a kernel that wants one dtype (``F.scaled_dot_product_attention`` here, xformers'
``memory_efficient_attention`` in facebookresearch/xformers#742) the float32 q/k next to the
half v raise. timm's EVA casts the rotated tensors back (``apply_rot_embed_cat(...)
.type_as(v)``), as PR #24262 casts cos/sin to ``x.dtype``. Building the tables in half
instead (EleutherAI/gpt-neox#1003, transformers#25681: ``t = torch.arange(...,
dtype=self.inv_freq.dtype)`` after ``model.half()`` cast ``inv_freq``) rounds
``position * inv_freq`` before the ``cos``: the angles are wrong at large positions.

The block below is one GPT-NeoX attention layer (fused ``query_key_value``, full rotary,
causal, ``dense``) over a window of ``dims.tokens`` tokens at the end of a
``dims.max_positions`` (2048) token context, with ``position_ids`` given explicitly, so the
cache rows used are the ones near position 2047. The ``upstream`` size has the dimensions of
RedPajama-INCITE-3B, a GPT-NeoX checkpoint with ``rotary_pct=1.0``, which the full-head
rotation here matches; GPT-NeoX-20B (the ``GPTNeoXConfig`` defaults) rotates only a quarter
of each head (``rotary_pct=0.25``) and is not used. Its figures come from copies of the
checkpoint's config, not from the Hugging Face file itself (see ``UPSTREAM_SOURCE``).
The tables stay plain float32 attributes in every cell (nothing casts them, the float64
reference included), so every fix but ``cache-built-in-half`` rotates with the same float32
table values, and the model of every such half cell still holds them after the fix.
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
    """One attention layer's dimensions and the window of tokens it attends over."""

    batch: int
    tokens: int
    hidden: int
    heads: int
    max_positions: int
    rotary_base: int

    @property
    def head_size(self) -> int:
        return self.hidden // self.heads

    @property
    def first_position(self) -> int:
        """The window's first position: its last token sits at ``max_positions - 1``."""
        return self.max_positions - self.tokens


SMALL = Dims(batch=2, tokens=16, hidden=64, heads=4, max_positions=2048, rotary_base=10_000)
UPSTREAM = Dims(batch=2, tokens=64, hidden=2560, heads=32, max_positions=2048, rotary_base=10_000)
UPSTREAM_SOURCE = (
    "togethercomputer/RedPajama-INCITE-Base-3B-v1 config.json (GPTNeoXForCausalLM, "
    "rotary_pct=1.0 like the full-head rotation here): hidden_size=2560, "
    "num_attention_heads=32 (head 80), max_position_embeddings=2048; values read from "
    "copies of that config (lit-gpt config.py 'RedPajama-INCITE-{}-3B-v1': n_embd=2560, "
    "n_head=32, block_size=2048, rotary_percentage=1.0; an MLC chat config), not from the "
    "HF file; rotary_emb_base=10000 is GPTNeoXConfig's default, unverified in that config. "
    "Not EleutherAI/gpt-neox-20b (6144/64 heads), whose rotary_pct=0.25 rotates a quarter "
    "of each head. tokens=64 (a window ending at position 2047) and batch=2 are choices."
)

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: A fix's attention core: rotated q, k and v (B, H, N, D) -> (B, H, N, D).
Core = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class NeoXRotaryEmbedding(nn.Module):
    """transformers 4.30's ``GPTNeoXRotaryEmbedding``: the cos/sin tables are plain
    attributes built in ``__init__`` (float32); ``inv_freq`` is a buffer."""

    inv_freq: torch.Tensor

    def __init__(self, dim: int, max_positions: int, base: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))
        self.max_seq_len_cached = max_positions
        self.cos_cached, self.sin_cached = self.tables(self.inv_freq.dtype)

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` of ``position * inv_freq``, the positions made in ``dtype``."""
        t = torch.arange(self.max_seq_len_cached, device=self.inv_freq.device, dtype=dtype)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq.to(dtype))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos()[None, None, :, :], emb.sin()[None, None, :, :]

    def forward(self, x: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self.cos_cached[:, :, :seq_len].to(x.device),
            self.sin_cached[:, :, :seq_len].to(x.device),
        )


def apply_rotary_pos_emb(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """4.30's gather of the table rows at ``position_ids``, then the rotation."""
    gather = ids[:, None, :, None].repeat(1, cos.shape[1], 1, cos.shape[3])
    cos = torch.gather(cos.repeat(gather.shape[0], 1, 1, 1), 2, gather)
    sin = torch.gather(sin.repeat(gather.shape[0], 1, 1, 1), 2, gather)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class NeoXAttention(nn.Module):
    """``GPTNeoXAttention`` (rotary_pct = 1, no KV cache), inference only."""

    bias: torch.Tensor

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.hidden, self.heads, self.head_size = dims.hidden, dims.heads, dims.head_size
        self.query_key_value = nn.Linear(dims.hidden, 3 * dims.hidden)
        self.dense = nn.Linear(dims.hidden, dims.hidden)
        self.rotary_emb = NeoXRotaryEmbedding(dims.head_size, dims.max_positions, dims.rotary_base)
        #: Upstream sizes the causal table to max_positions; the window needs dims.tokens.
        n = dims.tokens
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        self.register_buffer("bias", causal.view(1, 1, n, n), persistent=False)
        self.norm_factor = dims.head_size**0.5

    def rotated_qkv(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> QKV:
        """The fused projection split per head, q and k rotated with the cached tables."""
        b, n, _ = hidden.shape
        d = self.head_size
        qkv = self.query_key_value(hidden).view(b, n, self.heads, 3 * d)
        query = qkv[..., :d].permute(0, 2, 1, 3)
        key = qkv[..., d : 2 * d].permute(0, 2, 1, 3)
        value = qkv[..., 2 * d :].permute(0, 2, 1, 3)
        cos, sin = self.rotary_emb(value, seq_len=int(position_ids.max()) + 1)
        query, key = apply_rotary_pos_emb(query, key, cos, sin, position_ids)
        return query, key, value

    def eager_attn(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """4.30's ``_attn``: scores in ``query.dtype``, softmax, probabilities to v's dtype."""
        b, h, q_len, d = query.shape
        k_len = key.shape[-2]
        causal = self.bias[:, :, k_len - q_len : k_len, :k_len]
        q2 = query.reshape(b * h, q_len, d)
        k2 = key.reshape(b * h, k_len, d)
        scores = torch.zeros(b * h, q_len, k_len, dtype=q2.dtype, device=k2.device)
        scores = torch.baddbmm(
            scores, q2, k2.transpose(1, 2), beta=1.0, alpha=1.0 / self.norm_factor
        )
        scores = scores.view(b, h, q_len, k_len)
        mask_value = torch.tensor(torch.finfo(scores.dtype).min, dtype=scores.dtype)
        scores = torch.where(causal, scores, mask_value.to(scores.device))
        weights = F.softmax(scores, dim=-1).to(value.dtype)
        return torch.matmul(weights, value)

    def merge(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, n, _ = attn.shape
        return self.dense(attn.permute(0, 2, 1, 3).reshape(b, n, self.hidden))


def run_layer(w: Workload, ctx: RunContext, core: Core) -> torch.Tensor:
    """The layer with ``core`` between the rotation and the output projection."""
    model: NeoXAttention = w.model
    q, k, v = model.rotated_qkv(w.inputs["hidden_states"], w.inputs["position_ids"])
    with ctx.attention_core():
        attn = core(q, k, v)
    return model.merge(attn)


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@register
class RopeFp32Cache(Case):
    name = "rope-fp32-cache"
    title = "GPT-NeoX RoPE cos/sin cache left in fp32 by model.half() promotes q/k to fp32"
    upstream = Upstream(
        repo="huggingface/transformers",
        file="src/transformers/models/gpt_neox/modeling_gpt_neox.py",
        commit="4.30",
        issues=(
            "huggingface/transformers#24261",
            "huggingface/transformers#24262",
            "facebookresearch/xformers#742",
            "EleutherAI/gpt-neox#1003",
            "huggingface/transformers#25681",
        ),
        url="https://github.com/huggingface/transformers/issues/24261",
    )
    failure = FailureSignature(
        error_type="RuntimeError",
        message=(
            r"Expected query, key, and value to have the same dtype, but got "
            r"query\.dtype: float,? key\.dtype: float,? "
            r"and value\.dtype: (?:struct )?c10::(?:Half|BFloat16) instead"
        ),
        # GPTNeoXAttention's own path raises nothing: its attention runs in float32
        silent=(Symptom.WIDER_DTYPE,),
    )
    reference_fix = "sdpa-type-as-v"
    devices = ("cpu", "cuda")
    dtypes = ("float16", "bfloat16")
    modes = ("half", "autocast", "half-autocast", "fp32")
    backends = ("eager", "sdpa")
    sizes = (Size("small", SMALL, "toy dimensions"), Size("upstream", UPSTREAM, UPSTREAM_SOURCE))

    def build(self, ctx: RunContext) -> Workload:
        dims: Dims = ctx.dims
        positions = torch.arange(dims.first_position, dims.max_positions).expand(dims.batch, -1)
        return Workload(
            model=NeoXAttention(dims).eval(),
            inputs={
                "hidden_states": torch.randn(dims.batch, dims.tokens, dims.hidden),
                "position_ids": positions.contiguous(),
            },
        )

    @fix(
        "none",
        rationale="neox-eager-attn: fp32 cache makes q/k fp32; baddbmm and softmax run in "
        "fp32, probabilities cast to v's dtype",
        upstream="huggingface/transformers#24261",
        backends=("eager",),
    )
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        model: NeoXAttention = w.model
        return run_layer(w, ctx, model.eager_attn)

    @fix(
        "sdpa-no-cast",
        rationale="the fp32 rotated q/k and the half v go straight to SDPA",
        upstream="facebookresearch/xformers#742",
        backends=("sdpa",),
    )
    def sdpa_no_cast(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return run_layer(w, ctx, sdpa_causal)

    @fix(
        "sdpa-type-as-v",
        rationale="rotate with the fp32 tables, then q.type_as(v), k.type_as(v) before SDPA",
        upstream="timm eva.py apply_rot_embed_cat(...).type_as(v); transformers#24262",
        backends=("sdpa",),
    )
    def sdpa_type_as_v(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return sdpa_causal(q.type_as(v), k.type_as(v), v)

        return run_layer(w, ctx, core)

    @fix(
        "cache-built-in-half",
        rationale="the tables rebuilt from the cast inv_freq with positions in its dtype "
        "(half in a half model): position * inv_freq rounded before cos/sin",
        upstream="EleutherAI/gpt-neox#1003, huggingface/transformers#25681",
        backends=("sdpa",),
    )
    def cache_built_in_half(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        rotary: NeoXRotaryEmbedding = w.model.rotary_emb
        # Rebuilding is idempotent: every call stores the same tables.
        rotary.cos_cached, rotary.sin_cached = rotary.tables(rotary.inv_freq.dtype)

        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return sdpa_causal(q.type_as(v), k.type_as(v), v)

        return run_layer(w, ctx, core)
