"""The axis table: every list of axes is derived from :class:`Cell`'s fields.

A toy axis is added in one place (one field of a cell type) and shows in the flags, the
selection and its validation, cell ids, the plugin's test ids, ``expect`` keys and a case's
contract check, with nothing else edited.
"""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace
from typing import Any, get_args

import pytest

from harness.cli.options import add_run_options, selection_from
from harness.measure.authoring.registry import unknown_axis_values
from harness.plugin import cell_id, expected_label, parse_expect
from harness.schema import axes
from harness.schema.axes import AXES, AXIS, COLUMN_AXES, MODEL_AXES, Cell, Column, axes_of, axis
from harness.schema.selection import Selection, SelectionError, check_selection


@dataclasses.dataclass(frozen=True, order=True)
class SpicedCell(Cell):
    """A cell type with one more axis, declared by its field alone."""

    flavour: str = axis(
        "flavours",
        vocabulary=("plain", "spicy"),
        default="plain",
        model_default=("plain",),
        flag_help="; plain or spicy",
    )


TOY_AXES = axes_of(SpicedCell)


def spiced(flavour: str, dtype: str = "float16") -> SpicedCell:
    return SpicedCell("toy", "none", "cpu", dtype, "half", "sdpa", flavour=flavour)


def toy_case(**declared: object) -> Any:
    """What validation reads of a case: its name and its values on each axis."""
    values: dict[str, object] = {
        "name": "toy",
        "fixes": {"none": None},
        "devices": ("cpu",),
        "dtypes": ("float16",),
        "modes": ("half", "fp32"),
        "backends": ("sdpa",),
        "compiles": ("eager",),
        "size_names": ("small",),
        "sizes": (),
        "stages": ("forward",),
        "scaler_names": ("none",),
        "flavours": ("plain", "spicy"),
    }
    return SimpleNamespace(**{**values, **declared})


def test_the_table_is_the_cells_fields() -> None:
    assert [a.name for a in AXES] == [f.name for f in dataclasses.fields(Cell)]
    assert [a.name for a in TOY_AXES] == [*(a.name for a in AXES), "flavour"]
    assert [a.name for a in MODEL_AXES] == [
        "device",
        "dtype",
        "mode",
        "backend",
        "compile",
        "stage",
        "scaler",
    ]


def test_a_column_is_made_of_the_column_axes() -> None:
    assert [a.name for a in COLUMN_AXES] == [f.name for f in dataclasses.fields(Column)]


def test_a_toy_axis_shows_in_the_flags() -> None:
    parser = argparse.ArgumentParser()
    add_run_options(parser, TOY_AXES)
    args = parser.parse_args(["--flavour", "spicy", "--dtype", "float16,bfloat16"])
    selection = selection_from(args, TOY_AXES)
    assert selection["flavours"] == ("spicy",)
    assert selection["dtypes"] == ("float16", "bfloat16")
    assert "plain or spicy" in parser.format_help()
    with pytest.raises(SelectionError, match="--flavour was given no name"):
        selection_from(parser.parse_args(["--flavour", ""]), TOY_AXES)


def test_a_toy_axis_shows_in_the_selection() -> None:
    selection = Selection.over(TOY_AXES, {"flavours": ("spicy",)})
    assert selection.selects(spiced("spicy"))
    assert not selection.selects(spiced("plain"))
    assert Selection.over(TOY_AXES, {}).selects(spiced("plain"))
    with pytest.raises(TypeError, match="no axis flavours"):
        Selection(flavours=("spicy",))


def test_a_toy_axis_shows_in_the_validation() -> None:
    with pytest.raises(SelectionError, match="unknown flavour 'spicey'; did you mean spicy"):
        check_selection([toy_case()], Selection.over(TOY_AXES, {"flavours": ("spicey",)}))
    check_selection([toy_case()], Selection.over(TOY_AXES, {"flavours": ("plain",)}))
    assert unknown_axis_values(toy_case(flavours=("bitter",)), TOY_AXES) == [
        "unknown flavour 'bitter' (known: plain, spicy)"
    ]
    assert unknown_axis_values(toy_case(flavours=()), TOY_AXES) == ["flavours is empty"]


