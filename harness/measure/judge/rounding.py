"""The rounding yardstick's data: a float64 workload whose values are rounded to a dtype.

The reference computation run on these values, in float64, costs exactly what representing
the weights and inputs in the dtype costs, and nothing of how any fix computes (see
:mod:`harness.measure.judge.numerics`). Parts kept in float32 stay as they are. float32 data
cannot be rounded to float32 (they already are float32), so for the float32 control the rounding is
simulated: each value is moved by a random relative amount of at most the unit roundoff,
float32's, or TF32's (10 mantissa bits) where a GPU computes float32 matmuls in TF32; a value
the format holds exactly (an integer up to 2**24 in float32, 2**11 in TF32) is not moved.

A model in a dtype also stores its activations in it: each layer's output is rounded before
the next layer reads it, a cost that grows with depth (a healthy post-LayerNorm encoder of 48
layers loses 19-23 times what rounding its weights and inputs to half costs). So where a
cell's model holds its weights in the cell's dtype (modes ``half`` and ``half-autocast``)
the yardstick also rounds what the model stores between its modules: every floating tensor
a module returns, rounded by a forward hook while the computation itself stays in float64.
What happens inside a module's ``forward`` (a sum, a variance, the angles of a rotary
embedding) is never rounded, so a silent bug within a module still costs more than the
yardstick. Modules kept in float32, those inside them and those that hold them (their
output may be float32) are not rounded; nor are values beyond the dtype's range (the
yardstick measures precision: an overflow makes the cell's own output non-finite). Under
``autocast`` (float32 weights) a module returns half or float32 by the ops it ends with, and
the residual stream, the norms and the softmax stay float32: only the data are rounded.
The float32 control's yardstick is float32 arithmetic itself, simulated op by op with the
accumulation of long reductions (:mod:`harness.measure.judge.float32_arithmetic`): float32
has no half-precision bugs to hide, and a float32 sum over 2048 tokens costs 28 times what
rounding its data does.

The yardstick measures what the dtype's precision costs, never the failure under test:

* **Gradients as a scaled step holds them.** Where a cell's recipe scales its loss (float16
  in every mode: a GradScaler, or for half weights the same scale held by the harness), each
  module's gradient is rounded in backward as a
  dynamically scaled step holds it: multiplied by the largest power of two, up to the
  GradScaler's initial 2**16, at which it does not overflow, rounded, and divided back
  (exact: a power of two moves only the exponent); and the trusted fix's step, whose
  ``half`` recipe has no scaler, is taken scaled too (``training.held_scaled``). Before, it
  ran unscaled, underflowing as an unscaled step does, and excused the underflow a
  GradScaler exists to prevent: cross-entropy over 16,384 tokens without a scaler, 9.9
  times as far from float64 as with one, passed. The ``half`` modes' float16 recipe scales
  too (:func:`harness.measure.running.training.holds_scale`), so their yardstick rounds
  each gradient scaled as well; while it trained unscaled, healthy models in pure float16
  read 15 to 1000 times a scaled yardstick (12-layer BERT 22.8, Qwen2 20.5, OPT 15.2; BART
  lost a whole gradient), the cost of the unscaled recipe. Underflow in the forward stays
  in (no scaler prevents it).
* **Integers the dtype cannot count are not data.** A floating buffer whose values are all
  integers, the largest beyond the dtype's exact integers (2**11 = 2048 for float16, 2**8 =
  256 for bfloat16: ``2 / eps``), holds positions, indices or counts, not measurements:
  rounding it (positions 3000 and up, rounded by ``.half()``, move by 2 in float16 and 16
  in bfloat16) is a bug the cell's own cast makes (gradients 20% and 168% off, 139-211
  times the error of the same model with an integer buffer), so the yardstick keeps it
  exact. Integers the dtype holds exactly are unmoved by rounding anyway; a buffer of
  measurements (inverse frequencies, a running mean) is rounded as any weight is.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from harness.measure.judge.float32_arithmetic import Float32Arithmetic, integers_up_to
from harness.measure.judge.numerics import HALF_DTYPES
from harness.measure.precision.casting import is_kept, map_tensors
from harness.measure.precision.dtypes import TORCH_DTYPES
from harness.measure.running.replay import dtype_eps
from harness.measure.running.training import INIT_SCALE
from harness.measure.tracing.dispatch_mode import out_of_modes
from harness.schema.axes import MODES
from harness.schema.stages import stage_of

#: The dtypes whose rounding is simulated, and their unit roundoff (half an ulp at 1).
SIMULATED_ROUNDOFF = {"float32": 2.0**-24, "tf32": 2.0**-11}
#: The simulated rounding's noise is seeded: the yardstick is the same in every process.
NOISE_SEED = 20261123
#: The stored activations' noise has a seed of its own (not a replay of the weights').
STORED_NOISE_SEED = NOISE_SEED + 1
#: What a model stores its activations in, where that is not the dtype its data are rounded
#: to: TF32 is how a GPU multiplies float32 matrices, their results are float32.
STORED_AS = {"tf32": "float32"}


def round_to(tensor: torch.Tensor, dtype: str, noise: torch.Generator) -> torch.Tensor:
    """A float64 tensor's values as ``dtype`` would hold them, still in float64. The
    rounding is the yardstick's, not the computation's: no dispatch mode of the run sees
    it (a float64 run keeps float64 where the code casts narrower, and would undo it:
    :mod:`harness.measure.running.stays_float64`; a replay would count its draws)."""
    if not tensor.is_floating_point():
        return tensor
    with out_of_modes():
        return rounded_in_float64(tensor, dtype, noise)


def rounded_in_float64(tensor: torch.Tensor, dtype: str, noise: torch.Generator) -> torch.Tensor:
    if dtype in SIMULATED_ROUNDOFF:
        relative = torch.rand(tensor.shape, generator=noise, dtype=torch.float64) * 2 - 1
        moved = tensor * (1 + SIMULATED_ROUNDOFF[dtype] * relative.to(tensor.device))
        return torch.where(integers_up_to(tensor, largest_exact_integer(dtype)), tensor, moved)
    narrow = tensor.to(TORCH_DTYPES[dtype])
    if narrow.dtype in HALF_DTYPES and tensor.dtype == torch.float64:
        narrow = narrow.float()  # exact, and faster (HALF_DTYPES)
    return narrow.to(tensor.dtype)


def largest_exact_integer(dtype: str) -> float:
    """From 0 to this, ``dtype`` holds every integer: ``2 / eps`` (2048 in float16, 256 in
    bfloat16, 2**24 in float32)."""
    return 2.0 / dtype_eps(dtype)


def counts_beyond(tensor: torch.Tensor, dtype: str) -> bool:
    """A floating tensor of integers only, the largest beyond ``dtype``'s exact integers:
    positions, indices or counts that the dtype cannot hold (see the module docstring)."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return False
    values = tensor.detach()
    if not bool(torch.isfinite(values).all()) or not bool((values == values.round()).all()):
        return False
    return float(values.abs().max()) > largest_exact_integer(dtype)


