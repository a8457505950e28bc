"""The report's HTML and its files: the view (:mod:`harness.report.views`, built by
:mod:`harness.report.render`) through the Jinja2 template, the report written beside the
others and the folder's ``index.html`` refreshed.

Every string that comes from a run is escaped by Jinja2's autoescaping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from harness.report.render import report_view_while
from harness.results import storage
from harness.schema.text import terminal_safe

if TYPE_CHECKING:
    import jinja2

    from harness.report.aggregate import Run
    from harness.report.compare import Comparison
    from harness.report.drawing import Drawing
    from harness.report.views import ReportView


def template_environment() -> jinja2.Environment:
    """Jinja2's environment (imported here: a report drawing plots imports and compiles
    its template while they are drawn)."""
    from jinja2 import Environment, PackageLoader, select_autoescape

    return Environment(
        loader=PackageLoader("harness.report", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        finalize=shown_in_html,
        trim_blocks=False,
    )


def shown_in_html(value: object) -> object:
    """Every text a template shows, before Jinja escapes its ``<>&"'``: its control
    characters (ESC, a bidi override that reorders the text after it) shown escaped, as a
    terminal shows them (:func:`~harness.schema.text.terminal_safe`); the report's own
    markup (``Markup``: its SVG pictures) as it is."""
    from markupsafe import Markup

    if isinstance(value, str) and not isinstance(value, Markup):
        return terminal_safe(value)
    return value


def report_template() -> jinja2.Template:
    """The report's template, compiled (a fifth of a second)."""
    return template_environment().get_template("report.html.j2")


def report_html(view: ReportView, template: jinja2.Template | None = None) -> str:
    """The view as HTML: the template reads each of its fields by name."""
    template = template or report_template()
    return template.render(**{f.name: getattr(view, f.name) for f in fields(view)})


def render_report(
    runs: Sequence[Run], comparison: Comparison | None = None, drawing: Drawing | None = None
) -> str:
    """The report's HTML. The cyclic garbage collector is paused meanwhile: building the
    tables makes no garbage cycles worth collecting, and its walks over a large report's
    objects took a tenth of its time. The template is compiled while the plots are drawn
    (by ``drawing``, where the caller started it before reading the runs)."""
    with storage.paused_gc():
        view, template = report_view_while(runs, comparison, report_template, drawing)
        return report_html(view, template)


def write_report(html: str, out: Path) -> Path:
    """Write the report (never over an input file) and refresh the folder's index."""
    out.parent.mkdir(parents=True, exist_ok=True)
    storage.write_atomic(out, html)
    write_index(out.parent)
    return out


def write_index(folder: Path) -> Path:
    """``index.html``: every report in the folder, newest first."""
    reports = sorted(
        (p for p in folder.glob("*.html") if p.name != "index.html"),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    entries = [(relative_href(p.name), p.name, modified_at(p)) for p in reports]
    html = template_environment().from_string(INDEX_TEMPLATE).render(reports=entries)
    index = folder / "index.html"
    if index.exists() and not made_by_ampmatrix(index):
        return index  # someone else's index.html: left as it is
    storage.write_atomic(index, html)
    return index


def relative_href(name: str) -> str:
    """A link to the file ``name`` beside the page: ``./`` and URL-quoted, so that no part
    of a file's name (a run folder's) is read as a scheme (``javascript:``), a query or a
    fragment. A name's bytes that are not UTF-8 (lone surrogates here) are quoted as the
    bytes they were."""
    return "./" + quote(name, safe="", errors="surrogateescape")


def modified_at(path: Path) -> str:
    return datetime.fromtimestamp(path.stat().st_mtime, timezone.utc).strftime(
        "%Y-%m-%d %H:%M UTC"
    )


#: In the head of every HTML file the harness writes: what it may write over again.
GENERATOR = '<meta name="generator" content="ampmatrix">'
#: How the head of reports and indexes written before ``GENERATOR`` begins.
OLDER_HEADS = ("<title>ampmatrix report</title>", "<title>ampmatrix reports</title>")


def made_by_ampmatrix(path: Path) -> bool:
    """An HTML file this harness wrote (its head says so in its first kilobytes)."""
    try:
        with path.open("rb") as f:
            head = f.read(4096).decode(errors="replace")
    except OSError:
        return False
    return any(mark in head for mark in (GENERATOR, *OLDER_HEADS))


INDEX_TEMPLATE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="generator" content="ampmatrix"><title>ampmatrix reports</title>
<style>body{font:14px system-ui,sans-serif;margin:2em}li{margin:.3em 0}</style></head>
<body><h1>ampmatrix reports</h1><p>Newest first.</p><ul>
{% for href, name, when in reports %}<li><a href="{{ href }}">{{ name }}</a> ({{ when }})</li>
{% endfor %}</ul></body></html>
"""
