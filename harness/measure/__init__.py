"""Measuring one cell in this process (torch): the case API, putting a cell's precision on
a workload, the dtype trail, the float64 reference and the tolerance rule, timing and
figures, and the process-global caches with their one reset.

Its public surface is below, each name loaded from its module on first use; see
``docs/architecture.md`` for the layers.
"""

from harness.schema.surface import lazy_surface

SURFACE = {
    "Case": "case",
    "FailureSignature": "case",
    "RunContext": "case",
    "Size": "case",
    "Upstream": "case",
    "Workload": "case",
    "fix": "case",
    "register": "registry",
    "run_cell": "execute",
    "time_call": "timing",
    "reset": "caches",
}
__all__ = sorted(SURFACE)
__getattr__ = lazy_surface(__name__, SURFACE)
