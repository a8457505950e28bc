"""The contract every case follows: a Case with its fixes, and what a fix's code sees.

A case module defines one subclass of :class:`Case`, decorated with
:func:`harness.registry.register`, whose methods decorated with :func:`fix` are its fixes::

    @register
    class MyCase(Case):
        name = "my-case"
        ...
        def build(self, ctx): return Workload(model=..., inputs={...})

        @fix("none", rationale="the upstream code path")
        def none(self, w, ctx): return w.model(**w.inputs)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from harness.axes import LOW_PRECISION_DTYPES
from harness.observe import CoreObservation, record_core_dtypes
from harness.records import Cell


@dataclass(frozen=True)
class Upstream:
    """Where a failure comes from: links a report can show."""

    repo: str
    file: str
    commit: str
    issues: tuple[str, ...] = ()
    url: str = ""


@dataclass(frozen=True)
class FailureSignature:
    """The known failure: an exception type name and a regex its message matches."""

    error_type: str
    message: str

    def matches(self, error_type: str, message: str) -> bool:
        return error_type == self.error_type and re.search(self.message, message) is not None


@dataclass
class Workload:
    """What one cell runs: a model (any object) and its inputs, already placed."""

    model: Any
    inputs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunContext:
    """What a fix's code sees about the cell it runs in.

    ``dtype`` is the cell's dtype; it is ``float64`` when the harness computes the reference.
    """

    device: torch.device
    dtype: torch.dtype
    mode: str
    backend: str
    #: Record the attention core's dtypes; off while timing, so nothing sits in the timed path.
    observe: bool = True
    observation: CoreObservation = field(default_factory=CoreObservation)

    @property
    def is_reference(self) -> bool:
        return self.dtype == torch.float64

    @property
    def model_dtype(self) -> torch.dtype:
        """Dtype of weights and inputs: the cell dtype in ``half`` mode, else float32."""
        if self.mode == "half" or self.is_reference:
            return self.dtype
        return torch.float32

    @property
    def upcast_dtype(self) -> torch.dtype:
        """What upstream code means by ``.float()``: float32, or float64 in the reference."""
        return torch.float64 if self.is_reference else torch.float32

    def autocast(self) -> AbstractContextManager[Any]:
        """torch.autocast for the cell's dtype in ``autocast`` mode; a no-op otherwise."""
        if self.mode != "autocast":
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def place(self, module: torch.nn.Module) -> torch.nn.Module:
        """Move a module to the cell's device and model dtype."""
        return module.to(device=self.device, dtype=self.model_dtype)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Move an input tensor to the cell's device and model dtype."""
        return t.to(device=self.device, dtype=self.model_dtype)

    @contextmanager
    def attention_core(self) -> Iterator[None]:
        """Mark the attention core: the dtypes its kernels really see are recorded."""
        if not self.observe:
            yield
            return
        with record_core_dtypes(self.observation):
            yield


FixFunction = Callable[[Any, Workload, RunContext], Any]


@dataclass(frozen=True)
class Fix:
    """A named code variant of a case; ``none`` is the buggy upstream code path."""

    name: str
    rationale: str
    func: FixFunction
    upstream: str = ""
    modes: tuple[str, ...] | None = None
    backends: tuple[str, ...] | None = None


def fix(
    name: str,
    *,
    rationale: str,
    upstream: str = "",
    modes: tuple[str, ...] | None = None,
    backends: tuple[str, ...] | None = None,
) -> Callable[[FixFunction], FixFunction]:
    """Mark a method of a Case as a fix. ``modes``/``backends`` narrow where it applies."""

    def mark(func: FixFunction) -> FixFunction:
        func.__ampmatrix_fix__ = Fix(  # type: ignore[attr-defined]
            name, rationale, func, upstream=upstream, modes=modes, backends=backends
        )
        return func

    return mark


class Case:
    """A failure pattern from a real project. Subclass it; see the module docstring."""

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    upstream: ClassVar[Upstream | None] = None
    failure: ClassVar[FailureSignature | None] = None
    #: A fix that is correct in any dtype: run in float64 it is the reference, run in the
    #: cell's dtype (mode ``half``, on the CPU) it is the plain low-precision baseline.
    reference_fix: ClassVar[str] = ""
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    dtypes: ClassVar[tuple[str, ...]] = LOW_PRECISION_DTYPES
    modes: ClassVar[tuple[str, ...]] = ("half", "fp32")
    backends: ClassVar[tuple[str, ...]] = ("sdpa",)
    #: Modules that must be importable for the case to run; otherwise cells are skipped.
    requires: ClassVar[tuple[str, ...]] = ()
    #: The case's own time limit per cell in seconds (instead of the run's ``--timeout``).
    timeout_s: ClassVar[float | None] = None
    source_file: str = ""

    def build(self, ctx: RunContext) -> Workload:
        """Build the model and inputs for a cell. The harness seeds the RNG first."""
        raise NotImplementedError

    def skip_reason(self, cell: Cell) -> str | None:
        """A case-specific reason this cell cannot run here, or None (checked after the
        environment's own reasons: device, dtype support, backend, ``requires``)."""
        return None

    @property
    def fixes(self) -> dict[str, Fix]:
        found: dict[str, Fix] = {}
        for klass in reversed(type(self).__mro__):
            for attr in vars(klass).values():
                marked = getattr(attr, "__ampmatrix_fix__", None)
                if isinstance(marked, Fix):
                    found[marked.name] = marked
        return found

    def run_fix(self, fix_name: str, workload: Workload, ctx: RunContext) -> Any:
        return self.fixes[fix_name].func(self, workload, ctx)

    def metadata(self) -> dict[str, Any]:
        """What a report shows about the case, stored with each run (``cases.json``)."""
        return {
            "name": self.name,
            "title": self.title,
            "upstream": dataclasses.asdict(self.upstream) if self.upstream else None,
            "failure": dataclasses.asdict(self.failure) if self.failure else None,
            "source_file": self.source_file,
            "fixes": [
                {"name": f.name, "rationale": f.rationale, "upstream": f.upstream}
                for f in self.fixes.values()
            ],
        }
