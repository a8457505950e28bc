"""Gradients are judged as outputs are (docs/training.md; calibration: docs/tolerance.md):
the rounding yardstick of a train cell is the float64 step of the rounded model, whose
backward rounds the gradient each module receives as a model in the dtype stores it, so a
healthy model 48 layers deep passes in train, while a gradient summed in half precision
still fails."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.measure import execute
from harness.measure.authoring.model_case import Matrix, model_case
from harness.measure.judge.numerics import ROUNDING_FACTOR, rounding_ratio
from harness.measure.judge.rounding import round_stored, rounding_outputs, stored_rounding
from harness.measure.running import replay
from harness.runner.matrix import expand
from harness.schema.axes import TRAIN_STAGE
from harness.schema.records import CellRecord, NoteKind, outcome_label
from zoo.training_bugs import PAIRS

WIDTH = 16
LAYERS = 48


def train_cell(name: str, factory: Callable[..., Any], dtype: str, mode: str) -> CellRecord:
    """The one train cell of a model in ``dtype`` and ``mode``, run in this process as a
    ``check`` worker runs it."""
    matrix = Matrix(dtypes=(dtype,), modes=(mode,), stages=(TRAIN_STAGE,))
    case = model_case(name, factory, matrix, __file__)
    (cell,) = [c for c in expand([case]).to_run if c.stage == TRAIN_STAGE and c.mode == mode]
    return execute.run_cell(cell)


def post_layernorm_encoder() -> tuple[Any, ...]:
    """BERT's shape in plain torch, 48 layers deep: a LayerNorm after each residual add,
    GELU, weights drawn with BERT's standard deviation of 0.02 and zero biases."""
    return encoder("gelu")


def encoder(activation: str) -> tuple[Any, ...]:
    layer = nn.TransformerEncoderLayer(
        WIDTH, 2, 4 * WIDTH, dropout=0.0, activation=activation, norm_first=False
    )
    model = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False).eval()
    for name, parameter in model.named_parameters():
        if parameter.dim() > 1:
            nn.init.normal_(parameter, std=0.02)
        elif "norm" not in name:
            nn.init.zeros_(parameter)
    return model, {"src": torch.randn(8, 2, WIDTH)}


@pytest.mark.parametrize(("dtype", "mode"), [("float16", "half"), ("bfloat16", "autocast")])
def test_a_healthy_post_layernorm_encoder_48_layers_deep_passes_in_train(
    clean_registry: None, dtype: str, mode: str
) -> None:
    """Each gradient within the factor of its own rounding yardstick. Under autocast the
    yardstick's backward rounds the gradients too: with the weights and inputs alone an
    attention's output bias cost 15.6 times it in bfloat16 (passing only by eps)."""
    record = train_cell("post-ln-48l-train", post_layernorm_encoder, dtype, mode)
    assert outcome_label(record) == "passes"
    assert record.leaves is not None and len(record.leaves) == 1 + 12 * LAYERS
    grads = [n for name, n in record.leaves.items() if name.startswith("grad.")]
    assert all(n.decided_by == f"rounding to {dtype}" for n in grads)
    assert max(rounding_ratio(n) or 0 for n in grads) < ROUNDING_FACTOR


def relu_encoder() -> tuple[Any, ...]:
    """The same encoder with ReLU (T5's, OPT's, ``nn.TransformerEncoder``'s default)."""
    return encoder("relu")


