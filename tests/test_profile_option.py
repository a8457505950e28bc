"""``check --profile`` end to end, as a user runs it: the divergence profile of every cell
that ran, passing ones too, in its record (the run option reaches ``run_cell`` through the
runner, in a forked child with ``-n 0`` and in the workers of ``-n 1``); without it a
passing cell has none."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.results import storage
from harness.schema.records import CellRecord, Outcome
from tests.conftest import FIXTURES, ROOT, only_run_dir

MODELS = FIXTURES / "training_models"


def checked(folder: Path, *args: str) -> list[CellRecord]:
    """The records of ``python -m harness check models:mlp ARGS`` in bfloat16 ``half`` on
    the CPU, forward only, no timing, from a user's folder holding ``models.py``."""
    shutil.copy(MODELS / "models.py", folder / "models.py")
    result = subprocess.run(
        [sys.executable, "-m", "harness", "check", "models:mlp", *args, "--device", "cpu",
         "--dtype", "bfloat16", "--mode", "half", "--stage", "forward", "--no-timing",
         "--out", str(folder / "results")],
        cwd=folder, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return storage.read_records(only_run_dir(folder / "results"))


@pytest.mark.parametrize("workers", ["0", "1"])
def test_profile_records_the_series_of_a_passing_cell(tmp_path: Path, workers: str) -> None:
    (record,) = checked(tmp_path, "--profile", "-n", workers)
    assert record.outcome is Outcome.PASSES and record.divergence is None
    assert record.profile is not None and record.profile.forward
    assert all(m.ratio <= record.profile.factor for m in record.profile.forward)


def test_without_profile_a_passing_cell_has_none(tmp_path: Path) -> None:
    (record,) = checked(tmp_path, "-n", "0")
    assert record.outcome is Outcome.PASSES and record.profile is None
