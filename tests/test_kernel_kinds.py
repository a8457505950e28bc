"""The kinds of compute kernel are declared once (harness.schema.kernel_kinds) and the
tracer's classification answers in them."""

from __future__ import annotations

import torch

from harness.measure.tracing import kernels
from harness.schema.kernel_kinds import ATTENTION, KERNEL_KINDS, MATMUL


def test_the_kinds_are_matmul_and_attention() -> None:
    assert KERNEL_KINDS == (MATMUL, ATTENTION) == ("matmul", "attention")


def test_an_op_is_sorted_into_one_of_the_declared_kinds_or_none() -> None:
    aten = torch.ops.aten
    assert kernels.kernel_kind(aten.mm.default) == MATMUL
    assert kernels.kernel_kind(aten.convolution.default) == MATMUL
    assert kernels.kernel_kind(aten._scaled_dot_product_flash_attention_for_cpu.default) == (
        ATTENTION
    )
    assert kernels.kernel_kind(aten.add.Tensor) is None
