"""A cell is judged along its own random draws and its choices within rounding
(harness.measure.running.replay): the recorder changes nothing, the replay moves only the
choices within the band (in forward and backward), takes the cell's draws, and counts only
crossings within the band."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness.measure.running.replay import (
    KINK_WIDTH,
    Choice,
    Draw,
    Recorded,
    Recorder,
    Replay,
    crossings,
    dtype_eps,
    plan_replay,
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


def test_the_recorder_keeps_every_kink_and_changes_nothing() -> None:
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    plain = every_relu(x)
    plain.sum().backward()
    expected = x.grad.clone()  # type: ignore[union-attr]
    x.grad = None
    with Recorder(reference=True) as recorder:
        recorded = every_relu(x)
        recorded.sum().backward()
    assert torch.equal(recorded, plain) and torch.equal(x.grad, expected)  # type: ignore[arg-type]
    ops = [c.op for c in recorder.recorded.choices]
    # seven forward kinks, and the leaky ReLU's backward, which reads its input
    assert ops.count("aten.relu.default") == 4 and ops.count("aten.relu_.default") == 2
    assert ops.count("aten.leaky_relu.default") == 1
    assert ops.count("aten.leaky_relu_backward.default") == 1
    sides = recorder.recorded.choices[5].taken  # before relu_ overwrote its input
    assert torch.equal(sides.bool(), (x * 3 > 0).detach())


def test_the_replay_moves_only_the_units_within_the_band() -> None:
    """Units at +-1e-4 of the kink (the tensor's largest 1.0: float16's band is 7.8e-3)
    take the given side, off; those at 0.5 and 1.0 keep their own, on."""
    x = torch.tensor([-1.0, -1e-4, 1e-4, 0.5, 1.0], dtype=torch.float64, requires_grad=True)
    off = Choice("aten.relu.default", torch.zeros(5, dtype=torch.int8))
    with Replay(None, [off], "float16") as replay:
        out = F.relu(x)
    out.sum().backward()
    assert replay.fits and replay.crossed["ReLU"] == 1
    assert out.tolist() == [0.0, 0.0, 0.0, 0.5, 1.0]
    assert x.grad is not None and x.grad.tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]


def test_a_replayed_unit_turned_on_passes_its_gradient_and_a_leaky_one_its_slope() -> None:
    x = torch.tensor([-1e-4, -1.0, 1.0], dtype=torch.float64, requires_grad=True)
    on = torch.ones(3, dtype=torch.int8)
    choices = [
        Choice("aten.relu.default", on),
        Choice("aten.leaky_relu.default", on),
        Choice("aten.leaky_relu_backward.default", on),
    ]
    with Replay(None, choices, "float16") as replay:
        out = F.relu(x) + F.leaky_relu(x, negative_slope=0.5)
        out.sum().backward()
    assert replay.fits
    assert out[0].item() == -2e-4  # each unit put on holds its own input
    assert x.grad is not None and x.grad.tolist() == [2.0, 0.5, 2.0]


def test_a_replay_of_other_calls_than_those_recorded_imposes_nothing() -> None:
    x = torch.tensor([1e-4, 1.0], dtype=torch.float64, requires_grad=True)
    other = Choice("aten.relu.default", torch.zeros(3, dtype=torch.int8))
    with Replay(None, [other], "float16") as r:
        out = F.relu(x)
    assert not r.fits and out.tolist() == [1e-4, 1.0]
    with Replay(None, [], "float16") as replay:
        F.relu(x)
    assert not replay.fits


def test_only_crossings_within_the_band_count() -> None:
    with Recorder(reference=True) as recorder:
        F.relu(torch.tensor([-1e-4, 1e-4, -0.5, 1.0], dtype=torch.float64))
    reference = recorder.recorded.choices

    def cell(*sides: int) -> list[Choice]:
        return [Choice("aten.relu.default", torch.tensor(sides, dtype=torch.int8))]

    assert crossings(reference, cell(1, 0, 1, 1), "float16") == 2  # two within, one beyond
    assert crossings(reference, cell(0, 1, 0, 1), "float16") == 0
    assert crossings(reference, cell(1, 0), "float16") == 0  # other calls
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
    for scale in (1.0, 64.0):
        x = torch.tensor([0.0, 0.99 * band, -0.99 * band, 1.01 * band, 1.0], dtype=torch.float64)
        with Recorder(reference=True) as recorder:
            F.relu(x * scale)
        (choice,) = recorder.recorded.choices
        assert choice.margin is not None
        assert (choice.margin <= band).tolist() == [True, True, True, False, False]


def relu_mlp() -> tuple[Any, ...]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)), torch.randn(16, 8)


class Ops(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Any] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_a_traced_cell_records_its_choices_unseen_by_the_modes_beneath() -> None:
    """The recorder's own work runs out of sight (a dtype tracer beneath sees the model's)."""
    model, x = relu_mlp()
    with Ops() as ops:
        model(x).topk(2).values.sum().backward()
    model.zero_grad(set_to_none=True)
    with Ops() as recorded_ops, Recorder():
        model(x).topk(2).values.sum().backward()
    assert recorded_ops.seen == ops.seen


class ReluBlocks(nn.Module):
    """ReLU blocks under ``torch.utils.checkpoint``, with dropout and a random draw."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 16))
            for _ in range(3)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.reentrant)
            x = x * (1 + 0.1 * torch.rand(x.shape, dtype=x.dtype))
        return x


