"""Cells as pytest items, so pytest-xdist spreads them over worker processes.

The runner writes the plan (``plan.json``) into the run directory and hands it to pytest.
Each item runs a batch of one case's cells (one forked process for the batch) and appends
each record as its cell ends. An item fails only when the harness itself broke or the
worker process died; the controller then records the cell that was running as
``crashed``, the runner gives the batch's other cells a pass of their own, and the run
goes on. Timing items each time the columns of one case on one device (the timing plan,
``timing-plan.json``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.measure.authoring import model_case, registry
from harness.measure.running import crashes, errors, fitting
from harness.results import storage
from harness.runner.isolation import (
    batch_records,
    limits_for,
    remember_worker_state,
    timed_columns,
)
from harness.runner.progress import Progress, column_label, progress_label
from harness.schema import env_vars
from harness.schema.axes import Cell
from harness.schema.config import Limits, TimingConfig
from harness.schema.devices import CUDA, device_kind
from harness.schema.records import CellRecord, CrashKind, Outcome

OUTCOME_KEY = "ampmatrix_outcome"
#: How a failed item's message names a record that could not be written.
#: The item's property that carries why a record could not be written (a full disk).
NOT_WRITTEN_KEY = "ampmatrix_not_written"


def load_plan(path: Path) -> dict[str, Any]:
    """A plan file the runner wrote (``plan.json``, ``timing-plan.json``), read as every
    file of a run folder is (``storage.read_json``: no link out of the folder, no file
    too big or not JSON) and of the shape the runner writes: an object with the run
    folder's path, its batches lists of objects. One that is not raises ``ResultsError``
    naming the file and what is wrong, before any cell runs on it."""
    data = storage.read_json(storage.run_file(path.parent, path.name), "missing")
    problem = plan_shape_problem(data)
    if problem is not None:
        raise storage.ResultsError(f"{path}: {problem}")
    checked: dict[str, Any] = data
    return checked


def plan_shape_problem(data: Any) -> str | None:
    """What keeps ``data`` from being a plan the runner wrote, or None."""
    if not isinstance(data, dict):
        return f"expected a JSON object, got {type(data).__name__}"
    if not isinstance(data.get("run_dir"), str):
        return "'run_dir': expected the run folder's path (a string)"
    batches = data.get("batches", [])
    if not isinstance(batches, list) or not all(
        isinstance(batch, list) and batch and all(isinstance(c, dict) for c in batch)
        for batch in batches
    ):
        return "'batches': expected a list of non-empty lists of cells (objects)"
    timing = data.get("timing_batches", [])
    if not isinstance(timing, list) or not all(
        isinstance(batch, dict)
        and batch
        and all(
            isinstance(column, list) and column and all(isinstance(r, dict) for r in column)
            for column in batch.values()
        )
        for batch in timing
    ):
        return "'timing_batches': expected a list of objects of non-empty record lists"
    return None


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.name in storage.PLAN_FILES:
        return PlanFile.from_parent(parent, path=file_path)
    return None


#: How the run tells its workers the torch thread count each of their cells gets.
THREADS_VARIABLE = env_vars.THREADS.name


def cell_threads() -> int:
    return env_vars.THREADS.read() or 1


def pytest_configure(config: pytest.Config) -> None:
    threads = env_vars.THREADS.read()
    if threads is not None:
        torch.set_num_threads(threads)
    remember_worker_state()


class PlanFile(pytest.File):
    def collect(self) -> Iterator[pytest.Item]:
        try:
            plan = load_plan(self.path)
        except storage.ResultsError as error:  # one line, no traceback in the item's report
            raise self.CollectError(str(error)) from None
        run_dir = Path(plan["run_dir"])
        config = storage.read_run_config(run_dir)
        registry.discover(config.cases_dirs)
        model_case.registered_models(config)
        fitting.use_steps(config.fit_steps)
        limits = config.limits
        for batch in plan.get("batches", []):
            cells = [Cell.from_dict(data) for data in batch]
            cells_item = CellsItem.from_parent(
                self,
                name=batch_name(cells),
                cells=cells,
                run_dir=run_dir,
                limits=limits,
                trace=config.trace,
                profile=config.profile,
            )
            if device_kind(cells[0].device) == CUDA:  # one worker owns each GPU
                cells_item.add_marker(pytest.mark.xdist_group(cells[0].device))
            yield cells_item
        timing = config.timing or TimingConfig()
        for batch in plan.get("timing_batches", []):
            columns = {
                name: [CellRecord.from_dict(data) for data in column]
                for name, column in batch.items()
            }
            first = next(iter(columns.values()))[0].cell
            item = TimingItem.from_parent(
                self,
                name=timing_batch_name(list(columns)),
                columns=columns,
                run_dir=run_dir,
                timing=timing,
                limits=limits_for(first, limits),
            )
            item.add_marker(pytest.mark.xdist_group(first.device))
            yield item


def batch_name(cells: list[Cell]) -> str:
    """An item's name: its cell's id, or the first cell's id and how many follow."""
    return timing_batch_name([cell.id for cell in cells])


