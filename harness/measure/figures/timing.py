"""Timing one operation: warm-up, blocks of calls, adaptive repetition, raw samples recorded.

The method follows ``torch.utils.benchmark.Timer.blocked_autorange``: one *sample* is a
block of calls long enough to dwarf the clock's resolution, and the figure is the median
of per-call times over samples. Repetition is adaptive and bounded by what more samples can
still tell (:class:`StopRule`): sampling stops once the spread (IQR / median) falls under a
threshold (the machine was quiet for the call), or once the median is known to the target
precision (its 95% interval, which shrinks as 1 / sqrt(n) where samples are drawn alike);
it is given up, and the result flagged ``noisy`` with the reason (:class:`Stop`), once that
precision would take more samples than the budget leaves, or the interval has stopped
shrinking (a busy machine's samples are not drawn alike). Fixes that will be compared are
timed interleaved, one sample of each per round. The clock is injected, so tests drive it
with a fake.

On CUDA a sample is bracketed by CUDA events (the device's own clock) after a synchronise,
and an optional L2 flush (writing a buffer larger than the cache) precedes each sample.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from harness.schema.config import TimingConfig
from harness.schema.devices import CUDA
from harness.schema.stats import median_precision, quartiles

if TYPE_CHECKING:  # torch is imported where CUDA is timed: reports read this module too
    import torch

Clock = Callable[[], float]


class Stop(str, Enum):
    """Why a function's sampling ended (see :class:`StopRule`)."""

    #: The spread fell under the threshold: the machine was quiet for this call.
    SETTLED = "settled"
    #: The spread stayed above the threshold, but the median is known to the target
    #: precision: more samples would not change it.
    PRECISE = "precise"
    #: The target precision would take more samples than the budget leaves.
    OUT_OF_REACH = "out-of-reach"
    #: The median's interval did not shrink over the last ``plateau_rounds`` rounds.
    NOT_SHRINKING = "not-shrinking"
    #: A hard cap (``max_samples``, ``max_sampling_s``) came before ``min_samples``.
    CAPPED = "capped"


@dataclass(frozen=True)
class Timing:
    """Per-call times (seconds, one per sample) and their statistics; why sampling
    stopped, and the precision its median reached (:func:`median_precision`)."""

    samples: tuple[float, ...]
    block: int
    median: float
    iqr: float
    min: float
    noisy: bool
    timer: str
    stop: Stop = Stop.SETTLED
    precision: float = 0.0

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
    Rounds go on until the :class:`StopRule` of every function says stop, or a hard cap
    is reached: ``max_samples`` rounds, or ``max_sampling_s`` per function. ``estimates``:
    per-call times of functions already warm (called and timed by the caller), which then
    need no warm-up of their own, as ``blocked_autorange`` sizes its blocks from one call."""
    watch = stopwatch or ClockStopwatch(clock)
    if estimates is None:
        estimates = [warm_up(fn, config, watch, clock) for fn in fns]
        started = clock()
        blocks = [block_size(estimate, config) for estimate in estimates]
        samples: list[list[float]] = [[] for _ in fns]
    else:
        started = clock()
        blocks, samples = first_samples(fns, estimates, watch, config)
    rules = [StopRule(config) for _ in fns]
    budget = Budget(config, len(fns))
    for rounds in itertools.count(1):
        for fn, block, mine, rule in zip(fns, blocks, samples, rules, strict=True):
            mine.append(watch.time_block(fn, block) / block)
            rule.observe(mine)
        elapsed = clock() - started
        capped = budget.capped(samples, elapsed)
        stops = [
            None if capped else rule.verdict(s, block, budget.affordable(len(s), elapsed, rounds))
            for rule, s, block in zip(rules, samples, blocks, strict=True)
        ]
        if capped or all(stop is not None for stop in stops):
            break
    return [
        summarize(s, block, stop or rule.final(s), timer=watch.name)
        for s, block, stop, rule in zip(samples, blocks, stops, rules, strict=True)
    ]


class Budget:
    """What a column's sampling may spend: its budget (``budget_s`` per function), beyond
    which a noisy function's target precision is out of reach, and its hard caps."""

    def __init__(self, config: TimingConfig, functions: int) -> None:
        self.config = config
        self.seconds = config.budget_s * functions
        self.hard_seconds = config.max_sampling_s * functions

    def capped(self, samples: list[list[float]], elapsed: float) -> bool:
        """Whether a hard cap is reached: ``max_samples`` samples, or ``max_sampling_s``
        per function, whatever ``min_calls`` asks."""
        return min(map(len, samples)) >= self.config.max_samples or elapsed >= self.hard_seconds

    def affordable(self, count: int, elapsed: float, rounds: int) -> float:
        """Samples a function of ``count`` samples will have when the budget runs out, at
        the pace of the ``rounds`` taken in ``elapsed`` seconds."""
        left = max(0.0, self.seconds - elapsed)
        more = left * rounds / elapsed if elapsed > 0 else math.inf
        return min(float(self.config.max_samples), count + more)


