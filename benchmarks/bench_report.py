"""How long rendering a report takes, from 11 cells to 100k (``nox -s bench``).

Times ``report`` end to end as a user runs it: ``python -m harness report RUN_DIR...
--out FILE`` in a process of its own, by the wall clock (interpreter start-up and imports
included), with the peak resident memory of that process (``ru_maxrss`` of the children of
a fresh helper process per report, so one report's figure never carries another's; the
processes that read many runs in parallel are children of the report and counted as such:
the figure is the largest one's). Each figure is printed next to its target, PASS or MISS.

11 cells are a stored run of ``tests/data/runs`` cut short, twice: to its first 11 records
(all untimed: the correctness records come first), and to its first 11 cells with their
timed records (so the report draws a plot). 1k cells and more are synthetic runs built from
the stored result sets (the same records under other torch versions and hosts, a
nightly's worth). Every run is written as the current schema writes it (the stored runs
are of older ones), so the report reads it as a fresh run's. Also timed, in this process:
reading the results files alone, and ``compare`` over the same cells: each run against its
sibling of the other torch version (half the cells against the other half, with real
outcome and speed changes).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

from harness.report.aggregate import load_runs, load_runs_for_report
from harness.report.compare import compare_runs, render_comparison
from harness.results import storage
from harness.schema.records import CellRecord

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "tests" / "data" / "runs").iterdir())
SIZES = (11, 1_000, 10_000, 100_000)
RELEASES = ("2.1.2", "2.2.2", "2.3.1", "2.4.1", "2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1",
            "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1")  # fmt: skip
#: Per size: the most seconds (wall clock, start-up included) and megabytes (peak RSS) a
#: report may take; None where there is no target.
TARGETS: dict[int, tuple[float | None, float | None]] = {11: (1.0, None), 100_000: (5.0, 500.0)}
#: The stored run that the smallest reports are cut from: it has timed cells.
SMALL_SOURCE = ROOT / "tests" / "data" / "runs" / "torch-2.13.0"


@cache
def current_lines(source: Path) -> tuple[dict[str, Any], ...]:
    """The lines of ``source``'s results as the current schema writes them."""
    return tuple(
        CellRecord.from_dict(json.loads(line)).to_dict()
        for line in (source / storage.CELLS_FILE).read_text().splitlines()
    )


def written(lines: Iterable[dict[str, Any]]) -> str:
    return "".join(json.dumps(line, allow_nan=False) + "\n" for line in lines)


def synthetic_run(source: Path, folder: Path, version: str, host: str) -> int:
    """A copy of ``source`` as if measured with torch ``version`` on ``host``."""
    folder.mkdir(parents=True)
    env = replace(storage.read_env(source), torch_version=version, hostname=host)
    storage.write_env(folder, env)
    (folder / storage.CASES_FILE).write_text((source / storage.CASES_FILE).read_text())
    lines = [line | {"torch_version": version} for line in current_lines(source)]
    (folder / storage.CELLS_FILE).write_text(written(lines))
    return len({CellRecord.from_dict(line).cell for line in lines})