def timing_batch_name(names: list[str]) -> str:
    """The first name, and how many follow."""
    return names[0] if len(names) == 1 else f"{names[0]} +{len(names) - 1}"


class CellsItem(pytest.Item):
    """Runs cells of one case, in order, in forked processes (``run_cells_isolated``)."""

    def __init__(
        self,
        *,
        cells: list[Cell],
        run_dir: Path,
        limits: Limits,
        trace: bool,
        profile: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.cells = cells
        self.run_dir = run_dir
        self.limits = limits
        self.trace = trace
        self.profile = profile

    def runtest(self) -> None:
        threads = cell_threads()
        worker = worker_id(self.config)
        labels = []
        for cell, record in zip(self.cells, self.records(worker, threads), strict=True):
            append_or_stop(self, record)
            labels.append((cell.id, progress_label(record)))
        self.user_properties.append((OUTCOME_KEY, labels))

    def records(self, worker: str, threads: int) -> Iterator[CellRecord]:
        limits = partial(limits_for, limits=self.limits)
        return batch_records(self.cells, worker, limits, threads, self.trace, self.profile)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, self.name


class TimingItem(pytest.Item):
    """Times columns of one case (each: the cells of one case, device, dtype and mode, side
    by side), all in one forked process; each full record is appended again as its column
    ends, now with its figures."""

    def __init__(
        self,
        *,
        columns: dict[str, list[CellRecord]],
        run_dir: Path,
        timing: TimingConfig,
        limits: Limits,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.columns = columns
        self.run_dir = run_dir
        self.timing = timing
        self.limits = limits

    def runtest(self) -> None:
        labels = []
        for name, timed in zip(self.columns, self.timed(), strict=True):
            for record in timed:
                append_or_stop(self, record)
            labels.append((name, column_label(timed)))
        self.user_properties.append((OUTCOME_KEY, labels))

    def timed(self) -> Iterator[list[CellRecord]]:
        threads = cell_threads()
        columns = list(self.columns.values())
        return timed_columns(columns, self.timing, worker_id(self.config), self.limits, threads)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, self.name


def append_or_stop(item: CellsItem | TimingItem, record: CellRecord) -> None:
    """Append the record; when it cannot be written (a full disk), the session stops after
    this item, which fails with the reason (the controller records nothing for it)."""
    try:
        storage.append_record(item.run_dir, record)
    except storage.RecordNotWritten as error:
        item.user_properties.append((NOT_WRITTEN_KEY, str(error)))
        stop_session(item.session, str(error))
        raise


def stop_session(session: pytest.Session, why: str) -> None:
    """No further item starts: in this process, and (through pytest-xdist) in the others."""
    session.shouldstop = why
    dsession = session.config.pluginmanager.getplugin("dsession")
    if dsession is not None and not dsession.shouldstop:
        dsession.shouldstop = why


def worker_id(config: pytest.Config) -> str:
    workerinput = getattr(config, "workerinput", None)
    return str(workerinput["workerid"]) if workerinput else "main"


CrashRecords = Callable[[str, str], list[CellRecord]]


class Controller:
    """Runs in the controlling process: prints progress, and when an item fails (its worker
    died, or the harness broke on it) writes the records ``on_crash`` gives for that item
    from the failure message and the worker's name."""

    def __init__(self, run_dir: Path, on_crash: dict[str, CrashRecords], units: int = 0) -> None:
        self.run_dir = run_dir
        self.on_crash = on_crash
        #: Cells to count in the progress lines (0: count items).
        self.units = units
        self.progress = Progress(units or len(on_crash))
        self.finished: set[str] = set()
        #: Why a record could not be written, when one could not (the run then stops).
        self.not_written: str | None = None
        self.session: pytest.Session | None = None

    @pytest.hookimpl
    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.session = session

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" and report.passed:
            outcome = dict(report.user_properties).get(OUTCOME_KEY, "?")
            if isinstance(outcome, list):  # a batch of cells: a line for each
                for cell_id, label in outcome:
                    self._progress(report, label, cell_id)
            else:
                self._progress(report, str(outcome))
        elif report.failed:
            self._record_crash(report)

    def _record_crash(self, report: pytest.TestReport) -> None:
        name = item_name(report)
        if name not in self.on_crash or name in self.finished:
            return
        not_written = dict(report.user_properties).get(NOT_WRITTEN_KEY)
        if not_written is not None:
            self._stop(report, str(not_written))
            return
        message = crash_message(report)
        gateway = getattr(getattr(report, "node", None), "gateway", None)
        worker = str(getattr(gateway, "id", "main"))
        try:
            crashed = self.on_crash[name](message, worker)
            for record in crashed:
                storage.append_record(self.run_dir, record)
        except storage.RecordNotWritten as error:
            self._stop(report, str(error))
            return
        for record in crashed:
            self._progress(report, "crashed", record.cell.id if self.units else None)

    def _stop(self, report: pytest.TestReport, why: str) -> None:
        """A record could not be written: say so, and start no further item."""
        self.not_written = self.not_written or why
        self._progress(report, f"not recorded: {why}")
        if self.session is not None:
            stop_session(self.session, why)

    def _progress(self, report: pytest.TestReport, label: str, cell_id: str | None = None) -> None:
        """One line per cell (correctness) or per column (timing), numbered."""
        name = item_name(report)
        self.finished.add(name)
        self.progress.line(cell_id or name, label)


def crash_message(report: pytest.TestReport) -> str:
    """What went wrong, in words: pytest's own crash message, not its report objects."""
    crash = getattr(report.longrepr, "reprcrash", None)
    return str(getattr(crash, "message", None) or report.longrepr)


def item_name(report: pytest.TestReport) -> str:
    return report.nodeid.rsplit("::", 1)[-1]


def cell_crashes(run_dir: Path, batches: list[list[Cell]]) -> dict[str, CrashRecords]:
    """Correctness phase: when a batch's item fails (its worker died), the first of its
    cells without a record is the one that was running: it is recorded as ``crashed``. The
    cells after it never ran; the run gives them a pass of their own (``run.execute_cells``)."""
    return {batch_name(cells): partial(crashed_cell, run_dir, cells) for cells in batches}


def crashed_cell(run_dir: Path, cells: list[Cell], message: str, worker: str) -> list[CellRecord]:
    # which of the batch's cells have a record, read from cells.jsonl: the worker that
    # wrote them is another process, and it died (this runs only on a crash)
    recorded = {r.cell for r in storage.read_records(run_dir, problems=[])}
    running = next((cell for cell in cells if cell not in recorded), None)
    if running is None:
        return []
    return [
        crashes.limit_record(
            running, Outcome.CRASHED, "WorkerDied", message, worker, CrashKind.WORKER_DIED
        )
    ]


def timing_crashes(
    run_dir: Path, batches: list[dict[str, list[CellRecord]]]
) -> dict[str, CrashRecords]:
    """Timing phase: a crash keeps each cell's measured record, and notes it on the cells of
    the item that had no figures yet."""
    return {
        timing_batch_name(list(batch)): partial(
            noted_timing_crash, run_dir, [r for column in batch.values() for r in column]
        )
        for batch in batches
    }


def noted_timing_crash(
    run_dir: Path, records: list[CellRecord], message: str, worker: str
) -> list[CellRecord]:
    # as in crashed_cell: the dead worker's records are in cells.jsonl only
    timed = {r.cell for r in storage.read_records(run_dir, problems=[]) if r.perf}
    failure = f"the timing worker {worker} died: {message}"[: errors.MAX_MESSAGE]
    return [replace(r, timing_error=failure) for r in records if r.cell not in timed]
