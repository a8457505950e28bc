"""T5's feed-forward ``wo`` overflows float16; keeping it in float32 widens the residual stream.

Upstream: huggingface/transformers, ``src/transformers/models/t5/modeling_t5.py``. In
``T5LayerFF`` the hidden state goes through ``T5LayerNorm``, ``T5DenseActDense`` (``wi``,
ReLU, ``wo``) and is added back to the residual. With large activations the ``wo``
projection exceeds 65504, so a model cast with ``model.half()`` produces ``inf`` hidden
states and the next ``T5LayerNorm`` turns them into NaN (issues #14189, #4586, #9295); the
code runs and says nothing. Two upstream answers:

* ``T5Block`` clamps float16 hidden states to ``finfo.max - 1000`` when any is ``inf``
  (PR #10956 era): the residual saturates instead of overflowing.
* ``_keep_in_fp32_modules = ["wo"]`` (PR #20683, completed for ``T5DenseActDense`` in
  PR #21281): ``wo`` stays float32 and ``T5DenseActDense`` casts its input to ``wo``'s
  dtype. Its float32 output is added to the half residual, so from then on the residual
  stream is float32 in a "half" model: the next ``T5LayerNorm`` still returns half (its
  weight is half), but a strict fused norm that insists on matching dtypes (apex
  ``FusedRMSNorm``, PR #26226) refuses the float32 input with ``expected scalar type Float
  but found Half``. Casting the ``wo`` output back to the residual's dtype keeps the model
  half, and in float16 overflows again.

The workload is one T5 feed-forward sub-layer followed by the next block's first layer
norm, with weights large enough (as in the issues' fp16 NaNs) that the ``wo`` output is
about 73000, just above float16's 65504, at every size: the weights' mean is derived from
``d_model`` and ``d_ff`` (``Dims.for_widths``). The ``upstream`` size has t5-base's widths
(``d_model`` 768, ``d_ff`` 3072) over 128 tokens. Outputs compared: the block's hidden
state (what ``output_hidden_states`` returns) and the next layer norm's output. The strict
fused norm is a stand-in: apex is not used; its dtype check is emulated with CPU
``F.layer_norm``'s mixed-dtype check, computing RMSNorm as the layer norm of ``[h, -h]``
(zero mean, so its variance is ``mean(h**2)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from harness import Case, FailureSignature, RunContext, Size, Upstream, Workload, fix, register
from harness.measure.authoring.case import Symptom

EPS = 1e-6
#: What the ``wo`` outputs come to: with positive, unit-RMS normalised inputs and weights of
#: mean ``m``, the ``wi`` outputs are about ``d_model * m`` and the ``wo`` outputs about
#: ``d_ff * d_model * m**2``; ``m`` is chosen so that this is 73728 > 65504 (at the small
#: size ``m`` = 12: 8 * 12 = 96, then 64 * 96 * 12 = 73728).
WO_OUTPUT = 73_728.0
#: The weights' standard deviation relative to their mean (0.25 at a mean of 12).
WEIGHT_STD_RATIO = 1 / 48
HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Dims:
    """The sub-layer's widths, the tokens, and the ``wi``/``wo`` weight init they imply."""

    batch: int
    tokens: int
    d_model: int
    d_ff: int
    #: Mean and standard deviation of the ``wi`` and ``wo`` weights (see ``WO_OUTPUT``).
    weight_mean: float
    weight_std: float

    @classmethod
    def for_widths(cls, batch: int, tokens: int, d_model: int, d_ff: int) -> Dims:
        """Dims whose weight init puts the ``wo`` outputs at about ``WO_OUTPUT``."""
        mean = (WO_OUTPUT / (d_model * d_ff)) ** 0.5
        return cls(batch, tokens, d_model, d_ff, mean, mean * WEIGHT_STD_RATIO)


#: weight_mean 12.0, weight_std 0.25.
SMALL = Dims.for_widths(batch=2, tokens=3, d_model=8, d_ff=64)
#: weight_mean ~0.177, weight_std ~0.0037.
UPSTREAM = Dims.for_widths(batch=2, tokens=128, d_model=768, d_ff=3072)
UPSTREAM_SOURCE = (
    "t5-base config.json (huggingface/transformers T5Config fields, "
    "src/transformers/models/t5/configuration_t5.py): d_model=768, d_ff=3072, "
    "feed_forward_proj='relu', layer_norm_epsilon=1e-6; the t5-base values read from a "
    "third-party copy of the HF pretrained-config map, not the HF file (t5-base is the "
    "model of issues #4287, #4586, #5651). tokens=128 (#4586 feeds ~90 encoder tokens) and "
    "batch=2 are choices; weight mean/std derived so the wo output stays ~73728."
)


