"""Everything only a GPU can show, in one command, with a verdict against each target.

``nox -s gpu-acceptance`` (or, with no nox and no registry, ``PYTHONPATH=. python3
benchmarks/gpu_acceptance.py --out DIR``, or ``python3 -m benchmarks.gpu_acceptance``) runs,
one step after the other, each a process of its own with a time limit:

* ``matrix``: ``harness run --device cuda --size all``: every case on every visible GPU at
  both sizes, timed; no cell crashed or timed out, no timing failed, both sizes ran;
* ``flash-attn``: from that run's records, VAR's cells on the real flash-attn kernel:
  ``none`` is ``raises:repro``, its fixes pass, their timings beside SDPA's, and the dtype
  trail around the kernel call;
* ``do-bench``: the harness's CUDA figures against triton's ``do_bench`` on six calls; where
  they differ, the call must be marked launch-bound;
* ``check-vs-plain``: ``check`` of 14 small transformers and timm models on ``cuda``
  against a plain script (target: within 2x);
* ``cuda-starts``: how many times a ``check`` batch starts CUDA (issue 23 left two: the
  reference's process and the batch's), and what the extra starts cost;
* ``stages``: the ``train`` and ``fit`` stages on ``cuda``;
* ``tests``: the test suite with every core (``pytest -n auto``).

A step that fails or runs past its limit is a MISS with its reason, and the next step
runs. The figures go to ``DIR/gpu-acceptance.md``; the last line printed is the verdict,
and the exit status is 0 when every target is met (a skipped step, with its reason, is not
a miss), 1 on a MISS, 2 where nothing can be accepted (no CUDA device, or a package it needs
is not importable). It installs nothing: ``nox -s gpu-acceptance`` runs it with an
interpreter that already has what it needs.

The session itself never imports torch (the probes in ``gpu_probes.py`` do, each in its own
process), so it stays light, and its logic is tested on a CPU with fake commands.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any, Protocol
from xml.etree import ElementTree

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _path in (str(ROOT), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from harness.results import storage  # noqa: E402
from harness.schema.gpus import gpu_name  # noqa: E402
from harness.schema.records import CellRecord, NoteKind, Outcome, launch_bound  # noqa: E402
from harness.schema.releases import torch_release  # noqa: E402
from harness.schema.text import markdown_safe  # noqa: E402

PROBES = HERE / "gpu_probes.py"
#: Modules the session and the harness need in the interpreter that runs them.
REQUIRED = ("torch", "numpy", "pytest", "xdist", "pandas", "jinja2")
REPORT_FILE = "gpu-acceptance.md"
#: Exit statuses: every target met; a target missed; nothing could be accepted here.
EXIT_PASS, EXIT_MISS, EXIT_CANNOT = 0, 1, 2
VAR = "var-normalize-promotion"
CONTROL_MODE = "fp32"
#: How a record's backend note starts where the real flash-attn kernel ran
#: (``harness.measure.host.flash_kernels.backend_note``).
REAL_KERNEL = "flash-attn: the real kernel"
#: Outcomes of cells that did not run to a verdict of their own.
NOT_RUN = (Outcome.SKIPPED, Outcome.CRASHED, Outcome.TIMEOUT)
#: The check-vs-plain probe's GPU models need both of these.
MODEL_LIBRARIES = ("transformers", "timm")
#: Models of the ``check`` whose CUDA starts are counted: five cells each, one batch each.
START_MODELS = ("block_a", "block_b", "block_c")


class Verdict(str, Enum):
    PASS = "PASS"
    MISS = "MISS"
    #: A figure worth reading that has no target (timings beside each other).
    INFO = "info"
    SKIP = "skipped"


@dataclass(frozen=True)
class Figure:
    """One line of the Markdown: what was measured, its value, the target, the verdict."""

    step: str
    name: str
    value: str
    target: str = ""
    verdict: Verdict = Verdict.INFO


class StepTimeout(Exception):
    """A step's command ran past the step's time limit (and was killed)."""


class Skipped(Exception):
    """A step that cannot run here; the message says why."""


class CommandFailed(Exception):
    """A command of a step exited non-zero; the message ends with its log's last lines."""


@dataclass(frozen=True)
class Options:
    out: Path
    cases: tuple[str, ...] = ()
    rounds: int = 3
    models: int | None = None
    tests: tuple[str, ...] = ()
    skip: frozenset[str] = frozenset()
    time_budget: float | None = None
    #: Only say whether this interpreter has every module the session needs (exit 0/2).
    ready_only: bool = False


class Runner(Protocol):
    """Runs one command to its end, its output to ``log``; returns its exit status, or
    raises StepTimeout past ``timeout_s`` (having killed it)."""

    def __call__(
        self,
        argv: Sequence[str],
        timeout_s: float,
        log: Path,
        env: Mapping[str, str],
        cwd: Path,
    ) -> int: ...


