"""Timing one operation: warm-up, blocks of calls, adaptive repetition, raw samples recorded.

The method follows ``torch.utils.benchmark.Timer.blocked_autorange``: one *sample* is a
block of calls long enough to dwarf the clock's resolution, and the figure is the median
of per-call times over samples. Repetition is adaptive: sampling stops once the spread
(IQR / median) falls under a threshold, or when the time budget runs out, in which case the
result is flagged ``noisy``. Fixes that will be compared are timed interleaved, one sample
of each per round. The clock is injected, so tests drive it with a fake.

On CUDA a sample is bracketed by CUDA events (the device's own clock) after a synchronise,
and an optional L2 flush (writing a buffer larger than the cache) precedes each sample.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from harness.schema.config import TimingConfig
from harness.schema.devices import CUDA
from harness.schema.stats import quartiles

if TYPE_CHECKING:  # torch is imported where CUDA is timed: reports read this module too
    import torch

Clock = Callable[[], float]


@dataclass(frozen=True)
class Timing:
    """Per-call times (seconds, one per sample) and their statistics."""

    samples: tuple[float, ...]
    block: int
    median: float
    iqr: float
    min: float
    noisy: bool
    timer: str

    @property
    def count(self) -> int:
        return len(self.samples)

    @property
    def spread(self) -> float:
        return self.iqr / self.median if self.median > 0 else math.inf


class Stopwatch(Protocol):
    """Times one block of calls; ``name`` goes into the record."""

    name: str

    def time_block(self, fn: Callable[[], Any], calls: int) -> float: ...


class ClockStopwatch:
    """A host clock around the block (``time.perf_counter`` unless injected)."""

    def __init__(self, clock: Clock = time.perf_counter, name: str = "perf_counter") -> None:
        self.clock = clock
        self.name = name

    def time_block(self, fn: Callable[[], Any], calls: int) -> float:
        start = self.clock()
        for _ in range(calls):
            fn()
        return self.clock() - start


class CudaEventStopwatch:
    """CUDA events around the block, after a synchronise; optional L2 flush before it."""

    name = "cuda_event"
    L2_FLUSH_BYTES = 256 * 1024 * 1024

    def __init__(self, device: torch.device, flush_l2: bool = False) -> None:
        import torch

        self.device = device
        self.flush_buffer = (
            torch.empty(self.L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
            if flush_l2
            else None
        )

    def time_block(self, fn: Callable[[], Any], calls: int) -> float:
        import torch

        if self.flush_buffer is not None:
            self.flush_buffer.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0


def stopwatch_for(device: torch.device, flush_l2: bool = False) -> Stopwatch:
    if device.type == CUDA:
        return CudaEventStopwatch(device, flush_l2)
    return ClockStopwatch()


def warm_up(
    fn: Callable[[], Any], config: TimingConfig, stopwatch: Stopwatch, clock: Clock
) -> float:
    """Call ``fn`` until the warm-up time has passed; returns the last per-call estimate."""
    started, calls, last = clock(), 0, 0.0
    while calls < config.min_warmup_calls or clock() - started < config.warmup_s:
        last = stopwatch.time_block(fn, 1)
        calls += 1
    return last


def block_size(per_call_s: float, config: TimingConfig) -> int:
    """Calls per sample, so that one sample lasts at least ``min_block_s``."""
    if config.flush_l2 or per_call_s >= config.min_block_s:
        return 1
    return max(1, math.ceil(config.min_block_s / max(per_call_s, 1e-9)))


def time_call(
    fn: Callable[[], Any],
    config: TimingConfig = TimingConfig(),
    stopwatch: Stopwatch | None = None,
    clock: Clock = time.perf_counter,
) -> Timing:
    """Time ``fn``: warm up, then sample blocks until stable or out of budget."""
    return measure_interleaved([fn], config, stopwatch, clock)[0]


def measure_interleaved(
    fns: Sequence[Callable[[], Any]],
    config: TimingConfig = TimingConfig(),
    stopwatch: Stopwatch | None = None,
    clock: Clock = time.perf_counter,
    estimates: Sequence[float] | None = None,
) -> list[Timing]:
    """Time several functions side by side: each round takes one sample of every function,
    so a drift of the machine's speed during the measurement affects all of them alike.
    Rounds go on until every function's spread is under the threshold, or the budget
    (``budget_s`` per function) runs out. ``estimates``: per-call times of functions
    already warm (called and timed by the caller), which then need no warm-up of their own,
    as ``blocked_autorange`` sizes its blocks from one call."""
    watch = stopwatch or ClockStopwatch(clock)
    if estimates is None:
        estimates = [warm_up(fn, config, watch, clock) for fn in fns]
        started = clock()
        blocks = [block_size(estimate, config) for estimate in estimates]
        samples: list[list[float]] = [[] for _ in fns]
    else:
        started = clock()
        blocks, samples = first_samples(fns, estimates, watch, config)
    budget = config.budget_s * len(fns)
    plateau = Plateau(config.plateau_rounds)
    while min(map(len, samples)) < config.max_samples:
        for fn, block, mine in zip(fns, blocks, samples, strict=True):
            mine.append(watch.time_block(fn, block) / block)
        if not enough_calls(samples, blocks, config):
            continue
        if all(converged(s, config) for s in samples) or clock() - started >= budget:
            break
        if plateau.reached(max(spread_of(s) for s in samples)):
            break
    return [
        summarize(s, block, noisy=not converged(s, config), timer=watch.name)
        for s, block in zip(samples, blocks, strict=True)
    ]


def first_samples(
    fns: Sequence[Callable[[], Any]],
    estimates: Sequence[float],
    watch: Stopwatch,
    config: TimingConfig,
) -> tuple[list[int], list[list[float]]]:
    """Blocks sized from the caller's estimates, and one sample of each function. Where
    that sample shows the function quicker than its estimate allowed for (a first call
    slowed by one-time work), its block grows to fit, and the sample, taken with the
    smaller block, counts as warm-up."""
    blocks, samples = [], []
    for fn, estimate in zip(fns, estimates, strict=True):
        block = block_size(estimate, config)
        sample = watch.time_block(fn, block) / block
        better = block_size(sample, config)
        blocks.append(max(block, better))
        samples.append([sample] if better <= block else [])
    return blocks, samples


def enough_calls(samples: list[list[float]], blocks: list[int], config: TimingConfig) -> bool:
    """Every function has its ``min_samples`` samples and ``min_calls`` timed calls."""
    return min(map(len, samples)) >= config.min_samples and all(
        len(s) * block >= config.min_calls for s, block in zip(samples, blocks, strict=True)
    )


class Plateau:
    """Whether the worst spread has stopped shrinking: no round in the last ``rounds`` has
    brought it a tenth below the best seen before them."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds
        self.best = math.inf
        self.since_better = 0

    def reached(self, spread: float) -> bool:
        if spread < self.best * 0.9:
            self.best, self.since_better = spread, 0
        else:
            self.since_better += 1
        return self.rounds > 0 and self.since_better >= self.rounds


def converged(samples: list[float], config: TimingConfig) -> bool:
    return len(samples) >= config.min_samples and spread_of(samples) < config.iqr_threshold


def spread_of(samples: list[float]) -> float:
    q1, median, q3 = quartiles(samples)
    return (q3 - q1) / median if median > 0 else math.inf


def summarize(samples: list[float], block: int, noisy: bool, timer: str) -> Timing:
    q1, median, q3 = quartiles(samples)
    return Timing(tuple(samples), block, median, q3 - q1, min(samples), noisy, timer)
