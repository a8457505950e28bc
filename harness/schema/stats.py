"""Statistics of raw timing samples, shared by the timer and the readers of its records."""

from __future__ import annotations

import statistics


def quartiles(samples: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3) with the same interpolation as numpy's default."""
    if len(samples) == 1:
        return samples[0], samples[0], samples[0]
    q1, q2, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return q1, q2, q3
