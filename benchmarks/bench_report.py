"""How long rendering a report takes over a thousand cells and more (``nox -s bench``).

Builds synthetic runs from the stored result sets in ``tests/data/runs`` (the same records
under other torch versions and hosts), then times ``report`` end to end: reading the
results files, aggregating, plotting and rendering the HTML.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from harness import storage
from harness.report.aggregate import load_runs
from harness.report.render import render_report, write_report

SOURCES = sorted((Path(__file__).resolve().parent.parent / "tests" / "data" / "runs").iterdir())
TARGET_CELLS = 1000


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


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        runs, cells, n = [], 0, 0
        while cells < TARGET_CELLS:
            source = SOURCES[n % len(SOURCES)]
            folder = Path(tmp) / f"run{n}"
            cells += synthetic_run(source, folder, f"2.{n // len(SOURCES)}.0", f"host{n % 3}")
            runs.append(folder)
            n += 1
        started = time.perf_counter()
        html = render_report(load_runs(runs))
        out = write_report(html, Path(tmp) / "out" / "report.html")
        elapsed = time.perf_counter() - started
        print(
            f"6. report over {cells} cells in {len(runs)} runs: {elapsed:.1f} s "
            f"({out.stat().st_size / 1e6:.1f} MB of HTML)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
