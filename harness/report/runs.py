"""Runs as a report reads them: a results directory's environment, and its cells as
records (``load_run``: ``compare``, ``nightly``) or as the report's rows, column by column
(``load_rows``: the HTML report, over as many runs as a nightly holds).

Runs are read tolerantly: a line or file that cannot be read is listed as a problem (file
and line), and everything valid is still used.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from harness.report.rows import CELL_FIELDS, device_names, parsed_rows, record_row, verdict_key
from harness.results import storage
from harness.results.columns import ParsedRun, parsed_run
from harness.results.speed import record_key, speed_ratios
from harness.schema.axes import Cell
from harness.schema.perf_records import Perf
from harness.schema.records import (
    NESTED,
    CellRecord,
    MalformedRecord,
    Numerics,
    leaves_from,
    plain_field_names,
)
from harness.schema.run_files import Environment

T = TypeVar("T")


@dataclass
class Run:
    """One results directory as read: its environment, records and reading problems."""

    run_dir: Path
    env: Environment
    records: list[CellRecord]
    problems: list[str] = field(default_factory=list)
    #: The report's rows of the records, column by column (``run_columns``), where
    #: computed ahead (then ``records`` may be dropped: columns are cheaper to keep and to
    #: send between processes).
    rows: dict[str, list[Any]] | None = None

    @property
    def name(self) -> str:
        return self.run_dir.name

    @property
    def host(self) -> str:
        """The host the run names (``?`` where it names none)."""
        return "?" if self.env.hostname is None else self.env.hostname


def read_env(run_dir: Path) -> tuple[Environment, list[str]]:
    """The run's environment and the problems reading it found (an empty one where it
    cannot be read at all)."""
    problems: list[str] = []
    try:
        return storage.read_env(run_dir, problems), problems
    except storage.ResultsError as error:
        return Environment(), [str(error)]


def load_run(run_dir: Path, records: list[CellRecord] | None = None) -> Run:
    """The run as read: its environment and records (``records`` where the caller has
    them, read already: then the file is not read again)."""
    env, problems = read_env(run_dir)
    if records is None:
        records = read_records(run_dir, problems)
    if not records:
        problems.append(empty_run(run_dir))
    return Run(run_dir, env, records, problems)


def read_records(run_dir: Path, problems: list[str]) -> list[CellRecord]:
    """The run's records (``storage.read_records``'): a run of the current schema read as
    columns (``harness.results.columns``) and its records built from them
    (:func:`parsed_records`), a third of the time of parsing each line into its record;
    any other record by record, which names each problem."""
    with storage.paused_gc():
        parsed = parsed_run(run_dir) if records_inside(run_dir) else None
        if parsed is not None and parsed.lines:
            try:
                return parsed_records(parsed)
            except MalformedRecord:
                pass
        return storage.read_records(run_dir, problems)


def parsed_records(parsed: ParsedRun) -> list[CellRecord]:
    """The records of a run read as columns, equal to those parsed line by line. What a
    record builds from more than its own value (outcome, flags, trail, notes, fit, ...)
    is built once per distinct set of those values (``rows.verdict_key``: a line of
    each, superseded ones too, parsed whole, so each is checked as the record by record
    reading checks it; kept across the runs read, as a nightly's runs repeat their
    verdicts release after release, as ``rows._VERDICTS``); each line's cell, plain
    fields, figures and output leaves come from its checked columns. Raises
    ``MalformedRecord`` where a line's record cannot be read."""
    if len(TEMPLATES) > MAX_TEMPLATES:
        TEMPLATES.clear()
    keys = list(map(verdict_key, parsed.read))
    for key, line in zip(keys, parsed.read, strict=True):
        if key not in TEMPLATES:
            TEMPLATES[key] = CellRecord.from_dict(line)
    columns = parsed.columns
    cells = zip(*(columns[name] for name in CELL_FIELDS), strict=True)
    plain = list(zip(*(columns[name] for name in PLAIN_FIELDS), strict=True))
    records = []
    for i, (place, line) in enumerate(zip(cells, parsed.lines, strict=True)):
        leaves = line.get("leaves")
        changes = dict(zip(PLAIN_FIELDS, plain[i], strict=True)) | {
            "cell": Cell(*place),
            "numerics": nested(Numerics, columns, i, "tolerance"),
            "perf": nested(Perf, columns, i, "time_median_s"),
            "leaves": leaves_from(leaves) if leaves else None,
        }
        records.append(with_fields(TEMPLATES[keys[parsed.kept[i]]], changes))
    return records


