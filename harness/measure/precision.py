"""The harness puts a cell's precision on a case's workload, and checks that it took.

A case builds its model and inputs once, in float32 on the CPU. For a cell, the harness:

* moves them to the cell's device;
* in modes that cast (``half``, ``half-autocast``), casts the model's floating parameters
  and buffers and every floating input tensor to the cell dtype, except the modules,
  parameters, buffers and inputs the case (or the fix) declares in ``keep_fp32`` (as
  transformers' ``_keep_in_fp32_modules``; an input by its name), which stay float32;
* for the reference, casts everything (kept parts too) to float64;
* in modes with autocast (``autocast``, ``half-autocast``), runs the fix inside
  ``torch.autocast(device, dtype)``.

Two self-checks make a precision that was never applied visible (as flags on the record):
an autocast cell in which no torch op ran with autocast on, and a cell that should be half
whose model holds floating parameters or buffers in another dtype after the fix ran.

Autocast is witnessed with a Python profile hook
(:func:`harness.measure.python_watch.watch_python`), which leaves torch's dispatch untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch
from torch import nn

from harness.schema.axes import CONTROL_MODE, MODES
from harness.schema.records import DRIFT, Flag, Note, NoteKind
from harness.schema.trail_records import Drift, Trail

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}

NO_AUTOCAST = "no-autocast"
NOT_HALF = "not-half"


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype of an axis value (``float64`` for references)."""
    return TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float16`` -> ``float16``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Precision:
    """What the harness applies to one run of a fix."""

    device: torch.device
    #: The cell dtype, or float64 for the reference.
    dtype: torch.dtype
    mode: str
    #: The case manages precision itself (the harness only moves the workload to the device).
    managed_by_case: bool = False

    @property
    def is_reference(self) -> bool:
        return self.dtype == torch.float64

    @property
    def casts_model(self) -> bool:
        return self.is_reference or MODES[self.mode].casts_model

    @property
    def uses_autocast(self) -> bool:
        return not self.is_reference and MODES[self.mode].autocast

    @property
    def upcast_dtype(self) -> torch.dtype:
        """What upstream code means by ``.float()``: float32, or float64 in the reference."""
        return torch.float64 if self.is_reference else torch.float32

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the model's weights and inputs once the mode is applied."""
        if self.managed_by_case:
            return self.upcast_dtype
        return self.dtype if self.casts_model else torch.float32


