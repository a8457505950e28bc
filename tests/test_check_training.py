"""``check --stage train`` end to end, as a user runs it: the loss they name (``--loss``,
``check_model(loss=...)``) and the order it takes against the model's own, and every bad
input a one-line error (exit 2, no run started) or a recorded outcome on each cell that
reads as the model's error, not a precision bug."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.measure.authoring.model_case import Matrix
from harness.results import storage
from harness.schema.axes import STAGES
from harness.schema.records import CellRecord, CrashKind, Outcome
from tests.conftest import FIXTURES, PLUGIN_ARGS, ROOT, only_run_dir

MODELS = FIXTURES / "training_models"


def check(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m harness check ...`` from a user's folder holding ``models.py`` and
    ``losses.py``: bfloat16 on the CPU, both default modes, no timing."""
    for module in ("models.py", "losses.py"):
        shutil.copy(MODELS / module, folder / module)
    return subprocess.run(
        [sys.executable, "-m", "harness", "check", *args, "--device", "cpu", "--dtype",
         "bfloat16", "--no-timing", "-n", "0", "--out", str(folder / "results")],
        cwd=folder, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def by_model(records: list[CellRecord], stage: str) -> dict[str, list[CellRecord]]:
    found: dict[str, list[CellRecord]] = {}
    for record in records:
        if record.cell.stage == stage:
            found.setdefault(record.cell.case, []).append(record)
    return found


def test_a_named_loss_trains_every_cell_and_wins_over_the_models_own(tmp_path: Path) -> None:
    result = check(
        tmp_path, "models:mlp", "models:positional_mlp", "models:row_loss", "--stage", "train",
        "--loss", "losses:against_input", "--loss", "row_loss=losses:mean_square",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    trained = by_model(storage.read_records(only_run_dir(tmp_path / "results")), "train")
    # the inputs reach a loss as the factory gave them: a dict, or a tuple of positional ones
    assert set(trained) == {"mlp", "positional-mlp", "row-loss"}
    for model, records in trained.items():
        assert len(records) == 2, model  # bfloat16 in autocast and in half
        assert {r.outcome for r in records} == {Outcome.PASSES}, (model, records[0])
    # row_loss's own loss is not a scalar: the cells pass because the named loss is taken


def test_stage_all_checks_every_stage_of_a_model(tmp_path: Path) -> None:
    result = check(
        tmp_path, "models:mlp", "--stage", "all", "--mode", "half", "--loss", "losses:mean_square"
    )
    assert result.returncode == 0, result.stderr
    records = storage.read_records(only_run_dir(tmp_path / "results"))
    assert sorted(r.cell.stage for r in records) == ["fit", "forward", "train"]
    assert {r.outcome for r in records} == {Outcome.PASSES}


def test_all_in_check_model_is_every_stage() -> None:
    assert Matrix(stages=("all",))["stages"] == STAGES
    assert Matrix(stages=("train",))["stages"] == ("train",)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("detached", "TrainingError: the loss does not depend on any trainable parameter"),
        ("in_place", "RuntimeError: one of the variables needed for gradient computation "
         "has been modified by an inplace operation"),
        ("frozen", "TrainingError: the model has no trainable parameters: nothing to train"),
        ("row_loss", "TrainingError: the loss is not a scalar: it has shape (4,)"),
        ("positional_mlp", "TrainingError: the loss losses:per_row is not a scalar: it "
         "returned shape (8,)"),
    ],
)  # fmt: skip
def test_a_model_that_cannot_train_is_a_model_error_on_every_train_cell(
    tmp_path: Path, model: str, message: str
) -> None:
    """Each fails in float64 as in every dtype: ``crashed`` (``reference-failed``) with its
    error on each train cell, its forward cells judged as they are, no traceback."""
    loss = ("--loss", "losses:per_row") if model == "positional_mlp" else ()
    result = check(tmp_path, f"models:{model}", "--stage", "forward,train", *loss)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    records = storage.read_records(only_run_dir(tmp_path / "results"))
    forward, trained = by_model(records, "forward"), by_model(records, "train")
    case = model.replace("_", "-")
    assert {r.outcome for r in forward[case]} == {Outcome.PASSES}
    assert len(trained[case]) == 2
    for record in trained[case]:
        assert record.outcome is Outcome.CRASHED
        assert record.crash_kind is CrashKind.REFERENCE_FAILED
        assert message in f"{record.error_type}: {record.error_message}"
    assert f"reference-failed: {message}" in result.stdout  # the table says why


@pytest.mark.parametrize(
    ("loss", "message"),
    [
        ("losses:nope", "--loss losses:nope: losses has no function 'nope'"),
        ("nomodule:f", "--loss nomodule:f: cannot import nomodule: ModuleNotFoundError"),
        ("notaname", "--loss 'notaname': expected MODULE:FUNC, e.g. mylosses:token_loss"),
        ("", "--loss '': expected MODULE:FUNC"),
        ("losses:not_a_function", "--loss losses:not_a_function: losses has no function"),
        ("losses:takes_three", "--loss losses:takes_three takes (output: 'Any', inputs: "
         "'Any', extra: 'Any') -> 'torch.Tensor': a loss takes (output) or (output, inputs)"),
        ("nofactory=losses:per_row", "--loss nofactory=losses:per_row: no target's factory "
         "is named 'nofactory' (targets: models:mlp)"),
    ],
)  # fmt: skip
def test_a_loss_that_cannot_be_used_is_one_line(tmp_path: Path, loss: str, message: str) -> None:
    result = check(tmp_path, "models:mlp", "--stage", "train", "--loss", loss)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("ampmatrix: error: ") and result.stderr.count("\n") == 1
    assert message in result.stderr
    assert not (tmp_path / "results").exists()  # no run was started


