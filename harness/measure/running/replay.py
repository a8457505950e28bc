"""Only precision may differ: a cell's own random draws, and its discrete choices within
rounding, replayed in the float64 reference.

A cell is judged against float64 for what its precision costs. Two things that are not
precision would otherwise count as its error:

- **Random draws.** ``torch.rand(shape, dtype=x.dtype)`` draws other numbers in float64 than
  in float32 or half (stochastic depth written so put every cell 1.2e6 times its tolerance
  from float64). The cell's draws are recorded (:class:`Recorder`) and the float64 reference
  takes them (:class:`Replay`), cast to the dtype it asks for, in order; where the reference
  draws other shapes or another number of times, it keeps its own draws, and a note says so.
- **Choices within rounding.** A ReLU's side, a top-k routing, an argmax, a sort, a clamp, a
  max-pool's pick, ``where`` on a comparison, a floor (in place too: a stochastic-depth
  mask): where float64's inputs to the choice lie within rounding of the other outcome,
  which side a cell takes is below its dtype's resolution, and the gradient (or, for a
  routing, the output) jumps by the whole difference: one ReLU unit of 256 put off by a
  float16 step moved a T5 feed-forward's ``wi`` gradient 24% from float64's, 348 times what
  rounding the data costs; 6 of 512 top-2 routings flipped at near-ties (0.09-0.51 eps
  apart) put bfloat16 cells 3-8 times their tolerance out. Where the cell chose otherwise
  within the band (``KINK_WIDTH`` eps of the dtype, relative to the largest magnitude of the
  tensor the choice was made on), the reference is taken again along the cell's choices,
  every value in it float64's; a choice further from the other outcome keeps float64's: a
  computation that made it otherwise is judged as it is.

The rounding yardstick, which has chance crossings of its own, takes float64's choices within
the same band (it measures the smooth cost of rounding) and its own float64 draws, which are
the reference's: both are plain float64 runs from the same seed.

Both work at the aten level (``TorchDispatchMode``s): they see the ops inside
``F.dropout`` and ``F.relu6`` and the recomputation of ``torch.utils.checkpoint``, reentrant
or not (which a ``TorchFunctionMode`` does not see: the checkpoint recomputed a plain ReLU
where the forward had replayed one, and raised ``CheckpointError``). A replayed op returns
tensors of its own op's dtype and shape, so a checkpoint's recomputation matches its forward.
Elementwise choices are replayed where autograd reads them: a ReLU's backward reads the sign
of its output, so it takes the sides its replayed forward took (a unit put on holds its own
input, which may be negative); a leaky ReLU's and a hardtanh's backward read the input, and
are replayed as choices of their own; a clamp's backward is made of comparisons, replayed as
such. Indices (top-k, sort, max/min, argmax/argmin, max-pool) are replayed as the cell's
whole row of picks where every pick's float64 value is within the band of float64's own
pick at the same place, and the values are gathered from float64's input, so autograd's
backward scatters by the cell's picks.

Measured (CPU, torch 2.13.0; T5 and ``nn.TransformerEncoder`` with ReLU, 2 to 48 layers,
post- and pre-LN, float16 and bfloat16, ``autocast`` and ``half``): a cell's ReLU inputs
differ from float64's by at most 4.0 eps of their tensor's largest; ``KINK_WIDTH`` is twice
that. The other choices, on the healthy models of ``tests/test_replay.py`` (top-2 routing,
an argmax and ``where`` gate, max-pool, clamp/hardtanh/ReLU6, ReLU blocks under checkpoint;
float16 and bfloat16, ``autocast`` and ``half``), are made on inputs at most 0.84 eps of
their tensor's largest from float64's (top-k 0.50, argmax 0.38, max-pool 0.39, clamp and
comparisons 0.82, hardtanh 0.62, ReLU 0.84; a comparison's relative to its operands'
largest): well inside the same band, which that test holds them to half of.

What it costs: a forward records its draws, picks and comparisons (a forward output moves
continuously through a kink: elementwise kinks are recorded in a training step only); a cell
pays for a replay (one more float64 run of the model) only where a draw of its differs from
float64's or a choice of its crossed within the band. ``nn.Dropout`` on the CPU draws the
same masks in every dtype: no replay.

A fit (``fitting.fit``) records its draws and its outcomes (comparisons, floors: the masks
made of the draws) in every step and in its last loss, where the dtype tracer sees only its
first step (``seen_by_replay_alone``); its elementwise kinks and picks are not recorded
(the stage's ``replays_kinks`` and ``replays_picks``, :mod:`harness.schema.stages`): after
its first step a fit's weights are its own, and it is judged by where its loss ends, not
by one step's gradients. Where a draw differs or an outcome crossed, the float64 fit is
taken again with all of the cell's draws (its outcomes within the band), and
the fit is judged against where that ends. Measured (CPU, torch 2.13.0; the stochastic-depth
model of ``tests/test_replay.py``, masks drawn with ``torch.rand`` in the activations' dtype,
AdamW with an eps float16 holds, 20 steps: 63 draws): the float32 control's fit ends where
the float64 fit along its draws ends to float32's resolution, where against float64's own
draws it ended 16% beyond (0.2912 against 0.2515, 0.30 of its limit from the draws alone;
other seeds 0.08 and 0.14, or below); the float16 and bfloat16 ``autocast`` and ``half``
fits pass (bfloat16 ``autocast`` at 0.003 of its limit). The replay costs a fit one more
float64 fit where its draws are not float64's, and memory for every step's draws (a
dropout's masks: one activation per step).

A compiled cell (``torch.compile``) is not recorded: Inductor draws its own random numbers
in its kernels and makes its choices there, out of a dispatch mode's sight. It is judged
against float64's own draws and choices, and where float64 drew random numbers a note says
they could not be replayed.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch.utils._python_dispatch import (
    _disable_current_modes,
    _get_current_dispatch_mode_stack,
)

from harness.measure.precision.dtypes import TORCH_DTYPES
from harness.measure.running.stays_float64 import StaysFloat64
from harness.measure.tracing.dispatch_mode import LazyDynamoMode
from harness.schema.stages import stage_of

#: How near the other outcome (in the dtype's eps, relative to the largest magnitude of the
#: tensor the choice is made on) a choice is below the dtype's resolution: twice the largest
#: distance measured (4.0 eps, see the module docstring).
KINK_WIDTH = 8.0
#: The machine epsilon of the simulated roundings (see :mod:`harness.measure.judge.rounding`).
SIMULATED_EPS = {"float32": 2.0**-23, "tf32": 2.0**-10}

aten = torch.ops.aten

#: Elementwise kinks: the name a note gives the op, where its input is, and where its lower
#: and upper breakpoints are (a position in ``args``, the keyword, the default; None: none).
Bound = tuple[int, str, float | None] | None
KINKS: dict[Any, tuple[str, int, Bound, Bound]] = {
    aten.relu: ("ReLU", 0, (-1, "", 0.0), None),
    aten.relu_: ("ReLU", 0, (-1, "", 0.0), None),
    aten.leaky_relu: ("leaky ReLU", 0, (-1, "", 0.0), None),
    aten.leaky_relu_: ("leaky ReLU", 0, (-1, "", 0.0), None),
    aten.leaky_relu_backward: ("leaky ReLU", 1, (-1, "", 0.0), None),
    aten.hardtanh: ("hardtanh", 0, (1, "min_val", -1.0), (2, "max_val", 1.0)),
    aten.hardtanh_: ("hardtanh", 0, (1, "min_val", -1.0), (2, "max_val", 1.0)),
    aten.hardtanh_backward: ("hardtanh", 1, (2, "min_val", None), (3, "max_val", None)),
    aten.clamp: ("clamp", 0, (1, "min", None), (2, "max", None)),
    aten.clamp_: ("clamp", 0, (1, "min", None), (2, "max", None)),
    aten.clamp_min: ("clamp", 0, (1, "min", None), None),
    aten.clamp_min_: ("clamp", 0, (1, "min", None), None),
    aten.clamp_max: ("clamp", 0, None, (1, "max", None)),
    aten.clamp_max_: ("clamp", 0, None, (1, "max", None)),
}
#: Ops whose floating output is the choice itself: comparisons (``where``'s condition) and
#: rounding to integers (stochastic depth's ``floor``, in place as timm writes it:
#: ``(keep + torch.rand(...)).floor_()``).
COMPARISONS = {aten.gt, aten.lt, aten.ge, aten.le, aten.gt_, aten.lt_, aten.ge_, aten.le_}
TO_INTEGERS = {
    aten.floor, aten.ceil, aten.trunc, aten.round,
    aten.floor_, aten.ceil_, aten.trunc_, aten.round_,
}  # fmt: skip
#: Ops that pick indices, and how to read their picks (see ``picks_of``).
PICKS = {
    aten.topk: "top-k",
    aten.sort: "sort",
    aten.max: "max/min",
    aten.min: "max/min",
    aten.argmax: "argmax/argmin",
    aten.argmin: "argmax/argmin",
    aten.max_pool2d_with_indices: "max-pool",
    aten.max_pool3d_with_indices: "max-pool",
}
#: Random ops whose output is not a draw alone (its values depend on the input): never
#: replayed (the reference draws its own).
NOT_DRAWS = {aten.rrelu_with_noise, getattr(aten, "rrelu_with_noise_", aten.rrelu_with_noise)}


DRAW, KINK, OUTCOME, PICK = "draw", "kink", "outcome", "pick"


#: What each op seen is to the replay (None: nothing), by op overload.
_KINDS: dict[Any, str | None] = {}


def kind_of(func: Any) -> str | None:
    """Whether an op draws, is a kink, has a choice for its output, or picks; None for the
    others (most ops), looked up once per op."""
    if func not in _KINDS:
        packet = func.overloadpacket
        if is_draw(func):
            _KINDS[func] = DRAW
        elif packet in KINKS:
            _KINDS[func] = KINK
        elif packet in COMPARISONS or packet in TO_INTEGERS:
            _KINDS[func] = OUTCOME
        else:
            _KINDS[func] = PICK if packet in PICKS else None
    return _KINDS[func]


def dtype_eps(dtype: str) -> float:
    if dtype in SIMULATED_EPS:
        return SIMULATED_EPS[dtype]
    return float(torch.finfo(TORCH_DTYPES[dtype]).eps)


def band(dtype: str) -> float:
    """How near the other outcome a choice is below ``dtype``'s resolution, relative to
    its tensor's largest magnitude."""
    return KINK_WIDTH * dtype_eps(dtype)


