"""A fix's output as named tensor leaves (``output``, ``[0]``, ``.loss``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any

import torch


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
