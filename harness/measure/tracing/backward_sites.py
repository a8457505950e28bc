"""Where a training step's backward went wrong, told by the forward line that made the node.

An error raised in backward happens in an autograd node, far from the code that built the
graph: a built-in node's backward (``MmBackward0``) has no Python frame of the case's at
all, and a custom ``autograd.Function``'s backward has only its own. What names the place
is the line of the forward that made the node (for a custom Function, the line calling
``.apply``), as torch's anomaly mode prints it. The same holds for gradients that are not
finite: which parameter's gradient went non-finite first, and which node first made a
non-finite gradient from finite ones.

Nothing here runs on a healthy step. Only a step whose backward raised, or left gradients
that are not finite, is taken again (:func:`located_failure`, :func:`located_non_finite`):
its forward with torch's anomaly mode keeping each node's forward stack (its NaN check off,
its warnings not the cell's), from the random state the step began with, and its backward
with a hook before and after every node of the graph.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from harness.measure.precision.dtypes import dtype_name
from harness.measure.tracing.source_sites import (
    TORCH_DIR,
    frames_outward,
    is_library_file,
    shown,
    traceback_entries,
)
from harness.schema.devices import CUDA
from harness.schema.trail_records import BackwardNode

#: Set on an error raised in backward: the :class:`BackwardNode` it raised in.
BACKWARD_NODE_ATTR = "_ampmatrix_backward_node"
#: Where torch's anomaly mode keeps a node's forward stack (``traceback.format_list`` lines).
TRACEBACK_KEY = "traceback_"
FRAME_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+)')
#: The functions of ``torch.autograd`` that run the autograd engine (``loss.backward()``
#: goes through them): frames beyond them belong to whoever called backward, not to a node.
ENGINE_FILES = frozenset(str(Path(TORCH_DIR, "autograd", f)) for f in ("__init__.py", "graph.py"))
ENGINE_FUNCTIONS = frozenset({"backward", "grad", "_engine_run_backward"})

#: The step to take again, given the watch to attach to its graph's root (the loss's node).
Rerun = Callable[["NodeWatch"], None]


def in_backward() -> bool:
    """An autograd node is running (the op now dispatched is part of a backward)."""
    return torch._C._current_autograd_node() is not None


def location_in_backward(frame: FrameType | None) -> str | None:
    """The innermost frame of the case's or model's own code inside the running backward (a
    custom Function's backward), as ``file:line``; None for a built-in node's backward,
    whose only Python frames are those of the code that called ``backward()``."""
    for f in frames_outward(frame):
        if is_engine_entry(f):
            return None
        if not is_library_file(f.f_code.co_filename):
            return shown(f.f_code.co_filename, f.f_lineno)
    return None


def is_engine_entry(frame: FrameType) -> bool:
    code = frame.f_code
    return code.co_name in ENGINE_FUNCTIONS and resolved(code.co_filename) in ENGINE_FILES


def resolved(filename: str) -> str:
    """A source file's path with links resolved (``TORCH_DIR`` is), or as given."""
    try:
        return str(Path(filename).resolve())
    except (OSError, ValueError):
        return filename


def raised_in_backward_code(error: BaseException) -> bool:
    """``error`` was raised inside a backward by the case's or model's own code (a custom
    Function's backward), not by a built-in node (whose traceback's innermost frame of the
    case's is the code that called ``backward()``)."""
    inside = found = False
    for entry in traceback_entries(error.__traceback__):
        if is_engine_entry(entry.tb_frame):
            inside, found = True, False
        elif inside and not is_library_file(entry.tb_frame.f_code.co_filename):
            found = True
    return found


def made_at(node: Any) -> str | None:
    """The line whose forward call made ``node``, from the stack anomaly mode kept for it:
    the innermost of the case's or model's own code; None where it kept no stack, or none
    of the model's (a node of the harness's default loss: a harness file, or a mode the
    harness ran the step under, is never where a model's error came from)."""
    stack = node.metadata.get(TRACEBACK_KEY) if isinstance(node.metadata, dict) else None
    frames = [(m["file"], int(m["line"])) for e in stack or () if (m := FRAME_LINE.match(str(e)))]
    found = [(file, line) for file, line in frames if not is_library_file(file)]
    return shown(*found[-1]) if found else None


def dtypes_of(grads: Iterable[torch.Tensor | None]) -> tuple[str, ...]:
    return tuple(dtype_name(g.dtype) for g in grads if isinstance(g, torch.Tensor))


def all_finite(grads: Iterable[torch.Tensor | None]) -> bool:
    """Every floating gradient is finite (one check, one device synchronisation); of a
    sparse gradient (``nn.Embedding(sparse=True)``'s), the values it holds."""
    checks = [
        torch.isfinite(stored_values(g)).all()
        for g in grads
        if isinstance(g, torch.Tensor) and g.is_floating_point()
    ]
    return not checks or bool(torch.stack(checks).all())


def stored_values(tensor: torch.Tensor) -> torch.Tensor:
    """The values a tensor holds: a sparse tensor's, else the tensor itself."""
    return tensor._values() if tensor.is_sparse else tensor


def node_of(node: Any, received: tuple[torch.Tensor | None, ...]) -> BackwardNode:
    return BackwardNode(node.name(), made_at(node), dtypes_of(received))


def graph_nodes(root: Any) -> list[Any]:
    """Every node of the graph that ends in ``root``, each once."""
    seen: dict[int, Any] = {}
    pending = [root]
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        pending += [child for child, _ in node.next_functions]
    return list(seen.values())


class NodeWatch:
    """Hooks before and after every node of a step's graph: the node running (the one a
    raising backward raised in), the first node to make a gradient that is not finite from
    finite ones, and the first parameter whose gradient arrived not finite."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params
        self.names = {id(p): name for name, p in params.items()}
        #: The node running and the gradients it received (described only if it raised).
        self.running: tuple[Any, tuple[torch.Tensor | None, ...]] | None = None
        self.first_made: BackwardNode | None = None
        self.first_parameter: str | None = None
        self.handles: list[Any] = []

    def attach(self, root: Any) -> None:
        for node in graph_nodes(root):
            self.handles.append(node.register_prehook(partial(self.before, node)))
            self.handles.append(node.register_hook(partial(self.after, node)))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def before(self, node: Any, received: tuple[torch.Tensor | None, ...]) -> None:
        self.running = (node, received)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a parameter's
        name = self.names.get(id(variable)) if variable is not None else None
        if name is not None and self.first_parameter is None and not all_finite(received):
            self.first_parameter = name

    def after(
        self,
        node: Any,
        made: tuple[torch.Tensor | None, ...],
        received: tuple[torch.Tensor | None, ...],
    ) -> None:
        self.running = None
        if self.first_made is None and all_finite(received) and not all_finite(made):
            self.first_made = node_of(node, received)

    def failed(self) -> BackwardNode | None:
        """The node that was running when the backward raised."""
        return node_of(*self.running) if self.running is not None else None


@contextmanager
def forward_stacks() -> Iterator[None]:
    """Torch's anomaly mode, for one of its effects: every autograd node made keeps the
    stack that made it. Its NaN check is off (a NaN is found by the watch, not raised), and
    its warnings are not the cell's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.set_detect_anomaly(True, check_nan=False):
            yield


def watched_rerun(
    rerun: Rerun, params: dict[str, torch.Tensor]
) -> tuple[NodeWatch, Exception | None]:
    """The step taken again under the watch: the watch, and what the step raised."""
    watch = NodeWatch(params)
    try:
        with forward_stacks():
            rerun(watch)
    except Exception as raised:
        return watch, raised
    finally:
        watch.detach()
    return watch, None


def located_failure(error: BaseException, rerun: Rerun, params: dict[str, torch.Tensor]) -> None:
    """Take a step whose backward raised ``error`` again, and where it raises the same
    error, note on ``error`` the node it raised in (``BACKWARD_NODE_ATTR``)."""
    watch, again = watched_rerun(rerun, params)
    same = again is not None and type(again) is type(error) and str(again) == str(error)
    failed = watch.failed() if same else None
    if failed is not None:
        setattr(error, BACKWARD_NODE_ATTR, failed)


def failed_node(error: BaseException | None) -> BackwardNode | None:
    """The autograd node ``error`` was raised in, where a training step found it."""
    found = getattr(error, BACKWARD_NODE_ATTR, None)
    return found if isinstance(found, BackwardNode) else None


@dataclass(frozen=True)
class NonFinite:
    """Where a step's gradients went non-finite: the first parameter whose gradient arrived
    so, and the first node that made such a gradient from finite ones."""

    parameter: str | None
    node: BackwardNode | None

    def describe(self) -> str:
        """``gradients not finite, first grad.proj.bias's; first made from finite ones by
        RsqrtBackward0, made in the forward at model.py:14, on gradients [float16]``."""
        parts = ["gradients not finite"]
        if self.parameter:
            parts.append(f"first grad.{self.parameter}'s")
        if self.node:
            parts.append(f"first made from finite ones by {self.node.describe()}")
        return "; ".join([", ".join(parts[:2]), *parts[2:]])


def located_non_finite(rerun: Rerun, params: dict[str, torch.Tensor]) -> NonFinite | None:
    """Take a step whose gradients were not finite again, and say where they went so
    (None where the step taken again raised, or its gradients came out finite)."""
    watch, again = watched_rerun(rerun, params)
    if again is not None or (watch.first_parameter is None and watch.first_made is None):
        return None
    return NonFinite(watch.first_parameter, watch.first_made)


@dataclass(frozen=True)
class RandomState:
    """The random state a step began with, to take the step again from (dropout draws the
    same masks)."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    device: torch.device

    @classmethod
    def now(cls, device: torch.device) -> RandomState:
        cuda = torch.cuda.get_rng_state(device) if device.type == CUDA else None
        return cls(torch.get_rng_state(), cuda, device)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)
