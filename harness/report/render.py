"""The HTML report: one self-contained file (inline CSS and plots) over one or many runs.

A pure function of results files; every string that comes from a run is escaped by
Jinja2's autoescaping.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pandas as pd
from jinja2 import Environment, PackageLoader, select_autoescape

from harness import storage
from harness.axes import MODES
from harness.records import DRIFT, LABELS
from harness.report import aggregate, plots
from harness.report.aggregate import Run
from harness.report.compare import Comparison
from harness.summary import noise_statement

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


def template_environment() -> Environment:
    return Environment(
        loader=PackageLoader("harness.report", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=False,
    )


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
    env_spans: list[tuple[str, int]]
    columns: list[tuple[str, str, str]]
    rows: list[dict[str, Any]]


def matrix_view(frame: pd.DataFrame) -> MatrixView:
    table = aggregate.summary_matrix(frame)
    if table.empty:
        return MatrixView([], [], [])
    columns = [tuple(c) for c in table.columns]
    spans: list[tuple[str, int]] = []
    for env, *_ in columns:
        if spans and spans[-1][0] == env:
            spans[-1] = (env, spans[-1][1] + 1)
        else:
            spans.append((env, 1))
    rows = []
    for (case, row), values in table.iterrows():
        cells = [
            {
                "label": v if isinstance(v, str) else "-",
                "css": css_for(v) if isinstance(v, str) else "missing",
            }
            for v in values
        ]
        rows.append({"case": case, "fix": row, "cells": cells})
    return MatrixView(spans, columns, rows)


def upstream_links(meta: dict[str, Any]) -> list[tuple[str, str]]:
    up = meta.get("upstream") or {}
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


def cell_rows(case_frame: pd.DataFrame) -> list[dict[str, Any]]:
    rows = []
    ordered = case_frame.sort_values(
        ["fix", "backend", "env", "dtype", "mode"], key=lambda s: s.map(lambda v: (v != "none", v))
    )
    for r in ordered.itertuples():
        rows.append(
            {
                "row": r.row,
                "env": r.env,
                "dtype": r.dtype,
                "mode": r.mode,
                "label": r.label,
                "css": css_for(r.label),
                "skip_reason": text_or_none(r.skip_reason),
                "out_dtype": text_or_none(r.out_dtype),
                "attn_dtype": text_or_none(r.attn_dtype),
                "rel_err": fmt(r.rel_err, ".2e"),
                "tolerance": fmt(r.tolerance, ".2e"),
                "median": fmt(None if pd.isna(r.median_s) else r.median_s * 1e3, ".3f")
                + (" ms" if pd.notna(r.median_s) else "")
                + ("~" if r.noisy is True else ""),
                "vs_control": fmt(r.vs_control, ".2f"),
                "vs_fastest": fmt(r.vs_fastest, ".2f"),
                "memory": fmt_bytes(r.peak_mem_bytes),
                "gflops": fmt(r.gflops, ".2f"),
                "peak_fraction": fmt(r.peak_fraction, ".1%"),
            }
        )
    return rows


def skipped_summary(case_frame: pd.DataFrame) -> list[tuple[str, int]]:
    skipped = case_frame[case_frame["outcome"] == "skipped"]
    counts = skipped.groupby(["env", "skip_reason"]).size()
    return [(f"{env}: {reason}", int(n)) for (env, reason), n in counts.items()]


def messages(case_frame: pd.DataFrame) -> list[dict[str, str]]:
    found = []
    for r in case_frame.itertuples():
        for text in (r.failure, r.note):
            if isinstance(text, str) and text:
                found.append({"where": f"{r.row} · {r.env} · {r.dtype}/{r.mode}", "text": text})
    return found


def case_view(frame: pd.DataFrame, case: str, meta: dict[str, Any] | None) -> dict[str, Any]:
    mine = frame[frame["case"] == case]
    recommendation = aggregate.recommend(frame, case)
    passing = set(aggregate.fixes_passing_everywhere(mine))
    return {
        "name": case,
        "meta": meta,
        "links": upstream_links(meta or {}),
        "recommendation": recommendation,
        "precision": [
            (fix, level.value)
            for fix, level in aggregate.precision_by_fix(mine).items()
            if level is not None
        ],
        "cpu_timed": bool(
            ((mine["device"] == "cpu") & mine["median_s"].notna()).any() if len(mine) else False
        ),
        "plot": plots.error_vs_time(mine, passing),
        "rows": cell_rows(mine[mine["outcome"] != "skipped"]),
        "skipped": skipped_summary(mine),
        "messages": messages(mine),
        "trails": trails(mine),
    }


def trails(case_frame: pd.DataFrame) -> list[dict[str, str]]:
    """The dtype trail of every cell that raised or drifted: where the wider dtype entered,
    where it failed, what the kernels computed in."""
    shown = case_frame[(case_frame["outcome"] == "raises") | case_frame["drift"].fillna(False)]
    return [
        {
            "where": f"{r.row} · {r.env} · {r.dtype}/{r.mode}",
            "label": r.label,
            "css": css_for(r.label),
            "promotion": text_or_none(r.promotion) or "no op left the cell's dtype",
            "failure": text_or_none(r.failure_site) or "-",
            "compute": text_or_none(r.compute) or "-",
        }
        for r in shown.itertuples()
    ]


def environment_facts(run: Run) -> list[tuple[str, str]]:
    env = run.env
    keys = (
        "torch_version",
        "torch_git_version",
        "cuda_version",
        "cudnn_version",
        "gpus",
        "cuda_driver",
        "cpu",
        "cpu_count",
        "load_average",
        "torch_num_threads",
        "workers",
        "threads_per_worker",
        "peak_gflops",
        "peak_measured_at",
        "packages",
        "flags",
        "timing",
        "python",
        "platform",
        "hostname",
        "harness_commit",
        "started_at",
        "finished_at",
        "command",
    )
    facts = [("results", str(run.run_dir))]
    for key in keys:
        if key in env:
            value = env[key]
            text = (
                " ".join(value)
                if key == "command"
                else (
                    json.dumps(value, sort_keys=True)
                    if isinstance(value, dict | list)
                    else str(value)
                )
            )
            facts.append((key, text))
    return facts


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
        "columns": [c.split("+")[0] for c in view.columns],
        "rows": [(case, list(values)) for case, values in view.iterrows()],
        "passing_columns": [c.split("+")[0] for c in passing.columns[:-1]],
        "passing_rows": [(case, fix, list(values)) for (case, fix), values in passing.iterrows()],
    }


def noise_of(frame: pd.DataFrame) -> str | None:
    """The summary's noise statement over the timed cells of the report."""
    if frame.empty:
        return None
    timed = frame[frame["median_s"].notna() & (frame["median_s"] > 0)]
    pairs = zip(timed["noisy"], timed["iqr_s"] / timed["median_s"], strict=True)
    return noise_statement([(bool(noisy), float(spread)) for noisy, spread in pairs])


