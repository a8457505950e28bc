"""``run``: the matrix of the cases (built in and ``--cases-dir``), or ``--resume`` a
stopped run."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from harness.cli.options import add_cases_dir, add_report_dir, add_run_options, config_from
from harness.cli.output import existing_run_dir, show_run
from harness.schema.axes import AXES

HELP = "run the matrix and write results"


def fill(parser: argparse.ArgumentParser) -> None:
    add_cases_dir(parser)
    add_run_options(parser, AXES)
    parser.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="finish a stopped run: only its missing cells run (selection flags not allowed)",
    )
    add_report_dir(parser)


def command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from harness.runner.run import run

    if args.resume:
        return command_resume(args)
    return show_run(run(config_from(args, argv)), args.report_dir)


def command_resume(args: argparse.Namespace) -> int:
    from harness.runner.run import resume
    from harness.schema.selection import SelectionError

    chosen = [f"--{axis.name}" for axis in AXES if getattr(args, axis.plural, None)]
    if chosen or args.cases_dir:
        raise SelectionError(
            f"--resume finishes the run as it was started: drop "
            f"{', '.join(chosen + ['--cases-dir'] * bool(args.cases_dir))}"
        )
    run_dir = resume(existing_run_dir(args.resume), args.workers)
    return show_run(run_dir, args.report_dir)
