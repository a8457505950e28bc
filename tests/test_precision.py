"""The harness applies each cell's precision and checks that it took (measure.precision)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from harness.measure import execute
from harness.measure.authoring import registry
from harness.measure.authoring.case import Case, Workload
from harness.measure.figures import cell_timing
from harness.measure.figures.timing import ClockStopwatch
from harness.measure.precision.flags import leftover_precision
from harness.measure.precision.modes import Precision
from harness.measure.precision.outputs import output_leaves
from harness.measure.running import fix_run
from harness.measure.tracing.python_watch import PythonWatch, watch_python
from harness.results import storage
from harness.schema.axes import Cell
from harness.schema.records import (
    CellRecord,
    CrashKind,
    FlagKind,
    Note,
    NoteKind,
    Outcome,
    outcome_label,
)
from tests.conftest import CONTRACT_CASES, ROOT, only_run_dir, run_cases

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("dtype", "mode", "compute", "autocast"),
    [
        (torch.float16, "half", torch.float16, False),
        (torch.bfloat16, "autocast", torch.float32, True),
        (torch.bfloat16, "half-autocast", torch.bfloat16, True),
        (torch.float32, "fp32", torch.float32, False),
        (torch.float64, "half", torch.float64, False),  # the reference
        (torch.float64, "autocast", torch.float64, False),
    ],
)
def test_each_mode_says_what_it_applies(
    dtype: torch.dtype, mode: str, compute: torch.dtype, autocast: bool
) -> None:
    precision = Precision(CPU, dtype, mode)
    assert (precision.compute_dtype, precision.uses_autocast) == (compute, autocast)


def test_a_case_managing_its_precision_gets_float32_and_no_autocast() -> None:
    managed = Precision(CPU, torch.bfloat16, "half-autocast", managed_by_case=True)
    assert managed.compute_dtype == torch.float32
    assert Precision(CPU, torch.float64, "half", managed_by_case=True).compute_dtype == (
        torch.float64
    )


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.gate = nn.Parameter(torch.ones(4))


def test_half_casts_model_and_inputs_except_what_the_case_keeps(toy_registry: None) -> None:
    case = registry.get("toy-mixed-matmul")
    keep = ("norm", "gate", "t")  # parts of the model, and an input by its name
    ctx = fix_run.context_for(case, Cell(case.name, "none", "cpu", "bfloat16", "half", "eager"))
    inputs = {"x": torch.randn(2, 4), "ids": torch.arange(3), "steps": [torch.randn(2)], "n": 3}
    inputs["t"] = torch.tensor([500.25])
    w = fix_run.apply_precision(Workload(Block(), inputs), ctx, keep)
    assert w.model.proj.weight.dtype == torch.bfloat16
    assert w.model.norm.weight.dtype == torch.float32 and w.model.gate.dtype == torch.float32
    assert w.inputs["x"].dtype == torch.bfloat16 and w.inputs["steps"][0].dtype == torch.bfloat16
    assert w.inputs["ids"].dtype == torch.int64 and w.inputs["n"] == 3
    assert w.inputs["t"].dtype == torch.float32 and w.inputs["t"].item() == 500.25
    reference = fix_run.context_for(
        case, Cell(case.name, "none", "cpu", "float64", "half", "eager")
    )
    w64 = fix_run.apply_precision(Workload(Block(), inputs), reference, keep)
    assert {p.dtype for p in w64.model.parameters()} == {torch.float64}
    assert w64.inputs["t"].dtype == torch.float64


def test_autocast_mode_leaves_float32_weights(toy_registry: None) -> None:
    case = registry.get("toy-mixed-matmul")
    ctx = fix_run.context_for(case, Cell(case.name, "none", "cpu", "float16", "autocast", "eager"))
    w = fix_run.apply_precision(Workload(Block(), {"x": torch.randn(2, 4)}), ctx, ("norm",))
    assert {p.dtype for p in w.model.parameters()} == {torch.float32}


def test_keeping_a_part_the_model_lacks_is_an_error(toy_registry: None) -> None:
    case = registry.get("toy-mixed-matmul")
    ctx = fix_run.context_for(case, Cell(case.name, "none", "cpu", "float16", "half", "eager"))
    with pytest.raises(AttributeError, match="keep_fp32 names 'nrom', which is neither"):
        fix_run.apply_precision(Workload(Block(), {"x": torch.randn(2, 4)}), ctx, ("nrom",))


def test_the_autocast_witness_sees_ops_under_autocast_only() -> None:
    layer, x = nn.Linear(4, 4), torch.randn(2, 4)
    inside, outside, switched_off = (PythonWatch("cpu") for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with watch_python(inside):
            layer(x)
        with watch_python(switched_off), torch.autocast("cpu", enabled=False):
            layer(x)
    with watch_python(outside):
        layer(x)
    assert (inside.seen, outside.seen, switched_off.seen) == (True, False, False)


def test_leftovers_include_plain_tensor_attributes_and_skip_kept_parts() -> None:
    block = Block().to(torch.float16)
    block.cache = torch.zeros(2)  # a plain attribute: .to() never casts it
    block.norm.float()
    assert leftover_precision(block, torch.float16, keep=("norm",)) == ["cache (float32)"]


@dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor | None


def test_outputs_are_compared_leaf_by_leaf() -> None:
    t = torch.ones(2)
    assert list(output_leaves(t)) == ["output"]
    assert list(output_leaves((t, t))) == ["[0]", "[1]"]
    assert list(output_leaves({"loss": t, "grads": {"w": t}})) == ["loss", "grads.w"]
    assert list(output_leaves(Pair(t, None))) == ["first"]
    with pytest.raises(TypeError, match="returned str"):
        output_leaves({"bad": "x"})


@pytest.fixture
def contract_registry(clean_registry: None) -> None:
    registry.discover([CONTRACT_CASES])


def run(case: str, fix: str, dtype: str, mode: str) -> CellRecord:
    return execute.run_cell(Cell(case, fix, "cpu", dtype, mode, "eager"))


def test_a_case_that_forgets_autocast_is_flagged(contract_registry: None) -> None:
    forgot = run("toy-self-managed", "none", "bfloat16", "autocast")
    assert forgot.outcome is Outcome.PASSES
    assert [f.kind for f in forgot.flags] == [
        FlagKind.NO_AUTOCAST,
        FlagKind.DRIFT,
    ]  # its matmul ran in fp32
    assert outcome_label(forgot) == "passes[no-autocast,drift]"
    assert not run("toy-self-managed", "enters-autocast", "bfloat16", "autocast").flags
    warned = run("toy-self-managed", "warns", "bfloat16", "autocast")
    assert warned.outcome is Outcome.PASSES and not warned.flags
    assert warned.warnings == ("DeprecationWarning: this code path is deprecated",)
    assert not run("toy-self-managed", "none", "float32", "fp32").flags


def test_a_forgotten_cast_is_flagged(contract_registry: None) -> None:
    half = run("toy-plain-attribute", "none", "bfloat16", "half")
    assert [f.kind for f in half.flags] == [
        FlagKind.NOT_HALF,
        FlagKind.DRIFT,
    ]  # and its output is float32
    assert "scale (float32)" in half.flags[0].detail
    assert half.flags[1].detail.startswith(
        "output is float32 (float32 enters via tensor attribute scale at aten::mul"
    )
    assert outcome_label(half) == "passes[not-half,drift]"
    assert not run("toy-plain-attribute", "none", "float32", "fp32").flags


@pytest.mark.parametrize("mode", ["half", "autocast"])
def test_a_training_step_passes_leaf_by_leaf_and_is_rerunnable(
    contract_registry: None, mode: str
) -> None:
    record = run("toy-training-step", "as-dict", "bfloat16", mode)
    assert record.outcome is Outcome.PASSES and not record.flags
    assert record.numerics is not None
    assert record.numerics.leaf in ("loss", "head_grad", "updated_head")
    timed = cell_timing.checked_call(record, ClockStopwatch(), min_block_s=0.01)
    assert isinstance(timed, cell_timing.TimedCall) and timed.record.notes == ()
    timed.call()  # a timed call: it computes what the first call did
    assert cell_timing.rerun_note(timed) is None


def test_failures_show_the_real_error_and_the_case_frames(contract_registry: None) -> None:
    contract = run("toy-failures", "none", "float16", "half")
    assert contract.crash_kind is CrashKind.CONTRACT and contract.error_type == "TypeError"
    no_reference = run("toy-failures", "returns-model", "float16", "half")
    assert no_reference.outcome is Outcome.CRASHED
    assert no_reference.crash_kind is CrashKind.REFERENCE_FAILED
    assert no_reference.error_type == "ValueError"
    assert no_reference.error_message == "expected 3 features, got 4"
    assert no_reference.error_frames[-1].endswith("toy_failures.py:13 in check_shape")
    no_build = execute.run_cell(
        Cell("toy-failures", "broken-reference", "cpu", "float16", "half", "flash-attn-contract")
    )
    assert no_build.crash_kind is CrashKind.WORKLOAD_FAILED
    assert no_build.error_message == "expected 3 features, got 5"
    assert [f.split(":")[1].split()[-1] for f in no_build.error_frames] == ["build", "check_shape"]


def test_the_terminal_names_flags_and_errors(tmp_path: Path) -> None:
    mine = "toy-failures,toy-plain-attribute,toy-self-managed,toy-training-step"
    result = run_cases(CONTRACT_CASES, mine, tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "toy-self-managed[none,cpu,bfloat16,autocast,eager]  passes[no-autocast,drift]" in out
    assert "! none bfloat16/autocast: no-autocast:" in out
    assert "! none bfloat16/half: not-half: after the fix the model holds scale (float32)" in out
    assert (
        "reference-failed: ValueError: expected 3 features, got 4 "
        "(at tests/fixtures/contract_cases/toy_failures.py:13 in check_shape)" in out
    )
    assert "Traceback" not in out and "longrepr" not in out
    records = storage.read_records(only_run_dir(tmp_path))
    assert {r.cell.case for r in records} == set(mine.split(","))


def test_the_guide_shows_its_example_and_the_example_runs(tmp_path: Path) -> None:
    example = ROOT / "docs" / "examples" / "fp32_norm_weight.py"
    assert (
        f"```python\n{example.read_text()}```" in (ROOT / "docs" / "writing-a-case.md").read_text()
    )
    result = run_cases(example.parent, "guide-fp32-norm-weight", tmp_path)
    assert result.returncode == 0, result.stderr
    labels = {
        (r.cell.fix, r.cell.mode): outcome_label(r)
        for r in storage.read_records(only_run_dir(tmp_path))
        if r.cell.dtype == "bfloat16"
    }
    assert labels == {
        ("none", "half"): "raises:repro",
        ("none", "half-autocast"): "passes",
        ("none", "autocast"): "passes",
        ("cast-back", "half"): "passes",
        ("cast-back", "half-autocast"): "passes",
        ("cast-back", "autocast"): "passes",
    }


def test_the_authoring_api_is_importable_from_harness() -> None:
    import harness

    assert harness.Case is Case and harness.Workload is Workload and callable(harness.register)


def test_a_call_whose_output_changes_between_calls_is_noted(contract_registry: None) -> None:
    record = run("toy-training-step", "as-dict", "bfloat16", "half")
    calls = itertools.count()
    repeated = cell_timing.RepeatedCall(lambda: torch.tensor(float(next(calls))))
    repeated()
    timed = cell_timing.TimedCall(record, repeated, torch.device("cpu"), repeated.last, 0.0)
    repeated()  # a timed call that computes something else: a counter, a growing cache
    rerun = Note(NoteKind.NOT_RERUNNABLE, cell_timing.NOT_RERUNNABLE)
    assert cell_timing.rerun_note(timed) == rerun
