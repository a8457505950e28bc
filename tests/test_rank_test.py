"""The Mann-Whitney U test of ``compare`` (``harness.results.rank_test``): scipy's
p-values with its defaults, exact for small samples without ties and by the normal
approximation otherwise, without importing scipy."""

from __future__ import annotations

import math
import random

import pytest

from harness.results.rank_test import average_ranks, frequencies, mann_whitney_p


def samples(rng: random.Random, n: int, scale: float, digits: int | None) -> list[float]:
    values = [rng.lognormvariate(0, 0.3) * scale for _ in range(n)]
    return [round(v, digits) for v in values] if digits is not None else values


def test_the_p_values_are_scipys() -> None:
    """Small and large samples, shifted or not, with ties (rounded) and without."""
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(42)
    for trial in range(600):
        small = trial % 2 == 0
        n1, n2 = (rng.randint(1, 8), rng.randint(1, 12)) if small else (rng.randint(9, 40),) * 2
        digits = 1 if trial % 5 == 0 else None
        x, y = samples(rng, n1, 1.0, digits), samples(rng, n2, rng.choice((0.7, 1, 1.4)), digits)
        expected = float(stats.mannwhitneyu(x, y, alternative="two-sided").pvalue)
        assert math.isclose(mann_whitney_p(x, y), expected, rel_tol=1e-12, abs_tol=1e-300)


def test_known_values_without_scipy() -> None:
    # exact: 3 against 3 fully separated: 2 of the 20 orderings are as extreme
    assert mann_whitney_p([1, 2, 3], [4, 5, 6]) == pytest.approx(0.1)
    assert mann_whitney_p([1, 2, 3], [1, 2, 3]) == 1.0  # all tied in pairs: normal, U at mu
    assert math.isnan(mann_whitney_p([], [1.0])) and math.isnan(mann_whitney_p([math.nan], [1]))
    far = mann_whitney_p([float(v) for v in range(20)], [float(v) for v in range(100, 120)])
    assert far < 1e-6


def test_ranks_average_their_ties_and_frequencies_count_every_ordering() -> None:
    assert average_ranks([3.0, 1.0, 3.0, 2.0]) == ([3.5, 1.0, 3.5, 2.0], [1, 1, 2])
    assert frequencies(2, 2) == (1, 1, 2, 1, 1)
    assert sum(frequencies(5, 7)) == math.comb(12, 5)
