"""Lightning ``trainer.validate`` with ``bf16-mixed`` on the CPU: the encoder fast path fails.

Upstream: Lightning-AI/pytorch-lightning#19980. A LightningModule holding an
``nn.TransformerEncoder`` validates with ``Trainer(accelerator="cpu", precision="bf16-mixed")``:
Lightning puts the module in eval mode, runs ``validation_step`` under ``torch.inference_mode``
and the precision plugin's ``torch.autocast("cpu", dtype=torch.bfloat16)``, so the encoder
takes the native fast path that torch 2.4.1 does not autocast correctly on the CPU
(pytorch/pytorch#132613; the mechanism is in :mod:`cases.lightning_encoder_fastpath`).
``bf16-true`` (model and batch cast, no autocast) works. ``16-mixed`` on the CPU is turned
into ``bf16-mixed`` by Lightning's accelerator connector.

Lightning is imported lazily, so the module imports (and the harness skips the case) where it
is not installed. The Trainer's ``precision=`` applies the cell's precision (the case
``manages_precision``); the float64 reference is ``half-true`` with ``precision="64-true"``.
The sizes are the encoder case's: toy dimensions, and the #19980 reporter's encoder
(``d_model=512``, 16 heads, 6 layers; ``lightning_encoder_fastpath.UPSTREAM``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cases._lightning import AMP_PLUGIN, Precision, cpu_trainer, precision_flag, quiet_lightning
from cases.lightning_encoder_fastpath import (
    ENCODER_SIZES,
    MAT1_MAT2_DTYPES,
    encoder_workload,
    fastpath_disabled,
    record_self_attention,
)
from harness.measure.authoring.case import Case, FailureSignature, RunContext, Workload, fix
from harness.measure.authoring.registry import register


def validation_module(encoder: nn.TransformerEncoder, ctx: RunContext) -> Any:
    """A LightningModule whose ``validation_step`` runs the encoder and keeps its output."""
    import lightning.pytorch as pl

    class EncoderValidation(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder
            self.outputs: list[torch.Tensor] = []

        def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
            with record_self_attention(self.encoder, ctx):
                self.outputs.append(self.encoder(batch[0]))

    return EncoderValidation()


def validate_with_trainer(
    encoder: nn.TransformerEncoder, src: torch.Tensor, ctx: RunContext, precision: Precision
) -> torch.Tensor:
    """``trainer.validate`` over a one-batch DataLoader; returns the encoder's output."""

    module = validation_module(copy.deepcopy(encoder), ctx)
    loader = DataLoader(TensorDataset(src), batch_size=len(src))
    with quiet_lightning():
        trainer = cpu_trainer(precision)
        trainer.validate(module, dataloaders=loader, verbose=False)
    out: torch.Tensor = module.outputs[0]
    return out


@register
class LightningTrainerValidate(Case):
    name = "lightning-trainer-validate"
    title = "Lightning bf16-mixed validate on CPU: TransformerEncoder fast path mixes dtypes"
    upstream = AMP_PLUGIN
    failure = FailureSignature(error_type="RuntimeError", message=MAT1_MAT2_DTYPES)
    reference_fix = "half-true"
    devices = ("cpu",)
    dtypes = ("float16", "bfloat16")
    modes = ("autocast", "fp32")
    backends = ("sdpa",)
    requires = ("lightning",)
    manages_precision = True  # the Trainer's precision= casts and enters autocast
    sizes = ENCODER_SIZES

    def build(self, ctx: RunContext) -> Workload:
        return encoder_workload(ctx.dims)

    @fix(
        "none",
        rationale="Trainer(precision='bf16-mixed'/'16-mixed').validate: autocast + fast path",
        upstream="Lightning-AI/pytorch-lightning#19980",
    )
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        precision = precision_flag(ctx, true_precision=False)
        return validate_with_trainer(w.model, w.inputs["src"], ctx, precision)

    @fix(
        "disable-fastpath",
        rationale="torch.backends.mha.set_fastpath_enabled(False) around trainer.validate",
        upstream="pytorch/pytorch#132613 (workaround)",
    )
    def disable_fastpath(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        precision = precision_flag(ctx, true_precision=False)
        with fastpath_disabled():
            return validate_with_trainer(w.model, w.inputs["src"], ctx, precision)

    @fix(
        "half-true",
        rationale="Trainer(precision='bf16-true'/'16-true'): model and batch cast, no autocast",
        upstream="Lightning-AI/pytorch-lightning#19980 (bf16-true works)",
    )
    def half_true(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        precision = precision_flag(ctx, true_precision=True)
        return validate_with_trainer(w.model, w.inputs["src"], ctx, precision)
