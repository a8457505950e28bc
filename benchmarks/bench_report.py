"""How long rendering a report and comparing runs take, as a user waits for them
(``nox -s bench``).

First, side by side, what issue 42 asks, each against its target: the report of a run of
the default matrix's shape (2 s), the report over a nightly's 100k cells (5 s) and
``compare`` over the same cells (5 s). Then reports from 11 cells to 10k.

Every figure is end to end as a user runs it: ``python -m harness report RUN_DIR... --out
FILE`` or ``python -m harness compare BASE HEAD`` in a process of its own, with
``PYTHONDONTWRITEBYTECODE=1`` (as CI images run: nothing compiled is written, so what the
environment did not compile at install is compiled at every start), by the wall clock
(interpreter start-up and imports included), with the peak resident memory of that process
(``ru_maxrss`` of the children of a fresh helper process per command, so one command's
figure never carries another's; the processes that read many runs in parallel are children
of the command and counted as such: the figure is the largest one's).

The default run is synthetic, of the default ``nox -s matrix`` run's shape on a host
without a GPU (:data:`DEFAULT_CASES`: 16 cases, 1,302 cells, two thirds of them CUDA's and
skipped, the CPU's timed), its records those of the stored runs of ``tests/data/runs``
(their outcomes, errors, dtype trails, flags and timings) put in its cells. 11 cells are a
stored run cut short, twice: to its first 11 records (all untimed: the correctness records
come first), and to its first 11 cells with their timed records (so the report draws a
plot). 1k cells and more are synthetic runs built from the stored result sets (the same
records under other torch versions and hosts, a nightly's worth), each stored run in
``base`` and its sibling of the other torch version in ``head``, so ``compare base head``
pairs them by environment with real outcome and speed changes. Every run is written as the
current schema writes it (the stored runs are of older ones), so it is read as a fresh
run's. Also timed, in this process: reading the results files alone, and ``compare`` over
the same cells.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

from harness.report.aggregate import load_runs, load_runs_for_report
from harness.report.compare import compare_runs, render_comparison
from harness.results import storage
from harness.schema.axes import FORWARD_STAGE, Cell, default_scaler
from harness.schema.devices import CPU
from harness.schema.perf_records import Perf
from harness.schema.records import CellRecord, Outcome

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "tests" / "data" / "runs").iterdir())
SIZES = (11, 1_000, 10_000)
#: The sizes of the acceptance's reports: the default run's (its own shape, below), and a
#: nightly's 100k cells.
DEFAULT_RUN, NIGHTLY = 1_689, 100_000
RELEASES = ("2.1.2", "2.2.2", "2.3.1", "2.4.1", "2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1",
            "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1")  # fmt: skip
#: Per size: the most seconds (wall clock, start-up included) and megabytes (peak RSS) a
#: report may take; None where there is no target.
TARGETS: dict[int, tuple[float | None, float | None]] = {
    11: (1.0, None),
    DEFAULT_RUN: (2.0, None),
    NIGHTLY: (5.0, 500.0),
}
#: The most seconds ``compare`` over the nightly's cells may take, end to end.
COMPARE_TARGET = 5.0
#: The stored run that the smallest reports are cut from: it has timed cells.
SMALL_SOURCE = ROOT / "tests" / "data" / "runs" / "torch-2.13.0"


@cache
def current_lines(source: Path) -> tuple[dict[str, Any], ...]:
    """The lines of ``source``'s results as the current schema writes them."""
    return tuple(
        CellRecord.from_dict(json.loads(line)).to_dict()
        for line in (source / storage.CELLS_FILE).read_text().splitlines()
    )


def written(lines: Iterable[dict[str, Any]]) -> str:
    return "".join(json.dumps(line, allow_nan=False) + "\n" for line in lines)


#: The default ``nox -s matrix`` run's shape on a host without a GPU (torch 2.13.0, as
#: issue 42 measured it): 16 cases, 1,302 cells (two thirds of them CUDA's, skipped there),
#: the CPU's that ran timed (a second line each): 1,689 records. Per case: its fixes
#: (``none`` among them), its backends and its stages (``forward``; ``train`` too).
DEFAULT_CASES = ((3, 2, 1), (3, 1, 2), (2, 1, 2), (3, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 1),
                 (3, 1, 1), (1, 1, 2), (3, 1, 1), (3, 2, 1), (2, 1, 2), (3, 1, 1), (4, 1, 1),
                 (3, 1, 2), (2, 1, 1))  # fmt: skip
#: Each fix's (dtype, mode) columns, the fp32 control's among them.
DEFAULT_COLUMNS = (("float16", "autocast"), ("bfloat16", "autocast"), ("float16", "half"),
                   ("bfloat16", "half"), ("float16", "half-autocast"),
                   ("bfloat16", "half-autocast"), ("float32", "fp32"))  # fmt: skip
