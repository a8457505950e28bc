"""A diffusion UNet with its timestep embedding (diffusers) and a ViT (transformers)."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import UNet2DConditionModel
from transformers import ViTConfig, ViTForImageClassification

from harness import RunContext, check_model
from zoo import STAGES


def unet() -> UNet2DConditionModel:
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), cross_attention_dim=32, attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), norm_num_groups=8,
    )  # fmt: skip


def denoised(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    return model(**inputs).sample


@check_model(stages=STAGES, modes=("autocast", "half"), keep_fp32=("timestep",))
def test_unet_with_timestep_embedding() -> tuple[Any, ...]:
    """A Stable-Diffusion-style UNet: cross-attention blocks, sinusoidal timestep
    embedding (computed in float32 upstream; the timestep input stays float32, as a
    diffusers pipeline passes it whatever the model's dtype), a text-conditioning input."""
    inputs = {
        "sample": torch.randn(1, 4, 8, 8),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": torch.randn(1, 6, 32),
    }
    return unet().eval(), inputs, denoised


def class_logits(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    return model(**inputs).logits


@check_model(stages=STAGES, modes=("autocast", "half"), backends=("sdpa", "eager"))
def test_vit(ctx: RunContext) -> tuple[Any, ...]:
    """A ViT classifier (patch embedding, pre-norm encoder, CLS head) with SDPA or eager
    attention."""
    config = ViTConfig(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, num_labels=10,
    )  # fmt: skip
    config._attn_implementation = ctx.backend
    return (
        ViTForImageClassification(config).eval(),
        {"pixel_values": torch.randn(2, 3, 32, 32)},
        class_logits,
    )
