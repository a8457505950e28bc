"""A stage is one class: a toy stage declared and registered in this file alone runs through
``run``, is judged, and shows in the records, the terminal summary and the report, with
nothing else edited (as ``test_axes`` does for a toy axis).

The toy stage, ``twice``, calls the fix twice and judges the second output. Its case's fix
answers NaN at the first call on each workload in the cell's precision (float64, the
reference's, is spared), so a forward is ``inaccurate``, and a ``twice`` cell passes only
where the stage's own run and verdict were used.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.report import aggregate, writing
from harness.results import storage
from harness.results.summary import render_summary
from harness.runner import run
from harness.schema.axes import STAGES, Cell
from harness.schema.config import RunConfig
from harness.schema.records import Outcome
from harness.schema.selection import Selection
from harness.schema.stages import STAGE_REGISTRY, Stage, StageCall, stage_of


class ForwardTwice(Stage):
    """The fix called twice, the second output judged (a warm-up call, as a cache fills)."""

    name = "twice"
    meaning = "the fix called twice, the second output judged"
    passed = "the second call"
    noun = "second call"

    def run(self, call: StageCall) -> Any:
        call.forward()
        return call.forward()


#: A case of its own, in a cases folder of its own: its first call on each workload below
#: float64 answers NaN, its second the product.
TWICE_CASE = textwrap.dedent(
    '''
    """A toy case run at the toy stage ``twice``."""

    import torch

    from harness.measure.authoring.case import (
        Case,
        FailureSignature,
        RunContext,
        Symptom,
        Upstream,
        Workload,
        fix,
    )
    from harness.measure.authoring.registry import register


    @register
    class Twice(Case):
        name = "toy-twice"
        title = "Toy: a fix whose first call on a workload is NaN"
        upstream = Upstream(repo="example/toy", file="toy.py", commit="0000000")
        failure = FailureSignature(silent=(Symptom.NON_FINITE,))
        reference_fix = "none"
        devices = ("cpu",)
        modes = ("half", "fp32")
        backends = ("eager",)
        stages = ("forward", "twice")

        def build(self, ctx: RunContext) -> Workload:
            return Workload(model=torch.randn(16, 16), inputs={"x": torch.randn(4, 16)})

        @fix("none", rationale="the product, NaN on a workload's first call below float64")
        def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
            out = w.inputs["x"] @ w.model
            first = not getattr(w, "called", False)
            w.called = True
            return out * float("nan") if first and out.dtype != torch.float64 else out
    '''
)


@pytest.fixture
def twice_stage(monkeypatch: pytest.MonkeyPatch) -> Iterator[Stage]:
    """The toy stage registered for this test alone."""
    stage = ForwardTwice()
    monkeypatch.setitem(STAGE_REGISTRY, stage.name, stage)
    yield stage


@pytest.fixture
def twice_cases(tmp_path: Path, clean_registry: None) -> Path:
    folder = tmp_path / "cases"
    folder.mkdir()
    (folder / "toy_twice.py").write_text(TWICE_CASE)
    return folder


def run_twice(results: Path, cases: Path) -> Path:
    """``harness run --cases-dir CASES --case toy-twice --stage all -n 0 --no-timing --out
    RESULTS``."""
    return run.run(
        RunConfig(
            selection=Selection(cases=("toy-twice",), stages=("all",)),
            cases_dirs=(cases,),
            results_root=results,
            workers="0",
            timing=None,
        )
    )


def test_a_registered_stage_is_a_value_of_the_stage_axis(twice_stage: Stage) -> None:
    assert list(STAGES) == ["forward", "train", "fit", "twice"]
    assert stage_of("twice") is twice_stage
    assert Cell("c", "none", "cpu", "float16", "half", "eager", stage="twice").id == (
        "c[none,cpu,float16,half,eager,stage=twice]"
    )


def test_a_toy_stage_runs_and_shows_in_the_records_and_the_report(
    tmp_path: Path, twice_stage: Stage, twice_cases: Path
) -> None:
    run_dir = run_twice(tmp_path / "results", twice_cases)
    records = storage.read_records(run_dir)
    by_stage = {stage: [r for r in records if r.cell.stage == stage] for stage in STAGES}
    assert by_stage["twice"] and by_stage["forward"]
    assert not by_stage["train"] and not by_stage["fit"]
    # the second call is judged, against a reference taken the same way: it passes, where
    # the forward (one call, NaN) is inaccurate
    assert {r.outcome for r in by_stage["twice"]} == {Outcome.PASSES}
    assert {r.outcome for r in by_stage["forward"]} == {Outcome.INACCURATE}
    assert "toy-twice  (stage twice)" in render_summary(records)
    html = writing.render_report([aggregate.load_run(run_dir)])
    # the stage view: a column per stage that ran, the toy stage's beside the forward's
    assert "<th>forward</th><th>twice</th>" in html


def test_the_stage_words_name_the_toy_stage_in_a_failure(twice_stage: Stage) -> None:
    from harness.report.stages import StageFailure, StageMiss

    miss = StageMiss("twice", "float16/half", "inaccurate", Outcome.INACCURATE.value, "")
    failure = StageFailure("none", ("forward",), (miss,))
    assert failure.reason == "passes inference; float16/half second call is inaccurate"
