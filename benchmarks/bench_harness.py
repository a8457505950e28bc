"""Benchmark of the harness itself (``nox -s bench``). Prints, side by side, in one run:

1. the harness's median for a fixed SDPA call against
   ``torch.utils.benchmark.Timer.blocked_autorange`` on the same call (ratio);
2. the harness's overhead per timed cell beyond the measured time;
3. wall time of the default matrix with and without the timing phase, the share of the
   timing phase spent inside measured calls, and its time outside them per timed cell (a
   cell's build, first call, FLOP and memory count: what sampling until a share is reached
   would only dilute, so no share is a target: each cell samples until the stop rule says);
4. repeatability of fix rankings over three timed runs of the default matrix (ties within
   noise allowed and reported as ties);
5. the cost of the dtype tracer: the default matrix's correctness phase with and without it
   (``--no-trace``), alternated, as ratios of wall time and of the time inside the cells.

The runs serve several figures, so the bench stays within minutes: the timed runs are
traced and untraced by turns (the timing phase traces nothing), and their correctness
phases (a run's wall time less its timing phase) are the wall time without timing of 3 and
the two sides of 5; 2 times every ``OVERHEAD_SAMPLE``-th timed cell again.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import benchmark

from harness.measure.authoring import registry
from harness.measure.figures import cell_timing
from harness.measure.figures.timing import time_call
from harness.results import storage
from harness.results.speed import TIE_RATIO, median_of, rank_with_ties, significantly_faster
from harness.schema.axes import Column as CellColumn
from harness.schema.config import TimingConfig
from harness.schema.records import CellRecord

ROOT = Path(__file__).resolve().parent.parent
SDPA_SHAPE = (4, 8, 256, 64)
AGREEMENT = 0.05
ColumnKey = CellColumn


def sdpa_call() -> tuple[Callable[[], torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(SDPA_SHAPE) for _ in range(3))
    return (lambda: F.scaled_dot_product_attention(q, k, v)), {"q": q, "k": k, "v": v}


def harness_vs_torch_benchmark(rounds: int) -> None:
    """Both timers on the same call, alternating, so drift hits both alike."""
    call, tensors = sdpa_call()
    timer = benchmark.Timer(
        "F.scaled_dot_product_attention(q, k, v)",
        globals={"F": F, **tensors},
        num_threads=torch.get_num_threads(),  # its default is one thread
    )
    ratios = []
    print(
        f"1. SDPA {SDPA_SHAPE} float32, {torch.get_num_threads()} threads: harness median vs "
        "torch.utils.benchmark blocked_autorange median"
    )
    for n in range(rounds):
        ours = time_call(call, TimingConfig(budget_s=1.0)).median
        theirs = timer.blocked_autorange(min_run_time=1.0).median
        ratios.append(ours / theirs)
        print(
            f"   round {n + 1}: harness {ours * 1e3:.4f} ms, torch {theirs * 1e3:.4f} ms, "
            f"ratio {ours / theirs:.3f}"
        )
    ratio = statistics.median(ratios)
    verdict = "within" if abs(ratio - 1) <= AGREEMENT else "OUTSIDE"
    print(f"   median ratio {ratio:.3f}: {verdict} {AGREEMENT:.0%}\n")


def run_matrix(out: Path, *extra: str) -> tuple[Path, float]:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "harness", "run", "--out", str(out), *extra],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    elapsed = time.perf_counter() - started
    run_dirs = sorted(out.iterdir(), key=lambda p: p.stat().st_mtime)
    return run_dirs[-1], elapsed


def timing_phase_share(run_dirs: Sequence[Path]) -> None:
    """What each timed run's timing phase spent inside measured calls, and outside them per
    timed cell (its env.json)."""
    for run_dir in run_dirs:
        phase = storage.read_env(run_dir).timing_phase
        assert phase, f"{run_dir}: its env.json has no timing phase"
        outside = (phase["wall_s"] - phase["measured_s"]) / phase["cells"]
        print(
            f"   timing phase of {run_dir.name}: {phase['cells']} cells, {phase['wall_s']:.1f} s,"
            f" {phase['measured_s']:.1f} s in measured calls "
            f"({phase['measured_s'] / phase['wall_s']:.0%}), {outside * 1e3:.0f} ms a cell "
            "outside them"
        )
    print()


#: Every how many timed cells one is timed again for its overhead (in the run's order: every
#: case, stage, dtype and mode is among them).
OVERHEAD_SAMPLE = 8


def overhead_per_cell(run_dir: Path) -> None:
    """Time every ``OVERHEAD_SAMPLE``-th timed cell again in this process: wall time of the
    whole timing step (build, warm-up, FLOP count, memory pass) against the time inside its
    measured samples."""
    registry.discover()
    records = [r for r in storage.read_records(run_dir) if r.perf][::OVERHEAD_SAMPLE]
    overheads, measured_total = [], 0.0
    for record in records:
        started = time.perf_counter()
        timed = cell_timing.time_cell(record, TimingConfig())
        wall = time.perf_counter() - started
        assert timed.perf is not None
        measured = sum(timed.perf.time_samples) * timed.perf.time_block
        measured_total += measured
        overheads.append(wall - measured)
    print(
        f"2. overhead per timed cell beyond its measured samples ({len(records)} cells, "
        f"every {OVERHEAD_SAMPLE}th):"
    )
    print(
        f"   median {statistics.median(overheads) * 1e3:.1f} ms, "
        f"max {max(overheads) * 1e3:.1f} ms, total {sum(overheads):.1f} s "
        f"(measured samples: {measured_total:.1f} s)\n"
    )


def column_key(record: CellRecord) -> ColumnKey:
    return record.cell.column


Column = dict[str, CellRecord]


def timed_columns(run_dir: Path) -> dict[ColumnKey, Column]:
    """Per case column, the timed records by fix name (with backend)."""
    columns: dict[ColumnKey, Column] = defaultdict(dict)
    for record in storage.read_records(run_dir):
        if record.perf:
            columns[column_key(record)][record.cell.fix_and_backend] = record
    return {key: column for key, column in columns.items() if len(column) > 1}


def reversals(runs: Sequence[Column]) -> list[tuple[str, str]]:
    """Pairs where one fix is significantly faster in one run and significantly slower in
    another; pairs within noise (ties) never count."""
    names = sorted(set.intersection(*(set(run) for run in runs)))
    return [
        (a, b)
        for i, a in enumerate(names)
        for b in names[i + 1 :]
        if any(significantly_faster(r[a], r[b]) for r in runs)
        and any(significantly_faster(r[b], r[a]) for r in runs)
    ]


def describe(column: Column) -> str:
    names = {id(record): name for name, record in column.items()}
    tiers = rank_with_ties(list(column.values()))
    return " < ".join(" = ".join(names[id(r)] for r in tier) for tier in tiers)


def run_to_run_spread(per_run: Sequence[dict[ColumnKey, Column]]) -> list[float]:
    """For every cell timed in all runs: slowest median / fastest median across runs."""
    spreads = []
    for key, column in per_run[0].items():
        for name in column:
            medians = [
                median_of(r[key][name]) or 0.0 for r in per_run if key in r and name in r[key]
            ]
            spreads.append(max(medians) / min(medians))
    return spreads


def ranking_repeatability(run_dirs: Sequence[Path]) -> None:
    per_run = [timed_columns(d) for d in run_dirs]
    spreads = sorted(run_to_run_spread(per_run))
    print(
        f"4. fix rankings over {len(run_dirs)} runs (fastest first; '=' ties within noise: "
        f"medians within {TIE_RATIO:.2f}x or interquartile ranges overlapping)"
    )
    print(
        f"   run-to-run spread of one cell's median (max/min over runs): median "
        f"{statistics.median(spreads):.3f}, 90th percentile "
        f"{spreads[int(0.9 * (len(spreads) - 1))]:.3f}, max {spreads[-1]:.3f}"
    )
    consistent = 0
    for key in sorted(per_run[0]):
        runs = [r[key] for r in per_run if key in r]
        bad = reversals(runs)
        consistent += not bad
        verdict = "same order" if not bad else "REVERSED " + ", ".join(f"{a}/{b}" for a, b in bad)
        print(f"   {key.id}: {verdict}")
        for n, column in enumerate(runs, start=1):
            print(f"      run {n}: {describe(column)}")
    print(f"   {consistent} of {len(per_run[0])} columns ranked in the same order in every run\n")


def cell_seconds(run_dir: Path) -> float:
    """Time spent inside the cells of a run (build, fix, judging), without process start-up."""
    return sum(r.duration_s or 0.0 for r in storage.read_records(run_dir))


def correctness_wall(run_dir: Path, wall: float) -> float:
    """A run's wall time without its timing phase (a run with none: all of it)."""
    phase = storage.read_env(run_dir).timing_phase
    return wall - (phase["wall_s"] if phase else 0.0)


