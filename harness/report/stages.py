"""Each fix across the stages that ran: inference (``forward``), one training step
(``train``) and a short fit (``fit``), side by side.

A fix that passes inference may still fail training: its gradients beyond tolerance, or a
fit that stalls (its updates lost to the weights' rounding, its loss short of the float64
fit's progress). The report puts a fix's outcomes at each stage next to each other, the
train step's time and memory beside the forward pass's, and each fit's loss curve beside
the float64 fit's; and a fix is recommended only where it passes at every stage that ran
(:func:`stage_failures` says why one that passes inference is not).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from harness.schema.axes import CONTROL_FIX, DTYPES, MODE_NAMES, STAGES, rank
from harness.schema.fit_rule import where_it_ends
from harness.schema.records import RAISES_OTHER, REPRODUCES, FitFigures, Outcome
from harness.schema.stages import stage_as_read


def passed_words(stage: str) -> str:
    """How a sentence names what a fix passes at ``stage`` (``the train step``): the stage's
    own words (:attr:`Stage.passed <harness.schema.stages.Stage.passed>`), its name for a
    stage not registered here."""
    return stage_as_read(stage).passed


def noun(stage: str) -> str:
    """How a sentence names a cell of ``stage`` (``bfloat16/half train step``)."""
    return stage_as_read(stage).noun


#: Columns a cross-stage failure lists in full; beyond them, a count.
SHOWN_MISSES = 4
PASSES = Outcome.PASSES.value


def ran(case_frame: pd.DataFrame) -> pd.DataFrame:
    return case_frame[case_frame["outcome"] != Outcome.SKIPPED.value]


def stages_ran(case_frame: pd.DataFrame) -> list[str]:
    """The stages of the cells that ran, in axis order (forward, train, fit)."""
    found = set(ran(case_frame)["stage"]) if len(case_frame) else set()
    return in_stage_order(found)


def in_stage_order(found: set[str]) -> list[str]:
    """``found`` in axis order, a stage not registered here (a record of another harness's)
    after the registered ones, by name."""
    return [s for s in STAGES if s in found] + sorted(found.difference(STAGES))


def fit_reason(fit: FitFigures) -> str:
    """Why a fit fell behind the float64 fit, in its own figures: a loss that is not
    finite, every step skipped, or where its loss ends by the scale its verdict used (the
    float64 fit's progress or its last loss: :func:`~harness.schema.fit_rule.where_it_ends`)
    and the share of its updates lost."""
    losses = fit.losses
    if not all(math.isfinite(v) for v in losses):
        step = next(i for i, v in enumerate(losses) if not math.isfinite(v))
        return f"its loss is not finite from step {step}"
    if fit.steps and fit.skipped_steps == fit.steps:
        return f"the GradScaler skipped all {fit.steps} steps"
    parts = []
    if fit.shortfall is not None:
        parts.append(where_it_ends(fit))
    parts.append(f"{fit.lost_share:.0%} of its updates lost to rounding")
    if fit.skipped_steps:
        parts.append(f"{fit.skipped_steps} of {fit.steps} steps skipped")
    return ", ".join(parts)


@dataclass(frozen=True)
class StageMiss:
    """A column (``bfloat16/half``) where a fix failed at a stage, and why."""

    stage: str
    column: str
    label: str
    #: The failed cell's outcome (``Outcome``'s value), which names what it did.
    outcome: str
    why: str
    #: Environments where it failed, of those where the column ran at that stage.
    failed_in: int = 1
    ran_in: int = 1

    def describe(self) -> str:
        verb = miss_verb(self.stage, self.outcome, self.label)
        where = f" (in {self.failed_in} of {self.ran_in} environments)" * (
            self.failed_in < self.ran_in
        )
        why = f": {self.why}" if self.why else ""
        return f"{self.column} {noun(self.stage)} {verb}{where}{why}"


#: What a cell of each outcome did, as a failed column's sentence says it.
MISS_VERBS = {
    Outcome.RAISES.value: "raises",
    Outcome.TIMEOUT.value: "timed out",
    Outcome.CRASHED.value: "crashed",
}


def miss_verb(stage: str, outcome: str, label: str) -> str:
    """What a failed cell did (``raises``, ``stalls``), from its outcome; a cell that
    passes with a flag ``is passes[drift]``."""
    if outcome == Outcome.INACCURATE.value:
        return stage_as_read(stage).inaccurate_verb
    return MISS_VERBS.get(outcome, f"is {label}")


@dataclass(frozen=True)
class StageFailure:
    """A fix that passes every cell of its first stage (inference, for a case that ran
    one) and fails at a later one: never recommended, and the reason is named."""

    fix: str
    #: The stages it passes in every cell.
    passes: tuple[str, ...]
    misses: tuple[StageMiss, ...]

    @property
    def passed(self) -> str:
        return "passes " + " and ".join(passed_words(s) for s in self.passes)

    @property
    def reason(self) -> str:
        """``passes inference; bfloat16/half fit stalls: ...``, without the fix's name."""
        shown = [miss.describe() for miss in self.misses[:SHOWN_MISSES]]
        more = len(self.misses) - SHOWN_MISSES
        if more > 0:
            shown.append(f"and {more} more column(s)")
        return "; ".join([self.passed, *shown])

    def describe(self) -> str:
        return f"{self.fix}: {self.reason}"


#: What the stage view and :func:`stage_failures` read of a case's frame.
STAGE_COLUMNS = ["fix", "base_row", "stage", "dtype", "mode", "env", "label", "base_label",
                 "outcome", "failure", "fit", "median_s", "peak_mem_bytes",
                 "vs_fastest"]  # fmt: skip


def column_label(dtype: str, mode: str) -> str:
    return f"{dtype}/{mode}"


def column_order(key: tuple[str, str]) -> tuple[int, int, str, str]:
    return rank(DTYPES, key[0]), rank(MODE_NAMES, key[1]), *key


def fix_order(fix: str) -> tuple[bool, str]:
    return fix != CONTROL_FIX, fix


def stage_failures(case_frame: pd.DataFrame) -> tuple[StageFailure, ...]:
    """The fixes (``none`` too) that pass every cell of their first stage and fail at a
    later one, each with the columns where it failed and why; none for a case that ran
    one stage."""
    cells = ran(case_frame)
    if len(stages_ran(case_frame)) < 2:
        return ()
    found = []
    for fix in sorted(cells["fix"].unique(), key=fix_order):
        failure = fix_failure(str(fix), cells[cells["fix"] == fix])
        if failure is not None:
            found.append(failure)
    return tuple(found)


def fix_failure(fix: str, mine: pd.DataFrame) -> StageFailure | None:
    passing = (mine["label"] == PASSES).groupby(mine["stage"]).all().to_dict()
    order = in_stage_order(set(passing))
    if len(order) < 2 or not passing[order[0]] or all(passing.values()):
        return None
    misses = [
        miss
        for stage in order
        if not passing[stage]
        for miss in stage_misses(stage, mine[mine["stage"] == stage])
    ]
    return StageFailure(fix, tuple(s for s in order if passing[s]), tuple(misses))


def stage_misses(stage: str, cells: pd.DataFrame) -> list[StageMiss]:
    """Per column of ``cells`` (one fix, one stage) where a cell did not pass plainly: the
    first such cell's label and reason, and in how many environments."""
    misses = []
    for (dtype, mode), column in cells.groupby(["dtype", "mode"], sort=False):
        failed = column[column["label"] != PASSES]
        if failed.empty:
            continue
        first = failed.iloc[0]
        misses.append(
            StageMiss(
                stage,
                column_label(str(dtype), str(mode)),
                str(first["label"]),
                str(first["outcome"]),
                miss_reason(first),
                failed["env"].nunique(),
                column["env"].nunique(),
            )
        )
    return sorted(misses, key=lambda m: column_order(tuple(m.column.split("/", 1))))  # type: ignore[arg-type]


def miss_reason(cell: pd.Series) -> str:
    fit = cell["fit"]
    if isinstance(fit, FitFigures) and cell["outcome"] == Outcome.INACCURATE.value:
        return fit_reason(fit)
    failure = cell["failure"]
    return failure if isinstance(failure, str) else ""


# -- the side-by-side view ---------------------------------------------------------------


@dataclass(frozen=True)
class StageOutcome:
    """A fix's cells at one stage: how many pass plainly, the worst label among them."""

    label: str
    passed: int
    cells: int
    #: ``inaccurate: float16/half, bfloat16/half`` per label other than a plain pass,
    #: the worst first.
    misses: tuple[str, ...] = ()

    @property
    def text(self) -> str:
        if self.passed == self.cells:
            return f"passes ({self.cells})"
        return f"{self.passed}/{self.cells} pass"


#: Labels from worse to better for a summary's colour: an error, then a wrong result,
#: a reproduced failure, a flag, a pass.
SEVERITY = (
    Outcome.CRASHED.value,
    RAISES_OTHER,
    Outcome.TIMEOUT.value,
    Outcome.INACCURATE.value,
    REPRODUCES,
    Outcome.RAISES.value,
)


def severity(base: str, label: str) -> tuple[int, str]:
    """Worse labels first (:data:`SEVERITY`, by the label's outcome without its flags,
    ``base``), then flagged passes, then ``passes``."""
    if base in SEVERITY:
        return SEVERITY.index(base), label
    return len(SEVERITY) + (label == PASSES), label


def stage_outcome(cells: Sequence[Any]) -> StageOutcome:
    """The outcome of ``cells`` (rows of one stage, with ``dtype``, ``mode``, ``label``
    and ``base_label``)."""
    labels = [c.label for c in cells]
    bases = {c.label: c.base_label for c in cells}

    def worst_first(label: str) -> tuple[int, str]:
        return severity(bases[label], label)

    where: dict[str, set[tuple[str, str]]] = {}
    for c in cells:
        if c.label != PASSES:
            where.setdefault(c.label, set()).add((c.dtype, c.mode))
    misses = tuple(
        f"{label}: {', '.join(column_label(*c) for c in sorted(where[label], key=column_order))}"
        for label in sorted(where, key=worst_first)
    )
    passed = labels.count(PASSES)
    return StageOutcome(min(labels, key=worst_first), passed, len(labels), misses)


@dataclass(frozen=True)
class Costed:
    """A stage whose time and peak memory the report shows over another stage's in the same
    column, as that stage declares (:attr:`Stage.cost_against
    <harness.schema.stages.Stage.cost_against>`): the train step over the forward pass."""

    stage: str
    against: str

    @property
    def label(self) -> str:
        """A column's heading: ``train / forward``."""
        return f"{self.stage} / {self.against}"

    @property
    def noun(self) -> str:
        return noun(self.stage)

    @property
    def against_noun(self) -> str:
        return noun(self.against)


def costed(ran_stages: Sequence[str]) -> Costed | None:
    """The first stage that ran and is shown over another stage that ran too; None where
    none is."""
    for stage in ran_stages:
        against = stage_as_read(stage).cost_against
        if against is not None and against in ran_stages:
            return Costed(stage, against)
    return None


#: A ratio's place: (row, dtype, mode, environment).
RatioKey = tuple[str, str, str, str]


def cost_ratios(cells: Sequence[Any], value: str, pair: Costed | None) -> dict[RatioKey, float]:
    """The costed stage's ``value`` (time, peak memory) over its baseline's (the train
    step's over the forward pass's), per row, dtype, mode and environment where both were
    measured (medians where several); none without a costed stage."""
    if pair is None:
        return {}
    found: dict[RatioKey, dict[str, list[float]]] = {}
    for c in cells:
        figure = getattr(c, value)
        if c.stage in (pair.stage, pair.against) and is_number(figure):
            key = (c.base_row, c.dtype, c.mode, c.env)
            found.setdefault(key, {}).setdefault(c.stage, []).append(float(figure))
    return {
        key: statistics.median(by[pair.stage]) / statistics.median(by[pair.against])
        for key, by in found.items()
        if pair.stage in by and pair.against in by and statistics.median(by[pair.against])
    }


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def ratio_text(values: Sequence[float]) -> str:
    """``2.31x``, or the median with its range over several columns: ``2.31x (1.9-2.8x)``."""
    if not values:
        return ""
    low, mid, high = min(values), statistics.median(values), max(values)
    if math.isclose(low, high, rel_tol=0.005):
        return times(mid)
    return f"{times(mid)} ({times(low)[:-1]}\u2013{times(high)})"


def times(ratio: float) -> str:
    """``2.31x``, ``14.2x``, ``1279x``: three figures or so."""
    digits = 2 if ratio < 10 else 1 if ratio < 100 else 0
    return f"{ratio:.{digits}f}x"


@dataclass(frozen=True)
class FitView:
    """A fit column's figures as the report shows them, from its environment with the
    largest shortfall (the one that explains its verdict)."""

    fit: FitFigures
    label: str
    env: str
    envs: int

    @property
    def skipped(self) -> str:
        return f"{self.fit.skipped_steps} of {self.fit.steps}"

    @property
    def final_scale(self) -> str:
        return "-" if self.fit.final_scale is None else f"{self.fit.final_scale:g}"

    @property
    def lost(self) -> str:
        return f"{self.fit.lost_share:.0%}"

    @property
    def shortfall(self) -> str:
        value = self.fit.shortfall
        if value is None:
            return "-"
        return "not finite" if math.isinf(value) else f"{value:.0%}"

    @property
    def losses(self) -> str:
        """``0.693 -> 0.512 (float64 0.693 -> 0.301)``."""
        mine, ref = self.fit.losses, self.fit.reference_losses
        if not mine or not ref:
            return ""
        return f"{mine[0]:.4g} \u2192 {mine[-1]:.4g} (float64 {ref[0]:.4g} \u2192 {ref[-1]:.4g})"


def fit_view(cells: Sequence[Any]) -> FitView | None:
    """The figures of a column's fit cells (one per environment)."""
    fits = [c for c in cells if isinstance(c.fit, FitFigures)]
    if not fits:
        return None
    worst = min(fits, key=lambda c: (c.fit.shortfall is None, -(c.fit.shortfall or 0.0), c.env))
    return FitView(worst.fit, str(worst.label), str(worst.env), len({c.env for c in fits}))


@dataclass(frozen=True)
class SideBySide:
    """A case's fixes across the stages it ran: a row per fix (``fixes``) and per fix and
    column (``columns``), and how the fixes' train steps compare (``across``); the stage
    shown over another's cost (``costed``: the train step over the forward pass), and
    whether a stage judged by its loss curve ran (``curves``: the fit)."""

    stages: list[str]
    fixes: list[dict[str, Any]]
    columns: list[dict[str, Any]]
    across: str | None
    costed: Costed | None = None
    curves: bool = False


def side_by_side(case_frame: pd.DataFrame) -> SideBySide | None:
    """Each fix's outcome at each stage, the train step's time and peak memory over the
    forward pass's (per fix, per column, and across fixes), each fit's figures; None for a
    case that ran one stage. One pass over the rows: a nightly holds many."""
    ran_stages = stages_ran(case_frame)
    if len(ran_stages) < 2:
        return None
    cells = list(ran(case_frame)[STAGE_COLUMNS].itertuples(index=False))
    pair = costed(ran_stages)
    time = cost_ratios(cells, "median_s", pair)
    memory = cost_ratios(cells, "peak_mem_bytes", pair)
    by_row: dict[str, dict[str, list[Any]]] = {}
    by_column: dict[tuple[str, str, str], dict[str, list[Any]]] = {}
    fixes: dict[str, str] = {}
    for c in cells:
        fixes.setdefault(c.base_row, c.fix)
        by_row.setdefault(c.base_row, {}).setdefault(c.stage, []).append(c)
        by_column.setdefault((c.base_row, c.dtype, c.mode), {}).setdefault(c.stage, []).append(c)
    order = sorted(by_row, key=lambda row: (fixes[row] != CONTROL_FIX, row))
    return SideBySide(
        ran_stages,
        [fix_row(row, by_row[row], ran_stages, time, memory, pair) for row in order],
        [
            column_row(key, by_column[key], ran_stages, time, memory)
            for key in sorted(by_column, key=lambda k: (order.index(k[0]), column_order(k[1:])))
        ],
        across_fixes(time, memory, pair),
        pair,
        any(stage_as_read(stage).loss_curve for stage in ran_stages),
    )


def fix_row(
    row: str,
    by_stage: dict[str, list[Any]],
    ran_stages: list[str],
    time: dict[RatioKey, float],
    memory: dict[RatioKey, float],
    pair: Costed | None,
) -> dict[str, Any]:
    """A fix's outcome at each stage, its train step's time and memory over its forward
    pass's, and its train step's time over the fastest fix's (``vs_fastest``): the costed
    stage's (see :func:`costed`)."""
    shown = by_stage.get(pair.stage, []) if pair else []
    train = [c.vs_fastest for c in shown if is_number(c.vs_fastest)]
    return {
        "row": row,
        "stages": [stage_outcome(by_stage[s]) if s in by_stage else None for s in ran_stages],
        "time_ratio": ratio_text([v for k, v in time.items() if k[0] == row]),
        "memory_ratio": ratio_text([v for k, v in memory.items() if k[0] == row]),
        "train_vs_fastest": ratio_text(train),
    }


def column_row(
    key: tuple[str, str, str],
    by_stage: dict[str, list[Any]],
    ran_stages: list[str],
    time: dict[RatioKey, float],
    memory: dict[RatioKey, float],
) -> dict[str, Any]:
    """A fix in one column (``bfloat16/half``): its label at each stage (the worst over
    the environments), the train step over the forward pass, the fit's figures (of the
    stages judged by their loss curve)."""
    curves = [c for stage, cells in by_stage.items() if stage_as_read(stage).loss_curve
              for c in cells]  # fmt: skip
    return {
        "row": key[0],
        "dtype": key[1],
        "mode": key[2],
        "stages": [stage_outcome(by_stage[s]) if s in by_stage else None for s in ran_stages],
        "time_ratio": ratio_text([v for k, v in time.items() if k[:3] == key]),
        "memory_ratio": ratio_text([v for k, v in memory.items() if k[:3] == key]),
        "fit": fit_view(curves),
    }


def across_fixes(
    time: dict[RatioKey, float], memory: dict[RatioKey, float], pair: Costed | None
) -> str | None:
    """``Across fixes, the train step takes 2.1x (sdpa) to 3.4x (none) the forward pass's
    time and ...``: medians per fix over the columns (dtype, mode, environment) that every
    fix compared has, so no fix is ranked on columns the others lack (the fp32 control's)."""
    if pair is None:
        return None
    parts = []
    for found, what in ((time, "time"), (memory, "peak memory")):
        per_row = sorted(shared_medians(found).items(), key=lambda item: (item[1], item[0]))
        if not per_row:
            continue
        (low, least), (high, most) = per_row[0], per_row[-1]
        if len(per_row) == 1:
            span = f"{times(least)} ({low})"
        elif times(least) == times(most):
            span = f"{times(least)} (every fix)"
        else:
            span = f"{times(least)} ({low}) to {times(most)} ({high})"
        parts.append(f"{span} the {pair.against_noun}'s {what}")
    if not parts:
        return None
    return f"Across fixes, the {pair.noun} takes {' and '.join(parts)}."


def shared_medians(found: dict[RatioKey, float]) -> dict[str, float]:
    """Per row, the median of its ratios over the columns every row has."""
    columns: dict[str, dict[tuple[str, str, str], float]] = {}
    for (row, *column), value in found.items():
        columns.setdefault(row, {})[tuple(column)] = value  # type: ignore[index]
    if not columns:
        return {}
    shared = set.intersection(*(set(by) for by in columns.values()))
    return {row: statistics.median(by[c] for c in shared) for row, by in columns.items() if shared}
