"""The contract every case follows: a Case with its fixes, and what a fix's code sees.

A case module defines one subclass of :class:`Case`, decorated with :func:`register`, whose
methods decorated with :func:`fix` are its fixes. ``build`` makes the model and inputs in
float32 on the CPU; the harness, not the case, applies each cell's device and precision
(see :mod:`harness.measure.precision` and the guide, ``docs/writing-a-case.md``)::

    @register
    class MyCase(Case):
        name = "my-case"
        ...
        def build(self, ctx): return Workload(model=MyBlock(), inputs={"x": torch.randn(2, 8)})

        @fix("none", rationale="the upstream code path")
        def none(self, w, ctx): return w.model(**w.inputs)
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

import torch

from harness.measure.authoring.recipes import DEFAULT_LR, Recipe
from harness.measure.authoring.recipes import OptimizerFactory as OptimizerFactory
from harness.measure.precision.modes import Precision
from harness.measure.tracing.observe import CoreObservation, record_core_dtypes
from harness.schema.axes import (
    CONTROL_MODE,
    EAGER,
    FORWARD_STAGE,
    LOW_PRECISION_DTYPES,
    NO_SCALER,
    SCALERS,
    SMALL_SIZE,
    TRAINING_STAGES,
    Cell,
)
from harness.schema.devices import DEVICE_KINDS
from harness.schema.run_files import CaseInfo


@dataclass(frozen=True)
class Upstream:
    """Where a failure comes from: links a report can show."""

    #: The repository, ``owner/name`` (``nari-labs/dia``).
    repo: str
    #: The file of the failing code path, in that repository.
    file: str
    #: The commit (or tag) the case's code path was taken from.
    commit: str
    #: The issues that report the failure, ``owner/name#N``.
    issues: tuple[str, ...] = ()
    #: A link to the most telling of them (an issue, a pull request, a line).
    url: str = ""


class Symptom(str, Enum):
    """How a failure that raises nothing shows in a cell that ran (a silent failure)."""

    #: The output (or, in a training step, a gradient) is not finite: inf or NaN.
    NON_FINITE = "non-finite"
    #: The error is beyond the tolerance (``inaccurate``) while the output is finite.
    BEYOND_YARDSTICK = "beyond-yardstick"
    #: A matmul or attention kernel computed in a wider dtype than the cell's (the
    #: ``drift`` flag), whether or not the output is accurate.
    WIDER_DTYPE = "wider-dtype"


@dataclass(frozen=True)
class FailureSignature:
    """A case's known failure: raised (an exception type name and a regex its message
    matches), silent (the symptoms a cell shows without raising), or both.

    ``FailureSignature("RuntimeError", r"regex")`` is a raised failure;
    ``FailureSignature(silent=(Symptom.NON_FINITE,))`` a silent one. A cell reproduces it
    when it raises the error, or runs and shows any of the symptoms.
    """

    error_type: str | None = None
    message: str | None = None
    silent: tuple[Symptom, ...] = ()

    def __post_init__(self) -> None:
        # a symptom may be given by its value ("non-finite"); an unknown one is a ValueError
        symptoms = tuple(dict.fromkeys(Symptom(s) for s in self.silent))
        object.__setattr__(self, "silent", symptoms)

    @property
    def raised(self) -> bool:
        """The failure raises an exception (it declares its type and message)."""
        return self.error_type is not None and self.message is not None

    def matches(self, error_type: str, message: str) -> bool:
        """The raised error is this failure: its type name and a message the regex finds."""
        if self.error_type is None or self.message is None:
            return False
        return error_type == self.error_type and re.search(self.message, message) is not None

    def shown_by(self, symptoms: Iterable[Symptom]) -> bool:
        """A cell that ran with ``symptoms`` shows this failure silently."""
        return not set(self.silent).isdisjoint(symptoms)

    def problems(self) -> list[str]:
        """What is wrong with the declaration, as sentences (empty when it is valid)."""
        if (self.error_type is None) != (self.message is None):
            return ["a raised failure needs both error_type and message"]
        if not self.raised and not self.silent:
            return ["declares neither a raised error (error_type, message) nor silent symptoms"]
        if self.message is not None:
            try:
                re.compile(self.message)
            except re.error as error:
                return [f"message {self.message!r} is not a regex: {error}"]
        return []

    def to_dict(self) -> dict[str, str | list[str] | None]:
        """As ``cases.json`` stores it: the raised part (None where silent only) and the
        silent symptoms by value."""
        return {
            "error_type": self.error_type,
            "message": self.message,
            "silent": [symptom.value for symptom in self.silent],
        }


@dataclass(frozen=True)
class Size:
    """One workload size of a case: its name, its dimensions and where they come from.

    ``name`` is ``small`` or ``upstream``; ``dims`` is the case's own frozen dataclass of
    dimensions (``build`` and the fixes read it as ``ctx.dims``); ``source`` cites the config
    the figures are taken from, e.g. ``"nari-labs/Dia-1.6B config.json: decoder
    n_embd=2048, gqa_query_heads=16"``.
    """

    name: str
    dims: Any
    source: str


@dataclass
class Workload:
    """What one cell runs: a model (a module, a tensor, or any object) and its inputs.

    ``build`` returns them in float32 on the CPU; the fix receives them with the cell's
    device and precision applied. In the timing phase one workload serves many calls of the
    fix: a fix that changes state (an optimizer step) takes a :meth:`fresh_model` per call.
    """

    model: Any
    inputs: dict[str, Any] = field(default_factory=dict)

    def fresh_model(self) -> Any:
        """A deep copy of the prepared model (same device and dtypes): state changed on it
        does not leak into the next call."""
        return copy.deepcopy(self.model)


@dataclass
class RunContext:
    """What a fix's code sees about the cell it runs in (read-only facts, no plumbing).

    ``dtype`` is the cell's dtype; it is ``float64`` when the harness computes the reference.
    """

    device: torch.device
    dtype: torch.dtype
    mode: str
    backend: str
    #: Record the attention core's dtypes; off while timing, so nothing sits in the timed path.
    observe: bool = True
    observation: CoreObservation = field(default_factory=CoreObservation)
    managed_by_case: bool = False
    #: The cell's workload size and its dimensions (the case's ``sizes[size].dims``).
    size: str = SMALL_SIZE
    dims: Any = None
    #: ``forward``, or ``train``: the harness runs the fix as the forward of a training
    #: step (gradients on) and takes the loss and gradients after it.
    stage: str = FORWARD_STAGE
    #: A train or fit cell's loss scaling (``none``, ``dynamic``, ``static``); None: the
    #: recipe's, else the mode's.
    scaler: str | None = None

    @property
    def precision(self) -> Precision:
        return Precision(self.device, self.dtype, self.mode, self.managed_by_case)

    @property
    def is_reference(self) -> bool:
        return self.dtype == torch.float64

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the harness gave the model and inputs: the cell dtype in the casting
        modes (``half``, ``half-autocast``), float32 otherwise, float64 in the reference."""
        return self.precision.compute_dtype

    @property
    def upcast_dtype(self) -> torch.dtype:
        """What upstream code means by ``.float()``: float32, or float64 in the reference."""
        return self.precision.upcast_dtype

    @contextmanager
    def attention_core(self) -> Iterator[None]:
        """Mark the attention core: the dtypes its kernels really see are recorded."""
        if not self.observe:
            yield
            return
        with record_core_dtypes(self.observation):
            yield


