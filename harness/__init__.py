"""ampmatrix: a test-and-benchmark matrix for mixed-precision dtype failures in PyTorch.

The authoring API for cases is importable from here::

    from harness import Case, FailureSignature, RunContext, Size, Upstream, Workload, fix, register

The names load on first use, so ``harness.report`` (which never imports torch) stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.measure.case import (
        Case,
        FailureSignature,
        RunContext,
        Size,
        Upstream,
        Workload,
        fix,
    )
    from harness.measure.registry import register
    from harness.plugin import check_model

AUTHORING_API = {
    "Case": "harness.measure.case",
    "FailureSignature": "harness.measure.case",
    "RunContext": "harness.measure.case",
    "Size": "harness.measure.case",
    "Upstream": "harness.measure.case",
    "Workload": "harness.measure.case",
    "fix": "harness.measure.case",
    "register": "harness.measure.registry",
    "check_model": "harness.plugin",
}

__all__ = [
    "Case",
    "FailureSignature",
    "RunContext",
    "Size",
    "Upstream",
    "Workload",
    "check_model",
    "fix",
    "register",
]


def __getattr__(name: str) -> Any:
    if name in AUTHORING_API:
        return getattr(importlib.import_module(AUTHORING_API[name]), name)
    raise AttributeError(f"module 'harness' has no attribute {name!r}")
