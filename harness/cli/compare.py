"""``compare``: outcome and speed changes from one run (or results folder) to another; for
CI, a regression exits 1, and cells of BASE that HEAD has no record of exit 3 (a run that
broke must not pass its own gate) unless ``--allow-missing``; so do the cells of a run of
HEAD that BASE has nothing to compare with (no run of its environment, or a run without a
record). A side that holds no run, or two sides without a record, exit 2: a gate never
passes on nothing."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from harness.cli.options import probability, ratio_above_one
from harness.cli.output import INCOMPLETE, existing_run_dir, warn
from harness.results import storage
from harness.results.speed import ALPHA, MIN_RATIO
from harness.schema.text import one_line

if TYPE_CHECKING:  # imported when used: it brings in pandas
    from harness.report.compare import Missing

HELP = (
    "outcome and speed changes from BASE to HEAD (two runs, or two results folders: "
    "then each environment's newest run, by torch version and GPUs (a host without a GPU by "
    "its name), is compared with "
    "the same environment's; to compare across GPUs, give two run folders); speed is "
    "judged against the pair's machine factor and spread, per device; exits 1 on a "
    "regression, 3 when HEAD has no record of cells BASE has or BASE has nothing to "
    "compare a run of HEAD with, 2 when a side holds no run or no record"
)

#: The exit code of a regression.
REGRESSED = 1
#: The exit code of a HEAD without a record of cells BASE has (or of a run of HEAD that
#: BASE has nothing to compare with): the cells a run left without a record exit with the
#: same code.
MISSING = INCOMPLETE


def fill(compare: argparse.ArgumentParser) -> None:
    compare.add_argument("base", type=Path, metavar="BASE")
    compare.add_argument("head", type=Path, metavar="HEAD")
    compare.add_argument(
        "--min-ratio",
        type=ratio_above_one,
        default=MIN_RATIO,
        help=(
            f"smallest speed ratio, over the device's machine factor, that counts "
            f"(default {MIN_RATIO})"
        ),
    )
    compare.add_argument(
        "--alpha",
        type=probability,
        default=ALPHA,
        help=f"significance level of the Mann-Whitney U test (default {ALPHA})",
    )
    compare.add_argument(
        "--allow-missing",
        action="store_true",
        help=(
            f"pass when HEAD has no record of cells BASE has (a smaller selection on purpose); "
            f"without it they are named and the command exits {MISSING}"
        ),
    )


def command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from harness.report.compare import Missing, compared_pairs, pair_runs, render_comparison

    pairing = pair_runs(existing_run_dir(args.base), existing_run_dir(args.head))
    for line in pairing.left_out:
        print(f"ampmatrix: {one_line(line)}", file=sys.stderr)
    missing = [unpaired_cells(base_dir, args.head) for base_dir in pairing.unpaired_bases]
    missing += [unpaired_cells(head_dir, args.base) for head_dir in pairing.unpaired_heads]
    regressions = compared = 0
    for pair in compared_pairs(pairing.pairs, args.min_ratio, args.alpha):
        warn(pair.problems)
        comparison = pair.comparison
        print(render_comparison(comparison))
        regressions += len(comparison.regressions)
        compared += comparison.compared
        missing.append(Missing(pair.base, pair.head, comparison.only_in_base))
        missing.append(pair.with_nothing)
    missing = [m for m in missing if m.cells]
    if not compared and not missing:
        raise storage.ResultsError(
            f"{args.base} and {args.head} hold no record to compare: nothing compared"
        )
    return gate(regressions, missing, args.allow_missing)


def unpaired_cells(base_dir: Path, head: Path) -> Missing:
    """Every cell of a run of one side whose environment has no run in the other."""
    from harness.report.aggregate import load_run
    from harness.report.compare import Missing

    base = load_run(base_dir)
    warn(base.problems)
    return Missing(base_dir, head, sorted(record.cell for record in base.records))


def gate(regressions: int, missing: Sequence[Missing], allow_missing: bool) -> int:
    """The exit code, once every missing cell is named: a regression first, then cells of
    BASE that HEAD has no record of (unless allowed)."""
    for cells in missing:
        if allow_missing:
            print(
                f"ampmatrix: {one_line(cells.describe())} (allowed by --allow-missing)",
                file=sys.stderr,
            )
        else:
            print(
                f"ampmatrix: error: {one_line(cells.describe())} (--allow-missing accepts it)",
                file=sys.stderr,
            )
    if regressions:
        return REGRESSED
    return MISSING if missing and not allow_missing else 0
