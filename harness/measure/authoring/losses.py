"""The loss a training step takes when a case names none: the one a model's output carries
(a transformers model given ``labels``), else the mean squared error of every floating output
against a fixed random target; and the error of a model that cannot be trained as given."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from harness.measure.precision.outputs import output_leaves

#: The seed of the default loss's random target: the same target in every cell.
TARGET_SEED = 1234


class TrainingError(ValueError):
    """A model that cannot be trained as given (no trainable parameters, a loss that is not
    a scalar), said in one line."""


def default_loss(output: Any) -> torch.Tensor:
    """The mean squared error of each floating output leaf against a fixed random target
    of its shape (drawn in float64 on the CPU from ``TARGET_SEED``), summed over the
    leaves; computed in float32 (float64 in the reference), as training scripts compute a
    loss on half outputs (``F.mse_loss(pred.float(), target.float())``), and as torch
    before 2.5 must on a CPU, which has no half-precision ``mse_loss`` there."""
    generator = torch.Generator().manual_seed(TARGET_SEED)
    total: torch.Tensor | None = None
    for leaf in output_leaves(output).values():
        if not leaf.is_floating_point():
            continue
        target = torch.randn(leaf.shape, generator=generator, dtype=torch.float64)
        wide = torch.promote_types(leaf.dtype, torch.float32)
        term = F.mse_loss(leaf.to(wide), target.to(device=leaf.device, dtype=wide))
        total = term if total is None else total + term
    if total is None:
        raise TrainingError("the output has no floating tensor to take a loss of")
    return total


def model_loss(output: Any) -> torch.Tensor | None:
    """The loss a model's output carries (``output.loss``, ``output["loss"]``), if any."""
    found = getattr(output, "loss", None)
    if found is None and isinstance(output, dict):
        found = output.get("loss")
    return found if isinstance(found, torch.Tensor) else None
