"""``compare BASE HEAD``: what changed between two runs, cell by cell.

Outcome changes: a cell that passed and now does not is a regression; one that now passes
is an improvement; anything else (a skip, another error) is a change.

Speed changes are judged against the run-to-run noise of this pair of runs, not only
across samples. The samples of one run share that run's machine state: two back-to-back
runs of the same code on one CPU differed by up to 1.58x with p down to 4e-9, and beside a
busy core every cell of the second run, the fp32 control's among them, was about 2x
slower. A test across the samples of two runs cannot tell a slower fix from a busier
machine; what can is that a busier machine slows every cell of a device alike. So, per
device:

* the **machine factor** is the median head/base time ratio of every cell timed in both
  runs (the median of all cells rather than the fp32 controls': a case has one control per
  column, a run many cells, and a median stands as long as fewer than half of them
  changed); each cell's ratio is divided by it, so a uniformly slower machine changes
  nothing;
* the **spread** is the interquartile range of those normalised ratios (in log scale, so
  2x and 0.5x are as far from 1); a cell's change counts only beyond Tukey's far-out fence,
  three interquartile ranges past the quartiles, and beyond ``min_ratio``;
* a cell's own samples have a spread too: a change counts only beyond (1 + IQR / median)
  of its samples in each run, multiplied (beside a busy core, a few cells' samples spread
  over up to 3.5x their median while the rest moved with the machine);
* a cell whose timing did not settle in either run (the timer flagged it noisy: its IQR
  stayed above 3% of its median) has no speed verdict: on a machine whose load came and
  went, such cells were measured 26-30x slower with their samples spread over 40x, while
  the rest moved 2x with the machine;
* a change past ``min_ratio`` but within any of these noises is ``ambiguous``, as is one
  the Mann-Whitney U test on the normalised samples cannot confirm (asv and nvbench judge
  samples the same way);
* a device with fewer than ``MIN_CELLS_FOR_FACTOR`` cells timed in both runs has no factor
  to take: a change there cannot be told from the machine's and is ``ambiguous``.

What this cannot see: a change that slows most cells of a device alike (a torch release
that slows every kernel) reads as the machine's factor; ``compare`` prints the factor and
spread it used per device, so a factor far from 1 on a quiet machine is there to read.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields, replace
from datetime import datetime
from functools import partial
from operator import attrgetter
from pathlib import Path

from harness.report.aggregate import Run
from harness.report.runs import PARALLEL_BYTES, load_run, results_bytes
from harness.results import storage
from harness.results.rank_test import mann_whitney_p
from harness.results.speed import ALPHA, MIN_CELLS_FOR_FACTOR, MIN_RATIO, NOISE_FENCE
from harness.results.summary import format_rows
from harness.schema.axes import Cell
from harness.schema.gpus import device_label, gpus_text
from harness.schema.records import CellRecord, Outcome, outcome_label
from harness.schema.releases import torch_release
from harness.schema.run_files import Environment
from harness.schema.stats import quartiles
from harness.schema.text import terminal_lines

NOT_OK = (Outcome.RAISES, Outcome.INACCURATE, Outcome.CRASHED, Outcome.TIMEOUT)
#: How many missing cells a message names before "... and K more".
NAMED_MISSING = 10


@dataclass(frozen=True)
class Change:
    cell: Cell
    kind: str  # "outcome" or "speed"
    base: str
    head: str
    verdict: str  # "regression", "improvement", "changed" or "ambiguous"


@dataclass(frozen=True)
class SpeedNoise:
    """How one device's speed changes were judged: its machine factor (the median head/base
    ratio of its ``cells`` timed in both runs; None with too few cells to take one) and the
    quartiles of the ratios once divided by it. A change counts beyond ``bounds``."""

    device: str
    cells: int
    factor: float | None
    spread: tuple[float, float] = (1.0, 1.0)
    bounds: tuple[float, float] = (0.0, math.inf)

    def describe(self) -> str:
        if self.factor is None:
            return (
                f"speed on {self.device}: no machine factor ({self.cells} cells timed in both "
                f"runs, {MIN_CELLS_FOR_FACTOR} needed): a speed change is ambiguous"
            )
        low, high = self.spread
        return (
            f"speed on {self.device} judged against this pair's machine factor "
            f"{self.factor:.2f}x (median of {self.cells} cells; spread {low:.2f}-{high:.2f}): "
            f"a change counts beyond {self.bounds[0]:.2f}-{self.bounds[1]:.2f}x of it, "
            "beyond the spread of the cell's own samples, and where its timing settled"
        )


@dataclass(frozen=True)
class Comparison:
    base: str
    head: str
    changes: list[Change]
    only_in_base: list[Cell]
    only_in_head: list[Cell]
    #: Per device, the noise speed was judged against.
    noise: list[SpeedNoise] = field(default_factory=list)
    #: Where each run ran: ``torch 2.11.0 · H100 80GB HBM3 (sm90) on host-a``.
    base_where: str = ""
    head_where: str = ""
    #: How many cells both runs have a record of: what was compared.
    compared: int = 0

    @property
    def regressions(self) -> list[Change]:
        return [c for c in self.changes if c.verdict == "regression"]


@dataclass(frozen=True)
class Missing:
    """Cells of a BASE run that HEAD has no record of: its paired HEAD run lacks them, or
    HEAD has no run of the BASE run's environment at all (``head`` is then HEAD itself).
    A gate that let these pass would pass a nightly whose run broke."""

    base: Path
    head: Path
    cells: list[Cell]

    def describe(self, named: int = NAMED_MISSING) -> str:
        return (
            f"{len(self.cells)} cells of {self.base} have no record in {self.head}: "
            + first_names([cell.id for cell in self.cells], named)
        )


def first_names(names: Sequence[str], named: int) -> str:
    """``a, b, c ... and 7 more``: the first ``named`` of ``names``, and how many follow."""
    shown = ", ".join(names[:named])
    more = len(names) - named
    return f"{shown} ... and {more} more" if more > 0 else shown


def outcome_verdict(base: CellRecord, head: CellRecord) -> str | None:
    """A cell that passed and now fails, or passed plainly and now carries a flag (it
    drifted, say), regressed; the reverse is an improvement."""
    before, after = outcome_label(base), outcome_label(head)
    if before == after:
        return None
    if base.outcome is Outcome.PASSES and head.outcome in NOT_OK:
        return "regression"
    if base.outcome in NOT_OK and head.outcome is Outcome.PASSES:
        return "improvement"
    if clean_pass(base) != clean_pass(head):
        return "improvement" if clean_pass(head) else "regression"
    return "changed"


def clean_pass(record: CellRecord) -> bool:
    return record.outcome is Outcome.PASSES and not record.flags


def speed_change(
    base: CellRecord,
    head: CellRecord,
    min_ratio: float = MIN_RATIO,
    alpha: float = ALPHA,
    noise: SpeedNoise | None = None,
) -> Change | None:
    """A cell's speed change beyond ``min_ratio``, judged against ``noise`` (its device's
    machine factor and spread; None: taken at face value, as one pair of cells)."""
    ratio = time_ratio(base, head)
    if ratio is None:
        return None
    factor = 1.0 if noise is None or noise.factor is None else noise.factor
    normalised = ratio / factor
    if 1 / min_ratio < normalised < min_ratio:
        return None
    p_value = mann_whitney(base, head, factor)
    unsettled = noise is not None and not settled(base, head)
    beyond_noise = noise is None or (
        noise.factor is not None
        and not unsettled
        and beyond(normalised, noise.bounds, own_spread(base, head))
    )
    if beyond_noise and p_value < alpha:
        verdict = "regression" if normalised > 1 else "improvement"
    else:
        verdict = "ambiguous"
    assert base.perf is not None and head.perf is not None
    after = f"{ratio:.2f}x" + (f", {normalised:.2f}x of the machine's" if factor != 1.0 else "")
    after += f", p={p_value:.2g}" + (", did not settle" if unsettled else "")
    return Change(
        head.cell,
        "speed",
        f"{base.perf.time_median_s * 1e3:.4g} ms",
        f"{head.perf.time_median_s * 1e3:.4g} ms ({after})",
        verdict,
    )


def settled(base: CellRecord, head: CellRecord) -> bool:
    """Whether the cell's timing settled in both runs: the timer flags a cell whose IQR
    stayed above its threshold (3% of the median) noisy, and a noisy cell's median moves
    with the machine's load, not only with the code."""
    return not any(r.perf is not None and r.perf.time_noisy for r in (base, head))


