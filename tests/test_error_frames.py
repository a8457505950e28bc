"""Where a model's error came from is the model's own code, never the harness's: a model
checked from the project's root has the harness in its folder, and the harness's frames
that sit between the model's call and torch (the dtype tracer's ``__torch_dispatch__``)
are not where its error came from."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from harness.measure import execute
from harness.measure.authoring.model_case import Matrix, model_case
from harness.measure.running.errors import error_fields, own_frames
from harness.measure.tracing.python_watch import PythonWatch
from harness.measure.tracing.source_sites import HARNESS_DIR
from harness.measure.tracing.tensor_marks import Names
from harness.measure.tracing.trail import DtypeTracer, tracing
from harness.runner.matrix import expand
from harness.schema.records import Outcome

ROOT = Path(__file__).resolve().parent.parent
HERE = f"tests/{Path(__file__).name}"


def mixed_matmul_under_the_tracer() -> None:
    half, wide = torch.ones(2, 2, dtype=torch.float16), torch.ones(2, 2)
    with tracing(DtypeTracer(torch.float16, Names(), PythonWatch("cpu"))):
        torch.mm(half, wide)  # the model's line


def raised(call: object) -> BaseException:
    try:
        call()  # type: ignore[operator]
    except Exception as error:
        return error
    raise AssertionError("it did not raise")


def test_the_harness_frames_under_a_models_folder_are_not_its_own() -> None:
    error = raised(mixed_matmul_under_the_tracer)
    frames = own_frames(error, ROOT)  # the project's root holds the harness
    assert frames and all(not frame.startswith("harness/") for frame in frames), frames
    assert frames[-1].startswith(f"{HERE}:") and frames[-1].endswith(
        " in mixed_matmul_under_the_tracer"
    )
    assert error_fields(error, ROOT)["error_frames"] == frames


def test_a_harness_failure_still_names_the_harness_frames() -> None:
    """Where the harness itself failed, its own frames are what a record shows."""
    error = raised(mixed_matmul_under_the_tracer)
    frames = own_frames(error, HARNESS_DIR)
    assert frames and all(frame.startswith("harness/measure/tracing/") for frame in frames)


class MixedLinear(nn.Module):
    """The weight cast up for half inputs meets the half input: torch refuses the matmul
    (the float64 reference takes the weight as it is, and runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.dtype in (torch.float16, torch.bfloat16)
        return x @ (self.weight.float() if half else self.weight)  # raises in half


def mixed_linear() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    return MixedLinear(), {"x": torch.randn(2, 4)}


def test_a_model_checked_from_the_projects_root_is_blamed_at_its_own_line(
    clean_registry: None,
) -> None:
    """Run as ``check`` runs a model whose file lies in the project's root, its ``half``
    cell raises under the dtype tracer: the record's frames are the model's alone."""
    case = model_case(
        "mixed-linear", mixed_linear, Matrix(dtypes=("float16",), modes=("half",)),
        str(ROOT / "model.py"),
    )  # fmt: skip
    (record,) = [execute.run_cell(cell) for cell in expand([case]).to_run if cell.mode == "half"]
    assert record.outcome is Outcome.RAISES, (record.crash_kind, record.error_message)
    assert record.error_frames, record
    assert all(not frame.startswith("harness/") for frame in record.error_frames)
    assert record.error_frames[-1].startswith(f"{HERE}:")
    assert record.error_frames[-1].endswith(" in forward")
