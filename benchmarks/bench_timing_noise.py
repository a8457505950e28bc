"""The timing phase quiet and beside a busy core (``nox -s bench``): the same built-in cells
timed as a run times them (``harness.runner.run.time_cells``: a forked process per case,
the columns of a case side by side), alternately on the machine as it is and beside one
core kept busy by a spinning process (``python -c "while True: pass"``), so a load the
machine already has falls on both arms alike. Printed: each phase's wall time and load
average, its noisy cells, the median busy phase over the median quiet one against the
target of 2 times, and the noisy cells of the last two phases named with why (their
``noisy`` note: the spread reached, how well the median is known, and what stopped it).

The cells: three built-in cases' forward cells on the CPU, float32 ``fp32`` and bfloat16
``autocast``, their correctness run once (``--no-timing``) before the phases: calls of a
tenth of a millisecond (``t5-wo-keep-fp32``, ``fp16-attn-overflow`` in float32), of a few
(``sana-softmax-float``) and bfloat16 attention whose CPU kernel's time jumps between call
and call (``fp16-attn-overflow``). The machine's one-time costs (the profiler's first use,
the peak GEMM of each dtype) are paid before the first phase, as a run pays them once.

    python benchmarks/bench_timing_noise.py [--rounds N] [--gate]

``--gate`` exits non-zero where the busy phase takes more than twice the quiet one.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from harness.measure.authoring import registry  # noqa: E402
from harness.measure.figures import perf  # noqa: E402
from harness.measure.figures.perf import fd_silenced  # noqa: E402
from harness.results import storage  # noqa: E402
from harness.runner.run import Recorded, time_cells  # noqa: E402
from harness.schema.config import TimingConfig  # noqa: E402
from harness.schema.records import CellRecord, NoteKind  # noqa: E402

CASES = ("t5-wo-keep-fp32", "fp16-attn-overflow", "sana-softmax-float")
SELECTION = ("--device", "cpu", "--dtype", "float32,bfloat16", "--mode", "fp32,autocast")
#: The busy phase over the quiet one, at the most.
TARGET = 2.0
SPINNER = "while True: pass"


def correctness_run(out: Path) -> Path:
    """The cells' correctness run, untimed: the records every phase times afresh."""
    subprocess.run(
        [sys.executable, "-m", "harness", "run", "--case", ",".join(CASES), *SELECTION,
         "--stage", "forward", "--no-timing", "-n", "0", "--out", str(out)],
        cwd=ROOT, check=True, capture_output=True, text=True,
    )  # fmt: skip
    (run_dir,) = out.iterdir()
    return run_dir


@contextmanager
def busy_core(busy: bool) -> Iterator[None]:
    """One core kept busy by a spinning process, for the time of the block."""
    if not busy:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", SPINNER])
    try:
        time.sleep(0.2)  # under way before the phase starts
        yield
    finally:
        spinner.kill()
        spinner.wait()


@contextmanager
def quiet_stdout() -> Iterator[None]:
    """The phase's progress lines, its forked children's too, go nowhere."""
    sys.stdout.flush()
    try:
        with fd_silenced(1):
            yield
    finally:
        sys.stdout.flush()


@dataclasses.dataclass(frozen=True)
class Phase:
    busy: bool
    wall_s: float
    load: float
    records: list[CellRecord]

    @property
    def noisy(self) -> list[CellRecord]:
        return [r for r in self.records if r.perf is not None and r.perf.time_noisy]


def noise_note(record: CellRecord) -> str:
    return next((n.text for n in record.notes if n.kind is NoteKind.NOISY), "")


def timing_phase(run_dir: Path, work: Path, busy: bool) -> Phase:
    """The timing phase of a fresh copy of the untimed run, beside a busy core or not."""
    copy = work / f"phase-{time.monotonic_ns()}"
    copy.mkdir()
    for name in (storage.ENV_FILE, "run-plan.json", "cells.jsonl", "cases.json"):
        if (run_dir / name).exists():
            (copy / name).write_bytes((run_dir / name).read_bytes())
    config = dataclasses.replace(storage.read_run_plan(copy).config, timing=TimingConfig())
    recorded = Recorded(storage.read_records(copy))
    with busy_core(busy), quiet_stdout():
        load = os.getloadavg()[0]
        started = time.perf_counter()
        time_cells(copy, config, recorded)
        wall = time.perf_counter() - started
    timed = [r for r in recorded.records() if r.perf is not None]
    return Phase(busy, wall, load, timed)


def one_time_costs(records: Sequence[CellRecord]) -> None:
    """What a run pays once per machine or process, paid before the phases."""
    perf.warm_up()
    for dtype in sorted({r.cell.dtype for r in records}):
        perf.peak_matmul_gflops("cpu", dtype)


def describe(phase: Phase, round_: int) -> str:
    arm = "busy " if phase.busy else "quiet"
    return (
        f"   round {round_} {arm}: {phase.wall_s:5.1f} s (load {phase.load:.1f}), "
        f"{len(phase.records)} cells, {len(phase.noisy)} noisy"
    )


def name_noisy(phase: Phase, shown: int) -> None:
    arm = "beside the busy core" if phase.busy else "quiet"
    print(f"   noisy {arm} ({len(phase.noisy)} of {len(phase.records)}):")
    for record in phase.noisy[:shown]:
        print(f"     {record.cell.id}: {noise_note(record)}")
    if len(phase.noisy) > shown:
        print(f"     and {len(phase.noisy) - shown} more")


def measure(rounds: int, shown: int) -> bool:
    """Quiet and busy phases, alternated; the ratio of their medians against TARGET."""
    registry.discover()
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = correctness_run(Path(tmp) / "run")
        one_time_costs(storage.read_records(run_dir))
        threads = os.cpu_count()
        print(
            f"timing phase quiet and beside a busy core: {', '.join(CASES)} "
            f"({' '.join(SELECTION)}), {threads} threads"
        )
        phases: list[Phase] = []
        for n in range(1, rounds + 1):
            for spinning in (False, True):
                phases.append(timing_phase(run_dir, Path(tmp), spinning))
                print(describe(phases[-1], n), flush=True)
    quiet = statistics.median(p.wall_s for p in phases if not p.busy)
    busy = statistics.median(p.wall_s for p in phases if p.busy)
    ratio = busy / quiet
    verdict = "PASS" if ratio <= TARGET else "MISS"
    print(
        f"   median quiet {quiet:.1f} s, beside a busy core {busy:.1f} s: "
        f"{ratio:.2f}x (target <= {TARGET:g}x) {verdict}"
    )
    name_noisy(phases[-2], shown)
    name_noisy(phases[-1], shown)
    return ratio <= TARGET


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="quiet and busy phases (2)")
    parser.add_argument("--shown", type=int, default=8, help="noisy cells named a phase (8)")
    parser.add_argument("--gate", action="store_true", help="exit 1 where the ratio misses")
    args = parser.parse_args(argv)
    within = measure(args.rounds, args.shown)
    return 1 if args.gate and not within else 0


if __name__ == "__main__":
    sys.exit(main())
