"""The kinds of compute kernel, as a cell's trail names them (its ``compute_dtypes`` keys).

The tracer (:mod:`harness.measure.tracing.kernels`) sorts an op into one of these kinds,
the drift flag and the judge read the trail by them, and the report shows them: the
vocabulary is declared here, once, where the read side can see it without torch.
"""

from __future__ import annotations

from typing import Final, Literal, get_args

#: A matmul (a convolution is one too), or an attention kernel.
KernelKind = Literal["matmul", "attention"]
KERNEL_KINDS: tuple[KernelKind, ...] = get_args(KernelKind)
MATMUL: Final = "matmul"
ATTENTION: Final = "attention"
