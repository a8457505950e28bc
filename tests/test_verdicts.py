"""Verdicts that mean what they say: no cell judged against itself, drift with a size, an
upcast that autocast undid, inputs kept in float32. Silent bugs and their healthy twins
(``zoo/silent_bugs.py``) run through the same cell runner as ``check``."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from harness.measure import execute
from harness.measure.authoring import registry
from harness.measure.authoring.case import Case, RunContext, Workload, fix
from harness.measure.authoring.model_case import Matrix, model_case
from harness.measure.judge import judging
from harness.measure.judge.numerics import ROUNDING_FACTOR, rounding_ratio
from harness.measure.judge.rounding import noise_source, round_to
from harness.measure.precision.flags import ISLAND_NOTE
from harness.measure.running import fix_run
from harness.runner.matrix import expand
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, FlagKind, NoteKind, Outcome, outcome_label
from zoo.silent_bugs import PAIRS

HERE = Path(__file__).name
BUG_COST = 10.0


def line_of(marker: str) -> str:
    lines = inspect.getsource(inspect.getmodule(line_of)).splitlines()  # type: ignore[arg-type]
    number = next(n for n, text in enumerate(lines, 1) if marker in text and "line_of" not in text)
    return f"{HERE}:{number}"


def run_model(
    name: str, factory: Callable[..., Any], matrix: Matrix | None = None
) -> list[CellRecord]:
    """Every cell of a model, run in this process as a ``check`` worker runs it."""
    case = model_case(name, factory, matrix or Matrix(), __file__)
    return [execute.run_cell(cell) for cell in expand([case]).to_run]


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_a_silent_bug_never_passes_where_it_costs_ten_times_the_rounding(
    clean_registry: None, name: str
) -> None:
    records = run_model(name, PAIRS[name].bug)
    costly = [r for r in records if r.numerics and (rounding_ratio(r.numerics) or 0) > BUG_COST]
    assert costly, "the bug must cost more than ten times the rounding somewhere"
    assert all(r.cell.dtype in ("float16", "bfloat16", "float32") for r in costly)
    assert [outcome_label(r) for r in costly] == ["inaccurate"] * len(costly)
    assert all(r.numerics and r.numerics.decided_by == f"rounding to {r.cell.dtype}"
               for r in costly)  # fmt: skip


@pytest.mark.parametrize("name", sorted(PAIRS))
def test_a_healthy_twin_is_a_plain_pass_in_every_cell(clean_registry: None, name: str) -> None:
    records = run_model(f"{name}-twin", PAIRS[name].twin)
    assert len(records) == 5  # two dtypes x (autocast, half), and the float32 control
    assert [outcome_label(r) for r in records] == ["passes"] * 5


def test_a_reference_fix_cell_is_judged_against_rounding_not_itself(toy_registry: None) -> None:
    record = execute.run_cell(Cell("toy-mixed-matmul", "cast-input", "cpu", "float16", "half",
                                   "sdpa"))  # fmt: skip
    numerics = record.numerics
    assert numerics is not None and record.outcome is Outcome.PASSES
    assert numerics.baseline_rel_err is None  # it is the trusted fix: no fix to compare with
    assert numerics.rounding_rel_err is not None and numerics.rounding_rel_err > 0
    assert numerics.decided_by == "rounding to float16"
    assert numerics.factor == ROUNDING_FACTOR
    assert numerics.tolerance == pytest.approx(
        max(ROUNDING_FACTOR * numerics.rounding_rel_err, torch.finfo(torch.float16).eps)
    )


def test_another_fix_is_judged_against_the_trusted_fix(toy_registry: None) -> None:
    record = execute.run_cell(Cell("toy-mixed-matmul", "noisy", "cpu", "float16", "half",
                                   "sdpa"))  # fmt: skip
    numerics = record.numerics
    assert numerics is not None and record.outcome is Outcome.INACCURATE
    assert numerics.baseline_rel_err is not None
    assert numerics.decided_by == "fix cast-input"
    assert numerics.factor == 3.0


class QKVFloat(nn.Module):
    """Attention whose q, k and v are cast to float32 on purpose before its core: SDPA on
    (batch, heads, seq, dim), which SDPA's fused CPU kernel takes (``fused``); SDPA on 3-D
    q, k and v (heads folded into the batch), which it does not, so its math fallback runs
    (``math``); or softmax(q k^T) v by ``@`` (``matmul``). ``upcast=False``: the same
    without the casts."""

    def __init__(self, core: str = "fused", upcast: bool = True) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.core = core
        self.upcast = upcast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).unflatten(-1, (3, 2, 8)).transpose(1, 3).unbind(2)
        if self.core == "math":
            q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
        if self.upcast:
            q, k, v = q.float(), k.float(), v.float()  # intended upcast
        if self.core == "matmul":
            return (q @ k.transpose(-2, -1) * 8**-0.5).softmax(-1) @ v
        return F.scaled_dot_product_attention(q, k, v)


def qkv_float(core: str = "fused", upcast: bool = True) -> tuple[Any, ...]:
    return QKVFloat(core, upcast).eval(), {"x": torch.randn(2, 6, 16)}


class AttentionKernelInputs(TorchDispatchMode):
    """The dtypes the attention kernels (SDPA's fused kernels, its math fallback's and
    ``@``'s ``bmm``) receive, seen apart from the harness's tracer."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: set[torch.dtype] = set()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        name = func.overloadpacket.__name__
        if name == "bmm" or "attention" in name:
            self.dtypes.update(a.dtype for a in args[:3] if isinstance(a, torch.Tensor))
        return func(*args, **(kwargs or {}))


def attention_inputs_under_autocast(core: str, dtype: torch.dtype) -> set[torch.dtype]:
    """What the ``autocast`` cell computes attention in: float32 weights and inputs run
    under CPU autocast, as the harness runs them."""
    model, inputs = qkv_float(core)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype), AttentionKernelInputs() as seen:
        model(**inputs)
    return seen.dtypes


