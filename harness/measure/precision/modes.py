"""What a cell's precision mode applies to one run of a fix (:class:`Precision`), and
autocast as the harness enters it and as torch reports it."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from harness.schema.axes import MODES
from harness.schema.devices import CPU


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


def autocast_region(precision: Precision) -> AbstractContextManager[Any]:
    """``torch.autocast`` for a cell whose mode asks for it, applied by the harness."""
    if precision.managed_by_case or not precision.uses_autocast:
        return nullcontext()
    return torch.autocast(precision.device.type, dtype=precision.dtype)


def autocast_enabled(device_type: str) -> bool:
    """Autocast state for a device type (``is_autocast_enabled(device)`` is torch >= 2.4)."""
    try:
        return bool(torch.is_autocast_enabled(device_type))
    except TypeError:
        if device_type == CPU:
            return bool(torch.is_autocast_cpu_enabled())
        return bool(torch.is_autocast_enabled())


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