@pytest.mark.parametrize(
    ("dtype", "mode", "ratio_without"),
    [("float16", "half", 244), ("bfloat16", "autocast", 30), ("float16", "autocast", 39)],
)
def test_a_healthy_relu_encoder_48_layers_deep_passes_along_its_own_sides_of_the_kinks(
    clean_registry: None,
    monkeypatch: pytest.MonkeyPatch,
    dtype: str,
    mode: str,
    ratio_without: float,
) -> None:
    """Units within rounding of a ReLU's kink cross it by chance, and each crossing moves
    the gradients before it by the unit's whole share: judged against float64 along the
    cell's own sides (harness.measure.running.replay) the step passes; without the band (width 0)
    the same step reads tens to hundreds of times its rounding."""
    record = train_cell("relu-48l-train", relu_encoder, dtype, mode)
    assert outcome_label(record) == "passes"
    assert [n.kind for n in record.notes if n.kind == NoteKind.REPLAYED] == [NoteKind.REPLAYED]
    assert record.numerics is not None
    assert (rounding_ratio(record.numerics) or 0) < ROUNDING_FACTOR / 2
    monkeypatch.setattr(replay, "KINK_WIDTH", 0.0)
    without = train_cell("relu-48l-train-no-band", relu_encoder, dtype, mode)
    assert outcome_label(without) == "inaccurate" and without.numerics is not None
    assert (rounding_ratio(without.numerics) or 0) > ratio_without / 2
    assert not any(n.kind == NoteKind.REPLAYED for n in without.notes)


def test_a_weight_gradient_accumulated_in_a_half_buffer_fails_in_train(
    clean_registry: None,
) -> None:
    record = train_cell("grad-buffer-in-half", PAIRS["grad-buffer-in-half"].bug, "float16", "half")
    assert outcome_label(record) == "inaccurate"
    assert record.numerics is not None and record.numerics.leaf == "grad.out_weight"
    assert (rounding_ratio(record.numerics) or 0) > ROUNDING_FACTOR


class TokenByTokenReluFeedForward(nn.Module):
    """A ReLU feed-forward applied one token at a time (what transformers'
    ``apply_chunking_to_forward`` does with a chunk size of 1): autograd sums its weights'
    per-token gradients in their dtype. Its units cross the kink by chance too."""

    def __init__(self, tokens: int = 1024) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)
        self.tokens = tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chunks = [self.down(torch.relu(self.up(t))) for t in x.split(1, dim=1)]
        return x + torch.cat(chunks, dim=1)


def token_by_token_relu() -> tuple[Any, ...]:
    return TokenByTokenReluFeedForward(), {"x": torch.randn(1, 1024, WIDTH)}


def test_a_gradient_summed_in_half_still_fails_through_a_relu(clean_registry: None) -> None:
    """Crossings of the kink are forgiven; a gradient summed in half precision is not."""
    record = train_cell("relu-token-by-token", token_by_token_relu, "float16", "half")
    assert outcome_label(record) == "inaccurate"
    assert any(n.kind == NoteKind.REPLAYED for n in record.notes)
    assert record.numerics is not None and (record.numerics.leaf or "").startswith("grad.")
    assert (rounding_ratio(record.numerics) or 0) > ROUNDING_FACTOR


def is_float16(tensor: torch.Tensor) -> bool:
    return torch.equal(tensor, tensor.half().double())


def test_the_gradient_a_module_receives_is_rounded_as_its_output_is() -> None:
    """A model in float16 holds its activations' gradients in float16 too: the yardstick's
    hook rounds both, and under autocast (``values=False``) the gradient only."""
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(4, 8, dtype=torch.float64)
    for values in (True, False):
        model = nn.Linear(8, 8).double()
        exact = model(x)
        with rounding_outputs(model, "float16", (), values=values):
            out = model(x)
        out.backward(upstream)
        assert model.bias.grad is not None
        assert is_float16(out.detach()) is values
        assert torch.equal(model.bias.grad, upstream.half().double().sum(0))
        assert not values or not torch.equal(out, exact)


def test_a_simulated_rounding_moves_the_gradient_by_noise_of_its_own() -> None:
    """float32 data are rounded by noise: the gradient gets its own, not the value's (an
    integer gradient, which float32 holds exactly, is not moved)."""
    model = nn.Linear(64, 64).double()
    x = torch.randn(4, 64, dtype=torch.float64)
    upstream = torch.full((4, 64), 0.1, dtype=torch.float64)
    exact = model(x)
    with rounding_outputs(model, "float32", ()):
        out = model(x)
    out.backward(upstream)
    assert model.bias.grad is not None
    value_noise = out.detach() / exact.detach() - 1
    grad_noise = model.bias.grad / 0.4 - 1
    assert 0 < grad_noise.abs().max() <= 4 * 2.0**-24
    assert not torch.allclose(grad_noise, value_noise.mean(0), rtol=0, atol=2.0**-30)