def test_an_upcast_that_autocast_undoes_is_flagged_with_the_line_of_the_cast(
    clean_registry: None,
) -> None:
    matrix = Matrix(dtypes=("bfloat16",), modes=("autocast", "half"))
    records = {r.cell.mode: r for r in run_model("qkv-float", qkv_float, matrix)}
    undone = [f for f in records["autocast"].flags if f.kind is FlagKind.UNDONE_UPCAST]
    assert len(undone) == 1, records["autocast"].flags
    assert f"{line_of('# intended upcast')} was cast back" in undone[0].detail
    assert "cast back to bfloat16 by autocast" in undone[0].detail
    # without autocast the upcast holds: attention really runs in float32, a drift
    half = records["half"]
    assert [f.kind for f in half.flags] == [FlagKind.DRIFT]
    assert half.flags[0].share is not None and half.flags[0].share > 0.1


#: The kernel the undone upcast fed, on torch 2.4.1 and 2.13.0 alike.
UNDONE_BEFORE = {
    "fused": "aten::_scaled_dot_product_flash_attention_for_cpu",
    "math": "aten::bmm",
    "matmul": "aten::bmm",
}


def autocast_output(core: str, upcast: bool) -> torch.Tensor:
    torch.manual_seed(0)
    model, inputs = qkv_float(core, upcast)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return model(**inputs)


@pytest.mark.parametrize("core", ["fused", "math", "matmul"])
def test_an_upcast_autocast_undid_is_flagged_whatever_the_kernel_then_computes_in(
    clean_registry: None, core: str
) -> None:
    """Autocast casts q, k and v down at SDPA (or ``matmul``) on every release, so the
    upcast changes nothing: the output is bit for bit the one without it. What the kernel
    computes in after that is torch's choice, and differs by release: torch 2.4.1's SDPA
    math fallback computes in the dtype autocast cast to, 2.13.0's casts the rounded values
    back up to float32 itself (which restores nothing the cast down lost). The flag, and the
    kernel it names, are the same on both; the trail still says what the kernels computed
    in."""
    assert torch.equal(autocast_output(core, upcast=True), autocast_output(core, upcast=False))
    received = attention_inputs_under_autocast(core, torch.bfloat16)
    assert len(received) == 1, received
    (kernel_dtype,) = received
    matrix = Matrix(dtypes=("bfloat16",), modes=("autocast",))
    records = run_model(f"qkv-float-{core}", lambda: qkv_float(core), matrix)
    (record,) = [r for r in records if r.cell.mode == "autocast"]
    assert record.trail is not None
    computed = {d for dtypes in record.trail.compute_dtypes.values() for d in dtypes}
    assert str(kernel_dtype).removeprefix("torch.") in computed
    undone = [f for f in record.flags if f.kind is FlagKind.UNDONE_UPCAST]
    assert len(undone) == 1, record.flags
    assert (
        f"{line_of('# intended upcast')} was cast back to bfloat16 by autocast before "
        f"{UNDONE_BEFORE[core]} in QKVFloat" in (undone[0].detail or "")
    )


