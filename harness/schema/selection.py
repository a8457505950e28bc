"""Which cells of the matrix a run keeps: the ``--case``, ``--dtype``, ... flags as data."""

from __future__ import annotations

from dataclasses import dataclass

from harness.schema.axes import Cell


class SelectionError(ValueError):
    """A selection that names something that does not exist."""


@dataclass(frozen=True)
class Selection:
    """Which values of each axis to keep; an empty tuple keeps every value."""

    cases: tuple[str, ...] = ()
    fixes: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    modes: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()
    compiles: tuple[str, ...] = ()
    #: Workload sizes; empty: each device's default sizes (``DEFAULT_SIZES``); ``all``: every
    #: size a case declares.
    sizes: tuple[str, ...] = ()

    def keeps(self, cell: Cell) -> bool:
        return all(
            not wanted or value in wanted
            for wanted, value in (
                (self.cases, cell.case),
                (self.fixes, cell.fix),
                (self.dtypes, cell.dtype),
                (self.modes, cell.mode),
                (self.backends, cell.backend),
                (self.compiles, cell.compile),
            )
        )
