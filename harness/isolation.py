"""Each cell in a process of its own: a crash, a hang or a memory blow-up costs only that cell.

Children are forked from the worker (as pytest-forked does), which keeps everything a cell
needs loaded and warm: the case modules, and the float64 reference and low-precision
baseline of each case, computed once in the worker with a single thread. A worker that never
starts a thread pool is safe to fork (forking a process whose OpenMP pool is running can
hang the child); the child then sets its own thread count. A new cell process starts in
milliseconds.

The parent waits for the child's record up to the cell's time limit; a child that outlives
it is killed and recorded as ``timeout``, one that dies without a record is ``crashed`` with
its signal or exit code. An optional memory limit (``RLIMIT_DATA``) makes an allocation
beyond it fail inside the child as an ordinary out-of-memory error, recorded with its type.
"""

from __future__ import annotations

import multiprocessing
import resource
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from harness import execute, trail
from harness.records import Cell, CellRecord, CrashKind, Outcome

DEFAULT_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Limits:
    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_bytes: int | None = None


def warm_parent(cell: Cell) -> None:
    """Compute (and cache) what every cell of this case and dtype shares, single-threaded,
    before forking: children inherit it instead of each recomputing it. The dtype tracer's
    first-use imports are done here too."""
    torch.set_num_threads(1)
    trail.warm_up()
    try:
        execute.reference_leaves(cell.case)
        execute.baseline(cell.case, cell.dtype)
    except Exception:
        pass


def _child(
    conn: Connection, cell: Cell, worker: str, memory_bytes: int | None, threads: int, trace: bool
) -> None:
    """In the cell's own process: set limits, run the cell, send the record back."""
    if memory_bytes:
        resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, memory_bytes))
    torch.set_num_threads(threads)
    conn.send(execute.run_cell(cell, worker, trace).to_dict())
    conn.close()


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "the process did not exit"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        return f"the cell's process died from signal {-exitcode} ({name})"
    return f"the cell's process exited with code {exitcode} without a record"


def run_cell_isolated(
    cell: Cell, worker: str, limits: Limits, threads: int, trace: bool = True
) -> CellRecord:
    """Run one cell in a child process, within its limits; always returns a record."""
    warm_parent(cell)
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(
        target=_child,
        args=(send, cell, worker, limits.memory_bytes, threads, trace),
        daemon=True,
    )
    child.start()
    send.close()
    try:
        if receive.poll(limits.timeout_s):
            try:
                return CellRecord.from_dict(receive.recv())
            except EOFError:
                pass  # the child died before sending: a crash, below
        elif child.is_alive():
            child.kill()
            child.join()
            message = f"no result after {limits.timeout_s:g} s: the cell's process was killed"
            return execute.limit_record(cell, Outcome.TIMEOUT, "Timeout", message, worker)
        child.join()
        message = describe_exit(child.exitcode)
        return execute.limit_record(
            cell, Outcome.CRASHED, "ProcessDied", message, worker, CrashKind.PROCESS_DIED
        )
    finally:
        receive.close()
        if child.is_alive():
            child.kill()
            child.join()
