"""Every process-global cache of the measuring and running layers is registered in
``harness.measure.host.caches``, and its one ``reset`` empties each of them."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.measure.host import caches
from tests.conftest import ROOT

#: The layers whose modules keep process-global caches.
CACHING_PACKAGES = ("harness.measure", "harness.runner")


def import_caching_modules() -> None:
    """Every module of those layers imported, so each of their caches is registered."""
    for package in CACHING_PACKAGES:
        path = importlib.import_module(package).__path__
        for module in pkgutil.iter_modules(path, f"{package}."):
            importlib.import_module(module.name)


def function_fillers() -> dict[str, Callable[[], Any]]:
    """A call that puts an entry in each cached function's cache."""
    from harness.measure.figures import perf
    from harness.measure.host import cuda_facts, environment, flash_kernels, torch_state
    from harness.measure.running import training
    from harness.measure.tracing import kernels, source_sites, trail

    mm = torch.ops.aten.mm.default
    fillers: dict[Callable[..., Any], Callable[[], Any]] = {
        torch_state.settings: torch_state.settings,
        cuda_facts.facts: cuda_facts.facts,
        flash_kernels.installed_version: lambda: flash_kernels.installed_version("flash-attn"),
        kernels.op_name: lambda: kernels.op_name(mm),
        kernels.short_name: lambda: kernels.short_name(mm),
        kernels.kernel_kind: lambda: kernels.kernel_kind(mm),
        trail.warm_up: trail.warm_up,
        source_sites.calls_in: lambda: source_sites.calls_in(__file__),
        environment.module_available: lambda: environment.module_available("json"),
        perf.warm_up: perf.warm_up,
        training.warm_up: training.warm_up,
    }
    return {f"{func.__module__}.{func.__qualname__}": call for func, call in fillers.items()}


def fill(name: str, found: caches.Cache, fillers: dict[str, Callable[[], Any]]) -> None:
    if isinstance(found, dict):
        found[object()] = None
        return
    assert name in fillers, f"no filler for the registered cache {name}: add one above"
    fillers[name]()


def test_the_reset_empties_every_registered_cache(
    monkeypatch: pytest.MonkeyPatch, fresh_caches: None
) -> None:
    from harness.measure.figures import perf

    monkeypatch.setattr(perf, "peak_memory_cpu", lambda fn: 0)  # no profiler start
    import_caching_modules()
    fillers = function_fillers()
    for name, registered in caches.registered().items():
        for found in registered:
            fill(name, found, fillers)
    sizes = caches.sizes()
    assert [name for name, size in sizes.items() if size == 0] == []
    assert {
        "harness.measure.judge.references._REFERENCES",
        "harness.runner.isolation._SHARED",
    } <= set(sizes)
    caches.reset()
    assert {name: size for name, size in caches.sizes().items() if size} == {}


def test_a_module_run_again_keeps_both_caches_in_the_reset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Code that imported from the first run of a module still uses its cache."""
    monkeypatch.setattr(caches, "_CACHES", {})
    first, second = caches.keyed("module.CACHE"), caches.keyed("module.CACHE")
    first["a"] = second["b"] = 1
    assert caches.sizes() == {"module.CACHE": 2}
    caches.reset()
    assert (first, second) == ({}, {})


def functools_caches(path: Path) -> list[str]:
    """Where a module caches through functools directly, bypassing the registry."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "functools":
            names = {alias.name for alias in node.names} & {"cache", "lru_cache"}
            found += [f"{path.name}:{node.lineno} imports functools.{n}" for n in sorted(names)]
        if (
            isinstance(node, ast.Attribute)
            and node.attr in ("cache", "lru_cache")
            and isinstance(node.value, ast.Name)
            and node.value.id == "functools"
        ):
            found.append(f"{path.name}:{node.lineno} uses functools.{node.attr}")
    return found


def test_no_cache_of_the_measuring_or_running_layers_escapes_the_registry() -> None:
    caching_dirs = [ROOT / "harness" / name for name in ("measure", "runner")]
    unregistered = [
        where
        for folder in caching_dirs
        for path in sorted(folder.glob("*.py"))
        if path.name != "caches.py"
        for where in functools_caches(path)
    ]
    assert unregistered == []
