"""14 small models for ``check`` on a GPU (``benchmarks/bench_check.py``): the eight
transformers architectures of ``zoo/architectures.py`` and six timm image models, built
from their configs with random weights (nothing is downloaded). Each is a factory
``check`` takes as ``gpu_models:NAME``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from zoo.architectures import ARCHITECTURES

TRANSFORMERS = (
    "gpt2-12l", "bert-12l", "qwen2-12l", "opt-12l", "mistral-2l", "gemma2-2l", "bart-4l",
    "whisper-encoder-2l",
)  # fmt: skip
TIMM = (
    "vit_tiny_patch16_224", "deit_tiny_patch16_224", "convnext_atto", "resnet18",
    "efficientnet_b0", "mobilenetv3_small_100",
)  # fmt: skip


def timm_factory(name: str) -> Callable[[], tuple[Any, ...]]:
    def build() -> tuple[Any, ...]:
        import timm

        model = timm.create_model(name, pretrained=False).eval()
        return model, {"x": torch.randn(2, 3, 224, 224)}

    build.__name__ = name
    return build


MODELS: dict[str, Callable[[], tuple[Any, ...]]] = {
    **{name.replace("-", "_"): ARCHITECTURES[name][0] for name in TRANSFORMERS},
    **{name: timm_factory(name) for name in TIMM},
}
globals().update(MODELS)
