"""The ``fit`` stage (``harness.measure.running.fitting``): updates lost to the weights' rounding,
the GradScaler's skipped steps, the verdict on a fit's figures, the figures' round trip
through a record, and ``check --stage fit`` end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from cases.bf16_pure_weights import MasterWeightsAdamW
from harness.measure.authoring.losses import TrainingError
from harness.measure.authoring.recipes import Recipe, adamw
from harness.measure.precision.modes import Precision
from harness.measure.running import fitting
from harness.measure.running.fitting import (
    LOST_WORTH_SAYING,
    SHORTFALL_LIMIT,
    FitRun,
    fit,
    fit_figures,
    shortfall,
    stall_reason,
)
from harness.results import storage
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, FitFigures, NoteKind, Outcome
from tests.conftest import FIXTURES, only_run_dir

CPU = torch.device("cpu")


def block(dtype: torch.dtype) -> tuple[nn.Module, torch.Tensor]:
    """A Linear and a LayerNorm, 32 wide, and a batch of inputs, in ``dtype``: the weights
    of about 0.1 whose bfloat16 ulp (2**-11 and up) is above twice an update of 1e-4, and
    the LayerNorm's unit weights (ulp 2**-7)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32))
    return model.to(dtype), torch.randn(16, 32).to(dtype)


def fitted(
    dtype: torch.dtype,
    mode: str,
    lr: float,
    make_optimizer: Callable[[list[torch.Tensor], float], torch.optim.Optimizer] | None = None,
    steps: int = 8,
) -> FitRun:
    model, x = block(dtype if mode != "autocast" else torch.float32)
    target = torch.randn(16, 32, generator=torch.Generator().manual_seed(1))
    return fit(
        lambda: model(x),
        lambda out: (out.float() - target).pow(2).mean(),
        model,
        Precision(CPU, dtype, mode),
        Recipe(make_optimizer or adamw, lr),
        steps=steps,
    )


def test_pure_bfloat16_at_a_small_rate_loses_its_updates_where_master_weights_keep_them() -> None:
    reference = fitted(torch.float64, "half", 1e-4).losses
    pure = fit_figures(fitted(torch.bfloat16, "half", 1e-4), reference)
    master = fit_figures(fitted(torch.bfloat16, "half", 1e-4, MasterWeightsAdamW), reference)
    assert pure.lost_share > 0.7  # AdamW's steps of ~1e-4 are below half an ulp
    reason = stall_reason(pure)
    assert reason is not None and "stalls" in reason
    assert master.lost_share < 0.05  # the float32 masters receive them
    assert stall_reason(master) is None
    assert len(pure.losses) == len(master.losses) == 9


