"""Start-up of the commands a user waits on, with and without compiled bytecode
(``nox -s bench``).

``report`` of the stored run ``tests/data/runs/torch-2.13.0`` and ``check`` of a small
attention block on the CPU (``bench_check.BLOCK``, without the timing phase), each in a
fresh interpreter with PYTHONDONTWRITEBYTECODE=1 in both arms, as CI images run them:

- compiled: the environment as nox leaves it (site-packages compiled at install, the
  project's modules compiled by the session: ``INSTALL_OPTIONS`` in noxfile.py);
- uncompiled: the same interpreter and files, with PYTHONPYCACHEPREFIX naming a folder that
  holds the standard library's bytecode alone, so every other module is compiled from its
  source at each start, as in an environment installed without bytecode. The variable,
  unlike ``-X pycache_prefix``, reaches the processes a command starts.

The arms alternate, and each figure is the median of a few runs. One run of each command in
each arm under ``python -v`` counts the modules loaded from bytecode and those compiled from
source, by where they live: the uncompiled arm is refused if it loaded any module of the
environment or the project from bytecode (it would not measure what it says), and the
compiled arm shows what was left to compile at each start.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from bench_check import BLOCK

ROOT = Path(__file__).resolve().parent.parent
#: The stored run ``report`` renders.
STORED_RUN = ROOT / "tests" / "data" / "runs" / "torch-2.13.0"
#: The arms: variables set (a value) or removed (None) in the environment of every command.
COMPILED: dict[str, str | None] = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": None}
#: ``python -v``'s line for each module it executes: a quoted .pyc (loaded from bytecode) or
#: the source file (compiled from it).
CODE_OBJECT = re.compile(r"^# code object from '?(?P<path>[^']+?)'?$", re.MULTILINE)
#: Where a module lives, in the order a path is matched (the project may sit anywhere).
PLACES = ("site-packages", "project", "standard library", "elsewhere")


def commands(folder: Path) -> dict[str, list[str]]:
    """The commands timed, by the label printed, run in ``folder``."""
    python = [sys.executable, "-m", "harness"]
    records = sum(1 for line in (STORED_RUN / "cells.jsonl").open() if line.strip())
    report = [*python, "report", str(STORED_RUN), "--out", str(folder / "report.html")]
    check = [*python, "check", "mymodels:block", "--device", "cpu", "--no-timing"]
    check += ["--out", str(folder / "results")]
    return {
        f"report of a stored run ({records} records)": report,
        "check of an attention block (cpu, no timing)": check,
    }


@contextmanager
def pycache_prefix(prefix: str | None) -> Iterator[None]:
    """This interpreter's ``sys.pycache_prefix`` set to ``prefix`` for a while, so
    ``importlib.util.cache_from_source`` answers for it."""
    saved = sys.pycache_prefix
    sys.pycache_prefix = prefix
    try:
        yield
    finally:
        sys.pycache_prefix = saved


def standard_library_sources() -> Iterator[Path]:
    """The standard library's .py files, without any site-packages kept beneath it."""
    stdlib = Path(sysconfig.get_path("stdlib"))
    for folder, subfolders, files in os.walk(stdlib):
        subfolders[:] = [s for s in subfolders if s not in ("site-packages", "dist-packages")]
        yield from (Path(folder) / name for name in files if name.endswith(".py"))


def seed_standard_library(prefix: Path) -> int:
    """Link the standard library's bytecode, where the interpreter has it, to where it looks
    under ``prefix``: the uncompiled arm compiles the environment and the project, not what
    the interpreter's own installation compiled. The number of files linked."""
    linked = 0
    for source in standard_library_sources():
        with pycache_prefix(None):
            cached = Path(importlib.util.cache_from_source(str(source)))
        if not cached.is_file():
            continue
        with pycache_prefix(str(prefix)):
            target = Path(importlib.util.cache_from_source(str(source)))
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(cached, target)
        except OSError:  # another file system
            shutil.copyfile(cached, target)
        linked += 1
    return linked


