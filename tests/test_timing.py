"""Timing statistics, driven by a fake clock so every figure is exact."""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Iterable

import pytest

from harness.measure.figures.timing import (
    ClockStopwatch,
    Stop,
    StopRule,
    Timing,
    block_size,
    measure_interleaved,
    samples_needed,
    time_call,
)
from harness.schema.config import TimingConfig
from harness.schema.stats import Z95, median_precision, quantile, quartiles


class FakeClock:
    """A clock that advances only when the fake workload runs."""

    def __init__(self, durations: Iterable[float]) -> None:
        self.now = 0.0
        self.durations = iter(durations)
        self.calls = 0

    def __call__(self) -> float:
        return self.now

    def work(self) -> None:
        self.now += next(self.durations)
        self.calls += 1


def run(clock: FakeClock, config: TimingConfig) -> Timing:
    return time_call(clock.work, config, stopwatch=ClockStopwatch(clock, "fake"), clock=clock)


def test_steady_workload_converges_after_min_samples() -> None:
    clock = FakeClock(itertools.repeat(0.001))
    timing = run(clock, TimingConfig(warmup_s=0.05, min_block_s=0.01, min_samples=7))
    assert timing.block == 10
    assert timing.count == 7
    assert timing.median == pytest.approx(0.001)
    assert timing.iqr == pytest.approx(0.0)
    assert timing.min == pytest.approx(0.001)
    assert not timing.noisy and timing.stop is Stop.SETTLED
    assert timing.timer == "fake"
    assert clock.calls == 50 + 7 * 10  # warm-up until 0.05 s, then 7 blocks of 10


def test_a_noisy_workload_is_left_after_its_first_rounds_and_says_so() -> None:
    """Its spread (100% of the median) would take thousands of samples to pin the median
    within 3%: more than the budget leaves, so it stops at ``min_samples``."""
    clock = FakeClock(itertools.cycle([0.001, 0.003]))
    config = TimingConfig(
        warmup_s=0.0,
        min_warmup_calls=1,
        min_block_s=0.0,
        min_samples=3,
        min_calls=1,
        budget_s=0.01,
        iqr_threshold=0.03,
    )
    timing = run(clock, config)
    assert timing.samples == pytest.approx((0.003, 0.001, 0.003))
    assert timing.median == pytest.approx(0.003)
    assert timing.iqr == pytest.approx(0.001)
    assert timing.min == pytest.approx(0.001)
    assert timing.noisy and timing.stop is Stop.OUT_OF_REACH


def test_sampling_stops_at_max_samples_and_judges_what_it_has() -> None:
    """``min_calls`` asks for more calls than ``max_samples`` allows: the cap holds, and
    the samples taken, steady, settled."""
    clock = FakeClock(itertools.repeat(0.001))
    config = TimingConfig(
        warmup_s=0.0, min_block_s=0.0, min_samples=2, max_samples=4, min_calls=10**6
    )
    timing = run(clock, config)
    assert timing.count == 4
    assert not timing.noisy and timing.stop is Stop.SETTLED


def test_samples_are_per_call_times_of_each_block() -> None:
    clock = FakeClock(itertools.repeat(0.0004))
    timing = run(clock, TimingConfig(warmup_s=0.0, min_block_s=0.002, min_samples=3, min_calls=1))
    assert timing.block == 5
    assert all(s == pytest.approx(0.0004) for s in timing.samples)


def test_block_size() -> None:
    config = TimingConfig(min_block_s=0.01)
    assert block_size(0.0001, config) == 100
    assert block_size(0.02, config) == 1
    assert block_size(0.0001, TimingConfig(min_block_s=0.01, flush_l2=True)) == 1


def test_quartiles_match_numpy_default() -> None:
    numpy = pytest.importorskip("numpy")
    samples = [5.0, 1.0, 4.0, 2.0, 9.0, 3.0]
    q1, q2, q3 = quartiles(samples)
    assert (q1, q2, q3) == tuple(numpy.percentile(samples, [25, 50, 75]))


