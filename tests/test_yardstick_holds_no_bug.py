"""A yardstick never holds the bug (docs/tolerance.md): gradients are rounded as a scaled
step holds them, buffers of integers the dtype cannot hold stay exact, the float32
control's yardstick is float32 arithmetic, a float64 reference must be float64 and finite,
and sparse gradients are judged. Each model beside its healthy twin."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.measure import execute
from harness.measure.authoring import registry
from harness.measure.authoring.case import (
    Case,
    FailureSignature,
    RunContext,
    Size,
    Symptom,
    Upstream,
    Workload,
    fix,
)
from harness.measure.authoring.model_case import Matrix, model_case
from harness.measure.judge.float32_arithmetic import Float32Arithmetic, accumulated_terms
from harness.measure.judge.numerics import ROUNDING_FACTOR, rounding_ratio
from harness.measure.judge.rounding import counts_beyond, noise_source, round_gradient
from harness.measure.tracing.backward_sites import all_finite
from harness.runner.matrix import expand
from harness.schema.axes import FORWARD_STAGE, TRAIN_STAGE
from harness.schema.records import CellRecord, CrashKind, outcome_label

WIDTH = 32


def cells_of(
    name: str,
    factory: Callable[..., Any],
    dtypes: tuple[str, ...] = ("float16", "bfloat16"),
    modes: tuple[str, ...] = ("half",),
    stage: str = TRAIN_STAGE,
) -> dict[str, CellRecord]:
    """A model's cells of ``stage`` by ``dtype/mode``, run as a ``check`` worker runs them."""
    matrix = Matrix(dtypes=dtypes, modes=modes, stages=(stage,))
    case = model_case(name, factory, matrix, __file__)
    return {
        f"{c.dtype}/{c.mode}": execute.run_cell(c)
        for c in expand([case]).to_run
        if c.stage == stage
    }


def labels(records: dict[str, CellRecord]) -> dict[str, str]:
    return {where: outcome_label(r) for where, r in records.items()}


# gradient underflow ----------------------------------------------------------------------

TOKENS, VOCAB = 16384, 64


class TokenHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.proj(x)))


