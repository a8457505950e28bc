"""The nightly's job matrix: every torch release of the nox sessions on every GPU runner kind.

Reads ``nox --list --json --tags all-versions`` on stdin (one ``matrix(torch='X')`` session
per release of the noxfile) and the GPU kinds and exclusions of ``.github/nightly-gpus.toml``,
and prints the matrix's ``include`` list as JSON: one job per release x kind, each named by
both (``torch 2.11.0 · h100``). A release x kind that an exclusion rules out gets no job and
is printed to stderr (and to ``--summary FILE``) with the exclusion's reason.

Standard library only: it runs before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

#: The GPU kinds and exclusions, beside the workflows.
GPU_KINDS = Path(__file__).resolve().parent.parent / "nightly-gpus.toml"


@dataclass(frozen=True)
class GpuKind:
    """A kind of GPU runner: its short name, its runner labels, its compute capability."""

    name: str
    labels: tuple[str, ...]
    capability: tuple[int, ...]


@dataclass(frozen=True)
class Exclusion:
    """Every kind of at least ``min_capability`` cannot run a release older than
    ``torch_below``, for ``reason``."""

    min_capability: tuple[int, ...]
    torch_below: tuple[int, ...]
    reason: str

    def rules_out(self, release: str, kind: GpuKind) -> bool:
        return kind.capability >= self.min_capability and version(release) < self.torch_below


def version(text: str) -> tuple[int, ...]:
    """``2.11.0`` (or ``2.11.0+cu128``, or a capability ``9.0``) as numbers to order by."""
    return tuple(int(part) for part in text.split("+")[0].split("."))


def load_kinds(path: Path = GPU_KINDS) -> tuple[list[GpuKind], list[Exclusion]]:
    """The GPU kinds and the exclusions of the file; a kind named twice is an error."""
    data = tomllib.loads(path.read_text())
    kinds = [
        GpuKind(str(k["name"]), tuple(map(str, k["labels"])), version(str(k["capability"])))
        for k in data.get("gpu", [])
    ]
    names = [k.name for k in kinds]
    if not kinds or len(set(names)) != len(names):
        raise ValueError(f"{path}: expected GPU kinds with distinct names, got {names}")
    exclusions = [
        Exclusion(version(str(e["min_capability"])), version(str(e["torch_below"])), e["reason"])
        for e in data.get("exclude", [])
    ]
    return kinds, exclusions


def releases(sessions: Sequence[dict[str, Any]]) -> list[tuple[str, str]]:
    """Each matrix session of the nox listing and its torch release, in the listing's order."""
    return [
        (s["session"], str(s["call_spec"]["torch"]))
        for s in sessions
        if str(s["session"]).startswith("matrix(")
    ]


def job(session: str, release: str, kind: GpuKind) -> dict[str, Any]:
    return {
        "session": session,
        "torch": release,
        "gpu": kind.name,
        "labels": list(kind.labels),
        "capability": ".".join(map(str, kind.capability)),
        "title": f"torch {release} · {kind.name}",
        "artifact": f"results-torch-{release}-{kind.name}",
    }


def job_matrix(
    sessions: Sequence[dict[str, Any]], kinds: Sequence[GpuKind], exclusions: Sequence[Exclusion]
) -> tuple[list[dict[str, Any]], list[str]]:
    """The jobs (every release on every kind, release by release) and, for each pair left
    out, a line naming it and why."""
    jobs, left_out = [], []
    for session, release in releases(sessions):
        for kind in kinds:
            reasons = [e.reason for e in exclusions if e.rules_out(release, kind)]
            if reasons:
                left_out.append(f"torch {release} · {kind.name}: excluded: {reasons[0]}")
            else:
                jobs.append(job(session, release, kind))
    return jobs, left_out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=Path, default=GPU_KINDS, help="the GPU kinds' file")
    parser.add_argument(
        "--summary", type=Path, help="also append the exclusions to FILE ($GITHUB_STEP_SUMMARY)"
    )
    args = parser.parse_args(argv)
    jobs, left_out = job_matrix(json.load(sys.stdin), *load_kinds(args.gpus))
    for line in left_out:
        print(line, file=sys.stderr)
    if args.summary:
        with args.summary.open("a") as summary:
            summary.write(f"{len(jobs)} jobs, {len(left_out)} excluded\n\n")
            summary.writelines(f"- {line}\n" for line in left_out)
    print(json.dumps(jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
