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
class Perf:
    """Speed, throughput and memory of a cell that ran (see ``harness.perf``)."""

    time_samples: list[float]
    time_block: int
    time_median_s: float
    time_iqr_s: float
    time_min_s: float
    time_count: int
    time_noisy: bool
    timer: str
    threads: int
    flops: int
    gflops: float | None
    peak_gflops: float | None
    peak_fraction: float | None
    peak_mem_bytes: int
    mem_method: str
    timing_worker: str | None = None


#: Sub-records flattened into the record's JSON object, and the field that says one is there.
NESTED = {"numerics": (Numerics, "tolerance"), "perf": (Perf, "time_median_s")}


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
    perf: Perf | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"schema_version": SCHEMA_VERSION, **self.cell.to_dict()}
        for f in dataclasses.fields(self):
            if f.name == "cell":
                continue
            value = getattr(self, f.name)
            if f.name in NESTED:
                kind = NESTED[f.name][0]
                nested = dataclasses.asdict(value) if value else {}
                data.update({g.name: nested.get(g.name) for g in dataclasses.fields(kind)})
            else:
                data[f.name] = value.value if isinstance(value, Outcome) else value
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CellRecord:
        version = data.get("schema_version")
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {version!r} is not supported (this ampmatrix reads up to "
                f"{SCHEMA_VERSION}); upgrade ampmatrix to read it"
            )
        nested: dict[str, Any] = {
            name: kind(**{f.name: data[f.name] for f in dataclasses.fields(kind)})
            if data.get(marker) is not None
            else None
            for name, (kind, marker) in NESTED.items()
        }
        plain: dict[str, Any] = {
            f.name: data.get(f.name)
            for f in dataclasses.fields(cls)
            if f.name not in ("cell", "outcome", *NESTED)
        }
        return cls(cell=Cell.from_dict(data), outcome=Outcome(data["outcome"]), **nested, **plain)
