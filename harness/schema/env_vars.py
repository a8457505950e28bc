"""The environment variables ampmatrix reads, each declared once: its name, what it takes
(a ``Rule``), its default, who reads it and its help.

A variable is read only through its declaration (``Variable.read``), which returns the
typed value or raises ``EnvironmentVariableError``: one line naming the variable, the value
and what it must be (``AMPMATRIX_PEAK_MAX_AGE_DAYS: 'nan' is not a finite number of days
between 0 and 3650``). The command line checks every variable the harness reads before it
does any work (``check``), the noxfile every variable it reads as it loads, and the docs'
table of variables is rendered from here (``docs_table``; ``python -m
harness.schema.env_vars`` prints it), so a variable, its rule and its help cannot drift.

The standard library only: the noxfile runs in nox's own Python, where ampmatrix need not
be installed, and loads this file by its path.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: Who reads a variable: the harness (its command line checks it), the noxfile (checked as
#: it loads), the project's tests, and the GPU acceptance script.
HARNESS = "harness"
NOXFILE = "noxfile"
TESTS = "tests"
BENCHMARKS = "benchmarks"
READERS = (HARNESS, NOXFILE, TESTS, BENCHMARKS)

#: The most of a refused value an error line shows.
SHOWN_CHARS = 60


class EnvironmentVariableError(ValueError):
    """A variable's value its rule refuses, with the variable, the value and the rule as
    fields; its text is the one line a user reads."""

    def __init__(self, variable: str, value: str, expected: str) -> None:
        self.variable = variable
        self.value = value
        self.expected = expected
        super().__init__(f"{variable}: {shown(value)} is not {expected}")


def shown(value: str) -> str:
    """A value as an error line quotes it: its repr (a line break stays ``\\n``),
    shortened where it is long."""
    if len(value) > SHOWN_CHARS:
        return repr(value[:SHOWN_CHARS]) + "..."
    return repr(value)


@dataclass(frozen=True)
class Rule(Generic[T]):
    """What a variable's text must be (``parse`` raises ``ValueError`` for text that is not
    of the kind; ``fits`` says whether the value is in range) and, in words, what it is."""

    parse: Callable[[str], T]
    fits: Callable[[T], bool]
    #: ``AMPMATRIX_...: 'text' is not <expected>``.
    expected: str
    #: The type of the value read.
    kind: type
    #: The texts it takes, where it takes a few named ones.
    choices: tuple[str, ...] = ()

    def value_of(self, name: str, text: str) -> T:
        try:
            value = self.parse(text)
        except (ValueError, OverflowError):
            raise EnvironmentVariableError(name, text, self.expected) from None
        if not self.fits(value):
            raise EnvironmentVariableError(name, text, self.expected)
        return value


def parse_number(text: str) -> float:
    """A number as written in ASCII (``2.5``, ``1e3``); ``nan`` and ``inf`` parse, and a
    rule's range refuses them."""
    if not text.isascii():
        raise ValueError(text)
    return float(text)


WHOLE = re.compile(r"\s*[+-]?[0-9]+\s*")


def parse_whole(text: str) -> int:
    """A whole number in ASCII digits (``int`` would take other scripts' digits too)."""
    if not WHOLE.fullmatch(text):
        raise ValueError(text)
    return int(text)


def finite_number(low: float, high: float, unit: str, *, above_low: bool = False) -> Rule[float]:
    """A finite number from ``low`` (or above it) to ``high``, of ``unit`` where it has one."""
    what = f"a finite number{of(unit)}"
    if above_low:
        return Rule(
            parse_number,
            lambda x: low < x <= high,
            f"{what} above {number_text(low)} and at most {number_text(high)}",
            float,
        )
    return Rule(
        parse_number,
        lambda x: low <= x <= high,
        f"{what} between {number_text(low)} and {number_text(high)}",
        float,
    )


def whole_number(low: int, high: int, unit: str) -> Rule[int]:
    return Rule(
        parse_whole,
        lambda n: low <= n <= high,
        f"a whole number{of(unit)} from {low} to {high}",
        int,
    )


