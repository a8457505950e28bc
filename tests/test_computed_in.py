"""Which fixes run the computation in half precision, from what a record says the kernels
computed in."""

from __future__ import annotations

import pytest

from harness.results.computed_in import ComputedIn, computed_in, fix_computed_in
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, Outcome
from harness.schema.trail_records import Trail


def record(
    dtype: str = "bfloat16",
    compute: dict[str, tuple[str, ...]] | None = None,
    attn: tuple[str, ...] = (),
    outcome: Outcome = Outcome.PASSES,
) -> CellRecord:
    cell = Cell("c", "f", "cpu", dtype, "half" if dtype != "float32" else "fp32", "sdpa")
    trail = Trail(compute_dtypes=compute) if compute else None
    return CellRecord(cell, "2.13.0", outcome, trail=trail, attn_dtypes=attn)


@pytest.mark.parametrize(
    ("compute", "attn", "expected"),
    [
        ({"matmul": ("bfloat16",), "attention": ("bfloat16",)}, (), ComputedIn.HALF),
        ({"matmul": ("bfloat16",), "attention": ("float32",)}, (), ComputedIn.PARTLY),
        ({"matmul": ("float32",), "attention": ("float32",)}, (), ComputedIn.FALLBACK),
        # the observed attention dtypes count a float32 mask: the trail is preferred
        ({"attention": ("bfloat16",)}, ("bfloat16", "float32"), ComputedIn.HALF),
        (None, ("float32",), ComputedIn.FALLBACK),
        (None, ("bfloat16", "float32"), ComputedIn.PARTLY),
        (None, (), None),  # no trail (--no-trace, or compiled): not known
    ],
)
def test_a_cell_says_what_its_kernels_computed_in(
    compute: dict[str, tuple[str, ...]] | None,
    attn: tuple[str, ...],
    expected: ComputedIn | None,
) -> None:
    assert computed_in(record(compute=compute, attn=attn)) is expected


def test_the_control_and_cells_that_did_not_run_are_not_judged() -> None:
    assert computed_in(record(dtype="float32", compute={"matmul": ("float32",)})) is None
    failed = record(compute={"matmul": ("float32",)}, outcome=Outcome.RAISES)
    assert computed_in(failed) is None


def test_a_fix_is_as_wide_as_its_widest_cell() -> None:
    half, partly, fallback = ComputedIn.HALF, ComputedIn.PARTLY, ComputedIn.FALLBACK
    assert fix_computed_in([half, half, None]) is half
    assert fix_computed_in([half, partly]) is partly
    assert fix_computed_in([half, fallback, partly]) is fallback
    assert fix_computed_in([None, float("nan")]) is None  # pandas' missing values
