"""The report's summary, per case (issue 43): the case named once, its fixes as rows, each
stage's cells by dtype and mode side by side, the upstream path marked and the recommended
fix highlighted; the markup the filters read (a cell's outcome class, ``fail``, ``d``),
with one run and with two environments side by side."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness.report import aggregate
from harness.report.case_tables import label_styles
from harness.report.grouping import Environments
from harness.report.summary import differing_cells, summary_view
from harness.report.views import SummaryView
from harness.report.writing import render_report
from tests.test_report import NEW, OLD
from tests.test_report_stages import ATTENTION, CASE, stored_run


def view_of(frame: pd.DataFrame) -> SummaryView:
    """The summary as the report builds it, with each case's recommendation."""
    recommended = {case: aggregate.recommend(frame, case).fix for case in frame["case"].unique()}
    return summary_view(frame, Environments(frame), label_styles(frame), recommended)


def frame_of(*runs: Path) -> pd.DataFrame:
    return aggregate.records_frame(aggregate.load_runs(list(runs)))


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of two cases with forward, train (and for one, fit) cells."""
    return stored_run(tmp_path_factory.mktemp("staged"))


def test_each_case_is_named_once_with_its_fixes_as_rows(staged: Path) -> None:
    frame = frame_of(staged)
    view = view_of(frame)
    assert [case.name for case in view.cases] == [ATTENTION, CASE]
    rows = {case.name: [fix.row for fix in case.fixes] for case in view.cases}
    assert rows == {ATTENTION: ["sdpa", "upcast"], CASE: ["none", "kahan", "master"]}
    html = render_report(aggregate.load_runs([staged]))
    summary = html[html.index('id="summary-matrix"') : html.index('id="versions"')]
    for case in (ATTENTION, CASE):
        assert summary.count(f'data-case="{case}"') == 1
        assert summary.count(f">{case}</a>") == 1  # its header row; no row repeats it


def test_stages_and_dtype_mode_are_column_groups_side_by_side(staged: Path) -> None:
    """One row holds a fix's forward, train and fit cells, each stage a group of its
    dtype x mode columns; a cell reads the label of that stage's cell."""
    frame = frame_of(staged)
    view = view_of(frame)
    (group,) = view.groups
    assert [(s.stage, s.dtypes, s.modes) for s in group.stages] == [
        ("forward", [("float16", 1), ("bfloat16", 2)], ["autocast", "autocast", "half"]),
        ("train", [("float16", 1), ("bfloat16", 2)], ["autocast", "autocast", "half"]),
        ("fit", [("bfloat16", 1)], ["half"]),
    ]
    assert view.column_stages == ["forward"] * 3 + ["train"] * 3 + ["fit"]
    starts = [" s" in cell.css for cell in view.cases[0].fixes[0].cells]
    assert starts == [True, False, False] * 2 + [True]
    upcast = next(f for c in view.cases for f in c.fixes if f.row == "upcast")
    assert [cell.text for cell in upcast.cells] == ["pass", "pass", "-", "inacc", "pass", "-", "-"]
    none = view.cases[1].fixes[0]
    fit = frame[(frame["case"] == CASE) & (frame["fix"] == "none") & (frame["stage"] == "fit")]
    assert fit["label"].tolist() == ["inaccurate"] and none.cells[-1].text == "inacc"


def test_the_upstream_path_is_marked_and_the_recommended_fix_highlighted(staged: Path) -> None:
    frame = frame_of(staged)
    view = view_of(frame)
    for case in view.cases:
        best = aggregate.recommend(frame, case.name).fix
        assert case.recommended == best and best is not None
        assert [f.row for f in case.fixes if f.recommended] == [best]
        assert [f.row for f in case.fixes if f.upstream] == (["none"] if case.name == CASE else [])
    assert view.cases[1].fixes[0].row == "none"  # the upstream path first
    html = render_report(aggregate.load_runs([staged]))
    best = aggregate.recommend(frame, CASE).fix
    assert re.search(rf'<tr class="rec"><th class="fix">{best} <span class="tag rec">', html)
    assert '<th class="fix">none <span class="tag up">upstream</span></th>' in html


