"""The axes of the matrix and the values each may take."""

from __future__ import annotations

import torch

#: Low-precision dtypes under test, and the fp32 control (used only by mode ``fp32``).
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}
LOW_PRECISION_DTYPES = ("float16", "bfloat16")

#: ``autocast``: fp32 weights and inputs under torch.autocast(dtype).
#: ``half``: weights and inputs cast to the dtype, no autocast.
#: ``fp32``: the control, everything in float32 (dtype axis fixed to ``float32``).
MODES = ("autocast", "half", "fp32")

#: Attention backends a case may declare. ``flash-attn-contract`` enforces flash-attn's
#: documented input contract and computes with SDPA; it stands in where flash-attn is absent.
BACKENDS = ("sdpa", "eager", "flash-attn", "flash-attn-contract")

#: Device kinds a case may declare; ``cuda`` expands to every visible ``cuda:N``.
DEVICE_KINDS = ("cpu", "cuda")


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype for an axis value (``float64`` is accepted for references)."""
    if name == "float64":
        return torch.float64
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``float16``."""
    return str(dtype).removeprefix("torch.")
