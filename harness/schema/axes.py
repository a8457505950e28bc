"""The axes of the matrix and the values each may take: names only, no torch.

This module is the vocabulary shared by measuring and reporting (the report never imports
torch); :mod:`harness.measure.precision` turns these names into torch dtypes and applies the modes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, get_args

from harness.schema.devices import DEVICE_KINDS as DEVICE_KINDS  # the device axis's values
from harness.schema.devices import INDEXED_KINDS, indexed_device
from harness.schema.devices import DeviceKind as DeviceKind
from harness.schema.stages import STAGE_REGISTRY, StageNames
from harness.schema.typed import as_mapping, mismatch

#: Low-precision dtypes under test, and the fp32 control (used only by mode ``fp32``).
Dtype = Literal["float16", "bfloat16", "float32"]
DTYPES: tuple[Dtype, ...] = get_args(Dtype)
LOW_PRECISION_DTYPES: tuple[Dtype, ...] = ("float16", "bfloat16")

#: The precision modes' names, in the order reports show them (see :data:`MODES`).
ModeName = Literal["autocast", "half", "half-autocast", "fp32"]


@dataclass(frozen=True)
class Mode:
    """How the harness puts a cell's precision on a case's float32 model and inputs."""

    name: ModeName
    #: Model (weights, floating buffers) and floating inputs cast to the cell dtype.
    casts_model: bool
    #: The fix runs inside ``torch.autocast(device, dtype)``.
    autocast: bool
    meaning: str


#: The precision modes, in the order reports show them. Each name says what it does:
#: ``autocast`` keeps fp32 weights, ``half`` casts them, ``half-autocast`` does both.
MODES: dict[str, Mode] = {
    mode.name: mode
    for mode in (
        Mode("autocast", False, True, "fp32 weights and inputs, run under torch.autocast(dtype)"),
        Mode(
            "half", True, False, "weights and inputs cast to the dtype (model.half()), no autocast"
        ),
        Mode(
            "half-autocast",
            True,
            True,
            "weights and inputs cast to the dtype, and run under torch.autocast(dtype)",
        ),
        Mode("fp32", False, False, "the control: weights and inputs in float32, no autocast"),
    )
}
MODE_NAMES: tuple[ModeName, ...] = get_args(ModeName)


#: Attention backends a case may declare. ``flash-attn-contract`` enforces flash-attn's
#: documented input contract and computes with SDPA; it stands in where flash-attn is absent.
Backend = Literal["sdpa", "eager", "flash-attn", "flash-attn-contract"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)

#: How the fix runs: ``eager``, or compiled whole with ``torch.compile(backend="inductor")``.
CompileMode = Literal["eager", "inductor"]
COMPILE_MODES: tuple[CompileMode, ...] = get_args(CompileMode)
EAGER: Final = "eager"

#: Workload sizes, in the order reports show them: every case has ``small`` (toy
#: dimensions: CI and correctness); a case may declare ``upstream`` (the real model's
#: dimensions, from the config it cites). Speed is never compared across sizes.
SizeName = Literal["small", "upstream"]
SIZES: tuple[SizeName, ...] = get_args(SizeName)
SMALL_SIZE: Final = "small"
UPSTREAM_SIZE: Final = "upstream"
#: The size timed where a run has both, by device kind: on a GPU the real model's shapes
#: (toy shapes measure launch overhead), on a CPU the small one (half-precision matmuls at
#: model dimensions take minutes there, and a CPU's speed predicts no GPU's anyway).
TIMED_SIZE: dict[DeviceKind, SizeName] = {"cuda": UPSTREAM_SIZE, "cpu": SMALL_SIZE}
#: The sizes a run covers on each device kind unless ``--size`` says otherwise: correctness
#: at both sizes where that is affordable (a GPU), the small size alone on a CPU.
DEFAULT_SIZES: dict[DeviceKind, tuple[SizeName, ...]] = {"cuda": SIZES, "cpu": (SMALL_SIZE,)}

#: What a cell runs: ``forward``, one pass under ``no_grad`` (every case has it); ``train``,
#: one training step with the recipe of the cell's mode (the loss and every gradient
#: judged against a float64 step); ``fit``, a short run of steps. Each is a class of
#: :mod:`harness.schema.stages`; the axis's values are the registered ones (:data:`STAGES`),
#: the built-in first, which this type names.
Stage = Literal["forward", "train", "fit"]
if tuple(STAGE_REGISTRY)[: len(get_args(Stage))] != get_args(Stage):
    raise ImportError(f"the Stage type {get_args(Stage)} is not the registry's {STAGE_REGISTRY}")
#: The registered stages' names, in the order reports show them, read from the registry.
STAGES: Sequence[str] = StageNames()
FORWARD_STAGE: Final = "forward"
TRAIN_STAGE: Final = "train"
FIT_STAGE: Final = "fit"
#: The stages a run covers unless ``--stage`` says otherwise (a fit is asked for).
DEFAULT_STAGES: tuple[Stage, ...] = (FORWARD_STAGE, TRAIN_STAGE)
#: The stages a model check (``check``, ``@check_model``) covers unless it asks for others.
MODEL_STAGES: tuple[Stage, ...] = (FORWARD_STAGE,)
#: How a training step scales its loss (a recipe's scaler policy): ``none``; ``dynamic``, a
#: ``torch.amp.GradScaler`` (its scale halved where the gradients are not finite, the step
#: skipped); ``static``, a fixed loss scale (a step whose gradients are not finite is skipped).
ScalerName = Literal["none", "dynamic", "static"]
SCALERS: tuple[ScalerName, ...] = get_args(ScalerName)
NO_SCALER: Final = "none"
DYNAMIC_SCALER: Final = "dynamic"
STATIC_SCALER: Final = "static"
#: The stages that train, and so scale a loss (:attr:`~harness.schema.stages.Stage.trains`).
TRAINING_STAGES: Sequence[str] = StageNames(lambda stage: stage.trains)
#: How a row label names a scaler policy where it is not the cell's own default.
SCALER_WORDS: dict[str, str] = {
    NO_SCALER: "no scaler",
    DYNAMIC_SCALER: "dynamic scaler",
    STATIC_SCALER: "static scaler",
}


def mode_scaler(dtype: str, mode: str) -> str:
    """The mode's loss scaling where a recipe names none: dynamic for float16 in every mode
    (a GradScaler under autocast with float32 weights, the AMP recipe; the same scale held
    by the harness for half weights, whose float16 gradients a GradScaler refuses to
    unscale: see :mod:`harness.measure.running.training`), none elsewhere (bfloat16 and
    float32 have float32's range, and the float32 control trains unscaled)."""
    return DYNAMIC_SCALER if dtype == "float16" and mode != "fp32" else NO_SCALER


def default_scaler(dtype: str, mode: str, stage: str) -> str:
    """A cell's scaler where nothing names another: the mode's in a stage that trains,
    none in a forward (it scales no loss)."""
    return mode_scaler(dtype, mode) if stage in TRAINING_STAGES else NO_SCALER


#: An axis's ``default`` where it depends on the cell (``Axis.default_of``): a cell given
#: this takes its own.
OWN_DEFAULT: Final = ""


def rank(order: Sequence[str], value: str) -> int:
    """Position of ``value`` in a preferred order; unknown values go last."""
    return order.index(value) if value in order else len(order)


@dataclass(frozen=True)
class Axis:
    """One axis of the matrix, declared once, as a field of :class:`Cell`: everything that
    lists the axes (the ``run`` and ``check`` flags, selection and its validation, cell ids,
    the plugin's test ids, ``expect`` keys, a case's declared values) reads this table."""

    #: The plural: a selection's key, the keyword of ``check_model``, and the ``Case``
    #: attribute listing the values a case declares (``dtypes``).
    plural: str
    #: The ``Case`` attribute naming the values a case runs (default: ``plural``).
    declared_as: str = ""
    #: The values a case may declare; empty: any (names the cases give, like fixes).
    vocabulary: Sequence[str] = ()
    #: The value of records written before the axis existed; a cell id leaves it out.
    default: str | None = None
    #: The value of the float32 control, which the harness adds to every case.
    control: str | None = None
    #: In a cell id, written ``name=value`` (not the bare value) where not the default.
    named_in_id: bool = False
    #: Cells apart on this axis are compared apart (they are in different columns).
    column: bool = False
    #: Offered to model checks (``check``, ``@check_model``), with these defaults.
    model_default: tuple[str, ...] | None = None
    #: Names a selection may use beyond the values (``all``).
    requests: tuple[str, ...] = ()
    #: Device kinds whose devices take an index, ``cuda`` as ``cuda:N`` (parsed by
    #: :mod:`harness.schema.devices`); ``cuda`` then selects them all.
    indexed: tuple[str, ...] = ()
    #: What the flag takes, for its help, where it is more than a value.
    flag_help: str = ""
    #: The name of a :class:`Cell` property giving this axis's default for that cell, where
    #: the default depends on the cell's other axes (a scaler: the mode's); the axis's
    #: ``default`` is then :data:`OWN_DEFAULT`. Such a value is left out of the cell's id and
    #: row label, and a cell or record given none takes it.
    default_of: str = ""
    #: The name of a :class:`Cell` property saying whether a selection on this axis narrows
    #: that cell, where it narrows only some (a scaler: cells that scale a loss; a forward
    #: and the float32 control scale none and stay); empty: every cell.
    narrows: str = ""
    #: The Cell field; filled in from the field's name.
    name: str = ""

    def aliases(self, value: str) -> tuple[str, ...]:
        """The names that select ``value``: itself, and its kind where it is indexed."""
        device = indexed_device(value) if self.indexed else None
        return (value, device.kind) if device and device.kind in self.indexed else (value,)

    def selects(self, wanted: tuple[str, ...], value: str) -> bool:
        """Whether a selection of ``wanted`` (empty: every value) selects ``value``."""
        if not wanted or (self.requests and not set(wanted).isdisjoint(self.requests)):
            return True
        return any(name in wanted for name in self.aliases(value))

    def is_request(self, name: str) -> bool:
        """A name any selection may use (``all``, ``cuda:3``) whatever the cases declare."""
        device = indexed_device(name) if self.indexed else None
        return name in self.requests or (device is not None and device.kind in self.indexed)


def axis(plural: str, **declaration: Any) -> Any:
    """A field of :class:`Cell` that declares an axis; an axis added after records were
    written needs a ``default``, which those records read as."""
    spec = Axis(plural, **declaration)
    metadata = {"axis": spec}
    if spec.default is None:
        return dataclasses.field(metadata=metadata)
    return dataclasses.field(default=spec.default, metadata=metadata)


@dataclass(frozen=True, order=True)
class Cell:
    """One case x fix x device x dtype x mode x backend (x compile x size): a spec, never
    a result. Its fields are the axis table (:data:`AXES`)."""

    case: str = axis("cases", declared_as="name", column=True)
    fix: str = axis("fixes", control="none")
    device: str = axis(
        "devices",
        vocabulary=DEVICE_KINDS,
        column=True,
        model_default=("cpu",),
        requests=("all",),
        indexed=INDEXED_KINDS,
        flag_help="; cpu, cuda, cuda:N or all",
    )
    dtype: str = axis(
        "dtypes",
        vocabulary=DTYPES,
        control="float32",
        column=True,
        model_default=LOW_PRECISION_DTYPES,
    )
    mode: str = axis(
        "modes",
        vocabulary=MODE_NAMES,
        control="fp32",
        column=True,
        model_default=("autocast", "half"),
    )
    backend: str = axis("backends", vocabulary=BACKENDS, model_default=("sdpa",))
    #: ``eager``, or ``inductor`` for a fix run under ``torch.compile``.
    compile: str = axis(
        "compiles", vocabulary=COMPILE_MODES, default=COMPILE_MODES[0], model_default=(EAGER,)
    )
    #: The workload size: ``small`` (toy dimensions, for CI and correctness) or
    #: ``upstream`` (the real model's dimensions, from the config the case cites).
    size: str = axis(
        "sizes",
        declared_as="size_names",
        vocabulary=SIZES,
        default=SMALL_SIZE,
        named_in_id=True,
        column=True,
        requests=("all",),
        flag_help="; small, upstream or all (default: small on cpu, both sizes on cuda)",
    )
    #: ``forward``, ``train`` or ``fit`` (see :data:`STAGES`); a case opts in per stage.
    stage: str = axis(
        "stages",
        vocabulary=STAGES,
        default=FORWARD_STAGE,
        named_in_id=True,
        column=True,
        model_default=MODEL_STAGES,
        requests=("all",),
        # {values}: the registered stages when the parser is built (see cli.options)
        flag_help="; {values} or all "
        f"(default: {' and '.join(DEFAULT_STAGES)}, those a case declares; "
        f"in check: {' and '.join(MODEL_STAGES)})",
    )
    #: How a train or fit cell scales its loss (``none``, ``dynamic``, ``static``: see
    #: :data:`SCALERS`), from its recipe's ``scalers``, else the mode's; ``none`` in a forward.
    #: Scaled and unscaled training of one fix are rows of one column, compared side by side.
    scaler: str = axis(
        "scalers",
        declared_as="scaler_names",
        vocabulary=SCALERS,
        default=OWN_DEFAULT,
        named_in_id=True,
        default_of="default_scaler",
        narrows="scales",
        model_default=(),
        flag_help=f"; {', '.join(SCALERS)} (a train or fit cell's loss scaling: the cells "
        "that scale none, a forward and the fp32 control, stay; default: those its recipe "
        "names, else the mode's; in check: the scalers your model trains with)",
    )

    def __post_init__(self) -> None:
        """An axis whose default depends on the cell (``Axis.default_of``) given no value
        takes it: a train cell that names no scaler scales as its mode does, and so does a
        record written before the scaler axis."""
        for spec in axes_of(type(self)):
            if spec.default_of and not getattr(self, spec.name):
                object.__setattr__(self, spec.name, getattr(self, spec.default_of))

    @property
    def id(self) -> str:
        """The cell's identity: ``case[fix,device,dtype,mode,backend]``, with ``,inductor``
        appended for a compiled cell, ``,size=upstream`` for a cell not of the small size and
        ``,scaler=none`` for a train cell not scaled as its mode scales (an axis at its
        default is left out, so ids written before it stay what they were)."""
        return axis_id(self, axes_of(type(self)))

    @property
    def fix_and_backend(self) -> str:
        """A row label for tables whose case ran several backends: ``fix [backend]``."""
        return f"{self.fix} [{self.backend}]"

    @property
    def scales(self) -> bool:
        """Whether the cell may scale a loss (a stage that trains, out of the float32
        control): the cells a scaler selection narrows."""
        return self.stage in TRAINING_STAGES and self.mode != CONTROL_MODE

    @property
    def default_scaler(self) -> str:
        """The scaler this cell takes where its recipe names none (:func:`default_scaler`)."""
        return default_scaler(self.dtype, self.mode, self.stage)

    def row(self, show_backend: bool) -> str:
        """The row label of tables: the fix, its backend where a case ran several, how it
        was compiled where it was and its scaler where it is not the mode's
        (``none (inductor)``, ``none (no scaler)``): one fix keeps one label across the
        float16 and bfloat16 columns where each trains as its mode does."""
        label = self.fix_and_backend if show_backend else self.fix
        apart = [self.compile] if self.compile != EAGER else []
        if self.scaler != self.default_scaler:
            apart.append(SCALER_WORDS.get(self.scaler, self.scaler))
        return f"{label} ({', '.join(apart)})" if apart else label

    @property
    def column(self) -> Column:
        """The cells compared side by side (timed together, ranked against each other):
        never across workload sizes."""
        return Column(self.case, self.device, self.dtype, self.mode, self.size, self.stage)

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Cell:
        """A cell from its fields (records written before an axis read as its default)."""
        data = as_mapping(data, "cell")
        given: list[Any] = [data.get(axis.name, axis.default) for axis in axes_of(cls)]
        if {str}.issuperset(map(type, given)) and all(given):  # every name given, non-empty
            return cls(*given)
        values = {}
        for f in dataclasses.fields(cls):
            if f.name in data:
                values[f.name] = data[f.name]
                if not isinstance(values[f.name], str) or not values[f.name]:
                    raise TypeError(mismatch(f.name, "a name", values[f.name]))
            elif f.default is dataclasses.MISSING:
                raise KeyError(f.name)
        return cls(**values)


def axes_of(cell_type: type[Cell]) -> tuple[Axis, ...]:
    """The axis table of a cell type: its fields, in order, each with its declaration
    (worked out once per type and kept on it)."""
    table: tuple[Axis, ...] | None = cell_type.__dict__.get("_axis_table")
    if table is None:
        table = tuple(
            dataclasses.replace(f.metadata["axis"], name=f.name)
            for f in dataclasses.fields(cell_type)
        )
        setattr(cell_type, "_axis_table", table)  # noqa: B010  # on the class, not a field
    return table


def axis_id(cell: Any, axes: tuple[Axis, ...]) -> str:
    """``first[second,third,...]``: each axis's value, one left at its default left out."""
    first, *rest = axes
    parts = []
    for spec in rest:
        value = getattr(cell, spec.name)
        default = getattr(cell, spec.default_of) if spec.default_of else spec.default
        if default is None:
            parts.append(value)
        elif value != default:
            parts.append(f"{spec.name}={value}" if spec.named_in_id else value)
    return f"{getattr(cell, first.name)}[{','.join(parts)}]"


#: The axis table: every axis of the matrix, in the order of a cell's fields.
AXES = axes_of(Cell)
AXIS = {spec.name: spec for spec in AXES}
#: The axes a model check selects (``check``'s flags, ``@check_model``'s keywords).
MODEL_AXES = tuple(spec for spec in AXES if spec.model_default is not None)


@dataclass(frozen=True, order=True)
class Column:
    """One case, device, dtype and mode: the fixes of a column are compared with each other."""

    case: str
    device: str
    dtype: str
    mode: str
    size: str = SMALL_SIZE
    stage: str = FORWARD_STAGE

    @property
    def id(self) -> str:
        """``case[device,dtype,mode]``, with ``,size=upstream`` and ``,stage=train`` as in a
        cell's id."""
        return axis_id(self, COLUMN_AXES)


#: The axes a column is made of: the fixes, backends and compiles of a column are its rows.
COLUMN_AXES = tuple(spec for spec in AXES if spec.column)

#: The control of every case: its upstream code path (``none``) in float32.
CONTROL_FIX = AXIS["fix"].control or ""
CONTROL_DTYPE = AXIS["dtype"].control or ""
CONTROL_MODE = AXIS["mode"].control or ""
