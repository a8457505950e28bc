"""The report reads a run of the current schema as columns (``harness.results.columns`` and
``harness.report.rows``), building no record per cell: its rows must be those the record by
record reading gives, column by column, for every stored run; a run it cannot vouch for
is read record by record, which names each problem with its file and line."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from harness.report import rows, runs
from harness.report.rows import ROW_COLUMNS, VERDICT_FIELDS
from harness.results import columns, storage
from harness.schema.records import NESTED, CellRecord, MalformedRecord, plain_field_names
from harness.schema.trail_records import Trail

DATA = Path(__file__).parent / "data" / "runs"
STORED = sorted(DATA.iterdir())


def current_schema_copy(source: Path, folder: Path) -> Path:
    """``source`` with each record rewritten as the current schema writes it."""
    shutil.copytree(source, folder)
    lines = (source / storage.CELLS_FILE).read_text().splitlines()
    records = [CellRecord.from_dict(json.loads(line)).to_dict() for line in lines]
    text = "".join(json.dumps(r, allow_nan=False, sort_keys=True) + "\n" for r in records)
    (folder / storage.CELLS_FILE).write_text(text)
    return folder


def same(a: Any, b: Any) -> bool:
    """Equal, a missing number (NaN) equal to itself, in a fit's losses too."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and (a == b or repr(a) == repr(b))


def differences(got: dict[str, list[Any]], expected: dict[str, list[Any]]) -> list[str]:
    assert list(got) == list(expected)
    return [
        f"{name}[{i}]: {a!r} != {b!r}"
        for name in expected
        for i, (a, b) in enumerate(zip(got[name], expected[name], strict=True))
        if not same(a, b)
    ]


@pytest.fixture(params=["orjson", "json"])
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test of this name runs with orjson, and with the standard library's parser that
    stands in where orjson is not installed."""
    if request.param == "json":
        monkeypatch.setattr(columns, "orjson", None)
        monkeypatch.setattr(rows, "orjson", None)
    elif columns.orjson is None:
        pytest.skip("orjson is not installed")
    return str(request.param)


@pytest.mark.parametrize("source", STORED, ids=[s.name for s in STORED])
def test_a_stored_run_reads_as_columns_into_the_rows_of_its_records(
    source: Path, tmp_path: Path, parser: str
) -> None:
    run_dir = current_schema_copy(source, tmp_path / source.name)
    assert columns.parsed_run(run_dir) is not None, "the current schema is read as columns"
    by_columns = runs.load_rows(run_dir)
    expected = runs.run_columns(runs.load_run(run_dir))
    assert by_columns.rows is not None and not by_columns.problems
    assert list(expected) == [*ROW_COLUMNS, "device_label"]
    assert not differences(by_columns.rows, expected)
    # the stored run itself (schema 1 or 2) is read record by record, to the same rows
    assert columns.parsed_run(source) is None
    assert not differences(runs.load_rows(source).rows or {}, expected)


def test_the_columns_build_no_record_per_cell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One record per distinct verdict, not per cell: the same run read twice builds none
    the second time."""
    run_dir = current_schema_copy(DATA / "torch-2.13.0", tmp_path / "run")
    runs.load_rows(run_dir)
    built: list[Any] = []
    original = CellRecord.from_dict

    def counted(data: Any) -> CellRecord:
        built.append(data)
        return original(data)

    monkeypatch.setattr(CellRecord, "from_dict", counted)
    assert runs.load_rows(run_dir).rows
    assert built == []


def test_every_typed_field_is_in_the_verdict_key() -> None:
    """A field checked by building its record (not as a column) must be in the key, or a
    line that differs from the one checked only there would go unchecked."""
    flat = {c.name for c in columns.FIELD_CHECKS}
    first = (DATA / "torch-2.13.0" / storage.CELLS_FILE).read_text().splitlines()[0]
    record = CellRecord.from_dict(json.loads(first))
    typed = set(record.to_dict()) - flat - {"schema_version", "leaves"}  # leaves: columns too
    assert typed <= set(VERDICT_FIELDS)
    assert set(Trail().to_dict()) <= set(VERDICT_FIELDS)
    assert set(plain_field_names()) <= flat and {"tolerance", "time_median_s"} <= flat
    assert {marker for _, marker in NESTED.values()} <= flat


