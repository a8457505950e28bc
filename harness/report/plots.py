"""Plots for the report, as inline SVG (strings, no matplotlib): a case's error vs time
(:mod:`harness.report.error_chart`) and a fit's loss curve. The error-vs-time pictures are
drawn in the report's drawing process (:class:`harness.report.drawing.Drawing`) while the
tables are built.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

from harness.report.error_chart import COLOURS, Series, error_chart

#: Each environment's (or device's) marker, matplotlib's letters for them.
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def error_vs_time(case_frame: pd.DataFrame, passing_everywhere: set[str]) -> str | None:
    """Error against the float64 reference vs median time, one colour per fix; fixes that
    pass everywhere are drawn with a black edge and marked in the legend: an inline SVG
    (:mod:`harness.report.error_chart`), None where no cell has both figures.

    Drawn once per case, one path per row and marker whatever the number of cells:
    environments get a marker each while they are few; beyond ``len(MARKERS)`` they are
    grouped by device, so the legend stays one entry per fix and one per marker."""
    points = plotted(case_frame)
    by, title = marker_groups(points)
    # a point drawn twice in the same place and marker shows nothing more
    points = points.drop_duplicates(["row", by, "median_s", "rel_err"])
    if points.empty:
        return None
    rows = sorted(points["row"].unique())
    colours = {str(row): COLOURS[i % len(COLOURS)] for i, row in enumerate(rows)}
    # the rows of a fix that passes everywhere (a row is its fix, backend, size and stage)
    fixes = zip(points["row"], points["fix"], strict=True)
    edged = {str(row) for row, fix in fixes if fix in passing_everywhere}
    groups = sorted(points[by].unique())
    markers = {str(group): MARKERS[i % len(MARKERS)] for i, group in enumerate(groups)}
    return error_chart(series_of(points, by), markers, colours, edged, title)


def series_of(points: pd.DataFrame, by: str) -> list[Series]:
    """The points per row and marker group, in that order: (time in ms, error) each."""
    found: dict[tuple[str, str], list[tuple[float, float]]] = {}
    columns = (points["row"], points[by], points["median_s"], points["rel_err"])
    for row, group, seconds, error in zip(*(c.tolist() for c in columns), strict=True):
        found.setdefault((str(row), str(group)), []).append((seconds * 1e3, error))
    return [Series(row, group, found[row, group]) for row, group in sorted(found)]


#: The columns of a case's frame that its plot draws.
PLOTTED = ["row", "fix", "env", "device", "rel_err", "median_s"]


def plotted(case_frame: pd.DataFrame) -> pd.DataFrame:
    """The cells a plot shows (those with a finite error above zero and a finite time),
    and only the columns it reads: what is sent to the drawing process. A non-finite
    error (a cell whose output overflowed) has no place on a log axis: its cell's table
    row says it."""
    has_both = case_frame["rel_err"].notna() & case_frame["median_s"].notna()
    points = case_frame.loc[has_both, PLOTTED]
    errors, times = points["rel_err"].astype(float), points["median_s"].astype(float)
    return points[(errors > 0) & np.isfinite(errors) & (times > 0) & np.isfinite(times)]


Job = tuple[pd.DataFrame, set[str]]


def marker_groups(points: pd.DataFrame) -> tuple[str, str]:
    """The column whose values get a marker each, and the legend's title for it."""
    envs = points["env"].nunique()
    if envs <= len(MARKERS):
        return "env", "environment"
    return "device", f"device ({envs} environments)"


#: The size of a fit's loss curve in the report (CSS pixels) and its margin.
SPARK_WIDTH, SPARK_HEIGHT, SPARK_PAD = 140, 34, 2


def loss_sparkline(losses: Sequence[float], reference: Sequence[float], passes: bool) -> str:
    """A fit's loss per step against the float64 fit's, as a small inline SVG (a string,
    no matplotlib: one per fit cell costs microseconds). The float64 fit is dashed grey,
    the cell's green where it passes and purple where it does not; where its loss stops
    being finite the curve ends in a red cross. Built from numbers only."""
    finite = [v for v in (*losses, *reference) if math.isfinite(v)]
    steps = max(len(losses), len(reference)) - 1
    if not finite or not losses or not reference or steps < 1:
        return ""
    low, high = min(finite), max(finite)
    span = (high - low) or 1.0

    def point(step: int, value: float) -> tuple[float, float]:
        x = SPARK_PAD + step / steps * (SPARK_WIDTH - 2 * SPARK_PAD)
        if high == low:  # a flat curve, drawn across the middle
            return x, SPARK_HEIGHT / 2
        return x, SPARK_PAD + (high - value) / span * (SPARK_HEIGHT - 2 * SPARK_PAD)

    def polyline(values: Sequence[float], style: str) -> str:
        shown = list(itertools.takewhile(math.isfinite, values))
        coords = " ".join(
            f"{x:.1f},{y:.1f}" for x, y in (point(i, v) for i, v in enumerate(shown))
        )
        return f'<polyline points="{coords}" fill="none" {style}/>' if len(shown) > 1 else ""

    colour = "#2e7d32" if passes else "#7b1fa2"
    parts = [
        polyline(reference, 'stroke="#888" stroke-width="1.2" stroke-dasharray="3 2"'),
        polyline(losses, f'stroke="{colour}" stroke-width="1.6"'),
    ]
    broken = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
    if broken is not None:
        x = point(broken, low)[0]
        parts.append(
            f'<path d="M{x - 3:.1f},{SPARK_HEIGHT / 2 - 3:.1f}l6,6m0,-6l-6,6" '
            'stroke="#c00" stroke-width="1.6"/>'
        )
    title = (
        f"loss over {steps} steps: {_loss(losses[0])} to {_loss(losses[-1])}; "
        f"float64 fit (dashed): {_loss(reference[0])} to {_loss(reference[-1])}"
    )
    return (
        f'<svg class="spark" width="{SPARK_WIDTH}" height="{SPARK_HEIGHT}" '
        f'viewBox="0 0 {SPARK_WIDTH} {SPARK_HEIGHT}" role="img" aria-label="{title}">'
        f"<title>{title}</title>{''.join(parts)}</svg>"
    )


def _loss(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else "not finite"
