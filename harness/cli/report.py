"""``report``: one HTML report over one or more runs (no torch is imported)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

from harness.cli.output import existing_run_dir, warn
from harness.results import storage
from harness.schema.text import one_line

if TYPE_CHECKING:
    from harness.report.aggregate import Run
    from harness.report.drawing import Drawing

HELP = "render one HTML report over one or more runs"


def fill(report: argparse.ArgumentParser) -> None:
    report.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    report.add_argument(
        "--out", type=Path, metavar="FILE", help="output file (default reports/<run-id>.html)"
    )
    report.add_argument(
        "--baseline",
        type=Path,
        metavar="BASE",
        help="add a section comparing the (last) run with this run",
    )
    report.add_argument(
        "--markdown",
        type=Path,
        metavar="FILE",
        help="also append a short Markdown summary to FILE (a CI job summary: "
        "$GITHUB_STEP_SUMMARY)",
    )


def default_report_path(run_dirs: Sequence[Path]) -> Path:
    if len(run_dirs) == 1:
        return Path("reports") / f"{run_dirs[0].name}.html"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    return Path("reports") / f"combined-{stamp}.html"


def command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import harness.report.aggregate  # noqa: F401  # pandas, before the drawing process forks
    from harness.report.drawing import Drawing

    # forked with pandas imported (the figures' points are frames): it draws the figures
    # while the tables are built
    with Drawing() as drawing:
        return report_command(args, drawing)


def report_command(args: argparse.Namespace, drawing: Drawing) -> int:
    from harness.report.aggregate import load_run, load_runs_for_report
    from harness.report.compare import check_not_itself, compare_runs
    from harness.report.writing import render_report, write_report

    runs = load_runs_for_report([existing_run_dir(d) for d in args.run_dirs])
    out = args.out or default_report_path(args.run_dirs)
    inputs = [*args.run_dirs, *([args.baseline] if args.baseline else [])]
    check_output(out, inputs, "--out")
    if args.markdown:
        check_output(args.markdown, inputs, "--markdown")
    comparison = None
    if args.baseline:
        check_not_itself(args.baseline, args.run_dirs[-1])
        base = baseline_run(args.baseline)
        comparison = compare_runs(base, load_run(existing_run_dir(args.run_dirs[-1])))
    warn([p for loaded in runs for p in loaded.problems])
    report = write_report(render_report(runs, comparison, drawing), out)
    print(f"report: {one_line(str(report))}")
    if args.markdown:
        from harness.report.markdown import render_markdown

        storage.append_whole(args.markdown, render_markdown(runs).encode())
        print(f"summary: {one_line(str(args.markdown))}")
    return 0


def baseline_run(path: Path) -> Run:
    """The run ``--baseline`` names, with its reading problems said; a folder that is not
    a run (a results folder, a models folder) or a run without a record is refused: a
    comparison with nothing would say "no outcome changes"."""
    from harness.report.aggregate import load_run
    from harness.report.compare import is_run_dir

    if not is_run_dir(existing_run_dir(path)):
        raise storage.ResultsError(
            f"--baseline {path}: not a run folder (no {storage.ENV_FILE} or "
            f"{storage.CELLS_FILE} in it); name one run"
        )
    base = load_run(path)
    warn(base.problems)
    if not base.records:
        raise storage.ResultsError(f"--baseline {path}: no record to compare with")
    return base


def check_output(out: Path, run_dirs: Sequence[Path], flag: str) -> None:
    """A report goes to a file of its own: never into a run folder (its results, its run
    plan), never over a folder, the reports' index or a file that is not a report."""
    from harness.report.writing import made_by_ampmatrix

    if out.is_dir():
        raise storage.ResultsError(f"{flag} {out}: a folder; name the file to write")
    target = out.resolve()
    for run_dir in run_dirs:
        if target.is_relative_to(run_dir.resolve()):
            raise storage.ResultsError(f"{flag} {out}: refusing to write into the run {run_dir}")
    if flag == "--out" and out.name == "index.html":
        raise storage.ResultsError(f"{flag} {out}: index.html is the folder's list of reports")
    if flag == "--out" and out.exists() and not made_by_ampmatrix(out):
        raise storage.ResultsError(
            f"{flag} {out}: exists and is not an ampmatrix report; refusing to overwrite it"
        )