def own_spread(base: CellRecord, head: CellRecord) -> float:
    """The ratio a cell's own samples leave open: (1 + IQR / median) of each run's
    samples, multiplied. A cell whose samples in one run spread over twice their median
    (a thread descheduled now and then beside a busy core) cannot show a 2x change."""
    spread = 1.0
    for record in (base, head):
        perf = record.perf
        if perf is not None and is_time(perf.time_median_s) and perf.time_iqr_s >= 0:
            spread *= 1 + perf.time_iqr_s / perf.time_median_s
    return spread


def beyond(ratio: float, bounds: tuple[float, float], spread: float) -> bool:
    """A normalised ratio outside the device's bounds and outside the cell's own spread."""
    return ratio > max(bounds[1], spread) or ratio < min(bounds[0], 1 / spread)


def time_ratio(base: CellRecord, head: CellRecord) -> float | None:
    """HEAD's median time over BASE's; None where either has no usable time."""
    if base.perf is None or head.perf is None:
        return None
    if not (is_time(base.perf.time_median_s) and is_time(head.perf.time_median_s)):
        return None  # a damaged or hand-made record: no speed to compare
    return head.perf.time_median_s / base.perf.time_median_s


def mann_whitney(base: CellRecord, head: CellRecord, factor: float) -> float:
    """The two-sided Mann-Whitney U test's p-value of BASE's samples against HEAD's
    divided by the machine factor (scipy's, computed without it:
    :mod:`harness.results.rank_test`)."""
    assert base.perf is not None and head.perf is not None
    scaled = [sample / factor for sample in head.perf.time_samples]
    return mann_whitney_p(base.perf.time_samples, scaled)


