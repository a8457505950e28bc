"""``python -m harness`` / ``ampmatrix``: list cases, run the matrix."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from harness.results import storage
from harness.results.speed import ALPHA, MIN_RATIO
from harness.schema.axes import AXES, EAGER, MODEL_AXES, MODES, Axis, Cell
from harness.schema.config import TimingConfig

if TYPE_CHECKING:
    from harness.measure.case import Case
    from harness.schema.config import RunConfig
    from harness.schema.selection import Selection

# The run machinery (``harness.runner``, ``harness.measure``) imports torch, which takes
# seconds: it is imported inside the commands that run cells (``list``, ``run``,
# ``check``), never by ``report``, ``compare`` or ``bisect``, which only read results files.


def split_values(values: Sequence[str] | None) -> tuple[str, ...]:
    """``--dtype float16,bfloat16 --dtype float32`` -> three values."""
    return tuple(v for value in values or () for v in value.split(",") if v)


def batch_size(value: str) -> int:
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise argparse.ArgumentTypeError(f"{value!r} is not a whole number of cells, 1 or more")


def worker_count_arg(value: str) -> str:
    if value == "auto" or (value.isdigit() and int(value) >= 0):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is not 'auto' or a number of workers")


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
    """The options ``run`` and ``check`` share: the selection flags of ``axes``, where the
    results go, workers, timing, limits."""
    from harness.schema.config import DEFAULT_TIMEOUT_S, RunConfig

    for axis in axes:
        parser.add_argument(
            f"--{axis.name}",
            dest=axis.plural,
            action="append",
            metavar="NAME",
            help=f"only this {axis.name} (repeatable, or comma-separated){axis.flag_help}",
        )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("results"),
        metavar="DIR",
        help="results root; the run goes to DIR/<run-id> (default results)",
    )
    parser.add_argument(
        "-n",
        "--workers",
        default="auto",
        type=worker_count_arg,
        help="worker processes (default auto: one per core; 0: in-process)",
    )
    parser.add_argument(
        "--no-timing", action="store_true", help="skip the timing phase (correctness only)"
    )
    parser.add_argument(
        "--no-trace",
        action="store_true",
        help="no dtype trail and no drift check in correctness cells (measures their cost)",
    )
    parser.add_argument(
        "--time-budget",
        type=positive_float,
        default=TimingConfig.budget_s,
        metavar="SECONDS",
        help=f"sampling time allowed per timed cell (default {TimingConfig.budget_s})",
    )
    parser.add_argument(
        "--flush-l2", action="store_true", help="on CUDA, flush the L2 cache before each sample"
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help=f"time limit per cell; a case may set its own (default {DEFAULT_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--memory-limit",
        type=memory_gib,
        metavar="GIB",
        help="memory limit per cell process (RLIMIT_DATA); beyond it allocations fail",
    )
    parser.add_argument(
        "--batch",
        type=batch_size,
        default=RunConfig.batch,
        metavar="N",
        help=f"cells of one case sharing a forked process (default {RunConfig.batch}; "
        "1: every cell in a process of its own)",
    )


class DeferredParser(argparse.ArgumentParser):
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampmatrix", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=DeferredParser)
    list_parser = commands.add_parser("list", help="list cases, fixes, axes, upstream links")
    add_cases_dir(list_parser)
    commands.add_parser("run", help="run the matrix and write results", fill=fill_run_parser)
    add_check_parser(commands)
    add_report_parsers(commands)
    add_bisect_parser(commands)
    return parser


def fill_run_parser(parser: argparse.ArgumentParser) -> None:
    add_cases_dir(parser)
    add_run_options(parser, AXES)
    parser.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="finish a stopped run: only its missing cells run (selection flags not allowed)",
    )
    add_report_dir(parser)


def add_report_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--report-dir",
        type=Path,
        metavar="DIR",
        help="also render the run's HTML report into DIR/<run-id>.html",
    )


def add_check_parser(commands: Any) -> None:
    commands.add_parser(
        "check",
        help="run your own model through the matrix: MODULE:FACTORY returns (model, inputs)",
        fill=fill_check_parser,
    )


def fill_check_parser(check: argparse.ArgumentParser) -> None:
    check.add_argument("targets", nargs="+", metavar="MODULE:FACTORY")
    check.add_argument(
        "--keep-fp32",
        action="append",
        default=[],
        metavar="NAME",
        help="a module or parameter (dotted name) your model keeps in float32 when cast; "
        "FACTORY=NAME for one target's model only",
    )
    add_run_options(check, MODEL_AXES)
    add_report_dir(check)


def command_check(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``run`` over the models the targets build: same pipeline, results and report."""
    from harness.measure.model_case import target_name
    from harness.runner.run import run

    names = tuple(target_name(t) for t in args.targets)
    config = replace(
        config_from(args, argv),
        selection=selection_from(args).replace(cases=names),
        models=tuple(args.targets),
        models_path=str(Path.cwd()),
        keep_fp32=tuple(split_values(args.keep_fp32)),
    )
    return show_run(run(config), args.report_dir)


