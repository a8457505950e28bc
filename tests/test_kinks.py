"""A training step is judged along its own sides of the ReLU kinks (harness.measure.running.kinks):
the recorder changes nothing, the replay moves only the units within the band, and only
crossings within the band count."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.measure.running.kinks import (
    KINK_WIDTH,
    KinkRecorder,
    KinkReplay,
    crossings,
    dtype_eps,
    near_kink,
    sides,
)

#: float16's band around the kink, relative to the tensor's largest input.
BAND = KINK_WIDTH * 2.0**-10


def every_relu(x: torch.Tensor) -> torch.Tensor:
    """One call of each ReLU entry point torch has, in-place ones included."""
    a = F.relu(x)
    b = nn.ReLU()(x - 0.1)
    c = torch.relu(x + 0.1)
    d = (x * 2).relu()
    e = F.leaky_relu(x, 0.2)
    f = (x * 3).relu_()
    g = nn.ReLU(inplace=True)(x * 4)
    return a + b + c + d + e + f + g


def test_the_recorder_keeps_every_relu_input_and_changes_nothing() -> None:
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    plain = every_relu(x)
    plain.sum().backward()
    expected = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    with KinkRecorder(keep_values=True) as recorder:
        recorded = every_relu(x)
    recorded.sum().backward()
    assert torch.equal(recorded, plain) and torch.equal(x.grad, expected)  # type: ignore[arg-type]
    assert len(recorder.inputs) == 7
    assert torch.equal(recorder.inputs[5], (x * 3).detach())  # copied before relu_
    assert [s.dtype for s in sides(recorder.inputs)] == [torch.bool] * 7


def test_the_replay_moves_only_the_units_within_the_band() -> None:
    """Units at +-1e-4 of the kink (the tensor's largest 1.0: float16's band is 7.8e-3)
    take the given side, off; those at 0.5 and 1.0 keep their own, on."""
    x = torch.tensor([-1.0, -1e-4, 1e-4, 0.5, 1.0], dtype=torch.float64, requires_grad=True)
    given = torch.zeros(5, dtype=torch.bool)
    with KinkReplay([given], "float16") as replay:
        out = F.relu(x)
    out.sum().backward()
    assert replay.fits
    assert out.tolist() == [0.0, 0.0, 0.0, 0.5, 1.0]
    assert x.grad is not None and x.grad.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]


def test_a_replayed_unit_turned_on_passes_its_gradient_and_a_leaky_one_its_slope() -> None:
    x = torch.tensor([-1e-4, -1.0, 1.0], dtype=torch.float64, requires_grad=True)
    on = torch.tensor([True, True, True])
    with KinkReplay([on, on], "float16"):
        out = F.relu(x) + F.leaky_relu(x, negative_slope=0.5)
    out.sum().backward()
    assert x.grad is not None and x.grad.tolist() == [2.0, 0.5, 2.0]


def test_a_replay_of_other_calls_than_those_recorded_imposes_nothing() -> None:
    x = torch.tensor([1e-4, 1.0], dtype=torch.float64, requires_grad=True)
    with KinkReplay([torch.zeros(3, dtype=torch.bool)], "float16") as replay:
        out = F.relu(x)
    assert not replay.fits and out.tolist() == [1e-4, 1.0]
    with KinkReplay([], "float16") as replay:
        F.relu(x)
    assert not replay.fits


def test_only_crossings_within_the_band_count() -> None:
    reference = [torch.tensor([-1e-4, 1e-4, -0.5, 1.0], dtype=torch.float64)]
    cell = [torch.tensor([True, False, True, True])]  # two within the band, one beyond
    assert crossings(reference, cell, "float16") == 2
    assert crossings(reference, [torch.tensor([False, True, False, True])], "float16") == 0
    assert crossings(reference, [torch.tensor([True, False])], "float16") == 0  # other calls
    assert crossings(reference, [], "float16") == 0


@pytest.mark.parametrize(
    ("dtype", "eps"),
    [("float16", 2.0**-10), ("bfloat16", 2.0**-7), ("float32", 2.0**-23), ("tf32", 2.0**-10)],
)
def test_the_band_is_the_dtypes_eps_times_the_width_relative_to_the_largest_input(
    dtype: str, eps: float
) -> None:
    assert dtype_eps(dtype) == eps
    band = KINK_WIDTH * eps  # the largest input is 1.0
    x = torch.tensor([0.0, 0.99 * band, -0.99 * band, 1.01 * band, 1.0], dtype=torch.float64)
    assert near_kink(x, dtype).tolist() == [True, True, True, False, False]
    assert near_kink(x * 64, dtype).tolist() == [True, True, True, False, False]
    assert near_kink(torch.zeros(0, dtype=torch.float64), dtype).numel() == 0


def relu_mlp() -> tuple[Any, ...]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(16, 8)


def test_a_traced_cell_records_its_relu_inputs_without_copies() -> None:
    """The recorder runs no op of its own (a dtype tracer beneath sees the model's)."""
    seen: list[Any] = []

    class Ops(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    model, x = relu_mlp()
    with Ops():
        model(x)
    plain = list(seen)
    seen.clear()
    with KinkRecorder(), Ops():
        model(x)
    assert seen == plain
