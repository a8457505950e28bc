"""The two-sided Mann-Whitney U test's p-value, as ``scipy.stats.mannwhitneyu`` computes it
with its defaults (``method="auto"``, continuity correction), in plain Python.

``compare`` takes one for every cell whose speed changed beyond its threshold: over a
nightly's 100k cells, thousands. scipy's call costs about a millisecond (its input checks
and broadcasting, for two lists of a few dozen samples) and its import half a second to a
second; this costs microseconds and imports nothing. The p-values agree with scipy's to
the last bits (tested against it where it is installed): the exact distribution of U where
either sample has at most 8 values and none is tied, else the normal approximation with
scipy's tie correction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache

#: Beyond this many values in both samples, or with a tie, U's distribution is taken as
#: normal (scipy's ``_mwu_choose_method``).
EXACT_UP_TO = 8


def mann_whitney_p(x: Sequence[float], y: Sequence[float]) -> float:
    """The two-sided p-value that ``x`` and ``y`` come from one distribution (NaN where a
    sample is empty or holds a NaN, as scipy's ``nan_policy="propagate"``)."""
    n1, n2 = len(x), len(y)
    if not n1 or not n2 or any(map(math.isnan, (*x, *y))):
        return math.nan
    ranks, ties = average_ranks([*x, *y])
    u1 = sum(ranks[:n1]) - n1 * (n1 + 1) / 2
    u = max(u1, n1 * n2 - u1)
    if (n1 > EXACT_UP_TO and n2 > EXACT_UP_TO) or any(t > 1 for t in ties):
        p = 2 * normal_sf(u, n1, n2, ties)
    else:
        p = 2 * exact_sf(int(u), min(n1, n2), max(n1, n2))
    return min(max(p, 0.0), 1.0)


def average_ranks(values: Sequence[float]) -> tuple[list[float], list[int]]:
    """Each value's rank (1-based, tied values sharing their average), and the size of
    each group of equal values."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    ties = []
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        rank = (start + end) / 2 + 1
        for i in order[start : end + 1]:
            ranks[i] = rank
        ties.append(end - start + 1)
        start = end + 1
    return ranks, ties


def normal_sf(u: float, n1: int, n2: int, ties: Sequence[int]) -> float:
    """P(U >= u) by the normal approximation, tie-corrected, with the continuity
    correction (scipy's ``_get_mwu_z`` and ``ndtr(-z)``)."""
    n = n1 + n2
    tie_term = sum(t**3 - t for t in ties)
    s = math.sqrt(n1 * n2 / 12 * ((n + 1) - tie_term / (n * (n - 1))))
    numerator = u - n1 * n2 / 2 - 0.5
    if s == 0:
        z = math.copysign(math.inf, numerator) if numerator else math.nan
    else:
        z = numerator / s
    return 0.5 * math.erfc(z / math.sqrt(2))


def exact_sf(u: int, n1: int, n2: int) -> float:
    """P(U >= u) for samples of ``n1 <= n2`` values, from U's exact distribution (as
    scipy's ``_MWU.sf``: summed from the nearer end, the distribution being symmetric)."""
    complement = n1 * n2 - u
    if u < complement:
        cdf = cumulative(n1, n2, u)
        return 1.0 - cdf[u] + frequencies(n1, n2)[u] / math.comb(n1 + n2, n1)
    return cumulative(n1, n2, complement)[complement]


def cumulative(n1: int, n2: int, upto: int) -> list[float]:
    """P(U <= k) for k up to ``upto``, summed in order as numpy's ``cumsum``."""
    total = float(math.comb(n1 + n2, n1))
    sums, running = [], 0.0
    for count in frequencies(n1, n2)[: upto + 1]:
        running += count / total
        sums.append(running)
    return sums


@cache
def frequencies(n1: int, n2: int) -> tuple[int, ...]:
    """How many orderings of ``n1`` and ``n2`` values give each U from 0 to n1*n2 (the
    coefficients of the Gaussian binomial): exact integers."""
    if n1 == 0 or n2 == 0:
        return (1,)
    # the largest value is the first sample's (it beats all n2: U is n2 more than without
    # it) or the second's (U as without it)
    fewer_first, fewer_second = frequencies(n1 - 1, n2), frequencies(n1, n2 - 1)
    counts = [0] * (n1 * n2 + 1)
    for k, count in enumerate(fewer_second):
        counts[k] += count
    for k, count in enumerate(fewer_first):
        counts[k + n2] += count
    return tuple(counts)
