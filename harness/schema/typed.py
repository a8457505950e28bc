"""Checking that data read back from a results file has the types its dataclass declares.

JSON read from disk may have been edited, cut or corrupted: ``rel_err`` as a string,
``torch_version: null``, a list where a name belongs. Readers build the dataclasses first,
then ``check_fields`` walks them against their annotations and names the first field whose
value has the wrong type, so the reader can report the file and line instead of failing
later, somewhere else, with a traceback.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import operator
import reprlib
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

Check = Callable[[Any, str], "Mismatch | None"]
FieldChecks = tuple[tuple[str, Check], ...]


class Mismatch(str):
    """A value that does not fit its field: the text a reader prints (``perf.rel_err:
    expected a number, got str 'x'``), and its parts as fields, ``field`` (the path from
    the top of what is read), ``expected`` and ``got``. Code that needs a part reads it
    here, never back from the text."""

    field: str
    expected: str
    got: str

    def __new__(cls, field: str, expected: str, got: str) -> Mismatch:
        text = super().__new__(cls, f"{field}: expected {expected}, got {got}")
        text.field, text.expected, text.got = field, expected, got
        return text

    def __reduce__(self) -> tuple[type[Mismatch], tuple[str, str, str]]:
        return Mismatch, (self.field, self.expected, self.got)

    def within(self, outer: str) -> Mismatch:
        """The same mismatch, its field named from ``outer`` (``cells[3].dtype``)."""
        return Mismatch(f"{outer}.{self.field}" if self.field else outer, self.expected, self.got)


class FieldError(Exception):
    """A value read back that does not fit its field, raised with its :class:`Mismatch`
    (``mismatch``): a ``FieldTypeError`` or a ``FieldValueError``, so the ``except
    TypeError`` and ``except ValueError`` of readers still catch it."""

    def __init__(self, mismatch: Mismatch) -> None:
        super().__init__(mismatch)
        self.mismatch = mismatch

    def within(self, outer: str) -> FieldError:
        """The same error, its field named from ``outer``."""
        return type(self)(self.mismatch.within(outer))


class FieldTypeError(FieldError, TypeError):
    """A value of the wrong type for its field."""


class FieldValueError(FieldError, ValueError):
    """A value of the field's type that is not one the field takes (an enum's)."""


#: Values whose fit to a field's type depends on their type alone (not on what they hold).
ATOMIC = (str, int, float, bool, type(None), enum.Enum)
#: At most this many combinations of field types are remembered per class.
MAX_KNOWN = 1024
#: The deepest a JSON value read from a results file may nest (an object or list counts
#: one level). ampmatrix writes five at most; the free-form facts of ``env.json`` (flags,
#: GPUs, timing settings) are printed as they are, and a value nested hundreds deep would
#: exceed Python's recursion limit where it is printed.
MAX_DEPTH = 32


@dataclass
class ClassChecks:
    """A dataclass's field checks, and what is known to fit of the values it was given."""

    checks: FieldChecks
    values: Callable[[Any], Any]
    #: Types of the fields' values (in field order) that fitted before -> the checks still
    #: to run for values of these types: those of the fields holding a container or a
    #: dataclass (whose items may not fit), in field order.
    known: dict[tuple[type, ...], FieldChecks] = field(default_factory=dict)


_CLASS_CHECKS: dict[type, ClassChecks] = {}


def check_fields(obj: Any, where: str = "") -> None:
    """Raise ``TypeError`` naming the first field of the dataclass ``obj`` (or of one nested
    in it) whose value does not have its declared type.

    Reading a results file checks hundreds of thousands of objects whose fields have the same
    few types: a field holding a plain value (a string, a number, None, an enum) fits or not
    by its type alone, so once the types of all fields have fitted, only the fields holding
    containers or dataclasses are checked again (same answer, same message)."""
    known = _class_checks(type(obj))
    kinds = tuple(map(type, known.values(obj)))
    remaining = known.known.get(kinds)
    if remaining is None:
        _check_each(obj, known.checks, where)
        if len(known.known) < MAX_KNOWN:
            known.known[kinds] = tuple(
                checked
                for checked, kind in zip(known.checks, kinds, strict=True)
                if not issubclass(kind, ATOMIC)
            )
        return
    _check_each(obj, remaining, where)


def _check_each(obj: Any, checks: FieldChecks, where: str) -> None:
    for name, check in checks:
        value = getattr(obj, name)
        # checked with no name first: a field's name is built only for a problem
        problem = check(value, "")
        if problem is not None:
            raise FieldTypeError(check(value, f"{where}{name}") or problem)


def _class_checks(cls: type) -> ClassChecks:
    """Each field's check, built once per class from its annotations (reading many records
    must stay cheap)."""
    if cls not in _CLASS_CHECKS:
        hints = typing.get_type_hints(cls)
        names = [f.name for f in dataclasses.fields(cls)]
        getter = operator.attrgetter(*names) if len(names) > 1 else _one_value(names)
        checks = tuple((name, compiled(hints[name])) for name in names)
        _CLASS_CHECKS[cls] = ClassChecks(checks, getter)
    return _CLASS_CHECKS[cls]


