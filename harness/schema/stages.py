"""The stages a cell runs (``forward``, ``train``, ``fit``), each one class: its run, the
reference and yardsticks it is judged by, its verdict and its words in the report, as an asv
benchmark type is one class. The classes are registered in :data:`STAGE_REGISTRY` (one
place: every list of stages, the stage axis's vocabulary included, is read from it), and a
stage of one's own is one more subclass registered there.

A stage is declared here, where the read side sees it without torch: what it runs and how
its verdict is made are hooks that measuring calls with what it has (:class:`StageCall`,
:class:`StageJudge`), so a stage names the choice and :mod:`harness.measure` does the work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Protocol, TypeVar, overload


class StageCall(Protocol):
    """What a stage's run may do with one call of a fix (see
    :func:`harness.measure.running.fix_run.call_fix`)."""

    def forward(self) -> Any:
        """The fix called once with the gradient mode and autocast the cell asks for."""

    def train_step(self) -> Any:
        """One training step with the cell's recipe, the fix its forward."""

    def fit(self) -> Any:
        """A short fit with the cell's recipe, the fix the forward of each step."""


class StageJudge(Protocol):
    """How a stage's verdict may judge a run that returned (see
    :func:`harness.measure.judge.judging.ran`)."""

    def outputs(self) -> Any:
        """What the run returned, leaf by leaf, against its reference within its yardstick."""

    def fit(self) -> Any:
        """A fit's loss curve by where it ends beside the same fix's float64 fit."""


class Stage:
    """One stage of the matrix. A subclass sets the name and words and overrides a hook
    where it differs from a forward pass; :func:`register_stage` makes it a value of the
    stage axis. What measuring, the report and the summary do differently for a stage they
    ask of its class (the attributes below), never of its name.

    A stage is known to a process that imported the module declaring it. A cell runs in a
    child forked from the process that runs it, and inherits every stage registered there;
    the workers of ``run -n N`` (``N`` > 0) are interpreters of their own, which import the
    run's case modules: declare a stage of one's own in a case module or a module one
    imports, and it reaches them; a stage registered in a process alone (a test's fixture)
    runs with ``-n 0``. A record whose stage is not registered where it is read is read as
    a forward-like stage named by its name (:func:`stage_as_read`)."""

    #: The stage axis's value (``--stage NAME``, a record's ``stage``).
    name: ClassVar[str]
    #: What a cell of the stage runs, for ``--help`` and the docs.
    meaning: ClassVar[str]
    #: How a sentence of the report names what a fix passes (``passes the train step``).
    passed: ClassVar[str]
    #: How it names a cell of the stage (``bfloat16/half train step is inaccurate``).
    noun: ClassVar[str]
    #: What a cell judged ``inaccurate`` did, as the report says it.
    inaccurate_verb: ClassVar[str] = "is inaccurate"
    #: Runs a training recipe: asks the case for a loss and scales it (the scaler axis);
    #: a yardstick that keeps the activations rounds the gradients the step holds.
    trains: ClassVar[bool] = False
    #: Judged against the float64 run of its own fix (its optimizer, learning rate and
    #: data), not the case's reference fix: its cells share a process per fix.
    own_reference: ClassVar[bool] = False
    #: Judged within the rounding yardsticks (a fit is judged by the float64 curve alone).
    yardsticks: ClassVar[bool] = True
    #: Timed in the timing phase (a fit's step is the train stage's).
    timed: ClassVar[bool] = True
    #: What the stage records of a cell's run and replays in its float64 reference (see
    #: :mod:`harness.measure.running.replay`), beyond random draws and the outcomes made on
    #: them (comparisons, floors), which every stage replays: elementwise kinks (a ReLU's
    #: side), and picks (top-k, argmax, max-pool). A training step keeps every choice; a
    #: forward no elementwise kink (its output moves continuously through one); a fit, in
    #: every step, its draws and the outcomes made on them (a stochastic-depth mask's floor, a
    #: dropout mask's comparison) alone: its trajectory leaves the cell's after the first
    #: step, and it is judged by where its loss ends, not by one step's gradients.
    replays_kinks: ClassVar[bool] = False
    replays_picks: ClassVar[bool] = True
    #: The stage whose time and peak memory the report shows this stage's over, in the same
    #: column (the train step's over the forward pass's: what training costs beyond
    #: inference); None: shown over none.
    cost_against: ClassVar[str | None] = None
    #: Judged by where its loss curve ends beside float64's (:meth:`StageJudge.fit`): the
    #: report shows the curve and the fit's figures (steps skipped, updates lost) in its
    #: column.
    loss_curve: ClassVar[bool] = False

    @property
    def inference(self) -> bool:
        """Runs the fix as inference (under ``no_grad`` unless the case needs gradients),
        where torch takes fused inference paths (``nn.TransformerEncoder``'s fast path) that
        a dispatch mode runs with autocast off unless the dtype tracer switches it back on
        (see :mod:`harness.measure.tracing.trail`); a stage that trains runs none."""
        return not self.trains

    def run(self, call: StageCall) -> Any:
        """What one call of the fix is in a cell of this stage."""
        return call.forward()

    def verdict(self, judge: StageJudge) -> Any:
        """How a run that returned is judged."""
        return judge.outputs()


