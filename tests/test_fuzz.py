"""Fuzzing the readers: thousands of runs with one file damaged (a byte flipped, cut short,
a value of the wrong type, another encoding, emptied or removed), each read the way
``report``, ``compare``, ``bisect`` and ``--resume`` read it.

Every damaged run must end one of two ways: read, with each problem named by its file (and
line, for ``cells.jsonl``); or refused with one error that names the file. Anything else is
a traceback a user would have seen. ``AMPMATRIX_FUZZ_RUNS`` and ``AMPMATRIX_FUZZ_SEED``
explore further than the default."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.report import aggregate, compare, plots, writing
from harness.results import storage
from harness.results.versions import render_bisect
from harness.runner.run import missing_cells, saved_state
from harness.schema.config import RunConfig
from harness.schema.records import CellRecord
from harness.schema.run_files import RunPlan
from harness.schema.selection import SelectionError
from tests.conftest import ROOT

SOURCE = ROOT / "tests" / "data" / "runs" / "torch-2.13.0"
RUNS = int(os.environ.get("AMPMATRIX_FUZZ_RUNS", "3000"))
SEED = int(os.environ.get("AMPMATRIX_FUZZ_SEED", "20261123"))
#: One damaged run in this many is also rendered as a whole report (~0.1 s each).
RENDER_EVERY = 40
FILES = (storage.CELLS_FILE, storage.ENV_FILE, storage.CASES_FILE, storage.RUN_PLAN_FILE)
#: Values of the wrong type put where another belongs.
WRONG_VALUES: tuple[Any, ...] = (
    None, "", "x", "0.1", 0, -1, 1.5, True, [], [1], {}, {"a": 1}, "é\u2028", 10**30,
)  # fmt: skip


def base_run(folder: Path, records: int = 8) -> Path:
    """A small, valid run: the first records of a stored run, with a run plan."""
    folder.mkdir()
    lines = (SOURCE / storage.CELLS_FILE).read_text().splitlines()[:records]
    (folder / storage.CELLS_FILE).write_text("\n".join(lines) + "\n")
    env = storage.read_env(SOURCE)
    storage.write_env(folder, dataclasses.replace(env, torch_version=torch.__version__))
    storage.write_cases(folder, list(storage.read_cases(SOURCE).values()))
    cells = tuple(CellRecord.from_dict(json.loads(line)).cell for line in lines)
    storage.write_run_plan(folder, RunPlan(RunConfig(), cells))
    return folder


def flip_byte(data: bytes, rng: random.Random) -> bytes:
    at = rng.randrange(len(data))
    return data[:at] + bytes([rng.randrange(256)]) + data[at + 1 :]


def truncate(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data))]


def other_encoding(data: bytes, rng: random.Random) -> bytes:
    text = data.decode("utf-8", errors="replace")
    if rng.random() < 0.5:
        return text.encode("utf-16")
    return text.replace('"', '"\u00e9', 1).encode("latin-1", errors="replace")


def wrong_type(data: bytes, rng: random.Random) -> bytes:
    """One value somewhere in the JSON (of one line of a JSON-lines file) replaced by a
    value of another type."""
    if data.count(b"\n") > 1 and data.lstrip().startswith(b"{") and b"\n{" in data:
        lines = data.split(b"\n")
        at = rng.randrange(len(lines) - 1)
        lines[at] = wrong_type(lines[at], rng)
        return b"\n".join(lines)
    try:
        document = json.loads(data)
    except ValueError:
        return data
    replaced = replace_somewhere(document, rng)
    return json.dumps(replaced).encode()


def replace_somewhere(value: Any, rng: random.Random) -> Any:
    children = (
        list(value.keys())
        if isinstance(value, dict)
        else list(range(len(value)))
        if isinstance(value, list)
        else []
    )
    if not children or rng.random() < 0.3:
        return rng.choice(WRONG_VALUES)
    key = rng.choice(children)
    value[key] = replace_somewhere(value[key], rng)
    return value


Mutation = Callable[[bytes, random.Random], bytes]
MUTATIONS: dict[str, Mutation] = {
    "flip": flip_byte,
    "truncate": truncate,
    "encoding": other_encoding,
    "wrong-type": wrong_type,
    "wrong-type-2": wrong_type,
    "empty": lambda data, rng: b"",
}


def damage(run_dir: Path, rng: random.Random) -> str:
    """Damage one file of the run; returns what was done, to name a failing example."""
    name = rng.choice(FILES)
    path = run_dir / name
    if rng.random() < 0.03:
        path.unlink()
        return f"{name}: removed"
    kind = rng.choice(list(MUTATIONS))
    path.write_bytes(MUTATIONS[kind](path.read_bytes(), rng))
    return f"{name}: {kind}"


NAMED_ERRORS = (storage.ResultsError, SelectionError)


def read_as_every_reader_does(run_dir: Path, other: Path, full_report: bool) -> list[str]:
    """report, compare, bisect and --resume's reading; returns the problems they listed."""
    run = aggregate.load_run(run_dir)
    aggregate.records_frame([run])
    if full_report:  # the report's tables and page: slower, so on some runs only
        writing.render_report([run])
    compare.render_comparison(compare.compare_runs(aggregate.load_run(other), run))
    render_bisect(run.records)
    problems = list(run.problems)
    for reader in (saved_state, missing_cells):
        try:
            reader(run_dir)
        except NAMED_ERRORS as error:
            problems.append(str(error))
    return problems


def names_its_file(problem: str, run_dir: Path) -> bool:
    """``DIR/cells.jsonl:12: ...`` for a line of the records; ``DIR/FILE: ...`` otherwise."""
    if problem.startswith(f"{run_dir / storage.CELLS_FILE}:"):
        return bool(re.match(rf"{re.escape(str(run_dir / storage.CELLS_FILE))}(:\d+)?: ", problem))
    return any(problem.startswith(f"{run_dir / name}: ") for name in FILES)


@pytest.fixture
def quick_plots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plots are drawn from valid numbers: drawn for real in the report tests, left out
    here so thousands of damaged runs fit in a minute."""
    monkeypatch.setattr(plots, "error_vs_time", lambda *args: None)


def test_damaged_runs_are_read_with_every_problem_named_never_a_traceback(
    tmp_path: Path, quick_plots: None, clean_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # case folders a run plan names
    rng = random.Random(SEED)
    pristine = base_run(tmp_path / "pristine")
    other = base_run(tmp_path / "other", records=4)
    run_dir = tmp_path / "run"
    started, kinds = time.monotonic(), dict[str, int]()
    for number in range(RUNS):
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.copytree(pristine, run_dir)
        done = damage(run_dir, rng)
        kinds[done.split(": ")[1]] = kinds.get(done.split(": ")[1], 0) + 1
        try:
            problems = read_as_every_reader_does(run_dir, other, number % RENDER_EVERY == 0)
        except Exception as error:
            where = "".join(traceback.format_exception(error)[-4:])
            pytest.fail(f"run {number} ({done}, seed {SEED}): {where}")
        unnamed = [p for p in problems if not names_its_file(p, run_dir)]
        assert not unnamed, f"run {number} ({done}): problems without their file: {unnamed}"
    elapsed = time.monotonic() - started
    print(f"{RUNS} damaged runs read in {elapsed:.1f} s: {kinds}")
    assert set(kinds) == {*MUTATIONS, "removed"}  # every kind of damage was tried
