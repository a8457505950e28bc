"""A run's ``cells.jsonl`` read as columns: each line decoded by the JSON parser, then each
field checked over every line at once, with no record built per line (a report over a
nightly's runs reads hundreds of thousands of lines and needs only columns).

Only what this reader can vouch for is read so: a run whose every line is a JSON object
of schema :data:`COLUMNAR_SCHEMA` whose plain fields (names, numbers, figures) have their
types. Anything else (a line cut short, not UTF-8, of an older schema, a field of the wrong
type) makes :func:`parsed_run` answer None, and the caller reads the run record by record
(``harness.results.storage``), which names each problem with its file and line. An
output's leaves are checked here too; the fields built from more than their own value
(flags, notes, the trail, a fit) are checked by the reader of the columns, by building one
record per distinct set of their values (``harness.report.rows``).
"""

from __future__ import annotations

import dataclasses
import json
import json.scanner
import re
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from functools import cached_property
from itertools import compress
from operator import itemgetter, methodcaller
from pathlib import Path
from types import ModuleType
from typing import Any

from harness.results.storage import CELLS_FILE, MAX_LINE_BYTES
from harness.schema.axes import Cell
from harness.schema.records import (
    NESTED,
    SCHEMA_VERSION,
    CellRecord,
    Numerics,
    launch_bound,
    plain_field_names,
)
from harness.schema.typed import NON_FINITE, compiled, number_fields, number_from

#: A faster parser of strict JSON, a dependency of the project; where it is missing (an
#: environment that installed only what it had), the standard library's reads the lines.
orjson: ModuleType | None
try:
    import orjson
except ImportError:  # pragma: no cover - depends on what is installed
    orjson = None

#: The schema whose runs are read as columns (the one written now); older ones are read
#: record by record.
COLUMNAR_SCHEMA = SCHEMA_VERSION
#: A JSON escape of half a UTF-16 pair: a line holding one is read record by record, which
#: tells a lone half (no text) from a pair.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
#: Characters that a cell's id puts between its names: a name holding one may give two
#: cells one id, which only the record by record reading tells.
ID_PUNCTUATION = re.compile(r"[\[\],=]")


@dataclass(frozen=True)
class FieldCheck:
    """A plain field of a record's JSON object: its name, its declared type, whether it
    holds numbers (a non-finite one stored as ``"NaN"``, ``"Infinity"``, ``"-Infinity"``),
    and the field whose presence says that its sub-record is there (None: always there)."""

    name: str
    hint: Any
    numbers: bool
    marker: str | None
    #: A name of the cell (never empty).
    cell_name: bool = False
    #: What a cell's field holds when the line leaves it out (None: it must be there).
    default: Any = None

    @cached_property
    def fit(self) -> Callable[[Any, str], str | None]:
        """Why a value does not have the field's type (None where it does)."""
        return compiled(self.hint)

    @cached_property
    def exact(self) -> frozenset[type]:
        """The types whose values fit by their type alone (none for a list)."""
        return frozenset(getattr(self.fit, "exact_types", frozenset()))

    @cached_property
    def many(self) -> bool:
        """The field holds a list."""
        return typing.get_origin(self.hint) in (list, tuple)


def field_checks() -> tuple[FieldCheck, ...]:
    """Every plain field of a record: the cell's names, the record's own plain fields, and
    those of its numerics and figures (``NESTED``)."""
    cell = tuple(
        FieldCheck(f.name, str, False, None, True, None if f.default is MISSING else f.default)
        for f in dataclasses.fields(Cell)
    )
    owners: list[tuple[type, tuple[str, ...], str | None]] = [
        (CellRecord, plain_field_names(), None)
    ]
    for kind, present_by in NESTED.values():
        owners.append((kind, tuple(f.name for f in dataclasses.fields(kind)), present_by))
    plain = []
    for kind, names, marker in owners:
        hints, numbers = typing.get_type_hints(kind), dict(number_fields(kind))
        plain += [FieldCheck(n, hints[n], n in numbers, marker) for n in names]
    return cell + tuple(plain)


FIELD_CHECKS = field_checks()
#: The fields of a numerics object of one output leaf (``leaves``).
LEAF_CHECKS = tuple(
    FieldCheck(f.name, hint, f.name in dict(number_fields(Numerics)), None, False, f.default)
    for f, hint in zip(
        dataclasses.fields(Numerics), typing.get_type_hints(Numerics).values(), strict=True
    )
)
#: The fields read as columns beside the plain ones (each checked with its record).
TYPED_COLUMNS = ("flags", "outcome")


@dataclass(frozen=True)
class ParsedRun:
    """A run's lines as the JSON parser gave them (the latest line of each cell, in the
    order ``storage.read_records`` gives its records) and their plain fields, checked, as
    columns (a cell's names with their defaults, non-finite numbers as floats); and every
    line read."""

    lines: list[dict[str, Any]]
    columns: dict[str, list[Any]]
    #: Every line read, superseded ones included (each must be checked whole), and the
    #: positions among them of ``lines``.
    read: list[dict[str, Any]]
    kept: list[int]

    def launch_bound(self) -> list[bool]:
        """Per line, whether its timed median is launch-bound (``Perf.launch_bound``)."""
        timed, device = self.columns["time_median_s"], self.columns["device_time_s"]
        return [
            d is not None and t is not None and launch_bound(t, d)
            for t, d in zip(timed, device, strict=True)
        ]

    def speed_s(self) -> list[float | None]:
        """Per line, the figure its speed is judged by (``Perf.speed_s``; None: untimed)."""
        timed, device = self.columns["time_median_s"], self.columns["device_time_s"]
        return [
            d if bound else t
            for t, d, bound in zip(timed, device, self.launch_bound(), strict=True)
        ]


