"""``compare BASE HEAD``: what changed between two runs, cell by cell.

Outcome changes: a cell that passed and now does not is a regression; one that now passes
is an improvement; anything else (a skip, another error) is a change. Speed changes are
judged on the raw samples, as asv and nvbench do: a difference counts only when it is both
larger than a minimum ratio and significant by a Mann-Whitney U test; a large difference
that the test cannot confirm is reported as ambiguous.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.report.aggregate import Run
from harness.results import storage
from harness.results.speed import ALPHA, MIN_RATIO
from harness.results.summary import format_rows
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, Outcome, outcome_label
from harness.schema.run_files import Environment

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
class Comparison:
    base: str
    head: str
    changes: list[Change]
    only_in_base: list[Cell]
    only_in_head: list[Cell]

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
    base: CellRecord, head: CellRecord, min_ratio: float = MIN_RATIO, alpha: float = ALPHA
) -> Change | None:
    if base.perf is None or head.perf is None:
        return None
    if not (is_time(base.perf.time_median_s) and is_time(head.perf.time_median_s)):
        return None  # a damaged or hand-made record: no speed to compare
    ratio = head.perf.time_median_s / base.perf.time_median_s
    if 1 / min_ratio < ratio < min_ratio:
        return None
    from scipy.stats import mannwhitneyu  # a second or so to import: only for a large change

    p_value = float(
        mannwhitneyu(
            base.perf.time_samples, head.perf.time_samples, alternative="two-sided"
        ).pvalue
    )
    significant = p_value < alpha
    verdict = ("regression" if ratio > 1 else "improvement") if significant else "ambiguous"
    return Change(
        head.cell,
        "speed",
        f"{base.perf.time_median_s * 1e3:.4g} ms",
        f"{head.perf.time_median_s * 1e3:.4g} ms ({ratio:.2f}x, p={p_value:.2g})",
        verdict,
    )


def is_time(seconds: float) -> bool:
    """A median a speed ratio can be taken of: positive and finite."""
    return 0 < seconds < math.inf


def compare_runs(
    base: Run, head: Run, min_ratio: float = MIN_RATIO, alpha: float = ALPHA
) -> Comparison:
    base_cells = {r.cell: r for r in base.records}
    head_cells = {r.cell: r for r in head.records}
    changes = []
    for cell in sorted(base_cells.keys() & head_cells.keys()):
        before, after = base_cells[cell], head_cells[cell]
        verdict = outcome_verdict(before, after)
        if verdict:
            changes.append(
                Change(cell, "outcome", outcome_label(before), outcome_label(after), verdict)
            )
        speed = speed_change(before, after, min_ratio, alpha)
        if speed:
            changes.append(speed)
    return Comparison(
        base.name,
        head.name,
        changes,
        only_in_base=sorted(base_cells.keys() - head_cells.keys()),
        only_in_head=sorted(head_cells.keys() - base_cells.keys()),
    )


def is_run_dir(path: Path) -> bool:
    return (path / storage.ENV_FILE).exists() or (path / storage.CELLS_FILE).exists()


EnvironmentKey = tuple[str, str, str]


@dataclass
class Pairing:
    """Runs of two results folders paired by environment, and every run left out, with why."""

    pairs: list[tuple[Path, Path]] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    #: Runs of BASE whose environment has no run in HEAD: every cell of theirs is missing.
    unpaired_bases: list[Path] = field(default_factory=list)


def environment_key(env: Environment) -> EnvironmentKey:
    """What makes two runs comparable: the torch release and the machine (host and GPUs)."""
    names = ",".join(str(gpu.get("name", gpu)) for gpu in env.gpus or [])
    return (str(env.torch_version), str(env.hostname), names or "no GPU")


def describe_key(key: EnvironmentKey) -> str:
    return f"torch {key[0]} on {key[1]} ({key[2]})"


def runs_by_environment(root: Path, left_out: list[str]) -> dict[EnvironmentKey, Path]:
    """In a folder of runs, the newest run of each environment; older runs of the same
    environment and runs whose env.json cannot be read go to ``left_out``, with why."""
    runs: dict[EnvironmentKey, Path] = {}
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir() and is_run_dir(p)):
        try:
            key = environment_key(storage.read_env(run_dir, problems=[]))
        except storage.ResultsError as error:
            left_out.append(f"{run_dir}: not compared: {error}")
            continue
        if key in runs:  # names start with a UTC timestamp: the later is the newer
            left_out.append(
                f"{runs[key]}: not compared: {run_dir.name} is newer, same {describe_key(key)}"
            )
        runs[key] = run_dir
    return runs


def pair_runs(base: Path, head: Path) -> Pairing:
    """Two runs compare as they are; two results folders pair up by environment (torch
    release, host and GPUs), the newest run of each, and name every run left out."""
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
        if not heads:
            pairing.unpaired_bases = list(bases.values())
        return pairing
    for key in sorted(heads.keys() | bases.keys()):
        if key in heads and key in bases:
            pairing.pairs.append((bases[key], heads[key]))
        elif key in heads:
            pairing.left_out.append(f"{heads[key]}: no run of {describe_key(key)} in {base}")
        else:
            pairing.left_out.append(f"{bases[key]}: no run of {describe_key(key)} in {head}")
            pairing.unpaired_bases.append(bases[key])
    return pairing


def render_comparison(comparison: Comparison) -> str:
    """The terminal table of a comparison."""
    lines = [f"compare {comparison.base} -> {comparison.head}"]
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
        lines.append("  no outcome changes and no significant speed changes")
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
    return "\n".join(lines)