def run_command(
    argv: Sequence[str], timeout_s: float, log: Path, env: Mapping[str, str], cwd: Path
) -> int:
    """The real runner: a process group of its own, so a limit kills its workers too."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        process = subprocess.Popen(
            list(argv),
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
        try:
            return process.wait(timeout=max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            raise StepTimeout(f"killed after {timeout_s:.0f} s: {' '.join(argv)}") from None


@dataclass
class Context:
    """What a step gets: the options, the GPUs, a runner bounded by the step's deadline,
    and what earlier steps left for later ones."""

    options: Options
    environment: dict[str, Any]
    runner: Runner = run_command
    clock: Callable[[], float] = time.monotonic
    python: str = sys.executable
    deadline: float = float("inf")
    matrix_run: Path | None = None
    #: ``check``'s seconds a model on ``cuda`` (the check-vs-plain step's), for the cost
    #: of the CUDA starts.
    check_model_s: float | None = None
    importable: Callable[[str], bool] = lambda name: importlib.util.find_spec(name) is not None

    @property
    def devices(self) -> list[str]:
        return [gpu["device"] for gpu in self.environment.get("gpus", [])]

    def run(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        cwd: Path = ROOT,
        ok: Callable[[int], bool] = lambda code: code == 0,
    ) -> int:
        """Run a command within the step's deadline, its output in ``logs/NAME.log``;
        CommandFailed naming the log where ``ok`` refuses its status."""
        log = self.options.out / "logs" / f"{name}.log"
        remaining = self.deadline - self.clock()
        if remaining <= 0:
            raise StepTimeout(f"no time left for {name}")
        environment = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), *extra_path()) if p)}
        code = self.runner(argv, remaining, log, {**environment, **(env or {})}, cwd)
        if not ok(code):
            raise CommandFailed(f"{name} exited {code}: {tail(log)} (log: {log})")
        return code

    def probe(self, name: str, *args: str) -> Any:
        """A probe of ``gpu_probes.py`` in its own process; its figures (JSON)."""
        out = self.options.out / "probes" / f"{name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        self.run(f"probe-{name}", [self.python, str(PROBES), name, "--json", str(out), *args])
        return json.loads(out.read_text())


def extra_path() -> list[str]:
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def tail(log: Path, lines: int = 3) -> str:
    """A log's last lines on one line (what a failed command said last)."""
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return " / ".join(line.strip() for line in text[-lines:]) or "(no output)"


StepFunction = Callable[[Context], list[Figure]]


@dataclass(frozen=True)
class Step:
    name: str
    #: What the step shows, as the Markdown lists it.
    what: str
    limit_s: float
    function: StepFunction


@dataclass(frozen=True)
class StepRun:
    step: Step
    seconds: float
    figures: tuple[Figure, ...]


# --- figures from records (pure functions: the tests drive them with made-up records) ---


def outcome_counts(records: Iterable[CellRecord]) -> str:
    counts = Counter(r.outcome.value for r in records)
    return ", ".join(f"{n} {outcome}" for outcome, n in counts.most_common()) or "no cells"


def broken_cells(records: Iterable[CellRecord]) -> list[CellRecord]:
    """Cells the harness failed on: crashed, timed out, or their timing failed."""
    return [
        r
        for r in records
        if r.outcome in (Outcome.CRASHED, Outcome.TIMEOUT) or r.timing_error is not None
    ]


def first_error(records: Sequence[CellRecord]) -> str:
    """What the first of ``records`` failed with (its error, or its timing's)."""
    record = records[0]
    if record.timing_error and record.outcome not in (Outcome.CRASHED, Outcome.TIMEOUT):
        return f"timing: {record.timing_error}"[:300]
    return f"{record.error_type}: {record.error_message}"[:300]


def named_cells(records: Sequence[CellRecord], most: int = 3) -> str:
    names = ", ".join(r.cell.id for r in records[:most])
    return names + (f" and {len(records) - most} more" if len(records) > most else "")


