"""The run configuration: built once from the command line, frozen, stored with the run.

``run`` builds it, writes it into ``run-plan.json`` (``harness.schema.run_files.RunPlan``);
``--resume`` and the pytest plugin (in every worker) read it back from there, so each part
of a run sees the same settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.schema.selection import Selection
from harness.schema.typed import as_mapping, as_tuple, check_fields, mismatch


@dataclass(frozen=True)
class TimingConfig:
    warmup_s: float = 0.05
    min_warmup_calls: int = 2
    #: One sample is a block of calls lasting at least this long.
    min_block_s: float = 0.01
    min_samples: int = 7
    #: Timed calls per function at the least, whatever the budget: a cell also spends about
    #: three calls' time untimed (its warm-up, and its FLOP and memory count, which runs
    #: slower than a plain call), and 20 timed calls hold that near a seventh of its time.
    min_calls: int = 20
    max_samples: int = 500
    #: Stop once IQR / median falls under this.
    iqr_threshold: float = 0.03
    #: Wall time allowed for sampling, after warm-up.
    budget_s: float = 0.5
    flush_l2: bool = False
    #: Stop early, as noisy, once the worst spread has not shrunk by a tenth for this many
    #: rounds: on a loaded machine more samples do not settle it, they only spend the budget.
    plateau_rounds: int = 20


DEFAULT_TIMEOUT_S = 300.0
#: The longest time limit a run can keep: the kernel's poll() takes its timeout in
#: milliseconds as a C int (2**31 - 1 ms, 24.8 days); a longer one fails as it is waited on.
MAX_SECONDS = (2**31 - 1) // 1000
#: The largest memory limit setrlimit() takes (a C long of bytes).
MAX_MEMORY_BYTES = 2**63 - 1


@dataclass(frozen=True)
class Limits:
    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_bytes: int | None = None


#: Optimizer steps of a ``fit`` cell unless ``--fit-steps`` says otherwise, and the most
#: a run may ask for.
DEFAULT_FIT_STEPS = 20
MAX_FIT_STEPS = 10_000


@dataclass(frozen=True)
class RunConfig:
    selection: Selection = field(default_factory=Selection)
    cases_dirs: tuple[Path, ...] = ()
    results_root: Path = Path("results")
    workers: str = "auto"
    command: tuple[str, ...] = ()
    #: None: correctness only (``--no-timing``).
    timing: TimingConfig | None = field(default_factory=TimingConfig)
    limits: Limits = field(default_factory=Limits)
    #: Trace dtypes in correctness cells (``--no-trace`` turns it off, to measure its cost).
    trace: bool = True
    #: At most this many cells of one case share a forked process in the correctness phase
    #: (``--batch``; 1: every cell in a process of its own).
    batch: int = 16
    #: Optimizer steps of each ``fit`` cell (``--fit-steps``).
    fit_steps: int = DEFAULT_FIT_STEPS
    #: Models checked by ``check`` (``MODULE:FACTORY``), the folder their modules are
    #: imported from, the names they keep in float32 (``--keep-fp32``) and the loss their
    #: training steps take (``--loss``: ``MODULE:FUNC`` or ``FACTORY=MODULE:FUNC``).
    models: tuple[str, ...] = ()
    models_path: str = ""
    keep_fp32: tuple[str, ...] = ()
    losses: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "selection": self.selection.to_dict(),
            "cases_dirs": [str(Path(d).resolve()) for d in self.cases_dirs],
            "results_root": str(self.results_root),
            "workers": self.workers,
            "command": list(self.command),
            "timing": dataclasses.asdict(self.timing) if self.timing else None,
            "limits": dataclasses.asdict(self.limits),
            "trace": self.trace,
            "batch": self.batch,
            "fit_steps": self.fit_steps,
            "models": list(self.models),
            "models_path": self.models_path,
            "keep_fp32": list(self.keep_fp32),
            "losses": list(self.losses),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """The configuration as stored; a value of the wrong type or out of range is a
        ``TypeError`` / ``ValueError`` naming its field."""
        data = as_mapping(data, "config")
        selection = {
            k: strings(v, f"selection.{k}")
            for k, v in as_mapping(data.get("selection") or {}, "selection").items()
        }
        timing = data.get("timing")
        config = cls(
            selection=Selection.from_dict(selection),
            cases_dirs=absolute_paths(data.get("cases_dirs"), "cases_dirs"),
            results_root=Path(data.get("results_root") or "results"),
            workers=data.get("workers", "auto"),
            command=strings(data.get("command"), "command"),
            timing=TimingConfig(**as_mapping(timing, "timing")) if timing is not None else None,
            limits=Limits(**as_mapping(data.get("limits") or {}, "limits")),
            trace=data.get("trace", True),
            batch=data.get("batch", 1),  # runs before batching ran a cell per process
            fit_steps=data.get("fit_steps", DEFAULT_FIT_STEPS),
            models=strings(data.get("models"), "models"),
            models_path=data.get("models_path") or "",
            keep_fp32=strings(data.get("keep_fp32"), "keep_fp32"),
            losses=strings(data.get("losses"), "losses"),
        )
        for part in (config.limits, config.timing):
            if part is not None:
                check_fields(part, f"{type(part).__name__}.")
        for name, value in (
            ("results_root", data.get("results_root")),
            ("workers", config.workers),
            ("models_path", config.models_path),
        ):
            if value is not None and not isinstance(value, str):
                raise TypeError(mismatch(name, str, value))
        if not isinstance(config.trace, bool):
            raise TypeError(mismatch("trace", bool, config.trace))
        if not isinstance(config.batch, int) or isinstance(config.batch, bool) or config.batch < 1:
            raise ValueError(f"batch: expected a positive whole number, got {config.batch!r}")
        if not is_count(config.fit_steps, MAX_FIT_STEPS):
            raise ValueError(
                f"fit_steps: expected a whole number from 1 to {MAX_FIT_STEPS}, "
                f"got {config.fit_steps!r}"
            )
        check_limits(config.limits)
        return config


def is_count(value: Any, most: int) -> bool:
    """A whole number from 1 to ``most`` (a bool is not one)."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= most


def strings(value: Any, name: str) -> tuple[str, ...]:
    values = as_tuple(value, name)
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise TypeError(mismatch(f"{name}[{i}]", str, v))
    return values


def check_limits(limits: Limits) -> None:
    """A time limit is a positive number of seconds the platform can wait for
    (``MAX_SECONDS``); a memory limit a positive number of bytes setrlimit() takes."""
    if not (0 < limits.timeout_s <= MAX_SECONDS):
        raise ValueError(
            f"limits.timeout_s: expected seconds above 0 and at most {MAX_SECONDS}, "
            f"got {limits.timeout_s}"
        )
    memory = limits.memory_bytes
    if memory is not None and not (0 < memory <= MAX_MEMORY_BYTES):
        raise ValueError(
            f"limits.memory_bytes: expected bytes above 0 and at most {MAX_MEMORY_BYTES}, "
            f"got {memory}"
        )


def absolute_paths(value: Any, name: str) -> tuple[Path, ...]:
    """A run plan names its case folders by absolute path (``to_dict`` resolves them); a
    relative one would be read against whatever folder ``--resume`` runs in."""
    paths = tuple(Path(p) for p in strings(value, name))
    for i, path in enumerate(paths):
        if not path.is_absolute():
            raise ValueError(f"{name}[{i}]: expected an absolute path, got {str(path)!r}")
    return paths
