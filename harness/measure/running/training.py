"""One training step with the recipe of a cell's mode, the way people train in mixed
precision: the harness, not the case, applies it, so a case cannot forget it.

- ``autocast``: float32 weights; forward and loss under ``torch.autocast``; backward outside
  it. float16 adds ``torch.amp.GradScaler`` (the loss scaled, the gradients unscaled before
  they are read, as Lightning and accelerate do before clipping); bfloat16 runs without one.
- ``half``: weights in the dtype, their gradients too (Lightning ``16-true``/``bf16-true``);
  float16 at a dynamic loss scale the harness holds (``torch.amp.GradScaler`` refuses to
  unscale float16 gradients: :func:`holds_scale`).
- ``half-autocast``: half weights under autocast, scaled as ``half``.
- ``fp32``, and the float64 reference: plain.

What the step gives back to be judged is the loss and every trainable parameter's gradient,
as named leaves (``loss``, ``grad.attn.q_proj.weight``), so they are compared with a float64
step of the same model and data leaf by leaf, by the rule every output is judged by. The
step's optimizer update is the ``fit`` stage's to judge.

The loss is the case's (``Case.loss``), else the ``loss`` a model's output carries (a
transformers model given ``labels``), else the mean squared error of every floating output
against a fixed random target (:func:`harness.measure.authoring.losses.default_loss`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from harness.measure.authoring.losses import TrainingError
from harness.measure.authoring.recipes import DEFAULT_RECIPE, STATIC_SCALE, Recipe
from harness.measure.host import caches
from harness.measure.precision.modes import Precision, autocast_region
from harness.measure.running.recipe_steps import clip_gradients, scaler_policy, static_backward
from harness.measure.tracing.backward_sites import (
    NodeWatch,
    NonFinite,
    RandomState,
    all_finite,
    located_failure,
    located_non_finite,
)
from harness.schema.axes import DYNAMIC_SCALER, NO_SCALER, STATIC_SCALER
from harness.schema.devices import CUDA, device_kind
from harness.schema.records import Note, NoteKind

#: GradScaler's default initial scale, and how many halvings a step may take before its
#: gradients are finite (2**16 down to 2**-8: past it the gradients are not finite at any
#: scale, and the cell is judged with what the last try left).
INIT_SCALE = 2.0**16
MAX_BACKOFFS = 24
GRAD_PREFIX = "grad."
#: Set while a yardstick's step runs (the trusted fix's, see :func:`held_scaled`).
_HELD_SCALED: ContextVar[bool] = ContextVar("held_scaled", default=False)


@contextmanager
def held_scaled() -> Iterator[None]:
    """While it lasts, an unscaled float16 step takes its backward as a dynamically
    scaled step does, and its gradients are read unscaled from the scaled ones
    (:func:`held_backward`): a yardstick measures what float16's precision costs, not the
    underflow a loss scale prevents."""
    token = _HELD_SCALED.set(True)
    try:
        yield
    finally:
        _HELD_SCALED.reset(token)


@dataclass(frozen=True)
class TrainedStep:
    """What one training step leaves to be judged: the loss and the gradients as named
    leaves, the forward output (for the checks of what the mode promised), and a note on
    what the GradScaler did, if it skipped steps."""

    leaves: dict[str, torch.Tensor]
    forward_output: Any
    note: Note | None = None


def trainable_parameters(model: Any) -> dict[str, torch.Tensor]:
    """The floating parameters that require a gradient, by name; a model that is one tensor
    (a weight the fix multiplies by) is its own parameter, ``model``."""
    params: dict[str, torch.Tensor]
    if isinstance(model, torch.nn.Module):
        params = {
            name: p
            for name, p in model.named_parameters()
            if p.requires_grad and p.is_floating_point()
        }
    elif isinstance(model, torch.Tensor) and model.is_floating_point():
        params = {"model": model.requires_grad_(True)}
    else:
        params = {}
    if not params:
        raise TrainingError("the model has no trainable parameters: nothing to train")
    return params


def scalar_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise TrainingError(f"the loss is {type(loss).__name__}, not a tensor")
    if loss.numel() != 1:
        raise TrainingError(f"the loss is not a scalar: it has shape {tuple(loss.shape)}")
    if not loss.requires_grad:
        raise TrainingError("the loss does not depend on any trainable parameter")
    return loss.reshape(())


@caches.cache
def warm_up() -> None:
    """Construct an optimizer once, so its one-time import (``torch._dynamo``, about a
    second) is done in the worker before it forks its cells, not in every forked batch."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)


def grad_scaler_skip_reason(device: str) -> str | None:
    """Why the AMP recipe cannot run here, or None: ``torch.amp.GradScaler`` (torch 2.3+)
    is what scales on a CPU; before it only CUDA had one (``torch.cuda.amp``)."""
    if hasattr(torch.amp, "GradScaler"):
        return None
    if device_kind(device) == CUDA:
        return None
    return "a GradScaler on the CPU needs torch 2.3+ (torch.amp.GradScaler)"


