"""Matrix expansion: from each case's declared axes to concrete cells, then selection.

Expansion follows what each case declares; the environment decides which cells can run.
A cell that cannot run here is kept, with the reason, so the results say what was not
covered and why.
"""

from __future__ import annotations

import difflib
import itertools
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from harness.measure.case import Case, Fix
from harness.measure.environment import (
    cuda_devices,
    environment_skip_reason,
    torch_version_skip_reason,
)
from harness.schema.axes import (
    CONTROL_DTYPE,
    CONTROL_FIX,
    CONTROL_MODE,
    DEFAULT_SIZES,
    SIZES,
    Cell,
)
from harness.schema.selection import Selection, SelectionError

#: ``cuda:N`` with a device index.
CUDA_INDEX = re.compile(r"^cuda:\d+$")


@dataclass
class Plan:
    """The cells to run and the cells skipped here, each with its reason."""

    to_run: list[Cell] = field(default_factory=list)
    skipped: list[tuple[Cell, str]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return len(self.to_run) + len(self.skipped)


def concrete_devices(case: Case, requested: Sequence[str]) -> list[str]:
    """The devices this case's cells run on: its device kinds, made concrete.

    ``cuda`` becomes every visible ``cuda:N``; with none visible it stays ``cuda`` so the
    cells are recorded as skipped. ``requested`` (``--device``) narrows the result.
    """
    devices: list[str] = []
    for kind in case.devices:
        if kind == "cuda":
            devices += cuda_devices() or ["cuda"]
        else:
            devices.append(kind)
    if not requested or "all" in requested:
        return devices
    wanted = [d for d in devices if d in requested or d.split(":")[0] in requested]
    return wanted + [
        d
        for d in requested
        if d.startswith("cuda:") and d not in wanted and "cuda" in case.devices
    ]


def concrete_sizes(case: Case, device: str, requested: Sequence[str]) -> tuple[str, ...]:
    """The sizes this case runs at on ``device``: those asked for (``--size``; ``all`` is
    every size), else the device's default sizes, among the sizes the case declares."""
    if "all" in requested:
        return case.size_names
    wanted = requested or DEFAULT_SIZES[device.split(":")[0]]
    return tuple(size for size in case.size_names if size in wanted)


def case_cells(case: Case, devices: Sequence[str], sizes: Sequence[str] = ()) -> Iterator[Cell]:
    """Every cell a case declares, in a stable order: one size after the other (the cells
    of one size share a reference)."""
    for size in case.size_names:
        for fix in case.fixes.values():
            for device in devices:
                if size in concrete_sizes(case, device, sizes):
                    yield from fix_cells(case, fix, device, size)


def fix_cells(case: Case, fix: Fix, device: str, size: str) -> Iterator[Cell]:
    """A fix's cells on one device at one size: its modes, dtypes, backends, compiles."""
    for mode in fix.modes or case.modes:
        if mode == CONTROL_MODE and fix.name != CONTROL_FIX:
            continue
        dtypes = (CONTROL_DTYPE,) if mode == CONTROL_MODE else case.dtypes
        backends = fix.backends or case.backends
        for dtype, backend, compiled in itertools.product(dtypes, backends, case.compiles):
            yield Cell(case.name, fix.name, device, dtype, mode, backend, compiled, size)


def skip_reason(case: Case, cell: Cell) -> str | None:
    return (
        environment_skip_reason(cell, case.requires)
        or torch_version_skip_reason(case.min_torch)
        or case.skip_reason(cell)
    )


def expand(cases: Iterable[Case], selection: Selection = Selection()) -> Plan:
    """Expand, select, and split into cells to run and cells skipped (with reasons)."""
    plan = Plan()
    for case in cases:
        if selection.cases and case.name not in selection.cases:
            continue
        devices = concrete_devices(case, selection.devices)
        for cell in case_cells(case, devices, selection.sizes):
            if not selection.keeps(cell):
                continue
            reason = skip_reason(case, cell)
            if reason:
                plan.skipped.append((cell, reason))
            else:
                plan.to_run.append(cell)
    return plan


def check_selection(cases: Sequence[Case], selection: Selection) -> None:
    """Refuse names that match nothing, suggesting the closest valid ones."""
    known_cases = [c.name for c in cases]
    _check_names("case", selection.cases, known_cases)
    chosen = [c for c in cases if not selection.cases or c.name in selection.cases]
    _check_names("fix", selection.fixes, sorted({f for c in chosen for f in c.fixes}))
    _check_names(
        "dtype", selection.dtypes, sorted({d for c in chosen for d in c.dtypes} | {CONTROL_DTYPE})
    )
    _check_names("mode", selection.modes, sorted({m for c in chosen for m in c.modes}))
    _check_names("backend", selection.backends, sorted({b for c in chosen for b in c.backends}))
    _check_names("compile", selection.compiles, sorted({m for c in chosen for m in c.compiles}))
    _check_names("size", selection.sizes, ["all", *SIZES])
    for device in selection.devices:
        if device not in ("all", "cpu", "cuda") and not CUDA_INDEX.match(device):
            raise SelectionError(f"unknown device {device!r} (use cpu, cuda, cuda:N or all)")


def _check_names(axis: str, wanted: Iterable[str], known: list[str]) -> None:
    for name in wanted:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise SelectionError(
                f"unknown {axis} {name!r}{hint} (known: {', '.join(known) or 'none'})"
            )
