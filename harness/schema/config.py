"""The run configuration: built once from the command line, frozen, stored with the run.

``run`` builds it, writes it into ``run-plan.json`` (``harness.schema.run_files.RunPlan``);
``--resume`` and the pytest plugin (in every worker) read it back from there, so each part
of a run sees the same settings.

Each setting is declared once, on its field: a field that is a command-line option says so
with ``option`` (its flag, help and the values it takes, a ``Rule``). The flags of ``run``
and ``check`` (``declared_options``), the configuration built from them (``from_flags``),
the stored form (``to_dict``) and reading it back with its checks (``from_dict``) are all
derived from the fields.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from harness.schema.selection import Selection
from harness.schema.typed import as_mapping, as_tuple, compiled, mismatch

DEFAULT_TIMEOUT_S = 300.0
#: The longest time limit a run can keep: the kernel's poll() takes its timeout in
#: milliseconds as a C int (2**31 - 1 ms, 24.8 days); a longer one fails as it is waited on.
MAX_SECONDS = (2**31 - 1) // 1000
#: The largest memory limit setrlimit() takes (a C long of bytes).
MAX_MEMORY_BYTES = 2**63 - 1
#: Optimizer steps of a ``fit`` cell unless ``--fit-steps`` says otherwise, and the most
#: a run may ask for.
DEFAULT_FIT_STEPS = 20
MAX_FIT_STEPS = 10_000


@dataclass(frozen=True)
class Rule:
    """The values a field takes, declared with the field: the command line refuses any
    other (an argparse error naming the flag), and so does reading a stored configuration
    back (a ``ValueError`` naming the field). None (no value) is always allowed where the
    field's type allows it."""

    fits: Callable[[Any], bool]
    #: What a stored value must be: ``batch: expected <expected>, got 0``.
    expected: str
    #: Why a value given on the command line is refused; ``{text}`` stands for its text.
    refused: str

    def check(self, value: Any, name: str) -> None:
        if value is not None and not self.fits(value):
            raise ValueError(f"{name}: expected {self.expected}, got {value!r}")

    def refusal(self, text: str) -> str:
        return self.refused.replace("{text}", repr(text))


SECONDS = Rule(
    lambda s: 0 < s <= MAX_SECONDS,
    f"seconds above 0 and at most {MAX_SECONDS}",
    f"{{text}} seconds is longer than a run can wait (at most {MAX_SECONDS})",
)
MEMORY_BYTES = Rule(
    lambda b: 0 < b <= MAX_MEMORY_BYTES,
    f"bytes above 0 and at most {MAX_MEMORY_BYTES}",
    f"{{text}} GiB is more memory than a limit can hold ({MAX_MEMORY_BYTES} bytes)",
)
WORKERS = Rule(
    lambda w: w == "auto" or w.isdigit(),
    "'auto' or a number of workers",
    "{text} is not 'auto' or a number of workers",
)
BATCH = Rule(
    lambda n: n >= 1, "a positive whole number", "{text} is not a whole number of cells, 1 or more"
)
FIT_STEPS = Rule(
    lambda n: 1 <= n <= MAX_FIT_STEPS,
    f"a whole number from 1 to {MAX_FIT_STEPS}",
    f"{{text}} is not a whole number of steps from 1 to {MAX_FIT_STEPS}",
)


@dataclass(frozen=True)
class Option:
    """A field's command-line flag, declared on the field with ``option``."""

    flag: str
    #: ``{default}`` stands for the field's default (``{default:g}`` and the like too).
    help: str
    metavar: str | None = None
    short: str | None = None
    #: The command line's reader of the flag's text, by name (``harness.cli.options``
    #: holds them); None: the field's type says (a whole number, a positive number, a path).
    parse: str | None = None

    @property
    def negated(self) -> bool:
        """``--no-trace``: a switch that turns its field off (False, or None for a part)."""
        return self.flag.startswith("--no-")

    @property
    def dest(self) -> str:
        """The flag's name in the parsed arguments: ``--time-budget`` -> ``time_budget``."""
        return self.flag.removeprefix("--").replace("-", "_")


