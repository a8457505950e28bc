"""Fault injection: crashes, hangs, memory exhaustion, kills at random moments and resume.
Each test checks the exact outcome recorded and that every other cell's record is intact."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.results import storage
from harness.schema.records import SCHEMA_VERSION, CellRecord, NoteKind, Outcome
from tests.conftest import FIXTURES, ROOT, TOY_CASES, harness, only_run_dir, run_cases

CRASH_CASES = FIXTURES / "crash_cases"


def figures(records: list[CellRecord]) -> dict[str, tuple[object, ...]]:
    """What must match between runs: outcome, error type and the error figures."""
    return {
        r.cell.id: (r.outcome, r.reproduces, r.error_type, r.out_dtypes, r.numerics)
        for r in records
    }


def test_faults_are_classified_and_cost_only_themselves(tmp_path: Path) -> None:
    started = time.monotonic()
    faulty = harness(
        "run",
        "--cases-dir",
        str(CRASH_CASES),
        "--cases-dir",
        str(TOY_CASES),
        "--case",
        "toy-abort,toy-mixed-matmul",
        "--device",
        "cpu",
        "--no-timing",
        "--timeout",
        "3",
        "--memory-limit",
        "4",
        "-n",
        "2",
        "--out",
        str(tmp_path / "faulty"),
    )
    assert faulty.returncode == 0, faulty.stderr
    assert time.monotonic() - started < 120  # the hang was cut at its time limit
    records = {
        r.cell.fix: r
        for r in storage.read_records(only_run_dir(tmp_path / "faulty"))
        if r.cell.case == "toy-abort"
    }
    assert records["abort"].outcome is Outcome.CRASHED
    assert "signal 6 (SIGABRT)" in str(records["abort"].error_message)
    assert records["segfault"].outcome is Outcome.CRASHED
    assert "signal 11 (SIGSEGV)" in str(records["segfault"].error_message)
    assert records["hang"].outcome is Outcome.TIMEOUT
    assert "after 3 s" in str(records["hang"].error_message)
    assert records["exhaust-memory"].outcome is Outcome.RAISES
    assert "can't allocate memory" in str(records["exhaust-memory"].error_message)
    assert records["none"].outcome is Outcome.PASSES

    clean = harness(
        "run",
        "--cases-dir",
        str(TOY_CASES),
        "--case",
        "toy-mixed-matmul",
        "--device",
        "cpu",
        "--no-timing",
        "-n",
        "2",
        "--out",
        str(tmp_path / "clean"),
    )
    assert clean.returncode == 0, clean.stderr
    toy_faulty = [
        r
        for r in storage.read_records(only_run_dir(tmp_path / "faulty"))
        if r.cell.case == "toy-mixed-matmul"
    ]
    assert figures(toy_faulty) == figures(storage.read_records(only_run_dir(tmp_path / "clean")))


def wait_for_run_plan(root: Path, limit_s: float = 120) -> None:
    """A run can be resumed once its plan is written: wait for that moment."""
    deadline = time.monotonic() + limit_s
    while not list(root.glob(f"*/{storage.RUN_PLAN_FILE}")):
        assert time.monotonic() < deadline, "the run never wrote its plan"
        time.sleep(0.05)


#: Forward cells only: a kill and a resume work the same at every stage, and the cases'
#: timed train cells tripled the test's time.
SEED_SELECTION = (
    "--case",
    "sana-softmax-float,var-normalize-promotion,dia-sdpa-kv-cache",
    "--stage",
    "forward",
    "--device",
    "cpu",
    "-n",
    "2",
)


@pytest.mark.parametrize("run_timing", [False, True])
def test_a_run_killed_at_a_random_moment_resumes_to_the_same_results(
    tmp_path: Path, run_timing: bool
) -> None:
    timing = ("--time-budget", "0.05") if run_timing else ("--no-timing",)
    whole = harness("run", *SEED_SELECTION, *timing, "--out", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr

    delay = random.Random().uniform(0.0, 3.0)  # after the run's plan exists
    killed = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness",
            "run",
            *SEED_SELECTION,
            *timing,
            "--out",
            str(tmp_path / "killed"),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    wait_for_run_plan(tmp_path / "killed")
    time.sleep(delay)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    run_dir = only_run_dir(tmp_path / "killed")
    before = len(storage.read_records(run_dir, problems=[]))

    resumed = harness("run", "--resume", str(run_dir))
    assert resumed.returncode == 0, f"killed after {delay:.1f} s: {resumed.stderr}"
    expected = storage.read_records(only_run_dir(tmp_path / "whole"))
    got = storage.read_records(run_dir)
    assert figures(got) == figures(expected), f"killed after {delay:.1f} s ({before} records)"
    if run_timing:
        timed = {r.cell.id for r in expected if r.perf}
        assert {r.cell.id for r in got if r.perf} == timed
    env = storage.read_env(run_dir)
    assert env.finished_at
    # a kill that came after the run ended leaves nothing to resume, and nothing rewritten
    assert env.resumed or "is complete: nothing left" in resumed.stdout


def test_resume_refuses_selection_flags_and_runs_without_a_plan(tmp_path: Path) -> None:
    result = harness("run", "--resume", str(tmp_path), "--case", "sana-softmax-float")
    assert (
        result.returncode == 2 and "--resume finishes the run as it was started" in result.stderr
    )
    result = harness("run", "--resume", str(tmp_path))
    assert result.returncode == 2 and "run-plan.json: missing" in result.stderr


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        ("[]", "not a run plan"),
        ('{"cells": [1], "skipped": []}', "malformed run plan"),
        ('{"cells": [], "skipped": [], "config": {"selection": 3}}', "malformed run plan"),
        ('{"schema_version": 99, "cells": [], "skipped": []}', "schema_version 99 is newer"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_a_malformed_run_plan_is_named_not_a_traceback(
    tmp_path: Path, plan: str | bytes, message: str
) -> None:
    path = tmp_path / storage.RUN_PLAN_FILE
    path.write_bytes(plan if isinstance(plan, bytes) else plan.encode())
    result = harness("run", "--resume", str(tmp_path))
    assert result.returncode == 2 and message in result.stderr
    assert "Traceback" not in result.stderr


def test_results_folder_that_is_a_file_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "results"
    blocker.write_text("not a folder")
    result = harness("run", "--case", "sana-softmax-float", "--out", str(blocker))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("ampmatrix: error: ") and str(blocker) in result.stderr
    assert blocker.read_text() == "not a folder"


def test_a_half_written_last_line_is_cut_before_appending(tmp_path: Path) -> None:
    cells = tmp_path / storage.CELLS_FILE
    cells.write_text('{"a": 1}\n{"schema_version": 1, "ca')
    assert storage.drop_partial_last_line(tmp_path) == '{"schema_version": 1, "ca'
    assert cells.read_text() == '{"a": 1}\n'
    assert storage.drop_partial_last_line(tmp_path) is None


def test_records_are_whole_lines_under_parallel_appends(tmp_path: Path) -> None:
    result = run_cases(TOY_CASES, "toy-mixed-matmul", tmp_path)
    assert result.returncode == 0, result.stderr
    lines = (only_run_dir(tmp_path) / storage.CELLS_FILE).read_text().splitlines()
    assert all(json.loads(line)["schema_version"] == SCHEMA_VERSION for line in lines)


def test_resume_is_one_process_at_a_time_same_torch_and_leaves_a_finished_run(
    tmp_path: Path,
) -> None:
    result = run_cases(TOY_CASES, "toy-mixed-matmul", tmp_path, "--fix", "none")
    assert result.returncode == 0, result.stderr
    run_dir = only_run_dir(tmp_path)
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}

    finished = harness("run", "--resume", str(run_dir))
    assert finished.returncode == 0 and "nothing left to run or time" in finished.stdout
    after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    assert after == before  # env.json (workers, finished_at) not rewritten

    with storage.run_lock(run_dir):
        busy = harness("run", "--resume", str(run_dir))
    assert busy.returncode == 2 and "another ampmatrix process" in busy.stderr

    env = json.loads((run_dir / storage.ENV_FILE).read_text())
    (run_dir / storage.ENV_FILE).write_text(json.dumps({**env, "torch_version": "2.4.1+cu121"}))
    other = harness("run", "--resume", str(run_dir))
    assert other.returncode == 2 and "recorded under torch 2.4.1+cu121" in other.stderr
    assert "matrix(torch='2.4.1')" in other.stderr


def test_reference_and_baseline_run_on_as_many_threads_as_the_cells(tmp_path: Path) -> None:
    """At model sizes float32 rounding depends on the thread count: the figures a cell is
    judged against must come from the same number of threads as the cell."""
    result = harness(
        "run",
        "--cases-dir",
        str(FIXTURES / "thread_cases"),
        "--case",
        "toy-threads",
        "--no-timing",
        "-n",
        "1",
        "--out",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    records = storage.read_records(only_run_dir(tmp_path))
    assert records and all(r.outcome is Outcome.PASSES for r in records), [
        (r.cell.id, r.numerics) for r in records
    ]


def test_a_fix_that_kills_the_timing_process_costs_only_its_own_figures(
    clean_registry: None,
) -> None:
    """The columns of one case share a timing process: when a fix kills it, the cells of
    its column are timed each alone, and the columns after it in a process of their own."""
    from harness.measure.authoring import registry
    from harness.runner.isolation import time_columns_isolated
    from harness.schema.axes import Cell
    from harness.schema.config import Limits, TimingConfig

    registry.discover([CRASH_CASES])

    def passed(fix: str, dtype: str, mode: str) -> CellRecord:
        return CellRecord(Cell("toy-abort", fix, "cpu", dtype, mode, "eager"), "x", Outcome.PASSES)

    first = [passed("none", "float16", "half"), passed("abort-when-timed", "float16", "half")]
    second = [passed("none", "float32", "fp32")]
    config = TimingConfig(budget_s=0.01, min_calls=1)
    columns = list(time_columns_isolated([first, second], config, "main", Limits(), threads=1))
    (none, killer), (later,) = columns
    told = [[n.kind for n in r.notes if n.kind is not NoteKind.NOISY] for r in (none, later)]
    assert none.perf is not None and told[0] == [NoteKind.TIMED_ALONE]
    assert killer.perf is None and "died" in str(killer.timing_error)
    assert later.perf is not None and told[1] == []
