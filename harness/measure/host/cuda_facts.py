"""What the GPUs are, learned without starting CUDA in this process.

A run forks its cells from its own process, and a process forked after CUDA started in its
parent cannot start it again (``RuntimeError: Cannot re-initialize CUDA in forked
subprocess``). Measured on an H200 (torch 2.11.0+cu130): every CUDA cell of a one-GPU run
crashed so, because the run's process had asked ``torch.cuda.is_available()`` (the CUDA
runtime's device count, which starts the driver), each device's capability and properties
while planning and recording ``env.json``, and cuDNN's version. So the process that plans
and forks never starts CUDA: what only CUDA can say (each device's name, capability,
memory and multiprocessors, and cuDNN's version) is asked once, in a forked child that
starts CUDA in itself alone, sends the facts back and exits. A process where CUDA has
started already (a cell's own, or a user's) asks torch directly.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from harness.measure.host import caches
from harness.measure.host.forking import child_ignores_sigint, sigint_blocked
from harness.schema.devices import parse_device


@dataclass(frozen=True)
class DeviceFacts:
    """One visible CUDA device, as ``torch.cuda.get_device_properties`` describes it."""

    name: str
    major: int
    minor: int
    total_memory: int
    multiprocessors: int


@dataclass(frozen=True)
class CudaFacts:
    """Every visible CUDA device in torch's order (``cuda:0`` first), cuDNN's version, and
    why the facts could not be learned, if they could not (then no device is listed)."""

    devices: tuple[DeviceFacts, ...] = ()
    cudnn_version: int | None = None
    problem: str | None = None


def asked_here() -> CudaFacts:
    """The facts from torch, in this process (it starts CUDA here)."""
    if not torch.cuda.is_available():
        return CudaFacts()
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append(
            DeviceFacts(
                props.name,
                props.major,
                props.minor,
                props.total_memory,
                props.multi_processor_count,
            )
        )
    return CudaFacts(tuple(devices), torch.backends.cudnn.version())


def asked_in_a_child() -> CudaFacts:
    """The facts from a forked child, which starts CUDA in itself only."""
    read_end, write_end = os.pipe()
    with sigint_blocked():
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child's lines run in the forked process
        os.close(read_end)
        child_ignores_sigint()
        try:
            payload = encoded(asked_here())
        except BaseException as error:  # anything the child met is a fact to send back
            payload = json.dumps({"problem": f"{type(error).__name__}: {error}"})
        with os.fdopen(write_end, "w") as pipe:
            pipe.write(payload)
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    return decoded(data)


def encoded(facts: CudaFacts) -> str:
    return json.dumps(
        {
            "devices": [vars(d) for d in facts.devices],
            "cudnn_version": facts.cudnn_version,
            "problem": facts.problem,
        }
    )


def decoded(data: str) -> CudaFacts:
    """The child's facts; a child that died before it said anything is a problem."""
    try:
        raw: dict[str, Any] = json.loads(data)
    except ValueError:
        return CudaFacts(problem="the CUDA probe ended without an answer")
    devices = tuple(DeviceFacts(**d) for d in raw.get("devices", []))
    return CudaFacts(devices, raw.get("cudnn_version"), raw.get("problem"))


@caches.cache
def facts() -> CudaFacts:
    """The CUDA facts of this machine, asked once a process (a forked cell inherits them):
    none without a CUDA build of torch; in a child while CUDA has not started here."""
    if not torch.backends.cuda.is_built():
        return CudaFacts()
    if torch.cuda.is_initialized():
        return asked_here()
    return asked_in_a_child()


def device_index(device: str) -> int:
    """``cuda:1`` -> 1; ``cuda`` -> the device a process uses first, 0."""
    return parse_device(device).ordinal


def device_facts(device: str) -> DeviceFacts | None:
    """The facts of ``device`` (``cuda:N``), None where no such device is visible."""
    devices = facts().devices
    index = device_index(device)
    return devices[index] if 0 <= index < len(devices) else None