def _one_value(names: list[str]) -> Callable[[Any], tuple[Any, ...]]:
    """The values of a dataclass of one field or none, as a tuple (as ``attrgetter`` gives
    them for two fields or more)."""
    return lambda obj: tuple(getattr(obj, name) for name in names)


T = typing.TypeVar("T")


def built(kind: type[T], values: dict[str, Any]) -> T:
    """``kind(**values)`` for a frozen dataclass given a value for every field: its
    ``__dict__`` filled at once. A frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``, which made a fifth of reading a record; nothing else of it
    applies to a class this accepts (no ``__post_init__``, no slots, every field set by
    ``__init__``, as checked once per class)."""
    if kind not in _BUILDABLE:
        _BUILDABLE[kind] = _buildable(kind)
    if not _BUILDABLE[kind] or len(values) != len(_BUILDABLE[kind]):
        return kind(**values)
    made: T = object.__new__(kind)
    made.__dict__.update(values)
    return made


#: Per dataclass, its field names where ``built`` may fill its ``__dict__``, else ().
_BUILDABLE: dict[type, tuple[str, ...]] = {}


def _buildable(kind: type) -> tuple[str, ...]:
    params = getattr(kind, "__dataclass_params__", None)
    fields = dataclasses.fields(kind)
    plain = (
        params is not None
        and params.frozen
        and not hasattr(kind, "__post_init__")
        and not hasattr(kind, "__slots__")
        and all(f.init for f in fields)
    )
    return tuple(f.name for f in fields) if plain else ()


@cache
def compiled(hint: Any) -> Check:
    """A function telling why a value does not fit ``hint``, or None when it does (built
    once per hint: readers check every field of every record)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if all(_is_scalar(arg) for arg in args):
            return _scalar_check(hint, args)
        return _union_check(hint, [compiled(arg) for arg in args], type(None) in args)
    if origin in (list, tuple):
        return _sequence_check(hint, origin, compiled(args[0]))
    if origin is dict:
        return _mapping_check(hint, compiled(args[0]), compiled(args[1]))
    if dataclasses.is_dataclass(hint):
        return _dataclass_check(hint)
    return _scalar_check(hint)


def _union_check(hint: Any, checks: list[Check], optional: bool) -> Check:
    def check(value: Any, name: str) -> Mismatch | None:
        if value is None and optional:
            return None
        problems = []
        for c in checks:  # the first alternative that fits ends it
            problem = c(value, name)
            if problem is None:
                return None
            problems.append(problem)
        # a problem found deeper names the field inside
        return next((p for p in problems if p.field != name), None) or mismatch(name, hint, value)

    return check


def _sequence_check(hint: Any, kind: type, item: Check) -> Check:
    exact: frozenset[type] = getattr(item, "exact_types", frozenset())

    def check(value: Any, name: str) -> Mismatch | None:
        items: Sequence[Any] = value
        if not isinstance(items, kind):
            return mismatch(name, hint, value)
        if not items or (exact and set(map(type, items)) <= exact):  # one pass in C
            return None
        return next((p for i, v in enumerate(items) if (p := item(v, f"{name}[{i}]"))), None)

    return check


def _mapping_check(hint: Any, key: Check, item: Check) -> Check:
    def check(value: Any, name: str) -> Mismatch | None:
        if not isinstance(value, dict):
            return mismatch(name, hint, value)
        for k, v in value.items():
            problem = key(k, f"{name} key") or item(v, f"{name}[{k!r}]")
            if problem:
                return problem
        return None

    return check


def _dataclass_check(hint: Any) -> Check:
    def check(value: Any, name: str) -> Mismatch | None:
        if not isinstance(value, hint):
            return mismatch(name, hint, value)
        try:
            check_fields(value, f"{name}.")
        except FieldError as error:
            return error.mismatch
        return None

    return check


def _is_scalar(hint: Any) -> bool:
    return typing.get_origin(hint) is None and not dataclasses.is_dataclass(hint)


def _scalar_check(hint: Any, alternatives: tuple[Any, ...] | None = None) -> Check:
    """One ``isinstance`` for a plain type or a union of plain types (``str | None``)."""
    if hint is Any:
        return lambda value, name: None
    kinds = alternatives or (hint,)
    allowed = tuple({t for kind in kinds for t in ((int, float) if kind is float else (kind,))})
    no_bool = bool not in kinds and any(kind in (int, float) for kind in kinds)

    def check(value: Any, name: str) -> Mismatch | None:
        if isinstance(value, allowed) and not (no_bool and isinstance(value, bool)):
            return None
        return mismatch(name, hint, value)

    # the exact types that pass, for checking a long list in one pass (``bool`` is an exact
    # type of its own, so it is left out where it does not fit)
    check.exact_types = frozenset(t for t in allowed if not (no_bool and t is bool))  # type: ignore[attr-defined]
    return check


E = typing.TypeVar("E", bound=enum.Enum)
D = typing.TypeVar("D")


def member(kind: type[E], value: Any, name: str) -> E:
    """The member of the enum ``kind`` whose value is ``value``; a ``ValueError`` naming
    the field and the values it may take."""
    try:
        return kind(value)
    except (TypeError, ValueError, RecursionError):  # the enum's message holds its repr
        allowed = "one of " + ", ".join(str(m.value) for m in kind)
        raise FieldValueError(mismatch(name, allowed, value)) from None


def made(kind: type[D], value: Any, name: str) -> D:
    """The dataclass ``kind`` from a JSON object of its fields; a ``TypeError`` naming the
    field for anything else (a field missing or unknown)."""
    fields = as_mapping(value, name)
    try:
        return kind(**fields)
    except TypeError as error:
        raise TypeError(f"{name}: {error}") from None


def as_tuple(value: Any, name: str) -> tuple[Any, ...]:
    """A JSON list (or null, for none) as a tuple; anything else is a ``TypeError``."""
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise FieldTypeError(mismatch(name, "a list", value))
    return tuple(value)


def as_mapping(value: Any, name: str) -> dict[str, Any]:
    """A JSON object as a dict; anything else is a ``TypeError``."""
    if not isinstance(value, dict):
        raise FieldTypeError(mismatch(name, "an object", value))
    return value


def mismatch(name: str, hint: Any, value: Any) -> Mismatch:
    """What a reader says of ``value`` in the field ``name`` where ``hint`` (a type, or
    words: ``"a version number"``) was expected."""
    return Mismatch(name, describe(hint), f"{type(value).__name__} {shown(value)}")


def shallow_repr() -> reprlib.Repr:
    """A ``repr`` of a value's first three levels and first items only."""
    shallow = reprlib.Repr()  # set field by field: its keywords are Python 3.12's
    shallow.maxlevel, shallow.maxlist, shallow.maxdict = 3, 3, 3
    shallow.maxstring = shallow.maxother = 30
    return shallow


