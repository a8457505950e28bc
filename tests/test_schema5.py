"""Schema 5: typed flags, dtype lists, typed settings changes and strict JSON; every stored
run of schemas 1-4 still reads, and a record read back is the record written."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from harness.results import storage
from harness.schema.axes import Cell
from harness.schema.migrations import migrate_v4
from harness.schema.records import (
    SCHEMA_VERSION,
    CellRecord,
    FitFigures,
    Flag,
    FlagKind,
    MalformedRecord,
    Numerics,
    Outcome,
    Perf,
    SettingChange,
    outcome_label,
)
from harness.schema.trail_records import Island, Site, Trail

DATA = Path(__file__).parent / "data"
STORED = sorted(DATA.rglob("cells.jsonl"))
CELL = Cell("case-a", "fix-b", "cpu", "float16", "half", "sdpa")
NAN, INF = float("nan"), float("inf")


def stored_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def same(a: Any, b: Any) -> bool:
    """Equal, with NaN equal to NaN at any depth (records compare their numbers by ``==``)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return bool(a == b)


def non_finite_record() -> CellRecord:
    numerics = Numerics(INF, NAN, -INF, 0.01, "rule", False, rounding_rel_err=NAN, factor=INF)
    perf = Perf([1.0, NAN], 1, NAN, INF, 1.0, 2, False, "t", 1, None, -INF, None, None, 0, "m")
    fit = FitFigures((2.0, NAN, INF), (2.0, 1.0, 0.5), 1, INF, NAN, None)
    island = Island(Site("aten::mm"), "float32", NAN)
    return CellRecord(
        CELL,
        "2.13.0",
        Outcome.INACCURATE,
        flags=(Flag(FlagKind.DRIFT, "matmul computed in float32", NAN),),
        out_dtypes=("float16", "float32"),
        attn_dtypes=("float16",),
        numerics=numerics,
        leaves={"a": numerics, "b": dataclasses.replace(numerics, rel_err=0.5)},
        perf=perf,
        fit=fit,
        trail=Trail(island=island),
        duration_s=INF,
        settings_changes=(SettingChange("default dtype", "torch.float32", "torch.float16"),),
    )


@pytest.mark.parametrize("path", STORED, ids=lambda p: p.parent.name)
def test_every_stored_record_migrates_and_round_trips(path: Path) -> None:
    lines = stored_lines(path)
    assert lines, f"{path} holds no record"
    for data in lines:
        assert data["schema_version"] < SCHEMA_VERSION
        record = CellRecord.from_dict(data)
        written = record.to_dict()
        json.dumps(written, allow_nan=False)
        assert same(CellRecord.from_dict(json.loads(json.dumps(written))), record)
        for old, new in (("out_dtype", record.out_dtypes), ("attn_dtype", record.attn_dtypes)):
            assert "+".join(new) == (data[old] or "")


def test_the_stored_runs_hold_old_schemas_joined_dtypes_and_non_finite_numbers() -> None:
    """The migration test above reads what it should: the stored runs are of schemas 1-4,
    hold dtypes joined with "+" and NaN tokens."""
    texts = [path.read_text() for path in STORED]
    assert len(STORED) >= 4
    assert any("NaN" in text for text in texts)
    records = [CellRecord.from_dict(d) for path in STORED for d in stored_lines(path)]
    assert any(len(r.out_dtypes) > 1 for r in records)
    assert any(len(r.attn_dtypes) > 1 for r in records)
    assert any(flag.kind is FlagKind.NOT_HALF for r in records for flag in r.flags)


def test_non_finite_numbers_are_strict_json_strings_and_read_back() -> None:
    record = non_finite_record()
    data = record.to_dict()
    line = json.dumps(data, allow_nan=False)
    assert data["rel_err"] == "NaN" and data["max_abs_err"] == "Infinity"
    assert data["baseline_rel_err"] == "-Infinity" and data["time_samples"] == [1.0, "NaN"]
    assert data["fit"]["losses"] == [2.0, "NaN", "Infinity"]
    assert data["island"]["share"] == "NaN" and data["flags"][0]["share"] == "NaN"
    assert same(CellRecord.from_dict(json.loads(line)), record)