def round_model(model: Any, dtype: str, keep: tuple[str, ...], noise: torch.Generator) -> Any:
    """The model's floating parameters and buffers rounded in place (those ``keep`` names
    left as they are, and buffers of integers the dtype cannot hold: :func:`counts_beyond`);
    a tensor, or tensors in lists and dicts, rounded."""
    if isinstance(model, nn.Module):
        counts = {name for name, b in model.named_buffers() if counts_beyond(b, dtype)}
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if tensor.is_floating_point() and not is_kept(name, keep) and name not in counts:
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


def rounds_activations(mode: str) -> bool:
    """Whether a cell's rounding yardstick also rounds the activations its model stores
    between modules: wherever its weights are in the cell's dtype, that is in every mode but
    ``autocast`` (float32 weights, each op in the dtype autocast picks for it)."""
    return MODES[mode].casts_model or not MODES[mode].autocast


def stored_rounding(
    model: Any, dtype: str, keep: tuple[str, ...], activations: bool, stage: str
) -> AbstractContextManager[Any]:
    """What the yardstick's run rounds beyond its data: for the float32 control, every op's
    result as float32 arithmetic rounds it (:class:`Float32Arithmetic`); with
    ``activations`` what every module returns, and in backward the gradient each of them
    receives (:func:`rounding_outputs`); without (``autocast``), in a training step, that
    gradient only, as the recipe's dynamically scaled step holds it
    (:func:`round_gradient`); else nothing."""
    if dtype in SIMULATED_ROUNDOFF and activations:
        stored_as = STORED_AS.get(dtype, dtype)
        return Float32Arithmetic(SIMULATED_ROUNDOFF[stored_as], noise_source(STORED_NOISE_SEED))
    if activations:
        return rounding_outputs(model, dtype, keep)
    if stage_of(stage).trains:
        return rounding_outputs(model, dtype, keep, values=False)
    return nullcontext()


