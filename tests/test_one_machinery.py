"""One piece of machinery per promise: one version check for records and the run folder's
files, and one loop streaming results back from a forked child."""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable, Generator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harness.results import storage
from harness.runner import isolation
from harness.schema import migrations
from harness.schema.axes import Cell
from harness.schema.records import (
    SCHEMA_VERSION,
    CellRecord,
    CrashKind,
    MalformedRecord,
    NoteKind,
    Outcome,
)
from harness.schema.run_files import Environment, RunPlan
from harness.schema.typed import (
    FieldError,
    FieldTypeError,
    FieldValueError,
    as_mapping,
    as_tuple,
    check_fields,
    compiled,
    member,
    mismatch,
)
from harness.schema.versions import VERSION_KEY, checked_version

RECORD = CellRecord(
    cell=Cell(
        case="c", fix="none", device="cpu", dtype="float16", mode="autocast", backend="sdpa"
    ),
    outcome=Outcome.PASSES,
    torch_version="2.13.0",
)


def record_refusal(version: Any) -> str:
    data = {**RECORD.to_dict(), VERSION_KEY: version}
    with pytest.raises(MalformedRecord) as refused:
        CellRecord.from_dict(data)
    return str(refused.value)


def file_refusal(read: Callable[[Any], Any], version: Any) -> str:
    with pytest.raises(ValueError) as refused:
        read({VERSION_KEY: version, "cells": [], "skipped": []})
    return str(refused.value)


def newer_than(newest: int) -> str:
    return (
        f"schema_version {newest + 1} is newer than this ampmatrix reads (up to {newest}); "
        "upgrade ampmatrix to read it"
    )


def test_records_and_run_files_refuse_a_newer_version_in_the_same_words() -> None:
    assert record_refusal(SCHEMA_VERSION + 1) == newer_than(SCHEMA_VERSION)
    assert file_refusal(Environment.from_dict, Environment.VERSION + 1) == newer_than(
        Environment.VERSION
    )
    assert file_refusal(RunPlan.from_dict, RunPlan.VERSION + 1) == newer_than(RunPlan.VERSION)


@pytest.mark.parametrize("version", ["6", True, 0, -1, 2.0, [6]])
def test_what_is_no_version_number_is_refused_alike_in_records_and_files(version: Any) -> None:
    message = record_refusal(version)
    assert message.startswith("schema_version: expected a version number, got ")
    assert file_refusal(Environment.from_dict, version) == message
    assert file_refusal(RunPlan.from_dict, version) == message


def test_a_file_without_a_version_is_read_as_its_first_a_record_is_refused() -> None:
    assert checked_version({}, 2, absent=1) == 1
    assert Environment.from_dict({"torch_version": "2.4.1"}).torch_version == "2.4.1"
    assert record_refusal(None) == "schema_version: expected a version number, got NoneType None"


def test_a_stored_record_of_a_newer_schema_is_named_by_file_and_line(tmp_path: Path) -> None:
    storage.append_record(tmp_path, RECORD)
    cells = tmp_path / storage.CELLS_FILE
    mine = f'"{VERSION_KEY}": {SCHEMA_VERSION}'
    assert mine in cells.read_text()
    cells.write_text(cells.read_text().replace(mine, f'"{VERSION_KEY}": {SCHEMA_VERSION + 1}'))
    problems: list[str] = []
    assert storage.read_record_lines(tmp_path, problems) == []
    assert problems == [f"{cells}:1: {newer_than(SCHEMA_VERSION)}"]


def test_the_migrations_write_values_todays_enums_still_read() -> None:
    """The migrations write a schema's values as text (they import no enum of the records
    they migrate to): each is a value of today's enum, until a schema renames one and
    migrates it in a step of its own."""
    assert set(migrations.V1_CRASH_KINDS.values()) <= {kind.value for kind in CrashKind}
    assert NoteKind(migrations.V3_JOINED_NOTE) is NoteKind.JOINED
    assert Outcome(migrations.V1_CRASHED) is Outcome.CRASHED
    old = {**RECORD.to_dict(), VERSION_KEY: 1, "outcome": "crashed", "error_type": "ProcessDied"}
    del old["notes"]
    old["note"] = "timing failed: killed; joined"
    record = CellRecord.from_dict(old)
    assert (record.crash_kind, record.timing_error) == (CrashKind.PROCESS_DIED, "killed")
    assert [(note.kind, note.text) for note in record.notes] == [(NoteKind.JOINED, "joined")]


