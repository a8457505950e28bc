"""Calibration of the fit stage's limits: healthy fits and broken ones side by side.

Every fit runs through the harness's own cell runner (``execute.run_cell`` on a ``fit``
cell, as ``check --stage fit`` runs it: :func:`harness.measure.running.fitting.fit` and the
verdict of :func:`harness.measure.running.fitting.stall_reason`) and the script prints, per model x
recipe x cell, the two figures the verdict reads: the **shortfall** (the share of the
float64 fit's progress the last loss falls short of) and the **lost** share (of the updates
the optimizer computed, what the weights' rounding dropped), with the GradScaler's skipped
steps and the harness's verdict. Each fit is labelled by what was built, not by the verdict:

* **healthy**: the feed-forward block of ``cases/bf16_pure_weights.py`` and small real
  architectures of ``zoo/architectures.py`` (a post-LayerNorm BERT encoder 2 layers deep;
  with ``--all`` a pre-norm Llama decoder and Mistral 2 layers deep and BART 2+2; with
  ``--deep`` BERT and Llama 48 layers deep), fitted at lr 1e-3 with the recipe of each
  mode: float16 and bfloat16 under autocast (float16 with a GradScaler), bfloat16 weights
  (``half``, ``half-autocast``: AdamW's steps of 1e-3 still round away on LayerNorm's unit
  weights) and the float32 control; bfloat16 weights at lr 1e-4 with float32 master
  weights; pure bfloat16 weights at lr 1e-4 on the architectures, whose weights (std 0.02)
  are mostly below 2**-5 (0.031), from which a bfloat16 weight drops a step of 1e-4; the
  two-headed model of ``cases/fp16_no_grad_scaler.py`` under float16 autocast with a
  GradScaler, and a loss a million times smaller with one; float32 master weights at lr
  1e-5 with the loss computed in bfloat16 (a user's loss may be: its rounding alone costs
  a slow fit's shortfall up to a third of its progress, the **round** column);
* **broken**: pure bfloat16 weights stepped by AdamW where most weights are above 256
  times the step (a step below half a bfloat16 ulp, 2**-9 of the weight or more, is
  lost): the case ``bf16-pure-weights`` (lr 1e-4 on weights of about 0.1), the
  architectures at lr 1e-5 (with ``--all`` also 3e-5; fine-tuning rates), the loss in
  float32 or in bfloat16; pure float16 weights stepped by AdamW at lr 1e-3 (its ``eps`` of
  1e-8 is zero in float16: a gradient that is zero, or whose square underflows, makes the
  update 0/0 or x/0); float16 autocast without a GradScaler on a loss so small (x1e-6: a
  sum divided by the many tokens or micro-batches it covers) that its gradients flush to
  zero;
* **unseen**: the case ``fp16-no-grad-scaler`` itself (an auxiliary loss term weighted 1e-4
  whose gradients underflow without a GradScaler): its fit loses 1e-4 of the loss's
  progress at most, which no limit on the curve can see; the ``train`` stage judges it
  (its gradients against float64). Shown, not scored.

The limits must separate the groups: every healthy fit passes, every broken one stalls.
The script prints the table (with **round**: the shortfall that rounding the last loss to
the cell's dtype alone can cost, where the loss is computed in it), per dtype the healthy
maximum and the broken minimum of each figure and their margins to the limits, and exits
non-zero if a fit is misjudged.

    python benchmarks/bench_fit.py [--all] [--deep] [--only NAME,...] [--steps N] [--markdown]
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from cases.bf16_pure_weights import SMALL as BLOCK_DIMS  # noqa: E402
from cases.bf16_pure_weights import Block, MasterWeightsAdamW  # noqa: E402
from cases.fp16_no_grad_scaler import AUX_WEIGHT, TwoHeads  # noqa: E402
from cases.fp16_no_grad_scaler import SMALL as HEADS_DIMS  # noqa: E402
from harness.measure import execute  # noqa: E402
from harness.measure.authoring import registry  # noqa: E402
from harness.measure.authoring.case import Case, OptimizerFactory, RunContext, Workload, fix  # noqa: E402
from harness.measure.authoring.losses import TARGET_SEED  # noqa: E402
from harness.measure.authoring.model_case import Matrix, call_model, model_case  # noqa: E402
from harness.measure.host import caches  # noqa: E402
from harness.measure.precision.dtypes import dtype_of  # noqa: E402
from harness.measure.running import fitting  # noqa: E402
from harness.measure.running.fitting import EXCESS_LIMIT, SHORTFALL_LIMIT  # noqa: E402
from harness.runner.matrix import expand  # noqa: E402
from harness.schema.axes import FIT_STAGE  # noqa: E402
from harness.schema.records import CellRecord, FitFigures, Outcome, outcome_label  # noqa: E402
from harness.schema.selection import Selection  # noqa: E402

HEALTHY, BROKEN, UNSEEN, BETWEEN = "healthy", "broken", "unseen", "between"
#: The cells of a recipe, as dtype/mode.
AUTOCAST = ("float16/autocast", "bfloat16/autocast")
BF16_WEIGHTS = ("bfloat16/half", "bfloat16/half-autocast")
FP16_WEIGHTS = ("float16/half", "float16/half-autocast")
CONTROL = ("float32/fp32",)
#: The README table's columns.
CELLS = (*AUTOCAST, *BF16_WEIGHTS, *FP16_WEIGHTS, *CONTROL)
DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class Recipe:
    """How a model is fitted: the learning rate, whether float16 autocast scales its loss,
    the optimizer (None: the fit's AdamW), and a factor on the model's loss."""

    name: str
    lr: float
    grad_scaler: bool = True
    optimizer: OptimizerFactory | None = None
    loss_scale: float = 1.0
    #: The loss computed in the output's own dtype (as a user's loss or a model's own may
    #: be), not in float32 as the harness's default loss is.
    loss_in_dtype: bool = False


LR_1E3 = Recipe("adamw lr 1e-3", 1e-3)
LR_1E4 = Recipe("adamw lr 1e-4", 1e-4)
MASTER_1E4 = Recipe("fp32 master lr 1e-4", 1e-4, optimizer=MasterWeightsAdamW)
LR_3E5 = Recipe("adamw lr 3e-5", 3e-5)
LR_1E5 = Recipe("adamw lr 1e-5", 1e-5)
MASTER_1E5 = Recipe("fp32 master lr 1e-5", 1e-5, optimizer=MasterWeightsAdamW)
NO_SCALER = Recipe("no GradScaler", 1e-3, grad_scaler=False)
#: A loss this small (a sum over many tokens divided by their count, a loss divided by the
#: micro-batches it accumulates over) has gradients below float16's range.
TINY_LOSS = 1e-6
NO_SCALER_TINY = Recipe("no GradScaler, loss x1e-6", 1e-3, grad_scaler=False,
                        loss_scale=TINY_LOSS)  # fmt: skip
SCALER_TINY = Recipe("GradScaler, loss x1e-6", 1e-3, loss_scale=TINY_LOSS)
MASTER_1E5_LOSS_IN_DTYPE = Recipe("fp32 master lr 1e-5, loss bf16", 1e-5,
                                  optimizer=MasterWeightsAdamW, loss_in_dtype=True)  # fmt: skip
LR_1E5_LOSS_IN_DTYPE = Recipe("adamw lr 1e-5, loss bf16", 1e-5, loss_in_dtype=True)


Model = tuple[str, int, Callable[..., Any]]


@dataclass(frozen=True)
class Fit:
    """One model fitted with one recipe in some cells, each labelled healthy, broken or
    unseen by construction."""

    model: str
    layers: int
    factory: Callable[..., Any]
    recipe: Recipe
    groups: dict[str, str]  # dtype/mode -> group
    #: The model's loss ``f(output, inputs)``, where it is not the harness's default.
    loss: Callable[[Any, dict[str, Any]], torch.Tensor] | None = None

    @property
    def name(self) -> str:
        return f"{self.model} [{self.recipe.name}]"


@dataclass(frozen=True)
class Row:
    fit: Fit
    record: CellRecord

    @property
    def where(self) -> str:
        return f"{self.record.cell.dtype}/{self.record.cell.mode}"

    @property
    def group(self) -> str:
        return self.fit.groups[self.where]

    @property
    def figures(self) -> FitFigures | None:
        return self.record.fit

    def measure(self, name: str) -> float:
        """One of the figures the verdict reads (inf where the loss is not finite or there
        is none): ``short``, the excess of the last loss over the float64 fit's as a share
        of that fit's progress; ``beyond``, as a share of its last loss; ``lost``, the share
        of the updates lost (evidence, no limit)."""
        f = self.figures
        if f is None or not math.isfinite(f.losses[-1]):
            return math.inf
        if name == "lost":
            return f.lost_share
        first, last = f.reference_losses[0], f.reference_losses[-1]
        scale = first - last if name == "short" else abs(last)
        return max(0.0, f.losses[-1] - last) / scale if scale > 0 else math.inf

    @property
    def loss_rounding(self) -> float | None:
        """The shortfall that rounding the last loss alone can cost, where every loss of the
        fit is a value of the cell's dtype (the loss computed in it: a half-precision
        model's mean squared error): half a unit in the last place of the last loss over
        the float64 fit's progress. None where the losses are wider or not finite."""
        f = self.figures
        if f is None or not all(math.isfinite(v) for v in f.losses):
            return None
        dtype = dtype_of(self.record.cell.dtype)
        if any(float(torch.tensor(v, dtype=torch.float64).to(dtype)) != v for v in f.losses):
            return None
        progress = f.reference_losses[0] - f.reference_losses[-1]
        last = abs(f.losses[-1])
        if progress <= 0 or last == 0:
            return None
        ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(last))
        return ulp / 2 / progress

    @property
    def stalled(self) -> bool:
        return self.record.outcome is not Outcome.PASSES

    @property
    def misjudged(self) -> str | None:
        """Why the harness's verdict is wrong for the fit's group, or None."""
        label = outcome_label(self.record)
        if self.group == HEALTHY and self.stalled:
            return f"healthy fit reads {label}"
        if self.group == BROKEN and not self.stalled:
            return f"broken fit reads {label}"
        return None