class T5LayerNorm(nn.Module):
    """transformers' ``T5LayerNorm``: RMS scaling only, variance in float32 (``upcast``),
    cast back to the weight's dtype when that is half."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = EPS

    def forward(self, hidden: torch.Tensor, upcast: torch.dtype) -> torch.Tensor:
        variance = hidden.to(upcast).pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.variance_epsilon)
        if self.weight.dtype in HALF_DTYPES:
            hidden = hidden.to(self.weight.dtype)
        return self.weight * hidden

    def strict_fused(self, hidden: torch.Tensor) -> torch.Tensor:
        """The same RMSNorm through a kernel that requires the weight in the input's dtype
        (stand-in for apex ``FusedRMSNorm``; see the module docstring)."""
        mirrored = torch.cat([hidden, -hidden], dim=-1)
        weight = torch.cat([self.weight, self.weight])
        out = F.layer_norm(mirrored, (mirrored.shape[-1],), weight, eps=self.variance_epsilon)
        return out[..., : hidden.shape[-1]]


class T5DenseActDense(nn.Module):
    """``wi`` -> ReLU -> (cast to ``wo``'s dtype, PR #21281) -> ``wo``."""

    def __init__(self, d_model: int, d_ff: int, mean: float, std: float) -> None:
        super().__init__()
        self.wi = nn.Linear(d_model, d_ff, bias=False)
        self.wo = nn.Linear(d_ff, d_model, bias=False)
        self.act = nn.ReLU()
        for linear in (self.wi, self.wo):
            nn.init.normal_(linear.weight, mean=mean, std=std)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.wi(hidden))
        if hidden.dtype != self.wo.weight.dtype and self.wo.weight.dtype != torch.int8:
            hidden = hidden.to(self.wo.weight.dtype)
        out: torch.Tensor = self.wo(hidden)
        return out


class T5LayerFF(nn.Module):
    """Pre-norm feed-forward sub-layer with its residual add."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.layer_norm = T5LayerNorm(dims.d_model)
        self.DenseReluDense = T5DenseActDense(
            dims.d_model, dims.d_ff, dims.weight_mean, dims.weight_std
        )

    def forward(
        self, hidden: torch.Tensor, upcast: torch.dtype, cast_back: bool = False
    ) -> torch.Tensor:
        forwarded = self.DenseReluDense(self.layer_norm(hidden, upcast))
        return hidden + (forwarded.to(hidden.dtype) if cast_back else forwarded)


class T5FeedForwardThenNorm(nn.Module):
    """One block's ``T5LayerFF`` and the next block's first ``T5LayerNorm``."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.ff = T5LayerFF(dims)
        self.next_layer_norm = T5LayerNorm(dims.d_model)


def clamp_inf_fp16(hidden: torch.Tensor) -> torch.Tensor:
    """``T5Block``: clamp float16 hidden states to finite values (a no-op in other dtypes)."""
    if hidden.dtype != torch.float16:
        return hidden
    finfo = torch.finfo(hidden.dtype)
    clamp_value = torch.where(torch.isinf(hidden).any(), finfo.max - 1000, finfo.max)
    return torch.clamp(hidden, min=-clamp_value, max=clamp_value)


def wo_in_model_dtype(w: Workload, ctx: RunContext) -> T5FeedForwardThenNorm:
    """The model as ``model.half()`` left it before ``_keep_in_fp32_modules``: ``wo`` in the
    same dtype as everything else (a copy; the workload's model keeps ``wo`` in float32)."""
    model: T5FeedForwardThenNorm = w.fresh_model()
    model.ff.DenseReluDense.wo.to(ctx.compute_dtype)
    return model


def outputs(hidden: torch.Tensor, normed: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"hidden_states": hidden, "next_layer_norm": normed}