#: How a value too deep for ``repr`` is shown.
SHALLOW = shallow_repr()


def shown(value: Any) -> str:
    """``value``'s ``repr``, cut to 40 characters; one nested too deep for ``repr`` (a
    list in a list, thousands deep) shows its first levels."""
    try:
        text = repr(value)
    except RecursionError:
        text = SHALLOW.repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def deeper_than(value: Any, depth: int) -> bool:
    """Whether a JSON value nests objects and lists more than ``depth`` levels deep
    (walked without recursion: the value may be nested thousands deep)."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            if level == depth:
                return True
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, level + 1) for child in children)
    return False


#: A non-finite float as strict JSON holds it (protobuf's canonical JSON mapping): a string.
NON_FINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def finite_json(value: Any) -> Any:
    """``value`` (a JSON value) with each non-finite float written as ``"NaN"``,
    ``"Infinity"`` or ``"-Infinity"``, so ``json.dumps(..., allow_nan=False)`` writes it."""
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite_json(item) for item in value]
    return value


def number_from(value: Any) -> Any:
    """A number read back: ``"NaN"``, ``"Infinity"`` and ``"-Infinity"`` as floats, any other
    value as it is (its type is checked where it is used)."""
    if type(value) is str and value in NON_FINITE:
        return NON_FINITE[value]
    return value


@cache
def number_fields(kind: type) -> tuple[tuple[str, bool], ...]:
    """The fields of the dataclass ``kind`` that hold a float, each with whether it holds a
    list of them (``time_samples``) rather than one."""
    found = []
    for name, hint in typing.get_type_hints(kind).items():
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if hint is float or (origin in (typing.Union, types.UnionType) and float in args):
            found.append((name, False))
        elif origin in (list, tuple) and args and args[0] is float:
            found.append((name, True))
    return tuple(found)


def with_numbers(kind: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` (the JSON fields of the dataclass ``kind``) with the non-finite numbers
    of its float fields read back as floats: a new dict where one was, else ``values``."""
    changed: dict[str, Any] = {}
    for name, many in number_fields(kind):
        value = values.get(name)
        if many and isinstance(value, list) and str in set(map(type, value)):
            changed[name] = [number_from(item) for item in value]
        elif type(value) is str and value in NON_FINITE:
            changed[name] = NON_FINITE[value]
    return values | changed if changed else values


def describe(hint: Any) -> str:
    """``str | None`` -> ``str or null``; ``tuple[str, ...]`` -> ``a list of str``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin in (list, tuple):
        return f"a list of {describe(args[0])}"
    if origin is dict:
        return f"an object of {describe(args[1])}"
    if hint is type(None):
        return "null"
    if hint is float:
        return "a number"
    return str(getattr(hint, "__name__", hint))