@contextmanager
def rounding_outputs(
    model: Any, dtype: str, keep: tuple[str, ...], values: bool = True
) -> Iterator[None]:
    """While it lasts, a forward hook on every module of ``model`` (or of the modules in
    it) that rounds the floating tensors the module returns to what ``dtype`` stores (see
    ``STORED_AS``), and in backward the gradient that reaches them (a model in the dtype
    holds both in it); a module that ``keep`` names, one inside it and one that holds it
    left without, and a scripted one (it takes no hooks; its parent's output is rounded).
    With ``values`` False (a training step under autocast: its float32 weights keep the
    forward's values as autocast's ops leave them) only the gradients are rounded: the
    backward of every op autocast ran in the dtype gives its input the dtype's gradient,
    so what reaches a module's output has been through such ops but for the float32
    residual stream's share, and each gradient is rounded as the recipe's dynamically
    scaled step holds it (:func:`round_gradient`). The hooks are removed
    after: a module may be shared beyond this model (diffusers 0.31 hands every model one
    ``nn.SiLU``), and nothing else must be rounded."""
    stored_as = STORED_AS.get(dtype, dtype)
    noise = noise_source(STORED_NOISE_SEED)
    hook = StoredRounding(stored_as, noise) if values else GradientRounding(stored_as, noise)
    handles: list[RemovableHandle] = []

    def hooked(module: nn.Module) -> nn.Module:
        for name, part in module.named_modules():
            if not holds_kept(name, keep) and not isinstance(part, torch.jit.ScriptModule):
                handles.append(part.register_forward_hook(hook))
        return module

    try:
        map_tensors(model, lambda tensor: tensor, hooked)
        yield
    finally:
        for handle in handles:
            handle.remove()


def holds_kept(name: str, keep: tuple[str, ...]) -> bool:
    """The module ``name`` is kept in float32, is inside a kept module, or holds a kept
    part (the root module, named ``""``, holds every one)."""
    return is_kept(name, keep) or any(not name or k.startswith(name + ".") for k in keep)


