"""float32 arithmetic, simulated in float64: the float32 control's rounding yardstick.

A half dtype's yardstick rounds the data and what each module stores, and never what a
module computes inside its ``forward``: there the bugs live (see
:mod:`harness.measure.judge.rounding`). A float32 computation has no such bugs of its own
to hide, and a cost the data's rounding does not have: every op rounds its result to
float32, and a long reduction (a LayerNorm's weight gradient summed over 2048 tokens, a
loss over a 16,000-wide vocabulary, a matmul's dot products) accumulates one rounding per
term. A healthy float32 model summing over 2048 tokens loses 28 times what rounding its
data costs. So the float32 control's yardstick runs the reference computation in float64
under :class:`Float32Arithmetic`, which moves the result of every op that computes (forward
and backward alike, at the aten level) by a random relative amount of at most float32's
unit roundoff, times ``sqrt(K)`` for an op that sums ``K`` terms into each result: the
size a float32 accumulation's error grows to, one rounding per term with random signs
(measured: a LayerNorm weight gradient over 2048 tokens, 23 unit roundoffs against
``sqrt(2048) = 45``).

What is not float32 arithmetic is not in it: a value computed in half precision inside a
float32 model (an autocast region of its own, a ``.half()``, a branch on ``x.dtype ==
torch.float32``) costs a thousand times more than the yardstick, and fails. Values float32
holds exactly are not moved: integers up to 2**24 (positions, counts), and the results of
ops that only move, select or compare values (views, copies, concatenation, indexing, max,
ReLU, ``where``). Random draws are the cell's, not noise's to move.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils import _pytree as pytree

from harness.measure.tracing.dispatch_mode import LazyDynamoMode

#: Ops whose result float32 holds exactly, given inputs it holds: they move, select,
#: compare or copy values, and round nothing.
EXACT_OPS = frozenset(
    {
        "_to_copy", "clone", "copy_", "copy", "contiguous", "cat", "stack", "index",
        "index_select", "gather", "scatter", "embedding", "where", "masked_fill",
        "masked_fill_", "masked_scatter", "slice_scatter",
        "select_scatter", "diagonal_scatter", "constant_pad_nd", "repeat", "flip", "roll",
        "fill_", "zero_", "zeros_like", "ones_like", "full_like", "empty_like", "new_zeros",
        "new_ones", "new_full", "new_empty", "neg", "abs", "relu", "relu_", "threshold",
        "threshold_backward", "sign", "max", "min", "amax", "amin", "maximum", "minimum",
        "clamp", "clamp_", "clamp_min", "clamp_max", "sort", "topk", "argmax", "argmin",
        "max_pool2d_with_indices", "max_pool2d_with_indices_backward", "tril", "triu",
        "lift_fresh", "lift_fresh_copy", "detach", "alias", "_unsafe_view", "expand",
        "_local_scalar_dense", "unfold", "col2im", "im2col", "unsqueeze_copy", "permute_copy",
        "native_dropout", "native_dropout_backward", "bernoulli", "bernoulli_",
    }
)  # fmt: skip
#: Ops that contract the last dimension of their operand at ``index`` (the dot products
#: of a matmul: ``K`` terms summed into each result).
CONTRACTIONS = {
    "mm": 0, "bmm": 0, "mv": 0, "dot": 0, "vdot": 0, "addmm": 1, "baddbmm": 1, "addbmm": 1,
    "addmv": 1, "_addmm_activation": 1,
}  # fmt: skip
#: Ops that sum along one dimension of their first operand, by the position of the
#: argument naming it (a softmax's denominator, a cumulative sum), and those that sum over
#: the trailing dimensions an argument gives (a normalisation's mean and variance).
ALONG_DIM = {
    "_softmax": 1, "_log_softmax": 1, "_softmax_backward_data": 2,
    "_log_softmax_backward_data": 2, "cumsum": 1, "cumsum_": 1, "cumprod": 1,
}  # fmt: skip
NORMALIZED = {"native_layer_norm": 1, "native_layer_norm_backward": 2}
#: The largest integer from which float32 holds every integer: 2**24.
EXACT_INTEGERS = 2.0**24


def op_name(func: Any) -> str:
    return str(func.overloadpacket.__name__)


def rounds(func: Any) -> bool:
    """An op whose result float32 arithmetic rounds: not a view, not a random draw, not
    one of ``EXACT_OPS``."""
    if torch.Tag.nondeterministic_seeded in func.tags or op_name(func) in EXACT_OPS:
        return False
    aliases = (r.alias_info for r in func._schema.returns)
    return not any(a is not None and not a.is_write for a in aliases)


def floating_inputs(args: Any) -> list[torch.Tensor]:
    return [
        t
        for t in pytree.tree_leaves(args)
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.is_sparse
    ]


def accumulated_terms(func: Any, args: tuple[Any, ...], out: torch.Tensor) -> int:
    """How many terms an op sums into each result (1 for a pointwise op): how many times
    its largest input's elements outnumber its result's (a sum over a dimension, a weight
    gradient summed over tokens, an embedding's rows), or more where the op says: a
    matmul's contracted dimension, a softmax's or a normalisation's, a convolution's
    window, an attention's head and sequence; a loss over a vocabulary sums one term per
    target, not per logit."""
    inputs = floating_inputs(args)
    if not inputs or out.numel() == 0:
        return 1
    name = op_name(func)
    if name.startswith("nll_loss") and not name.endswith("backward"):
        return max(args[1].numel(), 1)
    ratio = max(t.numel() for t in inputs) // out.numel()
    return max(ratio, declared_terms(name, args), 1)


def declared_terms(name: str, args: tuple[Any, ...]) -> int:
    """The terms an op sums into each result by what it is, beyond its inputs' sizes."""
    if name in CONTRACTIONS:
        return int(args[CONTRACTIONS[name]].shape[-1])
    if name in ALONG_DIM:
        return int(args[0].shape[args[ALONG_DIM[name]]]) if args[0].dim() else 1
    if name in NORMALIZED:
        return math.prod(args[NORMALIZED[name]])
    if name == "convolution":
        return int(args[1][0].numel())
    if name == "convolution_backward":
        grad, weight = args[0], args[2]
        return max(int(weight[:, 0].numel()), grad.numel() // max(grad.shape[1], 1))
    if name.startswith("_scaled_dot_product"):
        return max(int(args[0].shape[-1]), int(args[1].shape[-2]))
    return 1


def integers_up_to(tensor: torch.Tensor, largest: float) -> torch.Tensor:
    """Where ``tensor`` holds an integer of at most ``largest`` in size: values a format
    whose integers are exact up to ``largest`` holds exactly (2**24 in float32)."""
    return (tensor == tensor.round()) & (tensor.abs() <= largest)


class Float32Arithmetic(LazyDynamoMode):
    """While active, the result of every op that rounds (:func:`rounds`) is moved by a
    random relative amount of at most ``roundoff * sqrt(K)`` (``K`` the terms it sums into
    each result, :func:`accumulated_terms`), drawn from ``noise``; integers float32 holds
    exactly stay as they are. An in-place op's result is moved in place."""

    def __init__(self, roundoff: float, noise: torch.Generator) -> None:
        super().__init__()
        self.roundoff = roundoff
        self.noise = noise

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        if not rounds(func) or not floating_inputs(args):
            return out
        return pytree.tree_map_only(
            torch.Tensor, lambda t: self.rounded(t, accumulated_terms(func, args, t)), out
        )

    def rounded(self, tensor: torch.Tensor, terms: int) -> torch.Tensor:
        if not tensor.is_floating_point() or tensor.is_sparse or tensor.numel() == 0:
            return tensor
        relative = torch.rand(tensor.shape, generator=self.noise, dtype=torch.float64)
        bound = self.roundoff * math.sqrt(terms)
        moved = tensor * (1 + bound * (2 * relative - 1).to(tensor))
        return tensor.copy_(torch.where(integers_up_to(tensor, EXACT_INTEGERS), tensor, moved))
