"""The pytest plugin: your model through the matrix, one test item per cell.

Installed with ampmatrix (the ``pytest11`` entry point ``ampmatrix``)::

    from harness import check_model

    @check_model(dtypes=("float16", "bfloat16"), modes=("autocast", "half"))
    def test_my_block():
        return MyBlock(64), {"x": torch.randn(2, 16, 64)}

The function is a factory (see :mod:`harness.measure.authoring.model_case`); pytest runs one
item per cell, ``test_my_block[float16-half]`` and so on, plus the float32 control. A cell passes
when the output is finite and within tolerance of the same model in float64, with no flag (a mode's
promise the model broke); otherwise it fails with what raised or drifted and where float32 entered.
``expect={"float16/half": "inaccurate"}`` marks a known, accepted failure (the
item is an xfail; it fails when the outcome changes). ``--ampmatrix-results DIR`` appends
every cell's record to the run folder ``DIR`` for ``python -m harness report DIR``.

Nothing here imports torch until a test asks for the matrix, so the plugin costs nothing in
projects that do not use it.
"""

from __future__ import annotations

import difflib
import functools
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from harness.measure.authoring.case import Case
    from harness.measure.authoring.model_case import Matrix
    from harness.schema.axes import Axis, Cell
    from harness.schema.records import CellRecord, FlagKind, Note

MARK = "__ampmatrix_model__"
CELL_ARG = "ampmatrix_cell"
#: What separates the axis values of an ``expect`` key (``"float16/half"``).
EXPECT_SEPARATOR = "/"
#: An ``expect`` label: an outcome, and the kinds of its flags in brackets, where it has any
#: (``passes[drift,no-autocast]``), as ``outcome_label`` writes one.
LABEL_FORM = re.compile(r"(?P<outcome>[^\[\]]*)(?:\[(?P<flags>[^\[\]]*)\])?")


@dataclass(frozen=True)
class ExpectedOutcome:
    """An ``expect`` label, read: the outcome a cell is accepted with and the kinds of the
    flags it has (in any order: a record lists them in the order they were found)."""

    outcome: str
    flags: frozenset[FlagKind] = frozenset()

    def accepts(self, record: CellRecord) -> bool:
        from harness.schema.records import base_label

        kinds = {flag.kind for flag in record.flags}
        return base_label(record) == self.outcome and kinds == self.flags


@dataclass(frozen=True)
class Expectation:
    """An entry of ``expect``, parsed: the axis values its key names, each with the model
    axes it is a value of, and the outcome label accepted where a cell has them all."""

    #: The key as written, for messages.
    key: str
    #: Each value the key names, and the axes it may be a value of (``eager``: the
    #: backend or the compile mode).
    values: tuple[tuple[str, tuple[Axis, ...]], ...]
    #: The label as written, for messages.
    label: str
    #: The label, read (``expected_outcome``).
    outcome: ExpectedOutcome

    def matches(self, cell: Cell) -> bool:
        """Whether the cell has every value of the key, on one of its axes (a device
        also by its kind: ``cuda`` matches ``cuda:1``)."""
        return all(
            any(value in axis.aliases(getattr(cell, axis.name)) for axis in axes)
            for value, axes in self.values
        )


def parse_expect(
    expect: Mapping[str, str], axes: Sequence[Axis] | None = None
) -> tuple[Expectation, ...]:
    """``expect`` read once, as ``check_model`` receives it: each key split into the values
    of the model axes (of ``axes``, the axis table, where given) it names. A key that is
    not text, has an empty part, or names a value of no model axis is a ``ModelCheckError``
    naming the key (at collection: the decorator runs as the test module is imported)."""
    from harness.measure.authoring.model_case import ModelCheckError
    from harness.schema.axes import AXES

    if not isinstance(expect, Mapping):  # a list or a bare label: no key to match a cell
        raise ModelCheckError(
            f"expect {expect!r}: a dict of axis values to an outcome label "
            "(e.g. {'float16/half': 'raises'})"
        )
    model_axes = tuple(a for a in (axes or AXES) if a.model_default is not None)
    parsed = []
    for key, label in expect.items():
        if not isinstance(key, str) or not isinstance(label, str):
            raise ModelCheckError(f"expect {key!r}: {label!r}: a key and a label are text")
        parts = key.split(EXPECT_SEPARATOR)  # the one place an expect key is split
        if not all(parts):
            raise ModelCheckError(
                f"expect key {key!r}: axis values joined by {EXPECT_SEPARATOR!r}, none empty "
                "(e.g. 'float16/half')"
            )
        values = tuple((part, axes_naming(key, part, model_axes)) for part in parts)
        parsed.append(Expectation(key, values, label, expected_outcome(key, label)))
    return tuple(parsed)


