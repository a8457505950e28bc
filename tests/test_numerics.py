"""The tolerance rule."""

from __future__ import annotations

import math

import torch

from harness import numerics


def test_relative_error_is_max_abs_over_reference_scale() -> None:
    ref = torch.tensor([1.0, -4.0, 2.0], dtype=torch.float64)
    out = torch.tensor([1.0, -3.5, 2.25], dtype=torch.float16)
    max_abs, rel = numerics.relative_error(out, ref)
    assert max_abs == 0.5
    assert rel == 0.5 / 4.0


def test_tolerance_is_fudge_times_baseline_with_an_epsilon_floor() -> None:
    assert numerics.tolerance_for(torch.float16, 1e-2) == numerics.FUDGE * 1e-2
    eps16 = torch.finfo(torch.float16).eps
    assert numerics.tolerance_for(torch.float16, 1e-9) == eps16
    assert numerics.tolerance_for(torch.bfloat16, None) == torch.finfo(torch.bfloat16).eps


def test_judge_passes_within_and_fails_beyond_tolerance() -> None:
    ref = torch.linspace(-1, 1, 101, dtype=torch.float64)
    close = ref.to(torch.float16)
    far = close + 0.1
    baseline = numerics.relative_error(close, ref)[1]
    good = numerics.judge(close, ref, torch.float16, baseline)
    bad = numerics.judge(far, ref, torch.float16, baseline)
    assert numerics.within_tolerance(good)
    assert not numerics.within_tolerance(bad)
    assert good.tolerance == max(numerics.FUDGE * baseline, torch.finfo(torch.float16).eps)
    assert "float16" in good.tolerance_rule


def test_non_finite_output_never_passes() -> None:
    ref = torch.zeros(3, dtype=torch.float64)
    out = torch.tensor([0.0, math.inf, 0.0])
    judged = numerics.judge(out, ref, torch.float32, 1.0)
    assert not judged.finite
    assert not numerics.within_tolerance(judged)


def test_nan_output_never_passes() -> None:
    ref = torch.ones(3, dtype=torch.float64)
    judged = numerics.judge(torch.tensor([1.0, math.nan, 1.0]), ref, torch.float32, 1.0)
    assert not numerics.within_tolerance(judged)
