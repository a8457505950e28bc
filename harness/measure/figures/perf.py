"""Performance figures of one cell: time, FLOPs and throughput, peak memory.

Each figure comes from its own call of the fix, so instrumentation never sits inside the
timed region: FLOPs from ``torch.utils.flop_counter.FlopCounterMode``; peak memory on CUDA
from the caching allocator's statistics (reset first), on the CPU from the profiler's
memory events (every tensor allocation and free, in order: the running sum's maximum is
the peak of one forward call, without process-RSS noise). The device's peak matmul
throughput per dtype is measured in the same run with a large GEMM, so every cell can be
shown as a fraction of what the device can do.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch._C._autograd import DeviceType
from torch.utils.flop_counter import FlopCounterMode

from harness.measure.figures import peaks
from harness.measure.figures.timing import Timing, stopwatch_for, time_call
from harness.measure.host import caches, cuda_facts
from harness.measure.host.environment import cpu_name
from harness.measure.precision.dtypes import dtype_of
from harness.schema.config import TimingConfig
from harness.schema.devices import CUDA, DeviceKind, device_kind
from harness.schema.records import Perf

#: The peak GEMM grows until one call lasts PEAK_GEMM_MIN_S or reaches the largest size, so a
#: slow dtype (fp16 on most CPUs) is measured without spending many seconds on it.
PEAK_GEMM_SIZES: dict[DeviceKind, tuple[int, ...]] = {
    "cpu": (256, 512, 1024, 2048),
    "cuda": (1024, 2048, 4096, 8192),
}
PEAK_GEMM_MIN_S = 0.01


def count_flops(fn: Callable[[], Any]) -> int | None:
    """FLOPs of one call, or None where torch's counter has no valid formula for an op in it
    (torch 2.11's SDPA formula asserts on grouped-query shapes that the CUDA kernels take)."""
    try:
        with FlopCounterMode(display=False) as counter:
            fn()
    except AssertionError:
        return None
    return int(counter.get_total_flops())


def stderr_silenced() -> AbstractContextManager[None]:
    """Some torch builds' profiler backend prints a line to fd 2 at every start and stop."""
    return fd_silenced(2)


@contextmanager
def fd_silenced(fd: int) -> Iterator[None]:
    """While it lasts, what is written to file descriptor ``fd`` (by this process and the
    children it forks) goes nowhere."""
    saved = os.dup(fd)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), fd)
    try:
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


def peak_memory_cpu(fn: Callable[[], Any]) -> int:
    """Peak bytes of tensors allocated during one call, from the profiler's memory events."""
    from torch.profiler import ProfilerActivity, profile

    with (
        stderr_silenced(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        fn()
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]"
    )
    return running_peak(nbytes for _, nbytes in events)


@caches.cache
def warm_up() -> None:
    """The profiler's first use in a process costs seconds (3.4 s measured here): done once
    in a timing worker, before it forks a process per column, instead of in every one. No
    torch op runs, so no thread pool starts before the fork. Not where a GPU is visible:
    starting the profiler initialises the CUDA driver (CUPTI), and no process forked after
    that can use CUDA (measured on an H100: every CUDA timing failed with "CUDA error:
    initialization error", and so did compiled CPU cells, whose Inductor queries CUDA)."""
    if gpu_visible():
        return
    peak_memory_cpu(lambda: None)


def gpu_visible() -> bool:
    """A CUDA build of torch that sees a GPU (learned without starting CUDA in this
    process, so it can still fork children that use CUDA: see ``cuda_facts``)."""
    return bool(cuda_facts.facts().devices)


def running_peak(deltas: Any) -> int:
    """Maximum of the running sum of allocation (+) and free (-) sizes."""
    current = peak = 0
    for delta in deltas:
        current += delta
        peak = max(peak, current)
    return peak


