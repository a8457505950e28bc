"""The report's views, built from the runs: one self-contained report (inline CSS and
plots) over one or many runs, as the dataclasses of :mod:`harness.report.views`.

A pure function of results files. :mod:`harness.report.writing` turns the view into HTML
and writes it; a case's tables are :mod:`harness.report.case_tables`'.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pandas as pd

from harness.report import aggregate, plots, stages
from harness.report.aggregate import Run
from harness.report.case_tables import (
    ROW_COLUMNS,
    Styles,
    cell_rows,
    label_styles,
    messages,
    skipped_summary,
    trails,
)
from harness.report.compare import Comparison
from harness.report.drawing import Drawing
from harness.report.grouping import Environments
from harness.report.profiles import profile_views
from harness.report.summary import summary_view
from harness.report.views import (
    LEGEND,
    CaseView,
    EnvironmentsView,
    ReportView,
    RunView,
    StageCell,
    StageColumnRow,
    StageFixRow,
    StagesView,
    SummaryView,
    VersionsView,
)
from harness.results import storage
from harness.results.summary import noise_statement
from harness.schema.axes import MODES, SIZES, rank
from harness.schema.devices import CPU
from harness.schema.releases import torch_release
from harness.schema.run_files import CaseInfo

ISSUE_REF = re.compile(r"^(?P<repo>[\w.-]+/[\w.-]+)#(?P<number>\d+)$")

T = TypeVar("T")


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


def size_plots(mine: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """One error-vs-time plot per workload size that was timed (speed is never drawn
    across sizes), as (size, its points); the one plot of a case that ran one size."""
    sizes = sorted(mine["size"].unique(), key=lambda s: rank(SIZES, s)) if len(mine) else []
    timed = [s for s in sizes if mine.loc[mine["size"] == s, "median_s"].notna().any()]
    if len(sizes) <= 1 or not timed:
        return [("", plots.plotted(mine))]
    return [(size, plots.plotted(mine[mine["size"] == size])) for size in timed]


def case_view(
    mine: pd.DataFrame, case: str, meta: CaseInfo | None, envs: Environments, styles: Styles
) -> CaseView:
    """A case's section, but its plots (drawn meanwhile)."""
    universe = mine["env"].unique()
    return CaseView(
        name=case,
        meta=meta,
        links=upstream_links(meta),
        recommendation=aggregate.recommend(mine, case),
        precision=[
            (fix, level.value)
            for fix, level in aggregate.precision_by_fix(mine).items()
            if level is not None
        ],
        cpu_timed=bool(
            ((mine["device"] == CPU) & mine["median_s"].notna()).any() if len(mine) else False
        ),
        environments=envs.describe(universe, universe),
        cell_count=len(mine),
        rows=cell_rows(mine.loc[mine["outcome"] != "skipped", ROW_COLUMNS], envs, styles),
        skipped=skipped_summary(mine, envs),
        messages=messages(mine, envs),
        trails=trails(mine, envs, styles),
        stages=stage_view(mine, styles),
        profiles=profile_views(mine, envs),
    )


def stage_cell(outcome: stages.StageOutcome | None, styles: Styles) -> StageCell | None:
    if outcome is None:
        return None
    css = styles[outcome.label].css
    return StageCell(
        outcome.label, css, outcome.text, outcome.passed, outcome.cells, outcome.misses
    )


def stage_view(mine: pd.DataFrame, styles: Styles) -> StagesView | None:
    """Each fix across the stages the case ran (``harness.report.stages``), each fit's
    loss curve an inline SVG; None for a case that ran one stage."""
    view = stages.side_by_side(mine)
    if view is None:
        return None
    fixes = [
        StageFixRow(
            row["row"],
            [stage_cell(o, styles) for o in row["stages"]],
            row["time_ratio"],
            row["memory_ratio"],
            row["train_vs_fastest"],
        )
        for row in view.fixes
    ]
    return StagesView(
        stages=view.stages,
        fixes=fixes,
        columns=[stage_column(row, styles) for row in view.columns],
        across=view.across,
        costed=view.costed,
        fitted=view.curves,
    )


