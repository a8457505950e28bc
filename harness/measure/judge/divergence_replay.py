"""A module measured on its own code: the modules it calls return float64's outputs.

The divergence profile (:mod:`harness.measure.judge.divergence`) calls each module's twins
on float64's inputs. A module that calls others (a block its norm, attention and MLP; a
model its blocks) would have its twins compute those again, though each has been measured
already, as it returned, on float64's inputs of its own: the profile would cost a forward
for every level of the module tree. So while a container's twin runs, each module it calls
returns, without computing, what the same call returned in the float64 run, as the twin
holds it:

* the cell's twin: float64's output cast to the dtype the cell's own module returned on
  float64's inputs (float16 from a half linear, float32 from an autocast norm), on the
  cell's device;
* the yardstick's twin: float64's output as it is, which the yardstick's rounding of what a
  module returns (the module's forward hook, which a replayed call still runs) rounds as it
  would have rounded the module's own.

The container's own code (a residual sum, the logits' scaling, a softmax, positions held in
a buffer) then runs on float64's values at every boundary, and what it makes is measured
where it leaves that code: in what it passes to each module it calls (those inputs are
compared with float64's inputs of the same call), and in what it returns. The container's
error, rounding and ratio are those of the point where its ratio is worst. An error the
container's code makes is charged to it whether it flows out through its return or into a
module it calls; an error a module inside it makes is that module's alone.

Taken only where it can be: every call the container made had tensors and plain values as
inputs and output (no cache object, which the float64 run and the twins would share), each
was measured, together they take at most ``LIMIT_MIB``, and the twin calls the same modules
as often as float64 did. Otherwise the container's twin computes the modules it calls (its
error then holds theirs, as measured along its whole inside).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from harness.measure.tracing.dispatch_mode import out_of_modes

#: What one container's calls may keep of float64's inputs and outputs until it returns.
LIMIT_MIB = 512
#: The values other than tensors a replayed call's inputs and output may hold.
PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)


@dataclass(frozen=True)
class ChildCall:
    """One call a container made in the float64 run: the module's path, its inputs (detached
    copies) and what it returned (float64's, detached), and the dtypes of the floating tensors the
    cell's module returned on those inputs, in pytree order."""

    path: str
    inputs: Any
    output: Any
    dtypes: tuple[torch.dtype, ...]
    #: The version of each tensor of ``output`` as it returned (a later change in place,
    #: by the container or a module after it, moves it: the call is then not replayed).
    versions: tuple[int, ...] = ()

    def unchanged(self) -> bool:
        return versions_of(self.output) == self.versions


class NotReplayed(ValueError):
    """The twin did not call the modules inside as float64 did: measured whole instead."""


@dataclass
class Calls:
    """The calls a container made, as they returned; ``replayable`` False once one could not
    be kept (then none is replayed)."""

    kept: list[ChildCall] = field(default_factory=list)
    replayable: bool = True
    nbytes: int = 0

    def add(
        self, path: str, inputs: Any, output: Any, dtypes: tuple[torch.dtype, ...] | None
    ) -> None:
        if not self.replayable:
            return
        if dtypes is None or not (plain_values(inputs) and plain_values(output)):
            self.drop()
            return
        with out_of_modes():
            kept = pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, output)
        self.nbytes += nbytes_of(inputs) + nbytes_of(output)
        if self.nbytes > LIMIT_MIB * 2**20:
            self.drop()
            return
        self.kept.append(ChildCall(path, inputs, kept, dtypes, versions_of(kept)))

    def drop(self) -> None:
        self.kept, self.replayable = [], False

    def replayed(self) -> Sequence[ChildCall]:
        """The calls to replay: none where one could not be kept, or where what one
        returned was changed in place after (float64's output is kept as a view, not a
        copy: a ``ReLU(inplace=True)`` after a linear changes the linear's)."""
        if self.replayable and not all(call.unchanged() for call in self.kept):
            self.drop()
        return self.kept if self.replayable else ()