#: Where a default run's records come from: the stored run whose lines carry dtype trails,
#: flags, output leaves and errors, and the one whose lines carry timings.
OUTCOME_SOURCE = ROOT / "tests" / "data" / "runs" / "patterns-torch-2.13.0"
TIMING_SOURCE = SMALL_SOURCE
PERF_FIELDS = tuple(f.name for f in dataclasses.fields(Perf))
#: Why a CUDA cell is skipped on a host without a GPU.
NO_CUDA = "no CUDA device visible"


def stored_cases() -> list[dict[str, Any]]:
    """Every case of the stored runs' ``cases.json``, once, those with most fixes first."""
    found: dict[str, dict[str, Any]] = {}
    for source in SOURCES:
        for case in json.loads((source / storage.CASES_FILE).read_text()):
            found.setdefault(case["name"], case)
    return sorted(found.values(), key=lambda case: (-len(case["fixes"]), case["name"]))


def default_cases() -> list[dict[str, Any]]:
    """``DEFAULT_CASES``' entries of ``cases.json``: the stored cases, and copies of the
    first of them under a name of their own where there are fewer."""
    stored = stored_cases()
    return [
        stored[i % len(stored)]
        | (
            {"name": f"{stored[i % len(stored)]['name']}-{i // len(stored) + 1}"}
            if i >= len(stored)
            else {}
        )
        for i in range(len(DEFAULT_CASES))
    ]


def default_cells() -> Iterator[dict[str, Any]]:
    """The cells of ``DEFAULT_CASES``, as the fields of a line: each case's first fixes
    (``none`` first), on the CPU (small) and on CUDA (small and upstream), in every column,
    backend and stage it has."""
    for case, (fixes, backends, stages) in zip(default_cases(), DEFAULT_CASES, strict=True):
        names = [fix["name"] for fix in case["fixes"]][:fixes]
        places = [(CPU, "small"), ("cuda", "small"), ("cuda", "upstream")]
        for fix, (device, size), stage, backend, (dtype, mode) in itertools.product(
            names,
            places,
            ("forward", "train")[:stages],
            ("sdpa", "eager")[-backends:],
            DEFAULT_COLUMNS,
        ):
            yield {"case": case["name"], "fix": fix, "device": device, "dtype": dtype,
                   "mode": mode, "backend": backend, "compile": "eager", "size": size,
                   "stage": stage, "scaler": default_scaler(dtype, mode, stage)}  # fmt: skip


def default_run(folder: Path) -> int:
    """A run of the default matrix's shape (``DEFAULT_CASES``) on a host without a GPU,
    its records the stored runs' put in its cells: a CPU cell takes the next stored line of
    its (dtype, mode) column (its outcome, error, dtype trail, flags, leaves), a CUDA cell
    is skipped, and a CPU cell that ran and did not raise (the trained fp32 controls aside)
    is timed: a second line with a stored line's timing, slower by its fix. Returns its
    number of records."""
    folder.mkdir(parents=True)
    storage.write_env(folder, storage.read_env(TIMING_SOURCE))
    (folder / storage.CASES_FILE).write_text(json.dumps(default_cases(), indent=1))
    outcomes = column_lines(current_lines(OUTCOME_SOURCE))
    timed = [line for line in current_lines(TIMING_SOURCE) if line["time_samples"]]
    timings = itertools.cycle(timed)
    lines = []
    for cell in default_cells():
        if cell["device"] != CPU:
            lines.append(skipped_line(cell))
            continue
        line = next(outcomes[cell["dtype"], cell["mode"]]) | cell
        lines.append(line)
        control = cell["mode"] == "fp32" and cell["stage"] != FORWARD_STAGE
        if line["outcome"] != Outcome.RAISES.value and not control:
            slower = 1 + 0.35 * (hash_of(cell["fix"]) % 4)
            lines.append(line | timing_of(next(timings), slower))
    (folder / storage.CELLS_FILE).write_text(written(checked(lines)))
    return len(lines)


def hash_of(name: str) -> int:
    """A number of ``name``, the same in every process (``hash`` is salted per process)."""
    return sum(name.encode())


def column_lines(
    lines: Iterable[dict[str, Any]],
) -> dict[tuple[str, str], Iterator[dict[str, Any]]]:
    """The lines that ran, by (dtype, mode), each column's in turn for ever."""
    by_column: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for line in lines:
        if line["outcome"] != Outcome.SKIPPED.value:
            by_column.setdefault((line["dtype"], line["mode"]), []).append(line)
    return {column: itertools.cycle(found) for column, found in by_column.items()}


