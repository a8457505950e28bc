"""LoRA on a float16 base model under float16 AMP: the adapters' gradients are float16 and the
GradScaler refuses to unscale them.

Upstream: huggingface/diffusers ``examples/text_to_image/train_text_to_image_lora.py`` as PR
#5388 (c271731) moved it to PEFT, issue #6442 (and the same error in the DreamBooth LoRA
scripts), fixed by PR #6119 (288ceeb) and PR #6553 (a080f0d, ``cast_training_params``);
huggingface/peft#341, documented in PEFT's troubleshooting guide (PR #1336) and fixed in
PEFT by PR #1706 (``autocast_adapter_dtype``, PEFT 0.12). The script freezes the UNet, casts
it to ``weight_dtype`` (float16 under ``--mixed_precision fp16``: "keeping weights in full
precision is not required" for frozen weights), then ``unet.add_adapter(LoraConfig(
target_modules=["to_k", "to_q", "to_v", "to_out.0"]))``. PEFT created each adapter on its base
layer's device and dtype, so the trainable LoRA weights are float16 too. accelerate trains
under ``torch.autocast`` with a ``torch.amp.GradScaler``; the forward runs, and the first
``accelerator.clip_grad_norm_`` unscales the gradients: torch's ``GradScaler._unscale_grads_``
raises ``ValueError: Attempting to unscale FP16 gradients.`` A forward-only check passes;
only a training step shows it. peft#341 is the same error from a transformers ``Trainer``
with ``fp16=True`` on a model loaded with ``torch_dtype=torch.float16`` (trainable
``modules_to_save`` copies there).

The harness applies accelerate's part of the recipe (autocast, and in float16 the
GradScaler: the ``autocast`` mode keeps float32 weights, so its train cells scale the loss);
the script's part, casting the frozen model to ``weight_dtype``, is the fixes' code, as
upstream wrote it: ``weight_dtype`` is the cell's dtype (float64 in the reference, float32
in the control). The model is one diffusers attention block (``norm1``, then ``attn1`` with
``AttnProcessor2_0``'s SDPA) with a LoRA adapter (PEFT's ``lora.Linear`` forward: the input
cast to the adapter's dtype, the sum cast back to the base layer's result dtype) on
``to_q``, ``to_k``, ``to_v`` and ``to_out.0``; the loss is the script's
``F.mse_loss(model_pred.float(), target.float())``. PEFT initialises ``lora_B`` to zero, which
makes ``lora_A``'s first gradient exactly zero; here ``lora_B`` is small and random, an
adapter some steps into training, so that every gradient has something to judge.

bfloat16 needs no GradScaler (the recipe has none), so every fix, ``none`` included, trains in
the bfloat16 cells. Storing the adapters in bfloat16 (``none``; ``cast-training-params``, which
casts under fp16 only, as upstream does) or in float32 (``autocast-adapter-dtype``) barely
changes the gradients: under autocast the adapter's matmuls run in bfloat16 either way, and
a float32 weight's gradient is the bfloat16 one cast up. Measured on the CPU, the worst
gradient is 5.08e-3 for all three on torch 2.13.0, and 7.82e-3 (bfloat16 adapters) against
7.10e-3 (float32) on 2.4.1, each within its tolerance. What bfloat16 storage costs is in the
update, which a fit judges, not one step. Where the
adapters are float32 their cells carry ``[undone-upcast]``: PEFT's ``x.to(lora_A.weight.dtype)``
casts the half input up and autocast casts it back down before the adapter's matmul, so the
adapter computes in half precision; only its weights and their gradients are float32. The
case runs under autocast only: in ``half`` there is no AMP and no GradScaler, so the pattern
does not arise there.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class Dims:
    batch: int
    tokens: int
    width: int
    heads: int
    rank: int


SMALL = Dims(batch=2, tokens=16, width=64, heads=4, rank=4)
#: Stable Diffusion 1.5's first down block attention at the script's default resolution.
UPSTREAM = Dims(batch=2, tokens=4096, width=320, heads=8, rank=4)
UPSTREAM_SOURCE = (
    "huggingface/diffusers examples/text_to_image/train_text_to_image_lora.py @58eb52c: "
    "--resolution 512 (a 64x64 latent: 4096 tokens), --rank 4, target_modules to_k, to_q, "
    "to_v, to_out.0; src/diffusers/models/unets/unet_2d_condition.py @58eb52c, whose "
    "defaults are SD 1.x's UNet: block_out_channels[0]=320, attention_head_dim=8, used as the "
    "head count (num_attention_heads = num_attention_heads or attention_head_dim); the "
    "stable-diffusion-v1-5 config.json itself was not read. batch=2 is a choice (the "
    "script's default is 16)."
)
#: The scale of the random ``lora_B`` (PEFT initialises it to zero; see the docstring).
LORA_B_STD = 0.02


class LoraLinear(nn.Module):
    """PEFT's ``lora.Linear``: a frozen base layer plus ``lora_B(lora_A(x)) * scaling``."""

    def __init__(self, base_layer: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base_layer = base_layer.requires_grad_(False)
        self.lora_A = nn.Linear(base_layer.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base_layer.out_features, bias=False)
        #: diffusers' LoraConfig sets lora_alpha = r.
        self.scaling = 1.0
        nn.init.normal_(self.lora_A.weight, std=1 / rank)  # init_lora_weights="gaussian"
        nn.init.normal_(self.lora_B.weight, std=LORA_B_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        torch_result_dtype = result.dtype
        x = x.to(self.lora_A.weight.dtype)  # _cast_input_dtype
        result = result + self.lora_B(self.lora_A(x)) * self.scaling
        return result.to(torch_result_dtype)


class Attention(nn.Module):
    """diffusers' ``Attention`` (self-attention) with ``AttnProcessor2_0``, LoRA targets in
    place."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.heads = dims.heads
        self.to_q = LoraLinear(nn.Linear(dims.width, dims.width, bias=False), dims.rank)
        self.to_k = LoraLinear(nn.Linear(dims.width, dims.width, bias=False), dims.rank)
        self.to_v = LoraLinear(nn.Linear(dims.width, dims.width, bias=False), dims.rank)
        self.to_out = nn.ModuleList(
            [LoraLinear(nn.Linear(dims.width, dims.width), dims.rank), nn.Dropout(0.0)]
        )

    def forward(self, hidden_states: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        batch = hidden_states.shape[0]
        query = self.to_q(hidden_states)
        key = self.to_k(hidden_states)
        value = self.to_v(hidden_states)
        head_dim = key.shape[-1] // self.heads
        query, key, value = (
            t.view(batch, -1, self.heads, head_dim).transpose(1, 2) for t in (query, key, value)
        )
        with ctx.attention_core():
            hidden_states = F.scaled_dot_product_attention(query, key, value)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch, -1, self.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)
        hidden_states = self.to_out[0](hidden_states)
        return self.to_out[1](hidden_states)


class LoraBlock(nn.Module):
    """``norm1`` and ``attn1`` of a ``BasicTransformerBlock``, the UNet frozen around the
    adapters (``unet.requires_grad_(False)`` before ``add_adapter``)."""

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dims.width).requires_grad_(False)
        self.attn1 = Attention(dims)

    def forward(self, hidden_states: torch.Tensor, ctx: RunContext) -> torch.Tensor:
        return self.attn1(self.norm1(hidden_states), ctx) + hidden_states


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]


def cast_to_weight_dtype(model: nn.Module, weight_dtype: torch.dtype) -> None:
    """The script's ``unet.to(dtype=weight_dtype)`` then ``add_adapter``: PEFT (before 0.12)
    put each adapter on its base layer's dtype, so here the whole block takes it."""
    model.to(dtype=weight_dtype)


def cast_training_params(model: nn.Module, dtype: torch.dtype) -> None:
    """diffusers' ``training_utils.cast_training_params``: only the trainable parameters."""
    for param in model.parameters():
        if param.requires_grad:  # only upcast trainable parameters into fp32
            param.data = param.to(dtype)


def cast_adapter_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """PEFT's ``cast_adapter_dtype`` (``autocast_adapter_dtype=True``, the default since
    0.12): the adapter weights found in float16 or bfloat16 go to float32."""
    for param in lora_parameters(model):
        if param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.to(dtype)


@register
class LoraFp16GradScaler(Case):
    name = "lora-fp16-grad-scaler"
    title = "LoRA adapters on a float16 base under fp16 AMP: the GradScaler refuses fp16 grads"
    upstream = Upstream(
        repo="huggingface/diffusers",
        file="examples/text_to_image/train_text_to_image_lora.py",
        commit="c2717317f03b12535cfd02b477ace61189e10e4b",
        issues=(
            "huggingface/diffusers#6442",
            "huggingface/diffusers#6119",
            "huggingface/peft#341",
            "huggingface/peft#1706",
        ),
        url="https://github.com/huggingface/diffusers/issues/6442",
    )
    failure = FailureSignature("ValueError", r"Attempting to unscale FP16 gradients")
    #: PEFT's upcast keeps the adapters float32 in either half dtype, so its float16 and
    #: bfloat16 runs are both a trusted yardstick.
    reference_fix = "autocast-adapter-dtype"
    modes = ("autocast", "fp32")
    backends = ("sdpa",)
    stages = ("forward", "train")
    sizes = (Size("small", SMALL, "toy dimensions"), Size("upstream", UPSTREAM, UPSTREAM_SOURCE))

    def build(self, ctx: RunContext) -> Workload:
        dims: Dims = ctx.dims
        x = torch.randn(dims.batch, dims.tokens, dims.width)
        target = torch.randn(dims.batch, dims.tokens, dims.width)
        return Workload(model=LoraBlock(dims), inputs={"x": x, "target": target})

    def loss(self, output: Any, workload: Workload, ctx: RunContext) -> Any:
        """The script's ``F.mse_loss(model_pred.float(), target.float(), reduction="mean")``."""
        up = ctx.upcast_dtype
        return F.mse_loss(output.to(up), workload.inputs["target"].to(up), reduction="mean")

    def _forward(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        """The model's forward on the latents in ``weight_dtype`` (the script's
        ``batch["pixel_values"].to(dtype=weight_dtype)``)."""
        model: LoraBlock = w.model
        return model(w.inputs["x"].to(model.norm1.weight.dtype), ctx)

    @fix(
        "none",
        rationale="the frozen model cast to weight_dtype, the LoRA adapter added in its dtype: "
        "float16 trainable weights under fp16 AMP",
        upstream="huggingface/diffusers#6442 (c271731, PEFT's add_adapter)",
    )
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        cast_to_weight_dtype(w.model, ctx.dtype)
        return self._forward(w, ctx)

    @fix(
        "cast-training-params",
        rationale="cast_training_params(unet, dtype=torch.float32) after add_adapter, under "
        "--mixed_precision fp16 only: the trainable LoRA weights float32",
        upstream="huggingface/diffusers PR #6119 (288ceeb), PR #6553 (a080f0d)",
    )
    def cast_training_params(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        cast_to_weight_dtype(w.model, ctx.dtype)
        if ctx.dtype == torch.float16:  # if args.mixed_precision == "fp16"
            cast_training_params(w.model, dtype=ctx.upcast_dtype)
        return self._forward(w, ctx)

    @fix(
        "autocast-adapter-dtype",
        rationale="PEFT's autocast_adapter_dtype=True: float16 and bfloat16 adapter weights "
        "upcast to float32 when the adapter is added",
        upstream="huggingface/peft PR #1706 (ae1ae20, PEFT 0.12)",
    )
    def autocast_adapter_dtype(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        cast_to_weight_dtype(w.model, ctx.dtype)
        cast_adapter_dtype(w.model, ctx.upcast_dtype)
        return self._forward(w, ctx)

    @fix(
        "fp32-base-autocast",
        rationale="no weight_dtype cast: the whole model stays float32 and AMP casts per op "
        "(peft#341: loaded in float32 with fp16=True it trains)",
        upstream="huggingface/peft#341; PEFT troubleshooting 'Attempting to unscale FP16 "
        "gradients' (PR #1336)",
    )
    def fp32_base_autocast(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return self._forward(w, ctx)
