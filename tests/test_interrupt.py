"""Ctrl-C during a run: one line that says how to finish it, every record kept, and
``--resume`` runs only what is left, from the worker path and from the run's own process."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.results import storage
from harness.runner.run import missing_cells
from tests.conftest import FIXTURES, ROOT, harness, only_run_dir

#: Five cells of a second each: the run is still going when the first one is recorded.
CASE = ("--cases-dir", str(FIXTURES / "slow_cases"), "--case", "toy-slow-cells")


def interrupt_after_first_cell(out: Path, workers: str) -> subprocess.CompletedProcess[str]:
    """``harness run`` stopped by SIGINT to its process group (what Ctrl-C in a terminal
    sends) once its first cell is recorded (each cell takes a second, so the others are
    still to come)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "harness", "run", *CASE, "--no-timing", "--batch", "1",
         "-n", workers, "--out", str(out)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
        # a shell without job control starts background commands with SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert process.stdout is not None
    lines = []
    for line in process.stdout:
        lines.append(line)
        if re.match(r"\[ *1/", line):
            break
    os.killpg(process.pid, signal.SIGINT)
    rest, stderr = process.communicate(timeout=120)
    return subprocess.CompletedProcess(
        process.args, process.returncode, "".join(lines) + rest, stderr
    )


@pytest.mark.parametrize("workers", ["0", "2"])
def test_ctrl_c_stops_the_run_with_how_to_finish_it(tmp_path: Path, workers: str) -> None:
    stopped = interrupt_after_first_cell(tmp_path, workers)
    run_dir = only_run_dir(tmp_path)
    assert stopped.returncode == 130, stopped.stdout + stopped.stderr
    assert "Traceback" not in stopped.stderr and "KeyboardInterrupt" not in stopped.stdout
    assert stopped.stderr.strip().splitlines()[-1] == (
        f"ampmatrix: interrupted: every record so far is kept in {run_dir}; finish the run "
        f"with python -m harness run --resume {run_dir}"
    )
    kept = storage.read_records(run_dir)
    assert kept and missing_cells(run_dir, kept)  # stopped part-way, what ran is recorded
    finished = harness("run", "--resume", str(run_dir), "-n", workers)
    assert finished.returncode == 0, finished.stderr
    records = storage.read_records(run_dir)
    assert not missing_cells(run_dir, records)
    assert len({r.cell for r in records}) == len(records)  # no cell recorded twice
