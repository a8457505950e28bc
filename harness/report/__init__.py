"""The HTML report, ``compare`` and the Markdown summary: pure functions of results files
(pandas and jinja2; never torch).

Its public surface is below, each name loaded from its module on first use; see
``docs/architecture.md`` for the layers.
"""

from harness.schema.surface import lazy_surface

SURFACE = {
    "load_run": "aggregate",
    "load_runs_for_report": "aggregate",
    "render_report": "writing",
    "write_report": "writing",
    "compare_runs": "compare",
    "render_comparison": "compare",
    "render_markdown": "markdown",
}
__all__ = sorted(SURFACE)
__getattr__ = lazy_surface(__name__, SURFACE)
