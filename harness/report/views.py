"""The report's views: what the HTML template reads, as dataclasses.

:mod:`harness.report.render` builds them from the frame of records and the runs' files;
:mod:`harness.report.writing` turns them into HTML and writes it. The style of an outcome
(:class:`CellStyle`) comes from the cell's outcome and flags, never from its label's text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from harness.schema.records import LABELS, Outcome
from harness.schema.stages import stage_as_read

if TYPE_CHECKING:
    from harness.report.aggregate import Recommendation
    from harness.report.compare import Comparison
    from harness.report.grouping import EnvironmentSet
    from harness.report.stages import Costed, FitView
    from harness.schema.run_files import CaseInfo

#: The legend: (label, CSS class, meaning) per outcome label, then the flag's.
LEGEND = (
    *((label.text, label.css, label.meaning) for label in LABELS),
    ("[flag]", "flagged", "the cell's precision mode was not applied as promised (see messages)"),
)
CSS_CLASS = {label.text: label.css for label in LABELS}


@dataclass(frozen=True)
class CellStyle:
    """How an outcome is coloured: by its label without flags (``passes``,
    ``raises:repro``), whether flags came with it, and whether one of them is drift."""

    base: str
    flagged: bool = False
    drift: bool = False

    @property
    def css(self) -> str:
        """The CSS classes: a flagged outcome gets ``flagged`` too, so it never looks like a
        plain pass, and a drifting one ``drift`` as well."""
        return (
            CSS_CLASS.get(self.base, "missing")
            + (" flagged" if self.flagged else "")
            + (" drift" if self.drift else "")
        )

    @property
    def plain_pass(self) -> bool:
        """A pass with no flag."""
        return self.base == Outcome.PASSES.value and not self.flagged


#: The style of a matrix cell that did not run.
MISSING = CellStyle("missing")


@dataclass(frozen=True)
class CellNumbers:
    """A cell row's numbers as shown: a value, or a median with its range."""

    rel_err: str
    tolerance: str
    median_s: str
    vs_control: str
    vs_fastest: str
    peak_mem_bytes: str
    gflops: str
    peak_fraction: str


@dataclass(frozen=True)
class CellRow:
    """A row of a case's table of cells: a cell and one of its outcomes, with the
    environments that gave it; ``variants`` counts a differing cell's outcomes on its
    first row (0 on the others)."""

    row: str
    dtype: str
    mode: str
    envs: EnvironmentSet
    cells: int
    label: str
    css: str
    skip_reason: str | None
    out_dtype: str | None
    attn_dtype: str | None
    numbers: CellNumbers
    noisy: bool
    launch_bound: bool
    variants: int = 0


@dataclass(frozen=True)
class SkippedCells:
    reason: str
    cells: int
    envs: EnvironmentSet


@dataclass(frozen=True)
class CellsAt:
    """Cells of one row, dtype and mode (``cell``) and their environments."""

    cell: str
    envs: EnvironmentSet


@dataclass(frozen=True)
class Message:
    """An error message or note, with every cell that gave it."""

    text: str
    count: int
    where: list[CellsAt]


@dataclass(frozen=True)
class TrailRow:
    """A distinct dtype trail of a cell that raised or drifted."""

    where: str
    envs: EnvironmentSet
    label: str
    css: str
    promotion: str
    failure: str
    compute: str


@dataclass(frozen=True)
class StageCell:
    """A fix's cells at one stage: the worst label, how many pass plainly of how many."""

    label: str
    css: str
    text: str
    passed: int
    cells: int
    misses: tuple[str, ...]


@dataclass(frozen=True)
class StageFixRow:
    """A fix across the stages, with its train step over its forward pass."""

    row: str
    stages: list[StageCell | None]
    time_ratio: str
    memory_ratio: str
    train_vs_fastest: str


@dataclass(frozen=True)
class StageColumnRow:
    """A fix in one column (dtype, mode) across the stages, with its fit and loss curve
    (an inline SVG)."""

    row: str
    dtype: str
    mode: str
    stages: list[StageCell | None]
    time_ratio: str
    memory_ratio: str
    fit: FitView | None
    curve: str


@dataclass(frozen=True)
class StagesView:
    stages: list[str]
    fixes: list[StageFixRow]
    columns: list[StageColumnRow]
    across: str | None
    #: The stage shown over another's time and memory (the train step over the forward
    #: pass), where both ran.
    costed: Costed | None
    #: A stage judged by its loss curve ran (the fit): its figures have columns.
    fitted: bool

    @property
    def trained(self) -> bool:
        """The cost columns are shown."""
        return self.costed is not None

    @property
    def meanings(self) -> list[tuple[str, str]]:
        """Each stage shown and what a cell of it runs, in the stage's own words."""
        return [(name, stage_as_read(name).meaning) for name in self.stages]


