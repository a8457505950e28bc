"""Batches run from the run's own process, where there is no worker to give them to (one
batch; the timing phase of one device): what the pytest items of ``harness.runner.cell_items``
do, without a pytest session, whose import and start are a tenth of a small model's
``check``. Each batch still runs in a forked child (``harness.runner.isolation``)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from harness.results import storage
from harness.runner.isolation import (
    Column,
    batch_records,
    limits_for,
    remember_worker_state,
    timed_columns,
)
from harness.runner.progress import Progress, column_label, progress_label
from harness.schema.axes import Cell
from harness.schema.config import Limits, TimingConfig
from harness.schema.records import CellRecord

WORKER = "main"


def resume_command(run_dir: Path) -> str:
    return f"python -m harness run --resume {run_dir}"


def stopped(run_dir: Path, why: str) -> storage.ResultsError:
    """A record that could not be written stops the run: the reason and how to finish it."""
    return storage.ResultsError(
        f"{why}; the run stopped there. Every record before it is intact: make room, then "
        f"finish it with {resume_command(run_dir)}"
    )


def interrupted(run_dir: Path) -> KeyboardInterrupt:
    """Ctrl-C stops the run where it is: every record written is whole (each is written as
    its cell ends), the cell it stopped has none, and ``--resume`` runs what is left."""
    return KeyboardInterrupt(
        f"every record so far is kept in {run_dir}; finish the run with {resume_command(run_dir)}"
    )


def append(run_dir: Path, record: CellRecord) -> None:
    try:
        storage.append_record(run_dir, record)
    except storage.RecordNotWritten as error:
        raise stopped(run_dir, str(error)) from error


def run_batches_here(
    run_dir: Path,
    batches: list[list[Cell]],
    limits: Limits,
    threads: int,
    trace: bool,
    profile: bool = False,
) -> list[CellRecord]:
    """The correctness phase's batches, one after another; each record is appended as its
    cell ends, and all of them are returned for the run's next phase."""
    remember_worker_state()
    progress = Progress(sum(len(batch) for batch in batches))
    limits_of = partial(limits_for, limits=limits)
    records: list[CellRecord] = []
    for batch in batches:
        for record in batch_records(batch, WORKER, limits_of, threads, trace, profile):
            append(run_dir, record)
            records.append(record)
            progress.line(record.cell.id, progress_label(record))
    return records


def time_batches_here(
    run_dir: Path,
    batches: list[dict[str, Column]],
    timing: TimingConfig,
    limits: Limits,
    threads: int,
) -> list[CellRecord]:
    """The timing phase's batches of columns, one after another; each record is appended
    as its column ends, and all of them are returned."""
    remember_worker_state()
    progress = Progress(sum(len(batch) for batch in batches))
    records: list[CellRecord] = []
    for batch in batches:
        columns = list(batch.values())
        own_limits = limits_for(columns[0][0].cell, limits)
        for name, timed in zip(
            batch, timed_columns(columns, timing, WORKER, own_limits, threads), strict=True
        ):
            for record in timed:
                append(run_dir, record)
            records.extend(timed)
            progress.line(name, column_label(timed))
    return records
