"""The report's drawing process (``harness.report.drawing``): started before the runs are
read, given its jobs later, and the figures it returns are those drawn in this process;
where it has nothing to draw it ends, and where it died the figures are drawn here."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.report import drawing, plots
from harness.report.drawing import Drawing


def points(n: int) -> pd.DataFrame:
    return pd.DataFrame(
        {
            "row": [f"fix{i % 3} [sdpa]" for i in range(n)],
            "fix": [f"fix{i % 3}" for i in range(n)],
            "env": ["torch 2.13.0 · cpu"] * n,
            "device": ["cpu"] * n,
            "rel_err": [1e-3 * (i + 1) for i in range(n)],
            "median_s": [1e-4 * (i + 2) for i in range(n)],
        }
    )


JOBS: list[plots.Job] = [(points(6), {"fix1"}), (points(0), set()), (points(3), set())]


def test_a_drawing_started_early_returns_the_figures_drawn_here() -> None:
    expected = [plots.error_vs_time(p, passing) for p, passing in JOBS]
    with Drawing() as drawer:
        assert drawer.process is not None and drawer.process.is_alive()
        drawer.give(JOBS)
        figures = drawer.figures()
    assert figures == expected
    assert figures[1] is None and figures[0] and figures[0].startswith("<svg")


def test_a_drawing_given_nothing_to_draw_ends_its_process() -> None:
    with Drawing() as drawer:
        process = drawer.process
        drawer.give([(points(0), set())])
        assert drawer.process is None
        assert process is not None and not process.is_alive()
        assert drawer.figures() == [None]


def test_a_drawing_whose_process_died_draws_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(drawing, "draw_when_given", lambda connection: connection.close())
    with Drawing() as drawer:
        drawer.give(JOBS)
        figures = drawer.figures()
    assert figures == [plots.error_vs_time(p, passing) for p, passing in JOBS]
