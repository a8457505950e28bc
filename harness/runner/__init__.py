"""Running the matrix: cases expanded to cells, the pipeline of a run (discover, expand,
select, run, time, store), each cell in a forked process, and the pytest items that
spread cells over workers.

Its public surface is below, each name loaded from its module on first use; see
``docs/architecture.md`` for the layers.
"""

from harness.schema.surface import lazy_surface

SURFACE = {
    "resume": "run",
    "Plan": "matrix",
    "expand": "matrix",
}
__all__ = sorted(SURFACE)
__getattr__ = lazy_surface(__name__, SURFACE)
