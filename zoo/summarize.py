"""The zoo's summary: the verdict of every cell, and a check that each one has a verdict.

Exits 1 when a cell has none of its own (the harness or the check itself broke: a
``crashed`` record), so ``nox -s zoo`` fails for the harness, never for a model's finding.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from harness.results import storage
from harness.results.summary import render_summary
from harness.schema.records import CrashKind, Outcome

NOT_A_VERDICT = (CrashKind.HARNESS, CrashKind.CONTRACT, CrashKind.WORKLOAD_FAILED)


def main(run_dir: Path) -> int:
    records = storage.read_records(run_dir)
    print(render_summary(records))
    per_model = Counter(r.cell.case for r in records)
    print("\ncells per model: " + ", ".join(f"{m} {n}" for m, n in sorted(per_model.items())))
    broken = [r for r in records if r.outcome is Outcome.CRASHED and r.crash_kind in NOT_A_VERDICT]
    for r in broken:
        print(f"no verdict: {r.cell.id}: {r.crash_kind}: {r.error_type}: {r.error_message}")
    return 1 if broken or not records else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