def environment(arm: Mapping[str, str | None]) -> dict[str, str]:
    """This process's environment with the arm's variables, and the project importable (as
    an install makes it)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    for name, value in arm.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run(command: Sequence[str], folder: Path, arm: Mapping[str, str | None]) -> str:
    """Run ``command`` in ``folder`` under the arm; its stderr. A failure ends the bench."""
    done = subprocess.run(
        command, cwd=folder, capture_output=True, text=True, env=environment(arm)
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    return done.stderr


def timed(command: Sequence[str], folder: Path, arm: Mapping[str, str | None]) -> float:
    started = time.perf_counter()
    run(command, folder, arm)
    return time.perf_counter() - started


def place_of(path: str) -> str:
    """Which of PLACES a module's file lives in."""
    roots = {
        "site-packages": {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")},
        "project": {str(ROOT)},
        "standard library": {sysconfig.get_path("stdlib")},
    }
    for place in PLACES[:-1]:
        if any(path.startswith(root + os.sep) for root in roots[place]):
            return place
    return "elsewhere"


def loads(verbose: str, prefix: Path | None = None) -> Counter[tuple[str, str]]:
    """(place, "bytecode" or "source") -> modules, from a ``python -v`` stderr; a module's
    bytecode under ``prefix`` is placed where its source is."""
    counts: Counter[tuple[str, str]] = Counter()
    for match in CODE_OBJECT.finditer(verbose):
        path = match["path"]
        if prefix is not None and path.startswith(str(prefix) + os.sep):
            path = path[len(str(prefix)) :]
        how = "bytecode" if path.endswith(".pyc") else "source"
        counts[(place_of(path), how)] += 1
    return counts


def from_source(counts: Counter[tuple[str, str]]) -> str:
    """``site-packages 0 of 402, project 0 of 120, ...``: modules compiled from source of
    those executed, in each place that has any."""
    parts = []
    for place in PLACES:
        total = counts[(place, "source")] + counts[(place, "bytecode")]
        if total:
            parts.append(f"{place} {counts[(place, 'source')]} of {total}")
    return ", ".join(parts)


def compiled_in_uncompiled_arm(counts: Counter[tuple[str, str]]) -> int:
    """Modules of the environment or the project the uncompiled arm loaded from bytecode:
    none, or it does not measure what it says."""
    return counts[("site-packages", "bytecode")] + counts[("project", "bytecode")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder, prefix = Path(tmp) / "work", Path(tmp) / "bytecode"
        folder.mkdir()
        (folder / "mymodels.py").write_text(BLOCK)
        linked = seed_standard_library(prefix)
        arms = {
            "compiled": COMPILED,
            "uncompiled": {**COMPILED, "PYTHONPYCACHEPREFIX": str(prefix)},
        }
        timings: dict[str, dict[str, list[float]]] = {
            label: {arm: [] for arm in arms} for label in commands(folder)
        }
        print(
            "start-up with and without compiled bytecode (PYTHONDONTWRITEBYTECODE=1 in both; "
            f"the uncompiled arm keeps the standard library's {linked} compiled modules)\n"
            "  modules compiled from source at start, of those executed (python -v, one run):",
            flush=True,
        )
        for label, command in commands(folder).items():
            for arm, variables in arms.items():
                verbose = run([sys.executable, "-v", *command[1:]], folder, variables)
                counts = loads(verbose, prefix)
                print(f"    {label.split()[0]}, {arm}: {from_source(counts)}", flush=True)
                if arm == "uncompiled" and compiled_in_uncompiled_arm(counts):
                    raise SystemExit("the uncompiled arm loaded bytecode of the environment")
        for round_ in range(args.rounds):
            order = list(arms) if round_ % 2 == 0 else list(reversed(arms))
            for label, command in commands(folder).items():
                for arm in order:
                    timings[label][arm].append(timed(command, folder, arms[arm]))
        width = max(map(len, timings))
        print(f"  wall time, median of {args.rounds} runs, the arms alternated:")
        print(f"  {'':{width}}  compiled  uncompiled")
        for label, by_arm in timings.items():
            compiled, uncompiled = (statistics.median(by_arm[arm]) for arm in arms)
            print(
                f"  {label:{width}}  {compiled:6.2f} s  {uncompiled:8.2f} s  "
                f"({uncompiled / compiled:.1f}x)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
