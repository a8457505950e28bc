"""Plots for the report (matplotlib, Agg), returned as inline ``data:`` PNG URIs.

matplotlib is imported when a plot is drawn (a quarter to half a second), in the report's
drawing process (:class:`harness.report.drawing.Drawing`), which imports it while the
report reads its runs and builds its tables.
"""

from __future__ import annotations

import base64
import io
import itertools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

Colour = tuple[float, float, float]
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def to_data_uri(figure: Figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=96)  # constrained layout already fits it
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def error_vs_time(case_frame: pd.DataFrame, passing_everywhere: set[str]) -> str | None:
    """Error against the float64 reference vs median time, one colour per fix; fixes that
    pass everywhere are drawn with a black edge and marked in the legend.

    Drawn once per case, with a bounded number of scatter calls whatever the number of
    cells: environments get a marker each while they are few; beyond ``len(MARKERS)`` they
    are grouped by device, so the legend stays one entry per fix and one per marker."""
    points = plotted(case_frame)
    by, title = marker_groups(points)
    # a point drawn twice in the same place and marker shows nothing more
    points = points.drop_duplicates(["row", by, "median_s", "rel_err"])
    if points.empty:
        return None
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    figure = Figure(figsize=(10, 4.2), layout="constrained")
    axes = figure.subplots()
    palette = matplotlib.colormaps["tab10"].colors  # type: ignore[attr-defined]
    colours: dict[str, Colour] = dict(zip(sorted(points["row"].unique()), palette, strict=False))
    # the rows of a fix that passes everywhere (a row is its fix, backend, size and stage)
    fixes = zip(points["row"], points["fix"], strict=True)
    edged = {str(row) for row, fix in fixes if fix in passing_everywhere}
    groups = sorted(points[by].unique())
    _draw_points(axes, points, by, colours, groups, edged)
    axes.set(
        xscale="log",
        yscale="log",
        xlabel="median time per call (ms)",
        ylabel="relative error vs float64",
    )
    axes.grid(True, which="both", alpha=0.25)
    axes.xaxis.set_major_formatter(ScalarFormatter())
    axes.xaxis.set_minor_formatter(ScalarFormatter())
    _legends(figure, colours, groups, title, edged)
    return to_data_uri(figure)


def _draw_points(
    axes: Axes,
    points: pd.DataFrame,
    by: str,
    colours: dict[str, Colour],
    groups: list[str],
    edged: set[str],
) -> None:
    """One marker per group of ``by``, one colour per row, a black edge for ``edged`` rows."""
    dense = len(points) > 400
    for (row, group_name), group in points.groupby(["row", by]):
        colour = colours.get(str(row), "grey")
        # markers on a line with no line: Agg stamps one marker, where a scatter draws
        # every point as a path of its own (seconds over 100,000 points)
        axes.plot(
            group["median_s"] * 1e3,
            group["rel_err"],
            linestyle="",
            color=colour,
            marker=MARKERS[groups.index(group_name) % len(MARKERS)],
            markersize=3.7 if dense else 6.8,
            alpha=0.5 if dense else 0.85,
            markeredgecolor="black" if str(row) in edged else colour,
        )


#: The columns of a case's frame that its plot draws.
PLOTTED = ["row", "fix", "env", "device", "rel_err", "median_s"]


def plotted(case_frame: pd.DataFrame) -> pd.DataFrame:
    """The cells a plot shows (those with an error above zero and a time), and only the
    columns it reads: what is sent to the drawing process."""
    has_both = case_frame["rel_err"].notna() & case_frame["median_s"].notna()
    points = case_frame.loc[has_both, PLOTTED]
    return points[points["rel_err"] > 0]


Job = tuple[pd.DataFrame, set[str]]


def warm_up() -> None:
    """Import what drawing a figure needs (a quarter to half a second), ahead of the jobs."""
    import matplotlib.figure
    import matplotlib.ticker  # noqa: F401


def marker_groups(points: pd.DataFrame) -> tuple[str, str]:
    """The column whose values get a marker each, and the legend's title for it."""
    envs = points["env"].nunique()
    if envs <= len(MARKERS):
        return "env", "environment"
    return "device", f"device ({envs} environments)"


def _legends(
    figure: Figure,
    colours: dict[str, Colour],
    groups: list[str],
    title: str,
    edged: set[str],
) -> None:
    from matplotlib.lines import Line2D

    fix_handles = [
        Line2D(
            [],
            [],
            marker="o",
            linestyle="",
            color=colour,
            markeredgecolor="black" if row in edged else colour,
            label=row + (" (passes everywhere)" if row in edged else ""),
        )
        for row, colour in colours.items()
    ]
    env_handles = [
        Line2D([], [], marker=MARKERS[i % len(MARKERS)], linestyle="", color="grey", label=name)
        for i, name in enumerate(groups)
    ]
    figure.legend(
        handles=fix_handles, loc="outside right upper", fontsize=8, title="fix", title_fontsize=8
    )
    figure.legend(
        handles=env_handles,
        loc="outside right lower",
        fontsize=8,
        title=title,
        title_fontsize=8,
    )


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
