"""ampmatrix: a test-and-benchmark matrix for mixed-precision dtype failures in PyTorch.

The authoring API for cases is importable from here::

    from harness import Case, FailureSignature, RunContext, Size, Symptom, Upstream, Workload
    from harness import fix, register

The names load on first use, so ``harness.report`` (which never imports torch) stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from harness.schema.surface import lazy_surface

if TYPE_CHECKING:
    from harness.measure.authoring.case import (
        Case,
        FailureSignature,
        RunContext,
        Size,
        Symptom,
        Upstream,
        Workload,
        fix,
    )
    from harness.measure.authoring.registry import register
    from harness.plugin import check_model

#: The names a case author imports, by the package that serves them (the case API from
#: ``harness.measure``'s surface, the pytest decorator from the plugin).
AUTHORING_API = {
    "Case": "measure",
    "FailureSignature": "measure",
    "RunContext": "measure",
    "Size": "measure",
    "Symptom": "measure",
    "Upstream": "measure",
    "Workload": "measure",
    "fix": "measure",
    "register": "measure",
    "check_model": "plugin",
}
# written out (not derived) so that type checkers see the names imported above as exported
__all__ = [
    "Case",
    "FailureSignature",
    "RunContext",
    "Size",
    "Symptom",
    "Upstream",
    "Workload",
    "check_model",
    "fix",
    "register",
]
__getattr__ = lazy_surface(__name__, AUTHORING_API)
