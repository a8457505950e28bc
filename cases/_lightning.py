"""What the Lightning cases share: the Trainer ``precision=`` flag of a cell, and a quiet
Trainer (a module whose name starts with ``_`` registers no case)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch

from harness.measure.authoring.case import RunContext, Upstream

#: Where both Lightning cases' failure is: Lightning's mixed-precision plugin meeting the
#: encoder fast path (#19980), and torch's side of it.
AMP_PLUGIN = Upstream(
    repo="Lightning-AI/pytorch-lightning",
    file="src/lightning/pytorch/plugins/precision/amp.py",
    commit="2.3.3",
    issues=(
        "Lightning-AI/pytorch-lightning#19980",
        "pytorch/pytorch#132613",
        "pytorch/pytorch#135936",
    ),
    url="https://github.com/Lightning-AI/pytorch-lightning/issues/19980",
)
LIGHTNING_LOGGERS = ("lightning.pytorch", "lightning.fabric", "lightning")
Precision = Literal["64-true", "32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]


def precision_flag(ctx: RunContext, true_precision: bool) -> Precision:
    """The Trainer ``precision`` for a cell: ``*-mixed`` for autocast, ``*-true`` otherwise."""
    if ctx.is_reference:
        return "64-true"
    if ctx.mode == "fp32" or ctx.dtype == torch.float32:
        return "32-true"
    mixed = ctx.mode == "autocast" and not true_precision
    if ctx.dtype == torch.bfloat16:
        return "bf16-mixed" if mixed else "bf16-true"
    return "16-mixed" if mixed else "16-true"


@contextmanager
def quiet_lightning() -> Iterator[None]:
    """Silence Lightning's console info and warnings; restore the logger levels after."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loggers = [logging.getLogger(name) for name in LIGHTNING_LOGGERS]
        levels = [lg.level for lg in loggers]
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in zip(loggers, levels, strict=True):
                lg.setLevel(level)


def cpu_trainer(precision: Precision, **options: Any) -> Any:
    """A Lightning ``Trainer`` on one CPU with ``precision``, one epoch, and nothing beside
    the loop (no logger, checkpoints, progress bar or model summary); ``options`` add to
    it. Build it inside :func:`quiet_lightning`."""
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        max_epochs=1,
        **options,
    )
