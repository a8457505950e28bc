"""Where a failing cell left float64 (a record's ``divergence``): the first module whose
error, measured where it meets float64's own inputs, went beyond what rounding costs it by
more than the cell's factor, or the first whose output went non-finite from finite inputs.

Made by :mod:`harness.measure.judge.divergence`; stored in a record as one JSON object under
``divergence`` (absent, or null, in a record of a cell that passed, was not profiled, or was
written before the profile existed: read as None). Beside it, under ``profile``, the series
the divergence was read from (:class:`Profile`: every module's ratio, in the order the pass
met them), for the report's picture of the ratio along the model's depth.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from harness.schema.typed import as_mapping, as_tuple, made, with_numbers

Direction = Literal["forward", "backward"]
DIRECTIONS: tuple[str, ...] = get_args(Direction)


@dataclass(frozen=True)
class Divergence:
    """The first module beyond its rounding: its dotted path in the model (``""`` for the
    model itself), its class, where its ``forward`` is defined (``file.py:LINE``, None
    where it has no Python source), the op inside it that did (None where unknown), its
    error over its rounding's (``ratio``: infinite for an output that went non-finite) and
    the ratio of the module measured just before it (None for the first), the factor it
    crossed, and the direction of the pass (``forward``, ``backward``)."""

    module: str
    kind: str
    location: str | None
    op: str | None
    ratio: float
    ratio_before: float | None
    factor: float
    direction: str = "forward"

    @property
    def non_finite(self) -> bool:
        return not math.isfinite(self.ratio)

    def describe(self) -> str:
        """``first beyond rounding at blocks.7.ffn (Mlp, toy.py:41), 140x (was 2.1x)``, or
        ``first non-finite at attn (Attention, toy.py:12) from finite inputs``."""
        where = ", ".join(p for p in (self.kind, self.location) if p)
        place = f"{self.module or 'the model'} ({where})"
        op = f", {self.op}" if self.op else ""
        back = " in backward" if self.direction == "backward" else ""
        if self.non_finite:
            return f"first non-finite{back} at {place}{op} from finite inputs"
        before = f" (was {self.ratio_before:.3g}x)" if self.ratio_before is not None else ""
        return f"first beyond rounding{back} at {place}{op}, {self.ratio:.3g}x{before}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Divergence:
        """A divergence from its JSON object (``TypeError`` or ``ValueError`` naming it)."""
        found = made(cls, with_numbers(cls, as_mapping(data, "divergence")), "divergence")
        if found.direction not in DIRECTIONS:
            raise ValueError(
                f"divergence.direction: {found.direction!r} is not one of {', '.join(DIRECTIONS)}"
            )
        return found


@dataclass(frozen=True)
class ModuleRatio:
    """One module's error over its rounding's, measured on float64's inputs (``module``: its
    dotted path, ``""`` for the model itself): infinite where its output went non-finite
    from finite inputs, NaN where it could not be measured (its inputs beyond the dtype's
    range)."""

    module: str
    ratio: float


@dataclass(frozen=True)
class Profile:
    """A profiled cell's series: the factor its ratios are held to, and each module's ratio
    in the order the modules returned in forward (``forward``) and, in a training step, in
    the order backward reached them (``backward``). Figures only: one number a module."""

    factor: float
    forward: tuple[ModuleRatio, ...] = ()
    backward: tuple[ModuleRatio, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """Its JSON object (a non-finite ratio as the record writes one: ``"Infinity"``,
        ``"NaN"``, once the record's ``finite_json`` has passed over it)."""
        return {
            "factor": self.factor,
            "forward": [dataclasses.asdict(m) for m in self.forward],
            "backward": [dataclasses.asdict(m) for m in self.backward],
        }

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        """A profile from its JSON object (``TypeError`` or ``ValueError`` naming it)."""
        found = with_numbers(cls, as_mapping(data, "profile"))
        return made(
            cls,
            dict(
                found,
                forward=series(found.get("forward"), "profile.forward"),
                backward=series(found.get("backward"), "profile.backward"),
            ),
            "profile",
        )


def series(data: Any, name: str) -> tuple[ModuleRatio, ...]:
    """A list of ``{"module", "ratio"}`` objects (null or absent: none)."""
    return tuple(
        made(
            ModuleRatio,
            with_numbers(ModuleRatio, as_mapping(item, f"{name}[{i}]")),
            f"{name}[{i}]",
        )
        for i, item in enumerate(as_tuple(data, name))
    )
