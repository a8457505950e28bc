"""The run configuration: built once from the command line, frozen, stored with the run.

``run`` builds it, writes it into ``run-plan.json``; ``--resume`` and the pytest plugin (in
every worker) read it back from there, so each part of a run sees the same settings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.isolation import Limits
from harness.matrix import Selection
from harness.timing import TimingConfig


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "selection": dataclasses.asdict(self.selection),
            "cases_dirs": [str(Path(d).resolve()) for d in self.cases_dirs],
            "results_root": str(self.results_root),
            "workers": self.workers,
            "command": list(self.command),
            "timing": dataclasses.asdict(self.timing) if self.timing else None,
            "limits": dataclasses.asdict(self.limits),
            "trace": self.trace,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        selection = {k: tuple(v) for k, v in (data.get("selection") or {}).items()}
        timing = data.get("timing")
        return cls(
            selection=Selection(**selection),
            cases_dirs=tuple(Path(d) for d in data.get("cases_dirs", ())),
            results_root=Path(data.get("results_root", "results")),
            workers=str(data.get("workers", "auto")),
            command=tuple(data.get("command", ())),
            timing=TimingConfig(**timing) if timing is not None else None,
            limits=Limits(**data.get("limits", {})),
            trace=bool(data.get("trace", True)),
        )

    @classmethod
    def of_run_plan(cls, saved: dict[str, Any]) -> RunConfig:
        """The configuration stored in a ``run-plan.json`` (runs of older versions kept its
        parts at the top level)."""
        return cls.from_dict(saved.get("config", saved))
