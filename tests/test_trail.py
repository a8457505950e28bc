"""The dtype trail: promotion sites, failure sites and compute dtypes, asserted exactly on
small modules whose answer is known, and on the seed cases' upstream bugs."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.measure import execute
from harness.measure.authoring import registry
from harness.measure.tracing.python_watch import PythonWatch, watch_python
from harness.measure.tracing.tensor_marks import Names
from harness.measure.tracing.trail import DtypeTracer, tracing
from harness.schema.axes import Cell
from harness.schema.records import Outcome
from harness.schema.trail_records import Promotion, Site, Trail

HERE = Path(__file__).name
TORCH_2_4 = torch.__version__.startswith("2.4.")


def traced(model: nn.Module, run: Callable[[], Any], low: torch.dtype = torch.float16) -> Trail:
    """Run ``run`` under the tracer as the harness does; the trail, whether it raised or not."""
    watch = PythonWatch("cpu")
    tracer = DtypeTracer(low, Names.of_workload(model, {}, ()), watch, root=model)
    error = None
    try:
        with watch_python(watch), tracing(tracer), torch.no_grad():
            run()
    except RuntimeError as raised:
        error = raised
    return tracer.trail(error)


def line_of(marker: str) -> str:
    """``test_trail.py:N`` of the line in this file that contains ``marker``."""
    lines = inspect.getsource(inspect.getmodule(line_of)).splitlines()  # type: ignore[arg-type]
    number = next(n for n, text in enumerate(lines, 1) if marker in text and "line_of" not in text)
    return f"{HERE}:{number}"


class Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight  # fp32 parameter meets half x


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.gain = Gain()
        self.out = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.gain(self.proj(x)))


def half_block_with_fp32_gain() -> Block:
    block = Block().half()
    block.gain.float()
    return block


def test_an_fp32_parameter_in_a_half_model_is_named_and_the_refusing_op_found() -> None:
    model = half_block_with_fp32_gain()
    trail = traced(model, lambda: model(torch.randn(2, 8).half()))
    assert trail.promotion is not None and trail.failure_site is not None
    assert trail.promotion.carrier == "parameter gain.weight"
    assert trail.promotion.site.op == "aten::mul"
    assert trail.promotion.site.module == "gain"
    assert trail.promotion.site.location is not None
    assert trail.promotion.site.location.endswith(line_of("fp32 parameter meets half x"))
    assert trail.promotion.output_dtype == "float32"
    assert trail.failure_site.op == "aten::addmm"
    assert trail.failure_site.module == "out"
    assert trail.failure_site.input_dtypes == ("float16", "float32", "float16")


def test_an_explicit_float_is_the_carrier() -> None:
    x = torch.randn(4, 8).half()
    w = torch.randn(8, 8).half()
    trail = traced(nn.Identity(), lambda: x.float() @ w)  # explicit upcast
    assert trail.promotion is not None and trail.failure_site is not None
    assert trail.promotion.carrier == "an explicit cast (.float() / .to())"
    assert trail.promotion.site.op == "aten::_to_copy"
    assert str(trail.promotion.site.location).endswith(line_of("# explicit upcast"))
    assert trail.failure_site.op == "aten::mm"
    assert trail.failure_site.input_dtypes == ("float32", "float16")


def test_a_tensor_created_in_fp32_inside_forward_is_the_carrier() -> None:
    x = torch.randn(4, 8).half()
    trail = traced(nn.Identity(), lambda: x * torch.ones(8))  # created in float32
    assert trail.promotion is not None and trail.failure_site is None
    made = line_of("# created in float32")
    assert trail.promotion.carrier == f"a tensor created in float32 (aten::ones) at tests/{made}"
    assert trail.promotion.site.op == "aten::mul"
    assert str(trail.promotion.site.location).endswith(line_of("# created in float32"))


def test_a_tensor_made_from_python_data_is_named_by_its_line() -> None:
    x = torch.randn(4, 8).half()

    def run() -> torch.Tensor:
        scale = torch.tensor([0.5] * 8, dtype=torch.float32)  # from Python data
        return x * scale

    trail = traced(nn.Identity(), run)
    assert trail.promotion is not None
    made = line_of("# from Python data")
    assert trail.promotion.carrier == f"a float32 tensor made from Python data at tests/{made}"
    assert "lift_fresh" not in trail.promotion.describe()


def test_derived_parameters_keep_their_name_through_fp32_ops() -> None:
    scale = nn.Parameter(torch.zeros(8))
    holder = nn.Module()
    holder.scale_mul = scale
    x = torch.randn(4, 8).half()
    trail = traced(holder, lambda: x.mul(scale.clamp_max(4.0).exp()))
    assert trail.promotion is not None
    assert trail.promotion.carrier == "parameter scale_mul"
    assert trail.promotion.site.op == "aten::mul"


def test_a_mixed_dtype_fused_native_op_is_the_failure_site() -> None:
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).eval()
    src = torch.randn(2, 8, 32).half()  # half input, fp32 weights
    trail = traced(layer, lambda: layer(src))
    assert trail.failure_site is not None
    assert trail.failure_site.op == "aten::_transformer_encoder_layer_fwd"
    assert trail.failure_site.input_dtypes[:2] == ("float16", "float32")
    assert trail.failure_site.module == "TransformerEncoderLayer"


def test_a_python_level_check_is_found_through_the_traceback() -> None:
    q = torch.randn(1, 2, 4, 8)
    k = v = q.half()
    trail = traced(nn.Identity(), lambda: F.scaled_dot_product_attention(q, k, v))
    assert trail.failure_site is not None
    assert trail.failure_site.op == "F.scaled_dot_product_attention"
    assert trail.failure_site.input_dtypes == ("float32", "float16", "float16")


def test_float32_statistics_beside_a_half_result_are_no_promotion() -> None:
    """CPU SDPA returns its logsumexp in float32 beside the half output, and layer norm its
    mean and rstd: the trail must not call that a promotion."""
    model = nn.Linear(8, 8).half()
    q = torch.randn(1, 2, 4, 8, dtype=torch.float16)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def attend() -> Any:
        out, logsumexp = flash(q, q, q)[:2]
        assert (out.dtype, logsumexp.dtype) == (torch.float16, torch.float32)
        return torch.ops.aten.native_layer_norm(model(out), [8], None, None, 1e-5)

    assert traced(model, attend).promotion is None


def test_kernels_report_the_dtype_they_computed_in() -> None:
    model = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trail = traced(model, lambda: model(x), low=torch.bfloat16)
    assert trail.compute_dtypes == {"matmul": ("bfloat16",)}


def test_the_tracer_keeps_the_fused_fast_path_as_it_is_untraced() -> None:
    """Under a plain TorchDispatchMode the encoder's fast path runs without autocast inside;
    the tracer switches it back on, so the traced run computes what the untraced run does."""
    torch.manual_seed(0)
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 2, enable_nested_tensor=True
    ).eval()
    src = torch.randn(2, 8, 32)

    def run() -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return encoder(src)

    watch = PythonWatch("cpu")
    tracer = DtypeTracer(torch.bfloat16, Names(), watch, root=encoder)
    outcomes = []
    for trace in (False, True):
        try:
            with torch.no_grad(), watch_python(watch):
                if trace:
                    with tracing(tracer):
                        outcomes.append(run())
                else:
                    outcomes.append(run())
        except RuntimeError as error:
            outcomes.append(str(error))
    if TORCH_2_4:  # the fast path fails under CPU autocast there, traced or not
        assert outcomes[0] == outcomes[1] and "mat1 and mat2" in str(outcomes[0])
    else:
        assert outcomes[0].dtype == torch.bfloat16 and torch.equal(outcomes[0], outcomes[1])


@pytest.fixture(scope="module")
def seeds() -> None:
    registry.discover()


def run_seed(case: str, fix: str, dtype: str, mode: str, backend: str) -> Any:
    return execute.run_cell(Cell(case, fix, "cpu", dtype, mode, backend))


def trail_of_raise(case: str, dtype: str, mode: str, backend: str) -> tuple[Promotion, Site]:
    """The promotion and failure site of a seed case's upstream path that raises."""
    record = run_seed(case, "none", dtype, mode, backend)
    assert record.outcome is Outcome.RAISES and record.trail is not None
    promotion, failure = record.trail.promotion, record.trail.failure_site
    assert promotion is not None and failure is not None
    return promotion, failure


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sana_float_of_q_and_k_then_attn_at_v(seeds: None, dtype: str) -> None:
    import cases.sana_softmax_float as sana

    promotion, failure = trail_of_raise("sana-softmax-float", dtype, "half", "eager")
    lines, first = inspect.getsourcelines(sana.SanaSoftmaxFloat.none)
    cast = first + next(n for n, text in enumerate(lines) if "q, k = q.float()" in text)
    assert promotion.carrier == "an explicit cast (.float() / .to())"
    assert str(promotion.site.location).endswith(f"sana_softmax_float.py:{cast}")
    assert (failure.op, failure.input_dtypes) == ("aten::bmm", ("float32", dtype))
    assert str(failure.location).endswith(f"sana_softmax_float.py:{cast + 1}")  # ... @ v


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_var_scale_mul_promotes_q_before_the_flash_kernel(seeds: None, dtype: str) -> None:
    promotion, failure = trail_of_raise(
        "var-normalize-promotion", dtype, "autocast", "flash-attn-contract"
    )
    assert promotion.carrier == "parameter scale_mul_1H11"
    assert promotion.site.op == "aten::mul"
    assert failure.op == "self.flash_attn_func"
    assert failure.input_dtypes == ("float32", dtype, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dia_fp32_norm_output_meets_the_half_kv_cache(seeds: None, dtype: str) -> None:
    if not TORCH_2_4:  # RMSNorm(fp32 weight)(half input) returns half on newer torch
        record = run_seed("dia-sdpa-kv-cache", "none", dtype, "half", "sdpa")
        assert record.outcome is Outcome.PASSES and not record.flags
        assert record.trail is not None and record.trail.failure_site is None
        return
    promotion, failure = trail_of_raise("dia-sdpa-kv-cache", dtype, "half", "sdpa")
    assert promotion.carrier == "parameter pre_sa_norm.weight"
    assert promotion.site.module == "pre_sa_norm"
    assert failure.op == "F.scaled_dot_product_attention"
    assert failure.input_dtypes == ("float32", dtype, dtype)


@pytest.mark.parametrize("fix", ["none", "cast-kv-to-q", "cast-qkv-to-cache"])
def test_dia_upcast_undone_before_sdpa_only_where_the_fp32_norm_returns_float32(
    seeds: None, fix: str
) -> None:
    """Dia's ``DenseGeneral`` returns its input's dtype (``output.to(inputs.dtype)``): a cast
    up to float32 where the fp32 ``pre_sa_norm`` returned float32 for half input (torch
    2.4), which autocast casts back down before SDPA; a no-op where the norm returns the
    input's dtype (newer torch). SDPA computes in bfloat16 either way, so the flag is there
    exactly where the code cast up."""
    import cases.dia_sdpa_kv_cache as dia

    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = torch.ones(2, 4, dtype=torch.bfloat16)
        norm_promotes = F.rms_norm(half, (4,), torch.ones(4)).dtype == torch.float32
    record = run_seed("dia-sdpa-kv-cache", fix, "bfloat16", "half-autocast", "sdpa")
    assert record.outcome is Outcome.PASSES and record.trail is not None
    assert record.trail.compute_dtypes["attention"] == ("bfloat16",)
    undone = [f for f in record.flags if f.kind == "undone-upcast"]
    # cast-qkv-to-cache casts q back to the cache's bfloat16 itself: nothing for autocast to undo
    assert bool(undone) == (norm_promotes and fix != "cast-qkv-to-cache"), record.flags
    if undone:
        lines, first = inspect.getsourcelines(dia.DenseGeneral.forward)
        cast = first + next(n for n, text in enumerate(lines) if "output.to(" in text)
        assert undone[0].detail.startswith(
            f"the explicit cast up at cases/dia_sdpa_kv_cache.py:{cast} was cast back to "
            "bfloat16 by autocast before aten::_scaled_dot_product"
        )


@pytest.mark.parametrize(
    ("case", "dtype", "module", "autocast"),
    [
        ("lightning-encoder-fastpath", "float16", "layers.0", "float16"),
        ("lightning-encoder-fastpath", "bfloat16", "layers.0", "bfloat16"),
        # Lightning turns 16-mixed into bf16 on the CPU
        ("lightning-trainer-validate", "float16", "encoder.layers.0", "bfloat16"),
        ("lightning-trainer-validate", "bfloat16", "encoder.layers.0", "bfloat16"),
    ],
)
def test_lightning_fast_path_fails_in_its_native_op(
    seeds: None, case: str, dtype: str, module: str, autocast: str
) -> None:
    record = run_seed(case, "none", dtype, "autocast", "sdpa")
    if not TORCH_2_4:  # fixed by pytorch/pytorch#135936
        assert record.outcome is not Outcome.RAISES and not record.flags
        return
    assert record.outcome is Outcome.RAISES and record.trail is not None
    failure = record.trail.failure_site
    assert failure is not None
    assert failure.op == "aten::_transformer_encoder_layer_fwd"
    assert (failure.module, failure.autocast) == (module, autocast)


def test_a_fix_that_passes_by_computing_attention_in_fp32_drifts(seeds: None) -> None:
    record = run_seed("sana-softmax-float", "fp32-then-cast", "bfloat16", "half", "eager")
    assert record.outcome is Outcome.PASSES
    assert [f.kind for f in record.flags] == ["drift"]
    assert record.flags[0].detail.startswith("attention computed in float32")
    keeps_half = run_seed("sana-softmax-float", "sdpa", "bfloat16", "half", "eager")
    assert keeps_half.outcome is Outcome.PASSES and not keeps_half.flags


def test_autocast_stays_on_for_the_ops_after_a_promotion_under_autocast() -> None:
    """The tracer reads autocast's dtype inside an op (to describe a promotion); that read
    must not make the watch believe autocast was switched off for the ops after it."""
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(2, 8)

    def run() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = first(x).float() * torch.ones(8)  # a promotion, described under autocast
            return second(h)

    trail = traced(nn.Identity(), run, low=torch.bfloat16)
    assert trail.promotion is not None
    assert trail.compute_dtypes["matmul"] == ("bfloat16",)  # the second linear too
