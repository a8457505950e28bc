"""Your own model through the matrix: a case made from a factory of a model and its inputs.

A factory is a function that returns the model and example inputs, in float32 on the CPU,
with random weights if you like (the harness seeds the RNG first)::

    def my_block():
        return MyBlock(dim=64), {"x": torch.randn(2, 16, 64)}

It may take one argument, the cell's :class:`~harness.measure.case.RunContext`, to build for the
cell's backend (``ctx.backend``: ``"sdpa"`` or ``"eager"`` attention, say). Inputs are a dict
of keyword arguments, a tuple or list of positional ones, or one tensor; a third element,
a function ``forward(model, inputs)``, picks what is compared (one output of a model that
returns a cache, say). The harness applies each cell's device and precision, calls the
model, and judges the output against the same model in float64, with the rules, flags and
dtype trail of the built-in cases. The pytest plugin (:mod:`harness.plugin`) and
``python -m harness check MODULE:FACTORY`` both build on this.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import torch

from harness.measure import import_probe, registry
from harness.measure.case import Case, RunContext, Upstream, Workload, fix
from harness.schema.axes import CONTROL_MODE, DEVICE_KINDS, FORWARD_STAGE, MODEL_AXES
from harness.schema.config import RunConfig
from harness.schema.selection import Selection

#: The keys under which positional inputs, and the forward function where the factory
#: gave one, travel in a workload's inputs (values that are not tensors stay as they are).
POSITIONAL = "*args"
FORWARD = "*forward"

Factory = Callable[..., Any]
Forward = Callable[[Any, dict[str, Any]], Any]


class ModelCheckError(ValueError):
    """A factory or target that cannot be checked, said in one line."""


class Matrix:
    """The cells a model check asks for, by axis (the fp32 control is always added): the
    model axes of the table (``devices``, ``dtypes``, ``modes``, ``backends``,
    ``compiles``), each at its default unless given."""

    __slots__ = ("_values", "keep_fp32")

    def __init__(self, keep_fp32: tuple[str, ...] = (), **axes: tuple[str, ...]) -> None:
        known = {axis.plural: axis.model_default or () for axis in MODEL_AXES}
        unknown = sorted(set(axes) - set(known))
        if unknown:
            raise TypeError(
                f"no model axis {', '.join(unknown)} (axes: {', '.join(known)}, keep_fp32)"
            )
        self._values = {
            plural: tuple(axes.get(plural, default)) for plural, default in known.items()
        }
        #: Modules or parameters (dotted names) that stay float32 when the model is cast,
        #: as transformers' ``_keep_in_fp32_modules`` keeps them.
        self.keep_fp32 = tuple(keep_fp32)

    def __getitem__(self, plural: str) -> tuple[str, ...]:
        return self._values[plural]

    def replace(self, **axes: tuple[str, ...]) -> Matrix:
        return Matrix(self.keep_fp32, **{**self._values, **axes})

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Matrix) and (self._values, self.keep_fp32) == (
            other._values,
            other.keep_fp32,
        )

    def __hash__(self) -> int:
        return hash((tuple(self._values.items()), self.keep_fp32))

    def __repr__(self) -> str:
        return f"Matrix(keep_fp32={self.keep_fp32!r}, **{self._values!r})"


def case_name(text: str) -> str:
    """A case name from a function or module name: ``test_T5_block`` -> ``test-t5-block``."""
    name = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if not name:
        raise ModelCheckError(f"{text!r} gives no usable case name")
    return name


def call_factory(factory: Factory, ctx: RunContext) -> Any:
    """The factory's result; it is given the cell's context where it takes an argument."""
    takes_ctx = bool(inspect.signature(factory).parameters)
    return factory(ctx) if takes_ctx else factory()


def as_workload(built: Any, where: str) -> Workload:
    """``(model, inputs)`` or ``(model, inputs, forward)`` as a workload."""
    if not isinstance(built, tuple) or len(built) not in (2, 3):
        raise ModelCheckError(
            f"{where} returned {type(built).__name__}; expected (model, inputs) or "
            "(model, inputs, forward)"
        )
    model, inputs, *rest = built
    forward = rest[0] if rest else None
    if forward is not None and not callable(forward):
        raise ModelCheckError(f"{where}: forward must be a function (model, inputs) -> output")
    extra = {FORWARD: forward} if forward is not None else {}
    return Workload(model=model, inputs={**input_dict(inputs, where), **extra})


def input_dict(inputs: Any, where: str) -> dict[str, Any]:
    if isinstance(inputs, Mapping):
        return {str(k): v for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return {POSITIONAL: list(inputs)}
    if isinstance(inputs, torch.Tensor):
        return {POSITIONAL: [inputs]}
    raise ModelCheckError(
        f"{where}: inputs are {type(inputs).__name__}; expected a dict, a tuple or a tensor"
    )


def call_model(model: Any, inputs: dict[str, Any]) -> Any:
    """The model called on its inputs, or the factory's forward where it gave one."""
    given = {k: v for k, v in inputs.items() if k != FORWARD}
    forward: Forward | None = inputs.get(FORWARD)
    if forward is not None:
        return forward(model, given)
    keywords = {k: v for k, v in given.items() if k != POSITIONAL}
    return model(*given.get(POSITIONAL, ()), **keywords)


