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
from typing import Any, TypeVar

from harness.schema.axes import Cell
from harness.schema.trail_records import Trail
from harness.schema.typed import as_mapping, as_tuple, built, check_fields, mismatch

#: Bumped whenever a record's fields change meaning; readers refuse newer versions.
#: 3: numerics name their yardsticks (``rounding_rel_err``, ``decided_by``, ``factor``;
#: ``baseline_rel_err`` is a different fix's error only) and flags carry a ``share``.
#: 4: a record's notes are a list of ``{"kind", "text"}`` (``notes``), not one text joined
#: with ``"; "`` (``note``).
SCHEMA_VERSION = 4


class Outcome(str, Enum):
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
    #: its own sides (see ``harness.measure.running.kinks``).
    KINKS = "kinks"
    #: A training step's GradScaler skipped steps (gradients not finite) before it ran.
    SCALER = "scaler"
    #: A training step's gradients were not finite: the first parameter whose gradient went
    #: so, and the first backward node that made one from finite gradients.
    GRADIENT = "gradient"
    #: The notes of a record of schema 3 or older, stored joined in one text: their kinds
    #: were not recorded (and a note's own text may hold ``"; "``, so they are not split).
    JOINED = "joined"


@dataclass(frozen=True)
class Note:
    """Something worth saying about a cell that is neither its outcome nor a flag."""

    kind: NoteKind
    text: str


#: The flag of a cell that ran but left its mode's promise (see :mod:`harness.measure.precision`).
DRIFT = "drift"


@dataclass(frozen=True)
class Flag:
    """Something a cell's precision mode promised and the cell did not do. A flagged cell is
    never a plain ``passes``: its label carries the flag's kind."""

    kind: str
    detail: str
    #: How much of the cell's work it touched: for ``drift``, the share of the matmul and
    #: attention FLOPs computed wider (None where unknown or not a matter of FLOPs).
    share: float | None = None

    def describe(self) -> str:
        return f"{self.kind}: {self.detail}"


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


#: A cell whose timed median exceeds its device time by more than this factor is
#: launch-bound.
LAUNCH_BOUND = 2.0


def launch_bound(timed_s: float, device_s: float) -> bool:
    return timed_s > LAUNCH_BOUND * device_s


@dataclass(frozen=True)
class Perf:
    """Speed, throughput and memory of a cell that ran (see ``harness.measure.figures.perf``)."""

    time_samples: list[float]
    time_block: int
    time_median_s: float
    time_iqr_s: float
    time_min_s: float
    time_count: int
    time_noisy: bool
    timer: str
    threads: int
    flops: int | None
    gflops: float | None
    peak_gflops: float | None
    peak_fraction: float | None
    peak_mem_bytes: int
    mem_method: str
    timing_worker: str | None = None
    #: When this machine's peak GEMM figure was measured (it is cached and reused).
    peak_measured_at: str | None = None
    #: On CUDA, per call, the time the device was busy with the call's kernels (from the
    #: profiler, over ``device_time_calls`` calls): the time without the host's launches.
    device_time_s: float | None = None
    device_time_calls: int | None = None

    @property
    def launch_bound(self) -> bool:
        """The timed figure is more than LAUNCH_BOUND times the device's: the host's Python
        and kernel launches set it, not the kernels."""
        device = self.device_time_s
        return device is not None and launch_bound(self.time_median_s, device)

    @property
    def speed_s(self) -> float:
        """The figure speed is judged by: the device time where the cell is launch-bound
        (comparing wall times there compares the fixes' Python), else the timed median."""
        if self.launch_bound and self.device_time_s is not None:
            return self.device_time_s
        return self.time_median_s

    @property
    def speed_clock(self) -> str:
        return "device time (launch-bound)" if self.launch_bound else "wall time"


@dataclass(frozen=True)
class FitFigures:
    """What a cell of the ``fit`` stage did over its steps (see
    ``harness.measure.running.fitting``): its loss before each step and after the last, the float64
    fit's, the steps a GradScaler skipped and the scale it ended at, the share of the updates the
    optimizer computed that the stored weights did not receive, and the share of the float64 fit's
    progress (its first loss minus its last) the cell's last loss fell short of (None where that
    progress is too small to judge by)."""

    losses: tuple[float, ...]
    reference_losses: tuple[float, ...]
    skipped_steps: int
    final_scale: float | None
    lost_share: float
    shortfall: float | None

    @property
    def steps(self) -> int:
        return len(self.losses) - 1

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "losses": list(self.losses),
            "reference_losses": list(self.reference_losses),
        }

    @classmethod
    def from_dict(cls, data: Any) -> FitFigures:
        figures = made(cls, data, "fit")
        return dataclasses.replace(
            figures,
            losses=floats(figures.losses, "fit.losses"),
            reference_losses=floats(figures.reference_losses, "fit.reference_losses"),
        )


