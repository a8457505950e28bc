"""The dtypes of the axis table as torch dtypes, and back (``float16`` <-> ``torch.float16``)."""

from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of an axis value (``float64`` for references)."""
    return TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``float16``."""
    return str(dtype).removeprefix("torch.")
