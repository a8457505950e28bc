"""Where a failing cell left float64 (its ``divergence``, issue 40) wherever a verdict is
printed: the summary's listing under a case's table (``run``, ``check``), the Markdown
summary, and the HTML report's messages, read from a run on disk both ways a report reads
one (as columns, and record by record)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from html import unescape
from pathlib import Path
from xml.etree import ElementTree

import pytest

from harness.report import aggregate, runs
from harness.report.markdown import render_markdown
from harness.report.profile_chart import ProfileLine, profile_chart
from harness.report.writing import render_report, write_report
from harness.results import storage
from harness.results.summary import render_summary, verdict_line, where_it_left
from harness.schema.axes import Cell
from harness.schema.divergence import Divergence, ModuleRatio, Profile
from harness.schema.records import CellRecord, Note, NoteKind, Numerics, Outcome
from harness.schema.run_files import Environment
from harness.schema.text import markdown_safe
from tests.test_report import needs_chromium, open_in_chromium

#: A cancelling variance in block 7's first norm of a toy model, as the profile names it.
FOUND = Divergence("blocks.7.norm1", "LayerNorm", "toy.py:44", None, 4.1e4, 1.3, 10.0)
PLACE = "first beyond rounding at blocks.7.norm1 (LayerNorm, toy.py:44), 4.1e+04x (was 1.3x)"
TOLERANCE = "rel_err 0.5 > tolerance 0.01 (10 x rounding)"
NO_MODULE = "no module went beyond its rounding on float64's inputs: the error is made between"


def cell(fix: str, dtype: str, mode: str = "half") -> Cell:
    return Cell("toy", fix, "cpu", dtype, mode, "eager")


def judged(fix: str, dtype: str, outcome: Outcome, **fields: object) -> CellRecord:
    error = 0.5 if outcome is Outcome.INACCURATE else 1e-3
    numerics = Numerics(
        max_abs_err=error,
        rel_err=error,
        baseline_rel_err=None,
        tolerance=1e-2,
        tolerance_rule="10 x rounding",
        finite=True,
        rounding_rel_err=1e-3,
        decided_by="rounding",
        factor=10.0,
    )
    return CellRecord(cell(fix, dtype), "2.13.0", outcome, numerics=numerics, **fields)  # type: ignore[arg-type]


def records() -> list[CellRecord]:
    """The upstream path profiled in float16 (a divergence) and bfloat16 (no module
    charged: a note says why), a fix that passes, and the float32 control."""
    return [
        judged("none", "float16", Outcome.INACCURATE, divergence=FOUND),
        judged(
            "none",
            "bfloat16",
            Outcome.INACCURATE,
            notes=(Note(NoteKind.DIVERGENCE, NO_MODULE + " modules (in the fix's own code)"),),
        ),
        judged("two-pass-variance", "float16", Outcome.PASSES),
        judged("none", "float32", Outcome.PASSES),
    ]


def test_a_profiled_cell_is_listed_under_its_table_with_where_it_left() -> None:
    lines = render_summary(records()).splitlines()
    assert f"  ! none float16/half: {PLACE}; {TOLERANCE}" in lines
    (unprofiled,) = [line for line in lines if line.startswith("  ! none bfloat16/half: ")]
    assert unprofiled.startswith(f"  ! none bfloat16/half: {NO_MODULE}")
    assert unprofiled.endswith(TOLERANCE)
    # a cell that passes, or failed without a profile, is not listed for it
    assert not [line for line in lines if "two-pass-variance" in line and "!" in line]
    plain = judged("none", "float16", Outcome.INACCURATE)
    assert where_it_left(plain) is None and verdict_line(plain) == TOLERANCE


def test_the_place_comes_first_and_the_tolerance_after() -> None:
    record = records()[0]
    assert where_it_left(record) == PLACE == FOUND.describe()
    assert verdict_line(record) == f"{PLACE}; {TOLERANCE}"
    assert verdict_line(judged("fix", "float16", Outcome.PASSES)) is None


@pytest.fixture
def run(tmp_path: Path) -> Path:
    folder = tmp_path / "toy-run"
    folder.mkdir()
    storage.write_env(folder, Environment(torch_version="2.13.0", hostname="box"))
    for record in records():
        storage.append_record(folder, record)
    return folder


def test_both_readings_of_a_run_carry_the_place(run: Path) -> None:
    """The columns (a run of this schema) and the records (any other) give the same rows."""
    as_columns = runs.load_rows(run).rows
    as_records = runs.run_columns(runs.load_run(run))
    assert as_columns is not None
    for rows in (as_columns, as_records):
        places = zip(rows["fix"], rows["dtype"], rows["left_at"], strict=True)
        by_cell = {(fix, dtype): where for fix, dtype, where in places}
        assert by_cell["none", "float16"] == PLACE
        assert str(by_cell["none", "bfloat16"]).startswith(NO_MODULE)
        assert by_cell["two-pass-variance", "float16"] is None
        failures = [f for f in rows["failure"] if f and PLACE in f]
        assert failures == [f"{PLACE}; {TOLERANCE}"]


def test_a_different_place_is_a_different_verdict(run: Path) -> None:
    """Two lines alike but for the module named: each row names its own (the columns'
    reading derives a verdict once per distinct key, so the divergence is in the key)."""
    moved = dataclasses.replace(FOUND, module="blocks.3.norm1")
    line = json.loads((run / storage.CELLS_FILE).read_text().splitlines()[0])
    twin = dict(line, fix="none-moved", divergence=moved.to_dict())
    with (run / storage.CELLS_FILE).open("a") as out:
        out.write(json.dumps(twin) + "\n")
    rows = runs.load_rows(run).rows
    assert rows is not None
    places = {
        (f, d): w for f, d, w in zip(rows["fix"], rows["dtype"], rows["left_at"], strict=True)
    }
    assert "at blocks.3.norm1 " in places["none-moved", "float16"]
    assert "at blocks.7.norm1 " in places["none", "float16"]


def test_the_markdown_summary_names_where_each_failing_cell_left(run: Path) -> None:
    text = render_markdown(aggregate.load_runs([run]))
    section = text.split("### Where each failing cell left float64\n\n", 1)[1].split("\n\n")[0]
    rows = section.splitlines()
    assert rows[0] == "| case | fix | column | environments | where it left float64 |"
    shown = markdown_safe(PLACE)  # a colon escaped, so no text of a run becomes a link
    assert rows[2] == f"| toy | none | float16/half | torch 2.13.0 · cpu | {shown} |"
    assert rows[3].startswith("| toy | none | bfloat16/half | torch 2.13.0 · cpu | no module went")
    assert len(rows) == 4


def test_no_section_where_no_cell_was_profiled(run: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    storage.write_env(plain, Environment(torch_version="2.13.0"))
    storage.append_record(plain, judged("none", "float16", Outcome.INACCURATE))
    assert "left float64" not in render_markdown(aggregate.load_runs([plain]))


def test_the_html_report_lists_the_place_with_the_cells_message(run: Path) -> None:
    html = render_report(runs.load_runs_for_report([run]))
    assert f"<pre>{PLACE}; {TOLERANCE}</pre>" in unescape(html)


# -- the picture: each module's ratio along the model ------------------------------------

SVG = "{http://www.w3.org/2000/svg}"
DEPTH = 500  # the modules of a 48-layer model, about


def ratios(
    bug: int | None, value: float = 140.0, gap: int | None = None
) -> tuple[ModuleRatio, ...]:
    """``DEPTH`` modules reading about 1 (0 for the ones with no rounding error), the one
    at ``bug`` reading ``value``, the one at ``gap`` not measurable."""
    found = []
    for i in range(DEPTH):
        ratio = (1.0 + (i % 5) / 10) if i % 7 else 0.0
        ratio = value if i == bug else math.nan if i == gap else ratio
        found.append(ModuleRatio(f"encoder.layer.{i // 10}.module{i % 10}", ratio))
    return tuple(found)


def parsed(svg: str) -> ElementTree.Element:
    """The picture as XML (it must be well formed: it is inline in the report)."""
    return ElementTree.fromstring(svg)


def polyline_points(svg: ElementTree.Element, row: str) -> list[tuple[float, float]]:
    points = []
    for line in svg.iter(f"{SVG}polyline"):
        if line.get("data-row") == row:
            points += [tuple(map(float, p.split(","))) for p in str(line.get("points")).split()]
    return points  # type: ignore[return-value]


def test_the_factor_is_a_line_at_its_height_on_the_log_axis() -> None:
    svg = parsed(profile_chart([ProfileLine("none", ratios(301))], 10.0))
    (factor,) = [e for e in svg.iter(f"{SVG}line") if e.get("class") == "factor"]
    ticks = {
        e.text: float(str(e.get("y"))) for e in svg.iter(f"{SVG}text") if e.get("class") == "tick"
    }
    # a decade's label sits 3.5 below its grid line; the factor 10 on the decade 10
    assert float(str(factor.get("y1"))) == pytest.approx(ticks["10"] - 3.5)
    assert ticks["1"] - ticks["10"] == pytest.approx(ticks["10"] - ticks["100"])


def test_the_first_crossing_is_marked_at_its_module_and_named() -> None:
    svg = parsed(profile_chart([ProfileLine("none", ratios(301, gap=40))], 10.0))
    points = polyline_points(svg, "none")
    assert len(points) == DEPTH - 1  # every module but the one not measured
    (ring,) = svg.iter(f"{SVG}circle")
    assert ring.get("data-module") == "encoder.layer.30.module1"
    assert ring.get("data-index") == "301"
    # the 301st module is the 300th point: the one at 40 leaves a gap
    assert (float(str(ring.get("cx"))), float(str(ring.get("cy")))) == points[300]
    labels = [e.text for e in svg.iter(f"{SVG}text") if e.get("class") == "crossing-label"]
    assert labels == ["encoder.layer.30.module1"]
    assert "none: first beyond at module 301, encoder.layer.30.module1" in str(
        svg.get("aria-label")
    )


def test_a_non_finite_module_is_drawn_at_the_top_edge() -> None:
    svg = parsed(profile_chart([ProfileLine("none", ratios(120, math.inf))], 10.0))
    (frame,) = svg.iter(f"{SVG}rect")
    top = float(str(frame.get("y")))
    assert polyline_points(svg, "none")[120][1] == top
    (marker,) = [e for e in svg.iter(f"{SVG}path") if e.get("class") == "non-finite"]
    assert "encoder.layer.12.module0: non-finite" in str(marker.findtext(f"{SVG}title"))
    (ring,) = svg.iter(f"{SVG}circle")
    assert ring.get("data-index") == "120"


def test_fixes_are_overlaid_and_a_fix_that_moves_the_crossing_shows_it() -> None:
    lines = [
        ProfileLine("none", ratios(301)),
        ProfileLine("clamp-logits", ratios(450)),
        ProfileLine("keep-fp32", ratios(None)),
    ]
    svg = parsed(profile_chart(lines, 10.0))
    rings = {str(e.get("data-index")): e.get("stroke") for e in svg.iter(f"{SVG}circle")}
    assert set(rings) == {"301", "450"} and len(set(rings.values())) == 2
    legend = [e.text for e in svg.iter(f"{SVG}text") if e.get("class") == "legend"]
    assert legend == ["none", "clamp-logits", "keep-fp32"]
    assert all(len(polyline_points(svg, line.row)) == DEPTH for line in lines)
    assert "keep-fp32: no module beyond" in str(svg.get("aria-label"))


def test_what_a_model_names_is_escaped_in_the_picture() -> None:
    hostile = "blocks.<script>alert(1)</script>&"
    series = (ModuleRatio("a", 1.0), ModuleRatio(hostile, 50.0))
    text = profile_chart([ProfileLine('fix"<b>', series)], 10.0)
    assert "<script>" not in text and "<b>" not in text
    assert parsed(text).find(f"{SVG}circle").get("data-module") == hostile  # type: ignore[union-attr]
    assert profile_chart([ProfileLine("none", ())], 10.0) == ""


def profiled(fix: str, dtype: str, bug: int | None, backward: int | None = None) -> CellRecord:
    forward = ratios(bug)
    profile = Profile(10.0, forward, ratios(backward) if backward is not None else ())
    found = dataclasses.replace(FOUND, module=forward[bug].module) if bug is not None else None
    outcome = Outcome.INACCURATE if bug is not None else Outcome.PASSES
    return judged(fix, dtype, outcome, divergence=found, profile=profile)


@pytest.fixture
def profiled_runs(tmp_path: Path) -> list[Path]:
    """Two environments alike (the same series) and one where the float16 cell's fix
    moved the crossing: ``none`` and a fix profiled in float16/half, ``none`` in
    bfloat16/half with a backward series too."""
    folders = []
    for version, moved in (("2.12.0", 450), ("2.13.0", 450), ("2.4.1", 200)):
        folder = tmp_path / f"torch-{version}"
        folder.mkdir()
        storage.write_env(folder, Environment(torch_version=version, hostname="box"))
        for record in (
            profiled("none", "float16", 301),
            profiled("clamp-logits", "float16", moved),
            profiled("none", "bfloat16", 301, backward=77),
        ):
            storage.append_record(folder, dataclasses.replace(record, torch_version=version))
        folders.append(folder)
    return folders


def test_the_report_draws_a_picture_per_column_and_set_of_alike_environments(
    profiled_runs: list[Path],
) -> None:
    html = render_report(runs.load_runs_for_report(profiled_runs))
    section = html.split("<h3>Where the failing cells left float64</h3>", 1)[1]
    section = section.split("<details>", 1)[0]
    pictures = re.findall(r'<div class="profile">(.*?)</div>', section, re.DOTALL)
    heads = [re.sub(r"<[^>]+>", "", p.split("</p>")[0]) for p in pictures]
    assert heads == [
        "float16/half in torch 2.4.1 · cpu",
        "float16/half in torch 2.12.0\u20132.13.0 · cpu",  # an en dash
        "bfloat16/half in torch 2.4.1\u20132.13.0 · cpu",
    ]
    indices = [re.findall(r'data-index="(\d+)"', p) for p in pictures]
    assert indices == [["301", "200"], ["301", "450"], ["301", "77"]]
    assert [p.count('data-direction="backward"') for p in pictures] == [0, 0, 1]


@needs_chromium
def test_the_pictures_render_in_headless_chromium(
    profiled_runs: list[Path], tmp_path: Path
) -> None:
    """The report with its profile pictures opens with no console error, and the browser
    keeps each picture's marks (an SVG it could not parse it would drop)."""
    report = write_report(
        render_report(runs.load_runs_for_report(profiled_runs)), tmp_path / "r.html"
    )
    shot, console, dom = open_in_chromium(report, tmp_path)
    assert console == [] and shot.stat().st_size > 20_000
    assert dom.count('<svg xmlns="http://www.w3.org/2000/svg" class="profile"') == 4
    assert dom.count('class="crossing"') == 6 and dom.count('class="factor"') == 4
