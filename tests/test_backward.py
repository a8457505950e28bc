"""A training step's backward, located: an error raised in backward names the forward line
that made the failing autograd node (a custom Function's ``.apply``, a built-in op's call)
and the gradients it received; gradients that are not finite name the first parameter whose
gradient went so and the first node that made one from finite gradients. Only a step that
failed is taken again."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from harness.measure.precision.modes import Precision
from harness.measure.running.training import TrainedStep, train_step
from harness.measure.tracing.python_watch import PythonWatch, watch_python
from harness.measure.tracing.source_sites import shown
from harness.measure.tracing.tensor_marks import Names
from harness.measure.tracing.trail import DtypeTracer, tracing
from harness.results.summary import render_summary
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, Note, NoteKind, Outcome
from harness.schema.trail_records import BackwardNode, Trail

CPU = torch.device("cpu")


def line_of(marker: str) -> str:
    """``tests/test_backward.py:N`` (as the harness shows this file) of the line that
    contains ``marker``."""
    lines = inspect.getsource(inspect.getmodule(line_of)).splitlines()  # type: ignore[arg-type]
    number = next(n for n, text in enumerate(lines, 1) if marker in text and "line_of" not in text)
    return shown(__file__, number)


class DenseFunc(torch.autograd.Function):
    """A fused linear layer as an autograd Function without ``custom_fwd``/``custom_bwd``:
    under autocast its output is half, and its backward meets the float32 weight it saved."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor) -> Any:
        ctx.save_for_backward(weight)
        return nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> Any:
        (weight,) = ctx.saved_tensors
        return grad_out @ weight, None  # the half gradient meets the float32 weight


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DenseFunc.apply(x, self.weight)  # the node's forward line


