"""Running one cell: build, run the fix, classify the outcome against the reference."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

import torch

from harness import registry
from harness.axes import dtype_name, dtype_of
from harness.case import Case, RunContext
from harness.numerics import judge, relative_error, within_tolerance
from harness.perf import perf_figures
from harness.records import Cell, CellRecord, Numerics, Outcome
from harness.timing import TimingConfig, measure_interleaved, stopwatch_for

#: Every cell of a case builds from the same seed, so all fixes and the reference see the
#: same weights and inputs.
SEED = 0
MAX_MESSAGE = 4000
CONTRACT_NOTE = (
    "flash-attn-contract: flash-attn's input contract enforced, computed with SDPA; "
    "not the real flash-attn kernel"
)
REFERENCE_BACKENDS = ("sdpa", "eager")


def seed_everything(seed: int = SEED) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def reference_backend(case: Case) -> str:
    """The backend the CPU reference and baseline use: plain SDPA or eager if declared."""
    return next((b for b in REFERENCE_BACKENDS if b in case.backends), case.backends[0])


def run_fix_once(case: Case, fix: str, ctx: RunContext) -> torch.Tensor:
    seed_everything()
    workload = case.build(ctx)
    output = case.run_fix(fix, workload, ctx)
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"fix {fix!r} returned {type(output).__name__}, expected a Tensor")
    return output


@lru_cache(maxsize=32)
def reference_output(case_name: str) -> torch.Tensor:
    """The case's reference fix in float64 on the CPU."""
    case = registry.get(case_name)
    ctx = RunContext(torch.device("cpu"), torch.float64, "half", reference_backend(case))
    with torch.no_grad():
        return run_fix_once(case, case.reference_fix, ctx).to(torch.float64)


@lru_cache(maxsize=32)
def baseline_rel_err(case_name: str, dtype: str) -> float | None:
    """Error of a plain low-precision computation (reference fix, mode half, CPU)."""
    case = registry.get(case_name)
    ctx = RunContext(torch.device("cpu"), dtype_of(dtype), "half", reference_backend(case))
    try:
        with torch.no_grad():
            output = run_fix_once(case, case.reference_fix, ctx)
    except Exception:
        return None
    return relative_error(output, reference_output(case_name))[1]


@dataclass(frozen=True)
class FixResult:
    output: torch.Tensor | None
    error: BaseException | None
    attn_dtype: str | None


def run_fix_in_cell(case: Case, cell: Cell) -> FixResult:
    ctx = RunContext(torch.device(cell.device), dtype_of(cell.dtype), cell.mode, cell.backend)
    try:
        output = run_fix_once(case, cell.fix, ctx)
    except Exception as error:  # every failure of the code under test is a result
        return FixResult(None, error, ctx.observation.summary())
    return FixResult(output, None, ctx.observation.summary())


def classify(case: Case, cell: Cell, result: FixResult, record: CellRecord) -> CellRecord:
    """Fill in the outcome and its evidence: the error, or the figures against the reference."""
    if result.error is not None:
        return raised(case, result.error, record)
    assert result.output is not None
    numerics, problem = compare_with_reference(case, cell, result.output)
    passed = problem is None and numerics is not None and within_tolerance(numerics)
    return replace(
        record,
        outcome=Outcome.PASSES if passed else Outcome.INACCURATE,
        out_dtype=dtype_name(result.output.dtype),
        numerics=numerics,
        error_message=problem,
    )


def raised(case: Case, error: BaseException, record: CellRecord) -> CellRecord:
    error_type = type(error).__name__
    message = str(error)[:MAX_MESSAGE]
    assert case.failure is not None
    return replace(
        record,
        outcome=Outcome.RAISES,
        reproduces=case.failure.matches(error_type, message),
        error_type=error_type,
        error_message=message,
    )


def compare_with_reference(
    case: Case, cell: Cell, output: torch.Tensor
) -> tuple[Numerics | None, str | None]:
    reference = reference_output(case.name)
    if output.shape != reference.shape:
        return None, f"output shape {tuple(output.shape)} != reference {tuple(reference.shape)}"
    baseline = baseline_rel_err(case.name, cell.dtype)
    return judge(output, reference, dtype_of(cell.dtype), baseline), None


