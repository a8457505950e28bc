"""The terminal summary of a run: one table per case, rows fix, columns the cell axes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from harness.results.computed_in import ComputedIn, computed_in, fix_computed_in
from harness.results.speed import RecordKey, SpeedRatios, record_key, speed_ratios
from harness.schema.axes import (
    CONTROL_FIX,
    DTYPES,
    FORWARD_STAGE,
    MODE_NAMES,
    MODES,
    SIZES,
    SMALL_SIZE,
    STAGES,
    rank,
)
from harness.schema.devices import CPU, device_kind
from harness.schema.gpus import environment_label
from harness.schema.records import LABELS, CellRecord, NoteKind, Outcome, outcome_label
from harness.schema.stages import stage_as_read
from harness.schema.text import one_line, terminal_lines

SPEED_LEGEND = (
    " (c: ratio to the case's fp32 control, f: to the column's fastest fix that passes with no"
    " flag, ~: noisy)"
)
LEGEND = "; ".join(
    [
        *(f"{label.text} = {label.meaning}" for label in LABELS[:4]),
        "[flag] = the cell's precision mode was not applied as promised (listed under the table)",
    ]
)
MODES_LEGEND = "modes: " + "; ".join(f"{m.name} = {m.meaning}" for m in MODES.values())


#: A device's name in a summary (``cuda:0`` -> ``H100 80GB HBM3 (sm90)``), by device.
DeviceNames = Mapping[str, str]


def column_key(
    record: CellRecord, show_device: bool, names: DeviceNames | None = None
) -> tuple[str, ...]:
    column = record.cell.column
    device = (names or {}).get(column.device, column.device)
    return ((device,) if show_device else ()) + (column.dtype, column.mode)


def column_order(key: tuple[str, ...]) -> tuple[object, ...]:
    *device, dtype, mode = key
    return (*device, rank(DTYPES, dtype), rank(MODE_NAMES, mode), key)


def row_key(record: CellRecord, show_backend: bool) -> str:
    return record.cell.row(show_backend)


def row_order(records: Sequence[CellRecord], show_backend: bool) -> list[str]:
    """Rows: the upstream path ``none`` first, then fixes by name; backends grouped."""
    ordered = sorted(
        records, key=lambda r: (r.cell.fix != CONTROL_FIX, r.cell.fix, r.cell.backend)
    )
    return list(dict.fromkeys(row_key(r, show_backend) for r in ordered))


CellText = Callable[[CellRecord], str | None]


def case_table(
    records: Sequence[CellRecord],
    text: CellText = outcome_label,
    names: DeviceNames | None = None,
) -> list[str]:
    """Rows of one case's table: ``text`` of each record that has one (skipped left out);
    a column of a device is headed by its name in ``names`` where it has one."""
    ran = [r for r in records if r.outcome is not Outcome.SKIPPED and text(r) is not None]
    if not ran:
        return []
    show_device = len({r.cell.device for r in ran}) > 1
    show_backend = len({r.cell.backend for r in ran}) > 1
    keys = {id(r): column_key(r, show_device, names) for r in ran}
    columns = sorted(set(keys.values()), key=column_order)
    grid = {(row_key(r, show_backend), keys[id(r)]): str(text(r)) for r in ran}
    rows = [["fix", *("/".join(c) for c in columns)]]
    rows += [
        [row, *(grid.get((row, c), "-") for c in columns)] for row in row_order(ran, show_backend)
    ]
    return format_rows(rows)


def format_rows(rows: list[list[str]]) -> list[str]:
    """A table's rows as aligned lines of a terminal: each cell one line (a case's name or
    an outcome from a record cannot break a row), padded to its column's width."""
    rows = [[one_line(value) for value in row] for row in rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def skipped_lines(records: Iterable[CellRecord]) -> list[str]:
    reasons = Counter(r.skip_reason for r in records if r.outcome is Outcome.SKIPPED)
    return [f"  {count:>4} skipped: {reason}" for reason, count in reasons.most_common()]


def speed_text(ratios: dict[RecordKey, SpeedRatios]) -> CellText:
    """``1.23ms c0.91 f1.00~``: median per call, ratio to the fp32 control (c) and to the
    fastest passing fix of the column (f); ``~`` marks a noisy timing, ``(device)`` a
    launch-bound CUDA cell judged by its kernels' device time."""

    def text(record: CellRecord) -> str | None:
        if record.perf is None:
            return None
        ratio = ratios.get(record_key(record), SpeedRatios(None, None))
        device = "(device)" if record.perf.launch_bound else ""
        parts = [f"{record.perf.speed_s * 1e3:#.3g}ms{device}"]
        parts += [
            f"{tag}{value:.2f}"
            for tag, value in (("c", ratio.vs_control), ("f", ratio.vs_fastest))
            if value is not None
        ]
        return " ".join(parts) + ("~" if record.perf.time_noisy else "")

    return text


def failure_line(record: CellRecord) -> str | None:
    """Why a cell did not pass plainly, in one line: the error (unless it is the case's
    known one) with the case's innermost frame, the dtype trail of a cell that raised, the
    crash kind, the tolerance it missed, its flags, and a train step's notes (the steps its
    scaler skipped, where its gradients went non-finite); None for a plain pass."""
    parts = [flag.describe() for flag in record.flags]
    if record.trail and record.outcome is Outcome.RAISES:
        parts.insert(0, str(record.trail.describe()))
    # the case's known error goes without saying, unless torch.compile itself raised it
    known = record.reproduces and not record.compile_error
    if (record.error_type or record.error_message) and not known:
        parts.insert(0, error_text(record))
    elif record.outcome is Outcome.INACCURATE and record.fit:
        parts.insert(0, next((n.text for n in record.notes if n.kind is NoteKind.FIT), ""))
    elif record.outcome is Outcome.INACCURATE and record.numerics:
        n = record.numerics
        leaf = f" in {n.leaf}" if n.leaf else ""
        finite = "" if n.finite else "non-finite output; "
        decided = f" ({n.factor:g} x {n.decided_by})" if n.decided_by and n.factor else ""
        parts.insert(
            0, f"{finite}rel_err {n.rel_err:.3g}{leaf} > tolerance {n.tolerance:.3g}{decided}"
        )
    parts += step_notes(record)
    if record.baseline_error:
        parts.append(f"yardstick failed ({record.baseline_error})")
    parts += [f"warns {text}" for text in record.warnings]
    return "; ".join(p for p in parts if p and p != "None") or None


def where_it_left(record: CellRecord) -> str | None:
    """Where a failing cell left float64, in one line: its divergence (``first beyond
    rounding at blocks.7.ffn (Mlp, toy.py:41), 140x (was 2.1x)``), or, for a cell whose
    profile names no module, the note that says why; None for a cell not profiled."""
    if record.divergence is not None:
        return record.divergence.describe()
    return next((n.text for n in record.notes if n.kind is NoteKind.DIVERGENCE), None)


def verdict_line(record: CellRecord) -> str | None:
    """A failing cell's line where cells are listed (under a summary's table, in a
    report): where it left float64 (:func:`where_it_left`), then why it did not pass
    (:func:`failure_line`); None for a plain pass."""
    parts = (where_it_left(record), failure_line(record))
    return "; ".join(p for p in parts if p) or None


def step_notes(record: CellRecord) -> list[str]:
    """A train or fit cell's notes on its steps (a stage that trains: a record of a stage not
    registered here has none): the steps its GradScaler skipped, and where its gradients
    went non-finite."""
    if not stage_as_read(record.cell.stage).trains:
        return []
    return [n.text for n in record.notes if n.kind in (NoteKind.SCALER, NoteKind.GRADIENT)]


def error_text(record: CellRecord) -> str:
    where = f" (at {record.error_frames[-1]})" if record.error_frames else ""
    kind = f"{record.crash_kind.value}: " if record.crash_kind else ""
    kind += "torch.compile failed: " if record.compile_error else ""
    first_line = (record.error_message or "").strip().splitlines()[:1]
    return f"{kind}{record.error_type}: {''.join(first_line)}{where}"


def detail_lines(records: Sequence[CellRecord]) -> list[str]:
    """One line per flagged, raising, crashed or timed-out cell of a case, per train or fit
    cell whose steps have a note (its scaler skipped, its gradients went non-finite), per
    fit that stalled, and per cell that was profiled (where it left float64 first)."""
    worth_saying = [
        r
        for r in records
        if (
            r.flags
            or r.outcome in (Outcome.CRASHED, Outcome.TIMEOUT, Outcome.RAISES)
            or r.baseline_error
            or r.warnings
            or step_notes(r)
            or (r.fit and r.outcome is Outcome.INACCURATE)
            or where_it_left(r)
        )
        and verdict_line(r)
    ]
    ran = [r for r in records if r.outcome is not Outcome.SKIPPED]
    show_device = len({r.cell.device for r in ran}) > 1
    show_backend = len({r.cell.backend for r in ran}) > 1
    grouped: dict[tuple[str, str], list[str]] = {}
    for r in sorted(worth_saying, key=lambda r: (r.cell.fix != CONTROL_FIX, r.cell)):
        heading = "/".join(column_key(r, show_device))
        grouped.setdefault((row_key(r, show_backend), str(verdict_line(r))), []).append(heading)
    return [f"  ! {row} {' '.join(columns)}: {text}" for (row, text), columns in grouped.items()]


CPU_SPEED_NOTE = "  (timed on a CPU: half-precision speed on a CPU does not predict a GPU's)"


def precision_line(records: Sequence[CellRecord]) -> str | None:
    """``  computes in: half: a, b; fp32 fallback: c``: which fixes ran the matmuls and
    attention in the cell's dtype (see ``harness.results.computed_in``)."""
    by_fix: dict[str, list[ComputedIn | None]] = {}
    for r in records:
        by_fix.setdefault(r.cell.fix, []).append(computed_in(r))
    groups: dict[ComputedIn, list[str]] = {}
    for fix, levels in by_fix.items():
        level = fix_computed_in(levels)
        if level is not None:
            groups.setdefault(level, []).append(fix)
    if not groups:
        return None
    parts = [f"{c.value}: {', '.join(groups[c])}" for c in ComputedIn if c in groups]
    return "  computes in: " + "; ".join(parts)


def noise_statement(timings: Sequence[tuple[bool, float]]) -> str | None:
    """What the noisy timings mean, from (noisy, IQR / median) per timed cell; None when
    every timing settled."""
    spreads = sorted(spread for noisy, spread in timings if noisy)
    if not spreads:
        return None
    typical = spreads[len(spreads) // 2]
    return (
        f"noise: {len(spreads)} of {len(timings)} timed cells did not settle (their IQR stayed "
        f"above 3% of the median; typically {typical:.0%}): speed ratios within "
        f"{1 + typical:.2f}x of each other do not separate those fixes. A loaded machine is "
        "the usual cause; time again on a quiet one."
    )


def table_order(key: tuple[str, str, str]) -> tuple[str, int, int, str]:
    """Tables by case, then size, then stage (forward, train, fit; one not registered here
    last, by name)."""
    return key[0], rank(SIZES, key[1]), rank(STAGES, key[2]), key[2]


def table_heading(case: str, size: str, stage: str, sized: bool, staged: bool) -> str:
    """``case``, with ``(size upstream)`` and ``(stage train)`` where the run has several."""
    facets = [f"size {size}"] * sized + [f"stage {stage}"] * staged
    return f"{case}  ({', '.join(facets)})" if facets else case


def device_line(records: Sequence[CellRecord], names: DeviceNames) -> str:
    """``ran on: torch 2.11.0 · H100 80GB HBM3 (sm90); torch 2.11.0 · cpu``: what each
    device of the run was, as a report's columns name it."""
    ran = (r for r in records if r.outcome is not Outcome.SKIPPED)
    places = dict.fromkeys((r.torch_version, r.cell.device) for r in ran)
    return "ran on: " + "; ".join(
        environment_label(version, names.get(device, device)) for version, device in places
    )


def render_summary(records: Sequence[CellRecord], names: DeviceNames | None = None) -> str:
    """The whole summary: tables per case (outcomes, then speed), counts, skip reasons;
    given the run's device ``names`` (its GPUs), a first line naming them and columns
    headed by them."""
    ran = any(r.outcome is not Outcome.SKIPPED for r in records)
    lines: list[str] = [device_line(records, names), ""] if names and ran else []
    by_speed = speed_text(speed_ratios(records))
    sized = any(r.cell.size != SMALL_SIZE for r in records)
    # the forward every case has goes unnamed until the run holds another stage
    staged = any(r.cell.stage != FORWARD_STAGE for r in records)
    tables = {(r.cell.case, r.cell.size, r.cell.stage) for r in records}
    for case, size, stage in sorted(tables, key=table_order):
        mine = [
            r for r in records if (r.cell.case, r.cell.size, r.cell.stage) == (case, size, stage)
        ]
        precision = precision_line(mine)
        heading = table_heading(case, size, stage, sized, staged)
        table = case_table(mine, names=names)
        lines += [heading, *("  " + row for row in table), *detail_lines(mine)]
        lines += [precision, ""] if precision else [""]
        speed = case_table(mine, by_speed, names)
        if speed:
            lines += ["  time per call" + SPEED_LEGEND, *("  " + row for row in speed)]
            on_cpu = any(r.perf and device_kind(r.cell.device) == CPU for r in mine)
            lines += [CPU_SPEED_NOTE, ""] if on_cpu else [""]
    counts = Counter(r.outcome.value for r in records)
    lines.append("outcomes: " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items())))
    noise = noise_statement(
        [(r.perf.time_noisy, r.perf.time_iqr_s / r.perf.time_median_s) for r in records if r.perf]
    )
    if noise:
        lines.append(noise)
    lines += skipped_lines(records)
    lines += [LEGEND, MODES_LEGEND]
    return terminal_lines(lines)