def add_report_parsers(commands: Any) -> None:
    report = commands.add_parser("report", help="render one HTML report over one or more runs")
    report.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    report.add_argument(
        "--out", type=Path, metavar="FILE", help="output file (default reports/<run-id>.html)"
    )
    report.add_argument(
        "--baseline",
        type=Path,
        metavar="BASE",
        help="add a section comparing the (last) run with this run",
    )
    report.add_argument(
        "--markdown",
        type=Path,
        metavar="FILE",
        help="also append a short Markdown summary to FILE (a CI job summary: "
        "$GITHUB_STEP_SUMMARY)",
    )
    compare = commands.add_parser(
        "compare",
        help="outcome and speed changes from BASE to HEAD (two runs, or two results folders: "
        "then each torch version's newest run is compared with the same version's)",
    )
    compare.add_argument("base", type=Path, metavar="BASE")
    compare.add_argument("head", type=Path, metavar="HEAD")
    compare.add_argument(
        "--min-ratio",
        type=positive_float,
        default=MIN_RATIO,
        help=f"smallest speed ratio that counts (default {MIN_RATIO})",
    )
    compare.add_argument(
        "--alpha",
        type=positive_float,
        default=ALPHA,
        help=f"significance level of the Mann-Whitney U test (default {ALPHA})",
    )


def add_bisect_parser(commands: Any) -> None:
    bisect = commands.add_parser(
        "bisect", help="outcomes of the same cells across torch versions, and where they change"
    )
    bisect.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    bisect.add_argument("--case", action="append", metavar="NAME", help="only this case")
    bisect.add_argument("--fix", action="append", metavar="NAME", help="only this fix")


def positive_float(value: str) -> float:
    """A finite number above zero (``nan``, ``inf`` and ``1e400`` are refused)."""
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not (math.isfinite(number) and number > 0):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive finite number")
    return number


#: The smallest per-cell memory limit: below it not even the interpreter fits.
MIN_MEMORY_GIB = 0.25


def memory_gib(value: str) -> float:
    number = positive_float(value)
    if number < MIN_MEMORY_GIB:
        raise argparse.ArgumentTypeError(
            f"{value!r} GiB is too small a memory limit (at least {MIN_MEMORY_GIB:g})"
        )
    return number


def describe_case(case: Case) -> list[str]:
    up = case.upstream
    assert up is not None and case.failure is not None
    lines = [
        f"{case.name}: {case.title}",
        f"  upstream: {up.repo} {up.file} @ {up.commit}"
        + (f" (issues {', '.join(up.issues)})" if up.issues else ""),
    ]
    if up.url:
        lines.append(f"  link:     {up.url}")
    lines += [
        *(f"  failure:  {f.error_type}: /{f.message}/" for f in case.known_failures),
        f"  devices:  {', '.join(case.devices)}   dtypes: {', '.join(case.dtypes)}",
        f"  modes:    {', '.join(case.modes)}   backends: {', '.join(case.backends)}",
    ]
    if case.compiles != (EAGER,):
        lines.append(f"  compiles: {', '.join(case.compiles)}")
    lines += size_lines(case)
    if case.keep_fp32:
        lines.append(f"  keeps fp32: {', '.join(case.keep_fp32)}")
    if case.manages_precision:
        lines.append("  precision: managed by the case's upstream code (the harness only places)")
    if case.requires:
        lines.append(f"  requires: {', '.join(case.requires)}")
    lines.append("  fixes:")
    for fix in case.fixes.values():
        ref = f" [{fix.upstream}]" if fix.upstream else ""
        lines.append(f"    {fix.name:<24} {fix.rationale}{ref}")
    return lines


def size_lines(case: Case) -> list[str]:
    """Each declared size with its dimensions and, past the small one, its source."""
    from harness.measure.case import size_metadata

    lines = []
    for size in case.sizes:
        described = size_metadata(size)
        dims = ", ".join(f"{k}={v}" for k, v in described["dims"].items())
        lines.append(f"  size {size.name + ':':<9} {dims}")
        if described["source"]:
            lines.append(f"    from: {described['source']}")
    return lines


