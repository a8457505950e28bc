"""A case's pictures of where its failing cells left float64: the profiled cells (a
record's ``profile``) grouped by column (dtype, mode, stage), the fixes profiled there
overlaid in one picture (:mod:`harness.report.profile_chart`), so a fix that moves the
first module beyond rounding is seen to move it. Environments whose fixes read the same
series share a picture; a nightly's releases that fail alike are one.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from harness.report.grouping import Environments
from harness.report.profile_chart import ProfileLine, profile_chart
from harness.report.views import ProfileView
from harness.schema.axes import CONTROL_FIX, DTYPES, FORWARD_STAGE, MODE_NAMES, STAGES, rank

#: What the pictures read of a case's frame.
PROFILE_COLUMNS = ["fix", "base_row", "dtype", "mode", "stage", "env", "profile"]


def profile_views(case_frame: pd.DataFrame, envs: Environments) -> list[ProfileView]:
    """A picture per column where a cell was profiled, and per set of environments that
    read alike there; in the order of the columns (dtype, mode, then stage), then of their
    first environment (by release)."""
    if "profile" not in case_frame:
        return []
    profiled = case_frame.loc[case_frame["profile"].notna(), PROFILE_COLUMNS]
    if profiled.empty:
        return []
    universe = case_frame["env"].unique()
    views = []
    columns = profiled.groupby(["dtype", "mode", "stage"], sort=False)
    for (dtype, mode, stage), cells in sorted(columns, key=lambda c: column_order(c[0])):
        groups = alike(cells).values()
        for lines, where in sorted(
            groups, key=lambda g: min(map(envs.sort_keys.__getitem__, g[1]))
        ):
            views.append(
                ProfileView(
                    column=column_name(str(dtype), str(mode), str(stage)),
                    envs=envs.describe(where, universe),
                    forward=chart(lines, "forward"),
                    backward=chart(lines, "backward"),
                )
            )
    return views


def first(where: list[str], envs: Environments) -> tuple[Any, ...]:
    """The sort key of the first of ``where``'s environments (by release)."""
    return min(envs.sort_keys[env] for env in where)


def column_order(key: tuple[Any, ...]) -> tuple[int, int, int, str]:
    dtype, mode, stage = map(str, key)
    return rank(DTYPES, dtype), rank(MODE_NAMES, mode), rank(STAGES, stage), stage


def column_name(dtype: str, mode: str, stage: str) -> str:
    """``float16/half``, with `` · train`` for a stage other than the forward."""
    return f"{dtype}/{mode}" + ("" if stage == FORWARD_STAGE else f" · {stage}")


Lines = list[tuple[str, Any]]


def alike(cells: pd.DataFrame) -> dict[str, tuple[Lines, list[str]]]:
    """The column's (row, profile) per fix in each environment (the upstream path
    ``none`` first), keyed by their text, with the environments that read them."""
    found: dict[str, tuple[Lines, list[str]]] = {}
    for env, mine in cells.groupby("env", sort=False):
        pairs = zip(mine["fix"], mine["base_row"], mine["profile"], strict=True)
        ordered = sorted(pairs, key=lambda p: (p[0] != CONTROL_FIX, p[1]))
        lines = list(dict.fromkeys((row, profile) for _, row, profile in ordered))
        found.setdefault(repr(lines), (lines, []))[1].append(str(env))
    return found


def chart(lines: Lines, direction: str) -> str:
    """The picture of one direction of ``lines``, held to their factor (the first line's:
    a profile's factor is its yardstick's, the same for every fix of a column)."""
    series = [ProfileLine(row, getattr(profile, direction)) for row, profile in lines]
    return profile_chart(series, lines[0][1].factor, direction)
