"""The parts of a :class:`~harness.measure.authoring.recipes.Recipe` a training step and a fit
share: the scaler policy a run takes, a static loss scale's backward, and the gradients'
clipping (the micro-batches' loss is :func:`harness.measure.running.training.step_loss`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from harness.measure.authoring.recipes import mode_scaler
from harness.measure.precision.dtypes import dtype_name
from harness.measure.precision.modes import Precision
from harness.schema.axes import NO_SCALER

#: What ``torch.nn.utils.clip_grad_norm_`` adds to the total norm before it divides by it.
CLIP_EPS = 1e-6


def scaler_policy(precision: Precision, asked: str | None) -> str:
    """The loss scaling a run takes: the one its cell asks for (``asked``), else the mode's
    (a GradScaler for float16 under autocast); none in the float64 reference (scaling is
    precision's business) and where the case manages its own precision."""
    if precision.is_reference or precision.managed_by_case:
        return NO_SCALER
    if asked is not None:
        return asked
    return mode_scaler(dtype_name(precision.dtype), precision.mode)


def static_backward(loss: torch.Tensor, params: Iterable[torch.Tensor], scale: float) -> None:
    """Backward of the loss at a fixed ``scale``, the gradients divided back in place in
    their own dtype (a power of two moves only the exponent; a float16 gradient of half
    weights, which a GradScaler refuses to unscale, is unscaled as well). Gradients that
    overflowed at the scale stay not finite: a static scaler does not retry."""
    (loss * scale).backward(retain_graph=True)
    unscale_in_place([p.grad for p in params], scale)


def unscale_in_place(grads: Iterable[torch.Tensor | None], scale: float) -> None:
    """Gradients made at a fixed loss ``scale`` divided back in place, in their own dtype."""
    for grad in grads:
        if grad is not None:
            grad.div_(scale)


def clip_gradients(grads: Iterable[torch.Tensor], max_norm: float) -> None:
    """The gradients scaled in place so their total 2-norm is at most ``max_norm``, by
    ``torch.nn.utils.clip_grad_norm_``'s arithmetic (each gradient's norm in its dtype,
    their norm, a coefficient clamped at 1, multiplied in): the same clip in every dtype."""
    present = [g for g in grads if g is not None]
    if not present:
        return
    norms = [torch.linalg.vector_norm(g.to_dense() if g.is_sparse else g, 2) for g in present]
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2)
    coefficient = torch.clamp(max_norm / (total + CLIP_EPS), max=1.0)
    for grad in present:
        grad.mul_(coefficient.to(device=grad.device, dtype=grad.dtype))