def command_list(args: argparse.Namespace) -> int:
    from harness.runner.run import discover_cases

    for case in discover_cases(args.cases_dir):
        print("\n".join(describe_case(case)), end="\n\n")
    print("modes:")
    for mode in MODES.values():
        print(f"  {mode.name:<14} {mode.meaning}")
    return 0


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


def command_run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from harness.runner.run import run

    if args.resume:
        return command_resume(args)
    return show_run(run(config_from(args, argv)), args.report_dir)


def config_from(args: argparse.Namespace, argv: Sequence[str]) -> RunConfig:
    """The run's one configuration, built once from the command line."""
    from harness.schema.config import Limits, RunConfig

    timing = TimingConfig(budget_s=args.time_budget, flush_l2=args.flush_l2)
    return RunConfig(
        selection=selection_from(args),
        cases_dirs=tuple(getattr(args, "cases_dir", ())),
        results_root=args.out,
        workers=args.workers,
        command=("python -m harness", *argv),
        timing=None if args.no_timing else timing,
        trace=not args.no_trace,
        batch=args.batch,
        limits=Limits(
            timeout_s=args.timeout,
            memory_bytes=int(args.memory_limit * 2**30) if args.memory_limit else None,
        ),
    )


def command_resume(args: argparse.Namespace) -> int:
    from harness.runner.run import resume
    from harness.schema.selection import SelectionError

    chosen = [f"--{axis.name}" for axis in AXES if getattr(args, axis.plural, None)]
    if chosen or args.cases_dir:
        raise SelectionError(
            f"--resume finishes the run as it was started: drop "
            f"{', '.join(chosen + ['--cases-dir'] * bool(args.cases_dir))}"
        )
    run_dir = resume(existing_run_dir(args.resume), args.workers)
    return show_run(run_dir, args.report_dir)


#: The exit code of a run that ended with planned cells that have no record.
INCOMPLETE = 3
#: At most this many missing cells are named one by one.
MAX_MISSING_SHOWN = 20


def show_run(run_dir: Path, report_dir: Path | None) -> int:
    """The summary of a finished run, its path, and its report when asked for. A run
    that left planned cells without a record names them and exits ``INCOMPLETE``."""
    from harness.results.summary import render_summary
    from harness.runner.run import missing_cells

    records = storage.read_records(run_dir)
    print()
    print(render_summary(records))
    print(f"\nresults: {run_dir / storage.CELLS_FILE}")
    if report_dir:
        from harness.report.aggregate import load_run
        from harness.report.render import render_report, write_report

        report = write_report(
            render_report([load_run(run_dir)]), report_dir / f"{run_dir.name}.html"
        )
        print(f"report:  {report}")
    return report_missing(run_dir, missing_cells(run_dir, records))


def report_missing(run_dir: Path, missing: Sequence[Cell]) -> int:
    if not missing:
        return 0
    print(f"\nampmatrix: {len(missing)} planned cells have no record:", file=sys.stderr)
    for cell in missing[:MAX_MISSING_SHOWN]:
        print(f"  {cell.id}", file=sys.stderr)
    if len(missing) > MAX_MISSING_SHOWN:
        print(f"  ... and {len(missing) - MAX_MISSING_SHOWN} more", file=sys.stderr)
    print(f"finish them with: python -m harness run --resume {run_dir}", file=sys.stderr)
    return INCOMPLETE


def existing_run_dir(path: Path) -> Path:
    if not path.is_dir():
        raise storage.ResultsError(f"{path}: not a directory (expected a results run folder)")
    return path


def default_report_path(run_dirs: Sequence[Path]) -> Path:
    if len(run_dirs) == 1:
        return Path("reports") / f"{run_dirs[0].name}.html"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    return Path("reports") / f"combined-{stamp}.html"


def command_report(args: argparse.Namespace) -> int:
    from harness.report.aggregate import load_run, load_runs_for_report
    from harness.report.compare import compare_runs
    from harness.report.render import render_report, write_report

    runs = load_runs_for_report([existing_run_dir(d) for d in args.run_dirs])
    out = args.out or default_report_path(args.run_dirs)
    inputs = [*args.run_dirs, *([args.baseline] if args.baseline else [])]
    check_output(out, inputs, "--out")
    if args.markdown:
        check_output(args.markdown, inputs, "--markdown")
    comparison = None
    if args.baseline:
        base = load_run(existing_run_dir(args.baseline))
        comparison = compare_runs(base, load_run(existing_run_dir(args.run_dirs[-1])))
    warn([p for loaded in runs for p in loaded.problems])
    print(f"report: {write_report(render_report(runs, comparison), out)}")
    if args.markdown:
        from harness.report.markdown import render_markdown

        storage.append_whole(args.markdown, render_markdown(runs).encode())
        print(f"summary: {args.markdown}")
    return 0