def counting_child(dies_at: int | None) -> Callable[[Callable[[Any], None]], None]:
    """A child that sends each item times ten, and dies (as a segfaulting fix does) on the
    item ``dies_at``."""

    def child(send: Callable[[Any], None]) -> None:
        for item in (1, 2, 3, 4):
            if item == dies_at:
                os._exit(3)
            send(item * 10)

    return child


def stream_of(dies_at: int | None, after: list[Sequence[int]]) -> Generator[str, None, None]:
    def alone(rest: Sequence[int]) -> list[str]:
        after.append(rest)
        return [f"{item} alone" for item in rest]

    return isolation.streamed(
        (1, 2, 3, 4),
        counting_child(dies_at),
        isolation.Fork(threads=1, memory_bytes=None, whose="the counting process"),
        limit=lambda item: 30.0,
        took=lambda item, value: f"{item}: {value}",
        lost=lambda item, lost: f"{item} lost: {lost.failure}",
        after_loss=alone,
    )


def test_the_one_streaming_loop_costs_a_dead_child_only_its_item() -> None:
    after: list[Sequence[int]] = []
    assert list(stream_of(None, after)) == ["1: 10", "2: 20", "3: 30", "4: 40"]
    assert after == []
    assert list(stream_of(3, after)) == [
        "1: 10",
        "2: 20",
        "3 lost: the counting process exited with code 3 without a result",
        "4 alone",
    ]
    assert after == [(4,)]
    assert list(stream_of(4, after))[-1] == (
        "4 lost: the counting process exited with code 3 without a result"
    )
    assert after == [(4,)]  # nothing after the last item: nothing handed on


def test_a_reader_that_stops_reading_ends_the_child_and_hands_nothing_on() -> None:
    after: list[Sequence[int]] = []
    with closing(stream_of(2, after)) as results:
        assert next(results) == "1: 10"
        assert next(results).startswith("2 lost")
    assert after == []


@dataclass(frozen=True)
class Inner:
    share: float | None = None


@dataclass(frozen=True)
class Outer:
    inner: Inner | list[Inner] | None = None
    names: list[str] = field(default_factory=list)


def test_a_mismatch_carries_its_field_what_was_expected_and_what_came() -> None:
    """Errors carry their parts as fields; the text is what a reader prints, unchanged."""
    with pytest.raises(TypeError) as wrong:
        check_fields(Outer(inner=Inner(share="x"), names=[]))  # type: ignore[arg-type]
    error = wrong.value
    assert isinstance(error, FieldTypeError)
    assert (error.mismatch.field, error.mismatch.expected, error.mismatch.got) == (
        "inner.share",
        "a number or null",
        "str 'x'",
    )
    assert str(error) == "inner.share: expected a number or null, got str 'x'"
    with pytest.raises(FieldTypeError) as listed:
        check_fields(Outer(names=["a", 3]))  # type: ignore[list-item]
    assert listed.value.mismatch.field == "names[1]"


def test_a_union_names_the_deeper_field_by_its_path_not_its_text() -> None:
    """Of a union's alternatives, the problem found inside the value is told apart from
    the value's own by its field (the text of both starts alike)."""
    problem = compiled(Inner | list[Inner] | None)([Inner(share="x")], "inner")  # type: ignore[arg-type]
    assert problem is not None and problem.field == "inner[0].share"
    own = compiled(Inner | list[Inner] | None)(3, "inner")
    assert own is not None and (own.field, own.got) == ("inner", "int 3")


def test_enum_and_shape_errors_carry_fields_and_are_the_errors_readers_catch() -> None:
    with pytest.raises(ValueError) as value:
        member(Outcome, "rasies", "outcome")
    assert isinstance(value.value, FieldValueError)
    assert value.value.mismatch.field == "outcome"
    with pytest.raises(TypeError) as shape:
        as_mapping([], "record")
    assert isinstance(shape.value, FieldError)
    assert str(shape.value) == "record: expected an object, got list []"
    assert (
        str(shape.value.within("cells[2]")) == "cells[2].record: expected an object, got list []"
    )
    with pytest.raises(TypeError, match=r"^notes: expected a list, got int 3$"):
        as_tuple(3, "notes")


def test_a_mismatch_is_text_wherever_text_goes() -> None:
    """A problem list, a message, a pickle to another process: a mismatch is its text."""
    problem = mismatch("cpu_count", int, "two")
    assert problem == "cpu_count: expected int, got str 'two'"
    again = pickle.loads(pickle.dumps(problem))
    assert (again, again.field, again.expected) == (problem, "cpu_count", "int")
    assert "; ".join([problem, "other"]).startswith("cpu_count: expected int")
