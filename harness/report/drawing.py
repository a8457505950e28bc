"""The report's plots drawn in a process of their own, started before the report reads its
runs: it draws the figures (:func:`harness.report.plots.error_vs_time` of each job) while
the tables are built. Where the platform cannot fork, or the process fails, the figures are
drawn here when asked for.
"""

from __future__ import annotations

import multiprocessing
import sys
from contextlib import suppress
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.report.plots import Job


class Drawing:
    """A drawing process: ``start()`` forks it, ``give``
    sends it the jobs, ``figures`` returns what it drew, in the order of the jobs."""

    def __init__(self) -> None:
        self.process: BaseProcess | None = None
        self.connection: Connection | None = None
        self.jobs: list[Job] = []

    def start(self) -> Drawing:
        """Fork the process (once; where the platform cannot fork, there is none)."""
        if self.process is None and "fork" in multiprocessing.get_all_start_methods():
            context = multiprocessing.get_context("fork")
            self.connection, child = context.Pipe(duplex=True)
            for stream in (sys.stdout, sys.stderr):  # or the process writes them out again
                stream.flush()
            self.process = context.Process(target=draw_when_given, args=(child,))
            self.process.start()
            child.close()
        return self

    def give(self, jobs: list[Job]) -> None:
        """The jobs to draw; a process given none to draw ends."""
        self.jobs = jobs
        drawn = any(not points.empty for points, _ in jobs)
        if self.connection is None:
            return
        try:
            self.connection.send(jobs if drawn else None)
        except (OSError, ValueError):  # the process is gone: the figures are drawn here
            self.stop()
        if not drawn:
            self.stop()

    def figures(self) -> list[str | None]:
        """The figures, in the order of the jobs. Where the drawing process failed they are
        drawn here, so that its error is raised here, as without a process."""
        drawn = None
        if self.connection is not None:
            with suppress(EOFError, OSError):
                drawn = self.connection.recv()
            self.stop()
        if drawn is None:
            from harness.report.plots import error_vs_time

            drawn = [error_vs_time(points, passing) for points, passing in self.jobs]
        return drawn

    def stop(self) -> None:
        """Ends the drawing process, finished or not (a report that failed)."""
        if self.process is not None:
            if self.process.is_alive():
                self.process.terminate()
            self.process.join()
        if self.connection is not None:
            self.connection.close()
        self.connection = self.process = None

    def __enter__(self) -> Drawing:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def draw_when_given(connection: Connection) -> None:
    """In the drawing process: wait for the jobs, send the figures (None if drawing
    failed, or no jobs came)."""
    figures: list[Any] | None = None
    with suppress(Exception):
        from harness.report import plots

        jobs = connection.recv()
        if jobs is None:
            return
        figures = [plots.error_vs_time(points, passing) for points, passing in jobs]
    with suppress(OSError):
        connection.send(figures)
    connection.close()