@dataclass(frozen=True)
class Draw:
    """One random op of a computation and what it drew (for ``native_dropout``, its mask)."""

    op: str
    value: torch.Tensor

    def matches(self, other: Draw) -> bool:
        return self.op == other.op and self.value.shape == other.value.shape

    def same_values(self, other: Draw) -> bool:
        return self.matches(other) and torch.equal(
            self.value.to(torch.float64), other.value.to(torch.float64)
        )


@dataclass(frozen=True)
class Choice:
    """One discrete choice of a computation: the op, what it chose (a kink's piece per
    element, a comparison's or a floor's output, the indices picked), and, in the float64
    reference's record only, how far each element is from the other outcome relative to its
    tensor's largest magnitude (``margin``) or, for picks, the values picked among
    (``source``, arranged so that ``source.gather(dim, taken)`` gives the picks)."""

    op: str
    taken: torch.Tensor
    margin: torch.Tensor | None = None
    source: torch.Tensor | None = None
    dim: int = -1
    grouped: bool = False

    def matches(self, other: Choice) -> bool:
        return self.op == other.op and self.taken.shape == other.taken.shape

    def crossed(self, cell: Choice, dtype: str) -> int:
        """How many of this (float64) record's choices ``cell`` made otherwise within the band."""
        if self.margin is not None:
            moved = (self.margin <= band(dtype)) & (self.taken != cell.taken.to(self.taken.device))
            return int(moved.sum())
        if self.source is None:
            return 0
        near, differs = picks_near(self.source, cell.taken, self.taken, self, band(dtype))
        return int((near & differs).sum())


