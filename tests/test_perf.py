"""FLOPs, memory and throughput figures, and the speed comparisons built on them."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch._C._autograd import DeviceType
from torch.utils.flop_counter import FlopCounterMode

from harness.measure.figures import perf
from harness.measure.figures.timing import Timing
from harness.measure.host import caches, cuda_facts
from harness.results.speed import (
    interquartile_range,
    median_of,
    rank_with_ties,
    record_key,
    speed_ratios,
)
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, Outcome, Perf
from tests.conftest import ROOT


def test_running_peak_is_the_high_water_mark() -> None:
    assert perf.running_peak([100, 50, -100, 200, -250]) == 250
    assert perf.running_peak([]) == 0


def test_cpu_peak_memory_counts_live_tensors_not_rss() -> None:
    x = torch.randn(256, 256)
    size = x.numel() * x.element_size()

    def two_live_then_one() -> torch.Tensor:
        a = x @ x
        b = a @ a
        del a
        return b.relu()

    peak = perf.peak_memory_cpu(two_live_then_one)
    assert 2 * size <= peak < 3 * size


def test_one_call_gives_the_flops_and_the_same_peak_as_a_call_of_its_own() -> None:
    x = torch.randn(256, 256)

    def two_matmuls() -> torch.Tensor:
        return (x @ x) @ x

    calls = []

    def counted() -> torch.Tensor:
        calls.append(1)
        return two_matmuls()

    flops, memory, method = perf.flops_and_memory(counted, torch.device("cpu"))
    assert (flops, method, len(calls)) == (2 * 2 * 256**3, "cpu-profiler", 1)
    assert memory == perf.peak_memory_cpu(two_matmuls)


def test_flops_of_a_matmul() -> None:
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert perf.count_flops(lambda: a @ b) == 2 * 8 * 16 * 4


def test_flops_unknown_where_a_formula_refuses_the_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's SDPA formula asserts on the grouped-query shapes its CUDA kernels take:
    the count is unknown (None) and the cell's timing is kept."""

    def refusing_mm_formula(*args: object, **kwargs: object) -> int:
        raise AssertionError("shapes are incompatible")

    def counter(display: bool) -> FlopCounterMode:
        return FlopCounterMode(
            display=display, custom_mapping={torch.ops.aten.mm: refusing_mm_formula}
        )

    monkeypatch.setattr(perf, "FlopCounterMode", counter)
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    assert perf.count_flops(lambda: a @ b) is None
    # the counter gave up part-way: the memory comes from a call of its own
    flops, memory, _ = perf.flops_and_memory(lambda: (a @ b).relu(), torch.device("cpu"))
    assert flops is None and memory == perf.peak_memory_cpu(lambda: (a @ b).relu())
    timing = Timing((0.002,), 1, 0.002, 0.0, 0.002, False, "fake")
    record = perf.perf_record(timing, flops=None, memory=0, memory_method="m", peak_gflops=8.0)
    assert (record.flops, record.gflops, record.peak_fraction) == (None, None, None)


def test_perf_record_derives_throughput_and_fraction_of_peak() -> None:
    timing = Timing((0.002, 0.001, 0.003), 4, 0.002, 0.001, 0.001, False, "fake")
    record = perf.perf_record(
        timing, flops=4_000_000, memory=1024, memory_method="m", peak_gflops=8.0
    )
    assert record.gflops == 2.0
    assert record.peak_fraction == 0.25
    assert record.time_samples == [0.002, 0.001, 0.003]
    assert (record.time_count, record.time_block) == (3, 4)