#: Every stage, by name, in the order reports show them.
STAGE_REGISTRY: dict[str, Stage] = {}

S = TypeVar("S", bound=type[Stage])


def register_stage(cls: S) -> S:
    """Class decorator: the stage becomes a value of the stage axis; a name taken by another
    class is an error. The same class declared again (its module imported anew, as
    discovery does with a case module once the case registry is cleared) replaces itself."""
    known = STAGE_REGISTRY.get(cls.name)
    if known is not None and declared_where(type(known)) != declared_where(cls):
        raise ValueError(f"stage {cls.name!r} is registered twice")
    STAGE_REGISTRY[cls.name] = cls()
    return cls


def declared_where(cls: type[Stage]) -> tuple[str, str]:
    """A stage class's module and qualified name: the same declaration wherever imported."""
    return cls.__module__, cls.__qualname__


def stage_of(name: str) -> Stage:
    """The registered stage ``name``; a ``KeyError`` naming the known ones otherwise."""
    try:
        return STAGE_REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown stage {name!r}; known: {', '.join(STAGE_REGISTRY)}") from None


def stage_as_read(name: str) -> Stage:
    """The stage of a record as what reads records sees it: the registered one, or, for a
    stage this process has not registered (a record of another harness's, or of a stage
    declared in a module not imported here), :func:`unregistered`: a report and a summary
    read any record and never fail on its stage."""
    known = STAGE_REGISTRY.get(name)
    return known if known is not None else unregistered(name)


@functools.cache
def unregistered(name: str) -> Stage:
    """A stage ``name`` not registered here, forward-like (the base class's answers: it
    trains not, is shown over no other stage's cost, has no loss curve) and named by its
    name in every sentence."""
    words = {"name": name, "meaning": name, "passed": name, "noun": name}
    stage: Stage = type(f"Unregistered[{name}]", (Stage,), words)()
    return stage


class StageNames(Sequence[str]):
    """The names of the registered stages (those ``keep`` accepts), read from the registry
    each time: a stage registered later is in every list made of this."""

    def __init__(self, keep: Callable[[Stage], bool] = lambda stage: True) -> None:
        self.keep = keep

    def names(self) -> tuple[str, ...]:
        return tuple(name for name, stage in STAGE_REGISTRY.items() if self.keep(stage))

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        return self.names()[index]

    def __len__(self) -> int:
        return len(self.names())

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def __eq__(self, other: object) -> bool:
        """Equal to the tuple of the names it holds now, as the tuple it stands for."""
        if isinstance(other, StageNames):
            return self.names() == other.names()
        return isinstance(other, tuple) and self.names() == other

    def __hash__(self) -> int:
        return hash(self.names())

    def __repr__(self) -> str:
        return repr(self.names())


@register_stage
class Forward(Stage):
    """One pass of the fix under ``no_grad`` (every case has it)."""

    name = "forward"
    meaning = "one pass under no_grad"
    passed = "inference"
    noun = "forward pass"


@register_stage
class Train(Stage):
    """One training step with the cell's recipe: the loss and every gradient judged
    against a float64 step."""

    name = "train"
    meaning = "one training step, its loss and every gradient judged against float64's"
    passed = "the train step"
    noun = "train step"
    trains = True
    replays_kinks = True
    cost_against = "forward"

    def run(self, call: StageCall) -> Any:
        return call.train_step()


@register_stage
class Fit(Stage):
    """A short run of steps, judged by where its loss ends beside the same fix's float64
    fit, with the updates lost to rounding and the steps a scaler skipped as evidence."""

    name = "fit"
    meaning = "a short fit, judged by where its loss ends beside the same fix's float64 fit"
    passed = "the fit"
    noun = "fit"
    inaccurate_verb = "stalls"
    trains = True
    own_reference = True
    yardsticks = False
    timed = False
    replays_picks = False
    loss_curve = True

    def run(self, call: StageCall) -> Any:
        return call.fit()

    def verdict(self, judge: StageJudge) -> Any:
        return judge.fit()
