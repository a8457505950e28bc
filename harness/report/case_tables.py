"""A case's tables in the report: its cells (one row per cell and distinct outcome), its
skipped cells by reason, its messages and its dtype trails, each as views
(:mod:`harness.report.views`) built from the case's rows of the frame.

A cell's colour comes from ``styles``: each label's :class:`~harness.report.views.CellStyle`,
read off the frame's outcome and flag columns (:func:`label_styles`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping
from typing import Any

import pandas as pd

from harness.report import grouping
from harness.report.grouping import Environments, EnvironmentSet
from harness.report.views import (
    CellNumbers,
    CellRow,
    CellsAt,
    CellStyle,
    Message,
    SkippedCells,
    TrailRow,
)

#: Each label of a frame and its style.
Styles = Mapping[str, CellStyle]


def label_styles(frame: pd.DataFrame) -> dict[str, CellStyle]:
    """Each label in ``frame`` and its style, from its cells' ``base_label`` and ``drift``
    columns; a label carries its flags, so it differs from its base label where it has
    any."""
    if frame.empty:
        return {}
    found = frame[["label", "base_label", "drift"]].drop_duplicates("label")
    drifts = found["drift"].fillna(False).astype(bool)
    return {
        str(label): CellStyle(str(base), label != base, bool(drift))
        for label, base, drift in zip(found["label"], found["base_label"], drifts, strict=True)
    }


def fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return format(value, spec)


def fmt_bytes(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return ""


def fmt_ms(seconds: Any) -> str:
    return fmt(seconds * 1e3, ".3f") + " ms"


def text_or_none(value: Any) -> str | None:
    """Strings from the frame, with pandas' missing values as None."""
    return value if isinstance(value, str) and value else None


#: The numbers of a cell's row, each shown as a value or a median with its range over the
#: environments of the row: (column, how it is shown); the fields of ``CellNumbers``.
NUMBERS: tuple[tuple[str, Callable[[Any], str]], ...] = (
    ("rel_err", lambda v: fmt(v, ".2e")),
    ("tolerance", lambda v: fmt(v, ".2e")),
    ("median_s", fmt_ms),
    ("vs_control", lambda v: fmt(v, ".2f")),
    ("vs_fastest", lambda v: fmt(v, ".2f")),
    ("peak_mem_bytes", fmt_bytes),
    ("gflops", lambda v: fmt(v, ".2f")),
    ("peak_fraction", lambda v: fmt(v, ".1%")),
)


#: What a case's table of cells reads of the frame.
ROW_COLUMNS = [*grouping.CELL_KEY, "env", "fix", "base_row", "stage", *grouping.VARIANT,
               "noisy", "launch_bound", *(column for column, _ in NUMBERS)]  # fmt: skip


def cell_rows(case_frame: pd.DataFrame, envs: Environments, styles: Styles) -> list[CellRow]:
    """One row per cell and distinct outcome: a cell with the same outcome in every
    environment is one row; one whose outcome differs has a row per outcome, most common
    first, each naming its environments."""
    if case_frame.empty:
        return []
    keys = grouping.key_columns(case_frame)
    show_size = "size" in case_frame and case_frame["size"].nunique() > 1
    universe = case_frame["env"].unique()
    rows_order = grouping.row_sort_keys(case_frame)
    variants: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for found in variant_stats(case_frame, [*keys, *grouping.VARIANT]):
        key = tuple(found[k] for k in keys)
        variants.setdefault(key, []).append(found)
    rows = []
    for key in sorted(variants, key=lambda k: grouping.cell_key_order(k, rows_order)):
        ordered = sorted(variants[key], key=lambda v: -len(v["envs"]))
        for i, found in enumerate(ordered):
            where = envs.describe(found["envs"], universe)
            count = len(ordered) if i == 0 else 0
            rows.append(variant_row(found, where, show_size, styles, count))
    return rows


def variant_stats(case_frame: pd.DataFrame, by: list[str]) -> list[dict[str, Any]]:
    """Per group of ``by`` (missing text a group of its own), in the order they first
    appear: its keys, its environments, its cell count, whether a timing was noisy or
    launch-bound, and each number's median, minimum and maximum over the values present.
    Computed over the columns as lists: a case's groups are a few cells each, where a
    pandas aggregation of 24 figures cost a tenth of a second a case."""
    keys = zip(*(filled_values(case_frame[c]) for c in by), strict=True)
    numbers = [numeric_values(case_frame[c]) for c, _ in NUMBERS]
    flags = [case_frame[c].eq(True).tolist() for c in ("noisy", "launch_bound")]
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    envs = case_frame["env"].tolist()
    found = []
    for key, members in groups.items():
        stats: dict[str, Any] = dict(zip(by, key, strict=True))
        stats["envs"] = list(dict.fromkeys(envs[i] for i in members))
        stats["cells"] = len(members)
        stats["noisy"] = any(flags[0][i] for i in members)
        stats["launch_bound"] = any(flags[1][i] for i in members)
        for (column, _), values in zip(NUMBERS, numbers, strict=True):
            present: list[float] = [v for i in members if (v := values[i]) is not None]
            median = statistics.median(present) if present else math.nan
            low, high = (min(present), max(present)) if present else (math.nan, math.nan)
            stats |= {f"{column} median": median, f"{column} min": low, f"{column} max": high}
        found.append(stats)
    return found


