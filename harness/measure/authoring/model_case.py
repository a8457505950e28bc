"""Your own model through the matrix: a case made from a factory of a model and its inputs.

A factory is a function that returns the model and example inputs, in float32 on the CPU,
with random weights if you like (the harness seeds the RNG first)::

    def my_block():
        return MyBlock(dim=64), {"x": torch.randn(2, 16, 64)}

It may take one argument, the cell's :class:`~harness.measure.authoring.case.RunContext`, to
build for the cell's backend (``ctx.backend``: ``"sdpa"`` or ``"eager"`` attention, say). Inputs
are a dict of keyword arguments, a tuple or list of positional ones, or one tensor; a third
element, a function ``forward(model, inputs)``, picks what is compared (one output of a
model that returns a cache, say). The harness applies each cell's device and precision, calls the
model, and judges the output against the same model in float64, with the rules, flags and
dtype trail of the built-in cases. The pytest plugin (:mod:`harness.plugin`) and
``python -m harness check MODULE:FACTORY`` both build on this.

In a ``train`` (or ``fit``) cell the loss of the step is, in this order: the loss the user
named (``--loss MODULE:FUNC``, ``check_model(loss=...)``), a function ``loss(output)`` or
``loss(output, inputs)`` of the output (what ``forward`` picked) and the inputs as the
factory gave them (a dict, or a tuple of the positional ones), in the cell's precision;
else the ``loss`` the model's output carries (a transformers model given ``labels``); else
the mean squared error of every floating output against a fixed random target. A named
loss wins over the model's own: a user who names one means it (and may read
``output.loss`` in it).

A ``train`` or ``fit`` cell trains with the recipe the user named (``--recipe
MODULE:NAME``, ``check_model(recipe=...)``: a
:class:`~harness.measure.authoring.recipes.Recipe`), else the default recipe.

What a ``check`` names (its targets, their case names, the ``--keep-fp32``, ``--loss`` and
``--recipe`` entries of each) is parsed and checked in
:mod:`harness.measure.authoring.model_targets`.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import torch

from harness.measure.authoring import import_probe, registry
from harness.measure.authoring.case import Case, RunContext, Upstream, Workload, fix
from harness.measure.authoring.model_targets import (
    FACTORY_FORM,
    LOSS_FORM,
    RECIPE_FORM,
    check_loss_entries,
    keep_for,
    loss_for,
    recipe_for,
    split_target,
    target_names,
)
from harness.measure.authoring.model_targets import ModelCheckError as ModelCheckError
from harness.measure.authoring.recipes import Recipe
from harness.schema.axes import (
    AXIS,
    CONTROL_FIX,
    CONTROL_MODE,
    DEVICE_KINDS,
    FORWARD_STAGE,
    MODEL_AXES,
    TRAINING_STAGES,
    Axis,
)
from harness.schema.config import RunConfig
from harness.schema.selection import Selection

#: The keys under which positional inputs, and the forward function where the factory
#: gave one, travel in a workload's inputs (values that are not tensors stay as they are).
POSITIONAL = "*args"
FORWARD = "*forward"

Factory = Callable[..., Any]
Forward = Callable[[Any, dict[str, Any]], Any]
Loss = Callable[..., Any]
#: The stages whose cells take a loss (a named loss means nothing to the others): those
#: that train (:attr:`~harness.schema.stages.Stage.trains`).
LOSS_STAGES = TRAINING_STAGES


class Matrix:
    """The cells a model check asks for, by axis (the fp32 control is always added): the
    model axes of the table (``devices``, ``dtypes``, ``modes``, ``backends``,
    ``compiles``), each at its default unless given."""

    __slots__ = ("_values", "keep_fp32")

    def __init__(self, keep_fp32: tuple[str, ...] = (), **axes: tuple[str, ...]) -> None:
        known = {axis.plural: axis for axis in MODEL_AXES}
        unknown = sorted(set(axes) - set(known))
        if unknown:
            raise TypeError(
                f"no model axis {', '.join(unknown)} (axes: {', '.join(known)}, keep_fp32)"
            )
        self._values = {
            plural: every_value(axis, axes.get(plural, axis.model_default or ()))
            for plural, axis in known.items()
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


def factory_inputs(inputs: dict[str, Any]) -> dict[str, Any] | tuple[Any, ...]:
    """The inputs as the factory gave them: its keyword inputs as a dict, or its positional
    ones as a tuple (one tensor given alone is a tuple of one)."""
    given = {k: v for k, v in inputs.items() if k != FORWARD}
    if POSITIONAL in given:
        return tuple(given[POSITIONAL])
    return given


def takes_inputs(loss: Loss) -> bool:
    """Whether a loss function takes the inputs after the output (two positional
    arguments); one whose signature cannot be read is given the output alone."""
    try:
        inspect.signature(loss).bind(None, None)
    except (TypeError, ValueError):
        return False
    return True


def named_loss(loss: Loss, name: str, output: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """``loss(output)`` or ``loss(output, inputs)``; what is not a one-element tensor is a
    ``TrainingError`` that names the function."""
    from harness.measure.authoring.losses import TrainingError

    value = loss(output, factory_inputs(inputs)) if takes_inputs(loss) else loss(output)
    if not isinstance(value, torch.Tensor):
        raise TrainingError(f"the loss {name} returned {type(value).__name__}, not a tensor")
    if value.numel() != 1:
        raise TrainingError(
            f"the loss {name} is not a scalar: it returned shape {tuple(value.shape)}"
        )
    return value


def check_loss_signature(loss: Loss, name: str) -> None:
    """A ``ModelCheckError`` where ``loss`` takes neither ``(output)`` nor
    ``(output, inputs)`` (a signature that cannot be read is taken on trust)."""
    if not callable(loss):
        raise ModelCheckError(f"{name}: a loss is a function (output[, inputs]) -> tensor")
    try:
        signature = inspect.signature(loss)
    except (TypeError, ValueError):
        return
    for arguments in ((None,), (None, None)):
        try:
            signature.bind(*arguments)
        except TypeError:
            continue
        return
    raise ModelCheckError(f"{name} takes {signature}: a loss takes (output) or (output, inputs)")


class ModelCase(Case):
    """A model from a factory: its one fix, ``none``, calls the model as it is."""

    factory: ClassVar[Factory]
    #: The ``MODULE:FACTORY`` that named it (``check``), or empty (the pytest plugin).
    target: ClassVar[str] = ""
    reference_fix = CONTROL_FIX
    failure = None
    has_known_failure = False
    #: A factory may build another model per backend (transformers' attention classes draw
    #: their random weights in another order): each backend is judged against its own.
    reference_per_backend = True
    #: The loss the user named (``--loss``, ``check_model(loss=...)``), or None, and its
    #: name as errors say it (``MODULE:FUNC``, or the function's own name).
    loss_function: ClassVar[Loss | None] = None
    loss_name: ClassVar[str] = ""

    def build(self, ctx: RunContext) -> Workload:
        return as_workload(call_factory(type(self).factory, ctx), self.name)

    def loss(self, output: Any, workload: Workload, ctx: RunContext) -> Any:
        """The named loss of the output, where the user named one; else the case's default
        (the model's own ``loss``, else the mean squared error against a fixed target)."""
        named = type(self).loss_function
        if named is None:
            return super().loss(output, workload, ctx)
        return named_loss(named, type(self).loss_name, output, workload.inputs)

    @fix(CONTROL_FIX, rationale="the model as it is")
    def none(self, w: Workload, ctx: RunContext) -> Any:
        return call_model(w.model, w.inputs)


def model_case(
    name: str,
    factory: Factory,
    matrix: Matrix,
    source_file: str,
    target: str = "",
    loss: Loss | None = None,
    loss_name: str = "",
    recipe: Recipe | None = None,
    recipe_name: str = "",
) -> Case:
    """A case for the model ``factory`` builds, over the cells ``matrix`` asks for;
    ``target`` is the ``MODULE:FACTORY`` it was named by, where ``check`` named it; ``loss``
    the loss its training steps take, where the user named one (``loss_name``: as named);
    ``recipe`` the recipe they train with (``recipe_name``: as named), its loss scaling the
    scalers ``matrix`` names where it names some (``--scaler``)."""
    modes = tuple(dict.fromkeys((*matrix["modes"], CONTROL_MODE)))
    stages = tuple(dict.fromkeys((FORWARD_STAGE, *matrix["stages"])))
    if matrix["scalers"]:
        check_scalers(name, matrix["scalers"], stages)
        recipe = (recipe or Recipe()).with_scalers(*matrix["scalers"])
    loss_name = loss_name or getattr(loss, "__qualname__", "") or repr(loss)
    if loss is not None:
        check_loss_signature(loss, loss_name)
        check_loss_stages(stages, loss_name)
    if recipe is not None:
        check_recipe(recipe, recipe_name or repr(recipe))
        check_loss_stages(stages, recipe_name or repr(recipe), "recipe")
    attributes = {
        "name": name,
        "title": (inspect.getdoc(factory) or f"{name}: a model checked by ampmatrix")
        .strip()
        .splitlines()[0],
        "upstream": Upstream(repo="your project", file=source_file, commit=""),
        "factory": staticmethod(factory),
        **{axis.plural: matrix[axis.plural] for axis in MODEL_AXES if not axis.declared_as},
        "modes": modes,
        "stages": stages,
        "keep_fp32": matrix.keep_fp32,
        "source_file": source_file,
        "target": target,
        "loss_function": None if loss is None else staticmethod(loss),
        "loss_name": loss_name if loss is not None else "",
        "recipe": recipe,
    }
    cls = type(f"ModelCase_{name.replace('-', '_')}", (ModelCase,), attributes)
    return registry.add_model_case(cls())


def check_loss_stages(stages: Sequence[str], name: str, what: str = "loss") -> None:
    """A named loss (or recipe: ``what``) with no stage that trains is a
    ``ModelCheckError``: the user would read the verdicts as the loss's, and none of them
    used it."""
    if not set(stages) & set(LOSS_STAGES):
        raise ModelCheckError(
            f"the {what} {name} is taken by a training step, and no stage trains: "
            f"ask for the stage {' or '.join(LOSS_STAGES)} too"
        )


def check_scalers(name: str, scalers: Sequence[str], stages: Sequence[str]) -> None:
    """Scaler policies a model is asked to train with (``--scaler``): known ones, and a
    stage that trains; a ``ModelCheckError`` otherwise."""
    known = AXIS["scaler"].vocabulary
    unknown = [scaler for scaler in scalers if scaler not in known]
    if unknown:
        raise ModelCheckError(f"{name}: unknown scaler {unknown[0]!r} (known: {', '.join(known)})")
    check_loss_stages(stages, ", ".join(scalers), "scaler policy")


def check_recipe(recipe: object, name: str) -> None:
    """What is named as a recipe and is not a ``Recipe`` is a ``ModelCheckError``."""
    if not isinstance(recipe, Recipe):
        raise ModelCheckError(
            f"{name} is {type(recipe).__name__}, not a Recipe "
            "(harness.measure.authoring.recipes.Recipe)"
        )


def load_target(target: str, path: str = "") -> tuple[Factory, str]:
    """The factory named by ``MODULE:FACTORY`` (importable from ``path``, the folder
    ``check`` ran in, too) and the file it is defined in."""
    factory, module = load_function(target, path)
    return factory, factory_file(factory, module)


def load_loss(spec: str, path: str = "") -> Loss:
    """The loss function named by ``MODULE:FUNC`` (``--loss``), imported as a factory is;
    what is wrong with it is a ``ModelCheckError`` that says ``--loss``."""
    try:
        loss, _ = load_function(spec, path, LOSS_FORM)
        check_loss_signature(loss, spec)
    except ModelCheckError as error:
        raise ModelCheckError(f"--loss {error}") from error
    return loss


def load_recipe(spec: str, path: str = "") -> Recipe:
    """The recipe named by ``MODULE:NAME`` (``--recipe``), imported as a factory is; a name
    the module lacks, or an object that is not a ``Recipe``, is a ``ModelCheckError`` that
    says ``--recipe``."""
    try:
        recipe, _ = load_named(spec, path, RECIPE_FORM)
        if recipe is None:
            module_name, attribute = split_target(spec, RECIPE_FORM)
            raise ModelCheckError(f"{spec}: {module_name} has no recipe {attribute!r}")
        check_recipe(recipe, spec)
    except ModelCheckError as error:
        raise ModelCheckError(f"--recipe {error}") from error
    return typing.cast(Recipe, recipe)


def load_function(
    target: str, path: str = "", form: str = FACTORY_FORM
) -> tuple[Callable[..., Any], ModuleType]:
    """The function ``MODULE:NAME`` names (importable from ``path``, the folder ``check``
    ran in, too) and its module (see :func:`load_named`)."""
    function, module = load_named(target, path, form)
    if not callable(function):
        raise ModelCheckError(
            f"{target}: {module.__name__} has no function {split_target(target, form)[1]!r}"
        )
    return function, module


def load_named(target: str, path: str = "", form: str = FACTORY_FORM) -> tuple[Any, ModuleType]:
    """What ``MODULE:NAME`` names (None where the module has no such name; importable from
    ``path``, the folder ``check`` ran in, too) and its module. The module is first imported
    in a forked child (``import_probe``), so one that exits, crashes or hangs as it is
    imported is one line; torch settings it changes as it is imported are put back."""
    module_name, attribute = split_target(target, form)
    folder = path or str(Path.cwd())
    if folder not in sys.path:
        sys.path.insert(0, folder)
    if module_name not in sys.modules:
        fatal = import_probe.first_fatal([lambda: importlib.import_module(module_name)])
        if fatal is not None:
            raise ModelCheckError(f"{target}: {module_name} {fatal.how}")
    module = import_target_module(target, module_name)
    return getattr(module, attribute, None), module


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


def target_case(
    target: str, name: str, matrix: Matrix, path: str = "", loss: str = "", recipe: str = ""
) -> Case:
    """The case of ``MODULE:FACTORY`` named ``name`` (registered once per process), trained
    on the loss ``MODULE:FUNC`` where ``loss`` names one, with the recipe ``MODULE:NAME``
    where ``recipe`` names one; a case of that name registered for anything else is a
    ``ModelCheckError``."""
    found = registry.find(name)
    if found is not None:
        if getattr(found, "target", None) != target:
            raise ModelCheckError(
                f"{target}: the name {name!r} is already a case of this run "
                f"({getattr(found, 'target', None) or found.source_file})"
            )
        return found
    function = load_loss(loss, path) if loss else None
    named_recipe = load_recipe(recipe, path) if recipe else None
    factory, source = load_target(target, path)
    return model_case(name, factory, matrix, source, target, function, loss, named_recipe, recipe)


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


def every_value(axis: Axis, values: Sequence[str]) -> tuple[str, ...]:
    """``values`` asked of ``axis``, where ``all`` (a request) is every value of its
    vocabulary (``--stage all``, ``stages=("all",)``: forward, train and fit)."""
    if axis.vocabulary and any(value in axis.requests for value in values):
        return tuple(axis.vocabulary)
    return tuple(values)


def registered_models(config: RunConfig) -> list[Case]:
    """The cases of the models a ``check`` run names (registered in every process of the
    run: the runner and each pytest worker)."""
    check_loss_entries(config.models, config.losses)
    check_loss_entries(config.models, config.recipes, "--recipe", RECIPE_FORM)
    return [
        target_case(
            target,
            name,
            matrix_of(config.selection, keep_for(target, config.keep_fp32)),
            config.models_path,
            loss_for(target, config.losses),
            recipe_for(target, config.recipes),
        )
        for target, name in target_names(config.models).items()
    ]