def run_cell(cell: Cell, worker: str | None = None) -> CellRecord:
    """Run one cell and return its record. Exceptions of the code under test are outcomes."""
    case = registry.get(cell.case)
    started = time.perf_counter()
    result = run_fix_in_cell(case, cell)
    record = CellRecord(
        cell=cell,
        torch_version=torch.__version__,
        outcome=Outcome.CRASHED,  # replaced by classify()
        attn_dtype=result.attn_dtype,
        note=CONTRACT_NOTE if cell.backend == "flash-attn-contract" else None,
        worker=worker,
    )
    record = classify(case, cell, result, record)
    return replace(record, duration_s=round(time.perf_counter() - started, 6))


def skipped_record(cell: Cell, reason: str) -> CellRecord:
    return CellRecord(
        cell=cell, torch_version=torch.__version__, outcome=Outcome.SKIPPED, skip_reason=reason
    )


def crashed_record(cell: Cell, message: str, worker: str | None = None) -> CellRecord:
    """A cell whose worker process died, or on which the harness itself failed."""
    worker_died = "crashed while running" in message
    error_type = "WorkerCrashed" if worker_died else "HarnessError"
    return limit_record(cell, Outcome.CRASHED, error_type, message, worker)


def limit_record(
    cell: Cell, outcome: Outcome, error_type: str, message: str, worker: str | None
) -> CellRecord:
    """A cell that produced no record of its own: it crashed or ran out of time."""
    return CellRecord(
        cell=cell,
        torch_version=torch.__version__,
        outcome=outcome,
        error_type=error_type,
        error_message=message[:MAX_MESSAGE],
        worker=worker,
    )


TIMED_OUTCOMES = (Outcome.PASSES, Outcome.INACCURATE)


def prepare_call(cell: Cell) -> tuple[Callable[[], Any], torch.device]:
    """The cell's fix as a zero-argument call on a workload built once (seeded as always)."""
    case = registry.get(cell.case)
    device = torch.device(cell.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ctx = RunContext(device, dtype_of(cell.dtype), cell.mode, cell.backend, observe=False)
    seed_everything()
    workload = case.build(ctx)
    return (lambda: case.run_fix(cell.fix, workload, ctx)), device


NOT_RERUNNABLE = "output changed between repeated calls: the timed work is not the checked work"


@dataclass(frozen=True)
class TimedCall:
    record: CellRecord
    call: Callable[[], Any]
    device: torch.device


def checked_call(record: CellRecord) -> TimedCall | CellRecord:
    """The cell's call, after two calls that must agree; or its record with a note."""
    try:
        call, device = prepare_call(record.cell)
        first, second = call(), call()
    except Exception as error:
        note = f"timing failed: {type(error).__name__}: {error}"[:MAX_MESSAGE]
        return replace(record, note=join_notes(record.note, note))
    same = torch.allclose(first, second, rtol=0, atol=0, equal_nan=True)
    return TimedCall(
        replace(record, note=join_notes(record.note, None if same else NOT_RERUNNABLE)),
        call,
        device,
    )


def time_column(
    records: Sequence[CellRecord], config: TimingConfig, worker: str | None = None
) -> list[CellRecord]:
    """Time cells that will be compared (one case, device, dtype and mode) side by side,
    then add FLOPs, throughput and memory to each record."""
    checked = [checked_call(r) for r in records]
    calls = [c for c in checked if isinstance(c, TimedCall)]
    if not calls:
        return [c for c in checked if isinstance(c, CellRecord)]
    stopwatch = stopwatch_for(calls[0].device, config.flush_l2)
    timings = measure_interleaved([c.call for c in calls], config, stopwatch)
    timed = iter(
        replace(
            c.record,
            perf=replace(
                perf_figures(c.call, c.device, c.record.cell.dtype, timing), timing_worker=worker
            ),
        )
        for c, timing in zip(calls, timings, strict=True)
    )
    return [next(timed) if isinstance(c, TimedCall) else c for c in checked]


def time_cell(record: CellRecord, config: TimingConfig, worker: str | None = None) -> CellRecord:
    """Add speed, throughput and memory to the record of one cell that ran."""
    return time_column([record], config, worker)[0]


def join_notes(*notes: str | None) -> str | None:
    kept = [n for n in notes if n]
    return "; ".join(kept) if kept else None
