"""A device, parsed once from its name: ``cpu``, ``cuda`` or ``cuda:N``.

Every other module asks this one what a device name is (its kind, its index) instead of
reading the text: :meth:`Device.parse` refuses anything else with a message naming the
forms it takes, and :func:`device_kind` is the kind of a name, parsed once per name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Final, Literal, get_args

#: The kinds of device a case may declare; ``cuda`` expands to every visible ``cuda:N``.
DeviceKind = Literal["cpu", "cuda"]
DEVICE_KINDS: tuple[DeviceKind, ...] = get_args(DeviceKind)
CPU: Final = "cpu"
CUDA: Final = "cuda"
#: The kinds whose devices are numbered (``cuda:1``); the bare kind is its first device.
INDEXED_KINDS: tuple[DeviceKind, ...] = (CUDA,)

#: What a device name may be, for the message that refuses one.
DEVICE_FORMS = "cpu, cuda or cuda:N"


@dataclass(frozen=True)
class Device:
    """A device of the matrix: its kind, and its index where the name gives one."""

    kind: DeviceKind
    index: int | None = None

    @classmethod
    def parse(cls, text: str) -> Device:
        """``cpu``, ``cuda`` or ``cuda:N`` (N a non-negative integer written without
        leading zeros) as a device; a ValueError naming the text for anything else."""
        name, colon, number = text.partition(":")
        kind = next((k for k in DEVICE_KINDS if k == name), None)
        if kind is None:
            raise ValueError(f"not a device: {text!r} (expected {DEVICE_FORMS})")
        if not colon:
            return cls(kind)
        if kind not in INDEXED_KINDS:
            raise ValueError(f"not a device: {text!r} ({kind} takes no index)")
        if not is_index(number):
            raise ValueError(
                f"not a device: {text!r} (the index after {kind}: is a number such as 0 or 3)"
            )
        return cls(kind, int(number))

    @property
    def ordinal(self) -> int:
        """The device's index; a bare ``cuda`` is the first device, 0."""
        return self.index if self.index is not None else 0

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


def is_index(text: str) -> bool:
    """``0``, ``3``, ``12``: ASCII digits, with no leading zero (so the name round-trips)."""
    return text.isascii() and text.isdigit() and (text == "0" or not text.startswith("0"))


@functools.lru_cache(maxsize=256)
def parse_device(name: str) -> Device:
    """:meth:`Device.parse`, once per name (a run asks about the same few names often)."""
    return Device.parse(name)


def device_kind(name: str) -> DeviceKind:
    """The kind of a device name: ``cuda`` for ``cuda:1``; a ValueError for a name that is
    not a device."""
    return parse_device(name).kind


def known_device(name: str) -> Device | None:
    """The device ``name`` is, or None where it is not one (``all``, a hand-made record's
    device): for the places that read a name that need not be a device."""
    try:
        return parse_device(name)
    except ValueError:
        return None


def indexed_device(name: str) -> Device | None:
    """The device ``name`` is where it names one by its index (``cuda:3``); None for a bare
    kind and for any name that is not a device (``all``)."""
    device = known_device(name)
    return device if device is not None and device.index is not None else None
