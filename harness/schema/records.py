"""Cell specs, outcomes and records: the data that flows from measuring to reporting.

What a cell's measurement produced, defined here once and importing no torch: its outcome
and the evidence for it (:class:`CellRecord`, its numerics, flags, notes and figures), and
the outcome labels every view prints (:data:`LABELS`, :func:`outcome_label`). A cell's
identity and the column it is compared in are the axis table's (``harness.schema.axes``:
``Cell.id``, ``Cell.column``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from functools import cache
from typing import Any

from harness.schema.axes import Cell
from harness.schema.divergence import Divergence, Profile
from harness.schema.migrations import migrated
from harness.schema.perf_records import LAUNCH_BOUND as LAUNCH_BOUND
from harness.schema.perf_records import FitFigures as FitFigures
from harness.schema.perf_records import Perf as Perf
from harness.schema.perf_records import launch_bound as launch_bound
from harness.schema.trail_records import Trail
from harness.schema.typed import (
    as_mapping,
    as_tuple,
    built,
    check_fields,
    finite_json,
    made,
    member,
    with_numbers,
)
from harness.schema.versions import checked_version

#: Bumped whenever a record's fields change meaning; readers refuse newer versions.
#: 3: numerics name their yardsticks (``rounding_rel_err``, ``decided_by``, ``factor``;
#: ``baseline_rel_err`` is a different fix's error only) and flags carry a ``share``.
#: 4: a record's notes are a list of ``{"kind", "text"}`` (``notes``), not one text joined
#: with ``"; "`` (``note``).
#: 5: flags' kinds are :class:`FlagKind`; ``out_dtypes`` and ``attn_dtypes`` are lists, not
#: texts joined with ``"+"``; ``settings_changes`` are typed; a non-finite number is the
#: string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``, so each line is strict JSON.
#: 6: a cell has a ``scaler`` (its loss scaling: ``none``, ``dynamic``, ``static``), an
#: axis of its own where it was a property of the fix.
#: Older records are read through ``harness.schema.migrations``.
SCHEMA_VERSION = 6


class Outcome(str, Enum):
    """What became of a cell: it raised, passed, was inaccurate, was skipped, ran past its
    time limit, or crashed (no outcome of its own; ``CrashKind`` says why)."""

    RAISES = "raises"
    PASSES = "passes"
    INACCURATE = "inaccurate"
    SKIPPED = "skipped"
    TIMEOUT = "timeout"
    CRASHED = "crashed"


class CrashKind(str, Enum):
    """Why a cell has no outcome of its own (``crashed``)."""

    #: The cell's process died (a signal, or an exit without a record).
    PROCESS_DIED = "process-died"
    #: The pytest-xdist worker running the cell died.
    WORKER_DIED = "worker-died"
    #: The case's reference fix failed in float64, so nothing can be judged.
    REFERENCE_FAILED = "reference-failed"
    #: The workload could not be prepared: ``build()`` raised, or the precision could not be
    #: applied to it (a ``keep_fp32`` name the model lacks).
    WORKLOAD_FAILED = "workload-failed"
    #: The case broke the contract (e.g. a fix returned something that is not tensors).
    CONTRACT = "contract"
    #: The harness itself failed on this cell.
    HARNESS = "harness"


class NoteKind(str, Enum):
    """What a note on a record is about: code that looks for a note asks for its kind."""

    #: What stood in for, or really ran as, flash-attn in a cell of a flash-attn backend.
    BACKEND = "backend"
    #: The worker's torch settings had changed before the cell (a case module's import,
    #: say) and were put back.
    WORKER_SETTLED = "worker-settled"
    #: The cell's code changed torch's global settings.
    SETTINGS_CHANGED = "settings-changed"
    #: A float32 island too small to flag (see ``harness.measure.precision``).
    ISLAND = "island"
    #: Float32 matmuls computed in TF32: the cell was judged against TF32 rounding.
    TF32 = "tf32"
    #: Timed with torch's settings put back after each call.
    SETTINGS_RESTORED = "settings-restored"
    #: The timed calls computed something else than the first call.
    NOT_RERUNNABLE = "not-rerunnable"
    #: Timed alone: another fix of its column killed the timing process they shared.
    TIMED_ALONE = "timed-alone"
    #: Why a fit stalled (its loss, or the updates it lost).
    FIT = "fit"
    #: A training step's ReLU units crossed the kink within rounding of it: judged along
    #: its own sides (records written before random draws and other choices were replayed;
    #: now ``REPLAYED``).
    KINKS = "kinks"
    #: The float64 reference was taken again with the cell's random draws and its discrete
    #: choices within rounding, or the cell's draws could not stand for float64's (see
    #: ``harness.measure.running.replay``).
    REPLAYED = "replayed"
    #: A training step's GradScaler skipped steps (gradients not finite) before it ran.
    SCALER = "scaler"
    #: A training step's gradients were not finite: the first parameter whose gradient went
    #: so, and the first backward node that made one from finite gradients.
    GRADIENT = "gradient"
    #: Why a failing cell has no divergence profile (it could not be taken, or no module
    #: went beyond its rounding), in one line.
    DIVERGENCE = "divergence"
    #: Why a timing is noisy: the spread its samples reached, how well they know their
    #: median, and what ended the sampling (see ``harness.measure.figures.timing.Stop``).
    NOISY = "noisy"
    #: The notes of a record of schema 3 or older, stored joined in one text: their kinds
    #: were not recorded (and a note's own text may hold ``"; "``, so they are not split).
    JOINED = "joined"


@dataclass(frozen=True)
class Note:
    """Something worth saying about a cell that is neither its outcome nor a flag."""

    kind: NoteKind
    text: str


class FlagKind(str, Enum):
    """What a cell's precision mode promised and the cell did not do (see
    :mod:`harness.measure.precision.flags`). Rendered by its ``value``."""

    #: The cell ran, but kernels computed wider than its dtype.
    DRIFT = "drift"
    #: The mode enters ``torch.autocast``, but no torch op ran with it on.
    NO_AUTOCAST = "no-autocast"
    #: After the fix, a half cell's model holds floating tensors in another dtype, not
    #: declared in ``keep_fp32``.
    NOT_HALF = "not-half"
    #: The cell's code cast a tensor up on purpose, and autocast cast it back down before a
    #: matmul or attention kernel: the upcast did nothing.
    UNDONE_UPCAST = "undone-upcast"


@dataclass(frozen=True)
class Flag:
    """Something a cell's precision mode promised and the cell did not do. A flagged cell is
    never a plain ``passes``: its label carries the flag's kind."""

    kind: FlagKind
    detail: str
    #: How much of the cell's work it touched: for ``drift``, the share of the matmul and
    #: attention FLOPs computed wider (None where unknown or not a matter of FLOPs).
    share: float | None = None

    def describe(self) -> str:
        return f"{self.kind.value}: {self.detail}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "detail": self.detail, "share": self.share}

    @classmethod
    def from_dict(cls, data: Any, name: str) -> Flag:
        """A flag from its JSON object (``TypeError`` or ``ValueError`` naming ``name``)."""
        fields = with_numbers(cls, as_mapping(data, name))
        flag = made(cls, fields, name)
        return dataclasses.replace(flag, kind=member(FlagKind, flag.kind, f"{name}.kind"))