def test_interleaved_functions_take_one_sample_each_per_round() -> None:
    clock = FakeClock(itertools.repeat(0.0))  # unused durations: each fn advances its own
    order: list[str] = []

    def fast() -> None:
        clock.now += 0.001
        order.append("fast")

    def slow() -> None:
        clock.now += 0.003
        order.append("slow")

    config = TimingConfig(
        warmup_s=0.0, min_warmup_calls=1, min_block_s=0.0, min_samples=3, min_calls=1
    )
    fast_t, slow_t = measure_interleaved([fast, slow], config, ClockStopwatch(clock), clock)
    assert order == ["fast", "slow"] + ["fast", "slow"] * 3  # warm-up, then 3 rounds
    assert (fast_t.median, slow_t.median) == pytest.approx((0.001, 0.003))
    assert fast_t.count == slow_t.count == 3
    assert not fast_t.noisy and not slow_t.noisy


def test_functions_already_warm_are_sized_from_their_estimates_without_warm_up() -> None:
    """The checked calls of the timing phase are the warm-up: no call is spent on another."""
    clock = FakeClock(itertools.repeat(0.001))
    config = TimingConfig(warmup_s=0.05, min_block_s=0.01, min_samples=7)
    watch = ClockStopwatch(clock, "fake")
    (timing,) = measure_interleaved([clock.work], config, watch, clock, estimates=[0.001])
    assert timing.block == 10 and timing.count == 7
    assert clock.calls == 7 * 10  # the samples only (50 more warm-up calls without estimates)


def test_a_slow_call_is_timed_at_least_min_calls_times_whatever_the_budget() -> None:
    """Seven samples of one call each settle within a run but drift between runs (a slow
    call's fixes reversed from run to run): sampling goes on to ``min_calls`` calls, past
    the budget, and to ``min_samples`` samples where blocks are longer."""
    config = TimingConfig(min_block_s=0.01, min_samples=7, min_calls=20, budget_s=0.1)
    clock = FakeClock(itertools.repeat(0.02))
    watch = ClockStopwatch(clock, "fake")
    (timing,) = measure_interleaved([clock.work], config, watch, clock, estimates=[0.02])
    assert timing.block == 1 and timing.count == 20 and not timing.noisy
    quick = FakeClock(itertools.repeat(0.001))  # blocks of 10 calls: 7 samples are 70 calls
    quick_watch = ClockStopwatch(quick, "fake")
    (timing,) = measure_interleaved([quick.work], config, quick_watch, quick, estimates=[0.001])
    assert timing.block == 10 and timing.count == 7


def test_a_block_sized_from_a_slow_first_call_grows_once_the_call_is_warm() -> None:
    """The caller's estimate came from a call slowed by one-time work (20 ms): the first
    sample shows 1 ms calls, so the block grows to 10 calls and that sample is warm-up."""
    clock = FakeClock(itertools.repeat(0.001))
    config = TimingConfig(min_block_s=0.01, min_samples=7, min_calls=20)
    watch = ClockStopwatch(clock, "fake")
    (timing,) = measure_interleaved([clock.work], config, watch, clock, estimates=[0.02])
    assert timing.block == 10 and timing.count == 7
    assert clock.calls == 1 + 7 * 10  # the one-call sample, then 7 blocks of 10


def test_a_block_sized_from_a_quick_first_call_shrinks_on_a_busy_machine() -> None:
    """The first call ran in a quiet moment (0.1 ms: blocks of 100 calls); the machine is
    busy and calls take 1 ms, so a block would last 100 ms where 10 ms is its due: it
    shrinks to 10 calls and the 100-call sample is warm-up. A block that lasts less than
    twice its due keeps its size."""
    clock = FakeClock(itertools.repeat(0.001))
    config = TimingConfig(min_block_s=0.01, min_samples=7, min_calls=20)
    watch = ClockStopwatch(clock, "fake")
    (timing,) = measure_interleaved([clock.work], config, watch, clock, estimates=[0.0001])
    assert timing.block == 10 and timing.count == 7
    assert clock.calls == 100 + 7 * 10
    steady = FakeClock(itertools.repeat(0.00015))  # blocks of 100 calls last 15 ms
    steady_watch = ClockStopwatch(steady, "fake")
    (timing,) = measure_interleaved(
        [steady.work], config, steady_watch, steady, estimates=[0.0001]
    )
    assert timing.block == 100 and timing.count == 7 and steady.calls == 7 * 100


