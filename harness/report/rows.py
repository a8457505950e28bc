"""A run's report rows, column by column: what the report's tables read of each cell.

Two ways in, one result. A run of schema 5 is read straight from its JSON lines
(:mod:`harness.results.columns`): its figures are taken column by column, and what is
derived from a cell's outcome, flags, trail and notes (its label, failure line, what it
computed in) is derived once per distinct value, from one record of those values, so no
record is built per cell. A run of an older schema is read record by record
(:func:`record_row`). Both derive through :func:`verdict_values`.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

from harness.results.columns import ParsedRun, orjson
from harness.results.computed_in import computed_in
from harness.results.speed import SpeedRatios, column_speed_ratios
from harness.results.summary import verdict_line, where_it_left
from harness.schema import gpus
from harness.schema.axes import Cell
from harness.schema.records import (
    CellRecord,
    FlagKind,
    Outcome,
    base_label,
    outcome_label,
)
from harness.schema.run_files import Environment

#: The fields of a cell, read once: ``dataclasses.asdict`` per record costs more than
#: the rest of a frame row.
CELL_FIELDS = tuple(f.name for f in dataclasses.fields(Cell))
cell_values = operator.attrgetter(*CELL_FIELDS)

#: What a row says of its cell's verdict: derived from its outcome, flags, trail, notes and
#: dtypes (never from the figures of one run), in this order.
VERDICT_COLUMNS = ("label", "base_label", "passed", "failure", "promotion", "failure_site",
                   "compute", "drift", "note", "out_dtype", "attn_dtype", "computed_in",
                   "fit", "left_at", "profile")  # fmt: skip
#: A row's columns, in the frame's order.
ROW_COLUMNS = (*CELL_FIELDS, "row_with_backend", "row_without_backend", "run", "torch_version",
               "hostname", "outcome", "label", "base_label", "failure", "promotion",
               "failure_site", "compute", "drift", "reproduces", "error_type", "error_message",
               "skip_reason", "note", "out_dtype", "attn_dtype", "computed_in", "rel_err",
               "tolerance", "median_s", "launch_bound", "iqr_s", "noisy", "peak_mem_bytes",
               "gflops", "peak_fraction", "vs_control", "vs_fastest", "fit", "passed",
               "left_at", "profile")  # fmt: skip


def dtypes_text(dtypes: Sequence[str]) -> str | None:
    """A cell's dtypes as the report shows them: ``float16+float32`` (None where none)."""
    return "+".join(dtypes) or None


def verdict_values(record: CellRecord) -> tuple[Any, ...]:
    """The record's :data:`VERDICT_COLUMNS`."""
    trail = record.trail
    return (
        outcome_label(record),
        base_label(record),
        record.outcome is Outcome.PASSES and not record.flags,
        verdict_line(record),
        trail.promotion.describe() if trail and trail.promotion else None,
        trail.failure() if trail else None,
        "; ".join(f"{kind}: {'+'.join(dtypes)}" for kind, dtypes in trail.compute_dtypes.items())
        if trail
        else None,
        any(flag.kind is FlagKind.DRIFT for flag in record.flags),
        record.notes_text,
        dtypes_text(record.out_dtypes),
        dtypes_text(record.attn_dtypes),
        computed_in(record),
        record.fit,
        where_it_left(record),
        record.profile,
    )


def record_row(
    record: CellRecord, run: tuple[str, str], ratio: SpeedRatios | None
) -> dict[str, Any]:
    """A record's row: its cell, outcome and figures, and its ``run``'s name and host."""
    perf, numerics, cell = record.perf, record.numerics, record.cell
    row = {
        **dict(zip(CELL_FIELDS, cell_values(cell), strict=True)),
        "row_with_backend": cell.row(show_backend=True),
        "row_without_backend": cell.row(show_backend=False),
        "run": run[0],
        "torch_version": record.torch_version,
        "hostname": run[1],
        "outcome": record.outcome.value,
        **dict(zip(VERDICT_COLUMNS, verdict_values(record), strict=True)),
        "reproduces": record.reproduces,
        "error_type": record.error_type,
        "error_message": record.error_message,
        "skip_reason": record.skip_reason,
        "rel_err": numerics.rel_err if numerics else None,
        "tolerance": numerics.tolerance if numerics else None,
        "median_s": perf.speed_s if perf else None,
        "launch_bound": perf.launch_bound if perf else None,
        "iqr_s": perf.time_iqr_s if perf else None,
        "noisy": perf.time_noisy if perf else None,
        "peak_mem_bytes": perf.peak_mem_bytes if perf else None,
        "gflops": perf.gflops if perf else None,
        "peak_fraction": perf.peak_fraction if perf else None,
        "vs_control": ratio.vs_control if ratio else None,
        "vs_fastest": ratio.vs_fastest if ratio else None,
    }
    return {name: row[name] for name in ROW_COLUMNS}


def device_names(env: Environment, devices: Sequence[str]) -> list[str]:
    """Per cell, its device as the report names it: by the GPU the run recorded at that
    device (``H100 80GB HBM3 (sm90)``), ``cpu`` for the CPU."""
    named = {d: gpus.device_label(env.gpus, d) for d in set(devices)}
    return [named[device] for device in devices]


#: The JSON fields a row's verdict is derived from (see :func:`verdict_key`): every field
#: that :func:`verdict_values` reads, and every field a record builds from more than its
#: own value (checked by building the record of a key's first line), but ``leaves``
#: (checked as columns: their figures differ from line to line).
VERDICT_FIELDS = ("outcome", "reproduces", "flags", "promotion", "failure_site", "compute_dtypes",
                  "island", "backward_node", "compile_error", "error_type", "error_message",
                  "error_frames", "crash_kind", "fit", "notes", "leaf", "finite", "factor",
                  "decided_by", "stage", "dtype", "baseline_error", "warnings", "out_dtypes",
                  "attn_dtypes", "settings_changes", "divergence", "profile")  # fmt: skip