class RopeIsland(nn.Module):
    """A Llama-style block: the RoPE frequency product in float32 with autocast off, cast
    back to the activations' dtype; everything else in the cell's dtype."""

    inv_freq: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64))

    def forward(self, x: torch.Tensor, wide_everything: bool = False) -> torch.Tensor:
        h = self.proj(x)
        positions = torch.arange(x.shape[1], device=x.device)[None, None, :]
        with torch.autocast(x.device.type, enabled=False):
            freqs = self.inv_freq[None, :, None].float() @ positions.float()  # the island
        angles = torch.cat((freqs, freqs), dim=1).transpose(1, 2)
        cos, sin = angles.cos().to(h.dtype), angles.sin().to(h.dtype)
        return self.proj(h * cos + h.flip(-1) * sin)


def rope_island() -> tuple[Any, ...]:
    return RopeIsland().eval(), {"x": torch.randn(2, 16, 64)}


def test_a_small_float32_island_cast_back_is_noted_not_flagged(clean_registry: None) -> None:
    for record in run_model("rope-island", rope_island):
        assert outcome_label(record) == "passes", record.flags
        if record.cell.dtype == "float32":
            continue
        (island,) = [n.text for n in record.notes if n.kind is NoteKind.ISLAND]
        assert island.startswith(ISLAND_NOTE)
        assert "% of the matmul and attention FLOPs in float32, from aten::" in island
        assert record.trail is not None and record.trail.island is not None
        assert record.trail.island.share is not None and record.trail.island.share < 0.01
        assert str(record.trail.island.site.location).endswith(line_of("# the island"))