def test_a_toy_axis_shows_in_the_cell_ids() -> None:
    assert spiced("spicy").id == "toy[none,cpu,float16,half,sdpa,spicy]"
    # at its default an axis is left out, so the ids of records written before it hold
    assert spiced("plain").id == Cell("toy", "none", "cpu", "float16", "half", "sdpa").id
    old_record = Cell("toy", "none", "cpu", "float16", "half", "sdpa").to_dict()
    assert SpicedCell.from_dict(old_record) == spiced("plain")


def test_a_toy_axis_shows_in_the_plugin_ids_and_expect_keys() -> None:
    cells = [spiced(f, d) for f in ("plain", "spicy") for d in ("float16", "bfloat16")]
    assert [cell_id(c, cells) for c in cells] == [
        "float16-plain",
        "bfloat16-plain",
        "float16-spicy",
        "bfloat16-spicy",
    ]
    expect = parse_expect({"bfloat16/spicy": "raises"}, TOY_AXES)
    assert [expected_label(expect, c) for c in cells] == [None, None, None, "raises"]


def test_the_real_axes_keep_their_ids_and_flags() -> None:
    """The ids every stored record uses, and the flags of ``run``, derived from the table."""
    cell = Cell("dia", "none", "cuda:0", "bfloat16", "autocast", "sdpa", "inductor", "upstream")
    assert cell.id == "dia[none,cuda:0,bfloat16,autocast,sdpa,inductor,size=upstream]"
    assert cell.column.id == "dia[cuda:0,bfloat16,autocast,size=upstream]"
    parser = argparse.ArgumentParser()
    add_run_options(parser, AXES)
    flags = {a.option_strings[0] for a in parser._actions if a.option_strings}
    assert {f"--{a.name}" for a in AXES} <= flags
    expect = parse_expect({"cuda/bfloat16": "passes[drift]"})
    assert expected_label(expect, cell) == "passes[drift]"


def test_each_vocabulary_is_its_literal_type_and_its_named_values_are_in_it() -> None:
    """The tuples, the table's vocabularies and the named constants come from one
    ``Literal`` per axis (mypy checks the values written against it)."""
    assert axes.DTYPES == get_args(axes.Dtype) == AXIS["dtype"].vocabulary
    assert axes.MODE_NAMES == get_args(axes.ModeName) == tuple(axes.MODES)
    assert AXIS["mode"].vocabulary == axes.MODE_NAMES
    assert axes.BACKENDS == get_args(axes.Backend) == AXIS["backend"].vocabulary
    assert axes.COMPILE_MODES == get_args(axes.CompileMode) == AXIS["compile"].vocabulary
    assert axes.SIZES == get_args(axes.SizeName) == AXIS["size"].vocabulary
    # the stages are read from their registry, the built-in ones the Literal names
    assert tuple(axes.STAGES) == get_args(axes.Stage) == tuple(AXIS["stage"].vocabulary)
    assert axes.DEVICE_KINDS == get_args(axes.DeviceKind) == AXIS["device"].vocabulary
    assert set(axes.LOW_PRECISION_DTYPES) < set(axes.DTYPES)
    assert {axes.FORWARD_STAGE, axes.TRAIN_STAGE, axes.FIT_STAGE} == set(axes.STAGES)
    assert {axes.SMALL_SIZE, axes.UPSTREAM_SIZE} == set(axes.SIZES)
    assert axes.EAGER in axes.COMPILE_MODES
    assert set(axes.TIMED_SIZE) == set(axes.DEFAULT_SIZES) == set(axes.DEVICE_KINDS)
    controls = (axes.CONTROL_DTYPE, axes.CONTROL_MODE)
    assert controls == ("float32", "fp32") and axes.CONTROL_MODE in axes.MODES
