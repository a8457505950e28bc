"""Where a failing cell left float64 (its ``divergence``, issue 40) wherever a verdict is
printed: the summary's listing under a case's table (``run``, ``check``), the Markdown
summary, and the HTML report's messages, read from a run on disk both ways a report reads
one (as columns, and record by record)."""

from __future__ import annotations

import dataclasses
import json
from html import unescape
from pathlib import Path

import pytest

from harness.report import aggregate, runs
from harness.report.markdown import render_markdown
from harness.report.writing import render_report
from harness.results import storage
from harness.results.summary import render_summary, verdict_line, where_it_left
from harness.schema.axes import Cell
from harness.schema.divergence import Divergence
from harness.schema.records import CellRecord, Note, NoteKind, Numerics, Outcome
from harness.schema.run_files import Environment
from harness.schema.text import markdown_safe

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
