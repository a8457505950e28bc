"""Only precision may differ (harness.measure.running.replay): healthy models written the
way people write them, with random draws in the step and discrete choices that rounding can
flip, pass every train cell, judged through the real path; each one's buggy twin (the
variance as E[h²] - E[h]² in the activations' dtype) does not."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from harness.measure import execute
from harness.measure.authoring.model_case import Matrix, model_case
from harness.measure.authoring.recipes import Recipe
from harness.measure.judge.references import reference_leaves, workpiece
from harness.measure.running import replay
from harness.runner.matrix import expand
from harness.schema.axes import FIT_STAGE, TRAIN_STAGE
from harness.schema.records import CellRecord, NoteKind, outcome_label
from harness.schema.selection import Selection

WIDTH = 16
TOKENS = 64
BATCH = 4


class Head(nn.Module):
    """Pools the tokens by their spread about an offset mean: the healthy variance, or
    (``bug``) the textbook shortcut E[h²] - E[h]² in the activations' dtype, which cancels
    (the mean is 8, the spread about 1: float16 loses three bits, bfloat16 all of them)."""

    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.bug = bug
        self.proj = nn.Linear(WIDTH, WIDTH)
        nn.init.constant_(self.proj.bias, 8.0)
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        mean = h.mean(1)
        if self.bug:
            spread = (h * h).mean(1) - mean * mean
        else:
            spread = (h - mean[:, None]).square().mean(1)
        return self.out(spread)


def mlp(width: int = WIDTH, activation: Callable[[], nn.Module] = nn.GELU) -> nn.Module:
    return nn.Sequential(nn.Linear(width, 2 * width), activation(), nn.Linear(2 * width, width))


class DropPath(nn.Module):
    """timm's stochastic depth, written with ``torch.rand`` in the input's dtype."""

    def __init__(self, p: float = 0.25) -> None:
        super().__init__()
        self.p = p
        self.block = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = 1 - self.p
        shape = (x.shape[0],) + (1,) * (x.dim() - 1)
        mask = (keep + torch.rand(shape, dtype=x.dtype, device=x.device)).floor_()
        return x + self.block(x) * mask / keep


class Dropped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Dropout(0.1))
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.block(x))


class TopTwoMoE(nn.Module):
    """Top-2 expert routing on a router softmax, tokens dispatched by index."""

    def __init__(self, experts: int = 8) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, experts)
        self.experts = nn.ModuleList(mlp() for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, WIDTH)
        weights, chosen = torch.topk(self.router(tokens).softmax(-1), 2, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == e)
            if token.numel():
                routed = expert(tokens[token]) * weights[token, slot, None]
                out = out.index_add(0, token, routed.to(out.dtype))
        return x + out.reshape(x.shape)


class Checkpointed(nn.Module):
    """ReLU blocks under ``torch.utils.checkpoint``."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(mlp(activation=nn.ReLU) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.reentrant)
        return x


class Clamped(nn.Module):
    """Bounded activations: ``clamp``, ``hardtanh``, ``ReLU6``."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = mlp(), mlp(activation=nn.Hardtanh), mlp(activation=nn.ReLU6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.a(x).clamp(-0.3, 0.3)
        x = x + self.b(x) + F.relu6(self.c(x) * 8)
        return x.clamp_min(-2.0)


class Pooled(nn.Module):
    """A small CNN: convolution, ReLU, max-pool, its pixels then the tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, WIDTH, 3, padding=1)
        self.pool = nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.conv(x))).flatten(2).transpose(1, 2)


class Gated(nn.Module):
    """A hard gate (``where`` on a comparison) and a codebook lookup by argmax."""

    def __init__(self, codes: int = 8) -> None:
        super().__init__()
        self.score = nn.Linear(WIDTH, 1)
        self.logits = nn.Linear(WIDTH, codes)
        self.codebook = nn.Parameter(torch.randn(codes, WIDTH) * 0.5)
        self.a, self.b = mlp(), mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gated = torch.where(self.score(x) > 0, self.a(x), self.b(x))
        chosen = F.one_hot(self.logits(x).argmax(-1), self.codebook.shape[0])
        return x + gated + chosen.to(x.dtype) @ self.codebook.to(x.dtype)


