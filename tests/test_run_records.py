"""A run's records pass from phase to phase in memory: ``cells.jsonl`` is written as each
cell ends (the source of truth) and read back only where the parent has them on disk
alone: after a phase pytest workers ran, and by ``--resume``."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from harness.results import storage
from harness.runner import run
from harness.schema.axes import Cell
from harness.schema.config import RunConfig, TimingConfig
from harness.schema.records import CellRecord
from harness.schema.selection import Selection
from tests.conftest import TOY_CASES

TOY = "toy-mixed-matmul"


def toy_config(results: Path, **changes: Any) -> RunConfig:
    """``harness run --cases-dir tests/fixtures/cases --case toy-mixed-matmul -n 0
    --no-timing --out RESULTS``."""
    config = RunConfig(
        selection=Selection(cases=(TOY,)),
        cases_dirs=(TOY_CASES,),
        results_root=results,
        workers="0",
        timing=None,
    )
    return replace(config, **changes)


def count_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Each reading of ``cells.jsonl`` (``read_records`` reads through it), by run folder."""
    reads: list[Path] = []
    read = storage.read_record_lines

    def counted(run_dir: Path, problems: list[str] | None = None) -> list[CellRecord]:
        reads.append(run_dir)
        return read(run_dir, problems)

    monkeypatch.setattr(storage, "read_record_lines", counted)
    return reads


def test_a_run_from_its_own_process_never_reads_its_records_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The correctness phase, the timing phase's choice of cells and the closing of the
    run read ``cells.jsonl`` once each before (three readings here): now none."""
    reads = count_reads(monkeypatch)
    run_dir = run.run(toy_config(tmp_path))
    assert reads == []
    records = storage.read_records(run_dir)
    assert records and not run.missing_cells(run_dir, records)
    assert storage.read_env(run_dir).runner_exit_code == 0


def test_a_timed_run_from_its_own_process_never_reads_its_records_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four readings before (the phase after correctness, the cells to time, the timing
    phase's figures, the closing); now none, and the timed records are what closes it."""
    reads = count_reads(monkeypatch)
    timing = TimingConfig(budget_s=0.01)
    selection = Selection(cases=(TOY,), fixes=("cast-input",), modes=("half",))
    run_dir = run.run(toy_config(tmp_path, timing=timing, selection=selection))
    assert reads == []
    env = storage.read_env(run_dir)
    assert env.timing_phase and env.timing_phase["cells"] >= 1
    records = storage.read_records(run_dir)
    timed = [r for r in records if r.perf is not None or r.timing_error is not None]
    assert len(timed) == env.timing_phase["cells"]  # each timed, or why not
    assert (env.peak_gflops or {}) == run.measured_peaks(records)


def test_a_phase_pytest_workers_ran_is_read_back_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers are other processes: their records reach the run through ``cells.jsonl``,
    read once as their phase ends (here a stand-in for pytest appends them)."""
    launched: list[list[list[Cell]]] = []

    def workers_run(run_dir: Path, batches: list[list[Cell]], workers: int) -> int:
        from harness.measure import execute

        launched.append(batches)
        for batch in batches:
            for cell in batch:
                storage.append_record(run_dir, execute.skipped_record(cell, "by a worker"))
        return 0

    monkeypatch.setattr(run, "launch_cells", workers_run)
    reads = count_reads(monkeypatch)
    run_dir = run.run(toy_config(tmp_path, workers="2", batch=1))
    assert len(launched) == 1 and len(reads) == 1 and reads[0] == run_dir
    assert not run.missing_cells(run_dir, storage.read_records(run_dir))


def test_resume_reads_what_the_stopped_run_left_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run stopped part-way (its last records lost, the last line cut off): ``--resume``
    reads ``cells.jsonl`` once, runs only what has no record, and closes the run."""
    run_dir = run.run(toy_config(tmp_path))
    path = run_dir / storage.CELLS_FILE
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(lines[:2]) + lines[2][:20])
    reads = count_reads(monkeypatch)
    run.resume(run_dir, workers="0")
    assert len(reads) == 1
    records = storage.read_records(run_dir)
    assert len(records) == len(lines) and not run.missing_cells(run_dir, records)
    assert storage.read_env(run_dir).resumed