@dataclass(frozen=True)
class SettingChange:
    """One of torch's global settings that code changed: its name (``default dtype``) and its
    value before and after, as torch prints them (``torch.float32``, ``torch.bfloat16``)."""

    name: str
    before: str
    after: str

    def describe(self) -> str:
        """``default dtype torch.float32 -> torch.bfloat16``."""
        return f"{self.name} {self.before} -> {self.after}"


@dataclass(frozen=True)
class Numerics:
    """Error of a cell's output against the float64 reference, and the tolerance used."""

    max_abs_err: float
    rel_err: float
    #: The error of a different, trusted fix run plainly in the cell's dtype (None for a
    #: cell of that fix itself, which would be judged against itself).
    baseline_rel_err: float | None
    tolerance: float
    tolerance_rule: str
    finite: bool
    #: The output leaf these figures are from (the worst one), for outputs of many tensors.
    leaf: str | None = None
    #: The error of merely rounding the weights and inputs to the cell's dtype (evaluated in
    #: float64): the yardstick that never depends on the code under test.
    rounding_rel_err: float | None = None
    #: The yardstick that set the tolerance (``rounding to float16``, ``fix sdpa``,
    #: ``eps(float16)``) and the factor it was multiplied by.
    decided_by: str | None = None
    factor: float | None = None


