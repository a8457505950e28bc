"""``benchmarks/bench_startup.py``'s uncompiled arm: what ``python -v`` says it compiled, and
that a pycache prefix holding the standard library's bytecode alone keeps that and ignores
the bytecode beside every other source."""

from __future__ import annotations

import compileall
import importlib.util
import os
import subprocess
import sys
import sysconfig
from collections import Counter
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The script, loaded by its path (with its folder importable, as when it runs)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "bench_startup", ROOT / "benchmarks" / "bench_startup.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_python_v_lines_are_counted_by_place_and_how(bench: ModuleType, tmp_path: Path) -> None:
    stdlib = sysconfig.get_path("stdlib")
    site = sysconfig.get_path("purelib")
    prefix = tmp_path / "bytecode"
    verbose = "\n".join(
        [
            f"# code object from '{prefix}{stdlib}/json/__init__.cpython-311.pyc'",
            f"# {site}/__pycache__/idna.cpython-311.pyc matches {site}/idna.py",  # not counted
            f"# code object from {site}/six.py",
            f"# code object from '{site}/__pycache__/idna.cpython-311.pyc'",
            f"# code object from {ROOT}/harness/cli.py",
            f"# code object from {tmp_path}/mymodels.py",
            "import 'json' # <_frozen_importlib_external.SourceFileLoader object>",
        ]
    )
    counts = bench.loads(verbose, prefix)
    assert counts == Counter(
        {
            ("standard library", "bytecode"): 1,
            ("site-packages", "source"): 1,
            ("site-packages", "bytecode"): 1,
            ("project", "source"): 1,
            ("elsewhere", "source"): 1,
        }
    )
    assert bench.from_source(counts) == (
        "site-packages 1 of 2, project 1 of 1, standard library 0 of 1, elsewhere 1 of 1"
    )
    assert bench.compiled_in_uncompiled_arm(counts) == 1


def loaded(tmp_path: Path, variables: dict[str, str]) -> str:
    """``python -v`` stderr of importing json and a compiled package of tmp_path."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(tmp_path)}
    env.pop("PYTHONPYCACHEPREFIX", None)
    done = subprocess.run(
        [sys.executable, "-v", "-c", "import json, mypackage"],
        capture_output=True,
        text=True,
        env={**env, **variables},
        check=True,
    )
    return done.stderr


def test_the_uncompiled_arm_keeps_the_standard_library_and_ignores_other_bytecode(
    bench: ModuleType, tmp_path: Path
) -> None:
    """The arm is what it says: the package, compiled beside its source, is compiled again
    from source under the prefix, and json comes from the bytecode linked there."""
    (tmp_path / "mypackage").mkdir()
    (tmp_path / "mypackage" / "__init__.py").write_text("VALUE = 1\n")
    assert compileall.compile_dir(tmp_path / "mypackage", quiet=1)
    if not Path(importlib.util.cache_from_source(json_source())).is_file():
        pytest.skip("this interpreter's standard library is not compiled")
    prefix = tmp_path / "bytecode"
    assert bench.seed_standard_library(prefix) > 0
    plain = bench.loads(loaded(tmp_path, {}))
    assert plain[("elsewhere", "bytecode")] == 1 and plain[("elsewhere", "source")] == 0
    arm = bench.loads(loaded(tmp_path, {"PYTHONPYCACHEPREFIX": str(prefix)}), prefix)
    assert arm[("elsewhere", "bytecode")] == 0 and arm[("elsewhere", "source")] == 1
    assert arm[("standard library", "bytecode")] >= 1
    assert arm[("standard library", "source")] == 0
    assert not list((tmp_path / "bytecode").rglob("mypackage*"))  # nothing written there


def json_source() -> str:
    import json

    return str(json.__file__)
