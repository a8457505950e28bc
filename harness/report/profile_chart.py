"""The divergence profile's picture: each module's error over its rounding's along the
depth of the model, as an inline SVG (a string: no matplotlib, no script), one per failing
cell's column and direction (forward, backward), the fixes profiled there overlaid.

Module index on x, in the order the pass met them; the ratio on a log y axis; the factor a
dashed horizontal line; each fix's first module beyond it (its divergence: the first ratio
over the factor, or the first non-finite one) marked and labelled with its path, so a fix
that moves the crossing is seen to move it. A module whose output went non-finite is a
triangle at the top edge; one that could not be measured (NaN) leaves a gap. Built for a
model of 500 modules: one polyline a fix, and marks only where they say something.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.schema.divergence import ModuleRatio

#: The picture's size (CSS pixels) and its margins: the y axis's labels on the left, the
#: x axis's below, the legend above.
WIDTH, HEIGHT = 760, 280
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 40, 40
#: One colour a fix (matplotlib's tab10, as the report's other plots).
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
           "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")  # fmt: skip
#: The y axis spans at least these ratios: a healthy model's reads about 1.
LOWEST, HIGHEST = 0.1, 100.0
#: A module path in a crossing's label is cut to this many characters (the whole path is
#: in its tooltip).
LABEL_CHARS = 48


@dataclass(frozen=True)
class ProfileLine:
    """One fix's series in a picture: its row label (``none``, ``two-pass [sdpa]``) and
    each module's ratio, in the order the pass met them."""

    row: str
    ratios: Sequence[ModuleRatio]

    def crossing(self, factor: float) -> int | None:
        """The index of the first module beyond ``factor`` (over it, or non-finite), as
        the record's divergence names it; None where none is."""
        return next(
            (i for i, m in enumerate(self.ratios) if math.isinf(m.ratio) or m.ratio > factor),
            None,
        )


@dataclass(frozen=True)
class Scale:
    """Where an index and a ratio are drawn: x over ``count`` modules, y over the decades
    from ``low`` to ``high``."""

    count: int
    low: float
    high: float

    def x(self, index: int) -> float:
        span = WIDTH - LEFT - RIGHT
        return LEFT + (index / (self.count - 1) * span if self.count > 1 else span / 2)

    def y(self, ratio: float) -> float:
        """A ratio's height; 0 and what is below the axis at its bottom, inf at its top."""
        if math.isinf(ratio):
            return TOP
        shown = min(max(ratio, self.low), self.high)
        share = (math.log10(shown) - math.log10(self.low)) / (
            math.log10(self.high) - math.log10(self.low)
        )
        return HEIGHT - BOTTOM - share * (HEIGHT - TOP - BOTTOM)


def scale_for(lines: Sequence[ProfileLine], factor: float) -> Scale:
    """Whole decades around every finite ratio above zero and the factor, at least
    :data:`LOWEST` to :data:`HIGHEST`."""
    finite = [
        m.ratio for line in lines for m in line.ratios if math.isfinite(m.ratio) and m.ratio > 0
    ]
    low = min([LOWEST, factor, *finite])
    high = max([HIGHEST, factor * 10, *finite])
    return Scale(
        max(len(line.ratios) for line in lines),
        10.0 ** math.floor(math.log10(low)),
        10.0 ** math.ceil(math.log10(high)),
    )


def profile_chart(lines: Sequence[ProfileLine], factor: float, direction: str = "forward") -> str:
    """The picture of ``lines`` (fixes profiled in one column) held to ``factor``, in
    ``direction`` (``forward``: modules in the order they returned; ``backward``: in the
    order backward reached them); ``""`` where no line has a module."""
    lines = [line for line in lines if line.ratios]
    if not lines:
        return ""
    scale = scale_for(lines, factor)
    parts = [*axes(scale, direction), factor_line(scale, factor)]
    for number, line in enumerate(lines):
        colour = COLOURS[number % len(COLOURS)]
        parts += series(line, scale, colour)
        parts += crossing_mark(line, factor, scale, colour, number)
    parts += legend(lines)
    title = chart_title(lines, factor, direction)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" class="profile" width="{WIDTH}" '
        f'height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="system-ui, sans-serif" '
        f'role="img" aria-label="{escape(title)}" data-direction="{escape(direction)}">'
        f"<title>{escape(title)}</title>{''.join(parts)}</svg>"
    )


def chart_title(lines: Sequence[ProfileLine], factor: float, direction: str) -> str:
    """What the picture says in words: per fix, its first module beyond the factor."""
    said = []
    for line in lines:
        index = line.crossing(factor)
        where = (
            f"first beyond at module {index}, {line.ratios[index].module or 'the model'}"
            if index is not None
            else "no module beyond"
        )
        said.append(f"{line.row}: {where}")
    return (
        f"{direction}: each module's error over its rounding's, against the factor "
        f"{factor:g}; " + "; ".join(said)
    )


def decades(scale: Scale) -> list[float]:
    first, last = round(math.log10(scale.low)), round(math.log10(scale.high))
    step = max(1, math.ceil((last - first) / 8))  # at most about 8 labels
    return [10.0**k for k in range(first, last + 1, step)]


def ratio_text(value: float) -> str:
    return f"{value:g}" if 1e-3 <= value <= 1e4 else f"1e{round(math.log10(value))}"


