"""Small models written the way training code is written, each beside a buggy twin.

Each family is a healthy model with a feature real training code has and a twin with a
real precision bug (or trained by a recipe that has one), on the same weights and data.
They are the train stage's acceptance models: a healthy model must pass every cell, float32
control included (a false alarm is the worst verdict), and a bug must not pass where its
cost is real. What a cell truly costs is measured by plain torch beside the harness's
verdict (:mod:`zoo.training_truth`), so the verdicts are checked against facts.

The healthy features, and the bug each twin carries:

* **stochastic depth** written as timm's ``drop_path`` before 0.9 (DeiT, Swin, ConvNeXt):
  ``keep + torch.rand(shape, dtype=x.dtype)``, floored, a draw in the activations' dtype;
  the bug: a hand-written LayerNorm whose variance is ``E[x^2] - E[x]^2``, on inputs of
  mean 40 (it cancels: both terms about 1600);
* **nn.Dropout** on attention probabilities and the residual branch; the bug: the softmax
  written out, ``exp(s) / exp(s).sum()``, in the scores' dtype without subtracting the
  maximum (float16's ``exp`` overflows past 11.1);
* **top-2 expert routing** (8 experts, 256 tokens, 512 choices): the router's softmax in
  float32 and ``torch.topk``, Mixtral's routing; the bug: the router's probabilities
  written out in the logits' dtype without subtracting the maximum;
* **non-reentrant checkpointing** over ReLU blocks (``use_reentrant=False``); the bug: an
  RMSNorm whose mean square is taken in the activations' dtype on activations of about
  1e-3 (float16's squares are subnormal there);
* **reentrant checkpointing** over ReLU blocks (``use_reentrant=True``); the bug: the
  cancelling variance again, inside the checkpoint;
* **a LayerNorm over 2048 tokens** (its weight's gradient sums 2048 terms); the bug: the
  tokens mean-pooled by a running sum in the activations' dtype. torch's CPU LayerNorm
  backward sums the rows of its bias and weight gradients in the half dtype (bfloat16,
  2048 rows: about 25 eps, 55% of the model's bias gradient): there the healthy model is
  truly inaccurate, and its cell must say so;
* **a 16,384-wide vocabulary head** with cross-entropy; the bug: the log-sum-exp written
  out without subtracting the maximum (float16 overflows in the sum);
* **sparse embeddings** (``nn.Embedding(sparse=True)``) trained by plain SGD, as sparse
  gradients are; the bug: an RMSNorm of small embeddings taken in the activations' dtype;
* **weight tying** (the embedding is the output head); the bug: a head hard-coded to
  bfloat16 (``h.to(torch.bfloat16)``: code written for one accelerator, run on another);
* **RoPE** at positions from 2000 and from 3000, the positions an integer buffer
  (``.half()`` leaves it alone) and the angles in float32, as Llama's; the bug: the
  positions a float buffer, which ``.half()`` rounds (float16 holds integers exactly to
  2048, bfloat16 to 256);
* **cross-entropy over 16,384 tokens**, its loss divided by the 8 micro-batches it is
  accumulated over, trained with a GradScaler in float16 autocast; the bug is the recipe:
  the same step without a scaler, where the logits' gradients (about 2e-7) underflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from zoo.training_truth import layer_norm_kernel_cost

WIDTH = 32
HEADS = 4
HEAD_DIM = WIDTH // HEADS
#: The mean of the inputs the cancelling variance is taken on.
OFFSET = 40.0
#: The size of activations whose squares float16 holds only as subnormals.
SMALL = 1e-3
EPS = 1e-5

Inputs = dict[str, torch.Tensor]
Factory = Callable[[], tuple[Any, ...]]
Loss = Callable[[Any, Inputs], torch.Tensor]
#: What a factory's third element is: the model called on the inputs it takes (the
#: others, a target or labels, are the loss's).
Forward = Callable[[Any, Inputs], Any]


class WrittenNorm(nn.Module):
    """A LayerNorm written out, as research code writes it; ``safe``: its variance is
    ``E[(x - mean)^2]``, else ``E[x^2] - E[x]^2`` (it cancels where the mean is large)."""

    def __init__(self, safe: bool, width: int = WIDTH) -> None:
        super().__init__()
        self.safe = safe
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        if self.safe:
            var = (x - mean).pow(2).mean(-1, keepdim=True)
        else:
            var = (x * x).mean(-1, keepdim=True) - mean * mean
        return (x - mean) * torch.rsqrt(var.clamp_min(0.0) + EPS) * self.weight + self.bias


class RMSNorm(nn.Module):
    """``safe``: the mean square in float32, as transformers' ``LlamaRMSNorm``; else in the
    activations' dtype, as T5's first releases did."""

    def __init__(self, safe: bool, width: int = WIDTH) -> None:
        super().__init__()
        self.safe = safe
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.safe:
            wide = x.to(torch.float32)
            normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-12)
            return self.weight * normed.to(x.dtype)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-12))


class DropPath(nn.Module):
    """timm's ``drop_path`` before 0.9: a per-sample mask of ``keep + rand`` floored, drawn
    in the activations' dtype."""

    def __init__(self, drop: float) -> None:
        super().__init__()
        self.drop = drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.drop == 0.0:
            return x
        keep = 1.0 - self.drop
        shape = (x.shape[0],) + (1,) * (x.ndim - 1)
        mask = keep + torch.rand(shape, dtype=x.dtype, device=x.device)
        mask.floor_()
        return x.div(keep) * mask


