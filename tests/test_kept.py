"""Which fixes keep the computation in half precision, from what a record says the kernels
computed in."""

from __future__ import annotations

import pytest

from harness.results.kept import Kept, fix_kept, kept
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, Outcome
from harness.schema.trail_records import Trail


def record(
    dtype: str = "bfloat16",
    compute: dict[str, tuple[str, ...]] | None = None,
    attn: str | None = None,
    outcome: Outcome = Outcome.PASSES,
) -> CellRecord:
    cell = Cell("c", "f", "cpu", dtype, "half" if dtype != "float32" else "fp32", "sdpa")
    trail = Trail(compute_dtypes=compute) if compute else None
    return CellRecord(cell, "2.13.0", outcome, trail=trail, attn_dtype=attn)


@pytest.mark.parametrize(
    ("compute", "attn", "expected"),
    [
        ({"matmul": ("bfloat16",), "attention": ("bfloat16",)}, None, Kept.HALF),
        ({"matmul": ("bfloat16",), "attention": ("float32",)}, None, Kept.PARTLY),
        ({"matmul": ("float32",), "attention": ("float32",)}, None, Kept.FALLBACK),
        # the observed attention dtypes count a float32 mask: the trail is preferred
        ({"attention": ("bfloat16",)}, "bfloat16+float32", Kept.HALF),
        (None, "float32", Kept.FALLBACK),
        (None, None, None),  # no trail (--no-trace, or compiled): not known
    ],
)
def test_a_cell_says_what_its_kernels_computed_in(
    compute: dict[str, tuple[str, ...]] | None, attn: str | None, expected: Kept | None
) -> None:
    assert kept(record(compute=compute, attn=attn)) is expected


def test_the_control_and_cells_that_did_not_run_are_not_judged() -> None:
    assert kept(record(dtype="float32", compute={"matmul": ("float32",)})) is None
    failed = record(compute={"matmul": ("float32",)}, outcome=Outcome.RAISES)
    assert kept(failed) is None


def test_a_fix_is_as_wide_as_its_widest_cell() -> None:
    assert fix_kept(["half", "half", None]) is Kept.HALF
    assert fix_kept(["half", "partly fp32"]) is Kept.PARTLY
    assert fix_kept(["half", "fp32 fallback", "partly fp32"]) is Kept.FALLBACK
    assert fix_kept([None, float("nan")]) is None  # pandas' missing values
