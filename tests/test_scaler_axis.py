"""The scaler as an axis: a recipe's loss-scaling policies expand into cells of one fix
(scaled and unscaled training are rows of one column, not twin fixes), selected with
``--scaler``, named in ids and row labels only where a cell does not scale as its mode
does, stored in records (schema 6) and read from older ones."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

import pytest

from harness.cli.options import add_run_options, selection_from
from harness.measure.authoring.case import Case, RunContext, Workload, fix
from harness.measure.authoring.recipes import Recipe
from harness.measure.running.fix_run import context_for
from harness.report.rows import cell_rows
from harness.runner import matrix
from harness.runner.matrix import expand
from harness.schema.axes import AXES, Cell
from harness.schema.records import SCHEMA_VERSION, CellRecord, Outcome
from harness.schema.selection import Selection, SelectionError, check_selection


class BothScalers(Case):
    """A case whose recipe trains scaled and unscaled: each is a cell of its one fix."""

    name = "both-scalers"
    has_known_failure = False
    dtypes = ("float16", "bfloat16")
    modes = ("autocast", "half", "fp32")
    stages = ("forward", "train")
    devices = ("cpu",)
    recipe = Recipe(scalers=("dynamic", "none", "static"))

    @fix("none", rationale="the upstream path")
    def none(self, w: Workload, ctx: RunContext) -> Any:
        return w.model(w.inputs["x"])


def train_cell(dtype: str, mode: str, scaler: str = "", **kw: str) -> Cell:
    return Cell("c", "none", "cpu", dtype, mode, "sdpa", stage="train", scaler=scaler, **kw)


def cells_of(plan: matrix.Plan, stage: str) -> dict[tuple[str, str], list[str]]:
    """Per dtype and mode, the scalers of ``stage``'s cells that run (skipped ones apart)."""
    found: dict[tuple[str, str], list[str]] = {}
    for cell in plan.to_run:
        if cell.stage == stage:
            found.setdefault((cell.dtype, cell.mode), []).append(cell.scaler)
    return found


def test_a_recipes_scalers_are_cells_of_one_fix_where_the_policy_can_train() -> None:
    plan = expand([BothScalers()])
    assert cells_of(plan, "train") == {
        ("float16", "autocast"): ["dynamic", "none", "static"],
        ("bfloat16", "autocast"): ["dynamic", "none", "static"],
        ("float16", "half"): ["dynamic", "none", "static"],  # its scale held by the harness
        ("bfloat16", "half"): ["dynamic", "none", "static"],
        ("float32", "fp32"): ["none"],  # the control trains plain
    }
    forward = cells_of(plan, "forward")
    assert len(forward) == 5 and all(scalers == ["none"] for scalers in forward.values())
    assert plan.skipped == []
    assert BothScalers().scaler_names == ("none", "dynamic", "static")


def test_a_cell_given_no_scaler_scales_as_its_mode_and_only_a_train_cell_scales() -> None:
    assert train_cell("float16", "autocast").scaler == "dynamic"
    assert train_cell("bfloat16", "autocast").scaler == "none"
    assert train_cell("float16", "half").scaler == "dynamic"
    assert train_cell("bfloat16", "half").scaler == "none"
    assert Cell("c", "none", "cpu", "float16", "autocast", "sdpa").scaler == "none"  # forward


def test_the_scaler_shows_in_ids_and_labels_only_where_it_is_not_the_modes() -> None:
    scaled, unscaled = train_cell("float16", "autocast"), train_cell("float16", "autocast", "none")
    assert scaled.id == "c[none,cpu,float16,autocast,sdpa,stage=train]"
    assert unscaled.id == "c[none,cpu,float16,autocast,sdpa,stage=train,scaler=none]"
    # one fix keeps one label across the columns where each trains as its mode does
    assert scaled.row(False) == train_cell("bfloat16", "autocast").row(False) == "none"
    assert unscaled.row(False) == "none (no scaler)"
    assert train_cell("bfloat16", "half", "static", compile="inductor").row(True) == (
        "none [sdpa] (inductor, static scaler)"
    )
    columns = {f.name: [getattr(c, f.name) for c in (scaled, unscaled)] for f in fields(Cell)}
    assert cell_rows(columns)[1] == ["none", "none (no scaler)"]


