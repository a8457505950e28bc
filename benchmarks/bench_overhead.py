"""The correctness phase's cost per cell against plain pytest-xdist (``nox -s bench``).

Both sides run the same cells of many tiny cases (copies of the toy case, whose own work
is well under a millisecond), on the same number of pytest-xdist workers:

- the harness: ``python -m harness run --no-timing`` (every cell isolated in a forked
  process, its record fsynced);
- plain pytest: one parametrized test per cell calling ``harness.measure.execute.run_cell`` in the
  worker itself, the same comparison against the same float64 reference, no isolation and
  nothing written.

Printed: the wall time of each, per cell, and their ratio, alternating the two for
``--rounds`` rounds so that drift on a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "tests" / "fixtures" / "cases" / "toy_mixed_matmul.py"

PLAIN_TEST = """
import pytest
from harness.measure import execute
from harness.measure.authoring import registry
from harness.runner.matrix import expand
from harness.schema.selection import Selection

registry.discover([__CASES__])
CELLS = expand(registry.all_cases(), Selection(cases=tuple(__NAMES__), devices=("cpu",))).to_run


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_cell(cell):
    assert execute.run_cell(cell).outcome is not None
"""


def write_toy_cases(folder: Path, count: int) -> list[str]:
    """``count`` copies of the toy case, each with a name of its own."""
    source = TOY.read_text()
    names = []
    for n in range(count):
        name = f"toy-copy-{n}"
        text = source.replace('name = "toy-mixed-matmul"', f'name = "{name}"')
        text = re.sub(r"class ToyMixedMatmul", f"class ToyCopy{n}", text)
        (folder / f"toy_copy_{n}.py").write_text(text)
        names.append(name)
    return names


def timed(command: Sequence[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stdout[-2000:]}{result.stderr}")
    return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cases", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "cases"
        folder.mkdir()
        names = write_toy_cases(folder, args.cases)
        test_file = Path(tmp) / "test_plain.py"
        test_file.write_text(
            PLAIN_TEST.replace("__CASES__", repr(str(folder))).replace("__NAMES__", repr(names))
        )
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        harness = [sys.executable, "-m", "harness", "run", "--cases-dir", str(folder),
                   "--case", ",".join(names), "--device", "cpu", "--no-timing",
                   "-n", str(args.workers)]  # fmt: skip
        plain = [sys.executable, "-m", "pytest", str(test_file), "-q", "-p", "no:cacheprovider",
                 "-n", str(args.workers), "--rootdir", tmp]  # fmt: skip
        cells = len(names) * 11
        ours, theirs = [], []
        for n in range(args.rounds):
            ours.append(timed([*harness, "--out", str(Path(tmp) / f"out{n}")], env))
            theirs.append(timed(plain, env))
        mine, base = statistics.median(ours), statistics.median(theirs)
        print(
            f"correctness phase, {args.cases} toy cases, {cells} cells, {args.workers} workers "
            f"(median of {args.rounds}): harness {mine:.1f} s ({mine / cells * 1e3:.1f} ms a "
            f"cell), plain pytest-xdist {base:.1f} s ({base / cells * 1e3:.1f} ms a cell): "
            f"{mine / base:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