def stage_column(row: dict[str, Any], styles: Styles) -> StageColumnRow:
    """A fix in one column across the stages, with its fit's loss curve."""
    fit: stages.FitView | None = row["fit"]
    curve = ""
    if fit:
        passes = styles[fit.label].plain_pass
        curve = plots.loss_sparkline(fit.fit.losses, fit.fit.reference_losses, passes)
    return StageColumnRow(
        row=row["row"],
        dtype=row["dtype"],
        mode=row["mode"],
        stages=[stage_cell(o, styles) for o in row["stages"]],
        time_ratio=row["time_ratio"],
        memory_ratio=row["memory_ratio"],
        fit=fit,
        curve=curve,
    )


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


def version_rows(frame: pd.DataFrame) -> VersionsView:
    view = aggregate.version_view(frame)
    passing = aggregate.passing_by_version(frame)
    return VersionsView(
        columns=[torch_release(c) for c in view.columns],
        rows=[(case, list(values)) for case, values in view.iterrows()],
        passing_columns=[torch_release(c) for c in passing.columns[:-1]],
        passing_rows=[(case, fix, list(values)) for (case, fix), values in passing.iterrows()],
    )


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


def report_view_while(
    runs: Sequence[Run],
    comparison: Comparison | None,
    meanwhile: Callable[[], T],
    drawing: Drawing | None = None,
) -> tuple[ReportView, T]:
    """The report's view, and what ``meanwhile`` gave, called while the plots are drawn
    (in ``drawing``'s process, started by the caller before it read the runs, or started
    here, as the tables are built)."""
    frame = aggregate.records_frame(runs)
    problems = [p for run in runs for p in run.problems]
    metadata = case_metadata(runs, problems)
    cases = [(str(case), mine) for case, mine in frame.groupby("case")] if not frame.empty else []
    wanted = [size_plots(mine) for _, mine in cases]
    passing = [set(aggregate.fixes_passing_everywhere(mine)) for _, mine in cases]
    jobs = [
        (points, fixes)
        for sizes, fixes in zip(wanted, passing, strict=True)
        for _, points in sizes
    ]
    with drawing or Drawing() as drawer:  # drawn while the tables are computed
        drawer.give(jobs)
        view = tables(runs, frame, problems, cases, metadata)
        given = meanwhile()
        figures = iter(drawer.figures())
    with_plots = [
        replace(case, plots=[(size, next(figures)) for size, _ in sizes])
        for case, sizes in zip(view.cases, wanted, strict=True)
    ]
    return replace(view, cases=with_plots, comparison=comparison), given


def case_metadata(runs: Sequence[Run], problems: list[str]) -> dict[str, CaseInfo]:
    """Each case's metadata from the runs' ``cases.json``; what cannot be read is added to
    ``problems``."""
    metadata: dict[str, CaseInfo] = {}
    for run in runs:
        try:
            metadata.update(storage.read_cases(run.run_dir, problems))
        except storage.ResultsError as error:
            problems.append(str(error))
    return metadata


def tables(
    runs: Sequence[Run],
    frame: pd.DataFrame,
    problems: list[str],
    cases: list[tuple[str, pd.DataFrame]],
    metadata: dict[str, CaseInfo],
) -> ReportView:
    """What the report shows but its plots and comparison."""
    envs = Environments(frame)
    styles = label_styles(frame)
    views = [case_view(mine, case, metadata.get(case), envs, styles) for case, mine in cases]
    recommended = {view.name: view.recommendation.fix for view in views}
    return ReportView(
        title="ampmatrix report",
        generated_at=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        runs=[RunView(run.name, str(run.run_dir)) for run in runs],
        environments=environments_view(runs),
        problems=problems,
        noise=noise_of(frame),
        legend=LEGEND,
        modes=[(mode.name, mode.meaning) for mode in MODES.values()],
        summary=summary_view(frame, envs, styles, recommended)
        if not frame.empty
        else SummaryView(),
        versions=version_rows(frame) if not frame.empty else VersionsView(),
        cases=views,
    )