def test_the_fix_runs_the_cells_scaler() -> None:
    case = BothScalers()
    assert context_for(case, train_cell("float16", "autocast", "none")).scaler == "none"
    assert context_for(case, train_cell("float16", "half", "static")).scaler == "static"
    forward = Cell("c", "none", "cpu", "float16", "autocast", "sdpa")
    assert context_for(case, forward).scaler is None


def test_scaler_selects_and_is_checked_against_what_the_cases_declare() -> None:
    parser = argparse.ArgumentParser()
    add_run_options(parser, AXES)
    selection = selection_from(parser.parse_args(["--scaler", "none"]), AXES)
    plan = expand([BothScalers()], selection)
    assert {c.scaler for c in plan.to_run} == {"none"}
    assert {c.stage for c in plan.to_run} == {"forward", "train"}
    scaled = expand([BothScalers()], selection_from(parser.parse_args(["--scaler", "dynamic"])))
    trained = {c.scaler for c in scaled.to_run if c.scales}
    assert trained == {"dynamic"}  # the cells that scale nothing stay: forwards, the control
    assert {(c.stage, c.mode) for c in scaled.to_run if not c.scales} >= {
        ("forward", "autocast"),
        ("train", "fp32"),
    }
    with pytest.raises(SelectionError, match="unknown scaler 'dynamc'; did you mean dynamic"):
        check_selection([BothScalers()], Selection(scalers=("dynamc",)))


def old_record(case: str, fix: str, dtype: str, mode: str, stage: str) -> dict[str, Any]:
    cell = Cell(case, fix, "cpu", dtype, mode, "eager", stage=stage).to_dict()
    del cell["scaler"]
    return {
        "schema_version": 5,
        **cell,
        "torch_version": "2.13.0",
        "outcome": "passes",
        "out_dtypes": [],
        "attn_dtypes": [],
        "notes": [],
        "settings_changes": [],
    }


@pytest.mark.parametrize(
    ("case", "fix", "dtype", "mode", "stage", "scaler"),
    [
        ("any", "none", "float16", "autocast", "train", "dynamic"),
        ("any", "none", "float16", "autocast", "fit", "dynamic"),
        ("any", "none", "bfloat16", "autocast", "train", "none"),
        ("any", "none", "float16", "autocast", "forward", "none"),
        # half weights trained unscaled then, though they scale as their mode does now
        ("any", "none", "float16", "half", "train", "none"),
        ("any", "none", "float16", "half-autocast", "fit", "none"),
        # the built-in fix that trained unscaled, known by name alone
        ("fp16-no-grad-scaler", "none", "float16", "autocast", "train", "none"),
        ("fp16-no-grad-scaler", "grad-scaler", "float16", "autocast", "train", "dynamic"),
    ],
)
def test_a_schema_5_record_reads_with_the_scaler_it_trained_with(
    case: str, fix: str, dtype: str, mode: str, stage: str, scaler: str
) -> None:
    record = CellRecord.from_dict(old_record(case, fix, dtype, mode, stage))
    assert record.cell.scaler == scaler
    written = record.to_dict()
    assert written["schema_version"] == SCHEMA_VERSION == 6 and written["scaler"] == scaler
    assert CellRecord.from_dict(written) == record


def test_a_record_keeps_a_scaler_that_is_not_the_modes() -> None:
    record = CellRecord(train_cell("float16", "autocast", "none"), "2.13.0", Outcome.PASSES)
    again = CellRecord.from_dict(record.to_dict())
    assert again.cell.scaler == "none" and again.cell.id.endswith(",scaler=none]")
