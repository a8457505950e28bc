"""The rounding yardstick's data: a float64 workload whose values are rounded to a dtype.

The reference computation run on these values, in float64, costs exactly what representing
the weights and inputs in the dtype costs, and nothing of how any fix computes (see
:mod:`harness.measure.numerics`). Parts kept in float32 stay as they are. float32 data cannot be
rounded to float32 (they already are float32), so for the float32 control the rounding is
simulated: each value is moved by a random relative amount of at most the unit roundoff,
float32's, or TF32's (10 mantissa bits) where a GPU computes float32 matmuls in TF32.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from harness.measure.precision import TORCH_DTYPES, is_kept, map_tensors

#: The dtypes whose rounding is simulated, and their unit roundoff (half an ulp at 1).
SIMULATED_ROUNDOFF = {"float32": 2.0**-24, "tf32": 2.0**-11}
#: The simulated rounding's noise is seeded: the yardstick is the same in every process.
NOISE_SEED = 20261123


def round_to(tensor: torch.Tensor, dtype: str, noise: torch.Generator) -> torch.Tensor:
    """A float64 tensor's values as ``dtype`` would hold them, still in float64."""
    if not tensor.is_floating_point():
        return tensor
    if dtype in SIMULATED_ROUNDOFF:
        relative = torch.rand(tensor.shape, generator=noise, dtype=torch.float64) * 2 - 1
        return tensor * (1 + SIMULATED_ROUNDOFF[dtype] * relative.to(tensor.device))
    return tensor.to(TORCH_DTYPES[dtype]).to(tensor.dtype)


def round_model(model: Any, dtype: str, keep: tuple[str, ...], noise: torch.Generator) -> Any:
    """The model's floating parameters and buffers rounded in place (those ``keep`` names
    left as they are); a tensor, or tensors in lists and dicts, rounded."""
    if isinstance(model, nn.Module):
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if tensor.is_floating_point() and not is_kept(name, keep):
                    tensor.copy_(round_to(tensor, dtype, noise))
        return model
    return round_values(model, dtype, noise)


def round_values(value: Any, dtype: str, noise: torch.Generator) -> Any:
    """Every floating tensor in ``value`` (nested lists, tuples, dicts) rounded."""
    return map_tensors(
        value,
        lambda tensor: round_to(tensor, dtype, noise),
        lambda module: round_model(module, dtype, (), noise),
    )


def round_inputs(
    inputs: dict[str, Any], dtype: str, keep: tuple[str, ...], noise: torch.Generator
) -> dict[str, Any]:
    return {
        name: value if name in keep else round_values(value, dtype, noise)
        for name, value in inputs.items()
    }


def noise_source() -> torch.Generator:
    return torch.Generator().manual_seed(NOISE_SEED)