def matrix_figures(
    step: str, records: Sequence[CellRecord], devices: Sequence[str], sizes: Sequence[str]
) -> list[Figure]:
    """Per GPU: its cells by size and outcome, with a target that every size in ``sizes``
    ran there (none: no size target), and that no cell crashed, timed out or lost its
    timing."""
    figures = []
    for device in devices:
        mine = [r for r in records if r.cell.device == device]
        by_size = Counter(r.cell.size for r in mine)
        ran = ", ".join(f"{n} at {size}" for size, n in sorted(by_size.items()))
        value = f"{len(mine)} cells ({ran or 'none'}): {outcome_counts(mine)}"
        if sizes:
            missing = [
                s
                for s in sizes
                if not any(r.outcome not in NOT_RUN and r.cell.size == s for r in mine)
            ]
            verdict = Verdict.MISS if missing else Verdict.PASS
            target = f"cells ran at {' and '.join(sizes)}"
            if missing:
                value += f"; none ran at {', '.join(missing)}"
        else:
            verdict = Verdict.PASS if any(r.outcome not in NOT_RUN for r in mine) else Verdict.MISS
            target = "cells ran"
        figures.append(Figure(step, f"{device} cells", value, target, verdict))
        broken = broken_cells(mine)
        figures.append(
            Figure(
                step,
                f"{device} crashed, timed out or untimed",
                f"{len(broken)}"
                + (f": {named_cells(broken)}; {first_error(broken)}" if broken else ""),
                "none",
                Verdict.MISS if broken else Verdict.PASS,
            )
        )
        timed = sum(r.perf is not None for r in mine)
        figures.append(Figure(step, f"{device} cells timed", f"{timed} of {len(mine)}"))
    return figures


def stage_figures(
    step: str, records: Sequence[CellRecord], devices: Sequence[str]
) -> list[Figure]:
    """Per GPU and stage: its cells and outcomes; a stage with no cell that ran is a MISS
    (a stage no selected case declares is said, not missed)."""
    figures = []
    for device in devices:
        for stage in ("train", "fit"):
            mine = [r for r in records if r.cell.device == device and r.cell.stage == stage]
            name = f"{device} {stage} cells"
            if not mine:
                figures.append(Figure(step, name, "no selected case has this stage"))
                continue
            ran = any(r.outcome not in NOT_RUN for r in mine)
            broken = broken_cells(mine)
            value = f"{len(mine)}: {outcome_counts(mine)}"
            if broken:
                value += f"; crashed, timed out or untimed: {named_cells(broken)}; "
                value += first_error(broken)
            verdict = Verdict.PASS if ran and not broken else Verdict.MISS
            figures.append(Figure(step, name, value, "ran, none crashed", verdict))
    return figures


def flash_figures(step: str, records: Sequence[CellRecord]) -> list[Figure]:
    """VAR's forward cells on the real flash-attn kernel, per GPU (Skipped where none ran,
    with the skip reason the run recorded)."""
    flash = [
        r
        for r in records
        if r.cell.case == VAR
        and r.cell.backend == "flash-attn"
        and r.cell.stage == "forward"
        and r.cell.device.startswith("cuda")
    ]
    ran = [r for r in flash if r.outcome != Outcome.SKIPPED]
    if not ran:
        reasons = sorted({r.skip_reason or "no reason recorded" for r in flash})
        raise Skipped(
            "; ".join(reasons) if reasons else f"the matrix ran no {VAR} cell on flash-attn"
        )
    figures = []
    for device in sorted({r.cell.device for r in ran}):
        mine = [r for r in ran if r.cell.device == device]
        sdpa = {
            replace(r.cell, backend="flash-attn"): r
            for r in records
            if r.cell.case == VAR and r.cell.backend == "sdpa" and r.cell.device == device
        }
        figures += kernel_figures(step, device, mine)
        figures += timing_figures(step, device, mine, sdpa)
    return figures


def kernel_figures(step: str, device: str, cells: Sequence[CellRecord]) -> list[Figure]:
    notes = sorted({n.text for r in cells for n in r.notes if n.kind == NoteKind.BACKEND})
    real = all(
        any(n.kind == NoteKind.BACKEND and n.text.startswith(REAL_KERNEL) for n in r.notes)
        for r in cells
    )
    half = [r for r in cells if r.cell.fix == "none" and r.cell.mode != CONTROL_MODE]
    promoted = [r for r in half if r.trail is not None and r.trail.promotion is not None]
    repro = [r for r in half if r.outcome == Outcome.RAISES and r.reproduces]
    errors = sorted({f"{r.error_type}: {r.error_message}" for r in half if r.error_type})
    fixes = [r for r in cells if r.cell.fix != "none"]
    passing = [r for r in fixes if r.outcome == Outcome.PASSES]
    not_passing = [r for r in fixes if r.outcome != Outcome.PASSES]
    trails = [r for r in repro if r.trail is not None and r.trail.failure_site is not None]
    trail = repro[0].trail.describe() if repro and repro[0].trail else None
    computed = sorted(
        {
            f"{r.cell.fix}: attention [{', '.join(r.trail.compute_dtypes.get('attention', ()))}]"
            for r in passing
            if r.trail is not None
        }
    )
    return [
        Figure(
            step,
            f"{device} kernel",
            "; ".join(notes) or "no note of the kernel",
            "the real kernel",
            Verdict.PASS if real else Verdict.MISS,
        ),
        Figure(
            step,
            f"{device} none raises:repro",
            f"{len(repro)} of the {len(promoted)} cells where float32 enters q "
            f"({len(half) - len(promoted)} where none enters)"
            + (f"; {'; '.join(errors)[:300]}" if errors else ""),
            "every cell where float32 enters, and only those",
            Verdict.PASS if promoted and repro == promoted else Verdict.MISS,
        ),
        Figure(
            step,
            f"{device} fixes pass",
            f"{len(passing)} of {len(fixes)}"
            + (f"; not passing: {named_cells(not_passing)}" if not_passing else ""),
            "every one",
            Verdict.PASS if fixes and not not_passing else Verdict.MISS,
        ),
        Figure(
            step,
            f"{device} dtype trail at the kernel call",
            f"{len(trails)} of {len(repro)} name the failing call"
            + (f"; {trail}" if trail else "")
            + (f"; {'; '.join(computed)}" if computed else ""),
            "every raises:repro names it",
            Verdict.PASS if repro and len(trails) == len(repro) else Verdict.MISS,
        ),
    ]


