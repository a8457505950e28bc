"""The float64 reference stays float64: a cast the code makes to a narrower dtype is not
taken in a float64 run.

A model that casts to a fixed dtype (``self.head(x.to(torch.bfloat16))``, a tied weight
``.half()``-ed in its forward, ``logits.float()``) computes that part in the fixed dtype in
every precision, the float64 reference and its rounding yardsticks included. Judged against
such a reference, the cast is in the cell and in what the cell is judged by alike, and the bug
passes in every cell: a head hard-coded to bfloat16 cost a float32 cell 2.1e4 times its
healthy twin's error and read ``passes``. So in a float64 run (the reference, its replays and
the rounding yardsticks, all on float64 data) a floating float64 tensor cast to a narrower
floating dtype is copied in float64 instead: the reference is the computation the code means,
carried out in float64, and a yardstick measures what representing the data costs, never the
cast under test. The cells themselves run the casts as written.

Every cast to a narrower floating dtype is taken to float64, whatever it casts from: HF's
rotary embedding multiplies ``inv_freq.float()`` (a float64 buffer in the reference) by
``position_ids.float()`` (integers), and the two must meet in one dtype. A tensor the code
makes in a fixed dtype (a factory with ``dtype=torch.float32``) stays what it was made, and
nothing is cast to an integer dtype.
"""

from __future__ import annotations

from typing import Any

import torch

from harness.measure.tracing.dispatch_mode import LazyDynamoMode

#: The floating dtypes a float64 run does not narrow to.
NARROWER = (torch.float32, torch.float16, torch.bfloat16)

aten = torch.ops.aten


class StaysFloat64(LazyDynamoMode):
    """While active, ``x.to(narrower)`` (``.float()``, ``.half()``, ``.to(torch.bfloat16)``,
    ``.type_as(y)``: all ``aten._to_copy``) gives a float64 copy; ``casts`` counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = dict(kwargs or {})
        if func is aten._to_copy.default and kwargs.get("dtype") in NARROWER:
            kwargs["dtype"] = torch.float64
            self.casts += 1
        return func(*args, **kwargs)
