"""The options ``run`` and ``check`` share, the argument types, and the run's one
configuration built from them. The selection flags are derived from the axis table."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from harness.schema.axes import AXES, Axis
from harness.schema.config import MAX_MEMORY_BYTES, MAX_SECONDS, TimingConfig

if TYPE_CHECKING:
    from harness.schema.config import RunConfig
    from harness.schema.selection import Selection


def split_values(values: Sequence[str] | None) -> tuple[str, ...]:
    """``--dtype float16,bfloat16 --dtype float32`` -> three values."""
    return tuple(v for value in values or () for v in value.split(",") if v)


def batch_size(value: str) -> int:
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of cells, 1 or more")


def fit_step_count(value: str) -> int:
    from harness.schema.config import MAX_FIT_STEPS

    if value.isdigit() and 1 <= int(value) <= MAX_FIT_STEPS:
        return int(value)
    raise argparse.ArgumentTypeError(
        f"{value!r} is not a whole number of steps from 1 to {MAX_FIT_STEPS}"
    )


def max_workers() -> int:
    """The most worker processes a run starts: four per core (each is an interpreter with
    torch loaded; more only queue for the cores and the process table)."""
    return 4 * (os.cpu_count() or 1)


def worker_count_arg(value: str) -> str:
    if value == "auto" or (value.isdigit() and 0 <= int(value) <= max_workers()):
        return value
    raise argparse.ArgumentTypeError(
        f"{value!r} is not 'auto' or a number of workers from 0 to {max_workers()} (four per core)"
    )


def add_cases_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cases-dir",
        action="append",
        type=Path,
        default=[],
        metavar="DIR",
        help="also load case modules from DIR (repeatable)",
    )


def add_run_options(parser: argparse.ArgumentParser, axes: tuple[Axis, ...]) -> None:
    """The options ``run`` and ``check`` share: the selection flags of ``axes``, where the
    results go, workers, timing, limits."""
    from harness.schema.config import DEFAULT_TIMEOUT_S, RunConfig

    for axis in axes:
        parser.add_argument(
            f"--{axis.name}",
            dest=axis.plural,
            action="append",
            metavar="NAME",
            help=f"only this {axis.name} (repeatable, or comma-separated){axis.flag_help}",
        )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("results"),
        metavar="DIR",
        help="results root; the run goes to DIR/<run-id> (default results)",
    )
    parser.add_argument(
        "-n",
        "--workers",
        default="auto",
        type=worker_count_arg,
        help="worker processes (default auto: one per core; 0: in-process)",
    )
    parser.add_argument(
        "--no-timing", action="store_true", help="skip the timing phase (correctness only)"
    )
    parser.add_argument(
        "--no-trace",
        action="store_true",
        help="no dtype trail and no drift check in correctness cells (measures their cost)",
    )
    parser.add_argument(
        "--time-budget",
        type=seconds,
        default=TimingConfig.budget_s,
        metavar="SECONDS",
        help=f"sampling time allowed per timed cell (default {TimingConfig.budget_s})",
    )
    parser.add_argument(
        "--flush-l2", action="store_true", help="on CUDA, flush the L2 cache before each sample"
    )
    parser.add_argument(
        "--timeout",
        type=seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"time limit per cell; a case may set its own (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--memory-limit",
        type=memory_gib,
        metavar="GIB",
        help="memory limit per cell process (RLIMIT_DATA); beyond it allocations fail",
    )
    parser.add_argument(
        "--batch",
        type=batch_size,
        default=RunConfig.batch,
        metavar="N",
        help=f"cells of one case sharing a forked process (default {RunConfig.batch}; "
        "1: every cell in a process of its own)",
    )
    parser.add_argument(
        "--fit-steps",
        type=fit_step_count,
        default=RunConfig.fit_steps,
        metavar="N",
        help=f"optimizer steps of each fit cell (--stage fit; default {RunConfig.fit_steps})",
    )


def add_report_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--report-dir",
        type=Path,
        metavar="DIR",
        help="also render the run's HTML report into DIR/<run-id>.html",
    )


def positive_float(value: str) -> float:
    """A finite number above zero (``nan``, ``inf`` and ``1e400`` are refused)."""
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not (math.isfinite(number) and number > 0):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive finite number")
    return number


def seconds(value: str) -> float:
    """A time in seconds the platform can wait for (``MAX_SECONDS``, 24.8 days)."""
    number = positive_float(value)
    if number > MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"{value!r} seconds is longer than a run can wait (at most {MAX_SECONDS})"
        )
    return number


def probability(value: str) -> float:
    number = positive_float(value)
    if number >= 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a probability between 0 and 1")
    return number


def ratio_above_one(value: str) -> float:
    number = positive_float(value)
    if number <= 1:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a speed ratio above 1 (1.10: a change of 10% or more)"
        )
    return number


#: The smallest per-cell memory limit: below it not even the interpreter fits.
MIN_MEMORY_GIB = 0.25


def physical_memory_gib() -> float | None:
    """This machine's memory (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def memory_gib(value: str) -> float:
    """A per-cell memory limit in GiB: enough for the interpreter, and at most what this
    machine has (a larger one limits nothing, and setrlimit() refuses the largest)."""
    number = positive_float(value)
    if number < MIN_MEMORY_GIB:
        raise argparse.ArgumentTypeError(
            f"{value!r} GiB is too small a memory limit (at least {MIN_MEMORY_GIB:g})"
        )
    ceiling = physical_memory_gib() or MAX_MEMORY_BYTES / 2**30
    if number > ceiling:
        raise argparse.ArgumentTypeError(
            f"{value!r} GiB is more memory than this machine has ({ceiling:.1f} GiB): "
            "leave --memory-limit out for no limit"
        )
    return number


def selection_from(args: argparse.Namespace, axes: tuple[Axis, ...] = AXES) -> Selection:
    """The selection flags; one given with no name at all (``--case ""``) is refused rather
    than read as "every case"."""
    from harness.schema.selection import Selection, SelectionError

    values = {}
    for axis in axes:
        given = getattr(args, axis.plural, None)
        values[axis.plural] = split_values(given)
        if given is not None and not values[axis.plural]:
            raise SelectionError(f"--{axis.name} was given no name")
    return Selection.over(axes, values)


def config_from(args: argparse.Namespace, argv: Sequence[str]) -> RunConfig:
    """The run's one configuration, built once from the command line."""
    from harness.schema.config import Limits, RunConfig

    timing = TimingConfig(budget_s=args.time_budget, flush_l2=args.flush_l2)
    return RunConfig(
        selection=selection_from(args),
        cases_dirs=tuple(getattr(args, "cases_dir", ())),
        results_root=args.out,
        workers=args.workers,
        command=("python -m harness", *argv),
        timing=None if args.no_timing else timing,
        trace=not args.no_trace,
        batch=args.batch,
        fit_steps=args.fit_steps,
        limits=Limits(
            timeout_s=args.timeout,
            memory_bytes=int(args.memory_limit * 2**30) if args.memory_limit else None,
        ),
    )