def rewritten(run_dir: Path, number: int, change: dict[str, Any]) -> None:
    """Line ``number`` (from 1) of the run with ``change`` applied."""
    path = run_dir / storage.CELLS_FILE
    lines = path.read_text().splitlines()
    lines[number - 1] = json.dumps(json.loads(lines[number - 1]) | change)
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(
    "change",
    [
        {"rel_err": "small"},
        {"time_noisy": 1},
        {"reproduces": 1},
        {"flags": [{"kind": "sideways", "detail": "", "share": None}]},
        {"promotion": {"site": 3}},
        {"leaves": {"out": {"rel_err": 0.1}}},
        {
            "leaves": {
                "out": {
                    "rel_err": "NaN",
                    "max_abs_err": 1.0,
                    "baseline_rel_err": None,
                    "tolerance": 1,
                    "tolerance_rule": "r",
                    "finite": 1,
                }
            }
        },
        {"case": ""},
        {"torch_version": None},
        {"schema_version": 4},
    ],
)
def test_a_line_the_columns_cannot_vouch_for_is_named_as_today(
    change: dict[str, Any], tmp_path: Path
) -> None:
    run_dir = current_schema_copy(DATA / "torch-2.13.0", tmp_path / "run")
    lines = (run_dir / storage.CELLS_FILE).read_text().splitlines()
    # a figure of the timing is checked in a line that was timed
    number = (
        3
        if "time_noisy" not in change
        else 1
        + next(i for i, line in enumerate(lines) if json.loads(line)["time_median_s"] is not None)
    )
    rewritten(run_dir, number, change)
    expected = runs.load_run(run_dir)
    loaded = runs.load_rows(run_dir)
    assert loaded.problems == expected.problems
    assert not differences(loaded.rows or {}, runs.run_columns(expected))
    if change != {"schema_version": 4}:
        cells = run_dir / storage.CELLS_FILE
        assert len(loaded.problems) == 1
        assert loaded.problems[0].startswith(f"{cells}:{number}: ")


def test_a_broken_line_is_named_with_its_file_and_line(tmp_path: Path, parser: str) -> None:
    run_dir = current_schema_copy(DATA / "torch-2.13.0", tmp_path / "run")
    with (run_dir / storage.CELLS_FILE).open("a") as cells:
        cells.write('{"schema_version": 5, "case": \n')
    assert columns.parsed_run(run_dir) is None
    loaded = runs.load_rows(run_dir)
    lines = len((run_dir / storage.CELLS_FILE).read_text().splitlines())
    assert [p.split(" ")[0] for p in loaded.problems] == [
        f"{run_dir / storage.CELLS_FILE}:{lines}:"
    ]


def test_a_later_line_of_a_cell_supersedes_the_earlier(tmp_path: Path) -> None:
    run_dir = current_schema_copy(DATA / "torch-2.13.0", tmp_path / "run")
    path = run_dir / storage.CELLS_FILE
    written = path.read_text().splitlines()
    first = json.loads(written[0])
    with path.open("a") as cells:
        cells.write(json.dumps(first | {"outcome": "raises", "error_type": "E"}) + "\n")
    parsed = columns.parsed_run(run_dir)
    assert parsed is not None
    expected = runs.run_columns(runs.load_run(run_dir))
    assert not differences(runs.load_rows(run_dir).rows or {}, expected)
    assert expected["outcome"][-1] == "raises" and len(parsed.read) == len(written) + 1
    assert [parsed.read[i] for i in parsed.kept] == parsed.lines


def test_a_non_finite_number_is_read_as_a_float(tmp_path: Path, parser: str) -> None:
    run_dir = current_schema_copy(DATA / "patterns-torch-2.13.0", tmp_path / "run")
    assert '"NaN"' in (run_dir / storage.CELLS_FILE).read_text()
    rows = runs.load_rows(run_dir).rows or {}
    assert any(isinstance(v, float) and math.isnan(v) for v in rows["rel_err"])
    assert not any(isinstance(v, str) for v in rows["rel_err"])


def test_a_verdict_record_that_cannot_be_read_sends_the_run_record_by_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = current_schema_copy(DATA / "torch-2.4.1", tmp_path / "run")

    def refuse(data: Any) -> CellRecord:
        raise MalformedRecord("no")

    monkeypatch.setattr("harness.report.rows._VERDICTS", {})
    monkeypatch.setattr("harness.report.runs.TEMPLATES", {})
    monkeypatch.setattr(CellRecord, "from_dict", refuse)
    loaded = runs.load_rows(run_dir)
    assert loaded.problems and all(":" in p for p in loaded.problems)


def test_speed_on_columns_follows_the_records_rules(tmp_path: Path) -> None:
    """Launch-bound cells judged by their device time, and a control of another backend
    standing in where a cell's own backend has none: the same ratios as the records'."""
    run_dir = current_schema_copy(DATA / "torch-2.13.0", tmp_path / "run")
    path = run_dir / storage.CELLS_FILE
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    timed = [line for line in lines if line["time_median_s"] is not None]
    for line in timed[::3]:
        line["device_time_s"] = line["time_median_s"] / 4  # launch-bound
    for line in timed[1::3]:
        line["device_time_s"] = line["time_median_s"] / 1.5  # not launch-bound
    controls = [line for line in timed if line["mode"] == "fp32" and line["fix"] == "none"]
    assert controls
    controls[0]["backend"] = "eager" if controls[0]["backend"] != "eager" else "sdpa"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    expected = runs.run_columns(runs.load_run(run_dir))
    assert columns.parsed_run(run_dir) is not None
    assert not differences(runs.load_rows(run_dir).rows or {}, expected)
    assert {True, False} <= set(expected["launch_bound"])