@dataclass
class Recorded:
    """What a computation drew and chose, in order."""

    draws: list[Draw] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)

    def to_data(self) -> dict[str, Any]:
        """Plain data (``torch.load(weights_only=True)`` reads it back)."""
        return {
            "draws": [{"op": d.op, "value": d.value} for d in self.draws],
            "choices": [{f.name: getattr(c, f.name) for f in fields(c)} for c in self.choices],
        }

    def on_cpu(self) -> Recorded:
        """The record with its tensors on the CPU, where float64's are compared with it."""
        return Recorded(
            [Draw(d.op, d.value.cpu()) for d in self.draws],
            [replace(c, taken=c.taken.cpu()) for c in self.choices],
        )

    @classmethod
    def from_data(cls, data: dict[str, Any]) -> Recorded:
        return cls(
            [Draw(**d) for d in data.get("draws", [])],
            [Choice(**c) for c in data.get("choices", [])],
        )


def label(func: Any) -> str:
    packet = func.overloadpacket
    if packet in KINKS:
        return KINKS[packet][0]
    if packet in PICKS:
        return PICKS[packet]
    return "comparison" if packet in COMPARISONS else "rounding to integers"


def is_draw(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags and func.overloadpacket not in NOT_DRAWS


def drawn(func: Any, out: Any) -> torch.Tensor | None:
    """What a random op drew: its output, or ``native_dropout``'s mask."""
    if func.overloadpacket is aten.native_dropout:
        return out[1]
    return out if isinstance(out, torch.Tensor) else None


@dataclass(frozen=True)
class Kink:
    """A kink op's floating input and its lower and upper breakpoints (None: none)."""

    x: torch.Tensor
    lower: Any
    upper: Any
    #: Whether an element at the upper breakpoint is above it: a hardtanh's backward passes
    #: a gradient only strictly between its bounds (bfloat16 holds many inputs at exactly 1).
    upper_closed: bool = False

    @property
    def points(self) -> list[Any]:
        return [p for p in (self.lower, self.upper) if p is not None]

    def piece(self) -> torch.Tensor:
        """Each element's piece: 0 at or below the lower breakpoint (a ReLU's off), 1
        between, 2 above the upper one."""
        x = self.x
        if self.lower is None:
            piece = torch.ones(x.shape, dtype=torch.int8, device=x.device)
        else:
            piece = (x > self.lower).to(torch.int8)
        if self.upper is None:
            return piece
        return piece + (x >= self.upper if self.upper_closed else x > self.upper)

    def margin(self) -> torch.Tensor:
        """How far each element is from its nearest breakpoint, relative to the largest."""
        x = self.x.double()
        distance = torch.stack(
            [(x - (p.double() if isinstance(p, torch.Tensor) else p)).abs().expand(x.shape)
             for p in self.points]
        ).amin(0)  # fmt: skip
        return relative(distance, scale_of(self.x))


def kink_input(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Kink | None:
    """A kink op's input and breakpoints, or None where it is no floating choice (an
    integer clamp, a clamp with no bound)."""
    _, position, lower, upper = KINKS[func.overloadpacket]
    x = args[position] if len(args) > position else None
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return None
    closed = func.overloadpacket is aten.hardtanh_backward
    found = Kink(x, bound_value(lower, args, kwargs), bound_value(upper, args, kwargs), closed)
    return found if found.points else None


def bound_value(spec: Bound, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if spec is None:
        return None
    index, name, default = spec
    return args[index] if 0 <= index < len(args) else kwargs.get(name, default)


def scale_of(*values: Any) -> torch.Tensor:
    """The largest magnitude among ``values`` (tensors and numbers), in float64."""
    device = next((v.device for v in values if isinstance(v, torch.Tensor)), None)
    parts = [magnitude(v, device) for v in values if isinstance(v, (torch.Tensor, int, float))]
    return torch.stack(parts).amax()


def magnitude(value: torch.Tensor | float, device: torch.device | None) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        return torch.tensor(abs(float(value)), dtype=torch.float64, device=device)
    if not value.numel():
        return value.new_zeros((), dtype=torch.float64)
    return value.detach().abs().amax().double()


def relative(distance: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``distance`` over ``scale``, 0 where both are (a tensor of zeros is all at its kink)."""
    distance = distance.double()
    return torch.where(distance == 0, 0.0, distance / scale).float()


def outcome_margin(func: Any, args: tuple[Any, ...]) -> torch.Tensor | None:
    """How far a comparison's operands, or a value rounded to an integer, are from the
    other outcome, relative to their largest magnitude; None where it is no floating choice."""
    if func.overloadpacket in COMPARISONS:
        a, b = args[0], args[1]
        floating = [t for t in (a, b) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not floating or (isinstance(a, torch.Tensor) and a.dtype == torch.bool):
            return None
        b64 = b.double() if isinstance(b, torch.Tensor) else b
        distance = (a.double() - b64).abs()
        return relative(distance, scale_of(a, b))
    x = args[0]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or len(args) > 1:
        return None
    x64 = x.double()
    if func.overloadpacket is aten.round:
        distance = ((x64 - x64.floor()) - 0.5).abs()
    else:
        distance = (x64 - x64.round()).abs()
    return relative(distance, scale_of(x))


@dataclass(frozen=True)
class Picks:
    """An index op's picks arranged so that ``source.gather(dim, indices)`` gives the values
    picked; ``grouped``: a row of picks along ``dim`` is one choice (top-k, sort), else each
    pick is (max-pool)."""

    source: torch.Tensor
    indices: torch.Tensor
    dim: int
    grouped: bool


def picks_of(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Picks | None:
    """An index op's picks (see :class:`Picks`), None where it is no floating choice (a max
    over the whole tensor, integers)."""
    x = args[0]
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        return None
    packet = func.overloadpacket
    if packet in (aten.max_pool2d_with_indices, aten.max_pool3d_with_indices):
        spatial = 2 if packet is aten.max_pool2d_with_indices else 3
        indices = out[1].flatten(-spatial)
        return Picks(x.flatten(-spatial), indices, indices.dim() - 1, False)
    if packet in (aten.argmax, aten.argmin):
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        if dim is None:
            return Picks(x.reshape(-1), out.reshape(1), 0, False)
        return Picks(x, keep_dim(out, x, dim, args, kwargs, 2), dim % x.dim(), False)
    if not isinstance(out, tuple):
        return None  # max/min over the whole tensor: a value, no index
    indices, dim = out[1], dim_of(func, args, kwargs) % x.dim()
    if packet in (aten.max, aten.min):
        return Picks(x, keep_dim(indices, x, dim, args, kwargs, 2), dim, False)
    return Picks(x, indices, dim, True)


def dim_of(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    packet = func.overloadpacket
    if packet is aten.topk:
        return int(args[2]) if len(args) > 2 else int(kwargs.get("dim", -1))
    if packet is aten.sort and "stable" in func._schema.overload_name:
        return int(kwargs.get("dim", -1))
    return int(args[1]) if len(args) > 1 else int(kwargs.get("dim", -1))


def keep_dim(
    indices: torch.Tensor,
    x: torch.Tensor,
    dim: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    position: int,
) -> torch.Tensor:
    keepdim = args[position] if len(args) > position else kwargs.get("keepdim", False)
    return indices if keepdim else indices.unsqueeze(dim % x.dim())


def picks_near(
    source: torch.Tensor,
    cell: torch.Tensor,
    own: torch.Tensor,
    picks: Any,
    width: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the cell's picks are within ``width`` of float64's own (every pick of a row,
    for grouped picks), and where they differ."""
    cell = cell.to(source.device)
    dim, grouped = picks.dim, picks.grouped
    apart = (source.gather(dim, cell) - source.gather(dim, own)).abs()
    near = apart.double() <= width * scale_of(source)
    differs = cell != own
    if grouped:
        near, differs = near.all(dim, keepdim=True), differs.any(dim, keepdim=True)
    return near, differs


class Recorder(LazyDynamoMode):
    """While active, keeps what every random op drew and what every discrete choice chose
    (elementwise kinks only with ``kinks``, picks only with ``picks``), in order, and
    changes nothing: its own work runs out of the sight of the modes beneath it (a dtype
    tracer sees the computation as it is). ``reference``: the float64 reference, which
    keeps how far each choice was from the other outcome, too."""

    def __init__(self, kinks: bool = True, reference: bool = False, picks: bool = True) -> None:
        super().__init__()
        self.kinks = kinks
        self.picks = picks
        self.reference = reference
        self.recorded = Recorded()

    @classmethod
    def at(cls, stage: str, reference: bool) -> Recorder:
        """The recorder of a ``stage``, keeping what the stage replays (its
        ``replays_kinks`` and ``replays_picks``, :mod:`harness.schema.stages`)."""
        kept = stage_of(stage)
        return cls(kept.replays_kinks, reference, kept.replays_picks)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        kind = kind_of(func)
        if kind is None or (kind == KINK and not self.kinks) or (kind == PICK and not self.picks):
            return func(*args, **kwargs)  # most ops: nothing to keep
        hook = sys.getprofile()
        sys.setprofile(None)  # the watch's profile hook has nothing to see here
        try:
            if kind == KINK:
                return self.kink(func, args, kwargs)
            if kind == OUTCOME:
                return self.outcome(func, args, kwargs)
            out = func(*args, **kwargs)
            if kind == DRAW:
                self.draw(func, out)
            else:
                self.pick(func, args, kwargs, out)
            return out
        finally:
            sys.setprofile(hook)

    def kink(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with _disable_current_modes():
            found = kink_input(func, args, kwargs)
            if found is not None:  # before the op: an in-place one overwrites its input
                margin = found.margin() if self.reference else None
                self.recorded.choices.append(Choice(str(func), found.piece(), margin))
        return func(*args, **kwargs)

    def draw(self, func: Any, out: Any) -> None:
        value = drawn(func, out)
        if value is not None:
            with _disable_current_modes():
                self.recorded.draws.append(Draw(str(func), value.detach().clone()))

    def outcome(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with _disable_current_modes():  # before the op: an in-place one overwrites its input
            margin = outcome_margin(func, args)
        out = func(*args, **kwargs)
        if margin is not None:
            with _disable_current_modes():
                kept = margin if self.reference else None
                self.recorded.choices.append(Choice(str(func), out.detach().clone(), kept))
        return out

    def pick(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        with _disable_current_modes():
            picks = picks_of(func, args, kwargs, out)
            if picks is not None:
                source = picks.source.detach().clone() if self.reference else None
                taken = picks.indices.detach().clone()
                self.recorded.choices.append(
                    Choice(str(func), taken, None, source, picks.dim, picks.grouped)
                )


class Replay(LazyDynamoMode):
    """While active, the i-th random op takes ``draws[i]`` (cast to its own dtype) and the
    i-th discrete choice takes ``choices[i]``'s outcome wherever its own inputs lie within
    ``dtype``'s band of the other outcome; ``None`` leaves draws (or choices) as they are.
    ``draws_fit`` (``choices_fit``) is False once an op is not the one recorded at its place
    (another op or shape, or one more than recorded): from there on it is left as it is.
    ``replayed``: the draws whose values the replay changed; ``crossed``: the choices it
    moved to the other outcome, by the name a note gives them."""

    def __init__(
        self,
        draws: Sequence[Draw] | None,
        choices: Sequence[Choice] | None,
        dtype: str,
        kinks: bool = True,
        picks: bool = True,
    ) -> None:
        super().__init__()
        self.draws = list(draws) if draws is not None else None
        self.choices = list(choices) if choices is not None else None
        self.width = band(dtype)
        self.kinks = kinks
        self.picks = picks
        self.draw_at = 0
        self.choice_at = 0
        self.draws_fit = True
        self.choices_fit = True
        self.replayed = 0
        self.crossed: Counter[str] = Counter()
        #: The sides each replayed ReLU took, by where its output is held (see
        #: ``relu_backward``).
        self.relu_sides: dict[tuple[Any, ...], torch.Tensor] = {}

    @property
    def fits(self) -> bool:
        return self.draws_fit and self.choices_fit

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if self.draws is not None and is_draw(func):
            return self.draw(func, args, kwargs)
        if self.choices is None:
            return func(*args, **kwargs)
        if packet is aten.threshold_backward and self.relu_sides:
            return self.relu_backward(func, args, kwargs)
        if self.kinks and packet in KINKS:
            found = kink_input(func, args, kwargs)
            recorded = self.next_choice(func, found.x.shape) if found else None
            return self.kink(func, args, kwargs, found, recorded)
        if packet in COMPARISONS or packet in TO_INTEGERS:
            return self.outcome(func, args, kwargs)
        if self.picks and packet in PICKS:
            return self.pick(func, args, kwargs)
        return func(*args, **kwargs)

    def next_choice(self, func: Any, shape: torch.Size) -> Choice | None:
        """The recorded choice at this place, or None (and no more) where it is not this op's."""
        assert self.choices is not None
        if not self.choices_fit:
            return None
        index, self.choice_at = self.choice_at, self.choice_at + 1
        if index >= len(self.choices) or self.choices[index].op != str(func):
            self.choices_fit = False
            return None
        recorded = self.choices[index]
        if recorded.taken.shape != shape:
            self.choices_fit = False
            return None
        return recorded

    def draw(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)  # its own draw first: the generator moves as it would
        assert self.draws is not None
        value = drawn(func, out)
        if value is None or not self.draws_fit:
            return out
        index, self.draw_at = self.draw_at, self.draw_at + 1
        if index >= len(self.draws) or not self.draws[index].matches(Draw(str(func), value)):
            self.draws_fit = False
            return out
        given = self.draws[index].value.to(device=value.device, dtype=value.dtype)
        self.replayed += not torch.equal(given, value)
        if func.overloadpacket is aten.native_dropout:
            x, p = args[0], float(args[1])
            scale = 0.0 if p >= 1 else 1.0 / (1.0 - p)
            return x * given * scale, given
        return out.copy_(given) if func._schema.is_mutable else given

    def kink(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        found: Any,
        recorded: Choice | None,
    ) -> Any:
        if found is None or recorded is None:
            out = func(*args, **kwargs)
            self.relu_sides.pop(tensor_key(out), None)
            return out
        x = found.x
        own = found.piece()
        near = found.margin() <= self.width
        taken = torch.where(near, recorded.taken.to(x.device), own)
        self.crossed[label(func)] += int((taken != own).sum())
        out = kink_output(func, args, found, taken)
        out = args[0].copy_(out) if func._schema.is_mutable else out
        if func.overloadpacket in (aten.relu, aten.relu_):
            self.relu_sides[tensor_key(out)] = taken > 0
        return out

    def relu_backward(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A ReLU's backward reads its output's sign: where the output is one this replay
        made, the sides it took (a unit put on may hold its own negative input)."""
        grad, result = args[0], args[1]
        on = self.relu_sides.get(tensor_key(result))
        if on is None or on.shape != grad.shape:
            return func(*args, **kwargs)
        return torch.where(on, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))

    def outcome(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        margin = outcome_margin(func, args)  # before the op: an in-place one overwrites its input
        out = func(*args, **kwargs)
        if margin is None:
            return out
        recorded = self.next_choice(func, out.shape)
        if recorded is None:
            return out
        taken = torch.where(margin <= self.width, recorded.taken.to(out), out)
        self.crossed[label(func)] += int((taken != out).sum())
        return out.copy_(taken) if func._schema.is_mutable else taken

    def pick(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        picks = picks_of(func, args, kwargs, out)
        if picks is None:
            return out
        recorded = self.next_choice(func, picks.indices.shape)
        if recorded is None:
            return out
        near, differs = picks_near(picks.source, recorded.taken, picks.indices, picks, self.width)
        take = near.expand_as(picks.indices) if picks.grouped else near
        indices = torch.where(take, recorded.taken.to(picks.indices.device), picks.indices)
        self.crossed[label(func)] += int((near & differs).sum())
        return picks_output(func, out, picks, indices)


def kink_output(func: Any, args: tuple[Any, ...], kink: Kink, piece: torch.Tensor) -> torch.Tensor:
    """What a kink op computes with its elements on the pieces ``piece`` gives."""
    packet, x = func.overloadpacket, kink.x
    if packet in (aten.relu, aten.relu_):
        return torch.where(piece > 0, x, torch.zeros((), dtype=x.dtype, device=x.device))
    if packet in (aten.leaky_relu, aten.leaky_relu_):
        slope = args[1] if len(args) > 1 else 0.01
        return torch.where(piece > 0, x, x * slope)
    if packet is aten.leaky_relu_backward:
        grad, slope = args[0], args[2]
        return torch.where(piece > 0, grad, grad * slope)
    if packet is aten.hardtanh_backward:
        grad = args[0]
        return torch.where(piece == 1, grad, torch.zeros((), dtype=grad.dtype))
    return clamped(kink, piece)


def tensor_key(t: Any) -> tuple[Any, ...]:
    """Where a tensor's values are held: a saved output unpacked in backward is another
    tensor object over the same memory."""
    if not isinstance(t, torch.Tensor):
        return ()
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def clamped(kink: Kink, piece: torch.Tensor) -> torch.Tensor:
    """A clamp (hardtanh, ``clamp_min``, ``clamp_max``) by pieces: at or below its lower
    bound that bound, above its upper bound that, between them the input."""
    x, out = kink.x, kink.x
    for bound, where in ((kink.lower, piece == 0), (kink.upper, piece == 2)):
        if bound is not None:
            held = torch.as_tensor(bound, dtype=x.dtype, device=x.device).expand(x.shape)
            out = torch.where(where, held, out)
    return out


def picks_output(func: Any, out: Any, picks: Picks, indices: torch.Tensor) -> Any:
    """An index op's output along the picks ``indices``, values gathered from its input."""
    packet = func.overloadpacket
    if packet in (aten.max_pool2d_with_indices, aten.max_pool3d_with_indices):
        values = picks.source.gather(picks.dim, indices)
        return values.view_as(out[0]), indices.view_as(out[1])
    if packet in (aten.argmax, aten.argmin):
        return indices.view_as(out)
    values = picks.source.gather(picks.dim, indices)
    return values.view_as(out[0]), indices.view_as(out[1])


@dataclass(frozen=True)
class ReplayPlan:
    """What a cell's reference is taken again with: the cell's draws (None: float64's own)
    and its choices (None: float64's own), and why draws were not replayed, if they were not."""

    draws: tuple[Draw, ...] | None
    choices: tuple[Choice, ...] | None
    kinks: bool
    unmatched: str | None = None
    picks: bool = True


def plan_replay(
    reference: Recorded, cell: Recorded, dtype: str, kinks: bool, picks: bool = True
) -> ReplayPlan | None:
    """What the reference must be taken again with for ``cell``, or None where float64's
    own draws and choices are the cell's (no draw differs, no choice crossed within the
    band): the replay is paid only by the cells that need it (``kinks``, ``picks``: whether
    the cell's stage replays those choices: its ``replays_kinks``, ``replays_picks``). What
    the cell drew after float64's last draw is not float64's to take (see
    :func:`draws_unmatched`): a step whose gradients are not finite is taken again to say
    where, and draws again."""
    unmatched = draws_unmatched(reference.draws, cell.draws)
    taken = cell.draws[: len(reference.draws)]
    draws_differ = unmatched is None and any(
        not r.same_values(c) for r, c in zip(reference.draws, taken, strict=True)
    )
    crossed = crossings(reference.choices, cell.choices, dtype)
    if not (draws_differ or crossed):
        return ReplayPlan(None, None, kinks, unmatched, picks) if unmatched else None
    return ReplayPlan(
        tuple(taken) if draws_differ else None,
        tuple(cell.choices) if cell.choices else None,
        kinks,
        unmatched,
        picks,
    )


def draws_unmatched(reference: Sequence[Draw], cell: Sequence[Draw]) -> str | None:
    """Why the cell's draws cannot stand for float64's (another number, op or shape), or
    None where they can. A cell may draw more than float64 after float64's last draw (a
    step taken again to say where its gradients went non-finite draws again): those are not
    float64's to take."""
    if not reference:
        return None
    if len(cell) < len(reference):
        return f"the cell drew {len(cell)} time(s), float64 {len(reference)}"
    for index, (r, c) in enumerate(zip(reference, cell, strict=False)):
        if not r.matches(c):
            return (
                f"draw {index + 1} is {c.op} of shape {tuple(c.value.shape)} in the cell, "
                f"{r.op} of shape {tuple(r.value.shape)} in float64"
            )
    return None


def crossings(reference: Sequence[Choice], cell: Sequence[Choice], dtype: str) -> int:
    """How many choices a cell made otherwise than float64 within the band, over the calls
    both made alike (from the first that differs in op or shape, the computations differ)."""
    total = 0
    for r, c in zip(reference, cell, strict=False):
        if not r.matches(c):
            break
        total += r.crossed(c, dtype)
    return total


def replay_note(replay: Replay | None, plan: ReplayPlan) -> str | None:
    """What a note says of a replay: ``replayed the cell's 3 random draw(s) and 6 choice(s)
    within rounding (top-k 6)``; and where the cell's draws could not be replayed, why."""
    parts = []
    if replay is not None and replay.replayed:
        parts.append(f"the cell's {replay.replayed} random draw(s)")
    crossed = {name: n for name, n in (replay.crossed if replay else {}).items() if n}
    if crossed:
        kinds = ", ".join(f"{name} {n}" for name, n in sorted(crossed.items()))
        parts.append(f"{sum(crossed.values())} choice(s) within rounding ({kinds})")
    text = "judged against float64 taken again with " + " and ".join(parts) if parts else ""
    if plan.unmatched:
        fallback = (
            f"the cell's random draws are not float64's ({plan.unmatched}): float64 kept its own"
        )
        text = f"{text}; {fallback}" if text else fallback
    return text or None


def run_replayed(run: Callable[[], Any], plan: ReplayPlan, dtype: str) -> tuple[Any, Replay]:
    """``run()`` under the replay of ``plan``."""
    replay = Replay(plan.draws, plan.choices, dtype, plan.kinks, plan.picks)
    with replay:
        return run(), replay


#: The dispatch modes a fit's later steps are seen by.
SEEN_IN_EVERY_STEP = (Recorder, Replay, StaysFloat64)


@contextmanager
def seen_by_replay_alone() -> Iterator[None]:
    """Out of the sight of every dispatch mode but a :class:`Recorder`, a :class:`Replay`
    and a float64 run's :class:`StaysFloat64`: a fit's later steps and its last loss, which
    the dtype tracer and the mode's checks do not see (the first step shows what they show),
    draw as its first step does, each draw is the cell's to replay, and a float64 fit stays
    float64 in every step."""
    kept = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, SEEN_IN_EVERY_STEP)]
    with _disable_current_modes(), ExitStack() as modes:
        for mode in kept:
            modes.enter_context(mode)
        yield
