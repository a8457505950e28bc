"""A case's error-vs-time picture (``harness.report.error_chart``, drawn by
``plots.error_vs_time``): an inline SVG with one path per row and marker, the fixes that
pass everywhere edged and named in the legend, log axes over the data, outside text inert,
and cells without a finite error and time left out."""

from __future__ import annotations

import math
import re

import pandas as pd

from harness.report import plots
from harness.report.error_chart import Axis, axis_for


def points(rows: list[str], envs: list[str], errors: list[float]) -> pd.DataFrame:
    """A point per (row, env), each row's fix its name before any `` [``."""
    cells = [(row, env) for row in rows for env in envs]
    return pd.DataFrame(
        {
            "row": [row for row, _ in cells],
            "fix": [row.split(" [")[0] for row, _ in cells],
            "env": [env for _, env in cells],
            "device": ["cpu"] * len(cells),
            "rel_err": [errors[i % len(errors)] for i in range(len(cells))],
            "median_s": [1e-3 * (i + 1) for i in range(len(cells))],
        }
    )


def series_paths(svg: str) -> list[str]:
    return re.findall(r'<path d="[^"]*" fill="#[0-9a-f]+" fill-opacity[^>]*>', svg)


def test_one_path_per_row_and_environment_and_the_passing_fix_edged_in_the_legend() -> None:
    frame = points(["none", "cast [sdpa]"], ["torch 2.4.1 · cpu", "torch 2.13.0 · cpu"], [1e-3])
    svg = plots.error_vs_time(frame, {"cast"})
    assert svg is not None and svg.startswith("<svg") and svg.endswith("</svg>")
    paths = series_paths(svg)
    assert len(paths) == 4  # 2 rows x 2 environments
    edged = [p for p in paths if 'stroke="#000"' in p]
    assert len(edged) == 2  # the passing fix's row, in both environments
    assert "cast [sdpa] (passes everywhere)" in svg and "none (passes everywhere)" not in svg
    assert svg.count("torch 2.4.1 · cpu") == 3  # its legend entry, each row's series there


def test_many_environments_get_a_marker_per_device() -> None:
    envs = [f"torch 2.{minor}.0 · cpu" for minor in range(11)]
    svg = plots.error_vs_time(points(["none"], envs, [1e-3, 2e-3]), set())
    assert svg is not None
    assert "device (11 environments)" in svg and len(series_paths(svg)) == 1


def test_cells_without_a_finite_error_and_time_are_left_out() -> None:
    frame = points(["none", "fp32"], ["torch 2.13.0 · cpu"], [math.inf, 2e-3])
    svg = plots.error_vs_time(frame, set())
    assert svg is not None and "1 point(s)" in svg and len(series_paths(svg)) == 1
    assert plots.error_vs_time(points(["none"], ["cpu"], [math.nan]), set()) is None
    assert plots.error_vs_time(points(["none"], ["cpu"], [0.0]), set()) is None


def test_outside_text_is_inert_in_the_picture() -> None:
    row = "<script>alert(1)</script>\x1b[2J\u202e"
    svg = plots.error_vs_time(points([row], ["torch 2.13.0 · <b>cpu</b>"], [1e-3]), set())
    assert svg is not None
    assert "<script>" not in svg and "<b>" not in svg and "\x1b" not in svg
    assert "\u202e" not in svg and "&lt;script&gt;" in svg


def test_an_axis_spans_its_values_with_a_margin_and_ticks_each_decade_within() -> None:
    axis = axis_for([1e-4, 1e-1], 0, 300)
    assert axis.low < 1e-4 and axis.high > 1e-1
    assert axis.at(1e-4) > 0 and axis.at(1e-1) < 300
    majors, minors = axis.ticks()
    assert majors == [1e-4, 1e-3, 1e-2, 1e-1]
    assert all(axis.low <= v <= axis.high for v in minors) and 2e-4 in minors
    single = axis_for([5e-3], 0, 100)  # one value: a tenth of a decade either side
    assert math.isclose(math.log10(single.high / single.low), 0.2)
    assert Axis(1, 100, 0, 100).at(10) == 50
