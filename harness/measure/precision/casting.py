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
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn


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
