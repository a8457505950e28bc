"""The self-checks that make a precision that was never applied visible, as flags on the
record: an autocast cell in which no torch op ran with autocast on (``no-autocast``), a half
cell whose model holds floating tensors in another dtype after the fix (``not-half``), a
cell whose compute ran wider than its dtype (``drift``), and an upcast autocast undid
(``undone-upcast``).

Autocast is witnessed with a Python profile hook
(:func:`harness.measure.tracing.python_watch.watch_python`), which leaves torch's dispatch
untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from harness.measure.precision.casting import is_kept
from harness.measure.precision.dtypes import dtype_name
from harness.measure.precision.modes import Precision
from harness.measure.precision.outputs import output_leaves_or_none
from harness.schema.axes import CONTROL_MODE, MODES
from harness.schema.records import Flag, FlagKind, Note, NoteKind
from harness.schema.trail_records import Drift, Trail


def plain_tensor_attributes(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Tensors a module holds as plain attributes: ``module.to()`` does not move or cast them
    (a classic way for float32 to survive ``model.half()``)."""
    return [
        (f"{prefix}.{attr}" if prefix else attr, value)
        for prefix, module in model.named_modules()
        for attr, value in vars(module).items()
        if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
    ]


def named_tensors(model: Any) -> list[tuple[str, str, torch.Tensor]]:
    """Every tensor a model holds, as (kind, name, tensor): parameters, buffers and plain
    tensor attributes of a module, or the model itself when it is a tensor."""
    if isinstance(model, torch.Tensor):
        return [("tensor", "model", model)]
    if not isinstance(model, nn.Module):
        return []
    return [
        (kind, name, tensor)
        for kind, named in (
            ("parameter", model.named_parameters()),
            ("buffer", model.named_buffers()),
            (TENSOR_ATTRIBUTE, plain_tensor_attributes(model)),
        )
        for name, tensor in named
    ]


def leftover_precision(
    model: Any,
    dtype: torch.dtype,
    keep: tuple[str, ...],
    unused: Callable[[torch.Tensor], bool] = lambda t: False,
) -> list[str]:
    """Floating tensors of ``model`` (parameters, buffers, plain tensor attributes) that are
    not in ``dtype`` and were not declared kept: ``name (float32)``. A plain tensor
    attribute for which ``unused`` is true (no op of the run read it) is left out."""
    return [
        f"{name} ({dtype_name(t.dtype)})"
        for kind, name, t in named_tensors(model)
        if t.is_floating_point()
        and t.dtype != dtype
        and not is_kept(name, keep)
        and not (kind == TENSOR_ATTRIBUTE and unused(t))
    ]


TENSOR_ATTRIBUTE = "tensor attribute"


def not_half_flag(
    model: Any,
    precision: Precision,
    keep: tuple[str, ...],
    unused: Callable[[torch.Tensor], bool] = lambda t: False,
) -> Flag | None:
    """The flag of a half cell whose model is not (or no longer) in the cell dtype; a plain
    tensor attribute that no op of the run read (``unused``, from the dtype tracer: a
    stale copy such as transformers 4.46's ``rotary_emb.original_inv_freq``) costs nothing
    and is not counted."""
    if precision.managed_by_case or precision.is_reference or not precision.casts_model:
        return None
    wrong = leftover_precision(model, precision.dtype, keep, unused)
    if not wrong:
        return None
    shown = ", ".join(wrong[:3]) + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else "")
    return Flag(
        FlagKind.NOT_HALF, f"after the fix the model holds {shown}, not declared in keep_fp32"
    )


def no_autocast_flag(seen: bool, precision: Precision) -> Flag | None:
    """The flag of an autocast cell in which no torch call ran with autocast on (``seen`` is
    the profile hook's finding, see :mod:`harness.measure.trail`)."""
    if seen or precision.is_reference or not MODES[precision.mode].autocast:
        return None
    return Flag(
        FlagKind.NO_AUTOCAST, "the mode enters torch.autocast, but no torch op ran with it on"
    )


#: A float32 island within this share of a cell's matmul and attention FLOPs, whose values
#: come back in the cell's dtype, is noted, not flagged (a RoPE frequency product in
#: float32: well under 0.1% of a Llama's FLOPs; see the calibration table in
#: ``docs/tolerance.md``).
ISLAND_SHARE = 0.01


def drift_flag(
    drift: Drift, output: Any, precision: Precision, trail: Trail | None
) -> tuple[Flag | None, Note | None]:
    """The flag of a cell that ran but left its mode's promise (or None), and a note for a
    small float32 island that is not worth a flag. Leaving it is: matmul or attention
    kernels computing in a wider dtype than the cell's (kept fp32 parts aside) beyond
    :data:`ISLAND_SHARE` of the FLOPs or without casting back, or, in ``half`` (a casting
    mode without autocast), an output wider than the cell dtype. Under autocast an output's
    dtype is the op policy's (CUDA autocast runs ``layer_norm`` and ``softmax`` in float32),
    so only the kernels count there. The detail says how much and where it entered."""
    if precision.is_reference or precision.mode == CONTROL_MODE:
        return None, None
    wider = wider_outputs(output, precision)
    if drift.kinds and not wider and is_island(drift):
        island = drift.island.describe() if drift.island else ""
        text = f"{ISLAND_NOTE}: {island}, cast back to {dtype_name(precision.dtype)}"
        return None, Note(NoteKind.ISLAND, text)
    problems = [f"{kind} computed in {'+'.join(dtypes)}" for kind, dtypes in drift.kinds.items()]
    if problems and drift.share is not None:
        problems[-1] += f" ({drift.share:.1%} of the matmul and attention FLOPs)"
    problems += wider
    if not problems:
        return None, None
    started = trail.promotion.describe() if trail and trail.promotion else None
    share = drift.share if drift.kinds else None
    return Flag(
        FlagKind.DRIFT, "; ".join(problems) + (f" ({started})" if started else ""), share
    ), None


ISLAND_NOTE = "float32 island, not a drift"


def is_island(drift: Drift) -> bool:
    return drift.contained and drift.share is not None and drift.share <= ISLAND_SHARE


def wider_outputs(output: Any, precision: Precision) -> list[str]:
    """In ``half``, the output leaves wider than the cell dtype."""
    if not precision.casts_model or precision.uses_autocast or output is None:
        return []
    return [
        f"{'output' if name == 'output' else f'output {name}'} is {dtype_name(t.dtype)}"
        for name, t in output_leaves_or_none(output).items()
        if t.is_floating_point() and t.dtype.itemsize > precision.dtype.itemsize
    ]


def undone_upcast_flag(detail: str | None) -> Flag | None:
    """The flag of a cell whose code cast a tensor up on purpose, which autocast cast back
    down before a matmul or attention kernel: the upcast did nothing."""
    return Flag(FlagKind.UNDONE_UPCAST, detail) if detail else None
