"""A cell's figures as data: its speed, throughput and memory (:class:`Perf`) and, for a
cell of the ``fit`` stage, its loss curve and what its optimizer did (:class:`FitFigures`).
No torch: reports read these."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from harness.schema.typed import as_mapping, as_tuple, made, number_from, with_numbers

#: A cell whose timed median exceeds its device time by more than this factor is
#: launch-bound.
LAUNCH_BOUND = 2.0


def launch_bound(timed_s: float, device_s: float) -> bool:
    return timed_s > LAUNCH_BOUND * device_s


@dataclass(frozen=True)
class Perf:
    """Speed, throughput and memory of a cell that ran (see ``harness.measure.figures.perf``)."""

    time_samples: list[float]
    time_block: int
    time_median_s: float
    time_iqr_s: float
    time_min_s: float
    time_count: int
    time_noisy: bool
    timer: str
    threads: int
    flops: int | None
    gflops: float | None
    peak_gflops: float | None
    peak_fraction: float | None
    peak_mem_bytes: int
    mem_method: str
    timing_worker: str | None = None
    #: When this machine's peak GEMM figure was measured (it is cached and reused).
    peak_measured_at: str | None = None
    #: On CUDA, per call, the time the device was busy with the call's kernels (from the
    #: profiler, over ``device_time_calls`` calls): the time without the host's launches.
    device_time_s: float | None = None
    device_time_calls: int | None = None

    @property
    def launch_bound(self) -> bool:
        """The timed figure is more than LAUNCH_BOUND times the device's: the host's Python
        and kernel launches set it, not the kernels."""
        device = self.device_time_s
        return device is not None and launch_bound(self.time_median_s, device)

    @property
    def speed_s(self) -> float:
        """The figure speed is judged by: the device time where the cell is launch-bound
        (comparing wall times there compares the fixes' Python), else the timed median."""
        if self.launch_bound and self.device_time_s is not None:
            return self.device_time_s
        return self.time_median_s

    @property
    def speed_clock(self) -> str:
        return "device time (launch-bound)" if self.launch_bound else "wall time"


@dataclass(frozen=True)
class FitFigures:
    """What a cell of the ``fit`` stage did over its steps (see
    ``harness.measure.running.fitting``): its loss before each step and after the last, the float64
    fit's, the steps a GradScaler skipped and the scale it ended at, the share of the updates the
    optimizer computed that the stored weights did not receive, and the share of the float64 fit's
    progress (its first loss minus its last) the cell's last loss fell short of (None where that
    progress is too small to judge by)."""

    losses: tuple[float, ...]
    reference_losses: tuple[float, ...]
    skipped_steps: int
    final_scale: float | None
    lost_share: float
    shortfall: float | None

    @property
    def steps(self) -> int:
        return len(self.losses) - 1

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "losses": list(self.losses),
            "reference_losses": list(self.reference_losses),
        }

    @classmethod
    def from_dict(cls, data: Any) -> FitFigures:
        figures = made(cls, with_numbers(cls, as_mapping(data, "fit")), "fit")
        return dataclasses.replace(
            figures,
            losses=floats(figures.losses, "fit.losses"),
            reference_losses=floats(figures.reference_losses, "fit.reference_losses"),
        )


def floats(values: Any, name: str) -> tuple[float, ...]:
    """A list of numbers (a non-finite one as its string, or ``null`` for a loss that was
    not finite)."""
    return tuple(
        float("nan") if v is None else float(number_from(v)) for v in as_tuple(values, name)
    )