#: Sub-records flattened into the record's JSON object, and the field that says one is there.
NESTED = {"numerics": (Numerics, "tolerance"), "perf": (Perf, "time_median_s")}
#: Fields of a record built from more than their own JSON value.
TYPED_FIELDS = (
    "cell",
    "outcome",
    "flags",
    "error_frames",
    "warnings",
    "notes",
    "leaves",
    "crash_kind",
    "trail",
    "fit",
    "divergence",
    "profile",
    "out_dtypes",
    "attn_dtypes",
    "settings_changes",
    *NESTED,
)


@cache
def field_names(kind: type) -> tuple[str, ...]:
    """A dataclass's field names, read once (reading a run builds thousands of records)."""
    return tuple(f.name for f in dataclasses.fields(kind))


def taken(names: tuple[str, ...], data: dict[str, Any]) -> dict[str, Any]:
    """The values of ``names`` in ``data`` (None where one is absent)."""
    return dict(zip(names, map(data.get, names), strict=True))


@cache
def plain_field_names() -> tuple[str, ...]:
    """The fields of a record taken from the JSON object as they are."""
    return tuple(name for name in field_names(CellRecord) if name not in TYPED_FIELDS)


class MalformedRecord(ValueError):
    """A JSON value that is not a record this ampmatrix reads: the message names the field
    and what is wrong with it. ``CellRecord.from_dict`` raises no other error, whatever
    the value (of any type, at any depth)."""


