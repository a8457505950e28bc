"""Importing a user's module first where its end cannot end the run.

A case module of ``--cases-dir`` or a model module ``check`` names is the user's code, and
its import may call ``sys.exit`` or ``os._exit``, crash the interpreter or never return.
Imported straight into the run's process, the first two end the run with its exit code
(``0``: a CI job green with nothing checked), the third with a signal and the last never.
``first_fatal`` imports them in a forked child first, in order and within a time limit, and
says which import ended or outlived the child and how; the caller turns that into one line.
"""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass

from harness.measure.host import forking
from harness.schema import env_vars

#: How long the imports of one probe may take (a model module that imports transformers
#: takes a few seconds): declared with its default and rule in ``harness.schema.env_vars``.
TIMEOUT_VARIABLE = env_vars.IMPORT_TIMEOUT.name
STEP = 4  # bytes per survived step on the pipe


@dataclass(frozen=True)
class Fatal:
    """The import that ended the child or outlived the limit: its index, and how, in words."""

    step: int
    how: str


def import_timeout() -> float:
    """The time limit of a probe: ``AMPMATRIX_IMPORT_TIMEOUT`` seconds, else the default;
    a value out of its rule is an ``EnvironmentVariableError`` naming it."""
    return env_vars.IMPORT_TIMEOUT.read()


def first_fatal(
    steps: Sequence[Callable[[], object]], timeout_s: float | None = None
) -> Fatal | None:
    """Run ``steps`` one after another in a forked child whose output goes nowhere (the real
    imports print what they print); None when every step returned or raised (errors are
    the real import's to report), else the step that ended the child or was still running
    when ``timeout_s`` ran out (the child is then killed)."""
    if not steps:
        return None
    limit = import_timeout() if timeout_s is None else timeout_s
    read, write = os.pipe()
    with forking.sigint_blocked():
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; its coverage is not collected
        os.close(read)
        _run_steps_quietly(steps, write)
    os.close(write)
    timed_out = True  # until read: a probe interrupted (Ctrl-C) kills its child too
    try:
        survived, timed_out = _read_survivals(read, len(steps), limit)
    finally:
        os.close(read)
        if timed_out:
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    if survived == len(steps):
        return None
    if timed_out:
        how = f"was still importing after {limit:g} s (killed; {TIMEOUT_VARIABLE} sets the limit)"
        return Fatal(survived, how)
    return Fatal(survived, f"ended the process importing it ({_how_it_ended(status)})")


def _run_steps_quietly(steps: Sequence[Callable[[], object]], write: int) -> None:
    """The child: each step, its survival said on the pipe; then leave without cleanup."""
    forking.child_ignores_sigint()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    for number, step in enumerate(steps):
        with suppress(BaseException):
            step()
        os.write(write, number.to_bytes(STEP, "big"))
    os._exit(0)


def _read_survivals(read: int, total: int, limit: float) -> tuple[int, bool]:
    """How many steps the child survived, and whether it ran out of time before the last."""
    deadline = time.monotonic() + limit
    received = b""
    while len(received) < total * STEP:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([read], [], [], left)[0]:
            return len(received) // STEP, True
        chunk = os.read(read, 4096)
        if not chunk:  # the child is gone
            break
        received += chunk
    return len(received) // STEP, False


def _how_it_ended(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        return f"exit code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"
    return f"signal {-code}, {name}"
