"""VAR: the l2-normalised query is promoted to fp32 before FlashAttention.

Upstream: FoundationVision/VAR, ``models/basic_var.py``, ``SelfAttention.forward`` with
``attn_l2_norm=True`` (issue #30, fixed by 74138aa). ``scale_mul`` is computed from the fp32
Parameter ``scale_mul_1H11``, so ``q = F.normalize(q, dim=-1).mul(scale_mul)`` is fp32 while
``qkv`` is half (under autocast, and on CUDA ``F.normalize`` itself returns fp32). Before
74138aa the fp32 q went straight to ``flash_attn_func``, which refuses it with
``FlashAttention only support fp16 and bf16 data type``. The SDPA fallback (``slow_attn``)
has no such contract. The model below follows the upstream forward: ``mat_qkv`` with
``q_bias``/``zero_k_bias``/``v_bias``, normalise-and-scale, the inference KV cache over
VAR's growing scales, the attention kernel, ``proj``. The ``small`` size runs three scales
of a narrow model; ``upstream`` is VAR-d16 (width 1024, 16 heads) over all ten of VAR's
scales (680 tokens), batch 2 (one class label and its CFG twin).

The ``flash-attn`` backend runs the real kernel (:mod:`harness.measure.host.flash_kernels`):
flash-attn 2 where it is installed, else flash-attn 4 on sm90+, which refuses the same fp32 query
with its own assertion (``q, k, v, and qv must have the same dtype``; all-fp32 inputs:
``inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2``). Where neither runs,
the ``flash-attn-contract`` backend (:mod:`harness.measure.host.flash_contract`) enforces
flash-attn 2's input checks and messages and computes with SDPA; its outcomes come from that
contract, not from the real kernel.

Training (the ``train`` stage, on the ``sdpa`` backend only): ``VAR.forward`` (models/var.py)
teacher-forces every scale at once with a block-causal ``attn_bias`` (``d >= dT``: a token
sees its own and the earlier scales), no KV cache, and casts the tokens and the mask to
``main_type`` (``torch.matmul(temp, temp).dtype``: float16 under float16 autocast). Upstream's
``using_flash`` needs ``attn_bias is None``, so training never calls ``flash_attn_func``: it
goes to xformers' ``memory_efficient_attention`` where xformers is installed (issue #27, the
training twin, fixed by bd84ce5 and 2236c79 with the same ``.to(main_type)``; this harness
has no xformers backend) and to SDPA otherwise, which accepts the promoted q under autocast.
The flash backends' train cells are skipped with that reason; on SDPA ``none`` and
``cast-to-main-type`` are the same code (74138aa cast only before the fused kernels), and the
train cells measure what the fp32 q costs the gradients against ``normalize-in-half``.
Measured (CPU, small, torch 2.13.0 and 2.4.1): every train cell passes, on both releases; the
promoted q costs nothing measurable there: in float16 autocast the largest gradient error is
1.61e-3 (``grad.q_bias``) for every fix on 2.13.0, and on 2.4.1 1.25e-3 for ``none`` and
``cast-to-main-type`` against 1.61e-3 for ``normalize-in-half``. The loss is taken in
float32, as upstream takes its logits from ``x_BLC.float()`` (see ``loss``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
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
    Upstream,
    Workload,
    fix,
)
from harness.measure.authoring.registry import register
from harness.measure.host import flash_kernels
from harness.measure.host.flash_contract import flash_attn_contract_func
from harness.schema.axes import TRAIN_STAGE, Cell


@dataclass(frozen=True)
class Dims:
    """The attention layer's width and heads, and the scales inference steps through."""

    embed_dim: int
    num_heads: int
    batch: int
    #: VAR's multi-scale token maps: a patch number ``pn`` is a step of ``pn * pn`` tokens
    #: (1x1, 2x2, 3x3 -> 1, 4, 9 tokens).
    patch_nums: tuple[int, ...]


