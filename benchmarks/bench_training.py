"""Calibration of the train and fit stages on the realistic training families: each healthy
model beside its buggy twin, each cell's verdict beside its truth.

Every family of ``zoo/training_realistic.py`` (training code written as people write it:
stochastic depth drawn with ``torch.rand``, dropout, top-2 routing, checkpointing, long
sums, a wide vocabulary head, sparse embeddings, weight tying, RoPE, a loss over many
tokens) is a healthy model and a buggy twin. Each twin's cells run as ``check`` runs them
(``zoo/training_table.py``: a case of the model trained by its own recipe, its cells run in
this process), and each cell's truth is measured with plain torch (``zoo/training_truth.py``:
each twin's error against a float64 step taken on the cell's draws and choices, and what the
bug costs over the healthy model, leaf by leaf). What a cell must read follows from its
truth alone (``healthy_expected``, ``bug_cell_expected``): a healthy model passes unless a
torch kernel it calls costs more on its own than the bar a bug is held to; a bug that costs
more than ten times its healthy twin does not pass, one that costs less than twice it
passes, and between the two either verdict is right.

The script prints, per family x twin x stage x cell, the verdict, the cell's error over its
tolerance (the **ratio**: below 1 passes; for a fit, the last loss's shortfall over its
limit), the truth, what the cell must read and whether it is misjudged; then per stage the
margins: the largest ratio of a healthy cell that must pass, and the smallest of a cell
that must not; and exits non-zero if a cell is misjudged.

    python benchmarks/bench_training.py [--family NAME ...] [--markdown]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from harness.schema.records import CellRecord, Outcome, outcome_label  # noqa: E402
from zoo.training_realistic import FAMILIES  # noqa: E402
from zoo.training_table import (  # noqa: E402
    CELLS,
    CellTruth,
    bug_cell_expected,
    cell_truth,
    check_cell,
    healthy_expected,
    misjudged,
    twin_name,
)
from zoo.training_table import shown as cost_text  # noqa: E402


@dataclass(frozen=True)
class Row:
    """One twin's cell: its record, its truth and what it must read."""

    family: str
    healthy: bool
    stage: str
    dtype: str
    mode: str
    record: CellRecord
    truth: CellTruth
    expected: str

    @property
    def where(self) -> str:
        return f"{self.dtype}/{self.mode}"

    @property
    def twin(self) -> str:
        return twin_name(self.healthy)

    @property
    def ratio(self) -> float | None:
        """The cell's error over its tolerance, where the verdict was decided by them."""
        if self.record.numerics is None:
            return None
        if self.record.outcome not in (Outcome.PASSES, Outcome.INACCURATE):
            return None
        numerics = self.record.numerics
        if not numerics.finite:
            return math.inf
        return numerics.rel_err / numerics.tolerance if numerics.tolerance > 0 else math.inf

    @property
    def verdict(self) -> str:
        return outcome_label(self.record)

    @property
    def truth_text(self) -> str:
        """The twin's error against float64, and for a bug what it costs over its twin."""
        t = self.truth
        if self.healthy:
            return f"{t.healthy:.2e}"
        return f"{t.bug:.2e}, cost {cost_text(t.cost)} ({t.leaf})"

    @property
    def misjudged(self) -> str | None:
        return misjudged(self.expected, self.record)


def family_rows(family: str) -> Iterator[Row]:
    """Both twins' cells of ``family``, in every stage it is checked at."""
    for stage in FAMILIES[family].stages:
        for dtype, mode in CELLS:
            truth = cell_truth(family, dtype, mode)
            yield Row(family, True, stage, dtype, mode,
                      check_cell(family, True, stage, dtype, mode), truth,
                      healthy_expected(family, dtype))  # fmt: skip
            yield Row(family, False, stage, dtype, mode,
                      check_cell(family, False, stage, dtype, mode), truth,
                      bug_cell_expected(family, stage, dtype, mode))  # fmt: skip


def shown(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.3g}"


def print_row(row: Row) -> None:
    after = "  MISJUDGED" if row.misjudged else ""
    print(f"{row.family:26} {row.twin:7} {row.stage:5} {row.where:17} {shown(row.ratio):>7}  "
          f"{row.verdict:24} {row.truth_text:48} {row.expected:11}{after}")  # fmt: skip
    sys.stdout.flush()


