"""The process that plans a run and forks its cells never starts CUDA (a child forked after
it did could not start it again: every CUDA cell of a one-GPU run crashed so on an H200):
what only CUDA can say is asked in a forked child (harness.measure.host.cuda_facts)."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from harness.measure.host import caches, cuda_facts, environment, flash_kernels
from harness.measure.host.cuda_facts import CudaFacts, DeviceFacts

#: Each test's fake GPU leaves the process's caches as they were (empty) after it.
pytestmark = pytest.mark.usefixtures("fresh_caches")

H100 = SimpleNamespace(
    name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=85_045_493_760,
    multi_processor_count=132,
)  # fmt: skip


@pytest.fixture
def cuda_only_in_children(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA build of torch with one H100, whose every call that starts CUDA fails the
    test when this process makes it, and answers in a forked child."""
    parent = os.getpid()

    def child_only(answer: Any) -> Any:
        def call(*args: Any) -> Any:
            if os.getpid() == parent:
                raise AssertionError("CUDA started in the process that forks the cells")
            return answer

        return call

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", child_only(True))
    monkeypatch.setattr(torch.cuda, "device_count", child_only(1))
    monkeypatch.setattr(torch.cuda, "get_device_properties", child_only(H100))
    monkeypatch.setattr(torch.cuda, "get_device_capability", child_only((9, 0)))
    monkeypatch.setattr(torch.cuda, "get_device_name", child_only(H100.name))
    monkeypatch.setattr(torch.backends.cudnn, "version", child_only(90100))
    monkeypatch.setattr(environment, "command_output", lambda argv: "570.86.15")
    caches.reset()


def test_planning_and_env_json_learn_the_gpu_without_starting_cuda_here(
    cuda_only_in_children: None,
) -> None:
    assert environment.cuda_devices() == ["cuda:0"]
    assert flash_kernels.capability("cuda:0") == (9, 0)
    assert environment.dtype_skip_reason("cuda:0", "bfloat16") is None
    assert environment.device_skip_reason("cuda:1") == "cuda:1 is not visible (visible: cuda:0)"
    env = environment.capture_environment(["test"])
    assert env.cudnn_version == 90100 and env.cuda_driver == "570.86.15"
    assert env.gpus is not None and env.gpus[0]["name"] == H100.name
    assert env.gpus[0]["capability"] == "9.0" and env.gpus[0]["multiprocessors"] == 132


def test_the_facts_are_asked_once_a_process(
    cuda_only_in_children: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    forks: list[int] = []
    real_fork = os.fork

    def counted_fork() -> int:
        forks.append(1)
        return real_fork()

    monkeypatch.setattr(os, "fork", counted_fork)
    for _ in range(3):
        environment.cuda_devices()
        flash_kernels.capability("cuda:0")
    assert len(forks) == 1


def test_a_probe_that_fails_says_why_and_lists_no_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken() -> CudaFacts:
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(cuda_facts, "asked_here", broken)
    facts = cuda_facts.asked_in_a_child()
    assert facts.devices == ()
    assert facts.problem == "RuntimeError: CUDA driver initialization failed"


def test_a_probe_that_dies_without_an_answer_is_a_problem(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cuda_facts, "asked_here", lambda: os._exit(3))
    assert cuda_facts.asked_in_a_child() == CudaFacts(
        problem="the CUDA probe ended without an answer"
    )


def test_a_process_where_cuda_started_asks_torch_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cell's own process (or a user's) has CUDA started already: no child."""
    gpu = CudaFacts((DeviceFacts(H100.name, 9, 0, 1, 132),))
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda_facts, "asked_here", lambda: gpu)
    monkeypatch.setattr(cuda_facts, "asked_in_a_child", pytest.fail)
    caches.reset()
    assert cuda_facts.facts() == gpu
    assert cuda_facts.device_facts("cuda") == gpu.devices[0]
    assert cuda_facts.device_facts("cuda:1") is None


def test_without_a_cuda_build_nothing_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    monkeypatch.setattr(cuda_facts, "asked_in_a_child", pytest.fail)
    caches.reset()
    assert cuda_facts.facts() == CudaFacts()
    assert environment.cuda_devices() == []
    assert flash_kernels.capability("cuda:0") == (0, 0)