def parsed_run(run_dir: Path) -> ParsedRun | None:
    """The run's lines as columns, or None where this reader does not vouch for every line
    (see the module's docstring) or there is none: then the run is to be read record by
    record."""
    lines = decoded_lines(run_dir / CELLS_FILE)
    if not lines or not of_schema(lines, COLUMNAR_SCHEMA):
        return None
    found = field_columns(lines)
    present = {marker: [v is not None for v in found[marker]] for _, marker in NESTED.values()}
    columns = {}
    for check in FIELD_CHECKS:
        values = checked_column(found[check.name], check, present.get(check.marker or ""))
        if values is None:
            return None
        columns[check.name] = values
    if not leaves_fit(list(map(methodcaller("get", "leaves"), lines))):
        return None
    cells = list(zip(*(columns[f.name] for f in dataclasses.fields(Cell)), strict=True))
    if ID_PUNCTUATION.search("".join(set().union(*cells))):
        return None
    # a later line of a cell supersedes the earlier ones, and takes their place
    kept = sorted(dict(zip(cells, range(len(cells)), strict=True)).values())
    latest = lines
    if len(kept) < len(lines):
        latest = [lines[i] for i in kept]
        columns = {name: [values[i] for i in kept] for name, values in columns.items()}
    for name in TYPED_COLUMNS:
        columns[name] = list(map(methodcaller("get", name), latest))
    return ParsedRun(latest, columns, lines, kept)


def field_columns(lines: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Every plain field's values over the lines, as they are (a cell's field that a line
    leaves out: its default)."""
    names = tuple(check.name for check in FIELD_CHECKS)
    try:  # a line the harness wrote has every field: one pass in C
        rows = map(itemgetter(*names), lines)
        return dict(zip(names, map(list, zip(*rows, strict=True)), strict=True))
    except KeyError:
        return {
            c.name: list(map(methodcaller("get", c.name, c.default), lines)) for c in FIELD_CHECKS
        }


#: Reads one JSON value from a position of a text: what ``json.loads`` runs, without its
#: checks of what it was given (a line, here, is always text).
SCAN = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
#: What JSON takes for whitespace around a value.
JSON_SPACE = b" \t\r"


def decoded_lines(path: Path) -> list[dict[str, Any]] | None:
    """Each non-blank line of ``path`` as the JSON parser reads it; None for a file that
    cannot be read, a line that is not UTF-8 or not one JSON value or is too long, or a
    half surrogate escape anywhere."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\\u" in data and SURROGATE_ESCAPE.search(data):
        return None
    raw = [line.strip(JSON_SPACE) for line in data.split(b"\n") if line.strip()]
    if raw and max(map(len, raw)) > MAX_LINE_BYTES:
        return None
    return parsed_lines(raw)


def parsed_lines(raw: list[bytes]) -> list[Any] | None:
    """Each line as one JSON value: by orjson where it is installed (schema 5 lines are
    strict JSON, which it reads 1.6x faster), else by the standard library's scanner;
    None where a line is not one JSON value (or, for orjson, holds a ``NaN`` token or an
    integer beyond 64 bits: the record path reads those)."""
    if orjson is not None:
        try:
            return list(map(orjson.loads, raw))
        except orjson.JSONDecodeError:
            return None
    values = []
    try:
        for text in map(bytes.decode, raw):
            value, end = SCAN(text, 0)
            if end != len(text):
                return None
            values.append(value)
    except (StopIteration, ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return values


def of_schema(lines: list[Any], version: int) -> bool:
    """Every line is a JSON object of schema ``version`` (an integer, as records say it)."""
    if set(map(type, lines)) - {dict}:
        return False
    versions = list(map(methodcaller("get", "schema_version"), lines))
    return set(map(type, versions)) <= {int} and set(versions) <= {version}


def checked_column(
    values: list[Any], check: FieldCheck, present: list[bool] | None
) -> list[Any] | None:
    """The field's values (non-finite numbers as floats), or None where one does not have
    its declared type (in a line where its sub-record is ``present``)."""
    if check.cell_name:  # a name, never empty
        return values if set(map(type, values)) <= {str} and all(values) else None
    if check.numbers:
        values = readable_numbers(values, check.many)
    checked = values if present is None else list(compress(values, present))
    if check.exact and set(map(type, checked)) <= check.exact:  # one pass in C
        return values
    return values if all(check.fit(value, "") is None for value in checked) else None


def leaves_fit(leaves: list[Any]) -> bool:
    """Whether each line's ``leaves`` (an object of each output leaf's numerics, or none)
    holds what a record reads: each leaf's fields, and none other, with their types."""
    given = [value for value in leaves if value]  # a record reads any other as none
    if set(map(type, given)) - {dict}:
        return False
    numerics = [leaf for value in given for leaf in value.values()]
    if set(map(type, numerics)) - {dict}:
        return False
    names = {check.name for check in LEAF_CHECKS}
    required = {check.name for check in LEAF_CHECKS if check.default is MISSING}
    if not all(required <= set(shape) <= names for shape in set(map(tuple, numerics))):
        return False
    return all(
        checked_column(list(map(methodcaller("get", c.name, c.default), numerics)), c, None)
        is not None
        for c in LEAF_CHECKS
    )


def readable_numbers(values: list[Any], many: bool) -> list[Any]:
    """A number field's values (``many``: lists of numbers) with ``"NaN"``, ``"Infinity"``
    and ``"-Infinity"`` as floats."""
    if many:
        return [
            [number_from(v) for v in value]
            if isinstance(value, list) and str in set(map(type, value))
            else value
            for value in values
        ]
    if str not in set(map(type, values)):
        return values
    return [NON_FINITE.get(v, v) if type(v) is str else v for v in values]