def print_header() -> None:
    print(f"{'family':26} {'twin':7} {'stage':5} {'cell':17} {'ratio':>7}  {'verdict':24} "
          f"{'truth: error vs float64 (bug: cost over its twin)':48} must read")  # fmt: skip


def print_markdown(rows: list[Row]) -> None:
    """One line per family, twin and stage: each cell's ratio, its verdict where it is not
    a plain pass, and a bug's cost over its twin (the docs' table); a misjudged cell in
    bold, a cell that must not pass in italics."""
    columns = [f"{dtype}/{mode}" for dtype, mode in CELLS]
    lines: dict[tuple[str, str, str], dict[str, str]] = {}
    for row in rows:
        lines.setdefault((row.family, row.twin, row.stage), {})[row.where] = markdown_cell(row)
    print("| family | twin | stage | " + " | ".join(columns) + " |")
    print("|---|---|---|" + "---:|" * len(columns))
    for (family, twin, stage), cells in lines.items():
        values = [cells.get(column, "") for column in columns]
        print(f"| {family} | {twin} | {stage} | " + " | ".join(values) + " |")


def markdown_cell(row: Row) -> str:
    text = shown(row.ratio)
    if row.verdict != "passes":
        text += f" ({row.verdict})"
    if not row.healthy:
        text += f"; cost {cost_text(row.truth.cost)}"
    if row.misjudged:
        return f"**{text}**"
    return f"*{text}*" if row.expected == "not passes" else text


def print_margins(rows: list[Row]) -> None:
    """Per stage: the largest ratio of a healthy cell that must pass, the largest of a bug
    that must pass (it costs less than twice its twin), and the smallest ratio of a cell
    that must not pass; each with its margin to the tolerance (ratio 1)."""
    for stage in dict.fromkeys(row.stage for row in rows):
        staged = [r for r in rows if r.stage == stage and r.record is not None]
        print(f"stage {stage}:")
        for healthy in (True, False):
            group = [r for r in staged if r.expected == "passes" and r.healthy is healthy]
            print_extreme(f"{twin_name(healthy)} cells that must pass", group, must_pass=True)
        must_fail = [r for r in staged if r.expected == "not passes"]
        print_extreme("cells that must not pass", must_fail, must_pass=False)


def print_extreme(name: str, group: list[Row], must_pass: bool) -> None:
    """The ratio of ``group`` nearest the wrong side (the largest where the cells must
    pass, the smallest where they must not) and its margin; where that cell is misjudged,
    also the nearest among the cells judged right, the margin the rule keeps elsewhere."""
    if not group:
        return
    extreme = nearest_wrong_side(group, must_pass)
    print(f"  {name}: {len(group)}, {extreme_text(extreme, must_pass)}")
    right = [r for r in group if not r.misjudged]
    if extreme.misjudged and right:
        print(f"    judged right: {extreme_text(nearest_wrong_side(right, must_pass), must_pass)}")


def nearest_wrong_side(group: list[Row], must_pass: bool) -> Row:
    pick = max if must_pass else min
    return pick(group, key=lambda r: r.ratio or 0.0)


def extreme_text(row: Row, must_pass: bool) -> str:
    ratio = row.ratio or 0.0
    where = f"({row.family} {row.twin} {row.where})"
    if must_pass:
        margin = 1 / ratio if ratio > 0 else math.inf
        return (
            f"largest ratio {shown(row.ratio)} {where}; margin to the tolerance {shown(margin)}x"
        )
    return f"smallest ratio {shown(row.ratio)} {where}; margin above the tolerance {shown(ratio)}x"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=sorted(FAMILIES))
    parser.add_argument("--markdown", action="store_true", help="also the docs' table")
    args = parser.parse_args()
    families = args.family or list(FAMILIES)
    started = time.perf_counter()
    print_header()
    rows = []
    for family in families:
        for row in family_rows(family):
            print_row(row)
            rows.append(row)
    if args.markdown:
        print()
        print_markdown(rows)
    print()
    print_margins(rows)
    wrong = [r for r in rows if r.misjudged]
    for row in wrong:
        print(f"MISJUDGED {row.family} {row.twin} {row.stage} {row.where}: {row.misjudged}")
    print(f"{len(rows)} cells of {len(families)} families on the CPU, torch "
          f"{torch.__version__}, in {time.perf_counter() - started:.0f} s; "
          f"{len(wrong)} misjudged")  # fmt: skip
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