@dataclass(frozen=True)
class CellRecord:
    """What one cell did. Flattened to one JSON object per line in ``cells.jsonl``."""

    cell: Cell
    torch_version: str
    outcome: Outcome
    reproduces: bool | None = None
    error_type: str | None = None
    error_message: str | None = None
    #: Innermost frames of the case's own code where the error was raised (``file:line in f``).
    error_frames: tuple[str, ...] = ()
    crash_kind: CrashKind | None = None
    flags: tuple[Flag, ...] = ()
    #: The dtypes of the output's tensors, in order first seen (none where it has none).
    out_dtypes: tuple[str, ...] = ()
    #: The dtypes the attention core's kernels received, in order first seen.
    attn_dtypes: tuple[str, ...] = ()
    numerics: Numerics | None = None
    skip_reason: str | None = None
    #: The plain low-precision baseline failed: the tolerance fell back to the dtype's eps.
    baseline_error: str | None = None
    #: What is worth saying about the cell besides its outcome and flags, in the order said.
    notes: tuple[Note, ...] = ()
    duration_s: float | None = None
    worker: str | None = None
    perf: Perf | None = None
    #: Timing was tried and failed (``Type: message``); the correctness record stands.
    timing_error: str | None = None
    #: For an output of several tensors: each leaf's figures (``numerics`` is the worst).
    leaves: dict[str, Numerics] | None = None
    #: The error came from ``torch.compile`` itself (Dynamo or Inductor), not eager code.
    compile_error: bool | None = None
    #: Warnings the fix raised (``Category: first line``, distinct, at most five).
    warnings: tuple[str, ...] = ()
    #: Where a wider dtype entered and where the cell failed (``promotion``,
    #: ``failure_site`` and ``compute_dtypes`` in the JSON object).
    trail: Trail | None = None
    #: A cell of the ``fit`` stage: its loss curve and what its optimizer did.
    fit: FitFigures | None = None
    #: torch's global settings the cell's own code changed (and the harness put back).
    settings_changes: tuple[SettingChange, ...] = ()
    #: A cell that ran and did not pass: the first module beyond its rounding (None where
    #: not profiled; absent from records written before the profile).
    divergence: Divergence | None = None
    #: The series the divergence was read from: every module's ratio, forward and backward
    #: (None where not profiled; absent from records written before the profile).
    profile: Profile | None = None

    @property
    def notes_text(self) -> str | None:
        """The notes as one line (``"; "`` between them), as views print them."""
        return "; ".join(note.text for note in self.notes) or None

    def noted(self, *notes: Note | None) -> CellRecord:
        """This record with ``notes`` (those not None) after its own."""
        added = tuple(note for note in notes if note is not None)
        return dataclasses.replace(self, notes=self.notes + added) if added else self

    def to_dict(self) -> dict[str, Any]:
        """The record's JSON object: strict JSON (a non-finite number is a string), so
        ``json.dumps(..., allow_nan=False)`` writes it."""
        data: dict[str, Any] = {"schema_version": SCHEMA_VERSION, **self.cell.to_dict()}
        for f in dataclasses.fields(self):
            if f.name == "cell":
                continue
            value = getattr(self, f.name)
            if f.name in NESTED:
                kind = NESTED[f.name][0]
                nested = dataclasses.asdict(value) if value else {}
                data.update({g.name: nested.get(g.name) for g in dataclasses.fields(kind)})
            elif f.name == "flags":
                data[f.name] = [flag.to_dict() for flag in value]
            elif f.name == "settings_changes":
                data[f.name] = [dataclasses.asdict(change) for change in value]
            elif f.name in ("error_frames", "warnings", "out_dtypes", "attn_dtypes"):
                data[f.name] = list(value)
            elif f.name == "notes":
                data[f.name] = [{"kind": n.kind.value, "text": n.text} for n in value]
            elif f.name == "leaves":
                data[f.name] = (
                    {k: dataclasses.asdict(v) for k, v in value.items()} if value else None
                )
            elif f.name == "trail":
                data.update(value.to_dict() if value else Trail().to_dict())
            elif f.name in ("fit", "divergence", "profile"):
                data[f.name] = value.to_dict() if value else None
            else:
                data[f.name] = value.value if isinstance(value, Enum) else value
        return finite_json(data)

    @classmethod
    def from_dict(cls, data: Any) -> CellRecord:
        """The record a JSON object holds (a record of an older schema migrated). Anything
        else raises ``MalformedRecord`` naming the field and what is wrong."""
        try:
            return cls._parsed(data)
        except KeyError as error:
            raise MalformedRecord(f"no {error.args[0] if error.args else 'field'}") from None
        except (TypeError, ValueError, ArithmeticError) as error:
            raise MalformedRecord(str(error)) from error
        except RecursionError:  # a value nested thousands deep, in a field of no such shape
            raise MalformedRecord("a value nested too deep to read") from None

    @classmethod
    def _parsed(cls, data: Any) -> CellRecord:
        """``from_dict``'s work: a field that is absent raises ``KeyError``, one that does
        not fit its type ``TypeError`` or ``ValueError``."""
        data = as_mapping(data, "record")
        version = checked_version(data, SCHEMA_VERSION)
        if version < SCHEMA_VERSION:
            data = migrated(data, version)
        nested: dict[str, Any] = {
            name: built(kind, with_numbers(kind, taken(field_names(kind), data)))
            if data.get(marker) is not None
            else None
            for name, (kind, marker) in NESTED.items()
        }
        plain = with_numbers(cls, taken(plain_field_names(), data))
        crash_kind = data.get("crash_kind")
        leaves = data.get("leaves")
        typed: dict[str, Any] = dict(
            cell=Cell.from_dict(data),
            outcome=member(Outcome, data["outcome"], "outcome"),
            flags=tuple(
                Flag.from_dict(f, f"flags[{i}]")
                for i, f in enumerate(as_tuple(data.get("flags"), "flags"))
            ),
            error_frames=as_tuple(data.get("error_frames"), "error_frames"),
            warnings=as_tuple(data.get("warnings"), "warnings"),
            out_dtypes=as_tuple(data.get("out_dtypes"), "out_dtypes"),
            attn_dtypes=as_tuple(data.get("attn_dtypes"), "attn_dtypes"),
            settings_changes=settings_changes_from(data.get("settings_changes")),
            notes=tuple(note_from(n) for n in as_tuple(data.get("notes"), "notes")),
            leaves=leaves_from(leaves) if leaves else None,
            crash_kind=member(CrashKind, crash_kind, "crash_kind") if crash_kind else None,
            trail=Trail.from_dict(data),
            fit=FitFigures.from_dict(data["fit"]) if data.get("fit") is not None else None,
            divergence=Divergence.from_dict(data["divergence"])
            if data.get("divergence") is not None
            else None,
            profile=Profile.from_dict(data["profile"])
            if data.get("profile") is not None
            else None,
        )
        record = built(cls, typed | nested | plain)
        check_fields(record)
        return record


