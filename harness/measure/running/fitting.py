"""The ``fit`` stage: a short run of optimizer steps on fixed data, with the recipe of the
cell's mode (:mod:`harness.measure.running.training`), and what it shows that one step cannot:

- the loss curve, judged against the float64 fit of the same model and data: a fit whose
  last loss falls short of the float64 fit's progress by more than ``SHORTFALL_LIMIT``
  (or is not finite) stalls;
- the steps a GradScaler skipped (gradients not finite at its scale) and its final scale;
- the share of the parameter updates lost to rounding: the update applied to the stored
  weights (or to what an optimizer holds for them: float32 master weights) against the
  update the optimizer computed from the same gradients in float64
  (a shadow of the optimizer on float64 copies of the weights, synchronised before each
  step). Pure bfloat16 weights stepped by Adam at a small learning rate keep almost none
  of their updates: each is below half a unit in the last place of the weight it updates.

The optimizer is AdamW at the case's ``fit_lr`` (no weight decay) unless the fix brings its
own (``@fix(optimizer=...)``: float32 master weights, say). Only the first step runs under
the dtype tracer and the mode's checks (the rest repeat it); the optimizer's bookkeeping
never does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from harness.measure.authoring.case import OptimizerFactory
from harness.measure.precision.modes import Precision, autocast_region
from harness.measure.running.training import (
    make_grad_scaler,
    scalar_loss,
    trainable_parameters,
    uses_grad_scaler,
)
from harness.measure.tracing.backward_sites import all_finite
from harness.schema.config import DEFAULT_FIT_STEPS
from harness.schema.records import FitFigures, Note, NoteKind, Numerics

#: A fit stalls where its last loss falls short of the float64 fit's progress (first loss
#: minus last) by more than this share of it, or where more than ``LOST_LIMIT`` of the
#: updates the optimizer computed never reached the weights. Calibrated in
#: ``benchmarks/bench_fit.py`` (``nox -s verdicts``; the table is in ``docs/tolerance.md``,
#: "The fit stage's limits, calibrated"; CPU, torch 2.13.0, 20 steps): healthy fits fall at most
#: 3.8% short and lose at most 2.7% of their updates; the mildest broken fit
#: (bf16-pure-weights: AdamW on bfloat16 weights at lr 1e-4) is 63% short and loses 65%.
#: The shortfall's limit stays at a half: a loss computed in bfloat16 rounds away up to a
#: third of a slow healthy fit's progress; the share lost, free of that rounding, is held
#: to a quarter (2.6x below the mildest broken fit, 9x above the worst healthy one).
SHORTFALL_LIMIT = 0.5
LOST_LIMIT = 0.25
#: The float64 fit's progress below this share of its first loss is too small to judge a
#: curve against: only the updates lost and the finiteness judge such a fit.
MIN_PROGRESS = 1e-6


_steps = DEFAULT_FIT_STEPS


def use_steps(steps: int) -> None:
    """Set the optimizer steps of every fit this process runs (a run's ``--fit-steps``)."""
    global _steps
    _steps = steps


def fit_steps() -> int:
    return _steps


def adamw(params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """The fit's optimizer unless a fix brings its own: AdamW, no weight decay, one tensor
    at a time (the same arithmetic on every release and device)."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=False)


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

    @property
    def leaves(self) -> dict[str, torch.Tensor]:
        return {"loss": self.losses}

    @property
    def note(self) -> Note | None:
        if not self.skipped_steps:
            return None
        return Note(
            NoteKind.SCALER,
            f"GradScaler skipped {self.skipped_steps} of {self.steps} step(s) of the fit "
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
        make: OptimizerFactory,
        lr: float,
        optimizer: torch.optim.Optimizer,
    ):
        self.params = params
        self.held = held_weights(params, optimizer)
        self.shadow = {
            name: p.detach().to(torch.float64).clone().requires_grad_(True)
            for name, p in params.items()
        }
        self.shadow_optimizer = make(list(self.shadow.values()), lr)
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
    lr: float,
    scaled: bool = True,
    make_optimizer: OptimizerFactory | None = None,
    steps: int | None = None,
) -> FitRun:
    """``steps`` optimizer steps on the same data with the mode's recipe (forward and loss
    under its autocast, a GradScaler for float16 autocast unless ``scaled`` is False), and
    the loss once more after the last."""
    steps = fit_steps() if steps is None else steps
    make = make_optimizer or adamw
    params = trainable_parameters(model)
    optimizer = make(list(params.values()), lr)
    scaler = make_grad_scaler(precision.device) if scaled and uses_grad_scaler(precision) else None
    ledger = UpdateLedger(params, make, lr, optimizer)
    losses: list[float] = []
    skipped = 0
    first_output: Any = None
    for step in range(steps):
        traced = step == 0
        with traced_if(traced):
            optimizer.zero_grad(set_to_none=True)
            output, loss = forward_loss(forward, loss_of, precision)
            backward(loss, scaler)
        if traced:
            first_output = output
        with untraced():
            losses.append(float(loss.detach()))
            skipped += not optimizer_step(optimizer, scaler, ledger)
    with untraced():
        with autocast_region(precision):
            losses.append(float(scalar_loss_value(loss_of(forward()))))
        return FitRun(
            torch.tensor(losses, dtype=torch.float64),
            first_output,
            skipped,
            scaler.get_scale() if scaler is not None else None,
            ledger.lost_share(),
        )


@contextmanager
def traced_if(traced: bool) -> Iterator[None]:
    """The first step runs where the tracer sees it; the later ones out of its sight."""
    if traced:
        yield
    else:
        with _disable_current_modes():
            yield


def forward_loss(
    forward: Callable[[], Any], loss_of: Callable[[Any], Any], precision: Precision
) -> tuple[Any, torch.Tensor]:
    with torch.enable_grad(), autocast_region(precision):
        output = forward()
        return output, scalar_loss(loss_of(output))


def backward(loss: torch.Tensor, scaler: Any) -> None:
    if scaler is None:
        loss.backward()
    else:
        scaler.scale(loss).backward()


def optimizer_step(optimizer: torch.optim.Optimizer, scaler: Any, ledger: UpdateLedger) -> bool:
    """The optimizer's step (through the GradScaler where there is one, its gradients
    unscaled first), with the ledger's record around it; False where the scaler skipped it
    (gradients not finite at its scale)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
        if not all_finite(p.grad for p in ledger.params.values()):
            scaler.step(optimizer)  # skips the step, as a fit's loop would call it
            scaler.update()
            return False
    ledger.record_before()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    ledger.record_after()
    return True


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