def feed_forward(width: int = WIDTH, activation: type[nn.Module] = nn.GELU) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, 4 * width), activation(), nn.Linear(4 * width, width))


class StochasticDepthNet(nn.Module):
    """Two pre-norm feed-forward blocks, each residual branch dropped per sample with
    probability 0.3 (stochastic depth), on inputs of mean 40."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.norms = nn.ModuleList([WrittenNorm(safe) for _ in range(2)])
        self.blocks = nn.ModuleList([feed_forward() for _ in range(2)])
        self.drop_path = DropPath(0.3)
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for norm, block in zip(self.norms, self.blocks, strict=True):
            h = h + self.drop_path(block(norm(h)))
        return self.head(h)


class DropoutAttention(nn.Module):
    """A pre-norm attention block with ``nn.Dropout`` on the attention probabilities and on
    the residual branch; ``safe``: ``F.softmax``, else the softmax written out without
    subtracting the maximum."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.safe = safe
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.attn_drop = nn.Dropout(0.1)
        self.resid_drop = nn.Dropout(0.1)
        with torch.no_grad():  # sharp attention: scores up to about 20
            self.qkv.weight[: 2 * WIDTH].mul_(4.0)

    def probabilities(self, scores: torch.Tensor) -> torch.Tensor:
        if self.safe:
            return F.softmax(scores, dim=-1)
        exp = scores.exp()  # overflows in float16 past 11.1
        return exp / exp.sum(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, tokens, 3, HEADS, HEAD_DIM).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(HEAD_DIM)
        attn = self.attn_drop(self.probabilities(scores))
        mixed = (attn @ v).transpose(1, 2).reshape(batch, tokens, WIDTH)
        return x + self.resid_drop(self.out(mixed))