class StoredRounding:
    """A forward hook: what a module returns with each floating tensor in it rounded to
    ``dtype`` (the containers torch's pytree knows rebuilt, transformers' and diffusers'
    outputs among them; anything else, a cache object, passed on as it is). A tensor is
    rounded once: one that a module passes on from a module inside it (a container returning
    its last layer's output) is rounded already, and a simulated rounding would move it
    again."""

    def __init__(self, dtype: str, noise: torch.Generator) -> None:
        self.dtype = dtype
        self.noise = noise
        self.rounded: weakref.WeakValueDictionary[int, torch.Tensor] = (
            weakref.WeakValueDictionary()
        )

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            return self.once(output)
        return pytree.tree_map_only(torch.Tensor, self.once, output)

    def once(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.rounded.get(id(tensor)) is tensor:
            return tensor
        if torch.is_grad_enabled() and tensor.requires_grad:
            result = StoredValue.apply(tensor, self.dtype, self.noise)
        else:  # no backward to round a gradient in: the value alone
            result = round_stored(tensor, self.dtype, self.noise)
        self.rounded[id(result)] = result
        return result


class GradientRounding:
    """A forward hook that leaves what a module returns as it is and rounds, in
    backward, the gradient each floating tensor of it receives to ``dtype``, as a
    dynamically scaled step holds it."""

    def __init__(self, dtype: str, noise: torch.Generator) -> None:
        self.dtype = dtype
        self.noise = noise

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        return pytree.tree_map_only(torch.Tensor, self.rounding_gradient, output)

    def rounding_gradient(self, tensor: torch.Tensor) -> torch.Tensor:
        if not (tensor.is_floating_point() and tensor.requires_grad):
            return tensor
        return StoredGradient.apply(tensor, self.dtype, self.noise)


class StoredValue(torch.autograd.Function):
    """A value as ``dtype`` stores it (:func:`round_stored`), and in backward its gradient
    as ``dtype`` stores it too, as a dynamically scaled step in the dtype holds it
    (:func:`round_gradient`: the float16 recipe scales half weights' loss as well); for a
    simulated rounding moved by noise of its own (not the value's, which a product with
    the noise would replay)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dtype: str, noise: torch.Generator) -> Any:
        ctx.dtype, ctx.noise = dtype, noise
        return round_stored(tensor, dtype, noise)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return round_gradient(grad, ctx.dtype, ctx.noise), None, None


class StoredGradient(torch.autograd.Function):
    """A value as it is, and in backward its gradient as a scaled step in ``dtype`` holds
    it (:func:`round_gradient`)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dtype: str, noise: torch.Generator) -> Any:
        ctx.dtype, ctx.noise = dtype, noise
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return round_gradient(grad, ctx.dtype, ctx.noise), None, None


def round_gradient(grad: torch.Tensor, dtype: str, noise: torch.Generator) -> torch.Tensor:
    """``grad`` as a dynamically scaled step holds it in ``dtype``: multiplied by
    :func:`held_scale`, rounded, divided back (a power of two: only the range moves)."""
    if dtype in SIMULATED_ROUNDOFF or not grad.is_floating_point():
        return round_stored(grad, dtype, noise)
    scale = held_scale(grad, dtype)
    return round_stored(grad * scale, dtype, noise) / scale


def held_scale(grad: torch.Tensor, dtype: str) -> float:
    """The scale a dynamic GradScaler holds ``grad`` at: the largest power of two, up to
    its initial scale, at which ``grad`` does not overflow ``dtype``."""
    largest = float(grad.detach().abs().max()) if grad.numel() else 0.0
    if largest == 0.0 or not math.isfinite(largest):
        return INIT_SCALE
    room = torch.finfo(TORCH_DTYPES[dtype]).max / largest
    return min(INIT_SCALE, 2.0 ** math.floor(math.log2(room)))


def round_stored(tensor: torch.Tensor, dtype: str, noise: torch.Generator) -> torch.Tensor:
    """``tensor`` rounded to ``dtype``, its values beyond the dtype's range left as they are.
    Like :func:`round_to`, out of the run's dispatch modes: the yardstick's own ops."""
    if not tensor.is_floating_point():
        return tensor
    with out_of_modes():
        rounded = rounded_in_float64(tensor, dtype, noise)
        if all_finite(rounded):
            return rounded
        return torch.where(torch.isinf(rounded) & torch.isfinite(tensor), tensor, rounded)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite (its least and largest: one pass)."""
    if not tensor.numel():
        return True
    least, largest = torch.aminmax(tensor)
    return math.isfinite(float(least)) and math.isfinite(float(largest))


def noise_source(seed: int = NOISE_SEED) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
