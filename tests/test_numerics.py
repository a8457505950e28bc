"""The tolerance rule."""

from __future__ import annotations

import math

import torch

from harness.measure.judge import numerics


def test_relative_error_is_max_abs_over_reference_scale() -> None:
    ref = torch.tensor([1.0, -4.0, 2.0], dtype=torch.float64)
    out = torch.tensor([1.0, -3.5, 2.25], dtype=torch.float16)
    max_abs, rel = numerics.relative_error(out, ref)
    assert max_abs == 0.5
    assert rel == 0.5 / 4.0


def test_tolerance_is_the_most_independent_yardstick_with_an_epsilon_floor() -> None:
    sticks = numerics.Yardsticks
    eps16 = torch.finfo(torch.float16).eps
    # a different, trusted fix decides where there is one
    assert numerics.deciding(torch.float16, sticks(1e-3, 1e-4, "fix ref")) == (
        numerics.FIX_FACTOR * 1e-3,
        "fix ref",
        numerics.FIX_FACTOR,
    )
    # else the rounding of the data
    assert numerics.deciding(torch.float16, sticks(None, 1e-3, rounding_name="rounding")) == (
        numerics.ROUNDING_FACTOR * 1e-3,
        "rounding",
        numerics.ROUNDING_FACTOR,
    )
    # never below eps
    assert numerics.deciding(torch.float16, sticks(1e-9, 1e-9))[0] == eps16
    assert numerics.deciding(torch.bfloat16, sticks())[0] == torch.finfo(torch.bfloat16).eps


def test_a_fix_that_is_not_accurate_itself_is_no_yardstick() -> None:
    """A reference fix that loses precision in the dtype (T5's clamp: 4840x the rounding)
    would excuse any other fix: the rounding decides instead."""
    tolerance, decided_by, _ = numerics.deciding(
        torch.float16, numerics.Yardsticks(0.126, 2.6e-5, "fix clamp", "rounding to float16")
    )
    assert decided_by == "eps(float16)" and tolerance == torch.finfo(torch.float16).eps
    for broken in (math.inf, math.nan):
        _, decided_by, _ = numerics.deciding(
            torch.float16, numerics.Yardsticks(broken, 1e-3, "fix", "rounding")
        )
        assert decided_by == "rounding"
    _, decided_by, _ = numerics.deciding(torch.float16, numerics.Yardsticks(None, math.inf))
    assert decided_by == "eps(float16)"  # data that overflow when rounded: no yardstick


def test_judge_passes_within_and_fails_beyond_tolerance() -> None:
    ref = torch.linspace(-1, 1, 101, dtype=torch.float64)
    close = ref.to(torch.float16)
    far = close + 0.1
    rounding = numerics.relative_error(close, ref)[1]
    sticks = numerics.Yardsticks(rounding_rel_err=rounding, rounding_name="rounding to float16")
    good = numerics.judge(close, ref, torch.float16, sticks)
    bad = numerics.judge(far, ref, torch.float16, sticks)
    assert numerics.within_tolerance(good)
    assert not numerics.within_tolerance(bad)
    assert good.tolerance == max(
        numerics.ROUNDING_FACTOR * rounding, torch.finfo(torch.float16).eps
    )
    assert good.rounding_rel_err == rounding and good.baseline_rel_err is None
    assert "float16" in good.tolerance_rule


def test_non_finite_output_never_passes() -> None:
    ref = torch.zeros(3, dtype=torch.float64)
    out = torch.tensor([0.0, math.inf, 0.0])
    judged = numerics.judge(out, ref, torch.float32, numerics.Yardsticks(1.0))
    assert not judged.finite
    assert not numerics.within_tolerance(judged)


def test_nan_output_never_passes() -> None:
    ref = torch.ones(3, dtype=torch.float64)
    out = torch.tensor([1.0, math.nan, 1.0])
    judged = numerics.judge(out, ref, torch.float32, numerics.Yardsticks(1.0))
    assert not numerics.within_tolerance(judged)
