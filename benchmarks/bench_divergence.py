"""The divergence profile's attribution, measured both ways the issue names (see
``harness/measure/judge/divergence.py``): (a) each module on float64's inputs rounded to the
cell's dtype, what the profile does; (b) the cell, float64 and the rounding yardstick each
run end to end, each module's output compared along the way, and the ratio's growth across
the module. Printed per module, in the order the modules return, for the 12-layer toy of
``tests/test_divergence.py`` with a variance by cancellation in block 2's norm, and for the
built-in ``t5-wo-keep-fp32`` (fix ``none``), both float16 ``half`` on the CPU.

``--cost``: what the profile costs, side by side in one process. A failing cell (the
pre-norm transformer of ``zoo/divergence_models.py``, 12 and 48 layers deep and 16 wide,
and 12 layers 256 wide over 128 tokens, with a variance by cancellation in its middle
block's first norm, float16 ``half``) run as ``check`` runs it (``execute.run_cell``)
without the profile and with it: what the profile alone takes over the plain run, against
the target of 3 times, and the whole cell with it over without (the target plus one);
then a passing cell (its healthy twin) without and with: the profile adds nothing to a
cell that passes. The same for a training step of the
12-layer model, its backward profiled too. Each figure the median of
``--repeats`` runs' wall time after one run of each not counted, the two arms
interleaved so a load on the machine falls on both, on one thread as ``check``'s workers
run a cell (a float16 linear on two threads of a loaded CPU takes milliseconds).

    python benchmarks/bench_divergence.py [--cost] [--repeats N] [--gate]

``--gate`` exits non-zero where a failing cell's profile costs more than the target or a
passing cell is profiled.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from harness.measure import execute  # noqa: E402
from harness.measure.authoring import registry  # noqa: E402
from harness.measure.authoring.model_case import Matrix, model_case  # noqa: E402
from harness.measure.judge import divergence  # noqa: E402
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
from harness.runner.matrix import expand  # noqa: E402
from harness.schema.axes import FORWARD_STAGE, TRAIN_STAGE, Cell  # noqa: E402
from harness.schema.records import CellRecord, Outcome  # noqa: E402
from zoo.divergence_models import transformer  # noqa: E402

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


#: The profile of a failing cell must cost at most this many times its plain run.
COST_TARGET = 3.0
#: The bug the cost is measured on, the cell's dtype, and the depths, stages and widths
#: (residual stream, tokens): the zoo's 16-wide toy, whose every op is a few microseconds
#: (the harness's bookkeeping per module is most of the cost), and a 256-wide one, whose
#: ops are most of it.
COST_BUG, COST_DTYPE = "cancelling-variance", "float16"
COST_CELLS = (
    (12, FORWARD_STAGE, 16, 8),
    (48, FORWARD_STAGE, 16, 8),
    (12, FORWARD_STAGE, 256, 128),
    (12, TRAIN_STAGE, 16, 8),
)


def stage_cell(name: str, factory: Callable[[], Any], stage: str = FORWARD_STAGE) -> Cell:
    """The model's ``stage`` cell in float16 ``half``, as ``check`` plans it."""
    matrix = Matrix(dtypes=(COST_DTYPE,), modes=("half",), stages=(stage,))
    case = model_case(name, factory, matrix, __file__)
    (cell,) = [
        c
        for c in expand([case]).to_run
        if (c.stage, c.dtype, c.mode) == (stage, COST_DTYPE, "half")
    ]
    return cell


@contextmanager
def unprofiled() -> Iterator[None]:
    """While it lasts, ``run_cell`` takes no profile: no cell is one the profile is for
    (the record as judged)."""
    wants = divergence.wants_profile

    def never(*args: Any, **kwargs: Any) -> bool:
        return False

    divergence.wants_profile = never
    try:
        yield
    finally:
        divergence.wants_profile = wants


def timed(cell: Cell, profiled: bool) -> tuple[float, CellRecord]:
    """One run of the cell, with or without the profile: its wall time and record."""
    started = time.perf_counter()
    if profiled:
        record = execute.run_cell(cell)
    else:
        with unprofiled():
            record = execute.run_cell(cell)
    return time.perf_counter() - started, record


def plain_and_profiled(cell: Cell, repeats: int) -> tuple[float, float, CellRecord]:
    """The median wall time of the cell without the profile and with it, interleaved, and
    the record of a run with it."""
    plain: list[float] = []
    with_profile: list[float] = []
    timed(cell, profiled=False)  # the first run of a cell builds what later ones reuse
    record = None
    for _ in range(repeats):
        plain.append(timed(cell, profiled=False)[0])
        seconds, record = timed(cell, profiled=True)
        with_profile.append(seconds)
    assert record is not None
    return statistics.median(plain), statistics.median(with_profile), record


def cost(repeats: int) -> bool:
    """Print the profile's cost on a failing and a passing cell of each model: the cell
    without and with it, what the profile alone takes over the plain run (the target), and
    the whole cell with it over without; whether the failing cells stay within the target
    and the passing ones take no profile."""
    torch.set_num_threads(1)
    print(
        f"\nthe profile's cost: run_cell without / with it, median of {repeats} "
        f"(torch {torch.__version__}, threads: {torch.get_num_threads()})"
    )
    print(
        f"  {'model':<56} {'outcome':<11} {'without':>8} {'with':>8} "
        f"{'profile':>8} {'with/out':>8}  target"
    )
    within = True
    for layers, stage, width, tokens in COST_CELLS:
        for healthy in (False, True):
            ok = cost_line(layers, stage, width, tokens, healthy, repeats)
            within = within and ok
    return within


def cost_line(
    layers: int, stage: str, width: int, tokens: int, healthy: bool, repeats: int
) -> bool:
    """One model's line: whether it keeps to its target."""
    depth = layers // 2
    twin = "healthy twin" if healthy else f"{COST_BUG} at {depth}"
    name = f"cost-{layers}l-{width}w-{stage}-{'healthy' if healthy else 'bug'}"
    factory = transformer(layers, COST_BUG, depth, healthy, width=width, tokens=tokens)
    cell = stage_cell(name, factory, stage)
    plain, profiled, record = plain_and_profiled(cell, repeats)
    alone = (profiled - plain) / plain
    failing = record.outcome is Outcome.INACCURATE
    target = f"profile <= {COST_TARGET:g}x" if failing else "nothing added"
    ok = record.profile is not None if failing else record.profile is None
    ok = ok and (alone <= COST_TARGET if failing else True)
    label = f"{layers}x{width} ({tokens} tokens) {stage}, {twin}"
    print(
        f"  {label:<56} {record.outcome.value:<11} {plain:>7.2f}s {profiled:>7.2f}s "
        f"{alone:>7.2f}x {profiled / plain:>7.2f}x  {target}{'' if ok else '  MISSED'}"
    )
    if record.divergence is not None:
        print(f"    {record.divergence.describe()}")
    return ok


def attribution() -> None:
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cost", action="store_true", help="the profile's cost alone")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each arm (3)")
    parser.add_argument("--gate", action="store_true", help="exit 1 where a figure misses")
    args = parser.parse_args(argv)
    registry.discover()
    if not args.cost:
        attribution()
    within = cost(args.repeats)
    return 1 if args.gate and not within else 0


if __name__ == "__main__":
    sys.exit(main())