def shortfall(last: float, reference: tuple[float, ...]) -> float | None:
    """The share of the float64 fit's progress (first loss minus last) that ``last`` falls
    short of: 0 at the float64 fit's last loss, 1 where it made no progress at all, inf
    where the loss is not finite; None where the float64 fit made too little progress."""
    progress = reference[0] - reference[-1]
    if not progress > MIN_PROGRESS * abs(reference[0]):
        return None
    if not math.isfinite(last):
        return math.inf
    return max(0.0, (last - reference[-1]) / progress)


def stall_reason(figures: FitFigures) -> str | None:
    """Why a fit stalled, or None: a loss that is not finite, every step skipped, or the
    loss short of the float64 fit's progress and its updates lost to rounding (each said
    where it is beyond its limit)."""
    if not all(math.isfinite(v) for v in figures.losses):
        step = next(i for i, v in enumerate(figures.losses) if not math.isfinite(v))
        return f"the fit's loss is not finite from step {step}"
    if figures.steps and figures.skipped_steps == figures.steps:
        return f"the GradScaler skipped every step of the fit (scale {figures.final_scale:g})"
    reasons = []
    if figures.shortfall is not None and figures.shortfall > SHORTFALL_LIMIT:
        reasons.append(
            f"its loss ends at {figures.losses[-1]:.4g}, {figures.shortfall:.0%} short of the "
            f"float64 fit's progress ({figures.reference_losses[0]:.4g} to "
            f"{figures.reference_losses[-1]:.4g})"
        )
    if figures.lost_share > LOST_LIMIT:
        reasons.append(
            f"{figures.lost_share:.0%} of the updates the optimizer computed were lost to the "
            f"weights' rounding"
        )
    return "the fit stalls: " + "; ".join(reasons) if reasons else None


def shortfall_numerics(figures: FitFigures) -> Numerics:
    """The fit's figures where the report reads a cell's error and tolerance: the worse of
    its shortfall and its updates lost, each against its limit."""
    candidates = [(figures.lost_share, LOST_LIMIT, "updates lost")]
    if figures.shortfall is not None:
        candidates.append((figures.shortfall, SHORTFALL_LIMIT, "loss shortfall"))
    value, limit, leaf = max(candidates, key=lambda c: c[0] / c[1])
    finite = all(math.isfinite(v) for v in figures.losses)
    return Numerics(
        max_abs_err=abs(figures.losses[-1] - figures.reference_losses[-1]),
        rel_err=value,
        baseline_rel_err=None,
        tolerance=limit,
        tolerance_rule="fit: shortfall of the float64 fit's progress, updates lost",
        finite=finite,
        leaf=leaf,
        decided_by="float64 fit",
        factor=None,
    )