def test_interleaving_goes_on_until_every_function_is_stable() -> None:
    clock = FakeClock(itertools.repeat(0.0))
    noisy = itertools.cycle([0.001, 0.002])

    def steady() -> None:
        clock.now += 0.001

    def jumpy() -> None:
        clock.now += next(noisy)

    config = TimingConfig(
        warmup_s=0.0, min_warmup_calls=1, min_block_s=0.0, min_samples=3, budget_s=0.01
    )
    steady_t, jumpy_t = measure_interleaved([steady, jumpy], config, ClockStopwatch(clock), clock)
    assert steady_t.count == jumpy_t.count  # the steady one kept sampling alongside
    assert not steady_t.noisy and jumpy_t.noisy
    assert clock.now >= 2 * config.budget_s  # the budget is per function


def drawn_alike(spread: float, seed: int) -> Iterable[float]:
    """Per-call times of 1 ms, each drawn alike from a lognormal: a quiet machine's."""
    draw = random.Random(seed)
    while True:
        yield 0.001 * draw.lognormvariate(0.0, spread)


def test_median_precision_shrinks_as_one_over_sqrt_n_for_samples_drawn_alike() -> None:
    """The quantiles of a normal (sd 5% of the median) at n points: the interval's half
    width is the normal theory's Z95 * sqrt(pi / 2) * sd / sqrt(n), a quarter of the
    samples twice as wide."""
    normal = statistics.NormalDist(1.0, 0.05)
    for n in (100, 400, 1600):
        samples = [normal.inv_cdf((i + 0.5) / n) for i in range(n)]
        theory = Z95 * math.sqrt(math.pi / 2) * 0.05 / math.sqrt(n)
        assert median_precision(samples) == pytest.approx(theory, rel=0.02)
    assert median_precision([0.001]) == 0.0
    assert median_precision([0.0, 0.0, 0.0]) == math.inf


def test_quantile_interpolates_as_quartiles_do() -> None:
    ordered = sorted([5.0, 1.0, 4.0, 2.0, 9.0, 3.0])
    q1, median, q3 = quartiles(ordered)
    assert (quantile(ordered, 0.25), quantile(ordered, 0.5), quantile(ordered, 0.75)) == (
        q1,
        median,
        q3,
    )
    assert (quantile(ordered, -1.0), quantile(ordered, 2.0)) == (1.0, 9.0)


def test_a_quiet_spread_series_stops_once_its_median_is_precise() -> None:
    """Samples drawn alike with a spread above the threshold (IQR about 7% of the median)
    never settle, but their median's interval shrinks as 1 / sqrt(n): sampling stops
    once it is within ``precision``, well before the budget, with the median there."""
    config = TimingConfig(min_block_s=0.0, min_calls=1, budget_s=10.0)
    clock = FakeClock(drawn_alike(0.05, seed=1))
    (timing,) = measure_interleaved(
        [clock.work], config, ClockStopwatch(clock, "fake"), clock, estimates=[0.001]
    )
    assert timing.stop is Stop.PRECISE and timing.noisy  # its spread stayed above 3%
    assert config.min_samples < timing.count < 100  # the budget allowed thousands
    assert timing.precision <= config.precision
    assert timing.median == pytest.approx(0.001, rel=config.precision)