def synthetic_runs(root: Path, target: int) -> tuple[list[Path], int]:
    """Runs of every release on a few hosts until ``target`` cells: a nightly's worth."""
    runs, cells, n = [], 0, 0
    while cells < target:
        source = SOURCES[n % len(SOURCES)]
        folder = root / f"run{n}"
        release = RELEASES[(n // len(SOURCES)) % len(RELEASES)]
        host = f"gpu-host-{n // (len(SOURCES) * len(RELEASES))}"
        cells += synthetic_run(source, folder, release, host)
        runs.append(folder)
        n += 1
    return runs, cells


def cut_run(source: Path, folder: Path, cells: int, timed: bool) -> int:
    """``source`` cut to its first ``cells`` records, or (``timed``) to its first ``cells``
    cells with every line of each (a cell's correctness record and its timed one)."""
    folder.mkdir(parents=True)
    for name in (storage.ENV_FILE, storage.CASES_FILE):
        (folder / name).write_text((source / name).read_text())
    lines = current_lines(source)
    if not timed:
        chosen_lines = lines[:cells]
    else:
        ids = [record.cell.id for record in storage.read_record_lines(source)]
        chosen = set(list(dict.fromkeys(ids))[:cells])
        chosen_lines = tuple(line for line, cell in zip(lines, ids, strict=True) if cell in chosen)
    (folder / storage.CELLS_FILE).write_text(written(chosen_lines))
    return len(storage.read_records(folder))


def reports_of(root: Path, target: int) -> list[tuple[str, list[Path], int]]:
    """The reports of a size, each as (what it is, its runs, its cells): below the stored
    run's size, the run cut short untimed and timed; else synthetic runs."""
    if target >= len(storage.read_records(SMALL_SOURCE)):
        runs, cells = synthetic_runs(root, target)
        return [("", runs, cells)]
    return [
        (what, [root / what], cut_run(SMALL_SOURCE, root / what, target, timed))
        for what, timed in (("untimed", False), ("timed", True))
    ]


def measured(command: list[str]) -> dict[str, float]:
    """``command``'s wall-clock seconds, its peak RSS in MB and exit code, taken by a fresh
    helper process (this module, ``--measure``) whose only child it is."""
    helper = [sys.executable, __file__, "--measure", *command]
    result = subprocess.run(helper, capture_output=True, text=True, check=True)
    figures: dict[str, float] = json.loads(result.stdout.splitlines()[-1])
    return figures


def measure(command: list[str]) -> int:
    """In the helper: run ``command`` from the project's root, print its figures as JSON on
    the last line."""
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    if done.returncode:
        print(done.stderr, file=sys.stderr)
    print(json.dumps({"s": seconds, "mb": peak_kib / 1024, "rc": done.returncode}))
    return 0


def verdict(value: float, limit: float | None, unit: str) -> str:
    """``1.20 s``, with `` (target < 5 s: PASS)`` where the size has a target."""
    shown = f"{value:.2f} s" if unit == "s" else f"{value:.0f} MB"
    if limit is None:
        return shown
    return f"{shown} (target < {limit:g} {unit}: {'PASS' if value < limit else 'MISS'})"


def time_report(runs: list[Path], out: Path, target: int) -> str:
    """One end-to-end report: wall time and peak RSS with their targets, HTML size."""
    command = [sys.executable, "-m", "harness", "report", *map(str, runs), "--out", str(out)]
    figures = measured(command)
    if figures["rc"]:
        return f"FAILED with exit code {figures['rc']:.0f}"
    seconds, megabytes = TARGETS.get(target, (None, None))
    return (
        f"{verdict(figures['s'], seconds, 's')}, peak RSS "
        f"{verdict(figures['mb'], megabytes, 'MB')}, {out.stat().st_size / 1e6:.2f} MB of HTML"
    )


def time_reading(runs: list[Path]) -> float:
    """Seconds to read the runs as ``report`` does (one process per core for many)."""
    started = time.perf_counter()
    load_runs_for_report(runs)
    return time.perf_counter() - started


def time_compare(runs: list[Path]) -> tuple[float, int]:
    """Seconds to compare every run with its sibling of the other torch version (the stored
    sets come in pairs), reading included, and the number of changes found. scipy (which
    ``compare`` imports at its first speed change, half a second) is imported first, as
    before it was imported with the module: this times comparing, not importing."""
    import scipy.stats  # noqa: F401

    started = time.perf_counter()
    changes = 0
    for base, head in zip(runs[0::2], runs[1::2], strict=False):
        before, after = load_runs([base, head])
        comparison = compare_runs(before, after)
        render_comparison(comparison)
        changes += len(comparison.changes)
    return time.perf_counter() - started, changes


def main(sizes: tuple[int, ...] = SIZES) -> int:
    for target in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            for what, runs, cells in reports_of(Path(tmp) / "runs", target):
                line = time_report(runs, Path(tmp) / "out" / f"report{what}.html", target)
                print(
                    f"report over {cells} cells{f' ({what})' if what else ''} in {len(runs)} "
                    f"run(s), end to end: {line}; reading alone {time_reading(runs):.2f} s",
                    flush=True,
                )
            if len(runs) > 1:
                compared, changes = time_compare(runs)
                print(
                    f"compare over the same {cells} cells, {len(runs) // 2} pairs of runs: "
                    f"{compared:.1f} s, {changes} changes",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--measure"]:
        sys.exit(measure(sys.argv[2:]))
    sys.exit(main(tuple(int(n) for n in sys.argv[1:]) or SIZES))