def speed_noise(
    pairs: Sequence[tuple[CellRecord, CellRecord]], min_ratio: float = MIN_RATIO
) -> dict[str, SpeedNoise]:
    """Per device, the noise of this pair of runs (see the module's docstring), from the
    (base, head) records of every cell both runs have."""
    ratios: dict[str, list[float]] = {}
    for base, head in pairs:
        ratio = time_ratio(base, head)
        if ratio is not None:
            ratios.setdefault(head.cell.device, []).append(ratio)
    return {device: device_noise(device, found, min_ratio) for device, found in ratios.items()}


def device_noise(device: str, ratios: Sequence[float], min_ratio: float) -> SpeedNoise:
    """One device's machine factor, spread and the bounds a change must pass: Tukey's
    far-out fence in log scale, never inside ``min_ratio``."""
    if len(ratios) < MIN_CELLS_FOR_FACTOR:
        return SpeedNoise(device, len(ratios), None)
    logs = [math.log(r) for r in ratios]
    _, centre, _ = quartiles(logs)
    q1, _, q3 = quartiles([value - centre for value in logs])
    reach = NOISE_FENCE * (q3 - q1)
    low, high = math.exp(q1 - reach), math.exp(q3 + reach)
    return SpeedNoise(
        device,
        len(ratios),
        math.exp(centre),
        (math.exp(q1), math.exp(q3)),
        (min(low, 1 / min_ratio), max(high, min_ratio)),
    )


