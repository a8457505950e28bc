"""What a training step truly costs, measured with plain torch, apart from the harness.

For a model, its inputs, its loss and a cell (dtype and mode), one training step is taken
as people train in that cell (``autocast``: float32 weights under ``torch.autocast``, a
GradScaler in float16 where the recipe has one; ``half``: the model and its floating inputs
cast to the dtype; ``fp32``: plain), and the same step in float64; the figure is the worst
leaf's ``max|x - x64| / max|x64|`` over the loss and every gradient (a gradient below 1e-8
of the step's largest judged against the step's largest, as a gradient zero by construction
is rounding noise). The float64 step differs from the cell's by precision alone:

* the cell's random draws (``rand``, ``bernoulli_``, dropout...) are recorded and replayed
  into it, its top-k choices taken by the cell's indices and its ReLU units on the cell's
  sides, so stochastic depth, routing and ReLU blocks are compared on the same samples,
  experts and units (recorded at the dispatcher, below autograd, so a checkpoint's
  recomputation in backward replays them too);
* a cast to a narrower floating dtype that the code makes (``.float()``, ``.to(bf16)``,
  ``dtype=torch.float32``) stays float64: the float64 step is the code's arithmetic done
  exactly, not the code's choice of dtype.

Every choice is the cell's, near rounding or not: a bug that moves a choice far is seen by
what else it moves. A bug's figure is read against its healthy twin's in the same cell.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

#: The ops that draw random numbers: recorded in the cell's step, replayed in float64's.
RANDOM_OPS = frozenset(
    (
        aten.rand, aten.rand_like, aten.randn, aten.randn_like, aten.randint,
        aten.randint_like, aten.bernoulli, aten.bernoulli_, aten.uniform_, aten.normal_,
        aten.exponential_, aten.randperm, aten.multinomial,
    )
)  # fmt: skip
#: The ReLUs whose sides the float64 step takes from the cell's.
RELUS = frozenset((aten.relu, aten.relu_))
#: A gradient below this share of the step's largest is judged against the largest.
VANISHING = 1e-8
#: GradScaler's initial scale: the static scale the truth's scaled steps start at.
INIT_SCALE = 2.0**16
NARROW_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class Tape:
    """The cell's random draws and top-k indices, in the order its step made them."""

    draws: list[Any] = field(default_factory=list)
    replayed: int = 0

    def next(self) -> Any:
        value = self.draws[self.replayed]
        self.replayed += 1
        return value


