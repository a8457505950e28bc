"""The files of a run folder beside its records (``env.json``, ``cases.json``,
``run-plan.json``): each written and read through its one declaration, versioned, older
files read as they are, newer ones refused and a malformed one named by file and field."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness.report import aggregate, writing
from harness.results import storage
from harness.schema.axes import Cell
from harness.schema.config import Limits, RunConfig, TimingConfig
from harness.schema.run_files import (
    SHOWN,
    VERSION_KEY,
    CaseInfo,
    CaseList,
    Environment,
    RunPlan,
    Shown,
)

DATA = Path(__file__).parent / "data" / "runs"
#: Stored runs written before the files had versions: one from before the run's
#: configuration was kept (no run plan, no ``config`` in env.json), one after.
UNVERSIONED = (DATA / "torch-2.13.0", DATA / "patterns-torch-2.13.0")

ENV = Environment(
    torch_version="2.13.0+cpu",
    cudnn_version=None,
    gpus=[{"device": "cuda:0", "name": "H100", "capability": "9.0", "memory_bytes": 8}],
    cpu_count=2,
    load_average=[0.5, 1.0, 1.5],
    peak_gflops={"cpu": {"float16": 12.5}},
    packages={"torch": "2.13.0", "flash-attn": None},
    timing=None,
    command=["python -m harness", "run"],
    timing_phase={"cells": 3, "wall_s": 1.5, "measured_s": 1.0},
    resumed=[{"at": "2026-01-01T00:00:00+00:00", "dropped_partial_line": None}],
)
CASE = CaseInfo(
    name="toy",
    title="A toy",
    upstream={"repo": "a/b", "issues": ["a/b#1"], "url": None},
    failure={"error_type": "RuntimeError", "message": "dtype"},
    fixes=[{"name": "none", "rationale": "as upstream", "upstream": None}],
    keep_fp32=["norm"],
    sizes={"small": {"dims": {"d": "4"}, "source": "toy"}},
)
CELLS = (
    Cell("toy", "none", "cpu", "float16", "half", "sdpa"),
    Cell("toy", "cast", "cpu", "bfloat16", "half", "sdpa"),
)
PLAN = RunPlan(
    config=RunConfig(workers="2", timing=TimingConfig(budget_s=0.1), limits=Limits(9.0)),
    cells=CELLS[:1],
    skipped=((CELLS[1], "bf16 needs sm80+"),),
)


def through_json(data: dict[str, Any]) -> Any:
    return json.loads(json.dumps(data))


def test_each_file_round_trips_through_its_declaration(tmp_path: Path) -> None:
    assert Environment.from_dict(through_json(ENV.to_dict())) == ENV
    assert CaseList.from_dict(through_json(CaseList((CASE,)).to_dict())) == CaseList((CASE,))
    assert RunPlan.from_dict(through_json(PLAN.to_dict())) == PLAN
    storage.write_env(tmp_path, ENV)
    storage.write_cases(tmp_path, [CASE])
    storage.write_run_plan(tmp_path, PLAN)
    assert storage.read_env(tmp_path) == ENV
    assert storage.read_cases(tmp_path) == {"toy": CASE}
    assert storage.read_run_plan(tmp_path) == PLAN
    assert storage.read_run_config(tmp_path) == PLAN.config  # what a worker reads


def test_a_worker_reads_the_configuration_without_the_cells(tmp_path: Path) -> None:
    write(tmp_path / storage.RUN_PLAN_FILE, {**PLAN.to_dict(), "cells": [1]})
    assert storage.read_run_config(tmp_path) == PLAN.config
    write(tmp_path / storage.RUN_PLAN_FILE, {**PLAN.to_dict(), VERSION_KEY: 3})
    with pytest.raises(storage.ResultsError, match="schema_version 3 is newer"):
        storage.read_run_config(tmp_path)


def test_each_file_carries_its_version_and_every_field() -> None:
    env = ENV.to_dict()
    assert env[VERSION_KEY] == Environment.VERSION == 2
    assert set(env) == {VERSION_KEY, *(f.name for f in dataclasses.fields(Environment))}
    assert "config" not in env  # run-plan.json holds the configuration
    assert CaseList((CASE,)).to_dict()[VERSION_KEY] == CaseList.VERSION == 2
    assert PLAN.to_dict()[VERSION_KEY] == RunPlan.VERSION == 2


@pytest.mark.parametrize("run_dir", UNVERSIONED, ids=lambda p: p.name)
def test_files_written_before_versions_are_read_as_version_1(run_dir: Path) -> None:
    raw = json.loads((run_dir / storage.ENV_FILE).read_text())
    assert VERSION_KEY not in raw
    env = storage.read_env(run_dir)
    assert env.torch_version == raw["torch_version"] and env.timing == raw["timing"]
    assert env.command == raw["command"] and env.gpus == raw["gpus"]
    # the report shows what it showed before: the facts the file holds, in the same order
    assert [name for name, _ in env.facts()] == [name for name in SHOWN if name in raw]
    cases = json.loads((run_dir / storage.CASES_FILE).read_text())
    assert isinstance(cases, list)  # version 1: a list, no version
    assert list(storage.read_cases(run_dir)) == [case["name"] for case in cases]
    if (run_dir / storage.RUN_PLAN_FILE).exists():
        raw_plan = json.loads((run_dir / storage.RUN_PLAN_FILE).read_text())
        plan = storage.read_run_plan(run_dir)
        assert plan.cells == tuple(Cell.from_dict(cell) for cell in raw_plan["cells"])
        assert plan.config == RunConfig.from_dict(raw_plan["config"])


def test_the_oldest_run_plan_kept_the_configuration_at_the_top() -> None:
    oldest = {"cells": [CELLS[0].to_dict()], "skipped": [], "limits": {"timeout_s": 5.0}}
    plan = RunPlan.from_dict(oldest)
    assert plan.config.limits.timeout_s == 5.0 and plan.cells == CELLS[:1]
    with pytest.raises(ValueError, match="malformed run plan: config: expected dict"):
        RunPlan.from_dict({**oldest, VERSION_KEY: 2})  # a versioned plan has its config


def test_env_facts_show_nulls_that_say_something_and_hide_unknowns() -> None:
    facts = dict(Environment(torch_version="2.13.0").facts())
    assert facts["cuda_version"] is None and facts["timing"] is None  # no CUDA, not timed
    assert "workers" not in facts and "load_average" not in facts  # a run not finished
    assert all(shown is not Shown.NEVER for shown in SHOWN.values())
    assert Environment().facts() == []  # env.json missing or unreadable: nothing to show


def write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


READERS: dict[str, Callable[[Path], object]] = {
    storage.ENV_FILE: storage.read_env,
    storage.CASES_FILE: storage.read_cases,
    storage.RUN_PLAN_FILE: storage.read_run_plan,
}


@pytest.mark.parametrize(
    ("name", "data"),
    [
        (storage.ENV_FILE, {VERSION_KEY: 3, "torch_version": "2.13.0"}),
        (storage.CASES_FILE, {VERSION_KEY: 3, "cases": []}),
        (storage.RUN_PLAN_FILE, {VERSION_KEY: 3, "cells": [], "skipped": []}),
    ],
)
def test_a_file_from_a_newer_ampmatrix_is_refused_naming_it(
    tmp_path: Path, name: str, data: dict[str, Any]
) -> None:
    path = write(tmp_path / name, data)
    with pytest.raises(storage.ResultsError) as refused:
        READERS[name](tmp_path)
    assert str(refused.value) == (
        f"{path}: schema_version 3 is newer than this ampmatrix reads (up to 2); "
        "upgrade ampmatrix to read it"
    )


def test_a_report_lists_a_newer_env_json_and_reads_the_rest(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for name in (storage.CELLS_FILE, storage.CASES_FILE):
        (run / name).write_bytes((UNVERSIONED[0] / name).read_bytes())
    write(run / storage.ENV_FILE, {VERSION_KEY: 9})
    loaded = aggregate.load_run(run)
    assert loaded.records and loaded.env == Environment()
    newer = "schema_version 9 is newer than this ampmatrix reads (up to 2)"
    assert loaded.problems == [f"{run / storage.ENV_FILE}: {newer}; upgrade ampmatrix to read it"]
    assert "schema_version 9 is newer" in writing.render_report([loaded])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"cpu_count": "two"}, "cpu_count: expected int or null, got str 'two'"),
        ({"gpus": [{"name": "H100"}, 3]}, "gpus[1]: expected an object of Any, got int 3"),
        ({"command": ["python", 1]}, "command[1]: expected str, got int 1"),
        ({VERSION_KEY: "2"}, "schema_version: expected a version number, got str '2'"),
        ([], "expected a JSON object, got list"),
    ],
)
def test_a_malformed_env_json_names_its_field(tmp_path: Path, data: Any, message: str) -> None:
    path = write(tmp_path / storage.ENV_FILE, data)
    with pytest.raises(storage.ResultsError) as refused:
        storage.read_env(tmp_path)
    assert str(refused.value) == f"{path}: {message}"


def test_a_field_of_env_json_of_the_wrong_type_is_left_out_when_read_tolerantly(
    tmp_path: Path,
) -> None:
    path = write(tmp_path / storage.ENV_FILE, {"hostname": "box", "cpu_count": "two"})
    problems: list[str] = []
    assert storage.read_env(tmp_path, problems) == Environment(hostname="box")
    assert problems == [f"{path}: cpu_count: expected int or null, got str 'two' (left out)"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({VERSION_KEY: 2, "cases": [{"name": "a", "title": 3}]}, "case 0.title: expected str"),
        ({VERSION_KEY: 2, "cases": [{"title": "no name"}]}, "case 0: no name"),
        ([{"name": "a", "keep_fp32": "norm"}], "case 0.keep_fp32: expected a list of str"),
        ({VERSION_KEY: 2}, "cases: expected list, got NoneType None"),
        ({"cases": []}, "expected a list of cases"),  # no version: a list, as version 1 was
    ],
)
def test_a_malformed_cases_json_names_its_case_and_field(
    tmp_path: Path, data: Any, message: str
) -> None:
    path = write(tmp_path / storage.CASES_FILE, data)
    with pytest.raises(storage.ResultsError) as refused:
        storage.read_cases(tmp_path)
    assert str(refused.value).startswith(f"{path}: {message}")


def test_a_malformed_case_is_left_out_of_a_report_and_named(tmp_path: Path) -> None:
    good = CASE.to_dict()
    path = write(
        tmp_path / storage.CASES_FILE,
        {VERSION_KEY: 2, "cases": [{**good, "name": "bad", "fixes": [{"name": 1}]}, good]},
    )
    problems: list[str] = []
    assert storage.read_cases(tmp_path, problems) == {"toy": CASE}
    assert problems == [
        f"{path}: case 0.fixes[0]['name']: expected str or null, got int 1 (left out)"
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"cells": [1]}, "malformed run plan: cells[0]: expected an object, got int 1"),
        ({"cells": [{"case": "toy"}]}, "malformed run plan: cells[0]: no fix"),
        ({"cells": [{**CELLS[0].to_dict(), "dtype": 16}]}, "cells[0].dtype: expected a name"),
        ({"skipped": [[CELLS[1].to_dict()]]}, "skipped[0]: expected a cell and a reason"),
        ({"config": {"batch": 0}}, "malformed run plan: config.batch: expected a positive"),
        ({"config": {"limits": 5}}, "malformed run plan: config.limits: expected an object"),
        ({"cells": {}}, "not a run plan (no lists of cells and skipped cells)"),
    ],
)
def test_a_malformed_run_plan_names_its_field(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    path = write(tmp_path / storage.RUN_PLAN_FILE, {**PLAN.to_dict(), **change})
    with pytest.raises(storage.ResultsError) as refused:
        storage.read_run_plan(tmp_path)
    assert str(refused.value).startswith(f"{path}: ") and message in str(refused.value)
    assert "\n" not in str(refused.value)