def tracer_cost(
    traced: Sequence[tuple[Path, float]], untraced: Sequence[tuple[Path, float]]
) -> None:
    """The correctness phase of the traced runs (the bench's untimed and timed runs) against
    the untraced ones made between them: walls, and the time inside the cells."""
    walls = {
        True: [correctness_wall(d, s) for d, s in traced],
        False: [correctness_wall(d, s) for d, s in untraced],
    }
    inside = {
        True: [cell_seconds(d) for d, _ in traced],
        False: [cell_seconds(d) for d, _ in untraced],
    }
    wall_ratio = statistics.median(walls[True]) / statistics.median(walls[False])
    inside_ratio = statistics.median(inside[True]) / statistics.median(inside[False])
    print(
        f"5. dtype tracer cost, default matrix correctness phase ({len(traced)} traced runs, "
        f"{len(untraced)} untraced, by turns): wall {statistics.median(walls[True]):.1f} s "
        f"traced vs {statistics.median(walls[False]):.1f} s untraced (ratio {wall_ratio:.2f}); "
        f"time inside cells {statistics.median(inside[True]):.2f} s vs "
        f"{statistics.median(inside[False]):.2f} s (ratio {inside_ratio:.2f})\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    harness_vs_torch_benchmark(args.rounds)
    with tempfile.TemporaryDirectory() as tmp:
        # traced and untraced by turns: the timing phase traces nothing, so the rankings
        # are alike, and each run's correctness phase is one side of the tracer's cost
        traced_by_turns = [n % 2 == 0 for n in range(args.runs)]
        timed_runs = [
            run_matrix(Path(tmp) / f"timed{n}", *(() if traced else ("--no-trace",)))
            for n, traced in enumerate(traced_by_turns)
        ]
        overhead_per_cell(timed_runs[0][0])
        walls = ", ".join(
            f"{s:.1f} s{'' if traced else ' (untraced)'}"
            for (_, s), traced in zip(timed_runs, traced_by_turns, strict=True)
        )
        untimed = ", ".join(f"{correctness_wall(d, s):.1f} s" for d, s in timed_runs)
        print(f"3. default matrix wall time: {walls}; the same less the timing phase {untimed}")
        timing_phase_share([d for d, _ in timed_runs])
        ranking_repeatability([d for d, _ in timed_runs])
        tracer_cost(
            [r for r, t in zip(timed_runs, traced_by_turns, strict=True) if t],
            [r for r, t in zip(timed_runs, traced_by_turns, strict=True) if not t],
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
