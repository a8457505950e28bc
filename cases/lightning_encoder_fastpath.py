"""nn.TransformerEncoder in eval mode under CPU autocast: the native fast path mixes dtypes.

Upstream: Lightning-AI/pytorch-lightning#19980 (``precision="bf16-mixed"`` validation on the
CPU fails, ``bf16-true`` works) and its plain-torch reproduction pytorch/pytorch#132613:
``model.eval()``, ``torch.no_grad()``, ``torch.autocast("cpu", dtype=torch.bfloat16)``.
In ``torch/nn/modules/transformer.py`` (torch 2.4.1) ``TransformerEncoderLayer.forward``
takes the native fast path ``torch._transformer_encoder_layer_fwd`` unless
``torch.is_autocast_enabled()``, which without a device argument only looks at CUDA
autocast. Under CPU autocast the native kernel's inner ``linear`` is autocast to half while
its ``_addmm_activation`` (no AutocastCPU policy) gets the fp32 weight:
``mat1 and mat2 must have the same dtype, but got BFloat16 and Float``. Fixed on the torch side
by pytorch/pytorch#135936 (AutocastCPU policy for ``_addmm_activation``); same bug class as
#82783 (CUDA, fixed by #84722), #107663 (CPU), #191796 (XPU).

The attention core of the fast path runs inside one native op, where no Python code can
observe it, and observing the encoder changes the path: a TorchDispatchMode around it makes
the native op run without autocast inside (torch 2.4.1 then passes), and module hooks turn the
fast path off on newer torch. So the attention core (``self_attn``) is recorded only when the
fast path is disabled; where it may be taken the observation stays empty.

Two sizes: ``SMALL`` (toy dimensions) and ``UPSTREAM``, the #132613 reporter's own encoder
(``PoseFSQAutoEncoder``: ``d_model=512``, ``nhead=16``, ``dim_feedforward=2048``, 6 layers)
on the issue's batch of 2 clips of 10 frames. Both feed the encoder token embeddings of
``dims.d_model``; the issue's ``Flatten`` and input ``Linear`` in front of it are left out.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from harness.measure.authoring.case import (
    Case,
    FailureSignature,
    RunContext,
    Size,
    Upstream,
    Workload,
    fix,
)
from harness.measure.authoring.registry import register


@dataclass(frozen=True)
class Dims:
    """The encoder's dimensions and the batch of token embeddings it validates."""

    d_model: int
    nhead: int
    dim_feedforward: int
    num_layers: int
    batch: int
    seq_len: int


SMALL = Dims(d_model=32, nhead=4, dim_feedforward=64, num_layers=2, batch=2, seq_len=8)
#: #132613's ``PoseFSQAutoEncoder`` encoder and the issue's input, 2 clips of 10 frames.
UPSTREAM = Dims(d_model=512, nhead=16, dim_feedforward=2048, num_layers=6, batch=2, seq_len=10)
UPSTREAM_SOURCE = (
    "pytorch/pytorch#132613 (the model of Lightning-AI/pytorch-lightning#19980): "
    "PoseFSQAutoEncoder(hidden_dim=512, nhead=16, dim_feedforward=2048, num_layers=6), "
    "nn.TransformerEncoderLayer(batch_first=True); input torch.randn(2, 10, 178, 3): batch 2, "
    "10 frames (its Flatten + Linear(534, 512) in front of the encoder left out)"
)
#: Both sizes, for this case and the Trainer case that validates the same encoder.
ENCODER_SIZES = (
    Size("small", SMALL, "toy dimensions"),
    Size("upstream", UPSTREAM, UPSTREAM_SOURCE),
)

MAT1_MAT2_DTYPES = r"mat1 and mat2 must have the same dtype, but got (BFloat16|Half) and Float"


def build_encoder(dims: Dims) -> nn.TransformerEncoder:
    """The #132613 model: batch-first post-norm encoder layers, eval mode, fp32 on the CPU."""
    layer = nn.TransformerEncoderLayer(
        d_model=dims.d_model,
        nhead=dims.nhead,
        dim_feedforward=dims.dim_feedforward,
        batch_first=True,
    )
    encoder = nn.TransformerEncoder(layer, num_layers=dims.num_layers, enable_nested_tensor=True)
    return encoder.eval()


def build_source(dims: Dims) -> torch.Tensor:
    """One batch of token embeddings (B, L, D), fp32 on the CPU."""
    return torch.randn(dims.batch, dims.seq_len, dims.d_model)


def encoder_workload(dims: Dims) -> Workload:
    """The encoder and its input in float32 (shared with the Trainer case)."""
    return Workload(model=build_encoder(dims), inputs={"src": build_source(dims)})


