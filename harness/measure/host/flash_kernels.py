"""The real flash-attn kernel: flash-attn 2 where it is installed, else flash-attn 4.

flash-attn 2 (PyPI ``flash-attn``, imported as ``flash_attn``) is a source package that
compiles against the CUDA toolkit for tens of minutes. flash-attn 4 (PyPI ``flash-attn-4``,
imported as ``flash_attn.cute``) is the CuTe-DSL FlashAttention for Hopper and Blackwell,
shipped as wheels: nothing to compile, its kernels are compiled on their first call of a
shape (a JIT compile of 1.2-1.6 s on an H100, which the timing phase's warm-up calls
cover). The ``flash-attn`` backend runs flash-attn 2 where it is installed and flash-attn 4
otherwise on sm90 and newer; anywhere else its cells are skipped with the reason.

Both refuse a float32 query before any kernel runs, each in its own words:

* flash-attn 2: ``RuntimeError: FlashAttention only support fp16 and bf16 data type``
  (``mha_fwd`` in ``csrc/flash_attn/flash_api.cpp``), for mixed and for all-float32 inputs;
* flash-attn 4 (4.0.0b36, ``_flash_attn_fwd`` in ``flash_attn/cute/interface.py``):
  ``AssertionError: q, k, v, and qv must have the same dtype`` for mixed dtypes and
  ``AssertionError: inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2`` where all
  are float32 (both checked before the device: the messages are the same on a CPU).

flash-attn 4's kernel is launched outside torch's dispatcher, so the dtype tracer sees the
tensors going in and out but not the kernel itself; a record says so.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from harness.measure.host import caches, cuda_facts
from harness.schema.devices import CUDA, device_kind
from harness.schema.gpus import gpu_name

FLASH_ATTN_2 = "flash-attn"
FLASH_ATTN_4 = "flash-attn-4"
#: flash-attn 4 is built for Hopper (sm90) and Blackwell (sm100+).
FLASH_ATTN_4_MIN_MAJOR = 9
#: The known failure of a float32 query, as each package words it: (error type, regex).
REFUSALS = {
    FLASH_ATTN_2: (("RuntimeError", r"FlashAttention only support fp16 and bf16 data type"),),
    FLASH_ATTN_4: (
        ("AssertionError", r"q, k, v, and qv must have the same dtype"),
        ("AssertionError", r"inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2"),
    ),
}
OPAQUE_NOTE = (
    "its CuTe-DSL kernel runs outside torch's dispatcher: the dtype trail sees its inputs "
    "and output, not the kernel"
)

Kernel = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class FlashPackage:
    """An installed flash-attn package: its distribution, what is imported, its version."""

    dist: str
    module: str
    version: str

    def describe(self) -> str:
        return f"{self.dist} {self.version} ({self.module})"


@caches.cache
def installed_version(dist: str) -> str | None:
    """The installed version of a distribution, read from its metadata (importing
    flash-attn 4 takes seconds; its metadata does not), once per process: every
    flash-attn cell of a plan asks."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_packages() -> dict[str, str | None]:
    """Both packages' versions (None: not installed), for ``env.json``."""
    return {dist: installed_version(dist) for dist in (FLASH_ATTN_2, FLASH_ATTN_4)}


def capability(device: str) -> tuple[int, int]:
    """``(8, 0)`` for an sm80 device; learned without starting CUDA in this process (see
    :mod:`harness.measure.host.cuda_facts`), (0, 0) for a device that is not visible."""
    facts = cuda_facts.device_facts(device)
    return (facts.major, facts.minor) if facts is not None else (0, 0)


def gpu_model(device: str) -> str | None:
    """The GPU's model as people name it (``A100-SXM4-40GB``), None where it is not
    visible."""
    facts = cuda_facts.device_facts(device)
    return gpu_name({"name": facts.name}) if facts is not None else None


def device_described(device: str) -> str:
    """``cuda:0 is sm80, A100-SXM4-40GB``: what a skip reason that depends on the GPU says
    of it, so a reason read in a report of several GPUs names the one that lacked it."""
    major, minor = capability(device)
    model = gpu_model(device)
    return f"{device} is sm{major}{minor}" + (f", {model}" if model else "")


def package_for(device: str) -> FlashPackage | str:
    """The flash-attn package that runs on ``device``, or why none can."""
    if device_kind(device) != CUDA:
        return "flash-attn needs a CUDA device"
    versions = installed_packages()
    flash2, flash4 = versions[FLASH_ATTN_2], versions[FLASH_ATTN_4]
    if flash2:
        return FlashPackage(FLASH_ATTN_2, "flash_attn", flash2)
    if flash4:
        if capability(device)[0] >= FLASH_ATTN_4_MIN_MAJOR:
            return FlashPackage(FLASH_ATTN_4, "flash_attn.cute", flash4)
        return (
            f"flash-attn 4 needs sm90+ ({device_described(device)}) and flash-attn 2 is "
            "not installed"
        )
    return (
        "neither flash-attn 2 (flash_attn) nor flash-attn 4 (flash_attn.cute) is installed "
        "(the flash-attn-contract backend stands in)"
    )


def skip_reason(device: str) -> str | None:
    found = package_for(device)
    return found if isinstance(found, str) else None


def load_kernel(package: FlashPackage) -> Kernel:
    """flash-attn's ``flash_attn_func`` with flash-attn 2's call, ``(q, k, v, dropout_p,
    softmax_scale, causal) -> out`` on (batch, seqlen, heads, head_dim) tensors."""
    if package.dist == FLASH_ATTN_2:
        from flash_attn import flash_attn_func

        return flash_attn_func
    from flash_attn.cute import flash_attn_func as flash4_func

    return as_flash_attn_2_call(flash4_func)


def as_flash_attn_2_call(flash4_func: Callable[..., Any]) -> Kernel:
    """flash-attn 4's function, called as flash-attn 2's: it has no dropout, and it returns
    the output with its log-sum-exp."""

    def flash_attn_4_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        if dropout_p:
            raise ValueError("flash-attn 4 has no dropout (dropout_p must be 0)")
        out, _lse = flash4_func(q, k, v, softmax_scale=softmax_scale, causal=causal)
        return out

    return flash_attn_4_func


def backend_note(device: str) -> str | None:
    """What a ``flash-attn`` cell on ``device`` ran: the package and version, and for
    flash-attn 4 that its kernel is opaque to the dtype trail."""
    found = package_for(device)
    if isinstance(found, str):
        return None
    note = f"flash-attn: the real kernel, {found.describe()}"
    return f"{note}; {OPAQUE_NOTE}" if found.dist == FLASH_ATTN_4 else note