class Recorder(TorchDispatchMode):
    """Records every random draw and top-k choice of the cell's step."""

    def __init__(self, tape: Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        packet = func.overloadpacket
        if packet in RELUS:
            self.tape.draws.append(args[0] > 0)
        out = func(*args, **(kwargs or {}))
        if packet in RANDOM_OPS or packet is aten.native_dropout or packet is aten.topk:
            self.tape.draws.append(tree_clone(out))
        return out


class Widener(TorchDispatchMode):
    """The float64 step: replays the cell's draws and top-k choices, and keeps in float64
    every value the code asks for in a narrower floating dtype."""

    def __init__(self, tape: Tape) -> None:
        super().__init__()
        self.tape = tape

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if kwargs.get("dtype") in NARROW_FLOATS:
            kwargs["dtype"] = torch.float64
        packet = func.overloadpacket
        if packet is aten.native_dropout:
            return replayed_dropout(args, self.tape.next())
        if packet is aten.topk:
            return replayed_topk(func, args, kwargs, self.tape.next())
        if packet in RELUS:
            return replayed_relu(packet, args[0], self.tape.next())
        if packet is aten.threshold_backward and args[2] == 0:
            return args[0] * (args[1] != 0).to(args[0].dtype)
        out = func(*args, **kwargs)
        if packet in RANDOM_OPS:
            with torch.no_grad():
                out.copy_(self.tape.next())
        return out


def tree_clone(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.detach().clone()
    return tuple(tree_clone(o) for o in out)


def replayed_dropout(args: Any, recorded: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``native_dropout`` with the cell's mask: the input times the mask over the keep."""
    x, p = args[0], args[1]
    mask = recorded[1]
    return x * mask.to(x.dtype) / (1.0 - p), mask.clone()


def replayed_relu(packet: Any, x: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """A ReLU on the cell's sides. Its backward (``threshold_backward`` of this result,
    replayed too) passes the gradient where the result is not zero: the cell's side, even
    for a unit float64 puts a hair below zero."""
    kept = torch.where(positive, x, torch.zeros_like(x))
    return x.copy_(kept) if packet is aten.relu_ else kept


def replayed_topk(func: Any, args: Any, kwargs: Any, recorded: Any) -> Any:
    """``topk`` choosing the cell's indices: their values gathered from the input."""
    x = args[0]
    dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
    func(*args, **kwargs)  # its own choice, discarded: the cell's is taken
    indices = recorded[1].clone()
    return x.gather(dim, indices), indices


@dataclass(frozen=True)
class Step:
    """The loss and every gradient of one step, in float64 (dense), by name."""

    leaves: dict[str, torch.Tensor]


def leaf_error(got: torch.Tensor, want: torch.Tensor, floor: float) -> float:
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    scale = max(float(want.abs().max()), floor) if want.numel() else floor
    if scale == 0.0:
        return float("inf") if bool((got != 0).any()) else 0.0
    return float((got - want).abs().max()) / scale


def leaf_errors(cell: Step, reference: Step) -> dict[str, float]:
    """Each leaf's error: the loss's, and every gradient's (one below ``VANISHING`` of the
    step's largest judged against the largest)."""
    grads = [v for k, v in reference.leaves.items() if k != "loss"]
    largest = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
    floor = VANISHING * largest
    return {
        name: leaf_error(cell.leaves[name], want, floor if name != "loss" else 0.0)
        for name, want in reference.leaves.items()
    }


def dense(grad: torch.Tensor) -> torch.Tensor:
    return (grad.to_dense() if grad.is_sparse else grad).detach().to(torch.float64)


def cast_inputs(inputs: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    return {
        k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in inputs.items()
    }


Forward = Callable[[Any, dict[str, Any]], Any]
Loss = Callable[[Any, dict[str, Any]], torch.Tensor]


def run_step(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    forward: Forward,
    loss_of: Loss,
    autocast: torch.dtype | None,
    scale: float | None,
) -> Step:
    """One step: forward and loss (under autocast where given), backward of the loss
    times ``scale`` (None: unscaled), the gradients divided by it."""
    model.zero_grad(set_to_none=True)
    region = torch.autocast("cpu", dtype=autocast) if autocast else nullcontext()
    with region:
        loss = loss_of(forward(model, inputs), inputs)
    (loss if scale is None else loss * scale).backward()
    grads = {
        f"grad.{name}": dense(p.grad) / (scale or 1.0)
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    return Step({"loss": loss.detach().to(torch.float64), **grads})


@dataclass(frozen=True)
class Truth:
    """A cell's error against float64, leaf by leaf."""

    errors: dict[str, float]

    @property
    def worst(self) -> tuple[str, float]:
        leaf = max(self.errors, key=lambda name: self.errors[name])
        return leaf, self.errors[leaf]


def truth(
    model: torch.nn.Module,
    inputs: dict[str, Any],
    forward: Forward,
    loss_of: Loss,
    dtype: str,
    mode: str,
    scaled: bool,
) -> Truth:
    """The error of the cell's step (``dtype``, ``mode``; ``scaled``: with a loss scale
    where the cell is float16, as a GradScaler would) against the same step in float64."""
    low = getattr(torch, dtype)
    cell_model = copy.deepcopy(model)
    cell_inputs = inputs
    autocast = None
    if mode == "half":
        cell_model = cell_model.to(low)
        cell_inputs = cast_inputs(inputs, low)
    elif mode == "autocast":
        autocast = low
    tape, began = Tape(), torch.random.get_rng_state()
    step = None
    for scale in scales(scaled and low == torch.float16):
        tape.draws.clear()
        torch.random.set_rng_state(began)
        with Recorder(tape):
            step = run_step(cell_model, cell_inputs, forward, loss_of, autocast, scale)
        if scale is None or finite_or_hopeless(step):
            break
    assert step is not None
    reference_model = copy.deepcopy(model).to(torch.float64)
    with Widener(tape):
        reference = run_step(
            reference_model, cast_inputs(inputs, torch.float64), forward, loss_of, None, None
        )
    return Truth(leaf_errors(step, reference))


def finite_or_hopeless(step: Step) -> bool:
    """Whether a scaled step is done: its gradients are finite, or its loss is not (no
    smaller scale helps a forward that overflowed)."""
    if not bool(torch.isfinite(step.leaves["loss"]).all()):
        return True
    return all(bool(torch.isfinite(v).all()) for v in step.leaves.values())


def scales(scaled: bool) -> Iterator[float | None]:
    """The loss scales a step tries: a GradScaler's, halving while the gradients are not
    finite; one unscaled try where there is no scaler."""
    if not scaled:
        yield None
        return
    scale = INIT_SCALE
    while scale >= 2.0**-8:
        yield scale
        scale /= 2.0


def layer_norm_kernel_cost(dtype: str, rows: int = 2048) -> float:
    """What torch's own LayerNorm backward costs in ``dtype``, in units of its eps: the
    bias gradient (a sum over ``rows``) against the same rounded gradients summed in
    float64. Rounding the sum once costs half an eps; torch's CPU kernel, which sums the
    rows in the half dtype, costs more (bfloat16 at 2048 rows: about 25 eps)."""
    low = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, 32, generator=generator)
    grad = (torch.randn(rows, 32, generator=generator) * 1e-3 + 1e-3).to(low)
    weight = torch.ones(32, dtype=low, requires_grad=True)
    bias = torch.zeros(32, dtype=low, requires_grad=True)
    torch.nn.functional.layer_norm(x.to(low), (32,), weight, bias).backward(grad)
    assert bias.grad is not None
    want = grad.to(torch.float64).sum(0)
    error = float((bias.grad.to(torch.float64) - want).abs().max() / want.abs().max())
    return error / torch.finfo(low).eps


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """torch's RNG seeded for a build, put back after it."""
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)
