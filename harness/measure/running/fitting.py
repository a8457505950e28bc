"""The ``fit`` stage: a short run of optimizer steps on fixed data, with the recipe of the
cell's mode (:mod:`harness.measure.running.training`), and what it shows that one step cannot:

- where the loss ends, judged against the float64 fit of the same fix (the same model,
  data, optimizer and learning rate: only the precision differs): a fit whose last loss
  ends beyond the float64 fit's by more than ``SHORTFALL_LIMIT`` of the smaller of that
  fit's progress (first loss minus last) and its last loss (or is not finite) stalls;
- as evidence of why, beside the verdict: the steps a GradScaler skipped (gradients not
  finite at its scale) and its final scale, and the share of the parameter updates lost
  to rounding: the update applied to the stored weights (or to what an optimizer holds
  for them: float32 master weights) against the update the optimizer computed from the
  same gradients in float64 (a shadow of the optimizer on float64 copies of the weights,
  synchronised before each step). Pure bfloat16 weights stepped by Adam at a small
  learning rate keep almost none of their updates: each is below half a unit in the last
  place of the weight it updates.

The fit runs the cell's recipe (:class:`~harness.measure.authoring.recipes.Recipe`: its
optimizer and learning rate, clipping, micro-batches and loss scaling; the default is AdamW
at the case's ``fit_lr``, no weight decay). Only the first step runs under the dtype tracer
and the mode's checks (the rest repeat it); the optimizer's bookkeeping never does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from harness.measure.authoring.losses import TrainingError
from harness.measure.authoring.recipes import DEFAULT_RECIPE, Recipe
from harness.measure.authoring.recipes import adamw as adamw
from harness.measure.precision.modes import Precision, autocast_region
from harness.measure.running.recipe_steps import clip_gradients, scaler_policy, unscale_in_place
from harness.measure.running.replay import seen_by_replay_alone
from harness.measure.running.training import (
    HELD_SCALER,
    INIT_SCALE,
    forward_and_loss,
    holds_scale,
    make_grad_scaler,
    scalar_loss,
    trainable_parameters,
)
from harness.measure.tracing.backward_sites import all_finite
from harness.schema.axes import DYNAMIC_SCALER, STATIC_SCALER
from harness.schema.config import DEFAULT_FIT_STEPS
from harness.schema.fit_rule import EXCESS_LIMIT as EXCESS_LIMIT
from harness.schema.fit_rule import PROGRESS, end_scale, where_it_ends
from harness.schema.fit_rule import SHORTFALL_LIMIT as SHORTFALL_LIMIT
from harness.schema.fit_rule import shortfall as shortfall
from harness.schema.records import FitFigures, Note, NoteKind, Numerics

#: The share of the updates lost to rounding from which a fit's note says so, passing or
#: not: evidence of why a fit stalls, not a verdict (a bfloat16 fit may round away a third
#: of its updates, on weights that matter little, and end where float64's does).
LOST_WORTH_SAYING = 0.1
_steps = DEFAULT_FIT_STEPS


def use_steps(steps: int) -> None:
    """Set the optimizer steps of every fit this process runs (a run's ``--fit-steps``)."""
    global _steps
    _steps = steps


def fit_steps() -> int:
    return _steps


@dataclass(frozen=True)
class FitRun:
    """What a fit leaves to be judged: the loss before each step and after the last (the
    ``loss`` leaf, one float64 curve), the first step's forward output (for the mode's
    checks), and what the optimizer and the GradScaler did."""

    losses: torch.Tensor
    forward_output: Any
    skipped_steps: int
    final_scale: float | None
    lost_share: float
    #: What in the recipe makes the fit fail in this dtype whatever the model (an Adam
    #: ``eps`` that is 0 in it), or None: said where the loss is not finite.
    cause: str | None = None
    #: What skipped the steps it skipped: a ``GradScaler``, or a recipe's static loss scale.
    skipper: str = "GradScaler"

    @property
    def leaves(self) -> dict[str, torch.Tensor]:
        return {"loss": self.losses}

    @property
    def note(self) -> Note | None:
        """The recipe's cause of a loss that is not finite, else what the GradScaler
        skipped, if it did."""
        if self.cause is not None and not bool(torch.isfinite(self.losses).all()):
            step = int((~torch.isfinite(self.losses)).nonzero()[0])
            return Note(
                NoteKind.FIT, f"the fit's loss is not finite from step {step}: {self.cause}"
            )
        if not self.skipped_steps:
            return None
        return Note(
            NoteKind.SCALER,
            f"{self.skipper} skipped {self.skipped_steps} of {self.steps} step(s) of the fit "
            f"(gradients not finite); its scale ended at {self.final_scale:g}",
        )

    @property
    def steps(self) -> int:
        return len(self.losses) - 1


@contextmanager
def untraced() -> Iterator[None]:
    """The harness's own bookkeeping, out of the sight of the dtype tracer and the watch."""
    with torch.no_grad(), _disable_current_modes():
        yield


class UpdateLedger:
    """The updates the optimizer computed and those the stored weights received, summed
    over the fit. The computed ones come from a shadow of the optimizer on float64 copies
    of the weights, set to the stored values before each step and given the same
    gradients, so its update is what the optimizer meant, free of the weights' rounding."""

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        recipe: Recipe,
        optimizer: torch.optim.Optimizer,
    ):
        self.params = params
        self.held = held_weights(params, optimizer)
        self.shadow = {
            name: p.detach().to(torch.float64).clone().requires_grad_(True)
            for name, p in params.items()
        }
        self.shadow_optimizer = recipe.make_optimizer(list(self.shadow.values()))
        self.meant = {name: torch.zeros_like(s) for name, s in self.shadow.items()}
        self.applied = {name: torch.zeros_like(s) for name, s in self.shadow.items()}
        self.before: dict[str, torch.Tensor] = {}

    def record_before(self) -> None:
        """The stored weights and their gradients, before the optimizer steps them; the
        shadow's step from them."""
        self.before = {n: w.detach().to(torch.float64) for n, w in self.held.items()}
        for name, shadow in self.shadow.items():
            shadow.copy_(self.before[name])
            grad = self.params[name].grad
            shadow.grad = None if grad is None else grad.detach().to(torch.float64)
        self.shadow_optimizer.step()
        for name, shadow in self.shadow.items():
            self.meant[name] += shadow.detach() - self.before[name]

    def record_after(self) -> None:
        for name, w in self.held.items():
            self.applied[name] += w.detach().to(torch.float64) - self.before[name]

    def lost_share(self) -> float:
        """1 - <applied, meant> / <meant, meant> over every weight, clamped to [0, 1]: 0 where
        the weights received what the optimizer computed, 1 where they received none of it."""
        meant = torch.cat([m.flatten().cpu() for m in self.meant.values()])
        applied = torch.cat([a.flatten().cpu() for a in self.applied.values()])
        norm = float(meant @ meant)
        if norm == 0.0 or not math.isfinite(norm):
            return 0.0 if norm == 0.0 else 1.0
        kept = float(applied @ meant) / norm
        return min(1.0, max(0.0, 1.0 - kept)) if math.isfinite(kept) else 1.0


