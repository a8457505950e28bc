"""The train stage: one training step with the recipe of the cell's mode, its loss and every
gradient judged against a float64 step, a failure in backward recorded where it arose."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.measure.authoring.losses import TrainingError, default_loss
from harness.measure.precision.modes import Precision
from harness.measure.running.recipe_steps import scaler_policy
from harness.measure.running.training import (
    scalar_loss,
    train_step,
    trainable_parameters,
)
from harness.results import storage
from harness.schema.axes import DYNAMIC_SCALER, NO_SCALER
from harness.schema.records import CellRecord, NoteKind, Outcome
from tests.conftest import ROOT, harness, only_run_dir

CASE = "custom-function-autocast"
#: The line of the case's backward that multiplies a half gradient by a float32 weight.
REFUSED = next(
    number
    for number, line in enumerate((ROOT / "cases" / "custom_function_autocast.py").open(), 1)
    if "grad_x = grad_out @ weight" in line
)


@pytest.fixture(scope="module")
def custom_function_run(tmp_path_factory: pytest.TempPathFactory) -> list[CellRecord]:
    out = tmp_path_factory.mktemp("custom-function")
    result = harness(
        "run", "--case", CASE, "--stage", "all", "--device", "cpu", "--no-timing", "-n", "0",
        "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return storage.read_records(only_run_dir(out))


def cells(records: list[CellRecord], **axes: str) -> list[CellRecord]:
    return [r for r in records if all(getattr(r.cell, k) == v for k, v in axes.items())]


def test_a_function_without_custom_fwd_passes_forward_and_raises_in_backward(
    custom_function_run: list[CellRecord],
) -> None:
    forward = cells(custom_function_run, fix="none", stage="forward")
    assert forward and {r.outcome for r in forward} == {Outcome.PASSES}
    for dtype, name in (("float16", "Half"), ("bfloat16", "BFloat16")):
        (trained,) = cells(
            custom_function_run, fix="none", stage="train", mode="autocast", dtype=dtype
        )
        assert trained.outcome is Outcome.RAISES and trained.reproduces, trained.error_message
        assert name in (trained.error_message or "") and "float" in (trained.error_message or "")
        # the trail names the backward's matmul, in the case's own code, and what met there
        assert trained.trail is not None and trained.trail.failure_site is not None
        failure = trained.trail.failure_site.describe()
        assert "aten::mm" in failure and f"custom_function_autocast.py:{REFUSED}" in failure, (
            failure
        )


def test_its_fixes_train_and_every_gradient_is_judged(
    custom_function_run: list[CellRecord],
) -> None:
    for fix in ("custom-fwd-bwd", "cast-grad-to-saved", "custom-fwd-cast-inputs"):
        trained = cells(custom_function_run, fix=fix, stage="train")
        assert {r.outcome for r in trained} == {Outcome.PASSES}, fix
        for record in trained:
            leaf = record.numerics.leaf if record.numerics else None
            assert leaf is not None and (leaf == "loss" or leaf.startswith("grad.")), leaf


def test_a_float16_autocast_step_trains_with_a_grad_scaler() -> None:
    cpu = torch.device("cpu")
    assert scaler_policy(Precision(cpu, torch.float16, "autocast"), None) == DYNAMIC_SCALER
    assert scaler_policy(Precision(cpu, torch.bfloat16, "autocast"), None) == NO_SCALER
    # half weights in float16 scale too, at a scale the harness holds (see holds_scale)
    assert scaler_policy(Precision(cpu, torch.float16, "half"), None) == DYNAMIC_SCALER
    assert scaler_policy(Precision(cpu, torch.float16, "half-autocast"), None) == DYNAMIC_SCALER
    assert scaler_policy(Precision(cpu, torch.bfloat16, "half"), None) == NO_SCALER
    assert scaler_policy(Precision(cpu, torch.float64, "half"), None) == NO_SCALER


def test_a_scaler_that_skips_steps_says_so_and_the_step_runs_at_a_smaller_scale() -> None:
    """Gradients of about 2**10 overflow float16 at the default scale 2**16: the scaler
    skips, halves, and the step runs once its gradients are finite."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    step = train_step(
        lambda: layer(x) * 1024.0,
        lambda out: out.float().pow(2).mean(),
        layer,
        Precision(torch.device("cpu"), torch.float16, "autocast"),
    )
    assert step.note is not None and step.note.kind is NoteKind.SCALER
    assert "GradScaler skipped" in step.note.text and "the step ran at scale" in step.note.text
    assert all(torch.isfinite(g).all() for g in step.leaves.values())


def test_a_model_that_cannot_be_trained_is_named() -> None:
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)
    with pytest.raises(TrainingError, match="no trainable parameters"):
        trainable_parameters(frozen)
    with pytest.raises(TrainingError, match="not a scalar: it has shape \\(2, 4\\)"):
        scalar_loss(torch.ones(2, 4, requires_grad=True))
    with pytest.raises(TrainingError, match="not a tensor"):
        scalar_loss("loss")
    with pytest.raises(TrainingError, match="no floating tensor"):
        default_loss(torch.ones(3, dtype=torch.long))


