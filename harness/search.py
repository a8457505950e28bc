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


NOT_RUN = "not run"
#: Labels of a cell that did not run in a release.
NOT_RUNNING = ("skipped", NOT_RUN)


@dataclass(frozen=True)
class Bracket:
    """A cell's outcome ``old`` holds at release index ``lo``; index ``hi`` is the first
    measured one after it with another outcome. Resolved when ``hi == lo + 1``."""

    old: str
    lo: int
    hi: int

    @classmethod
    def around(
        cls, labels: dict[int, str], old: str, start: int, same: tuple[str, ...]
    ) -> Bracket:
        lo = max(i for i, label in labels.items() if i >= start and label in same)
        hi = min(i for i, label in labels.items() if i > lo and label not in same)
        return cls(old, lo, hi)


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
        middles = Counter(
            self._middle(b.lo, b.hi) for b in self._brackets().values() if b.hi - b.lo > 1
        )
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
                b.old,
                self._label(self.releases[b.hi], cell),
                self.releases[b.lo],
                self.releases[b.hi],
            )
            for cell, b in sorted(self._brackets().items())
        ]

    def unchanged(self) -> list[Cell]:
        """Cells measured at both ends whose outcome does not change where they run."""
        if not self._ends_measured():
            return []
        changing = self._brackets()
        return sorted(c for c in self._cells() if c not in changing)

    def _label(self, release: str, cell: Cell) -> str:
        return self.measured[release].get(cell, NOT_RUN)

    def _ends_measured(self) -> bool:
        return self.releases[0] in self.measured and self.releases[-1] in self.measured

    def _cells(self) -> set[Cell]:
        return self.measured[self.releases[0]].keys() | self.measured[self.releases[-1]].keys()

    def _brackets(self) -> dict[Cell, Bracket]:
        """The bracket of every cell whose outcome changes, from the releases measured."""
        if not self._ends_measured():
            return {}
        brackets = {}
        for cell in self._cells():
            bracket = self._bracket(cell)
            if bracket is not None:
                brackets[cell] = bracket
        return brackets

    def _bracket(self, cell: Cell) -> Bracket | None:
        """A cell skipped in the oldest release first has the release where it starts to run
        searched (``min_torch``, an API that arrived later); from there, the last index with
        its first outcome and the first index after it with another."""
        labels = {
            i: self._label(release, cell)
            for i, release in enumerate(self.releases)
            if release in self.measured
        }
        last = len(self.releases) - 1
        start = 0
        if labels[0] in NOT_RUNNING and labels[last] not in NOT_RUNNING:
            bracket = Bracket.around(labels, labels[0], 0, NOT_RUNNING)
            if bracket.hi - bracket.lo > 1:
                return bracket
            start = bracket.hi
        old = labels[start]
        if old == labels[last]:
            return None
        return Bracket.around(labels, old, start, (old,))

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