def option(
    *,
    flag: str,
    help: str,
    metavar: str | None = None,
    short: str | None = None,
    parse: str | None = None,
    rule: Rule | None = None,
    absent: Any = dataclasses.MISSING,
) -> dict[str, Any]:
    """The metadata of a field that is a command-line option (``field(default=...,
    metadata=option(...))``): its flag, help and ``Rule``; ``absent``: what a stored
    configuration without the field reads as, where that is not the default (a setting
    older runs did not have)."""
    metadata: dict[str, Any] = {"option": Option(flag, help, metavar, short, parse)}
    if rule is not None:
        metadata["rule"] = rule
    if absent is not dataclasses.MISSING:
        metadata["absent"] = absent
    return metadata


@dataclass(frozen=True)
class TimingConfig:
    warmup_s: float = 0.05
    min_warmup_calls: int = 2
    #: One sample is a block of calls lasting at least this long.
    min_block_s: float = 0.01
    min_samples: int = 7
    #: Timed calls per function at the least, whatever the stop rule says: seven samples of
    #: a slow call (one call each) settle within a run but drift between runs. With 7 calls
    #: (``min_calls`` 0), three runs of the default matrix reversed one column's fixes (two
    #: sana-softmax-float train fixes 60 ms a call apart by a few percent); with 20, none.
    min_calls: int = 20
    max_samples: int = 500
    #: Stop once IQR / median falls under this.
    iqr_threshold: float = 0.03
    #: Wall time allowed for sampling, after warm-up.
    budget_s: float = field(
        default=0.5,
        metadata=option(
            flag="--time-budget",
            metavar="SECONDS",
            help="sampling time allowed per timed cell (default {default})",
            rule=SECONDS,
        ),
    )
    flush_l2: bool = field(
        default=False,
        metadata=option(flag="--flush-l2", help="on CUDA, flush the L2 cache before each sample"),
    )
    #: Leave a cell noisy once its median's 95% interval is no narrower than this many
    #: rounds before: on a loaded machine more samples add no precision, they only spend
    #: the budget (0: never on this ground).
    plateau_rounds: int = 20
    #: A cell whose spread stays above ``iqr_threshold`` stops once its median's 95%
    #: interval is within this share of it, and is left noisy once the budget cannot bring
    #: it there (``harness.measure.figures.timing.StopRule``).
    precision: float = 0.03
    #: Wall time allowed for sampling one cell at the most, ``min_calls`` or not.
    max_sampling_s: float = 10.0


@dataclass(frozen=True)
class Limits:
    timeout_s: float = field(
        default=DEFAULT_TIMEOUT_S,
        metadata=option(
            flag="--timeout",
            metavar="SECONDS",
            help="time limit per cell; a case may set its own (default {default:g})",
            rule=SECONDS,
        ),
    )
    #: Bytes (``--memory-limit`` takes GiB); None: no limit.
    memory_bytes: int | None = field(
        default=None,
        metadata=option(
            flag="--memory-limit",
            metavar="GIB",
            parse="gib",
            help="memory limit per cell process (RLIMIT_DATA); beyond it allocations fail",
            rule=MEMORY_BYTES,
        ),
    )


