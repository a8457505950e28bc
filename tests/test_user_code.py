"""Users' code as it comes: a case or model module that changes torch's global settings as
it is imported, exits, crashes or hangs there, two models with one factory name, factories
that are not plain functions. Each verdict must be the one the code earns alone, and every
other end a one-line error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.results import storage
from harness.schema.records import CellRecord
from tests.conftest import FIXTURES, ROOT, harness, only_run_dir

LEAKING_CASES = FIXTURES / "leaking_cases"
#: The cells the leaked settings flipped (float16, through autocast): the Sana case's
#: fix that computes attention in float32, its trusted fix and the upstream path.
SANA = ("--case", "sana-softmax-float", "--dtype", "float16", "--size", "small")


def outcomes(records: list[CellRecord], case: str) -> dict[str, tuple[object, ...]]:
    return {
        r.cell.id: (r.outcome, r.reproduces, r.out_dtypes, r.numerics and r.numerics.rel_err)
        for r in records
        if r.cell.case == case
    }


def sana_run(out: Path, workers: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return harness(
        "run", *SANA, "--device", "cpu", "--no-timing", "-n", workers, "--out", str(out), *extra
    )  # fmt: skip


@pytest.mark.parametrize("workers", ["0", "1"])
def test_settings_a_case_module_changes_at_import_reach_no_cell(
    tmp_path: Path, workers: str
) -> None:
    alone = sana_run(tmp_path / "alone", workers)
    beside = sana_run(
        tmp_path / "beside", workers, "--case", "toy-leaks-settings", "--cases-dir",
        str(LEAKING_CASES),
    )  # fmt: skip
    assert alone.returncode == 0 and beside.returncode == 0, beside.stderr
    run_alone, run_beside = only_run_dir(tmp_path / "alone"), only_run_dir(tmp_path / "beside")
    case = "sana-softmax-float"
    expected = outcomes(storage.read_records(run_alone), case)
    assert outcomes(storage.read_records(run_beside), case) == expected
    # said once, in the output and in env.json, as what the module changed
    warnings = [line for line in beside.stderr.splitlines() if "leaks_settings.py" in line]
    assert len(warnings) == 1 and "default dtype torch.float32 -> torch.float16" in warnings[0]
    env = json.loads((run_beside / "env.json").read_text())
    (changes,) = env["import_changes"].values()
    assert "float32 matmul precision highest -> medium" in changes
    assert "backends.mkldnn.enabled True -> False" in changes
    # the environment recorded is torch's own, not the leaked one
    alone_env = json.loads((run_alone / "env.json").read_text())
    assert env["flags"] == alone_env["flags"] and alone_env["import_changes"] is None


def check(folder: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m harness check ...`` from a user's project folder."""
    return subprocess.run(
        [sys.executable, "-m", "harness", "check", *args, "--device", "cpu", "--no-timing",
         "--dtype", "bfloat16", "--mode", "half", "-n", "0", "--out", str(folder / "results")],
        cwd=folder, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )  # fmt: skip


def model_module(body: str, factory: str = "build", scale: float = 1.0) -> str:
    return (
        "import torch\n"
        f"{body}\n"
        f"def {factory}():\n"
        "    torch.manual_seed(0)\n"
        f"    return torch.nn.Linear(8, 8), {{'input': torch.randn(2, 8) * {scale}}}\n"
    )


def test_two_models_with_one_factory_name_are_each_checked(tmp_path: Path) -> None:
    (tmp_path / "dup_a.py").write_text(model_module(""))
    (tmp_path / "dup_b.py").write_text(
        "import torch\n\ndef build():\n    raise RuntimeError('only dup_b fails')\n"
    )
    result = check(tmp_path, "dup_a:build", "dup_b:build")
    assert "Traceback" not in result.stderr
    records = storage.read_records(only_run_dir(tmp_path / "results"))
    by_case: dict[str, set[str]] = {}
    for r in records:
        by_case.setdefault(r.cell.case, set()).add(r.outcome.value)
    assert set(by_case) == {"dup-a-build", "dup-b-build"}
    assert by_case["dup-a-build"] == {"passes"}
    assert "passes" not in by_case["dup-b-build"]  # the model that fails is the one that ran


def test_two_targets_that_would_share_a_name_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "a_b.py").write_text(model_module(""))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "__init__.py").write_text("")
    (tmp_path / "a" / "b.py").write_text(model_module(""))
    (tmp_path / "other.py").write_text(model_module(""))
    result = check(tmp_path, "a_b:build", "a.b:build", "other:build")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1
    assert "a_b:build and a.b:build would both be checked as 'a-b-build'" in result.stderr


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("import sys\nsys.exit(0)", "mod called sys.exit(0)"),
        ("import os\nos._exit(0)", "mod ended the process importing it (exit code 0)"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)",
         "mod ended the process importing it (signal 11, SIGSEGV)"),
        ("import time\nwhile True:\n    time.sleep(1)", "mod was still importing after 2 s"),
    ],
)  # fmt: skip
def test_a_model_module_that_exits_crashes_or_hangs_at_import_is_one_line(
    tmp_path: Path, body: str, message: str
) -> None:
    (tmp_path / "mod.py").write_text(model_module(body))
    result = check(tmp_path, "mod:build", AMPMATRIX_IMPORT_TIMEOUT="2")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("ampmatrix: error: mod:build: ")
    assert message in result.stderr and result.stderr.count("\n") == 1
    assert not (tmp_path / "results").exists()  # no run was started


def test_a_case_module_that_hangs_at_import_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "hangs.py").write_text("import time\nwhile True:\n    time.sleep(1)\n")
    result = subprocess.run(
        [sys.executable, "-m", "harness", "list", "--cases-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "AMPMATRIX_IMPORT_TIMEOUT": "2"},
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{tmp_path / 'hangs.py'}: was still importing after 2 s" in result.stderr


def test_an_import_time_limit_that_is_not_a_number_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "mod.py").write_text(model_module(""))
    result = check(tmp_path, "mod:build", AMPMATRIX_IMPORT_TIMEOUT="soon")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr == (
        "ampmatrix: error: AMPMATRIX_IMPORT_TIMEOUT: 'soon' is not a finite number of seconds"
        " above 0 and at most 86400\n"
    )


@pytest.mark.parametrize(
    "definition",
    [
        "import functools\nbuild = functools.partial(_build)",
        "class Builder:\n    def __call__(self):\n        return _build()\nbuild = Builder()",
    ],
)
def test_factories_that_are_not_plain_functions_are_checked(
    tmp_path: Path, definition: str
) -> None:
    (tmp_path / "mod.py").write_text(model_module("", factory="_build") + definition + "\n")
    result = check(tmp_path, "mod:build")
    assert result.returncode == 0, result.stderr
    records = storage.read_records(only_run_dir(tmp_path / "results"))
    assert {r.outcome.value for r in records} == {"passes"}
    assert {r.cell.case for r in records} == {"build"}


def test_a_builtin_named_as_a_factory_is_one_line(tmp_path: Path) -> None:
    result = check(tmp_path, "builtins:len")
    assert "Traceback" not in result.stderr
    records = storage.read_records(only_run_dir(tmp_path / "results"))
    assert all(
        r.outcome.value == "crashed" and "has no len()" in (r.error_message or "") for r in records
    )
