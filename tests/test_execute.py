"""Outcome classification of real cells of the toy case, and determinism."""

from __future__ import annotations

import pytest

from harness.measure import execute
from harness.measure.running import crashes, errors, fix_run
from harness.schema.axes import Cell
from harness.schema.records import CrashKind, Outcome


def toy_cell(fix: str, dtype: str = "float16", mode: str = "half") -> Cell:
    return Cell("toy-mixed-matmul", fix, "cpu", dtype, mode, "eager")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_known_failure_is_raises_and_reproduces(toy_registry: None, dtype: str) -> None:
    record = execute.run_cell(toy_cell("none", dtype))
    assert record.outcome is Outcome.RAISES
    assert record.reproduces is True
    assert record.error_type == "RuntimeError"
    assert record.numerics is None


def test_different_error_is_raises_but_does_not_reproduce(toy_registry: None) -> None:
    record = execute.run_cell(toy_cell("other-error"))
    assert record.outcome is Outcome.RAISES
    assert record.reproduces is False
    assert "cannot be multiplied" in str(record.error_message)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_correct_fix_passes_with_its_figures(toy_registry: None, dtype: str) -> None:
    record = execute.run_cell(toy_cell("cast-input", dtype))
    assert record.outcome is Outcome.PASSES
    assert record.out_dtypes == (dtype,)
    assert record.attn_dtypes == (dtype,)
    assert record.numerics is not None
    assert 0 < record.numerics.rel_err <= record.numerics.tolerance
    # the reference fix's own cell: judged against rounding its data, never against itself
    assert record.numerics.baseline_rel_err is None
    assert record.numerics.decided_by in (f"rounding to {dtype}", f"eps({dtype})")


def test_fp32_control_passes_in_fp32(toy_registry: None) -> None:
    record = execute.run_cell(toy_cell("none", "float32", "fp32"))
    assert record.outcome is Outcome.PASSES
    assert record.out_dtypes == ("float32",)


def test_wrong_answer_is_inaccurate(toy_registry: None) -> None:
    record = execute.run_cell(toy_cell("noisy"))
    assert record.outcome is Outcome.INACCURATE
    assert record.numerics is not None
    assert record.numerics.finite
    assert record.numerics.rel_err > record.numerics.tolerance


def test_overflow_is_inaccurate_and_not_finite(toy_registry: None) -> None:
    record = execute.run_cell(toy_cell("overflow"))
    assert record.outcome is Outcome.INACCURATE
    assert record.numerics is not None and not record.numerics.finite


def test_same_cell_twice_gives_identical_figures(toy_registry: None) -> None:
    first = execute.run_cell(toy_cell("cast-input"))
    second = execute.run_cell(toy_cell("cast-input"))
    assert first.numerics == second.numerics


def test_skipped_and_crashed_records_carry_their_reason() -> None:
    cell = toy_cell("none")
    assert execute.skipped_record(cell, "why").skip_reason == "why"
    crashed = crashes.limit_record(
        cell, Outcome.CRASHED, "WorkerDied", "x" * 10_000, "gw1", CrashKind.WORKER_DIED
    )
    assert crashed.outcome is Outcome.CRASHED and crashed.crash_kind is CrashKind.WORKER_DIED
    assert len(str(crashed.error_message)) == errors.MAX_MESSAGE


@pytest.mark.parametrize(
    "cell",
    [
        Cell("dia-sdpa-kv-cache", "norm-to-compute-dtype", "cpu", "float16", "half", "sdpa"),
        Cell("sana-softmax-float", "sdpa", "cpu", "bfloat16", "half", "eager"),
        Cell(
            "var-normalize-promotion",
            "cast-to-main-type",
            "cpu",
            "float16",
            "autocast",
            "flash-attn-contract",
        ),
        Cell("lightning-encoder-fastpath", "half-true", "cpu", "bfloat16", "autocast", "sdpa"),
    ],
    ids=lambda c: c.case,
)
def test_a_seed_cell_run_twice_gives_bit_identical_output(cell: Cell) -> None:
    import torch

    from harness.measure.authoring import registry

    registry.discover()
    case = registry.get(cell.case)

    def output() -> torch.Tensor:
        ctx = fix_run.context_for(case, cell)
        run = fix_run.run_fix_checked(case, cell.fix, ctx)
        assert run.error is None and isinstance(run.output, torch.Tensor)
        return run.output

    first, second = output(), output()
    assert first.dtype == second.dtype and torch.equal(first, second)
