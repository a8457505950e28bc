"""The realistic training families through the harness, beside their truth.

Each family of :mod:`zoo.training_realistic` is checked as ``check`` checks a model (a case
made from its factory, its cells run in this process), and each cell's truth is measured
with plain torch (:mod:`zoo.training_truth`): the healthy model's error and the bug's
against a float64 step, and what the bug costs over the healthy model, leaf by leaf.

``python -m zoo.training_table`` prints every cell: the verdict of each twin and its
truth (``PYTHONPATH=.``; ``--family NAME`` for one family).
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from harness.measure import execute
from harness.measure.authoring import registry
from harness.measure.authoring.case import Case, Workload, fix
from harness.measure.authoring.model_case import Matrix, call_model, model_case
from harness.runner.matrix import expand
from harness.schema.axes import CONTROL_FIX
from harness.schema.records import CellRecord, Outcome, outcome_label
from harness.schema.selection import Selection
from zoo.training_realistic import FAMILIES, SCALED, Family, Recipe
from zoo.training_truth import seeded, truth

#: The cells every family is checked in: both half dtypes in both modes, and the control.
CELLS = (
    ("float16", "autocast"),
    ("float16", "half"),
    ("bfloat16", "autocast"),
    ("bfloat16", "half"),
    ("float32", "fp32"),
)
#: A bug that costs more than this many times its healthy twin's error must not pass (the
#: bar the zoo's silent bugs are held to).
BUG_COST = 10.0
#: A bug that costs less than this is as healthy as its twin in the cell: it must pass.
NO_COST = 2.0
#: The rows a family's ``kernel_cost`` is measured summing (a LayerNorm's bias gradient
#: over 2048 tokens).
KERNEL_TERMS = 2048
#: The seed the harness builds every cell from (``fix_run.SEED``): the truth's weights and
#: data are the cell's.
SEED = 0


def twin_name(healthy: bool) -> str:
    return "healthy" if healthy else "bug"


def case_name(family: str, healthy: bool) -> str:
    return f"realistic-{family}-{twin_name(healthy)}"


@functools.cache
def family_case(family: str, healthy: bool) -> Case:
    """The case ``check`` makes of the family's model, trained by its recipe."""
    name, spec = case_name(family, healthy), FAMILIES[family]
    found = registry.find(name)
    if found is not None:
        return found
    matrix = Matrix(modes=("autocast", "half"), stages=spec.stages)
    case = model_case(name, spec.factory(healthy), matrix, __file__, loss=spec.loss)
    recipe = spec.recipe(healthy)
    return case if recipe == SCALED else with_recipe(case, recipe)


def with_recipe(case: Case, recipe: Recipe) -> Case:
    """The model case trained by ``recipe``. A fix's options are where the harness takes a
    recipe from today (``check`` and the plugin name none), so the case's one fix is the
    model as it is, with the recipe's scaler and optimizer."""

    @fix(
        CONTROL_FIX,
        rationale="the model as it is, trained by its own recipe",
        grad_scaler=recipe.grad_scaler,
        optimizer=recipe.optimizer,
    )
    def none(self: Any, w: Workload, ctx: Any) -> Any:
        return call_model(w.model, w.inputs)

    trained = type(type(case).__name__, (type(case),), {"none": none})
    registry._REGISTRY.pop(case.name)
    return registry.add_model_case(trained())


@functools.cache
def check_cell(family: str, healthy: bool, stage: str, dtype: str, mode: str) -> CellRecord:
    """The record of one cell, run as ``check`` runs it."""
    plan = expand([family_case(family, healthy)], Selection(stages=(stage,)))
    for cell in plan.to_run:
        if (cell.stage, cell.dtype, cell.mode) == (stage, dtype, mode):
            return execute.run_cell(cell)
    raise LookupError(f"{case_name(family, healthy)} has no cell {stage} {dtype}/{mode}")


@dataclass(frozen=True)
class CellTruth:
    """A cell's truth: each twin's error against float64 (the worst leaf) and what the bug
    costs over the healthy model (the largest ratio of a leaf's errors)."""

    healthy: float
    bug: float
    cost: float
    leaf: str


@functools.cache
def cell_truth(family: str, dtype: str, mode: str) -> CellTruth:
    spec = FAMILIES[family]
    errors = {healthy: twin_errors(spec, healthy, dtype, mode) for healthy in (True, False)}
    floor = torch.finfo(getattr(torch, dtype)).eps
    costs = {
        leaf: bug / max(errors[True].get(leaf, 0.0), floor) for leaf, bug in errors[False].items()
    }
    leaf = max(costs, key=lambda name: costs[name])
    return CellTruth(
        healthy=max(errors[True].values()),
        bug=max(errors[False].values()),
        cost=costs[leaf],
        leaf=leaf,
    )