def number_text(x: float) -> str:
    """``30``, ``1000000``, ``0.5``: a bound as a person writes it."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def of(unit: str) -> str:
    return f" of {unit}" if unit else ""


def one_of(*choices: str) -> Rule[str]:
    """One of ``choices``, as written (empty text is the variable unset, not a choice)."""
    expected = "one of " + ", ".join(map(repr, choices))
    return Rule(str, lambda c: c in choices, expected, str, choices)


SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True}
SWITCH_WORDS |= {"0": False, "false": False, "no": False, "off": False}


def parse_switch(text: str) -> bool:
    word = text.strip().lower()
    if word not in SWITCH_WORDS:
        raise ValueError(text)
    return SWITCH_WORDS[word]


SWITCH = Rule(
    parse_switch, lambda _: True, "a switch: 1, true, yes or on; 0, false, no or off", bool
)


def text_of(what: str) -> Rule[str]:
    """Any text (a path, a command), described as ``what``."""
    return Rule(str, lambda _: True, what, str)


#: A torch release as pip pins it and a session's name holds it: ``2.4.1``,
#: ``2.6.0rc1``, ``2.8.0.dev20250101``, ``2.4.1+cu121``.
RELEASE = re.compile(
    r"[0-9]+(\.[0-9]+){1,3}((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?(\+[A-Za-z0-9.]+)?"
)
TORCH_RELEASE = Rule(
    str,
    lambda v: RELEASE.fullmatch(v) is not None,
    "a torch release such as 2.4.1 or 2.6.0rc1",
    str,
)


@dataclass(frozen=True)
class Variable(Generic[T]):
    """One environment variable: its name, its rule, its value when unset (or set to
    empty text), who reads it and what it does."""

    name: str
    rule: Rule[Any]
    default: T
    read_by: str
    help: str
    #: How the docs show the default, where ``default`` itself is not what a user reads.
    default_shown: str | None = None
    #: Set by ampmatrix for the processes it starts, not by a user.
    internal: bool = False

    def read(self, environ: Mapping[str, str] | None = None) -> T:
        """The variable's typed value in ``environ`` (the process's by default); its
        default where unset or empty; an ``EnvironmentVariableError`` where its rule
        refuses the text."""
        text = (os.environ if environ is None else environ).get(self.name, "")
        if text == "":
            return self.default
        value: T = self.rule.value_of(self.name, text)
        return value

    @property
    def shown_default(self) -> str:
        if self.default_shown is not None:
            return self.default_shown
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        if isinstance(self.default, float):
            return number_text(self.default)
        return str(self.default)


#: The variables, in the order the docs list them.
CACHE_DIR: Variable[str | None] = Variable(
    "AMPMATRIX_CACHE_DIR",
    text_of("a folder"),
    None,
    HARNESS,
    "where the machine's peak matmul figures are cached",
    default_shown="$XDG_CACHE_HOME/ampmatrix, else ~/.cache/ampmatrix",
)
PEAK_MAX_AGE_DAYS: Variable[float] = Variable(
    "AMPMATRIX_PEAK_MAX_AGE_DAYS",
    finite_number(0, 3650, "days"),
    30.0,
    HARNESS,
    "how long a cached peak matmul figure is reused before it is measured again",
)
IMPORT_TIMEOUT: Variable[float] = Variable(
    "AMPMATRIX_IMPORT_TIMEOUT",
    finite_number(0, 86400, "seconds", above_low=True),
    300.0,
    HARNESS,
    "how long importing a model's or a case's module may take before it is killed",
)
THREADS: Variable[int | None] = Variable(
    "AMPMATRIX_THREADS",
    whole_number(1, 4096, "threads"),
    None,
    HARNESS,
    "the torch thread count of each cell a worker runs (the run sets it for its workers)",
    default_shown="torch's own",
    internal=True,
)
TORCH: Variable[str] = Variable(
    "AMPMATRIX_TORCH",
    TORCH_RELEASE,
    "",
    NOXFILE,
    "the torch release `nox -s matrix` runs (one outside the list is added to it)",
    default_shown="the noxfile's DEFAULT_TORCH",
)
FLASH_ATTN: Variable[str] = Variable(
    "AMPMATRIX_FLASH_ATTN",
    one_of("0", "1", "2", "4", "auto"),
    "",
    NOXFILE,
    "which flash-attn `nox -s matrix` installs on a GPU box: none (0), 2 (1 or 2, built "
    "from source), 4 (sm90+ wheels), auto (4 on sm90+, 2 on an older GPU, none without one)",
    default_shown="none",
)
KEEP_ENVS: Variable[int] = Variable(
    "AMPMATRIX_KEEP_ENVS",
    whole_number(0, 1000, "environments"),
    4,
    NOXFILE,
    "matrix environments kept after a matrix session, the most recently used (0 keeps all)",
)
MIN_FREE_GB: Variable[float] = Variable(
    "AMPMATRIX_MIN_FREE_GB",
    finite_number(0, 1_000_000, "GB"),
    20.0,
    NOXFILE,
    "the free disk below which a prune also cleans uv's cache of pruned torch releases",
)
NO_BROWSER: Variable[bool] = Variable(
    "AMPMATRIX_NO_BROWSER",
    SWITCH,
    False,
    NOXFILE,
    "on: `nox -s tests` installs no chromium for the report's browser test",
)
PYTHON: Variable[str | None] = Variable(
    "AMPMATRIX_PYTHON",
    text_of("an interpreter"),
    None,
    NOXFILE,
    "the interpreter `nox -s gpu-acceptance` tries first",
)
CUDA_START_LOG: Variable[str | None] = Variable(
    "AMPMATRIX_CUDA_START_LOG",
    text_of("a file"),
    None,
    BENCHMARKS,
    "where the GPU acceptance's child process logs each CUDA start",
    internal=True,
)
FUZZ_RUNS: Variable[int] = Variable(
    "AMPMATRIX_FUZZ_RUNS",
    whole_number(1, 10_000_000, "runs"),
    3000,
    TESTS,
    "damaged runs `tests/test_fuzz.py` reads",
)
FUZZ_SEED: Variable[int] = Variable(
    "AMPMATRIX_FUZZ_SEED",
    whole_number(0, 2**32 - 1, ""),
    20261123,
    TESTS,
    "the seed of `tests/test_fuzz.py`'s damage",
)
FUZZ_SCALE: Variable[float] = Variable(
    "AMPMATRIX_FUZZ_SCALE",
    finite_number(0, 1000, "", above_low=True),
    1.0,
    TESTS,
    "multiplies the examples of `tests/test_fuzz_hostile.py`",
)
EXAMPLE_TIMEOUT: Variable[float] = Variable(
    "AMPMATRIX_EXAMPLE_TIMEOUT",
    finite_number(0, 86400, "seconds", above_low=True),
    60.0,
    TESTS,
    "how long one runnable example of the docs may take",
)
UPDATE_GOLDEN: Variable[bool] = Variable(
    "AMPMATRIX_UPDATE_GOLDEN",
    SWITCH,
    False,
    TESTS,
    "on: the report tests rewrite their golden files",
)

VARIABLES: tuple[Variable[Any], ...] = (
    CACHE_DIR,
    PEAK_MAX_AGE_DAYS,
    IMPORT_TIMEOUT,
    THREADS,
    TORCH,
    FLASH_ATTN,
    KEEP_ENVS,
    MIN_FREE_GB,
    NO_BROWSER,
    PYTHON,
    CUDA_START_LOG,
    FUZZ_RUNS,
    FUZZ_SEED,
    FUZZ_SCALE,
    EXAMPLE_TIMEOUT,
    UPDATE_GOLDEN,
)
BY_NAME: dict[str, Variable[Any]] = {v.name: v for v in VARIABLES}


def refused(
    read_by: str, environ: Mapping[str, str] | None = None
) -> list[EnvironmentVariableError]:
    """The errors of every variable ``read_by`` reads, in declaration order."""
    errors = []
    for variable in VARIABLES:
        if variable.read_by == read_by:
            try:
                variable.read(environ)
            except EnvironmentVariableError as error:
                errors.append(error)
    return errors


def check(read_by: str, environ: Mapping[str, str] | None = None) -> None:
    """Raises the first variable's error among those ``read_by`` reads, before any work."""
    errors = refused(read_by, environ)
    if errors:
        raise errors[0]


def docs_table() -> str:
    """The Markdown table of the variables that ``docs/environment-variables.md`` holds."""
    lines = [
        "| Variable | Takes | Default | Read by | What it does |",
        "|---|---|---|---|---|",
    ]
    for v in VARIABLES:
        does = v.help + (" (internal: not set by hand)" if v.internal else "")
        plain = v.default_shown is not None or v.default is None
        default = v.shown_default if plain else f"`{v.shown_default}`"
        cells = (f"`{v.name}`", v.rule.expected, default, v.read_by, does)
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(docs_table())