def with_fields(record: CellRecord, changes: dict[str, Any]) -> CellRecord:
    """A copy of ``record`` with ``changes``: ``dataclasses.replace`` without its call of
    the frozen class's ``__init__`` (each field set by ``object.__setattr__``: 12 us a
    record, a third of reading one), for values already checked."""
    copy = object.__new__(CellRecord)
    copy.__dict__.update(record.__dict__)
    copy.__dict__.update(changes)
    return copy


def nested(kind: type[T], columns: dict[str, list[Any]], i: int, marker: str) -> T | None:
    """Line ``i``'s figures of ``kind`` (its numerics, its timing), None where its
    ``marker`` field is null."""
    if columns[marker][i] is None:
        return None
    return kind(**{name: columns[name][i] for name in NESTED_FIELDS[kind]})


#: A record per distinct verdict key seen by this process (see :func:`parsed_records`).
TEMPLATES: dict[str | bytes, CellRecord] = {}
MAX_TEMPLATES = 65_536
#: The plain fields of a record, and each nested kind's.
PLAIN_FIELDS = plain_field_names()
NESTED_FIELDS: dict[type, tuple[str, ...]] = {
    kind: tuple(f.name for f in dataclasses.fields(kind)) for kind, _ in NESTED.values()
}


def empty_run(run_dir: Path) -> str:
    return f"{run_dir / storage.CELLS_FILE}: no records (an empty run)"


def load_runs(run_dirs: Sequence[Path]) -> list[Run]:
    return [load_run(Path(d)) for d in run_dirs]


#: Results files beyond this many bytes in all are read by several processes at once.
PARALLEL_BYTES = 4_000_000


def load_runs_for_report(run_dirs: Sequence[Path], processes: int | None = None) -> list[Run]:
    """The runs with their report rows computed and no records kept: what a report needs.
    Many runs (a nightly over every release) are read by one process per core."""
    dirs = [Path(d) for d in run_dirs]
    processes = min(processes or os.cpu_count() or 1, len(dirs))
    with storage.paused_gc():  # the rows received are no garbage: nothing to collect
        if processes < 2 or results_bytes(dirs) < PARALLEL_BYTES:
            return [load_rows(d) for d in dirs]
        context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        # small chunks: no process left alone at the end
        with context.Pool(processes) as pool:
            return pool.map(load_rows, dirs, chunksize=max(1, len(dirs) // (processes * 16)))


def results_bytes(dirs: Sequence[Path]) -> int:
    files = (d / storage.CELLS_FILE for d in dirs)
    return sum(f.stat().st_size for f in files if f.is_file())


def load_rows(run_dir: Path) -> Run:
    """One run as a report reads it: rows instead of records. A run of the current schema
    is read as columns (``harness.results.columns``), with no record per cell; any other
    (an older schema, a line that cannot be read) record by record, which names each
    problem."""
    with storage.paused_gc():
        env, problems = read_env(run_dir)
        parsed = parsed_run(run_dir) if records_inside(run_dir) else None
        if parsed is not None and parsed.lines:
            try:
                rows = parsed_rows(parsed, (run_dir.name, Run(run_dir, env, []).host))
            except MalformedRecord:
                rows = None
            if rows is not None:
                rows["device_label"] = device_names(env, rows["device"])
                return Run(run_dir, env, [], problems, shared(rows))
        run = load_run(run_dir)
        return Run(run.run_dir, run.env, [], run.problems, shared(run_columns(run)))


def records_inside(run_dir: Path) -> bool:
    """Whether ``cells.jsonl`` is a file of the run folder, not a link out of it (read
    record by record, such a link is named as a problem and read as no record)."""
    try:
        storage.run_file(run_dir, storage.CELLS_FILE)
    except storage.ResultsError:
        return False
    return True


def run_columns(run: Run) -> dict[str, list[Any]]:
    """A row per record of the run, with its speed ratios (computed within the run), column
    by column (empty for a run without records)."""
    ratios = speed_ratios(run.records)
    names = (run.name, run.host)
    rows = [record_row(r, names, ratios.get(record_key(r))) for r in run.records]
    if not rows:
        return {}
    # every row has the same keys in the same order: the values, transposed
    values = zip(*(row.values() for row in rows), strict=True)
    columns = dict(zip(rows[0], map(list, values), strict=True))
    columns["device_label"] = device_names(run.env, [r.cell.device for r in run.records])
    return columns


def shared(columns: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """``columns`` with equal values as one object: a run repeats its names, labels and
    messages in every row, and one object is sent between processes (pickled once) and held
    once, where a copy per row made a large report's memory."""
    seen: dict[str | None, str | None] = {}
    return {
        name: list(map(seen.setdefault, values, values))
        if TEXT.issuperset(map(type, values))
        else values
        for name, values in columns.items()
    }


#: The types of a column of text (numbers are left as they are: ``1 == 1.0 == True``).
TEXT = frozenset((str, type(None)))