def test_a_cell_carries_what_the_filters_read(staged: Path) -> None:
    """The outcome's class, ``fail`` unless a plain pass, the full label where flags came
    with it; the form offers the stages and the outcomes present; with one environment,
    no cell differs and no "only what differs" view is offered."""
    frame = frame_of(staged)
    view = view_of(frame)
    cells = [cell for case in view.cases for fix in case.fixes for cell in fix.cells]
    assert {cell.css.removesuffix(" s") for cell in cells} == {
        "passes",
        "inaccurate fail",
        "missing",
    }
    assert view.stages == ["forward", "train", "fit"] and not view.differs
    assert view.outcomes == [("inaccurate", "inaccurate"), ("passes", "passes")]
    html = render_report(aggregate.load_runs([staged]))
    form = html[html.index('<form id="summary-filter"') : html.index("</form>")]
    assert "<option>forward</option><option>train</option><option>fit</option>" in form
    assert '<option value="fail">only failures</option>' in form
    assert 'value="d"' not in form
    assert html.count("<script>") == 1 and '<col data-stage="train">' in html


def test_two_environments_side_by_side_mark_the_cells_that_differ() -> None:
    """Two releases: a column group each; a (fix, dtype, mode) whose label differs
    between them is marked ``d`` in both groups, and only such cells are (one that ran in
    one release alone has nothing to differ from)."""
    frame = frame_of(OLD, NEW)
    view = view_of(frame)
    assert [g.envs.text for g in view.groups] == ["torch 2.4.1 · cpu", "torch 2.13.0 · cpu"]
    width = len(view.column_stages) // 2
    assert [g.first for g in view.groups] == [0, width]
    labels = frame[frame["outcome"] != "skipped"].drop_duplicates(
        ["case", "base_row", "env", "dtype", "mode"]
    )
    by_cell = labels.groupby(["case", "base_row", "dtype", "mode"])["label"]
    expected = {key for key, found in by_cell if found.nunique() > 1}
    marked = set()
    for case in view.cases:
        for fix in case.fixes:
            for i, cell in enumerate(fix.cells):
                if "d" in cell.css.split():
                    dtype, mode = column_names(view, i)
                    marked.add((case.name, fix.row, dtype, mode))
    assert marked == expected and ("dia-sdpa-kv-cache", "none", "float16", "half") in marked
    assert view.differs
    html = render_report(aggregate.load_runs([OLD, NEW]))
    assert '<option value="d">only what differs between environments</option>' in html
    assert '<td class="o raises-repro fail d">repro</td>' in html  # float16, half


def column_names(view: SummaryView, index: int) -> tuple[str, str]:
    """The (dtype, mode) of the summary's column ``index``."""
    columns = [
        (dtype, mode)
        for group in view.groups
        for stage in group.stages
        for dtype, mode in zip(
            [d for d, span in stage.dtypes for _ in range(span)], stage.modes, strict=True
        )
    ]
    return columns[index]


def test_alike_environments_share_one_column_group(tmp_path: Path) -> None:
    """The same records under two hosts: every outcome alike, one group naming both."""
    runs = []
    for host in ("host-a", "host-b"):
        (tmp_path / host).mkdir()
        runs.append(stored_run(tmp_path / host, host))
    view = view_of(frame_of(*runs))
    (group,) = view.groups
    assert "host-a" in group.envs.text and "host-b" in group.envs.text
    assert not any(
        "d" in c.css.split() for case in view.cases for f in case.fixes for c in f.cells
    )


def test_a_cell_one_environment_alone_ran_differs_from_none() -> None:
    """Per row, two groups' (forward, float16, half) columns: equal, different, run in
    one group alone, run in neither."""
    columns: list[tuple[str, ...]] = [
        ("a", "forward", "float16", "half"),
        ("b", "forward", "float16", "half"),
    ]
    values = np.array(
        [["passes", "passes"], ["passes", "inaccurate"], ["passes", np.nan], [np.nan, np.nan]],
        dtype=object,
    )
    assert differing_cells(values, columns).tolist() == [
        [False, False],
        [True, True],
        [False, False],
        [False, False],
    ]
