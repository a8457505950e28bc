"""Reading and summarising results, with no torch: the run folder on disk, the terminal
summary, speed ratios and ranks, what a cell's compute ran in, outcomes across torch
releases and the release bisect.

Its public surface is below, each name loaded from its module on first use; see
``docs/architecture.md`` for the layers.
"""

from harness.schema.surface import lazy_surface

SURFACE = {
    "ResultsError": "storage",
    "append_record": "storage",
    "read_records": "storage",
    "render_summary": "summary",
    "speed_ratios": "speed",
    "ComputedIn": "computed_in",
    "render_bisect": "versions",
    "ReleaseSearch": "search",
}
__all__ = sorted(SURFACE)
__getattr__ = lazy_surface(__name__, SURFACE)
