"""The terminal summary of a run: one table per case, rows fix, columns the cell axes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from harness.records import CellRecord, Outcome

LEGEND = (
    "raises:repro = fails with the case's known error; raises:OTHER = a different error; "
    "inaccurate = ran but beyond tolerance or non-finite"
)


def short_outcome(record: CellRecord) -> str:
    if record.outcome is Outcome.RAISES:
        return "raises:repro" if record.reproduces else "raises:OTHER"
    return record.outcome.value


def column_key(record: CellRecord, show_device: bool, show_backend: bool) -> str:
    cell = record.cell
    parts = [cell.device] if show_device else []
    parts += [cell.dtype, cell.mode]
    if show_backend:
        parts.append(cell.backend)
    return "/".join(parts)


def case_table(records: Sequence[CellRecord]) -> list[str]:
    """Rows of one case's table (skipped cells left out)."""
    ran = [r for r in records if r.outcome is not Outcome.SKIPPED]
    if not ran:
        return []
    show_device = len({r.cell.device for r in ran}) > 1
    show_backend = len({r.cell.backend for r in ran}) > 1
    columns = sorted({column_key(r, show_device, show_backend) for r in ran})
    fixes = list(dict.fromkeys(r.cell.fix for r in ran))
    grid = {(r.cell.fix, column_key(r, show_device, show_backend)): short_outcome(r) for r in ran}
    rows = [["fix", *columns]]
    rows += [[fix, *(grid.get((fix, c), "-") for c in columns)] for fix in fixes]
    return format_rows(rows)


def format_rows(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def skipped_lines(records: Iterable[CellRecord]) -> list[str]:
    reasons = Counter(r.skip_reason for r in records if r.outcome is Outcome.SKIPPED)
    return [f"  {count:>4} skipped: {reason}" for reason, count in reasons.most_common()]


def render_summary(records: Sequence[CellRecord]) -> str:
    """The whole summary: a table per case, outcome counts, and skip reasons."""
    lines: list[str] = []
    for case in dict.fromkeys(r.cell.case for r in records):
        table = case_table([r for r in records if r.cell.case == case])
        lines += [f"{case}", *("  " + row for row in table), ""]
    counts = Counter(r.outcome.value for r in records)
    lines.append("outcomes: " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items())))
    lines += skipped_lines(records)
    lines.append(LEGEND)
    return "\n".join(lines)