def model_check_outcomes() -> tuple[str, ...]:
    """The outcomes a model check's cell can have, as labels name them: every outcome's
    but those of a raised cell split by whether it reproduces a known failure, which a
    model you check does not have (its raised cells are ``raises``)."""
    from harness.schema.records import LABELS, RAISES_OTHER, REPRODUCES

    return tuple(label.text for label in LABELS if label.text not in (REPRODUCES, RAISES_OTHER))


def expected_outcome(key: str, label: str) -> ExpectedOutcome:
    """An ``expect`` label read against the outcomes a model check's cell can have and the
    kinds of flag; anything else is a ``ModelCheckError`` naming the key and the label,
    with the nearest valid label suggested (at collection, as the key's errors are)."""
    from harness.measure.authoring.model_case import ModelCheckError
    from harness.schema.records import RAISES_OTHER, REPRODUCES, FlagKind

    where = f"expect {key!r}: {label!r}"
    form = LABEL_FORM.fullmatch(label)
    outcome, flags = (form["outcome"], form["flags"]) if form else (label, None)
    if outcome in (REPRODUCES, RAISES_OTHER):
        raise ModelCheckError(
            f"{where} is never a model check's label: {outcome!r} says whether a cell "
            "reproduces its case's known failure, and a model you check has none (a cell "
            "that raises is 'raises')"
        )
    outcomes = model_check_outcomes()
    if form is None or outcome not in outcomes:
        raise ModelCheckError(
            f"{where}: no outcome {outcome!r}{nearest(outcome, outcomes)} (outcomes: "
            f"{', '.join(outcomes)}; a flagged cell's kinds follow in brackets, "
            "as in 'passes[drift]')"
        )
    if flags is None:
        return ExpectedOutcome(outcome)
    kinds = [kind.value for kind in FlagKind]
    for name in flags.split(","):
        if name not in kinds:
            raise ModelCheckError(
                f"{where}: no flag {name!r}{nearest(name, kinds)} (flags: {', '.join(kinds)}; "
                "several joined by ',')"
            )
    return ExpectedOutcome(outcome, frozenset(FlagKind(name) for name in flags.split(",")))


def nearest(name: str, known: Sequence[str]) -> str:
    """``; did you mean ...?`` with the valid name nearest ``name`` (where one is near: a
    slip of a letter or two), or nothing."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def axes_naming(key: str, value: str, axes: Sequence[Axis]) -> tuple[Axis, ...]:
    """The model axes ``value`` is a value of (an indexed one, ``cuda:1``, too); none is a
    ``ModelCheckError`` naming the key and the values each axis takes."""
    from harness.measure.authoring.model_case import ModelCheckError

    found = tuple(axis for axis in axes if is_value_of(axis, value))
    if not found:
        known = "; ".join(f"{axis.plural}: {', '.join(axis.vocabulary)}" for axis in axes)
        raise ModelCheckError(
            f"expect key {key!r}: {value!r} is no value of a model axis ({known})"
        )
    return found


def is_value_of(axis: Axis, name: str) -> bool:
    """``name`` is one of the axis's values, or one of its indexed values (``cuda:1``)."""
    return name in axis.vocabulary or (axis.is_request(name) and name not in axis.requests)


@dataclass(frozen=True)
class ModelTest:
    """A decorated factory, the matrix it asks for, and the failures it accepts."""

    factory: Callable[..., Any]
    matrix: Matrix
    expect: tuple[Expectation, ...] = ()
    #: The loss of a training step, where the test names one (``loss=``).
    loss: Callable[..., Any] | None = None
    #: The recipe of training steps and fits, where the test names one (``recipe=``).
    recipe: Any = None

    def case(self, name: str, source: str) -> Case:
        from harness.measure.authoring import registry
        from harness.measure.authoring.model_case import model_case

        found = registry.find(name)
        return found or model_case(
            name, self.factory, self.matrix, source, loss=self.loss, recipe=self.recipe
        )


