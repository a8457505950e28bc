"""The compute kernels, defined once: which aten ops are the matmuls, convolutions and
attention kernels whose input dtypes are the dtypes a model computed in, and their FLOPs.

Both watches of a run classify ops here: the dtype tracer (:mod:`harness.measure.tracing.trail`:
a cell's ``compute_dtypes``, its FLOPs computed wider and their share, the drift flag) and
the attention core's recorder (:mod:`harness.measure.tracing.observe`: ``attn_dtype`` where no
tracer runs). Ops are named by their schema name without the namespace and overload
(``aten::addmm.out`` -> ``addmm``), compared whole, never searched as text, except the
attention kernels, a family whose members are named by what they contain.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.measure.host import caches
from harness.schema.kernel_kinds import ATTENTION as ATTENTION  # the kinds, declared once
from harness.schema.kernel_kinds import MATMUL as MATMUL
from harness.schema.kernel_kinds import KernelKind

#: Matmul kernels, by the positions of their two factors among the floating inputs.
FACTORS = {"mm": 0, "bmm": 0, "mv": 0, "dot": 0, "addmm": 1, "_addmm_activation": 1}
FACTORS |= {"baddbmm": 1, "addbmm": 1, "addmv": 1}
MATMUL_OPS = frozenset(FACTORS)
#: Convolutions: compute kernels of the matmul kind.
CONVOLUTION_OPS = frozenset({"convolution", "_convolution", "mkldnn_convolution"})
#: Ops that run attention (or a whole layer) in one native kernel: names containing these.
ATTENTION_MARKERS = ("attention", "_transformer_encoder_layer_fwd", "_native_multi_head")
#: Fused layers that dispatch their inner ops themselves: under autocast their inputs do not
#: tell the dtype they compute in.
FUSED_LAYER_OPS = frozenset(
    {
        "_transformer_encoder_layer_fwd",
        "_native_multi_head_attention",
        "_transformer_decoder_only_layer_fwd",
    }
)
#: Attention kernels whose first three inputs are q, k and v; what follows (a float mask, a
#: bias) is added to the scores and says nothing of the dtype the kernel computes in.
QKV_FIRST_MARKERS = ("scaled_dot_product", "_flash_attention_forward", "_efficient_attention")
#: Attention kernels that take q, k and v laid out (batch, seq, heads, dim); the others
#: take (batch, heads, seq, dim).
SEQ_FIRST_MARKERS = ("_efficient_attention", "_flash_attention")


@caches.cache
def op_name(func: Any) -> str:
    """``aten::mm``; cached per op (the tracer asks for every op a cell runs)."""
    schema = getattr(func, "_schema", None)
    return str(schema.name) if schema is not None else str(func)


@caches.cache
def short_name(func: Any) -> str:
    return op_name(func).split("::")[-1]


@caches.cache
def kernel_kind(func: Any) -> KernelKind | None:
    """:data:`ATTENTION`, :data:`MATMUL` (a convolution too), or None for an op that is not
    a compute kernel."""
    name = short_name(func)
    if any(marker in name for marker in ATTENTION_MARKERS):
        return ATTENTION
    return MATMUL if name in MATMUL_OPS or name in CONVOLUTION_OPS else None


def is_fused_layer(func: Any) -> bool:
    return short_name(func) in FUSED_LAYER_OPS


def computed_inputs(func: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The inputs whose dtype is the dtype a kernel computes in."""
    name = short_name(func)
    return inputs[:3] if any(marker in name for marker in QKV_FIRST_MARKERS) else inputs


def kernel_flops(func: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> int | None:
    """Floating-point operations of a matmul, convolution or attention kernel from its
    shapes (a multiply-add is two); None for a kernel whose work its shapes do not tell (a
    fused layer)."""
    name = short_name(func)
    if name in FACTORS and len(inputs) >= FACTORS[name] + 2:
        # (..., M, K) @ (..., K, N): 2 * M * K * N per batch; a vector factor has N = 1
        a, b = inputs[FACTORS[name]], inputs[FACTORS[name] + 1]
        return 2 * a.numel() * (b.shape[-1] if b.dim() >= 2 else 1)
    if name in CONVOLUTION_OPS and len(inputs) >= 2 and outputs:
        return 2 * outputs[0].numel() * int(inputs[1][0].numel())
    if any(marker in name for marker in QKV_FIRST_MARKERS) and len(inputs) >= 3:
        q, k, v = inputs[:3]
        keys = k.shape[1] if name.startswith(SEQ_FIRST_MARKERS) else k.shape[-2]
        return 2 * q.numel() * keys * (q.shape[-1] + v.shape[-1]) // max(q.shape[-1], 1)
    return None
