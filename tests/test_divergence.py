"""The divergence profile (issue 40): a failing forward cell names the first module that
left float64 beyond its rounding, measured on float64's own inputs; a passing cell is not
profiled. A healthy 12-layer model beside the same model with one bug at a chosen depth,
in float16 and bfloat16, and a built-in case."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from harness.measure import execute
from harness.measure.authoring import registry
from harness.measure.authoring.model_case import Matrix, model_case
from harness.measure.judge import divergence
from harness.runner.matrix import expand
from harness.runner.progress import progress_label
from harness.schema.axes import FORWARD_STAGE, TRAIN_STAGE, Cell
from harness.schema.divergence import Divergence, ModuleRatio, Profile
from harness.schema.records import CellRecord, MalformedRecord, NoteKind, Outcome
from harness.schema.typed import finite_json

WIDTH, HEADS, TOKENS, LAYERS = 16, 2, 8, 12
#: The residual stream's shared offset: activations of mean 40, where a variance taken as
#: ``E[x^2] - E[x]^2`` in half cancels (``zoo/silent_bugs.py``'s bug).
OFFSET = 40.0
#: The query and key projections' bias in the block whose logits the bug scales after the
#: product: ``q . k`` about 8 * 100**2 = 80000 (beyond float16's 65504; 8 dimensions a
#: head), the scaled logits ``8**-0.5`` of it.
HOT_BIAS = 100.0


class CancellingBackward(torch.autograd.Function):
    """A LayerNorm's normalisation (no affine) that saves only its input, as a
    memory-saving norm does, and whose backward takes the statistics again with the
    variance as ``E[x^2] - E[x]^2``: in the input's dtype, with activations of mean 40,
    it cancels (a bug that shows in backward only: the forward is as people write it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        mean = x.mean(-1, keepdim=True)
        return (x - mean) * torch.rsqrt((x - mean).pow(2).mean(-1, keepdim=True) + 1e-5)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        mean = x.mean(-1, keepdim=True)
        inv = torch.rsqrt((x * x).mean(-1, keepdim=True) - mean * mean + 1e-5)
        normed = (x - mean) * inv
        projection = (grad * normed).mean(-1, keepdim=True)
        return inv * (grad - grad.mean(-1, keepdim=True) - normed * projection)


class LayerNorm(nn.Module):
    """LayerNorm as people write it; ``cancelling``: the variance as ``E[x^2] - E[x]^2``;
    ``cancelling_backward``: its backward's projection so (:class:`CancellingBackward`)."""

    def __init__(
        self, width: int, cancelling: bool = False, cancelling_backward: bool = False
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))
        self.cancelling = cancelling
        self.cancelling_backward = cancelling_backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cancelling_backward:
            return CancellingBackward.apply(x) * self.weight + self.bias
        mean = x.mean(-1, keepdim=True)
        if self.cancelling:
            var = (x * x).mean(-1, keepdim=True) - mean * mean
        else:
            var = (x - mean).pow(2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * self.weight + self.bias


class Attention(nn.Module):
    """Multi-head self-attention; ``scaled_after``: the logits scaled after ``q @ k^T``."""

    def __init__(self, width: int, bias: float = 0.0, scaled_after: bool = False) -> None:
        super().__init__()
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.scaled_after = scaled_after
        with torch.no_grad():
            self.q.bias.add_(bias)
            self.k.bias.add_(bias)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        return x.view(b, n, HEADS, -1).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(self.q(x)), self.heads(self.k(x)), self.heads(self.v(x))
        scale = q.shape[-1] ** -0.5
        if self.scaled_after:
            logits = (q @ k.transpose(-1, -2)) * scale
        else:
            logits = (q * scale) @ k.transpose(-1, -2)
        attn = logits.softmax(-1) @ v
        b, _, n, _ = attn.shape
        return self.out(attn.transpose(1, 2).reshape(b, n, -1))


class Mlp(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """A pre-LayerNorm transformer block."""

    def __init__(self, norm: LayerNorm, attn: Attention) -> None:
        super().__init__()
        self.norm1 = norm
        self.attn = attn
        self.norm2 = LayerNorm(WIDTH)
        self.mlp = Mlp(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Toy(nn.Module):
    def __init__(self, blocks: list[Block]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.norm = LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


#: What a bug changes in the block at its depth, and the module the profile must name.
BUGS: dict[str, str] = {
    "cancelling-variance": "norm1",
    "logits-scaled-after": "attn",
    "cancelling-backward": "norm1",
}


def toy(bug: str | None, depth: int, hot: bool = False) -> Callable[[], Any]:
    """A factory of the 12-layer model, with ``bug`` in the block at ``depth`` (None: the
    healthy twin); ``hot``: that block's query and key projections have the bias that
    makes ``q . k`` overflow float16 (in both twins)."""

    def factory() -> tuple[nn.Module, dict[str, torch.Tensor]]:
        blocks = [
            Block(
                LayerNorm(
                    WIDTH,
                    cancelling=bug == "cancelling-variance" and i == depth,
                    cancelling_backward=bug == "cancelling-backward" and i == depth,
                ),
                Attention(
                    WIDTH,
                    bias=HOT_BIAS if hot and i == depth else 0.0,
                    scaled_after=bug == "logits-scaled-after" and i == depth,
                ),
            )
            for i in range(LAYERS)
        ]
        return Toy(blocks), {"x": torch.randn(2, TOKENS, WIDTH) + OFFSET}

    return factory


def forward_record(
    name: str, factory: Callable[[], Any], dtype: str, stage: str = FORWARD_STAGE
) -> CellRecord:
    """The model's ``stage`` cell in ``dtype``, ``half``, run as a ``check`` worker runs it."""
    matrix = Matrix(dtypes=(dtype,), modes=("half",), stages=(stage,))
    case = model_case(name, factory, matrix, __file__)
    (cell,) = [
        c
        for c in expand([case]).to_run
        if c.stage == stage and c.dtype == dtype and c.mode == "half"
    ]
    return execute.run_cell(cell)


@pytest.fixture(autouse=True)
def registered(clean_registry: None) -> None:
    """The built-in cases, and the models each test adds (dropped after it)."""
    registry.discover()


def injected(bug: str, depth: int) -> str:
    return f"blocks.{depth}.{BUGS[bug]}"


def forward_line(kind: type[nn.Module]) -> str:
    """``file.py:LINE`` of ``kind.forward``'s definition, as ``inspect`` reads it."""
    line = inspect.getsourcelines(kind.forward)[1]
    return f"{Path(inspect.getsourcefile(kind.forward) or '').name}:{line}"


@pytest.mark.parametrize(
    ("bug", "depth", "dtype"),
    [
        ("cancelling-variance", 2, "float16"),
        ("cancelling-variance", 9, "bfloat16"),
        # bfloat16 holds 80000: scaled after or before, the same logits (no bug there)
        ("logits-scaled-after", 2, "float16"),
        ("logits-scaled-after", 9, "float16"),
    ],
)
def test_the_profile_names_the_injected_module(bug: str, depth: int, dtype: str) -> None:
    hot = bug == "logits-scaled-after"
    record = forward_record(f"toy-{bug}-at-{depth}-{dtype}", toy(bug, depth, hot), dtype)
    found = record.divergence
    assert record.outcome is Outcome.INACCURATE and found is not None
    assert found.module == injected(bug, depth)
    kind = LayerNorm if BUGS[bug] == "norm1" else Attention
    assert (found.kind, found.location) == (kind.__name__, forward_line(kind))
    assert found.ratio > found.factor == 10.0
    assert found.ratio_before is not None and found.ratio_before <= found.factor
    assert found.direction == "forward" and found.op is not None  # the op: test_divergence_ops
    assert f"inaccurate: {found.describe()}" in progress_label(record)
    assert f"at {injected(bug, depth)} ({kind.__name__}, " in found.describe()
    assert_the_series_is_whole(record, found)


def assert_the_series_is_whole(record: CellRecord, found: Divergence) -> None:
    """The record's profile holds every module of the toy that is called (a ModuleList is
    not), each once, the model last, and the divergence is its first ratio beyond the factor
    (with the one before it)."""
    assert record.profile is not None and record.profile.factor == found.factor
    series = record.profile.forward
    modules = [m.module for m in series]
    model = toy(None, 0)()[0]
    called = [p for p, m in model.named_modules() if not isinstance(m, nn.ModuleList)]
    assert sorted(modules) == sorted(called)
    assert modules[-1] == ""
    first = next(i for i, m in enumerate(series) if not m.ratio <= found.factor)
    assert series[first] == ModuleRatio(found.module, found.ratio)
    assert series[first - 1].ratio == found.ratio_before


@pytest.mark.parametrize(
    ("depth", "dtype"), [(2, "float16"), (9, "float16"), (2, "bfloat16"), (9, "bfloat16")]
)
def test_a_bug_in_backward_is_named_at_its_module(depth: int, dtype: str) -> None:
    bug = "cancelling-backward"
    record = forward_record(f"toy-back-{depth}-{dtype}", toy(bug, depth), dtype, TRAIN_STAGE)
    found = record.divergence
    assert record.outcome is Outcome.INACCURATE and found is not None
    assert (found.direction, found.module) == ("backward", injected(bug, depth))
    assert (found.kind, found.location) == ("LayerNorm", forward_line(LayerNorm))
    assert found.ratio > found.factor  # the variance cancels to below zero: non-finite
    assert found.ratio_before is not None and found.ratio_before <= found.factor
    assert f"in backward at {found.module} (LayerNorm, " in progress_label(record)
    profile = record.profile
    assert profile is not None and profile.forward and profile.backward
    assert all(m.ratio <= profile.factor for m in profile.forward)  # forward is sound
    order = [m.module for m in profile.backward]
    assert (
        order.index(f"blocks.{depth}.attn")
        < order.index(found.module)
        < order.index(f"blocks.{depth}")
    ), "backward order: the block's attention, its norm, then the block"
    assert order[-1] == ""


@pytest.mark.parametrize(
    ("dtype", "hot", "stage"),
    [
        ("float16", False, FORWARD_STAGE),
        ("bfloat16", False, FORWARD_STAGE),
        ("float16", True, FORWARD_STAGE),
        ("float16", False, TRAIN_STAGE),
        ("bfloat16", False, TRAIN_STAGE),
    ],
)
def test_the_healthy_twin_passes_and_is_not_profiled(
    dtype: str, hot: bool, stage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a cell that passes is profiled")

    monkeypatch.setattr(divergence, "profile", never)
    name = f"toy-healthy-{dtype}-{int(hot)}-{stage}"
    record = forward_record(name, toy(None, 2, hot), dtype, stage)
    assert record.outcome is Outcome.PASSES and record.divergence is None
    assert not [n for n in record.notes if n.kind is NoteKind.DIVERGENCE]


@pytest.mark.parametrize(
    ("case", "module", "kind"),
    [
        # the attention's score computation (get_attention_scores) is the core's own code
        ("fp16-attn-overflow", "", "CrossAttentionCore"),
        # upstream kept ``wo`` in float32 (_keep_in_fp32_modules)
        ("t5-wo-keep-fp32", "ff.DenseReluDense.wo", "Linear"),
    ],
)
def test_a_built_in_case_names_the_module_its_upstream_fix_changed(
    case: str, module: str, kind: str
) -> None:
    record = execute.run_cell(Cell(case, "none", "cpu", "float16", "half", "eager"))
    found = record.divergence
    assert record.outcome is Outcome.INACCURATE and found is not None
    assert (found.module, found.kind) == (module, kind)
    assert found.non_finite and math.isinf(found.ratio)
    assert "first non-finite at" in progress_label(record)


def test_a_failing_profile_keeps_the_verdict_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("out of memory\nsecond line")

    monkeypatch.setattr(divergence, "profile", broken)
    record = forward_record("toy-unprofiled", toy("cancelling-variance", 2), "float16")
    assert record.outcome is Outcome.INACCURATE and record.divergence is None
    (note,) = [n for n in record.notes if n.kind is NoteKind.DIVERGENCE]
    assert note.text == "no divergence profile: RuntimeError: out of memory"


def test_the_divergence_is_a_typed_field_of_the_record() -> None:
    found = Divergence("blocks.2.norm1", "LayerNorm", "toy.py:44", None, 4.1e4, 1.3, 10.0)
    record = CellRecord(
        Cell("c", "none", "cpu", "float16", "half", "eager"),
        "2.13",
        Outcome.INACCURATE,
        divergence=found,
    )
    line = json.dumps(record.to_dict(), allow_nan=False)
    assert CellRecord.from_dict(json.loads(line)).divergence == found
    non_finite = dataclasses.replace(found, ratio=math.inf)
    data = dict(record.to_dict(), divergence=non_finite.to_dict())
    assert (
        CellRecord.from_dict(json.loads(json.dumps(finite_json(data), allow_nan=False))).divergence
        == non_finite
    )
    older = {k: v for k, v in record.to_dict().items() if k not in ("divergence", "profile")}
    assert CellRecord.from_dict(older).divergence is None
    assert CellRecord.from_dict(older).profile is None
    with pytest.raises(MalformedRecord, match=r"divergence\.direction"):
        CellRecord.from_dict(
            dict(record.to_dict(), divergence=dict(found.to_dict(), direction="sideways"))
        )
    assert (
        found.describe()
        == "first beyond rounding at blocks.2.norm1 (LayerNorm, toy.py:44), 4.1e+04x (was 1.3x)"
    )


def test_the_profile_is_a_typed_field_of_the_record() -> None:
    series = Profile(
        10.0,
        forward=(ModuleRatio("blocks.0", 1.2), ModuleRatio("blocks.1", math.inf)),
        backward=(ModuleRatio("blocks.1", math.nan), ModuleRatio("", 0.5)),
    )
    record = CellRecord(
        Cell("c", "none", "cpu", "float16", "half", "eager"),
        "2.13",
        Outcome.INACCURATE,
        profile=series,
    )
    line = json.dumps(record.to_dict(), allow_nan=False)
    assert json.loads(line)["profile"]["forward"][1] == {"module": "blocks.1", "ratio": "Infinity"}
    read = CellRecord.from_dict(json.loads(line)).profile
    assert read is not None and read.forward == series.forward
    assert read.backward[0].module == "blocks.1" and math.isnan(read.backward[0].ratio)
    assert read.backward[1:] == series.backward[1:]
    with pytest.raises(MalformedRecord, match=r"profile\.forward\[0\]"):
        CellRecord.from_dict(dict(record.to_dict(), profile={"factor": 10.0, "forward": [3]}))
    with pytest.raises(MalformedRecord, match=r"ratio"):
        CellRecord.from_dict(
            dict(
                record.to_dict(),
                profile={"factor": 10.0, "forward": [{"module": "a", "ratio": "x"}]},
            )
        )


def toy_cell(name: str, factory: Callable[[], Any], dtype: str = "float16") -> Cell:
    """The forward cell of a toy registered as ``name``, ``half``."""
    case = model_case(name, factory, Matrix(dtypes=(dtype,), modes=("half",)), __file__)
    (cell,) = [c for c in expand([case]).to_run if c.dtype == dtype and c.mode == "half"]
    return cell


def test_profile_asks_for_the_series_of_a_passing_cell() -> None:
    record = execute.run_cell(toy_cell("toy-asked", toy(None, 2)), profile=True)
    assert record.outcome is Outcome.PASSES and record.divergence is None
    assert record.profile is not None and record.profile.forward
    assert all(m.ratio <= record.profile.factor for m in record.profile.forward)
    assert not [n for n in record.notes if n.kind is NoteKind.DIVERGENCE]


def test_a_model_too_large_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a model too large is profiled")

    monkeypatch.setattr(divergence, "profile", never)
    # the toy's float64 parameters, about 110 KB, against 100 KB available
    monkeypatch.setattr(divergence, "available_bytes", lambda: 100_000)
    record = forward_record("toy-too-large", toy("cancelling-variance", 2), "float16")
    assert record.outcome is Outcome.INACCURATE and record.profile is None
    (note,) = [n for n in record.notes if n.kind is NoteKind.DIVERGENCE]
    assert note.text == "too large to profile: 0.0 GiB in float64"


def test_the_profile_keeps_within_the_time_it_is_given() -> None:
    cell = toy_cell("toy-timed", toy("cancelling-variance", 2))
    record = execute.run_cell(cell)
    assert record.numerics is not None and record.profile is not None
    unprofiled = dataclasses.replace(record, notes=(), profile=None, divergence=None)
    timed_out = divergence.profiled(registry.get(cell.case), cell, unprofiled, within_s=0.0)
    assert timed_out.profile is None and timed_out.divergence is None
    (note,) = [n for n in timed_out.notes if n.kind is NoteKind.DIVERGENCE]
    assert note.text.startswith("no divergence profile: ProfileTimeout")
