"""``python -m harness`` / ``ampmatrix``: list cases, run the matrix, check a model, report,
compare and bisect runs; one module per command.

The run machinery (``harness.runner``, ``harness.measure``) imports torch, which takes
seconds: it is imported inside the commands that run cells (``list``, ``run``, ``check``),
never by ``report``, ``compare`` or ``bisect``, which only read results files.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NoReturn

from harness.cli import bisect, check, compare, listing, nightly, output, report, run, startup
from harness.results import storage
from harness.schema import env_vars
from harness.schema.text import one_line


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose error stays on one line after the usage line, whatever the
    argument it names holds (a line break in a folder's name)."""

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {one_line(message)}\n")


class DeferredParser(Parser):
    """A command's parser whose arguments are added when it is first used (to parse or to
    print its help): ``run`` and ``check`` take their defaults from the run machinery, which
    imports torch, and ``report``, ``compare`` and ``bisect`` must not wait for that."""

    def __init__(
        self, *args: Any, fill: Callable[[argparse.ArgumentParser], None] | None = None, **kw: Any
    ) -> None:
        super().__init__(*args, **kw)
        self.fill = fill

    def filled(self) -> None:
        fill, self.fill = self.fill, None
        if fill is not None:
            fill(self)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.filled()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self.filled()
        return super().format_usage()

    def format_help(self) -> str:
        self.filled()
        return super().format_help()


DESCRIPTION = "list cases, run the matrix, check your model, report, compare and bisect runs"

#: The commands, one module each: ``HELP``, ``fill(parser)`` and ``command(args, argv)``.
COMMANDS: dict[str, ModuleType] = {
    "list": listing,
    "run": run,
    "check": check,
    "report": report,
    "compare": compare,
    "bisect": bisect,
    "nightly-verdict": nightly,
}

#: The commands that import the run machinery, and torch with it; the others only read
#: results files. The machinery is imported before them (``startup.import_run_machinery``).
RUNS_CELLS = ("list", "run", "check")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ampmatrix", description=DESCRIPTION)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=DeferredParser)
    for name, module in COMMANDS.items():
        commands.add_parser(name, help=module.HELP, fill=module.fill)
    return parser


#: The errors of the run machinery that end a command with one line, by module: a module
#: that was not imported (it imports torch: ``report`` never imports it) raised none.
RUN_ERRORS = (
    ("harness.measure.authoring.registry", "CaseContractError"),
    ("harness.schema.selection", "SelectionError"),
    ("harness.measure.authoring.model_case", "ModelCheckError"),
)


def user_errors() -> tuple[type[Exception], ...]:
    """The errors that end a command with ``ampmatrix: error: ...`` and exit code 2."""
    loaded = tuple(
        getattr(sys.modules[module], name) for module, name in RUN_ERRORS if module in sys.modules
    )
    return (
        storage.ResultsError,
        bisect.NoRecordChosen,
        env_vars.EnvironmentVariableError,
        *loaded,
    )


#: The exit code of a command stopped by Ctrl-C (a shell's for SIGINT).
INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Runs a command; what it prints shows text from outside inert (``inert_streams``)."""
    with output.inert_streams():
        return run_command(argv)


def entry() -> int:
    """The command line (``ampmatrix``, ``python -m harness``): ``main``, then the heap
    frozen for the interpreter's exit, which follows (``startup.before_exit``)."""
    code = main()
    startup.before_exit()
    return code


def run_command(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        env_vars.check(env_vars.HARNESS)  # a bad AMPMATRIX_* value: one line, before any work
        if args.command in RUNS_CELLS:
            startup.import_run_machinery()
        return int(COMMANDS[args.command].command(args, argv))
    except user_errors() as error:
        print(f"ampmatrix: error: {one_line(str(error))}", file=sys.stderr)
        return 2
    except OSError as error:  # a folder that is a file, read-only, full: one line, no trace
        where = f": {error.filename}" if error.filename else ""
        print(
            f"ampmatrix: error: {one_line(f'{error.strerror or error}{where}')}", file=sys.stderr
        )
        return 2
    except (
        KeyboardInterrupt
    ) as interrupt:  # Ctrl-C: one line, and how to go on where there is a way
        detail = str(interrupt)
        print(f"ampmatrix: interrupted{': ' + detail if detail else ''}", file=sys.stderr)
        return INTERRUPTED
