"""Which cells of the matrix a run selects: the ``--case``, ``--dtype``, ... flags as data.

A selection holds, for each axis of the table (:data:`harness.schema.axes.AXES`), the
names asked for under the axis's plural (``dtypes``); an axis with none selects every value.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from harness.schema.axes import AXES, Axis, Cell


class SelectionError(ValueError):
    """A selection that names something that does not exist."""


class Declares(Protocol):
    """What validating a selection reads of a case: its name and the values it declares
    on each axis (``case.dtypes``, ``case.fixes``, ...)."""

    @property
    def name(self) -> str: ...


class Selection:
    """Which values of each axis to run; an axis given no values selects every value."""

    __slots__ = ("_axes", "_wanted")

    def __init__(self, **wanted: Iterable[str]) -> None:
        self._set(AXES, wanted)

    @classmethod
    def over(cls, axes: tuple[Axis, ...], wanted: Mapping[str, Iterable[str]]) -> Selection:
        """A selection over another axis table (a table with a new axis, say)."""
        selection = cls.__new__(cls)
        selection._set(axes, wanted)
        return selection

    def _set(self, axes: tuple[Axis, ...], wanted: Mapping[str, Iterable[str]]) -> None:
        plurals = {spec.plural for spec in axes}
        unknown = sorted(set(wanted) - plurals)
        if unknown:
            raise TypeError(
                f"Selection: no axis {', '.join(unknown)} (axes: {', '.join(sorted(plurals))})"
            )
        self._axes = axes
        self._wanted = {spec.plural: tuple(wanted.get(spec.plural, ())) for spec in axes}

    def __getitem__(self, plural: str) -> tuple[str, ...]:
        """The names asked for on the axis ``plural`` (``selection["dtypes"]``)."""
        return self._wanted[plural]

    def replace(self, **wanted: Iterable[str]) -> Selection:
        return Selection.over(self._axes, {**self._wanted, **wanted})

    def selects(self, cell: Cell) -> bool:
        wanted = self._wanted
        return all(
            spec.selects(wanted[spec.plural], getattr(cell, spec.name))
            for spec in self._axes
            if not spec.narrows or getattr(cell, spec.narrows)
        )

    def to_dict(self) -> dict[str, list[str]]:
        return {plural: list(names) for plural, names in self._wanted.items()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Sequence[str]]) -> Selection:
        return cls.over(AXES, data)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Selection) and (self._axes, self._wanted) == (
            other._axes,
            other._wanted,
        )

    def __hash__(self) -> int:
        return hash((self._axes, tuple(self._wanted.items())))

    def __repr__(self) -> str:
        asked = ", ".join(f"{k}={v!r}" for k, v in self._wanted.items() if v)
        return f"Selection({asked})"


def check_selection(cases: Sequence[Declares], selection: Selection) -> None:
    """Refuse names that match nothing, suggesting the closest valid ones. A name is known
    where a case declares it (the first axis, cases, among all cases; every other axis among
    the cases chosen), where it is the axis's control, or where any selection may use it."""
    first, *rest = selection._axes
    check_names(first, selection[first.plural], choices(first, cases))
    chosen = [c for c in cases if first.selects(selection[first.plural], c.name)]
    for spec in rest:
        check_names(spec, selection[spec.plural], choices(spec, chosen))


def choices(spec: Axis, cases: Sequence[Declares]) -> list[str]:
    declared: set[str] = set()
    for case in cases:
        values = getattr(case, spec.declared_as or spec.plural)
        declared.update((values,) if isinstance(values, str) else values)
    extra = [spec.control] if spec.control else []
    return [*spec.requests, *sorted(declared.union(extra) - set(spec.requests))]


def check_names(spec: Axis, wanted: Iterable[str], known: list[str]) -> None:
    for name in wanted:
        if name in known or spec.is_request(name):
            continue
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        listed = [*known, *(f"{kind}:N" for kind in spec.indexed)]
        raise SelectionError(
            f"unknown {spec.name} {name!r}{hint} (known: {', '.join(listed) or 'none'})"
        )