def held_weights(
    params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """The tensors that hold the weights' values between steps: the parameters, or what
    the optimizer keeps for them where it says so (``optimizer.held_weights()``, one tensor
    per parameter in order: float32 master weights, whose rounding to the parameters'
    dtype loses nothing the next step needs)."""
    held = getattr(optimizer, "held_weights", None)
    if held is None:
        return params
    values = list(held())
    if len(values) != len(params):
        raise TypeError(
            f"{type(optimizer).__name__}.held_weights() gave {len(values)} tensors for "
            f"{len(params)} parameters"
        )
    return dict(zip(params, values, strict=True))


def fit(
    forward: Callable[[], Any],
    loss_of: Callable[[Any], Any],
    model: Any,
    precision: Precision,
    recipe: Recipe = DEFAULT_RECIPE,
    scaler: str | None = None,
    steps: int | None = None,
) -> FitRun:
    """``steps`` optimizer steps on the same data with ``recipe`` (forward and loss under
    the mode's autocast, the loss scaling ``scaler`` names, None: the mode's, a GradScaler
    for float16 under autocast), and the loss once more after the last."""
    steps = fit_steps() if steps is None else steps
    params = trainable_parameters(model)
    optimizer = recipe.make_optimizer(list(params.values()))
    scaling = loss_scaler(scaler_policy(precision, scaler), precision, recipe)
    ledger = UpdateLedger(params, recipe, optimizer)
    losses: list[float] = []
    skipped = 0
    first_output: Any = None
    for step in range(steps):
        traced = step == 0
        with traced_if(traced):
            output, loss = forward_and_loss(
                forward, loss_of, params, precision, recipe.accumulation
            )
            backward(loss, scaling)
        if traced:
            first_output = output
        with untraced():
            losses.append(float(loss.detach()))
            skipped += not optimizer_step(optimizer, scaling, ledger, recipe.clip_norm)
    with torch.no_grad(), seen_by_replay_alone(), autocast_region(precision):
        losses.append(float(scalar_loss_value(loss_of(forward()))))
    with untraced():
        return FitRun(
            torch.tensor(losses, dtype=torch.float64),
            first_output,
            skipped,
            scaling.get_scale() if scaling is not None else None,
            ledger.lost_share(),
            eps_cause(optimizer),
            skipper_of(scaling),
        )


def eps_cause(optimizer: torch.optim.Optimizer) -> str | None:
    """An ``eps`` (Adam's, RMSprop's, ...) below the smallest normal of the dtype of the
    weights it divides the update of: 1e-8 is 0 in float16 (its smallest subnormal is
    6e-8), so a weight whose squared gradient underflows divides 0 by 0 from the first
    step; None where every group's ``eps`` holds in its weights' dtype."""
    for group in optimizer.param_groups:
        eps = group.get("eps")
        if not isinstance(eps, float) or eps <= 0.0:
            continue
        for dtype in dict.fromkeys(p.dtype for p in group["params"] if p.is_floating_point()):
            tiny = torch.finfo(dtype).tiny
            if eps < tiny:
                held = float(torch.tensor(eps, dtype=dtype))
                return (
                    f"{type(optimizer).__name__}'s eps ({eps:g}) is below "
                    f"{str(dtype).removeprefix('torch.')}'s smallest normal ({tiny:.3g}) and "
                    f"is {held:g} in it: a weight whose squared gradient underflows divides "
                    "by it (a larger eps, or float32 master weights, holds)"
                )
    return None


@contextmanager
def traced_if(traced: bool) -> Iterator[None]:
    """The first step runs where the tracer sees it; the later ones out of its sight, seen
    by the replay's modes alone (each step's draws are the cell's to replay)."""
    if traced:
        yield
    else:
        with seen_by_replay_alone():
            yield


def loss_scaler(policy: str, precision: Precision, recipe: Recipe) -> Any:
    """What scales the fit's loss under ``policy``: a GradScaler (``dynamic``; for half
    weights in float16, which it refuses, a :class:`DynamicScaler`), a :class:`FixedScaler`
    (``static``), or None."""
    if policy == DYNAMIC_SCALER and holds_scale(precision, policy):
        return DynamicScaler()
    if policy == DYNAMIC_SCALER:
        return make_grad_scaler(precision.device)
    if policy == STATIC_SCALER:
        return FixedScaler(recipe.static_scale)
    return None


def skipper_of(scaling: Any) -> str:
    """How a fit's note names what skipped its steps: a scale of the harness's names itself
    (:meth:`FixedScaler.skipper`), else a ``GradScaler``."""
    return scaling.skipper() if isinstance(scaling, FixedScaler) else "GradScaler"


class FixedScaler:
    """A static loss scale with the part of a GradScaler's interface a fit calls: the loss
    scaled by a fixed ``scale``, the gradients divided back in place in their own dtype (a
    float16 gradient of half weights too, which a GradScaler refuses), a step whose
    gradients are not finite skipped, the scale never changed."""

    def __init__(self, scale: float) -> None:
        self.scale_value = scale
        self.finite = True

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        unscale_in_place(grads, self.scale_value)
        self.finite = all_finite(g for g in grads if g is not None)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.finite:
            optimizer.step()

    def update(self) -> None:
        """A static scale does not move."""

    def get_scale(self) -> float:
        return self.scale_value

    def skipper(self) -> str:
        return f"the static loss scale ({self.scale_value:g})"


class DynamicScaler(FixedScaler):
    """A dynamic loss scale for the float16 gradients of half weights, which a GradScaler
    refuses to unscale: a GradScaler's initial scale, the gradients divided back in place in
    float16 (as a memory-efficient float16 optimizer does), halved after a skipped step as a
    GradScaler backs off (it grows only every 2000 steps, beyond a short fit)."""

    def __init__(self) -> None:
        super().__init__(INIT_SCALE)

    def update(self) -> None:
        if not self.finite:
            self.scale_value /= 2

    def skipper(self) -> str:
        return HELD_SCALER


def backward(loss: torch.Tensor, scaler: Any) -> None:
    if scaler is None:
        loss.backward()
    else:
        scaler.scale(loss).backward()


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    scaler: Any,
    ledger: UpdateLedger,
    clip_norm: float | None = None,
) -> bool:
    """The optimizer's step (through the scaler where there is one, its gradients unscaled
    first, then clipped to ``clip_norm`` where the recipe clips), with the ledger's record
    around it; False where the scaler skipped it (gradients not finite at its scale)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
        if not all_finite(p.grad for p in ledger.params.values()):
            scaler.step(optimizer)  # skips the step, as a fit's loop would call it
            scaler.update()
            return False
    if clip_norm is not None:
        clip_gradients([p.grad for p in ledger.params.values() if p.grad is not None], clip_norm)
    try:
        ledger.record_before()
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    except RuntimeError as error:
        refused = sparse_refusal(optimizer, ledger.params, error)
        if refused is None:
            raise
        raise refused from error
    ledger.record_after()
    return True


def sparse_refusal(
    optimizer: torch.optim.Optimizer, params: dict[str, torch.Tensor], error: RuntimeError
) -> TrainingError | None:
    """An optimizer that refused a sparse gradient (``nn.Embedding(sparse=True)`` under
    Adam: "Adam does not support sparse gradients"), as one line naming the optimizer and
    the parameter; None for any other error."""
    if "sparse" not in str(error):
        return None
    sparse = next(
        (name for name, p in params.items() if p.grad is not None and p.grad.is_sparse), None
    )
    if sparse is None:
        return None
    return TrainingError(
        f"the fit's optimizer, {type(optimizer).__name__}, does not take sparse gradients "
        f"(grad.{sparse} is sparse): name a recipe whose optimizer does "
        "(torch.optim.SparseAdam, SGD)"
    )


def scalar_loss_value(loss: Any) -> torch.Tensor:
    """The last loss, after the last step: a scalar tensor (no gradient needed)."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.detach().reshape(())
    return scalar_loss(loss)


