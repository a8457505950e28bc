"""How long rendering a report takes over a thousand cells and more (``nox -s bench``).

Builds synthetic runs from the stored result sets in ``tests/data/runs`` (the same records
under other torch versions and hosts), then times ``report`` end to end: reading the
results files (also shown on its own), aggregating, plotting and rendering the HTML; and
``compare`` over the same cells: each run against its sibling of the other torch version
(half the cells against the other half, with real outcome and speed changes).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from harness import storage
from harness.report.aggregate import load_runs, load_runs_for_report
from harness.report.compare import compare_runs, render_comparison
from harness.report.render import render_report, write_report

SOURCES = sorted((Path(__file__).resolve().parent.parent / "tests" / "data" / "runs").iterdir())
SIZES = (1_000, 10_000, 100_000)
RELEASES = ("2.1.2", "2.2.2", "2.3.1", "2.4.1", "2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1",
            "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1")  # fmt: skip


def synthetic_run(source: Path, folder: Path, version: str, host: str) -> int:
    """A copy of ``source`` as if measured with torch ``version`` on ``host``."""
    folder.mkdir(parents=True)
    env = storage.read_env(source) | {"torch_version": version, "hostname": host}
    storage.write_env(folder, env)
    (folder / storage.CASES_FILE).write_text((source / storage.CASES_FILE).read_text())
    records = [
        json.loads(line) | {"torch_version": version}
        for line in (source / storage.CELLS_FILE).read_text().splitlines()
    ]
    (folder / storage.CELLS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    return len(storage.read_records(folder))


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


def time_report(runs: list[Path], out: Path) -> tuple[float, float, int]:
    """Seconds to read the runs, seconds end to end, and the report's size in bytes: as
    ``python -m harness report`` does it (runs read by one process per core)."""
    started = time.perf_counter()
    loaded = load_runs_for_report(runs)
    read = time.perf_counter() - started
    html = render_report(loaded)
    written = write_report(html, out)
    return read, time.perf_counter() - started, written.stat().st_size


def time_compare(runs: list[Path]) -> tuple[float, int]:
    """Seconds to compare every run with its sibling of the other torch version (the stored
    sets come in pairs), reading included, and the number of changes found."""
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
            runs, cells = synthetic_runs(Path(tmp), target)
            read, elapsed, size = time_report(runs, Path(tmp) / "out" / "report.html")
            print(
                f"report over {cells} cells in {len(runs)} runs: {elapsed:.1f} s "
                f"(reading {read:.1f} s), {size / 1e6:.1f} MB of HTML",
                flush=True,
            )
            compared, changes = time_compare(runs)
            print(
                f"compare over the same {cells} cells, {len(runs) // 2} pairs of runs: "
                f"{compared:.1f} s, {changes} changes",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(tuple(int(n) for n in sys.argv[1:]) or SIZES))
