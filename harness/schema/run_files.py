"""The files of a run folder beside its records, each declared once: ``env.json``
(:class:`Environment`), ``cases.json`` (:class:`CaseList`) and ``run-plan.json``
(:class:`RunPlan`).

A declaration is a frozen dataclass: the file's name (``FILE``), its version (``VERSION``)
and its fields with their types. Its ``to_dict`` is what every writer writes and its
``from_dict`` what every reader reads (:mod:`harness.results.storage` does the reading and
writing, and puts the file's path in front of every message); the fields' types are what
a file read back is checked against. Like a record's ``schema_version``, each file carries
its version under :data:`VERSION_KEY`: a file from a newer ampmatrix is refused, and one
written before the files had versions (no key) is read as version 1.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

from harness.schema.axes import Cell
from harness.schema.config import RunConfig
from harness.schema.typed import Check, as_mapping, compiled, mismatch
from harness.schema.versions import VERSION_KEY as VERSION_KEY
from harness.schema.versions import checked_version


def file_version(data: dict[str, Any], newest: int) -> int:
    """The version ``data`` declares: 1 where it has none (written before the files had
    versions). A ``ValueError`` for a version newer than ``newest`` or not a number."""
    return checked_version(data, newest, absent=1)


def json_object(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise TypeError(f"expected a JSON object, got {type(data).__name__}")
    return data


def field_checks(kind: type) -> tuple[tuple[str, Check], ...]:
    """Each field of a declaration and the check of its declared type (worked out once per
    declaration, after it)."""
    hints = typing.get_type_hints(kind)
    return tuple((f.name, compiled(hints[f.name])) for f in dataclasses.fields(kind))


class Shown(Enum):
    """Whether the report's table of environments shows a fact of ``env.json``."""

    #: Null too: it says something (no CUDA here, a run without timing).
    ALWAYS = "always"
    #: Where it is known (not null).
    KNOWN = "known"
    NEVER = "never"


#: The metadata of a field of :class:`Environment`: whether the report shows it.
ALWAYS_SHOWN = {"shown": Shown.ALWAYS}
SHOWN_IF_KNOWN = {"shown": Shown.KNOWN}
NOT_SHOWN = {"shown": Shown.NEVER}