def timing_figures(
    step: str,
    device: str,
    cells: Sequence[CellRecord],
    sdpa: Mapping[Any, CellRecord],
) -> list[Figure]:
    """Per fix: the median speed figure of its timed flash-attn cells beside the same
    cells' on SDPA."""
    figures = []
    for fix in sorted({r.cell.fix for r in cells if r.cell.fix != "none"}):
        pairs = [
            (r.perf.speed_s, twin.perf.speed_s)
            for r in cells
            if r.cell.fix == fix
            and r.perf is not None
            and (twin := sdpa.get(r.cell)) is not None
            and twin.perf is not None
        ]
        if not pairs:
            value = "not timed (no timed cell on both backends)"
        else:
            flash_s = statistics.median(p[0] for p in pairs)
            sdpa_s = statistics.median(p[1] for p in pairs)
            value = (
                f"flash-attn {flash_s * 1e3:.3f} ms, SDPA {sdpa_s * 1e3:.3f} ms "
                f"({flash_s / sdpa_s:.2f}x; median of {len(pairs)} cells)"
            )
        figures.append(Figure(step, f"{device} {fix} time beside SDPA", value))
    return figures


def do_bench_figures(
    step: str, rows: Sequence[Mapping[str, Any]], agreement: float
) -> list[Figure]:
    """Each call: the harness's speed figure (its device time where it marks the call
    launch-bound, else its timed median) over ``do_bench``'s; a call where they differ by
    more than ``agreement`` must be marked launch-bound."""
    figures = []
    measured = 0
    for row in rows:
        wall, device, bench = row["wall"], row["device"], row["do_bench"]
        if not all(
            isinstance(v, (int, float)) and v == v and v > 0 for v in (wall, device, bench)
        ):
            figures.append(
                Figure(step, row["call"], f"not measured: {row}", "measured", Verdict.MISS)
            )
            continue
        measured += 1
        bound = launch_bound(wall, device)
        ratio = (device if bound else wall) / bench
        agrees = abs(ratio - 1) <= agreement
        value = (
            f"timed {wall * 1e6:.1f} us, device {device * 1e6:.1f} us"
            f"{' (launch-bound)' if bound else ''}, do_bench {bench * 1e6:.1f} us: "
            f"{ratio:.3f}x"
        )
        verdict = Verdict.PASS if agrees or bound else Verdict.MISS
        target = f"within {agreement:.0%}, or marked launch-bound"
        figures.append(Figure(step, row["call"], value, target, verdict))
    figures.append(
        Figure(
            step,
            "calls measured",
            f"{measured}",
            "at least 3",
            Verdict.PASS if measured >= 3 else Verdict.MISS,
        )
    )
    return figures


def check_figures(step: str, got: Mapping[str, Any]) -> list[Figure]:
    ratio = got["check_s"] / got["plain_s"]
    value = (
        f"check {got['check_s']:.2f} s, plain script {got['plain_s']:.2f} s: {ratio:.2f}x "
        f"({len(got['models'])} models, median of {got['rounds']} rounds)"
    )
    target = f"at most {got['target']}x"
    verdict = Verdict.PASS if ratio <= got["target"] else Verdict.MISS
    outcomes: dict[str, int] = got["outcomes"]
    broken = sum(outcomes.get(o.value, 0) for o in (Outcome.CRASHED, Outcome.TIMEOUT))
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))
    return [
        Figure(step, "check on cuda against a plain script", value, target, verdict),
        Figure(
            step,
            "check's cells",
            counts or "none",
            "none crashed (else the time is no figure)",
            Verdict.MISS if broken or not outcomes else Verdict.PASS,
        ),
    ]