@register
class T5WoKeepFp32(Case):
    name = "t5-wo-keep-fp32"
    title = "T5 FF wo overflows fp16; keeping wo in fp32 silently makes the residual fp32"
    upstream = Upstream(
        repo="huggingface/transformers",
        file="src/transformers/models/t5/modeling_t5.py",
        commit="v4.27.0",
        issues=(
            "huggingface/transformers#14189",
            "huggingface/transformers#9295",
            "huggingface/transformers#20683",
            "huggingface/transformers#21281",
            "huggingface/transformers#26226",
        ),
        url="https://github.com/huggingface/transformers/issues/14189",
    )
    #: Upstream's path fails silently: the ``wo`` output overflows float16 to inf and the
    #: next layer norm makes NaN of it. A strict fused norm given the float32 residual of a
    #: kept ``wo`` raises.
    failure = FailureSignature(
        "RuntimeError",
        r"mixed dtype \(CPU\): expect parameter to have scalar type of Float"
        r"|expected scalar type Float but found (?:Half|BFloat16)",
        silent=(Symptom.NON_FINITE,),
    )
    #: Correct in float64 (the clamp only acts on float16), and the most a float16 residual
    #: can hold: values above 65504 saturate instead of overflowing.
    reference_fix = "t5block-clamp"
    devices = ("cpu", "cuda")
    dtypes = ("float16", "bfloat16")
    modes = ("half", "autocast", "half-autocast", "fp32")
    backends = ("eager",)
    keep_fp32 = ("ff.DenseReluDense.wo",)  # T5's _keep_in_fp32_modules = ["wo"]
    sizes = (Size("small", SMALL, "toy dimensions"), Size("upstream", UPSTREAM, UPSTREAM_SOURCE))

    def build(self, ctx: RunContext) -> Workload:
        dims: Dims = ctx.dims
        model = T5FeedForwardThenNorm(dims).eval()
        # Positive: ReLU passes all.
        hidden = 1.0 + 0.5 * torch.rand(dims.batch, dims.tokens, dims.d_model)
        return Workload(model=model, inputs={"hidden_states": hidden})

    @fix(
        "none",
        rationale="everything half, wo included (model.half() before _keep_in_fp32_modules)",
    )
    def none(self, w: Workload, ctx: RunContext) -> dict[str, torch.Tensor]:
        model = wo_in_model_dtype(w, ctx)
        hidden = model.ff(w.inputs["hidden_states"], ctx.upcast_dtype)
        return outputs(hidden, model.next_layer_norm(hidden, ctx.upcast_dtype))

    @fix(
        "t5block-clamp",
        rationale="all half, and T5Block clamps float16 hidden states below finfo.max",
        upstream="T5Block 'clamp inf values to enable fp16 training' (PR #10956, #9295)",
    )
    def t5block_clamp(self, w: Workload, ctx: RunContext) -> dict[str, torch.Tensor]:
        model = wo_in_model_dtype(w, ctx)
        hidden = clamp_inf_fp16(model.ff(w.inputs["hidden_states"], ctx.upcast_dtype))
        return outputs(hidden, model.next_layer_norm(hidden, ctx.upcast_dtype))

    @fix(
        "keep-wo-fp32",
        rationale="wo kept in fp32, its input cast up; the fp32 output widens the residual",
        upstream="_keep_in_fp32_modules = ['wo'] (PR #20683, PR #21281)",
    )
    def keep_wo_fp32(self, w: Workload, ctx: RunContext) -> dict[str, torch.Tensor]:
        model: T5FeedForwardThenNorm = w.model
        hidden = model.ff(w.inputs["hidden_states"], ctx.upcast_dtype)
        return outputs(hidden, model.next_layer_norm(hidden, ctx.upcast_dtype))

    @fix(
        "keep-wo-fp32-strict-norm",
        rationale="wo kept in fp32, and the next norm is a fused kernel that needs one dtype",
        upstream="apex FusedRMSNorm given T5's fp32 residual (PR #26226); emulated on CPU",
    )
    def keep_wo_fp32_strict_norm(self, w: Workload, ctx: RunContext) -> dict[str, torch.Tensor]:
        model: T5FeedForwardThenNorm = w.model
        hidden = model.ff(w.inputs["hidden_states"], ctx.upcast_dtype)
        return outputs(hidden, model.next_layer_norm.strict_fused(hidden))

    @fix(
        "keep-wo-fp32-cast-back",
        rationale="wo kept in fp32, its output cast back to the residual's (half) dtype",
        upstream="the repro's keep_wo_fp32_cast_back variant (keeps the residual half)",
    )
    def keep_wo_fp32_cast_back(self, w: Workload, ctx: RunContext) -> dict[str, torch.Tensor]:
        model: T5FeedForwardThenNorm = w.model
        hidden = model.ff(w.inputs["hidden_states"], ctx.upcast_dtype, cast_back=True)
        return outputs(hidden, model.next_layer_norm(hidden, ctx.upcast_dtype))