def block() -> tuple[Any, ...]:
    """The feed-forward block of bf16-pure-weights (a LayerNorm between two Linears)."""
    return Block(BLOCK_DIMS), {"x": torch.randn(BLOCK_DIMS.batch, BLOCK_DIMS.width)}


def two_heads() -> tuple[Any, ...]:
    """The two-headed model of fp16-no-grad-scaler, its loss the main head's error plus the
    auxiliary head's weighted 1e-4."""
    x = torch.randn(HEADS_DIMS.batch, HEADS_DIMS.width)
    targets = [torch.randn(HEADS_DIMS.batch, HEADS_DIMS.classes) for _ in range(2)]
    return TwoHeads(HEADS_DIMS), {"x": x, "main": targets[0], "aux": targets[1]}, heads


def heads(model: Any, inputs: dict[str, Any]) -> Any:
    return model(inputs["x"])


def heads_loss(output: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """fp16-no-grad-scaler's loss: the main head's error and the auxiliary head's, 1e-4."""
    main = F.mse_loss(output["main"], inputs["main"].to(output["main"].dtype))
    return main + AUX_WEIGHT * F.mse_loss(output["aux"], inputs["aux"].to(output["aux"].dtype))


def loss_in_dtype(output: Any) -> torch.Tensor:
    """The harness's default loss (the mean squared error against its fixed random
    target), computed in the output's dtype."""
    generator = torch.Generator().manual_seed(TARGET_SEED)
    leaf = output if isinstance(output, torch.Tensor) else output[0]
    target = torch.randn(leaf.shape, generator=generator, dtype=torch.float64)
    return F.mse_loss(leaf, target.to(leaf.dtype))


def architecture(name: str, layers: int) -> Callable[[], tuple[Any, ...]]:
    """A zoo architecture's factory (transformers is imported when it builds, so
    ``--only`` the other models runs without it)."""

    def build() -> tuple[Any, ...]:
        from zoo import architectures

        builders: dict[str, Callable[[int], tuple[Any, ...]]] = {
            "bert": architectures.bert,
            "llama": architectures.llama,
        }
        return builders[name](layers)

    return build


def named_architecture(name: str) -> Callable[[], tuple[Any, ...]]:
    from zoo.architectures import ARCHITECTURES

    return ARCHITECTURES[name][0]


def teacher(weights: float) -> Callable[[], tuple[Any, ...]]:
    """A linear regression a fit takes far: the student's weights of std ``weights``, the
    teacher's each 0.01 away from them (20 AdamW steps of lr 1e-3 move a weight at most
    0.02), so the float64 fit ends near zero (0.0045 from 0.0065 at 64 wide). From 0.25 on
    most weights' bfloat16 ulp (2**-9 and up) is above twice a step of 1e-3: pure bfloat16
    weights lose the steps that take the fit its last way."""

    def build() -> tuple[Any, ...]:
        width, outputs = 64, 16
        student = torch.nn.Linear(width, outputs, bias=False)
        with torch.no_grad():
            student.weight.copy_(torch.randn(outputs, width) * weights)
            target = student.weight + 0.01 * torch.sign(torch.randn(outputs, width))
        x = torch.randn(256, width)
        return student, {"x": x, "y": x @ target.T}, regressed

    return build


def regressed(model: Any, inputs: dict[str, Any]) -> Any:
    return model(inputs["x"])


def regression_loss(output: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """The squared error against the teacher's outputs, in float32 (float64 in the
    reference)."""
    dtype = torch.promote_types(output.dtype, torch.float32)
    return F.mse_loss(output.to(dtype), inputs["y"].to(dtype))


def attention(width: int) -> Callable[[], tuple[Any, ...]]:
    """One ``nn.TransformerEncoderLayer`` (self-attention and a feed-forward, post-norm),
    ``width`` wide with 4 heads, on 8 sequences of 16 tokens."""

    def build() -> tuple[Any, ...]:
        layer = torch.nn.TransformerEncoderLayer(
            width, 4, 2 * width, dropout=0.0, batch_first=True
        )
        return layer, {"src": torch.randn(8, 16, width)}

    return build


LR_5E4 = Recipe("adamw lr 5e-4", 5e-4)
LR_2E4 = Recipe("adamw lr 2e-4", 2e-4)


def far_fits() -> Iterator[Fit]:
    """Fits judged by where they end: a regression the float64 fit takes near zero, in
    pure bfloat16 at lr 1e-3 (broken where its weights are large: its last loss 5 times
    float64's, 0.6% short of its progress) beside bfloat16 autocast (healthy: float32
    weights; what it ends beyond float64 its compute's rounding costs); attention layers
    in bfloat16 at 1e-3 and 5e-4 (healthy), 2e-4 (between: a third of the updates lost,
    the loss within 2% of float64's) and 1e-4 (broken: stalled)."""
    both = {**broken("bfloat16/half"), **healthy("bfloat16/autocast", "float16/autocast")}
    yield Fit("teacher-0.5", 1, teacher(0.5), LR_1E3, both, regression_loss)
    yield Fit("teacher-0.25", 1, teacher(0.25), LR_1E3,
              {**dict.fromkeys(["bfloat16/half"], BETWEEN), **healthy("bfloat16/autocast")},
              regression_loss)  # fmt: skip
    yield Fit("teacher-0.1", 1, teacher(0.1), LR_1E3,
              healthy("bfloat16/half", "bfloat16/autocast"), regression_loss)  # fmt: skip
    for width in (64, 128):
        name = f"attention-{width}"
        yield Fit(name, 1, attention(width), LR_1E3,
                  healthy("bfloat16/half", "bfloat16/autocast", "float16/autocast"))  # fmt: skip
        yield Fit(name, 1, attention(width), LR_5E4, healthy("bfloat16/half"))
        yield Fit(name, 1, attention(width), LR_2E4, dict.fromkeys(["bfloat16/half"], BETWEEN))
        yield Fit(name, 1, attention(width), LR_1E4, broken("bfloat16/half"))


def healthy(*cells: str) -> dict[str, str]:
    return dict.fromkeys(cells, HEALTHY)


def broken(*cells: str) -> dict[str, str]:
    return dict.fromkeys(cells, BROKEN)


def fits(everything: bool, deep: bool) -> Iterator[Fit]:
    """The default set (a couple of minutes on two cores), or with ``everything`` the
    README's (more architectures, and a learning rate between healthy and broken), with
    ``deep`` the 48-layer models too."""
    everyday = {**healthy(*AUTOCAST, *BF16_WEIGHTS, *CONTROL), **broken(*FP16_WEIGHTS)}
    block_fit: Model = ("block", 1, block)
    bert: Model = ("bert-2l", 2, architecture("bert", 2))
    llama: Model = ("llama-2l", 2, architecture("llama", 2))
    more = [llama] if everything else []
    fitted = [block_fit, bert, *more]
    if everything:
        fitted += [("mistral-2l", 2, named_architecture("mistral-2l")),
                   ("bart-4l", 4, named_architecture("bart-4l"))]  # fmt: skip
    for model in fitted:
        yield Fit(*model, LR_1E3, everyday)
    if deep:  # the cells where depth could cost: the GradScaler's, bfloat16 weights
        for layers in (48,):
            for name in ("bert", "llama"):
                deep_cells = healthy("float16/autocast", "bfloat16/half")
                yield Fit(f"{name}-{layers}l", layers, architecture(name, layers), LR_1E3,
                          deep_cells)  # fmt: skip
    yield Fit(*block_fit, LR_1E4, broken("bfloat16/half"))
    yield Fit(*block_fit, MASTER_1E4, healthy("bfloat16/half"))
    for model in [bert, llama]:
        yield Fit(*model, LR_1E4, healthy("bfloat16/half"))
        if everything:
            yield Fit(*model, LR_3E5, broken("bfloat16/half"))
        yield Fit(*model, LR_1E5, broken("bfloat16/half"))
        yield Fit(*model, MASTER_1E5, healthy("bfloat16/half"))
        if everything or model is llama:
            yield Fit(*model, MASTER_1E5_LOSS_IN_DTYPE, healthy("bfloat16/half"))
            yield Fit(*model, LR_1E5_LOSS_IN_DTYPE, broken("bfloat16/half"))
    yield Fit("two-heads", 2, two_heads, LR_1E3, healthy("float16/autocast"), heads_loss)
    yield Fit("two-heads", 2, two_heads, NO_SCALER, dict.fromkeys(["float16/autocast"], UNSEEN),
              heads_loss)  # fmt: skip
    yield from far_fits()
    for model in [block_fit, *more]:
        yield Fit(*model, NO_SCALER_TINY, broken("float16/autocast"))
        yield Fit(*model, SCALER_TINY, healthy("float16/autocast"))


def recipe_case(fit: Fit) -> Case:
    """A model case for the fit: the model as it is, fitted with the recipe."""
    cells = fit.groups
    matrix = Matrix(
        devices=("cpu",),
        dtypes=tuple(dict.fromkeys(c.split("/")[0] for c in cells if c not in CONTROL)),
        modes=tuple(dict.fromkeys(c.split("/")[1] for c in cells if c not in CONTROL)),
        backends=("sdpa",),
        stages=(FIT_STAGE,),
    )
    name = re.sub(r"[^a-z0-9]+", "-", f"calibrate-fit-{fit.name}".lower()).strip("-")
    base = type(model_case(name, fit.factory, matrix, __file__))
    registry._REGISTRY.pop(base.name, None)
    recipe = fit.recipe
    loss_of = fit.loss

    class Fitted(base):  # type: ignore[valid-type, misc]
        fit_lr = recipe.lr

        def loss(self, output: Any, workload: Workload, ctx: RunContext) -> Any:
            if loss_of is not None:
                loss = loss_of(output, workload.inputs)
            elif recipe.loss_in_dtype:
                loss = loss_in_dtype(output)
            else:
                loss = super().loss(output, workload, ctx)
            return loss * recipe.loss_scale if recipe.loss_scale != 1.0 else loss

        @fix("none", rationale=recipe.name, grad_scaler=recipe.grad_scaler,
             optimizer=recipe.optimizer)  # fmt: skip
        def none(self, w: Workload, ctx: RunContext) -> Any:
            return call_model(w.model, w.inputs)

    return registry.add_model_case(Fitted())


def run_fit(fit: Fit) -> list[Row]:
    """The fit's cells, run as ``check --stage fit`` runs them (in this process)."""
    case = recipe_case(fit)
    plan = expand([case], Selection(stages=(FIT_STAGE,)))
    cells = [
        c for c in plan.to_run if c.stage == FIT_STAGE and f"{c.dtype}/{c.mode}" in fit.groups
    ]
    rows = [Row(fit, execute.run_cell(cell)) for cell in cells]
    caches.reset()
    registry._REGISTRY.pop(case.name, None)
    return rows


def shown(value: float | None, percent: bool = False) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    if math.isnan(value):
        return "nan"
    return f"{value:.1%}" if percent else f"{value:.3g}"


def print_table(rows: list[Row]) -> None:
    print(f"{'model':12} {'recipe':30} {'cell':22} {'group':8} {'short':>7} {'beyond':>7} "
          f"{'round':>6} {'lost':>6} {'skip':>4}  verdict")  # fmt: skip
    for row in rows:
        f = row.figures
        print(
            f"{row.fit.model:12} {row.fit.recipe.name:30} {row.where:22} {row.group:8} "
            f"{shown(row.measure('short'), True):>7} "
            f"{shown(row.measure('beyond'), True):>7} "
            f"{shown(row.loss_rounding, True):>6} "
            f"{shown(f.lost_share if f else None, True):>6} "
            f"{f.skipped_steps if f else '-':>4}  {verdict(row)}"
        )


def verdict(row: Row) -> str:
    label = outcome_label(row.record)
    notes = [n.text for n in row.record.notes if "stall" in n.text or "not finite" in n.text]
    return label + (f": {notes[0]}" if notes and row.stalled else "")


def print_markdown(rows: list[Row]) -> None:
    """One line per model and recipe: each cell's shortfall / lost share (the README's
    table); a fit broken by construction in bold, one the fit cannot see in italics, and
    ``stalls`` where the harness judged it so."""
    print("| model | layers | recipe | " + " | ".join(CELLS) + " |")
    print("|---|---:|---|" + "---:|" * len(CELLS))
    by_fit: dict[str, dict[str, Row]] = {}
    for row in rows:
        by_fit.setdefault(row.fit.name, {})[row.where] = row
    for cells in by_fit.values():
        fit = next(iter(cells.values())).fit
        values = [markdown_cell(cells.get(cell)) for cell in CELLS]
        print(f"| {fit.model} | {fit.layers} | {fit.recipe.name} | " + " | ".join(values) + " |")


def markdown_cell(row: Row | None) -> str:
    if row is None:
        return ""
    f = row.figures
    text = " / ".join(
        shown(value, True)
        for value in (row.measure("short"), row.measure("beyond"), f.lost_share if f else None)
    )
    text += " stalls" if row.stalled else ""
    return {BROKEN: f"**{text}**", UNSEEN: f"*{text}*", BETWEEN: f"*{text}*"}.get(row.group, text)


def print_margins(rows: list[Row]) -> None:
    """Per dtype, each limited figure's healthy maximum and broken minimum, and the
    margins to its limit (a fit stalls where either is beyond its limit); the share of the
    updates lost, evidence with no limit, beside them."""
    limits = {"short": SHORTFALL_LIMIT, "beyond": EXCESS_LIMIT}
    print(f"\nlimits: a fit stalls where its last loss ends beyond the float64 fit's by more "
          f"than {SHORTFALL_LIMIT:.0%} of its progress (short) or {EXCESS_LIMIT:.0%} of its "
          "last loss (beyond); the updates lost are evidence")  # fmt: skip
    for dtype in DTYPES:
        cells = [r for r in rows if r.record.cell.dtype == dtype and r.figures is not None]
        if not cells:
            continue
        print(f"{dtype}:")
        for name, limit in limits.items():
            print_figure(cells, name, limit)
        print_figure(cells, "lost", None)
        print_rounding(cells)


def print_rounding(rows: list[Row]) -> None:
    """The largest shortfall that rounding a healthy fit's last loss to its dtype alone
    could cost: below it, the shortfall cannot tell a healthy fit from a short one."""
    rounded = [r for r in rows if r.group == HEALTHY and r.loss_rounding is not None]
    worst = max(rounded, key=lambda r: r.loss_rounding or 0.0, default=None)
    if worst is not None:
        where = f"{worst.fit.model} {worst.fit.recipe.name} {worst.where}"
        print(f"  the last loss's rounding alone: up to {worst.loss_rounding:.1%} of a "
              f"healthy fit's progress ({where})")  # fmt: skip


def print_figure(rows: list[Row], name: str, limit: float | None) -> None:
    """The healthy maximum of a figure and, where it has a limit, the margin to it and the
    mildest broken fit it catches (without one: the broken minimum)."""
    healthy_rows = [r for r in rows if r.group == HEALTHY and r.measure(name) != math.inf]
    worst = max(healthy_rows, key=lambda r: r.measure(name), default=None)
    text = f"  {name:7}"
    if worst is not None:
        value = worst.measure(name)
        where = f"{worst.fit.model} {worst.fit.recipe.name} {worst.where}"
        text += f" healthy max {value:6.1%} ({where})"
        if limit is not None:
            margin = f"{limit / value:.2f}x" if value > limit / 1000 else "> 1000x"
            text += f", margin {margin}"
        text += ";"
    bound = limit if limit is not None else -1.0
    caught = [r for r in rows if r.group == BROKEN and bound < r.measure(name) < math.inf]
    mildest = min(caught, key=lambda r: r.measure(name), default=None)
    if mildest is not None:
        value = mildest.measure(name)
        where = f"{mildest.fit.model} {mildest.fit.recipe.name} {mildest.where}"
        if limit is None:
            text += f" broken min {value:6.1%} ({where})"
        else:
            text += (f" broken min {value:6.1%} over the {len(caught)} it catches ({where}), "
                     f"margin {value / limit:.2f}x")  # fmt: skip
    print(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated model names")
    parser.add_argument("--all", action="store_true",
                        help="also Llama, Mistral, BART; lr 3e-5 in pure bfloat16")  # fmt: skip
    parser.add_argument("--deep", action="store_true", help="also BERT and Llama 48 layers")
    parser.add_argument("--steps", type=int, default=fitting.fit_steps())
    parser.add_argument("--markdown", action="store_true", help="also the README's table")
    args = parser.parse_args()
    fitting.use_steps(args.steps)
    chosen = [
        f for f in fits(args.all, args.deep) if not args.only or f.model in args.only.split(",")
    ]
    started = time.perf_counter()
    rows = []
    for fit in chosen:
        began = time.perf_counter()
        rows += run_fit(fit)
        print(f"{fit.name}: {time.perf_counter() - began:.1f} s", file=sys.stderr)
    print_table(rows)
    if args.markdown:
        print()
        print_markdown(rows)
    print_margins(rows)
    wrong = [(r, r.misjudged) for r in rows if r.misjudged]
    for row, why in wrong:
        print(f"MISJUDGED {row.fit.name} {row.where}: {why}")
    print(f"{len(rows)} fits of {args.steps} steps ({len(chosen)} model x recipe) on cpu, "
          f"torch {torch.__version__}, in {time.perf_counter() - started:.0f} s; "
          f"{len(wrong)} misjudged")  # fmt: skip
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
