"""Where behaviour changed across torch versions: outcomes of the same cells, version by
version, and the consecutive versions between which an outcome differs."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from harness.results.search import release_key, reproduction_label
from harness.results.summary import format_rows
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, Outcome
from harness.schema.releases import torch_release
from harness.schema.text import terminal_lines


@dataclass(frozen=True)
class OutcomeChange:
    cell: Cell
    before_version: str
    before: str
    after_version: str
    after: str

    def describe(self) -> str:
        return (
            f"{self.cell.id}: {self.before} on torch "
            f"{self.before_version} -> {self.after} on torch {self.after_version}"
        )


def outcomes_by_version(records: Iterable[CellRecord]) -> dict[Cell, dict[str, str]]:
    """For each cell that ran (a cell is the same across environments), its outcome label
    under each torch version, saying where it reproduced its case's known failure, raised
    or silent (:func:`~harness.results.search.reproduction_label`)."""
    table: dict[Cell, dict[str, str]] = {}
    for r in records:
        if r.outcome is not Outcome.SKIPPED:
            table.setdefault(r.cell, {})[r.torch_version] = reproduction_label(r)
    return table


def outcome_changes(records: Sequence[CellRecord]) -> list[OutcomeChange]:
    """Consecutive versions (in version order) between which a cell's outcome differs."""
    changes = []
    for cell, by_version in sorted(outcomes_by_version(records).items()):
        versions = sorted(by_version, key=release_key)
        for before, after in itertools.pairwise(versions):
            if by_version[before] != by_version[after]:
                changes.append(
                    OutcomeChange(cell, before, by_version[before], after, by_version[after])
                )
    return changes


def render_bisect(records: Sequence[CellRecord]) -> str:
    """The outcome of every cell under every version, then the changes."""
    table = outcomes_by_version(records)
    versions = sorted({v for by in table.values() for v in by}, key=release_key)
    rows = [["cell", *(f"torch {torch_release(v)}" for v in versions)]]
    for cell, by in sorted(table.items()):
        rows.append([cell.id, *(by.get(v, "-") for v in versions)])
    lines = ["  " + row for row in format_rows(rows)] if len(rows) > 1 else ["  no cell ran"]
    changes = outcome_changes(records)
    lines.append("")
    if len(versions) < 2:
        lines.append(f"only one torch version among the runs ({', '.join(versions) or 'none'})")
    elif changes:
        lines.append(f"outcome changes ({len(changes)}):")
        lines += ["  " + change.describe() for change in changes]
    else:
        lines.append(f"no outcome changes across torch {', '.join(versions)}")
    return terminal_lines(lines)
