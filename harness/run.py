"""The run pipeline: discover -> expand -> select -> run -> store.

Each step is a small function taking the previous one's output. Cells run as pytest items
(see ``harness.pytest_plugin``) so pytest-xdist can spread them over worker processes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from harness import execute, registry, storage
from harness.case import Case
from harness.environment import capture_environment, now_iso
from harness.matrix import Plan, Selection, check_selection, expand
from harness.pytest_plugin import Controller


@dataclass(frozen=True)
class RunOptions:
    selection: Selection = field(default_factory=Selection)
    cases_dirs: tuple[Path, ...] = ()
    results_root: Path = Path("results")
    workers: str = "auto"
    command: tuple[str, ...] = field(default_factory=tuple)


def discover_cases(cases_dirs: Sequence[Path]) -> list[Case]:
    registry.discover(cases_dirs)
    return registry.all_cases()


def plan_run(options: RunOptions) -> Plan:
    cases = discover_cases(options.cases_dirs)
    check_selection(cases, options.selection)
    return expand(cases, options.selection)


def start_run_dir(options: RunOptions) -> Path:
    run_dir = storage.create_run_dir(options.results_root, storage.new_run_id(torch.__version__))
    storage.write_env(run_dir, capture_environment(list(options.command)))
    return run_dir


def record_skipped(run_dir: Path, plan: Plan) -> None:
    for cell, reason in plan.skipped:
        storage.append_record(run_dir, execute.skipped_record(cell, reason))


def write_plan(run_dir: Path, plan: Plan, cases_dirs: Sequence[Path]) -> Path:
    path = run_dir / storage.PLAN_FILE
    data = {
        "run_dir": str(run_dir.resolve()),
        "cases_dirs": [str(Path(d).resolve()) for d in cases_dirs],
        "cells": [cell.to_dict() for cell in plan.to_run],
    }
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def worker_count(workers: str, cells: int) -> int:
    """``auto`` means one worker per core, never more workers than cells."""
    count = (os.cpu_count() or 1) if workers == "auto" else int(workers)
    return max(0, min(count, cells))


#: pytest plugins the cell run does without: no cache files in the results directory, and
#: the harness prints its own progress lines instead of pytest's.
DISABLED_PLUGINS = ("cacheprovider", "terminal", "randomly")


def pytest_args(plan_path: Path, workers: int) -> list[str]:
    args = [str(plan_path), "-c", os.devnull, "--rootdir", str(plan_path.parent)]
    args += ["-p", "harness.pytest_plugin", "--assert=plain"]
    for plugin in DISABLED_PLUGINS:
        args += ["-p", f"no:{plugin}"]
    if workers > 0:  # even one worker runs in its own process, so a crash costs one cell
        args += ["-n", str(workers)]
    return args


def threads_per_worker(workers: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def execute_cells(run_dir: Path, plan: Plan, workers: int, cases_dirs: Sequence[Path]) -> int:
    """Run the cells as pytest items; returns pytest's exit code."""
    if not plan.to_run:
        return 0
    plan_path = write_plan(run_dir, plan, cases_dirs)
    os.environ["AMPMATRIX_THREADS"] = str(threads_per_worker(workers))
    controller = Controller(run_dir, plan.to_run)
    return int(pytest.main(pytest_args(plan_path, workers), plugins=[controller]))


def finish_run(run_dir: Path, exit_code: int, workers: int) -> None:
    env = storage.read_env(run_dir)
    env.update(
        finished_at=now_iso(),
        runner_exit_code=exit_code,
        workers=workers,
        threads_per_worker=threads_per_worker(workers),
    )
    storage.write_env(run_dir, env)


def run(options: RunOptions) -> Path:
    """Run the selected matrix; returns the run directory."""
    plan = plan_run(options)
    run_dir = start_run_dir(options)
    print(
        f"ampmatrix: {len(plan.to_run)} cells to run, {len(plan.skipped)} skipped here; "
        f"results in {run_dir}",
        flush=True,
    )
    record_skipped(run_dir, plan)
    workers = worker_count(options.workers, len(plan.to_run))
    exit_code = execute_cells(run_dir, plan, workers, options.cases_dirs)
    finish_run(run_dir, exit_code, workers)
    return run_dir