class IncompleteGamma(nn.Module):
    """``torch.igamma``'s derivative in its first argument is not implemented: its
    backward node raises, and no Python frame of the model's is running then."""

    def __init__(self) -> None:
        super().__init__()
        self.shape = nn.Parameter(torch.rand(4) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.igamma(self.shape, x)  # igamma's node


class Reciprocal(nn.Module):
    """In float16, 1 / 0.003 (333) is finite, its gradient -1 / 0.003**2 (-111111) is not."""

    def __init__(self) -> None:
        super().__init__()
        self.offset = nn.Parameter(torch.zeros(4))
        self.scale = nn.Parameter(torch.full((4,), 0.003))

    def forward(self) -> torch.Tensor:
        return torch.reciprocal(self.scale).sum() + self.offset.sum()  # reciprocal's node


def traced_step(
    model: nn.Module, forward: Callable[[], Any], precision: Precision
) -> tuple[TrainedStep | None, Trail, BaseException | None]:
    """One training step under the dtype tracer, as a train cell runs it: the step (None if
    it raised), the trail, and the error."""
    watch = PythonWatch("cpu")
    tracer = DtypeTracer(precision.dtype, Names.of_workload(model, {}, ()), watch, root=model)
    step, error = None, None
    try:
        with watch_python(watch), tracing(tracer):
            step = train_step(forward, lambda out: out.float().pow(2).mean(), model, precision)
    except Exception as raised:
        error = raised
    return step, tracer.trail(error), error


def counted(forward: Callable[[], Any]) -> tuple[Callable[[], Any], list[int]]:
    calls: list[int] = []

    def call() -> Any:
        calls.append(1)
        return forward()

    return call, calls


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_custom_function_raising_in_backward_is_located_at_its_apply_line(
    dtype: torch.dtype,
) -> None:
    """float16 goes through a GradScaler, bfloat16 not: both are taken again to locate."""
    torch.manual_seed(0)
    model, x = Dense(), torch.randn(4, 8)
    forward, calls = counted(lambda: model(x))
    _, trail, error = traced_step(model, forward, Precision(CPU, dtype, "autocast"))
    assert isinstance(error, RuntimeError) and "same dtype" in str(error)
    name = str(dtype).removeprefix("torch.")
    assert trail.backward_node == BackwardNode(
        "DenseFuncBackward", line_of("the node's forward line"), (name,)
    )
    assert trail.failure_site is not None and trail.failure_site.op == "aten::mm"
    assert trail.failure_site.input_dtypes == (name, "float32")
    assert trail.failure_site.location == line_of("the half gradient meets")
    made = line_of("the node's forward line")
    assert f"in the backward of DenseFuncBackward, made in the forward at {made}" in str(
        trail.describe()
    )
    assert len(calls) == 2  # the step, and once again to find the node


def test_a_built_in_node_raising_in_backward_is_located_at_its_forward_call() -> None:
    torch.manual_seed(0)
    model, x = IncompleteGamma(), torch.rand(4)
    _, trail, error = traced_step(model, lambda: model(x), Precision(CPU, torch.float32, "fp32"))
    assert isinstance(error, NotImplementedError), error
    assert trail.backward_node == BackwardNode(
        "IgammaBackward0", line_of("igamma's node"), ("float32",)
    )
    assert trail.failure_site is None  # no traced op raised, and no frame of the model's
    made = line_of("igamma's node")
    assert trail.describe() == (
        f"fails in the backward of IgammaBackward0, made in the forward at {made}, on "
        "gradients [float32]"
    )


def test_gradients_not_finite_name_the_first_parameter_and_the_node_that_made_them() -> None:
    model = Reciprocal().half()
    forward, calls = counted(model)
    step, _, error = traced_step(model, forward, Precision(CPU, torch.float16, "half"))
    assert error is None and step is not None and step.note is not None
    assert step.note.kind is NoteKind.GRADIENT
    made = line_of("reciprocal's node")
    # half weights in float16 train at a dynamic loss scale: not finite at any it tried
    assert step.note.text == (
        "the dynamic loss scale skipped every step it tried (24): gradients not finite at "
        "scale 65536 down to 0.0078125; "
        "gradients not finite, first grad.scale's; first made from finite ones by "
        f"ReciprocalBackward0, made in the forward at {made}, on gradients [float16]"
    )
    # the step's own gradients are what is judged (read unscaled in float32), and what
    # the model keeps (its float16 ones)
    assert torch.isinf(step.leaves["grad.scale"]).all()
    assert model.scale.grad is not None and model.scale.grad.dtype == torch.float16
    assert torch.equal(model.scale.grad.float(), step.leaves["grad.scale"])
    assert len(calls) == 2


def test_a_healthy_step_is_taken_once() -> None:
    torch.manual_seed(0)
    layer, x = nn.Linear(8, 8), torch.randn(4, 8)
    forward, calls = counted(lambda: layer(x))
    step, trail, error = traced_step(layer, forward, Precision(CPU, torch.float16, "autocast"))
    assert error is None and step is not None and step.note is None
    assert trail.backward_node is None and len(calls) == 1


def test_the_backward_node_is_kept_in_the_record() -> None:
    trail = Trail(backward_node=BackwardNode("MmBackward0", "model.py:12", ("float16",)))
    assert Trail.from_dict(trail.to_dict()) == trail
    record = CellRecord(
        Cell("case-a", "none", "cpu", "float16", "autocast", "sdpa", stage="train"),
        "2.13.0",
        Outcome.RAISES,
        reproduces=True,
        trail=trail,
    )
    assert CellRecord.from_dict(record.to_dict()) == record
    assert (
        "  ! none float16/autocast: fails in the backward of MmBackward0, made in the forward "
        "at model.py:12, on gradients [float16]"
    ) in render_summary([record]).splitlines()


def test_a_train_cells_step_notes_are_in_the_summary() -> None:
    skipped = Note(NoteKind.SCALER, "GradScaler skipped 1 step(s)")
    scaled = CellRecord(
        Cell("case-a", "none", "cpu", "float16", "autocast", "sdpa", stage="train"),
        "2.13.0",
        Outcome.PASSES,
        notes=(skipped,),
    )
    assert (
        "  ! none float16/autocast: GradScaler skipped 1 step(s)"
        in render_summary([scaled]).splitlines()
    )
