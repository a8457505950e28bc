"""A TorchDispatchMode that keeps Dynamo out of its frames without importing Dynamo first.

torch 2.9 and later wrap every mode's ``__torch_dispatch__`` in ``torch._disable_dynamo``,
whose first call imports ``torch._dynamo`` (some 800 modules: 1.0 s on a 2-core CPU, and
0.8 s more at interpreter exit). Dynamo can only trace a frame once it is imported, so the
wrapper here turns it away only where it is loaded, and costs nothing where it is not: the
harness's watches run in processes that never compile anything, and ``check`` of a small
model starts in half the time.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,
    _pop_mode,
    _push_mode,
)

DYNAMO = "torch._dynamo"


def skipped_by_dynamo(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as Dynamo's ``disable`` makes it, once Dynamo is imported; before, ``fn``."""
    disabled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal disabled
        if DYNAMO not in sys.modules:
            return fn(*args, **kwargs)
        if disabled is None:
            disabled = sys.modules[DYNAMO].disable(fn, recursive=True)
        return disabled(*args, **kwargs)

    return call


class LazyDynamoMode(TorchDispatchMode):
    """Base of the harness's dispatch modes: a subclass's ``__torch_dispatch__`` is wrapped
    by ``skipped_by_dynamo`` instead of torch's own wrapper."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # torch's own wrapping (2.9+): replaced below

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        dispatch = cls.__dict__.get("__torch_dispatch__")
        if dispatch is not None and not isinstance(dispatch, classmethod):
            cls.__torch_dispatch__ = skipped_by_dynamo(dispatch)  # type: ignore[method-assign]


def out_of_modes() -> AbstractContextManager[Any]:
    """While it lasts, the dispatch modes about stand aside, for the harness's own ops in a
    run it watches (what ``_disable_current_modes`` does, which imports four modules and
    walks both mode stacks on every call: a deep model's profile enters it thousands of
    times)."""
    return ModesAside()


class ModesAside:
    """The dispatch modes popped on entry and pushed back on exit; where torch's
    pre-dispatch stack holds any, ``_disable_current_modes`` itself."""

    def __init__(self) -> None:
        self.popped: list[TorchDispatchMode] = []
        self.whole: AbstractContextManager[Any] | None = None

    def __enter__(self) -> None:
        if pre_dispatch_modes():
            self.whole = _disable_current_modes()
            self.whole.__enter__()
            return
        self.popped = [_pop_mode() for _ in range(torch._C._len_torch_dispatch_stack())]

    def __exit__(self, *raised: Any) -> None:
        if self.whole is not None:
            self.whole.__exit__(*raised)
            return
        for mode in reversed(self.popped):
            _push_mode(mode)


def pre_dispatch_modes() -> int:
    """The modes on torch's pre-dispatch stack (torch 2.2 and later; none before)."""
    count = getattr(torch._ops, "_len_torch_dispatch_stack_pre_dispatch", None)
    return int(count()) if count is not None else 0