def peak_memory_cuda(fn: Callable[[], Any], device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return int(torch.cuda.max_memory_allocated(device) - before)


def flops_and_memory(fn: Callable[[], Any], device: torch.device) -> tuple[int | None, int, str]:
    """FLOPs and peak memory from one call: the FLOP counter runs inside the memory
    measurement (it adds Python work per op, no tensor). Where the counter gave up part-way
    through the call, a second call measures the memory."""
    flops: list[int | None] = []
    memory, method = peak_memory(lambda: flops.append(count_flops(fn)), device)
    if flops[0] is None:
        memory, method = peak_memory(fn, device)
    return flops[0], memory, method


def peak_memory(fn: Callable[[], Any], device: torch.device) -> tuple[int, str]:
    if device.type == CUDA:
        return peak_memory_cuda(fn, device), "cuda-allocator"
    return peak_memory_cpu(fn), "cpu-profiler"


#: Peaks known to this worker (from the cache, or measured by an earlier timing process),
#: by (device, dtype): the GFLOP/s and when they were measured.
KNOWN_PEAKS: dict[tuple[str, str], tuple[float, str]] = caches.keyed(f"{__name__}.KNOWN_PEAKS")


def remember_peak(device: str, dtype: str, gflops: float, measured_at: str) -> None:
    KNOWN_PEAKS[device, dtype] = (gflops, measured_at)


def peak_matmul_gflops(device: str, dtype: str) -> tuple[float, str]:
    """This machine's matmul throughput on ``device`` in ``dtype`` (a large square GEMM) and
    when it was measured: from the machine's cache of peaks (``harness.measure.figures.peaks``)
    when it holds a recent figure, else measured now and cached."""
    if (device, dtype) not in KNOWN_PEAKS:
        key = peaks.peak_key(
            device_model(device), dtype, torch.__version__, torch.get_num_threads()
        )
        entry = peaks.cached_peak(key) or peaks.store_peak(key, measure_peak_gflops(device, dtype))
        remember_peak(device, dtype, float(entry["gflops"]), str(entry["measured_at"]))
    return KNOWN_PEAKS[device, dtype]


def device_model(device: str) -> str:
    """``NVIDIA H100 80GB HBM3`` or the CPU's model name."""
    if device_kind(device) == CUDA:
        facts = cuda_facts.device_facts(device)
        return facts.name if facts is not None else device
    return cpu_name()


def measure_peak_gflops(device: str, dtype: str) -> float:
    target = torch.device(device)
    stopwatch = stopwatch_for(target)
    for n in PEAK_GEMM_SIZES[device_kind(device)]:
        gemm = square_gemm(n, target, dtype_of(dtype))
        if stopwatch.time_block(gemm, 1) >= PEAK_GEMM_MIN_S:
            break
    timing = time_call(gemm, TimingConfig(budget_s=0.5), stopwatch=stopwatch)
    return 2 * n**3 / timing.median / 1e9


def square_gemm(n: int, device: torch.device, dtype: torch.dtype) -> Callable[[], Any]:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return lambda: a @ b


def perf_figures(fn: Callable[[], Any], device: torch.device, dtype: str, timing: Timing) -> Perf:
    """The timing of ``fn`` with its FLOPs, throughput and peak memory on ``device``, and on
    CUDA the time its kernels occupied the device."""
    flops, memory, memory_method = flops_and_memory(fn, device)
    peak, measured_at = peak_matmul_gflops(str(device), dtype)
    record = perf_record(timing, flops, memory, memory_method, peak, measured_at)
    if device.type != CUDA:
        return record
    calls = device_time_calls(timing)
    return replace(record, device_time_s=device_seconds(fn, calls), device_time_calls=calls)


#: Calls whose kernels are profiled for the device time: about DEVICE_TIME_BUDGET_S of
#: them, within these bounds (the profiler records an event per kernel).
DEVICE_TIME_CALLS = (3, 100)
DEVICE_TIME_BUDGET_S = 0.05


def device_time_calls(timing: Timing) -> int:
    fewest, most = DEVICE_TIME_CALLS
    wanted = round(DEVICE_TIME_BUDGET_S / timing.median) if timing.median > 0 else most
    return min(most, max(fewest, wanted))


def device_seconds(fn: Callable[[], Any], calls: int) -> float | None:
    """Per call, the time the device was busy with ``fn``'s kernels and copies (the union
    of their intervals, from the profiler's CUDA activity), without the host's launch gaps:
    None where the profiler saw no device activity."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with stderr_silenced(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    busy = busy_ns(device_spans(prof.profiler.kineto_results.events()))
    return busy / calls / 1e9 if busy else None


def device_spans(events: Iterable[Any]) -> list[tuple[int, int]]:
    """``(start, end)`` in ns of the profiler events that ran on a CUDA device."""
    return [
        (event.start_ns(), event.start_ns() + event.duration_ns())
        for event in events
        if event.device_type() == DeviceType.CUDA
    ]


def busy_ns(spans: Iterable[tuple[int, int]]) -> int:
    """The length of the union of ``(start, end)`` intervals: kernels on several streams
    that overlap count once."""
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def perf_record(
    timing: Timing,
    flops: int | None,
    memory: int,
    memory_method: str,
    peak_gflops: float,
    peak_measured_at: str | None = None,
) -> Perf:
    gflops = flops / timing.median / 1e9 if flops and timing.median > 0 else None
    return Perf(
        time_samples=list(timing.samples),
        time_block=timing.block,
        time_median_s=timing.median,
        time_iqr_s=timing.iqr,
        time_min_s=timing.min,
        time_count=timing.count,
        time_noisy=timing.noisy,
        timer=timing.timer,
        threads=torch.get_num_threads(),
        flops=flops,
        gflops=gflops,
        peak_gflops=peak_gflops,
        peak_fraction=gflops / peak_gflops if gflops and peak_gflops else None,
        peak_mem_bytes=memory,
        mem_method=memory_method,
        peak_measured_at=peak_measured_at,
    )
