"""A bisect that searches the ordered torch releases: which release changed a cell's outcome.

The oldest and newest releases are measured first. Wherever two measured releases next to
each other in the measured order give a cell different outcomes, there is an open bracket
between them. Each step measures the middle release of the bracket most cells share, so
one run narrows every cell it can, until every such pair is two neighbouring releases. A
cell that fails, is fixed and fails again is found at both changes as soon as a measured
release falls between them; one that changes and changes back between two measured
releases with the same outcome stays invisible (the exhaustive sweep, ``nox -t
all-versions``, shows every release). Where a cell starts (or stops) running, because its
case needs an API a release lacks, is searched the same way and reported apart.

Only the standard library and the records are imported here: the nox session that drives
the search runs outside the environments it creates.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.results import storage
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, Outcome, base_label, outcome_label
from harness.schema.releases import torch_release

NOT_RUN = "not run"
#: Labels of a cell that did not run in a release.
NOT_RUNNING = ("skipped", NOT_RUN)


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

    @property
    def is_running_change(self) -> bool:
        """The cell starts or stops running here (a release lacks an API its case needs)."""
        return self.old in NOT_RUNNING or self.new in NOT_RUNNING


@dataclass(frozen=True)
class Bracket:
    """Outcome ``old`` at release index ``lo``, ``new`` at ``hi``, nothing measured between."""

    old: str
    new: str
    lo: int
    hi: int

    @property
    def open(self) -> bool:
        return self.hi - self.lo > 1


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
        middles = Counter(self._middle(b.lo, b.hi) for _, b in self._brackets() if b.open)
        if not middles:
            return None
        best = max(middles.values())
        return self.releases[min(i for i, n in middles.items() if n == best)]

    def changes(self, running: bool = False) -> list[Change]:
        """Every outcome change with its tightest bracket so far (resolved when the search
        is done). ``running``: the changes where a cell starts or stops running instead."""
        found = [
            Change(cell, b.old, b.new, self.releases[b.lo], self.releases[b.hi])
            for cell, b in self._brackets()
        ]
        return sorted(
            (c for c in found if running == c.is_running_change),
            key=lambda c: (c.cell, self.releases.index(c.last_old)),
        )

    def unchanged(self) -> list[Cell]:
        """Cells measured at both ends whose outcome does not change where they run."""
        changing = {change.cell for change in self.changes()}
        return sorted(c for c in self._cells() if c not in changing)

    def _label(self, release: str, cell: Cell) -> str:
        return self.measured[release].get(cell, NOT_RUN)

    def _cells(self) -> set[Cell]:
        if self.releases[0] not in self.measured or self.releases[-1] not in self.measured:
            return set()
        return self.measured[self.releases[0]].keys() | self.measured[self.releases[-1]].keys()

    def _brackets(self) -> list[tuple[Cell, Bracket]]:
        """For every cell, each pair of releases next to each other in the measured order
        that give it different outcomes."""
        indices = [i for i, release in enumerate(self.releases) if release in self.measured]
        brackets = []
        for cell in self._cells():
            labels = [self._label(self.releases[i], cell) for i in indices]
            brackets += [
                (cell, Bracket(labels[k], labels[k + 1], indices[k], indices[k + 1]))
                for k in range(len(indices) - 1)
                if labels[k] != labels[k + 1]
            ]
        return brackets

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
        starts = self.changes(running=True)
        if starts:
            firsts = sorted({c.first_new for c in starts}, key=self.releases.index)
            lines.append(
                f"{len({c.cell for c in starts})} cells run only from (or until) torch "
                f"{', '.join(firsts)}: skipped elsewhere"
            )
        lines.append(f"{len(self.unchanged())} cells give the same outcome wherever they run")
        return "\n".join(lines)


def labels_of(records: Iterable[CellRecord]) -> dict[Cell, str]:
    """Each cell's outcome label (the last record of each cell wins, as in every reader)."""
    return {r.cell: reproduction_label(r) for r in records}


#: What a label adds where the cell showed its case's known failure (``raises:repro``).
REPRO = ":repro"


def reproduction_label(record: CellRecord) -> str:
    """A cell's outcome label saying whether it showed its case's known failure, raised
    (``raises:repro``) or silent (``inaccurate:repro``, ``passes:repro[drift]``): the
    release where a silent failure starts or stops reproducing is an outcome change too."""
    label = outcome_label(record)
    if record.outcome is Outcome.RAISES or record.reproduces is not True:
        return label
    base = base_label(record)
    return f"{base}{REPRO}{label[len(base) :]}"


def labels_of_run(run_dir: Path) -> dict[Cell, str]:
    return labels_of(storage.read_records(run_dir))


def search_order(releases: Sequence[str]) -> tuple[str, ...]:
    """The releases sorted oldest first (``2.4.1`` before ``2.13.0``)."""
    return tuple(sorted(releases, key=release_key))


def release_key(version: str) -> tuple[int, ...]:
    """``2.13.0+cpu`` -> (2, 13, 0), so 2.4 sorts before 2.13 (the one version order: the
    report, ``harness bisect``, ``min_torch`` and the search all use it)."""
    core = torch_release(version)
    return tuple(int(p) if p.isdigit() else 0 for p in core.split("."))
