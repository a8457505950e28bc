"""Results files: record round trip, env.json, corrupt input named by file and line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from harness.results import storage
from harness.schema.axes import Cell
from harness.schema.records import (
    SCHEMA_VERSION,
    CellRecord,
    CrashKind,
    Flag,
    FlagKind,
    MalformedRecord,
    Note,
    NoteKind,
    Numerics,
    Outcome,
)
from harness.schema.run_files import Environment
from harness.schema.trail_records import Promotion, Site, Trail

CELL = Cell("case-a", "none", "cpu", "float16", "half", "sdpa")
RECORDS = [
    CellRecord(
        CELL,
        "2.13.0",
        Outcome.RAISES,
        reproduces=True,
        error_type="RuntimeError",
        error_message="Expected query, key, and value to have the same dtype <x>",
        attn_dtypes=("float32", "float16"),
        duration_s=0.01,
        worker="gw0",
        error_frames=("cases/a.py:12 in forward",),
        flags=(Flag(FlagKind.DRIFT, "attention computed in float32"),),
        trail=Trail(
            promotion=Promotion(
                Site("aten::mul", "norm", "cases/a.py:9", ("float16", "float32")),
                "float32",
                "parameter norm.weight",
            ),
            failure_site=Site(
                "F.scaled_dot_product_attention",
                None,
                "cases/a.py:12",
                ("float32", "float16", "float16"),
                autocast="float16",
            ),
            compute_dtypes={"matmul": ("float16", "float32")},
        ),
    ),
    CellRecord(
        Cell("case-a", "fix-b", "cpu", "bfloat16", "autocast", "sdpa"),
        "2.13.0",
        Outcome.PASSES,
        out_dtypes=("bfloat16",),
        attn_dtypes=("bfloat16",),
        numerics=Numerics(0.01, 0.002, 0.001, 0.003, "rule", True),
    ),
    CellRecord(
        Cell("case-a", "none", "cuda", "float16", "half", "sdpa"),
        "2.13.0",
        Outcome.SKIPPED,
        skip_reason="no CUDA device visible",
    ),
]


def test_record_round_trip_through_dict() -> None:
    for record in RECORDS:
        assert CellRecord.from_dict(record.to_dict()) == record


def test_record_has_the_documented_flat_fields() -> None:
    data = RECORDS[1].to_dict()
    for key in (
        "schema_version",
        "case",
        "fix",
        "device",
        "dtype",
        "mode",
        "backend",
        "torch_version",
        "outcome",
        "reproduces",
        "error_type",
        "error_message",
        "out_dtypes",
        "attn_dtypes",
        "settings_changes",
        "max_abs_err",
        "rel_err",
        "baseline_rel_err",
        "tolerance",
        "tolerance_rule",
        "flags",
        "promotion",
        "failure_site",
        "compute_dtypes",
    ):
        assert key in data
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["outcome"] == "passes"


def test_run_directory_round_trip(tmp_path: Path) -> None:
    run_dir = storage.create_run_dir(tmp_path, "run")
    storage.write_env(run_dir, Environment(torch_version="2.13.0"))
    for record in RECORDS:
        storage.append_record(run_dir, record)
    assert storage.read_env(run_dir) == Environment(torch_version="2.13.0")
    assert storage.read_records(run_dir) == RECORDS


def test_run_dirs_are_never_reused(tmp_path: Path) -> None:
    first = storage.create_run_dir(tmp_path, "same")
    second = storage.create_run_dir(tmp_path, "same")
    assert first != second and second.name == "same-2"


def test_newer_schema_is_refused_naming_file_and_line(tmp_path: Path) -> None:
    run_dir = storage.create_run_dir(tmp_path, "run")
    storage.append_record(run_dir, RECORDS[0])
    newer = dict(RECORDS[0].to_dict(), schema_version=SCHEMA_VERSION + 1)
    with (run_dir / storage.CELLS_FILE).open("a") as f:
        f.write(json.dumps(newer) + "\n")
    with pytest.raises(
        storage.ResultsError, match=rf"cells.jsonl:2: schema_version {SCHEMA_VERSION + 1}"
    ):
        storage.read_records(run_dir)


def test_truncated_line_is_reported_with_its_number(tmp_path: Path) -> None:
    run_dir = storage.create_run_dir(tmp_path, "run")
    storage.append_record(run_dir, RECORDS[0])
    with (run_dir / storage.CELLS_FILE).open("a") as f:
        f.write('{"schema_version": 1, "case": "tru')
    before = (run_dir / storage.CELLS_FILE).read_bytes()
    with pytest.raises(storage.ResultsError, match=r"cells.jsonl:2"):
        storage.read_records(run_dir)
    assert (run_dir / storage.CELLS_FILE).read_bytes() == before


def test_missing_env_is_reported(tmp_path: Path) -> None:
    with pytest.raises(storage.ResultsError, match=r"env\.json: missing"):
        storage.read_env(tmp_path)


def test_a_schema_1_record_is_migrated_to_typed_fields() -> None:
    timed_failure = dict(
        RECORDS[1].to_dict(),
        schema_version=1,
        note="flash-attn-contract: ...; timing failed: RuntimeError: boom",
    )
    for key in ("flags", "error_frames", "crash_kind", "timing_error", "baseline_error"):
        timed_failure.pop(key)
    migrated = CellRecord.from_dict(timed_failure)
    assert migrated.timing_error == "RuntimeError: boom"
    assert migrated.notes == (Note(NoteKind.JOINED, "flash-attn-contract: ..."),)
    assert migrated.flags == ()
    crashed = dict(timed_failure, outcome="crashed", error_type="ProcessDied", note=None)
    assert CellRecord.from_dict(crashed).crash_kind is CrashKind.PROCESS_DIED


def test_notes_round_trip_with_their_kinds() -> None:
    notes = (
        Note(NoteKind.BACKEND, "flash-attn-contract: computed with SDPA; not the real kernel"),
        Note(NoteKind.TIMED_ALONE, "timed alone"),
    )
    record = dataclasses.replace(RECORDS[1], notes=notes)
    data = record.to_dict()
    assert "note" not in data and data["notes"][0]["kind"] == "backend"
    assert CellRecord.from_dict(json.loads(json.dumps(data))) == record
    joined = "flash-attn-contract: computed with SDPA; not the real kernel; timed alone"
    assert record.notes_text == joined


def test_a_schema_3_note_is_read_as_one_joined_note_word_for_word() -> None:
    """Schema 3 stored the notes joined with "; ", which a note's own text may hold."""
    data = RECORDS[1].to_dict()
    data.pop("notes")
    text = "flash-attn-contract: computed with SDPA; not the real kernel; timed alone"
    old = CellRecord.from_dict(dict(data, schema_version=3, note=text))
    assert old.notes == (Note(NoteKind.JOINED, text),) and old.notes_text == text
    assert CellRecord.from_dict(dict(data, schema_version=3, note=None)).notes == ()


def test_a_note_of_an_unknown_kind_is_refused() -> None:
    data = dict(RECORDS[1].to_dict(), notes=[{"kind": "gossip", "text": "x"}])
    with pytest.raises(ValueError, match="gossip"):
        CellRecord.from_dict(data)
    data = dict(RECORDS[1].to_dict(), notes=["a bare text"])
    with pytest.raises(MalformedRecord, match="notes"):
        CellRecord.from_dict(data)
