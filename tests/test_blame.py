"""Blame where it belongs: a model that crashes, hangs or raises in one dtype costs only that
dtype's cells, a model that fails in float64 too is reported as such, and a model whose
output changes from call to call is told so, end to end through ``python -m harness check``."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import pytest

from harness.measure.figures import cell_timing, perf
from harness.results import storage
from harness.runner import isolation
from harness.schema.axes import Cell
from harness.schema.config import Limits, TimingConfig
from harness.schema.records import CellRecord, CrashKind, NoteKind, Outcome
from tests.conftest import harness, only_run_dir

MODELS = """
import os
import signal

import torch


class InFloat16(torch.nn.Module):
    \"\"\"A linear layer that does ``self.failure()`` when fed float16.\"\"\"

    def __init__(self, failure):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.failure = failure

    def forward(self, x):
        if x.dtype == torch.float16:
            self.failure()
        return self.lin(x)


def segfault():
    os.kill(os.getpid(), signal.SIGSEGV)


def hang():
    while True:
        pass


def refuse():
    raise RuntimeError("float16 is not supported here")


def segv_in_float16():
    return InFloat16(segfault), {"x": torch.randn(2, 8)}


def hangs_in_float16():
    return InFloat16(hang), {"x": torch.randn(2, 8)}


def raises_in_float16():
    return InFloat16(refuse), {"x": torch.randn(2, 8)}


class NeverWorks(torch.nn.Module):
    def forward(self, x):
        raise ValueError("this model never works")


def always_raises():
    return NeverWorks(), {"x": torch.randn(2, 8)}


CALLS = [0]


class CountsCalls(torch.nn.Linear):
    \"\"\"Its output gains rows with every call the process makes.\"\"\"

    def forward(self, x):
        CALLS[0] += 1
        return super().forward(x).repeat(CALLS[0], 1)


def counts_calls():
    return CountsCalls(8, 8), {"x": torch.randn(2, 8)}