@registry.register
class CrossEntropyOverManyTokens(Case):
    """Cross-entropy averaged over 16,384 tokens: each logit's gradient is about 1e-6,
    below float16's smallest normal number; without a GradScaler it loses precision."""

    name = "cross-entropy-many-tokens"
    title = "cross-entropy over 16,384 tokens in float16 autocast, with and without a scaler"
    upstream = Upstream(repo="pytorch/pytorch", file="docs/source/amp.rst", commit="")
    failure = FailureSignature("RuntimeError", "never raised", silent=(Symptom.BEYOND_YARDSTICK,))
    reference_fix = "grad-scaler"
    dtypes = ("float16",)
    modes = ("autocast",)
    backends = ("eager",)
    stages = (FORWARD_STAGE, TRAIN_STAGE)
    sizes = (Size("small", None, ""),)

    def build(self, ctx: RunContext) -> Workload:
        tokens = {"x": torch.randn(TOKENS, WIDTH), "y": torch.randint(0, VOCAB, (TOKENS,))}
        return Workload(model=TokenHead(), inputs=tokens)

    def loss(self, output: Any, workload: Workload, ctx: RunContext) -> Any:
        return F.cross_entropy(output.to(ctx.upcast_dtype), workload.inputs["y"])

    @fix("none", rationale="float16 autocast without a GradScaler", grad_scaler=False)
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return w.model(w.inputs["x"])

    @fix("grad-scaler", rationale="the AMP recipe: a GradScaler")
    def grad_scaler(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return w.model(w.inputs["x"])


def test_gradient_underflow_without_a_scaler_is_not_in_the_yardstick(
    clean_registry: None,
) -> None:
    """The trusted fix's yardstick takes its step scaled as a GradScaler would (before, it
    ran the same unscaled recipe, 3.8e-3, and excused the unscaled step at 3.8e-3)."""
    registry.register(CrossEntropyOverManyTokens)
    case = registry.get("cross-entropy-many-tokens")
    records = {
        c.fix: execute.run_cell(c)
        for c in expand([case]).to_run
        if c.stage == TRAIN_STAGE and c.mode == "autocast"
    }
    unscaled, scaled = records["none"], records["grad-scaler"]
    assert outcome_label(scaled) == "passes" and scaled.numerics is not None
    assert outcome_label(unscaled) == "inaccurate" and unscaled.numerics is not None
    assert unscaled.numerics.decided_by == "fix grad-scaler"
    assert unscaled.numerics.rel_err > 2 * unscaled.numerics.tolerance
    assert unscaled.numerics.rel_err > 5 * scaled.numerics.rel_err


def test_a_gradient_is_rounded_as_a_scaled_step_holds_it() -> None:
    """A float16 gradient of 1e-7 keeps float16's precision (held 2**16 times larger);
    one of 1e5, beyond float16's range at that scale, is held at a smaller one."""
    noise = noise_source()
    for size in (1e-7, 1e5):
        grad = torch.full((8,), size, dtype=torch.float64) * torch.linspace(1, 2, 8)
        held = round_gradient(grad, "float16", noise)
        assert torch.isfinite(held).all()
        assert ((held - grad).abs() / grad).max() <= 2.0**-11


# integers a half buffer cannot hold -------------------------------------------------------


class RotaryPositions(nn.Module):
    """Rotary embedding at positions 3000 and up, kept in a buffer: float (``.half()``
    rounds it: float16 holds every second integer there, bfloat16 every sixteenth) or an
    integer one (the healthy twin); the angles computed in float32 (float64 in the
    reference)."""

    def __init__(self, floating: bool, tokens: int = 64, start: int = 3000) -> None:
        super().__init__()
        positions = torch.arange(start, start + tokens)
        self.register_buffer("positions", positions.float() if floating else positions)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        wide = torch.promote_types(x.dtype, torch.float32)
        inv_freq = 1.0 / 10000 ** (torch.arange(0, WIDTH, 2, dtype=wide) / WIDTH)
        positions = self.get_buffer("positions")
        angles = positions.to(wide)[:, None] * inv_freq[None, :]
        cos, sin = angles.cos().to(h.dtype), angles.sin().to(h.dtype)
        even, odd = h[..., 0::2], h[..., 1::2]
        return self.out(torch.cat((even * cos - odd * sin, even * sin + odd * cos), dim=-1))


def float_positions() -> tuple[Any, ...]:
    return RotaryPositions(floating=True), {"x": torch.randn(2, 64, WIDTH)}


def integer_positions() -> tuple[Any, ...]:
    return RotaryPositions(floating=False), {"x": torch.randn(2, 64, WIDTH)}


def test_positions_in_a_half_buffer_fail_and_their_integer_twin_passes(
    clean_registry: None,
) -> None:
    """Measured: the float buffer's gradients 38 to 107 times their tolerance (before,
    the yardstick rounded the buffer too, and both cells passed); the twin's at most 0.2."""
    bug = cells_of("float-positions", float_positions)
    twin = cells_of("integer-positions", integer_positions)
    assert labels(bug) == {
        "float16/half": "inaccurate",
        "bfloat16/half": "inaccurate",
        "float32/fp32": "passes",
    }
    assert set(labels(twin).values()) == {"passes"}
    for record in bug.values():
        assert record.numerics is not None
        if record.cell.mode == "half":
            assert record.numerics.rel_err > ROUNDING_FACTOR * (record.numerics.tolerance / 2)


def test_only_a_buffer_of_integers_beyond_the_dtypes_exact_range_is_kept() -> None:
    positions = torch.arange(3000, 3064, dtype=torch.float64)
    assert counts_beyond(positions, "float16") and counts_beyond(positions, "bfloat16")
    assert not counts_beyond(positions, "float32")  # float32 holds them exactly
    assert not counts_beyond(torch.arange(0, 200, dtype=torch.float64), "bfloat16")
    assert not counts_beyond(positions + 0.5, "float16")  # measurements: rounded


# the float64 reference must be float64 and finite -----------------------------------------


class CastsItself(nn.Module):
    """A model that casts itself to bfloat16 in its forward (or, the twin, follows the
    dtype of its weights)."""

    def __init__(self, casts: bool) -> None:
        super().__init__()
        self.casts = casts
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.casts:
            self.to(torch.bfloat16)
        return self.lin(x.to(self.lin.weight.dtype))


class LogOfNegatives(nn.Module):
    """log(x - 10) of a standard normal: NaN in every dtype (the twin: log(x + 10))."""

    def __init__(self, shift: float) -> None:
        super().__init__()
        self.shift = shift
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.log(x + self.shift)


def test_a_model_that_casts_itself_is_judged_against_float64(clean_registry: None) -> None:
    """Before, its float64 reference and its float16 yardstick were bfloat16, and every
    cell passed. The float64 run keeps float64 where the model casts (its ``self.to``
    included: :mod:`harness.measure.running.stays_float64`), so its float16 cell, which
    computes in bfloat16, is judged against float64, and so is its float32 control; its
    bfloat16 cell casts to its own dtype, and passes."""
    bug = cells_of("casts-itself", lambda: (CastsItself(True), {"x": torch.randn(4, WIDTH)}))
    twin = cells_of("follows-weights", lambda: (CastsItself(False), {"x": torch.randn(4, WIDTH)}))
    assert labels(bug) == {
        "float16/half": "inaccurate[not-half]",
        "bfloat16/half": "passes",
        "float32/fp32": "inaccurate",
    }
    trail = bug["float16/half"].trail
    assert trail is not None and trail.compute_dtypes["matmul"] == ("bfloat16",)
    assert set(labels(twin).values()) == {"passes"}


class HeadInBfloat16(nn.Module):
    """A tied head computed in bfloat16 whatever the run's dtype (``x.to(torch.bfloat16)``
    and the tied weight ``.to(torch.bfloat16)`` in its forward), or, the twin, in the
    activations' dtype."""

    def __init__(self, hard_coded: bool) -> None:
        super().__init__()
        self.hard_coded = hard_coded
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(self.embed(ids)))
        dtype = torch.bfloat16 if self.hard_coded else h.dtype
        return F.linear(h.to(dtype), self.embed.weight.to(dtype)).to(h.dtype)


