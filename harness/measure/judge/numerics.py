"""The tolerance rule: how a cell's output is judged against the float64 reference.

The rule, written down once (every record carries the numbers it used):

* ``reference`` is the case's reference fix evaluated in float64 on the CPU, same weights and
  inputs.
* ``rel_err(x) = max|x - reference| / max|reference|`` (a normalised max error).
* Two yardsticks, neither of which is the code under test:

  - **rounding**: the reference computation with its weights and inputs rounded to the
    cell's dtype (the parts a case keeps in float32 left as they are), evaluated in float64;
    where the cell's model holds its weights in the cell's dtype (modes ``half`` and
    ``half-autocast``, and the float32 control; not ``autocast``), every floating tensor a
    module returns rounded too, as such a model stores it, so the yardstick grows with depth
    as a healthy model's error does (see :mod:`harness.measure.judge.rounding`).
    It is what merely representing the data in that dtype costs, whatever the code does
    (PyTorch's own SDPA tests anchor on a low-precision reference against a float64 golden
    result in the same way). float32 data cannot be rounded to float32, so the float32
    control's rounding is simulated: every value moved by a random relative amount of at
    most float32's unit roundoff (TF32's where a GPU computes float32 matmuls in TF32),
    and its run is float32 arithmetic, every op's result moved so, times ``sqrt(K)`` for
    an op summing ``K`` terms (:mod:`harness.measure.judge.float32_arithmetic`).
  - **fix**: a different, trusted fix (the case's reference fix) run plainly in the cell's
    dtype on the cell's device: what an honest low-precision computation achieves there.
    A cell of the reference fix itself has no such yardstick: it would be judged against
    itself.

* ``tolerance = max(FIX_FACTOR * fix, eps(dtype))`` where the case has a different, trusted
  fix (the most independent yardstick: another code path) that is itself accurate in the
  dtype (within the rounding rule), else
  ``max(ROUNDING_FACTOR * rounding, eps(dtype))``; the record names the yardstick that
  decided it (``decided_by``) and its factor. A yardstick that is not finite (data that
  overflow when rounded) is not used.
* A cell **passes** when its output is finite, has the reference's shape and
  ``rel_err <= tolerance``; otherwise it is **inaccurate**.
* An output of several tensors (a tuple, dict or dataclass; a loss and its gradients) is
  judged leaf by leaf, each against its own reference and yardsticks; the cell passes when
  every leaf does, and its record shows the leaf furthest from passing.

``ROUNDING_FACTOR`` is calibrated on healthy and silently broken models side by side
(``benchmarks/bench_verdicts.py``, the table in ``docs/tolerance.md``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from harness.measure.precision.dtypes import dtype_name
from harness.measure.running.training import GRAD_PREFIX
from harness.schema.records import Numerics

#: How far beyond a trusted fix's own low-precision error a cell may go.
FIX_FACTOR = 3.0
#: How far beyond the error of rounding the data a cell may go: calibrated (see above;
#: healthy cells at most 5.9 times their rounding, a float32 control, and 3.84 in half
#: precision; the mildest costly bug 15.8 times; CPU, torch 2.13.0, three seeds).
ROUNDING_FACTOR = 10.0
DTYPE_FLOOR = {
    torch.float16: torch.finfo(torch.float16).eps,
    torch.bfloat16: torch.finfo(torch.bfloat16).eps,
    torch.float32: torch.finfo(torch.float32).eps,
    torch.float64: torch.finfo(torch.float64).eps,
}
RULE = (
    "rel_err <= max({fix_factor} * fix if a different trusted fix ran, else "
    "{rounding_factor} * rounding, eps({dtype}))"
)


@dataclass(frozen=True)
class Yardsticks:
    """The independent errors a leaf is judged against: a trusted fix's (None where the
    cell is that fix, or it failed) and rounding's (None where it could not be computed),
    with the name shown for each (``fix sdpa``, ``rounding to float16``)."""

    fix_rel_err: float | None = None
    rounding_rel_err: float | None = None
    fix_name: str = "fix"
    rounding_name: str = "rounding"


#: The dtypes widened to float64 by way of float32: exact, and torch's CPU conversion from
#: half to float64 takes several times longer.
HALF_DTYPES = (torch.float16, torch.bfloat16)


def as_float64_cpu(output: torch.Tensor) -> torch.Tensor:
    """``output`` in float64 on the CPU, dense (a sparse gradient compared value by value)."""
    tensor = output.detach()
    if tensor.dtype in HALF_DTYPES:
        tensor = tensor.to(device="cpu", dtype=torch.float32)
    return dense(tensor.to(device="cpu", dtype=torch.float64))


def dense(tensor: torch.Tensor) -> torch.Tensor:
    """A sparse tensor (``nn.Embedding(sparse=True)``'s gradient) as the dense tensor it
    stands for; any other as it is."""
    return tensor.to_dense() if tensor.is_sparse else tensor


def relative_error(
    output: torch.Tensor, reference: torch.Tensor, scale: float | None = None
) -> tuple[float, float]:
    """(max abs error, max abs error / max |reference|), both in float64; relative to
    ``scale`` instead where given (a gradient zero by construction, see
    :func:`vanishing_scales`)."""
    reference = dense(reference)
    diff = (as_float64_cpu(output) - reference).abs().max().item()
    scale = reference.abs().max().item() if scale is None else scale
    return diff, diff / scale if scale > 0 else diff


def deciding(dtype: torch.dtype, sticks: Yardsticks) -> tuple[float, str, float]:
    """(tolerance, the yardstick that set it, its factor): the most independent yardstick
    there is (a different, trusted fix; else the rounding), never below eps."""
    floor = (DTYPE_FLOOR[dtype], f"eps({dtype_name(dtype)})", 1.0)
    rounding = sticks.rounding_rel_err
    if rounding is not None and not math.isfinite(rounding):
        rounding = None
    if trusted(sticks.fix_rel_err, rounding, floor[0]):
        chosen = (FIX_FACTOR * sticks.fix_rel_err, sticks.fix_name, FIX_FACTOR)  # type: ignore[operator]
    elif rounding is not None:
        chosen = (ROUNDING_FACTOR * rounding, sticks.rounding_name, ROUNDING_FACTOR)
    else:
        return floor
    return max(chosen, floor, key=lambda c: c[0])


def trusted(fix_rel_err: float | None, rounding_rel_err: float | None, floor: float) -> bool:
    """A fix's error is a yardstick where it is finite and the fix itself is within the
    rounding factor of the rounding (or of eps, where the rounding costs less): a fix that
    loses precision in the dtype (HF's clamp of T5's hidden states, 4840 times the rounding
    in float16) would excuse any other."""
    if fix_rel_err is None or not math.isfinite(fix_rel_err):
        return False
    return fix_rel_err <= ROUNDING_FACTOR * max(rounding_rel_err or 0.0, floor)


def judge(
    output: torch.Tensor,
    reference: torch.Tensor,
    dtype: torch.dtype,
    sticks: Yardsticks,
    scale: float | None = None,
) -> Numerics:
    """Error figures of ``output`` and the tolerance it is held to (shape must match),
    relative to ``scale`` where given."""
    finite = bool(torch.isfinite(dense(output)).all().item())
    max_abs, rel = relative_error(output, reference, scale)
    tolerance, decided_by, factor = deciding(dtype, sticks)
    return Numerics(
        max_abs_err=max_abs,
        rel_err=rel,
        baseline_rel_err=sticks.fix_rel_err,
        tolerance=tolerance,
        tolerance_rule=RULE.format(
            fix_factor=FIX_FACTOR, rounding_factor=ROUNDING_FACTOR, dtype=dtype_name(dtype)
        ),
        finite=finite,
        rounding_rel_err=sticks.rounding_rel_err,
        decided_by=decided_by,
        factor=factor,
    )


def within_tolerance(numerics: Numerics) -> bool:
    return numerics.finite and numerics.rel_err <= numerics.tolerance


def judge_leaves(
    leaves: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    dtype: torch.dtype,
    fix_errs: dict[str, float],
    rounding_errs: dict[str, float],
    names: Yardsticks = Yardsticks(),
) -> dict[str, Numerics]:
    """:func:`judge` for each named leaf (same names and shapes as the reference), each
    against its own yardsticks (``names`` gives the yardsticks' names); a gradient zero by
    construction against the step's largest gradient (:func:`vanishing_scales`)."""
    vanishing = vanishing_scales(reference)
    if vanishing:
        fix_errs, rounding_errs = rescaled(fix_errs, rounding_errs, reference, vanishing)
    return {
        name: replace(
            judge(
                t,
                reference[name],
                dtype,
                replace(
                    names, fix_rel_err=fix_errs.get(name), rounding_rel_err=rounding_errs.get(name)
                ),
                vanishing.get(name),
            ),
            leaf=name,
        )
        for name, t in leaves.items()
    }


#: A gradient whose float64 values are all below this share of the step's largest gradient
#: is zero by construction (a key projection's bias: softmax ignores a shift shared by a
#: query's scores), its float64 value rounding noise of 1e-24 to 1e-10.
VANISHING = 1e-8


def leaf_scale(tensor: torch.Tensor) -> float:
    return float(dense(tensor).abs().max().item()) if tensor.numel() else 0.0


def vanishing_scales(reference: dict[str, torch.Tensor]) -> dict[str, float]:
    """The gradients of a training step that are zero by construction, each with the
    scale it is judged relative to: the step's largest gradient. Judged relative to its own
    float64 value, noise against noise (a float32 control 24 times its rounding), such a
    leaf is held instead to what rounding costs the step's gradients (see
    :func:`rescaled`). Measured: the zoo's key biases come to at most 0.0018 of that
    tolerance; fp16-no-grad-scaler's lost gradient, 1.4e-4 of the largest, is unaffected."""
    scales = {name: leaf_scale(t) for name, t in reference.items() if name.startswith(GRAD_PREFIX)}
    largest = max(scales.values(), default=0.0)
    return {name: largest for name, s in scales.items() if s < VANISHING * largest}


def rescaled(
    fix_errs: dict[str, float],
    rounding_errs: dict[str, float],
    reference: dict[str, torch.Tensor],
    vanishing: dict[str, float],
) -> tuple[dict[str, float], dict[str, float]]:
    """The yardsticks of vanishing gradients: no trusted fix's (its error is noise too),
    and the largest absolute error rounding costs any gradient of the step, relative to
    the step's largest gradient."""
    absolute = [
        err * leaf_scale(reference[name])
        for name, err in rounding_errs.items()
        if name.startswith(GRAD_PREFIX) and name not in vanishing and math.isfinite(err)
    ]
    fix = {name: err for name, err in fix_errs.items() if name not in vanishing}
    rounding = dict(rounding_errs)
    for name, scale in vanishing.items():
        if absolute:
            rounding[name] = max(absolute) / scale
        else:
            rounding.pop(name, None)
    return fix, rounding


def rounding_ratio(numerics: Numerics) -> float | None:
    """How many times the error of rounding the data a cell's error is (None if unknown)."""
    rounding = numerics.rounding_rel_err
    if rounding is None:
        return None
    return numerics.rel_err / rounding if rounding > 0 else float("inf")
