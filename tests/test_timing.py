"""Timing statistics, driven by a fake clock so every figure is exact."""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import replace

import pytest

from harness.measure.figures.timing import (
    ClockStopwatch,
    Plateau,
    Timing,
    block_size,
    measure_interleaved,
    time_call,
)
from harness.schema.config import TimingConfig
from harness.schema.stats import quartiles


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
    assert not timing.noisy
    assert timing.timer == "fake"
    assert clock.calls == 50 + 7 * 10  # warm-up until 0.05 s, then 7 blocks of 10


def test_noisy_workload_stops_at_the_budget_and_says_so() -> None:
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
    assert timing.samples == pytest.approx((0.003, 0.001, 0.003, 0.001, 0.003))
    assert timing.median == pytest.approx(0.003)
    assert timing.iqr == pytest.approx(0.002)
    assert timing.min == pytest.approx(0.001)
    assert timing.noisy


def test_sampling_stops_at_max_samples() -> None:
    clock = FakeClock(itertools.cycle([0.001, 0.002]))
    config = TimingConfig(
        warmup_s=0.0, min_block_s=0.0, min_samples=2, max_samples=4, budget_s=100.0
    )
    timing = run(clock, config)
    assert timing.count == 4
    assert timing.noisy


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
    """Seven samples of one call each would leave a cell's untimed calls (warm-up, FLOP and
    memory count) a third of its time: sampling goes on to ``min_calls`` calls, past the
    budget, and to ``min_samples`` samples where blocks are longer."""
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


def test_a_spread_that_stops_shrinking_ends_sampling_early_as_noisy() -> None:
    """On a loaded machine the spread settles above the threshold: sampling stops once it
    has not shrunk for ``plateau_rounds`` rounds instead of spending the whole budget."""
    config = TimingConfig(
        warmup_s=0.0, min_warmup_calls=1, min_block_s=0.0, min_samples=5, budget_s=100.0,
        max_samples=500, plateau_rounds=10, min_calls=1,
    )  # fmt: skip
    clock = FakeClock(itertools.cycle([0.001, 0.003]))
    timing = run(clock, config)
    assert timing.noisy
    assert timing.count < 30  # min_samples, a few rounds to settle, then 10 flat ones
    unbounded = run(FakeClock(itertools.cycle([0.001, 0.003])), replace(config, plateau_rounds=0))
    assert unbounded.count == 500


def test_a_spread_still_shrinking_is_not_a_plateau() -> None:
    plateau = Plateau(rounds=3)
    assert not any(plateau.reached(spread) for spread in (1.0, 0.5, 0.25, 0.1, 0.05))
    assert [plateau.reached(0.05) for _ in range(3)] == [False, False, True]
