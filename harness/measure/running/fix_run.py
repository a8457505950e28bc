"""Running a fix: build the workload, apply the cell's precision, call the fix once under the
dtype tracer, and check that the precision took and the run did what the mode promised.

What the harness guarantees a fix (the contract in ``docs/writing-a-case.md``): the RNG is
seeded before ``build``; the workload arrives with the cell's device and precision; the
fix runs under ``torch.no_grad()`` unless the case ``needs_grad``, and inside
``torch.autocast`` in the autocast modes.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from harness.measure.authoring.case import Case, RunContext, Workload
from harness.measure.precision.casting import cast_inputs, cast_model, split_kept
from harness.measure.precision.dtypes import dtype_of
from harness.measure.precision.flags import (
    drift_flag,
    no_autocast_flag,
    not_half_flag,
    undone_upcast_flag,
)
from harness.measure.precision.modes import Precision, autocast_region
from harness.measure.precision.outputs import output_leaves_or_none
from harness.measure.running import fitting, training
from harness.measure.running.errors import WorkloadFailed
from harness.measure.running.replay import Recorded, Recorder
from harness.measure.running.stays_float64 import StaysFloat64
from harness.measure.tracing.python_watch import PythonWatch, watch_python
from harness.measure.tracing.tensor_marks import Names
from harness.measure.tracing.trail import DtypeTracer, tracing
from harness.schema.axes import (
    EAGER,
    TRAINING_STAGES,
    Cell,
)
from harness.schema.records import Flag, Note
from harness.schema.stages import stage_of
from harness.schema.trail_records import Drift, Trail

#: Every cell of a case builds from the same seed, so all fixes and the reference see the
#: same weights and inputs.
SEED = 0
#: At most this many distinct warnings are recorded per cell, each cut to its first line.
MAX_WARNINGS = 5


def seed_everything(seed: int = SEED) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def context_for(case: Case, cell: Cell, observe: bool = True) -> RunContext:
    """What the fix sees of its cell (a ``float64`` cell is the reference)."""
    return RunContext(
        torch.device(cell.device),
        dtype_of(cell.dtype),
        cell.mode,
        cell.backend,
        observe=observe,
        managed_by_case=case.manages_precision,
        size=cell.size,
        dims=case.dims(cell.size),
        stage=cell.stage,
        scaler=cell_scaler(cell),
    )


def cell_scaler(cell: Cell) -> str | None:
    """The loss scaling a train or fit cell runs: its own (the scaler axis, expanded from
    its fix's recipe); None in a forward, which scales no loss."""
    return cell.scaler if cell.stage in TRAINING_STAGES else None


def apply_precision(workload: Workload, ctx: RunContext, keep: tuple[str, ...] = ()) -> Workload:
    """The cell's device and precision put on a float32 workload (see harness.measure.precision);
    the parts and inputs ``keep`` names stay float32 where the mode casts."""
    precision = ctx.precision
    if not precision.casts_model or precision.managed_by_case:
        keep = ()
    model_keep, input_keep = split_kept(keep, workload.inputs)
    device, dtype, wide = precision.device, precision.compute_dtype, precision.upcast_dtype
    return Workload(
        model=cast_model(workload.model, device, dtype, model_keep, wide),
        inputs=cast_inputs(workload.inputs, device, dtype, input_keep, wide),
    )


def prepared_workload(case: Case, ctx: RunContext, keep: tuple[str, ...]) -> Workload:
    """The case's workload, seeded and built, with the cell's precision applied."""
    seed_everything()
    try:
        return apply_precision(case.build(ctx), ctx, keep)
    except Exception as error:
        raise WorkloadFailed(error) from error


def call_fix(
    case: Case, fix: str, workload: Workload, ctx: RunContext, compiled: Any = None
) -> Any:
    """One call of a fix as the cell's stage runs it (:meth:`Stage.run
    <harness.schema.stages.Stage.run>`); through ``compiled`` (the fix under
    ``torch.compile``) in a compiled cell. In a ``forward`` cell it is one call with the
    gradient mode and autocast the cell asks for; in a ``train`` cell the forward of a
    training step (:func:`training.train_step`), which returns the step's
    :class:`~harness.measure.running.training.TrainedStep`; in a ``fit`` cell the forward of
    each step of a short fit (:func:`fitting.fit`)."""
    func = case.fixes[fix].func if compiled is None else compiled
    return stage_of(ctx.stage).run(FixCall(case, fix, workload, ctx, func))


@dataclass(frozen=True)
class FixCall:
    """What a stage's run does with one call of a fix (the stage chooses:
    :meth:`harness.schema.stages.Stage.run`): ``func`` is the fix, compiled or not."""

    case: Case
    fix: str
    workload: Workload
    ctx: RunContext
    func: Callable[..., Any]

    def call(self) -> Any:
        return self.func(self.case, self.workload, self.ctx)

    def loss_of(self, output: Any) -> Any:
        return self.case.loss(output, self.workload, self.ctx)

    def forward(self) -> Any:
        grad = torch.enable_grad() if self.case.needs_grad else torch.no_grad()
        with grad, autocast_region(self.ctx.precision):
            return self.call()

    def train_step(self) -> Any:
        return self.trained(training.train_step)

    def fit(self) -> Any:
        return self.trained(fitting.fit)

    def trained(self, train: Callable[..., Any]) -> Any:
        recipe = self.case.recipe_of(self.fix)
        model, precision = self.workload.model, self.ctx.precision
        return train(self.call, self.loss_of, model, precision, recipe, self.ctx.scaler)


def compiled_fix(case: Case, fix: str, compile_mode: str) -> Any:
    """The fix function under ``torch.compile`` for a compiled cell, else None. The whole
    fix is compiled: Dynamo traces into the model calls it makes."""
    if compile_mode == EAGER:
        return None
    return torch.compile(case.fixes[fix].func, backend=compile_mode)


@dataclass(frozen=True)
class FixRun:
    """A fix's checked run: its output (or error), its dtype trail, and what the mode
    promised but the run did not do."""

    output: Any = None
    error: BaseException | None = None
    flags: tuple[Flag, ...] = ()
    trail: Trail | None = None
    #: Warnings the fix raised (``Category: first line``), recorded on the cell.
    warnings: tuple[str, ...] = ()
    #: What the checks found worth saying but not worth a flag (a small float32 island).
    note: Note | None = None
    #: What the run drew at random and chose, in order (see
    #: :mod:`harness.measure.running.replay`); None where it was not recorded.
    recorded: Recorded | None = None
    #: The floating elements of the model's parameters and buffers as it ran (0 where the
    #: workload's model is not a module): what its float64 copy will take, at 8 bytes each.
    model_elements: int = 0


def run_fix_checked(
    case: Case,
    fix: str,
    ctx: RunContext,
    trace: bool = True,
    compile_mode: str = EAGER,
    workload: Workload | None = None,
    record: bool = True,
) -> FixRun:
    """Build, apply the precision, call the fix once under the dtype tracer; then check that
    the precision took and that the computation did what the mode promised. A compiled run is
    neither traced nor watched (both would see Dynamo's work, not the model's). ``workload``
    is one already prepared (the rounding yardstick's). ``record``: keep what the run drew
    and chose, where its stage has them replayed (a yardstick's run needs none)."""
    keep = case.kept_by(fix)
    ready = prepared_workload(case, ctx, keep) if workload is None else workload
    compiled = compiled_fix(case, fix, compile_mode)
    watch = PythonWatch(ctx.device.type)
    # the tracer needs the watch's autocast state; the no-autocast check needs its finding
    watched = compiled is None and (trace or ctx.precision.uses_autocast)
    tracer = None
    if trace and compiled is None:
        names = Names.of_workload(ready.model, ready.inputs, keep)
        tracer = DtypeTracer(ctx.dtype, names, watch, root=ready.model)
    recorder = choice_recorder(ctx, compiled, tracer) if record else None
    with draws_as_eager(compiled):
        output, error, texts = watched_call(
            lambda: call_in_precision(case, fix, ready, ctx, compiled),
            watch if watched else None,
            tracer,
            recorder,
        )
    output, forward_output, step_note = step_parts(output)
    trail, drifted, island_note = traced_findings(tracer, forward_output, error, ctx.precision)
    found = (
        no_autocast_flag(watch.seen, ctx.precision) if watched else None,
        not_half_flag(
            ready.model, ctx.precision, keep, tracer.names.unused if tracer else no_tensor
        ),
        drifted,
        undone_upcast_flag(tracer.undone_upcast() if tracer is not None else None),
    )
    note = step_note or island_note
    recorded = recorder.recorded.on_cpu() if recorder is not None else None
    if compiled is not None and record:
        recorded = eager_twin_draws(case, fix, ctx, keep)
    elements = floating_elements(ready.model)
    return FixRun(
        output, error, tuple(f for f in found if f), trail, texts, note, recorded, elements
    )


def floating_elements(model: Any) -> int:
    """The elements of a module's floating parameters and buffers; 0 for anything else."""
    if not isinstance(model, nn.Module):
        return 0
    tensors = (*model.parameters(), *model.buffers())
    return sum(t.numel() for t in tensors if t.is_floating_point())


def draws_as_eager(compiled: Any) -> AbstractContextManager[Any]:
    """Around a compiled run: Inductor draws its random numbers as eager torch does (its
    ``fallback_random``), so the draws an eager run of the same cell records are the
    compiled run's (:func:`eager_twin_draws`) and float64 can be taken along them; the
    arithmetic Inductor compiles is unchanged. Nothing around an eager run."""
    return inductor_fallback_random() if compiled is not None else nullcontext()


@contextmanager
def inductor_fallback_random() -> Iterator[None]:
    import torch._inductor.config as inductor_config  # only a compiled cell pays its import

    with inductor_config.patch(fallback_random=True):
        yield


def eager_twin_draws(case: Case, fix: str, ctx: RunContext, keep: tuple[str, ...]) -> Recorded:
    """What a compiled cell drew, recorded from the same cell run eagerly: built from the
    same seed, it draws what the compiled run drew under :func:`draws_as_eager` (a
    dispatch mode around a compiled call would make Dynamo run it eagerly). Its draws and
    the outcomes made on them are kept; its kinks and picks are eager arithmetic's, not the
    compiled run's, and are not."""
    recorder = Recorder(kinks=False, reference=False, picks=False)
    twin = prepared_workload(case, ctx, keep)
    watched_call(lambda: call_in_precision(case, fix, twin, ctx), None, None, recorder)
    return recorder.recorded.on_cpu()


def choice_recorder(ctx: RunContext, compiled: Any, tracer: DtypeTracer | None) -> Recorder | None:
    """What keeps a run's random draws and discrete choices (what the cell's stage replays:
    its ``replays_kinks`` and ``replays_picks``; a fit's in every step), to judge it against
    float64 taken along them (see :mod:`harness.measure.running.replay`); None for a
    compiled run (Inductor draws and chooses in its own kernels) and for a stage run as
    inference under autocast with no tracer, which alone switches autocast back on around
    the fused layer ops a dispatch mode runs without it (see
    :mod:`harness.measure.tracing.trail`; a stage that trains runs none: they are inference
    paths)."""
    if compiled is not None:
        return None
    stage = stage_of(ctx.stage)
    if stage.inference and ctx.precision.uses_autocast and tracer is None:
        return None
    return Recorder.at(ctx.stage, reference=ctx.precision.is_reference)


def step_parts(output: Any) -> tuple[Any, Any, Note | None]:
    """What is judged (a training step's loss and gradients, or the output), what the mode's
    checks look at (the forward output), and the step's note, if any.

    Read from what the run returned, not asked of the stage: a stage's run
    (:meth:`Stage.run <harness.schema.stages.Stage.run>`) chooses the call, and the call's
    result says what it is (a :class:`~harness.measure.running.training.TrainedStep`, a
    :class:`~harness.measure.running.fitting.FitRun`, else a forward's output), so a stage
    of one's own that calls ``train_step`` or ``fit`` is judged as they are with nothing
    more to declare, and a stage attribute naming the result would say it a second time."""
    if isinstance(output, training.TrainedStep):
        return output.leaves, output.forward_output, output.note
    if isinstance(output, fitting.FitRun):
        return output, output.forward_output, output.note
    return output, output, None


def judged_output(output: Any) -> Any:
    """What of a run's output is compared leaf by leaf: a fit's loss curve, else the output
    (read from the result, as :func:`step_parts` says why)."""
    return output.leaves if isinstance(output, fitting.FitRun) else output


def call_in_precision(
    case: Case, fix: str, workload: Workload, ctx: RunContext, compiled: Any = None
) -> Any:
    """:func:`call_fix`, in a float64 run (the reference and its yardsticks) with the casts
    the code makes to narrower dtypes kept float64 (see
    :mod:`harness.measure.running.stays_float64`)."""
    stays = StaysFloat64() if ctx.precision.is_reference else nullcontext()
    with stays:
        return call_fix(case, fix, workload, ctx, compiled)


def watched_call(
    call: Callable[[], Any],
    watch: PythonWatch | None,
    tracer: DtypeTracer | None,
    recorder: Recorder | None = None,
) -> tuple[Any, BaseException | None, tuple[str, ...]]:
    """``call()`` under the watch, the tracer and the choice recorder where given: its
    output, the exception it raised (every failure of the code under test is a result, not
    an error here) and the warnings it raised."""
    output, error = None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with (
                watch_python(watch) if watch is not None else nullcontext(),
                tracing(tracer) if tracer is not None else nullcontext(),
                recorder if recorder is not None else nullcontext(),
            ):
                output = call()
        except Exception as raised:
            error = raised
    return output, error, warning_texts(caught)


def traced_findings(
    tracer: DtypeTracer | None, output: Any, error: BaseException | None, precision: Precision
) -> tuple[Trail | None, Flag | None, Note | None]:
    """The run's dtype trail (with the float32 island it left, if any), and the drift flag
    and note of a run that did not raise."""
    trail = tracer.trail(error) if tracer is not None else None
    drift = tracer.drift(output_leaves_or_none(output)) if tracer is not None else Drift()
    if trail is not None and drift.island is not None:
        trail = replace(trail, island=drift.island)
    if error:
        return trail, None, None
    drifted, island_note = drift_flag(drift, output, precision, trail)
    return trail, drifted, island_note


def no_tensor(tensor: torch.Tensor) -> bool:
    """Without a tracer nothing is known unused."""
    return False


def warning_texts(caught: list[warnings.WarningMessage]) -> tuple[str, ...]:
    """The distinct warnings a fix raised, ``Category: first line``, in order."""
    texts = (
        f"{w.category.__name__}: {str(w.message).strip().splitlines()[0][:300]}"
        for w in caught
        if str(w.message).strip()
    )
    return tuple(dict.fromkeys(texts))[:MAX_WARNINGS]
