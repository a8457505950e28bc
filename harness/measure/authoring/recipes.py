"""A training recipe as data: what a ``train`` or ``fit`` cell trains with, named by a case
(``Case.recipe``), a fix (``@fix(recipe=...)``), ``check --recipe MODULE:NAME`` or the pytest
plugin (``check_model(recipe=...)``); the harness's default is one :class:`Recipe` among them.

A recipe says what a person's training loop says: the optimizer and its settings, the
gradient clipping, the micro-batches a step accumulates, and the loss scaling. The float64
reference of a cell runs the same recipe without a scaler: scaling is what precision needs,
and only precision may differ between a cell and its reference.

- ``optimizer(params, lr)`` builds the optimizer (default :func:`adamw`: AdamW, no weight
  decay, one tensor at a time); ``lr`` its learning rate.
- ``clip_norm``: the gradients' total 2-norm is clipped to it after they are unscaled and
  before they are judged or stepped (``torch.nn.utils.clip_grad_norm_``'s arithmetic); None
  clips nothing.
- ``accumulation``: micro-batches per step. Each is the cell's whole workload (the harness
  cannot know how inputs split: a batch dimension, a cache and a target differ by model),
  its loss divided by ``accumulation``, their gradients summed in the gradients' own dtype:
  what accumulating costs in precision is measured, not what other data would give. The
  judged loss is the sum of the divided losses; a dropout draws anew in each micro-batch.
- ``scalers``: the loss-scaling policies the recipe trains with (``none``, ``dynamic``: a
  GradScaler, ``static``: ``static_scale`` held fixed); each is a cell of its own, so scaled
  and unscaled training are cells, not twin fixes. Empty: the mode's, a GradScaler for
  float16 under autocast and none elsewhere. The float32 control always runs unscaled.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from harness.schema.axes import (
    CONTROL_MODE,
    NO_SCALER,
    SCALERS,
)
from harness.schema.axes import mode_scaler as mode_scaler  # the mode's, where a recipe names none

#: An optimizer a recipe steps with: ``f(params, lr)``.
OptimizerFactory = Callable[[list[torch.Tensor], float], torch.optim.Optimizer]
#: The learning rate of the default recipe.
DEFAULT_LR = 1e-3
#: A static scaler's loss scale unless the recipe says otherwise (a GradScaler's first).
STATIC_SCALE = 2.0**16


def adamw(params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """The default recipe's optimizer: AdamW, no weight decay, one tensor at a time (the
    same arithmetic on every release and device)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=False)


class RecipeError(ValueError):
    """A recipe that cannot train as declared, said in one line."""


@dataclass(frozen=True)
class Recipe:
    """How a cell trains: see the module docstring. Frozen and hashable, so a case, a fix,
    ``check`` and the plugin can name one and share it."""

    optimizer: OptimizerFactory = adamw
    lr: float = DEFAULT_LR
    clip_norm: float | None = None
    accumulation: int = 1
    scalers: tuple[str, ...] = ()
    static_scale: float = STATIC_SCALE

    def __post_init__(self) -> None:
        object.__setattr__(self, "scalers", tuple(dict.fromkeys(self.scalers)))
        problem = self.problem()
        if problem is not None:
            raise RecipeError(f"Recipe: {problem}")

    def problem(self) -> str | None:
        """What is wrong with the declaration, or None."""
        if not callable(self.optimizer):
            return "optimizer is a function (params, lr) -> torch.optim.Optimizer"
        if not (isinstance(self.lr, int | float) and math.isfinite(self.lr) and self.lr > 0):
            return f"lr must be a positive number, not {self.lr!r}"
        if self.clip_norm is not None and not (
            isinstance(self.clip_norm, int | float) and self.clip_norm > 0
        ):
            return f"clip_norm must be a positive number or None, not {self.clip_norm!r}"
        if isinstance(self.accumulation, bool) or not (
            isinstance(self.accumulation, int) and self.accumulation >= 1
        ):
            return (
                "accumulation must be a whole number of micro-batches, 1 or more, "
                f"not {self.accumulation!r}"
            )
        unknown = [s for s in self.scalers if s not in SCALERS]
        if unknown:
            return f"scalers: {unknown[0]!r} is not one of {', '.join(SCALERS)}"
        if not (math.isfinite(self.static_scale) and self.static_scale > 0):
            return f"static_scale must be a positive number, not {self.static_scale!r}"
        return None

    def make_optimizer(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        return self.optimizer(params, self.lr)

    def scalers_for(self, dtype: str, mode: str, managed_by_case: bool = False) -> tuple[str, ...]:
        """The scaler policies a train or fit cell of ``dtype`` and ``mode`` runs, each a cell:
        the recipe's, else the mode's (:func:`mode_scaler`); the float32 control and a case
        that manages its own precision run unscaled."""
        if mode == CONTROL_MODE or managed_by_case:
            return (NO_SCALER,)
        return self.scalers or (mode_scaler(dtype, mode),)

    def with_scalers(self, *scalers: str) -> Recipe:
        return replace(self, scalers=scalers)


#: The harness's recipe where a case, fix or user names none.
DEFAULT_RECIPE = Recipe()