@dataclass(frozen=True)
class Environment:
    """``env.json``: the environment a run ran in, captured as it starts, and how the run
    went, added as it finishes and by each ``--resume``. Any fact may be null: not known
    (no CUDA here, a run that did not finish), or, read tolerantly, a value of the wrong
    type (named as a problem and left out). The fields are in the order the report shows
    them."""

    FILE: ClassVar[str] = "env.json"
    #: 1: no version key; the run's configuration stored here too (``config``).
    #: 2: the version key; every field written (null where not known); no ``config``, which
    #: ``run-plan.json`` holds (a version 1 file's is not read).
    VERSION: ClassVar[int] = 2

    torch_version: str | None = field(default=None, metadata=ALWAYS_SHOWN)
    torch_git_version: str | None = field(default=None, metadata=ALWAYS_SHOWN)
    cuda_version: str | None = field(default=None, metadata=ALWAYS_SHOWN)
    cudnn_version: int | None = field(default=None, metadata=ALWAYS_SHOWN)
    gpus: list[dict[str, Any]] | None = field(default=None, metadata=ALWAYS_SHOWN)
    cuda_driver: str | None = field(default=None, metadata=ALWAYS_SHOWN)
    cpu: str | None = field(default=None, metadata=ALWAYS_SHOWN)
    cpu_count: int | None = field(default=None, metadata=ALWAYS_SHOWN)
    #: How loaded the machine was over the run's last minutes (timing noise's usual cause).
    load_average: list[float] | None = field(default=None, metadata=SHOWN_IF_KNOWN)
    torch_num_threads: int | None = field(default=None, metadata=ALWAYS_SHOWN)
    #: Worker processes of the correctness phase, and the torch threads each cell got.
    workers: int | None = field(default=None, metadata=SHOWN_IF_KNOWN)
    threads_per_worker: int | None = field(default=None, metadata=SHOWN_IF_KNOWN)
    #: The peak matmul throughput measured per device and dtype, and when it was measured.
    peak_gflops: dict[str, dict[str, float]] | None = field(default=None, metadata=SHOWN_IF_KNOWN)
    peak_measured_at: dict[str, dict[str, str]] | None = field(
        default=None, metadata=SHOWN_IF_KNOWN
    )
    packages: dict[str, str | None] | None = field(default=None, metadata=ALWAYS_SHOWN)
    flags: dict[str, Any] | None = field(default=None, metadata=ALWAYS_SHOWN)
    #: What importing the run's case or model modules changed of torch's global settings,
    #: by module: each change was put back before any cell ran (``flags`` is torch's own).
    import_changes: dict[str, list[str]] | None = field(default=None, metadata=SHOWN_IF_KNOWN)
    #: The timing settings (null: correctness only, or a run that did not finish).
    timing: dict[str, Any] | None = field(default=None, metadata=ALWAYS_SHOWN)
    python: str | None = field(default=None, metadata=ALWAYS_SHOWN)
    platform: str | None = field(default=None, metadata=ALWAYS_SHOWN)
    hostname: str | None = field(default=None, metadata=ALWAYS_SHOWN)
    harness_commit: str | None = field(default=None, metadata=ALWAYS_SHOWN)
    started_at: str | None = field(default=None, metadata=ALWAYS_SHOWN)
    finished_at: str | None = field(default=None, metadata=ALWAYS_SHOWN)
    command: list[str] | None = field(default=None, metadata=ALWAYS_SHOWN)
    runner_exit_code: int | None = field(default=None, metadata=NOT_SHOWN)
    #: What the timing phase spent its time on (``TimingPhase.to_dict``).
    timing_phase: dict[str, float] | None = field(default=None, metadata=NOT_SHOWN)
    #: One entry per ``--resume``: when, the partial line it cut, the cells it had left.
    resumed: list[dict[str, Any]] | None = field(default=None, metadata=NOT_SHOWN)

    def to_dict(self) -> dict[str, Any]:
        return {VERSION_KEY: self.VERSION, **{name: getattr(self, name) for name in FIELDS}}

    @classmethod
    def from_dict(cls, data: Any, problems: list[str] | None = None) -> Environment:
        """The environment a file holds. A field of the wrong type is a ``TypeError`` naming
        it; where a ``problems`` list is given, the problem goes there instead and the
        field is left out. Keys it does not declare are not read."""
        data = json_object(data)
        file_version(data, cls.VERSION)
        values = {}
        for name, check in ENVIRONMENT_CHECKS:
            value = data.get(name)
            problem = None if value is None else check(value, name)
            if problem is None:
                values[name] = value
            elif problems is None:
                raise TypeError(problem)
            else:
                problems.append(problem)
        return cls(**values)

    def facts(self) -> list[tuple[str, Any]]:
        """What the report shows of the environment, in order: each fact's name and value
        (none where no fact is known: an ``env.json`` missing or unreadable)."""
        values = [(name, shown, getattr(self, name)) for name, shown in SHOWN.items()]
        if all(value is None for _, _, value in values):
            return []
        return [
            (name, value)
            for name, shown, value in values
            if shown is Shown.ALWAYS or value is not None
        ]


ENVIRONMENT_CHECKS = field_checks(Environment)
FIELDS = tuple(name for name, _ in ENVIRONMENT_CHECKS)
SHOWN: dict[str, Shown] = {
    f.name: f.metadata["shown"]
    for f in dataclasses.fields(Environment)
    if f.metadata["shown"] is not Shown.NEVER
}