@dataclass(frozen=True)
class RunConfig:
    """A run's whole configuration, built once from the command line (each option declared
    on its field, with its flag, help, default and rule) and stored in ``run-plan.json``,
    where ``--resume`` and every worker read it back."""

    selection: Selection = field(default_factory=Selection)
    cases_dirs: tuple[Path, ...] = ()
    results_root: Path = field(
        default=Path("results"),
        metadata=option(
            flag="--out",
            metavar="DIR",
            help="results root; the run goes to DIR/<run-id> (default {default})",
        ),
    )
    workers: str = field(
        default="auto",
        metadata=option(
            flag="--workers",
            short="-n",
            parse="workers",
            help="worker processes (default auto: one per core; 0: in-process)",
            rule=WORKERS,
        ),
    )
    command: tuple[str, ...] = ()
    #: Trace dtypes in correctness cells (``--no-trace`` turns it off, to measure its cost).
    trace: bool = field(
        default=True,
        metadata=option(
            flag="--no-trace",
            help="no dtype trail and no drift check in correctness cells (measures their cost)",
        ),
    )
    #: Profile every cell that ran, passing ones too (``--profile``): the divergence
    #: profile's series in each record (a cell that passes still has no divergence).
    profile: bool = field(
        default=False,
        metadata=option(
            flag="--profile",
            help="take the divergence profile of every cell that ran, passing ones too",
        ),
    )
    #: None: correctness only (``--no-timing``), as a stored configuration without it reads.
    timing: TimingConfig | None = field(
        default_factory=TimingConfig,
        metadata=option(
            flag="--no-timing", help="skip the timing phase (correctness only)", absent=None
        ),
    )
    limits: Limits = field(default_factory=Limits)
    #: At most this many cells of one case share a forked process in the correctness phase
    #: (1: every cell in a process of its own, as runs did before ``--batch``).
    batch: int = field(
        default=16,
        metadata=option(
            flag="--batch",
            metavar="N",
            help="cells of one case sharing a forked process (default {default}; "
            "1: every cell in a process of its own)",
            rule=BATCH,
            absent=1,
        ),
    )
    fit_steps: int = field(
        default=DEFAULT_FIT_STEPS,
        metadata=option(
            flag="--fit-steps",
            metavar="N",
            help="optimizer steps of each fit cell (--stage fit; default {default})",
            rule=FIT_STEPS,
        ),
    )
    #: Models checked by ``check`` (``MODULE:FACTORY``), the folder their modules are
    #: imported from, the names they keep in float32 (``--keep-fp32``), the loss their
    #: training steps take (``--loss``: ``MODULE:FUNC`` or ``FACTORY=MODULE:FUNC``) and the
    #: recipe they train with (``--recipe``: ``MODULE:NAME`` or ``FACTORY=MODULE:NAME``).
    models: tuple[str, ...] = ()
    models_path: str = ""
    keep_fp32: tuple[str, ...] = ()
    losses: tuple[str, ...] = ()
    recipes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return stored(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """The configuration as stored; a value of the wrong type or out of range is a
        ``TypeError`` / ``ValueError`` naming its field. Fields it does not know are left
        (the oldest run plans held the configuration beside their cells)."""
        return cls(**read_fields(cls, as_mapping(data, "config"), "", strict=False))


@dataclass(frozen=True)
class Declared:
    """An option as its field declares it, with where the field is, its type and default."""

    #: The field's names from ``RunConfig`` down: ``("limits", "timeout_s")``.
    path: tuple[str, ...]
    #: The field's type (None taken out of an optional one).
    kind: Any
    default: Any
    option: Option
    rule: Rule | None

    @property
    def help(self) -> str:
        return self.option.help.format(default=self.default)


def declared_options(cls: type = RunConfig, path: tuple[str, ...] = ()) -> tuple[Declared, ...]:
    """The options the fields of ``cls`` and of its parts declare, in field order (a part's
    own switch, ``--no-timing``, before its options)."""
    found: list[Declared] = []
    for f in dataclasses.fields(cls):
        kind = value_type(field_types(cls)[f.name])
        if "option" in f.metadata:
            default = f.default_factory() if callable(f.default_factory) else f.default
            opt, rule = f.metadata["option"], f.metadata.get("rule")
            found.append(Declared((*path, f.name), kind, default, opt, rule))
        if dataclasses.is_dataclass(kind):
            found.extend(declared_options(typing.cast(type, kind), (*path, f.name)))
    return tuple(found)


T = typing.TypeVar("T")


def from_flags(cls: type[T], given: Mapping[str, Any], **plain: Any) -> T:
    """``cls`` from the values of its options' flags (by ``Option.dest``: the parsed
    command line), and ``plain`` for its fields that are not options."""
    return cls(**flag_values(cls, given), **plain)


def flag_values(cls: type, given: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of ``cls`` its flags set: a switch given turns its field off (False, or
    None for a part); a part is built from its own flags."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        kind = value_type(field_types(cls)[f.name])
        opt: Option | None = f.metadata.get("option")
        if opt is not None and opt.negated and given[opt.dest]:
            values[f.name] = None if dataclasses.is_dataclass(kind) else False
        elif dataclasses.is_dataclass(kind):
            values[f.name] = from_flags(typing.cast(type, kind), given)
        elif opt is not None and not opt.negated:
            values[f.name] = given[opt.dest]
    return values


@cache
def field_types(cls: Any) -> dict[str, Any]:
    """The types of the fields of the dataclass ``cls``, read once."""
    return typing.get_type_hints(cls)


def value_type(hint: Any) -> Any:
    """``TimingConfig | None`` -> ``TimingConfig``; any other type as it is."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return kinds[0] if len(kinds) == 1 else hint
    return hint


def admits_none(hint: Any) -> bool:
    """Whether a field of the type ``hint`` may hold None (``int | None``)."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    return union and type(None) in typing.get_args(hint)


def stored(obj: Any) -> dict[str, Any]:
    """A configuration dataclass as JSON data, field by field."""
    hints = field_types(obj.__class__)
    return {
        f.name: stored_value(hints[f.name], getattr(obj, f.name)) for f in dataclasses.fields(obj)
    }


def stored_value(hint: Any, value: Any) -> Any:
    """A part as an object, a selection as its ``to_dict``, a tuple as a list, a path as
    text; case folders (a tuple of paths) absolute, to be read against any folder."""
    if value is None or isinstance(value, str | int | float):
        return value
    if dataclasses.is_dataclass(value):
        return stored(value)
    if isinstance(value, Selection):
        return value.to_dict()
    if hint == tuple[Path, ...]:
        return [str(Path(p).resolve()) for p in value]
    if isinstance(value, tuple):
        return list(value)
    return str(value)


#: Fields whose stored null is of the wrong type, not the default.
SCALARS = (bool, int, float)


def read_fields(cls: type, data: dict[str, Any], where: str, strict: bool) -> dict[str, Any]:
    """The fields of ``cls`` from their stored values, each checked against its type and
    its ``Rule``. A field missing reads as its default (or its ``absent`` value), and so
    does null where it stands for an empty list, object or text (a number or a switch has
    none: null there is of the wrong type); a field ``cls`` does not have is a
    ``TypeError`` where ``strict``."""
    hints = field_types(cls)
    if strict and (unknown := sorted(set(data) - set(hints))):
        raise TypeError(f"{where}{unknown[0]}: not a field of {cls.__name__}")
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        raw = data.get(f.name)
        hint = hints[f.name]
        if f.name not in data or (raw is None and not admits_none(hint) and hint not in SCALARS):
            if "absent" in f.metadata:
                values[f.name] = f.metadata["absent"]
            continue
        values[f.name] = read_value(hint, raw, f"{where}{f.name}")
        if "rule" in f.metadata:
            f.metadata["rule"].check(values[f.name], f"{where}{f.name}")
    return values


def read_value(hint: Any, raw: Any, name: str) -> Any:
    """One stored value as its field's type; of the wrong type, a ``TypeError`` naming it."""
    kind = value_type(hint)
    if raw is None and admits_none(hint):
        return None
    if dataclasses.is_dataclass(kind):
        part = typing.cast(type, kind)
        return part(**read_fields(part, as_mapping(raw, name), f"{name}.", strict=True))
    if kind is Selection:
        return Selection.from_dict(
            {
                axis: strings(names, f"{name}.{axis}")
                for axis, names in as_mapping(raw, name).items()
            }
        )
    if kind == tuple[Path, ...]:
        return absolute_paths(raw, name)
    if kind == tuple[str, ...]:
        return strings(raw, name)
    if kind is Path:
        if not isinstance(raw, str):
            raise TypeError(mismatch(name, str, raw))
        return Path(raw)
    problem = compiled(hint)(raw, name)
    if problem is not None:
        raise TypeError(problem)
    return raw


def strings(value: Any, name: str) -> tuple[str, ...]:
    values = as_tuple(value, name)
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise TypeError(mismatch(f"{name}[{i}]", str, v))
    return values


def absolute_paths(value: Any, name: str) -> tuple[Path, ...]:
    """A run plan names its case folders by absolute path (``to_dict`` resolves them); a
    relative one would be read against whatever folder ``--resume`` runs in."""
    paths = tuple(Path(p) for p in strings(value, name))
    for i, path in enumerate(paths):
        if not path.is_absolute():
            raise ValueError(f"{name}[{i}]: expected an absolute path, got {str(path)!r}")
    return paths