FixFunction = Callable[[Any, Workload, RunContext], Any]


@dataclass(frozen=True)
class Fix:
    """A named code variant of a case; ``none`` is the buggy upstream code path."""

    name: str
    rationale: str
    func: FixFunction
    upstream: str = ""
    modes: tuple[str, ...] | None = None
    backends: tuple[str, ...] | None = None
    #: The low-precision dtypes this fix runs in, where it narrows the case's (a fix for a
    #: bfloat16 failure); the float32 control runs for every fix whatever it names.
    dtypes: tuple[str, ...] | None = None
    #: The parts this fix keeps in float32, where it keeps fewer than its case (a subset of
    #: the case's ``keep_fp32``); None: the case's.
    keep_fp32: tuple[str, ...] | None = None
    #: In a train cell where the recipe scales the loss (float16 under autocast): whether
    #: this fix's training does. False is upstream code that trains without a GradScaler
    #: (its recipe's scalers are ``none``).
    grad_scaler: bool = True
    #: The optimizer this fix's fit steps with (``f(params, lr)``), where it is part of the
    #: fix (float32 master weights, say); None: the recipe's.
    optimizer: OptimizerFactory | None = None
    #: The recipe this fix trains with, where it is part of the fix; None: the case's.
    recipe: Recipe | None = None