def make_grad_scaler(device: torch.device) -> Any:
    if hasattr(torch.amp, "GradScaler"):
        return torch.amp.GradScaler(device.type, init_scale=INIT_SCALE)
    return torch.cuda.amp.GradScaler(init_scale=INIT_SCALE)  # pragma: no cover - torch < 2.3


def train_step(
    forward: Callable[[], Any],
    loss_of: Callable[[Any], Any],
    model: Any,
    precision: Precision,
    recipe: Recipe = DEFAULT_RECIPE,
    scaler: str | None = None,
) -> TrainedStep:
    """Forward and loss under the mode's autocast (``recipe.accumulation`` micro-batches),
    backward outside it with the loss scaling ``scaler`` names (None: the mode's, a
    GradScaler for float16 under autocast), the gradients clipped as the recipe clips them;
    the loss and the gradients of ``model``'s trainable parameters. A backward that raised,
    or left gradients that are not finite, is taken again to say where
    (``backward_sites``)."""
    params = trainable_parameters(model)
    policy = scaler_policy(precision, scaler)
    held = holds_scale(precision, policy)
    began = RandomState.now(precision.device)
    micro = recipe.accumulation
    output, loss = forward_and_loss(forward, loss_of, params, precision, micro)
    try:
        ran = backward_pass(loss, params, precision.device, policy, held, recipe.static_scale)
    except Exception as error:
        del output, loss  # the failed step's graph, freed before the step is taken again
        backward = partial(
            backward_pass,
            params=params,
            device=precision.device,
            policy=policy,
            held=held,
            static_scale=recipe.static_scale,
        )
        again = partial(step_again, began, forward, loss_of, precision, backward, micro=micro)
        located_failure(error, again, params)
        raise
    own = {name: p.grad.detach() for name, p in params.items() if p.grad is not None}
    grads = {GRAD_PREFIX + name: g for name, g in own.items()}
    if held and ran.scale is not None:
        grads = {name: g.float() / ran.scale for name, g in grads.items()}
    if recipe.clip_norm is not None:
        clip_gradients(grads.values(), recipe.clip_norm)
    note = ran.note
    if not all_finite(grads.values()):
        rerun = partial(
            step_again,
            began,
            forward,
            loss_of,
            precision,
            partial(backward_at, ran.scale),
            micro=micro,
        )
        note = non_finite_note(located_non_finite(rerun, params), ran.note)
        for name, p in params.items():  # the step's own gradients, not those taken again
            p.grad = own.get(name)
    return TrainedStep({"loss": loss.detach(), **grads}, output, note)


def forward_and_loss(
    forward: Callable[[], Any],
    loss_of: Callable[[Any], Any],
    params: dict[str, torch.Tensor],
    precision: Precision,
    micro: int = 1,
) -> tuple[Any, torch.Tensor]:
    """The forward and its scalar loss under the mode's autocast, from no gradient (a timed
    step repeats), over ``micro`` micro-batches (:func:`step_loss`)."""
    for param in params.values():
        param.grad = None
    with torch.enable_grad(), autocast_region(precision):
        return step_loss(forward, loss_of, micro)


def step_loss(
    forward: Callable[[], Any], loss_of: Callable[[Any], Any], micro: int = 1
) -> tuple[Any, torch.Tensor]:
    """The first micro-batch's output and the step's loss: ``micro`` forwards of the whole
    workload (a recipe's ``accumulation``), each loss divided by their number, summed. The
    backward of the sum adds each micro-batch's gradient into a weight's in the gradient's
    own dtype, as that many backward calls into ``.grad`` would."""
    output = forward()
    loss = scalar_loss(loss_of(output))
    if micro == 1:
        return output, loss
    loss = loss / micro
    for _ in range(micro - 1):
        loss = loss + scalar_loss(loss_of(forward())) / micro
    return output, loss


@dataclass(frozen=True)
class BackwardRan:
    """What a step's backward did: the scale its gradients were computed at (None:
    unscaled), and the GradScaler's note where it skipped steps."""

    scale: float | None = None
    note: Note | None = None


def holds_scale(precision: Precision, policy: str) -> bool:
    """Whether the step's backward is taken at a dynamic loss scale the harness holds
    itself (:func:`held_backward`): a dynamically scaled float16 step of half weights,
    whose float16 gradients ``torch.amp.GradScaler`` refuses to unscale (as a
    memory-efficient float16 optimizer keeps them scaled and reads them unscaled in
    float32), and an unscaled float16 step taken as a yardstick (:func:`held_scaled`)."""
    if precision.dtype != torch.float16 or precision.managed_by_case:
        return False
    if policy == DYNAMIC_SCALER:
        return precision.casts_model
    return policy == NO_SCALER and _HELD_SCALED.get()


