"""A case's error against the float64 reference vs its median time, as an inline SVG (a
string: no matplotlib, no script), the picture :func:`harness.report.plots.error_vs_time`
draws once per case and size.

Both axes logarithmic, a grid line per decade and fainter ones between; one colour per
row (a fix, its backend, size and stage), one marker per environment while they are few
(per device beyond :data:`MARKERS`' count, as :func:`~harness.report.plots.marker_groups`
says); a row whose fix passes everywhere drawn with a black edge and marked in the legend.
Each row and marker is one path of all its points, so a picture of thousands of points stays
one element per series; hovering a series names its row and environment.

Drawn in milliseconds where matplotlib took a second a picture (its constrained layout and
tick labels), which was most of a report's time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

from harness.schema.text import terminal_safe

#: The picture's height (CSS pixels) at least, the plot area's width, and its margins: the
#: y axis's labels on the left, the x axis's below, the legends on the right.
HEIGHT, PLOT_WIDTH = 400, 640
LEFT, TOP, BOTTOM, GAP = 64, 10, 44, 18
#: A legend's line height, and the width of a character of its text (11px, about).
LINE, CHAR = 16, 6.3
#: One colour a row: matplotlib's tab10, as the report's other pictures.
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")  # fmt: skip
#: A share of the span of the data left free at each end of an axis (matplotlib's margin).
MARGIN = 0.05
#: Beyond this many points, markers are smaller and more transparent.
DENSE = 400


@dataclass(frozen=True)
class Series:
    """The points of one row in one marker group: (time in ms, relative error) each."""

    row: str
    group: str
    points: Sequence[tuple[float, float]]


@dataclass(frozen=True)
class Axis:
    """A logarithmic axis over ``low``..``high`` drawn from ``start`` to ``end`` pixels."""

    low: float
    high: float
    start: float
    end: float

    def at(self, value: float) -> float:
        share = (math.log10(value) - math.log10(self.low)) / (
            math.log10(self.high) - math.log10(self.low)
        )
        return self.start + share * (self.end - self.start)

    def ticks(self) -> tuple[list[float], list[float]]:
        """The decades within the axis, and the 2..9 multiples between them."""
        first, last = math.floor(math.log10(self.low)), math.ceil(math.log10(self.high))
        majors, minors = [], []
        for exponent in range(first, last + 1):
            decade = 10.0**exponent
            if self.low <= decade <= self.high:
                majors.append(decade)
            minors += [m * decade for m in range(2, 10) if self.low <= m * decade <= self.high]
        return majors, minors


def axis_for(values: Sequence[float], start: float, end: float) -> Axis:
    """An axis over ``values`` with :data:`MARGIN` of their span (in decades) at each end;
    at least a tenth of a decade either side of a single value."""
    low, high = math.log10(min(values)), math.log10(max(values))
    pad = max((high - low) * MARGIN, 0.1 if high == low else 0.0)
    return Axis(10 ** (low - pad), 10 ** (high + pad), start, end)


def marker_path(marker: str, x: float, y: float, r: float) -> str:
    """One marker (matplotlib's letter for it) centred on (x, y), ``r`` its half-size, as a
    closed subpath."""
    if marker == "o":
        arc = f"a{r:.1f},{r:.1f} 0 1,0"
        return f"M{x - r:.1f},{y:.1f}{arc} {2 * r:.1f},0{arc} {-2 * r:.1f},0z"
    corners = [(x + dx * r, y + dy * r) for dx, dy in SHAPES[marker]]
    return "M" + "L".join(f"{cx:.1f},{cy:.1f}" for cx, cy in corners) + "z"


#: Each polygonal marker's corners, in units of its half-size (y down).
SHAPES: dict[str, tuple[tuple[float, float], ...]] = {
    "s": ((-0.85, -0.85), (0.85, -0.85), (0.85, 0.85), (-0.85, 0.85)),
    "^": ((0, -1.1), (1, 0.75), (-1, 0.75)),
    "v": ((0, 1.1), (1, -0.75), (-1, -0.75)),
    "<": ((-1.1, 0), (0.75, -1), (0.75, 1)),
    ">": ((1.1, 0), (-0.75, -1), (-0.75, 1)),
    "D": ((0, -1.1), (0.8, 0), (0, 1.1), (-0.8, 0)),
    "P": ((-0.33, -1), (0.33, -1), (0.33, -0.33), (1, -0.33), (1, 0.33), (0.33, 0.33),
          (0.33, 1), (-0.33, 1), (-0.33, 0.33), (-1, 0.33), (-1, -0.33), (-0.33, -0.33)),
    "X": ((-0.7, -1), (0, -0.3), (0.7, -1), (1, -0.7), (0.3, 0), (1, 0.7), (0.7, 1),
          (0, 0.3), (-0.7, 1), (-1, 0.7), (-0.3, 0), (-1, -0.7)),
    "*": tuple(
        (math.sin(k * math.pi / 5) * (1.15 if k % 2 == 0 else 0.48),
         -math.cos(k * math.pi / 5) * (1.15 if k % 2 == 0 else 0.48))
        for k in range(10)
    ),
}  # fmt: skip


def shown(text: str) -> str:
    """Outside text (a fix's, an environment's name) as the picture shows it: its control
    characters escaped as a terminal shows them, then its markup escaped."""
    return escape(terminal_safe(text))


def tick_text(value: float) -> str:
    """``0.5``, ``20``, ``1e-05``: a tick's value as short as it reads."""
    return f"{value:g}"


def power_text(value: float) -> str:
    """A decade as ``10`` with its exponent raised: ``10⁻³`` in SVG."""
    exponent = round(math.log10(value))
    return f'10<tspan dy="-5" font-size="8">{exponent}</tspan>'


def x_axis(axis: Axis, top: float, bottom: float) -> list[str]:
    """Grid lines across the plot and labels below it: every decade, and the 2..9
    multiples too where the axis spans two decades or less (fewer would crowd)."""
    majors, minors = axis.ticks()
    few = math.log10(axis.high / axis.low) <= 2
    labelled = [*majors, *(v for v in minors if few and str(v)[0] in "235")]
    parts = [grid(axis.at(v), top, axis.at(v), bottom, major=False) for v in minors]
    parts += [grid(axis.at(v), top, axis.at(v), bottom, major=True) for v in majors]
    parts += [
        f'<text x="{axis.at(v):.1f}" y="{bottom + 14}" text-anchor="middle">{tick_text(v)}</text>'
        for v in labelled
    ]
    return parts


def y_axis(axis: Axis, left: float, right: float) -> list[str]:
    """Grid lines across the plot and a label per decade on its left."""
    majors, minors = axis.ticks()
    parts = [grid(left, axis.at(v), right, axis.at(v), major=False) for v in minors]
    parts += [grid(left, axis.at(v), right, axis.at(v), major=True) for v in majors]
    parts += [
        f'<text x="{left - 5}" y="{axis.at(v) + 4:.1f}" text-anchor="end">{power_text(v)}</text>'
        for v in majors
    ]
    return parts


def grid(x1: float, y1: float, x2: float, y2: float, major: bool) -> str:
    colour = "#d9d9d9" if major else "#eeeeee"
    return f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" stroke="{colour}"/>'


def series_path(
    series: Series, x: Axis, y: Axis, marker: str, colour: str, edged: bool, dense: bool
) -> str:
    """One series' points as one path of markers, named by its row and group on hover."""
    r = 2.6 if dense else 4.6
    d = "".join(marker_path(marker, x.at(t), y.at(e), r) for t, e in series.points)
    opacity = 0.5 if dense else 0.85
    edge = "#000" if edged else colour
    return (
        f'<path d="{d}" fill="{colour}" fill-opacity="{opacity}" stroke="{edge}" '
        f'stroke-opacity="{opacity}" stroke-width="1"><title>{shown(series.row)} · '
        f"{shown(series.group)}: {len(series.points)} cell(s)</title></path>"
    )


def legend(
    title: str, entries: Sequence[tuple[str, str, str, str]], x: float, y: float
) -> list[str]:
    """A legend's title and one marker and label per entry: (label, marker, fill, edge)."""
    parts = [f'<text x="{x}" y="{y}" font-weight="600">{shown(title)}</text>']
    for i, (label, marker, fill, edge) in enumerate(entries):
        top = y + (i + 1) * LINE
        parts.append(
            f'<path d="{marker_path(marker, x + 6, top - 4, 4.6)}" fill="{fill}" '
            f'stroke="{edge}"/><text x="{x + 16}" y="{top}">{shown(label)}</text>'
        )
    return parts


def error_chart(
    series: Sequence[Series],
    markers: dict[str, str],
    colours: dict[str, str],
    edged: set[str],
    group_title: str,
) -> str:
    """The picture of ``series`` (each row's points per marker group): ``markers`` gives
    each group's marker, ``colours`` each row's colour (in the legend's order), ``edged``
    the rows whose fix passes everywhere, ``group_title`` the groups' legend's title."""
    times = [t for s in series for t, _ in s.points]
    errors = [e for s in series for _, e in s.points]
    fixes = [(row + (" (passes everywhere)" if row in edged else ""), row) for row in colours]
    legend_width = max(
        CHAR * len(text) for text in [group_title, *markers, *(f for f, _ in fixes)]
    )
    width = round(LEFT + PLOT_WIDTH + GAP + 16 + legend_width + 8)
    fix_lines, group_lines = len(fixes) + 1, len(markers) + 1
    height = max(HEIGHT, TOP + (fix_lines + group_lines) * LINE + 3 * LINE)
    right, bottom = LEFT + PLOT_WIDTH, height - BOTTOM
    x, y = axis_for(times, LEFT, right), axis_for(errors, bottom, TOP)
    dense = len(times) > DENSE
    parts = [
        f'<rect x="{LEFT}" y="{TOP}" width="{PLOT_WIDTH}" height="{bottom - TOP}" fill="#fff"/>',
        *x_axis(x, TOP, bottom),
        *y_axis(y, LEFT, right),
        f'<rect x="{LEFT}" y="{TOP}" width="{PLOT_WIDTH}" height="{bottom - TOP}" fill="none" '
        'stroke="#333"/>',
        *(
            series_path(s, x, y, markers[s.group], colours[s.row], s.row in edged, dense)
            for s in series
        ),
        f'<text x="{(LEFT + right) / 2:.0f}" y="{height - 10}" text-anchor="middle" '
        'font-size="12">median time per call (ms)</text>',
        f'<text transform="translate(16 {(TOP + bottom) / 2:.0f}) rotate(-90)" '
        'text-anchor="middle" font-size="12">relative error vs float64</text>',
    ]
    legend_x = right + GAP
    parts += legend(
        "fix",
        [
            (label, "o", colours[row], "#000" if row in edged else colours[row])
            for label, row in fixes
        ],
        legend_x,
        TOP + 12,
    )
    groups_top = height - BOTTOM - group_lines * LINE + 12
    parts += legend(
        group_title,
        [(group, marker, "#808080", "#808080") for group, marker in markers.items()],
        legend_x,
        max(groups_top, TOP + 12 + (fix_lines + 1) * LINE),
    )
    title = (
        f"relative error vs float64 against median time per call, {len(times)} point(s) of "
        f"{len(colours)} row(s)"
    )
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="error-time" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" font-family="system-ui, sans-serif" '
        f'font-size="11" fill="#222" role="img" aria-label="{escape(title)}">'
        f"<title>{escape(title)}</title>{''.join(parts)}</svg>"
    )
