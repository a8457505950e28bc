"""The HTML report: one self-contained file (inline CSS and plots) over one or many runs.

A pure function of results files; every string that comes from a run is escaped by
Jinja2's autoescaping.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

import pandas as pd

if TYPE_CHECKING:
    import jinja2

from harness.report import aggregate, grouping, plots, stages
from harness.report.aggregate import Run
from harness.report.compare import Comparison
from harness.report.grouping import Environments, EnvironmentSet
from harness.results import storage
from harness.results.summary import noise_statement
from harness.schema.axes import FIT_STAGE, MODES, SIZES, TRAIN_STAGE, rank
from harness.schema.records import DRIFT, LABELS
from harness.schema.releases import torch_release
from harness.schema.run_files import CaseInfo

LEGEND = (
    *((label.text, label.css, label.meaning) for label in LABELS),
    ("[flag]", "flagged", "the cell's precision mode was not applied as promised (see messages)"),
)
CSS_CLASS = {label.text: label.css for label in LABELS}


def css_for(label: str) -> str:
    """The CSS class of a label; a flagged one (``passes[no-autocast]``) gets ``flagged``
    too, so it never looks like a plain pass, and a drifting one ``drift`` as well."""
    base, _, flags = label.partition("[")
    drift = DRIFT in flags.rstrip("]").split(",")
    return (
        CSS_CLASS.get(base, "missing")
        + (" flagged" if flags else "")
        + (" drift" if drift else "")
    )


ISSUE_REF = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)#(?P<number>\d+)$")


def template_environment() -> jinja2.Environment:
    """Jinja2's environment (imported here: a report drawing plots imports and compiles
    its template while they are drawn)."""
    from jinja2 import Environment, PackageLoader, select_autoescape

    environment = Environment(
        loader=PackageLoader("harness.report", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=False,
    )
    environment.filters["css"] = css_for
    return environment


def fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return format(value, spec)


def fmt_bytes(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return ""


@dataclass(frozen=True)
class MatrixView:
    env_spans: list[tuple[EnvironmentSet, int]]
    columns: list[tuple[str, str, str]]
    rows: list[dict[str, Any]]


def matrix_view(frame: pd.DataFrame, envs: Environments) -> MatrixView:
    """The summary matrix with environments whose every outcome is the same merged into one
    column group (a nightly's releases that behave alike), so it stays as wide as what
    differs."""
    table = aggregate.summary_matrix(frame)
    if table.empty:
        return MatrixView([], [], [])
    groups = alike_environments(table)
    columns = [c for labels in groups for c in table.columns if c[0] == labels[0]]
    universe = frame["env"].unique()
    spans = [
        (envs.describe(labels, universe), sum(c[0] == labels[0] for c in columns))
        for labels in groups
    ]
    rows = []
    for (case, row), values in table[columns].iterrows():
        cells = [
            {
                "label": v if isinstance(v, str) else "-",
                "css": css_for(v) if isinstance(v, str) else "missing",
            }
            for v in values
        ]
        rows.append({"case": case, "fix": row, "cells": cells})
    return MatrixView(spans, [tuple(c) for c in columns], rows)


def alike_environments(table: pd.DataFrame) -> list[list[str]]:
    """The summary matrix's environments, grouped where their columns (dtype/mode) and every
    outcome in them are the same; in the matrix's order of first appearance."""
    values = table.fillna("-").to_numpy()
    columns = list(table.columns)
    positions: dict[str, list[int]] = {}
    for i, column in enumerate(columns):
        positions.setdefault(column[0], []).append(i)
    groups: dict[tuple[Any, ...], list[str]] = {}
    for env, where in positions.items():
        shape = tuple(columns[i][1:] for i in where)
        groups.setdefault((shape, *values[:, where].ravel()), []).append(env)
    return list(groups.values())


def upstream_links(meta: CaseInfo | None) -> list[tuple[str, str]]:
    up: dict[str, Any] = (meta.upstream if meta else None) or {}
    repo, commit, file = up.get("repo", ""), up.get("commit", ""), up.get("file", "")
    base = f"https://github.com/{repo}"
    links = [(repo, base)] if repo else []
    if file:
        links.append((file, f"{base}/blob/{commit or 'HEAD'}/{file}"))
    if commit:
        links.append((f"commit {commit[:10]}", f"{base}/commit/{commit}"))
    for issue in up.get("issues", []):
        match = ISSUE_REF.match(issue)
        if match:
            links.append((issue, f"https://github.com/{match['repo']}/issues/{match['number']}"))
    if up.get("url"):
        url = str(up["url"])
        links.append(("link", url) if is_web_url(url) else (f"link (not linked: {url})", ""))
    return links


def is_web_url(url: str) -> bool:
    """Only http(s) addresses become links: a case's metadata must not put a
    ``javascript:`` or ``data:`` address into a report someone clicks in."""
    return urlsplit(url.strip()).scheme.lower() in ("http", "https")


def text_or_none(value: Any) -> str | None:
    """Strings from the frame, with pandas' missing values as None."""
    return value if isinstance(value, str) and value else None


def fmt_ms(seconds: Any) -> str:
    return fmt(seconds * 1e3, ".3f") + " ms"


#: The numbers of a cell's row, each shown as a value or a median with its range over the
#: environments of the row: (column, how it is shown).
NUMBERS: tuple[tuple[str, Callable[[Any], str]], ...] = (
    ("rel_err", lambda v: fmt(v, ".2e")),
    ("tolerance", lambda v: fmt(v, ".2e")),
    ("median_s", fmt_ms),
    ("vs_control", lambda v: fmt(v, ".2f")),
    ("vs_fastest", lambda v: fmt(v, ".2f")),
    ("peak_mem_bytes", fmt_bytes),
    ("gflops", lambda v: fmt(v, ".2f")),
    ("peak_fraction", lambda v: fmt(v, ".1%")),
)


#: What a case's table of cells reads of the frame.
ROW_COLUMNS = [*grouping.CELL_KEY, "env", "fix", "base_row", "stage", *grouping.VARIANT,
               "noisy", "launch_bound", *(column for column, _ in NUMBERS)]  # fmt: skip


def cell_rows(case_frame: pd.DataFrame, envs: Environments) -> list[dict[str, Any]]:
    """One row per cell and distinct outcome: a cell with the same outcome in every
    environment is one row; one whose outcome differs has a row per outcome, most common
    first, each naming its environments."""
    if case_frame.empty:
        return []
    keys = grouping.key_columns(case_frame)
    show_size = "size" in case_frame and case_frame["size"].nunique() > 1
    universe = case_frame["env"].unique()
    rows_order = grouping.row_sort_keys(case_frame)
    variants: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for found in variant_stats(case_frame, [*keys, *grouping.VARIANT]):
        key = tuple(found[k] for k in keys)
        variants.setdefault(key, []).append(found)
    rows = []
    for key in sorted(variants, key=lambda k: grouping.cell_key_order(k, rows_order)):
        ordered = sorted(variants[key], key=lambda v: -len(v["envs"]))
        for i, found in enumerate(ordered):
            row = variant_row(found, envs.describe(found["envs"], universe), show_size)
            rows.append(row | {"variants": len(ordered) if i == 0 else 0})
    return rows


def variant_stats(case_frame: pd.DataFrame, by: list[str]) -> list[dict[str, Any]]:
    """Per group of ``by``: its keys, its environments, its cell count, whether a timing
    was noisy, and each number's median, minimum and maximum (one pandas aggregation,
    not a frame per group)."""
    columns = [column for column, _ in NUMBERS]
    frame = grouping.filled(case_frame, by).assign(
        noisy=case_frame["noisy"].eq(True),
        launch_bound=case_frame["launch_bound"].eq(True),
        **{c: pd.to_numeric(case_frame[c], errors="coerce") for c in columns},
    )
    stats = frame.groupby(by, sort=False, dropna=False).agg(
        envs=("env", "unique"),
        cells=("env", "size"),
        noisy=("noisy", "any"),
        launch_bound=("launch_bound", "any"),
        **{f"{c} {how}": (c, how) for c in columns for how in ("median", "min", "max")},
    )
    return [
        dict(zip(by, key, strict=True)) | values
        for key, values in zip(stats.index, stats.to_dict("records"), strict=True)
    ]


def variant_row(found: dict[str, Any], where: EnvironmentSet, show_size: bool) -> dict[str, Any]:
    numbers = {
        column: grouping.spread(
            found[f"{column} median"], found[f"{column} min"], found[f"{column} max"], show
        )
        for column, show in NUMBERS
    }
    return {
        "row": found["row"] + (f" ({found['size']})" if show_size else ""),
        "dtype": found["dtype"],
        "mode": found["mode"],
        "envs": where,
        "cells": found["cells"],
        "label": found["label"],
        "css": css_for(found["label"]),
        "skip_reason": text_or_none(found["skip_reason"]),
        "out_dtype": text_or_none(found["out_dtype"]),
        "attn_dtype": text_or_none(found["attn_dtype"]),
        **numbers,
        "noisy": bool(found["noisy"]),
        "launch_bound": bool(found["launch_bound"]),
    }


def skipped_summary(case_frame: pd.DataFrame, envs: Environments) -> list[dict[str, Any]]:
    """Skipped cells counted by reason, with the environments where they were skipped."""
    skipped = case_frame.loc[case_frame["outcome"] == "skipped", ["skip_reason", "env"]]
    universe = case_frame["env"].unique()
    return [
        {"reason": reason, "cells": len(cells), "envs": envs.describe(cells["env"], universe)}
        for (reason,), cells in grouping.grouped(skipped, ["skip_reason"])
    ]


def where_cells(cells: pd.DataFrame, envs: Environments, universe: Any) -> list[dict[str, Any]]:
    """The cells of a message or trail: ``row · dtype/mode`` and the environments."""
    keys = grouping.key_columns(cells)
    return [
        {"cell": f"{key[0]} · {key[1]}/{key[2]}", "envs": envs.describe(group["env"], universe)}
        for key, group in grouping.grouped(cells, keys)
    ]


def messages(case_frame: pd.DataFrame, envs: Environments) -> list[dict[str, Any]]:
    """Each distinct error message or note once, with every cell and environment it came
    from."""
    universe = case_frame["env"].unique()
    cells = case_frame[[*grouping.key_columns(case_frame), "env"]]  # what where_cells reads
    texts = pd.concat(
        [
            cells.assign(text=case_frame[column])[lambda f: f["text"].map(is_text)]
            for column in ("failure", "note")
        ]
    )
    return [
        {"text": text, "count": len(cells), "where": where_cells(cells, envs, universe)}
        for (text,), cells in grouping.grouped(texts, ["text"])
    ]


def is_text(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


TRAIL = ("label", "promotion", "failure_site", "compute")


def trails(case_frame: pd.DataFrame, envs: Environments) -> list[dict[str, Any]]:
    """The dtype trail of every cell that raised or drifted: where the wider dtype entered,
    where it failed, what the kernels computed in; one row per distinct trail."""
    keys = grouping.key_columns(case_frame)
    shown = case_frame.loc[
        (case_frame["outcome"] == "raises") | case_frame["drift"].fillna(False),
        [*keys, *TRAIL, "env"],
    ]
    universe = case_frame["env"].unique()
    rows = []
    for key, cells in grouping.grouped(shown, [*keys, *TRAIL]):
        label, promotion, failure, compute = key[len(keys) :]
        rows.append(
            {
                "where": f"{key[0]} · {key[1]}/{key[2]}",
                "envs": envs.describe(cells["env"], universe),
                "label": label,
                "css": css_for(label),
                "promotion": text_or_none(promotion) or "no op left the cell's dtype",
                "failure": text_or_none(failure) or "-",
                "compute": text_or_none(compute) or "-",
            }
        )
    return rows


def size_plots(mine: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """One error-vs-time plot per workload size that was timed (speed is never drawn
    across sizes), as (size, its points); the one plot of a case that ran one size."""
    sizes = sorted(mine["size"].unique(), key=lambda s: rank(SIZES, s)) if len(mine) else []
    timed = [s for s in sizes if mine.loc[mine["size"] == s, "median_s"].notna().any()]
    if len(sizes) <= 1 or not timed:
        return [("", plots.plotted(mine))]
    return [(size, plots.plotted(mine[mine["size"] == size])) for size in timed]


def case_view(
    mine: pd.DataFrame, case: str, meta: CaseInfo | None, envs: Environments
) -> dict[str, Any]:
    recommendation = aggregate.recommend(mine, case)
    universe = mine["env"].unique()
    return {
        "name": case,
        "meta": meta,
        "links": upstream_links(meta),
        "recommendation": recommendation,
        "precision": [
            (fix, level.value)
            for fix, level in aggregate.precision_by_fix(mine).items()
            if level is not None
        ],
        "cpu_timed": bool(
            ((mine["device"] == "cpu") & mine["median_s"].notna()).any() if len(mine) else False
        ),
        "environments": envs.describe(universe, universe),
        "cell_count": len(mine),
        "rows": cell_rows(mine.loc[mine["outcome"] != "skipped", ROW_COLUMNS], envs),
        "skipped": skipped_summary(mine, envs),
        "messages": messages(mine, envs),
        "trails": trails(mine, envs),
        "stages": stage_view(mine),
    }


def stage_view(mine: pd.DataFrame) -> dict[str, Any] | None:
    """Each fix across the stages the case ran (``harness.report.stages``), each fit's
    loss curve an inline SVG; None for a case that ran one stage."""
    view = stages.side_by_side(mine)
    if view is None:
        return None
    for row in view.columns:
        fit = row["fit"]
        row["curve"] = (
            plots.loss_sparkline(fit.fit.losses, fit.fit.reference_losses, fit.label == "passes")
            if fit
            else ""
        )
    return {
        "stages": view.stages,
        "fixes": view.fixes,
        "columns": view.columns,
        "across": view.across,
        "trained": TRAIN_STAGE in view.stages,
        "fitted": FIT_STAGE in view.stages,
    }


def environment_facts(run: Run) -> list[tuple[str, str]]:
    facts = [("results", str(run.run_dir))]
    for key, value in run.env.facts():
        text = (
            " ".join(value)
            if key == "command" and value is not None
            else (
                json.dumps(value, sort_keys=True) if isinstance(value, dict | list) else str(value)
            )
        )
        facts.append((key, text))
    return facts


@dataclass(frozen=True)
class EnvironmentsView:
    """The runs' environments: the facts all runs share once, then a row per run with the
    facts that differ (a nightly's runs share most of theirs)."""

    common: list[tuple[str, str]]
    keys: list[str]
    runs: list[tuple[str, list[str]]]


def environments_view(runs: Sequence[Run]) -> EnvironmentsView:
    facts = [dict(environment_facts(run)) for run in runs]
    keys = list(dict.fromkeys(key for found in facts for key in found))
    shared = [
        key
        for key in keys
        if len(runs) > 1 and all(key in f and f[key] == facts[0][key] for f in facts)
    ]
    differing = [key for key in keys if key not in shared]
    return EnvironmentsView(
        common=[(key, facts[0][key]) for key in shared],
        keys=differing,
        runs=[
            (run.name, [f.get(key, "") for key in differing])
            for run, f in zip(runs, facts, strict=True)
        ],
    )


EMPTY_VERSIONS: dict[str, Any] = {
    "columns": [],
    "rows": [],
    "passing_columns": [],
    "passing_rows": [],
}


def version_rows(frame: pd.DataFrame) -> dict[str, Any]:
    view = aggregate.version_view(frame)
    passing = aggregate.passing_by_version(frame)
    return {
        "columns": [torch_release(c) for c in view.columns],
        "rows": [(case, list(values)) for case, values in view.iterrows()],
        "passing_columns": [torch_release(c) for c in passing.columns[:-1]],
        "passing_rows": [(case, fix, list(values)) for (case, fix), values in passing.iterrows()],
    }


def noise_of(frame: pd.DataFrame) -> str | None:
    """The summary's noise statement over the timed cells of the report."""
    if frame.empty:
        return None
    timed = frame.loc[
        frame["median_s"].notna() & (frame["median_s"] > 0), ["noisy", "iqr_s", "median_s"]
    ]
    spreads = timed["iqr_s"] / timed["median_s"]
    pairs = zip(timed["noisy"].tolist(), spreads.tolist(), strict=True)
    return noise_statement([(bool(noisy), float(spread)) for noisy, spread in pairs])


def render_report(runs: Sequence[Run], comparison: Comparison | None = None) -> str:
    """The report's HTML. The cyclic garbage collector is paused meanwhile: building the
    tables makes no garbage cycles worth collecting, and its walks over a large report's
    objects took a tenth of its time."""
    with storage.paused_gc():
        return rendered(runs, comparison)


def rendered(runs: Sequence[Run], comparison: Comparison | None) -> str:
    frame = aggregate.records_frame(runs)
    metadata: dict[str, CaseInfo] = {}
    problems = [p for run in runs for p in run.problems]
    for run in runs:
        try:
            metadata.update(storage.read_cases(run.run_dir, problems))
        except storage.ResultsError as error:
            problems.append(str(error))
    envs = Environments(frame)
    cases = [(str(case), mine) for case, mine in frame.groupby("case")] if not frame.empty else []
    wanted = [size_plots(mine) for _, mine in cases]
    passing = [set(aggregate.fixes_passing_everywhere(mine)) for _, mine in cases]
    jobs = [
        (points, fixes)
        for sizes, fixes in zip(wanted, passing, strict=True)
        for _, points in sizes
    ]
    with plots.Drawing(jobs) as drawing:  # drawn while the tables are computed
        context = tables(runs, frame, envs, problems, cases, metadata)
        template = template_environment().get_template("report.html.j2")
        figures = iter(drawing.figures())
    for view, sizes in zip(context["cases"], wanted, strict=True):
        view["plots"] = [(size, next(figures)) for size, _ in sizes]
    context["comparison"] = comparison
    return template.render(**context)


def tables(
    runs: Sequence[Run],
    frame: pd.DataFrame,
    envs: Environments,
    problems: list[str],
    cases: list[tuple[str, pd.DataFrame]],
    metadata: dict[str, CaseInfo],
) -> dict[str, Any]:
    """What the report shows but its plots and comparison."""
    return {
        "title": "ampmatrix report",
        "generated_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "runs": [{"name": run.name, "path": str(run.run_dir)} for run in runs],
        "environments": environments_view(runs),
        "problems": problems,
        "noise": noise_of(frame),
        "legend": LEGEND,
        "modes": [(mode.name, mode.meaning) for mode in MODES.values()],
        "matrix": matrix_view(frame, envs) if not frame.empty else MatrixView([], [], []),
        "versions": version_rows(frame) if not frame.empty else EMPTY_VERSIONS,
        "cases": [case_view(mine, case, metadata.get(case), envs) for case, mine in cases],
    }


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
