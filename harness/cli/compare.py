"""``compare``: outcome and speed changes from one run (or results folder) to another; a
regression exits 1, for CI."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from harness.cli.options import positive_float
from harness.cli.output import existing_run_dir, warn
from harness.results.speed import ALPHA, MIN_RATIO

HELP = (
    "outcome and speed changes from BASE to HEAD (two runs, or two results folders: "
    "then each torch version's newest run is compared with the same version's)"
)


def fill(compare: argparse.ArgumentParser) -> None:
    compare.add_argument("base", type=Path, metavar="BASE")
    compare.add_argument("head", type=Path, metavar="HEAD")
    compare.add_argument(
        "--min-ratio",
        type=positive_float,
        default=MIN_RATIO,
        help=f"smallest speed ratio that counts (default {MIN_RATIO})",
    )
    compare.add_argument(
        "--alpha",
        type=positive_float,
        default=ALPHA,
        help=f"significance level of the Mann-Whitney U test (default {ALPHA})",
    )


def command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from harness.report.aggregate import load_run
    from harness.report.compare import compare_runs, pair_runs, render_comparison

    pairing = pair_runs(existing_run_dir(args.base), existing_run_dir(args.head))
    for line in pairing.left_out:
        print(f"ampmatrix: {line}", file=sys.stderr)
    if not pairing.pairs:
        print(
            f"ampmatrix: no run of {args.head} has a run of the same environment (torch "
            f"release, host and GPUs) in {args.base}: nothing to compare",
            file=sys.stderr,
        )
        return 0
    regressions = 0
    for base_dir, head_dir in pairing.pairs:
        base, head = load_run(base_dir), load_run(head_dir)
        warn(base.problems + head.problems)
        comparison = compare_runs(base, head, args.min_ratio, args.alpha)
        print(render_comparison(comparison))
        regressions += len(comparison.regressions)
    return 1 if regressions else 0
