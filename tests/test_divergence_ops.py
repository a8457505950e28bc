"""The divergence profile's op (issue 40): inside the first module beyond its rounding,
the first op that crossed (or, for a non-finite output, made inf or NaN from finite
inputs), with the line that called it; where no module crossed, the op in the fix's own
code. The 12-layer toy of ``tests/test_divergence.py`` and the built-in silent cases."""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from harness.measure import execute
from harness.measure.authoring import registry
from harness.measure.judge.divergence_ops import FIX_CODE, first_op
from harness.schema.axes import Cell
from harness.schema.records import Outcome
from tests.test_divergence import Attention, LayerNorm, Mlp, forward_record, toy
from zoo.divergence_models import one_thread

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def registered(clean_registry: None) -> Iterator[None]:
    """The built-in cases on one thread (float16 on two is slow on a shared CPU)."""
    with one_thread():
        registry.discover()
        yield


def line_of(source: object, text: str) -> str:
    """``path:LINE`` (from the project's root) of the line of ``source`` holding ``text``."""
    lines, start = inspect.getsourcelines(source)  # type: ignore[arg-type]
    (offset,) = [i for i, line in enumerate(lines) if text in line]
    path = Path(inspect.getsourcefile(source) or "").resolve().relative_to(ROOT)  # type: ignore[arg-type]
    return f"{path}:{start + offset if start else offset + 1}"  # a module starts at 0


@pytest.mark.parametrize(
    ("bug", "dtype", "op", "text"),
    [
        # float16: E[x^2] of 1600 stored in half, less E[x]^2: the subtraction cancels
        ("cancelling-variance", "float16", "aten::sub", "(x * x).mean(-1"),
        # bfloat16: the variance cancels below zero, and its square root is NaN
        ("cancelling-variance", "bfloat16", "aten::sqrt", "torch.sqrt(var"),
        # q . k of 80000 overflows float16 before the scale brings it back
        ("logits-scaled-after", "float16", "aten::bmm", "(q @ k.transpose"),
    ],
)
def test_the_op_inside_the_injected_module_is_named_at_its_line(
    bug: str, dtype: str, op: str, text: str
) -> None:
    hot = bug == "logits-scaled-after"
    record = forward_record(f"toy-op-{bug}-{dtype}", toy(bug, 2, hot), dtype)
    found = record.divergence
    assert record.outcome is Outcome.INACCURATE and found is not None
    kind = LayerNorm if found.kind == "LayerNorm" else Attention
    assert found.module == ("blocks.2.norm1" if kind is LayerNorm else "blocks.2.attn")
    assert found.op == f"{op} ({line_of(kind.forward, text)})"
    assert f", {found.op}" in found.describe()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("kind", [LayerNorm, Attention, Mlp])
def test_a_healthy_module_names_no_op(kind: type[torch.nn.Module], dtype: str) -> None:
    """Each op of a healthy module, on activations of mean 40 (those the toy's norms meet),
    stays within ten times the yardstick's error along the same ops."""
    torch.manual_seed(0)
    module = kind(16).double()
    x = torch.randn(2, 8, 16, dtype=torch.float64) + (40.0 if kind is LayerNorm else 0.0)
    half = TORCH[dtype]
    cell = kind(16).to(half)
    stick = kind(16).double()
    cell.load_state_dict(module.state_dict())
    stick.load_state_dict({k: v.to(half).double() for k, v in module.state_dict().items()})
    found = first_op(
        lambda: module(x),
        lambda: stick(x.to(half).double()),
        lambda: cell(x.to(half)),
        dtype,
        10.0,
        non_finite=False,
    )
    assert (found.op, found.why) == (None, "no op went beyond its rounding")


TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}
#: The lines of the ``baddbmm`` call in ``cases/fp16_attn_overflow.py``, after its first.
CALL_LINES = 6


@pytest.mark.parametrize(
    ("case", "module", "op", "text"),
    [
        # the attention's score computation: q k^T overflows float16 (get_attention_scores)
        ("fp16-attn-overflow", "", "aten::baddbmm", "scores = torch.baddbmm("),
        # the ``wo`` projection upstream kept in float32: 73000 is beyond float16
        ("t5-wo-keep-fp32", "ff.DenseReluDense.wo", "aten::mm", None),
    ],
)
def test_a_built_in_case_names_the_op_in_its_module(
    case: str, module: str, op: str, text: str | None
) -> None:
    record = execute.run_cell(Cell(case, "none", "cpu", "float16", "half", "eager"))
    found = record.divergence
    assert record.outcome is Outcome.INACCURATE and found is not None and found.non_finite
    assert found.module == module and found.op is not None
    name, _, where = found.op.partition(" (")
    assert name == op
    source = inspect.getsourcefile(type(registry.get(case)))
    assert source is not None
    path = Path(source).resolve().relative_to(ROOT)
    assert where.startswith(f"{path}:")
    if text is not None:
        model = inspect.getmodule(type(registry.get(case)))
        start = int(line_of(model, text).rpartition(":")[2])
        # a call over several lines: Python reports the line of its last argument
        assert start <= int(where[:-1].rpartition(":")[2]) <= start + CALL_LINES


def test_an_error_made_between_modules_is_named_in_the_fixs_own_code() -> None:
    """``mask-finfo-min-overflow``: no module crosses (the mask is summed in the fix); the
    pad row's ``finfo.min + score`` is ``-inf``, made by the sum from finite inputs."""
    record = execute.run_cell(
        Cell("mask-finfo-min-overflow", "none", "cpu", "float16", "half", "eager")
    )
    found = record.divergence
    assert record.outcome is Outcome.INACCURATE and found is not None
    assert (found.module, found.kind, found.op) == ("", FIX_CODE, "aten::add")
    assert found.non_finite and math.isinf(found.ratio)
    model = inspect.getmodule(type(registry.get("mask-finfo-min-overflow")))
    assert found.location == line_of(model, "return s + single_min_mask(causal, pad)")
    assert record.profile is not None
    assert all(not m.ratio > found.factor for m in record.profile.forward)
    assert "(the fix's own code, cases/mask_finfo_min_overflow.py:" in found.describe()