@dataclass(frozen=True)
class CaseInfo:
    """What a report shows about a case: one entry of ``cases.json``."""

    name: str
    title: str | None = None
    source_file: str | None = None
    #: ``repo``, ``file``, ``commit``, ``issues``, ``url`` (``Upstream`` as a dict).
    upstream: dict[str, str | list[str] | None] | None = None
    #: ``error_type`` and ``message`` (None for a failure that only shows silently) and
    #: ``silent``, the symptoms of a silent failure (``FailureSignature`` as a dict; runs
    #: stored before silent failures were declared have no ``silent``).
    failure: dict[str, str | list[str] | None] | None = None
    failure_variants: list[dict[str, str | list[str] | None]] = field(default_factory=list)
    #: ``name``, ``rationale``, ``upstream`` of each fix.
    fixes: list[dict[str, str | None]] = field(default_factory=list)
    keep_fp32: list[str] = field(default_factory=list)
    manages_precision: bool = False
    #: Each size's ``dims`` (each dimension's ``repr``) and ``source``.
    sizes: dict[str, dict[str, str | dict[str, str]]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_dict(cls, data: Any, where: str = "case") -> CaseInfo:
        """A case as stored; a ``TypeError`` / ``ValueError`` naming ``where`` and the field
        that does not fit. A field left out takes its default."""
        if not isinstance(data, dict):
            raise TypeError(mismatch(where, dict, data))
        if "name" not in data:
            raise ValueError(f"{where}: no name")
        values = {}
        for name, check in CASE_CHECKS:
            if name in data:
                problem = check(data[name], f"{where}.{name}")
                if problem:
                    raise TypeError(problem)
                values[name] = data[name]
        return cls(**values)


CASE_CHECKS = field_checks(CaseInfo)


@dataclass(frozen=True)
class CaseList:
    """``cases.json``: the cases of a run as its report shows them."""

    FILE: ClassVar[str] = "cases.json"
    #: 1: a JSON list of cases, with no version. 2: an object: the version key and ``cases``.
    VERSION: ClassVar[int] = 2

    cases: tuple[CaseInfo, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {VERSION_KEY: self.VERSION, "cases": [case.to_dict() for case in self.cases]}

    @classmethod
    def from_dict(cls, data: Any, problems: list[str] | None = None) -> CaseList:
        """The cases of a file. A case that does not fit is a ``TypeError`` or ``ValueError``
        naming it (``case 3.title: ...``); where a ``problems`` list is given, the problem
        goes there instead and the case is left out."""
        if isinstance(data, dict) and file_version(data, cls.VERSION) > 1:
            entries = data.get("cases")
            if not isinstance(entries, list):
                raise TypeError(mismatch("cases", list, entries))
        elif isinstance(data, list):
            entries = data
        else:
            raise TypeError("expected a list of cases")
        cases = []
        for number, entry in enumerate(entries):
            try:
                cases.append(CaseInfo.from_dict(entry, f"case {number}"))
            except (TypeError, ValueError) as error:
                if problems is None:
                    raise
                problems.append(str(error))
        return cls(tuple(cases))


@dataclass(frozen=True)
class RunPlan:
    """``run-plan.json``: what ``--resume`` and the workers of a run read to run it as it was
    started: its configuration, its cells, and the cells skipped here with why."""

    FILE: ClassVar[str] = "run-plan.json"
    #: 1: no version key (the oldest held the configuration's parts at the top level).
    #: 2: the version key; ``config``, ``cells``, ``skipped``.
    VERSION: ClassVar[int] = 2

    config: RunConfig
    cells: tuple[Cell, ...] = ()
    skipped: tuple[tuple[Cell, str], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            VERSION_KEY: self.VERSION,
            "config": self.config.to_dict(),
            "cells": [cell.to_dict() for cell in self.cells],
            "skipped": [[cell.to_dict(), reason] for cell, reason in self.skipped],
        }

    @classmethod
    def from_dict(cls, data: Any) -> RunPlan:
        """The plan a file holds; a ``ValueError`` naming the field that does not fit."""
        config = cls.config_from_dict(data)
        try:
            return cls(
                config=config,
                cells=tuple(cell_at(c, f"cells[{i}]") for i, c in enumerate(data["cells"])),
                skipped=tuple(
                    skipped_at(s, f"skipped[{i}]") for i, s in enumerate(data["skipped"])
                ),
            )
        except (TypeError, ValueError) as error:
            raise ValueError(f"malformed run plan: {error}") from error

    @classmethod
    def config_from_dict(cls, data: Any) -> RunConfig:
        """The configuration of the plan a file holds, its cells not read (a worker of the
        run needs only the configuration, and a plan may list a hundred thousand cells)."""
        if not isinstance(data, dict):
            raise ValueError("not a run plan (no lists of cells and skipped cells)")
        version = file_version(data, cls.VERSION)
        if not all(isinstance(data.get(key), list) for key in ("cells", "skipped")):
            raise ValueError("not a run plan (no lists of cells and skipped cells)")
        try:
            return stored_config(data, version)
        except (TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"malformed run plan: {error}") from error


def stored_config(data: dict[str, Any], version: int) -> RunConfig:
    """A plan's configuration (the oldest plans held its parts at the top level), its
    problems named from the plan's top."""
    if "config" not in data and version == 1:
        return RunConfig.from_dict(data)
    if not isinstance(data.get("config"), dict):
        raise TypeError(mismatch("config", dict, data.get("config")))
    try:
        return RunConfig.from_dict(data["config"])
    except (TypeError, ValueError) as error:
        raise type(error)(f"config.{error}") from error


def cell_at(data: Any, where: str) -> Cell:
    fields = as_mapping(data, where)
    try:
        return Cell.from_dict(fields)
    except KeyError as error:
        raise ValueError(f"{where}: no {error.args[0]}") from error
    except (TypeError, ValueError) as error:
        raise type(error)(f"{where}.{error}") from error


def skipped_at(data: Any, where: str) -> tuple[Cell, str]:
    if not isinstance(data, list) or len(data) != 2 or not isinstance(data[1], str):
        raise TypeError(mismatch(where, "a cell and a reason", data))
    return cell_at(data[0], f"{where}[0]"), data[1]
