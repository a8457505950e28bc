"""Calibration of the tolerance rule: healthy models and silent bugs side by side, for
forward outputs and for gradients.

For every model, every half-precision cell (float16 and bfloat16) and the float32 control
runs through the harness's own cell runner (``execute.run_cell``, as ``check`` runs it) and
prints its error over the error of merely rounding its data to the cell's dtype (the
rounding yardstick of ``harness.measure.judge.rounding``: weights and inputs, and where the model
holds its weights in the dtype what each module returns too; in a training step the float64
step of that rounded model, whose backward rounds the gradient each module receives as the
cell's model stores it). Two stages:

* **forward** (modes ``autocast`` and ``half``): the healthy models, the silent precision
  bugs of ``zoo/silent_bugs.py`` and their twins;
* **train** (modes ``autocast``, ``half`` and ``half-autocast``): one training step of the
  healthy models, and of the training bugs of ``zoo/training_bugs.py`` and their twins; the
  loss and every gradient are leaves, and a cell's figure is its largest ratio among the
  leaves its rounding yardstick judged (a leaf whose tolerance is eps, such as a loss whose
  rounding costs less, is not a figure of the yardstick).

Groups: **healthy** (the zoo's models and the real architectures of
``zoo/architectures.py``: transformers and diffusers, shallow and 12 layers deep, and a
post-LayerNorm encoder and a pre-norm decoder 48 layers deep, each as its library writes
it), **bug** and **twin**. The rule must separate them: every healthy and twin cell within
``ROUNDING_FACTOR`` times its rounding error (outcome ``passes``, whatever flags it
carries), every bug cell that costs more than ten times its rounding error beyond it. The
script prints the table, both groups' extremes and the margins on either side of the factor
(per stage: over the half-precision cells, then per dtype), and exits non-zero if a cell is
misjudged.

    python benchmarks/bench_verdicts.py [--device cpu|cuda] [--only NAME,...]
        [--stage forward|train|all] [--markdown]
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from harness.measure import execute  # noqa: E402
from harness.measure.authoring import registry  # noqa: E402
from harness.measure.authoring.model_case import Matrix, model_case  # noqa: E402
from harness.measure.authoring.model_targets import case_name  # noqa: E402
from harness.measure.host import caches  # noqa: E402
from harness.measure.judge.numerics import ROUNDING_FACTOR, rounding_ratio  # noqa: E402
from harness.plugin import MARK  # noqa: E402
from harness.runner.matrix import expand  # noqa: E402
from harness.schema.axes import FORWARD_STAGE, TRAIN_STAGE  # noqa: E402
from harness.schema.records import CellRecord, Numerics, Outcome, outcome_label  # noqa: E402

#: A bug that costs more than this many times the rounding error must not read as passes.
BUG_COST = 10.0
ZOO_MODULES = ("zoo.test_transformers_models", "zoo.test_vision_models")
HALF_CELLS = ("float16/autocast", "float16/half", "bfloat16/autocast", "bfloat16/half")
TRAIN_CELLS = tuple(
    f"{dtype}/{mode}"
    for dtype in ("float16", "bfloat16")
    for mode in ("autocast", "half", "half-autocast")
)
#: The modes each stage is calibrated in (the float32 control is always added).
STAGE_MODES = {
    FORWARD_STAGE: ("autocast", "half"),
    TRAIN_STAGE: ("autocast", "half", "half-autocast"),
}


@dataclass(frozen=True)
class Model:
    name: str
    group: str  # healthy, bug or twin
    layers: int | None
    factory: Callable[..., Any]
    matrix: Matrix
    stages: tuple[str, ...] = (FORWARD_STAGE, TRAIN_STAGE)


@dataclass(frozen=True)
class Row:
    model: Model
    record: CellRecord

    @property
    def where(self) -> str:
        cell = self.record.cell
        backend = f" [{cell.backend}]" if len(self.model.matrix["backends"]) > 1 else ""
        return f"{cell.dtype}/{cell.mode}{backend}"

    @property
    def stage(self) -> str:
        return self.record.cell.stage

    @property
    def judged_leaf(self) -> Numerics | None:
        """The figures this cell is calibrated by: a forward cell's worst leaf, and a
        failing training step's (as its record shows it); a training step that passes, its
        leaf with the largest ratio among those the rounding yardstick judged (a loss whose
        tolerance is eps is not one)."""
        numerics = self.record.numerics
        failed = self.record.outcome is not Outcome.PASSES
        if self.stage != TRAIN_STAGE or not self.record.leaves or failed:
            return numerics
        by_rounding = [
            n
            for n in self.record.leaves.values()
            if (n.decided_by or "").startswith("rounding") and rounding_ratio(n) is not None
        ]
        return max(by_rounding, key=lambda n: rounding_ratio(n) or 0, default=numerics)

    @property
    def ratio(self) -> float | None:
        numerics = self.judged_leaf
        return rounding_ratio(numerics) if numerics else None

    @property
    def misjudged(self) -> str | None:
        """Why this cell's verdict is wrong for its group, or None. The outcome is what the
        tolerance rule decides; a flag beside it (``passes[undone-upcast]``: autocast cast
        T5's float32 ``wo`` input back down) is another check's, shown but not judged here."""
        label = outcome_label(self.record)
        passes = self.record.outcome is Outcome.PASSES
        if self.model.group != "bug":
            return None if passes else f"{self.model.group} cell reads {label}"
        costly = self.ratio is None or self.ratio > BUG_COST
        if costly and passes:
            return f"bug costing {self.ratio:.3g}x the rounding reads {label}"
        return None


def zoo_models() -> Iterator[Model]:
    """The zoo's models, with the matrix each test asks for."""
    for module_name in ZOO_MODULES:
        module = importlib.import_module(module_name)
        for name, test in vars(module).items():
            spec = getattr(test, MARK, None)
            if spec is not None:
                yield Model(case_name(name.removeprefix("test_")), "healthy", None, spec.factory,
                            spec.matrix)  # fmt: skip


def architecture_models(matrix: Matrix) -> Iterator[Model]:
    from zoo.architectures import ARCHITECTURES, DEEP

    for name, (factory, layers) in {**ARCHITECTURES, **DEEP}.items():
        yield Model(name, "healthy", layers, factory, matrix)


def silent_bug_models(matrix: Matrix) -> Iterator[Model]:
    from zoo.silent_bugs import PAIRS

    for name, pair in PAIRS.items():
        yield Model(f"{name}", "bug", None, pair.bug, matrix, (FORWARD_STAGE,))
        yield Model(f"{name}-twin", "twin", None, pair.twin, matrix, (FORWARD_STAGE,))


def training_bug_models(matrix: Matrix) -> Iterator[Model]:
    from zoo.training_bugs import PAIRS

    for name, pair in PAIRS.items():
        yield Model(f"{name}", "bug", None, pair.bug, matrix, (TRAIN_STAGE,))
        yield Model(f"{name}-twin", "twin", None, pair.twin, matrix, (TRAIN_STAGE,))


def models(device: str) -> list[Model]:
    matrix = Matrix(devices=(device,), modes=("autocast", "half"))
    found = [
        *zoo_models(),
        *architecture_models(matrix),
        *silent_bug_models(matrix),
        *training_bug_models(matrix),
    ]
    return [
        Model(m.name, m.group, m.layers, m.factory, for_stages(m, device), m.stages) for m in found
    ]


def for_stages(model: Model, device: str) -> Matrix:
    """The model's matrix on ``device``, with the modes and stages its calibration runs."""
    modes = tuple(dict.fromkeys(mode for stage in model.stages for mode in STAGE_MODES[stage]))
    return model.matrix.replace(devices=(device,), modes=modes, stages=model.stages)


def calibrated(model: Model, stages: tuple[str, ...], cell: Any) -> bool:
    """A cell the calibration runs: of a stage asked for, in that stage's modes."""
    return (
        cell.stage in stages
        and cell.stage in model.stages
        and cell.mode in (*STAGE_MODES[cell.stage], "fp32")
    )


def run_model(model: Model, stages: tuple[str, ...]) -> list[Row]:
    """Every cell of the model the calibration asks for, run as ``check`` runs it (in this
    process)."""
    case = model_case(f"calibrate-{model.name}", model.factory, model.matrix, __file__)
    plan = expand([case])
    rows = [
        Row(model, execute.run_cell(cell))
        for cell in plan.to_run
        if calibrated(model, stages, cell)
    ]
    caches.reset()
    registry._REGISTRY.pop(case.name, None)
    return rows


def shown(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.3g}"


def print_table(rows: list[Row]) -> None:
    print(f"{'model':34} {'group':7} {'stage':7} {'cell':28} {'rel_err':>9} {'rounding':>9} "
          f"{'ratio':>7}  verdict  (leaf)")  # fmt: skip
    for row in rows:
        n = row.judged_leaf
        leaf = f"  ({n.leaf})" if n is not None and n.leaf else ""
        if row.record.error_type:
            leaf = f"  ({row.record.error_type}: {(row.record.error_message or '')[:120]})"
        print(
            f"{row.model.name:34} {row.model.group:7} {row.stage:7} {row.where:28} "
            f"{shown(n.rel_err if n else None):>9} "
            f"{shown(n.rounding_rel_err if n else None):>9} {shown(row.ratio):>7}  "
            f"{outcome_label(row.record)}{leaf}"
        )


def print_markdown(rows: list[Row], stage: str) -> None:
    """One line per model: its ratio in each half-precision cell of ``stage`` and the
    float32 control's (the README's table)."""
    columns = (*(HALF_CELLS if stage == FORWARD_STAGE else TRAIN_CELLS), "float32/fp32")
    by_model: dict[str, dict[str, Row]] = {}
    for row in rows:
        if row.stage == stage:
            by_model.setdefault(row.model.name, {})[row.where.split(" ")[0]] = row
    if not by_model:
        return
    print(f"\n{stage}:\n")
    print("| model | group | layers | " + " | ".join(columns) + " |")
    print("|---|---|---|" + "---:|" * len(columns))
    for name, cells in by_model.items():
        model = next(iter(cells.values())).model
        values = [cell_text(cells.get(key)) for key in columns]
        layers = str(model.layers) if model.layers else "-"
        print(f"| {name} | {model.group} | {layers} | " + " | ".join(values) + " |")


def cell_text(row: Row | None) -> str:
    if row is None:
        return ""
    label = outcome_label(row.record)
    return shown(row.ratio) + ("" if label == "passes" else f" ({label})")


def print_separation(rows: list[Row]) -> None:
    print(f"\nrule: rel_err <= {ROUNDING_FACTOR:g} x rounding (cells of a different trusted "
          "fix aside, a model you check has none)")  # fmt: skip
    for stage in (FORWARD_STAGE, TRAIN_STAGE):
        staged = [r for r in rows if r.stage == stage and r.ratio is not None]
        if not staged:
            continue
        print(f"stage {stage}:")
        print_margins([r for r in staged if r.record.cell.mode != "fp32"], indent="  ")
        for dtype in ("float16", "bfloat16", "float32"):
            cells = [r for r in staged if r.record.cell.dtype == dtype]
            if cells:
                print(f"  {dtype}:")
                print_margins(cells, indent="    ")


def print_margins(rows: list[Row], indent: str = "") -> None:
    """The largest healthy ratio and the smallest ratio of a costly bug among ``rows``, and
    how far each lies from the factor."""
    healthy = [r for r in rows if r.model.group != "bug"]
    costly = [r for r in rows if r.model.group == "bug" and (r.ratio or 0) > BUG_COST]
    worst_healthy = max(healthy, key=lambda r: r.ratio or 0, default=None)
    mildest_bug = min(costly, key=lambda r: r.ratio or 0, default=None)
    if worst_healthy is not None:
        ratio = worst_healthy.ratio or 0
        print(f"{indent}healthy and twin cells: {len(healthy)}, largest ratio {ratio:.3g} "
              f"({worst_healthy.model.name} {worst_healthy.where}); "
              f"margin to the factor {ROUNDING_FACTOR / ratio:.2f}x")  # fmt: skip
    if mildest_bug is not None:
        ratio = mildest_bug.ratio or 0
        print(f"{indent}bug cells costing > {BUG_COST:g}x: {len(costly)}, "
              f"smallest ratio {ratio:.3g} ({mildest_bug.model.name} {mildest_bug.where}); "
              f"margin above the factor {ratio / ROUNDING_FACTOR:.2f}x")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", default="", help="comma-separated model names")
    parser.add_argument("--stage", choices=(FORWARD_STAGE, TRAIN_STAGE, "all"), default="all")
    parser.add_argument("--markdown", action="store_true", help="also the README's tables")
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    stages = (FORWARD_STAGE, TRAIN_STAGE) if args.stage == "all" else (args.stage,)
    chosen = [
        m
        for m in models(args.device)
        if (not args.only or m.name in args.only.split(",")) and set(m.stages) & set(stages)
    ]
    started = time.perf_counter()
    rows = [row for model in chosen for row in run_model(model, stages)]
    print_table(rows)
    if args.markdown:
        for stage in stages:
            print_markdown(rows, stage)
    print_separation(rows)
    wrong = [(r, r.misjudged) for r in rows if r.misjudged]
    for row, why in wrong:
        print(f"MISJUDGED {row.model.name} {row.where}: {why}")
    print(f"{len(rows)} cells of {len(chosen)} models on {args.device}, torch "
          f"{torch.__version__}, in {time.perf_counter() - started:.0f} s; "
          f"{len(wrong)} misjudged")  # fmt: skip
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
