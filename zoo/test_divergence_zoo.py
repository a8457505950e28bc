"""The divergence profile on a real model (issue 40): transformers' GPT-2, 12 layers, with
one layer's ``ln_1`` taking its variance by cancellation
(``zoo/divergence_models.py: gpt2_with_cancelling_norm``), is named at that norm, at the
first, middle and last layer, in float16 and bfloat16 ``half``; the healthy model passes
and is not profiled. Each cell run as ``check``'s worker runs it, on one thread.

Measured (CPU, torch 2.13.0, transformers 5.23.0): the healthy model reads 0.034 against
a tolerance of 0.34 in float16 and 0.163 against 1.63 in bfloat16; with the bug, every
cell's output is non-finite (the variance of activations around 100 cancels to a negative
number, whose square root is NaN), and the profile names the norm, non-finite from finite
inputs.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest

from harness.measure import execute
from harness.measure.authoring import registry
from harness.measure.authoring.model_case import Matrix, model_case
from harness.measure.judge import divergence
from harness.runner.matrix import expand
from harness.runner.progress import progress_label
from harness.schema.axes import FORWARD_STAGE, Cell
from harness.schema.records import CellRecord, NoteKind, Outcome
from zoo import divergence_models
from zoo.divergence_models import (
    GPT2_LAYERS,
    gpt2_injected,
    gpt2_with_cancelling_norm,
)

LAYERS = (0, GPT2_LAYERS // 2, GPT2_LAYERS - 1)
DTYPES = ("float16", "bfloat16")


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """A cell's thread count in ``check`` (one per worker), restored after."""
    with divergence_models.one_thread():
        yield


@functools.cache
def forward_cell(layer: int | None, dtype: str) -> Cell:
    """The forward cell of GPT-2 with the bug at ``layer`` (None: healthy) in ``dtype``,
    ``half``, its case made as ``check`` makes it (once)."""
    name = f"gpt2-12l-cancelling-ln-{'healthy' if layer is None else layer}-{dtype}"
    case = registry.find(name) or model_case(
        name,
        gpt2_with_cancelling_norm(layer),
        Matrix(dtypes=(dtype,), modes=("half",)),
        __file__,
    )
    (cell,) = [
        c
        for c in expand([case]).to_run
        if (c.stage, c.dtype, c.mode) == (FORWARD_STAGE, dtype, "half")
    ]
    return cell


def forward_record(layer: int | None, dtype: str) -> CellRecord:
    return execute.run_cell(forward_cell(layer, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layer", LAYERS)
def test_gpt2_with_one_cancelling_norm_is_named_at_that_norm(layer: int, dtype: str) -> None:
    record = forward_record(layer, dtype)
    found = record.divergence
    assert record.outcome is Outcome.INACCURATE, progress_label(record)
    assert found is not None, [n.text for n in record.notes]
    assert (found.module, found.kind) == (gpt2_injected(layer), "CancellingLayerNorm")
    assert found.location is not None and found.location.startswith("divergence_models.py:")
    assert found.non_finite or found.ratio > found.factor
    assert f"inaccurate: {found.describe()}" in progress_label(record)


@pytest.mark.parametrize("dtype", DTYPES)
def test_healthy_gpt2_passes_and_is_not_profiled(
    dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a cell that passes is profiled")

    monkeypatch.setattr(divergence, "profile", never)
    record = forward_record(None, dtype)
    assert record.outcome is Outcome.PASSES, progress_label(record)
    assert record.divergence is None and record.profile is None
    assert not [n for n in record.notes if n.kind is NoteKind.DIVERGENCE]
