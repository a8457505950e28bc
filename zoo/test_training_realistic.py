"""The train stage's acceptance models (``zoo/training_realistic.py``): each healthy model
passes every cell, and each bug does not pass where its truth, measured with plain torch,
shows it costs more than ten times its healthy twin (see ``zoo/training_table.py``).

One test per family, twin, stage and cell, each run as ``check`` runs a model; a failing
test here is a verdict the harness gets wrong, against the measured truth.
"""

from __future__ import annotations

import pytest

from zoo.training_realistic import FAMILIES
from zoo.training_table import (
    CELLS,
    bug_cell_expected,
    cell_truth,
    check_cell,
    healthy_expected,
    misjudged,
    verdict_text,
    yardstick_sum_eps,
)
from zoo.training_truth import layer_norm_kernel_cost

PARAMS = [
    pytest.param(family, stage, dtype, mode, id=f"{family}-{stage}-{dtype}-{mode}")
    for family, spec in FAMILIES.items()
    for stage in spec.stages
    for dtype, mode in CELLS
]


def reads(expected: str, family: str, healthy: bool, stage: str, dtype: str, mode: str) -> None:
    """The cell's verdict is the one ``expected`` asks for (see
    :func:`zoo.training_table.misjudged`)."""
    record = check_cell(family, healthy, stage, dtype, mode)
    truth = cell_truth(family, dtype, mode)
    said = (
        f"{'healthy' if healthy else 'bug'} {stage} {dtype}/{mode}: {verdict_text(record)}; "
        f"truth: healthy {truth.healthy:.3g}, bug {truth.bug:.3g}, the bug's cost "
        f"{truth.cost:.3g}x at {truth.leaf}"
    )
    why = misjudged(expected, record)
    assert why is None, f"{why}: {said}"


@pytest.mark.parametrize(("family", "stage", "dtype", "mode"), PARAMS)
def test_healthy_model(family: str, stage: str, dtype: str, mode: str) -> None:
    reads(healthy_expected(family, dtype), family, True, stage, dtype, mode)


@pytest.mark.parametrize(("family", "stage", "dtype", "mode"), PARAMS)
def test_bug(family: str, stage: str, dtype: str, mode: str) -> None:
    reads(bug_cell_expected(family, stage, dtype, mode), family, False, stage, dtype, mode)


def test_every_bug_costs_somewhere() -> None:
    """Each bug is a real one: in some cell it costs more than ten times its healthy twin
    (else its cells would test nothing)."""
    for family in FAMILIES:
        costs = [cell_truth(family, dtype, mode).cost for dtype, mode in CELLS]
        assert max(costs) > 10.0, f"{family}: its bug costs at most {max(costs):.3g}x"


def test_layer_norm_kernel_cost_is_measured() -> None:
    """The healthy cells the tests accept as inaccurate rest on a fact: torch's CPU
    LayerNorm backward sums 2048 rows in the half dtype, at 50 times the cost of rounding
    the sum once in bfloat16 (truly inaccurate) and 11 times in float16 (at the bar of
    ten: either verdict), while in float32 it is within float32 arithmetic's own cost."""
    assert layer_norm_kernel_cost("bfloat16") / yardstick_sum_eps("bfloat16") > 20.0
    assert 5.0 < layer_norm_kernel_cost("float16") / yardstick_sum_eps("float16") < 20.0
    assert layer_norm_kernel_cost("float32") / yardstick_sum_eps("float32") < 5.0
    family = "layernorm-2048-tokens"
    assert [healthy_expected(family, d) for d in ("bfloat16", "float16", "float32")] == [
        "not passes",
        "any verdict",
        "passes",
    ]