@dataclass(frozen=True)
class ProfileView:
    """A picture of where the failing cells of one column (``float16/half``, with its
    stage where it is not the forward) left float64, in the environments where it is the
    same: each profiled fix's ratio along the model, forward and (a train cell's)
    backward, each an inline SVG (``""`` where that direction was not profiled)."""

    column: str
    envs: EnvironmentSet
    forward: str
    backward: str


@dataclass(frozen=True)
class CaseView:
    """A case's section: its metadata, recommendation, tables, stages and plots (each
    ``(size, data URI)``; the size empty for a case that ran one)."""

    name: str
    meta: CaseInfo | None
    links: list[tuple[str, str]]
    recommendation: Recommendation
    precision: list[tuple[str, str]]
    cpu_timed: bool
    environments: EnvironmentSet
    cell_count: int
    rows: list[CellRow]
    skipped: list[SkippedCells]
    messages: list[Message]
    trails: list[TrailRow]
    stages: StagesView | None
    plots: list[tuple[str, str | None]] = field(default_factory=list)
    profiles: list[ProfileView] = field(default_factory=list)


@dataclass(frozen=True)
class VersionsView:
    """Where each case's failure reproduces per torch release, and from which release
    each fix passes."""

    columns: list[str] = field(default_factory=list)
    rows: list[tuple[str, list[str]]] = field(default_factory=list)
    passing_columns: list[str] = field(default_factory=list)
    passing_rows: list[tuple[str, str, list[str]]] = field(default_factory=list)


@dataclass(frozen=True)
class EnvironmentsView:
    """The runs' environments: the facts all runs share once, then a row per run with the
    facts that differ (a nightly's runs share most of theirs)."""

    common: list[tuple[str, str]]
    keys: list[str]
    runs: list[tuple[str, list[str]]]


@dataclass(frozen=True)
class RunView:
    name: str
    path: str


@dataclass(frozen=True)
class ReportView:
    """The whole report, as the template reads it."""

    title: str
    generated_at: str
    runs: list[RunView]
    environments: EnvironmentsView
    problems: list[str]
    noise: str | None
    legend: tuple[tuple[str, str, str], ...]
    modes: list[tuple[str, str]]
    summary: SummaryView
    versions: VersionsView
    cases: list[CaseView]
    comparison: Comparison | None = None


@dataclass(frozen=True)
class SummaryCell:
    """A summary cell: its code, CSS classes (the outcome's style, ``fail`` where it is not
    a plain pass, ``d`` where it differs between environments) and its full label where
    the code does not say all of it."""

    text: str
    css: str
    title: str = ""


#: A cell of a column that did not run in this row.
NOT_RUN = SummaryCell("-", MISSING.css)


@dataclass(frozen=True)
class SummaryFix:
    """A fix's row of a case: its label (``fix``, ``fix [backend]``, ``fix @upstream``),
    whether it is the upstream path or the case's recommended fix, and its cells."""

    row: str
    upstream: bool
    recommended: bool
    cells: list[SummaryCell]


@dataclass(frozen=True)
class SummaryCase:
    name: str
    recommended: str | None
    fixes: list[SummaryFix]


@dataclass(frozen=True)
class StageHeader:
    """A stage's column group in one environment group: its dtypes with the number of
    modes each spans, and the modes in column order."""

    stage: str
    dtypes: list[tuple[str, int]]
    modes: list[str]

    @property
    def span(self) -> int:
        return len(self.modes)


@dataclass(frozen=True)
class EnvGroup:
    """Environments whose every outcome is the same, one column group, from the table's
    column ``first`` (counted from 0, after the fix's)."""

    envs: EnvironmentSet
    stages: list[StageHeader]
    first: int

    @property
    def span(self) -> int:
        return sum(stage.span for stage in self.stages)


@dataclass(frozen=True)
class SummaryView:
    """The summary: its column groups, each column's stage (what the stage filter hides),
    the cases, and the choices of the outcome filter as (label, CSS class)."""

    groups: list[EnvGroup] = field(default_factory=list)
    column_stages: list[str] = field(default_factory=list)
    cases: list[SummaryCase] = field(default_factory=list)
    outcomes: list[tuple[str, str]] = field(default_factory=list)
    codes: list[tuple[str, str]] = field(default_factory=list)

    @property
    def stages(self) -> list[str]:
        return list(dict.fromkeys(self.column_stages))

    @property
    def differs(self) -> bool:
        """Whether environments are side by side, so some cells differ between them."""
        return len(self.groups) > 1
