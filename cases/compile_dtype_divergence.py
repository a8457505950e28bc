"""Eager and ``torch.compile`` (inductor) disagree on dtypes in attention code.

Upstream: pytorch/pytorch#119162 (fixed by PR #136041), #138015, Lightning-AI/pytorch-lightning
#19207. Lightning's ``bf16-true`` sets the default dtype to the compute dtype for the step; a
VAE-style cross-attention draws its latent noise with ``torch.randn(..., dtype=embed.dtype)``.
Eager gives a half tensor; inside an inductor graph on torch 2.4.1 the draw comes out float32
(its random lowering follows the default-dtype bookkeeping, not the argument), the latent
becomes float32 and ``k_proj`` refuses it: ``mat1 and mat2 must have the same dtype``. Only
the compiled run fails. (Inductor's ``fallback_random`` hides the bug; the harness compiles
with the defaults, as users do.)

The second variant is pytorch/pytorch#177630 (#172183, #171190): a 3-D ``matmul`` of a half
latent with a float32 basis. Eager refuses it (``expected scalar type Half but found
Float``); inductor on torch 2.4.1 promotes it silently to float32, and 2.13.0 refuses it at
trace time (``TorchRuntimeError``).

The latent is ``mu + eps * exp(logvar / 2)`` with a nearly deterministic posterior (``logvar``
= -60), so the float64 reference does not depend on which random numbers were drawn, while
the draw still runs (and goes wrong) inside the graph.

Two sizes: ``SMALL`` (toy dimensions) and ``UPSTREAM``, the VAE of the #19207/#119162 repro
(``d_model=128``, 8 heads, a 128-token vocabulary, 4 latent vectors) on a batch of 8
sequences of 64 tokens (batch and length are not in the issues: chosen). ``LOGVAR`` does not
depend on the size.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from harness import Case, FailureSignature, RunContext, Size, Upstream, Workload, fix, register


@dataclass(frozen=True)
class Dims:
    """The VAE cross-attention's dimensions and its batch of token ids."""

    dim: int
    heads: int
    #: Latent vectors the tokens attend to.
    latent: int
    vocab: int
    batch: int
    tokens: int


SMALL = Dims(dim=32, heads=4, latent=4, vocab=64, batch=2, tokens=6)
#: The #19207/#119162 repro's VAE; batch and sequence length chosen.
UPSTREAM = Dims(dim=128, heads=8, latent=4, vocab=128, batch=8, tokens=64)
UPSTREAM_SOURCE = (
    "Lightning-AI/pytorch-lightning#19207 repro (class VAE), as reduced in "
    "pytorch/pytorch#119162: nn.Embedding(128, embedding_dim=128), MultiheadAttention(128, 8), "
    "latent torch.randn(B, 4, d_model, dtype=embed.dtype): dim=128, heads=8, vocab=128, "
    "latent=4; batch 8 and 64 tokens chosen, not in either issue (UNVERIFIED)"
)
LOGVAR = -60.0


class LatentCrossAttention(nn.Module):
    """#119162's model: tokens attend to a latent drawn from a (near-point) posterior."""

    basis: torch.Tensor

    def __init__(self, dims: Dims) -> None:
        super().__init__()
        self.dims = dims
        dim = dims.dim
        self.tok_emb = nn.Embedding(dims.vocab, dim)
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(dim, dim) for _ in range(3))
        self.logvar = nn.Parameter(torch.full((dim,), LOGVAR))
        basis, _ = torch.linalg.qr(torch.randn(dim, dim))
        self.register_buffer("basis", basis)  # kept in fp32, as #177630's projection

    def heads(self, t: torch.Tensor) -> torch.Tensor:
        heads = self.dims.heads
        return t.view(t.shape[0], -1, heads, self.dims.dim // heads).transpose(1, 2)

    def forward(
        self, tokens: torch.Tensor, noise_fp32: bool = False, cast_basis: bool = True
    ) -> torch.Tensor:
        embed = self.tok_emb(tokens)
        mu = embed[:, : self.dims.latent]
        if noise_fp32:
            eps = torch.randn(mu.shape, device=mu.device, dtype=torch.float32).to(mu.dtype)
        else:
            eps = torch.randn(mu.shape, device=mu.device, dtype=embed.dtype)
        z = mu + eps * torch.exp(0.5 * self.logvar)
        keys = self.k_proj(z)
        basis = self.basis.to(keys.dtype) if cast_basis else self.basis
        dim = self.dims.dim
        keys = torch.matmul(keys, basis.expand(keys.shape[0], dim, dim))  # keys rotated
        q, k, v = self.heads(self.q_proj(embed)), self.heads(keys), self.heads(self.v_proj(z))
        # a defensive cast before attention, as many models have (Dia PR #45)
        return F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype))


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Lightning's ``*-true`` precision: the default dtype is the compute dtype for the step."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@register
class CompileDtypeDivergence(Case):
    name = "compile-dtype-divergence"
    title = "torch.compile vs eager: a latent drawn in-graph and a mixed 3-D matmul"
    upstream = Upstream(
        repo="pytorch/pytorch",
        file="torch/_inductor/lowering.py",
        commit="PR #136041",
        issues=(
            "pytorch/pytorch#119162",
            "pytorch/pytorch#138015",
            "Lightning-AI/pytorch-lightning#19207",
            "pytorch/pytorch#177630",
        ),
        url="https://github.com/pytorch/pytorch/issues/119162",
    )
    failure = FailureSignature(
        error_type="RuntimeError",
        message=(
            r"mat1 and mat2 must have the same dtype"
            r"|expected scalar type (?:torch\.)?\w+ but found (?:torch\.)?\w+"
        ),
    )
    reference_fix = "noise-fp32-then-cast"
    dtypes = ("float16", "bfloat16")
    modes = ("half", "fp32")
    backends = ("sdpa",)
    compiles = ("eager", "inductor")
    keep_fp32 = ("basis",)
    sizes = (Size("small", SMALL, "toy dimensions"), Size("upstream", UPSTREAM, UPSTREAM_SOURCE))

    def build(self, ctx: RunContext) -> Workload:
        dims: Dims = ctx.dims
        tokens = torch.randint(0, dims.vocab, (dims.batch, dims.tokens))
        return Workload(model=LatentCrossAttention(dims).eval(), inputs={"tokens": tokens})

    @fix(
        "none",
        rationale="bf16-true: default dtype = compute dtype, noise drawn with dtype=embed.dtype",
        upstream="pytorch/pytorch#119162",
    )
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        with default_dtype(ctx.compute_dtype):
            return w.model(w.inputs["tokens"])

    @fix(
        "noise-fp32-then-cast",
        rationale="draw the noise in float32 and cast it to the latent's dtype",
        upstream="pytorch/pytorch#119162 (workaround)",
    )
    def noise_fp32_then_cast(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        with default_dtype(ctx.compute_dtype):
            return w.model(w.inputs["tokens"], noise_fp32=True)

    @fix(
        "fp32-basis-matmul",
        rationale="the half latent times the fp32 basis as is: a mixed 3-D matmul",
        upstream="pytorch/pytorch#177630",
        modes=("half",),
    )
    def fp32_basis_matmul(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return w.model(w.inputs["tokens"], cast_basis=False)
