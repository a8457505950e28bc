"""The report's summary: per case, its fixes as rows, and side by side a column group per
stage with a column per dtype and mode in it (per group of alike environments), so a fix's
forward and training verdicts read across one row and the case is named once, in a header
row of its own with its recommended fix.

A cell shows a short code of its outcome (:data:`CODES`, in the legend), coloured as
everywhere in the report, its full label (with its flags) on hover, so a single
environment's two stages fit a laptop's screen without scrolling sideways. Each cell is
marked with what the template's filters read: ``fail`` where it is not a plain pass, and
``d`` where its outcome differs between the environments side by side (the collapsed
views "only failures" and "only differences").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from harness.report import aggregate
from harness.report.grouping import Environments, EnvironmentSet
from harness.report.views import (
    NOT_RUN,
    CellStyle,
    EnvGroup,
    StageHeader,
    SummaryCase,
    SummaryCell,
    SummaryFix,
    SummaryView,
)
from harness.schema.axes import CONTROL_FIX, DTYPES, MODE_NAMES, SIZES, STAGES, rank
from harness.schema.records import LABELS, RAISES_OTHER, REPRODUCES, Outcome

#: The short code a summary cell shows for each outcome label without its flags; a flagged
#: outcome's code ends in ``*`` (its flags on hover and in the case's table).
CODES = {
    REPRODUCES: "repro",
    RAISES_OTHER: "other",
    Outcome.RAISES.value: "raises",
    Outcome.INACCURATE.value: "inacc",
    Outcome.PASSES.value: "pass",
    Outcome.CRASHED.value: "crash",
    Outcome.TIMEOUT.value: "time",
}
#: What makes a summary cell: a fix's row of a case, in one environment's column.
CELL_KEYS = ["case", "base_row", "env", "stage", "dtype", "mode"]
#: A summary column: an environment, a stage, a dtype and a mode.
COLUMN_KEYS = ["env", "stage", "dtype", "mode"]
#: What the summary reads of the frame.
SUMMARY_COLUMNS = [*CELL_KEYS, "label", "fix", "size", "torch_version", "device"]


def summary_view(
    frame: pd.DataFrame, envs: Environments, styles: Mapping[str, CellStyle],
    recommended: Mapping[str, str | None],
) -> SummaryView:  # fmt: skip
    """The summary over the cells that ran (a column skipped everywhere is left out), with
    environments whose every outcome is the same merged into one column group (a
    nightly's releases that behave alike), so it stays as wide as what differs."""
    ran = frame.loc[frame["outcome"] != Outcome.SKIPPED.value, SUMMARY_COLUMNS]
    if ran.empty:
        return SummaryView()
    # each cell's first label; the first of each row and column is among them
    firsts = ran.drop_duplicates(CELL_KEYS)
    table = firsts.set_index(CELL_KEYS)["label"].unstack(COLUMN_KEYS)
    rows = fix_rows(firsts)
    index = [(case, row) for case, row, _ in rows]
    table = table.reindex(index=index, columns=column_order(firsts))
    groups = alike_environments(table)
    columns = [c for labels in groups for c in table.columns if c[0] == labels[0]]
    values = table[columns].to_numpy(dtype=object)
    differing = differing_cells(values, columns) if len(groups) > 1 else None
    headers = env_groups(groups, columns, envs, frame["env"].unique())
    starts = [i == 0 for group in headers for stage in group.stages for i in range(stage.span)]
    cells = summary_cells(values, differing, starts, styles)
    bases = {styles[str(label)].base for label in firsts["label"].unique()}
    return SummaryView(
        groups=headers,
        column_stages=[str(c[1]) for c in columns],
        cases=summary_cases(rows, cells, recommended),
        outcomes=[(label.text, label.css) for label in LABELS if label.text in bases],
        codes=[(code, label) for label, code in CODES.items() if label in bases],
    )


def fix_rows(firsts: pd.DataFrame) -> list[tuple[str, str, str]]:
    """(case, fix row, fix): cases by name, a fix's rows of the small size first, the
    upstream path ``none`` first in each case."""
    pairs = firsts.drop_duplicates(["case", "base_row"])[["case", "base_row", "fix", "size"]]
    ordered = sorted(
        pairs.itertuples(index=False),
        key=lambda p: (p.case, rank(SIZES, p.size), p.fix != CONTROL_FIX, p.base_row),
    )
    return [(p.case, p.base_row, p.fix) for p in ordered]


def column_order(firsts: pd.DataFrame) -> list[tuple[str, str, str, str]]:
    """(environment, stage, dtype, mode): environments by release and device, then stages,
    dtypes and modes in the order the report names them."""
    keys = firsts.drop_duplicates(COLUMN_KEYS)[COLUMN_KEYS]
    envs = aggregate.env_order(firsts)
    return sorted(
        (tuple(k) for k in keys.itertuples(index=False)),
        key=lambda k: (
            envs.index(k[0]),
            rank(STAGES, k[1]),
            rank(DTYPES, k[2]),
            rank(MODE_NAMES, k[3]),
        ),
    )


def alike_environments(table: pd.DataFrame) -> list[list[str]]:
    """The table's environments (its columns' first level), grouped where their columns
    and every outcome in them are the same; in the table's order of first appearance."""
    values = table.fillna("-").to_numpy()
    columns = list(table.columns)
    positions: dict[str, list[int]] = {}
    for i, column in enumerate(columns):
        positions.setdefault(column[0], []).append(i)
    groups: dict[tuple[Any, ...], list[str]] = {}
    for env, where in positions.items():
        shape = tuple(columns[i][1:] for i in where)
        groups.setdefault((shape, *values[:, where].ravel()), []).append(env)
    return list(groups.values())


def differing_cells(values: np.ndarray, columns: list[tuple[str, ...]]) -> np.ndarray:
    """Which cells differ between the environment groups side by side: each group's cell
    of a (stage, dtype, mode) in a row where two groups that ran it read differently (a
    group that did not run it differs from none: it has nothing to compare)."""
    differing = np.zeros(values.shape, dtype=bool)
    by_column: dict[tuple[str, ...], list[int]] = {}
    for i, column in enumerate(columns):
        by_column.setdefault(tuple(column[1:]), []).append(i)
    for where in by_column.values():
        if len(where) < 2:
            continue
        block = pd.DataFrame(values[:, where])
        ran = block.notna()
        first = block.bfill(axis=1).iloc[:, 0]  # each row's first value that ran
        unequal = (block.ne(first, axis=0) & ran).any(axis=1).to_numpy()
        differing[:, where] = unequal[:, None] & ran.to_numpy()
    return differing


def summary_cells(
    values: np.ndarray,
    differing: np.ndarray | None,
    starts: list[bool],
    styles: Mapping[str, CellStyle],
) -> list[list[SummaryCell]]:
    """The table's cells, row by row; a cell of each distinct label (and difference, and
    place at a stage group's start) is made once and shared."""
    made: dict[tuple[str | None, bool, bool], SummaryCell] = {}
    rows = []
    for i, row in enumerate(values.tolist()):
        flags = differing[i].tolist() if differing is not None else [False] * len(row)
        cells = []
        for value, differs, start in zip(row, flags, starts, strict=True):
            label = value if isinstance(value, str) else None
            key = (label, differs, start)
            if key not in made:
                made[key] = summary_cell(label, styles, differs, start)
            cells.append(made[key])
        rows.append(cells)
    return rows


def summary_cell(
    label: str | None, styles: Mapping[str, CellStyle], differs: bool, start: bool
) -> SummaryCell:
    """A cell of ``label`` (None: not run): its code (``*`` after it where flags came with
    it), its style, ``fail`` unless it is a plain pass, ``d`` where it differs between
    environments, ``s`` where it starts a stage's group (a border before it)."""
    edge = " s" if start else ""
    if label is None:
        return SummaryCell(NOT_RUN.text, NOT_RUN.css + edge)
    style = styles[label]
    code = CODES.get(style.base, style.base) + ("*" if style.flagged else "")
    css = style.css + ("" if style.plain_pass else " fail") + (" d" if differs else "") + edge
    return SummaryCell(code, css, label if label != style.base else "")


def summary_cases(
    rows: list[tuple[str, str, str]],
    cells: list[list[SummaryCell]],
    recommended: Mapping[str, str | None],
) -> list[SummaryCase]:
    """The rows grouped by case, in order; a row is upstream where its fix is ``none`` and
    recommended where its fix is the case's recommendation."""
    cases: dict[str, list[SummaryFix]] = {}
    for (case, row, fix), row_cells in zip(rows, cells, strict=True):
        best = recommended.get(case)
        cases.setdefault(case, []).append(
            SummaryFix(row, fix == CONTROL_FIX, best is not None and fix == best, row_cells)
        )
    return [SummaryCase(case, recommended.get(case), fixes) for case, fixes in cases.items()]


def env_groups(
    groups: list[list[str]], columns: list[Any], envs: Environments, universe: Any
) -> list[EnvGroup]:
    """A column group per group of alike environments, named by them, in column order."""
    made, first = [], 0
    for labels in groups:
        group = env_group(envs.describe(labels, universe), columns, labels[0], first)
        made.append(group)
        first += group.span
    return made


def env_group(envs: EnvironmentSet, columns: list[Any], env: str, first: int) -> EnvGroup:
    """The column group of ``env`` (its group's first environment): a header per stage,
    its dtypes spanning their modes."""
    stages: dict[str, list[tuple[str, str]]] = {}
    for column in columns:
        if column[0] == env:
            stages.setdefault(str(column[1]), []).append((str(column[2]), str(column[3])))
    headers = []
    for stage, pairs in stages.items():
        dtypes: dict[str, int] = {}
        for dtype, _ in pairs:
            dtypes[dtype] = dtypes.get(dtype, 0) + 1
        headers.append(StageHeader(stage, list(dtypes.items()), [mode for _, mode in pairs]))
    return EnvGroup(envs, headers, first)
