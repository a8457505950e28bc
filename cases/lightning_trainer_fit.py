"""Lightning ``trainer.fit`` with ``bf16-mixed`` on the CPU: the validation loop inside the fit
meets the encoder fast path, and ``bf16-true``, the fix that avoids it, stalls the fit.

Upstream: Lightning-AI/pytorch-lightning#19980, in the setting its reporter hit it: a
LightningModule holding an ``nn.TransformerEncoder`` trained with
``Trainer(accelerator="cpu", precision="bf16-mixed").fit(...)``. The training steps run
the encoder in train mode (no fast path); the validation loop the fit runs after each epoch
puts it in eval mode under ``torch.inference_mode`` and the precision plugin's autocast, and
the fast path that torch 2.4.1 does not autocast correctly on the CPU raises there
(pytorch/pytorch#132613; the mechanism is in :mod:`cases.lightning_encoder_fastpath`).
The issue's first suggestion, ``bf16-true``, avoids the fast path's autocast by casting the
model, and so trains bfloat16 weights with AdamW: at the learning rate used here (1e-4) its
updates are below half an ulp of most weights and the fit stalls (the pattern of
:mod:`cases.bf16_pure_weights`, here through Lightning's own loop). Turning the fast path
off keeps ``bf16-mixed``'s float32 master weights.

Each fix runs a real ``Trainer.fit``: one epoch of ``FIT_STEPS`` steps on the same batch
(the fixed data), AdamW at 1e-4, then the fit's validation loop (no sanity check: the
failure is the fit's own validation). What is judged is the training loss at every step
and the validation's output, against the same fit in ``64-true``; the trusted fix is
``disable-fastpath``. bfloat16 only: ``16-mixed`` on the CPU is run as ``bf16-mixed`` by
Lightning's accelerator connector (``lightning-trainer-validate`` shows that).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from cases._lightning import AMP_PLUGIN, Precision, cpu_trainer, precision_flag, quiet_lightning
from cases.lightning_encoder_fastpath import (
    ENCODER_SIZES,
    MAT1_MAT2_DTYPES,
    encoder_workload,
    fastpath_disabled,
)
from harness.measure.authoring.case import Case, FailureSignature, RunContext, Workload, fix
from harness.measure.authoring.registry import register

FIT_STEPS = 20
LEARNING_RATE = 1e-4
#: The seed of the regression target the encoder is trained towards.
TARGET_SEED = 1234


def mixed_flag(ctx: RunContext) -> Precision:
    """``bf16-mixed`` in every bfloat16 cell, whatever its mode (the baseline runs the
    trusted fix in mode ``half``, which for this fix still means mixed precision);
    ``64-true`` for the reference, ``32-true`` in float32 (the control, and the float32
    baseline)."""
    if ctx.is_reference or ctx.mode == "fp32" or ctx.dtype == torch.float32:
        return precision_flag(ctx, true_precision=False)
    return "bf16-mixed"


def fit_module(encoder: nn.TransformerEncoder) -> Any:
    """A LightningModule that trains the encoder towards a target (mean squared error) and
    keeps each step's loss and each validation's output."""
    import lightning.pytorch as pl

    class EncoderFit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder
            self.losses: list[torch.Tensor] = []
            self.validated: list[torch.Tensor] = []

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            src, target = batch
            out = self.encoder(src)
            loss = F.mse_loss(out, target.to(out.dtype))
            self.losses.append(loss.detach())
            return loss

        def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
            self.validated.append(self.encoder(batch[0]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LEARNING_RATE, weight_decay=0.0)

    return EncoderFit()


def fit_with_trainer(
    encoder: nn.TransformerEncoder, src: torch.Tensor, precision: Precision
) -> dict[str, torch.Tensor]:
    """``trainer.fit``: one epoch of ``FIT_STEPS`` steps on the same batch, then the fit's
    validation of it; the loss of each training step and the validation's output."""

    module = fit_module(copy.deepcopy(encoder))
    generator = torch.Generator().manual_seed(TARGET_SEED)
    target = torch.randn(src.shape, generator=generator, dtype=torch.float64).to(src.dtype)
    steps = TensorDataset(*(t.expand(FIT_STEPS, *t.shape).flatten(0, 1) for t in (src, target)))
    train_loader = DataLoader(steps, batch_size=len(src))
    validation_loader = DataLoader(TensorDataset(src, target), batch_size=len(src))
    with quiet_lightning():
        trainer = cpu_trainer(precision, num_sanity_val_steps=0, limit_val_batches=1)
        trainer.fit(module, train_dataloaders=train_loader, val_dataloaders=validation_loader)
    return {"train_loss": torch.stack(module.losses), "validation": module.validated[-1]}


@register
class LightningTrainerFit(Case):
    name = "lightning-trainer-fit"
    title = "Lightning bf16-mixed fit on CPU: validation inside the fit fails; bf16-true stalls"
    upstream = AMP_PLUGIN
    failure = FailureSignature(error_type="RuntimeError", message=MAT1_MAT2_DTYPES)
    reference_fix = "disable-fastpath"
    devices = ("cpu",)
    dtypes = ("bfloat16",)
    modes = ("autocast", "fp32")
    backends = ("sdpa",)
    requires = ("lightning",)
    manages_precision = True  # the Trainer's precision= casts and enters autocast
    needs_grad = True  # the fit's training steps
    sizes = ENCODER_SIZES[:1]  # twenty epochs at the upstream encoder's size take minutes

    def build(self, ctx: RunContext) -> Workload:
        return encoder_workload(ctx.dims)

    @fix(
        "none",
        rationale="Trainer(precision='bf16-mixed'/'16-mixed').fit: validation takes the fast path",
        upstream="Lightning-AI/pytorch-lightning#19980",
    )
    def none(self, w: Workload, ctx: RunContext) -> dict[str, torch.Tensor]:
        return fit_with_trainer(w.model, w.inputs["src"], mixed_flag(ctx))

    @fix(
        "disable-fastpath",
        rationale="torch.backends.mha.set_fastpath_enabled(False) around trainer.fit",
        upstream="pytorch/pytorch#132613 (workaround)",
    )
    def disable_fastpath(self, w: Workload, ctx: RunContext) -> dict[str, torch.Tensor]:
        with fastpath_disabled():
            return fit_with_trainer(w.model, w.inputs["src"], mixed_flag(ctx))

    @fix(
        "half-true",
        rationale="Trainer(precision='bf16-true'/'16-true').fit: model and batch cast, AdamW "
        "stepping the half weights",
        upstream="Lightning-AI/pytorch-lightning#19980 (bf16-true suggested)",
    )
    def half_true(self, w: Workload, ctx: RunContext) -> dict[str, torch.Tensor]:
        return fit_with_trainer(w.model, w.inputs["src"], precision_flag(ctx, True))