class ModelCase(Case):
    """A model from a factory: its one fix, ``none``, calls the model as it is."""

    factory: ClassVar[Factory]
    #: The ``MODULE:FACTORY`` that named it (``check``), or empty (the pytest plugin).
    target: ClassVar[str] = ""
    reference_fix = "none"
    failure = None
    has_known_failure = False
    #: A factory may build another model per backend (transformers' attention classes draw
    #: their random weights in another order): each backend is judged against its own.
    reference_per_backend = True

    def build(self, ctx: RunContext) -> Workload:
        return as_workload(call_factory(type(self).factory, ctx), self.name)

    @fix("none", rationale="the model as it is")
    def none(self, w: Workload, ctx: RunContext) -> Any:
        return call_model(w.model, w.inputs)


def model_case(
    name: str, factory: Factory, matrix: Matrix, source_file: str, target: str = ""
) -> Case:
    """A case for the model ``factory`` builds, over the cells ``matrix`` asks for;
    ``target`` is the ``MODULE:FACTORY`` it was named by, where ``check`` named it."""
    modes = tuple(dict.fromkeys((*matrix["modes"], CONTROL_MODE)))
    stages = tuple(dict.fromkeys((FORWARD_STAGE, *matrix["stages"])))
    attributes = {
        "name": name,
        "title": (inspect.getdoc(factory) or f"{name}: a model checked by ampmatrix")
        .strip()
        .splitlines()[0],
        "upstream": Upstream(repo="your project", file=source_file, commit=""),
        "factory": staticmethod(factory),
        **{axis.plural: matrix[axis.plural] for axis in MODEL_AXES},
        "modes": modes,
        "stages": stages,
        "keep_fp32": matrix.keep_fp32,
        "source_file": source_file,
        "target": target,
    }
    cls = type(f"ModelCase_{name.replace('-', '_')}", (ModelCase,), attributes)
    return registry.add_model_case(cls())


def split_target(target: str) -> tuple[str, str]:
    """``MODULE:FACTORY`` as its two parts, or a ``ModelCheckError`` saying what is wrong."""
    module_name, _, attribute = target.partition(":")
    if not module_name or not attribute:
        raise ModelCheckError(f"{target!r}: expected MODULE:FACTORY, e.g. models:build_block")
    return module_name, attribute


def target_names(targets: Sequence[str]) -> dict[str, str]:
    """The case name of each target: its factory's name (``models:build_block`` ->
    ``build-block``), or, where two targets' factories share a name, the module's and the
    factory's (``dup_a:build`` -> ``dup-a-build``), so no two models share a cell id. Two
    targets that would still share a name are a ``ModelCheckError``."""
    unique = list(dict.fromkeys(targets))
    short = {target: case_name(split_target(target)[1]) for target in unique}
    counts = Counter(short.values())
    names = {
        target: name if counts[name] == 1 else case_name(target.replace(":", "-"))
        for target, name in short.items()
    }
    by_name: dict[str, str] = {}
    for target, name in names.items():
        if name in by_name:
            raise ModelCheckError(
                f"{by_name[name]} and {target} would both be checked as {name!r}: "
                "rename one factory"
            )
        by_name[name] = target
    return names


