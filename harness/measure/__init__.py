"""Measuring one cell in this process (torch), in subpackages that import only those
before them: ``host`` (this process, its torch, devices and caches), ``precision`` (a
cell's precision put on a workload), ``tracing`` (the dtype trail), ``authoring`` (the case
API), ``running`` (a fix run, its training step and fit), then ``judge`` (the float64
reference and the tolerance rule) and ``figures`` (timing, speed and memory), which
``execute`` ties together into one cell's record.

Its public surface is below, each name loaded from its module on first use; see
``docs/architecture.md`` for the layers.
"""

from harness.schema.surface import lazy_surface

SURFACE = {
    "Case": "authoring.case",
    "FailureSignature": "authoring.case",
    "RunContext": "authoring.case",
    "Size": "authoring.case",
    "Symptom": "authoring.case",
    "Upstream": "authoring.case",
    "Workload": "authoring.case",
    "fix": "authoring.case",
    "register": "authoring.registry",
    "run_cell": "execute",
    "time_call": "figures.timing",
    "reset": "host.caches",
}
__all__ = sorted(SURFACE)
__getattr__ = lazy_surface(__name__, SURFACE)