def backward_pass(
    loss: torch.Tensor,
    params: dict[str, torch.Tensor],
    device: torch.device,
    policy: str,
    held: bool = False,
    static_scale: float = STATIC_SCALE,
) -> BackwardRan:
    """The backward of the recipe's loss scaling ``policy``: at a dynamic scale the harness
    holds (``held``: :func:`holds_scale`), through a GradScaler (``dynamic``), at a fixed
    scale (``static``), else plain."""
    if held:
        return held_backward(loss, params, noted=policy == DYNAMIC_SCALER)
    if policy == DYNAMIC_SCALER:
        return scaled_backward(loss, params, device)
    if policy == STATIC_SCALER:
        static_backward(loss, params.values(), static_scale)
        return BackwardRan(static_scale)
    loss.backward()
    return BackwardRan()


#: How a note names the dynamic loss scale the harness holds for half weights.
HELD_SCALER = "the dynamic loss scale"


def held_backward(
    loss: torch.Tensor, params: dict[str, torch.Tensor], noted: bool = False
) -> BackwardRan:
    """Backward at the loss scale a dynamic GradScaler settles on (its initial scale,
    halved while the gradients are not finite), the gradients left scaled: a GradScaler
    refuses to unscale float16 gradients in place, so they are read unscaled in float32.
    ``noted``: the cell's own scaling, whose skipped steps a note names."""
    scale, skipped = INIT_SCALE, list[float]()
    for _ in range(MAX_BACKOFFS):
        for param in params.values():
            param.grad = None
        (loss * scale).backward(retain_graph=True)
        if all_finite(p.grad for p in params.values()):
            return BackwardRan(scale, scaler_note(skipped, scale, HELD_SCALER) if noted else None)
        skipped.append(scale)
        scale /= 2
    return BackwardRan(skipped[-1], scaler_note(skipped, None, HELD_SCALER) if noted else None)


def step_again(
    began: RandomState,
    forward: Callable[[], Any],
    loss_of: Callable[[Any], Any],
    precision: Precision,
    backward: Callable[[torch.Tensor], object],
    watch: NodeWatch,
    micro: int = 1,
) -> None:
    """The step taken again from the random state it began with, with ``watch`` on its
    graph and ``backward`` as its backward."""
    began.restore()
    _, loss = forward_and_loss(forward, loss_of, watch.params, precision, micro)
    watch.attach(loss.grad_fn)
    backward(loss)


def backward_at(scale: float | None, loss: torch.Tensor) -> None:
    """A plain backward of the loss at the scale a step's gradients were made at (None:
    unscaled)."""
    (loss if scale is None else loss * scale).backward()


def non_finite_note(found: NonFinite | None, skipped: Note | None) -> Note | None:
    """The note of a step whose gradients are not finite: where they went so (after what
    the GradScaler skipped, if it did)."""
    if found is None:
        return skipped
    text = found.describe()
    if skipped is not None:
        text = f"{skipped.text}; {text}"
    return Note(NoteKind.GRADIENT, text)


def scaled_backward(
    loss: torch.Tensor, params: dict[str, torch.Tensor], device: torch.device
) -> BackwardRan:
    """Backward through a GradScaler, its gradients unscaled; where they were not finite
    the scaler skips the step and halves its scale, and the step is taken again (as the
    next step of a fit would be), up to ``MAX_BACKOFFS`` times. A note says what it
    skipped and the scale the step ran at."""
    scaler = make_grad_scaler(device)
    optimizer = torch.optim.SGD(list(params.values()), lr=0.0)
    skipped: list[float] = []
    for _ in range(MAX_BACKOFFS):
        optimizer.zero_grad(set_to_none=True)
        scale = scaler.get_scale()
        scaler.scale(loss).backward(retain_graph=True)
        scaler.unscale_(optimizer)
        if all_finite(p.grad for p in params.values()):
            return BackwardRan(scale, scaler_note(skipped, scale))
        skipped.append(scale)
        scaler.update()  # the skipped step: the scale halves
    return BackwardRan(scale, scaler_note(skipped, None))


def scaler_note(
    skipped: list[float], ran_at: float | None, skipper: str = "GradScaler"
) -> Note | None:
    """What the ``skipper`` skipped (each scale, or the first and last of more than three),
    and the scale the step ran at (None: its gradients were not finite at any it tried)."""
    if not skipped:
        return None
    scales = ", ".join(f"{s:g}" for s in skipped)
    if len(skipped) > 3:
        scales = f"{skipped[0]:g} down to {skipped[-1]:g}"
    if ran_at is None:
        return Note(
            NoteKind.SCALER,
            f"{skipper} skipped every step it tried ({len(skipped)}): gradients not finite "
            f"at scale {scales}",
        )
    return Note(
        NoteKind.SCALER,
        f"{skipper} skipped {len(skipped)} step(s) with gradients not finite at scale "
        f"{scales}; the step ran at scale {ran_at:g}",
    )