def load_target(target: str, path: str = "") -> tuple[Factory, str]:
    """The factory named by ``MODULE:FACTORY`` (importable from ``path``, the folder
    ``check`` ran in, too) and the file it is defined in. The module is first imported in
    a forked child (``import_probe``), so one that exits, crashes or hangs as it is imported
    is one line; torch settings it changes as it is imported are put back."""
    module_name, attribute = split_target(target)
    folder = path or str(Path.cwd())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    if module_name not in sys.modules:
        fatal = import_probe.first_fatal([lambda: importlib.import_module(module_name)])
        if fatal is not None:
            raise ModelCheckError(f"{target}: {module_name} {fatal.how}")
    module = import_target_module(target, module_name)
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ModelCheckError(f"{target}: {module_name} has no function {attribute!r}")
    return factory, factory_file(factory, module)


def import_target_module(target: str, module_name: str) -> ModuleType:
    """The target's module, imported with torch's settings put back after it; an exit or an
    error it raises as it is imported is a ``ModelCheckError``."""
    try:
        return registry.import_confined(module_name, lambda: importlib.import_module(module_name))
    except KeyboardInterrupt:
        raise
    except SystemExit as error:
        raise ModelCheckError(
            f"{target}: {module_name} called sys.exit({error.code!r})"
        ) from error
    except BaseException as error:
        raise ModelCheckError(f"{target}: cannot import {module_name}: {error!r}") from error


def factory_file(factory: Factory, module: ModuleType) -> str:
    """The file a factory is defined in; for one that has none of its own (a
    ``functools.partial``, a callable object, a builtin), the file of the module it was
    named in."""
    try:
        return str(Path(inspect.getfile(inspect.unwrap(factory))).resolve())
    except TypeError:
        pass
    wrapped = getattr(factory, "func", None)  # functools.partial
    if wrapped is not None and wrapped is not factory:
        with suppress(TypeError):
            return str(Path(inspect.getfile(wrapped)).resolve())
    own = getattr(module, "__file__", None)
    return str(Path(own).resolve()) if own else module.__name__


def target_case(target: str, name: str, matrix: Matrix, path: str = "") -> Case:
    """The case of ``MODULE:FACTORY`` named ``name`` (registered once per process); a case
    of that name registered for anything else is a ``ModelCheckError``."""
    found = registry.find(name)
    if found is not None:
        if getattr(found, "target", None) != target:
            raise ModelCheckError(
                f"{target}: the name {name!r} is already a case of this run "
                f"({getattr(found, 'target', None) or found.source_file})"
            )
        return found
    factory, source = load_target(target, path)
    return model_case(name, factory, matrix, source, target)


def matrix_of(selection: Selection, keep_fp32: tuple[str, ...]) -> Matrix:
    """The cells ``check`` asks of a model: on each model axis, what the selection names
    (the float32 control aside: it is always added), else the axis's default; and every
    device kind, which the selection narrows when the cells are expanded (``cuda:1``)."""
    asked = {
        axis.plural: tuple(v for v in selection[axis.plural] if v != axis.control)
        for axis in MODEL_AXES
    }
    given = {plural: values for plural, values in asked.items() if values}
    return Matrix(keep_fp32, **{**given, "devices": DEVICE_KINDS})


def keep_for(target: str, keep_fp32: tuple[str, ...]) -> tuple[str, ...]:
    """The ``--keep-fp32`` names that apply to ``target``: ``NAME`` applies to every target,
    ``FACTORY=NAME`` to that factory's model only."""
    factory = split_target(target)[1]
    kept = []
    for entry in keep_fp32:
        owner, _, name = entry.rpartition("=")
        if not owner or owner == factory:
            kept.append(name)
    return tuple(kept)


def registered_models(config: RunConfig) -> list[Case]:
    """The cases of the models a ``check`` run names (registered in every process of the
    run: the runner and each pytest worker)."""
    return [
        target_case(
            target,
            name,
            matrix_of(config.selection, keep_for(target, config.keep_fp32)),
            config.models_path,
        )
        for target, name in target_names(config.models).items()
    ]
