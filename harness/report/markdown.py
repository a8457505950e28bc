"""A short Markdown summary of runs, for a CI job's summary page (``$GITHUB_STEP_SUMMARY``):
outcome counts per torch version and device, where each case's failure reproduces, and the
first release where each fix passes."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from harness.report import aggregate, stages
from harness.report.aggregate import Run
from harness.schema.axes import CONTROL_FIX, DTYPES, MODE_NAMES, rank
from harness.schema.records import LABELS
from harness.schema.releases import torch_release
from harness.schema.text import markdown_safe


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A table whose cells (names and values from the runs) each show as plain text on
    their row: no line break, cell break, link, image, tag or code span from the data."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(markdown_safe(str(c)) for c in cells) + " |"

    return [line(header), line(["---"] * len(header)), *(line(r) for r in rows)]


def outcome_counts(frame: pd.DataFrame) -> list[str]:
    counts = frame.groupby(["env", "outcome"]).size().unstack(fill_value=0)
    outcomes = [o for o in ("passes", "raises", "inaccurate", "crashed", "timeout", "skipped")
                if o in counts.columns]  # fmt: skip
    rows = [[env, *(str(counts.at[env, o]) for o in outcomes)] for env in counts.index]
    return markdown_table(["environment", *outcomes], rows)


def which_fix(frame: pd.DataFrame) -> list[str]:
    """Per case, the fix recommended (passing at every stage that ran), each fix that
    passes where it ran but ran fewer cells than the others, and each that passes inference
    but fails a later stage, with why."""
    rows = []
    for case in sorted(frame["case"].unique()):
        found = aggregate.recommend(frame, str(case))
        verdict = "recommended" if found.fix else "no recommendation"
        rows.append([str(case), found.fix or "-", verdict, found.reason])
        rows += [[str(case), fix, "not recommended", why] for fix, why in found.narrower]
        rows += [
            [str(case), failure.fix, "not recommended", failure.reason]
            for failure in found.stage_failures
        ]
    return ["### Which fix", "", *markdown_table(["case", "fix", "verdict", "why"], rows), ""]


def across_stages(frame: pd.DataFrame) -> list[str]:
    """Each fix of a case that ran several stages: its outcome at each, and its train
    step's time and memory over its forward pass's."""
    views = [(str(case), stages.side_by_side(mine)) for case, mine in frame.groupby("case")]
    staged = [(case, view) for case, view in views if view is not None]
    shown = stages.in_stage_order({s for _, view in staged for s in view.stages})
    rows = []
    for case, view in staged:
        for row in view.fixes:
            by_stage = dict(zip(view.stages, row["stages"], strict=True))
            outcomes = [stage_text(by_stage.get(stage)) for stage in shown]
            rows.append([case, row["row"], *outcomes, row["time_ratio"], row["memory_ratio"]])
    if not rows:
        return []
    costed = next((view.costed.label for _, view in staged if view.costed), "cost")
    header = ["case", "fix", *shown, f"{costed}: time", f"{costed}: memory"]
    return ["### Each fix across stages", "", *markdown_table(header, rows), ""]


def stage_text(outcome: stages.StageOutcome | None) -> str:
    if outcome is None:
        return "not run"
    misses = f" ({'; '.join(outcome.misses)})" if outcome.misses else ""
    return outcome.text + misses


def where_cells_left(frame: pd.DataFrame) -> list[str]:
    """Each failing cell that was profiled, and where it left float64 (its divergence: the
    first module beyond its rounding; or why its profile names none): a row per case, fix,
    column and place, with the environments it was found in."""
    found = frame.loc[frame["left_at"].map(lambda v: isinstance(v, str) and bool(v))]
    if found.empty:
        return []
    keys = ["case", "row", "dtype", "mode", "left_at"]
    groups = sorted(
        found.groupby(keys, sort=False),
        key=lambda group: (
            group[0][0],
            group[0][1] != CONTROL_FIX,
            group[0][1],
            rank(DTYPES, group[0][2]),
            rank(MODE_NAMES, group[0][3]),
        ),
    )
    rows = [
        [case, row, f"{dtype}/{mode}", ", ".join(cells["env"].unique()), where]
        for (case, row, dtype, mode, where), cells in groups
    ]
    header = ["case", "fix", "column", "environments", "where it left float64"]
    return ["### Where each failing cell left float64", "", *markdown_table(header, rows), ""]


def render_markdown(runs: Sequence[Run]) -> str:
    frame = aggregate.records_frame(runs)
    lines = ["## ampmatrix", ""]
    if frame.empty:
        return "\n".join([*lines, "No cell ran in these runs.", ""])
    lines += ["### Outcomes", "", *outcome_counts(frame), ""]
    view = aggregate.version_view(frame)
    versions = [f"torch {torch_release(c)}" for c in view.columns]
    rows = [[case, *values] for case, values in view.iterrows()]
    lines += ["### Where each failure reproduces (fix `none`)", ""]
    lines += [*markdown_table(["case", *versions], rows), ""]
    passing = aggregate.passing_by_version(frame)
    rows = [[case, fix, values.iloc[-1]] for (case, fix), values in passing.iterrows()]
    lines += ["### First release where each fix passes", ""]
    lines += [*markdown_table(["case", "fix", "first passing"], rows), ""]
    lines += which_fix(frame)
    lines += where_cells_left(frame)
    lines += across_stages(frame)
    lines += ["Labels: " + "; ".join(f"`{label.text}`: {label.meaning}" for label in LABELS), ""]
    return "\n".join(lines)