def check_train(folder: Path, body: str) -> subprocess.CompletedProcess[str]:
    (folder / "mymodel.py").write_text(body)
    return subprocess.run(
        [sys.executable, "-m", "harness", "check", "mymodel:build", "--stage", "train",
         "--device", "cpu", "--no-timing", "-n", "0", "--out", str(folder / "results")],
        cwd=folder, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip


def test_check_trains_a_model_of_yours(tmp_path: Path) -> None:
    result = check_train(
        tmp_path,
        "import torch\n\ndef build():\n    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(),"
        " torch.nn.Linear(16, 4)), {'input': torch.randn(8, 16)}\n",
    )
    assert result.returncode == 0, result.stderr
    records = storage.read_records(only_run_dir(tmp_path / "results"))
    assert {r.cell.stage for r in records} == {"train"}
    assert {r.outcome for r in records} == {Outcome.PASSES}
    assert "build  (stage train)" in result.stdout  # a train table says its stage


def test_check_of_a_model_with_nothing_to_train_is_recorded_not_a_traceback(
    tmp_path: Path,
) -> None:
    result = check_train(
        tmp_path,
        "import torch\n\ndef build():\n"
        "    return torch.nn.Linear(4, 4).requires_grad_(False), {'input': torch.randn(2, 4)}\n",
    )
    assert "Traceback" not in result.stderr
    records = storage.read_records(only_run_dir(tmp_path / "results"))
    assert records and all("no trainable parameters" in (r.error_message or "") for r in records)


def test_a_step_taken_again_gives_the_same_gradients() -> None:
    """The timing phase repeats a train cell's step: gradients must not accumulate."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8).to(torch.bfloat16)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    precision = Precision(torch.device("cpu"), torch.bfloat16, "half")
    first = train_step(lambda: layer(x), default_loss, layer, precision)
    again = train_step(lambda: layer(x), default_loss, layer, precision)
    assert first.leaves.keys() == again.leaves.keys()
    for name, grad in first.leaves.items():
        assert torch.equal(grad, again.leaves[name]), name


def test_float16_training_without_a_scaler_loses_a_small_terms_gradients(
    tmp_path: Path,
) -> None:
    result = harness(
        "run", "--case", "fp16-no-grad-scaler", "--stage", "train", "--device", "cpu",
        "--no-timing", "-n", "0", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = storage.read_records(only_run_dir(tmp_path))
    trained = cells(records, fix="none", dtype="float16", mode="autocast")
    by_scaler = {r.cell.scaler: r for r in trained if r.cell.stage == "train"}
    unscaled, scaled = by_scaler["none"], by_scaler["dynamic"]  # one fix, two rows
    assert unscaled.outcome is Outcome.INACCURATE and unscaled.numerics is not None
    assert unscaled.reproduces is True
    assert (unscaled.numerics.leaf or "").startswith("grad.aux_head.")  # silent: no error
    assert scaled.outcome is Outcome.PASSES and scaled.numerics is not None
    assert unscaled.numerics.rel_err > 20 * scaled.numerics.rel_err
    assert {r.outcome for r in cells(records, dtype="bfloat16")} == {Outcome.PASSES}


def test_a_timed_step_is_compared_by_its_loss_and_gradients() -> None:
    """A step whose scaler skipped carries a note: the timing's check that repeated calls
    compute the same compares the judged leaves, not the note."""
    from harness.measure.figures.cell_timing import same_output

    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    precision = Precision(torch.device("cpu"), torch.float16, "autocast")
    steps = [
        train_step(
            lambda: layer(x) * 1024.0, lambda out: out.float().pow(2).mean(), layer, precision
        )
        for _ in range(2)
    ]
    assert steps[0].note is not None
    assert same_output(steps[0], steps[1])


def test_lora_adapters_in_float16_are_refused_by_the_grad_scaler(tmp_path: Path) -> None:
    """LoRA on a float16 base under float16 AMP: the forward passes, and torch's GradScaler
    (the recipe's, not the case's code) refuses the adapters' float16 gradients; upcast
    adapters, or a float32 base, train; bfloat16 needs no scaler."""
    result = harness(
        "run", "--case", "lora-fp16-grad-scaler", "--stage", "forward,train", "--device",
        "cpu", "--no-timing", "-n", "0", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = storage.read_records(only_run_dir(tmp_path))
    assert {r.outcome for r in cells(records, stage="forward")} == {Outcome.PASSES}
    (refused,) = cells(records, fix="none", stage="train", dtype="float16", mode="autocast")
    assert refused.outcome is Outcome.RAISES and refused.reproduces, refused.error_message
    assert refused.error_type == "ValueError" and not refused.error_frames  # raised in torch
    trained = [r for r in cells(records, stage="train") if r is not refused]
    assert trained and {r.outcome for r in trained} == {Outcome.PASSES}
