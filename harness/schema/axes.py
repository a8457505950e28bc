"""The axes of the matrix and the values each may take: names only, no torch.

This module is the vocabulary shared by measuring and reporting (the report never imports
torch); :mod:`harness.measure.precision` turns these names into torch dtypes and applies the modes.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Low-precision dtypes under test, and the fp32 control (used only by mode ``fp32``).
DTYPES = ("float16", "bfloat16", "float32")
LOW_PRECISION_DTYPES = ("float16", "bfloat16")


@dataclass(frozen=True)
class Mode:
    """How the harness puts a cell's precision on a case's float32 model and inputs."""

    name: str
    #: Model (weights, floating buffers) and floating inputs cast to the cell dtype.
    casts_model: bool
    #: The fix runs inside ``torch.autocast(device, dtype)``.
    autocast: bool
    meaning: str


#: The precision modes, in the order reports show them. Each name says what it does:
#: ``autocast`` keeps fp32 weights, ``half`` casts them, ``half-autocast`` does both.
MODES: dict[str, Mode] = {
    mode.name: mode
    for mode in (
        Mode("autocast", False, True, "fp32 weights and inputs, run under torch.autocast(dtype)"),
        Mode(
            "half", True, False, "weights and inputs cast to the dtype (model.half()), no autocast"
        ),
        Mode(
            "half-autocast",
            True,
            True,
            "weights and inputs cast to the dtype, and run under torch.autocast(dtype)",
        ),
        Mode("fp32", False, False, "the control: weights and inputs in float32, no autocast"),
    )
}
MODE_NAMES = tuple(MODES)

#: The control of every case: its upstream code path (``none``) in float32.
CONTROL_MODE = "fp32"
CONTROL_DTYPE = "float32"
CONTROL_FIX = "none"

#: Attention backends a case may declare. ``flash-attn-contract`` enforces flash-attn's
#: documented input contract and computes with SDPA; it stands in where flash-attn is absent.
BACKENDS = ("sdpa", "eager", "flash-attn", "flash-attn-contract")

#: How the fix runs: ``eager``, or compiled whole with ``torch.compile(backend="inductor")``.
COMPILE_MODES = ("eager", "inductor")
EAGER = "eager"

#: Workload sizes, in the order reports show them: every case has ``small`` (toy
#: dimensions: CI and correctness); a case may declare ``upstream`` (the real model's
#: dimensions, from the config it cites). Speed is never compared across sizes.
SMALL_SIZE = "small"
UPSTREAM_SIZE = "upstream"
SIZES = (SMALL_SIZE, UPSTREAM_SIZE)
#: The size timed where a run has both, by device kind: on a GPU the real model's shapes
#: (toy shapes measure launch overhead), on a CPU the small one (half-precision matmuls at
#: model dimensions take minutes there, and a CPU's speed predicts no GPU's anyway).
TIMED_SIZE = {"cuda": UPSTREAM_SIZE, "cpu": SMALL_SIZE}
#: The sizes a run covers on each device kind unless ``--size`` says otherwise: correctness
#: at both sizes where that is affordable (a GPU), the small size alone on a CPU.
DEFAULT_SIZES = {"cuda": SIZES, "cpu": (SMALL_SIZE,)}

#: Device kinds a case may declare; ``cuda`` expands to every visible ``cuda:N``.
DEVICE_KINDS = ("cpu", "cuda")


def rank(order: tuple[str, ...], value: str) -> int:
    """Position of ``value`` in a preferred order; unknown values go last."""
    return order.index(value) if value in order else len(order)