def cast_tensors(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Every floating tensor in ``value`` (nested lists, tuples, dicts) moved and cast;
    other tensors only moved; anything else returned as is."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        target = dtype if tensor.is_floating_point() else tensor.dtype
        return tensor.to(device=device, dtype=target)

    return map_tensors(value, cast, lambda module: module.to(device=device, dtype=dtype))


def map_tensors(
    value: Any,
    on_tensor: Callable[[torch.Tensor], torch.Tensor],
    on_module: Callable[[nn.Module], nn.Module],
) -> Any:
    """``value`` with each tensor and module in it (nested in lists, tuples and dicts)
    replaced by what the functions make of it; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return on_tensor(value)
    if isinstance(value, nn.Module):
        return on_module(value)
    if isinstance(value, Mapping):
        return {k: map_tensors(v, on_tensor, on_module) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_tensors(v, on_tensor, on_module) for v in value)
    return value


def cast_model(
    model: Any, device: torch.device, dtype: torch.dtype, keep: tuple[str, ...], kept: torch.dtype
) -> Any:
    """The model moved and cast to ``dtype``; the parts named in ``keep`` go straight to
    ``kept`` (their float32 values never take a round trip through half)."""
    if keep and not isinstance(model, nn.Module):
        raise TypeError(f"keep_fp32 {keep} needs the workload's model to be an nn.Module")
    saved = kept_state(model, keep) if keep else {}
    model = cast_tensors(model, device, dtype)
    for name, data in saved.items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        value = data.to(device=device, dtype=kept if data.is_floating_point() else data.dtype)
        if attr in owner._parameters:
            owner._parameters[attr].data = value
        else:
            owner._buffers[attr] = value
    return model


def cast_inputs(
    inputs: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    keep: tuple[str, ...],
    kept: torch.dtype,
) -> dict[str, Any]:
    """The inputs moved and cast to ``dtype``, those named in ``keep`` to ``kept``."""
    return {
        name: cast_tensors(value, device, kept if name in keep else dtype)
        for name, value in inputs.items()
    }


def split_kept(
    keep: tuple[str, ...], inputs: dict[str, Any]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``keep_fp32`` as (parts of the model, names of inputs): a name that is an input's key
    names that input."""
    return tuple(k for k in keep if k not in inputs), tuple(k for k in keep if k in inputs)


def kept_state(model: nn.Module, keep: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Copies of the parameters and buffers that ``keep`` names (by themselves or through a
    module), checking that every name exists."""
    for name in keep:
        find_part(model, name)
    named = [*model.named_parameters(), *model.named_buffers()]
    return {name: t.detach().clone() for name, t in named if is_kept(name, keep)}


def find_part(model: nn.Module, name: str) -> nn.Module | torch.Tensor:
    """A submodule, parameter or buffer of ``model`` by its dotted name."""
    for getter in (model.get_submodule, model.get_parameter, model.get_buffer):
        try:
            part: nn.Module | torch.Tensor = getter(name)
            return part
        except AttributeError:
            continue
    raise AttributeError(
        f"keep_fp32 names {name!r}, which is neither a part of the model nor an input"
    )


def is_kept(name: str, keep: tuple[str, ...]) -> bool:
    return any(name == k or name.startswith(k + ".") for k in keep)


def plain_tensor_attributes(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Tensors a module holds as plain attributes: ``module.to()`` does not move or cast them
    (a classic way for float32 to survive ``model.half()``)."""
    return [
        (f"{prefix}.{attr}" if prefix else attr, value)
        for prefix, module in model.named_modules()
        for attr, value in vars(module).items()
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
    ]


def named_tensors(model: Any) -> list[tuple[str, str, torch.Tensor]]:
    """Every tensor a model holds, as (kind, name, tensor): parameters, buffers and plain
    tensor attributes of a module, or the model itself when it is a tensor."""
    if isinstance(model, torch.Tensor):
        return [("tensor", "model", model)]
    if not isinstance(model, nn.Module):
        return []
    return [
        (kind, name, tensor)
        for kind, named in (
            ("parameter", model.named_parameters()),
            ("buffer", model.named_buffers()),
            (TENSOR_ATTRIBUTE, plain_tensor_attributes(model)),
        )
        for name, tensor in named
    ]


def leftover_precision(
    model: Any,
    dtype: torch.dtype,
    keep: tuple[str, ...],
    unused: Callable[[torch.Tensor], bool] = lambda t: False,
) -> list[str]:
    """Floating tensors of ``model`` (parameters, buffers, plain tensor attributes) that are
    not in ``dtype`` and were not declared kept: ``name (float32)``. A plain tensor
    attribute for which ``unused`` is true (no op of the run read it) is left out."""
    return [
        f"{name} ({dtype_name(t.dtype)})"
        for kind, name, t in named_tensors(model)
        if t.is_floating_point()
        and t.dtype != dtype
        and not is_kept(name, keep)
        and not (kind == TENSOR_ATTRIBUTE and unused(t))
    ]


TENSOR_ATTRIBUTE = "tensor attribute"


def not_half_flag(
    model: Any,
    precision: Precision,
    keep: tuple[str, ...],
    unused: Callable[[torch.Tensor], bool] = lambda t: False,
) -> Flag | None:
    """The flag of a half cell whose model is not (or no longer) in the cell dtype; a plain
    tensor attribute that no op of the run read (``unused``, from the dtype tracer: a
    stale copy such as transformers 4.46's ``rotary_emb.original_inv_freq``) costs nothing
    and is not counted."""
    if precision.managed_by_case or precision.is_reference or not precision.casts_model:
        return None
    wrong = leftover_precision(model, precision.dtype, keep, unused)
    if not wrong:
        return None
    shown = ", ".join(wrong[:3]) + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else "")
    return Flag(NOT_HALF, f"after the fix the model holds {shown}, not declared in keep_fp32")


def autocast_region(precision: Precision) -> AbstractContextManager[Any]:
    """``torch.autocast`` for a cell whose mode asks for it, applied by the harness."""
    if precision.managed_by_case or not precision.uses_autocast:
        return nullcontext()
    return torch.autocast(precision.device.type, dtype=precision.dtype)


#: Torch calls that query or switch state rather than compute: not evidence of autocast.
STATE_CALL_PREFIXES = ("is_", "get_", "set_", "_is_", "_get_", "_set_", "_has_")


def is_compute_call(func: Any) -> bool:
    """A torch builtin that computes on tensors: a Tensor method, or a function of torch's
    C modules, other than state queries and autocast's own bookkeeping."""
    name = getattr(func, "__name__", "")
    if "autocast" in name or name.startswith(STATE_CALL_PREFIXES):
        return False
    owner = getattr(func, "__self__", None)
    if isinstance(owner, torch.Tensor):
        return True
    module = getattr(func, "__module__", None) or getattr(owner, "__name__", "")
    return str(module).startswith("torch")


def autocast_enabled(device_type: str) -> bool:
    """Autocast state for a device type (``is_autocast_enabled(device)`` is torch >= 2.4)."""
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:
        if device_type == "cpu":
            return bool(torch.is_autocast_cpu_enabled())
        return bool(torch.is_autocast_enabled())


def no_autocast_flag(seen: bool, precision: Precision) -> Flag | None:
    """The flag of an autocast cell in which no torch call ran with autocast on (``seen`` is
    the profile hook's finding, see :mod:`harness.measure.trail`)."""
    if seen or precision.is_reference or not MODES[precision.mode].autocast:
        return None
    return Flag(NO_AUTOCAST, "the mode enters torch.autocast, but no torch op ran with it on")


#: A float32 island within this share of a cell's matmul and attention FLOPs, whose values
#: come back in the cell's dtype, is noted, not flagged (a RoPE frequency product in
#: float32: well under 0.1% of a Llama's FLOPs; see the README's calibration table).
ISLAND_SHARE = 0.01
UNDONE_UPCAST = "undone-upcast"


def drift_flag(
    drift: Drift, output: Any, precision: Precision, trail: Trail | None
) -> tuple[Flag | None, Note | None]:
    """The flag of a cell that ran but left its mode's promise (or None), and a note for a
    small float32 island that is not worth a flag. Leaving it is: matmul or attention
    kernels computing in a wider dtype than the cell's (kept fp32 parts aside) beyond
    :data:`ISLAND_SHARE` of the FLOPs or without casting back, or, in ``half`` (a casting
    mode without autocast), an output wider than the cell dtype. Under autocast an output's
    dtype is the op policy's (CUDA autocast runs ``layer_norm`` and ``softmax`` in float32),
    so only the kernels count there. The detail says how much and where it entered."""
    if precision.is_reference or precision.mode == CONTROL_MODE:
        return None, None
    wider = wider_outputs(output, precision)
    if drift.kinds and not wider and is_island(drift):
        island = drift.island.describe() if drift.island else ""
        text = f"{ISLAND_NOTE}: {island}, cast back to {dtype_name(precision.dtype)}"
        return None, Note(NoteKind.ISLAND, text)
    problems = [f"{kind} computed in {'+'.join(dtypes)}" for kind, dtypes in drift.kinds.items()]
    if problems and drift.share is not None:
        problems[-1] += f" ({drift.share:.1%} of the matmul and attention FLOPs)"
    problems += wider
    if not problems:
        return None, None
    started = trail.promotion.describe() if trail and trail.promotion else None
    share = drift.share if drift.kinds else None
    return Flag(DRIFT, "; ".join(problems) + (f" ({started})" if started else ""), share), None


ISLAND_NOTE = "float32 island, not a drift"


def is_island(drift: Drift) -> bool:
    return drift.contained and drift.share is not None and drift.share <= ISLAND_SHARE


def wider_outputs(output: Any, precision: Precision) -> list[str]:
    """In ``half``, the output leaves wider than the cell dtype."""
    if not precision.casts_model or precision.uses_autocast or output is None:
        return []
    return [
        f"{'output' if name == 'output' else f'output {name}'} is {dtype_name(t.dtype)}"
        for name, t in output_leaves_or_none(output).items()
        if t.is_floating_point() and t.dtype.itemsize > precision.dtype.itemsize
    ]


def undone_upcast_flag(detail: str | None) -> Flag | None:
    """The flag of a cell whose code cast a tensor up on purpose, which autocast cast back
    down before a matmul or attention kernel: the upcast did nothing."""
    return Flag(UNDONE_UPCAST, detail) if detail else None


def output_leaves_or_none(output: Any) -> dict[str, torch.Tensor]:
    try:
        return output_leaves(output)
    except TypeError:
        return {}


def output_leaves(output: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """A fix's output as named tensors: a tensor is one leaf (``""``); tuples, lists, dicts
    and dataclasses are walked (``[0]``, ``.loss``, ``.grads.weight``)."""
    if isinstance(output, torch.Tensor):
        return {prefix or "output": output}
    if is_dataclass(output) and not isinstance(output, type):
        items: list[tuple[str, Any]] = [(f.name, getattr(output, f.name)) for f in fields(output)]
        return _leaves_of(items, prefix, ".{}")
    if isinstance(output, Mapping):
        return _leaves_of([(str(k), v) for k, v in output.items()], prefix, ".{}")
    if isinstance(output, (list, tuple)):
        return _leaves_of(list(enumerate(output)), prefix, "[{}]")
    raise TypeError(
        f"a fix returned {type(output).__name__}{' at ' + prefix if prefix else ''}; "
        "expected a tensor, or a tuple, list, dict or dataclass of tensors"
    )


def _leaves_of(items: list[tuple[Any, Any]], prefix: str, form: str) -> dict[str, torch.Tensor]:
    leaves: dict[str, torch.Tensor] = {}
    for key, value in items:
        if value is None:
            continue  # e.g. the gradient of a parameter that took no part
        name = form.format(key)
        leaves.update(output_leaves(value, prefix + name if prefix else name.lstrip(".")))
    if not leaves:
        raise TypeError(f"a fix returned no tensors{' at ' + prefix if prefix else ''}")
    return leaves