def test_a_grad_scaler_skips_the_steps_whose_gradients_overflow_and_lowers_its_scale() -> None:
    """The squared output summed: its gradients, scaled by the GradScaler's first scales
    (2**16, 2**15), overflow float16 in the backward; at 2**14 they fit."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    x = torch.randn(4, 8) * 0.5
    run = fit(
        lambda: model(x),
        lambda out: out.float().pow(2).sum(),
        model,
        Precision(CPU, torch.float16, "autocast"),
        steps=5,
    )
    assert (run.skipped_steps, run.final_scale) == (2, 2.0**14)
    assert run.note is not None and "skipped 2 of 5 step(s)" in run.note.text
    assert run.losses[0] == run.losses[2] > run.losses[-1]  # no step taken, then three
    assert all(math.isfinite(v) for v in run.losses)


def figures(**changed: Any) -> FitFigures:
    """A healthy fit's figures: the float64 fit goes from 1.0 to 0.5, the cell's to 0.52."""
    values: dict[str, Any] = dict(
        losses=(1.0, 0.75, 0.52),
        reference_losses=(1.0, 0.75, 0.5),
        skipped_steps=0,
        final_scale=None,
        lost_share=0.01,
        shortfall=shortfall(0.52, (1.0, 0.75, 0.5)),
    )
    return FitFigures(**(values | changed))


def test_shortfall_is_judged_by_the_smaller_of_the_float64_fits_progress_and_last_loss() -> None:
    assert shortfall(0.52, (1.0, 0.5)) == pytest.approx(0.04)
    assert shortfall(0.4, (1.0, 0.5)) == 0.0  # beyond the float64 fit: no shortfall
    assert shortfall(1.0, (1.0, 0.5)) == 1.0
    assert shortfall(float("nan"), (1.0, 0.5)) == math.inf
    # a slow fit is judged by its progress: 63% of 1.158 -> 1.092 is missed
    assert shortfall(1.134, (1.158, 1.092)) == pytest.approx(0.636, abs=1e-3)
    # a fit that went far is judged by its last loss: 0.0483 is 3.6 of 0.0105 beyond it,
    # while only 0.6% short of its progress
    assert shortfall(0.0483, (6.02, 0.0105)) == pytest.approx(3.6, abs=0.01)
    assert shortfall(0.9, (1.0, 1.0)) == 0.0  # no progress: judged by the last loss alone
    assert shortfall(0.9, (0.0, 0.0)) is None  # no scale to judge by


def test_stall_reason_names_where_the_fit_ends() -> None:
    assert stall_reason(figures()) is None
    not_finite = stall_reason(figures(losses=(1.0, float("nan"), float("nan"))))
    assert not_finite == "the fit's loss is not finite from step 1"
    skipped = stall_reason(figures(skipped_steps=2, final_scale=16384.0))
    assert skipped is not None and "skipped every step" in skipped and "16384" in skipped
    assert stall_reason(figures(skipped_steps=1, final_scale=32768.0)) is None
    short = figures(losses=(1.0, 0.9, 0.8), shortfall=shortfall(0.8, (1.0, 0.75, 0.5)))
    assert short.shortfall is not None and short.shortfall > SHORTFALL_LIMIT
    short_reason = stall_reason(short)
    assert short_reason is not None and "60% short of the float64 fit's progress" in short_reason
    far = (6.02, 1.0, 0.0105)
    beyond = figures(losses=(6.02, 1.1, 0.0483), reference_losses=far,
                     shortfall=shortfall(0.0483, far))  # fmt: skip
    assert (
        stall_reason(beyond)
        == "the fit stalls: its loss ends at 0.0483, 4.6x the float64 fit's 0.0105"
    )


def test_updates_lost_are_evidence_not_a_verdict() -> None:
    """A bfloat16 fit that rounds away 37% of its updates and ends within 2.3% of the
    float64 fit's loss passes; the share lost is said beside it."""
    within = figures(losses=(2.0, 1.6, 1.023), reference_losses=(2.0, 1.5, 1.0),
                     lost_share=0.37, shortfall=shortfall(1.023, (2.0, 1.5, 1.0)))  # fmt: skip
    assert stall_reason(within) is None
    said = fitting.evidence(within)
    assert said is not None and "37% of the updates" in said
    assert fitting.evidence(figures(lost_share=LOST_WORTH_SAYING / 2)) is None


def test_fit_figures_round_trip_through_a_record_a_nan_loss_included() -> None:
    nan = float("nan")
    kept = figures(losses=(1.0, nan, nan), shortfall=math.inf, skipped_steps=1,
                   final_scale=32768.0)  # fmt: skip
    cell = Cell("toy", "none", "cpu", "float16", "autocast", "eager", stage="fit")
    record = CellRecord(cell, torch.__version__, Outcome.INACCURATE, fit=kept)
    line = json.dumps(record.to_dict())
    back = CellRecord.from_dict(json.loads(line)).fit
    assert back is not None
    assert back.losses[0] == 1.0 and all(math.isnan(v) for v in back.losses[1:])
    assert (back.reference_losses, back.skipped_steps, back.final_scale) == (
        kept.reference_losses, 1, 32768.0,
    )  # fmt: skip
    assert (back.lost_share, back.shortfall, back.steps) == (0.01, math.inf, 2)
    # JSON written by another tool says null for a loss that is not finite
    data = record.to_dict()
    data["fit"]["losses"] = [1.0, None, None]
    nulls = CellRecord.from_dict(data).fit
    assert nulls is not None and math.isnan(nulls.losses[1])