def cuda_start_figures(
    step: str, log: str, batches: int, start_s: float, model_s: float | None
) -> list[Figure]:
    """From the start-up log (``pid forked seconds`` per CUDA start): the starts in forked
    processes (cells and references) per batch, and what starts beyond one per batch cost,
    beside what ``check`` took a model where that was measured (``model_s``)."""
    starts = [line.split() for line in log.splitlines() if line.strip()]
    if not starts:
        raise CommandFailed("no CUDA start was counted: the counting hook did not load")
    forked = sum(1 for s in starts if s[1] == "1")
    own = len(starts) - forked
    extra = max(forked - batches, 0)
    per_batch = forked / batches
    figures = [
        Figure(
            step,
            "CUDA starts per batch",
            f"{per_batch:g} ({forked} in forked processes for {batches} models of one batch "
            f"each; {own} more in the run's own interpreters)",
            "1",
            Verdict.PASS if forked <= batches else Verdict.MISS,
        )
    ]
    extra_s = extra / batches * start_s
    cost = f"{extra_s:.2f} s a batch ({start_s:.2f} s a start)"
    if model_s:
        cost += f": {extra_s / model_s:.0%} of check's {model_s:.2f} s a model"
    figures.append(Figure(step, "cost of the extra starts", cost))
    return figures


def test_figures(step: str, junit: Path, code: int, installed: bool) -> list[Figure]:
    """The suite's counts from its JUnit XML: no failure and no error; every skip has a
    reason (grouped, most frequent first)."""
    root = ElementTree.parse(junit).getroot()
    cases = list(root.iter("testcase"))
    failed = [c for c in cases if c.find("failure") is not None or c.find("error") is not None]
    skips = [c.find("skipped") for c in cases]
    reasons = Counter((s.get("message") or "").strip() for s in skips if s is not None)
    skipped = sum(reasons.values())
    without_reason = reasons.pop("", 0)
    passed = len(cases) - len(failed) - skipped
    names = ", ".join(f"{c.get('classname')}::{c.get('name')}" for c in failed[:5])
    where = "ampmatrix installed" if installed else "ampmatrix not installed (PYTHONPATH=.)"
    figures = [
        Figure(
            step,
            "tests",
            f"{passed} passed, {len(failed)} failed, {skipped} skipped; pytest exited {code}; "
            f"{where}" + (f"; failed: {names}" if failed else ""),
            "none failed",
            Verdict.PASS if not failed and code == 0 else Verdict.MISS,
        ),
        Figure(
            step,
            "skips without a reason",
            f"{without_reason}",
            "none",
            Verdict.MISS if without_reason else Verdict.PASS,
        ),
    ]
    figures += [Figure(step, f"skipped ({n}x)", reason) for reason, n in reasons.most_common(8)]
    return figures


# --- the steps ---


def run_dir_under(root: Path) -> Path:
    runs = sorted(p for p in root.iterdir() if (p / storage.CELLS_FILE).exists())
    if not runs:
        raise CommandFailed(f"no run with records under {root}")
    return runs[-1]


def harness_run(ctx: Context, name: str, *args: str) -> tuple[Path, list[CellRecord], Figure]:
    """``python -m harness run --device cuda ARGS`` (with the session's cases and time
    budget): its run folder, its records and its exit status as a figure."""
    out = ctx.options.out / name
    argv = [ctx.python, "-m", "harness", "run", "--device", "cuda", *args, "--out", str(out)]
    for case in ctx.options.cases:
        argv += ["--case", case]
    if ctx.options.time_budget is not None:
        argv += ["--time-budget", str(ctx.options.time_budget)]
    code = ctx.run(name, argv, ok=lambda code: True)
    run_dir = run_dir_under(out)
    return run_dir, storage.read_records(run_dir), exit_figure(name, code)


def exit_figure(step: str, code: int) -> Figure:
    """``harness run`` exits 0 when every planned cell has a record."""
    verdict = Verdict.PASS if code == 0 else Verdict.MISS
    return Figure(step, "harness run exit status", str(code), "0", verdict)


def matrix_step(ctx: Context) -> list[Figure]:
    run_dir, records, exited = harness_run(ctx, "matrix", "--size", "all", "--stage", "forward")
    ctx.matrix_run = run_dir
    figures = [Figure("matrix", "run", str(run_dir)), exited]
    return figures + matrix_figures("matrix", records, ctx.devices, ("small", "upstream"))


def flash_step(ctx: Context) -> list[Figure]:
    if ctx.matrix_run is None:
        raise CommandFailed("the matrix step left no run to read")
    return flash_figures("flash-attn", storage.read_records(ctx.matrix_run))