def skipped_line(cell: dict[str, Any]) -> dict[str, Any]:
    """A cell skipped on a host without its device, as the runner writes it."""
    record = CellRecord(Cell(**cell), "2.13.0+cpu", Outcome.SKIPPED, skip_reason=NO_CUDA)
    return record.to_dict()


def timing_of(line: dict[str, Any], slower: float) -> dict[str, Any]:
    """``line``'s timing fields, its times ``slower`` times as long."""
    perf = {name: line[name] for name in PERF_FIELDS}
    scaled = {name: perf[name] * slower for name in ("time_median_s", "time_iqr_s", "time_min_s")}
    return (
        perf
        | scaled
        | {
            "time_samples": [sample * slower for sample in perf["time_samples"]],
            "gflops": perf["gflops"] / slower,
            "peak_fraction": perf["peak_fraction"] / slower,
        }
    )


def checked(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``lines`` as records write them: each read back as a record (a line this
    synthesis got wrong fails here, not in the report)."""
    return [CellRecord.from_dict(line).to_dict() for line in lines]


def synthetic_run(source: Path, folder: Path, version: str, host: str) -> int:
    """A copy of ``source`` as if measured with torch ``version`` on ``host``."""
    folder.mkdir(parents=True)
    env = replace(storage.read_env(source), torch_version=version, hostname=host)
    storage.write_env(folder, env)
    (folder / storage.CASES_FILE).write_text((source / storage.CASES_FILE).read_text())
    lines = [line | {"torch_version": version} for line in current_lines(source)]
    (folder / storage.CELLS_FILE).write_text(written(lines))
    return len({CellRecord.from_dict(line).cell for line in lines})


def synthetic_runs(root: Path, target: int) -> tuple[list[Path], int]:
    """Runs of every release on a few hosts until ``target`` cells: a nightly's worth. The
    stored sets come in pairs (the same cells under two torch versions): the first of each
    pair goes to ``root/base``, its sibling to ``root/head`` with the same release and host,
    so ``compare root/base root/head`` pairs them by environment (each pair on a host of
    its own)."""
    runs, cells, n = [], 0, 0
    while cells < target or n % 2:  # whole pairs
        source = SOURCES[n % len(SOURCES)]
        pair, side = divmod(n % len(SOURCES), 2)
        folder = root / SIDES[side] / f"run{n}"
        release = RELEASES[(n // len(SOURCES)) % len(RELEASES)]
        host = f"gpu-host-{n // (len(SOURCES) * len(RELEASES))}-{pair}"
        cells += synthetic_run(source, folder, release, host)
        runs.append(folder)
        n += 1
    return runs, cells


#: The folders of a synthetic nightly's runs: each pair's first and second.
SIDES = ("base", "head")


def cut_run(source: Path, folder: Path, cells: int, timed: bool) -> int:
    """``source`` cut to its first ``cells`` records, or (``timed``) to its first ``cells``
    cells with every line of each (a cell's correctness record and its timed one)."""
    folder.mkdir(parents=True)
    for name in (storage.ENV_FILE, storage.CASES_FILE):
        (folder / name).write_text((source / name).read_text())
    lines = current_lines(source)
    if not timed:
        chosen_lines = lines[:cells]
    else:
        ids = [record.cell.id for record in storage.read_record_lines(source)]
        chosen = set(list(dict.fromkeys(ids))[:cells])
        chosen_lines = tuple(line for line, cell in zip(lines, ids, strict=True) if cell in chosen)
    (folder / storage.CELLS_FILE).write_text(written(chosen_lines))
    return len(storage.read_records(folder))


def reports_of(root: Path, target: int) -> list[tuple[str, list[Path], int]]:
    """The reports of a size, each as (what it is, its runs, its cells): below the stored
    run's size, the run cut short untimed and timed; else synthetic runs."""
    if target >= len(storage.read_records(SMALL_SOURCE)):
        runs, cells = synthetic_runs(root, target)
        return [("", runs, cells)]
    return [
        (what, [root / what], cut_run(SMALL_SOURCE, root / what, target, timed))
        for what, timed in (("untimed", False), ("timed", True))
    ]


def measured(command: list[str]) -> dict[str, float]:
    """``command``'s wall-clock seconds, its peak RSS in MB and exit code, taken by a fresh
    helper process (this module, ``--measure``) whose only child it is."""
    helper = [sys.executable, __file__, "--measure", *command]
    result = subprocess.run(helper, capture_output=True, text=True, check=True)
    figures: dict[str, float] = json.loads(result.stdout.splitlines()[-1])
    return figures


def measure(command: list[str]) -> int:
    """In the helper: run ``command`` from the project's root, print its figures as JSON on
    the last line."""
    started = time.perf_counter()
    env = os.environ | {"PYTHONDONTWRITEBYTECODE": "1"}  # as CI images run
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    seconds = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    if done.returncode not in (0, 1):  # compare's 1: a regression found
        print(done.stderr, file=sys.stderr)
    print(json.dumps({"s": seconds, "mb": peak_kib / 1024, "rc": done.returncode}))
    return 0


def verdict(value: float, limit: float | None, unit: str) -> str:
    """``1.20 s``, with `` (target < 5 s: PASS)`` where the size has a target."""
    shown = f"{value:.2f} s" if unit == "s" else f"{value:.0f} MB"
    if limit is None:
        return shown
    return f"{shown} (target < {limit:g} {unit}: {'PASS' if value < limit else 'MISS'})"


def time_report(runs: list[Path], out: Path, target: int) -> str:
    """One end-to-end report: wall time and peak RSS with their targets, HTML size."""
    command = [sys.executable, "-m", "harness", "report", *map(str, runs), "--out", str(out)]
    figures = measured(command)
    if figures["rc"]:
        return f"FAILED with exit code {figures['rc']:.0f}"
    seconds, megabytes = TARGETS.get(target, (None, None))
    return (
        f"{verdict(figures['s'], seconds, 's')}, peak RSS "
        f"{verdict(figures['mb'], megabytes, 'MB')}, {out.stat().st_size / 1e6:.2f} MB of HTML"
    )


def time_reading(runs: list[Path]) -> float:
    """Seconds to read the runs as ``report`` does (one process per core for many)."""
    started = time.perf_counter()
    load_runs_for_report(runs)
    return time.perf_counter() - started


def time_compare(runs: list[Path]) -> tuple[float, int]:
    """Seconds to compare every run with its sibling of the other torch version in this
    process, reading included, and the number of changes found."""
    started = time.perf_counter()
    changes = 0
    for base, head in zip(runs[0::2], runs[1::2], strict=False):
        before, after = load_runs([base, head])
        comparison = compare_runs(before, after)
        render_comparison(comparison)
        changes += len(comparison.changes)
    return time.perf_counter() - started, changes


def time_compare_command(root: Path) -> str:
    """``compare root/base root/head`` end to end, as CI runs it (each run paired with its
    sibling by environment), with its target: exit code 1 (a regression: the siblings'
    outcomes differ) is a comparison done."""
    command = [sys.executable, "-m", "harness", "compare", *(str(root / side) for side in SIDES)]
    figures = measured([*command, "--allow-missing"])
    if figures["rc"] not in (0, 1):
        return f"FAILED with exit code {figures['rc']:.0f}"
    return f"{verdict(figures['s'], COMPARE_TARGET, 's')}, peak RSS {figures['mb']:.0f} MB"


def acceptance(root: Path) -> None:
    """What issue 42 asks, side by side: the default run's report, the report over 100k
    cells and ``compare`` over them, each end to end (start-up included, bytecode not
    written: ``PYTHONDONTWRITEBYTECODE=1``, as CI runs) against its target."""
    records = default_run(root / "default")
    line = time_report([root / "default"], root / "out" / "default.html", DEFAULT_RUN)
    print(
        f"report of the default run ({records} records, {len(DEFAULT_CASES)} cases), "
        f"end to end: {line}",
        flush=True,
    )
    runs, cells = synthetic_runs(root / "nightly", NIGHTLY)
    line = time_report(runs, root / "out" / "nightly.html", NIGHTLY)
    print(f"report over {cells} cells in {len(runs)} runs, end to end: {line}", flush=True)
    print(
        f"compare over the same {cells} cells, {len(runs) // 2} pairs of runs, end to end: "
        f"{time_compare_command(root / 'nightly')}",
        flush=True,
    )


def main(sizes: tuple[int, ...] = SIZES) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        acceptance(Path(tmp))
    for target in sizes:
        with tempfile.TemporaryDirectory() as tmp:
            for what, runs, cells in reports_of(Path(tmp) / "runs", target):
                line = time_report(runs, Path(tmp) / "out" / f"report{what}.html", target)
                print(
                    f"report over {cells} cells{f' ({what})' if what else ''} in {len(runs)} "
                    f"run(s), end to end: {line}; reading alone {time_reading(runs):.2f} s",
                    flush=True,
                )
            if len(runs) > 1:
                compared, changes = time_compare(runs)
                print(
                    f"compare over the same {cells} cells in this process, {len(runs) // 2} "
                    f"pairs of runs: {compared:.1f} s, {changes} changes",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--measure"]:
        sys.exit(measure(sys.argv[2:]))
    sys.exit(main(tuple(int(n) for n in sys.argv[1:]) or SIZES))
