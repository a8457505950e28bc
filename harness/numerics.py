"""The tolerance rule: how a cell's output is judged against the float64 reference.

The rule, written down once (every record carries the numbers it used):

* ``reference`` is the case's reference fix evaluated in float64 on the CPU, same weights and
  inputs; ``baseline`` is the same fix run plainly in the cell's dtype (mode ``half``) on
  the cell's device, thread count and size: what an honest low-precision computation of the
  function achieves there.
* ``rel_err(x) = max|x - reference| / max|reference|`` (a normalised max error).
* ``tolerance = max(FUDGE * rel_err(baseline), floor(dtype))`` where ``floor`` is the
  dtype's machine epsilon. This follows PyTorch's own SDPA tests, which allow a fudge factor
  times the error of a low-precision reference against a float64 "golden" result.
* A cell **passes** when its output is finite, has the reference's shape and
  ``rel_err <= tolerance``; otherwise it is **inaccurate**.
* An output of several tensors (a tuple, dict or dataclass; a loss and its gradients) is
  judged leaf by leaf, each against its own reference and baseline; the cell passes when
  every leaf does, and its record shows the leaf furthest from passing.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from harness.precision import dtype_name
from harness.records import Numerics

FUDGE = 3.0
DTYPE_FLOOR = {
    torch.float16: torch.finfo(torch.float16).eps,
    torch.bfloat16: torch.finfo(torch.bfloat16).eps,
    torch.float32: torch.finfo(torch.float32).eps,
}
RULE = "rel_err <= max({fudge} * baseline_rel_err, eps({dtype}))"


def as_float64_cpu(output: torch.Tensor) -> torch.Tensor:
    return output.detach().to(device="cpu", dtype=torch.float64)


def relative_error(output: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max abs error / max |reference|), both in float64."""
    diff = (as_float64_cpu(output) - reference).abs().max().item()
    scale = reference.abs().max().item()
    return diff, diff / scale if scale > 0 else diff


def tolerance_for(dtype: torch.dtype, baseline_rel_err: float | None) -> float:
    floor = DTYPE_FLOOR[dtype]
    if baseline_rel_err is None:
        return floor
    return max(FUDGE * baseline_rel_err, floor)


def judge(
    output: torch.Tensor,
    reference: torch.Tensor,
    dtype: torch.dtype,
    baseline_rel_err: float | None,
) -> Numerics:
    """Error figures of ``output`` and the tolerance it is held to (shape must match)."""
    finite = bool(torch.isfinite(output).all().item())
    max_abs, rel = relative_error(output, reference)
    return Numerics(
        max_abs_err=max_abs,
        rel_err=rel,
        baseline_rel_err=baseline_rel_err,
        tolerance=tolerance_for(dtype, baseline_rel_err),
        tolerance_rule=RULE.format(fudge=FUDGE, dtype=dtype_name(dtype)),
        finite=finite,
    )


def within_tolerance(numerics: Numerics) -> bool:
    return numerics.finite and numerics.rel_err <= numerics.tolerance


def judge_leaves(
    leaves: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    dtype: torch.dtype,
    baseline_rel_errs: dict[str, float],
) -> dict[str, Numerics]:
    """:func:`judge` for each named leaf (same names and shapes as the reference)."""
    return {
        name: replace(judge(t, reference[name], dtype, baseline_rel_errs.get(name)), leaf=name)
        for name, t in leaves.items()
    }