def fix(
    name: str,
    *,
    rationale: str,
    upstream: str = "",
    modes: tuple[str, ...] | None = None,
    backends: tuple[str, ...] | None = None,
    keep_fp32: tuple[str, ...] | None = None,
    dtypes: tuple[str, ...] | None = None,
    grad_scaler: bool = True,
    optimizer: OptimizerFactory | None = None,
    recipe: Recipe | None = None,
) -> Callable[[FixFunction], FixFunction]:
    """Mark a method of a Case as a fix. ``modes``/``backends``/``dtypes`` narrow where it
    applies (the float32 control runs for every fix);
    ``keep_fp32`` narrows what of the case's ``keep_fp32`` it keeps in float32;
    ``recipe`` is the :class:`~harness.measure.authoring.recipes.Recipe` its training
    steps and fits run, where that is part of the fix. Two shorthands for a recipe:
    ``optimizer`` is the optimizer its fit steps with (``f(params, lr)``), the case's
    recipe otherwise; ``grad_scaler=False`` is a fix whose training scales no loss (the
    upstream code path of a case about training float16 without a GradScaler)."""
    if recipe is not None and (optimizer is not None or not grad_scaler):
        raise TypeError(
            f"fix {name!r}: a recipe= names its optimizer and scalers itself; "
            "give it alone, without optimizer= or grad_scaler="
        )

    def mark(func: FixFunction) -> FixFunction:
        func.__ampmatrix_fix__ = Fix(  # type: ignore[attr-defined]
            name,
            rationale,
            func,
            upstream=upstream,
            modes=modes,
            backends=backends,
            keep_fp32=keep_fp32,
            dtypes=dtypes,
            grad_scaler=grad_scaler,
            optimizer=optimizer,
            recipe=recipe,
        )
        return func

    return mark


