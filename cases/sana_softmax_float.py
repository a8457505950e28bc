"""Sana vanilla attention: q and k upcast to fp32, softmax in fp32, then ``attn @ v`` in half.

Upstream: NVlabs/Sana, ``diffusion/model/nets/sana_blocks.py``, ``class Attention`` ("AMP
attention with fp32 softmax to fix loss NaN problem during training"), issue #82 ("Vanilla
Attention Inference Precision Error"). With ``fp32_attention=True`` (the model config
default) the forward does ``q, k = q.float(), k.float()``, computes the scaled logits and the
softmax in fp32 inside ``torch.cuda.amp.autocast(enabled=False)``, and then multiplies the
fp32 probabilities with ``v``, which is still half because the model was
``.eval().to(float16)`` for inference with no outer autocast. The matmul refuses the mixed
dtypes (CUDA: ``expected scalar type Half but found Float``). The upstream class has no q/k
norm (timm's ``Attention`` forward is overridden without it), so this case has none either.

The ``upstream`` size is Sana 1600M's attention (hidden 2240, 20 heads) over the 1024 tokens
of a 1024 px image (DC-AE f32 latent, patch 1), batch 2 (a CFG pair). The released Sana
configs use linear attention; issue #82 swapped in this vanilla ``Attention``, so the size
is Sana's dims in the issue's setting, not a released checkpoint.

Training (the ``train`` stage; the loss is Sana's own, ``mean_flat((target - output) ** 2)``,
see ``loss``): what dropping the upcast (``remove-upcast``) costs the gradients, against the
reference fix (``fp32-then-cast``), measured on the CPU at the small size, torch 2.13.0 / 2.4.1,
at ``grad.qkv.bias`` (the worst leaf wherever a cell fails). float16 ``half``: 1.16e-2 /
1.19e-2 against 1.11e-3 / 1.11e-3, about 10.5 times, beyond the tolerance of 3.33e-3 (three
times the reference fix's half error): ``inaccurate``, where its forward cell passes; SDPA
comes to 3.13e-3 / 4.60e-3 (on 2.4.1 SDPA's own float16 step fails the same tolerance, in
every float16 mode). bfloat16 ``half``: 1.55e-2 / 1.78e-2 against 9.22e-3, 1.7 to 1.9 times, within
2.77e-2. Under autocast the CPU casts the upcast q and k back down before the matmul
(``[undone-upcast]``), so the four eager variants compute the same thing: in ``autocast``
float16 they all come to 2.60e-3 / 2.37e-3 (pass), in ``half-autocast`` float16 all to
1.16e-2 / 1.19e-2, the reference fix included, which passes only because the reference fix
is judged by the rounding (tolerance 1.32e-2) while the others are held to its plain half
error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
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
    """One attention block's width and heads, and the image tokens it sees."""

    batch: int
    tokens: int
    hidden: int
    heads: int


SMALL = Dims(batch=2, tokens=256, hidden=128, heads=4)
UPSTREAM = Dims(batch=2, tokens=1024, hidden=2240, heads=20)
UPSTREAM_SOURCE = (
    "NVlabs/Sana diffusion/model/nets/sana_multi_scale.py @2cfb4f7 SanaMS_1600M_P1_D20: "
    "depth=20, hidden_size=2240, num_heads=20 (head 112), patch_size=1; "
    "configs/sana_config/1024ms/Sana_1600M_img1024.yaml (@28af99f): image_size=1024, "
    "vae dc-ae-f32c32 (downsample 32) -> 32x32 = 1024 tokens, fp32_attention true. The "
    "released configs use attn_type linear; issue #82 ran vanilla attention (the dims of "
    "its model are not stated in what was read: unverified). batch=2 (a CFG pair) is a choice."
)
#: The seed of the training target, drawn in float64 on the CPU: the same in every cell.
TARGET_SEED = 1234
#: Standard deviation of q, k and v for unit-variance tokens: logits then have a standard
#: deviation of about QKV_GAIN**2 (moderate, peaked softmax rows, nothing near overflow).
QKV_GAIN = 1.8

AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class SanaAttention(nn.Module):
    """The projections and head layout of Sana's ``class Attention`` (a timm Attention)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.scale = (dim // num_heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(0.0)
        #: Set on every block by Sana from the model config (default True).
        self.fp32_attention = True
        nn.init.normal_(self.qkv.weight, std=QKV_GAIN / dim**0.5)

    def split_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv(x)`` reshaped to (B, H, N, D) q, k, v, as upstream."""
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, c // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        return q, k, v

    def merge_heads(self, out: torch.Tensor) -> torch.Tensor:
        """(B, H, N, D) attention output back to (B, N, C), then the output projection."""
        b, _, n, _ = out.shape
        x = out.transpose(1, 2).reshape(b, n, -1)
        return self.proj_drop(self.proj(x))

    def cuda_autocast_region(self) -> torch.autocast:
        """Upstream's ``torch.cuda.amp.autocast(enabled=not use_fp32_attention)``."""
        return torch.autocast("cuda", enabled=not self.fp32_attention)

    def probabilities(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Scaled logits and softmax, in whatever dtype q and k have, as upstream."""
        with self.cuda_autocast_region():
            attn = (q @ k.transpose(-2, -1)) * self.scale
            attn = attn.softmax(dim=-1)
        return self.attn_drop(attn)


def run_attention(w: Workload, ctx: RunContext, core: AttentionCore) -> torch.Tensor:
    """The Sana attention forward with ``core`` (q, k, v -> (B, H, N, D)) in the middle."""
    model: SanaAttention = w.model
    q, k, v = model.split_heads(w.inputs["x"])
    with ctx.attention_core():
        out = core(q, k, v)
    return model.merge_heads(out)


@register
class SanaSoftmaxFloat(Case):
    name = "sana-softmax-float"
    title = "Sana vanilla attention: fp32 q/k and softmax, then attn @ v with half v"
    upstream = Upstream(
        repo="NVlabs/Sana",
        file="diffusion/model/nets/sana_blocks.py",
        commit="2cfb4f7c63284111109cc0a09050522fb7be806a",
        issues=("NVlabs/Sana#82",),
        url="https://github.com/NVlabs/Sana/issues/82",
    )
    failure = FailureSignature(
        error_type="RuntimeError",
        message=(
            r"expected scalar type (?:Float but found (?:Half|BFloat16)"
            r"|(?:Half|BFloat16) but found Float)"
            r"|expected (?:m1|mat1) and (?:m2|mat2) to have the same dtype, "
            r"but got: float != c10::(?:Half|BFloat16)"
        ),
    )
    reference_fix = "fp32-then-cast"
    devices = ("cpu", "cuda")
    dtypes = ("float16", "bfloat16")
    modes = ("half", "autocast", "half-autocast", "fp32")
    stages = ("forward", "train")
    backends = ("eager",)
    sizes = (Size("small", SMALL, "toy dimensions"), Size("upstream", UPSTREAM, UPSTREAM_SOURCE))

    def build(self, ctx: RunContext) -> Workload:
        dims: Dims = ctx.dims
        model = SanaAttention(dims.hidden, dims.heads).eval()
        x = torch.randn(dims.batch, dims.tokens, dims.hidden)
        return Workload(model=model, inputs={"x": x})

    def loss(self, output: Any, workload: Workload, ctx: RunContext) -> Any:
        """Sana's training loss (``GaussianDiffusion.training_losses``: ``loss = (target -
        output) ** 2``, ``mean_flat``, then the mean over the batch) against a fixed random
        target (the flow velocity ``noise - x_start`` upstream), in the output's dtype."""
        generator = torch.Generator().manual_seed(TARGET_SEED)
        target = torch.randn(output.shape, generator=generator, dtype=torch.float64)
        return ((target.to(output) - output) ** 2).mean()

    @fix("none", rationale="upstream: q, k upcast to fp32, softmax fp32, attn @ v with half v")
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        model: SanaAttention = w.model

        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if model.fp32_attention:
                q, k = q.float(), k.float()
            return model.probabilities(q, k) @ v

        return run_attention(w, ctx, core)

    @fix(
        "remove-upcast",
        rationale="drop the q, k .float() line: logits, softmax and attn @ v all in half",
        upstream="maintainers' answer in NVlabs/Sana#82",
    )
    def remove_upcast(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        model: SanaAttention = w.model

        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return model.probabilities(q, k) @ v

        return run_attention(w, ctx, core)

    @fix(
        "cast-attn-to-v",
        rationale="keep fp32 logits and softmax, cast the probabilities to v's dtype",
        upstream="common eager-attention pattern (attn_weights.to(value.dtype))",
    )
    def cast_attn_to_v(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        model: SanaAttention = w.model

        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if model.fp32_attention:
                q, k = q.float(), k.float()
            return model.probabilities(q, k).to(v.dtype) @ v

        return run_attention(w, ctx, core)

    @fix(
        "fp32-then-cast",
        rationale="q, k and v all upcast, whole attention in fp32, output cast back",
        upstream="sana_blocks.py MultiHeadCrossVallinaAttention ('Cast for sCM')",
    )
    def fp32_then_cast(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        model: SanaAttention = w.model

        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            dtype = q.dtype
            up = ctx.upcast_dtype
            q, k, v = q.to(up), k.to(up), v.to(up)
            return (model.probabilities(q, k) @ v).to(dtype)

        return run_attention(w, ctx, core)

    @fix(
        "sdpa",
        rationale="F.scaled_dot_product_attention on the half q, k, v with the same scale",
        upstream="sana_blocks.py MultiHeadCrossAttention / FlashAttention use SDPA",
    )
    def sdpa(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        model: SanaAttention = w.model

        def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, scale=model.scale)

        return run_attention(w, ctx, core)