def test_a_cast_to_a_fixed_dtype_is_judged_against_float64_not_against_itself(
    clean_registry: None,
) -> None:
    """The float64 reference and its yardsticks keep float64 where the code casts to a
    narrower dtype (:mod:`harness.measure.running.stays_float64`): before, they computed
    the head in bfloat16 too, and the float32 control passed a head 2.1e4 times its
    twin's error."""
    ids = torch.randint(0, VOCAB, (4, 8))
    matrix: dict[str, Any] = {"dtypes": ("bfloat16",), "modes": ("half",)}
    bug = cells_of("head-in-bf16", lambda: (HeadInBfloat16(True), {"ids": ids}), **matrix)
    twin = cells_of("head-follows", lambda: (HeadInBfloat16(False), {"ids": ids}), **matrix)
    assert labels(bug)["float32/fp32"] == "inaccurate"
    assert labels(twin) == {"bfloat16/half": "passes", "float32/fp32": "passes"}


def test_a_model_not_finite_in_float64_fails_its_reference_naming_float64(
    clean_registry: None,
) -> None:
    """Before: ``inaccurate (1 x eps)`` in every cell, its note naming a harness file."""
    x = torch.randn(4, WIDTH)
    bug = cells_of("log-of-negatives", lambda: (LogOfNegatives(-10.0), {"x": x}))
    twin = cells_of("log-of-positives", lambda: (LogOfNegatives(10.0), {"x": x}))
    for record in bug.values():
        assert record.crash_kind is CrashKind.REFERENCE_FAILED
        message = record.error_message or ""
        assert message.startswith("the float64 reference's output is not finite (loss")
        assert not any("harness" in frame for frame in record.error_frames)
    assert set(labels(twin).values()) == {"passes"}


# the float32 control's yardstick is float32 arithmetic -----------------------------------