def twin_errors(spec: Family, healthy: bool, dtype: str, mode: str) -> dict[str, float]:
    with seeded(SEED):
        model, inputs, forward = spec.factory(healthy)()
    scaled = spec.recipe(healthy).grad_scaler
    return truth(model, inputs, forward, spec.loss, dtype, mode, scaled).errors


def verdict_text(record: CellRecord) -> str:
    numerics = record.numerics
    figures = ""
    if numerics is not None and record.outcome in (Outcome.PASSES, Outcome.INACCURATE):
        figures = f" {numerics.rel_err:.2e}/{numerics.tolerance:.2e} ({numerics.leaf})"
    fit = record.fit
    if fit is not None:
        figures = (
            f" last loss {fit.losses[-1]:.3g} vs float64's {fit.reference_losses[-1]:.3g}, "
            f"{fit.lost_share:.0%} of updates lost"
        )
    elif record.outcome in (Outcome.CRASHED, Outcome.RAISES):
        kind = record.crash_kind.value if record.crash_kind else ""
        figures = f" {kind}: {record.error_type}: {(record.error_message or '')[:70]}"
    return f"{outcome_label(record)}{figures}"


def bug_expected(cost: float, stage: str = "train", float32_arithmetic: bool = False) -> str:
    """What a bug's cell must read, by what it costs over the healthy model in a training
    step; a fit (judged by where it ends) must not pass where the step is not finite; a
    float32 control whose bug is float32 arithmetic (``Family.float32_arithmetic_bug``)
    may read either verdict."""
    if float32_arithmetic:
        return "any verdict"
    if stage == "fit":
        return "not passes" if math.isinf(cost) else "any verdict"
    if cost > BUG_COST:
        return "not passes"
    if cost < NO_COST:
        return "passes"
    return "any verdict"


def bug_cell_expected(family: str, stage: str, dtype: str, mode: str) -> str:
    """What the bug's cell must read (:func:`bug_expected`), from its family and cell."""
    control_arithmetic = dtype == "float32" and FAMILIES[family].float32_arithmetic_bug
    return bug_expected(cell_truth(family, dtype, mode).cost, stage, control_arithmetic)


def healthy_expected(family: str, dtype: str) -> str:
    """What a healthy model's cell must read: passes, unless a torch kernel it calls costs
    on its own about the bar a bug is held to (``BUG_COST`` times what the yardstick
    charges the same sum: within a factor ``NO_COST`` of it either verdict is right) or
    more (then the cell is truly inaccurate)."""
    kernel = FAMILIES[family].kernel_cost
    if kernel is None:
        return "passes"
    cost = kernel(dtype) / yardstick_sum_eps(dtype)
    if cost > BUG_COST * NO_COST:
        return "not passes"
    return "any verdict" if cost > BUG_COST / NO_COST else "passes"


def yardstick_sum_eps(dtype: str, terms: int = KERNEL_TERMS) -> float:
    """What the yardstick charges a sum of ``terms`` values, in eps: a half dtype's rounds
    the sum once (half an eps); the float32 control's is float32 arithmetic, whose sum of
    ``terms`` values costs about the square root of their number times that."""
    once = 0.5
    return once * math.sqrt(terms) if dtype == "float32" else once


def misjudged(expected: str, record: CellRecord) -> str | None:
    """Why the cell's verdict is not the one ``expected`` asks for, or None (``passes``: a
    plain pass, as the pytest plugin asks of a model; ``not passes``: inaccurate, or
    raises; ``any verdict``: passes or inaccurate; a crash is never a verdict)."""
    if expected == "passes":
        right = record.outcome is Outcome.PASSES and not record.flags
    elif expected == "not passes":
        right = record.outcome in (Outcome.INACCURATE, Outcome.RAISES)
    else:
        right = record.outcome in (Outcome.PASSES, Outcome.INACCURATE)
    return None if right else f"must read {expected}, reads {outcome_label(record)}"


def rows(family: str) -> list[str]:
    spec, lines = FAMILIES[family], []
    for stage in spec.stages:
        for dtype, mode in CELLS:
            t = cell_truth(family, dtype, mode)
            healthy = verdict_text(check_cell(family, True, stage, dtype, mode))
            bug = verdict_text(check_cell(family, False, stage, dtype, mode))
            lines.append(
                f"| {family} | {stage} {dtype}/{mode} | {healthy} | {t.healthy:.2e} | "
                f"{healthy_expected(family, dtype)} | {bug} | {t.bug:.2e} | "
                f"{shown(t.cost)} ({t.leaf}) | {bug_cell_expected(family, stage, dtype, mode)} |"
            )
    return lines


def shown(cost: float) -> str:
    return "inf" if math.isinf(cost) else f"{cost:.3g}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES))
    args = parser.parse_args()
    print(
        "| family | cell | healthy: verdict | healthy: truth | healthy must read | "
        "bug: verdict | bug: truth | bug's cost (leaf) | bug must read |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    started = time.perf_counter()
    for family in args.family or FAMILIES:
        for line in rows(family):
            print(line, flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
