"""From results files to the tables a report shows: a pure function of the runs (pandas).

Nothing here runs a case. Runs are read tolerantly: a line or file that cannot be read is
listed as a problem (file and line), and everything valid is still used.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import operator
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import pandas as pd

from harness.report import stages
from harness.report.stages import StageFailure
from harness.results import storage
from harness.results.computed_in import ComputedIn, computed_in, fix_computed_in
from harness.results.search import release_key
from harness.results.speed import SpeedRatios, record_key, speed_ratios
from harness.results.summary import failure_line
from harness.schema import gpus
from harness.schema.axes import (
    CONTROL_FIX,
    DTYPES,
    FORWARD_STAGE,
    MODE_NAMES,
    SIZES,
    SMALL_SIZE,
    STAGES,
    Cell,
    rank,
)
from harness.schema.records import (
    DRIFT,
    CellRecord,
    Outcome,
    base_label,
    outcome_label,
)
from harness.schema.releases import torch_release
from harness.schema.run_files import Environment


@dataclass
class Run:
    """One results directory as read: its environment, records and reading problems."""

    run_dir: Path
    env: Environment
    records: list[CellRecord]
    problems: list[str] = field(default_factory=list)
    #: The report's rows of the records, column by column (``run_columns``), where
    #: computed ahead (then ``records`` may be dropped: columns are cheaper to keep and to
    #: send between processes).
    rows: dict[str, list[Any]] | None = None

    @property
    def name(self) -> str:
        return self.run_dir.name


def load_run(run_dir: Path) -> Run:
    problems: list[str] = []
    try:
        env = storage.read_env(run_dir, problems)
    except storage.ResultsError as error:
        env, problems = Environment(), [str(error)]
    records = storage.read_records(run_dir, problems)
    if not records:
        problems.append(f"{run_dir / storage.CELLS_FILE}: no records (an empty run)")
    return Run(run_dir, env, records, problems)


def load_runs(run_dirs: Sequence[Path]) -> list[Run]:
    return [load_run(Path(d)) for d in run_dirs]


#: Results files beyond this many bytes in all are read by several processes at once.
PARALLEL_BYTES = 4_000_000


def load_runs_for_report(run_dirs: Sequence[Path], processes: int | None = None) -> list[Run]:
    """The runs with their report rows computed and their records dropped: what a report
    needs. Many runs (a nightly over every release) are read by one process per core,
    since reading and checking a record is most of a large report's time."""
    dirs = [Path(d) for d in run_dirs]
    processes = min(processes or os.cpu_count() or 1, len(dirs))
    with storage.paused_gc():  # the rows received are no garbage: nothing to collect
        if processes < 2 or results_bytes(dirs) < PARALLEL_BYTES:
            return [load_rows(d) for d in dirs]
        context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        # small chunks: no process left alone at the end
        with context.Pool(processes) as pool:
            return pool.map(load_rows, dirs, chunksize=max(1, len(dirs) // (processes * 16)))


def results_bytes(dirs: Sequence[Path]) -> int:
    files = (d / storage.CELLS_FILE for d in dirs)
    return sum(f.stat().st_size for f in files if f.is_file())


def load_rows(run_dir: Path) -> Run:
    """One run as a report reads it: rows instead of records."""
    with storage.paused_gc():
        run = load_run(run_dir)
        return Run(run.run_dir, run.env, [], run.problems, shared(run_columns(run)))


def shared(columns: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """``columns`` with equal values as one object: a run repeats its names, labels and
    messages in every row, and one object is sent between processes (pickled once) and held
    once, where a copy per row made a large report's memory."""
    seen: dict[str | None, str | None] = {}
    return {
        name: list(map(seen.setdefault, values, values))
        if TEXT.issuperset(map(type, values))
        else values
        for name, values in columns.items()
    }


#: The types of a column of text (numbers are left as they are: ``1 == 1.0 == True``).
TEXT = frozenset((str, type(None)))


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


#: The fields of a cell, read once: ``dataclasses.asdict`` per record costs more than
#: the rest of a frame row.
CELL_FIELDS = tuple(f.name for f in dataclasses.fields(Cell))
cell_values = operator.attrgetter(*CELL_FIELDS)


def record_row(
    record: CellRecord, run: tuple[str, str], ratio: SpeedRatios | None
) -> dict[str, Any]:
    """A record's row: its cell, outcome and figures, and its ``run``'s name and host."""
    perf, numerics, cell = record.perf, record.numerics, record.cell
    return {
        **dict(zip(CELL_FIELDS, cell_values(cell), strict=True)),
        "row_with_backend": cell.row(show_backend=True),
        "row_without_backend": cell.row(show_backend=False),
        "run": run[0],
        "torch_version": record.torch_version,
        "hostname": run[1],
        "outcome": record.outcome.value,
        "label": outcome_label(record),
        "base_label": base_label(record),
        "failure": failure_line(record),
        "promotion": record.trail.promotion.describe()
        if record.trail and record.trail.promotion
        else None,
        "failure_site": record.trail.failure() if record.trail else None,
        "compute": "; ".join(
            f"{kind}: {'+'.join(dtypes)}" for kind, dtypes in record.trail.compute_dtypes.items()
        )
        if record.trail
        else None,
        "drift": any(flag.kind == DRIFT for flag in record.flags),
        "reproduces": record.reproduces,
        "error_type": record.error_type,
        "error_message": record.error_message,
        "skip_reason": record.skip_reason,
        "note": record.notes_text,
        "out_dtype": record.out_dtype,
        "attn_dtype": record.attn_dtype,
        "computed_in": computed_in(record),
        "rel_err": numerics.rel_err if numerics else None,
        "tolerance": numerics.tolerance if numerics else None,
        "median_s": perf.speed_s if perf else None,
        "launch_bound": perf.launch_bound if perf else None,
        "iqr_s": perf.time_iqr_s if perf else None,
        "noisy": perf.time_noisy if perf else None,
        "peak_mem_bytes": perf.peak_mem_bytes if perf else None,
        "gflops": perf.gflops if perf else None,
        "peak_fraction": perf.peak_fraction if perf else None,
        "vs_control": ratio.vs_control if ratio else None,
        "vs_fastest": ratio.vs_fastest if ratio else None,
        "fit": record.fit,
    }


def run_columns(run: Run) -> dict[str, list[Any]]:
    """A row per record of the run, with its speed ratios (computed within the run), column
    by column (empty for a run without records)."""
    ratios = speed_ratios(run.records)
    names = (run.name, "?" if run.env.hostname is None else run.env.hostname)
    rows = [record_row(r, names, ratios.get(record_key(r))) for r in run.records]
    if not rows:
        return {}
    # every row has the same keys in the same order: the values, transposed
    values = zip(*(row.values() for row in rows), strict=True)
    columns = dict(zip(rows[0], map(list, values), strict=True))
    columns["device_label"] = device_labels(run)
    return columns


def device_labels(run: Run) -> list[str]:
    """Per record, its device as the report names it: by the GPU the run recorded at that
    device (``H100 80GB HBM3 (sm90)``), ``cpu`` for the CPU."""
    named = {d: gpus.device_label(run.env.gpus, d) for d in {r.cell.device for r in run.records}}
    return [named[record.cell.device] for record in run.records]


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
    other than ``forward``."""
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
    repro = upstream[upstream["reproduces"].eq(True)].drop(columns="reproduces")
    reproduced = repro.groupby(by).size().to_dict()
    where: dict[tuple[str, str], set[str]] = {}
    for case, version, dtype, mode in repro.drop_duplicates().itertuples(index=False):
        where.setdefault((case, version), set()).add(f"{dtype}/{mode}")
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
        frame["outcome"] != Outcome.SKIPPED.value, ["case", "fix", "torch_version", "label"]
    ]
    versions = sorted(ran["torch_version"].unique(), key=release_key)
    counted = (
        ran.assign(passed=ran["label"] == "passes")
        .groupby(["case", "fix", "torch_version"])["passed"]
        .agg(["sum", "size"])
    )
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


def _reproduction_text(cells: int, reproduced: int, where: set[str]) -> str:
    """Of the ``cells`` that ran, ``reproduced`` showed the known failure (raised it, or
    showed its silent symptoms), in the ``dtype/mode`` columns ``where``."""
    if not cells:
        return "not run"
    if not reproduced:
        return "does not reproduce"
    shown = sorted(where, key=lambda k: (rank(DTYPES, k.split("/")[0]), k))
    return f"reproduces ({', '.join(shown)}); {reproduced} of {cells} cells"


def fixes_passing_everywhere(case_frame: pd.DataFrame) -> list[str]:
    """Fixes other than ``none`` whose every cell that ran passed, with no flag."""
    ran = case_frame.loc[
        (case_frame["outcome"] != Outcome.SKIPPED.value) & (case_frame["fix"] != CONTROL_FIX),
        ["fix", "label"],
    ]
    passing = (ran["label"] == "passes").groupby(ran["fix"]).all()
    return [str(fix) for fix, everywhere in passing.items() if everywhere]


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


CRITERION = (
    "Among the fixes that pass in every cell measured and keep the matmuls and attention in "
    "the cell's half-precision dtype, the one with the lowest median error and time "
    "(the sum of the two ranks)."
)
FALLBACK_CRITERION = (
    "No fix passes everywhere in half precision: among the fp32 fallbacks that pass in every "
    "cell measured, the one with the lowest median error and time."
)


def precision_by_fix(case_frame: pd.DataFrame) -> dict[str, ComputedIn | None]:
    """What each fix computed in over the low-precision cells that ran
    (``harness.results.computed_in``)."""
    by_fix = case_frame.groupby("fix")["computed_in"]
    return {str(fix): fix_computed_in(levels.unique()) for fix, levels in by_fix}


#: What a recommendation reads of the frame.
RECOMMEND_COLUMNS = list(dict.fromkeys([
    "fix", "outcome", "label", "computed_in", "rel_err", "vs_fastest", "env", "size", "dtype",
    "mode", "median_s", "peak_mem_bytes", "stage", *stages.STAGE_COLUMNS,
]))  # fmt: skip


def stage_criterion(ran: Sequence[str]) -> str:
    """What a case that ran several stages adds to its criterion."""
    first = stages.NOUN.get(ran[0], ran[0])
    return (
        f" A fix must pass at every stage that ran ({', '.join(ran)}); error and time are "
        f"compared at the {first}."
    )


def recommend(frame: pd.DataFrame, case: str) -> Recommendation:
    """The fix that passes in every environment measured, at every stage that ran, keeps
    half precision, and has the lowest error and time.

    Candidates are fixes other than ``none`` whose every cell that ran passed (at every
    stage: a fix that passes inference and stalls in training is no candidate, and is named
    with the reason), and of those the ones that do not fall back to float32; only when
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
    candidates = fixes_passing_everywhere(mine)
    if not candidates:
        where = "at every stage and " if staged else ""
        reason = f"no fix passes {where}in every environment measured"
        return Recommendation(case, None, reason, stage_failures=failures)
    levels = precision_by_fix(mine)
    fallbacks = [f for f in candidates if levels.get(f) is ComputedIn.FALLBACK]
    in_half = [f for f in candidates if f not in fallbacks]
    pool = in_half or fallbacks
    judged = mine[mine["stage"] == ran[0]] if staged else mine
    stats = (
        judged[judged["fix"].isin(pool)]
        .groupby("fix")
        .agg(error=("rel_err", "median"), time=("vs_fastest", "median"))
        .join(
            mine[mine["fix"].isin(pool)]
            .groupby("fix")
            .agg(cells=("fix", "size"), envs=("env", "nunique")),
            how="right",
        )
    )
    stats["score"] = stats["error"].rank() + stats["time"].rank(na_option="bottom")
    best = stats.sort_values(["score", "time"]).iloc[0]
    name = str(stats.sort_values(["score", "time"]).index[0])
    costs = tuple(fallback_cost(mine, f, name) for f in fallbacks if f != name)
    criterion = CRITERION if in_half else FALLBACK_CRITERION
    return Recommendation(
        case,
        name,
        _reason(name, best, stats, tuple(ran) if staged else ()),
        criterion + (stage_criterion(ran) if staged else ""),
        costs,
        failures,
    )


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
    at_first = f" at the {stages.NOUN.get(staged[0], staged[0])}" if staged else ""
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
