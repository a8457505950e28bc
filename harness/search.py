"""A bisect that searches the ordered torch releases: which release changed a cell's outcome.

The oldest and newest releases are measured first. Every cell whose outcome differs between
them has an open bracket: the last release known to give the old outcome and the first
known to give another. Each step measures the middle release of the bracket most cells
share, so one run narrows every cell it can; a cell is resolved when its bracket holds two
neighbouring releases. A cell that changes more than once between the ends is reported at
one of its changes (the exhaustive sweep, ``nox -t all-versions``, shows every one).

Only the standard library and the records are imported here: the nox session that drives
the search runs outside the environments it creates.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness import storage
from harness.records import Cell, CellRecord, outcome_label


@dataclass(frozen=True)
class Change:
    """A cell's outcome change, bracketed by two neighbouring releases once resolved."""

    cell: Cell
    old: str
    new: str
    last_old: str
    first_new: str

    def describe(self) -> str:
        return (
            f"{self.cell.id}: {self.old} through torch {self.last_old}, "
            f"{self.new} from torch {self.first_new}"
        )


@dataclass
class ReleaseSearch:
    """The state of one search over ``releases`` (ordered oldest to newest)."""

    releases: tuple[str, ...]
    #: release -> cell -> outcome label, for every release measured so far.
    measured: dict[str, dict[Cell, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.releases) < 2:
            raise ValueError("a search needs at least two releases")
        if len(set(self.releases)) != len(self.releases):
            raise ValueError(f"releases listed twice: {self.releases}")

    def add(self, release: str, labels: Mapping[Cell, str]) -> None:
        if release not in self.releases:
            raise ValueError(f"torch {release} is not among the releases searched")
        self.measured[release] = dict(labels)

    def next_release(self) -> str | None:
        """The release to measure next: the ends first, then the middle of the open bracket
        most cells share (the oldest such on a tie); None when every cell is resolved."""
        for end in (self.releases[0], self.releases[-1]):
            if end not in self.measured:
                return end
        middles = Counter(self._middle(lo, hi) for lo, hi in self._open_brackets().values())
        if not middles:
            return None
        best = max(middles.values())
        return self.releases[min(i for i, n in middles.items() if n == best)]

    def changes(self) -> list[Change]:
        """Every changing cell with its tightest bracket so far (resolved when the search is
        done)."""
        return [
            Change(
                cell,
                self._label(self.releases[0], cell),
                self._label(self.releases[-1], cell),
                self.releases[lo],
                self.releases[hi],
            )
            for cell, (lo, hi) in sorted(self._brackets().items())
        ]

    def unchanged(self) -> list[Cell]:
        """Cells measured at both ends with the same outcome."""
        first, last = self.measured[self.releases[0]], self.measured[self.releases[-1]]
        return sorted(c for c in first.keys() & last.keys() if first[c] == last[c])

    def _label(self, release: str, cell: Cell) -> str:
        return self.measured[release].get(cell, "not run")

    def _brackets(self) -> dict[Cell, tuple[int, int]]:
        """For each cell whose ends differ: (last index with the old outcome, first index
        after it with another), from the releases measured."""
        oldest, newest = self.releases[0], self.releases[-1]
        if oldest not in self.measured or newest not in self.measured:
            return {}
        cells = self.measured[oldest].keys() | self.measured[newest].keys()
        brackets = {}
        for cell in cells:
            old = self._label(oldest, cell)
            if old == self._label(newest, cell):
                continue
            brackets[cell] = self._bracket(cell, old)
        return brackets

    def _bracket(self, cell: Cell, old: str) -> tuple[int, int]:
        indices = [i for i, r in enumerate(self.releases) if r in self.measured]
        lo = max(i for i in indices if self._label(self.releases[i], cell) == old)
        hi = min(i for i in indices if i > lo and self._label(self.releases[i], cell) != old)
        return lo, hi

    def _open_brackets(self) -> dict[Cell, tuple[int, int]]:
        return {cell: (lo, hi) for cell, (lo, hi) in self._brackets().items() if hi - lo > 1}

    @staticmethod
    def _middle(lo: int, hi: int) -> int:
        return (lo + hi) // 2

    def render(self) -> str:
        measured = [r for r in self.releases if r in self.measured]
        lines = [
            f"measured {len(measured)} of {len(self.releases)} releases: {', '.join(measured)}"
        ]
        changes = self.changes()
        if changes:
            lines.append(f"outcome changes ({len(changes)}):")
            lines += ["  " + change.describe() for change in changes]
        else:
            lines.append(
                f"no outcome changes between torch {self.releases[0]} and {self.releases[-1]}"
            )
        lines.append(f"{len(self.unchanged())} cells give the same outcome at both ends")
        return "\n".join(lines)


def labels_of(records: Iterable[CellRecord]) -> dict[Cell, str]:
    """Each cell's outcome label (the last record of each cell wins, as in every reader)."""
    return {r.cell: outcome_label(r) for r in records}


def labels_of_run(run_dir: Path) -> dict[Cell, str]:
    return labels_of(storage.read_records(run_dir))


def search_order(releases: Sequence[str]) -> tuple[str, ...]:
    """The releases sorted oldest first (``2.4.1`` before ``2.13.0``)."""
    return tuple(sorted(releases, key=release_key))


def release_key(version: str) -> tuple[int, ...]:
    core = version.split("+")[0]
    return tuple(int(p) if p.isdigit() else 0 for p in core.split("."))
