"""What this environment can run, and the facts about it that go into ``env.json``."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from harness.measure.host import caches, cuda_facts, flash_kernels
from harness.results.search import release_key
from harness.schema.axes import EAGER, Cell
from harness.schema.devices import CPU, CUDA, Device, device_kind
from harness.schema.releases import torch_release
from harness.schema.run_files import Environment

PROJECT_ROOT = Path(__file__).resolve().parents[3]
PACKAGES = (
    "torch",
    "numpy",
    "lightning",
    "pytorch-lightning",
    "flash-attn",
    "flash-attn-4",
    "nvidia-cutlass-dsl",
    "pytest",
    "pytest-xdist",
)


def cuda_devices() -> list[str]:
    """The visible CUDA devices, learned without starting CUDA in this process (see
    :mod:`harness.measure.host.cuda_facts`: a run forks its cells from it)."""
    return [str(Device(CUDA, i)) for i in range(len(cuda_facts.facts().devices))]


@caches.cache
def module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def device_skip_reason(device: str) -> str | None:
    if device_kind(device) == CPU:
        return None
    visible = cuda_devices()
    if not visible:
        return "no CUDA device visible"
    if device not in visible:
        return f"{device} is not visible (visible: {', '.join(visible)})"
    return None


#: bfloat16 arithmetic came with Ampere (sm80).
BFLOAT16_MIN_MAJOR = 8


def dtype_skip_reason(device: str, dtype: str) -> str | None:
    too_old = (
        device_kind(device) == CUDA
        and dtype == "bfloat16"
        and flash_kernels.capability(device)[0] < BFLOAT16_MIN_MAJOR
    )
    return f"bfloat16 needs sm80+ ({flash_kernels.device_described(device)})" if too_old else None


def backend_skip_reason(device: str, backend: str) -> str | None:
    """flash-attn needs a GPU one of its packages runs on (see
    harness.measure.host.flash_kernels); the contract stand-in runs where the real kernel
    cannot."""
    if backend == "flash-attn":
        return flash_kernels.skip_reason(device)
    if backend == "flash-attn-contract" and device_kind(device) == CUDA:
        real = flash_kernels.package_for(device)
        if not isinstance(real, str):
            return f"the real flash-attn kernel runs here instead ({real.describe()})"
    return None


def requirement_skip_reason(requires: tuple[str, ...]) -> str | None:
    missing = [name for name in requires if not module_available(name)]
    if missing:
        return f"{', '.join(missing)} not importable in this environment"
    return None


def torch_version_skip_reason(min_torch: str | None, version: str | None = None) -> str | None:
    """Why a case that needs torch ``min_torch`` or newer cannot run under this torch."""
    version = version or torch.__version__
    if min_torch and release_key(version) < release_key(min_torch):
        return f"needs torch >= {min_torch} (this is {torch_release(version)})"
    return None


def environment_skip_reason(cell: Cell, requires: tuple[str, ...] = ()) -> str | None:
    """Why this environment cannot run the cell, or None if it can."""
    return (
        device_skip_reason(cell.device)
        or dtype_skip_reason(cell.device, cell.dtype)
        or backend_skip_reason(cell.device, cell.backend)
        or compile_skip_reason(cell)
        or requirement_skip_reason(requires)
    )


def compile_skip_reason(cell: Cell) -> str | None:
    """Inductor on the CPU writes and builds C++: it needs a compiler."""
    if cell.compile == EAGER or device_kind(cell.device) != CPU:
        return None
    if any(shutil.which(cc) for cc in ("g++", "c++", "clang++")):
        return None
    return "torch.compile (inductor) on the CPU needs a C++ compiler; none found"


def package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def command_output(argv: list[str]) -> str | None:
    """A command's output, stripped; None where it cannot run, fails or says nothing."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def harness_commit() -> str | None:
    return command_output(
        ["git", "-C", str(PROJECT_ROOT), "describe", "--always", "--dirty", "--abbrev=40"]
    )


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_facts() -> list[dict[str, Any]]:
    """Per visible GPU, what decides what it can run and what people name it by: its model,
    compute capability, memory, and the driver and CUDA runtime it ran under (the report
    names a column by the first two: ``H100 80GB HBM3 (sm90)``)."""
    devices = cuda_facts.facts().devices
    # one driver serves every GPU of a machine (nvidia-smi's order need not be torch's)
    drivers = nvidia_drivers() if devices else []
    return [
        {
            "device": f"cuda:{index}",
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_bytes": props.total_memory,
            "multiprocessors": props.multiprocessors,
            "driver": drivers[0] if drivers else None,
            "cuda_runtime": torch.version.cuda,
        }
        for index, props in enumerate(devices)
    ]


def nvidia_drivers() -> list[str]:
    """The driver version ``nvidia-smi`` reports, one line per GPU in its order (empty
    where it cannot run)."""
    out = command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return [line.strip() for line in out.splitlines()] if out else []


def backend_flags() -> dict[str, Any]:
    cuda = torch.backends.cuda
    return {
        "sdpa_flash": cuda.flash_sdp_enabled(),
        "sdpa_mem_efficient": cuda.mem_efficient_sdp_enabled(),
        "sdpa_math": cuda.math_sdp_enabled(),
        "matmul_allow_tf32": cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
    }


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def capture_environment(command: list[str]) -> Environment:
    """The facts ``env.json`` records as a run starts; all of them read from what was
    really imported."""
    return Environment(
        torch_version=torch.__version__,
        torch_git_version=torch.version.git_version,
        cuda_version=torch.version.cuda,
        cudnn_version=cuda_facts.facts().cudnn_version,
        gpus=gpu_facts(),
        cuda_driver=_nvidia_driver(),
        cpu=cpu_name(),
        cpu_count=os.cpu_count(),
        torch_num_threads=torch.get_num_threads(),
        packages=package_versions(),
        flags=backend_flags(),
        python=sys.version.split()[0],
        platform=platform.platform(),
        hostname=platform.node(),
        harness_commit=harness_commit(),
        started_at=now_iso(),
        command=command,
    )


def _nvidia_driver() -> str | None:
    if not cuda_devices():
        return None
    drivers = nvidia_drivers()
    return drivers[0] if drivers else None