def axes(scale: Scale, direction: str) -> list[str]:
    """The frame, a grid line and label per decade, and the axes' names."""
    bottom, right = HEIGHT - BOTTOM, WIDTH - RIGHT
    parts = [
        f'<rect x="{LEFT}" y="{TOP}" width="{right - LEFT}" height="{bottom - TOP}" '
        'fill="#fafafa" stroke="#bbb"/>'
    ]
    for value in decades(scale):
        y = scale.y(value)
        parts.append(
            f'<line class="decade" x1="{LEFT}" x2="{right}" y1="{y:.1f}" y2="{y:.1f}" '
            'stroke="#e2e2e2"/>'
            f'<text class="tick" x="{LEFT - 4}" y="{y + 3.5:.1f}" text-anchor="end" '
            f'font-size="10" fill="#555">{ratio_text(value)}</text>'
        )
    last = scale.count - 1
    for index in sorted({0, last // 4, last // 2, 3 * last // 4, last}):
        x = scale.x(index)
        parts.append(
            f'<text x="{x:.1f}" y="{bottom + 13}" text-anchor="middle" font-size="10" '
            f'fill="#555">{index}</text>'
        )
    order = "returned in forward" if direction == "forward" else "backward reached them"
    parts.append(
        f'<text x="{(LEFT + right) / 2:.0f}" y="{HEIGHT - 8}" text-anchor="middle" '
        f'font-size="11" fill="#333">module, in the order {order} ({scale.count})</text>'
        f'<text transform="translate(13 {(TOP + bottom) / 2:.0f}) rotate(-90)" '
        'text-anchor="middle" font-size="11" fill="#333">error / rounding</text>'
    )
    return parts


def factor_line(scale: Scale, factor: float) -> str:
    y = scale.y(factor)
    return (
        f'<line class="factor" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" '
        'stroke="#c00" stroke-width="1.2" stroke-dasharray="6 3"/>'
        f'<text x="{WIDTH - RIGHT - 4}" y="{y - 4:.1f}" text-anchor="end" font-size="10" '
        f'fill="#c00">factor {factor:g}</text>'
    )


def series(line: ProfileLine, scale: Scale, colour: str) -> list[str]:
    """The fix's ratios as polylines (a NaN, not measured, breaks the line), and a
    triangle at the top edge per module whose output went non-finite."""
    runs: list[list[str]] = [[]]
    tops = []
    for index, module in enumerate(line.ratios):
        if math.isnan(module.ratio):
            runs.append([])
            continue
        runs[-1].append(f"{scale.x(index):.1f},{scale.y(module.ratio):.1f}")
        if math.isinf(module.ratio):
            tops.append(index)
    parts = [
        f'<polyline class="ratios" data-row="{escape(line.row)}" points="{" ".join(run)}" '
        f'fill="none" stroke="{colour}" stroke-width="1.3" stroke-linejoin="round"/>'
        for run in runs
        if len(run) > 1
    ]
    parts += [
        f'<path class="non-finite" d="M{scale.x(i) - 4:.1f},{TOP - 7}h8l-4,7z" fill="{colour}">'
        f"<title>{escape(line.ratios[i].module or 'the model')}: non-finite</title></path>"
        for i in tops
    ]
    return parts


def crossing_mark(
    line: ProfileLine, factor: float, scale: Scale, colour: str, number: int
) -> list[str]:
    """The fix's first module beyond the factor: a ring on it, a dotted drop to the axis,
    and its path written beside it (staggered per fix, so overlaid fixes stay legible)."""
    index = line.crossing(factor)
    if index is None:
        return []
    module = line.ratios[index]
    path = module.module or "the model"
    x, y = scale.x(index), scale.y(module.ratio)
    shown = path if len(path) <= LABEL_CHARS else "…" + path[-(LABEL_CHARS - 1) :]
    label_y = min(TOP + 14 + 13 * number, HEIGHT - BOTTOM - 4)
    anchor = "end" if x > (LEFT + WIDTH - RIGHT) / 2 else "start"
    dx = -6 if anchor == "end" else 6
    ratio = "non-finite" if math.isinf(module.ratio) else f"{module.ratio:.3g}x"
    return [
        f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{y:.1f}" y2="{HEIGHT - BOTTOM}" stroke="{colour}" '
        'stroke-dasharray="2 2"/>'
        f'<circle class="crossing" data-module="{escape(path)}" data-index="{index}" '
        f'cx="{x:.1f}" cy="{y:.1f}" r="4.5" fill="none" stroke="{colour}" stroke-width="2">'
        f"<title>{escape(line.row)}: first beyond at {escape(path)} (module {index}), "
        f"{ratio}</title></circle>"
        f'<text class="crossing-label" x="{x + dx:.1f}" y="{label_y}" text-anchor="{anchor}" '
        f'font-size="11" fill="{colour}">{escape(shown)}</text>'
    ]


def legend(lines: Sequence[ProfileLine]) -> list[str]:
    """A swatch and row label per fix, in a row above the plot."""
    parts = []
    x = LEFT
    for number, line in enumerate(lines):
        colour = COLOURS[number % len(COLOURS)]
        parts.append(
            f'<line x1="{x}" x2="{x + 18}" y1="14" y2="14" stroke="{colour}" stroke-width="2"/>'
            f'<text class="legend" x="{x + 22}" y="18" font-size="11" fill="#333">'
            f"{escape(line.row)}</text>"
        )
        x += 34 + 7 * len(line.row)
    return parts
