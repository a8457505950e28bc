"""A module measured on its own code (``harness.measure.judge.divergence_replay``): while a
container's twins run, the modules it calls return float64's outputs, and the container is
judged at what it returns and at what its own code passes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from harness.measure.authoring import registry
from harness.measure.judge import divergence
from harness.measure.judge.divergence_replay import (
    Calls,
    NotReplayed,
    as_held,
    replaying,
)
from harness.schema.axes import Cell
from tests.test_divergence import LayerNorm, toy, toy_cell

FACTOR = 10.0


@pytest.fixture(autouse=True)
def registered(clean_registry: None) -> None:
    registry.discover()


def ratios(cell: Cell) -> dict[str, float]:
    taken = divergence.profile(registry.get(cell.case), cell, FACTOR)
    assert not taken.unmeasured
    return {m.path: m.ratio for m in taken.modules}


def test_a_module_s_error_is_its_own_not_its_containers() -> None:
    """The cancelling norm of block 2 crosses; the block and the model that hold it read
    their own code's rounding (whole, they read non-finite: the norm's error carried)."""
    found = ratios(toy_cell("replay-variance", toy("cancelling-variance", 2)))
    assert found["blocks.2.norm1"] > 1e3
    assert found["blocks.2"] < 2 and found[""] < 2
    assert max(r for path, r in found.items() if path != "blocks.2.norm1") < 2


def test_own_code_that_feeds_a_module_is_charged_to_the_container() -> None:
    """Logits scaled after ``q @ k^T`` overflow inside the attention's own code, and reach
    its output only through ``out``: ``out`` is fed float64's input in its own measure
    (1), the attention is charged at what it passed ``out`` (non-finite)."""
    cell = toy_cell("replay-logits", toy("logits-scaled-after", 2, hot=True))
    found = ratios(cell)
    assert found["blocks.2.attn"] == float("inf")
    assert found["blocks.2.attn.out"] < 2
    assert found["blocks.2"] < 2


class Boxed:
    """A value pytree does not know (a cache object, a custom output)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class BoxedNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = LayerNorm(16, cancelling=True)

    def forward(self, x: torch.Tensor) -> Boxed:
        return Boxed(self.norm(x))


class Holder(nn.Module):
    """Calls a module that returns a :class:`Boxed`: its call cannot be replayed."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = BoxedNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).tensor * 2


def holder() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    return Holder(), {"x": torch.randn(2, 8, 16) + 100}


def test_a_container_whose_calls_cannot_be_replayed_is_measured_whole() -> None:
    """``inner`` returns no tensor to compare and no value to replay: ``Holder`` computes
    it in its twins, and holds the cancelling norm's error (measured, not dropped)."""
    found = ratios(toy_cell("replay-boxed", holder))
    assert "inner" not in found  # nothing floating returned that pytree sees
    assert found["inner.norm"] > 1e3
    assert found[""] > 1e3


def call_log() -> Calls:
    """One call of a float64 linear, kept as a container's twins replay it."""
    linear = nn.Linear(4, 4).double()
    calls = Calls()
    x = torch.randn(2, 4, dtype=torch.float64)
    calls.add("lin", ((x,), {}), linear(x), (torch.float16,))
    return calls


def test_a_replayed_module_returns_float64_s_output_as_the_twin_holds_it() -> None:
    calls = call_log()
    twin = nn.Linear(4, 4).half()
    given = torch.zeros(2, 4, dtype=torch.float16)
    with replaying(calls.replayed(), {"lin": twin}.__getitem__, as_held("cpu"), clone) as seen:
        out = twin(given)
    assert out.dtype == torch.float16
    assert torch.equal(out, calls.kept[0].output.half())
    assert "forward" not in twin.__dict__  # the module's own forward is back
    assert seen.fed() == []  # passed what the twin was given: no own code made it


def test_the_own_code_s_input_to_a_module_is_kept_and_a_view_is_not() -> None:
    calls = call_log()
    twin = nn.Linear(4, 4)
    given = torch.ones(2, 4)
    module_at: Callable[[str], nn.Module] = {"lin": twin}.__getitem__
    with replaying(calls.replayed(), module_at, as_held("cpu"), clone, given) as seen:
        twin(given.view(2, 4))
    assert seen.fed() == []
    with replaying(calls.replayed(), module_at, as_held("cpu"), clone, given) as seen:
        twin(given * 3)
    assert seen.fed() == [0] and torch.equal(seen.passed[0][0][0], torch.full((2, 4), 3.0))


def test_a_twin_that_calls_otherwise_is_not_replayed() -> None:
    calls = call_log()
    twin = nn.Linear(4, 4)
    module_at = {"lin": twin}.__getitem__
    held = as_held("cpu")
    nowhere: dict[str, nn.Module] = {}
    with (
        pytest.raises(NotReplayed, match="more often"),
        replaying(calls.replayed(), module_at, held, clone),
    ):
        twin(torch.ones(2, 4))
        twin(torch.ones(2, 4))
    assert "forward" not in twin.__dict__
    with (
        pytest.raises(NotReplayed, match="0 of the 1"),
        replaying(calls.replayed(), module_at, held, clone),
    ):
        pass
    with (
        pytest.raises(NotReplayed, match="no module"),
        replaying(calls.replayed(), nowhere.__getitem__, held, clone),
    ):
        pass


@pytest.mark.parametrize(
    ("inputs", "output", "dtypes"),
    [
        (((torch.ones(1),), {}), Boxed(torch.ones(1)), (torch.float16,)),  # not pytree's
        (((Boxed(torch.ones(1)),), {}), torch.ones(1), (torch.float16,)),
        (((torch.ones(1),), {}), torch.ones(1), None),  # the module was not measured
    ],
)
def test_a_call_that_cannot_be_kept_drops_them_all(inputs: Any, output: Any, dtypes: Any) -> None:
    calls = call_log()
    calls.add("other", inputs, output, dtypes)
    assert calls.replayed() == () and not calls.replayable
    calls.add("lin", ((torch.ones(1),), {}), torch.ones(1), (torch.float16,))
    assert calls.replayed() == ()


def test_calls_beyond_the_limit_are_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("harness.measure.judge.divergence_replay.LIMIT_MIB", 1)
    calls = Calls()
    big = torch.zeros(2**17, dtype=torch.float64)  # 1 MiB
    calls.add("a", ((big,), {}), big, (torch.float16,))
    assert not calls.replayable


def clone(value: Any) -> Any:
    return divergence.cloned(value)


def test_an_output_changed_in_place_after_it_returned_is_not_replayed() -> None:
    """float64's output is kept as a view: a ``ReLU(inplace=True)`` after the linear, or the
    container's own ``add_``, changes it, and the container is measured whole."""
    calls = call_log()
    assert calls.replayed()
    torch.relu_(calls.kept[0].output)  # what a ReLU(inplace=True) does to the linear's
    assert calls.replayed() == () and not calls.replayable


def test_a_module_with_an_in_place_relu_is_profiled_whole_and_right() -> None:
    def factory() -> tuple[nn.Module, dict[str, torch.Tensor]]:
        mlp = nn.Sequential(nn.Linear(16, 64), nn.ReLU(inplace=True), nn.Linear(64, 16))
        return mlp, {"input": torch.randn(2, 8, 16)}

    found = ratios(toy_cell("replay-inplace", factory))
    assert set(found) == {"0", "1", "2", ""}
    assert max(found.values()) < 2
