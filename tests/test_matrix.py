"""Matrix expansion, selection and skip reasons."""

from __future__ import annotations

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
    # none, cast-input: 2 dtypes in half + the fp32 control for none; three half-only fixes.
    assert len(cells) == 2 * 2 + 1 + 3 * 2
    assert Cell("toy-mixed-matmul", "none", "cpu", "float32", "fp32", "eager") in cells
    assert all(c.mode == "half" for c in cells if c.fix != "none")
    assert len(set(cells)) == len(cells)


def test_fp32_control_runs_only_the_upstream_path(toy: list[Case]) -> None:
    fp32 = [c for c in matrix.case_cells(toy[0], ["cpu"]) if c.mode == "fp32"]
    assert [(c.fix, c.dtype) for c in fp32] == [("none", "float32")]


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
