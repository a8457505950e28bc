"""``compare`` judges speed against the run-to-run noise of its pair of runs: a machine that
is slower for every cell alike is not a regression, one fix slower than the rest is, and a
change within the spread of all cells' ratios is ``ambiguous``. The records are synthetic,
their samples drawn from a seeded generator around a chosen median."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path

import pytest

from harness.report.aggregate import Run
from harness.report.compare import (
    Comparison,
    compare_runs,
    device_noise,
    own_spread,
    render_comparison,
    speed_change,
)
from harness.results.speed import MIN_CELLS_FOR_FACTOR, MIN_RATIO
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, Outcome, Perf
from harness.schema.run_files import Environment

#: As many timed cells as the case the noise was measured on (lightning-encoder-fastpath).
CELLS = 17
#: Samples per timed cell, and their relative jitter around the median.
SAMPLES, JITTER = 25, 0.02


def cell(index: int, device: str = "cpu") -> Cell:
    return Cell("timed", f"fix-{index:02d}", device, "float16", "half", "sdpa")


def perf(median: float, rng: random.Random, jitter: float = JITTER) -> Perf:
    """Samples spread evenly within ``jitter`` of ``median``: noisy (the timer's flag) where
    their IQR is above 3% of the median, as the timer judges."""
    samples = sorted(median * (1 + rng.uniform(-jitter, jitter)) for _ in range(SAMPLES))
    iqr = samples[3 * SAMPLES // 4] - samples[SAMPLES // 4]
    return Perf(samples, 1, samples[SAMPLES // 2], iqr, samples[0], SAMPLES, iqr > 0.03 * median,
                "perf_counter", 2, None, None, None, None, 0, "tracemalloc")  # fmt: skip


def run(
    name: str, medians: Sequence[float], seed: int, device: str = "cpu", first: int = 0
) -> Run:
    """A run of one timed cell per median, every one passing."""
    rng = random.Random(seed)
    records = [
        CellRecord(cell(first + i, device), "2.13.0", Outcome.PASSES, perf=perf(m, rng))
        for i, m in enumerate(medians)
    ]
    return Run(Path(name), Environment(torch_version="2.13.0", hostname="ci"), records)


def base_medians(cells: int = CELLS) -> list[float]:
    """Cells of different speeds, 1 ms to about 5 ms, as a case's fixes are."""
    return [1e-3 * (1 + 0.25 * i) for i in range(cells)]


def compared(base: Sequence[float], head: Sequence[float]) -> Comparison:
    return compare_runs(run("base", base, seed=1), run("head", head, seed=2))


def verdicts(comparison: Comparison) -> dict[str, str]:
    return {c.cell.fix: c.verdict for c in comparison.changes if c.kind == "speed"}


def test_every_cell_twice_as_slow_is_a_slower_machine_not_a_regression() -> None:
    base = base_medians()
    comparison = compared(base, [2 * m for m in base])
    assert comparison.regressions == []
    assert verdicts(comparison) == {}
    (noise,) = comparison.noise
    assert noise.factor == pytest.approx(2.0, rel=0.03)
    assert noise.cells == CELLS
    text = render_comparison(comparison)
    assert "speed on cpu judged against this pair's machine factor 2.0" in text
    assert f"(median of {CELLS} cells; spread " in text


def test_one_fix_twice_as_slow_among_unchanged_ones_is_the_one_regression() -> None:
    base = base_medians()
    head = [2 * m if i == 5 else m for i, m in enumerate(base)]
    comparison = compared(base, head)
    assert verdicts(comparison) == {"fix-05": "regression"}
    assert [c.cell.fix for c in comparison.regressions] == ["fix-05"]
    assert comparison.noise[0].factor == pytest.approx(1.0, rel=0.03)


def test_one_fix_twice_as_slow_on_a_machine_twice_as_slow_is_still_found() -> None:
    base = base_medians()
    head = [(4 if i == 9 else 2) * m for i, m in enumerate(base)]
    comparison = compared(base, head)
    assert verdicts(comparison) == {"fix-09": "regression"}
    (change,) = comparison.changes
    assert "of the machine's" in change.head


def test_one_fix_twice_as_fast_is_an_improvement() -> None:
    base = base_medians()
    head = [m / 2 if i == 3 else m for i, m in enumerate(base)]
    assert verdicts(compared(base, head)) == {"fix-03": "improvement"}


def test_a_change_within_a_large_spread_is_ambiguous() -> None:
    """Cells scattered from 0.5x to 2x (a machine whose load came and went): the largest
    change is within the spread of all of them, so nothing is a regression."""
    base = base_medians()
    scatter = [2 ** math.sin(1.7 * i) for i in range(CELLS)]  # 0.5x to 2x, no pattern
    comparison = compared(base, [m * s for m, s in zip(base, scatter, strict=True)])
    found = verdicts(comparison)
    assert comparison.regressions == []
    assert found and set(found.values()) == {"ambiguous"}
    low, high = comparison.noise[0].bounds
    assert low < 1 / MIN_RATIO and high > MIN_RATIO  # the spread widened the bounds


def test_too_few_cells_give_no_machine_factor_and_no_verdict() -> None:
    base = base_medians(MIN_CELLS_FOR_FACTOR - 1)
    comparison = compared(base, [2 * m for m in base])
    assert comparison.regressions == []
    assert set(verdicts(comparison).values()) == {"ambiguous"}
    (noise,) = comparison.noise
    assert noise.factor is None
    assert "no machine factor (4 cells timed in both runs, 5 needed)" in noise.describe()


def test_each_device_has_its_own_machine_factor() -> None:
    """A busy CPU beside an idle GPU: the CPU's cells are twice as slow, the GPU's not."""
    base_cpu, base_gpu = run("b", base_medians(), 1), run("b", base_medians(), 3, "cuda:0")
    head_cpu = run("h", [2 * m for m in base_medians()], 2)
    head_gpu = run("h", base_medians(), 4, "cuda:0")
    base = Run(Path("base"), base_cpu.env, base_cpu.records + base_gpu.records)
    head = Run(Path("head"), head_cpu.env, head_cpu.records + head_gpu.records)
    comparison = compare_runs(base, head)
    assert comparison.regressions == []
    factors = {noise.device: noise.factor for noise in comparison.noise}
    assert factors == {"cpu": pytest.approx(2.0, rel=0.03), "cuda:0": pytest.approx(1.0, rel=0.03)}


def test_an_outcome_regression_still_counts_on_a_slower_machine() -> None:
    base = run("base", base_medians(), 1)
    head = run("head", [2 * m for m in base_medians()], 2)
    broken = CellRecord(head.records[0].cell, "2.13.0", Outcome.RAISES, error_type="RuntimeError")
    head.records[0] = broken
    comparison = compare_runs(base, head)
    assert [(c.kind, c.verdict) for c in comparison.regressions] == [("outcome", "regression")]


def test_the_bounds_are_never_inside_the_minimum_ratio() -> None:
    """Identical ratios have no spread: the minimum ratio still bounds a change."""
    noise = device_noise("cpu", [1.0] * 10, MIN_RATIO)
    assert noise.bounds == pytest.approx((1 / MIN_RATIO, MIN_RATIO))
    assert noise.factor == 1.0


def test_without_noise_a_pair_of_cells_is_judged_by_its_samples_alone() -> None:
    """``speed_change`` called on its own (no noise given) keeps its old meaning."""
    rng = random.Random(5)
    before = CellRecord(cell(0), "2.13.0", Outcome.PASSES, perf=perf(1e-3, rng))
    after = CellRecord(cell(0), "2.13.0", Outcome.PASSES, perf=perf(2e-3, rng))
    change = speed_change(before, after)
    assert change is not None and change.verdict == "regression"


def with_cell(run: Run, index: int, median: float, jitter: float, seed: int) -> Run:
    """``run`` with the cell at ``index`` timed anew around ``median``."""
    record = run.records[index]
    timed = CellRecord(record.cell, "2.13.0", Outcome.PASSES,
                       perf=perf(median, random.Random(seed), jitter))  # fmt: skip
    return Run(run.run_dir, run.env, [*run.records[:index], timed, *run.records[index + 1 :]])


def test_a_cell_whose_timing_did_not_settle_has_no_speed_verdict() -> None:
    """Beside a busy core a few cells' samples spread over several times their median
    while the rest moved with the machine: such a cell's 3x is not a regression."""
    base = run("base", base_medians(), 1)
    head = with_cell(run("head", [2 * m for m in base_medians()], 2), 4, 6 * base_medians()[4],
                     jitter=0.9, seed=7)  # fmt: skip
    assert head.records[4].perf is not None and head.records[4].perf.time_noisy
    comparison = compare_runs(base, head)
    assert comparison.regressions == []
    (change,) = comparison.changes
    assert change.verdict == "ambiguous" and "did not settle" in change.head


def test_a_settled_cell_is_still_judged_beside_noisy_ones() -> None:
    """Noisy cells elsewhere do not hide a settled cell that slowed beyond the noise."""
    base = run("base", base_medians(), 1)
    head = run("head", base_medians(), 2)
    head = with_cell(head, 2, base_medians()[2], jitter=0.5, seed=8)  # noisy, unchanged
    head = with_cell(head, 11, 3 * base_medians()[11], jitter=JITTER, seed=9)  # settled, 3x
    comparison = compare_runs(base, head)
    assert [c.cell.fix for c in comparison.regressions] == ["fix-11"]
    assert verdicts(comparison).get("fix-02") in (None, "ambiguous")


def test_own_spread_multiplies_each_run_s_relative_iqr() -> None:
    rng = random.Random(3)
    quiet = CellRecord(cell(0), "2.13.0", Outcome.PASSES, perf=perf(1e-3, rng, 0.01))
    loud = CellRecord(cell(0), "2.13.0", Outcome.PASSES, perf=perf(1e-3, rng, 0.8))
    assert own_spread(quiet, quiet) == pytest.approx(1.01, abs=0.01)
    assert own_spread(quiet, loud) > 1.5
