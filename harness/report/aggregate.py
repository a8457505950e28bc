"""From runs to the tables a report shows: a pure function of the runs (pandas).

Nothing here runs a case, nor reads a file: the runs and their rows are read by
:mod:`harness.report.runs` (its names are served here too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, compress

import pandas as pd

from harness.report import stages
from harness.report.runs import Run as Run
from harness.report.runs import load_run as load_run
from harness.report.runs import load_runs as load_runs
from harness.report.runs import load_runs_for_report as load_runs_for_report
from harness.report.runs import run_columns
from harness.report.stages import StageFailure
from harness.results.computed_in import ComputedIn, fix_computed_in
from harness.results.search import release_key
from harness.schema import gpus
from harness.schema.axes import (
    CONTROL_FIX,
    CONTROL_MODE,
    DTYPES,
    FORWARD_STAGE,
    MODE_NAMES,
    SIZES,
    SMALL_SIZE,
    STAGES,
    rank,
)
from harness.schema.records import Outcome
from harness.schema.releases import torch_release


def environment_labels(frame: pd.DataFrame, show_host: bool | pd.Series) -> pd.Series:
    """``torch 2.4.1 · cpu`` or ``torch 2.11.0 · H100 80GB HBM3 (sm90)``, with `` · host``
    where ``show_host`` (one flag, or one per row: see :func:`hosts_shown`)."""
    shown = show_host if isinstance(show_host, pd.Series) else pd.Series(show_host, frame.index)
    devices = frame["device_label"] if "device_label" in frame else frame["device"]
    columns = [frame["torch_version"].tolist(), devices.tolist(), frame["hostname"].tolist()]
    places = list(zip(*columns, shown.tolist(), strict=True))
    labels = {place: environment_label(*place) for place in set(places)}
    return pd.Series([labels[place] for place in places], index=frame.index, dtype=str)


def environment_label(torch_version: str, device: str, hostname: str, show_host: bool) -> str:
    """An environment column's name; ``device`` is a device label (``cpu``, or the GPU's
    name: :func:`harness.schema.gpus.device_label`)."""
    label = gpus.environment_label(torch_version, device)
    return f"{label} · {hostname}" if show_host else label


def hosts_shown(frame: pd.DataFrame) -> pd.Series:
    """Per row, whether its column names the host: where a device label (``cpu``, a GPU's
    name) was measured on several hosts, the host tells those columns apart; an A100
    host's and an H100 host's GPU columns are told apart by their GPUs."""
    devices = frame["device_label"] if "device_label" in frame else frame["device"]
    hosts = frame.groupby(devices)["hostname"].transform("nunique")
    return hosts > 1


def records_frame(runs: Sequence[Run]) -> pd.DataFrame:
    """One row per cell per run, with its environment label and speed ratios."""
    columns = [run.rows if run.rows is not None else run_columns(run) for run in runs]
    columns = [found for found in columns if found]
    if not columns:
        return pd.DataFrame()
    frame = pd.DataFrame(
        {name: list(chain.from_iterable(found[name] for found in columns)) for name in columns[0]}
    )
    show_host = hosts_shown(frame)
    frame["env"] = environment_labels(frame, show_host)
    frame["base_row"] = base_row_labels(frame)
    frame["row"] = row_labels(frame)
    # the host an environment's label names: none where its device label tells it apart
    frame["host"] = frame["hostname"].where(show_host, "")
    return frame


def base_row_labels(frame: pd.DataFrame) -> pd.Series:
    """``fix``, or ``fix [backend]`` for cases that ran several backends, with
    `` @upstream`` for a cell of a workload size other than ``small`` (every figure says
    which size it is from): a fix's row at every stage."""
    backends = frame.groupby("case")["backend"].transform("nunique")
    rows = frame["row_with_backend"].where(backends > 1, frame["row_without_backend"])
    sized = frame["size"] != SMALL_SIZE
    return rows.where(~sized, rows + " @" + frame["size"])


def row_labels(frame: pd.DataFrame) -> pd.Series:
    """The base row (:func:`base_row_labels`), with `` · train`` for a cell of a stage
    other than ``forward`` (the stage every case has, whose rows are the case's own)."""
    rows = frame["base_row"]
    trained = frame["stage"] != FORWARD_STAGE
    return rows.where(~trained, rows + " · " + frame["stage"])


def env_order(frame: pd.DataFrame) -> list[str]:
    envs = frame.drop_duplicates("env")[["env", "torch_version", "device"]]
    ordered = sorted(
        envs.itertuples(), key=lambda e: (release_key(e.torch_version), e.device, e.env)
    )
    return [e.env for e in ordered]