class Case:
    """A failure pattern from a real project. Subclass it; see the module docstring."""

    #: The case's name, as cell ids and ``--case`` write it (``dia-sdpa-kv-cache``).
    name: ClassVar[str] = ""
    #: One line saying what fails and where, shown by ``list`` and the report.
    title: ClassVar[str] = ""
    #: Where the failure comes from (required for a failure pattern).
    upstream: ClassVar[Upstream | None] = None
    #: The known failure: raised, silent or both (required for a failure pattern).
    failure: ClassVar[FailureSignature | None] = None
    #: The same failure in other words: as another kernel or release words it (flash-attn
    #: 4's assertion where flash-attn 2 raises a RuntimeError). A cell reproduces when its
    #: error matches ``failure`` or any of these.
    failure_variants: ClassVar[tuple[FailureSignature, ...]] = ()
    #: A failure pattern reproduces a known failure, which it must declare (``failure``); a
    #: model you check (``harness.measure.authoring.model_case``) has none: its errors are just
    #: errors.
    has_known_failure: ClassVar[bool] = True
    #: A fix that is correct in any dtype: run in float64 on the CPU it is the reference, run
    #: in the cell's dtype on the cell's device (mode ``half``) it is the plain low-precision
    #: baseline.
    reference_fix: ClassVar[str] = ""
    #: The device kinds the case runs on (``cuda`` expands to every visible ``cuda:N``).
    devices: ClassVar[tuple[str, ...]] = DEVICE_KINDS
    #: The low-precision dtypes it runs in (the float32 control is added by the harness).
    dtypes: ClassVar[tuple[str, ...]] = LOW_PRECISION_DTYPES
    #: The precision modes (``autocast``, ``half``, ``half-autocast``, and ``fp32``, the
    #: control).
    modes: ClassVar[tuple[str, ...]] = ("half", CONTROL_MODE)
    #: The attention backends its workload can be built for.
    backends: ClassVar[tuple[str, ...]] = ("sdpa",)
    #: ``("eager", "inductor")`` where eager and compiled runs may differ: the harness then
    #: also runs each fix under ``torch.compile(backend="inductor")``.
    compiles: ClassVar[tuple[str, ...]] = (EAGER,)
    #: Modules that must be importable for the case to run; otherwise cells are skipped.
    requires: ClassVar[tuple[str, ...]] = ()
    #: The oldest torch release with the API its upstream code needs (``nn.RMSNorm``: "2.4");
    #: under an older torch its cells are skipped with that reason.
    min_torch: ClassVar[str | None] = None
    #: The case's own time limit per cell in seconds (instead of the run's ``--timeout``).
    timeout_s: ClassVar[float | None] = None
    #: Modules, parameters or buffers of the model (dotted names) that upstream keeps in
    #: float32 when the rest is cast to half (transformers' ``_keep_in_fp32_modules``), and
    #: inputs (their keys in ``Workload.inputs``) that stay float32 whatever the model's
    #: dtype (diffusers' timesteps). A fix may keep fewer (``@fix(keep_fp32=...)``).
    keep_fp32: ClassVar[tuple[str, ...]] = ()
    #: Fixes run with gradients enabled (a training step); otherwise under ``no_grad``.
    needs_grad: ClassVar[bool] = False
    #: The stages the case runs (``forward`` always): ``train`` adds one training step
    #: per cell, with the recipe of the cell's mode (:mod:`harness.measure.running.training`).
    stages: ClassVar[tuple[str, ...]] = (FORWARD_STAGE,)
    #: The learning rate of a ``fit`` cell's optimizer where the case names no ``recipe``
    #: (the default recipe's AdamW with this rate).
    fit_lr: ClassVar[float] = DEFAULT_LR
    #: How the case's train and fit cells train (optimizer, clipping, accumulation, loss
    #: scaling: :class:`~harness.measure.authoring.recipes.Recipe`); None: the default
    #: recipe at ``fit_lr``. A fix may bring its own (``@fix(recipe=...)``).
    recipe: ClassVar[Recipe | None] = None
    #: Upstream code manages precision itself (a Lightning Trainer's ``precision=``): the
    #: harness then only moves the float32 workload to the device (float64 for the
    #: reference) and neither casts nor enters autocast; the fixes read ``ctx.dtype`` and
    #: ``ctx.mode`` and apply them the upstream way.
    manages_precision: ClassVar[bool] = False
    #: The workload sizes, smallest first: ``small`` (required where any is declared) and
    #: ``upstream``, each with its dimensions and the config they come from. A case without
    #: sizes runs at one size, ``small``, and ``ctx.dims`` is None.
    sizes: ClassVar[tuple[Size, ...]] = ()
    #: The reference is computed on each cell's own backend (not the case's reference
    #: backend): for a model built differently per backend, with other weights, say.
    reference_per_backend: ClassVar[bool] = False
    source_file: str = ""

    @property
    def known_failures(self) -> tuple[FailureSignature, ...]:
        """``failure`` and its variants (empty for a model you check)."""
        return (self.failure, *self.failure_variants) if self.failure else ()

    @property
    def size_names(self) -> tuple[str, ...]:
        """The sizes this case runs at, smallest first."""
        return tuple(s.name for s in self.sizes) or (SMALL_SIZE,)

    def dims(self, size: str) -> Any:
        """The dimensions of ``size`` (None for a case that declares no sizes)."""
        return next((s.dims for s in self.sizes if s.name == size), None)

    def kept_by(self, fix: str) -> tuple[str, ...]:
        """What ``fix`` keeps in float32: its own ``keep_fp32`` where it narrows the case's."""
        narrowed = self.fixes[fix].keep_fp32
        return self.keep_fp32 if narrowed is None else narrowed

    def recipe_of(self, fix: str) -> Recipe:
        """The recipe ``fix`` trains with: its own, else the case's (the default recipe at
        ``fit_lr`` where the case names none), with the fix's ``optimizer`` and, for
        ``grad_scaler=False``, no loss scaling."""
        own = self.fixes[fix]
        recipe = own.recipe or type(self).recipe or Recipe(lr=self.fit_lr)
        if own.optimizer is not None:
            recipe = dataclasses.replace(recipe, optimizer=own.optimizer)
        if not own.grad_scaler:
            recipe = recipe.with_scalers(NO_SCALER)
        return recipe

    def scalers_of(self, fix: str, dtype: str, mode: str, stage: str) -> tuple[str, ...]:
        """The loss-scaling policies ``fix`` runs at ``dtype``, ``mode`` and ``stage``, each a
        cell of its own (the scaler axis): its recipe's in a stage that trains
        (:meth:`Recipe.scalers_for`), none in a forward."""
        if stage not in TRAINING_STAGES:
            return (NO_SCALER,)
        return self.recipe_of(fix).scalers_for(dtype, mode, self.manages_precision)

    @property
    def scaler_names(self) -> tuple[str, ...]:
        """Every scaler policy the case's cells run, the scaler axis's declared values:
        ``none`` (its forward and its float32 control) and those its fixes' recipes name."""
        named = {
            scaler
            for fix in self.fixes
            for dtype in self.dtypes
            for mode in self.modes
            for stage in self.stages
            for scaler in self.scalers_of(fix, dtype, mode, stage)
        }
        return tuple(s for s in SCALERS if s in named or s == NO_SCALER)

    def loss(self, output: Any, workload: Workload, ctx: RunContext) -> Any:
        """The loss of a training step from the fix's output: by default the loss the output
        carries (a transformers model given ``labels``), else the mean squared error of
        every floating output against a fixed random target
        (:func:`harness.measure.authoring.losses.default_loss`). A case overrides it where its
        model is trained on another loss."""
        from harness.measure.authoring.losses import default_loss, model_loss

        carried = model_loss(output)
        return carried if carried is not None else default_loss(output)

    def build(self, ctx: RunContext) -> Workload:
        """The model and inputs in float32 on the CPU. The harness seeds the RNG first, then
        applies the cell's device and precision. ``ctx`` tells the backend and the cell."""
        raise NotImplementedError

    def skip_reason(self, cell: Cell) -> str | None:
        """A case-specific reason this cell cannot run here, or None (checked after the
        environment's own reasons: device, dtype support, backend, ``requires``)."""
        return None

    @property
    def fixes(self) -> dict[str, Fix]:
        found: dict[str, Fix] = {}
        for klass in reversed(type(self).__mro__):
            for attr in vars(klass).values():
                marked = getattr(attr, "__ampmatrix_fix__", None)
                if isinstance(marked, Fix):
                    found[marked.name] = marked
        return found

    def metadata(self) -> CaseInfo:
        """What a report shows about the case, stored with each run (``cases.json``)."""
        return CaseInfo(
            name=self.name,
            title=self.title,
            upstream=dataclasses.asdict(self.upstream) if self.upstream else None,
            failure=self.failure.to_dict() if self.failure else None,
            failure_variants=[f.to_dict() for f in self.failure_variants],
            source_file=self.source_file,
            keep_fp32=list(self.keep_fp32),
            manages_precision=self.manages_precision,
            sizes={size.name: size_metadata(size) for size in self.sizes},
            fixes=[
                {"name": f.name, "rationale": f.rationale, "upstream": f.upstream}
                for f in self.fixes.values()
            ],
        )


def size_metadata(size: Size) -> dict[str, Any]:
    """A size as a report shows it: its dimensions by name, and its source."""
    dims = size.dims
    is_instance = dataclasses.is_dataclass(dims) and not isinstance(dims, type)
    values = dataclasses.asdict(dims) if is_instance else dict(dims or {})
    return {"dims": {k: repr(v) for k, v in values.items()}, "source": size.source}
