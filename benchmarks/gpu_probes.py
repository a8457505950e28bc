"""The measurements of ``benchmarks/gpu_acceptance.py`` that need torch and a GPU, each run
in a process of its own: ``python benchmarks/gpu_probes.py NAME --json FILE [options]``
writes its figures to FILE as JSON.

The acceptance session never imports torch itself: a process that has initialised CUDA
cannot fork a child that uses it, a kernel that hangs cannot be stopped from Python, and a
process of its own can be killed at its time limit. So each probe is one child:

* ``environment``: torch, its CUDA, and each visible GPU's model, capability and memory;
* ``do-bench``: the harness's CUDA figures against ``triton.testing.do_bench`` on SDPA
  calls from a launch-bound size to a large one (``bench_gpu_timing.py``'s calls);
* ``check-vs-plain``: ``check`` of small transformers and timm models on ``cuda`` against
  a plain script computing the same errors (``bench_check.py``'s comparison);
* ``cuda-start``: the seconds one process takes to start CUDA (its first allocation).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for path in (str(ROOT), str(HERE)):
    if path not in sys.path:
        sys.path.insert(0, path)

#: Packages whose versions the environment probe records where they are installed.
PACKAGES = ("triton", "flash_attn", "transformers", "timm", "lightning", "xdist")


def environment() -> dict[str, Any]:
    """torch, its CUDA build and every visible GPU (without a GPU: ``cuda_available``
    false and no GPUs; nothing here fails for the want of one)."""
    import torch

    available = torch.cuda.is_available()
    gpus = []
    for index in range(torch.cuda.device_count() if available else 0):
        props = torch.cuda.get_device_properties(index)
        gpus.append(
            {
                "device": f"cuda:{index}",
                "name": props.name,
                "capability": f"{props.major}.{props.minor}",
                "memory_gib": round(props.total_memory / 2**30, 1),
            }
        )
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cuda_available": available,
        "gpus": gpus,
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        "packages": {name: package_version(name) for name in PACKAGES},
    }


def package_version(module: str) -> str | None:
    """The version of an importable module (None: not importable), without importing it
    where its distribution's metadata says it."""
    if importlib.util.find_spec(module) is None:
        return None
    from importlib import metadata

    dist = {"flash_attn": "flash-attn", "xdist": "pytest-xdist"}.get(module, module)
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "installed"


def do_bench() -> dict[str, Any]:
    """``bench_gpu_timing.py``'s calls, each with the harness's timed median, its device
    time, whether it marks the call launch-bound, and ``do_bench``'s figure (seconds)."""
    import bench_gpu_timing as bench

    calls: list[tuple[str, Callable[[], Any]]] = [
        (f"sdpa {shape}", bench.sdpa(shape)) for shape in bench.SHAPES
    ]
    calls.append(("9 x sdpa (2, 8, 256, 64)", bench.sdpa((2, 8, 256, 64), repeats=9)))
    rows = []
    for name, call in calls:
        got = bench.figures(call)
        rows.append({"call": name, **got})
    return {"rows": rows, "agreement": bench.AGREEMENT}


def check_vs_plain(rounds: int, models: int | None) -> dict[str, Any]:
    """``check`` of the GPU models (the first ``models`` of them, or all) on ``cuda``
    against the plain script, alternated ``rounds`` times: median seconds of each."""
    import bench_check
    from gpu_models import MODELS

    names = list(MODELS)[:models] if models else list(MODELS)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "gpu_models.py").write_text((HERE / "gpu_models.py").read_text())
        check_s, plain_s = bench_check.side_by_side(folder, "gpu_models", names, "cuda", rounds)
        outcomes = last_run_outcomes(folder / "results")
    return {
        "models": names,
        "rounds": rounds,
        "check_s": check_s,
        "plain_s": plain_s,
        "target": bench_check.TARGETS["cuda"],
        "outcomes": outcomes,
    }


def last_run_outcomes(results: Path) -> dict[str, int]:
    """How many cells of the last ``check`` had each outcome: a fast check whose cells
    crashed is no figure."""
    from collections import Counter

    from harness.results import storage

    runs = sorted(p for p in results.iterdir() if (p / storage.CELLS_FILE).exists())
    return dict(Counter(r.outcome.value for r in storage.read_records(runs[-1])))


def cuda_start() -> dict[str, Any]:
    """Seconds from a process's first CUDA call to its first allocation done (torch
    already imported): what each process that starts CUDA pays."""
    import torch

    started = time.perf_counter()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    return {"seconds": time.perf_counter() - started}


PROBES: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "environment": lambda args: environment(),
    "do-bench": lambda args: do_bench(),
    "check-vs-plain": lambda args: check_vs_plain(args.rounds, args.models),
    "cuda-start": lambda args: cuda_start(),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("probe", choices=sorted(PROBES))
    parser.add_argument("--json", type=Path, required=True, help="where the figures go")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", type=int, default=None)
    args = parser.parse_args(argv)
    figures = PROBES[args.probe](args)
    args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
