"""Plots for the report (matplotlib, Agg), returned as inline ``data:`` PNG URIs."""

from __future__ import annotations

import base64
import io

import matplotlib
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import ScalarFormatter

Colour = tuple[float, float, float]
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")


def to_data_uri(figure: Figure) -> str:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=96, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def error_vs_time(case_frame: pd.DataFrame, passing_everywhere: set[str]) -> str | None:
    """Error against the float64 reference vs median time, one colour per fix and one
    marker per environment; fixes that pass everywhere are drawn bold in the legend."""
    points = case_frame.dropna(subset=["rel_err", "median_s"])
    points = points[points["rel_err"] > 0]
    if points.empty:
        return None
    figure = Figure(figsize=(10, 4.2), layout="constrained")
    axes = figure.subplots()
    palette = matplotlib.colormaps["tab10"].colors  # type: ignore[attr-defined]
    colours: dict[str, Colour] = dict(zip(sorted(points["row"].unique()), palette, strict=False))
    envs = sorted(points["env"].unique())
    for (row, env), group in points.groupby(["row", "env"]):
        axes.scatter(
            group["median_s"] * 1e3,
            group["rel_err"],
            color=colours.get(row, "grey"),
            marker=MARKERS[envs.index(env) % len(MARKERS)],
            s=46,
            alpha=0.85,
            edgecolors="black" if _fix_of(row) in passing_everywhere else "none",
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
    _legends(figure, colours, envs, passing_everywhere)
    return to_data_uri(figure)


def _fix_of(row: str) -> str:
    return row.split(" [")[0]


def _legends(
    figure: Figure, colours: dict[str, Colour], envs: list[str], passing_everywhere: set[str]
) -> None:
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
        Line2D([], [], marker=MARKERS[i % len(MARKERS)], linestyle="", color="grey", label=env)
        for i, env in enumerate(envs)
    ]
    figure.legend(
        handles=fix_handles, loc="outside right upper", fontsize=8, title="fix", title_fontsize=8
    )
    figure.legend(
        handles=env_handles,
        loc="outside right lower",
        fontsize=8,
        title="environment",
        title_fontsize=8,
    )
