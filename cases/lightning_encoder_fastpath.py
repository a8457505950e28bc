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
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import nn

from harness.case import Case, FailureSignature, RunContext, Upstream, Workload, fix
from harness.registry import register

D_MODEL = 32
NHEAD = 4
DIM_FEEDFORWARD = 64
NUM_LAYERS = 2
BATCH = 2
SEQ_LEN = 8

MAT1_MAT2_DTYPES = r"mat1 and mat2 must have the same dtype, but got (BFloat16|Half) and Float"


def build_encoder() -> nn.TransformerEncoder:
    """The #132613 model: batch-first post-norm encoder layers, eval mode, fp32 on the CPU."""
    layer = nn.TransformerEncoderLayer(
        d_model=D_MODEL, nhead=NHEAD, dim_feedforward=DIM_FEEDFORWARD, batch_first=True
    )
    return nn.TransformerEncoder(layer, num_layers=NUM_LAYERS, enable_nested_tensor=True).eval()


def build_source() -> torch.Tensor:
    """One batch of token embeddings (B, L, D), fp32 on the CPU."""
    return torch.randn(BATCH, SEQ_LEN, D_MODEL)


def encoder_workload() -> Workload:
    """The encoder and its input in float32 (shared with the Trainer case)."""
    return Workload(model=build_encoder(), inputs={"src": build_source()})


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

    def build(self, ctx: RunContext) -> Workload:
        return encoder_workload()

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