BODIES: dict[str, Callable[[], nn.Module]] = {
    "stochastic-depth": lambda: nn.Sequential(*(DropPath() for _ in range(3))),
    "dropout": lambda: nn.Sequential(Dropped(), Dropped()),
    "top-2-moe": TopTwoMoE,
    "checkpoint": lambda: Checkpointed(reentrant=False),
    "checkpoint-reentrant": lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), Checkpointed(True)),
    "clamped": Clamped,
    "max-pool": Pooled,
    "gated": Gated,
}


def factory(body: str, bug: bool) -> Callable[[], tuple[Any, ...]]:
    def build() -> tuple[Any, ...]:
        torch.manual_seed(0)
        model = nn.Sequential(BODIES[body](), Head(bug))
        if body == "max-pool":
            return model, {"input": torch.randn(BATCH, 3, 16, 16)}
        return model, {"input": torch.randn(BATCH, TOKENS, WIDTH)}

    return build


def train_cells(name: str, build: Callable[[], tuple[Any, ...]], **axes: Any) -> list[CellRecord]:
    """A model's train cells (float16 and bfloat16 in ``autocast`` and ``half``, and the
    ``fp32`` control), run in this process as a ``check`` worker runs them."""
    matrix = Matrix(
        dtypes=("float16", "bfloat16"), modes=("autocast", "half"), stages=(TRAIN_STAGE,)
    )
    case = model_case(name, build, matrix.replace(**axes) if axes else matrix, __file__)
    return [execute.run_cell(c) for c in expand([case]).to_run if c.stage == TRAIN_STAGE]


def replay_notes(record: CellRecord) -> list[str]:
    return [n.text for n in record.notes if n.kind is NoteKind.REPLAYED]


@pytest.mark.parametrize("body", sorted(BODIES))
def test_a_healthy_model_passes_every_train_cell_and_its_buggy_twin_does_not(
    clean_registry: None, body: str
) -> None:
    records = train_cells(body, factory(body, bug=False))
    assert sorted((r.cell.dtype, r.cell.mode) for r in records) == [
        ("bfloat16", "autocast"), ("bfloat16", "half"), ("float16", "autocast"),
        ("float16", "half"), ("float32", "fp32"),
    ]  # fmt: skip
    for record in records:
        assert outcome_label(record) == "passes", (record.cell, record.numerics, record.notes)
    buggy = train_cells(f"{body}-bug", factory(body, bug=True), modes=("half",))
    for record in buggy:
        if record.cell.dtype != "float32":
            assert outcome_label(record) == "inaccurate", (record.cell, record.numerics)


def test_the_note_says_what_was_replayed(clean_registry: None) -> None:
    records = {
        (r.cell.dtype, r.cell.mode): r
        for r in train_cells("stochastic-depth", factory("stochastic-depth", bug=False))
    }
    # three drop-path masks drawn in the activations' dtype, other numbers than float64's
    assert replay_notes(records[("float32", "fp32")]) == [
        "judged against float64 taken again with the cell's 3 random draw(s)"
    ]
    dropout = train_cells("dropout", factory("dropout", bug=False), modes=("half",))
    # nn.Dropout's masks are float64's own on the CPU: nothing replayed, no extra run
    assert all(not replay_notes(r) for r in dropout)


def test_a_compiled_cell_is_judged_along_the_draws_it_made(clean_registry: None) -> None:
    """Inductor draws as eager torch does around a compiled run, and the cell's eager twin
    records those draws: stochastic depth in the activations' dtype passes compiled, where
    judged against float64's own draws it read inaccurate."""
    records = train_cells(
        "stochastic-depth-compiled", factory("stochastic-depth", bug=False),
        dtypes=("bfloat16",), modes=("half",), compiles=("inductor",),
    )  # fmt: skip
    compiled = [r for r in records if r.cell.compile == "inductor"]
    assert [r.cell.dtype for r in compiled] == ["bfloat16", "float32"]
    for record in compiled:
        assert outcome_label(record) == "passes", (record.cell, record.numerics, record.notes)
        assert replay_notes(record) == [
            "judged against float64 taken again with the cell's 3 random draw(s)"
        ]