def is_time(seconds: float) -> bool:
    """A median a speed ratio can be taken of: positive and finite."""
    return 0 < seconds < math.inf


#: A cell's place in a comparison: its fields in order, as ``Cell``'s own ordering
#: compares them (a tuple compared in C, where ``Cell.__lt__`` is a Python call).
cell_order = attrgetter(*(f.name for f in fields(Cell)))


def compare_runs(
    base: Run, head: Run, min_ratio: float = MIN_RATIO, alpha: float = ALPHA
) -> Comparison:
    base_cells = {r.cell: r for r in base.records}
    head_cells = {r.cell: r for r in head.records}
    both = sorted(base_cells.keys() & head_cells.keys(), key=cell_order)
    noise = speed_noise([(base_cells[cell], head_cells[cell]) for cell in both], min_ratio)
    changes = []
    for cell in both:
        before, after = base_cells[cell], head_cells[cell]
        verdict = outcome_verdict(before, after)
        if verdict:
            changes.append(
                Change(cell, "outcome", outcome_label(before), outcome_label(after), verdict)
            )
        speed = speed_change(before, after, min_ratio, alpha, noise.get(cell.device))
        if speed:
            changes.append(speed)
    return Comparison(
        base.name,
        head.name,
        changes,
        only_in_base=sorted(base_cells.keys() - head_cells.keys()),
        only_in_head=sorted(head_cells.keys() - base_cells.keys()),
        noise=[
            replace(noise[device], device=device_pair(base.env, head.env, device))
            for device in sorted(noise)
        ],
        base_where=run_where(base.env),
        head_where=run_where(head.env),
        compared=len(both),
    )


def compared_with_nothing(base: Run, head: Run, comparison: Comparison) -> Missing:
    """The cells of HEAD that a BASE without any record leaves unjudged, named as cells of
    HEAD with no record in BASE (none where BASE has records: a cell only HEAD has is new,
    not lost). A gate that passed them would pass on nothing."""
    cells = [] if base.records else comparison.only_in_head
    return Missing(head.run_dir, base.run_dir, cells)


@dataclass(frozen=True)
class PairCompared:
    """One pair of runs compared: what ``compare`` prints and gates on, without the runs'
    records (what a process comparing pairs sends back)."""

    base: Path
    head: Path
    comparison: Comparison
    #: What reading either run found wrong.
    problems: list[str]
    #: HEAD's cells that a BASE without a record leaves unjudged.
    with_nothing: Missing


def compare_pair(pair: tuple[Path, Path], min_ratio: float, alpha: float) -> PairCompared:
    """Read a pair of runs and compare them."""
    base, head = load_run(pair[0]), load_run(pair[1])
    comparison = compare_runs(base, head, min_ratio, alpha)
    return PairCompared(
        pair[0],
        pair[1],
        comparison,
        base.problems + head.problems,
        compared_with_nothing(base, head, comparison),
    )


