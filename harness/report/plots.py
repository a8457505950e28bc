"""Plots for the report (matplotlib, Agg), returned as inline ``data:`` PNG URIs.

matplotlib is imported when a plot is drawn (half a second): a report with no timed cell
never imports it.
"""

from __future__ import annotations

import base64
import io
from typing import TYPE_CHECKING

import pandas as pd

if TYPE_CHECKING:
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
    points = case_frame.dropna(subset=["rel_err", "median_s"])
    points = points[points["rel_err"] > 0]
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
    groups = sorted(points[by].unique())
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
            markeredgecolor="black" if _fix_of(str(row)) in passing_everywhere else colour,
        )
    axes.set(
        xscale="log",
        yscale="log",
        xlabel="median time per call (ms)",
        ylabel="relative error vs float64",
    )
    axes.grid(True, which="both", alpha=0.25)
    axes.xaxis.set_major_formatter(ScalarFormatter())
    axes.xaxis.set_minor_formatter(ScalarFormatter())
    _legends(figure, colours, groups, title, passing_everywhere)
    return to_data_uri(figure)


def marker_groups(points: pd.DataFrame) -> tuple[str, str]:
    """The column whose values get a marker each, and the legend's title for it."""
    envs = points["env"].nunique()
    if envs <= len(MARKERS):
        return "env", "environment"
    return "device", f"device ({envs} environments)"


def _fix_of(row: str) -> str:
    """The fix of a row label (``fix [backend] @size``)."""
    return row.split(" [")[0].split(" @")[0]


def _legends(
    figure: Figure,
    colours: dict[str, Colour],
    groups: list[str],
    title: str,
    passing_everywhere: set[str],
) -> None:
    from matplotlib.lines import Line2D

    fix_handles = [
        Line2D(
            [],
            [],
            marker="o",
            linestyle="",
            color=colour,
            markeredgecolor="black" if _fix_of(row) in passing_everywhere else colour,
            label=row + (" (passes everywhere)" if _fix_of(row) in passing_everywhere else ""),
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
