"""Speed comparisons derived from records: ratios to the control and to the fastest fix,
and rankings of fixes in which fixes whose spreads overlap are reported as ties.

All of it is computed from results files, never stored: a pure function of records.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from harness.schema.axes import CONTROL_FIX, CONTROL_MODE, Cell, Column
from harness.schema.records import CellRecord, Outcome
from harness.schema.stats import quartiles

#: Medians closer than this ratio are within run-to-run noise: a tie. On a shared 2-core VM
#: identical work was measured up to ~6% apart between runs (``nox -s bench`` prints it).
TIE_RATIO = 1.10
#: ``compare``: a speed change counts when beyond this ratio and significant at ALPHA.
MIN_RATIO = 1.10
ALPHA = 0.05
#: ``compare``: a cell's ratio, over its device's machine factor, counts only beyond this
#: many interquartile ranges of all cells' ratios past the quartiles (Tukey's "far out").
NOISE_FENCE = 3.0
#: ``compare``: the fewest cells timed in both runs of a device that a machine factor is
#: taken from; with fewer, a cell's change cannot be told from the machine's.
MIN_CELLS_FOR_FACTOR = 5


@dataclass(frozen=True)
class SpeedRatios:
    """Median time over the case's fp32 control, and over the fastest passing fix."""

    vs_control: float | None
    vs_fastest: float | None


def environment_key(record: CellRecord) -> tuple[str, str]:
    return record.torch_version, record.cell.device


def column_key(record: CellRecord) -> tuple[str, Column]:
    """Records compared with each other: the cell's column, in one torch version."""
    return record.torch_version, record.cell.column


def median_of(record: CellRecord) -> float | None:
    """The figure a cell's speed is judged by: its timed median, or on CUDA where the cell
    is launch-bound, its device time (``Perf.speed_s``)."""
    return record.perf.speed_s if record.perf else None


#: A control's key: case, workload size, torch version, device, backend.
ControlKey = tuple[str, str, str, str, str]


def controls(records: Iterable[CellRecord]) -> dict[ControlKey, float]:
    """The fp32 control's median per (case, size, torch, device, backend): speed is never
    compared across workload sizes."""
    found = {}
    for r in records:
        median = median_of(r)
        if r.cell.mode == CONTROL_MODE and r.cell.fix == CONTROL_FIX and median:
            found[(r.cell.case, r.cell.size, *environment_key(r), r.cell.backend)] = median
    return found


def fastest_passing(records: Iterable[CellRecord]) -> dict[tuple[str, Column], float]:
    """The fastest median per column among cells that pass with no flag (a fix that left the
    cell's precision is no yardstick for the others)."""
    fastest: dict[tuple[str, Column], float] = {}
    for r in records:
        median = median_of(r)
        if r.outcome is Outcome.PASSES and not r.flags and median:
            key = column_key(r)
            fastest[key] = min(fastest.get(key, median), median)
    return fastest


def control_for(record: CellRecord, found: dict[ControlKey, float]) -> float | None:
    """The control with the same backend, or else any control of the case, size and
    environment."""
    key = (record.cell.case, record.cell.size, *environment_key(record))
    same_backend = found.get((*key, record.cell.backend))
    if same_backend:
        return same_backend
    return next((m for k, m in sorted(found.items()) if k[:4] == key), None)


RecordKey = tuple[str, Cell]


def record_key(record: CellRecord) -> RecordKey:
    """Identifies a record across runs: the torch version and the cell."""
    return record.torch_version, record.cell


def speed_ratios(records: Sequence[CellRecord]) -> dict[RecordKey, SpeedRatios]:
    """Ratios for every timed record, keyed by :func:`record_key`."""
    found, fastest = controls(records), fastest_passing(records)
    ratios = {}
    for r in records:
        median = median_of(r)
        if not median:
            continue
        control = control_for(r, found)
        best = fastest.get(column_key(r))
        ratios[record_key(r)] = SpeedRatios(
            vs_control=median / control if control else None,
            vs_fastest=median / best if best else None,
        )
    return ratios


def interquartile_range(record: CellRecord) -> tuple[float, float]:
    """The quartiles of the timed samples, on the scale of ``median_of``: a launch-bound
    cell's device time is one figure over many calls, so its spread is taken to be the
    timed samples' relative spread."""
    perf = record.perf
    assert perf is not None
    q1, _, q3 = quartiles(perf.time_samples)
    scale = perf.speed_s / perf.time_median_s if perf.launch_bound else 1.0
    return q1 * scale, q3 * scale


def significantly_faster(a: CellRecord, b: CellRecord) -> bool:
    """``a`` beats ``b`` beyond noise: by more than TIE_RATIO, with interquartile ranges
    that do not overlap."""
    median_a, median_b = median_of(a) or 0.0, median_of(b) or 0.0
    return (
        median_a * TIE_RATIO < median_b and interquartile_range(a)[1] < (interquartile_range(b)[0])
    )


def ties_with(record: CellRecord, tier: Sequence[CellRecord]) -> bool:
    """Within noise of a tier: not significantly slower than its fastest member."""
    return not significantly_faster(tier[0], record)


def rank_with_ties(records: Sequence[CellRecord]) -> list[list[CellRecord]]:
    """Timed records, fastest first, grouped into tiers of records within noise of each
    other (see :func:`ties_with`)."""
    timed = sorted((r for r in records if r.perf), key=lambda r: median_of(r) or 0.0)
    tiers: list[list[CellRecord]] = []
    for record in timed:
        if tiers and ties_with(record, tiers[-1]):
            tiers[-1].append(record)
        else:
            tiers.append([record])
    return tiers


def column_speed_ratios(
    columns: dict[str, list[Any]], medians: Sequence[float | None], unflagged: Sequence[bool]
) -> tuple[list[float | None], list[float | None]]:
    """:func:`speed_ratios` over a run read as columns (``harness.results.columns``): per
    line, in order, its ratio to the control and to the fastest (None where there is
    none). ``medians``: each line's :func:`median_of`; ``unflagged``: whether it carries
    no flag."""
    names = ("torch_version", "case", "size", "device", "backend", "mode", "fix", "dtype",
             "stage", "outcome")  # fmt: skip
    rows = list(zip(*(columns[name] for name in names), medians, unflagged, strict=True))
    found: dict[ControlKey, float] = {}
    fastest: dict[tuple[str, ...], float] = {}
    for version, case, size, device, backend, mode, fix, dtype, stage, outcome, m, plain in rows:
        if not m:
            continue
        if mode == CONTROL_MODE and fix == CONTROL_FIX:
            found[(case, size, version, device, backend)] = m
        if outcome == Outcome.PASSES.value and plain:
            key = (version, case, device, dtype, mode, size, stage)
            fastest[key] = min(fastest.get(key, m), m)
    # a control of another backend: the first by key, as control_for takes it
    any_backend: dict[tuple[str, ...], float] = {}
    for control_key, median in sorted(found.items()):
        any_backend.setdefault(control_key[:4], median)
    vs_control: list[float | None] = []
    vs_fastest: list[float | None] = []
    for version, case, size, device, backend, mode, _, dtype, stage, _, m, _ in rows:
        control = found.get((case, size, version, device, backend)) or any_backend.get(
            (case, size, version, device)
        )
        best = fastest.get((version, case, device, dtype, mode, size, stage))
        vs_control.append(m / control if m and control else None)
        vs_fastest.append(m / best if m and best else None)
    return vs_control, vs_fastest