def param_dtype(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


@contextmanager
def record_self_attention(encoder: nn.TransformerEncoder, ctx: RunContext) -> Iterator[None]:
    """Record the dtypes of every Python ``self_attn`` call, only when the fast path is off.

    Forward hooks would themselves turn the fast path off on newer torch ("forward pre-/hooks
    are attached to the module"), so none are attached while it may be taken.
    """
    recording = ExitStack()

    def start(*_: Any) -> None:
        recording.enter_context(ctx.attention_core())

    def stop(*_: Any) -> None:
        recording.close()

    with ExitStack() as cleanup:
        cleanup.callback(recording.close)
        fastpath_possible = torch.backends.mha.get_fastpath_enabled()
        hooked = () if fastpath_possible or not ctx.observe else encoder.layers
        for layer in hooked:
            cleanup.callback(layer.self_attn.register_forward_pre_hook(start).remove)
            cleanup.callback(layer.self_attn.register_forward_hook(stop).remove)
        yield


@contextmanager
def fastpath_disabled() -> Iterator[None]:
    """``torch.backends.mha.set_fastpath_enabled(False)``, the previous value restored."""
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


def encode(encoder: nn.TransformerEncoder, src: torch.Tensor, ctx: RunContext) -> torch.Tensor:
    """Inference as in #132613, the attention recorded where that leaves the path alone."""
    with record_self_attention(encoder, ctx):
        out: torch.Tensor = encoder(src)
    return out


def encode_outside_autocast(
    encoder: nn.TransformerEncoder, src: torch.Tensor, ctx: RunContext
) -> torch.Tensor:
    """Autocast switched off around the encoder; it runs in its weights' dtype (fp32).

    Upstream code would write ``src.float()``; the weights' dtype is float32 in the autocast
    cells and float64 in the reference, so nothing is forced to float32 there.
    """
    with torch.autocast(ctx.device.type, enabled=False):
        return encode(encoder, src.to(param_dtype(encoder)), ctx)


def encode_cast_to(
    encoder: nn.TransformerEncoder, src: torch.Tensor, ctx: RunContext, dtype: torch.dtype
) -> torch.Tensor:
    """``bf16-true``: a copy of the model and the input cast to ``dtype``, no autocast."""
    with torch.autocast(ctx.device.type, enabled=False):
        return encode(copy.deepcopy(encoder).to(dtype), src.to(dtype), ctx)


@register
class LightningEncoderFastpath(Case):
    name = "lightning-encoder-fastpath"
    title = "nn.TransformerEncoder eval fast path under CPU autocast: half input, fp32 weight"
    upstream = Upstream(
        repo="pytorch/pytorch",
        file="torch/nn/modules/transformer.py",
        commit="38b96d3399a695e704ed39b60dac733c3fbf20e2",
        issues=(
            "Lightning-AI/pytorch-lightning#19980",
            "pytorch/pytorch#132613",
            "pytorch/pytorch#135936",
            "pytorch/pytorch#107663",
            "pytorch/pytorch#82783",
        ),
        url="https://github.com/pytorch/pytorch/issues/132613",
    )
    failure = FailureSignature(error_type="RuntimeError", message=MAT1_MAT2_DTYPES)
    reference_fix = "encoder-outside-autocast"
    devices = ("cpu", "cuda")
    dtypes = ("float16", "bfloat16")
    modes = ("autocast", "half-autocast", "fp32")
    backends = ("sdpa",)
    sizes = ENCODER_SIZES

    def build(self, ctx: RunContext) -> Workload:
        return encoder_workload(ctx.dims)

    @fix(
        "none",
        rationale="eval + no_grad + autocast through nn.TransformerEncoder (native fast path)",
        upstream="pytorch/pytorch#132613",
    )
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return encode(w.model, w.inputs["src"], ctx)

    @fix(
        "disable-fastpath",
        rationale="torch.backends.mha.set_fastpath_enabled(False): the Python path autocasts",
        upstream="pytorch/pytorch#132613 (workaround)",
    )
    def disable_fastpath(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        with fastpath_disabled():
            return encode(w.model, w.inputs["src"], ctx)

    @fix(
        "encoder-outside-autocast",
        rationale="autocast disabled around the encoder, which runs in its weights' dtype",
        upstream="Lightning-AI/pytorch-lightning#19980 (workaround)",
    )
    def encoder_outside_autocast(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return encode_outside_autocast(w.model, w.inputs["src"], ctx)

    @fix(
        "half-true",
        rationale="bf16-true: model and input cast to the cell dtype, no autocast",
        upstream="Lightning-AI/pytorch-lightning#19980 (bf16-true works)",
    )
    def half_true(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return encode_cast_to(w.model, w.inputs["src"], ctx, ctx.dtype)
