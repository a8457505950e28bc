"""Results files built to break their reader: JSON nested thousands deep, lines and files
too large to hold, values that no record's field has. A bad line of ``cells.jsonl`` is a
problem named by file and line and the rest is read; a bad ``env.json`` or
``run-plan.json`` is one error naming the file; and the record parser raises its own
error, never another, whatever JSON value it is given."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harness import cli
from harness.report import aggregate, compare
from harness.results import storage
from harness.schema.records import CellRecord, MalformedRecord
from harness.schema.typed import MAX_DEPTH

DATA = Path(__file__).parent / "data" / "runs"
NEW = DATA / "torch-2.13.0"
#: About 200 KB of brackets: far deeper than Python's recursion limit.
DEEP_LIST = "[" * 100_000 + "]" * 100_000
DEEP_OBJECT = '{"a":' * 40_000 + "1" + "}" * 40_000
DEEP_TEXTS = pytest.mark.parametrize("deep", [DEEP_LIST, DEEP_OBJECT], ids=["list", "object"])


def copied_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(NEW, run)
    return run


def nested(depth: int, inner: Any = "x") -> Any:
    """``inner`` inside ``depth`` lists, built without recursion."""
    for _ in range(depth):
        inner = [inner]
    return inner


def with_line(run: Path, number: int, line: str) -> Path:
    """``cells.jsonl`` with ``line`` put in as its line ``number`` (from 1)."""
    cells = run / storage.CELLS_FILE
    lines = cells.read_text().splitlines()
    lines.insert(number - 1, line)
    cells.write_text("".join(f"{text}\n" for text in lines))
    return cells


@DEEP_TEXTS
def test_a_deeply_nested_line_of_cells_jsonl_is_named_and_the_rest_is_read(
    tmp_path: Path, deep: str
) -> None:
    run = copied_run(tmp_path)
    cells = with_line(run, 2, deep)
    problems: list[str] = []
    records = storage.read_record_lines(run, problems)
    assert len(records) == len(storage.read_record_lines(NEW))
    (problem,) = problems
    assert problem.startswith(f"{cells}:2: ") and "nested" in problem
    with pytest.raises(storage.ResultsError, match=rf"^{cells}:2: "):
        storage.read_record_lines(run)


@DEEP_TEXTS
@pytest.mark.parametrize("name", [storage.ENV_FILE, storage.RUN_PLAN_FILE, storage.CASES_FILE])
def test_a_deeply_nested_json_file_is_one_error_naming_it(
    tmp_path: Path, deep: str, name: str
) -> None:
    run = copied_run(tmp_path)
    storage.write_run_plan(run, storage.read_run_plan(DATA / "patterns-torch-2.13.0"))
    (run / name).write_text(deep)
    read: dict[str, Callable[[Path], object]] = {
        storage.ENV_FILE: storage.read_env,
        storage.RUN_PLAN_FILE: storage.read_run_plan,
        storage.CASES_FILE: storage.read_cases,
    }
    with pytest.raises(storage.ResultsError, match=rf"^{run / name}: .*nested"):
        read[name](run)
    if name == storage.RUN_PLAN_FILE:
        with pytest.raises(storage.ResultsError, match=rf"^{run / name}: .*nested"):
            storage.read_run_config(run)


@DEEP_TEXTS
def test_report_and_compare_of_a_run_with_a_deeply_nested_env_json_go_on_without_it(
    tmp_path: Path, deep: str, capsys: pytest.CaptureFixture[str]
) -> None:
    run = copied_run(tmp_path)
    (run / storage.ENV_FILE).write_text(deep)
    assert cli.main(["report", str(run), "--out", str(tmp_path / "r.html")]) == 0
    assert cli.main(["compare", str(NEW), str(run)]) == 0
    err = capsys.readouterr().err
    assert f"ampmatrix: warning: {run / storage.ENV_FILE}: " in err
    assert "Traceback" not in err


def test_a_free_form_fact_of_env_json_nested_too_deep_is_refused_naming_the_file(
    tmp_path: Path,
) -> None:
    """``flags``, ``gpus`` and ``timing`` hold any JSON and the report prints them as they
    are: nested 900 deep (json reads it), printing them would exceed the recursion limit."""
    run = copied_run(tmp_path)
    env = json.loads((run / storage.ENV_FILE).read_text())
    for depth in (MAX_DEPTH + 1, 900):
        env["flags"] = {"deep": nested(depth)}
        (run / storage.ENV_FILE).write_text(json.dumps(env))
        with pytest.raises(storage.ResultsError, match=f"nested deeper than {MAX_DEPTH}"):
            storage.read_env(run, problems=[])
        loaded = aggregate.load_run(run)
        assert any(p.startswith(f"{run / storage.ENV_FILE}: ") for p in loaded.problems)
        assert compare.environment_key(loaded.env)  # the rest of the run is still read
    env["flags"] = {"deep": nested(MAX_DEPTH - 2)}  # within the limit: read as it is
    (run / storage.ENV_FILE).write_text(json.dumps(env))
    assert storage.read_env(run).flags == {"deep": nested(MAX_DEPTH - 2)}


def test_a_line_of_cells_jsonl_over_the_size_limit_is_named_without_parsing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage, "MAX_LINE_BYTES", 4096, raising=False)
    run = copied_run(tmp_path)
    cells = with_line(run, 3, json.dumps({"error_message": "x" * 5000}))
    problems: list[str] = []
    records = storage.read_record_lines(run, problems)
    assert len(records) == len(storage.read_record_lines(NEW))
    assert problems == [f"{cells}:3: a line of 5021 bytes, over the 4096 a record may take"]


@pytest.mark.parametrize("name", [storage.ENV_FILE, storage.RUN_PLAN_FILE])
def test_a_json_file_over_the_size_limit_is_one_error_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    monkeypatch.setattr(storage, "MAX_FILE_BYTES", 1024, raising=False)
    run = copied_run(tmp_path)
    (run / name).write_text(json.dumps({"padding": "x" * 2000}))
    with pytest.raises(storage.ResultsError, match=rf"^{run / name}: over the 1024 bytes"):
        storage.read_env(run) if name == storage.ENV_FILE else storage.read_run_plan(run)


def test_a_results_file_that_is_a_folder_costs_only_itself(tmp_path: Path) -> None:
    run = copied_run(tmp_path)
    (run / storage.ENV_FILE).unlink()
    (run / storage.ENV_FILE).mkdir()
    with pytest.raises(storage.ResultsError, match=rf"^{run / storage.ENV_FILE}: "):
        storage.read_env(run)
    loaded = aggregate.load_run(run)
    assert loaded.records and loaded.problems[0].startswith(f"{run / storage.ENV_FILE}: ")


def a_record() -> dict[str, Any]:
    line = (NEW / storage.CELLS_FILE).read_text().splitlines()[0]
    data: dict[str, Any] = json.loads(line)
    return data


ISLAND = {"site": {"op": "mm"}, "dtype": "float32"}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        pytest.param({"island": ISLAND | {"share": 10**400}}, "share", id="huge-share"),
        pytest.param({"island": ISLAND | {"share": "0.5"}}, "share", id="text-share"),
        pytest.param({"outcome": nested(5000)}, "outcome", id="deep-outcome"),
        pytest.param({"error_message": nested(5000)}, "error_message", id="deep-message"),
        pytest.param({"flags": [nested(5000)]}, "flags", id="deep-flag"),
        pytest.param({"leaves": {"out": {"rel_err": nested(5000)}}}, "leaves", id="deep-leaf"),
        pytest.param({"outcome": ...}, "no outcome", id="no-outcome"),
        pytest.param({"case": ...}, "no case", id="no-case"),
    ],
)
def test_the_record_parser_raises_only_its_own_error_naming_the_field(
    change: dict[str, Any], named: str
) -> None:
    data = a_record() | change
    data = {key: value for key, value in data.items() if value is not ...}
    with pytest.raises(MalformedRecord, match=named):
        CellRecord.from_dict(data)


@pytest.mark.parametrize("value", [None, [], "record", 1.5, nested(5000), [a_record()]])
def test_a_record_that_is_not_an_object_is_a_malformed_record(value: Any) -> None:
    with pytest.raises(MalformedRecord, match="record: expected an object"):
        CellRecord.from_dict(value)


def test_a_file_is_written_with_a_lone_surrogate_shown_escaped(tmp_path: Path) -> None:
    """A folder's name with a byte that is not UTF-8 (``\\udcff`` in Python's string) goes
    into the page of its report: UTF-8 has no encoding for it, and writing failed."""
    page = tmp_path / "report.html"
    storage.write_atomic(page, "<h1>run\udcff</h1>")
    assert page.read_text() == "<h1>run\\udcff</h1>"


@pytest.mark.parametrize("text", ["case\\ud800", "\\udcff", "a\\uDFFFb"])
def test_a_json_string_with_a_lone_surrogate_is_a_named_problem(tmp_path: Path, text: str) -> None:
    """JSON can escape half of a UTF-16 pair (``"\\ud800"``); such a string is no text (it
    cannot be written, URL-quoted or encoded) and its line is refused, naming it."""
    run = copied_run(tmp_path)
    line = json.dumps(a_record()).replace('"dia-sdpa-kv-cache"', f'"{text}"', 1)
    cells = with_line(run, 1, line)
    problems: list[str] = []
    records = storage.read_record_lines(run, problems)
    assert len(records) == len(storage.read_record_lines(NEW))
    assert problems == [f"{cells}:1: a string with a lone surrogate (not text)"]
    pair = json.dumps(a_record()).replace('"dia-sdpa-kv-cache"', '"\\ud83d\\ude00"', 1)
    cells.write_text(pair + "\n")  # a whole pair is one character, read as it is
    assert storage.read_record_lines(run)[0].cell.case == "\U0001f600"
    (run / storage.ENV_FILE).write_text(f'{{"hostname": "{text}"}}')
    with pytest.raises(storage.ResultsError, match=rf"^{run / storage.ENV_FILE}: .*surrogate"):
        storage.read_env(run)