def timed(
    fix: str,
    mode: str,
    dtype: str,
    samples: list[float],
    outcome: Outcome = Outcome.PASSES,
    backend: str = "sdpa",
) -> CellRecord:
    median = sorted(samples)[len(samples) // 2]
    figures = Perf(
        time_samples=samples,
        time_block=1,
        time_median_s=median,
        time_iqr_s=0.0,
        time_min_s=min(samples),
        time_count=len(samples),
        time_noisy=False,
        timer="fake",
        threads=1,
        flops=0,
        gflops=None,
        peak_gflops=None,
        peak_fraction=None,
        peak_mem_bytes=0,
        mem_method="m",
    )
    return CellRecord(Cell("c", fix, "cpu", dtype, mode, backend), "2.13.0", outcome, perf=figures)


def test_speed_ratios_against_control_and_fastest_passing_fix() -> None:
    control = timed("none", "fp32", "float32", [2.0, 2.0, 2.0])
    fast = timed("fast", "half", "float16", [1.0, 1.0, 1.0])
    slow = timed("slow", "half", "float16", [3.0, 3.0, 3.0])
    wrong = timed("wrong", "half", "float16", [0.5, 0.5, 0.5], outcome=Outcome.INACCURATE)
    ratios = speed_ratios([control, fast, slow, wrong])
    assert ratios[record_key(control)].vs_control == 1.0
    assert ratios[record_key(fast)].vs_control == 0.5
    assert ratios[record_key(slow)].vs_fastest == 3.0
    # an inaccurate fix is never "the fastest"; it is still compared with the passing one
    assert ratios[record_key(wrong)].vs_fastest == 0.5


def test_ranking_groups_overlapping_spreads_as_ties() -> None:
    a = timed("a", "half", "float16", [1.0, 1.1, 1.2, 1.3])
    b = timed("b", "half", "float16", [1.2, 1.22, 1.4, 1.5])  # >10% slower, IQRs overlap
    c = timed("c", "half", "float16", [2.0, 2.1, 2.2, 2.3])
    tiers = rank_with_ties([c, b, a])
    assert [[r.cell.fix for r in tier] for tier in tiers] == [["a", "b"], ["c"]]


def test_medians_within_the_tie_ratio_are_ties_even_without_overlap() -> None:
    a = timed("a", "half", "float16", [1.00, 1.00, 1.00])
    b = timed("b", "half", "float16", [1.09, 1.09, 1.09])
    c = timed("c", "half", "float16", [1.11, 1.11, 1.11])
    tiers = rank_with_ties([a, b, c])
    assert [[r.cell.fix for r in tier] for tier in tiers] == [["a", "b"], ["c"]]


def test_the_profiler_is_not_warmed_where_a_gpu_is_visible(
    monkeypatch: pytest.MonkeyPatch, fresh_caches: None
) -> None:
    """Starting the profiler initialises the CUDA driver: a timing worker that did it could
    not fork a single column that uses CUDA (seen on an H100)."""
    started: list[object] = []

    def profiled(fn: object) -> int:
        started.append(fn)
        return 0

    monkeypatch.setattr(perf, "peak_memory_cpu", profiled)
    gpu = cuda_facts.CudaFacts((cuda_facts.DeviceFacts("NVIDIA H100 80GB HBM3", 9, 0, 1, 132),))
    monkeypatch.setattr(cuda_facts, "facts", lambda: gpu)
    perf.warm_up()
    assert started == []
    monkeypatch.setattr(cuda_facts, "facts", cuda_facts.CudaFacts)
    caches.reset()
    perf.warm_up()
    assert len(started) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_timing_worker_still_forks_children_that_use_cuda() -> None:
    script = (
        "import torch\n"
        "from harness.measure.figures import perf\n"
        "from harness.measure.host import torch_state\n"
        "from harness.measure.tracing import trail\n"
        "from harness.runner import isolation\n"
        "perf.warm_up(); trail.warm_up(); torch_state.snapshot()\n"
        "forked = isolation.run_forked(\n"
        "    lambda: torch.ones(2, device='cuda').sum().item(), timeout_s=120, threads=1)\n"
        "print(forked.value, forked.failure)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.stdout.strip().splitlines()[-1] == "2.0 None", result.stderr


class FakeEvent:
    def __init__(self, start: int, duration: int, on_cuda: bool = True) -> None:
        self.start, self.duration = start, duration
        self.kind = DeviceType.CUDA if on_cuda else DeviceType.CPU

    def start_ns(self) -> int:
        return self.start

    def duration_ns(self) -> int:
        return self.duration

    def device_type(self) -> object:
        return self.kind


def test_device_time_is_the_union_of_the_kernels_on_the_device() -> None:
    events = [
        FakeEvent(0, 10),
        FakeEvent(5, 10),  # overlaps the first (another stream): counted once
        FakeEvent(30, 5),
        FakeEvent(0, 1000, on_cuda=False),  # the host's launch calls are not device time
    ]
    assert perf.busy_ns(perf.device_spans(events)) == 15 + 5
    assert perf.busy_ns([]) == 0


def test_device_time_profiles_about_50_ms_of_calls_within_bounds() -> None:
    def timing(median: float) -> Timing:
        return Timing((median,), 1, median, 0.0, median, False, "fake")

    assert perf.device_time_calls(timing(9e-6)) == 100  # launch-bound sizes: 100 calls
    assert perf.device_time_calls(timing(0.001)) == 50
    assert perf.device_time_calls(timing(0.5)) == 3


def test_a_launch_bound_cell_is_judged_by_its_device_time() -> None:
    """9 us of kernels timed at 31 us (the host's launches): speed verdicts use the 9 us,
    and the spread keeps its relative size; a cell within 2x keeps its timed median."""
    wall = timed("lean", "half", "float16", [30e-6, 31e-6, 32e-6])
    assert wall.perf is not None
    bound = replace(wall, perf=replace(wall.perf, device_time_s=9e-6, device_time_calls=100))
    assert bound.perf is not None and bound.perf.launch_bound
    assert median_of(bound) == 9e-6 and bound.perf.speed_clock == "device time (launch-bound)"
    low, high = interquartile_range(bound)
    assert low == pytest.approx(9e-6 * 30.5 / 31) and high == pytest.approx(9e-6 * 31.5 / 31)
    near = replace(wall, perf=replace(wall.perf, device_time_s=20e-6, device_time_calls=100))
    assert near.perf is not None and not near.perf.launch_bound
    assert median_of(near) == 31e-6 and near.perf.speed_clock == "wall time"
    assert median_of(wall) == 31e-6  # no device time (the CPU): the timed median
