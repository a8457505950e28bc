"""Models whose training step loses gradient precision silently, each beside its healthy twin.

Each bug's forward is healthy (its forward cells pass); what goes wrong is how the
gradients are summed when the model is trained in half precision. Each arises from how the
code computes, not from anything injected: a sum of many gradient contributions is kept in
the half dtype, so every add is rounded to it and the error grows with the number of terms,
where the twin sums the same contributions in float32 (a matmul's own accumulation, or a
float32 buffer cast once). They calibrate the tolerance rule for gradients
(``benchmarks/bench_verdicts.py``, ``tests/test_grad_calibration.py``): in a ``train`` cell
a bug that costs more than ten times its rounding must not read as ``passes``, a twin must
read as ``passes`` everywhere.

The kinds:

* **embedding rows**: a small vocabulary (a byte-level or codebook model: 16 symbols) over
  4096 tokens, its embedding tied to the output head: torch's embedding backward on the
  CPU sums each row's gradient over every token that looked it up in the weight's dtype,
  about 256 adds a row (the twin looks up by a one-hot matmul, whose backward accumulates
  in float32, as TPU-style ``one_hot`` embeddings do);
* **chunked feed-forward**: transformers' ``apply_chunking_to_forward`` (the
  ``chunk_size_feed_forward`` of BERT-style models) one token at a time over 1024 tokens:
  autograd sums the weights' 1024 per-chunk gradients in the weights' dtype (the twin: the
  same feed-forward unchunked, one matmul per weight); once with GELU, once with T5's and
  OPT's ReLU, whose units cross the kink by chance (see ``harness.measure.running.replay``);
* **gradient buffer**: a memory-saving linear layer (a custom ``autograd.Function``, as
  fused or chunked linear-loss kernels are written) whose backward accumulates the weight
  gradient chunk by chunk, 1024 chunks of two rows, into a buffer of the weight's dtype
  (the twin: a float32 buffer, cast once). Under ``autocast`` the weights are float32 and so is the
  buffer: the bug costs nothing there;
* **loss summed step by step**: a sequence model's loss as Python's ``sum`` of its 512
  per-step losses (a teacher-forced decoder loop), each add rounded to the losses' dtype in
  a model trained in half precision (the twin: one ``torch.stack(...).sum()``, a reduction
  that accumulates in float32); only the loss leaf pays, the gradients do not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from zoo import silent_bugs
from zoo.silent_bugs import Pair

WIDTH = 32
BATCH = 1


class TiedSymbolModel(nn.Module):
    """A small-vocabulary model: embed, one feed-forward block with a residual, and the
    output head tied to the embedding."""

    def __init__(self, safe: bool, vocab: int = 16) -> None:
        super().__init__()
        self.safe = safe
        self.embed = nn.Embedding(vocab, WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.safe:  # a one-hot matmul: its backward is a matmul, accumulated in float32
            one_hot = F.one_hot(ids, self.embed.num_embeddings).to(self.embed.weight.dtype)
            return one_hot @ self.embed.weight
        return self.embed(ids)  # its backward sums each row in the weight's dtype (CPU)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.lookup(ids)
        h = h + self.down(F.gelu(self.up(h)))
        return h @ self.embed.weight.t()  # the head, tied to the embedding


class ChunkedFeedForward(nn.Module):
    """A feed-forward block applied chunk by chunk along the tokens, as BERT-style models in
    transformers do with ``chunk_size_feed_forward``."""

    def __init__(
        self, safe: bool, chunk_size: int = 1, activation: Callable[..., Any] = F.gelu
    ) -> None:
        super().__init__()
        from transformers.pytorch_utils import apply_chunking_to_forward

        self.apply_chunking = apply_chunking_to_forward
        self.chunk_size = 0 if safe else chunk_size  # 0: transformers' "no chunking"
        self.activation = activation
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.activation(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.apply_chunking(self.feed_forward, self.chunk_size, 1, x)


def chunked_relu_feed_forward(safe: bool) -> ChunkedFeedForward:
    """The chunked feed-forward with T5's and OPT's ReLU: its gradient jumps where a unit
    crosses the kink (see ``harness.measure.running.replay``), and the bug must still show."""
    return ChunkedFeedForward(safe, activation=F.relu)


class ChunkedLinearFunction(torch.autograd.Function):
    """``x @ weight.T``, whose backward computes the weight's gradient chunk by chunk of
    rows (so no (rows, out) x (rows, in) product is held whole) and accumulates it in
    ``buffer_dtype`` (None: the weight's own dtype)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        chunks: int,
        buffer_dtype: torch.dtype | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.chunks, ctx.buffer_dtype = chunks, buffer_dtype
        return x @ weight.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        grad = grad.to(weight.dtype)
        x = x.to(weight.dtype)
        grad_x = grad @ weight
        rows_x, rows_grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        buffer = torch.zeros_like(weight, dtype=ctx.buffer_dtype or weight.dtype)
        chunks = zip(rows_x.chunk(ctx.chunks), rows_grad.chunk(ctx.chunks), strict=True)
        for x_chunk, grad_chunk in chunks:
            buffer += grad_chunk.t() @ x_chunk  # each add rounded to the buffer's dtype
        return grad_x, buffer.to(weight.dtype), None, None


class ChunkedGradLinear(nn.Module):
    """A projection, a non-linearity and a memory-saving output layer whose weight gradient
    is accumulated over 1024 chunks of rows."""

    def __init__(self, safe: bool, chunks: int = 1024) -> None:
        super().__init__()
        self.safe = safe
        self.chunks = chunks
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.out_weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / WIDTH**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.proj(x))
        buffer_dtype = torch.float32 if self.safe else None
        output: torch.Tensor = ChunkedLinearFunction.apply(
            h, self.out_weight, self.chunks, buffer_dtype
        )
        return output


