"""The data every layer shares, with no torch: the axis table (``Cell``'s fields), the
records a cell leaves, the run's configuration and selection, and the files of a run
folder, each declared once.

Its public surface is below, each name loaded from its module on first use; see
``docs/architecture.md`` for the layers.
"""

from harness.schema.surface import lazy_surface

SURFACE = {
    "AXES": "axes",
    "Axis": "axes",
    "Cell": "axes",
    "Column": "axes",
    "SCHEMA_VERSION": "records",
    "CellRecord": "records",
    "CrashKind": "records",
    "Flag": "records",
    "Numerics": "records",
    "Outcome": "records",
    "Perf": "records",
    "outcome_label": "records",
    "Trail": "trail_records",
    "Limits": "config",
    "RunConfig": "config",
    "TimingConfig": "config",
    "Selection": "selection",
    "SelectionError": "selection",
    "check_selection": "selection",
    "CaseList": "run_files",
    "Environment": "run_files",
    "RunPlan": "run_files",
}
__all__ = sorted(SURFACE)
__getattr__ = lazy_surface(__name__, SURFACE)
