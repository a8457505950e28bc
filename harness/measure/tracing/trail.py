"""The dtype tracer: for every aten op of a correctness run, the dtypes it received and made.

It holds only what the trail needs (bounded memory): the first *promotion* (an op with a
low-precision input whose output is wider), what carried the wider dtype in (a parameter or
buffer by name, an explicit cast, a tensor created in float32, a model input), the op that
raised, and the dtypes the compute kernels (:mod:`harness.measure.tracing.kernels`) computed in.
The marks it leaves on tensors, the op families it tells apart and the names of a
workload's tensors are :mod:`harness.measure.tracing.tensor_marks`'.
Where an op ran comes from the Python stack at that moment: the module path (``self`` of
the module frames) and the innermost ``file:line`` of the case's or model's own code (in a
training step's backward, only inside a custom Function's backward: a built-in node's
backward has no line of the case's, and the trail names instead the node an error was
raised in and the forward line that made it, found by
:mod:`harness.measure.tracing.backward_sites`).

A TorchDispatchMode runs below autocast, and calls each op with autocast switched off
(PyTorch excludes the dispatch keys above Python while a mode handles an op). Fused native
ops that dispatch internally (``nn.TransformerEncoder``'s fast path) would then compute
differently under the tracer than without it. The tracer therefore follows the autocast
state that Python code set (a profile hook watches torch's autocast switches) and switches
autocast back on around those fused ops (``kernels.FUSED_LAYER_OPS``), so the traced run
computes exactly what the untraced run computes. Around no other op: an op autocast ran
with autocast off (the ops of a composite autocast handled, SDPA's math fallback among
them) would be cast below autograd, which recorded it with its uncast inputs, and its
backward would meet dtypes its forward never had (T5's attention under the tracer raised
in backward, untraced it trained).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from harness.measure.host import caches
from harness.measure.precision.dtypes import dtype_name
from harness.measure.tracing.backward_sites import (
    failed_node,
    in_backward,
    location_in_backward,
    raised_in_backward_code,
)
from harness.measure.tracing.dispatch_mode import LazyDynamoMode
from harness.measure.tracing.kernels import (
    ATTENTION,
    computed_inputs,
    is_fused_layer,
    kernel_flops,
    kernel_kind,
    op_name,
    short_name,
)
from harness.measure.tracing.observe import ACTIVE, CoreObservation
from harness.measure.tracing.python_watch import AUTOCAST_KEYS, PythonWatch
from harness.measure.tracing.source_sites import failure_from_traceback, module_path, user_location
from harness.measure.tracing.tensor_marks import (
    CAST_OPS,
    FROM_DATA_OPS,
    ISLAND_ATTR,
    KEPT_ATTR,
    LAYOUT_OPS,
    ORIGIN_ATTR,
    PROMOTION_ATTR,
    SCALING_OPS,
    UNDONE_ATTR,
    UPCAST_ATTR,
    IslandState,
    Names,
    floating_tensors,
    promotion_of,
    scales_one,
    widens,
)
from harness.schema.devices import CPU
from harness.schema.trail_records import Drift, Island, Promotion, Site, Trail


class DtypeTracer(LazyDynamoMode):
    """Watches every aten op of one run of a fix (see the module docstring)."""

    def __init__(
        self, low: torch.dtype, names: Names, python: PythonWatch, root: Any = None
    ) -> None:
        super().__init__()
        self.low = low
        self.names = names
        self.python = python
        #: The workload's model: module paths are named from it where it is on the stack.
        self.root = root if isinstance(root, nn.Module) else None
        self.promotion: Promotion | None = None
        self.failure: Site | None = None
        self.compute: dict[str, dict[str, None]] = {}
        #: Compute dtypes wider than ``low`` that did not come from kept (fp32) parts.
        self.drifted: dict[str, dict[str, None]] = {}
        self.failure_message: str | None = None
        self.failure_promotion: Promotion | None = None
        self.drift_promotion: Promotion | None = None
        self.core: CoreObservation | None = None
        #: Matmul and attention FLOPs: all of them, and those computed wider than ``low``.
        self.flops = 0
        self.wide_flops = 0
        #: A wide kernel whose FLOPs its shapes do not tell ran: no share can be given.
        self.wide_uncounted = False
        self.islands: list[IslandState] = []
        #: An explicit upcast autocast undid: (where the cast was, the kernel it fed).
        self.undone: tuple[str, Site] | None = None
        self.upcast_seen = False
        #: How deep the run is inside calls of torch's SDPA (see :class:`SdpaCalls`).
        self.inside_sdpa = 0

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        # the watch's profile hook has nothing to see in the tracer's own code: off here
        # (its calls would cost a hook call each, several times the op's own bookkeeping)
        hook = sys.getprofile()
        sys.setprofile(None)
        try:
            return self.dispatch(func, args, kwargs or {})
        finally:
            sys.setprofile(hook)

    def dispatch(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        inputs = floating_tensors(args) + (floating_tensors(kwargs) if kwargs else [])
        switched = self.autocast_switched_on() if is_fused_layer(func) else []
        try:
            out = func(*args, **kwargs)
        except Exception as error:
            self.failure = self.site(func, inputs)
            self.failure_message = str(error)
            self.failure_promotion = self.promotion_behind(func, inputs)
            raise
        finally:
            for key in switched:
                torch._C._dispatch_tls_set_dispatch_key_excluded(key, True)
        self.observe(func, inputs, floating_tensors(out) if out is not None else [])
        return out

    def autocast_switched_on(self) -> list[Any]:
        """Autocast back on for the op where Python code had it on (see module docstring);
        the keys switched, to switch off again after the op."""
        switched = []
        for device, on in self.python.enabled.items():
            key = AUTOCAST_KEYS[device]
            if on and torch._C._dispatch_tls_is_dispatch_key_excluded(key):
                torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
                switched.append(key)
        return switched

    def autocast_dtype(self, device_type: str) -> str | None:
        if not self.python.enabled.get(device_type, False):
            return None
        try:
            return dtype_name(torch.get_autocast_dtype(device_type))
        except (AttributeError, TypeError):  # torch < 2.4
            getter = torch.get_autocast_cpu_dtype if device_type == CPU else None
            return dtype_name(getter()) if getter else None

    def observe(self, func: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        outputs = self.results_of(outputs)
        if self.names.attributes:
            self.names.read.update(id(t) for t in inputs if id(t) in self.names.attributes)
        kind = kernel_kind(func)
        if self.core is not None and kind is not None:
            for t in inputs:
                self.core.add(t.dtype)
            kind = ATTENTION
        island = None
        if kind is not None:
            island = self.record_compute(func, kind, inputs, outputs)
        if self.islands:
            self.follow_islands(inputs, outputs, island)
        self.follow_casts(func, inputs, outputs)
        wide_out = [t for t in outputs if widens(t.dtype, self.low)]
        if wide_out:
            self.mark_wide(func, inputs, wide_out)
        promotion = self.promotion_through(func, inputs, wide_out)
        if promotion is not None:
            for t in outputs:
                if not isinstance(t, nn.Parameter):
                    setattr(t, PROMOTION_ATTR, promotion)

    def results_of(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """An op's results, without the statistics some ops return in float32 by design
        beside a result in the low dtype (SDPA's ``logsumexp``, a norm's mean and rstd):
        they are no promotion (seen in ViT and T5 under CPU SDPA)."""
        if len(outputs) > 1 and not widens(outputs[0].dtype, self.low):
            return [t for t in outputs if not widens(t.dtype, self.low)]
        return outputs

    def mark_wide(
        self, func: Any, inputs: list[torch.Tensor], wide_out: list[torch.Tensor]
    ) -> None:
        """Remember where each wide output's dtype came from, and whether it is a kept part."""
        origin = self.origin_of(func, inputs)
        wide_in = [t for t in inputs if widens(t.dtype, self.low)]
        kept = bool(wide_in) and all(self.is_kept(t) for t in wide_in)
        for t in wide_out:
            if not hasattr(t, ORIGIN_ATTR) and not isinstance(t, nn.Parameter):
                setattr(t, ORIGIN_ATTR, origin)
                setattr(t, KEPT_ATTR, kept)

    def promotion_through(
        self, func: Any, inputs: list[torch.Tensor], wide_out: list[torch.Tensor]
    ) -> Promotion | None:
        """The promotion this op's outputs descend from. An op that widens a low-precision
        input is a promotion; a cast back up of a tensor that descends from an earlier
        promotion (narrowed on the way) keeps that earlier one, the root cause."""
        inherited = promotion_of(inputs)
        widening = wide_out and any(t.dtype == self.low for t in inputs)
        if not widening:
            return inherited
        if inherited is not None and short_name(func) in CAST_OPS:
            return inherited
        promotion = Promotion(
            self.site(func, inputs), dtype_name(wide_out[0].dtype), self.origin_of(func, inputs)
        )
        if self.promotion is None:
            self.promotion = promotion
        return promotion

    def record_compute(
        self, func: Any, kind: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]
    ) -> int | None:
        """Note the dtypes and FLOPs of a matmul or attention kernel; the index of the new
        island where it computed wider than the cell's dtype (not from kept parts)."""
        device = inputs[0].device.type if inputs else "cpu"
        if is_fused_layer(func) and self.autocast_dtype(device) is not None:
            return None  # it autocasts inside: its inputs do not tell what it computes in
        flops = kernel_flops(func, inputs, outputs)
        self.flops += flops or 0
        inputs = computed_inputs(func, inputs)
        if self.undone is None:
            self.note_undone(func, inputs)
        seen = self.compute.setdefault(kind, {})
        for t in inputs:
            seen[dtype_name(t.dtype)] = None
        wide = [t for t in inputs if widens(t.dtype, self.low)]
        if not wide or any(self.is_kept(t) for t in wide) or self.torch_chose_the_dtype():
            return None
        for t in wide:
            self.drifted.setdefault(kind, {})[dtype_name(t.dtype)] = None
        if self.drift_promotion is None:
            self.drift_promotion = self.promotion_behind(func, inputs)
        self.wide_flops += flops or 0
        self.wide_uncounted |= flops is None
        self.islands.append(IslandState(self.site(func, inputs), dtype_name(wide[0].dtype)))
        return len(self.islands) - 1

    def given_low(self, qkv: tuple[Any, ...]) -> bool:
        """q, k and v are all in the cell's dtype, as SDPA computes them (autocast casts a
        float32 one to its dtype, where it is on)."""
        low = dtype_name(self.low)
        return all(isinstance(t, torch.Tensor) and self.as_computed(t) == low for t in qkv)

    def as_computed(self, tensor: torch.Tensor) -> str:
        autocast = self.autocast_dtype(tensor.device.type)
        return autocast if autocast and tensor.dtype == torch.float32 else dtype_name(tensor.dtype)

    def torch_chose_the_dtype(self) -> bool:
        """A wide kernel whose dtype no code of the case's or model's chose, so it is no
        drift (it is in the cell's ``compute_dtypes`` all the same): one inside torch's
        SDPA (its math fallback, taken where no fused kernel takes the call, a mask that
        needs a gradient among the reasons, computes half inputs in float32 by design and
        returns the call's dtype: T5's trainable position bias sends every training step
        there), or in the backward of a built-in autograd node, which computes in the dtypes
        its forward computed in (a wide forward was judged there, a kept part's backward
        included); a custom Function's backward is the model's own code, and judged."""
        if self.inside_sdpa:
            return True
        return in_backward() and location_in_backward(sys._getframe(2)) is None

    def follow_islands(
        self, inputs: list[torch.Tensor], outputs: list[torch.Tensor], new: int | None
    ) -> None:
        """Carry the island marks from an op's inputs to its wide outputs; an island whose
        values come back in the cell's dtype is narrowed, one that feeds another wide
        kernel goes on in that one."""
        found = {i for t in inputs if (i := getattr(t, ISLAND_ATTR, None)) is not None}
        if new is not None:
            for i in found:
                self.islands[i].continued = True
        mark = new if new is not None else min(found, default=None)
        if mark is None:
            return
        for t in outputs:
            if widens(t.dtype, self.low):
                if not isinstance(t, nn.Parameter):
                    setattr(t, ISLAND_ATTR, mark)
            elif t.dtype == self.low:
                for i in found:
                    self.islands[i].narrowed = True

    def follow_casts(
        self, func: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor]
    ) -> None:
        """Mark what the code cast up explicitly, and what autocast cast back down of it;
        carry the marks through layout ops (and the cast-down one through a scaling by a
        number, and torch's own casts) to the kernel they feed."""
        if not (inputs and outputs):
            return
        if short_name(func) in CAST_OPS:
            self.mark_cast(inputs[0], outputs[0])
            return
        if not self.upcast_seen:
            return
        name = short_name(func).split(".")[0]
        if name in LAYOUT_OPS:
            self.carry(UPCAST_ATTR, inputs, [t for t in outputs if widens(t.dtype, self.low)])
        if name in LAYOUT_OPS or (name in SCALING_OPS and scales_one(inputs)):
            self.carry(UNDONE_ATTR, inputs, outputs)

    def mark_cast(self, source: torch.Tensor, result: torch.Tensor) -> None:
        """A cast: an explicit one up from the cell's dtype marks an upcast; autocast's back
        down of an upcast marks it undone. A cast torch makes of an undone tensor keeps the
        mark: its values were rounded already, so casting them up again restores nothing
        (torch's SDPA math fallback computes half inputs in float32 from torch 2.5 on, after
        autocast cast them down at the call; on 2.4 it computes them in the half dtype, and
        the verdict must not depend on which)."""
        upcast = getattr(source, UPCAST_ATTR, None)
        undone = getattr(source, UNDONE_ATTR, None)
        if self.python.casting:
            if source.dtype == self.low and widens(result.dtype, self.low):
                setattr(result, UPCAST_ATTR, user_location(sys._getframe(2)) or "?")
                self.upcast_seen = True
        elif (
            upcast is not None
            and result.dtype == self.low
            and self.autocast_dtype(source.device.type) is not None
        ):
            setattr(result, UNDONE_ATTR, upcast)
        elif undone is not None:
            setattr(result, UNDONE_ATTR, undone)

    @staticmethod
    def carry(attr: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        """Mark ``outputs`` with the first ``attr`` mark among ``inputs``."""
        mark = next((m for t in inputs if (m := getattr(t, attr, None))), None)
        if mark is not None:
            for t in outputs:
                setattr(t, attr, mark)

    def note_undone(self, func: Any, inputs: list[torch.Tensor]) -> None:
        cast = next((u for t in inputs if (u := getattr(t, UNDONE_ATTR, None))), None)
        if cast is not None:
            self.undone = (cast, self.site(func, inputs))

    def promotion_behind(self, func: Any, inputs: list[torch.Tensor]) -> Promotion | None:
        """Where the wide inputs of an op (one that failed or drifted) got their dtype: their
        promotion, or, for a wide input straight from a parameter or a created tensor, this
        op itself with that carrier."""
        wide = [t for t in inputs if widens(t.dtype, self.low)]
        if not wide or not any(t.dtype == self.low for t in inputs):
            return promotion_of(wide)
        return promotion_of(wide) or Promotion(
            self.site(func, inputs), dtype_name(wide[0].dtype), self.origin_of(func, inputs)
        )

    def is_kept(self, tensor: torch.Tensor) -> bool:
        """A part the case keeps in fp32 (``keep_fp32``), or computed from such parts only."""
        return id(tensor) in self.names.kept or bool(getattr(tensor, KEPT_ATTR, False))

    def origin_of(self, func: Any, inputs: list[torch.Tensor]) -> str:
        """What carried the wider dtype into this op's output."""
        wide = [t for t in inputs if widens(t.dtype, self.low)]
        for t in wide:
            named = self.names.by_id.get(id(t))
            if named:
                return named
        for t in wide:
            inherited = getattr(t, ORIGIN_ATTR, None)
            if inherited:
                return str(inherited)
            if isinstance(t, nn.Parameter):
                return "a float32 parameter"
        name = short_name(func)
        made = user_location(sys._getframe(1))
        at = f" at {made}" if made else ""
        if name in FROM_DATA_OPS:
            return f"a {dtype_name(wide[0].dtype)} tensor made from Python data{at}"
        if not inputs:
            return f"a tensor created in float32 (aten::{name}){at}"
        if name in CAST_OPS:
            device = inputs[0].device.type
            if self.autocast_dtype(device) is not None:
                return (
                    "a cast to float32 (an explicit .float() / .to(), or autocast's fp32 policy)"
                )
            return "an explicit cast (.float() / .to())"
        return f"aten::{name}, which returned a wider dtype than its inputs"

    def site(self, func: Any, inputs: list[torch.Tensor]) -> Site:
        """The op with where it ran; in a backward, the case's own line only inside a custom
        Function's backward (the node's forward line is the trail's ``backward_node``)."""
        frame = sys._getframe(1)
        device = inputs[0].device.type if inputs else "cpu"
        return Site(
            op=op_name(func),
            module=module_path(frame, self.root),
            location=location_in_backward(frame) if in_backward() else user_location(frame),
            input_dtypes=tuple(dtype_name(t.dtype) for t in inputs),
            autocast=self.autocast_dtype(device),
        )

    def trail(self, error: BaseException | None) -> Trail:
        """The trail of the run; ``error`` is what the fix raised, if anything. Its promotion
        is the one behind the failure, else behind the drift, else the first one."""
        failure, behind_failure = self.failure_of(error)
        return Trail(
            promotion=behind_failure or self.drift_promotion or self.promotion,
            failure_site=failure,
            compute_dtypes={k: tuple(v) for k, v in self.compute.items()},
            backward_node=failed_node(error),
        )

    def failure_of(self, error: BaseException | None) -> tuple[Site | None, Promotion | None]:
        """The op that raised ``error`` (or where the case's code called what raised it), and
        the promotion behind its wide inputs."""
        if error is None:
            return None, None
        if self.failure is not None and self.failure_message == str(error):
            return self.failure, self.failure_promotion
        if failed_node(error) is not None and not raised_in_backward_code(error):
            return None, None  # a built-in node raised: the trail's backward node says where
        site, tensors = failure_from_traceback(error, self.root)
        return site, promotion_of([t for t in tensors if widens(t.dtype, self.low)])

    def drift(self, outputs: dict[str, torch.Tensor]) -> Drift:
        """What of the run computed wider than the cell's dtype (kept fp32 parts aside),
        how much of it, and whether every such island came back in the cell's dtype (none
        of ``outputs``, the fix's result, is still one of them)."""
        escaped = any(getattr(t, ISLAND_ATTR, None) is not None for t in outputs.values())
        ends = [i for i in self.islands if not i.continued]
        share = None if self.wide_uncounted or not self.flops else self.wide_flops / self.flops
        first = self.islands[0] if self.islands else None
        return Drift(
            kinds={k: tuple(v) for k, v in self.drifted.items()},
            share=share,
            contained=bool(ends) and not escaped and all(i.narrowed for i in ends),
            island=Island(first.site, first.dtype, share) if first else None,
        )

    def undone_upcast(self) -> str | None:
        """Where an explicit upcast was cast back down by autocast before a kernel."""
        if self.undone is None:
            return None
        cast, kernel = self.undone
        where = kernel.where()
        return (
            f"the explicit cast up at {cast} was cast back to {dtype_name(self.low)} by "
            f"autocast before {kernel.op}" + (f" {where}" if where else "")
        )


@contextmanager
def tracing(tracer: DtypeTracer) -> Iterator[DtypeTracer]:
    ACTIVE.append(tracer)
    try:
        with watching_sdpa(tracer), tracer:
            yield tracer
    finally:
        ACTIVE.remove(tracer)


@contextmanager
def watching_sdpa(tracer: DtypeTracer) -> Iterator[None]:
    """While it lasts, ``torch.nn.functional.scaled_dot_product_attention`` is a thin
    wrapper that tells the tracer when the run is inside a call given q, k and v in the
    cell's dtype (as autocast casts them, where it is on): what torch computes inside is
    its choice (see :meth:`DtypeTracer.torch_chose_the_dtype`); a call given wider inputs
    is the code's choice, and its kernels are judged. A wrapper, not a TorchFunctionMode,
    which would turn fused fast paths off; code that imported the function by name before
    calls it unwatched (its kernels judged as any)."""
    original = F.scaled_dot_product_attention

    @functools.wraps(original)
    def watched(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        inside = tracer.given_low((query, key, value))
        tracer.inside_sdpa += inside
        try:
            return original(query, key, value, *args, **kwargs)
        finally:
            tracer.inside_sdpa -= inside

    F.scaled_dot_product_attention = watched
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@caches.cache
def warm_up() -> None:
    """Trace one op once, so the first use's one-time work (the profile hook, the tracer's
    own imports and caches) is done in the worker before it forks its cells, not inside a
    cell's time limit. (Before the tracer's modes derived from ``LazyDynamoMode``, this
    also imported ``torch._dynamo``: 1 s and more.)"""
    watch = PythonWatch("cpu")
    with tracing(DtypeTracer(torch.float16, Names(), watch)):
        torch.zeros(1) + 1