def filled_values(column: pd.Series) -> list[Any]:
    """A column's values, missing text as ``""`` (:func:`grouping.filled`)."""
    if column.dtype != object:
        return column.tolist()
    return column.fillna("").tolist()


def numeric_values(column: pd.Series) -> list[float | int | None]:
    """A column's numbers, None where one is missing or not a number."""
    values = pd.to_numeric(column, errors="coerce")
    return [None if pd.isna(v) else v for v in values.tolist()]


def variant_row(
    found: dict[str, Any], where: EnvironmentSet, show_size: bool, styles: Styles, variants: int
) -> CellRow:
    numbers = {
        column: grouping.spread(
            found[f"{column} median"], found[f"{column} min"], found[f"{column} max"], show
        )
        for column, show in NUMBERS
    }
    return CellRow(
        row=found["row"] + (f" ({found['size']})" if show_size else ""),
        dtype=found["dtype"],
        mode=found["mode"],
        envs=where,
        cells=found["cells"],
        label=found["label"],
        css=styles[found["label"]].css,
        skip_reason=text_or_none(found["skip_reason"]),
        out_dtype=text_or_none(found["out_dtype"]),
        attn_dtype=text_or_none(found["attn_dtype"]),
        numbers=CellNumbers(**numbers),
        noisy=bool(found["noisy"]),
        launch_bound=bool(found["launch_bound"]),
        variants=variants,
    )


def skipped_summary(case_frame: pd.DataFrame, envs: Environments) -> list[SkippedCells]:
    """Skipped cells counted by reason, with the environments where they were skipped."""
    skipped = case_frame.loc[case_frame["outcome"] == "skipped", ["skip_reason", "env"]]
    universe = case_frame["env"].unique()
    return [
        SkippedCells(reason, len(cells), envs.describe(cells["env"], universe))
        for (reason,), cells in grouping.grouped(skipped, ["skip_reason"])
    ]


def where_cells(cells: pd.DataFrame, envs: Environments, universe: Any) -> list[CellsAt]:
    """The cells of a message or trail: ``row · dtype/mode`` and the environments."""
    keys = grouping.key_columns(cells)
    return [
        CellsAt(f"{key[0]} · {key[1]}/{key[2]}", envs.describe(group["env"], universe))
        for key, group in grouping.grouped(cells, keys)
    ]


def messages(case_frame: pd.DataFrame, envs: Environments) -> list[Message]:
    """Each distinct error message or note once, with every cell and environment it came
    from."""
    universe = case_frame["env"].unique()
    cells = case_frame[[*grouping.key_columns(case_frame), "env"]]  # what where_cells reads
    texts = pd.concat(
        [
            cells.assign(text=case_frame[column])[lambda f: f["text"].map(is_text)]
            for column in ("failure", "note")
        ]
    )
    return [
        Message(text, len(cells), where_cells(cells, envs, universe))
        for (text,), cells in grouping.grouped(texts, ["text"])
    ]


def is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


TRAIL = ("label", "promotion", "failure_site", "compute")


def trails(case_frame: pd.DataFrame, envs: Environments, styles: Styles) -> list[TrailRow]:
    """The dtype trail of every cell that raised or drifted: where the wider dtype entered,
    where it failed, what the kernels computed in; one row per distinct trail."""
    keys = grouping.key_columns(case_frame)
    shown = case_frame.loc[
        (case_frame["outcome"] == "raises") | case_frame["drift"].fillna(False),
        [*keys, *TRAIL, "env"],
    ]
    universe = case_frame["env"].unique()
    rows = []
    for key, cells in grouping.grouped(shown, [*keys, *TRAIL]):
        label, promotion, failure, compute = key[len(keys) :]
        rows.append(
            TrailRow(
                where=f"{key[0]} · {key[1]}/{key[2]}",
                envs=envs.describe(cells["env"], universe),
                label=label,
                css=styles[label].css,
                promotion=text_or_none(promotion) or "no op left the cell's dtype",
                failure=text_or_none(failure) or "-",
                compute=text_or_none(compute) or "-",
            )
        )
    return rows