def compared_pairs(
    pairs: Sequence[tuple[Path, Path]],
    min_ratio: float = MIN_RATIO,
    alpha: float = ALPHA,
    processes: int | None = None,
) -> Iterator[PairCompared]:
    """Each pair compared, in order. Many pairs (two folders of a nightly's runs) are read
    and compared by one process per core, as the report reads many runs: reading the
    records is most of comparing them."""
    work = partial(compare_pair, min_ratio=min_ratio, alpha=alpha)
    dirs = [d for pair in pairs for d in pair]
    processes = min(processes or os.cpu_count() or 1, len(pairs))
    if processes < 2 or results_bytes(dirs) < PARALLEL_BYTES:
        for pair in pairs:
            with storage.paused_gc():  # reading and comparing make no cycles
                compared = work(pair)
            yield compared
        return
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with context.Pool(processes) as pool:  # small chunks: no process left alone at the end
        yield from pool.imap(work, pairs, chunksize=max(1, len(pairs) // (processes * 16)))


def device_pair(base: Environment, head: Environment, device: str) -> str:
    """A device as both runs name it: ``H100 80GB HBM3 (sm90)``, or
    ``A100-SXM4-40GB (sm80) -> H100 80GB HBM3 (sm90)`` where their GPUs differ."""
    before, after = device_label(base.gpus, device), device_label(head.gpus, device)
    return after if before == after else f"{before} -> {after}"


def run_where(env: Environment) -> str:
    """``torch 2.11.0 · H100 80GB HBM3 (sm90) on host-a``: the release, GPUs and host of a
    run, as a comparison's header names each side."""
    release = torch_release(env.torch_version)
    gpus = gpus_text(env.gpus)
    return f"torch {release} · {'cpu' if gpus == 'no GPU' else gpus} on {env.hostname or '?'}"


def is_run_dir(path: Path) -> bool:
    return (path / storage.ENV_FILE).exists() or (path / storage.CELLS_FILE).exists()


def runs_in(root: Path) -> list[Path]:
    """The run folders of a results folder; a folder that holds none is refused: a gate
    that compared nothing would pass."""
    runs = sorted(p for p in root.iterdir() if p.is_dir() and is_run_dir(p))
    if not runs:
        raise storage.ResultsError(
            f"{root}: no run folder in it (nothing to compare: name a run or a folder of runs)"
        )
    return runs


EnvironmentKey = tuple[str, str, str]


@dataclass
class Pairing:
    """Runs of two results folders paired by environment, and every run left out, with why."""

    pairs: list[tuple[Path, Path]] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    #: Runs of BASE whose environment has no run in HEAD: every cell of theirs is missing.
    unpaired_bases: list[Path] = field(default_factory=list)
    #: Runs of HEAD whose environment has no run in BASE: every cell of theirs is compared
    #: with nothing.
    unpaired_heads: list[Path] = field(default_factory=list)


def environment_key(env: Environment) -> EnvironmentKey:
    """What makes two runs comparable: the torch release and the machine: its GPUs, each
    named by model and capability, where it has any (a pool of self-hosted runners of one
    GPU kind is one environment, whichever host took tonight's job), else its host."""
    gpus = gpus_text(env.gpus)
    return (str(env.torch_version), "" if env.gpus else str(env.hostname), gpus)


def describe_key(key: EnvironmentKey) -> str:
    """``torch 2.11.0 · H100 80GB HBM3 (sm90)``, or ``torch 2.13.0 · no GPU on host-a``."""
    return f"torch {key[0]} · {key[2]}" + (f" on {key[1]}" if key[1] else "")


def start_time(run_dir: Path, env: Environment) -> datetime:
    """When a run started, as its ``env.json`` records it (an ISO time with its zone): which
    run of an environment is the newest is decided by it, never by a folder's name, which
    anyone can change."""
    path = run_dir / storage.ENV_FILE
    try:
        started = datetime.fromisoformat(env.started_at or "")
    except (TypeError, ValueError):
        started = None
    if started is None or started.tzinfo is None:
        raise storage.ResultsError(
            f"{path}: no start time with its zone (started_at {env.started_at!r}): which run "
            "is newest cannot be told; refusing to compare"
        )
    return started


def runs_by_environment(root: Path, left_out: list[str]) -> dict[EnvironmentKey, Path]:
    """In a folder of runs, the newest run of each environment, by the start time each
    records; older runs of the same environment go to ``left_out``, with why. A run whose
    ``env.json`` or start time cannot be read, or two runs of one environment started at
    the same time, are refused (``ResultsError``): either could be the newest."""
    started: dict[EnvironmentKey, list[tuple[datetime, Path]]] = {}
    for run_dir in runs_in(root):
        env = storage.read_env(run_dir, problems=[])
        started.setdefault(environment_key(env), []).append((start_time(run_dir, env), run_dir))
    runs: dict[EnvironmentKey, Path] = {}
    for key, found in started.items():
        (newest_at, newest), *older = sorted(found, reverse=True)
        for at, run_dir in older:
            if at == newest_at:
                raise storage.ResultsError(
                    f"{newest} and {run_dir}: two runs of {describe_key(key)} started at "
                    f"{at.isoformat()}: which is newest cannot be told; keep one"
                )
            left_out.append(
                f"{run_dir}: not compared: {newest.name} started later "
                f"({newest_at.isoformat()}), same {describe_key(key)}"
            )
        runs[key] = newest
    return runs


def check_not_itself(base: Path, head: Path) -> None:
    """A run compared with itself (one folder named on both sides, or a run in both results
    folders) has no change to find: a gate on it passes on nothing, so it is refused."""
    if base.resolve() == head.resolve():
        raise storage.ResultsError(
            f"{base}: the same run on both sides: compared with itself, nothing could fail"
        )


def pair_runs(base: Path, head: Path) -> Pairing:
    """Two runs compare as they are; two results folders pair up by environment (torch
    release, host and GPUs), the newest run of each, and name every run left out. A
    results folder without a run is refused (``runs_in``), and so is a run paired with
    itself (``check_not_itself``)."""
    pairing = paired_runs(base, head)
    for base_dir, head_dir in pairing.pairs:
        check_not_itself(base_dir, head_dir)
    return pairing


def paired_runs(base: Path, head: Path) -> Pairing:
    if is_run_dir(base) and is_run_dir(head):
        return Pairing([(base, head)])
    pairing = Pairing()
    bases = (
        {("", "", ""): base} if is_run_dir(base) else runs_by_environment(base, pairing.left_out)
    )
    heads = (
        {("", "", ""): head} if is_run_dir(head) else runs_by_environment(head, pairing.left_out)
    )
    if is_run_dir(base) or is_run_dir(head):
        pairing.pairs = [(b, h) for b in bases.values() for h in heads.values()]
        return pairing
    for key in sorted(heads.keys() | bases.keys()):
        if key in heads and key in bases:
            pairing.pairs.append((bases[key], heads[key]))
        elif key in heads:
            pairing.left_out.append(f"{heads[key]}: no run of {describe_key(key)} in {base}")
            pairing.unpaired_heads.append(heads[key])
        else:
            pairing.left_out.append(f"{bases[key]}: no run of {describe_key(key)} in {head}")
            pairing.unpaired_bases.append(bases[key])
    return pairing


def render_comparison(comparison: Comparison) -> str:
    """The terminal table of a comparison."""
    lines = [f"compare {comparison.base} -> {comparison.head}"]
    if comparison.base_where or comparison.head_where:
        lines += [f"  base: {comparison.base_where}", f"  head: {comparison.head_where}"]
    lines += [f"  {noise.describe()}" for noise in comparison.noise]
    if comparison.changes:
        rows = [["cell", "what", "base", "head", "verdict"]]
        rows += [
            [
                c.cell.id,
                c.kind,
                c.base,
                c.head,
                c.verdict.upper() if c.verdict == "regression" else c.verdict,
            ]
            for c in comparison.changes
        ]
        lines += ["  " + row for row in format_rows(rows)]
    else:
        lines.append("  no outcome changes and no speed changes beyond the noise")
    for label, cells in (
        ("only in base", comparison.only_in_base),
        ("only in head", comparison.only_in_head),
    ):
        if cells:
            lines.append(f"  {len(cells)} cells {label}: " + first_names([c.id for c in cells], 5))
    counts = {
        v: sum(c.verdict == v for c in comparison.changes)
        for v in ("regression", "improvement", "changed", "ambiguous")
    }
    lines.append("  " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    return terminal_lines(lines)