def column_order(frame: pd.DataFrame) -> list[tuple[str, str, str]]:
    keys = frame.drop_duplicates(["env", "dtype", "mode"])[["env", "dtype", "mode"]]
    envs = env_order(frame)
    return sorted(
        (tuple(k) for k in keys.itertuples(index=False)),
        key=lambda k: (envs.index(k[0]), rank(DTYPES, k[1]), rank(MODE_NAMES, k[2])),
    )


def row_order(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """(case, row) pairs: cases by name, the upstream path ``none`` first in each, and a
    fix's stages next to each other (forward, train, fit), so each fix reads across
    them."""
    columns = ["case", "row", "base_row", "fix", "size", "stage"]
    pairs = frame.drop_duplicates(["case", "row"])[columns]
    ordered = sorted(
        pairs.itertuples(index=False),
        key=lambda p: (
            p.case,
            rank(SIZES, p.size),
            p.fix != CONTROL_FIX,
            p.base_row,
            rank(STAGES, p.stage),
        ),
    )
    return [(p.case, p.row) for p in ordered]


#: What the summary matrix reads of the frame (its filters copy only these).
MATRIX_COLUMNS = ["case", "row", "base_row", "env", "dtype", "mode", "label", "fix", "size",
                  "stage", "torch_version", "device"]  # fmt: skip


def summary_matrix(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows (case, fix), columns (environment, dtype, mode), values the outcome label.

    Cells skipped everywhere in a column are left out so the matrix shows what ran.
    """
    ran = frame.loc[frame["outcome"] != Outcome.SKIPPED.value, MATRIX_COLUMNS]
    if ran.empty:
        return pd.DataFrame()
    # each cell's first label (a pivot table's "first", without its aggregation machinery);
    # the first of each row and column is among them, in the same order: they order them
    keys, columns = ["case", "row", "env", "dtype", "mode"], ["env", "dtype", "mode"]
    firsts = ran.drop_duplicates(keys)
    table = firsts.set_index(keys)["label"].unstack(columns)
    return table.reindex(index=row_order(firsts), columns=column_order(firsts))


def version_view(frame: pd.DataFrame) -> pd.DataFrame:
    """For each case: in which torch versions its upstream path (fix ``none``) reproduces
    the known failure, raised or silent (a record's ``reproduces``), and in which dtypes."""
    upstream = frame.loc[
        (frame["fix"] == CONTROL_FIX) & (frame["outcome"] != Outcome.SKIPPED.value),
        ["case", "torch_version", "reproduces", "dtype", "mode"],
    ]
    versions = sorted(upstream["torch_version"].unique(), key=release_key)
    by = ["case", "torch_version"]
    cells = upstream.groupby(by).size().to_dict()
    shown = upstream["reproduces"].eq(True).fillna(False).astype(bool)  # None, NA: not shown
    repro = upstream[shown].drop(columns="reproduces")
    reproduced = repro.groupby(by).size().to_dict()
    where: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for case, version, dtype, mode in repro.drop_duplicates().itertuples(index=False):
        where.setdefault((case, version), set()).add((dtype, mode))
    rows = {
        case: {
            v: _reproduction_text(
                cells.get((case, v), 0), reproduced.get((case, v), 0), where.get((case, v), set())
            )
            for v in versions
        }
        for case in sorted(upstream["case"].unique())
    }
    return pd.DataFrame.from_dict(rows, orient="index", columns=versions).fillna("not run")


def passing_by_version(frame: pd.DataFrame) -> pd.DataFrame:
    """Rows (case, fix), a column per torch version measured (``passed/ran``: cells that
    pass with no flag, of those that ran), and ``first passing``: the oldest version from
    which the fix passes in every cell that ran, in every later version measured too."""
    ran = frame.loc[
        frame["outcome"] != Outcome.SKIPPED.value, ["case", "fix", "torch_version", "passed"]
    ]
    versions = sorted(ran["torch_version"].unique(), key=release_key)
    counted = ran.groupby(["case", "fix", "torch_version"])["passed"].agg(["sum", "size"])
    rows = {}
    for (case, fix), per_version in counted.groupby(level=["case", "fix"]):
        found = {v: (int(n), int(of)) for (_, _, v), n, of in per_version.itertuples()}
        by_version = {v: found.get(v, (0, 0)) for v in versions}
        counts = {v: f"{n}/{of}" if of else "not run" for v, (n, of) in by_version.items()}
        rows[case, fix] = {**counts, FIRST_PASSING: _first_passing(by_version)}
    columns = [*versions, FIRST_PASSING]
    return pd.DataFrame.from_dict(rows, orient="index", columns=columns)


FIRST_PASSING = "first passing"


def _first_passing(by_version: dict[str, tuple[int, int]]) -> str:
    """From (cells passing, cells that ran) per version, oldest first."""
    measured = [(v, counts) for v, counts in by_version.items() if counts[1]]
    first = None
    for version, (passed, ran) in measured:
        all_pass = passed == ran
        first = (first or version) if all_pass else None
    if first is None:
        return f"fails on every release through {torch_release(measured[-1][0])}"
    if first == measured[0][0]:
        return f"passes on every release from {torch_release(first)}"
    return torch_release(first)


def _reproduction_text(cells: int, reproduced: int, where: set[tuple[str, str]]) -> str:
    """Of the ``cells`` that ran, ``reproduced`` showed the known failure (raised it, or
    showed its silent symptoms), in the (dtype, mode) columns ``where``."""
    if not cells:
        return "not run"
    if not reproduced:
        return "does not reproduce"
    ordered = sorted(where, key=lambda column: (rank(DTYPES, column[0]), column))
    shown = ", ".join(f"{dtype}/{mode}" for dtype, mode in ordered)
    return f"reproduces ({shown}); {reproduced} of {cells} cells"


def fixes_passing_everywhere(case_frame: pd.DataFrame) -> list[str]:
    """Fixes other than ``none`` whose every cell that ran passed, with no flag, and that
    ran wherever the upstream path or another fix ran (:func:`narrower_fixes`)."""
    passing = fixes_passing_where_they_ran(case_frame)
    narrower = narrower_fixes(case_frame, passing)
    return [fix for fix in passing if fix not in narrower]


def fixes_passing_where_they_ran(case_frame: pd.DataFrame) -> list[str]:
    """Fixes other than ``none`` whose every cell that ran passed, with no flag."""
    ran = case_frame.loc[
        (case_frame["outcome"] != Outcome.SKIPPED.value) & (case_frame["fix"] != CONTROL_FIX),
        ["fix", "passed"],
    ]
    passing = ran["passed"].astype(bool).groupby(ran["fix"]).all()
    return [str(fix) for fix, everywhere in passing.items() if everywhere]


#: What tells a fix's cells apart: a fix ran as widely as another where it ran in each of
#: the other's places (environment, device, size, stage, dtype, mode, backend, compile).
PLACE_COLUMNS = ["env", "device", "size", "stage", "dtype", "mode", "backend", "compile"]


def places_by_fix(case_frame: pd.DataFrame) -> dict[str, frozenset[tuple[str, ...]]]:
    """Where each fix (``none`` too) ran: skipped cells aside, and the float32 control,
    which only the upstream path ran before every fix did. Read off the columns as lists,
    each distinct (fix, place) once (a frame per fix cost more than the rest of a case's
    recommendation; a nightly repeats each place in every environment)."""
    ran = (case_frame["outcome"] != Outcome.SKIPPED.value) & (case_frame["mode"] != CONTROL_MODE)
    columns = [case_frame[c].tolist() for c in ("fix", *PLACE_COLUMNS)]
    distinct = set(compress(zip(*columns, strict=True), ran.tolist()))
    found: dict[str, set[tuple[str, ...]]] = {}
    for fix, *place in distinct:
        found.setdefault(str(fix), set()).add(tuple(map(str, place)))
    return {fix: frozenset(places) for fix, places in sorted(found.items())}


def narrower_fixes(case_frame: pd.DataFrame, fixes: Sequence[str]) -> dict[str, str]:
    """Those of ``fixes`` that ran in fewer places than the upstream path and the other
    fixes together (a fix narrowed to some modes, one that another run left out), each with
    what it missed: "passes in all its cells" says nothing of the cells it never ran, where
    the bug it fixes may be (a fix that scales no loss, run only where no scaler is
    needed)."""
    places = places_by_fix(case_frame)
    measured: frozenset[tuple[str, ...]] = frozenset().union(*places.values())
    return {
        fix: missed_places(places.get(fix, frozenset()), measured)
        for fix in fixes
        if not measured <= places.get(fix, frozenset())
    }


def missed_places(mine: frozenset[tuple[str, ...]], measured: frozenset[tuple[str, ...]]) -> str:
    """``passes in the 4 cells it ran, of the 8 the upstream path and the other fixes ran
    (never mode autocast)``: the values of an axis it never ran in, where there are any."""
    missing = measured - mine
    never = [
        f"{column} {', '.join(sorted(theirs))}"
        for i, column in enumerate(PLACE_COLUMNS)
        if (theirs := {p[i] for p in missing} - {p[i] for p in mine})
    ]
    shown = f" (never {'; '.join(never)})" if never else ""
    return (
        f"passes in the {len(mine)} cells it ran, of the {len(measured)} the upstream path "
        f"and the other fixes ran{shown}"
    )


@dataclass(frozen=True)
class Recommendation:
    case: str
    fix: str | None
    reason: str
    #: How the fix was chosen, in one sentence.
    criterion: str = ""
    #: Fixes that pass everywhere by falling back to float32, each with its cost.
    fallbacks: tuple[str, ...] = ()
    #: Fixes that pass inference (their first stage) but fail a later stage, with why.
    stage_failures: tuple[StageFailure, ...] = ()
    #: Fixes that pass where they ran but ran fewer cells than the others: (fix, what it
    #: missed), ``passes in the 4 cells it ran, of the 8 ...``.
    narrower: tuple[tuple[str, str], ...] = ()


CRITERION = (
    "Among the fixes that ran in every cell the upstream path or another fix ran (the fp32 "
    "control aside), pass in each and keep the matmuls and attention in the cell's "
    "half-precision dtype, the one with the lowest median error and time (the sum of the "
    "two ranks)."
)
FALLBACK_CRITERION = (
    "No fix passes everywhere in half precision: among the fp32 fallbacks that ran in every "
    "cell the upstream path or another fix ran and pass in each, the one with the lowest "
    "median error and time."
)


def precision_by_fix(case_frame: pd.DataFrame) -> dict[str, ComputedIn | None]:
    """What each fix computed in over the low-precision cells that ran
    (``harness.results.computed_in``)."""
    by_fix = case_frame.groupby("fix")["computed_in"]
    return {str(fix): fix_computed_in(levels.unique()) for fix, levels in by_fix}


#: What a recommendation reads of the frame.
RECOMMEND_COLUMNS = list(dict.fromkeys([
    "fix", "outcome", "passed", "computed_in", "rel_err", "vs_fastest", "env", "size", "dtype",
    "mode", "median_s", "peak_mem_bytes", "stage", "device", "backend", "compile",
    *stages.STAGE_COLUMNS,
]))  # fmt: skip


def stage_criterion(ran: Sequence[str]) -> str:
    """What a case that ran several stages adds to its criterion."""
    first = stages.noun(ran[0])
    return (
        f" A fix must pass at every stage that ran ({', '.join(ran)}); error and time are "
        f"compared at the {first}."
    )


def recommend(frame: pd.DataFrame, case: str) -> Recommendation:
    """The fix that passes in every environment measured, at every stage that ran, keeps
    half precision, and has the lowest error and time.

    Candidates are fixes other than ``none`` whose every cell that ran passed (at every
    stage: a fix that passes inference and stalls in training is no candidate, and is named
    with the reason) and that ran in every cell the upstream path or another fix ran (one
    that ran fewer is named with what it missed), and of those the ones that do not fall
    back to float32; only when
    none is left are the fallbacks considered. Among the candidates the one with the lowest
    median error and the lowest median time (relative to the fastest passing fix), both at
    the first stage that ran (inference), wins; when no single fix is best at both, the sum
    of its two ranks decides and the reason says what was traded.
    """
    mine = frame.loc[
        (frame["case"] == case) & (frame["outcome"] != Outcome.SKIPPED.value), RECOMMEND_COLUMNS
    ]
    ran = stages.stages_ran(mine)
    staged = len(ran) > 1
    failures = stages.stage_failures(mine)
    passing = fixes_passing_where_they_ran(mine)
    narrower = narrower_fixes(mine, passing)
    candidates = [fix for fix in passing if fix not in narrower]  # fixes_passing_everywhere
    if not candidates:
        where = "at every stage and " if staged else ""
        reason = f"no fix passes {where}in every environment measured"
        if narrower:
            reason = (
                f"no fix passes {where}in every cell measured: {', '.join(narrower)} pass "
                "where they ran, in fewer cells than the others"
            )
        return Recommendation(
            case, None, reason, stage_failures=failures, narrower=tuple(narrower.items())
        )
    levels = precision_by_fix(mine)
    fallbacks = [f for f in candidates if levels.get(f) is ComputedIn.FALLBACK]
    in_half = [f for f in candidates if f not in fallbacks]
    stats = fix_stats(mine, in_half or fallbacks, ran[0] if staged else None)
    ranked = stats.sort_values(["score", "time"])
    best, name = ranked.iloc[0], str(ranked.index[0])
    costs = tuple(fallback_cost(mine, f, name) for f in fallbacks if f != name)
    criterion = CRITERION if in_half else FALLBACK_CRITERION
    return Recommendation(
        case,
        name,
        _reason(name, best, stats, tuple(ran) if staged else ()),
        criterion + (stage_criterion(ran) if staged else ""),
        costs,
        failures,
        tuple(narrower.items()),
    )


def fix_stats(case_frame: pd.DataFrame, pool: list[str], judged_stage: str | None) -> pd.DataFrame:
    """Per fix of ``pool``: its median error and time (at ``judged_stage`` where given,
    the first of several stages), its cells and environments, and its score (the sum of its
    error's and its time's ranks; no time ranks last)."""
    judged = (
        case_frame if judged_stage is None else case_frame[case_frame["stage"] == judged_stage]
    )
    stats = (
        judged[judged["fix"].isin(pool)]
        .groupby("fix")
        .agg(error=("rel_err", "median"), time=("vs_fastest", "median"))
        .join(
            case_frame[case_frame["fix"].isin(pool)]
            .groupby("fix")
            .agg(cells=("fix", "size"), envs=("env", "nunique")),
            how="right",
        )
    )
    stats["score"] = stats["error"].rank() + stats["time"].rank(na_option="bottom")
    return stats


def fallback_cost(case_frame: pd.DataFrame, fallback: str, chosen: str) -> str:
    """``fp32: an fp32 fallback; 1.8x the time and 2.0x the memory of cast-kv-to-q``,
    medians over the columns where both were measured."""
    columns = ["env", "size", "stage", "dtype", "mode"]  # never a ratio across sizes or stages
    pair = case_frame[case_frame["fix"].isin([fallback, chosen])]
    by_column = pair.pivot_table(
        index=columns, columns="fix", values=["median_s", "peak_mem_bytes"], aggfunc="median"
    )
    parts = []
    for value, what in (("median_s", "the time"), ("peak_mem_bytes", "the memory")):
        if value in by_column and {fallback, chosen} <= set(by_column[value].columns):
            ratio = (by_column[value][fallback] / by_column[value][chosen]).median()
            if pd.notna(ratio):
                parts.append(f"{ratio:.2f}x {what}")
    cost = f"; {' and '.join(parts)} of {chosen}" if parts else ""
    return f"{fallback}: passes by falling back to fp32{cost}"


def best_of(values: pd.Series) -> str | None:
    """The index of the smallest value, or None when there are only missing values."""
    return str(values.idxmin()) if values.notna().any() else None


def _reason(name: str, best: pd.Series, stats: pd.DataFrame, staged: tuple[str, ...]) -> str:
    """Why ``name`` won; ``staged``: the stages the case ran, where it ran several."""
    at_stages = f" at every stage ({', '.join(staged)})" if staged else ""
    at_first = f" at the {stages.noun(staged[0])}" if staged else ""
    parts = [
        f"passes in all {int(best['cells'])} cells{at_stages} over {int(best['envs'])} "
        f"environment(s); median error {best['error']:.2e}{at_first}"
    ]
    if pd.notna(best["time"]):
        parts.append(f"median time {best['time']:.2f}x the fastest passing fix")
    lowest_error, fastest = best_of(stats["error"]), best_of(stats["time"])
    # a tie is no trade: the fix chosen is as accurate (as fast) as the best
    if lowest_error is not None and not stats.loc[lowest_error, "error"] < best["error"]:
        lowest_error = name
    if fastest is not None and not stats.loc[fastest, "time"] < best["time"]:
        fastest = name
    if lowest_error not in (None, name):
        parts.append(
            f"{lowest_error} is more accurate ({stats.loc[lowest_error, 'error']:.2e}) but slower"
        )
    if fastest not in (None, name):
        parts.append(f"{fastest} is faster ({stats.loc[fastest, 'time']:.2f}x) but less accurate")
    if best_of(stats["time"]) is None:
        parts.append("no timing in these runs")
    others = len(stats) - 1
    parts.append(
        f"{others} other fix(es) also pass everywhere"
        if others
        else "the only fix that passes everywhere"
    )
    return "; ".join(parts)