class Top2Experts(nn.Module):
    """A mixture of 8 feed-forward experts, each token routed to the 2 the router ranks
    highest and their outputs mixed by the renormalised router weights (Mixtral's
    ``MixtralSparseMoeBlock``)."""

    def __init__(self, safe: bool, experts: int = 8) -> None:
        super().__init__()
        self.safe = safe
        self.router = nn.Linear(WIDTH, experts, bias=False)
        self.experts = nn.ModuleList([feed_forward(WIDTH) for _ in range(experts)])
        with torch.no_grad():  # a confident router: logits up to about 15
            self.router.weight.normal_(0.0, 1.0)

    def routing_weights(self, logits: torch.Tensor) -> torch.Tensor:
        if self.safe:
            return F.softmax(logits, dim=-1, dtype=torch.float)
        exp = logits.exp()  # in the logits' dtype, no maximum subtracted
        return exp / exp.sum(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(self.routing_weights(self.router(h)), 2, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(h.dtype)
        mixed = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == index)
            if rows.numel():
                out = expert(h[rows]) * weights[rows, slot, None]
                mixed.index_add_(0, rows, out.to(mixed.dtype))
        return x + mixed.view_as(x)


class ReluBlock(nn.Module):
    """A pre-norm ReLU feed-forward block with its residual."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.ff = feed_forward(activation=nn.ReLU)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.ff(self.norm(h))


class CheckpointedRelu(nn.Module):
    """Three ReLU blocks, each recomputed in backward by ``torch.utils.checkpoint``."""

    def __init__(self, norm: Callable[[], nn.Module], reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.stem = nn.Linear(WIDTH, WIDTH, bias=False)
        self.blocks = nn.ModuleList([ReluBlock(norm()) for _ in range(3)])
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=self.reentrant)
        return self.head(h)


def checkpointed_relu(safe: bool) -> CheckpointedRelu:
    """Non-reentrant checkpointing; its norm is an RMSNorm (the bug: in half)."""
    return CheckpointedRelu(lambda: RMSNorm(safe), reentrant=False)


def reentrant_relu(safe: bool) -> nn.Module:
    """Reentrant checkpointing over blocks with a written-out LayerNorm (the bug: its
    variance cancels); the inputs of mean 40 go in unprojected."""
    return ReentrantRelu(safe)


class ReentrantRelu(nn.Module):
    """Three ReLU blocks with written-out norms, each under reentrant checkpointing."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([ReluBlock(WrittenNorm(safe)) for _ in range(3)])
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reentrant checkpointing trains nothing unless an input requires grad
        # (transformers' enable_input_require_grads does this to the embeddings' output)
        h = x if x.requires_grad else x.detach().requires_grad_(True)
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=True)
        return self.head(h)


class LongTokenPool(nn.Module):
    """A LayerNorm over 2048 tokens, a projection, the tokens mean-pooled and a head;
    ``safe``: ``mean`` over the tokens, else a running sum in the activations' dtype."""

    def __init__(self, safe: bool) -> None:
        super().__init__()
        self.safe = safe
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, 8)

    def pooled(self, h: torch.Tensor) -> torch.Tensor:
        if self.safe:
            return h.mean(1)
        total = torch.zeros_like(h[:, 0])
        for token in h.unbind(1):  # one add per token, each rounded to h's dtype
            total = total + token
        return total / h.shape[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.proj(self.norm(self.embed(x))))
        return self.head(self.pooled(h))


class VocabHead(nn.Module):
    """A token model's last layers: a LayerNorm and a 16,384-wide output head, its loss
    the cross-entropy against the next tokens; ``safe``: ``F.cross_entropy``, else the
    log-sum-exp written out without subtracting the maximum."""

    def __init__(self, safe: bool, vocab: int = 16384) -> None:
        super().__init__()
        self.safe = safe
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, vocab, bias=False)
        with torch.no_grad():  # a trained model's logits: spread of about 3
            self.head.weight.normal_(0.0, 0.5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.head(self.norm(x)).flatten(0, 1)
        if self.safe:
            return {"loss": F.cross_entropy(logits, labels.flatten())}
        log_sum_exp = logits.exp().sum(-1).log()  # the sum overflows float16
        picked = logits.gather(-1, labels.flatten()[:, None]).squeeze(-1)
        return {"loss": (log_sum_exp - picked).mean()}


class SparseBagClassifier(nn.Module):
    """Token ids embedded by a sparse embedding (small, as initialised with std 1e-3),
    projected, RMS-normalised, mean-pooled and classified."""

    def __init__(self, safe: bool, vocab: int = 1000) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, WIDTH, sparse=True)
        with torch.no_grad():
            self.embed.weight.normal_(0.0, SMALL)
        self.proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.norm = RMSNorm(safe)
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.proj(self.embed(ids))).mean(1))