"""

Verdicts = dict[tuple[str, str], CellRecord]


def check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Verdicts]:
    """``python -m harness check`` of the models above on the CPU, and its records by
    (dtype, mode)."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "blame_models.py").write_text(MODELS)
    where = ("--device", "cpu", "-n", "1", "--out", str(tmp_path / "results"))
    result = subprocess.run(
        [sys.executable, "-m", "harness", "check", *args, *where],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    records = storage.read_records(next((tmp_path / "results").iterdir()))
    return result, {(r.cell.dtype, r.cell.mode): r for r in records}


@pytest.mark.parametrize(
    ("factory", "outcome", "says"),
    [
        ("segv_in_float16", Outcome.CRASHED, "died from signal 11 (SIGSEGV)"),
        ("hangs_in_float16", Outcome.TIMEOUT, "no result after 4 s"),
    ],
)
def test_a_model_that_dies_in_float16_costs_only_its_float16_cells(
    tmp_path: Path, factory: str, outcome: Outcome, says: str
) -> None:
    """The float16 baseline kills its process (or hangs) too: that costs the float16
    yardstick, not the float64 reference, so every other cell gets its real verdict."""
    _, verdicts = check(tmp_path, f"blame_models:{factory}", "--no-timing", "--timeout", "4")
    dead = verdicts.pop(("float16", "half"))
    assert dead.outcome is outcome and says in (dead.error_message or ""), dead
    assert dead.crash_kind is not CrashKind.REFERENCE_FAILED
    assert {key: r.outcome for key, r in verdicts.items()} == {
        ("float16", "autocast"): Outcome.PASSES,  # fed float32: autocast casts inside
        ("bfloat16", "autocast"): Outcome.PASSES,
        ("bfloat16", "half"): Outcome.PASSES,
        ("float32", "fp32"): Outcome.PASSES,
    }


def test_a_model_that_fails_in_float64_too_is_not_a_half_precision_bug(tmp_path: Path) -> None:
    """Every cell of a model whose float64 reference raises says the reference failed; a
    model that raises only in float16 still ``raises`` there, and passes elsewhere."""
    _, always = check(tmp_path / "always", "blame_models:always_raises", "--no-timing")
    for record in always.values():
        assert record.outcome is Outcome.CRASHED, record
        assert record.crash_kind is CrashKind.REFERENCE_FAILED
        assert (record.error_type, record.error_message) == (
            "ValueError",
            "this model never works",
        )
        assert "blame_models.py:" in record.error_frames[-1]  # the model's own line
        assert record.error_frames[-1].endswith(" in forward")
    _, only_half = check(tmp_path / "half", "blame_models:raises_in_float16", "--no-timing")
    raised = only_half.pop(("float16", "half"))
    assert (raised.outcome, raised.error_type) == (Outcome.RAISES, "RuntimeError")
    assert {r.outcome for r in only_half.values()} == {Outcome.PASSES}


def test_an_output_that_changes_between_calls_is_told_so(tmp_path: Path) -> None:
    """The cells of one batch share a process: the second call of the counting model gives
    four rows where the float64 reference has two. No ``None:`` and no timed-alone note."""
    result, verdicts = check(
        tmp_path, "blame_models:counts_calls", "--dtype", "float16,float32", "--mode", "half,fp32",
        "--time-budget", "0.05",
    )  # fmt: skip
    first, second = verdicts[("float16", "half")], verdicts[("float32", "fp32")]
    assert first.outcome is Outcome.PASSES  # its one call was the process's first
    assert second.outcome is Outcome.CRASHED and second.crash_kind is CrashKind.CONTRACT
    assert (second.error_message or "").startswith("output shape changed between calls: ")
    assert "(4, 8)" in (second.error_message or "") and "(2, 8)" in (second.error_message or "")
    assert "None:" not in result.stdout
    timing_notes = [n.kind for n in first.notes if n.kind is not NoteKind.NOISY]
    assert timing_notes == [NoteKind.NOT_RERUNNABLE]  # timed, and told
    assert first.perf is not None and first.timing_error is None


CASE = """
import os
import signal

import torch

from harness import Case, FailureSignature, RunContext, Upstream, Workload, fix, register


@register
class BaselineDies(Case):
    name = "toy-baseline-dies"
    title = "Toy: the trusted fix kills its process in float16"
    upstream = Upstream(repo="example/toy", file="toy.py", commit="0000000")
    failure = FailureSignature("RuntimeError", "never")
    reference_fix = "trusted"
    devices = ("cpu",)
    dtypes = ("float16",)
    modes = ("half", "fp32")
    backends = ("eager",)

    def build(self, ctx: RunContext) -> Workload:
        return Workload(model=torch.randn(16, 16), inputs={"x": torch.randn(4, 16)})

    @fix("trusted", rationale="right, but segfaults in float16")
    def trusted(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        if w.model.dtype == torch.float16:
            os.kill(os.getpid(), signal.SIGSEGV)
        return w.inputs["x"] @ w.model

    @fix("none", rationale="right")
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return w.inputs["x"] @ w.model
"""


def test_a_baseline_that_dies_leaves_its_cells_judged_by_the_rounding(tmp_path: Path) -> None:
    """Where the trusted fix kills the process computing its float16 baseline, the other
    fixes' float16 cells are judged by the rounding yardstick and say why."""
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "baseline_dies.py").write_text(CASE)
    result = harness(
        "run", "--cases-dir", str(tmp_path / "cases"), "--case", "toy-baseline-dies",
        "--no-timing", "-n", "1", "--out", str(tmp_path / "results"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = storage.read_records(only_run_dir(tmp_path / "results"))
    verdicts = {(r.cell.fix, r.cell.dtype): r for r in records}
    judged = verdicts[("none", "float16")]
    assert judged.outcome is Outcome.PASSES and judged.numerics is not None
    assert judged.numerics.decided_by == "rounding to float16"
    assert judged.baseline_error == (
        "fix trusted: the process computing the float16 baseline died from signal 11 (SIGSEGV)"
    )
    dead = verdicts[("trusted", "float16")]
    assert (dead.outcome, dead.crash_kind) == (Outcome.CRASHED, CrashKind.PROCESS_DIED)
    assert verdicts[("none", "float32")].outcome is Outcome.PASSES


def test_a_column_of_one_whose_timing_fails_is_not_said_timed_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The timed-alone note says another fix of the column killed the process they shared:
    a column of one cell had no other fix, and a cell whose timing fails alone too was not
    timed at all. Neither gets the note."""

    def fails(*args: object) -> NoReturn:
        raise RuntimeError("timing broke")

    monkeypatch.setattr(cell_timing, "time_column", fails)  # the forked children inherit it
    monkeypatch.setattr(perf, "warm_up", lambda: None)
    cell = Cell("toy", "none", "cpu", "float16", "half", "eager")
    records = [CellRecord(cell=replace(cell, fix=fix), torch_version="", outcome=Outcome.PASSES)
               for fix in ("none", "other")]  # fmt: skip
    columns = [records[:1], records]
    timed = list(isolation.time_columns_isolated(columns, TimingConfig(), "w", Limits(), 1))
    for record in (r for column in timed for r in column):
        assert record.notes == () and "RuntimeError: timing broke" in (record.timing_error or "")