def test_under_autocast_a_float16_gradient_is_rounded_as_the_scaled_recipe_holds_it() -> None:
    """float16 trains with a dynamic loss scale (a GradScaler under autocast, one the
    harness holds for half weights): a gradient of 1e-7, below float16's smallest normal
    number, is held scaled (2**16 times larger) and keeps its precision in the yardstick of
    both, so an unscaled step that loses it is not excused; stored unscaled, it would have
    lost it."""
    model = nn.Linear(8, 8).double()
    x = torch.randn(4, 8, dtype=torch.float64)
    upstream = torch.full((4, 8), 1e-7, dtype=torch.float64)

    def bias_grad_error(stored: AbstractContextManager[None]) -> float:
        model.zero_grad()
        with stored:
            out = model(x)
        out.backward(upstream)
        assert model.bias.grad is not None
        return (model.bias.grad / 4e-7 - 1).abs().max().item()

    autocast = stored_rounding(model, "float16", (), activations=False, stage=TRAIN_STAGE)
    assert bias_grad_error(autocast) <= 2.0**-11
    half = stored_rounding(model, "float16", (), activations=True, stage=TRAIN_STAGE)
    assert bias_grad_error(half) <= 2.0**-11
    noise = torch.Generator().manual_seed(0)
    unscaled = round_stored(torch.full((4,), 1e-7, dtype=torch.float64), "float16", noise)
    assert (unscaled.sum() / 4e-7 - 1).abs().item() > 1e-2


class BiasedAttention(nn.Module):
    """Attention with a trainable position bias as SDPA's mask (T5's way): with a mask
    that needs a gradient, torch takes SDPA's math fallback, which computes half q, k and v
    in float32 by design; ``upcast`` makes the code itself call SDPA in float32. Its output
    projection casts its input to its weight's dtype (T5's ``wo``), and back."""

    def __init__(self, upcast: bool = False) -> None:
        super().__init__()
        self.upcast = upcast
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.bias = nn.Parameter(torch.randn(1, 2, 12, 12) * 0.1)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, WIDTH // 2)).permute(2, 0, 3, 1, 4)
        if self.upcast:
            q, k, v = q.float(), k.float(), v.float()
        attention = F.scaled_dot_product_attention(q, k, v, attn_mask=self.bias.to(q.dtype))
        hidden = attention.transpose(1, 2).flatten(-2).to(x.dtype)
        return self.out(hidden.to(self.out.weight.dtype)).to(x.dtype)


def biased_attention() -> tuple[Any, ...]:
    return BiasedAttention(), {"x": torch.randn(2, 12, WIDTH)}


def upcast_attention() -> tuple[Any, ...]:
    return BiasedAttention(upcast=True), {"x": torch.randn(2, 12, WIDTH)}


def test_what_torch_computes_inside_sdpa_and_in_backward_is_no_drift(clean_registry: None) -> None:
    """Called with half q, k and v, SDPA's math fallback computes in float32 (the cell's
    compute dtypes say so) and the output's projection, kept float32, has a float32
    backward: neither is the model's choice, and neither is drift."""
    matrix = Matrix(
        dtypes=("float16",), modes=("half",), stages=(TRAIN_STAGE,), keep_fp32=("out",)
    )
    case = model_case("biased-attention", biased_attention, matrix, __file__)
    (cell,) = [c for c in expand([case]).to_run if c.stage == TRAIN_STAGE and c.mode == "half"]
    record = execute.run_cell(cell)
    assert outcome_label(record) == "passes"
    assert record.trail is not None and "float32" in record.trail.compute_dtypes["matmul"]


def test_sdpa_called_in_float32_by_the_code_drifts(clean_registry: None) -> None:
    record = train_cell("upcast-attention", upcast_attention, "float16", "half")
    assert [flag.kind for flag in record.flags] == ["drift"]
