"""The dtype trail of a cell as data: where a wider dtype entered, where the cell failed, and
what the matmul and attention kernels computed in. No torch: reports read these."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from harness.schema.typed import as_mapping, as_tuple, mismatch, number_from


@dataclass(frozen=True)
class Site:
    """An op in the model: its name, where it ran, and the dtypes it received."""

    op: str
    #: Dotted module path from the outermost module on the stack (``layers.0.self_attn``);
    #: the root module's class name when the op ran in the root's own code.
    module: str | None = None
    #: ``file:line`` of the innermost frame in the case's or model's own code.
    location: str | None = None
    input_dtypes: tuple[str, ...] = ()
    #: ``bfloat16`` when the op ran with autocast on (to that dtype), else None.
    autocast: str | None = None

    def where(self) -> str:
        """``in layers.0 (model.py:12)``, or whichever of the two is known."""
        module = f"in {self.module}" if self.module else ""
        location = f"({self.location})" if self.location else ""
        return " ".join(p for p in (module, location) if p)

    def describe(self) -> str:
        inputs = f" [{runs_of(self.input_dtypes)}]" if self.input_dtypes else ""
        amp = f" under autocast({self.autocast})" if self.autocast else ""
        where = self.where()
        return f"{self.op}{inputs}{amp}" + (f" {where}" if where else "")


def runs_of(dtypes: tuple[str, ...]) -> str:
    """``float32, float32, float16`` -> ``2x float32, float16``."""
    runs: list[list[Any]] = []
    for dtype in dtypes:
        if runs and runs[-1][0] == dtype:
            runs[-1][1] += 1
        else:
            runs.append([dtype, 1])
    return ", ".join(f"{n}x {d}" if n > 1 else d for d, n in runs)


@dataclass(frozen=True)
class Promotion:
    """The first op whose output left the cell's low-precision dtype for a wider one."""

    site: Site
    output_dtype: str
    #: What carried the wider dtype in: ``parameter norm.weight``, ``explicit cast``, ...
    carrier: str

    def describe(self) -> str:
        where = self.site.where()
        return f"{self.output_dtype} enters via {self.carrier} at {self.site.op}" + (
            f" {where}" if where else ""
        )


@dataclass(frozen=True)
class BackwardNode:
    """An autograd node of a training step's backward (the one that raised, or the first to
    make a gradient that is not finite): its name (``MmBackward0``, a custom Function's
    ``FusedDenseFuncBackward``), the line of the case's or model's own code whose forward
    call made it (for a custom ``autograd.Function``, the line that calls ``.apply``), and
    the dtypes of the gradients it received."""

    node: str
    made_at: str | None = None
    grad_dtypes: tuple[str, ...] = ()

    def describe(self) -> str:
        """``MmBackward0, made in the forward at model.py:12, on gradients [float16]``."""
        made = f", made in the forward at {self.made_at}" if self.made_at else ""
        grads = f", on gradients [{runs_of(self.grad_dtypes)}]" if self.grad_dtypes else ""
        return f"{self.node}{made}{grads}"


@dataclass(frozen=True)
class Island:
    """Where matmul or attention kernels first computed wider than the cell's dtype, and the
    share of the cell's matmul and attention FLOPs computed wider in all (None: unknown)."""

    site: Site
    dtype: str
    share: float | None = None

    def describe(self) -> str:
        share = f"{self.share * 100:.2g}%" if self.share is not None else "an unknown share"
        where = self.site.where()
        return (
            f"{share} of the matmul and attention FLOPs in {self.dtype}, from {self.site.op}"
            + (f" {where}" if where else "")
        )


@dataclass(frozen=True)
class Drift:
    """What of a run computed wider than the cell's dtype (not stored: it becomes a flag,
    or a note and the trail's island)."""

    #: Kernel kind -> the wider dtypes it computed in.
    kinds: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: The share of the matmul and attention FLOPs computed wider (None: unknown).
    share: float | None = None
    #: Every wide island's values came back in the cell's dtype before the output.
    contained: bool = False
    island: Island | None = None


