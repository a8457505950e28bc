"""A GPU named as people name it, and an environment column named by its GPU.

Whether a failure happens depends on the GPU (flash-attn needs sm80+, flash-attn 4 sm90+,
bfloat16 sm80), so a report column, a ``compare`` header and a summary say
``torch 2.11.0 · H100 80GB HBM3 (sm90)``, not ``cuda:0``: two nightly jobs on an A100 and an
H100 runner are then two columns told apart by what differs between them. The facts come
from ``env.json``'s ``gpus`` (one mapping per visible GPU, as ``measure.environment``
records them); a run from before a fact was recorded is named with what it has.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from harness.schema.devices import CUDA, Device, known_device
from harness.schema.releases import torch_release

#: The vendor prefix a device name starts with, left out where a GPU is named.
VENDOR_PREFIX = "NVIDIA "

GpuFacts = Mapping[str, Any]


def sm_tag(capability: Any) -> str | None:
    """``9.0`` (or ``"9.0"``, or ``(9, 0)``) as ``sm90``; None where it is not a
    capability."""
    if isinstance(capability, (list, tuple)) and len(capability) == 2:
        major, minor = capability
    elif isinstance(capability, str) and capability.count(".") == 1:
        major, minor = capability.split(".")
    else:
        return None
    if not (str(major).isdigit() and str(minor).isdigit()):
        return None
    return f"sm{major}{minor}"


def gpu_name(gpu: GpuFacts) -> str:
    """``H100 80GB HBM3 (sm90)``: the model without the vendor's prefix, and its compute
    capability where it is known."""
    if not isinstance(gpu, Mapping):  # a hand-made env.json: shown as it is
        return str(gpu)
    name = str(gpu.get("name") or "unknown GPU")
    if name.startswith(VENDOR_PREFIX):
        name = name[len(VENDOR_PREFIX) :]
    tag = sm_tag(gpu.get("capability"))
    return f"{name} ({tag})" if tag else name


def gpu_for(gpus: Sequence[GpuFacts] | None, device: str) -> GpuFacts | None:
    """The GPU at a CUDA ``device`` (``cuda`` is ``cuda:0``): the entry recorded for that
    device, or else the entry at its index; None for the CPU or a GPU not recorded."""
    parsed = known_device(device)  # None for a device of a hand-made record
    if parsed is None or parsed.kind != CUDA or not gpus:
        return None
    named = str(Device(CUDA, parsed.ordinal))
    found = next(
        (gpu for gpu in gpus if isinstance(gpu, Mapping) and gpu.get("device") == named), None
    )
    if found is not None or parsed.ordinal >= len(gpus):
        return found
    return gpus[parsed.ordinal]


def device_label(gpus: Sequence[GpuFacts] | None, device: str) -> str:
    """What a column of ``device`` is named: ``cpu``; a CUDA device by its GPU
    (``H100 80GB HBM3 (sm90)``), with the device where the run saw several GPUs of that
    name (``H100 80GB HBM3 (sm90) cuda:1``); the device itself where its GPU is not
    recorded."""
    gpu = gpu_for(gpus, device)
    if gpu is None:
        return device
    name = gpu_name(gpu)
    twins = sum(gpu_name(other) == name for other in gpus or ())
    return f"{name} {device}" if twins > 1 else name


def environment_label(torch_version: str | None, device: str) -> str:
    """``torch 2.11.0 · H100 80GB HBM3 (sm90)``: a release and a device label (see
    :func:`device_label`), without a local version suffix such as ``+cu121``."""
    return f"torch {torch_release(torch_version)} · {device}"


def gpus_text(gpus: Sequence[GpuFacts] | None) -> str:
    """Every GPU a run saw, named, or ``no GPU``: ``2x H100 80GB HBM3 (sm90)``."""
    names = [gpu_name(gpu) for gpu in gpus or ()]
    if not names:
        return "no GPU"
    counted = dict.fromkeys(names, 0)
    for name in names:
        counted[name] += 1
    return ", ".join(name if n == 1 else f"{n}x {name}" for name, n in counted.items())
