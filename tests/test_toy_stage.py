"""A stage is one class: a toy stage declared and registered in this file alone runs through
``run``, is judged, and shows in the records, the terminal summary and the report, with
nothing else edited (as ``test_axes`` does for a toy axis).

The toy stage, ``twice``, calls the fix twice and judges the second output. Its case's fix
answers NaN at the first call on each workload in the cell's precision (float64, the
reference's, is spared), so a forward is ``inaccurate``, and a ``twice`` cell passes only
where the stage's own run and verdict were used. It declares what it replays and the stage
its cost is shown over, and the recorder and the report read them from the class.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.cli import main
from harness.measure.running.replay import Recorder
from harness.report import aggregate, stages, writing
from harness.results import storage
from harness.results.summary import render_summary
from harness.runner import run
from harness.schema.axes import STAGES, Cell
from harness.schema.config import RunConfig
from harness.schema.records import Outcome
from harness.schema.selection import Selection
from harness.schema.stages import (
    STAGE_REGISTRY,
    Stage,
    StageCall,
    register_stage,
    stage_as_read,
    stage_of,
)


class ForwardTwice(Stage):
    """The fix called twice, the second output judged (a warm-up call, as a cache fills)."""

    name = "twice"
    meaning = "the fix called twice, the second output judged"
    passed = "the second call"
    noun = "second call"
    # unlike a forward: its elementwise kinks are replayed, its picks not
    replays_kinks = True
    replays_picks = False
    # its time and memory are shown over the forward pass's, as the train step's are
    cost_against = "forward"

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


def run_twice(results: Path, cases: Path, workers: str = "0") -> Path:
    """``harness run --cases-dir CASES --case toy-twice --stage all -n WORKERS --no-timing
    --out RESULTS``."""
    return run.run(
        RunConfig(
            selection=Selection(cases=("toy-twice",), stages=("all",)),
            cases_dirs=(cases,),
            results_root=results,
            workers=workers,
            timing=None,
        )
    )


@pytest.fixture
def stages_restored() -> Iterator[None]:
    """The stage registry as it was, after a test whose case module registers a stage."""
    saved = dict(STAGE_REGISTRY)
    yield
    STAGE_REGISTRY.clear()
    STAGE_REGISTRY.update(saved)


def test_a_stage_declared_in_a_case_module_reaches_a_worker_process(
    tmp_path: Path, twice_cases: Path, stages_restored: None
) -> None:
    """A worker of ``-n N`` is an interpreter of its own, not a fork: it knows the stages of
    the modules it imports, the run's case modules among them. The toy stage declared in
    its case module runs there."""
    module = twice_cases / "toy_twice.py"
    stage = inspect.getsource(ForwardTwice)
    declared = (
        "from typing import Any\n\n"
        "from harness.schema.stages import Stage, StageCall, register_stage\n\n\n"
        f"@register_stage\n{stage}\n\n@register\n"
    )
    module.write_text(TWICE_CASE.replace("@register\n", declared, 1))
    assert "twice" not in STAGE_REGISTRY
    records = storage.read_records(run_twice(tmp_path / "results", twice_cases, workers="1"))
    assert {r.worker for r in records if r.cell.stage == "twice"} == {"gw0"}
    assert {r.outcome for r in records if r.cell.stage == "twice"} == {Outcome.PASSES}


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
    # the stage view: a column per stage that ran, the toy stage's beside the forward's,
    # its cost over the forward pass's in columns headed by the stage's own words
    assert "<th>forward</th><th>twice</th>" in html
    assert "<code>twice</code> (the fix called twice, the second output judged)" in html
    assert "<th>twice / forward: time</th><th>twice / forward: memory</th>" in html
    assert "<th>second call vs fastest</th>" in html
    assert "The second call's time and peak memory are over the forward pass's" in html
    assert "fit loss (float64 dashed)" not in html  # no stage judged by a loss curve ran


def test_what_a_stage_replays_is_read_from_its_class(twice_stage: Stage) -> None:
    """The recorder of a cell keeps the choices its stage's class says it replays: the toy
    stage's kinks and not its picks, where a forward keeps its picks and not its kinks."""
    toy = Recorder.at("twice", reference=False)
    forward = Recorder.at("forward", reference=True)
    assert (toy.kinks, toy.picks) == (True, False)
    assert (forward.kinks, forward.picks, forward.reference) == (False, True, True)
    assert twice_stage.inference and not stage_of("train").inference


def test_a_record_of_a_stage_not_registered_here_is_read(
    tmp_path: Path,
    twice_stage: Stage,
    twice_cases: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Records of a stage this process has not registered (another harness's) are read by
    the summary and the report, as a forward-like stage named by its name."""
    run_dir = run_twice(tmp_path / "results", twice_cases)
    monkeypatch.delitem(STAGE_REGISTRY, "twice")
    records = storage.read_records(run_dir)
    assert {r.cell.stage for r in records} == {"forward", "twice"}
    unknown = stage_as_read("twice")
    assert (unknown.name, unknown.noun) == ("twice", "twice")
    assert not unknown.trains and unknown.cost_against is None
    assert "toy-twice  (stage twice)" in render_summary(records)
    html = writing.render_report([aggregate.load_run(run_dir)])
    assert "<th>forward</th><th>twice</th>" in html
    assert "twice / forward" not in html  # its cost over the forward's is its class's to say
    miss = stages.StageMiss("twice", "float16/half", "inaccurate", Outcome.INACCURATE.value, "")
    assert miss.describe() == "float16/half twice is inaccurate"


def test_help_lists_a_stage_registered_before_the_parser_is_built(
    twice_stage: Stage, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert "forward, train, fit, twice or all" in " ".join(capsys.readouterr().out.split())


def test_a_stage_class_declared_again_replaces_itself(twice_stage: Stage) -> None:
    """A module imported anew declares its stage again (discovery re-runs a case module once
    the case registry is cleared): the same class replaces itself; another class of the
    same name is an error."""
    assert register_stage(ForwardTwice) is ForwardTwice
    assert type(stage_of("twice")) is ForwardTwice

    class Other(ForwardTwice):
        pass

    with pytest.raises(ValueError, match="'twice' is registered twice"):
        register_stage(Other)


def test_the_stage_words_name_the_toy_stage_in_a_failure(twice_stage: Stage) -> None:
    from harness.report.stages import StageFailure, StageMiss

    miss = StageMiss("twice", "float16/half", "inaccurate", Outcome.INACCURATE.value, "")
    failure = StageFailure("none", ("forward",), (miss,))
    assert failure.reason == "passes inference; float16/half second call is inaccurate"