SMALL = Dims(embed_dim=64, num_heads=4, batch=2, patch_nums=(1, 2, 3))
UPSTREAM = Dims(
    embed_dim=1024, num_heads=16, batch=2, patch_nums=(1, 2, 3, 4, 5, 6, 8, 10, 13, 16)
)
UPSTREAM_SOURCE = (
    "FoundationVision/VAR models/__init__.py @74138aa build_vae_var: "
    "patch_nums=(1,2,3,4,5,6,8,10,13,16), heads=depth, width=depth*64; VAR-d16: depth=16 -> "
    "embed_dim=1024, num_heads=16 (head 64), also models/var.py's defaults. batch=2: one "
    "class label doubled for CFG (var.py next_token_map.repeat(2, 1, 1)); the demo samples "
    "8 labels (16 rows)."
)

#: The seed of the training target, drawn in float64 on the CPU: the same in every cell.
TARGET_SEED = 1234

Kernel = Callable[..., torch.Tensor]
QKNorm = Callable[["VarSelfAttention", torch.Tensor, torch.Tensor, bool], tuple[Any, Any]]
CoreContext = Callable[[], AbstractContextManager[Any]]


def normalize_then_scale(
    attn: VarSelfAttention, q: torch.Tensor, k: torch.Tensor, flash_layout: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Upstream: ``scale_mul`` stays in the Parameter's dtype (fp32 under autocast)."""
    scale_mul = attn.scale_mul_1H11.clamp_max(attn.max_scale_mul).exp()
    if flash_layout:
        scale_mul = scale_mul.transpose(1, 2)  # 1H11 -> 11H1
    return F.normalize(q, dim=-1).mul(scale_mul), F.normalize(k, dim=-1)


def normalize_in_qkv_dtype(
    attn: VarSelfAttention, q: torch.Tensor, k: torch.Tensor, flash_layout: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalise and scale in q's own dtype: no autocast fp32 policy, scale_mul cast to q."""
    with torch.autocast(q.device.type, enabled=False):
        scale_mul = attn.scale_mul_1H11.clamp_max(attn.max_scale_mul).exp().to(q.dtype)
        if flash_layout:
            scale_mul = scale_mul.transpose(1, 2)
        return F.normalize(q, dim=-1).mul(scale_mul), F.normalize(k, dim=-1)


class VarSelfAttention(nn.Module):
    """VAR's ``SelfAttention`` (attn_l2_norm=True, inference: no dropout, KV cache on)."""

    zero_k_bias: torch.Tensor

    def __init__(self, embed_dim: int, num_heads: int, flash_attn_func: Kernel | None) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.scale = 1.0  # attn_l2_norm: the scale lives in scale_mul_1H11
        init = torch.full((1, num_heads, 1, 1), 4.0).log()
        self.scale_mul_1H11 = nn.Parameter(init + 0.3 * torch.randn_like(init))
        self.max_scale_mul = torch.log(torch.tensor(100)).item()
        self.mat_qkv = nn.Linear(embed_dim, embed_dim * 3, bias=False)
        self.q_bias = nn.Parameter(0.02 * torch.randn(embed_dim))
        self.v_bias = nn.Parameter(0.02 * torch.randn(embed_dim))
        self.register_buffer("zero_k_bias", torch.zeros(embed_dim))
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.flash_attn_func = flash_attn_func
        self.cached_k: torch.Tensor | None = None
        self.cached_v: torch.Tensor | None = None

    def kv_caching(self) -> None:
        self.cached_k = self.cached_v = None

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        bias = torch.cat((self.q_bias, self.zero_k_bias, self.v_bias))
        qkv = F.linear(input=x, weight=self.mat_qkv.weight, bias=bias)
        return qkv.view(B, L, 3, self.num_heads, self.head_dim)

    def _cache(self, k: torch.Tensor, v: torch.Tensor, dim_cat: int) -> tuple[Any, Any]:
        if self.cached_k is None or self.cached_v is None:
            self.cached_k, self.cached_v = k, v
        else:
            self.cached_k = torch.cat((self.cached_k, k), dim=dim_cat)
            self.cached_v = torch.cat((self.cached_v, v), dim=dim_cat)
        return self.cached_k, self.cached_v

    def forward(
        self,
        x: torch.Tensor,
        core: CoreContext,
        qk_norm: QKNorm,
        cast_to_main_type: bool,
        attn_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Inference (``attn_bias`` None: KV cache on) or training (the block-causal mask
        over every scale, no cache), as upstream."""
        B, L, C = x.shape
        qkv = self._qkv(x)
        main_type = qkv.dtype
        using_flash = (
            self.flash_attn_func is not None and attn_bias is None and qkv.dtype != torch.float32
        )
        if using_flash:
            q, k, v = qkv.unbind(dim=2)  # BLHc
            dim_cat = 1
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(dim=0)  # BHLc
            dim_cat = 2
        q, k = qk_norm(self, q, k, using_flash)
        if attn_bias is None:  # upstream caches during inference only
            k, v = self._cache(k, v, dim_cat)
        if using_flash and self.flash_attn_func is not None:
            if cast_to_main_type:  # 74138aa
                q, k, v = q.to(main_type), k.to(main_type), v.to(main_type)
            with core():
                out = self.flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=self.scale)
            oup = out.view(B, L, C)
        else:
            with core():
                out = F.scaled_dot_product_attention(
                    q, k, v, scale=self.scale, attn_mask=attn_bias
                )
            oup = out.transpose(1, 2).reshape(B, L, C)
        return self.proj(oup)


def block_causal_bias(patch_nums: tuple[int, ...]) -> torch.Tensor:
    """VAR's ``attn_bias_for_masking``: 0 where a token's scale is at most the query's,
    ``-inf`` elsewhere, shaped (1, 1, L, L)."""
    d = torch.cat([torch.full((pn * pn,), i) for i, pn in enumerate(patch_nums)]).view(1, -1, 1)
    dT = d.transpose(1, 2)
    length = d.shape[1]
    return torch.where(d >= dT, 0.0, -torch.inf).reshape(1, 1, length, length)


def _kernel_for(backend: str, device: torch.device) -> Kernel | None:
    """The attention kernel for a backend; None selects VAR's SDPA fallback (``slow_attn``)."""
    if backend == "flash-attn":
        package = flash_kernels.package_for(str(device))
        if isinstance(package, str):  # the environment skips such cells; a direct call
            raise RuntimeError(package)
        return flash_kernels.load_kernel(package)
    if backend == "flash-attn-contract":
        return flash_attn_contract_func
    return None


@register
class VarNormalizePromotion(Case):
    name = "var-normalize-promotion"
    title = "VAR: fp32 scale_mul / F.normalize promote q to fp32 before FlashAttention"
    upstream = Upstream(
        repo="FoundationVision/VAR",
        file="models/basic_var.py",
        commit="74138aa4229d97f0003d1bf70d03188d597d863a",
        issues=("FoundationVision/VAR#30", "FoundationVision/VAR#27"),
        url="https://github.com/FoundationVision/VAR/issues/30",
    )
    failure = FailureSignature(*flash_kernels.REFUSALS[flash_kernels.FLASH_ATTN_2][0])
    failure_variants = tuple(
        FailureSignature(*refusal)
        for refusal in flash_kernels.REFUSALS[flash_kernels.FLASH_ATTN_4]
    )
    reference_fix = "cast-to-main-type"
    devices = ("cpu", "cuda")
    dtypes = ("float16", "bfloat16")
    modes = ("autocast", "half", "half-autocast", "fp32")
    stages = ("forward", "train")
    #: sdpa first: the float64 reference runs on the first backend, on the CPU.
    backends = ("sdpa", "flash-attn", "flash-attn-contract")
    sizes = (Size("small", SMALL, "toy dimensions"), Size("upstream", UPSTREAM, UPSTREAM_SOURCE))

    def build(self, ctx: RunContext) -> Workload:
        dims: Dims = ctx.dims
        kernel = _kernel_for(ctx.backend, ctx.device)
        model = VarSelfAttention(dims.embed_dim, dims.num_heads, kernel).eval()
        scales = [torch.randn(dims.batch, pn * pn, dims.embed_dim) for pn in dims.patch_nums]
        return Workload(model=model, inputs={"scales": scales})

    def loss(self, output: Any, workload: Workload, ctx: RunContext) -> Any:
        """In float32, as upstream: ``VAR.forward`` takes its logits from ``x_BLC.float()``
        and the trainer's cross-entropy from them. The block has no head, so the loss is the
        mean squared error of ``output.float()`` against a fixed random target."""
        generator = torch.Generator().manual_seed(TARGET_SEED)
        target = torch.randn(output.shape, generator=generator, dtype=torch.float64)
        up = ctx.upcast_dtype
        return F.mse_loss(output.to(up), target.to(device=output.device, dtype=up))

    def skip_reason(self, cell: Cell) -> str | None:
        if cell.stage == TRAIN_STAGE and cell.backend != "sdpa":
            return (
                "VAR trains with an attn_bias, which turns flash_attn_func off (basic_var.py: "
                "using_flash needs attn_bias is None); it trains through xformers (#27) or SDPA"
            )
        return None

    def _run(
        self, w: Workload, ctx: RunContext, qk_norm: QKNorm, cast_to_main_type: bool
    ) -> torch.Tensor:
        """Inference in the forward stage, ``VAR.forward``'s teacher forcing in a train cell."""
        if ctx.stage == TRAIN_STAGE:
            return self._train(w, ctx, qk_norm, cast_to_main_type)
        return self._infer(w, ctx, qk_norm, cast_to_main_type)

    def _train(
        self, w: Workload, ctx: RunContext, qk_norm: QKNorm, cast_to_main_type: bool
    ) -> torch.Tensor:
        """``VAR.forward``: every scale at once under the block-causal mask, the tokens and
        the mask cast to ``main_type`` (upstream's matmul hack), no KV cache."""
        model: VarSelfAttention = w.model
        dims: Dims = ctx.dims
        x = torch.cat(w.inputs["scales"], dim=1)
        temp = x.new_ones(8, 8)
        main_type = torch.matmul(temp, temp).dtype
        attn_bias = block_causal_bias(dims.patch_nums).to(device=x.device, dtype=main_type)
        return model(x.to(main_type), ctx.attention_core, qk_norm, cast_to_main_type, attn_bias)

    def _infer(
        self, w: Workload, ctx: RunContext, qk_norm: QKNorm, cast_to_main_type: bool
    ) -> torch.Tensor:
        """VAR's autoregressive inference over the scales, KV cache on; outputs concatenated."""
        model: VarSelfAttention = w.model
        model.kv_caching()
        outputs = []
        with torch.inference_mode():
            for x in w.inputs["scales"]:
                outputs.append(model(x, ctx.attention_core, qk_norm, cast_to_main_type))
        return torch.cat(outputs, dim=1)

    @fix(
        "none",
        rationale="upstream before 74138aa: the fp32-promoted q goes straight to the kernel",
        upstream="FoundationVision/VAR#30",
    )
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return self._run(w, ctx, normalize_then_scale, cast_to_main_type=False)

    @fix(
        "cast-to-main-type",
        rationale="main_type = qkv.dtype; q, k, v .to(main_type) before the flash kernel",
        upstream="FoundationVision/VAR@74138aa",
    )
    def cast_to_main_type(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return self._run(w, ctx, normalize_then_scale, cast_to_main_type=True)

    @fix(
        "normalize-in-half",
        rationale="normalise and scale q/k in qkv's dtype (scale_mul cast to q, autocast off)",
        upstream="equivalent of 74138aa that never makes an fp32 q",
    )
    def normalize_in_half(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return self._run(w, ctx, normalize_in_qkv_dtype, cast_to_main_type=False)
