"""The flash-attn backend: which package runs where, why it is skipped elsewhere, and the
failure signatures of both flash-attn 2 and flash-attn 4 (against the real flash-attn 4
where it imports: its dtype checks run before its device check, so on a CPU too)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness.measure.authoring import registry
from harness.measure.host import environment, flash_kernels
from harness.measure.host.flash_kernels import FLASH_ATTN_2, FLASH_ATTN_4, FlashPackage
from harness.measure.judge import judging
from harness.measure.running import crashes
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, NoteKind, Outcome

#: What each package raised for VAR's float32 query (flash-attn 4 measured on an H100 and
#: on this CPU, flash-attn 2 from its source): (error type, message).
FLASH_2_REFUSAL = ("RuntimeError", "FlashAttention only support fp16 and bf16 data type")
FLASH_4_MIXED = ("AssertionError", "q, k, v, and qv must have the same dtype")
FLASH_4_ALL_FP32 = ("AssertionError", "inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2")


def installed(monkeypatch: pytest.MonkeyPatch, **versions: str) -> None:
    """Pretend these distributions are installed (``flash_attn_4="4.0.0b36"``)."""
    known = {name.replace("_", "-"): v for name, v in versions.items()}
    monkeypatch.setattr(flash_kernels, "installed_version", lambda dist: known.get(dist))


def on_gpu(monkeypatch: pytest.MonkeyPatch, major: int, minor: int) -> None:
    monkeypatch.setattr(flash_kernels, "capability", lambda device: (major, minor))


def test_no_gpu_no_flash_attn() -> None:
    assert flash_kernels.package_for("cpu") == "flash-attn needs a CUDA device"


def test_flash_attn_2_runs_where_it_is_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    installed(monkeypatch, flash_attn="2.8.3", flash_attn_4="4.0.0b36")
    on_gpu(monkeypatch, 8, 0)
    assert flash_kernels.package_for("cuda:0") == FlashPackage(FLASH_ATTN_2, "flash_attn", "2.8.3")


@pytest.mark.parametrize(("major", "minor"), [(9, 0), (10, 0), (12, 0)])
def test_flash_attn_4_runs_on_hopper_and_newer(
    monkeypatch: pytest.MonkeyPatch, major: int, minor: int
) -> None:
    installed(monkeypatch, flash_attn_4="4.0.0b36")
    on_gpu(monkeypatch, major, minor)
    package = flash_kernels.package_for("cuda:0")
    assert package == FlashPackage(FLASH_ATTN_4, "flash_attn.cute", "4.0.0b36")
    assert environment.backend_skip_reason("cuda:0", "flash-attn") is None
    assert environment.backend_skip_reason("cuda:0", "flash-attn-contract") == (
        "the real flash-attn kernel runs here instead (flash-attn-4 4.0.0b36 (flash_attn.cute))"
    )


def test_flash_attn_4_on_an_older_gpu_is_skipped_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    installed(monkeypatch, flash_attn_4="4.0.0b36")
    on_gpu(monkeypatch, 8, 6)
    reason = "flash-attn 4 needs sm90+ (cuda:0 is sm86) and flash-attn 2 is not installed"
    assert environment.backend_skip_reason("cuda:0", "flash-attn") == reason
    assert environment.backend_skip_reason("cuda:0", "flash-attn-contract") is None


def test_neither_installed_the_contract_stands_in(monkeypatch: pytest.MonkeyPatch) -> None:
    installed(monkeypatch)
    assert environment.backend_skip_reason("cuda:0", "flash-attn") == (
        "neither flash-attn 2 (flash_attn) nor flash-attn 4 (flash_attn.cute) is installed "
        "(the flash-attn-contract backend stands in)"
    )


def test_records_say_which_kernel_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    installed(monkeypatch, flash_attn_4="4.0.0b36")
    on_gpu(monkeypatch, 9, 0)
    note = crashes.backend_note(Cell("c", "none", "cuda:0", "float16", "half", "flash-attn"))
    assert note is not None and note.kind is NoteKind.BACKEND
    assert note.text.startswith(
        "flash-attn: the real kernel, flash-attn-4 4.0.0b36 (flash_attn.cute)"
    )
    assert "outside torch's dispatcher" in note.text  # the trail cannot see inside it
    contract = crashes.backend_note(Cell("c", "none", "cpu", "float16", "half",
                                         "flash-attn-contract"))  # fmt: skip
    assert contract is not None and contract.kind is NoteKind.BACKEND
    assert "flash-attn 2's input contract and error messages" in contract.text


def test_env_json_lists_both_packages() -> None:
    versions = environment.package_versions()
    assert "flash-attn" in versions and "flash-attn-4" in versions


def test_flash_attn_4_is_called_as_flash_attn_2() -> None:
    calls: list[dict[str, Any]] = []

    def fake_flash4(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
        calls.append(kw)
        return q + 1, torch.zeros(1)

    func = flash_kernels.as_flash_attn_2_call(fake_flash4)
    q = torch.zeros(1, 2, 1, 4)
    assert torch.equal(func(q, q, q, dropout_p=0.0, softmax_scale=0.5), q + 1)
    assert calls == [{"softmax_scale": 0.5, "causal": False}]
    with pytest.raises(ValueError, match="no dropout"):
        func(q, q, q, dropout_p=0.1)


@pytest.fixture
def var_case(clean_registry: None) -> Any:
    registry.discover()
    return registry.get("var-normalize-promotion")


def raised_record(case: Any, error: BaseException) -> CellRecord:
    cell = Cell(case.name, "none", "cuda:0", "float16", "autocast", "flash-attn")
    record = CellRecord(cell=cell, torch_version=torch.__version__, outcome=Outcome.CRASHED)
    return judging.raised(case, error, record)


@pytest.mark.parametrize("refusal", [FLASH_2_REFUSAL, FLASH_4_MIXED, FLASH_4_ALL_FP32])
def test_var_reproduces_with_either_packages_message(var_case: Any, refusal: Any) -> None:
    kind, message = refusal
    error = {"RuntimeError": RuntimeError, "AssertionError": AssertionError}[kind](message)
    record = raised_record(var_case, error)
    assert record.outcome is Outcome.RAISES and record.reproduces is True


def test_another_error_does_not_reproduce(var_case: Any) -> None:
    record = raised_record(var_case, AssertionError("num_head must be divisible by num_head_kv"))
    assert record.reproduces is False


def real_flash_attn_4() -> Any:
    """flash-attn 4's own function where it imports here, else the test is skipped."""
    if flash_kernels.installed_version(FLASH_ATTN_4) is None:
        pytest.skip("flash-attn-4 is not installed here (ampmatrix[flash4])")
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as error:  # its CUTLASS DSL or triton missing, say
        pytest.skip(f"flash-attn-4 does not import here: {error!r}")
    return flash_attn_func


def test_the_real_flash_attn_4_refuses_vars_query_as_the_case_expects(var_case: Any) -> None:
    flash4 = real_flash_attn_4()
    q = torch.randn(2, 5, 4, 64)  # VAR's fp32 q from the scale_mul promotion, half k and v
    for args, expected in (
        ((q, q.half(), q.half()), FLASH_4_MIXED),
        ((q, q, q), FLASH_4_ALL_FP32),
    ):
        with pytest.raises(AssertionError) as raised:
            flash4(*args)
        assert str(raised.value) == expected[1]
        assert raised_record(var_case, raised.value).reproduces is True
