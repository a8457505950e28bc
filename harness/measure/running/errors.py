"""A failure in words: the text, type and innermost own frames of an error, as a record holds
them, and the exceptions that say which part of a case's code failed before a cell could be
judged."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

from harness.measure.authoring.case import Case
from harness.measure.tracing.source_sites import HARNESS_DIR, is_library_file, shown_path

#: The longest error message a record holds.
MAX_MESSAGE = 4000
#: How many of the case's own frames a failure shows (the innermost ones).
MAX_FRAMES = 3


def error_text(error: BaseException) -> str:
    """``str(error)``, or what stopped it when an exception's ``__str__`` itself fails."""
    try:
        return str(error)
    except Exception as broken:
        return f"<str() of the exception failed: {type(broken).__name__}>"


def own_frames(error: BaseException, root: Path) -> tuple[str, ...]:
    """The innermost frames of the traceback in files under ``root``, as ``file:line in f``.

    Where ``root`` is a case's or model's folder (not the harness's own), the frames of the
    harness, torch, the test runner and the standard library are none of its code even
    where they lie under it: a model checked from the project's root has the harness in its
    folder, and the harness's frames between the model's call and torch (a dispatch mode's
    ``__torch_dispatch__``, a ``TorchFunctionMode``'s ``__torch_function__``) would
    otherwise be named as the place the model's error came from."""
    harness_own = root.resolve().is_relative_to(HARNESS_DIR)
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if Path(frame.filename).resolve().is_relative_to(root)
        and (harness_own or not is_library_file(frame.filename))
    ]
    return tuple(
        f"{shown_path(frame.filename)}:{frame.lineno} in {frame.name}"
        for frame in frames[-MAX_FRAMES:]
    )


def case_root(case: Case) -> Path:
    return Path(case.source_file).resolve().parent


def error_fields(error: BaseException, root: Path) -> dict[str, Any]:
    """A record's fields for ``error``: its type, its message, its frames under ``root``."""
    return {
        "error_type": type(error).__name__,
        "error_message": error_text(error)[:MAX_MESSAGE],
        "error_frames": own_frames(error, root),
    }


class CaseCodeFailed(Exception):
    """Something the case's code does before a cell can be judged raised ``error``."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error_text(error)}")
        self.error = error


class WorkloadFailed(CaseCodeFailed):
    """The case's ``build()`` raised, or its precision could not be applied."""


class ReferenceFailed(CaseCodeFailed):
    """The case's reference fix failed in float64: no cell of the case can be judged."""
