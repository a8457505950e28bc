"""Hostile and careless code and input: a fix or reference fix that reaches beyond its cell,
a worker killed under its cell, a full disk. Each must end in a recorded outcome or one clear
line, and nothing recorded before may be lost."""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.cli import output
from harness.measure.host import torch_state
from harness.results import storage
from harness.runner.run import missing_cells
from harness.schema.records import CellRecord, CrashKind, NoteKind, Outcome, SettingChange
from tests.conftest import FIXTURES, ROOT, TOY_CASES, harness, only_run_dir

HOSTILE_CASES = FIXTURES / "hostile_cases"


def notes_of(record: CellRecord, kind: NoteKind) -> str:
    """The text of a record's notes of ``kind`` (empty where it has none)."""
    return " ".join(note.text for note in record.notes if note.kind is kind)


def verdicts(records: list[CellRecord], case: str) -> dict[str, tuple[object, ...]]:
    """What another case's fix must not change: its outcome, dtypes and figures (and its
    notes, but for whether its timing settled: that is the machine's load, not the fix's)."""
    return {
        r.cell.id: (
            r.outcome, r.reproduces, r.error_type, r.out_dtypes, r.numerics,
            tuple(n for n in r.notes if n.kind is not NoteKind.NOISY),
        )
        for r in records
        if r.cell.case == case
    }  # fmt: skip


def run_toy(out: Path, cases: str, *extra: str) -> list[CellRecord]:
    result = harness(
        "run", "--cases-dir", str(HOSTILE_CASES), "--cases-dir", str(TOY_CASES), "--case",
        cases, "--device", "cpu", "--out", str(out), *extra,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    return storage.read_records(only_run_dir(out))


@pytest.mark.parametrize("workers", ["2", "0"])
def test_a_reference_fix_that_ends_its_process_costs_only_its_own_case(
    tmp_path: Path, workers: str
) -> None:
    records = run_toy(
        tmp_path / "run", "toy-reference-exits,toy-mixed-matmul", "--no-timing", "-n", workers
    )
    planned = storage.read_run_plan(only_run_dir(tmp_path / "run")).cells
    assert len(records) == len(planned)  # every planned cell has its record
    exits = [r for r in records if r.cell.case == "toy-reference-exits"]
    assert exits and all(r.crash_kind is CrashKind.REFERENCE_FAILED for r in exits)
    assert all("exited with code 0 without a result" in str(r.error_message) for r in exits)
    clean = run_toy(tmp_path / "clean", "toy-mixed-matmul", "--no-timing", "-n", workers)
    assert verdicts(records, "toy-mixed-matmul") == verdicts(clean, "toy-mixed-matmul")


def test_global_settings_a_fix_changes_reach_no_other_cell_in_either_phase(
    tmp_path: Path,
) -> None:
    timing = ("--time-budget", "0.02", "-n", "1")  # one worker: every cell in one process
    records = run_toy(tmp_path / "run", "toy-global-state,toy-mixed-matmul", *timing)
    clean = run_toy(tmp_path / "clean", "toy-mixed-matmul", *timing)
    assert verdicts(records, "toy-mixed-matmul") == verdicts(clean, "toy-mixed-matmul")
    leaky = {r.cell.fix: r for r in records if r.cell.case == "toy-global-state"}
    changed = notes_of(leaky["leaky"], NoteKind.SETTINGS_CHANGED)
    assert "default dtype torch.float32 -> torch.float64" in changed
    assert "autocast(cpu) False -> True" in changed
    assert "threads" in notes_of(leaky["one-thread"], NoteKind.SETTINGS_CHANGED)
    assert notes_of(leaky["one-thread"], NoteKind.SETTINGS_RESTORED)  # timed, put back
    timed_threads = {r.perf.threads for r in records if r.perf}
    assert timed_threads == {r.perf.threads for r in clean if r.perf}  # one value, unchanged
    assert leaky["none"].outcome is Outcome.PASSES and leaky["none"].out_dtypes == ("bfloat16",)


def test_worker_deaths_lose_no_cell(tmp_path: Path) -> None:
    records = run_toy(tmp_path, "toy-kills-worker", "--no-timing", "-n", "1")
    killers = [r for r in records if r.cell.fix == "kill-worker"]
    assert len(killers) == 6  # more than pytest-xdist's default restarts for one worker
    assert all(r.crash_kind is CrashKind.WORKER_DIED for r in killers)
    assert len(records) == 12


def test_a_run_with_planned_cells_unrecorded_names_them_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = run_toy(tmp_path, "toy-mixed-matmul", "--no-timing", "--fix", "none")
    run_dir = only_run_dir(tmp_path)
    lines = (run_dir / storage.CELLS_FILE).read_text().splitlines(keepends=True)
    (run_dir / storage.CELLS_FILE).write_text("".join(lines[1:]))
    lost = CellRecord.from_dict(json.loads(lines[0])).cell
    assert output.show_run(run_dir, None) == output.INCOMPLETE
    err = capsys.readouterr().err
    assert f"1 planned cells have no record:\n  {lost.id}" in err
    assert f"--resume {run_dir}" in err
    assert len(records) == len(lines)

    finished = harness("run", "--resume", str(run_dir))
    assert finished.returncode == 0, finished.stderr
    assert lost in {r.cell for r in storage.read_records(run_dir)}


def test_torch_settings_are_named_and_put_back() -> None:
    before = torch_state.snapshot()
    found: list[SettingChange] = []
    with torch_state.restored(found):
        torch.set_default_dtype(torch.float64)
        torch._C._set_mkldnn_enabled(False)  # torch.backends.mkldnn.enabled = False
    assert torch.get_default_dtype() == torch.float32 and torch.backends.mkldnn.enabled
    assert found == [
        SettingChange("default dtype", "torch.float32", "torch.float64"),
        SettingChange("backends.mkldnn.enabled", "True", "False"),
    ]
    assert torch_state.describe(torch_state.worded(found)) == (
        "changed torch's global settings (default dtype torch.float32 -> torch.float64; "
        "backends.mkldnn.enabled True -> False)"
    )
    assert torch_state.snapshot() == before
    assert torch_state.restore(before) == []


#: The size a file of the full-disk test may grow to.
FILE_LIMIT = 60_000


@pytest.mark.parametrize("workers", ["2", "0"])  # in a worker, and from the run's process
def test_a_full_disk_keeps_every_whole_record_stops_and_resumes(
    tmp_path: Path, workers: str
) -> None:
    """``RLIMIT_FSIZE`` makes writes past 60 kB fail as a full disk does: a short write, then
    an error. The run stops with one line; what it wrote is whole; ``--resume`` finishes.
    (The limit is per file: ``cases.json`` of every case, 41 kB, fits under it; the run's
    ``cells.jsonl``, 176 kB with Sana's train cells, does not.)"""

    def small_disk() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, FILE_LIMIT))

    selection = ("--case", "sana-softmax-float", "--device", "cpu", "--no-timing", "-n", workers)
    full = subprocess.run(
        [sys.executable, "-m", "harness", "run", *selection, "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, preexec_fn=small_disk, timeout=300,
    )  # fmt: skip
    assert full.returncode == 2 and "Traceback" not in full.stderr
    assert "could not be written (File too large); the run stopped there" in full.stderr
    run_dir = only_run_dir(tmp_path)
    data = (run_dir / storage.CELLS_FILE).read_bytes()
    assert data.endswith(b"\n") and len(data) <= FILE_LIMIT
    written = storage.read_records(run_dir)  # every line whole
    planned = storage.read_run_plan(run_dir)
    assert 0 < len(written) < len(planned.cells) + len(planned.skipped)

    finished = harness("run", "--resume", str(run_dir))
    assert finished.returncode == 0, finished.stderr
    assert {r.cell for r in written} < {r.cell for r in storage.read_records(run_dir)}
    assert missing_cells(run_dir) == []


def test_a_short_write_leaves_no_part_of_the_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = storage_record()
    storage.append_record(tmp_path, record)
    before = (tmp_path / storage.CELLS_FILE).read_bytes()
    real_write = os.write
    calls: list[int] = []

    def short_then_full(fd: int, data: bytes | memoryview) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:10]))  # a short write, as a filling disk does
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", short_then_full)
    with pytest.raises(storage.RecordNotWritten, match="No space left on device"):
        storage.append_record(tmp_path, record)
    monkeypatch.undo()
    assert (tmp_path / storage.CELLS_FILE).read_bytes() == before
    assert len(calls) == 2


