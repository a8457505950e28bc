"""Records of older schemas read as today's: each step rewrites a JSON object of one schema
into the next one's fields (``migrated`` runs the steps an object needs). Each old field is
parsed here, the one place it is read from its stored text.

A step writes the values of the schema it migrates to, as that schema stored them: text, not
:mod:`harness.schema.records`' enums, whose values are today's (a later schema that renamed
one would migrate it in a step of its own), and which import this module to read an old
record: the two never import each other."""

from __future__ import annotations

from typing import Any

from harness.schema.axes import NO_SCALER
from harness.schema.typed import mismatch

V1_TIMING_FAILED = "timing failed: "
#: Schema 1's outcome of a cell whose process died.
V1_CRASHED = "crashed"
#: Schema 1 named a crash's kind by its error type; schema 2's ``crash_kind`` by these.
V1_CRASH_KINDS = {
    "ProcessDied": "process-died",
    "WorkerCrashed": "worker-died",
    "HarnessError": "harness",
}
#: Schema 4's kind of the one note that holds schema 3's notes joined.
V3_JOINED_NOTE = "joined"
#: Schema 4 and older joined a cell's several dtypes with this (``float16+float32``).
V4_DTYPE_JOIN = "+"
#: Schema 4's dtype fields and schema 5's lists that replace them.
V4_DTYPE_FIELDS = {"out_dtype": "out_dtypes", "attn_dtype": "attn_dtypes"}
#: The built-in fixes that trained with no loss scaling where their mode scales
#: (``@fix(grad_scaler=False)``), by case and fix: a schema 5 record kept its recipe
#: nowhere, so these are known by name alone.
V5_UNSCALED_FIXES = frozenset({("fp16-no-grad-scaler", "none")})
#: The one (dtype, mode) whose train and fit cells schema 5 scaled, with a GradScaler.
V5_SCALED_MODE = ("float16", "autocast")


def migrated(data: dict[str, Any], version: int) -> dict[str, Any]:
    """A record's JSON object of schema ``version`` as the current schema's fields."""
    if version < 2:
        data = migrate_v1(data)
    if version < 4:
        data = migrate_v3(data)
    if version < 5:
        data = migrate_v4(data)
    if version < 6:
        data = migrate_v5(data)
    return data


def migrate_v1(data: dict[str, Any]) -> dict[str, Any]:
    """Schema 1 stored a timing failure in ``note`` and a crash's kind in ``error_type``."""
    data = dict(data)
    if not isinstance(data.get("note") or "", str):
        raise TypeError(mismatch("note", str | None, data["note"]))
    notes = [n for n in (data.get("note") or "").split("; ") if n]
    failed = [n for n in notes if n.startswith(V1_TIMING_FAILED)]
    if failed:
        data["timing_error"] = failed[0].removeprefix(V1_TIMING_FAILED)
        data["note"] = "; ".join(n for n in notes if n not in failed) or None
    if data.get("outcome") == V1_CRASHED:
        data["crash_kind"] = V1_CRASH_KINDS.get(str(data.get("error_type")))
    return data


def migrate_v3(data: dict[str, Any]) -> dict[str, Any]:
    """Schema 3 and older stored a record's notes as one text joined with ``"; "``: it
    becomes one note of kind ``joined``, word for word."""
    data = dict(data)
    note = data.pop("note", None)
    if not isinstance(note or "", str):
        raise TypeError(mismatch("note", str | None, note))
    data["notes"] = [{"kind": V3_JOINED_NOTE, "text": note}] if note else []
    return data


def migrate_v4(data: dict[str, Any]) -> dict[str, Any]:
    """Schema 4 and older stored the output's and the attention core's dtypes as one text
    joined with ``"+"`` (null where none): each becomes a list of dtype names. They kept no
    settings changes of their own (those are in the notes' text)."""
    data = dict(data)
    for old, new in V4_DTYPE_FIELDS.items():
        joined = data.pop(old, None)
        if not isinstance(joined or "", str):
            raise TypeError(mismatch(old, str | None, joined))
        data[new] = joined.split(V4_DTYPE_JOIN) if joined else []
    data["settings_changes"] = []
    return data


def migrate_v5(data: dict[str, Any]) -> dict[str, Any]:
    """Schema 5 and older had no ``scaler``: a train or fit cell scaled its loss as its
    mode then did, a GradScaler for float16 under autocast (:data:`V5_SCALED_MODE`, which
    ``Cell.from_dict`` reads an absent scaler as) and none elsewhere (float16 ``half``
    weights now take a dynamic scale: the record says it ran unscaled), but where its
    fix's recipe scaled nothing. A record kept no recipe, so that is known only for the
    built-in fixes that scaled nothing (:data:`V5_UNSCALED_FIXES`); a case of one's own
    whose fix trained unscaled reads as scaled by its mode."""
    data = dict(data)
    if "scaler" in data:
        return data
    unscaled_fix = (data.get("case"), data.get("fix")) in V5_UNSCALED_FIXES
    if unscaled_fix or (data.get("dtype"), data.get("mode")) != V5_SCALED_MODE:
        data["scaler"] = NO_SCALER
    return data
