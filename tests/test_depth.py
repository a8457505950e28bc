"""The rounding yardstick holds at any depth (docs/tolerance.md). A model cast to
half precision stores every layer's output in it, a cost that grows with depth; the
yardstick of the modes that cast the model rounds what each module returns as such a model
does, so a healthy model 48 layers deep passes, while a silent bug inside a module still
costs far more than the yardstick."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from harness.measure import execute
from harness.measure.authoring.model_case import Matrix, model_case
from harness.measure.judge import references
from harness.measure.judge.numerics import ROUNDING_FACTOR, rounding_ratio
from harness.measure.judge.rounding import (
    noise_source,
    round_stored,
    rounding_outputs,
    rounds_activations,
)
from harness.runner.matrix import expand
from harness.schema.records import CellRecord, outcome_label
from zoo.silent_bugs import PAIRS

WIDTH = 32
LAYERS = 48


def run_model(name: str, factory: Callable[..., Any], matrix: Matrix) -> list[CellRecord]:
    """Every cell of a model, run in this process as a ``check`` worker runs it."""
    case = model_case(name, factory, matrix, __file__)
    return [execute.run_cell(cell) for cell in expand([case]).to_run]


def post_layernorm_encoder() -> tuple[Any, ...]:
    """BERT's shape in plain torch, 48 layers deep: a LayerNorm after each residual add
    (``norm_first=False``), weights drawn with BERT's standard deviation of 0.02 and zero
    biases. Each sublayer adds little to a residual stream of unit size, so what storing
    that stream in half costs dwarfs what rounding the weights costs."""
    layer = nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, norm_first=False)
    model = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False).eval()
    for name, parameter in model.named_parameters():
        if parameter.dim() > 1:
            nn.init.normal_(parameter, std=0.02)
        elif "norm" not in name:
            nn.init.zeros_(parameter)
    return model, {"src": torch.randn(8, 2, WIDTH)}


def test_a_healthy_post_layernorm_encoder_48_layers_deep_passes_in_half(
    clean_registry: None,
) -> None:
    records = run_model("post-ln-48l", post_layernorm_encoder, Matrix(modes=("half",)))
    assert sorted((r.cell.dtype, r.cell.mode, outcome_label(r)) for r in records) == [
        ("bfloat16", "half", "passes"),
        ("float16", "half", "passes"),
        ("float32", "fp32", "passes"),
    ]
    fp16 = next(r for r in records if r.cell.dtype == "float16")
    assert fp16.numerics is not None and fp16.numerics.decided_by == "rounding to float16"
    # rounding its weights and inputs alone would have called it inaccurate
    data_only = references.rounding(references.workpiece(fp16.cell), "float16", (), False)
    assert fp16.numerics.rel_err > ROUNDING_FACTOR * data_only.rel_errs["output"]


def test_a_silent_bug_inside_a_module_still_fails_in_half(clean_registry: None) -> None:
    """The linear-attention state summed token by token in float16: the bug that costs the
    least over the yardstick in ``benchmarks/bench_verdicts.py``."""
    matrix = Matrix(dtypes=("float16",), modes=("half",))
    records = run_model("state-summed-in-half", PAIRS["state-summed-in-half"].bug, matrix)
    (half,) = [r for r in records if r.cell.mode == "half"]
    assert outcome_label(half) == "inaccurate"
    assert half.numerics is not None and half.numerics.decided_by == "rounding to float16"
    assert (rounding_ratio(half.numerics) or 0) > ROUNDING_FACTOR


def test_activations_are_rounded_wherever_the_weights_are_in_the_cells_dtype() -> None:
    """Under autocast the weights stay float32 and so do the residual stream, the norms and
    the softmax: its yardstick rounds the weights and inputs only."""
    modes = ("half", "half-autocast", "fp32", "autocast")
    assert [rounds_activations(m) for m in modes] == [True, True, True, False]


def test_tf32_data_store_float32_activations() -> None:
    """A GPU multiplies float32 matrices in TF32 and stores float32: the activations move by
    float32's simulated rounding, not TF32's."""
    model = nn.Linear(64, 64).double()
    x = torch.randn(4, 64, dtype=torch.float64)
    exact = model(x)
    with rounding_outputs(model, "tf32", ()):
        moved = ((model(x) - exact) / exact).abs().max().item()
    assert 0 < moved <= 2.0**-24


def test_the_hooks_last_as_long_as_the_yardsticks_run() -> None:
    """diffusers 0.31 hands every model the same ``nn.SiLU``: a hook left on it would round
    the next model's activations (and, simulating float32, make them float64)."""
    shared = nn.SiLU()
    model = nn.Sequential(nn.Linear(8, 8), shared).double()
    x = torch.randn(2, 8, dtype=torch.float64)
    with rounding_outputs(model, "float32", ()):
        assert shared._forward_hooks
    assert not any(m._forward_hooks for m in model.modules())
    assert shared(x.half()).dtype == torch.float16
    assert torch.equal(model(x), shared(model[0](x)))


def outputs_seen(model: nn.Module, skip: tuple[nn.Module, ...] = ()) -> dict[str, Any]:
    """What each module of ``model`` returns, after the hooks registered before this one
    (those in ``skip`` and inside them left alone)."""
    seen: dict[str, Any] = {}
    inside = {id(m) for s in skip for m in s.modules()}
    for name, module in model.named_modules():
        if id(module) in inside:
            continue
        module.register_forward_hook(
            lambda _module, _args, output, name=name: seen.__setitem__(name, output)
        )
    return seen


def is_float16(tensor: torch.Tensor) -> bool:
    return torch.equal(tensor, tensor.half().double())


def test_a_kept_module_and_the_modules_holding_it_return_what_they_computed() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8))).double()
    with rounding_outputs(model, "float16", ("1.0",)):
        seen = outputs_seen(model)
        model(torch.randn(2, 8, dtype=torch.float64))
    assert is_float16(seen["0"])
    assert not any(is_float16(seen[name]) for name in ("1.0", "1", ""))  # kept, holders


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_a_scripted_module_takes_no_hook_and_its_parent_is_rounded() -> None:
    scripted = torch.jit.script(nn.Sequential(nn.Linear(8, 8)).double())
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(scripted)).double()
    with rounding_outputs(model, "float16", ()):
        seen = outputs_seen(model, skip=(scripted,))
        model(torch.randn(2, 8, dtype=torch.float64))
    assert is_float16(seen["1"]) and is_float16(seen[""])


def test_a_module_output_is_rounded_in_its_structure_and_its_range() -> None:
    class Several(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
            return x * 3, {"big": x * 1e5, "count": 3, "ids": torch.arange(3)}

    model = Several()
    x = torch.tensor([1 + 2**-20, 1.0], dtype=torch.float64)
    with rounding_outputs(model, "float16", ()):
        scaled, extra = model(x)
    assert is_float16(scaled) and extra["count"] == 3 and extra["ids"].tolist() == [0, 1, 2]
    # 1e5 is beyond float16's range: left as it is, not made infinite
    assert torch.equal(extra["big"], x * 1e5)
    assert torch.equal(round_stored(x * 1e5, "float16", noise_source()), x * 1e5)