class WideHead(nn.Module):
    """Half of the matmul work upcast to float32 and never cast back."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32, bias=False)
        self.b = nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return F.linear(h.float(), self.b.weight.float())


def test_a_drift_flag_carries_the_share_of_flops_computed_wider(clean_registry: None) -> None:
    matrix = Matrix(dtypes=("float16",), modes=("half",))
    (record,) = [r for r in run_model("wide-head", lambda: (WideHead(), torch.randn(4, 32)),
                                      matrix) if r.cell.mode == "half"]  # fmt: skip
    (flag,) = record.flags
    assert flag.kind is FlagKind.DRIFT and flag.share == pytest.approx(0.5)
    assert "(50.0% of the matmul and attention FLOPs)" in flag.detail


class TimestepModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        assert t.dtype in (torch.float32, torch.float64), t.dtype
        return self.proj(x) * torch.cos(t).to(x.dtype)


def test_an_input_named_in_keep_fp32_stays_float32(clean_registry: None) -> None:
    def factory() -> tuple[Any, ...]:
        return TimestepModel(), {"x": torch.randn(2, 8), "t": torch.tensor([500.0])}

    matrix = Matrix(dtypes=("float16",), modes=("half",), keep_fp32=("t",))
    records = run_model("timestep", factory, matrix)
    assert [outcome_label(r) for r in records] == ["passes", "passes"]


def test_a_keep_fp32_name_that_is_neither_part_nor_input_is_refused(clean_registry: None) -> None:
    def factory() -> tuple[Any, ...]:
        return TimestepModel(), {"x": torch.randn(2, 8), "t": torch.tensor([500.0])}

    matrix = Matrix(dtypes=("float16",), modes=("half",), keep_fp32=("nowhere",))
    record = run_model("nowhere", factory, matrix)[0]
    assert record.outcome is Outcome.CRASHED
    assert "neither a part of the model nor an input" in str(record.error_message)


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.gain = nn.Linear(8, 8)


class NarrowingCase(Case):
    name = "narrowing"
    title = "a fix keeps fewer parts in float32 than its case"
    reference_fix = "none"
    modes = ("half", "fp32")
    devices = ("cpu",)
    keep_fp32 = ("gain",)

    def build(self, ctx: RunContext) -> Workload:
        return Workload(Scaled(), {"x": torch.randn(2, 8)})

    @fix("none", rationale="gain kept in float32, as the case says")
    def none(self, w: Workload, ctx: RunContext) -> Any:
        return w.model.gain.weight.dtype == torch.float32, w.model.proj(w.inputs["x"])

    @fix("all-half", rationale="keeps nothing in float32", keep_fp32=())
    def all_half(self, w: Workload, ctx: RunContext) -> Any:
        return w.model.gain.weight.dtype == torch.float32, w.model.proj(w.inputs["x"])


def test_a_fix_can_narrow_keep_fp32() -> None:
    case = NarrowingCase()
    assert not [p for p in registry.contract_problems(case) if "keep" in p]
    assert case.kept_by("none") == ("gain",) and case.kept_by("all-half") == ()
    ctx = fix_run.context_for(case, Cell("narrowing", "none", "cpu", "float16", "half", "sdpa"))
    for fix_name, kept in (("none", True), ("all-half", False)):
        workload = fix_run.prepared_workload(case, ctx, case.kept_by(fix_name))
        assert case.fixes[fix_name].func(case, workload, ctx)[0] is kept


def test_a_fix_cannot_keep_what_its_case_does_not() -> None:
    class Widening(NarrowingCase):
        name = "widening"

        @fix("all-half", rationale="keeps another part", keep_fp32=("proj",))
        def all_half(self, w: Workload, ctx: RunContext) -> Any:
            return w.model.proj(w.inputs["x"])

    problems = registry.contract_problems(Widening())
    assert any("keeps 'proj' in float32" in p and "only narrow" in p for p in problems)


def test_tf32_rounding_is_simulated_at_its_unit_roundoff() -> None:
    values = torch.linspace(1, 2, 1001, dtype=torch.float64)
    for dtype, roundoff in (("tf32", 2.0**-11), ("float32", 2.0**-24)):
        moved = (round_to(values, dtype, noise_source()) - values).abs() / values
        assert 0 < moved.max().item() <= roundoff
        assert moved.max().item() > roundoff / 2  # the noise spans the unit roundoff
    halved = round_to(values, "float16", noise_source())
    assert torch.equal(halved, values.to(torch.float16).to(torch.float64))


def test_a_gpu_float32_control_with_tf32_on_is_judged_against_tf32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cell = Cell("any", "none", "cuda:0", "float32", "fp32", "sdpa")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert judging.tf32_setting(cell, None) is None
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # as allow_tf32 = True does
    try:
        assert judging.tf32_setting(cell, None) == (
            "torch.get_float32_matmul_precision() == 'high'"
        )
        on_cpu = Cell("any", "none", "cpu", "float32", "fp32", "sdpa")
        half = Cell("any", "none", "cuda:0", "float16", "half", "sdpa")
        assert judging.tf32_setting(on_cpu, None) is None
        assert judging.tf32_setting(half, None) is None
    finally:
        torch.set_float32_matmul_precision(previous)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
    assert judging.tf32_setting(cell, None) == "torch.backends.cudnn.allow_tf32"


def test_kernel_flops_from_shapes() -> None:
    from harness.measure.tracing.kernels import kernel_flops

    a, b = torch.empty(3, 5, 7), torch.empty(3, 7, 2)
    assert kernel_flops(torch.ops.aten.bmm.default, [a, b], []) == 2 * 3 * 5 * 7 * 2
    bias, x, w = torch.empty(2), torch.empty(4, 3), torch.empty(3, 2)
    assert kernel_flops(torch.ops.aten.addmm.default, [bias, x, w], []) == 2 * 4 * 3 * 2
    q, k, v = torch.empty(2, 4, 6, 8), torch.empty(2, 4, 9, 8), torch.empty(2, 4, 9, 8)
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    # q @ k^T and p @ v: 2 * (2*4*6) * 9 * (8 + 8)
    assert kernel_flops(sdpa, [q, k, v], []) == 2 * 48 * 9 * 16
    image, weight = torch.empty(1, 3, 8, 8), torch.empty(4, 3, 3, 3)
    out = torch.empty(1, 4, 6, 6)
    assert kernel_flops(torch.ops.aten.convolution.default, [image, weight], [out]) == (
        2 * out.numel() * 27
    )
    assert kernel_flops(torch.ops.aten.add.Tensor, [a, a], [a]) is None


class StaleAttribute(nn.Module):
    """A float32 copy kept as a plain attribute (``.half()`` does not cast it), unused by
    ``forward`` unless asked: transformers 4.46's ``rotary_emb.original_inv_freq``."""

    def __init__(self, use_it: bool) -> None:
        super().__init__()
        self.use_it = use_it
        self.proj = nn.Linear(8, 8)
        self.original_scale = torch.ones(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h * self.original_scale.to(h.dtype) if self.use_it else h


@pytest.mark.parametrize("use_it", [False, True])
def test_a_plain_float32_attribute_counts_only_where_the_run_reads_it(
    clean_registry: None, use_it: bool
) -> None:
    matrix = Matrix(dtypes=("float16",), modes=("half",))
    name = f"stale-{str(use_it).lower()}"
    records = run_model(name, lambda: (StaleAttribute(use_it), torch.randn(2, 8)), matrix)
    half = next(r for r in records if r.cell.mode == "half")
    assert outcome_label(half) == ("passes[not-half]" if use_it else "passes")