def test_a_loss_with_no_stage_that_trains_is_one_line(tmp_path: Path) -> None:
    result = check(tmp_path, "models:mlp", "--loss", "losses:mean_square")
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "the loss losses:mean_square is taken by a training step, and no stage trains: " \
        "ask for the stage train or fit too" in result.stderr  # fmt: skip
    assert not (tmp_path / "results").exists()


def test_two_losses_for_one_model_are_one_line(tmp_path: Path) -> None:
    result = check(
        tmp_path, "models:mlp", "--stage", "train",
        "--loss", "losses:mean_square", "--loss", "losses:against_input",
    )  # fmt: skip
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "models:mlp: two losses, --loss losses:mean_square and --loss " \
        "losses:against_input" in result.stderr  # fmt: skip


PLUGIN_TEST = """
import torch
from harness import check_model


def mean_square(output, inputs):
    assert set(inputs) == {"x"}
    return output["logits"].pow(2).mean()


class RowLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.proj(x)
        return {"logits": y, "loss": y.pow(2).mean(-1)}


@check_model(modes=("half",), stages=("forward", "train"), loss=mean_square)
def test_named():
    return RowLoss(), {"x": torch.randn(4, 8)}


@check_model(modes=("half",), stages=("forward", "train"))
def test_own():
    return RowLoss(), {"x": torch.randn(4, 8)}
"""


def test_check_model_takes_a_loss_before_the_models_own(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_losses=PLUGIN_TEST)
    result = pytester.runpytest_subprocess(*PLUGIN_ARGS, "-p", "no:cacheprovider", "-v")
    # named: every cell passes on the named loss; own: the train cells take the model's
    # loss, which is not a scalar (its forward cells pass)
    outcomes = {k: v for k, v in result.parseoutcomes().items() if k != "seconds"}
    assert outcomes == {"passed": 9, "failed": 3}, result.stdout.str()
    result.stdout.fnmatch_lines(["*test_own?float16-half-train? FAILED*"])
    result.stdout.fnmatch_lines(["*reference-failed: TrainingError: the loss is not a scalar*"])


def test_check_model_refuses_a_loss_it_would_never_take(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_unused="""
import torch
from harness import check_model

@check_model(loss=lambda output: output.sum())
def test_forward_only():
    return torch.nn.Linear(4, 4), {"input": torch.randn(2, 4)}
"""
    )
    result = pytester.runpytest_subprocess(*PLUGIN_ARGS, "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(
        ["*ModelCheckError: the loss <lambda> is taken by a training step, and no stage trains*"]
    )
    assert result.ret != 0


def test_check_model_runs_the_fit_cells_it_asks_for(pytester: pytest.Pytester) -> None:
    """A fit runs only where asked for: ``stages=("train", "fit")`` collects a fit cell per
    dtype and mode beside the train cells (before, the fit cells were left out)."""
    pytester.makepyfile(
        test_fit="""
import torch
from harness import check_model

@check_model(modes=("half",), dtypes=("bfloat16",), stages=("train", "fit"))
def test_fits():
    return torch.nn.Linear(8, 8), {"input": torch.randn(4, 8)}
"""
    )
    result = pytester.runpytest_subprocess(*PLUGIN_ARGS, "-p", "no:cacheprovider", "--co", "-q")
    collected = result.stdout.str()
    assert "bfloat16-half-fit" in collected and "bfloat16-half-train" in collected, collected


def test_scaler_trains_the_model_with_each_policy_named(tmp_path: Path) -> None:
    """``--scaler none,static`` puts an unscaled and a statically scaled train cell of each
    mode beside each other; the forward scales nothing and stays."""
    result = check(tmp_path, "models:mlp", "--stage", "all", "--scaler", "none,static")
    assert result.returncode == 0, result.stderr
    records = storage.read_records(only_run_dir(tmp_path / "results"))
    trained = {(r.cell.stage, r.cell.mode, r.cell.scaler) for r in records if r.cell.scales}
    assert trained == {
        (stage, mode, scaler)
        for stage in ("train", "fit")
        for mode in ("autocast", "half")
        for scaler in ("none", "static")
    }
    assert {r.cell.scaler for r in records if r.cell.stage == "forward"} == {"none"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--scaler", "dynamc", "--stage", "train"), "unknown scaler 'dynamc' (known: none,"),
        (("--scaler", "none"), "the scaler policy none is taken by a training step, and no"),
    ],
)
def test_a_scaler_check_cannot_use_is_one_line(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    result = check(tmp_path, "models:mlp", *args)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "results").exists()


def test_check_model_takes_scalers_as_check_takes_scaler() -> None:
    matrix = Matrix(stages=("train",), scalers=("none", "static"))
    assert matrix["scalers"] == ("none", "static") and Matrix()["scalers"] == ()