def check(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m harness check fit_model:build`` from the fixtures folder, as a user runs
    it on a module of theirs: float16 on the CPU, under autocast, no timing."""
    return subprocess.run(
        [sys.executable, "-m", "harness", "check", "fit_model:build", "--stage", "fit",
         "--device", "cpu", "--dtype", "float16", "--mode", "autocast", "--no-timing",
         "-n", "0", "--out", str(out), *args],
        cwd=FIXTURES, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_check_stage_fit_records_each_cells_fit(tmp_path: Path) -> None:
    result = check(tmp_path, "--fit-steps", "3")
    assert result.returncode == 0, result.stderr
    records = storage.read_records(only_run_dir(tmp_path))
    fits = [r for r in records if r.cell.stage == "fit"]
    assert [r.cell.mode for r in fits] == ["autocast"]
    for record in fits:
        assert record.outcome is Outcome.PASSES, record
        assert record.fit is not None and len(record.fit.losses) == 4
        assert len(record.fit.reference_losses) == 4
    scaled = next(r for r in fits if r.cell.mode == "autocast")
    assert scaled.fit is not None and scaled.fit.final_scale is not None


def test_a_fit_not_finite_from_its_first_step_says_why_once(tmp_path: Path) -> None:
    """float16 half weights under the default AdamW (eps 1e-8 is 0 in float16): one note
    naming the cause, where the record said it twice and then a third time in part."""
    result = check(tmp_path, "--fit-steps", "3", "--mode", "half")
    assert result.returncode == 0, result.stderr
    records = storage.read_records(only_run_dir(tmp_path))
    (fit,) = [r for r in records if r.cell.stage == "fit" and r.cell.mode == "half"]
    assert fit.outcome is Outcome.INACCURATE
    (note,) = [n.text for n in fit.notes if n.kind is NoteKind.FIT]
    assert note.startswith("the fit's loss is not finite from step 1: AdamW's eps (1e-08)")


def test_check_refuses_zero_fit_steps_in_one_line(tmp_path: Path) -> None:
    result = check(tmp_path, "--fit-steps", "0")
    assert result.returncode == 2, result.stderr
    *usage, error = result.stderr.strip().splitlines()  # argparse's usage, then one line
    assert error == (
        "ampmatrix check: error: argument --fit-steps: '0' is not a whole number of steps "
        "from 1 to 10000"
    )
    assert usage[0].startswith("usage: ampmatrix check") and "Traceback" not in result.stderr
    assert not any(tmp_path.iterdir())


def test_the_fit_steps_setting_is_the_processs() -> None:
    before = fitting.fit_steps()
    try:
        fitting.use_steps(3)
        assert fitting.fit_steps() == 3
    finally:
        fitting.use_steps(before)


def test_a_float16_adam_fit_not_finite_from_its_first_step_names_eps() -> None:
    """AdamW's eps of 1e-8 is 0 in float16: the fit's note says so, not only that the loss
    went non-finite; in bfloat16 (smallest normal 1e-38) the same eps holds."""
    run = fitted(torch.float16, "half", 1e-3, steps=2)
    assert not torch.isfinite(run.losses[1:]).all()
    assert run.note is not None and run.note.text.startswith(
        "the fit's loss is not finite from step 1: AdamW's eps (1e-08) is below float16's "
        "smallest normal (6.1e-05) and is 0 in it"
    )
    assert fitted(torch.bfloat16, "half", 1e-3, steps=2).cause is None


def test_an_optimizer_that_refuses_sparse_gradients_is_one_line_naming_it() -> None:
    torch.manual_seed(0)
    model = nn.Embedding(10, 4, sparse=True)
    ids = torch.tensor([1, 2, 3])
    with pytest.raises(TrainingError) as raised:
        fit(lambda: model(ids), lambda out: out.pow(2).mean(), model,
            Precision(CPU, torch.float32, "fp32"), steps=1)  # fmt: skip
    assert str(raised.value) == (
        "the fit's optimizer, AdamW, does not take sparse gradients (grad.weight is sparse): "
        "name a recipe whose optimizer does (torch.optim.SparseAdam, SGD)"
    )
