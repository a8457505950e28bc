"""The workload-size axis: declaration, expansion, identity, timing policy, views, CLI."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from harness.measure.authoring import registry
from harness.measure.authoring.case import Case, Size
from harness.measure.authoring.registry import contract_problems
from harness.results import storage
from harness.results.speed import speed_ratios
from harness.results.summary import render_summary
from harness.runner import matrix
from harness.runner.matrix import expand
from harness.runner.run import timed_sizes
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, Outcome, Perf
from harness.schema.selection import Selection, SelectionError, check_selection
from tests.conftest import FIXTURES, harness, only_run_dir

SIZED_CASES = FIXTURES / "sized_cases"


@pytest.fixture
def sized(clean_registry: None) -> Case:
    for path in registry.case_module_paths(SIZED_CASES):
        registry._import_case_module(path)
    return registry.get("toy-sized")


def sizes_of(cells: list[Cell]) -> set[tuple[str, str]]:
    return {(c.device, c.size) for c in cells}


def test_cpu_runs_the_small_size_and_cuda_both_by_default(
    sized: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(matrix, "cuda_devices", lambda: ["cuda:0"])
    cells = list(matrix.case_cells(sized, ["cpu", "cuda:0"]))
    assert sizes_of(cells) == {("cpu", "small"), ("cuda:0", "small"), ("cuda:0", "upstream")}


@pytest.mark.parametrize(
    ("asked", "expected"),
    [(("all",), {"small", "upstream"}), (("upstream",), {"upstream"}), (("small",), {"small"})],
)
def test_size_selection_on_the_cpu(
    sized: Case, asked: tuple[str, ...], expected: set[str]
) -> None:
    plan = expand([sized], Selection(devices=("cpu",), sizes=asked))
    assert {c.size for c in plan.to_run} == expected


def test_cells_of_one_size_come_together(sized: Case) -> None:
    cells = list(matrix.case_cells(sized, ["cpu"], ("all",)))
    sizes = [c.size for c in cells]
    assert sizes == sorted(sizes, key=("small", "upstream").index)


def test_a_case_without_sizes_runs_at_the_small_size_with_no_dims(toy_registry: None) -> None:
    toy = registry.get("toy-mixed-matmul")
    assert toy.size_names == ("small",) and toy.dims("small") is None
    assert {c.size for c in matrix.case_cells(toy, ["cpu"], ("all",))} == {"small"}


def test_an_unknown_size_is_refused_with_a_suggestion(sized: Case) -> None:
    with pytest.raises(SelectionError, match="unknown size 'upstrem'; did you mean upstream"):
        check_selection([sized], Selection(sizes=("upstrem",)))


@pytest.mark.parametrize(
    ("sizes", "problem"),
    [
        ((Size("upstream", None, "cfg"),), "sizes must start with 'small'"),
        ((Size("small", None, ""), Size("huge", None, "cfg")), "unknown size 'huge'"),
        ((Size("small", None, ""), Size("upstream", None, " ")), "does not cite"),
        ((Size("small", None, ""), Size("small", None, "")), "sizes repeat a name"),
        (({"small": None},), "tuple of Size(name, dims, source)"),
    ],
)
def test_size_declarations_are_checked(
    sized: Case, sizes: tuple[object, ...], problem: str
) -> None:
    broken = type("Broken", (type(sized),), {"sizes": sizes})()
    assert any(problem in p for p in contract_problems(broken))


def test_size_is_part_of_identity_and_column_but_small_ids_are_unchanged() -> None:
    small = Cell("c", "none", "cpu", "float16", "half", "sdpa")
    upstream = dataclasses.replace(small, size="upstream")
    assert small.id == "c[none,cpu,float16,half,sdpa]"
    assert upstream.id == "c[none,cpu,float16,half,sdpa,size=upstream]"
    assert small.column != upstream.column and upstream.column.id.endswith(",size=upstream]")
    assert Cell.from_dict(upstream.to_dict()) == upstream
    old = {k: v for k, v in small.to_dict().items() if k != "size"}  # written before sizes
    assert Cell.from_dict(old) == small


def ran(device: str, size: str, outcome: Outcome = Outcome.PASSES) -> CellRecord:
    return CellRecord(
        Cell("c", "none", device, "float16", "half", "sdpa", size=size), "2", outcome
    )


def test_each_device_times_one_size_upstream_on_cuda_small_on_cpu() -> None:
    records = [ran(d, s) for d in ("cpu", "cuda:0") for s in ("small", "upstream")]
    assert timed_sizes(records) == {("c", "cpu"): "small", ("c", "cuda:0"): "upstream"}


def test_the_timed_size_falls_back_to_the_size_that_ran() -> None:
    records = [
        ran("cpu", "upstream"),
        ran("cuda:0", "small"),
        ran("cuda:0", "upstream", Outcome.SKIPPED),
    ]
    assert timed_sizes(records) == {("c", "cpu"): "upstream", ("c", "cuda:0"): "small"}


def timed(cell: Cell, median: float) -> CellRecord:
    perf = Perf(
        [median], 1, median, 0.0, median, 1, False, "fake", 1, None, None, None, None, 0, "fake"
    )
    return CellRecord(cell, "2.13.0", Outcome.PASSES, perf=perf)


def test_speed_is_never_compared_across_sizes() -> None:
    control = Cell("c", "none", "cpu", "float32", "fp32", "sdpa")
    fix = Cell("c", "cast", "cpu", "float16", "half", "sdpa")
    big = {"size": "upstream"}
    records = [
        timed(control, 1.0),
        timed(fix, 2.0),
        timed(dataclasses.replace(control, **big), 100.0),
        timed(dataclasses.replace(fix, **big), 50.0),
    ]
    ratios = speed_ratios(records)
    assert ratios["2.13.0", fix].vs_control == 2.0
    assert ratios["2.13.0", dataclasses.replace(fix, **big)].vs_control == 0.5
    assert ratios["2.13.0", fix].vs_fastest == 1.0  # not 2.0 / 50.0 from the other size


def test_summary_shows_one_table_per_case_and_size() -> None:
    summary = render_summary([ran("cpu", "small"), ran("cpu", "upstream", Outcome.RAISES)])
    assert "c  (size small)" in summary and "c  (size upstream)" in summary
    assert "(size" not in render_summary([ran("cpu", "small")])


def test_both_sizes_run_end_to_end_and_only_one_is_timed_on_the_cpu(tmp_path: Path) -> None:
    result = harness(
        "run",
        "--cases-dir",
        str(SIZED_CASES),
        "--case",
        "toy-sized",
        "--device",
        "cpu",
        "--size",
        "all",
        "--time-budget",
        "0.02",
        "--out",
        str(tmp_path),
        "-n",
        "1",
    )
    assert result.returncode == 0, result.stderr
    records = {r.cell: r for r in storage.read_records(only_run_dir(tmp_path))}
    passing = {c: r for c, r in records.items() if c.fix == "cast-input"}
    assert {c.size for c in passing} == {"small", "upstream"}
    assert all(r.outcome is Outcome.PASSES for r in passing.values())  # dims reached the fix
    assert {c.size for c, r in records.items() if r.perf is not None} == {"small"}
    assert "toy-sized  (size upstream)" in result.stdout
    flops = {r.perf.flops for r in records.values() if r.perf and r.cell.fix == "cast-input"}
    assert flops == {2 * 2 * 8 * 8}  # the small size's matmul


def test_list_shows_each_size_and_its_source() -> None:
    result = harness("list", "--cases-dir", str(SIZED_CASES))
    assert result.returncode == 0, result.stderr
    assert "size upstream: rows=4, width=32" in result.stdout
    assert "from: example/toy config.json: width=32" in result.stdout