def fit_figures(run: FitRun, reference: torch.Tensor) -> FitFigures:
    """A fit's figures beside the float64 fit's loss curve ``reference``."""
    losses = tuple(float(v) for v in run.losses)
    reference_losses = tuple(float(v) for v in reference)
    return FitFigures(
        losses,
        reference_losses,
        run.skipped_steps,
        run.final_scale,
        run.lost_share,
        shortfall(losses[-1], reference_losses),
    )


def stall_reason(figures: FitFigures) -> str | None:
    """Why a fit stalled, or None: a loss that is not finite, every step skipped, or its
    last loss beyond the float64 fit's by more than ``SHORTFALL_LIMIT`` of its scale."""
    if not all(math.isfinite(v) for v in figures.losses):
        step = next(i for i, v in enumerate(figures.losses) if not math.isfinite(v))
        return f"the fit's loss is not finite from step {step}"
    if figures.steps and figures.skipped_steps == figures.steps:
        return f"the loss scale skipped every step of the fit (scale {figures.final_scale:g})"
    scale = end_scale(figures.reference_losses)
    if scale is None or figures.shortfall is None or figures.shortfall <= scale.limit:
        return None
    return "the fit stalls: " + where_it_ends(figures)


def evidence(figures: FitFigures) -> str | None:
    """What the optimizer's updates show beside the verdict, where worth saying: the share
    of them the weights' rounding dropped (the GradScaler's skipped steps have their own
    note, :attr:`FitRun.note`)."""
    finite = all(math.isfinite(v) for v in figures.losses)
    if not finite or not figures.lost_share >= LOST_WORTH_SAYING:
        return None  # a step that made the weights not finite lost nothing to rounding
    return (
        f"{figures.lost_share:.0%} of the updates the optimizer computed were lost to the "
        "weights' rounding"
    )


def shortfall_numerics(figures: FitFigures) -> Numerics:
    """The fit's figures where the report reads a cell's error and tolerance: how far its
    last loss ends beyond the float64 fit's, against its limit."""
    finite = all(math.isfinite(v) for v in figures.losses)
    judged = figures.shortfall
    scale = end_scale(figures.reference_losses)
    return Numerics(
        max_abs_err=abs(figures.losses[-1] - figures.reference_losses[-1]),
        rel_err=judged if judged is not None else (0.0 if finite else math.inf),
        baseline_rel_err=None,
        tolerance=scale.limit if scale is not None else SHORTFALL_LIMIT,
        tolerance_rule="fit: the last loss beyond the same fix's float64 fit's, over its "
        f"{scale.name if scale is not None else PROGRESS}",
        finite=finite,
        leaf="loss at the end",
        decided_by="float64 fit",
        factor=None,
    )