def check_model(
    *,
    keep_fp32: tuple[str, ...] = (),
    expect: Mapping[str, str] | None = None,
    loss: Callable[..., Any] | None = None,
    recipe: Any = None,
    **axes: tuple[str, ...],
) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Turn a factory of ``(model, inputs)`` into one test per cell of the matrix asked for.

    The keywords are the axes a model check selects, by their plural (``devices``,
    ``dtypes``, ``modes``, ``backends``, ``compiles``); an axis left out takes its default
    (the CPU; float16 and bfloat16; autocast and half; SDPA; eager). ``devices`` may name
    ``cuda`` (every visible GPU; skipped where there is none); ``backends`` are passed to a
    factory that takes the cell's context (``ctx.backend``); ``expect`` maps ``"dtype/mode"``
    (any of those axes' values, joined by ``/``) to the outcome label accepted there, e.g.
    ``"raises"`` or ``"passes[drift]"`` (a key that names no such value is an error as the
    test module is collected). ``stages=("forward", "train")`` also takes one
    training step in each cell; its loss is ``loss(output)`` or ``loss(output, inputs)``
    where ``loss`` is given (it wins over a loss the model returns), else the model's own
    ``loss``, else the mean squared error against a fixed random target. ``recipe`` (a
    :class:`~harness.measure.authoring.recipes.Recipe`) is what those steps and a fit
    (``stages=("fit",)``) train with, else the default recipe.
    """
    from harness.measure.authoring.model_case import (  # torch is imported here, by a test module
        Matrix,
        check_loss_signature,
        check_loss_stages,
        check_recipe,
    )

    matrix = Matrix(keep_fp32=keep_fp32, **axes)
    expectations = parse_expect(expect or {})
    if loss is not None:
        name = getattr(loss, "__qualname__", repr(loss))
        check_loss_signature(loss, f"loss={name}")
        check_loss_stages(matrix["stages"], name)
    if recipe is not None:
        check_recipe(recipe, f"recipe={recipe!r}")
        check_loss_stages(matrix["stages"], repr(recipe), "recipe")

    def decorate(factory: Callable[..., Any]) -> Callable[..., None]:
        spec = ModelTest(factory, matrix, expectations, loss, recipe)

        def test(ampmatrix_cell: Any, request: pytest.FixtureRequest) -> None:
            run_model_cell(spec, ampmatrix_cell, session_state(request.config))

        functools.update_wrapper(test, factory)
        del test.__wrapped__  # type: ignore[attr-defined]  # pytest reads the signature: the cell, not the factory's
        setattr(test, MARK, spec)
        return test

    return decorate


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ampmatrix", "ampmatrix: models through the mixed-precision matrix")
    group.addoption(
        "--ampmatrix-results",
        metavar="DIR",
        type=Path,
        help="append every model cell's record to the run folder DIR (for harness report)",
    )


@dataclass
class SessionState:
    """What the plugin keeps for one pytest session, on its ``config.stash`` (two sessions
    in one process, as pytester runs them, keep theirs apart)."""

    #: The run folder every model cell's record is appended to (``--ampmatrix-results``).
    results: Path | None = None
    #: The command that ran the tests, recorded in a results folder's ``env.json``.
    command: tuple[str, ...] = ("pytest",)
    #: torch's global settings before any test module was imported (they cannot have
    #: changed before torch was): each model cell starts from them (``settle_torch``).
    torch_state: dict[str, Any] | None = None


SESSION_STATE = pytest.StashKey[SessionState]()


def session_state(config: pytest.Config) -> SessionState:
    """The session's state (a fresh one where the plugin was not configured, as when a
    decorated test is called by a session with the plugin disabled)."""
    return config.stash.setdefault(SESSION_STATE, SessionState())


def pytest_configure(config: pytest.Config) -> None:
    # a pytest-xdist worker's own arguments are not the user's: its controller's are
    worker_input: dict[str, Any] = getattr(config, "workerinput", {})
    argv = worker_input.get("mainargv") or ["pytest", *config.invocation_params.args]
    state = SessionState(
        results=config.getoption("ampmatrix_results", None),
        command=tuple(str(arg) for arg in argv),
    )
    config.stash[SESSION_STATE] = state
    remember_torch_state(state)


def pytest_collectstart(collector: pytest.Collector) -> None:
    """Before each test module is imported: torch's settings, where it is loaded by now."""
    remember_torch_state(session_state(collector.config))


def remember_torch_state(state: SessionState) -> None:
    """torch's global settings, the first time they can be read without importing torch
    (a plain test run must not load it): at configure, or before the first test module is
    imported once a conftest has loaded torch. A test module that is the first to import
    torch and then changes its settings at import is not told apart from torch's own."""
    if state.torch_state is None and "torch" in sys.modules:
        from harness.measure.host import torch_state

        state.torch_state = torch_state.snapshot()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    spec: ModelTest | None = getattr(metafunc.function, MARK, None)
    if spec is None:
        return
    from harness.measure.authoring.model_targets import case_name
    from harness.runner.matrix import expand
    from harness.schema.selection import Selection

    case = spec.case(case_name(metafunc.function.__name__), str(metafunc.definition.path))
    plan = expand([case], Selection(stages=case.stages))  # a fit only runs where asked for
    cells = [*plan.to_run, *(cell for cell, _ in plan.skipped)]
    reasons = dict(plan.skipped)
    params = [
        pytest.param(
            cell,
            id=cell_id(cell, cells),
            marks=[pytest.mark.skip(reason=reasons[cell])] if cell in reasons else [],
        )
        for cell in cells
    ]
    metafunc.parametrize(CELL_ARG, params)


