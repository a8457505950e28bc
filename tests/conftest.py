"""Shared fixtures: a registry that each test can fill without leaking into others."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from harness.measure.authoring import registry
from harness.measure.host import caches

pytest_plugins = ["pytester"]

# Peaks measured by the tests' runs go to a cache of their own, not the user's.
os.environ.setdefault("AMPMATRIX_CACHE_DIR", tempfile.mkdtemp(prefix="ampmatrix-test-cache-"))

ROOT = Path(__file__).resolve().parent.parent
# The processes the tests start (``python -m harness``, pytester's pytest) import the
# project from this checkout, whether or not ampmatrix is installed in the interpreter.
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
)

FIXTURES = Path(__file__).parent / "fixtures"
TOY_CASES = FIXTURES / "cases"
BROKEN_CASES = FIXTURES / "broken_cases"
CONTRACT_CASES = FIXTURES / "contract_cases"


def plugin_installed() -> bool:
    """Whether ampmatrix's pytest11 entry point loads the plugin in a new pytest."""
    from importlib.metadata import entry_points

    return any(ep.value == "harness.plugin" for ep in entry_points(group="pytest11"))


#: What a pytest started by a test needs to load the plugin: nothing where ampmatrix is
#: installed (its entry point does), else the plugin by name (loading it twice would fail).
PLUGIN_ARGS: tuple[str, ...] = () if plugin_installed() else ("-p", "harness.plugin")


def harness(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m harness ARGS`` from the project root, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "harness", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_cases(
    cases_dir: Path, cases: str, out: Path, *extra: str
) -> subprocess.CompletedProcess[str]:
    """``harness run`` of some cases of a folder on the CPU, correctness only, on two
    workers (the same cells on a GPU box as on CI)."""
    return harness(
        "run", "--cases-dir", str(cases_dir), "--case", cases, "--device", "cpu",
        "--no-timing", "-n", "2", "--out", str(out), *extra,
    )  # fmt: skip


def only_run_dir(root: Path) -> Path:
    """The single run folder a test's ``--out`` received."""
    (run_dir,) = root.iterdir()
    return run_dir


@pytest.fixture
def fresh_caches() -> Iterator[None]:
    """Every process-global cache empty for the test, and emptied again after it: what a
    test computed (from its own cases, or under a monkeypatch) reaches no test after it."""
    caches.reset()
    yield
    caches.reset()


@pytest.fixture
def clean_registry(fresh_caches: None) -> Iterator[None]:
    """An empty registry, restored (with sys.modules) after the test."""
    saved = dict(registry._REGISTRY)
    saved_modules = set(sys.modules)
    registry.clear()
    yield
    registry.clear()
    registry._REGISTRY.update(saved)
    for name in set(sys.modules) - saved_modules:
        if name.startswith(("cases.", "ampmatrix_external_")):
            del sys.modules[name]


@pytest.fixture
def toy_registry(clean_registry: None) -> None:
    """Only the toy external case registered."""
    for path in registry.case_module_paths(TOY_CASES):
        registry._import_case_module(path)


@pytest.fixture(scope="session")
def nf() -> ModuleType:
    """The project's ``noxfile`` as a module (its sessions' helpers, tested as functions)."""
    pytest.importorskip("nox", reason="nox is not installed here")
    sys.path.insert(0, str(ROOT))
    try:
        import noxfile as module
    finally:
        sys.path.remove(str(ROOT))
    return module