def floats(values: Any, name: str) -> tuple[float, ...]:
    """A list of numbers (``null`` for a loss that was not finite: JSON has no NaN)."""
    return tuple(float("nan") if v is None else float(v) for v in as_tuple(values, name))


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
    out_dtype: str | None = None
    attn_dtype: str | None = None
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

    @property
    def notes_text(self) -> str | None:
        """The notes as one line (``"; "`` between them), as views print them."""
        return "; ".join(note.text for note in self.notes) or None

    def noted(self, *notes: Note | None) -> CellRecord:
        """This record with ``notes`` (those not None) after its own."""
        added = tuple(note for note in notes if note is not None)
        return dataclasses.replace(self, notes=self.notes + added) if added else self

    def to_dict(self) -> dict[str, Any]:
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
                data[f.name] = [dataclasses.asdict(flag) for flag in value]
            elif f.name in ("error_frames", "warnings"):
                data[f.name] = list(value)
            elif f.name == "notes":
                data[f.name] = [{"kind": n.kind.value, "text": n.text} for n in value]
            elif f.name == "leaves":
                data[f.name] = (
                    {k: dataclasses.asdict(v) for k, v in value.items()} if value else None
                )
            elif f.name == "trail":
                data.update(value.to_dict() if value else Trail().to_dict())
            elif f.name == "fit":
                data[f.name] = value.to_dict() if value else None
            else:
                data[f.name] = value.value if isinstance(value, Enum) else value
        return data

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
        version = data.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool) or version > SCHEMA_VERSION:
            raise ValueError(
                f"schema_version {version!r} is not supported (this ampmatrix reads up to "
                f"{SCHEMA_VERSION}); upgrade ampmatrix to read it"
            )
        if version < 2:
            data = migrate_v1(data)
        if version < 4:
            data = migrate_v3(data)
        nested: dict[str, Any] = {
            name: built(kind, taken(field_names(kind), data))
            if data.get(marker) is not None
            else None
            for name, (kind, marker) in NESTED.items()
        }
        plain = taken(plain_field_names(), data)
        crash_kind = data.get("crash_kind")
        leaves = data.get("leaves")
        typed: dict[str, Any] = dict(
            cell=Cell.from_dict(data),
            outcome=member(Outcome, data["outcome"], "outcome"),
            flags=tuple(
                made(Flag, f, f"flags[{i}]")
                for i, f in enumerate(as_tuple(data.get("flags"), "flags"))
            ),
            error_frames=as_tuple(data.get("error_frames"), "error_frames"),
            warnings=as_tuple(data.get("warnings"), "warnings"),
            notes=tuple(note_from(n) for n in as_tuple(data.get("notes"), "notes")),
            leaves={
                k: made(Numerics, v, f"leaves[{k!r}]")
                for k, v in as_mapping(leaves, "leaves").items()
            }
            if leaves
            else None,
            crash_kind=member(CrashKind, crash_kind, "crash_kind") if crash_kind else None,
            trail=Trail.from_dict(data),
            fit=FitFigures.from_dict(data["fit"]) if data.get("fit") is not None else None,
        )
        record = built(cls, typed | nested | plain)
        check_fields(record)
        return record


E = TypeVar("E", bound=Enum)
D = TypeVar("D")


def member(kind: type[E], value: Any, name: str) -> E:
    """The member of the enum ``kind`` whose value is ``value``; a ``ValueError`` naming
    the field and the values it may take."""
    try:
        return kind(value)
    except (TypeError, ValueError, RecursionError):  # the enum's message holds its repr
        allowed = "one of " + ", ".join(str(m.value) for m in kind)
        raise ValueError(mismatch(name, allowed, value)) from None


def made(kind: type[D], value: Any, name: str) -> D:
    """The dataclass ``kind`` from a JSON object of its fields; a ``TypeError`` naming the
    field for anything else (a field missing or unknown)."""
    try:
        return kind(**as_mapping(value, name))
    except TypeError as error:
        if str(error).startswith(name):
            raise
        raise TypeError(f"{name}: {error}") from None


V1_TIMING_FAILED = "timing failed: "
V1_CRASH_KINDS = {
    "ProcessDied": CrashKind.PROCESS_DIED,
    "WorkerCrashed": CrashKind.WORKER_DIED,
    "HarnessError": CrashKind.HARNESS,
}


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
    if data.get("outcome") == Outcome.CRASHED.value:
        kind = V1_CRASH_KINDS.get(str(data.get("error_type")))
        data["crash_kind"] = kind.value if kind else None
    return data


def migrate_v3(data: dict[str, Any]) -> dict[str, Any]:
    """Schema 3 and older stored a record's notes as one text joined with ``"; "``: it
    becomes one note of kind ``joined``, word for word."""
    data = dict(data)
    note = data.pop("note", None)
    if not isinstance(note or "", str):
        raise TypeError(mismatch("note", str | None, note))
    data["notes"] = [{"kind": NoteKind.JOINED.value, "text": note}] if note else []
    return data


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


REPRODUCES = "raises:repro"
#: Every outcome label, in the order tables and legends list them.
LABELS = (
    Label(REPRODUCES, "raises-repro", "fails with the case's known error (it reproduces)"),
    Label("raises:OTHER", "raises-other", "fails with a different, unexpected error"),
    Label("inaccurate", "inaccurate", "ran, but beyond tolerance, non-finite or misshapen"),
    Label("passes", "passes", "finite and within tolerance of the float64 reference"),
    Label(
        "crashed", "crashed", "no outcome: the process died, or the reference or harness failed"
    ),
    Label("timeout", "timeout", "ran past its time limit"),
    Label("skipped", "skipped", "not possible in that environment"),
    Label("raises", "raises-other", "fails with an error (a model you check: no known one)"),
)


def base_label(record: CellRecord) -> str:
    """The outcome's label without flags: ``raises:repro``, ``passes``, ..."""
    if record.outcome is Outcome.RAISES:
        if record.reproduces is None:
            return Outcome.RAISES.value  # no known failure to match (a model you check)
        return REPRODUCES if record.reproduces else "raises:OTHER"
    return record.outcome.value


def outcome_label(record: CellRecord) -> str:
    """The label every view prints: flags follow in brackets (``passes[no-autocast]``), so a
    flagged cell never reads as a plain ``passes``."""
    flags = ",".join(dict.fromkeys(flag.kind for flag in record.flags))
    return f"{base_label(record)}[{flags}]" if flags else base_label(record)