def cell_id(cell: Cell, cells: Sequence[Cell]) -> str:
    """The axes that vary among the cells: ``float16-half``, ``cuda:0-bfloat16-autocast``."""
    from harness.schema.axes import axes_of

    names = [axis.name for axis in axes_of(type(cell))]
    varying = [name for name in names if len({id_part(c, name) for c in cells}) > 1]
    parts = (id_part(cell, name) for name in varying or ("dtype", "mode"))
    return "-".join(part for part in parts if part)


def id_part(cell: Cell, name: str) -> str:
    """A cell's value of an axis in its test id; a scaler only where it is not the mode's
    (``float16-autocast-train-none``: trained without the mode's GradScaler), so the ids of
    a model trained as its modes do are those written before the scaler was an axis."""
    if name == "scaler" and cell.scaler == cell.default_scaler:
        return ""
    return str(getattr(cell, name))


def run_model_cell(spec: ModelTest, cell: Cell, state: SessionState) -> None:
    """Run the cell, store its record where asked, and pass, xfail or fail the test."""
    from harness.measure import execute

    settled = settle_torch(state)
    record = execute.run_cell(cell)
    if settled is not None:
        record = replace(record, notes=(settled, *record.notes))
    if state.results is not None:
        keep_record(state.results, record, state.command)
    verdict(record, expectation(spec.expect, cell))


def settle_torch(state: SessionState) -> Note | None:
    """Put torch's global settings back as they were before the tests were imported (a
    test module or fixture that sets the default dtype, say, would change every model
    cell after it); a note says what had changed, or None."""
    from harness.measure.host import torch_state

    remember_torch_state(state)
    assert state.torch_state is not None  # a model cell has torch loaded
    return torch_state.settled_note(state.torch_state, "the test process's")


def expectation(expect: Sequence[Expectation], cell: Cell) -> Expectation | None:
    """The entry of ``expect`` for ``cell``: the first whose values the cell has, each on
    one of its axes."""
    return next((entry for entry in expect if entry.matches(cell)), None)


def expected_label(expect: Sequence[Expectation], cell: Cell) -> str | None:
    """The label ``expect`` accepts for ``cell``, as written."""
    entry = expectation(expect, cell)
    return entry.label if entry else None


def verdict(record: CellRecord, expected: Expectation | None) -> None:
    from harness.schema.records import Outcome, outcome_label

    label = outcome_label(record)
    plain_pass = record.outcome is Outcome.PASSES and not record.flags
    if expected is not None:
        if expected.outcome.accepts(record):
            pytest.xfail(f"accepted: {label}: {failure_message(record)}")
        pytest.fail(
            f"{record.cell.dtype}/{record.cell.mode}: expected {expected.label}, got {label}"
            + ("" if plain_pass else f": {failure_message(record)}")
            + ("; it passes now: drop it from expect" if plain_pass else ""),
            pytrace=False,
        )
    if not plain_pass:
        pytest.fail(f"{label}: {failure_message(record)}", pytrace=False)


def failure_message(record: CellRecord) -> str:
    """What went wrong, as a user can act on it: the error or the error figures, the flags,
    and where a wider dtype entered and which op refused it (the dtype trail)."""
    from harness.results.summary import failure_line

    parts = [f"{record.cell.device} {record.cell.dtype}/{record.cell.mode}"]
    line = failure_line(record)
    if line:
        parts.append(line)
    trail = record.trail
    if trail and trail.promotion and "enters" not in (line or ""):
        parts.append(f"float32 enters: {trail.promotion.describe()}")
    if record.out_dtypes:
        parts.append(f"output {'+'.join(record.out_dtypes)}")
    return "; ".join(parts)


def keep_record(run_dir: Path, record: CellRecord, command: Sequence[str]) -> None:
    """Append the record to the run folder, with the environment and the case's metadata
    (written by the first process that needs them; several pytest-xdist workers share it)."""
    from harness.measure.authoring import registry
    from harness.measure.host.environment import capture_environment
    from harness.results import storage

    run_dir.mkdir(parents=True, exist_ok=True)
    with storage.metadata_lock(run_dir):
        if not (run_dir / storage.ENV_FILE).exists():
            storage.write_env(run_dir, capture_environment(list(command)))
        cases = storage.read_cases(run_dir)
        if record.cell.case not in cases:
            case = registry.get(record.cell.case).metadata()
            storage.write_cases(run_dir, [*cases.values(), case])
    storage.append_record(run_dir, record)
