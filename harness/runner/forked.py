"""A forked child with a time limit: its values come back one at a time as it sends them,
and a child that dies, raises or overruns says how (``Forked.failure``) instead.

Nothing is pickled on the way in (the child is a fork of this process); each value is on
the way back. The child ignores SIGINT (the parent stops the run and ends it), dies with
its parent (``die_with_parent``), and runs under the memory limit and thread count it is
given.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import resource
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from harness.measure.host import forking
from harness.measure.running import errors


@dataclass(frozen=True)
class Forked:
    """What came back from a forked child: its value, or why none came."""

    value: Any = None
    #: None when the value came back; otherwise what happened to the child, in words.
    failure: str | None = None
    timed_out: bool = False


PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """On Linux, the child is killed when the process that forked it dies, so a child whose
    worker died (its fix killed it, say) neither lingers nor holds the worker's pipes open."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def describe_error(error: BaseException) -> str:
    """``Type: message``, even for an exception whose ``str()`` itself fails."""
    message = errors.error_text(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def describe_exit(exitcode: int | None, whose: str = "the cell's process") -> str:
    if exitcode is None:
        return f"{whose} did not exit"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        return f"{whose} died from signal {-exitcode} ({name})"
    return f"{whose} exited with code {exitcode} without a result"


def run_forked(
    work: Callable[[], Any],
    timeout_s: float,
    threads: int,
    memory_bytes: int | None = None,
    whose: str = "the cell's process",
) -> Forked:
    """``work()`` in a forked child (nothing is pickled on the way in; its value is on the
    way back), killed after ``timeout_s``; a child that dies says how."""
    with ForkedStream(lambda send: send(work()), threads, memory_bytes, whose) as stream:
        return stream.next(timeout_s)


class ForkedStream:
    """A forked child that sends values one at a time (``work(send)``), read with a time
    limit for each; a child that dies or overruns says how, and is killed."""

    def __init__(
        self,
        work: Callable[[Callable[[Any], None]], None],
        threads: int,
        memory: int | None,
        whose: str = "the cell's process",
    ) -> None:
        context = multiprocessing.get_context("fork")
        self.whose = whose
        self.receive, send = context.Pipe(duplex=False)
        # Not a daemon: inductor's compile workers are children of the child (torch 2.1-2.3).
        self.child = context.Process(
            target=_child, args=(send, work, memory, threads, os.getpid())
        )
        with forking.sigint_blocked():
            self.child.start()
        send.close()

    def __enter__(self) -> ForkedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.receive.close()
        if self.child.is_alive():
            self.child.kill()
        self.child.join()

    def next(self, timeout_s: float, whose: str | None = None) -> Forked:
        """The child's next value, within ``timeout_s``; a failure names the child as
        ``whose`` (what it is computing now) where given."""
        whose = whose or self.whose
        if self.receive.poll(timeout_s):
            try:
                ok, value = self.receive.recv()
                if ok:
                    return Forked(value=value)
                return Forked(failure=f"{whose} failed without a result: {value}")
            except EOFError:
                pass  # the child died before sending: below
        elif self.child.is_alive():
            self.child.kill()
            self.child.join()
            failure = f"no result after {timeout_s:g} s: {whose} was killed"
            return Forked(failure=failure, timed_out=True)
        self.child.join()
        return Forked(failure=describe_exit(self.child.exitcode, whose))


def _child(
    conn: Connection,
    work: Callable[[Callable[[Any], None]], None],
    memory_bytes: int | None,
    threads: int,
    parent: int,
) -> None:
    """In the child: set limits, do the work, sending each value as soon as it exists, or
    what stopped it (any exception the work let out, ``KeyboardInterrupt`` and
    ``SystemExit`` included)."""
    try:
        forking.child_ignores_sigint()  # the parent stops the run and ends this child
        die_with_parent(parent)
        if memory_bytes:
            resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, memory_bytes))
        torch.set_num_threads(threads)
        work(lambda value: conn.send((True, value)))
    except BaseException as error:  # everything goes back to the parent
        conn.send((False, describe_error(error)))
    conn.close()