def test_a_busy_series_is_left_at_its_first_rounds() -> None:
    """Calls of 1 ms spread over 40% of the median (a busy core): within 3% would take
    more samples than the half second of its budget holds, so the cell is left noisy
    after ``min_samples`` rounds, whatever ``min_calls`` asks."""
    config = TimingConfig(min_block_s=0.001, min_calls=20, budget_s=0.5)
    clock = FakeClock(drawn_alike(0.3, seed=2))
    (timing,) = measure_interleaved(
        [clock.work], config, ClockStopwatch(clock, "fake"), clock, estimates=[0.001]
    )
    assert timing.stop is Stop.OUT_OF_REACH and timing.noisy
    assert timing.block == 1 and timing.count == config.min_samples
    affordable = config.budget_s / timing.median
    assert samples_needed(timing.count, timing.precision, config.precision) > affordable


def test_a_drifting_series_whose_interval_does_not_shrink_is_left_noisy() -> None:
    """A machine slowing down round by round: its samples are not drawn alike, and the
    median's interval widens instead of shrinking; within the budget the target looked
    reachable, but after ``plateau_rounds`` rounds no narrower, sampling stops."""
    config = TimingConfig(
        min_block_s=0.0, min_samples=7, min_calls=1, budget_s=100.0, plateau_rounds=5
    )
    clock = FakeClock(0.001 * (1 + 0.02 * i) for i in itertools.count())
    (timing,) = measure_interleaved(
        [clock.work], config, ClockStopwatch(clock, "fake"), clock, estimates=[0.001]
    )
    assert timing.stop is Stop.NOT_SHRINKING and timing.noisy
    first_look = config.min_samples + config.plateau_rounds
    assert first_look <= timing.count < first_look + config.plateau_rounds


def test_sampling_stops_at_the_wall_time_cap_short_of_min_calls() -> None:
    """Calls of one second each: ``min_calls`` would take 20 s; the cap of 3 s per
    function holds, and a steady call is judged settled by the samples it has."""
    config = TimingConfig(min_samples=2, min_calls=20, max_sampling_s=3.0)
    clock = FakeClock(itertools.repeat(1.0))
    (timing,) = measure_interleaved(
        [clock.work], config, ClockStopwatch(clock, "fake"), clock, estimates=[1.0]
    )
    assert timing.count == 3 and clock.now == 3.0
    assert timing.stop is Stop.SETTLED and not timing.noisy


def test_a_cap_before_min_samples_is_noisy() -> None:
    config = TimingConfig(min_samples=7, max_sampling_s=3.0)
    clock = FakeClock(itertools.repeat(1.0))
    (timing,) = measure_interleaved(
        [clock.work], config, ClockStopwatch(clock, "fake"), clock, estimates=[1.0]
    )
    assert timing.count == 3
    assert timing.stop is Stop.CAPPED and timing.noisy


def test_the_wall_time_cap_is_per_function_of_a_column() -> None:
    config = TimingConfig(min_samples=2, min_calls=20, max_sampling_s=3.0)
    clock = FakeClock(itertools.repeat(1.0))
    timings = measure_interleaved(
        [clock.work, clock.work], config, ClockStopwatch(clock, "fake"), clock, [1.0, 1.0]
    )
    assert [t.count for t in timings] == [3, 3] and clock.now == 6.0


def test_the_stop_rule_judges_after_min_samples_and_min_calls() -> None:
    """Steady samples settle only with ``min_calls`` calls; wide ones are given up on at
    ``min_samples`` where the budget falls short of what the target would take, and go
    on where it does not."""
    config = TimingConfig(min_samples=3, min_calls=6)
    steady, wide = [0.001] * 3, [0.001, 0.002, 0.003]
    rule = StopRule(config)
    for n in range(1, 4):
        rule.observe(steady[:n])
    assert rule.verdict(steady[:2], block=3, affordable=100) is None  # under min_samples
    assert rule.verdict(steady, block=1, affordable=100) is None  # 3 calls of 6
    assert rule.verdict(steady, block=2, affordable=100) is Stop.SETTLED
    rule = StopRule(config)
    rule.observe(wide)
    needed = samples_needed(3, median_precision(wide), config.precision)
    assert rule.verdict(wide, block=1, affordable=needed - 1) is Stop.OUT_OF_REACH
    assert rule.verdict(wide, block=1, affordable=needed + 1) is None
