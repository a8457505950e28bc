"""Matrix expansion: from each case's declared axes to concrete cells, then selection.

Expansion follows what each case declares; the environment decides which cells can run.
A cell that cannot run here is recorded as skipped, with the reason, so the results say
what was not covered and why.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from harness.measure.authoring.case import Case, Fix
from harness.measure.host.environment import (
    cuda_devices,
    environment_skip_reason,
    torch_version_skip_reason,
)
from harness.measure.running.training import grad_scaler_skip_reason
from harness.schema.axes import (
    AXIS,
    CONTROL_DTYPE,
    CONTROL_MODE,
    DEFAULT_SIZES,
    DEFAULT_STAGES,
    DYNAMIC_SCALER,
    FORWARD_STAGE,
    MODES,
    TRAINING_STAGES,
    Cell,
)
from harness.schema.devices import CUDA, device_kind, indexed_device
from harness.schema.selection import Selection


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
        if kind == CUDA:
            devices += cuda_devices() or [CUDA]
        else:
            devices.append(kind)
    if not requested or "all" in requested:
        return devices
    wanted = [d for d in devices if AXIS["device"].selects(tuple(requested), d)]
    return wanted + [
        d for d in requested if is_cuda_device(d) and d not in wanted and CUDA in case.devices
    ]


def is_cuda_device(name: str) -> bool:
    """Whether ``name`` is a CUDA device named by its index (``cuda:3``)."""
    device = indexed_device(name)
    return device is not None and device.kind == CUDA


def concrete_sizes(case: Case, device: str, requested: Sequence[str]) -> tuple[str, ...]:
    """The sizes this case runs at on ``device``: those asked for (``--size``; ``all`` is
    every size), else the device's default sizes, among the sizes the case declares."""
    if "all" in requested:
        return case.size_names
    wanted = requested or DEFAULT_SIZES[device_kind(device)]
    return tuple(size for size in case.size_names if size in wanted)


def concrete_stages(case: Case, requested: Sequence[str]) -> tuple[str, ...]:
    """The stages this case runs: those asked for (``--stage``; ``all`` is every stage),
    else the default ones (``forward`` and ``train``: a fit is run on request), among the
    stages the case declares."""
    if "all" in requested:
        return case.stages
    wanted = requested or DEFAULT_STAGES
    return tuple(stage for stage in case.stages if stage in wanted)


def case_cells(
    case: Case, devices: Sequence[str], sizes: Sequence[str] = (), stages: Sequence[str] = ()
) -> Iterator[Cell]:
    """Every cell a case declares, in a stable order: one size and stage after the other
    (the cells of one size and stage share a reference)."""
    for size in case.size_names:
        for stage in concrete_stages(case, stages):
            for fix in case.fixes.values():
                for device in devices:
                    if size in concrete_sizes(case, device, sizes):
                        yield from fix_cells(case, fix, device, size, stage)


def fix_cells(
    case: Case, fix: Fix, device: str, size: str, stage: str = FORWARD_STAGE
) -> Iterator[Cell]:
    """A fix's cells on one device at one size and stage: its modes, dtypes (those it
    narrows the case's to), backends, compiles, and in a stage that trains the scalers its
    recipe names (``Case.scalers_of``); and the float32 control for every fix, so each is
    seen to run plain in float32 too."""
    for mode in fix_modes(case, fix):
        dtypes = (CONTROL_DTYPE,) if mode == CONTROL_MODE else fix_dtypes(case, fix)
        backends = fix.backends or case.backends
        for dtype, backend, compiled in itertools.product(dtypes, backends, case.compiles):
            for scaler in case.scalers_of(fix.name, dtype, mode, stage):
                where = (device, dtype, mode, backend, compiled, size, stage, scaler)
                yield Cell(case.name, fix.name, *where)


def fix_modes(case: Case, fix: Fix) -> tuple[str, ...]:
    """The modes a fix runs: those it narrows the case's to, and the float32 control where
    the case has one, whatever the fix names."""
    modes = fix.modes or case.modes
    if CONTROL_MODE in case.modes and CONTROL_MODE not in modes:
        modes = (*modes, CONTROL_MODE)
    return modes


def fix_dtypes(case: Case, fix: Fix) -> tuple[str, ...]:
    """The low-precision dtypes a fix runs in: the case's, narrowed to the fix's."""
    return tuple(d for d in case.dtypes if fix.dtypes is None or d in fix.dtypes)


def skip_reason(case: Case, cell: Cell) -> str | None:
    return (
        stage_skip_reason(cell)
        or environment_skip_reason(cell, case.requires)
        or torch_version_skip_reason(case.min_torch)
        or case.skip_reason(cell)
    )


def stage_skip_reason(cell: Cell) -> str | None:
    """A train or fit cell scaled by a GradScaler (``dynamic``) needs one this torch has
    here; float16 half weights, whose gradients a GradScaler refuses to unscale, have their
    dynamic scale held by the harness and need none."""
    if cell.stage not in TRAINING_STAGES or cell.scaler != DYNAMIC_SCALER:
        return None
    if cell.dtype == "float16" and MODES[cell.mode].casts_model:
        return None
    return grad_scaler_skip_reason(cell.device)


def expand(cases: Iterable[Case], selection: Selection = Selection()) -> Plan:
    """Expand, select, and split into cells to run and cells skipped (with reasons)."""
    plan = Plan()
    for case in cases:
        if not AXIS["case"].selects(selection["cases"], case.name):
            continue
        devices = concrete_devices(case, selection["devices"])
        for cell in case_cells(case, devices, selection["sizes"], selection["stages"]):
            if not selection.selects(cell):
                continue
            reason = skip_reason(case, cell)
            if reason:
                plan.skipped.append((cell, reason))
            else:
                plan.to_run.append(cell)
    return plan
