"""The harness's CUDA figures against triton's ``do_bench`` on the same calls (``nox -s
bench`` on a GPU box; elsewhere it says so and exits).

For SDPA from a launch-bound size (a few microseconds of kernel) to a large one, and for
nine SDPA calls back to back, it prints side by side: the harness's timed median (CUDA
events around blocks of calls: what the host's launches allow), its device time (the
kernels' busy time from the profiler) and whether it marks the call launch-bound, triton's
``do_bench`` and torch.utils.benchmark's ``blocked_autorange``, and the ratios of the
harness's speed figure (the device time where launch-bound, else the timed median) to
``do_bench``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils import benchmark

from harness.measure.figures import perf
from harness.measure.figures.timing import stopwatch_for, time_call
from harness.schema.config import TimingConfig
from harness.schema.records import launch_bound

SHAPES = ((1, 1, 16, 16), (1, 4, 64, 32), (2, 8, 256, 64), (4, 16, 1024, 64), (8, 16, 2048, 128))
AGREEMENT = 0.05


def sdpa(shape: tuple[int, ...], repeats: int = 1) -> Callable[[], Any]:
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.float16) for _ in range(3))

    def call() -> Any:
        for _ in range(repeats):
            out = F.scaled_dot_product_attention(q, k, v)
        return out

    return call


def figures(call: Callable[[], Any]) -> dict[str, float]:
    from triton.testing import do_bench

    device = torch.device("cuda")
    call()
    torch.cuda.synchronize()
    timing = time_call(call, TimingConfig(), stopwatch_for(device))
    device_s = perf.device_seconds(call, perf.device_time_calls(timing)) or float("nan")
    timer = benchmark.Timer("call()", globals={"call": call})
    return {
        "wall": timing.median,
        "device": device_s,
        "do_bench": float(do_bench(call)) / 1e3,
        "utils": timer.blocked_autorange(min_run_time=0.2).median,
    }


def row(name: str, got: dict[str, float]) -> str:
    bound = launch_bound(got["wall"], got["device"])
    speed = got["device"] if bound else got["wall"]
    ratio = speed / got["do_bench"]
    verdict = "agrees" if abs(ratio - 1) <= AGREEMENT else "DIFFERS"
    return (
        f"{name:<28} {got['wall'] * 1e6:>9.1f} {got['device'] * 1e6:>9.1f} "
        f"{'yes' if bound else 'no':>6} {got['do_bench'] * 1e6:>9.1f} {got['utils'] * 1e6:>9.1f}"
        f"   {ratio:.3f} {verdict}"
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("GPU timing check: no CUDA device visible, skipped")
        return 0
    print(f"GPU timing check on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(
        f"{'call (float16)':<28} {'wall us':>9} {'device':>9} {'bound':>6} {'do_bench':>9} "
        f"{'utils':>9}   speed figure / do_bench"
    )
    for shape in SHAPES:
        print(row(f"sdpa {shape}", figures(sdpa(shape))), flush=True)
    print(row("9 x sdpa (2, 8, 256, 64)", figures(sdpa((2, 8, 256, 64), repeats=9))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
