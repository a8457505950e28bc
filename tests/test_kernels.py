"""The compute kernels are defined once: the dtype tracer and the attention core's own
recorder count the same ops."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from harness.measure.tracing.kernels import ATTENTION, MATMUL, kernel_kind
from harness.measure.tracing.observe import CoreObservation, record_core_dtypes
from harness.measure.tracing.python_watch import PythonWatch, watch_python
from harness.measure.tracing.tensor_marks import Names
from harness.measure.tracing.trail import DtypeTracer, tracing


def core_work() -> None:
    """A matmul in float64, a convolution in float32, elementwise work in bfloat16."""
    torch.mm(torch.ones(2, 2, dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64))
    F.conv1d(torch.ones(1, 1, 4), torch.ones(1, 1, 2))
    torch.ones(3, dtype=torch.bfloat16) * 2


def test_ops_are_classified_by_their_whole_name() -> None:
    aten = torch.ops.aten
    assert kernel_kind(aten.addmm.default) == MATMUL
    assert kernel_kind(aten.convolution.default) == MATMUL
    assert kernel_kind(aten._scaled_dot_product_flash_attention_for_cpu.default) == ATTENTION
    # names that merely contain a matmul's name are not matmuls
    assert kernel_kind(aten.addmm_.default) is None
    assert kernel_kind(aten.mul.Tensor) is None


def test_the_recorder_and_the_tracer_count_the_same_kernels() -> None:
    alone = CoreObservation()
    with record_core_dtypes(alone), torch.no_grad():
        core_work()
    traced = CoreObservation()
    watch = PythonWatch("cpu")
    tracer = DtypeTracer(torch.bfloat16, Names(), watch)
    with watch_python(watch), tracing(tracer), record_core_dtypes(traced), torch.no_grad():
        core_work()
    assert alone.dtypes == traced.dtypes == ["float64", "float32"]
