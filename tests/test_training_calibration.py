"""What the training families' calibration counts as misjudged (``zoo/training_table.py``,
read by ``zoo/test_training_realistic.py`` and ``benchmarks/bench_training.py``): a cell that
must pass passes plainly, one that must not pass is inaccurate or raises, and a crash is
never a verdict."""

from __future__ import annotations

import pytest

from harness.schema.axes import Cell
from harness.schema.records import CellRecord, Flag, FlagKind, Outcome
from zoo.training_table import misjudged

CELL = Cell("realistic-toy-healthy", "none", "cpu", "float16", "autocast", "sdpa", stage="train")


def record(outcome: Outcome, flagged: bool = False) -> CellRecord:
    flags = (Flag(FlagKind.NO_AUTOCAST, "no op ran under autocast"),) if flagged else ()
    return CellRecord(CELL, "2.13.0", outcome, flags=flags)


@pytest.mark.parametrize(
    ("expected", "outcome", "flagged", "right"),
    [
        ("passes", Outcome.PASSES, False, True),
        ("passes", Outcome.PASSES, True, False),  # a flagged pass is not a plain pass
        ("passes", Outcome.INACCURATE, False, False),
        ("not passes", Outcome.INACCURATE, False, True),
        ("not passes", Outcome.RAISES, False, True),
        ("not passes", Outcome.PASSES, False, False),
        ("any verdict", Outcome.PASSES, True, True),
        ("any verdict", Outcome.INACCURATE, False, True),
        ("any verdict", Outcome.RAISES, False, False),
        ("not passes", Outcome.CRASHED, False, False),  # a crash is never a verdict
        ("any verdict", Outcome.CRASHED, False, False),
    ],
)
def test_a_cell_is_misjudged_where_its_verdict_is_not_the_one_its_truth_asks_for(
    expected: str, outcome: Outcome, flagged: bool, right: bool
) -> None:
    why = misjudged(expected, record(outcome, flagged))
    assert (why is None) is right, why
    if why is not None:
        assert why.startswith(f"must read {expected}, reads {outcome.value}")
