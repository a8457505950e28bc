"""A command line's start and end, kept short: the collector's passes over torch's heap.

Importing torch makes about a million objects that live as long as the process, and the
cyclic garbage collector's full passes walk all of them: several during the imports, and
more as the interpreter exits. On a 2-core CPU that is 0.15 s at start-up and 0.3 s at exit,
as long as a small model's whole ``check``. Here the run machinery is imported with the
collector paused, what the import made is then frozen out of its passes (``gc.freeze``),
and the heap is frozen again before the exit. Objects are still freed as ever where their
last reference goes; only the search for cycles among long-lived objects is skipped, and
their memory goes back with the process.
"""

from __future__ import annotations

import gc
import importlib
import sys

from harness.results import storage

#: The run machinery: the module the commands that run cells import, and torch with it.
RUN_MACHINERY = "harness.runner.run"


def import_run_machinery() -> None:
    """Import the run machinery with the collector paused, then freeze what it made; once
    per process (a second call, or one after it was imported, does nothing)."""
    if RUN_MACHINERY in sys.modules:
        return
    with storage.paused_gc():
        try:
            importlib.import_module(RUN_MACHINERY)
        finally:
            gc.freeze()


def before_exit() -> None:
    """Freeze the heap: the interpreter's exit, which follows, then skips the collector's
    passes over it."""
    gc.freeze()
