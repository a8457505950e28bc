"""Statistics of raw timing samples, shared by the timer and the readers of its records."""

from __future__ import annotations

import math
import statistics

#: The normal quantile of a two-sided 95% interval.
Z95 = 1.96


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3) with the same interpolation as numpy's default."""
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    q1, q2, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, q2, q3


def quantile(ordered: list[float], p: float) -> float:
    """The ``p`` quantile of samples already sorted, interpolated as numpy's default (and
    :func:`quartiles`) does."""
    position = min(max(p, 0.0), 1.0) * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (position - below) * (ordered[above] - ordered[below])


def median_precision(samples: list[float]) -> float:
    """Half the width of the median's 95% confidence interval, over the median: how well
    the samples know their median. Distribution-free: the interval's ends are the sample
    quantiles at 0.5 -/+ Z95 / (2 sqrt(n)), the order statistics a binomial count of
    samples below the median puts there, interpolated (a wide-tailed or lopsided machine
    noise needs no model). Of samples drawn alike it shrinks as 1 / sqrt(n); of samples
    whose machine drifts or jumps between speeds, it does not."""
    ordered = sorted(samples)
    middle = quantile(ordered, 0.5)
    if middle <= 0:
        return math.inf
    reach = Z95 / (2 * math.sqrt(len(ordered)))
    return (quantile(ordered, 0.5 + reach) - quantile(ordered, 0.5 - reach)) / (2 * middle)