def check_output(out: Path, run_dirs: Sequence[Path], flag: str) -> None:
    """A report goes to a file of its own: never into a run folder (its results, its run
    plan), never over a folder, the reports' index or a file that is not a report."""
    from harness.report.render import made_by_ampmatrix

    if out.is_dir():
        raise storage.ResultsError(f"{flag} {out}: a folder; name the file to write")
    target = out.resolve()
    for run_dir in run_dirs:
        if target.is_relative_to(run_dir.resolve()):
            raise storage.ResultsError(f"{flag} {out}: refusing to write into the run {run_dir}")
    if flag == "--out" and out.name == "index.html":
        raise storage.ResultsError(f"{flag} {out}: index.html is the folder's list of reports")
    if flag == "--out" and out.exists() and not made_by_ampmatrix(out):
        raise storage.ResultsError(
            f"{flag} {out}: exists and is not an ampmatrix report; refusing to overwrite it"
        )


def warn(problems: Sequence[str]) -> None:
    """Reading problems (file and line) go to stderr; the command goes on with the rest."""
    for problem in problems:
        print(f"ampmatrix: warning: {problem}", file=sys.stderr)


def command_compare(args: argparse.Namespace) -> int:
    from harness.report.aggregate import load_run
    from harness.report.compare import compare_runs, pair_runs, render_comparison

    pairing = pair_runs(existing_run_dir(args.base), existing_run_dir(args.head))
    for line in pairing.left_out:
        print(f"ampmatrix: {line}", file=sys.stderr)
    if not pairing.pairs:
        print(
            f"ampmatrix: no run of {args.head} has a run of the same environment (torch "
            f"release, host and GPUs) in {args.base}: nothing to compare",
            file=sys.stderr,
        )
        return 0
    regressions = 0
    for base_dir, head_dir in pairing.pairs:
        base, head = load_run(base_dir), load_run(head_dir)
        warn(base.problems + head.problems)
        comparison = compare_runs(base, head, args.min_ratio, args.alpha)
        print(render_comparison(comparison))
        regressions += len(comparison.regressions)
    return 1 if regressions else 0


class NoRecordChosen(ValueError):
    """``bisect --case/--fix`` named what no record of the runs has."""


def command_bisect(args: argparse.Namespace) -> int:
    from harness.results.versions import render_bisect

    cases, fixes = split_values(args.case), split_values(args.fix)
    records = []
    for run_dir in args.run_dirs:
        problems: list[str] = []
        records += storage.read_records(existing_run_dir(run_dir), problems)
        warn(problems)
    chosen = [
        r
        for r in records
        if (not cases or r.cell.case in cases) and (not fixes or r.cell.fix in fixes)
    ]
    if records and not chosen:
        raise NoRecordChosen(
            f"no records of case {cases or 'any'} / fix {fixes or 'any'} in these runs"
        )
    print(render_bisect(chosen))
    return 0


#: The errors of the run machinery that end a command with one line, by module: a module
#: that was not imported (it imports torch: ``report`` never imports it) raised none.
RUN_ERRORS = (
    ("harness.measure.registry", "CaseContractError"),
    ("harness.schema.selection", "SelectionError"),
    ("harness.measure.model_case", "ModelCheckError"),
)


def user_errors() -> tuple[type[Exception], ...]:
    """The errors that end a command with ``ampmatrix: error: ...`` and exit code 2."""
    loaded = tuple(
        getattr(sys.modules[module], name) for module, name in RUN_ERRORS if module in sys.modules
    )
    return (storage.ResultsError, NoRecordChosen, *loaded)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "list":
            return command_list(args)
        if args.command == "report":
            return command_report(args)
        if args.command == "compare":
            return command_compare(args)
        if args.command == "bisect":
            return command_bisect(args)
        if args.command == "check":
            return command_check(args, argv)
        return command_run(args, argv)
    except user_errors() as error:
        print(f"ampmatrix: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # a folder that is a file, read-only, full: one line, no trace
        where = f": {error.filename}" if error.filename else ""
        print(f"ampmatrix: error: {error.strerror or error}{where}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