def settings_changes_from(data: Any) -> tuple[SettingChange, ...]:
    """A record's settings changes from their JSON list (null or absent: none)."""
    changes = as_tuple(data, "settings_changes")
    return tuple(made(SettingChange, c, f"settings_changes[{i}]") for i, c in enumerate(changes))


def leaves_from(data: Any) -> dict[str, Numerics]:
    """Each output leaf's figures from their JSON object (non-finite numbers as strings)."""
    return {
        k: made(
            Numerics, with_numbers(Numerics, as_mapping(v, f"leaves[{k!r}]")), f"leaves[{k!r}]"
        )
        for k, v in as_mapping(data, "leaves").items()
    }


def note_from(data: Any) -> Note:
    """A note from its JSON object (``TypeError`` or ``ValueError`` naming what is wrong)."""
    fields = as_mapping(data, "notes")
    if set(fields) != {"kind", "text"}:
        raise TypeError(f"notes: expected an object of kind and text, got {sorted(fields)}")
    return Note(member(NoteKind, fields["kind"], "notes.kind"), fields["text"])


@dataclass(frozen=True)
class Label:
    """An outcome as every view names it, with its CSS class and its meaning."""

    text: str
    css: str
    meaning: str


#: A raised cell's label, by whether it reproduces the case's known failure.
REPRODUCES = f"{Outcome.RAISES.value}:repro"
RAISES_OTHER = f"{Outcome.RAISES.value}:OTHER"
#: Every outcome label, in the order tables and legends list them: each outcome's value,
#: a raised cell's split by whether it reproduces.
LABELS = (
    Label(REPRODUCES, "raises-repro", "fails with the case's known error (it reproduces)"),
    Label(RAISES_OTHER, "raises-other", "fails with a different, unexpected error"),
    Label(
        Outcome.INACCURATE.value,
        "inaccurate",
        "ran, but beyond tolerance, non-finite or misshapen",
    ),
    Label(Outcome.PASSES.value, "passes", "finite and within tolerance of the float64 reference"),
    Label(
        Outcome.CRASHED.value,
        "crashed",
        "no outcome: the process died, or the reference or harness failed",
    ),
    Label(Outcome.TIMEOUT.value, "timeout", "ran past its time limit"),
    Label(Outcome.SKIPPED.value, "skipped", "not possible in that environment"),
    Label(
        Outcome.RAISES.value,
        "raises-other",
        "fails with an error (a model you check: no known one)",
    ),
)


def base_label(record: CellRecord) -> str:
    """The outcome's label without flags: ``raises:repro``, ``passes``, ..."""
    if record.outcome is Outcome.RAISES:
        if record.reproduces is None:
            return Outcome.RAISES.value  # no known failure to match (a model you check)
        return REPRODUCES if record.reproduces else RAISES_OTHER
    return record.outcome.value


def outcome_label(record: CellRecord) -> str:
    """The label every view prints: flags follow in brackets (``passes[no-autocast]``), so a
    flagged cell never reads as a plain ``passes``."""
    flags = ",".join(dict.fromkeys(flag.kind.value for flag in record.flags))
    return f"{base_label(record)}[{flags}]" if flags else base_label(record)