class TiedLanguageModel(nn.Module):
    """GPT-2's shape in one block: embeddings, a pre-norm feed-forward, a final norm and
    the head tied to the embedding; ``safe``: the head in the model's dtype, else
    hard-coded to bfloat16."""

    def __init__(self, safe: bool, vocab: int = 512) -> None:
        super().__init__()
        self.safe = safe
        self.embed = nn.Embedding(vocab, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.ff = feed_forward()
        self.final_norm = nn.LayerNorm(WIDTH)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        if self.safe:
            return h @ self.embed.weight.t()
        head = self.embed.weight.to(torch.bfloat16)
        return (h.to(torch.bfloat16) @ head.t()).to(h.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.ff(self.norm(h))
        return self.logits(self.final_norm(h))


class RotaryProjection(nn.Module):
    """Project, rotate by RoPE at positions from ``first_position``, project back. The
    angles are Llama's: ``inv_freq`` and the positions in float32, outside autocast;
    ``safe``: the positions are an integer buffer, else a float one (``.half()`` rounds
    it with the model)."""

    positions: torch.Tensor

    def __init__(self, safe: bool, first_position: int, tokens: int = 32) -> None:
        super().__init__()
        positions = torch.arange(first_position, first_position + tokens)
        self.register_buffer("positions", positions if safe else positions.float())
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)

    def angles(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        steps = torch.arange(0, WIDTH, 2, device=like.device, dtype=torch.int64)
        inv_freq = 1.0 / (10000 ** (steps.float() / WIDTH))
        with torch.autocast(like.device.type, enabled=False):
            angles = self.positions.float()[:, None] * inv_freq[None, :]
            return angles.cos().to(like.dtype), angles.sin().to(like.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        cos, sin = self.angles(h)
        even, odd = h[..., 0::2], h[..., 1::2]
        return self.out(torch.cat((even * cos - odd * sin, even * sin + odd * cos), dim=-1))


def rotary_from(first_position: int) -> Callable[[bool], nn.Module]:
    def make(safe: bool) -> nn.Module:
        return RotaryProjection(safe, first_position)

    return make


class TokenClassifier(nn.Module):
    """Per-token features through a GELU layer to a 64-class head, as a tagger's last
    layers; its loss is the cross-entropy over every token, divided by the micro-batches
    it is accumulated over (the step's gradients are small: the case for a GradScaler)."""

    def __init__(self, safe: bool = True, classes: int = 64) -> None:
        super().__init__()
        self.hidden = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.hidden(x)))


#: The micro-batches a step's loss is divided by (gradient accumulation).
ACCUMULATION = 8


def on_x(model: Any, inputs: Inputs) -> Any:
    return model(inputs["x"])


def on_ids(model: Any, inputs: Inputs) -> Any:
    return model(inputs["ids"])


def on_x_and_labels(model: Any, inputs: Inputs) -> Any:
    return model(inputs["x"], inputs["labels"])


def mse_to_target(output: Any, inputs: Inputs) -> torch.Tensor:
    """The mean squared error against the inputs' ``target``, in float32, as training
    scripts compute a loss on half outputs."""
    return F.mse_loss(output.float(), inputs["target"].float())


def cross_entropy(output: Any, inputs: Inputs) -> torch.Tensor:
    """The cross-entropy of every position's logits against the inputs' ``labels``."""
    if isinstance(output, dict):
        return output["loss"]
    return F.cross_entropy(output.flatten(0, -2).float(), inputs["labels"].flatten())


def accumulated_cross_entropy(output: Any, inputs: Inputs) -> torch.Tensor:
    """The cross-entropy of one micro-batch of ``ACCUMULATION``, as accumulation divides it."""
    return cross_entropy(output, inputs) / ACCUMULATION


def regression(
    tokens: int, batch: int, shift: float = 0.0, scale: float = 1.0
) -> Callable[[], Inputs]:
    def inputs() -> Inputs:
        return {
            "x": torch.randn(batch, tokens, WIDTH) * scale + shift,
            "target": torch.randn(batch, tokens, WIDTH),
        }

    return inputs


def pooled_regression(tokens: int) -> Callable[[], Inputs]:
    def inputs() -> Inputs:
        return {"x": torch.randn(1, tokens, WIDTH), "target": torch.randn(1, 8)}

    return inputs


def next_tokens(tokens: int, vocab: int, batch: int = 1) -> Callable[[], Inputs]:
    def inputs() -> Inputs:
        return {
            "x": torch.randn(batch, tokens, WIDTH),
            "labels": torch.randint(0, vocab, (batch, tokens)),
        }

    return inputs


def token_ids(tokens: int, vocab: int, labels: int) -> Callable[[], Inputs]:
    def inputs() -> Inputs:
        return {
            "ids": torch.randint(0, vocab, (4, tokens)),
            "labels": torch.randint(0, labels, (4,)),
        }

    return inputs


def language_modelling(tokens: int, vocab: int) -> Callable[[], Inputs]:
    def inputs() -> Inputs:
        ids = torch.randint(0, vocab, (2, tokens + 1))
        return {"ids": ids[:, :-1], "labels": ids[:, 1:]}

    return inputs


def sgd(params: list[torch.Tensor], lr: float) -> torch.optim.Optimizer:
    """Plain SGD: the optimizer sparse gradients are trained with."""
    return torch.optim.SGD(params, lr=lr)


@dataclass(frozen=True)
class Recipe:
    """How a model is trained, where that is part of the family: whether float16 autocast
    scales the loss (a GradScaler), and the optimizer its fit steps with (None: the
    harness's)."""

    grad_scaler: bool = True
    optimizer: Callable[[list[torch.Tensor], float], torch.optim.Optimizer] | None = None


SCALED = Recipe()


@dataclass(frozen=True)
class Family:
    """A healthy model and its buggy twin on the same data: ``make(True)`` the healthy one,
    ``make(False)`` the bug; the loss they train on, the stages they are checked at, and
    each one's recipe (the underflow family differs by the recipe alone)."""

    feature: str
    bug: str
    make: Callable[[bool], nn.Module]
    inputs: Callable[[], Inputs]
    loss: Loss
    forward: Forward = on_x
    stages: tuple[str, ...] = ("train",)
    healthy_recipe: Recipe = SCALED
    bug_recipe: Recipe = SCALED
    #: What a torch kernel the healthy model calls costs on its own in a dtype, in eps
    #: (measured with plain torch), where it is more than rounding: near the bar a bug is
    #: held to either verdict is right, and beyond it the healthy cell is truly inaccurate
    #: (``training_table.healthy_expected``).
    kernel_cost: Callable[[str], float] | None = None
    #: The bug is arithmetic written in the activations' dtype (a cancelling variance, a
    #: running sum): in the float32 control it is float32 arithmetic, which the control's
    #: yardstick holds by design (the control judges whether code leaves float32, not how
    #: well it computes in it), so there any verdict is right; its half cells are judged.
    float32_arithmetic_bug: bool = False

    def factory(self, healthy: bool) -> Factory:
        """A factory of the model and its inputs, as ``check`` takes one (the model in
        training mode: its dropout and stochastic depth draw)."""

        def build() -> tuple[Any, ...]:
            return self.make(healthy), self.inputs(), self.forward

        build.__doc__ = f"{self.feature}" if healthy else f"{self.feature}, with {self.bug}"
        return build

    def recipe(self, healthy: bool) -> Recipe:
        return self.healthy_recipe if healthy else self.bug_recipe


#: Every family, by name.
FAMILIES = {
    "stochastic-depth": Family(
        "stochastic depth drawn with torch.rand in the activations' dtype",
        "a variance computed as E[x^2] - E[x]^2",
        StochasticDepthNet,
        regression(tokens=16, batch=8, shift=OFFSET),
        mse_to_target,
        float32_arithmetic_bug=True,
    ),
    "dropout-attention": Family(
        "nn.Dropout on attention probabilities and the residual",
        "a softmax written out without subtracting the maximum",
        DropoutAttention,
        regression(tokens=16, batch=2),
        mse_to_target,
    ),
    "top2-routing": Family(
        "top-2 routing over 8 experts (router softmax in float32, torch.topk)",
        "router probabilities written out in half without subtracting the maximum",
        Top2Experts,
        regression(tokens=64, batch=4),
        mse_to_target,
    ),
    "checkpoint-non-reentrant": Family(
        "non-reentrant torch.utils.checkpoint over ReLU blocks",
        "an RMSNorm's mean square in half on activations of 1e-3",
        checkpointed_relu,
        regression(tokens=16, batch=2, scale=SMALL),
        mse_to_target,
    ),
    "checkpoint-reentrant": Family(
        "reentrant torch.utils.checkpoint over ReLU blocks",
        "a variance computed as E[x^2] - E[x]^2",
        reentrant_relu,
        regression(tokens=16, batch=2, shift=OFFSET),
        mse_to_target,
        float32_arithmetic_bug=True,
    ),
    "layernorm-2048-tokens": Family(
        "a LayerNorm over 2048 tokens, mean-pooled",
        "the tokens pooled by a running sum in half",
        LongTokenPool,
        pooled_regression(tokens=2048),
        mse_to_target,
        kernel_cost=layer_norm_kernel_cost,
        float32_arithmetic_bug=True,
    ),
    "vocab-16k-head": Family(
        "a 16,384-wide vocabulary head with F.cross_entropy",
        "a log-sum-exp written out without subtracting the maximum",
        VocabHead,
        next_tokens(tokens=64, vocab=16384),
        cross_entropy,
        on_x_and_labels,
    ),
    "sparse-embedding": Family(
        "nn.Embedding(sparse=True) trained by plain SGD",
        "an RMSNorm's mean square in half on embeddings of 1e-3",
        SparseBagClassifier,
        token_ids(tokens=32, vocab=1000, labels=8),
        cross_entropy,
        on_ids,
        stages=("train", "fit"),
        healthy_recipe=Recipe(optimizer=sgd),
        bug_recipe=Recipe(optimizer=sgd),
    ),
    "weight-tying": Family(
        "an embedding tied to the output head",
        "the head hard-coded to bfloat16",
        TiedLanguageModel,
        language_modelling(tokens=32, vocab=512),
        cross_entropy,
        on_ids,
    ),
    "rope-positions-2000": Family(
        "RoPE at positions 2000-2031 from an integer position buffer",
        "the positions in a float buffer",
        rotary_from(2000),
        regression(tokens=32, batch=2),
        mse_to_target,
    ),
    "rope-positions-3000": Family(
        "RoPE at positions 3000-3031 from an integer position buffer",
        "the positions in a float buffer",
        rotary_from(3000),
        regression(tokens=32, batch=2),
        mse_to_target,
    ),
    "cross-entropy-16k-tokens": Family(
        "cross-entropy over 16,384 tokens, float16 autocast with a GradScaler",
        "no GradScaler",
        TokenClassifier,
        next_tokens(tokens=16384, vocab=64),
        accumulated_cross_entropy,
        bug_recipe=Recipe(grad_scaler=False),
    ),
}
