"""Cell specs, outcomes and records: the data that flows from measuring to reporting."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

#: Bumped whenever a record's fields change meaning; readers refuse newer versions.
SCHEMA_VERSION = 1


class Outcome(str, Enum):
    RAISES = "raises"
    PASSES = "passes"
    INACCURATE = "inaccurate"
    SKIPPED = "skipped"
    TIMEOUT = "timeout"
    CRASHED = "crashed"


@dataclass(frozen=True, order=True)
class Cell:
    """One case x fix x device x dtype x mode x backend: a spec, never a result."""

    case: str
    fix: str
    device: str
    dtype: str
    mode: str
    backend: str

    @property
    def id(self) -> str:
        return f"{self.case}[{self.fix},{self.device},{self.dtype},{self.mode},{self.backend}]"

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cell:
        return cls(**{f.name: str(data[f.name]) for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class Numerics:
    """Error of a cell's output against the float64 reference, and the tolerance used."""

    max_abs_err: float
    rel_err: float
    baseline_rel_err: float | None
    tolerance: float
    tolerance_rule: str
    finite: bool


@dataclass(frozen=True)
class CellRecord:
    """What one cell did. Flattened to one JSON object per line in ``cells.jsonl``."""

    cell: Cell
    torch_version: str
    outcome: Outcome
    reproduces: bool | None = None
    error_type: str | None = None
    error_message: str | None = None
    out_dtype: str | None = None
    attn_dtype: str | None = None
    numerics: Numerics | None = None
    skip_reason: str | None = None
    note: str | None = None
    duration_s: float | None = None
    worker: str | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"schema_version": SCHEMA_VERSION, **self.cell.to_dict()}
        for f in dataclasses.fields(self):
            if f.name in ("cell", "numerics"):
                continue
            value = getattr(self, f.name)
            data[f.name] = value.value if isinstance(value, Outcome) else value
        numerics = dataclasses.asdict(self.numerics) if self.numerics else {}
        for f in dataclasses.fields(Numerics):
            data[f.name] = numerics.get(f.name)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CellRecord:
        version = data.get("schema_version")
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {version!r} is not supported (this ampmatrix reads up to "
                f"{SCHEMA_VERSION}); upgrade ampmatrix to read it"
            )
        numerics = None
        if data.get("tolerance") is not None:
            numerics = Numerics(**{f.name: data[f.name] for f in dataclasses.fields(Numerics)})
        plain: dict[str, Any] = {
            f.name: data.get(f.name)
            for f in dataclasses.fields(cls)
            if f.name not in ("cell", "numerics", "outcome")
        }
        return cls(
            cell=Cell.from_dict(data),
            outcome=Outcome(data["outcome"]),
            numerics=numerics,
            **plain,
        )
