"""The divergence profile's attribution, measured both ways the issue names (see
``harness/measure/judge/divergence.py``): (a) each module on float64's inputs rounded to the
cell's dtype, what the profile does; (b) the cell, float64 and the rounding yardstick each
run end to end, each module's output compared along the way, and the ratio's growth across
the module. Printed per module, in the order the modules return, for the 12-layer toy of
``tests/test_divergence.py`` with a variance by cancellation in block 2's norm, and for the
built-in ``t5-wo-keep-fp32`` (fix ``none``), both float16 ``half`` on the CPU.

    python benchmarks/bench_divergence.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from harness.measure.authoring import registry  # noqa: E402
from harness.measure.authoring.model_case import Matrix, model_case  # noqa: E402
from harness.measure.judge.divergence import (  # noqa: E402
    compared,
    floating,
    hooked,
    profile,
)
from harness.measure.judge.numerics import DTYPE_FLOOR, ROUNDING_FACTOR  # noqa: E402
from harness.measure.judge.references import (  # noqa: E402
    float64_run,
    float64_workload,
    plain_cell,
    rounded_workload,
    workpiece,
)
from harness.measure.judge.rounding import rounds_activations, stored_rounding  # noqa: E402
from harness.measure.precision.casting import split_kept  # noqa: E402
from harness.measure.precision.dtypes import TORCH_DTYPES  # noqa: E402
from harness.measure.running.fix_run import (  # noqa: E402
    context_for,
    prepared_workload,
    run_fix_checked,
)
from harness.schema.axes import Cell  # noqa: E402

Outputs = dict[str, list[torch.Tensor]]


def outputs_of(model: Any, run: Any) -> Outputs:
    """What each module of ``model`` returned in ``run()`` (first call), on the CPU."""
    kept: Outputs = {}

    def returned(path: str, module: Any, args: Any, kwargs: Any, output: Any) -> None:
        if path not in kept:
            kept[path] = [t.detach().cpu() for t in floating(output)]

    with hooked(model, lambda *_: None, returned):
        run()
    return kept


def along_the_run(case_name: str, cell: Cell) -> list[tuple[str, float]]:
    """(b): each module's ratio with the three runs taken end to end."""
    case = registry.get(case_name)
    keep = case.kept_by(cell.fix)
    ctx = context_for(case, cell, observe=False)
    piece = workpiece(cell)._replace(fix=cell.fix)
    reference = float64_workload(piece)
    mine = prepared_workload(case, ctx, keep)
    f64_ctx = context_for(
        case, plain_cell(case, "float64", cell.size, backend=piece.backend, stage=cell.stage)
    )
    stick = rounded_workload(case, f64_ctx, cell.dtype, keep)
    model_keep = split_kept(keep, reference.inputs)[0]
    truth = outputs_of(reference.model, lambda: float64_run(piece, reference, record=False))
    ran = outputs_of(
        mine.model,
        lambda: run_fix_checked(case, cell.fix, ctx, trace=False, workload=mine, record=False),
    )

    def yardstick() -> None:
        with stored_rounding(
            stick.model, cell.dtype, model_keep, rounds_activations(cell.mode), cell.stage
        ):
            run_fix_checked(case, cell.fix, f64_ctx, trace=False, workload=stick, record=False)

    rounded = outputs_of(stick.model, yardstick)
    floor = DTYPE_FLOOR[TORCH_DTYPES[cell.dtype]] / ROUNDING_FACTOR
    ratios = []
    for path, expected in truth.items():
        if not expected or path not in ran or path not in rounded:
            continue
        error = compared(ran[path], expected)
        rounding = compared(rounded[path], expected)
        ratios.append(
            (path, error / max(rounding, floor) if math.isfinite(rounding) else math.nan)
        )
    return ratios


def show(case_name: str, cell: Cell) -> None:
    case = registry.get(case_name)
    isolated = {m.path: m.ratio for m in profile(case, cell, ROUNDING_FACTOR).modules}
    print(f"\n{cell.id}: ratio per module, (a) on float64's inputs, (b) along the run, growth")
    previous = None
    for path, ratio in along_the_run(case_name, cell):
        growth = ratio / previous if previous else math.nan
        previous = ratio if math.isfinite(ratio) and ratio > 0 else previous
        a = isolated.get(path, math.nan)
        name = path or "(model)"
        print(f"  {name:<24} (a) {a:>10.3g}   (b) {ratio:>10.3g}   growth {growth:>8.3g}")


def main() -> None:
    registry.discover()
    from test_divergence import toy  # the toy models of the tests

    model_case(
        "toy-variance-at-2",
        toy("cancelling-variance", 2),
        Matrix(dtypes=("float16",), modes=("half",)),
        __file__,
    )
    show("toy-variance-at-2", Cell("toy-variance-at-2", "none", "cpu", "float16", "half", "sdpa"))
    show(
        "t5-wo-keep-fp32",
        Cell("t5-wo-keep-fp32", "none", "cpu", "float16", "half", "eager", size="small"),
    )


if __name__ == "__main__":
    main()
