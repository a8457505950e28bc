"""``check``: your own models (``MODULE:FACTORY``) through the same pipeline as ``run``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from harness.cli.options import (
    add_report_dir,
    add_run_options,
    config_from,
    selection_from,
    split_values,
)
from harness.cli.output import show_run
from harness.schema.axes import MODEL_AXES

HELP = "run your own model through the matrix: MODULE:FACTORY returns (model, inputs)"


def fill(check: argparse.ArgumentParser) -> None:
    check.add_argument("targets", nargs="+", metavar="MODULE:FACTORY")
    check.add_argument(
        "--keep-fp32",
        action="append",
        default=[],
        metavar="NAME",
        help="a module or parameter (dotted name) your model keeps in float32 when cast; "
        "FACTORY=NAME for one target's model only",
    )
    check.add_argument(
        "--loss",
        action="append",
        default=[],
        metavar="MODULE:FUNC",
        help="the loss of a training step (--stage train): FUNC(output) or "
        "FUNC(output, inputs) returns a scalar tensor; it wins over a loss your model "
        "returns; FACTORY=MODULE:FUNC for one target's model only",
    )
    check.add_argument(
        "--recipe",
        action="append",
        default=[],
        metavar="MODULE:NAME",
        help="the recipe of training steps and fits (--stage train, fit): NAME is a "
        "harness.measure.authoring.recipes.Recipe (optimizer, lr, clip_norm, accumulation, "
        "scalers); FACTORY=MODULE:NAME for one target's model only",
    )
    add_run_options(check, MODEL_AXES)
    add_report_dir(check)


def command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``run`` over the models the targets build: same pipeline, results and report."""
    from harness.measure.authoring.model_targets import target_names
    from harness.runner.run import run

    names = target_names(args.targets)
    config = replace(
        config_from(args, argv),
        selection=selection_from(args).replace(cases=tuple(names.values())),
        models=tuple(names),
        models_path=str(Path.cwd()),
        keep_fp32=tuple(split_values(args.keep_fp32)),
        losses=tuple(args.loss),
        recipes=tuple(args.recipe),
    )
    return show_run(run(config), args.report_dir)