def render_report(runs: Sequence[Run], comparison: Comparison | None = None) -> str:
    frame = aggregate.records_frame(runs)
    metadata: dict[str, dict[str, Any]] = {}
    problems = [p for run in runs for p in run.problems]
    for run in runs:
        try:
            metadata.update(storage.read_cases(run.run_dir, problems))
        except storage.ResultsError as error:
            problems.append(str(error))
    cases = sorted(frame["case"].unique()) if not frame.empty else []
    context = {
        "title": "ampmatrix report",
        "generated_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "runs": [
            {"name": run.name, "path": str(run.run_dir), "facts": environment_facts(run)}
            for run in runs
        ],
        "problems": problems,
        "noise": noise_of(frame),
        "legend": LEGEND,
        "modes": [(mode.name, mode.meaning) for mode in MODES.values()],
        "matrix": matrix_view(frame) if not frame.empty else MatrixView([], [], []),
        "versions": version_rows(frame) if not frame.empty else EMPTY_VERSIONS,
        "cases": [case_view(frame, case, metadata.get(case)) for case in cases],
        "comparison": comparison,
    }
    return template_environment().get_template("report.html.j2").render(**context)


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
    html = (
        template_environment()
        .from_string(INDEX_TEMPLATE)
        .render(
            reports=[
                (
                    p.name,
                    datetime.fromtimestamp(p.stat().st_mtime, timezone.utc).strftime(
                        "%Y-%m-%d %H:%M UTC"
                    ),
                )
                for p in reports
            ]
        )
    )
    index = folder / "index.html"
    if index.exists() and not made_by_ampmatrix(index):
        return index  # someone else's index.html: left as it is
    storage.write_atomic(index, html)
    return index


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
{% for name, when in reports %}<li><a href="{{ name }}">{{ name }}</a> ({{ when }})</li>
{% endfor %}</ul></body></html>
"""
