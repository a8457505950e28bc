"""``compare BASE HEAD``: what changed between two runs, cell by cell.

Outcome changes: a cell that passed and now does not is a regression; one that now passes
is an improvement; anything else (a skip, another error) is a change. Speed changes are
judged on the raw samples, as asv and nvbench do: a difference counts only when it is both
larger than a minimum ratio and significant by a Mann-Whitney U test; a large difference
that the test cannot confirm is reported as ambiguous.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from scipy.stats import mannwhitneyu

from harness import storage
from harness.records import Cell, CellRecord, Outcome, outcome_label
from harness.report.aggregate import Run
from harness.speed import ALPHA, MIN_RATIO
from harness.summary import format_rows

NOT_OK = (Outcome.RAISES, Outcome.INACCURATE, Outcome.CRASHED, Outcome.TIMEOUT)


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
    ratio = head.perf.time_median_s / base.perf.time_median_s
    if 1 / min_ratio < ratio < min_ratio:
        return None
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


def newest_run_per_version(root: Path) -> dict[str, Path]:
    """In a folder of runs, the newest run of each torch version (by its env.json)."""
    runs: dict[str, Path] = {}
    for run_dir in sorted(p for p in root.iterdir() if p.is_dir() and is_run_dir(p)):
        try:
            version = str(storage.read_env(run_dir, problems=[]).get("torch_version"))
        except storage.ResultsError:
            continue
        runs[version] = run_dir  # names start with a UTC timestamp: the last is the newest
    return runs


def pair_runs(base: Path, head: Path) -> list[tuple[Path, Path]]:
    """Two runs compare as they are; two results folders pair up by torch version."""
    if is_run_dir(base) and is_run_dir(head):
        return [(base, head)]
    bases = {base.name: base} if is_run_dir(base) else newest_run_per_version(base)
    heads = {head.name: head} if is_run_dir(head) else newest_run_per_version(head)
    if is_run_dir(base) or is_run_dir(head):
        return [(b, h) for b in bases.values() for h in heads.values()]
    return [(bases[v], heads[v]) for v in sorted(heads) if v in bases]


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
            lines.append(
                f"  {len(cells)} cells {label}: "
                + ", ".join(c.id for c in cells[:5])
                + (" ..." if len(cells) > 5 else "")
            )
    counts = {
        v: sum(c.verdict == v for c in comparison.changes)
        for v in ("regression", "improvement", "changed", "ambiguous")
    }
    lines.append("  " + ", ".join(f"{n} {v}" for v, n in counts.items()))
    return "\n".join(lines)
