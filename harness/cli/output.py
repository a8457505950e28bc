"""What the commands print: a finished run's summary and paths, the cells a run left
without a record, reading problems; and the streams they print to, which show text from
outside inert."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from harness.results import storage
from harness.schema.axes import Cell
from harness.schema.records import CellRecord
from harness.schema.text import one_line, terminal_safe


class InertWriter:
    """A text stream that writes ``terminal_safe`` text to the stream it wraps: a control
    character in a case name, an error message or a folder name is shown escaped, never
    acted on by the terminal. The harness's own output has none (newline and tab pass)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        self.stream.write(terminal_safe(text))
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self.stream, name)


@contextmanager
def inert_streams() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` wrapped in an ``InertWriter`` while a command
    runs: every line any part of the harness prints (progress, summaries, ``compare``,
    ``bisect``, warnings, errors) in one place, and those added later too."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = InertWriter(saved[0]), InertWriter(saved[1])
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def existing_run_dir(path: Path) -> Path:
    if not path.is_dir():
        raise storage.ResultsError(f"{path}: not a directory (expected a results run folder)")
    return path


def warn(problems: Sequence[str]) -> None:
    """Reading problems (file and line) go to stderr, one line each whatever the file's
    name or text holds; the command goes on with the rest."""
    for problem in problems:
        print(f"ampmatrix: warning: {one_line(problem)}", file=sys.stderr)


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
    print(render_summary(records, device_names(run_dir, records)))
    print(f"\nresults: {one_line(str(run_dir / storage.CELLS_FILE))}")
    if report_dir:
        from harness.report.aggregate import load_run
        from harness.report.writing import render_report, write_report

        report = write_report(
            render_report([load_run(run_dir, records)]), report_dir / f"{run_dir.name}.html"
        )
        print(f"report:  {one_line(str(report))}")
    return report_missing(run_dir, missing_cells(run_dir, records))


def device_names(run_dir: Path, records: Sequence[CellRecord]) -> dict[str, str]:
    """Each device of the run's records by the name its GPU goes by (``cpu`` for the CPU),
    from the run's ``env.json``; none where it cannot be read."""
    from harness.schema.gpus import device_label

    try:
        gpus = storage.read_env(run_dir, problems=[]).gpus
    except storage.ResultsError:
        return {}
    return {r.cell.device: device_label(gpus, r.cell.device) for r in records}


def report_missing(run_dir: Path, missing: Sequence[Cell]) -> int:
    if not missing:
        return 0
    print(f"\nampmatrix: {len(missing)} planned cells have no record:", file=sys.stderr)
    for cell in missing[:MAX_MISSING_SHOWN]:
        print(f"  {one_line(cell.id)}", file=sys.stderr)
    if len(missing) > MAX_MISSING_SHOWN:
        print(f"  ... and {len(missing) - MAX_MISSING_SHOWN} more", file=sys.stderr)
    print(
        f"finish them with: python -m harness run --resume {one_line(str(run_dir))}",
        file=sys.stderr,
    )
    return INCOMPLETE