def gradients(model: nn.Module, x: torch.Tensor, mode: Any) -> dict[str, torch.Tensor]:
    model.zero_grad()
    torch.manual_seed(1)
    with mode:
        model(x.requires_grad_()).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_blocks_are_recorded_and_replayed_in_their_recomputation_too(
    reentrant: bool,
) -> None:
    """The recomputation a checkpoint runs in backward draws and chooses again: both are
    recorded and replayed (a non-reentrant checkpoint checks that its recomputation saves
    what its forward saved)."""
    torch.manual_seed(0)
    model = ReluBlocks(reentrant)
    x = torch.randn(8, 16)
    cell = Recorder()
    gradients(model, x, cell)  # float32: draws other numbers than float64
    model64 = model.double()
    reference = Recorder(reference=True)
    plain = gradients(model64, x.double(), reference)
    drawn = cell.recorded.draws
    assert len(drawn) == 9 == len(reference.recorded.draws)  # 3 + 3 + 3 recomputed dropouts
    plan = plan_replay(reference.recorded, cell.recorded.on_cpu(), "float32", kinks=True)
    assert plan is not None and plan.draws is not None
    replay = Replay(plan.draws, plan.choices, "float32")
    along = gradients(model64, x.double(), replay)
    assert replay.fits and replay.replayed >= 3  # float32 rand draws other numbers
    model32 = model.float()
    cell_grads = gradients(model32, x, Recorder())
    for name, grad in cell_grads.items():
        assert torch.allclose(grad.double(), along[name], rtol=1e-4, atol=1e-6), name
        assert not torch.allclose(grad.double(), plain[name], rtol=1e-2), name


def test_draws_that_do_not_match_keep_float64s_own_and_say_why() -> None:
    reference = Recorded([Draw("aten.rand.default", torch.rand(4, dtype=torch.float64))])
    cell = Recorded(
        [Draw("aten.rand.default", torch.rand(4)), Draw("aten.rand.default", torch.rand(4))]
    )
    assert plan_replay(reference, cell, "float32", True) is not None  # one more: a retry
    shorter = Recorded([])
    plan = plan_replay(reference, shorter, "float32", True)
    assert plan is not None and plan.draws is None
    assert plan.unmatched == "the cell drew 0 time(s), float64 1"
    alike = Recorded([Draw("aten.rand.default", reference.draws[0].value.clone())])
    assert plan_replay(reference, alike, "float32", True) is None  # nothing to replay