VERDICT_VALUES = operator.itemgetter(*VERDICT_FIELDS)
#: The figures an inaccurate cell's failure line quotes (its error and tolerance).
QUOTED_FIELDS = ("rel_err", "tolerance")

#: A record per distinct verdict key seen by this process, its verdict's values (kept
#: across the runs of a report: a nightly's runs repeat their verdicts release after release).
_VERDICTS: dict[str | bytes, tuple[Any, ...]] = {}
MAX_VERDICTS = 65_536


def verdict_key(line: dict[str, Any]) -> str | bytes:
    """What a line's verdict is derived from, as the text of its values (JSON again by
    orjson where installed, else ``repr``: both tell ``true``, ``1`` and ``1.0`` apart, as
    JSON does): equal keys, equal verdicts. An inaccurate cell's line quotes its error and
    tolerance, so theirs are in its key."""
    try:  # a line the harness wrote has every field
        values = VERDICT_VALUES(line)
    except KeyError:
        values = tuple(map(line.get, VERDICT_FIELDS))
    if line.get("outcome") == Outcome.INACCURATE.value:
        values += tuple(map(line.get, QUOTED_FIELDS))
    return repr(values) if orjson is None else orjson.dumps(values)


def line_verdicts(parsed: ParsedRun) -> list[tuple[Any, ...]]:
    """Each latest line's :data:`VERDICT_COLUMNS`, from one record per distinct key; a
    line (superseded ones too) whose record cannot be read raises ``MalformedRecord``."""
    if len(_VERDICTS) > MAX_VERDICTS:
        _VERDICTS.clear()
    keys = list(map(verdict_key, parsed.read))
    for key, line in zip(keys, parsed.read, strict=True):
        if key not in _VERDICTS:
            _VERDICTS[key] = verdict_values(CellRecord.from_dict(line))
    return [_VERDICTS[keys[i]] for i in parsed.kept]


#: The cell's fields its row label reads (``Cell.row``): the fix, backend, compile, and the
#: scaler beside what decides the mode's (dtype, mode, stage).
ROW_FIELDS = ("fix", "backend", "compile", "dtype", "mode", "stage", "scaler")


def cell_rows(columns: dict[str, list[Any]]) -> tuple[list[str], list[str]]:
    """Each cell's row label with and without its backend (``Cell.row``), once per
    distinct value of the fields it reads."""
    places = list(zip(*(columns[name] for name in ROW_FIELDS), strict=True))
    if len(_ROW_LABELS) > MAX_VERDICTS:
        _ROW_LABELS.clear()
    for place in set(places).difference(_ROW_LABELS):
        cell = Cell("", device="", **dict(zip(ROW_FIELDS, place, strict=True)))
        _ROW_LABELS[place] = (cell.row(show_backend=True), cell.row(False))
    labels = list(map(_ROW_LABELS.__getitem__, places))
    return [label[0] for label in labels], [label[1] for label in labels]


#: Each place's row labels seen by this process (kept across the runs of a report, as
#: ``_VERDICTS``: a nightly's runs repeat their cells).
_ROW_LABELS: dict[tuple[Any, ...], tuple[str, str]] = {}


def parsed_rows(parsed: ParsedRun, run: tuple[str, str]) -> dict[str, list[Any]]:
    """The rows of a run read as columns (``harness.results.columns``), column by column; a
    line whose verdict's record cannot be read raises ``MalformedRecord``."""
    lines, columns = parsed.lines, parsed.columns
    count = len(lines)
    with_backend, without_backend = cell_rows(columns)
    verdicts = list(zip(*line_verdicts(parsed), strict=True))
    median = parsed.speed_s()
    vs_control, vs_fastest = column_speed_ratios(
        columns, median, [not flags for flags in columns["flags"]]
    )
    timed = [m is not None for m in median]
    judged = [t is not None for t in columns["tolerance"]]
    rows = {
        **{name: columns[name] for name in CELL_FIELDS},
        "row_with_backend": with_backend,
        "row_without_backend": without_backend,
        "run": [run[0]] * count,
        "torch_version": columns["torch_version"],
        "hostname": [run[1]] * count,
        "outcome": columns["outcome"],
        **{name: list(values) for name, values in zip(VERDICT_COLUMNS, verdicts, strict=True)},
        **{name: columns[name] for name in ("reproduces", "error_type", "error_message")},
        "skip_reason": columns["skip_reason"],
        "rel_err": where(judged, columns["rel_err"]),
        "tolerance": where(judged, columns["tolerance"]),
        "median_s": median,
        "launch_bound": where(timed, parsed.launch_bound()),
        **{name: where(timed, columns[field]) for name, field in PERF_COLUMNS.items()},
        "vs_control": vs_control,
        "vs_fastest": vs_fastest,
    }
    return {name: rows[name] for name in ROW_COLUMNS}


#: The row's figures of a timed cell, by the JSON field each is read from.
PERF_COLUMNS = {"iqr_s": "time_iqr_s", "noisy": "time_noisy", "peak_mem_bytes": "peak_mem_bytes",
                "gflops": "gflops", "peak_fraction": "peak_fraction"}  # fmt: skip


def where(present: list[bool], values: list[Any]) -> list[Any]:
    """``values``, None where not ``present`` (a figure of a sub-record the line lacks)."""
    if all(present):
        return values
    return [v if p else None for v, p in zip(values, present, strict=True)]
