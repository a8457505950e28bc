"""The fit stage's rule, where measuring and reporting both read it (no torch): where a fit's
last loss ends beside the same fix's float64 fit, by which scale it is judged, and the
sentence that says so (:mod:`harness.measure.running.fitting` runs the fit and judges it;
the report says why a fit stalled in the same words)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from harness.schema.records import FitFigures

#: A fit stalls where its last loss ends beyond the float64 fit's last by more than the
#: smaller of two allowances: ``SHORTFALL_LIMIT`` of the float64 fit's progress (first
#: loss minus last), which judges a slow fit, and ``EXCESS_LIMIT`` of its last loss, which
#: judges a fit that went far (6.02 to 0.0105: a fit ending at 0.0483 is 0.6% short of
#: that progress, and 4.6 times the loss). Calibrated in ``benchmarks/bench_fit.py``
#: (``nox -s verdicts``; the table is in ``docs/tolerance.md``, "The fit stage's limits,
#: calibrated"; CPU, torch 2.13.0, 20 steps): healthy fits end at most 11% of their progress
#: short and 40% beyond the last loss (bfloat16 autocast near a small float64 loss, its
#: compute rounding), stalled ones at least 63% short or 2.6 times beyond.
SHORTFALL_LIMIT = 0.5
EXCESS_LIMIT = 1.0
#: A scale below this share of the float64 fit's first loss is too small to judge a last
#: loss by: a fit with neither scale is judged by its finiteness alone.
MIN_PROGRESS = 1e-6


def shortfall(last: float, reference: tuple[float, ...]) -> float | None:
    """How far ``last`` ends beyond the float64 fit's last loss, as a share of the scale it
    is judged by (:func:`end_scale`: the float64 fit's progress or its last loss): 0 at or
    below the float64 fit's last loss; of its progress, 1 where a fit made none of it; of
    its last loss, 1 where a fit ended at twice it; inf where ``last`` is not finite; None
    where neither scale is there to judge by."""
    scale = end_scale(reference)
    if scale is None:
        return None
    if not math.isfinite(last):
        return math.inf
    return max(0.0, (last - reference[-1]) / scale.size)


@dataclass(frozen=True)
class EndScale:
    """What a fit's last loss is judged by: a scale of the float64 fit, its name, and how
    far beyond the float64 fit's last loss, as a share of it, a fit may end."""

    size: float
    name: str
    limit: float


#: The names of the two scales a last loss is judged by (see :func:`end_scale`).
PROGRESS, LAST_LOSS = "progress", "last loss"


def end_scale(reference: tuple[float, ...]) -> EndScale | None:
    """The scale whose allowance is the smaller: the float64 fit's progress (with
    ``SHORTFALL_LIMIT``) or the size of its last loss (with ``EXCESS_LIMIT``), each where
    it is above ``MIN_PROGRESS`` of the first loss; None where neither is."""
    first, last = reference[0], reference[-1]
    floor = MIN_PROGRESS * abs(first)
    scales = (
        EndScale(first - last, PROGRESS, SHORTFALL_LIMIT),
        EndScale(abs(last), LAST_LOSS, EXCESS_LIMIT),
    )
    usable = [s for s in scales if s.size > floor]
    return min(usable, key=lambda s: s.size * s.limit) if usable else None  # progress on a tie


def where_it_ends(figures: FitFigures) -> str:
    """The last loss beside the float64 fit's, by the scale it is judged by:
    ``its loss ends at 0.0483, 4.6x the float64 fit's 0.0105`` or ``..., 63% short of the
    float64 fit's progress (1.158 to 1.092)``."""
    last, reference = figures.losses[-1], figures.reference_losses
    scale = end_scale(reference)
    if scale is not None and scale.name == LAST_LOSS and reference[-1] > 0:
        return (
            f"its loss ends at {last:.4g}, {last / reference[-1]:.2g}x the float64 fit's "
            f"{reference[-1]:.4g}"
        )
    return (
        f"its loss ends at {last:.4g}, {figures.shortfall:.0%} short of the float64 fit's "
        f"progress ({reference[0]:.4g} to {reference[-1]:.4g})"
    )