@dataclass(frozen=True)
class Trail:
    promotion: Promotion | None = None
    failure_site: Site | None = None
    #: Kernel kind (``matmul``, ``attention``) -> the dtypes its inputs had, in order seen.
    compute_dtypes: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: Where kernels computed wider than the cell's dtype, and their share of the FLOPs.
    island: Island | None = None
    #: For an error raised in a training step's backward: the autograd node it raised in,
    #: and where the forward made that node.
    backward_node: BackwardNode | None = None

    def describe(self) -> str | None:
        """``float32 enters via ... at aten::mul in norm (x.py:12), fails at ...``."""
        parts = []
        if self.promotion:
            parts.append(self.promotion.describe())
        failure = self.failure()
        if failure:
            parts.append(f"fails {'at ' if self.failure_site else ''}{failure}")
        return ", ".join(parts) or None

    def failure(self) -> str | None:
        """Where the cell failed: the op that refused (``aten::mm [float16, float32]
        (x.py:55)``) and, in a backward, the node it ran for (``in the backward of
        MmBackward0, made in the forward at x.py:12, on gradients [float16]``)."""
        parts = [self.failure_site.describe()] if self.failure_site else []
        if self.backward_node:
            parts.append(f"in the backward of {self.backward_node.describe()}")
        return " ".join(parts) or None

    def to_dict(self) -> dict[str, Any]:
        return {
            "promotion": dataclasses.asdict(self.promotion) if self.promotion else None,
            "failure_site": dataclasses.asdict(self.failure_site) if self.failure_site else None,
            "compute_dtypes": {k: list(v) for k, v in self.compute_dtypes.items()},
            "island": dataclasses.asdict(self.island) if self.island else None,
            "backward_node": (
                dataclasses.asdict(self.backward_node) if self.backward_node else None
            ),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trail | None:
        promotion, failure, compute = (
            data.get("promotion"),
            data.get("failure_site"),
            data.get("compute_dtypes"),
        )
        island, backward = data.get("island"), data.get("backward_node")
        if promotion is None and failure is None and not compute and not island and not backward:
            return None
        return cls(
            island=island_from(as_mapping(island, "island")) if island else None,
            backward_node=backward_from(as_mapping(backward, "backward_node"))
            if backward
            else None,
            promotion=promotion_from(as_mapping(promotion, "promotion")) if promotion else None,
            failure_site=site_from(as_mapping(failure, "failure_site")) if failure else None,
            compute_dtypes={
                k: as_tuple(v, f"compute_dtypes[{k!r}]")
                for k, v in as_mapping(compute or {}, "compute_dtypes").items()
            },
        )


def promotion_from(data: dict[str, Any]) -> Promotion:
    return Promotion(
        site=site_from(as_mapping(data["site"], "promotion.site")),
        output_dtype=data["output_dtype"],
        carrier=data["carrier"],
    )


def backward_from(data: dict[str, Any]) -> BackwardNode:
    return BackwardNode(
        node=data["node"],
        made_at=data.get("made_at"),
        grad_dtypes=as_tuple(data.get("grad_dtypes"), "backward_node.grad_dtypes"),
    )


def island_from(data: dict[str, Any]) -> Island:
    return Island(
        site=site_from(as_mapping(data["site"], "island.site")),
        dtype=data["dtype"],
        share=share_from(data.get("share")),
    )


def share_from(share: Any) -> float | None:
    """An island's share of the FLOPs: a number (a non-finite one as its string) or null
    (``TypeError`` or ``ValueError`` naming it for anything else, an integer too large for a
    float included)."""
    share = number_from(share)
    if share is None:
        return None
    if not isinstance(share, int | float) or isinstance(share, bool):
        raise TypeError(mismatch("island.share", float | None, share))
    try:
        return float(share)
    except OverflowError:
        raise ValueError(mismatch("island.share", "a number a float holds", share)) from None


def site_from(data: dict[str, Any]) -> Site:
    return Site(**{**data, "input_dtypes": as_tuple(data.get("input_dtypes"), "input_dtypes")})
