"""Every process-global cache of computed values, in one registry, cleared by one ``reset``.

A value that is costly to compute and the same for the rest of the process (a case's float64
reference, the torch settings this build can read, an op's name) is held in a cache made
here: ``keyed`` for a dict the code fills itself (references arrive from a forked child,
not from a call), ``cache`` and ``lru_cache`` for a function's results, as functools'
decorators of the same names. Each registers under its qualified name as its module is
imported (a cache whose module is not imported is empty).

``reset`` clears them all: what a test or a benchmark calls when it changes what they were
computed from (the registered cases, a monkeypatched environment), so no cache is forgotten
and no cache's own clearing function is called from outside.

Registries (the cases, in ``harness.measure.authoring.registry``) and recorded states (the worker's
torch settings at its start, in ``harness.runner.isolation``) are not caches: clearing them
would lose what cannot be computed again, so they are not registered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, Protocol, TypeVar, cast

P = ParamSpec("P")
T = TypeVar("T")


class Cache(Protocol):
    """What the registry needs of a cache: to empty it, and to tell how much it holds."""

    def clear(self) -> None: ...

    def __len__(self) -> int: ...


class FunctionCache:
    """A functools-cached function seen as a cache."""

    def __init__(self, func: Any) -> None:
        self.func = func

    def clear(self) -> None:
        self.func.cache_clear()

    def __len__(self) -> int:
        return int(self.func.cache_info().currsize)


#: The registered caches by name; a name has more than one where its module ran again.
_CACHES: dict[str, list[Cache]] = {}


def register(name: str, cache: Cache) -> None:
    """Add a cache to those ``reset`` clears. A module executed again (``importlib.reload``,
    a test that drops it from ``sys.modules``) registers its new cache beside the old one,
    which code that imported from it earlier may still use: ``reset`` clears both."""
    _CACHES.setdefault(name, []).append(cache)


def keyed(name: str) -> dict[Any, Any]:
    """A new, registered dict, for a cache the code fills itself (``name``: the module's
    name and the variable's)."""
    found: dict[Any, Any] = {}
    register(name, found)
    return found


def lru_cache(maxsize: int | None) -> Callable[[Callable[P, T]], Callable[P, T]]:
    """``functools.lru_cache(maxsize)``, registered under the function's qualified name."""

    def decorate(func: Callable[P, T]) -> Callable[P, T]:
        cached = functools.lru_cache(maxsize=maxsize)(func)
        register(f"{func.__module__}.{func.__qualname__}", FunctionCache(cached))
        return cast(Callable[P, T], cached)

    return decorate


def cache(func: Callable[P, T]) -> Callable[P, T]:
    """``functools.cache``, registered under the function's qualified name."""
    return lru_cache(None)(func)


def reset() -> None:
    """Empty every registered cache: each value is computed again when next asked for."""
    for registered in _CACHES.values():
        for found in registered:
            found.clear()


def registered() -> dict[str, list[Cache]]:
    """The registered caches, by name."""
    return {name: list(found) for name, found in _CACHES.items()}


def sizes() -> dict[str, int]:
    """How many entries the caches of each name hold."""
    return {name: sum(len(c) for c in found) for name, found in _CACHES.items()}