def do_bench_step(ctx: Context) -> list[Figure]:
    if not ctx.importable("triton"):
        raise Skipped("triton is not importable here (do_bench is triton's)")
    got = ctx.probe("do-bench")
    return do_bench_figures("do-bench", got["rows"], got["agreement"])


def check_step(ctx: Context) -> list[Figure]:
    missing = [name for name in MODEL_LIBRARIES if not ctx.importable(name)]
    if missing:
        raise Skipped(f"{' and '.join(missing)} not importable here (the GPU models need them)")
    args = ["--rounds", str(ctx.options.rounds)]
    if ctx.options.models:
        args += ["--models", str(ctx.options.models)]
    got = ctx.probe("check-vs-plain", *args)
    ctx.check_model_s = got["check_s"] / len(got["models"])
    return check_figures("check-vs-plain", got)


#: Written as ``sitecustomize.py`` on the PYTHONPATH of one ``check``: every interpreter of
#: it (the command's, pytest-xdist's workers) counts each CUDA start (torch's
#: ``_cuda_init``, which every first CUDA use in a process goes through), forked processes
#: included, which inherit the counting. A line per start: pid, forked (1/0), seconds.
START_HOOK = """\
import os
import time

try:
    import torch

    _log = os.environ["AMPMATRIX_CUDA_START_LOG"]
    _interpreter = os.getpid()
    _init = torch._C._cuda_init

    def _counted_init():
        started = time.perf_counter()
        try:
            return _init()
        finally:
            forked = int(os.getpid() != _interpreter)
            with open(_log, "a") as log:
                log.write(f"{os.getpid()} {forked} {time.perf_counter() - started:.4f}\\n")

    torch._C._cuda_init = _counted_init
except Exception:
    pass
"""


def cuda_starts_step(ctx: Context) -> list[Figure]:
    start_s = ctx.probe("cuda-start")["seconds"]
    folder = ctx.options.out / "cuda-starts"
    hook = folder / "hook"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(START_HOOK)
    models = folder / "models"
    models.mkdir(exist_ok=True)
    (models / "blocks.py").write_text(block_source())
    log = folder / "starts.log"
    log.write_text("")
    targets = [f"blocks:{name}" for name in START_MODELS]
    argv = [ctx.python, "-m", "harness", "check", *targets, "--device", "cuda", "--no-timing"]
    argv += ["--out", str(folder / "results")]
    env = {
        "PYTHONPATH": os.pathsep.join([str(hook), str(ROOT), *extra_path()]),
        "AMPMATRIX_CUDA_START_LOG": str(log),
    }
    ctx.run("cuda-starts", argv, env=env, cwd=models)
    broken = broken_cells(storage.read_records(run_dir_under(folder / "results")))
    if broken:
        raise CommandFailed(
            f"{len(broken)} cells crashed, so no start was counted: "
            f"{named_cells(broken)}: {broken[0].error_type}: {broken[0].error_message}"
        )
    return cuda_start_figures(
        "cuda-starts", log.read_text(), len(START_MODELS), start_s, ctx.check_model_s
    )


def block_source() -> str:
    """``bench_check.py``'s attention block, under three factory names: three models,
    each a case of five cells on one GPU (one batch)."""
    from bench_check import BLOCK

    names = "\n".join(f"{name} = block" for name in START_MODELS)
    return f"{BLOCK}\n{names}\n"


def stages_step(ctx: Context) -> list[Figure]:
    _, records, exited = harness_run(ctx, "stages", "--stage", "train,fit")
    return [exited, *stage_figures("stages", records, ctx.devices)]


def tests_step(ctx: Context) -> list[Figure]:
    junit = ctx.options.out / "tests.xml"
    argv = [ctx.python, "-m", "pytest", "-n", "auto", "-p", "no:cacheprovider", "-q", "-rs"]
    argv += ["--junitxml", str(junit), *ctx.options.tests]
    code = ctx.run("tests", argv, ok=lambda code: code in (0, 1))
    installed = ctx.importable("ampmatrix") or distribution_installed("ampmatrix")
    return test_figures("tests", junit, code, installed)


