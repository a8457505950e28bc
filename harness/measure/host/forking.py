"""Forking a child that Ctrl-C cannot stop half-way.

Ctrl-C sends SIGINT to the whole process group: the run's process stops the run and ends its
children. A child must not take it itself, not even in the moment after the fork where
Python's at-fork handlers run (``random`` reseeds there: a ``KeyboardInterrupt`` in it is
printed as "Exception ignored in ... Random.seed" with a traceback). So SIGINT is blocked
around the fork (a child inherits the blocked set, not the pending signals), the child
ignores it and unblocks it, and the parent unblocks it, taking an interrupt that came in
between as soon as the fork is done.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

SIGINT_ONLY = {signal.SIGINT}


@contextmanager
def sigint_blocked() -> Iterator[None]:
    """Fork inside this block: SIGINT waits until it ends (in the parent)."""
    signal.pthread_sigmask(signal.SIG_BLOCK, SIGINT_ONLY)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGINT_ONLY)


def child_ignores_sigint() -> None:
    """In a child forked inside :func:`sigint_blocked`: Ctrl-C is the parent's to handle."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGINT_ONLY)
