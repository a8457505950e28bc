"""The nightly's verdict: tonight's runs against last night's, one torch release and GPU at
a time, failing on what a maintainer must look at and not on what the cases document.

The runs of the two nights are paired by environment and compared cell by cell by
``compare`` (:func:`~harness.report.compare.pair_runs`,
:func:`~harness.report.compare.compare_runs`); each change it finds is judged here as one
of :class:`Judgement`:

- **expected**: tonight the cell reproduces its case's known failure (raised, ``raises:repro``, or
  silent: its declared symptom shown) on
  the case's upstream code path (fix ``none``) in a low-precision mode. That failure is
  what the case exists to show, and whether a release or a GPU shows it (the kernel it
  picks, flash-attn installed or not) is the finding, not a fault of the night.
- **stopped passing**: the cell passed last night and tonight does not (it raises, is
  inaccurate, crashed, timed out or was skipped), or ``compare`` calls the change a
  regression (a plain pass now flagged), and it is not expected. A fix that stops passing
  is the first thing the nightly is for; so is a control (``none`` in float32) that breaks.
- **new error**: tonight the cell raises an error other than its case's known failure,
  crashes or times out, and last night it did not end that way.
- **slower**: ``compare`` judges its speed a regression (beyond the noise ``compare``
  measures by).
- **other**: anything else (an improvement, a speed change within the noise, a skip that
  became a pass, one inaccuracy for another): shown, never failing.

Cells last night had that tonight has no record of are ``compare``'s missing cells, and
fail the same way (a night whose job broke must not pass); so do the cells of a run of
tonight that last night has nothing to compare with (no run of its environment, or one
without a record): a night judged against nothing must not pass either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from harness.report.aggregate import Run, load_run
from harness.report.compare import (
    Change,
    Missing,
    compare_runs,
    compared_with_nothing,
    describe_key,
    environment_key,
    pair_runs,
)
from harness.report.markdown import markdown_table
from harness.schema.axes import CONTROL_FIX, CONTROL_MODE, Cell
from harness.schema.records import CellRecord, Outcome
from harness.schema.text import markdown_safe, terminal_lines

#: Tonight's outcomes that end a cell with an error.
ERRORS = (Outcome.RAISES, Outcome.CRASHED, Outcome.TIMEOUT)


class Judgement(Enum):
    EXPECTED = "expected"
    STOPPED_PASSING = "stopped passing"
    NEW_ERROR = "new error"
    SLOWER = "slower"
    OTHER = "other"


#: The judgements that fail the night.
FAILING = (Judgement.STOPPED_PASSING, Judgement.NEW_ERROR, Judgement.SLOWER)


@dataclass(frozen=True)
class Judged:
    """One change of one cell between the nights, in one environment, and its judgement."""

    environment: str
    change: Change
    judgement: Judgement

    @property
    def failing(self) -> bool:
        return self.judgement in FAILING

    def describe(self) -> str:
        change = self.change
        return (
            f"{self.judgement.value}: {change.cell.id} on {self.environment}: "
            f"{change.base} -> {change.head}"
        )


@dataclass
class NightVerdict:
    """Every judged change of the night, the cells tonight lost, and the runs left out."""

    judged: list[Judged] = field(default_factory=list)
    missing: list[Missing] = field(default_factory=list)
    #: Cells of tonight's runs that last night has nothing to compare with.
    uncompared: list[Missing] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    #: What could not be read of last night's runs (file and line); the rest was compared.
    problems: list[str] = field(default_factory=list)
    #: How many environments (torch release x GPU) were compared with last night.
    compared: int = 0
    #: How many cells both nights have a record of.
    cells_compared: int = 0
    #: Per environment and device, the noise ``compare`` judged speed against.
    noise: list[str] = field(default_factory=list)

    @property
    def failures(self) -> list[Judged]:
        return [j for j in self.judged if j.failing]

    def count(self, judgement: Judgement) -> int:
        return sum(j.judgement is judgement for j in self.judged)

    @property
    def unjudged(self) -> list[Missing]:
        """The cells either night has and the other cannot be compared with."""
        return [*self.missing, *self.uncompared]

    def failed(self, allow_missing: bool = False) -> bool:
        """A failing change fails the night; so do missing and uncompared cells, unless
        allowed."""
        return bool(self.failures) or (bool(self.unjudged) and not allow_missing)


def reproduces_its_known_failure(record: CellRecord) -> bool:
    """The cell showed its case's known failure: raised it (``raises:repro``), or ran and
    showed its silent symptoms (an ``inaccurate`` non-finite output, say)."""
    return record.reproduces is True


def on_the_upstream_path(cell: Cell) -> bool:
    """The case's upstream code (fix ``none``) in a low-precision mode: the cells a case
    declares its known failure for (the float32 control must pass)."""
    return cell.fix == CONTROL_FIX and cell.mode != CONTROL_MODE


def new_error(last: CellRecord, tonight: CellRecord) -> bool:
    """Tonight an error that is not the case's known failure, a crash or a time-out, where
    last night the cell did not end the same way."""
    if tonight.outcome not in ERRORS or reproduces_its_known_failure(tonight):
        return False
    return (last.outcome, last.reproduces) != (tonight.outcome, tonight.reproduces)


def judge(change: Change, last: CellRecord, tonight: CellRecord) -> Judgement:
    """What one change of a cell between the nights means (see the module's docstring)."""
    if change.kind == "speed":
        return Judgement.SLOWER if change.verdict == "regression" else Judgement.OTHER
    if on_the_upstream_path(change.cell) and reproduces_its_known_failure(tonight):
        return Judgement.EXPECTED
    if new_error(last, tonight):
        return Judgement.NEW_ERROR
    stopped = last.outcome is Outcome.PASSES and tonight.outcome is not Outcome.PASSES
    if stopped or change.verdict == "regression":
        return Judgement.STOPPED_PASSING
    return Judgement.OTHER


def describe_environment(run: Run) -> str:
    """The torch release and GPUs of a run, as ``compare`` tells environments apart."""
    return describe_key(environment_key(run.env))


@dataclass(frozen=True)
class PairJudged:
    """One environment's night: its judged changes, the cells tonight lost, and the noise
    its speed was judged against (``where: speed on cuda:0 judged against ...``)."""

    judged: list[Judged]
    missing: Missing
    noise: list[str]
    #: Tonight's cells where last night's run has no record at all.
    uncompared: Missing
    #: How many cells both nights have a record of.
    compared: int


def judge_pair(last: Run, tonight: Run) -> PairJudged:
    """Every change between the runs of one environment, judged; the cells of last night's
    run that tonight's has no record of; and the noise of each device's speed."""
    comparison = compare_runs(last, tonight)
    before: Mapping[Cell, CellRecord] = {r.cell: r for r in last.records}
    after: Mapping[Cell, CellRecord] = {r.cell: r for r in tonight.records}
    where = describe_environment(tonight)
    judged = [
        Judged(where, c, judge(c, before[c.cell], after[c.cell])) for c in comparison.changes
    ]
    noise = [f"{where}: {n.describe()}" for n in comparison.noise]
    return PairJudged(
        judged,
        Missing(last.run_dir, tonight.run_dir, comparison.only_in_base),
        noise,
        compared_with_nothing(last, tonight, comparison),
        comparison.compared,
    )


def judge_nights(last: Path, tonight: Path) -> NightVerdict:
    """Last night's results folder against tonight's, environment by environment."""
    pairing = pair_runs(last, tonight)
    verdict = NightVerdict(left_out=list(pairing.left_out), compared=len(pairing.pairs))
    for base_dir in pairing.unpaired_bases:
        lost = load_run(base_dir)
        verdict.problems += lost.problems
        verdict.missing.append(Missing(base_dir, tonight, sorted(r.cell for r in lost.records)))
    for head_dir in pairing.unpaired_heads:
        new = load_run(head_dir)
        verdict.uncompared.append(Missing(head_dir, last, sorted(r.cell for r in new.records)))
    for base_dir, head_dir in pairing.pairs:
        base = load_run(base_dir)
        verdict.problems += base.problems
        pair = judge_pair(base, load_run(head_dir))
        verdict.judged += pair.judged
        verdict.missing.append(pair.missing)
        verdict.uncompared.append(pair.uncompared)
        verdict.cells_compared += pair.compared
        verdict.noise += pair.noise
    verdict.missing = [m for m in verdict.missing if m.cells]
    verdict.uncompared = [m for m in verdict.uncompared if m.cells]
    return verdict


def render_verdict(verdict: NightVerdict, allow_missing: bool = False) -> str:
    """The terminal lines: each failing change (``FAIL``), then the others, then the
    counts."""
    ordered = sorted(verdict.judged, key=lambda j: not j.failing)
    lines = [f"{'FAIL' if j.failing else '    '} {j.describe()}" for j in ordered]
    lines += verdict.noise
    lines.append(summary_line(verdict, allow_missing))
    return terminal_lines(lines)  # a line break in a GPU's name forges no line


def summary_line(verdict: NightVerdict, allow_missing: bool = False) -> str:
    counts = ", ".join(f"{verdict.count(j)} {j.value}" for j in Judgement)
    lost = sum(len(m.cells) for m in verdict.missing)
    new = sum(len(m.cells) for m in verdict.uncompared)
    outcome = "FAIL" if verdict.failed(allow_missing) else "pass"
    return (
        f"nightly verdict: {outcome}: {verdict.compared} environments compared with last "
        f"night; {counts}; {lost} cells missing tonight; {new} cells of tonight with "
        "nothing to compare with last night"
    )


#: The judgements the summary page lists cell by cell (the others are only counted).
LISTED = (*FAILING, Judgement.EXPECTED)


def render_verdict_markdown(verdict: NightVerdict, allow_missing: bool = False) -> str:
    """The verdict for the run's summary page: its line, and a table of the failing and
    the expected changes."""
    rows = [
        [j.judgement.value, j.change.cell.id, j.environment, j.change.base, j.change.head]
        for j in verdict.judged
        if j.judgement in LISTED
    ]
    lines = ["### Against last night", "", summary_line(verdict, allow_missing), ""]
    if rows:
        header = ["judgement", "cell", "environment", "last night", "tonight"]
        lines += [*markdown_table(header, rows), ""]
    if verdict.noise:
        lines += [f"- {markdown_safe(noise)}" for noise in verdict.noise] + [""]
    return "\n".join(lines) + "\n"
