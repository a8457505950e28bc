"""The run's progress lines, one per cell (correctness) or per column (timing), numbered:
the same whether the cells ran in pytest-xdist workers or from the run's own process."""

from __future__ import annotations

from harness.results.summary import failure_line
from harness.schema.records import CellRecord, Outcome, outcome_label
from harness.schema.text import one_line


def progress_label(record: CellRecord) -> str:
    """The outcome label, and for a cell that did not pass, where it left float64 (its
    divergence: ``inaccurate: first beyond rounding at blocks.7.ffn (Mlp, toy.py:41), 140x
    (was 2.1x)``) and the error in one line."""
    label = outcome_label(record)
    if record.outcome is Outcome.PASSES:
        return label
    if record.divergence is not None:
        label = f"{label}: {record.divergence.describe()}"
    detail = failure_line(record)
    return one_line(f"{label}  {detail}" if detail else label)


def timing_label(record: CellRecord) -> str:
    perf = record.perf
    if perf is None:
        return f"not timed: {record.timing_error or record.notes_text}"
    noisy = " noisy" if perf.time_noisy else ""
    return (
        f"{perf.time_median_s * 1e3:.3f} ms (IQR {perf.time_iqr_s / perf.time_median_s:.1%},"
        f" {perf.time_count}x{perf.time_block} calls{noisy})"
    )


def column_label(timed: list[CellRecord]) -> str:
    """``timed`` and a line per fix of a column with its figures."""
    fixes = [one_line(f"{r.cell.fix} [{r.cell.backend}]: {timing_label(r)}") for r in timed]
    return "timed" + "".join(f"\n    {fix}" for fix in fixes)


class Progress:
    """Prints ``[done/total] name  label`` lines; ``name`` (a cell's id) is one line, and so
    is each line of ``label`` (:func:`progress_label`, :func:`column_label`)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0

    def line(self, name: str, label: str) -> None:
        self.done += 1
        width = len(str(self.total))
        # the label's line breaks are the harness's own (a column's fixes, one a line)
        print(f"[{self.done:>{width}}/{self.total}] {one_line(name)}  {label}", flush=True)
