"""The rounding yardstick's data: a float64 workload whose values are rounded to a dtype.

The reference computation run on these values, in float64, costs exactly what representing
the weights and inputs in the dtype costs, and nothing of how any fix computes (see
:mod:`harness.measure.judge.numerics`). Parts kept in float32 stay as they are. float32 data
cannot be rounded to float32 (they already are float32), so for the float32 control the rounding is
simulated: each value is moved by a random relative amount of at most the unit roundoff,
float32's, or TF32's (10 mantissa bits) where a GPU computes float32 matmuls in TF32.

A model in a dtype also stores its activations in it: each layer's output is rounded before
the next layer reads it, a cost that grows with depth (a healthy post-LayerNorm encoder of 48
layers loses 19-23 times what rounding its weights and inputs to half costs). So where a
cell's model holds its weights in the cell's dtype (modes ``half`` and ``half-autocast``, and
the float32 control) the yardstick also rounds what the model stores between its modules:
every floating tensor a module returns, rounded by a forward hook while the computation itself
stays in float64 (to float32 where the data are rounded to TF32: a GPU multiplies float32
matrices in TF32 and stores float32). What happens inside a module's ``forward`` (a sum, a
variance, the angles of a rotary embedding) is never rounded, so a silent bug within a module
still costs more than the yardstick. Modules kept in float32, those inside them and those that
hold them (their output may be float32) are not rounded; nor are values beyond the dtype's
range (the yardstick measures precision: an overflow makes the cell's own output non-finite).
Under ``autocast`` (float32 weights) a module returns half or float32 by the ops it ends with,
and the residual stream, the norms and the softmax stay float32: only the data are rounded.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.hooks import RemovableHandle

from harness.measure.precision.casting import is_kept, map_tensors
from harness.measure.precision.dtypes import TORCH_DTYPES
from harness.measure.running.training import INIT_SCALE
from harness.schema.axes import MODES, TRAIN_STAGE

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


def rounds_activations(mode: str) -> bool:
    """Whether a cell's rounding yardstick also rounds the activations its model stores
    between modules: wherever its weights are in the cell's dtype, that is in every mode but
    ``autocast`` (float32 weights, each op in the dtype autocast picks for it)."""
    return MODES[mode].casts_model or not MODES[mode].autocast


def stored_rounding(
    model: Any, dtype: str, keep: tuple[str, ...], activations: bool, stage: str
) -> AbstractContextManager[None]:
    """What the yardstick's run rounds beyond its data: with ``activations`` what every
    module returns, and in backward the gradient each of them receives
    (:func:`rounding_outputs`); without (``autocast``), in a training step, that gradient
    only, as the recipe holds it: float16's scaled by the GradScaler's initial scale (so
    the yardstick loses to float16's range what the recipe's scaled step loses, not what
    an unscaled one would); else nothing."""
    if activations:
        return rounding_outputs(model, dtype, keep)
    if stage == TRAIN_STAGE:
        scale = INIT_SCALE if dtype == "float16" else 1.0
        return rounding_outputs(model, dtype, keep, values=False, gradient_scale=scale)
    return nullcontext()


@contextmanager
def rounding_outputs(
    model: Any,
    dtype: str,
    keep: tuple[str, ...],
    values: bool = True,
    gradient_scale: float = 1.0,
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
    residual stream's share; each gradient is rounded as it is held scaled by
    ``gradient_scale`` (a power of two: only the range moves). The hooks are removed
    after: a module may be shared beyond this model (diffusers 0.31 hands every model one
    ``nn.SiLU``), and nothing else must be rounded."""
    stored_as = STORED_AS.get(dtype, dtype)
    noise = noise_source(STORED_NOISE_SEED)
    hook = (
        StoredRounding(stored_as, noise)
        if values
        else GradientRounding(stored_as, noise, gradient_scale)
    )
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
        return pytree.tree_map_only(torch.Tensor, self.once, output)

    def once(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.rounded.get(id(tensor)) is tensor:
            return tensor
        result = StoredValue.apply(tensor, self.dtype, self.noise)
        self.rounded[id(result)] = result
        return result


class GradientRounding:
    """A forward hook that leaves what a module returns as it is and rounds, in
    backward, the gradient each floating tensor of it receives to ``dtype``, as it is held
    multiplied by ``scale``."""

    def __init__(self, dtype: str, noise: torch.Generator, scale: float = 1.0) -> None:
        self.dtype = dtype
        self.noise = noise
        self.scale = scale

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        return pytree.tree_map_only(torch.Tensor, self.rounding_gradient, output)

    def rounding_gradient(self, tensor: torch.Tensor) -> torch.Tensor:
        if not (tensor.is_floating_point() and tensor.requires_grad):
            return tensor
        return StoredGradient.apply(tensor, self.dtype, self.noise, self.scale)


class StoredValue(torch.autograd.Function):
    """A value as ``dtype`` stores it (:func:`round_stored`), and in backward its gradient
    as ``dtype`` stores it too: rounded, for a half dtype as ``.to(half)`` would; for a
    simulated rounding moved by noise of its own (not the value's, which a product with the
    noise would replay)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dtype: str, noise: torch.Generator) -> Any:
        ctx.dtype, ctx.noise = dtype, noise
        return round_stored(tensor, dtype, noise)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return round_stored(grad, ctx.dtype, ctx.noise), None, None


class StoredGradient(torch.autograd.Function):
    """A value as it is, and in backward its gradient as ``dtype`` stores it multiplied by
    ``scale`` (a loss scale: a power of two, so the products are exact)."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, dtype: str, noise: torch.Generator, scale: float
    ) -> Any:
        ctx.dtype, ctx.noise, ctx.scale = dtype, noise, scale
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        held = round_stored(grad * ctx.scale, ctx.dtype, ctx.noise) / ctx.scale
        return held, None, None, None


def round_stored(tensor: torch.Tensor, dtype: str, noise: torch.Generator) -> torch.Tensor:
    """``tensor`` rounded to ``dtype``, its values beyond the dtype's range left as they are."""
    if not tensor.is_floating_point():
        return tensor
    rounded = round_to(tensor, dtype, noise)
    return torch.where(torch.isinf(rounded) & torch.isfinite(tensor), tensor, rounded)


def noise_source(seed: int = NOISE_SEED) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
