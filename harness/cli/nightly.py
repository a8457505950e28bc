"""``nightly-verdict TONIGHT [LAST]``: the nightly's combine step. One report over every run
of tonight (each torch release on each GPU kind), then tonight against last night, release
by release and GPU by GPU (:mod:`harness.report.nightly` says what fails and what is
expected). Exits 1 on a failing change, 3 when tonight has no record of cells last night
had or last night has nothing to compare a run of tonight with (unless ``--allow-missing``),
2 when LAST holds no run or neither night a record, 0 otherwise; with no LAST it says so and
passes."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.cli.compare import gate
from harness.cli.output import existing_run_dir, warn
from harness.cli.report import check_output
from harness.results import storage
from harness.schema.text import one_line

HELP = (
    "the nightly's verdict: one report over tonight's runs, then each torch release and "
    "GPU against last night's; exits 1 on a fix that stopped passing or a new error, 3 on "
    "cells tonight lost or cells last night has nothing to compare with, 2 when LAST holds "
    "no run"
)

#: Where the report goes unless ``--out`` says otherwise.
DEFAULT_OUT = Path("reports") / "nightly.html"


def fill(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "tonight", type=Path, metavar="TONIGHT", help="tonight's results: a folder of runs"
    )
    parser.add_argument(
        "last",
        type=Path,
        nargs="?",
        metavar="LAST",
        help="last night's results folder (none: the first night, nothing to compare)",
    )
    parser.add_argument(
        "--out", type=Path, metavar="FILE", default=DEFAULT_OUT, help=f"(default {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--markdown",
        type=Path,
        metavar="FILE",
        help="append the runs' summary and the verdict to FILE ($GITHUB_STEP_SUMMARY)",
    )
    parser.add_argument(
        "--allow-missing",
        action="store_true",
        help="pass when tonight has no record of cells last night had, or last night has "
        "nothing to compare a run of tonight with (once, after a runner's GPUs or the "
        "releases changed); they are still named",
    )


def command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from harness.report.nightly import judge_nights, render_verdict, render_verdict_markdown

    tonight = runs_under(existing_run_dir(args.tonight))
    render_tonight(tonight, [*tonight, *([args.last] if args.last else [])], args)
    if args.last is None:
        note = "nightly verdict: no last night's results: nothing to compare, nothing fails"
        print(note)
        append_markdown(args.markdown, f"### Against last night\n\n{note}\n")
        return 0
    verdict = judge_nights(existing_run_dir(args.last), args.tonight)
    warn(verdict.problems)  # tonight's were said with the report
    for line in verdict.left_out:
        print(f"ampmatrix: {one_line(line)}", file=sys.stderr)
    if not verdict.cells_compared and not verdict.unjudged:
        raise storage.ResultsError(
            f"{args.last} and {args.tonight} hold no record to compare: nothing compared"
        )
    print(render_verdict(verdict, args.allow_missing))
    append_markdown(args.markdown, render_verdict_markdown(verdict, args.allow_missing))
    return gate(len(verdict.failures), verdict.unjudged, args.allow_missing)


def runs_under(folder: Path) -> list[Path]:
    """The run folders of a night: the folder itself where it is one run, else each run
    folder in it (the artifacts of every job, downloaded into one folder)."""
    from harness.report.compare import is_run_dir

    if is_run_dir(folder):
        return [folder]
    runs = sorted(p for p in folder.iterdir() if p.is_dir() and is_run_dir(p))
    if not runs:
        raise storage.ResultsError(f"{folder}: no run folder in it (expected tonight's runs)")
    return runs


def render_tonight(runs: Sequence[Path], inputs: Sequence[Path], args: argparse.Namespace) -> None:
    """One HTML report over every run of the night, and its Markdown summary."""
    from harness.report.aggregate import load_runs_for_report
    from harness.report.markdown import render_markdown
    from harness.report.writing import render_report, write_report

    check_output(args.out, inputs, "--out")
    if args.markdown:
        check_output(args.markdown, inputs, "--markdown")
    loaded = load_runs_for_report(runs)
    warn([problem for run in loaded for problem in run.problems])
    report = write_report(render_report(loaded), args.out)
    print(f"report: {one_line(str(report))} ({len(runs)} runs)")
    append_markdown(args.markdown, render_markdown(loaded))


def append_markdown(path: Path | None, text: str) -> None:
    if path is not None:
        storage.append_whole(path, text.encode())
