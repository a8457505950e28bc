"""Cells as pytest items, so pytest-xdist spreads them over worker processes.

The runner writes the plan (``plan.json``) into the run directory and hands it to pytest.
Each item runs one cell and appends its record at once. An item fails only when the harness
itself broke or the worker process died; the controller then records the cell as
``crashed``, and the run goes on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import execute, registry, storage
from harness.records import Cell, CellRecord, Outcome
from harness.timing import TimingConfig

OUTCOME_KEY = "ampmatrix_outcome"


def load_plan(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.name in storage.PLAN_FILES:
        return PlanFile.from_parent(parent, path=file_path)
    return None


def pytest_configure(config: pytest.Config) -> None:
    threads = os.environ.get("AMPMATRIX_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


class PlanFile(pytest.File):
    def collect(self) -> Iterator[pytest.Item]:
        plan = load_plan(self.path)
        registry.discover(Path(d) for d in plan["cases_dirs"])
        run_dir = Path(plan["run_dir"])
        for data in plan["cells"]:
            cell = Cell.from_dict(data)
            yield CellItem.from_parent(self, name=cell.id, cell=cell, run_dir=run_dir)
        config = TimingConfig(**plan.get("timing", {}))
        for data in plan.get("timed", []):
            record = CellRecord.from_dict(data)
            item = TimingItem.from_parent(
                self, name=record.cell.id, record=record, run_dir=run_dir, timing=config
            )
            item.add_marker(pytest.mark.xdist_group(record.cell.device))
            yield item


class CellItem(pytest.Item):
    def __init__(self, *, cell: Cell, run_dir: Path, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cell = cell
        self.run_dir = run_dir

    def runtest(self) -> None:
        record = execute.run_cell(self.cell, worker=worker_id(self.config))
        storage.append_record(self.run_dir, record)
        self.user_properties.append((OUTCOME_KEY, outcome_label(record)))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, self.cell.id


class TimingItem(pytest.Item):
    """Times a cell that already ran; its full record is appended again, now with figures."""

    def __init__(
        self, *, record: CellRecord, run_dir: Path, timing: TimingConfig, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.record = record
        self.run_dir = run_dir
        self.timing = timing

    def runtest(self) -> None:
        record = execute.time_cell(self.record, self.timing, worker_id(self.config))
        storage.append_record(self.run_dir, record)
        self.user_properties.append((OUTCOME_KEY, timing_label(record)))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, self.record.cell.id


def timing_label(record: CellRecord) -> str:
    perf = record.perf
    if perf is None:
        return str(record.note)
    noisy = " noisy" if perf.time_noisy else ""
    return (
        f"{perf.time_median_s * 1e3:.3f} ms (IQR {perf.time_iqr_s / perf.time_median_s:.1%},"
        f" {perf.time_count}x{perf.time_block} calls{noisy})"
    )


def worker_id(config: pytest.Config) -> str:
    workerinput = getattr(config, "workerinput", None)
    return str(workerinput["workerid"]) if workerinput else "main"


def outcome_label(record: CellRecord) -> str:
    if record.outcome is Outcome.RAISES:
        return "raises (reproduces)" if record.reproduces else "raises (unexpected error)"
    return record.outcome.value


class Controller:
    """Runs in the controlling process: records crashed cells and prints progress.

    In the timing phase ``timed`` holds the records being timed: a crash there keeps the
    cell's measured record and adds a note, instead of replacing it with ``crashed``.
    """

    def __init__(
        self, run_dir: Path, cells: list[Cell], timed: dict[str, CellRecord] | None = None
    ) -> None:
        self.run_dir = run_dir
        self.by_id = {cell.id: cell for cell in cells}
        self.timed = timed or {}
        self.finished: set[str] = set()

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" and report.passed:
            self._progress(report, str(dict(report.user_properties).get(OUTCOME_KEY, "?")))
        elif report.failed:
            self._record_crash(report)

    def _record_crash(self, report: pytest.TestReport) -> None:
        cell = self.by_id.get(report.nodeid.rsplit("::", 1)[-1])
        if cell is None or cell.id in self.finished:
            return
        worker = getattr(report, "node", None)
        worker_name = str(getattr(getattr(worker, "gateway", None), "id", "main"))
        message = str(report.longrepr)
        if cell.id in self.timed:
            note = execute.join_notes(self.timed[cell.id].note, f"timing crashed: {message}")
            record = replace(self.timed[cell.id], note=note)
        else:
            record = execute.crashed_record(cell, message, worker_name)
        storage.append_record(self.run_dir, record)
        self._progress(report, "crashed")

    def _progress(self, report: pytest.TestReport, label: str) -> None:
        name = report.nodeid.rsplit("::", 1)[-1]
        self.finished.add(name)
        width = len(str(len(self.by_id)))
        print(f"[{len(self.finished):>{width}}/{len(self.by_id)}] {name}  {label}", flush=True)
