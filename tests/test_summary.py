"""The terminal summary table."""

from __future__ import annotations

from harness.results.summary import noise_statement, render_summary
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, Outcome


def record(
    fix: str,
    dtype: str,
    mode: str,
    outcome: Outcome,
    reproduces: bool | None = None,
    backend: str = "sdpa",
    error: tuple[str, str] | None = None,
) -> CellRecord:
    cell = Cell("case-a", fix, "cpu", dtype, mode, backend)
    error_type, message = error or (None, None)
    return CellRecord(
        cell,
        "2.13.0",
        outcome,
        reproduces=reproduces,
        error_type=error_type,
        error_message=message,
    )


def test_summary_table_rows_columns_and_counts() -> None:
    records = [
        record("cast", "bfloat16", "half", Outcome.PASSES),
        record("none", "bfloat16", "half", Outcome.RAISES, reproduces=True),
        record("none", "float16", "half", Outcome.RAISES, False, error=("TypeError", "boom")),
        record("none", "float32", "fp32", Outcome.PASSES),
        record("cast", "float16", "half", Outcome.INACCURATE),
        CellRecord(
            Cell("case-a", "none", "cuda", "float16", "half", "sdpa"),
            "2.13.0",
            Outcome.SKIPPED,
            skip_reason="no CUDA device visible",
        ),
    ]
    expected = [
        "case-a",
        "  fix   float16/half  bfloat16/half  float32/fp32",
        "  none  raises:OTHER  raises:repro   passes",
        "  cast  inaccurate    passes         -",
        "  ! none float16/half: TypeError: boom",
        "",
        "outcomes: 1 inaccurate, 2 passes, 2 raises, 1 skipped",
        "     1 skipped: no CUDA device visible",
    ]
    assert render_summary(records).splitlines()[: len(expected)] == expected


def test_backends_become_part_of_the_row_when_several_ran() -> None:
    records = [
        record(
            "none",
            "float16",
            "autocast",
            Outcome.RAISES,
            reproduces=True,
            backend="flash-attn-contract",
        ),
        record("none", "float16", "autocast", Outcome.PASSES, backend="sdpa"),
    ]
    lines = render_summary(records).splitlines()
    assert lines[2].split() == ["none", "[flash-attn-contract]", "raises:repro"]
    assert lines[3].split() == ["none", "[sdpa]", "passes"]


def test_a_raising_cell_shows_its_dtype_trail() -> None:
    from harness.schema.trail_records import Promotion, Site, Trail

    trail = Trail(
        promotion=Promotion(
            Site("aten::mul", "blocks.0.attn", "models/x.py:123", ("bfloat16", "float32")),
            "float32",
            "parameter blocks.0.attn.scale_mul",
        ),
        failure_site=Site(
            "aten::_flash_attention_forward", "blocks.0.attn", "models/x.py:130", ("float32",)
        ),
    )
    raised = CellRecord(
        Cell("case-a", "none", "cpu", "bfloat16", "autocast", "sdpa"),
        "2.13.0",
        Outcome.RAISES,
        reproduces=True,
        error_type="RuntimeError",
        error_message="known",
        trail=trail,
    )
    lines = render_summary([raised]).splitlines()
    assert (
        "  ! none bfloat16/autocast: float32 enters via parameter blocks.0.attn.scale_mul at "
        "aten::mul in blocks.0.attn (models/x.py:123), fails at aten::_flash_attention_forward "
        "[float32] in blocks.0.attn (models/x.py:130)"
    ) in lines


def test_noisy_timings_come_with_what_they_mean() -> None:
    statement = noise_statement([(True, 0.12), (False, 0.01), (True, 0.2), (True, 0.1)])
    assert statement is not None
    assert statement.startswith("noise: 3 of 4 timed cells did not settle")
    assert "typically 12%" in statement and "within 1.12x" in statement
    assert noise_statement([(False, 0.01)]) is None