class StopRule:
    """When one function's sampling may stop, judged after each round from its samples.

    Settled (IQR / median under ``iqr_threshold``) or precise (the median's 95% interval
    within ``precision`` of it) ends sampling once the function has ``min_samples``
    samples and ``min_calls`` calls. A function that is neither is left, noisy, as soon as
    more samples cannot tell more: where, at the 1 / sqrt(n) shrinking of samples drawn
    alike, the target precision would take more samples than the budget leaves, or where
    its interval has not shrunk at all over the last ``plateau_rounds`` rounds (a machine
    whose speed drifts or jumps: more samples add no precision). That is decided after
    ``min_samples`` rounds, ``min_calls`` or not: a busy core costs a noisy cell its first
    rounds only."""

    def __init__(self, config: TimingConfig) -> None:
        self.config = config
        self.widths: list[float] = []

    def observe(self, samples: list[float]) -> None:
        """After each sample: the median's precision so far."""
        self.widths.append(median_precision(samples))

    def verdict(self, samples: list[float], block: int, affordable: float) -> Stop | None:
        """Why sampling may stop now (None: go on), where ``affordable`` samples could
        still be reached."""
        config = self.config
        if len(samples) < config.min_samples:
            return None
        enough = len(samples) * block >= config.min_calls
        if spread_of(samples) < config.iqr_threshold:
            return Stop.SETTLED if enough else None
        if self.widths[-1] <= config.precision:
            return Stop.PRECISE if enough else None
        if samples_needed(len(samples), self.widths[-1], config.precision) > affordable:
            return Stop.OUT_OF_REACH
        return Stop.NOT_SHRINKING if self.not_shrinking() else None

    def not_shrinking(self) -> bool:
        """The interval is no narrower than ``plateau_rounds`` rounds ago (where samples
        drawn alike would have narrowed it by sqrt(n_then / n_now))."""
        rounds = self.config.plateau_rounds
        then = len(self.widths) - rounds  # the round compared with, counted from 1
        return (
            rounds > 0
            and then >= self.config.min_samples
            and self.widths[-1] >= self.widths[then - 1]
        )

    def final(self, samples: list[float]) -> Stop:
        """Why sampling ended where a hard cap ended it: the verdict with no more samples
        to take, so a function short of ``min_calls`` is judged by the samples it has."""
        verdict = StopRule(replace(self.config, min_calls=0))
        verdict.widths = self.widths
        return verdict.verdict(samples, 1, float(len(samples))) or Stop.CAPPED


def samples_needed(count: int, width: float, target: float) -> float:
    """Samples that would bring an interval of ``width`` over ``count`` samples to
    ``target``, shrinking as 1 / sqrt(n)."""
    return count * (width / target) ** 2 if target > 0 else math.inf


def first_samples(
    fns: Sequence[Callable[[], Any]],
    estimates: Sequence[float],
    watch: Stopwatch,
    config: TimingConfig,
) -> tuple[list[int], list[list[float]]]:
    """Blocks sized from the caller's estimates, and one sample of each function. Where
    that sample shows the function quicker than its estimate allowed for (a first call
    slowed by one-time work), its block grows to fit; where it shows the block lasting
    over ``OVERSIZED`` times ``min_block_s`` (an estimate taken in a quiet moment of a busy
    machine), it shrinks to fit, so every round does not cost as many times its due. Either
    way the sample, taken with the other block, counts as warm-up."""
    blocks, samples = [], []
    for fn, estimate in zip(fns, estimates, strict=True):
        block = block_size(estimate, config)
        sample = watch.time_block(fn, block) / block
        better = block_size(sample, config)
        fits = block >= better and block <= OVERSIZED * better
        blocks.append(block if fits else better)
        samples.append([sample] if fits else [])
    return blocks, samples


#: A block sized from the caller's estimate is sized again where its first sample lasted
#: more than this many times ``min_block_s``.
OVERSIZED = 2


def spread_of(samples: list[float]) -> float:
    q1, median, q3 = quartiles(samples)
    return (q3 - q1) / median if median > 0 else math.inf


def summarize(samples: list[float], block: int, stop: Stop, timer: str) -> Timing:
    """The samples' statistics; noisy unless their spread settled."""
    q1, median, q3 = quartiles(samples)
    noisy = stop is not Stop.SETTLED
    return Timing(
        tuple(samples), block, median, q3 - q1, min(samples), noisy, timer, stop,
        median_precision(samples),
    )  # fmt: skip
