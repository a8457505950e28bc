"""What a cell's heavy compute ran in: the cell's dtype, or float32 where a fix left it?

Mixed precision exists to run the matmuls and attention in half precision. A fix that
passes by running them in float32 is a fallback: correct, but it gives up what the
precision mode was for. What a cell's kernels computed in is in its record: the dtype
trail's ``compute_dtypes`` (the matmul and attention kernels' input dtypes) and the
attention core's observed dtypes (``attn_dtypes``). No torch here: reports read this.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from harness.schema.records import CellRecord, Outcome

LOW_PRECISION = ("float16", "bfloat16")
WIDE = ("float32", "float64")


class ComputedIn(str, Enum):
    """How much of a cell's heavy compute ran in its low-precision dtype."""

    #: Every matmul and attention kernel ran in the cell's dtype.
    HALF = "half"
    #: Some ran in float32 (a softmax or a norm left wide, say), the rest in half.
    PARTLY = "partly fp32"
    #: Every one ran in float32: the fix passes by leaving half precision.
    FALLBACK = "fp32 fallback"


def kernel_dtypes(record: CellRecord) -> set[str]:
    """The dtypes the cell's matmul and attention kernels computed in: from the dtype trail,
    else from the attention core's observed dtypes (which count an additive mask's dtype
    too, so they are the second choice)."""
    if record.trail and record.trail.compute_dtypes:
        return {d for dtypes in record.trail.compute_dtypes.values() for d in dtypes}
    return set(record.attn_dtypes)


def computed_in(record: CellRecord) -> ComputedIn | None:
    """How a low-precision cell that ran computed; None where that is not known (no trail:
    ``--no-trace`` or a compiled cell) or does not apply (the float32 control, a cell that
    raised or was skipped)."""
    if record.cell.dtype not in LOW_PRECISION:  # the float32 control among them
        return None
    if record.outcome not in (Outcome.PASSES, Outcome.INACCURATE):
        return None
    dtypes = kernel_dtypes(record)
    low = record.cell.dtype in dtypes
    wide = any(d in WIDE for d in dtypes)
    if not dtypes or not (low or wide):
        return None
    if low and not wide:
        return ComputedIn.HALF
    return ComputedIn.PARTLY if low else ComputedIn.FALLBACK


def fix_computed_in(cells: Iterable[object]) -> ComputedIn | None:
    """A fix over its cells (each a ``ComputedIn``, or None or a missing value where not
    known): a fallback if any cell fell back, else partly if any cell ran partly in
    float32, else half; None when no cell says."""
    known = {c for c in cells if isinstance(c, ComputedIn)}
    for level in (ComputedIn.FALLBACK, ComputedIn.PARTLY, ComputedIn.HALF):
        if level in known:
            return level
    return None