class StepwiseLossDecoder(nn.Module):
    """A decoder step applied to every position of a teacher-forced sequence at once, its
    loss the sum of each step's mean squared error against the next position."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.safe = safe
        self.step = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        predicted = self.step(x[:, :-1])  # every step at once: one matmul
        losses = [
            F.mse_loss(predicted[:, t], x[:, t + 1].to(predicted.dtype))
            for t in range(predicted.shape[1])
        ]
        if self.safe:
            return {"loss": torch.stack(losses).sum()}
        total: torch.Tensor = sum(losses)  # type: ignore[assignment]
        return {"loss": total}


def symbols(tokens: int, vocab: int = 16) -> Callable[[], dict[str, torch.Tensor]]:
    def inputs() -> dict[str, torch.Tensor]:
        return {"ids": torch.randint(0, vocab, (BATCH, tokens))}

    return inputs


def activations(tokens: int) -> Callable[[], dict[str, torch.Tensor]]:
    def inputs() -> dict[str, torch.Tensor]:
        return {"x": torch.randn(BATCH, tokens, WIDTH)}

    return inputs


def pair(kind: str, make: Callable[[bool], nn.Module], inputs: Callable[[], Any]) -> Pair:
    return silent_bugs.pair(kind, make, inputs, label="training bug")


#: Every training bug with its twin, by name.
PAIRS = {
    "embedding-rows-summed-in-half": pair(
        "an embedding's rows summed in half over many tokens", TiedSymbolModel, symbols(4096)
    ),
    "chunked-ffn-grads-summed-in-half": pair(
        "a chunked feed-forward's weight gradients summed in half",
        ChunkedFeedForward,
        activations(1024),
    ),
    "chunked-relu-ffn-grads-summed-in-half": pair(
        "a chunked ReLU feed-forward's weight gradients summed in half",
        chunked_relu_feed_forward,
        activations(1024),
    ),
    "grad-buffer-in-half": pair(
        "a weight gradient accumulated chunk by chunk in a half buffer",
        ChunkedGradLinear,
        activations(2048),
    ),
    "loss-summed-step-by-step": pair(
        "a loss summed step by step in half", StepwiseLossDecoder, activations(513)
    ),
}