def test_top_2_routing_takes_the_cells_choices_within_rounding_only(
    clean_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Near-ties in the routing flip by chance; with no band (width 0) the same cells are
    judged against float64's own routing."""
    with_band = train_cells("moe", factory("top-2-moe", bug=False), dtypes=("bfloat16",))
    assert any("top-k" in " ".join(replay_notes(r)) for r in with_band)
    monkeypatch.setattr(replay, "KINK_WIDTH", 0.0)
    without = train_cells("moe-no-band", factory("top-2-moe", bug=False), dtypes=("bfloat16",))
    assert not any(replay_notes(r) for r in without)


class ChoiceInputs(torch.utils._python_dispatch.TorchDispatchMode):
    """Keeps what every discrete choice is made on (a kink's or a pick's input, a
    comparison's difference with its scale), in order."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in replay.KINKS and (kink := replay.kink_input(func, args, kwargs)):
            self.keep(replay.label(func), kink.x, replay.scale_of(kink.x))
        elif packet in replay.COMPARISONS and replay.outcome_margin(func, args) is not None:
            a, b = args[0], args[1]
            self.keep("comparison", a.double() - b, replay.scale_of(a, b))
        elif packet in replay.PICKS and args[0].is_floating_point():
            self.keep(replay.label(func), args[0], replay.scale_of(args[0]))
        return func(*args, **kwargs)

    def keep(self, name: str, x: torch.Tensor, scale: torch.Tensor) -> None:
        self.seen.append((name, x.detach().double().clone(), scale.double()))


def choice_inputs(model: nn.Module, x: torch.Tensor, modes: tuple[Any, Any], low: Any) -> Any:
    torch.manual_seed(1)
    with modes[0], modes[1], torch.autocast("cpu", dtype=low or torch.bfloat16, enabled=bool(low)):
        loss = model(x).double().square().mean()
    with modes[0], modes[1]:
        loss.backward()
    return modes[1].seen


@pytest.mark.parametrize("body", ["top-2-moe", "clamped", "max-pool", "gated"])
def test_the_cells_choices_are_made_within_half_the_band_of_float64s(body: str) -> None:
    """KINK_WIDTH's measure for the choices beyond ReLU: what a healthy cell's choices are
    made on lies within half the band (4 eps of the tensor's largest) of what float64's
    replayed along the cell's choices are made on (CPU, torch 2.13.0: top-k 0.50 eps,
    argmax 0.38, max-pool 0.39, clamp and comparisons 0.82, hardtanh 0.62)."""
    model, inputs = factory(body, bug=False)()
    for dtype, mode in (("float16", "autocast"), ("bfloat16", "half")):
        low = getattr(torch, dtype)
        cell = copy.deepcopy(model).to(low) if mode == "half" else copy.deepcopy(model)
        x = inputs["input"].to(low) if mode == "half" else inputs["input"]
        recorder = replay.Recorder()
        seen = choice_inputs(
            cell, x, (recorder, ChoiceInputs()), low if mode == "autocast" else None
        )
        reference = copy.deepcopy(model).double()
        own = replay.Recorder(reference=True)
        choice_inputs(reference, inputs["input"].double(), (own, ChoiceInputs()), None)
        plan = replay.plan_replay(own.recorded, recorder.recorded.on_cpu(), dtype, True)
        along = replay.Replay(None, plan.choices if plan else None, dtype)
        float64 = choice_inputs(reference, inputs["input"].double(), (along, ChoiceInputs()), None)
        assert [n for n, _, _ in seen] == [n for n, _, _ in float64]
        for (name, ours, _), (_, theirs, scale) in zip(seen, float64, strict=True):
            apart = float((ours.to(theirs) - theirs).abs().amax() / scale) / replay.dtype_eps(
                dtype
            )
            assert apart < replay.KINK_WIDTH / 2, (name, dtype, mode, apart)


class OverflowingDropout(nn.Module):
    """Dropout before a softmax written out without subtracting the maximum: its scores
    (about 12) overflow ``exp`` in float16, so the step's gradients are not finite."""

    def __init__(self) -> None:
        super().__init__()
        self.scores = nn.Linear(WIDTH, WIDTH)
        nn.init.constant_(self.scores.bias, 12.0)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        exp = self.drop(self.scores(x)).exp()
        return x + exp / exp.sum(-1, keepdim=True)


def test_a_step_gone_non_finite_with_dropout_active_is_judged(clean_registry: None) -> None:
    """A step whose gradients are not finite is taken again to say where, drawing its
    dropout masks again: the cell drew twice what float64 drew, and is judged inaccurate
    (it crashed the harness, a strict zip over the draws)."""

    def build() -> tuple[Any, ...]:
        torch.manual_seed(0)
        return nn.Sequential(OverflowingDropout(), Head(False)), {
            "input": torch.randn(BATCH, TOKENS, WIDTH)
        }

    records = train_cells("overflowing-dropout", build, dtypes=("float16",))
    low = [r for r in records if r.cell.dtype == "float16"]
    assert len(low) == 2
    for record in low:
        assert outcome_label(record) == "inaccurate", (
            record.cell,
            record.error_message,
            record.notes,
        )


def test_draws_after_float64s_last_are_not_float64s_to_take() -> None:
    """A cell that drew float64's draws and then more (its step taken again) is replayed
    with float64's count of its draws, the first ones."""
    first, second = torch.rand(3, dtype=torch.float16), torch.rand(3, dtype=torch.float16)
    reference = replay.Recorded([replay.Draw("aten.rand.default", first.double())])
    cell = replay.Recorded(
        [replay.Draw("aten.rand.default", first), replay.Draw("aten.rand.default", second)]
    )
    assert replay.plan_replay(reference, cell, "float16", True) is None
    other = replay.Recorded([replay.Draw("aten.rand.default", second), *cell.draws])
    plan = replay.plan_replay(reference, other, "float16", True)
    assert plan is not None and plan.draws is not None
    assert [torch.equal(d.value, second) for d in plan.draws] == [True]


def adamw_holding_eps(params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """AdamW with an eps float16 holds (its default 1e-8 is 0 there)."""
    return torch.optim.AdamW(params, lr=lr, eps=1e-4, weight_decay=0.0, foreach=False)


def test_a_fit_is_judged_against_float64_fitted_along_its_draws(clean_registry: None) -> None:
    """Stochastic depth drawn in the activations' dtype draws in every step of a fit, and
    its last loss is taken with a draw too: each cell's fit is judged against the float64
    fit taken again with all of its draws (63: three blocks, twenty steps and the last
    loss). The float32 control ends where that fit ends to float32's resolution; against
    float64's own draws it ended 16% beyond (0.2912 against 0.2515), 0.30 of its limit
    from the draws alone."""
    matrix = Matrix(
        dtypes=("float16", "bfloat16"), modes=("autocast", "half"), stages=(FIT_STAGE,)
    )
    case = model_case(
        "stochastic-depth-fit",
        factory("stochastic-depth", bug=False),
        matrix,
        __file__,
        recipe=Recipe(optimizer=adamw_holding_eps),
    )
    cells = expand([case], Selection(stages=(FIT_STAGE,))).to_run
    records = {(c.dtype, c.mode): execute.run_cell(c) for c in cells}
    assert len(records) == 5
    for record in records.values():
        assert outcome_label(record) == "passes", (record.cell, record.numerics, record.notes)
        assert replay_notes(record) == [
            "judged against float64 taken again with the cell's 63 random draw(s)"
        ]
    control = records[("float32", "fp32")].fit
    assert control is not None
    own_draws = reference_leaves(workpiece(records[("float32", "fp32")].cell))["loss"]
    assert control.losses[-1] == pytest.approx(control.reference_losses[-1], rel=1e-6)
    assert control.losses[-1] != pytest.approx(float(own_draws[-1]), rel=0.05)
