"""Matrix expansion, selection and skip reasons."""

from __future__ import annotations

import dataclasses

import pytest

from harness.measure.authoring import registry
from harness.measure.authoring.case import Case
from harness.measure.host import environment
from harness.runner import matrix
from harness.runner.matrix import expand
from harness.schema.axes import Cell
from harness.schema.selection import Selection, SelectionError, check_selection


@pytest.fixture
def toy(toy_registry: None) -> list[Case]:
    return [registry.get("toy-mixed-matmul")]


def test_expansion_follows_declared_axes(toy: list[Case]) -> None:
    cells = list(matrix.case_cells(toy[0], ["cpu"]))
    # five fixes (two of every mode, three half-only): 2 dtypes in half + the fp32 control
    assert len(cells) == 5 * (2 + 1)
    assert Cell("toy-mixed-matmul", "none", "cpu", "float32", "fp32", "eager") in cells
    assert all(c.mode in ("half", "fp32") for c in cells)
    assert len(set(cells)) == len(cells)


def test_fp32_control_runs_for_every_fix(toy: list[Case]) -> None:
    """A fix narrowed to a mode (``half``) still runs plain in float32: the control shows
    each fix's code is right where precision is not in question."""
    fp32 = [c for c in matrix.case_cells(toy[0], ["cpu"]) if c.mode == "fp32"]
    assert sorted(c.fix for c in fp32) == sorted(toy[0].fixes)
    assert {c.dtype for c in fp32} == {"float32"}


def test_a_fix_narrowed_to_a_dtype_runs_in_it_and_the_control_only(toy: list[Case]) -> None:
    case = toy[0]
    narrowed = dataclasses.replace(case.fixes["cast-input"], dtypes=("bfloat16",))
    cells = list(matrix.fix_cells(case, narrowed, "cpu", "small"))
    assert sorted((c.dtype, c.mode) for c in cells) == [("bfloat16", "half"), ("float32", "fp32")]
    assert registry.contract_problems(case) == []


def test_cuda_cells_are_recorded_as_skipped_when_no_gpu(
    toy: list[Case], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(matrix, "cuda_devices", lambda: [])
    monkeypatch.setattr(environment, "cuda_devices", lambda: [])
    plan = expand(toy)
    assert {c.device for c in plan.to_run} == {"cpu"}
    assert {c.device for c, _ in plan.skipped} == {"cuda"}
    assert {reason for _, reason in plan.skipped} == {"no CUDA device visible"}
    assert plan.total == 2 * len(plan.to_run)


def test_cuda_kind_expands_to_every_visible_gpu(
    toy: list[Case], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(matrix, "cuda_devices", lambda: ["cuda:0", "cuda:1"])
    assert matrix.concrete_devices(toy[0], []) == ["cpu", "cuda:0", "cuda:1"]
    assert matrix.concrete_devices(toy[0], ["cuda"]) == ["cuda:0", "cuda:1"]
    assert matrix.concrete_devices(toy[0], ["cuda:1"]) == ["cuda:1"]
    assert matrix.concrete_devices(toy[0], ["all"]) == ["cpu", "cuda:0", "cuda:1"]


def test_selection_narrows_every_axis(toy: list[Case]) -> None:
    plan = expand(toy, Selection(fixes=("none",), dtypes=("float16",), devices=("cpu",)))
    assert plan.to_run == [Cell("toy-mixed-matmul", "none", "cpu", "float16", "half", "eager")]
    assert plan.skipped == []


@pytest.mark.parametrize(
    ("selection", "message"),
    [
        (Selection(cases=("toy-mixed-matmal",)), "did you mean toy-mixed-matmul"),
        (Selection(fixes=("cast-inptu",)), "did you mean cast-input"),
        (Selection(dtypes=("fp16",)), "unknown dtype 'fp16'"),
        (Selection(modes=("halve",)), "did you mean half"),
        (Selection(backends=("flash",)), "unknown backend 'flash'"),
        (Selection(devices=("gpu",)), "unknown device 'gpu'"),
    ],
)
def test_unknown_names_are_refused_with_suggestions(
    toy: list[Case], selection: Selection, message: str
) -> None:
    with pytest.raises(SelectionError, match=message):
        check_selection(toy, selection)


def test_backend_skip_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.measure.host import environment, flash_kernels

    monkeypatch.setattr(flash_kernels, "installed_version", lambda dist: None)
    assert "neither flash-attn 2" in str(environment.backend_skip_reason("cuda:0", "flash-attn"))
    assert environment.backend_skip_reason("cpu", "flash-attn-contract") is None
    monkeypatch.setattr(flash_kernels, "installed_version", lambda dist: "2.8.3")
    assert environment.backend_skip_reason("cpu", "flash-attn") == "flash-attn needs a CUDA device"
    assert environment.backend_skip_reason("cuda:0", "flash-attn") is None
    assert "real flash-attn kernel runs here instead" in str(
        environment.backend_skip_reason("cuda:0", "flash-attn-contract")
    )


def test_missing_requirement_skips_with_the_module_name() -> None:
    reason = environment.environment_skip_reason(
        Cell("c", "none", "cpu", "float16", "half", "sdpa"), ("surely_not_installed_mod",)
    )
    assert reason == "surely_not_installed_mod not importable in this environment"


def test_case_specific_skip_reason_is_recorded(
    toy: list[Case], monkeypatch: pytest.MonkeyPatch
) -> None:
    def skip_noisy(self: Case, cell: Cell) -> str | None:
        return "noisy is not meant for bfloat16" if cell.fix == "noisy" else None

    monkeypatch.setattr(type(toy[0]), "skip_reason", skip_noisy)
    plan = expand(toy, Selection(devices=("cpu",), dtypes=("bfloat16",)))
    assert [(c.fix, r) for c, r in plan.skipped] == [("noisy", "noisy is not meant for bfloat16")]
    assert "noisy" not in {c.fix for c in plan.to_run}


def test_a_case_older_torch_cannot_run_is_skipped_with_the_release_it_needs() -> None:
    assert environment.torch_version_skip_reason("2.4", "2.3.1+cu121") == (
        "needs torch >= 2.4 (this is 2.3.1)"
    )
    assert environment.torch_version_skip_reason("2.4", "2.4.1") is None
    assert environment.torch_version_skip_reason("2.4", "2.13.0") is None  # not text order
    assert environment.torch_version_skip_reason(None, "2.1.2") is None


def test_a_fix_naming_a_dtype_its_case_lacks_is_a_contract_problem() -> None:
    from harness.measure.authoring.case import fix

    class Narrow(Case):
        name = "narrow"
        dtypes = ("float16",)

        @fix("none", rationale="upstream", dtypes=("bfloat16",))
        def none(self, w: object, ctx: object) -> None:
            return None

    assert "fix 'none' names dtype 'bfloat16' the case does not declare" in (
        registry.contract_problems(Narrow())
    )