class NormOverTokens(nn.Module):
    """A LayerNorm over 2048 tokens (its weight gradient a float32 sum of 2048 terms), or
    the same attention-free block whose float32 values go through bfloat16 (``downcast``:
    a float32 bug, what a kernel that takes only half inputs does)."""

    def __init__(self, downcast: bool = False) -> None:
        super().__init__()
        self.downcast = downcast
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        if self.downcast and h.dtype == torch.float32:
            h = h.to(torch.bfloat16).to(torch.float32)
        return self.out(self.norm(h))


def norm_over_tokens() -> tuple[Any, ...]:
    return NormOverTokens(), {"x": torch.randn(2048, WIDTH)}


def downcast_norm_over_tokens() -> tuple[Any, ...]:
    return NormOverTokens(downcast=True), {"x": torch.randn(2048, WIDTH)}


def test_a_long_float32_reduction_passes_the_control_and_a_half_one_does_not(
    clean_registry: None,
) -> None:
    """Measured: the LayerNorm's weight gradient over 2048 tokens cost 28 times a
    yardstick without float32 arithmetic; against float32 arithmetic it costs under one.
    The twin that rounds through bfloat16 costs hundreds of times it."""
    healthy = cells_of("norm-over-tokens", norm_over_tokens, ("float16",))["float32/fp32"]
    broken = cells_of("downcast-norm", downcast_norm_over_tokens, ("float16",))["float32/fp32"]
    assert outcome_label(healthy) == "passes" and healthy.numerics is not None
    assert (rounding_ratio(healthy.numerics) or 0) < ROUNDING_FACTOR / 4
    assert outcome_label(broken) == "inaccurate" and broken.numerics is not None
    assert (rounding_ratio(broken.numerics) or 0) > 10 * ROUNDING_FACTOR


def test_float32_arithmetic_moves_each_result_by_its_accumulated_roundoff() -> None:
    """A matmul summing 4096 terms moves by at most sqrt(4096) unit roundoffs; positions
    (integers float32 holds) and copies do not move."""
    a = torch.randn(4, 4096, dtype=torch.float64)
    b = torch.randn(4096, 3, dtype=torch.float64)
    with Float32Arithmetic(2.0**-24, noise_source()):
        product = a @ b
        positions = torch.arange(3000, 3010, dtype=torch.float64) * 1.0
        copied = a.clone()
    exact = a @ b
    moved = ((product - exact) / exact).abs().max().item()
    assert 2.0**-24 < moved <= 64 * 2.0**-24
    assert torch.equal(positions, torch.arange(3000, 3010, dtype=torch.float64))
    assert torch.equal(copied, a)
    assert accumulated_terms(torch.ops.aten.mm.default, (a, b), exact) == 4096


# sparse gradients -----------------------------------------------------------------------


class SparseRotary(RotaryPositions):
    """Token ids through ``nn.Embedding(sparse=True)`` into the rotary block."""

    def __init__(self, floating: bool) -> None:
        super().__init__(floating)
        self.embed = nn.Embedding(100, WIDTH, sparse=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(self.embed(ids))


def test_sparse_gradients_are_trained_and_judged(clean_registry: None) -> None:
    """Before, every train cell crashed in the harness's own finiteness check."""
    ids = torch.randint(0, 100, (2, 64))
    healthy = cells_of("sparse-rotary", lambda: (SparseRotary(False), {"ids": ids}))
    broken = cells_of("sparse-float-positions", lambda: (SparseRotary(True), {"ids": ids}))
    assert set(labels(healthy).values()) == {"passes"}
    assert healthy["float16/half"].leaves is not None
    assert "grad.embed.weight" in healthy["float16/half"].leaves
    assert labels(broken)["float16/half"] == "inaccurate"
    where = torch.tensor([[0, 2]])
    finite = torch.sparse_coo_tensor(where, torch.tensor([1.0, 2.0]), (4,), check_invariants=True)
    not_finite = torch.sparse_coo_tensor(
        where, torch.tensor([1.0, math.nan]), (4,), check_invariants=True
    )
    assert all_finite([finite]) and not all_finite([not_finite])