def distribution_installed(name: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


STEPS = (
    Step("matrix", "every case on every visible GPU at both sizes, timed", 3600, matrix_step),
    Step(
        "flash-attn", "VAR on the real flash-attn kernel (the matrix's records)", 120, flash_step
    ),
    Step("do-bench", "the harness's CUDA figures against triton's do_bench", 900, do_bench_step),
    Step("check-vs-plain", "check of 14 models on cuda against a plain script", 2400, check_step),
    Step("cuda-starts", "CUDA starts of a check batch and their cost", 900, cuda_starts_step),
    Step("stages", "the train and fit stages on cuda", 3600, stages_step),
    Step("tests", "the test suite on every core", 3600, tests_step),
)


# --- the session ---


def run_steps(
    steps: Sequence[Step],
    ctx: Context,
    after_each: Callable[[list[StepRun]], None] = lambda runs: None,
) -> list[StepRun]:
    """Each step in turn within its time limit; one that fails or runs past its limit is a
    MISS with its reason, and the next one runs. ``after_each`` gets the steps so far (the
    Markdown is written after each, so a session killed midway keeps what it measured)."""
    runs: list[StepRun] = []
    for step in steps:
        started = ctx.clock()
        ctx.deadline = started + step.limit_s
        figures = step_figures(step, ctx)
        seconds = ctx.clock() - started
        if seconds > step.limit_s and not any(f.verdict == Verdict.MISS for f in figures):
            figures = [*figures, over_limit(step, seconds)]
        runs.append(StepRun(step, seconds, tuple(figures)))
        after_each(runs)
        print(
            f"gpu-acceptance: {step.name}: {step_verdict(figures).value} ({seconds:.0f} s)",
            flush=True,
        )
    return runs


def step_figures(step: Step, ctx: Context) -> list[Figure]:
    if step.name in ctx.options.skip:
        return [Figure(step.name, "skipped", "not asked for (--skip)", verdict=Verdict.SKIP)]
    try:
        return step.function(ctx)
    except Skipped as skip:
        return [Figure(step.name, "skipped", str(skip), verdict=Verdict.SKIP)]
    except StepTimeout as timeout:
        return [over_limit(step, step.limit_s, str(timeout))]
    except Exception as error:  # a failing step is a MISS with its reason, never the end
        reason = f"{type(error).__name__}: {error}"
        return [Figure(step.name, "failed", reason, "runs", Verdict.MISS)]


def over_limit(step: Step, seconds: float, detail: str = "") -> Figure:
    value = f"ran past its limit of {step.limit_s:.0f} s ({seconds:.0f} s)"
    return Figure(
        step.name,
        "time limit",
        value + (f": {detail}" if detail else ""),
        f"within {step.limit_s:.0f} s",
        Verdict.MISS,
    )


def step_verdict(figures: Iterable[Figure]) -> Verdict:
    verdicts = {f.verdict for f in figures}
    if Verdict.MISS in verdicts:
        return Verdict.MISS
    if Verdict.PASS in verdicts:
        return Verdict.PASS
    return Verdict.SKIP if Verdict.SKIP in verdicts else Verdict.INFO


def environment_lines(env: Mapping[str, Any]) -> list[str]:
    release = torch_release(env.get("torch"))
    lines = [
        f"- `{gpu['device']}`: torch {release} · {gpu_name(gpu)}, {gpu.get('memory_gib')} GiB"
        for gpu in env.get("gpus", [])
    ]
    packages = ", ".join(f"{k} {v}" for k, v in sorted(env.get("packages", {}).items()) if v)
    lines.append(
        f"- torch {env.get('torch')} (CUDA {env.get('cuda')}), Python {env.get('python')}, "
        f"{env.get('cpu_count')} cores; {packages or 'no optional package'}"
    )
    return lines


def render_markdown(env: Mapping[str, Any], runs: Sequence[StepRun], started: str) -> str:
    """The session's one Markdown file: the GPUs and torch, the verdict, every figure
    against its target, and what was skipped and why."""
    figures = [f for run in runs for f in run.figures]
    missed = [f for f in figures if f.verdict == Verdict.MISS]
    met = sum(f.verdict == Verdict.PASS for f in figures)
    verdict = "MISS" if missed else "PASS"
    gpus = ", ".join(gpu_name(g) for g in env.get("gpus", [])) or "no GPU"
    release = torch_release(env.get("torch"))
    lines = [
        f"# GPU acceptance: torch {release} · {gpus}",
        "",
        f"Started {started}.",
        "",
        *environment_lines(env),
        "",
        f"**{verdict}**: {met} targets met, {len(missed)} missed.",
        "",
        "| step | figure | value | target | verdict |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {f.step} | {markdown_safe(f.name)} | {markdown_safe(f.value)} | "
        f"{markdown_safe(f.target)} | {f.verdict.value} |"
        for f in figures
    ]
    lines += [
        "",
        "## Steps",
        "",
        "| step | what | time | limit | verdict |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.step.name} | {r.step.what} | {r.seconds:.0f} s | {r.step.limit_s:.0f} s | "
        f"{step_verdict(r.figures).value} |"
        for r in runs
    ]
    skipped = [f for f in figures if f.verdict == Verdict.SKIP]
    if skipped:
        lines += ["", "## Skipped", ""]
        lines += [f"- {f.step}: {markdown_safe(f.value)}" for f in skipped]
    return "\n".join(lines) + "\n"


def final_line(runs: Sequence[StepRun], report: Path) -> tuple[str, int]:
    figures = [f for run in runs for f in run.figures]
    missed = [f for f in figures if f.verdict == Verdict.MISS]
    skipped = sum(f.verdict == Verdict.SKIP for f in figures)
    if missed:
        names = ", ".join(f"{f.step}: {f.name}" for f in missed[:4])
        more = f" and {len(missed) - 4} more" if len(missed) > 4 else ""
        return f"gpu-acceptance: MISS: {len(missed)} missed ({names}{more}); {report}", EXIT_MISS
    met = sum(f.verdict == Verdict.PASS for f in figures)
    return f"gpu-acceptance: PASS: {met} targets met, {skipped} skipped; {report}", EXIT_PASS


def missing_modules(importable: Callable[[str], bool]) -> list[str]:
    return [name for name in REQUIRED if not importable(name)]


def cannot_accept(env: Mapping[str, Any]) -> str | None:
    """Why nothing can be accepted on this machine (None: CUDA is there)."""
    if not env.get("cuda_available") or not env.get("gpus"):
        build = f"CUDA {env['cuda']}" if env.get("cuda") else "no CUDA"
        return (
            f"gpu-acceptance: no CUDA device visible (torch {env.get('torch')}, built with "
            f"{build}): nothing to accept on this machine"
        )
    return None


def probe_environment(ctx: Context) -> dict[str, Any]:
    ctx.deadline = ctx.clock() + 300
    got: dict[str, Any] = ctx.probe("environment")
    return got


def session(
    options: Options,
    runner: Runner = run_command,
    steps: Sequence[Step] = STEPS,
    importable: Callable[[str], bool] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """The whole session: refuse at once where it cannot run, else every step, the
    Markdown, one last line; the exit status."""
    ctx = Context(options, {}, runner=runner, clock=clock)
    if importable is not None:
        ctx.importable = importable
    missing = missing_modules(ctx.importable)
    if missing:
        print(
            f"gpu-acceptance: {', '.join(missing)} not importable by {ctx.python}: run it "
            "with an interpreter that has them (nox -s gpu-acceptance finds or makes one)"
        )
        return EXIT_CANNOT
    if options.ready_only:
        return EXIT_PASS
    created = not options.out.exists()
    options.out.mkdir(parents=True, exist_ok=True)
    try:
        ctx.environment = probe_environment(ctx)
        reason = cannot_accept(ctx.environment)
    except (CommandFailed, StepTimeout, ValueError) as error:
        reason = f"gpu-acceptance: the environment probe failed: {error}"
    if reason:
        if created:  # nothing was measured: no folder left behind
            shutil.rmtree(options.out, ignore_errors=True)
        print(reason)
        return EXIT_CANNOT
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    report = options.out / REPORT_FILE

    def write(runs: list[StepRun]) -> None:
        report.write_text(render_markdown(ctx.environment, runs, started))

    runs = run_steps(steps, ctx, after_each=write)
    write(runs)
    line, code = final_line(runs, report)
    print(line)
    return code


def parse_options(argv: Sequence[str] | None) -> Options:
    parser = argparse.ArgumentParser(
        prog="gpu-acceptance", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("results") / f"gpu-acceptance-{stamp}",
        metavar="DIR",
        help="where the Markdown, the runs and the logs go (default results/gpu-acceptance-TIME)",
    )
    parser.add_argument(
        "--case", action="append", default=[], help="only this case (matrix, stages)"
    )
    parser.add_argument("--rounds", type=int, default=3, metavar="N", help="check-vs-plain rounds")
    parser.add_argument(
        "--models", type=int, default=None, metavar="N", help="check only the first N models"
    )
    parser.add_argument(
        "--tests", action="append", default=[], metavar="PATH", help="only these tests"
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=[s.name for s in STEPS],
        metavar="STEP",
        help="leave a step out: " + ", ".join(s.name for s in STEPS),
    )
    parser.add_argument(
        "--time-budget", type=float, default=None, metavar="S", help="per timed cell"
    )
    parser.add_argument(
        "--ready", action="store_true", help="only say whether this interpreter has what it needs"
    )
    args = parser.parse_args(argv)
    return Options(
        ready_only=args.ready,
        out=args.out.resolve(),
        cases=tuple(args.case),
        rounds=args.rounds,
        models=args.models,
        tests=tuple(args.tests),
        skip=frozenset(args.skip),
        time_budget=args.time_budget,
    )


def main(argv: Sequence[str] | None = None) -> int:
    return session(parse_options(argv))


if __name__ == "__main__":
    sys.exit(main())
