"""What Python code does about autocast while a fix runs, seen by a profile hook: whether a
torch compute call ran with autocast on, autocast's state per device type, and whether a
tensor cast method is running. A hook leaves torch's dispatch untouched (a
TorchFunctionMode would turn fused fast paths off)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch

from harness.measure.precision.modes import autocast_enabled, is_compute_call

AUTOCAST_KEYS = {
    "cpu": torch._C.DispatchKey.AutocastCPU,
    "cuda": torch._C.DispatchKey.AutocastCUDA,
}


#: Tensor methods that cast: called from Python, they are the code's own casts (autocast's
#: casts are made in C++, with no Python call around them).
CAST_METHODS = frozenset({"float", "double", "half", "bfloat16", "to", "type", "type_as"})


@dataclass
class PythonWatch:
    """What Python code did about autocast while a fix ran: whether any torch compute call
    ran with it on (the ``no-autocast`` check), and its current state per device type."""

    device_type: str
    seen: bool = False
    enabled: dict[str, bool] = field(default_factory=dict)
    #: A tensor cast method called from Python is running (``x.float()``).
    casting: bool = False

    def refresh(self) -> None:
        self.enabled = {device: autocast_enabled(device) for device in AUTOCAST_KEYS}


@contextmanager
def watch_python(watch: PythonWatch) -> Iterator[None]:
    """A profile hook: it leaves torch's dispatch untouched (a TorchFunctionMode would turn
    fused fast paths off)."""
    previous = sys.getprofile()
    watch.refresh()

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "c_call":
            name = getattr(arg, "__name__", "")
            if name in CAST_METHODS:
                watch.casting = isinstance(getattr(arg, "__self__", None), torch.Tensor)
            elif not watch.seen and is_compute_call(arg):
                watch.seen = watch.enabled.get(watch.device_type, False)
        elif event == "c_return" or event == "c_exception":
            name = getattr(arg, "__name__", "")
            if name in CAST_METHODS:
                watch.casting = False
            elif "autocast" in name:
                watch.refresh()

    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(previous)
        watch.refresh()