def test_the_record_holds_typed_flags_dtype_lists_and_settings_changes() -> None:
    data = non_finite_record().to_dict()
    assert data["schema_version"] == SCHEMA_VERSION == 6
    assert data["flags"] == [
        {"kind": "drift", "detail": "matmul computed in float32", "share": "NaN"}
    ]
    assert data["out_dtypes"] == ["float16", "float32"] and data["attn_dtypes"] == ["float16"]
    assert data["settings_changes"] == [
        {"name": "default dtype", "before": "torch.float32", "after": "torch.float16"}
    ]
    assert "out_dtype" not in data and "attn_dtype" not in data
    read = CellRecord.from_dict(json.loads(json.dumps(data, allow_nan=False)))
    assert read.flags[0].kind is FlagKind.DRIFT
    assert read.settings_changes[0] == SettingChange(
        "default dtype", "torch.float32", "torch.float16"
    )


def test_the_label_renders_flag_kinds_by_value() -> None:
    flags = (Flag(FlagKind.NO_AUTOCAST, "x"), Flag(FlagKind.DRIFT, "y"), Flag(FlagKind.DRIFT, "z"))
    record = CellRecord(CELL, "2.13.0", Outcome.PASSES, flags=flags)
    assert outcome_label(record) == "passes[no-autocast,drift]"
    assert flags[0].describe() == "no-autocast: x"


def test_schema_4_joined_dtypes_become_lists() -> None:
    data = {"out_dtype": "float16+float32", "attn_dtype": None, "x": 1}
    assert migrate_v4(data) == {
        "out_dtypes": ["float16", "float32"],
        "attn_dtypes": [],
        "settings_changes": [],
        "x": 1,
    }
    with pytest.raises(TypeError, match="out_dtype"):
        migrate_v4({"out_dtype": ["float16"]})


def test_a_schema_4_record_with_nan_tokens_reads() -> None:
    data = non_finite_record().to_dict()
    for name in ("out_dtypes", "attn_dtypes", "settings_changes"):
        data.pop(name)
    data.update(schema_version=4, out_dtype="float16+float32", attn_dtype="float16")
    line = json.dumps(data).replace('"NaN"', "NaN").replace('"Infinity"', "Infinity")
    record = CellRecord.from_dict(json.loads(line))
    assert record.out_dtypes == ("float16", "float32") and record.settings_changes == ()
    assert math.isnan(record.numerics.rel_err) if record.numerics else False


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("flags", [{"kind": "gossip", "detail": "x", "share": None}], "flags[0].kind"),
        ("out_dtypes", "float16+float32", "out_dtypes"),
        ("attn_dtypes", [1], "attn_dtypes[0]"),
        ("settings_changes", [{"name": "x"}], "settings_changes[0]"),
        ("rel_err", "nan", "rel_err"),
    ],
)
def test_a_malformed_schema_5_field_is_refused_naming_it(
    field: str, value: Any, named: str
) -> None:
    data = dict(non_finite_record().to_dict(), **{field: value})
    with pytest.raises(MalformedRecord, match=named.replace("[", r"\[").replace("]", r"\]")):
        CellRecord.from_dict(data)


def test_a_newer_schema_is_refused() -> None:
    data = dict(non_finite_record().to_dict(), schema_version=SCHEMA_VERSION + 1)
    with pytest.raises(MalformedRecord, match=f"schema_version {SCHEMA_VERSION + 1}"):
        CellRecord.from_dict(data)


def test_append_record_writes_strict_json(tmp_path: Path) -> None:
    storage.append_record(tmp_path, non_finite_record())
    line = (tmp_path / storage.CELLS_FILE).read_text()
    assert "NaN" in line and json.loads(line, parse_constant=lambda token: 1 / 0)
