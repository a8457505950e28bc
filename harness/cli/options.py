"""The options ``run`` and ``check`` share, the argument types, and the run's one
configuration built from them. The selection flags are derived from the axis table, the
others from the configuration's fields (``harness.schema.config``): each field that is an
option declares its flag, help, default and the values it takes, once."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.schema.axes import AXES, Axis
from harness.schema.config import (
    MAX_MEMORY_BYTES,
    Declared,
    RunConfig,
    declared_options,
    from_flags,
)

if TYPE_CHECKING:
    from harness.schema.selection import Selection


def split_values(values: Sequence[str] | None) -> tuple[str, ...]:
    """``--dtype float16,bfloat16 --dtype float32`` -> three values."""
    return tuple(v for value in values or () for v in value.split(",") if v)


def max_workers() -> int:
    """The most worker processes a run starts: four per core (each is an interpreter with
    torch loaded; more only queue for the cores and the process table)."""
    return 4 * (os.cpu_count() or 1)


def worker_count_arg(value: str) -> str:
    if value == "auto" or (value.isdigit() and 0 <= int(value) <= max_workers()):
        return value
    raise argparse.ArgumentTypeError(
        f"{value!r} is not 'auto' or a number of workers from 0 to {max_workers()} (four per core)"
    )


def add_cases_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cases-dir",
        action="append",
        type=Path,
        default=[],
        metavar="DIR",
        help="also load case modules from DIR (repeatable)",
    )


def add_run_options(parser: argparse.ArgumentParser, axes: tuple[Axis, ...]) -> None:
    """The options ``run`` and ``check`` share: the selection flags of ``axes``, then the
    options the run configuration's fields declare (where the results go, workers, timing,
    limits)."""
    for axis in axes:
        parser.add_argument(
            f"--{axis.name}",
            dest=axis.plural,
            action="append",
            metavar="NAME",
            help=f"only this {axis.name} (repeatable, or comma-separated){flag_help(axis)}",
        )
    for declared in declared_options(RunConfig):
        add_option(parser, declared)


def flag_help(axis: Axis) -> str:
    """What an axis's flag takes, its ``{values}`` the axis's values as they are when the
    parser is built: a stage registered after ``harness.schema.axes`` was imported (a
    stage of one's own) is listed."""
    return axis.flag_help.replace("{values}", ", ".join(axis.vocabulary))


def add_option(parser: argparse.ArgumentParser, declared: Declared) -> None:
    """One option as its field declares it: a switch (``--flush-l2``, ``--no-trace``) or a
    flag taking a value, read by ``reader``."""
    option = declared.option
    names = [name for name in (option.short, option.flag) if name]
    if option.negated or declared.kind is bool:
        parser.add_argument(*names, dest=option.dest, action="store_true", help=declared.help)
        return
    parser.add_argument(
        *names,
        dest=option.dest,
        type=reader(declared),
        default=declared.default,
        metavar=option.metavar,
        help=declared.help,
    )


def reader(declared: Declared) -> Callable[[str], Any]:
    """The flag's text as its field's value: read by the option's ``parse`` (``PARSERS``)
    or its field's type (``BY_TYPE``), then held to the field's ``Rule``."""
    parse = PARSERS[declared.option.parse] if declared.option.parse else BY_TYPE[declared.kind]
    rule = declared.rule

    def read(text: str) -> Any:
        value = parse(text)
        if value is None or (rule is not None and not rule.fits(value)):
            refused = rule.refusal(text) if rule else f"{text!r} is not a whole number"
            raise argparse.ArgumentTypeError(refused)
        return value

    read.__name__ = declared.option.dest  # argparse names a type by it
    return read


def add_report_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--report-dir",
        type=Path,
        metavar="DIR",
        help="also render the run's HTML report into DIR/<run-id>.html",
    )


def positive_float(value: str) -> float:
    """A finite number above zero (``nan``, ``inf`` and ``1e400`` are refused)."""
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not (math.isfinite(number) and number > 0):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive finite number")
    return number


def whole_number(value: str) -> int | None:
    """Digits as a number; None for any other text (its field's ``Rule`` says why)."""
    return int(value) if value.isdigit() else None


def probability(value: str) -> float:
    number = positive_float(value)
    if number >= 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a probability between 0 and 1")
    return number


def ratio_above_one(value: str) -> float:
    number = positive_float(value)
    if number <= 1:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a speed ratio above 1 (1.10: a change of 10% or more)"
        )
    return number


#: The smallest per-cell memory limit: below it not even the interpreter fits.
MIN_MEMORY_GIB = 0.25


def physical_memory_gib() -> float | None:
    """This machine's memory (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def memory_gib(value: str) -> float:
    """A per-cell memory limit in GiB: enough for the interpreter, and at most what this
    machine has (a larger one limits nothing, and setrlimit() refuses the largest)."""
    number = positive_float(value)
    if number < MIN_MEMORY_GIB:
        raise argparse.ArgumentTypeError(
            f"{value!r} GiB is too small a memory limit (at least {MIN_MEMORY_GIB:g})"
        )
    ceiling = physical_memory_gib() or MAX_MEMORY_BYTES / 2**30
    if number > ceiling:
        raise argparse.ArgumentTypeError(
            f"{value!r} GiB is more memory than this machine has ({ceiling:.1f} GiB): "
            "leave --memory-limit out for no limit"
        )
    return number


def memory_limit(value: str) -> int:
    """``--memory-limit``: GiB on the command line, bytes in ``Limits.memory_bytes``."""
    return int(memory_gib(value) * 2**30)


#: The readers of flags whose field names one (``Option.parse``).
PARSERS: dict[str, Callable[[str], Any]] = {"workers": worker_count_arg, "gib": memory_limit}
#: The readers of the other flags, by their field's type.
BY_TYPE: dict[Any, Callable[[str], Any]] = {
    int: whole_number,
    float: positive_float,
    str: str,
    Path: Path,
}


def selection_from(args: argparse.Namespace, axes: tuple[Axis, ...] = AXES) -> Selection:
    """The selection flags; one given with no name at all (``--case ""``) is refused rather
    than read as "every case"."""
    from harness.schema.selection import Selection, SelectionError

    values = {}
    for axis in axes:
        given = getattr(args, axis.plural, None)
        values[axis.plural] = split_values(given)
        if given is not None and not values[axis.plural]:
            raise SelectionError(f"--{axis.name} was given no name")
    return Selection.over(axes, values)


def config_from(args: argparse.Namespace, argv: Sequence[str]) -> RunConfig:
    """The run's one configuration, built once from the command line: the fields that are
    options from their flags, the selection, the case folders and the command itself."""
    return from_flags(
        RunConfig,
        vars(args),
        selection=selection_from(args),
        cases_dirs=tuple(getattr(args, "cases_dir", ())),
        command=("python -m harness", *argv),
    )