def storage_record() -> CellRecord:
    from harness.schema.axes import Cell

    cell = Cell("c", "none", "cpu", "float16", "half", "eager")
    return CellRecord(cell=cell, torch_version="2.13.0", outcome=Outcome.PASSES)


def test_files_are_written_whole_and_no_foreign_file_is_overwritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "data.json"
    storage.write_json_atomic(target, {"a": 1})
    (tmp_path / "data.json.tmp").write_text("mine")  # a file the harness did not make

    def disk_full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(storage.ResultsError, match=r"could not be written \(No space left"):
        storage.write_json_atomic(target, {"a": 2})
    monkeypatch.undo()
    assert json.loads(target.read_text()) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.json", "data.json.tmp"]
    assert (tmp_path / "data.json.tmp").read_text() == "mine"


def test_a_case_module_that_ends_the_process_at_import_is_named(tmp_path: Path) -> None:
    result = harness(
        "run", "--cases-dir", str(FIXTURES / "exiting_cases"), "--no-timing", "--out",
        str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "ends_process.py: ended the process importing it (exit code 0)" in result.stderr
    assert not list(tmp_path.iterdir())  # no run was started


def test_fixes_that_fail_oddly_keep_their_cause(tmp_path: Path) -> None:
    records = run_toy(tmp_path, "toy-odd-fixes", "--no-timing", "-n", "1")
    by_fix = {r.cell.fix: r for r in records}
    interrupted = by_fix["keyboard-interrupt"]
    assert interrupted.outcome is Outcome.CRASHED
    assert "KeyboardInterrupt: pressed in a fix" in str(interrupted.error_message)
    meta = by_fix["meta-tensor"]
    assert meta.crash_kind is CrashKind.CONTRACT
    assert meta.error_message == "output is a meta tensor: it has no values to compare"
    unprintable = by_fix["unprintable-error"]
    assert (unprintable.outcome, unprintable.reproduces) == (Outcome.RAISES, False)
    assert unprintable.error_message == "<str() of the exception failed: ValueError>"
    assert unprintable.error_frames and "unprintable_error" in unprintable.error_frames[-1]
