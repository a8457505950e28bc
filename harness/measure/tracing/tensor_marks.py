"""What the dtype tracer (:mod:`harness.measure.tracing.trail`) reads and leaves on
tensors: the marks it sets on them (attribute names), the families of ops it tells apart
(casts, layout, scaling, from Python data), the floating tensors of an op's arguments, the
names of a workload's tensors (:class:`Names`) and a drifted kernel's state while the run
goes on (:class:`IslandState`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from harness.measure.precision.casting import is_kept
from harness.measure.precision.flags import TENSOR_ATTRIBUTE, named_tensors
from harness.schema.trail_records import Promotion, Site

ORIGIN_ATTR = "_ampmatrix_origin"
#: Set on wide tensors computed only from parts the case keeps in fp32 (views of them, say).
KEPT_ATTR = "_ampmatrix_kept"
#: The promotion a tensor descends from (carried through later ops, narrowing casts too).
PROMOTION_ATTR = "_ampmatrix_promotion"
#: Casts: a low-precision tensor made wider by one of these was cast on purpose.
CAST_OPS = frozenset({"_to_copy", "to", "_to_copy_out", "type_as", "copy"})
#: Ops that only lay a tensor out anew: an upcast tensor stays "the upcast" through them
#: (once computed with, in a norm say, the upcast has served its purpose).
LAYOUT_OPS = frozenset(
    {
        "view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "permute", "t",
        "expand", "contiguous", "clone", "slice", "select", "unsqueeze", "squeeze", "unbind",
        "split", "split_with_sizes", "chunk", "narrow", "as_strided", "alias", "detach",
        "flatten", "unflatten", "repeat", "cat", "stack",
    }
)  # fmt: skip
#: Ops that scale a tensor by a number (every other input a 0-dim tensor, or none): a tensor
#: autocast cast back down stays "the undone upcast" through them and layout ops, on its way
#: to the kernel autocast cast it for. SDPA's math fallback (CPU inputs the fused kernel
#: does not take: dropout, not 4-D, a head dim that differs) scales q and k before its
#: ``bmm``; on torch 2.4.1 that ``bmm`` runs in the dtype autocast cast to (on 2.13.0 the
#: math path casts the rounded inputs back to float32 itself, and the mark goes with them).
SCALING_OPS = frozenset({"mul", "div"})
#: Ops that turn Python data into a tensor (``torch.tensor([...])``).
FROM_DATA_OPS = frozenset({"lift_fresh", "lift_fresh_copy", "lift"})
#: Set on a tensor the code cast up explicitly (and on what is computed from it, wide):
#: where the cast was.
UPCAST_ATTR = "_ampmatrix_upcast"
#: Set on a tensor autocast cast back down from an explicit upcast: where the upcast was.
UNDONE_ATTR = "_ampmatrix_undone"
#: Set on wide results of a drifted kernel and what is computed from them, wide: the
#: island's index in ``DtypeTracer.islands``.
ISLAND_ATTR = "_ampmatrix_island"


def floating_tensors(tree: Any) -> list[torch.Tensor]:
    """The floating tensors of an op's arguments or result (flat, or one level of lists, as
    aten ops take them; anything deeper is flattened the slow way)."""
    if isinstance(tree, torch.Tensor):
        return [tree] if tree.is_floating_point() else []
    if not isinstance(tree, (list, tuple, dict)):
        return []  # a number, None, or an opaque object (a profiler record, say)
    found = []
    for item in tree.values() if isinstance(tree, dict) else tree:
        if isinstance(item, torch.Tensor):
            if item.is_floating_point():
                found.append(item)
        elif isinstance(item, (list, tuple, dict)):
            found += floating_tensors(item)
    return found


def scales_one(inputs: list[torch.Tensor]) -> bool:
    """One tensor scaled by numbers: every other floating input is 0-dim."""
    return sum(t.dim() > 0 for t in inputs) == 1


def widens(dtype: torch.dtype, low: torch.dtype) -> bool:
    return dtype.is_floating_point and torch.finfo(dtype).bits > torch.finfo(low).bits


@dataclass
class Names:
    """Names of the tensors a workload holds: parameters, buffers, attributes, inputs."""

    by_id: dict[int, str] = field(default_factory=dict)
    kept: set[int] = field(default_factory=set)
    #: Plain tensor attributes of the model (``module.to()`` does not cast them), and those
    #: an op of the run read.
    attributes: set[int] = field(default_factory=set)
    read: set[int] = field(default_factory=set)

    def unused(self, tensor: torch.Tensor) -> bool:
        """A plain tensor attribute that no op of the run read."""
        return id(tensor) in self.attributes and id(tensor) not in self.read

    @classmethod
    def of_workload(cls, model: Any, inputs: dict[str, Any], keep: tuple[str, ...]) -> Names:
        names = cls()
        for kind, name, tensor in named_tensors(model):
            names.by_id[id(tensor)] = f"{kind} {name}"
            if kind == TENSOR_ATTRIBUTE:
                names.attributes.add(id(tensor))
            if is_kept(name, keep):
                names.kept.add(id(tensor))
        for key, value in inputs.items():
            for n, t in enumerate(floating_tensors(value)):
                names.by_id.setdefault(id(t), f"input {key}" + (f"[{n}]" if n else ""))
        return names


@dataclass
class IslandState:
    """A kernel that computed wider than the cell's dtype, while the run goes on."""

    site: Site
    dtype: str
    #: Its values came back in the cell's dtype.
    narrowed: bool = False
    #: Its values fed another wide kernel (that island's fate is theirs).
    continued: bool = False


def promotion_of(tensors: list[torch.Tensor]) -> Promotion | None:
    return next((p for t in tensors if (p := getattr(t, PROMOTION_ATTR, None)) is not None), None)