def versions_of(value: Any) -> tuple[int, ...]:
    return tuple(t._version for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def nbytes_of(value: Any) -> int:
    tensors = [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def plain_values(value: Any) -> bool:
    """Whether ``value`` is tensors and plain values, in containers pytree knows."""
    return all(isinstance(leaf, (torch.Tensor, *PLAIN)) for leaf in pytree.tree_leaves(value))


def floating_dtypes(output: Any) -> tuple[torch.dtype, ...]:
    leaves = pytree.tree_leaves(output)
    return tuple(t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point())


def as_held(device: torch.device | str) -> Callable[[ChildCall], Any]:
    """A call's float64 output as the cell holds it: each floating tensor in the dtype the
    cell's module returned it in, every tensor on the cell's device, fresh copies."""

    def held(call: ChildCall) -> Any:
        dtypes = iter(call.dtypes)

        def cast(tensor: torch.Tensor) -> torch.Tensor:
            dtype = next(dtypes) if tensor.is_floating_point() else tensor.dtype
            return tensor.to(device=device, dtype=dtype, copy=True)

        return pytree.tree_map_only(torch.Tensor, cast, call.output)

    return held


def as_is(call: ChildCall) -> Any:
    """A call's float64 output, fresh copies (the container may change them in place)."""
    return pytree.tree_map_only(torch.Tensor, torch.clone, call.output)


@dataclass
class Replay:
    """What a twin passed to each module it called in place of computing it, in the order of
    ``calls`` (None where it passed on only what it was given and what those modules
    returned, or views of them: its own code made none of it)."""

    calls: Sequence[ChildCall]
    #: The calls to keep what was passed to, by index (None: those the own code fed).
    keep_at: frozenset[int] | None = None
    passed: list[Any] = field(default_factory=list)
    #: The tensors its own code did not make, by id (kept alive while the twin runs).
    given: dict[int, torch.Tensor] = field(default_factory=dict)

    def fed(self) -> list[int]:
        """The calls the twin's own code fed, by index."""
        return [index for index, passed in enumerate(self.passed) if passed is not None]

    def give(self, value: Any) -> Any:
        """``value``, its tensors noted as given to the twin's own code."""
        for tensor in pytree.tree_leaves(value):
            if isinstance(tensor, torch.Tensor):
                self.given[id(tensor)] = tensor
        return value

    def made_by_own_code(self, value: Any) -> bool:
        """Whether a floating tensor in ``value`` is neither given nor a view of one given."""
        for tensor in pytree.tree_leaves(value):
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                base = tensor if tensor._base is None else tensor._base
                if not (self.was_given(tensor) or self.was_given(base)):
                    return True
        return False

    def keeps(self, index: int, fed: Any) -> bool:
        if self.keep_at is not None:
            return index in self.keep_at
        return self.made_by_own_code(fed)

    def was_given(self, tensor: torch.Tensor) -> bool:
        return self.given.get(id(tensor)) is tensor


@contextmanager
def replaying(
    calls: Sequence[ChildCall],
    module_at: Callable[[str], nn.Module],
    value: Callable[[ChildCall], Any],
    kept: Callable[[Any], Any],
    given: Any = None,
    keep_at: Collection[int] = (),
) -> Iterator[Replay]:
    """While it lasts, the module at each call's path (``module_at``) returns ``value(call)``
    for each of its calls in turn instead of computing, keeping ``kept((args, kwargs))`` of
    what it was passed: with ``given`` (the twin's inputs), where the twin's own code made
    some of it; else at the calls ``keep_at`` names (by index). Its hooks run as they
    would. ``NotReplayed`` where the twin called them otherwise than float64 did (more
    often, or not every one)."""
    replay = Replay(calls, None if given is not None else frozenset(keep_at))
    if not calls:  # a module that calls none: nothing to replay
        yield replay
        return
    replay.give(given)
    queues: dict[str, deque[tuple[int, ChildCall]]] = {}
    for index, call in enumerate(calls):
        queues.setdefault(call.path, deque()).append((index, call))
    passed: dict[int, Any] = {}
    forwards = []
    for path, queue in queues.items():
        try:
            module = module_at(path)
        except (KeyError, AttributeError) as error:
            raise NotReplayed(f"no module {path!r} in the twin") from error
        forwards.append((module, replayed(queue, value, kept, passed, replay)))
    with forwards_replaced(forwards):
        yield replay
    if len(passed) != len(calls):
        raise NotReplayed(f"called {len(passed)} of the {len(calls)} modules float64 called")
    replay.passed.extend(passed[index] for index in range(len(calls)))


def replayed(
    queue: deque[tuple[int, ChildCall]],
    value: Callable[[ChildCall], Any],
    kept: Callable[[Any], Any],
    passed: dict[int, Any],
    replay: Replay,
) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not queue:
            raise NotReplayed("called a module more often than float64 did")
        index, call = queue.popleft()
        fed = (args, kwargs)
        passed[index] = kept(fed) if replay.keeps(index, fed) else None
        return replay.give(value(call))

    return forward


@contextmanager
def forwards_replaced(
    forwards: Iterable[tuple[nn.Module, Callable[..., Any]]],
) -> Iterator[None]:
    """While it lasts, each module's ``forward`` is the function paired with it (its
    ``__call__``, and so its hooks, as they are); its own given back after."""
    patched: list[tuple[nn.Module, Any]] = []
    try:
        for module, forward in forwards:
            patched.append((module, module.__dict__.get("forward")))
            module.forward = forward
        yield
    finally:
        for module, own in reversed(patched):
            if own is None:
                del module.forward
            else:
                module.forward = own
