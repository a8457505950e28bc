"""Record the dtype the attention core actually ran in.

A fix can look right and still run everything in fp32; the record must show that. Inside
``RunContext.attention_core()`` a TorchDispatchMode watches the compute kernels (the
matmuls, convolutions and attention kernels of :mod:`harness.measure.tracing.kernels`, the ops the
dtype tracer counts) below autocast, so it sees the dtypes the kernels really received.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from harness.measure.tracing.dispatch_mode import LazyDynamoMode
from harness.measure.tracing.kernels import kernel_kind


@dataclass
class CoreObservation:
    """Dtypes of the floating-point tensors that the core kernels received, in order."""

    dtypes: list[str] = field(default_factory=list)

    def add(self, dtype: torch.dtype) -> None:
        name = str(dtype).removeprefix("torch.")
        if name not in self.dtypes:
            self.dtypes.append(name)

    def summary(self) -> tuple[str, ...]:
        """The dtypes seen, in order first seen (``("float16", "float32")`` when mixed;
        none where nothing was seen)."""
        return tuple(self.dtypes)


class _CoreDtypeRecorder(LazyDynamoMode):
    """The core's watch where no dtype tracer runs (a compiled or untraced run).

    It records what the tracer does not, by design: a kernel's positional floating-point
    arguments as it is called, so a kernel that raises counts too (without a trail, its
    inputs are the only word on what made it fail); the tracer counts every floating input
    (keyword ones, an attention mask, too) of a kernel that ran (``DtypeTracer.observe``).
    """

    def __init__(self, observation: CoreObservation) -> None:
        super().__init__()
        self.observation = observation

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        if kernel_kind(func) is not None:
            for arg in args:
                if isinstance(arg, torch.Tensor) and arg.is_floating_point():
                    self.observation.add(arg.dtype)
        return func(*args, **(kwargs or {}))


class CoreSink(Protocol):
    """A watch already running (the dtype tracer) that records the core's kernels into its
    ``core`` while one is set."""

    core: CoreObservation | None


#: The watches running now, innermost last: ``harness.measure.tracing.trail`` registers its
#: tracer here.
ACTIVE: list[CoreSink] = []


@contextmanager
def record_core_dtypes(observation: CoreObservation) -> Iterator[None]:
    """Record the dtypes core kernels receive while the block runs: through the dtype
    tracer when one is active (correctness runs), else with a dispatch mode of its own."""
    if not ACTIVE:
        with _CoreDtypeRecorder(observation):
            yield
        return
    sink = ACTIVE[-1]
    previous, sink.core = sink.core, observation
    try:
        yield
    finally:
        sink.core = previous
