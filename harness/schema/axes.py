"""The axes of the matrix and the values each may take: names only, no torch.

This module is the vocabulary shared by measuring and reporting (the report never imports
torch); :mod:`harness.measure.precision` turns these names into torch dtypes and applies the modes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from typing import Any

from harness.schema.typed import as_mapping, mismatch

#: Low-precision dtypes under test, and the fp32 control (used only by mode ``fp32``).
DTYPES = ("float16", "bfloat16", "float32")
LOW_PRECISION_DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class Mode:
    """How the harness puts a cell's precision on a case's float32 model and inputs."""

    name: str
    #: Model (weights, floating buffers) and floating inputs cast to the cell dtype.
    casts_model: bool
    #: The fix runs inside ``torch.autocast(device, dtype)``.
    autocast: bool
    meaning: str


#: The precision modes, in the order reports show them. Each name says what it does:
#: ``autocast`` keeps fp32 weights, ``half`` casts them, ``half-autocast`` does both.
MODES: dict[str, Mode] = {
    mode.name: mode
    for mode in (
        Mode("autocast", False, True, "fp32 weights and inputs, run under torch.autocast(dtype)"),
        Mode(
            "half", True, False, "weights and inputs cast to the dtype (model.half()), no autocast"
        ),
        Mode(
            "half-autocast",
            True,
            True,
            "weights and inputs cast to the dtype, and run under torch.autocast(dtype)",
        ),
        Mode("fp32", False, False, "the control: weights and inputs in float32, no autocast"),
    )
}
MODE_NAMES = tuple(MODES)

#: The control of every case: its upstream code path (``none``) in float32.
CONTROL_MODE = "fp32"
CONTROL_DTYPE = "float32"
CONTROL_FIX = "none"

#: Attention backends a case may declare. ``flash-attn-contract`` enforces flash-attn's
#: documented input contract and computes with SDPA; it stands in where flash-attn is absent.
BACKENDS = ("sdpa", "eager", "flash-attn", "flash-attn-contract")

#: How the fix runs: ``eager``, or compiled whole with ``torch.compile(backend="inductor")``.
COMPILE_MODES = ("eager", "inductor")
EAGER = "eager"

#: Workload sizes, in the order reports show them: every case has ``small`` (toy
#: dimensions: CI and correctness); a case may declare ``upstream`` (the real model's
#: dimensions, from the config it cites). Speed is never compared across sizes.
SMALL_SIZE = "small"
UPSTREAM_SIZE = "upstream"
SIZES = (SMALL_SIZE, UPSTREAM_SIZE)
#: The size timed where a run has both, by device kind: on a GPU the real model's shapes
#: (toy shapes measure launch overhead), on a CPU the small one (half-precision matmuls at
#: model dimensions take minutes there, and a CPU's speed predicts no GPU's anyway).
TIMED_SIZE = {"cuda": UPSTREAM_SIZE, "cpu": SMALL_SIZE}
#: The sizes a run covers on each device kind unless ``--size`` says otherwise: correctness
#: at both sizes where that is affordable (a GPU), the small size alone on a CPU.
DEFAULT_SIZES = {"cuda": SIZES, "cpu": (SMALL_SIZE,)}

#: Device kinds a case may declare; ``cuda`` expands to every visible ``cuda:N``.
DEVICE_KINDS = ("cpu", "cuda")


def rank(order: tuple[str, ...], value: str) -> int:
    """Position of ``value`` in a preferred order; unknown values go last."""
    return order.index(value) if value in order else len(order)


@dataclass(frozen=True, order=True)
class Cell:
    """One case x fix x device x dtype x mode x backend: a spec, never a result."""

    case: str
    fix: str
    device: str
    dtype: str
    mode: str
    backend: str
    #: ``eager``, or ``inductor`` for a fix run under ``torch.compile``.
    compile: str = "eager"
    #: The workload size: ``small`` (toy dimensions, for CI and correctness) or
    #: ``upstream`` (the real model's dimensions, from the config the case cites).
    size: str = SMALL_SIZE

    @property
    def id(self) -> str:
        """The cell's identity: ``case[fix,device,dtype,mode,backend]``, with ``,inductor``
        appended for a compiled cell and ``,size=upstream`` for a cell not of the small size
        (so the ids of records written before the size axis stay what they were)."""
        compiled = "" if self.compile == "eager" else f",{self.compile}"
        size = "" if self.size == SMALL_SIZE else f",size={self.size}"
        return (
            f"{self.case}[{self.fix},{self.device},{self.dtype},{self.mode},{self.backend}"
            f"{compiled}{size}]"
        )

    @property
    def fix_and_backend(self) -> str:
        """A row label for tables whose case ran several backends: ``fix [backend]``."""
        return f"{self.fix} [{self.backend}]"

    def row(self, show_backend: bool) -> str:
        """The row label of tables: the fix, its backend where a case ran several, and how it
        was compiled where it was (``none (inductor)``)."""
        label = self.fix_and_backend if show_backend else self.fix
        return label if self.compile == "eager" else f"{label} ({self.compile})"

    @property
    def column(self) -> Column:
        """The cells compared side by side (timed together, ranked against each other):
        never across workload sizes."""
        return Column(self.case, self.device, self.dtype, self.mode, self.size)

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cell:
        """A cell from its fields (records written before the compile axis are eager)."""
        data = as_mapping(data, "cell")
        given = [data.get(name, default) for name, default in cell_defaults()]
        if {str}.issuperset(map(type, given)) and all(given):  # every name given, non-empty
            return cls(*given)
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in data:
                values[f.name] = data[f.name]
                if not isinstance(values[f.name], str) or not values[f.name]:
                    raise TypeError(mismatch(f.name, "a name", values[f.name]))
            elif f.default is dataclasses.MISSING:
                raise KeyError(f.name)
        return cls(**values)


@cache
def cell_defaults() -> tuple[tuple[str, Any], ...]:
    """Each field of a cell with its default (``dataclasses.MISSING`` where it has none)."""
    return tuple((f.name, f.default) for f in dataclasses.fields(Cell))


@dataclass(frozen=True, order=True)
class Column:
    """One case, device, dtype and mode: the fixes of a column are compared with each other."""

    case: str
    device: str
    dtype: str
    mode: str
    size: str = SMALL_SIZE

    @property
    def id(self) -> str:
        size = "" if self.size == SMALL_SIZE else f",size={self.size}"
        return f"{self.case}[{self.device},{self.dtype},{self.mode}{size}]"
