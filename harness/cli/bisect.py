"""``bisect``: the outcomes of the same cells across torch versions, and where they change."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from harness.cli.options import split_values
from harness.cli.output import existing_run_dir, warn
from harness.results import storage

HELP = "outcomes of the same cells across torch versions, and where they change"


def fill(bisect: argparse.ArgumentParser) -> None:
    bisect.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    bisect.add_argument("--case", action="append", metavar="NAME", help="only this case")
    bisect.add_argument("--fix", action="append", metavar="NAME", help="only this fix")


class NoRecordChosen(ValueError):
    """``bisect --case/--fix`` named what no record of the runs has."""


def command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from harness.results.versions import render_bisect

    cases, fixes = split_values(args.case), split_values(args.fix)
    records = []
    for run_dir in args.run_dirs:
        problems: list[str] = []
        records += storage.read_records(existing_run_dir(run_dir), problems)
        warn(problems)
    chosen = [
        r
        for r in records
        if (not cases or r.cell.case in cases) and (not fixes or r.cell.fix in fixes)
    ]
    if records and not chosen:
        raise NoRecordChosen(
            f"no records of case {cases or 'any'} / fix {fixes or 'any'} in these runs"
        )
    print(render_bisect(chosen))
    return 0
