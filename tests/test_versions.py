"""Finding where behaviour changed across torch versions, and pairing runs for compare."""

from __future__ import annotations

import shutil
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest

from harness.report.compare import pair_runs
from harness.results import storage
from harness.results.search import release_key
from harness.results.versions import outcome_changes, render_bisect
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, Outcome
from harness.schema.releases import torch_release

DATA = Path(__file__).parent / "data" / "runs"


def rec(
    version: str, outcome: Outcome, reproduces: bool | None = None, fix: str = "none"
) -> CellRecord:
    return CellRecord(
        Cell("c", fix, "cpu", "float16", "half", "sdpa"), version, outcome, reproduces=reproduces
    )


def test_versions_sort_numerically() -> None:
    assert sorted(["2.13.0+cpu", "2.4.1+cu121", "2.10.1"], key=release_key) == [
        "2.4.1+cu121",
        "2.10.1",
        "2.13.0+cpu",
    ]


def test_changes_are_reported_between_consecutive_versions() -> None:
    records = [
        rec("2.13.0", Outcome.PASSES),
        rec("2.4.1", Outcome.RAISES, True),
        rec("2.5.1", Outcome.RAISES, True),
        rec("2.4.1", Outcome.PASSES, fix="cast"),
    ]
    (change,) = outcome_changes(records)
    assert (change.before_version, change.before) == ("2.5.1", "raises:repro")
    assert (change.after_version, change.after) == ("2.13.0", "passes")
    text = render_bisect(records)
    expected = (
        "c[none,cpu,float16,half,sdpa]: raises:repro on torch 2.5.1 -> passes on torch 2.13.0"
    )
    assert expected in text


def test_no_change_and_single_version_are_said_plainly() -> None:
    assert "no outcome changes across torch 2.4.1, 2.13.0" in render_bisect(
        [rec("2.4.1", Outcome.PASSES), rec("2.13.0", Outcome.PASSES)]
    )
    assert "only one torch version" in render_bisect([rec("2.4.1", Outcome.PASSES)])


def started_copy(stored: Path, run: Path) -> None:
    """A copy of a stored run, started when its name says (``20260103T000000-...``): which
    run of an environment is newest is read from its start time."""
    shutil.copytree(stored, run)
    started = datetime.strptime(run.name[:15], "%Y%m%dT%H%M%S").replace(tzinfo=timezone.utc)
    storage.write_env(run, replace(storage.read_env(run), started_at=started.isoformat()))


def test_results_folders_pair_up_by_environment_and_name_every_run_left_out(
    tmp_path: Path,
) -> None:
    base, head = tmp_path / "base", tmp_path / "head"
    for root, stamp in ((base, "20260101"), (head, "20260102")):
        for name in ("torch-2.4.1", "torch-2.13.0"):
            started_copy(DATA / name, root / f"{stamp}T000000-{name}")
    started_copy(DATA / "torch-2.13.0", head / "20260103T000000-torch-2.13.0")
    other_host = head / "20260104T000000-torch-2.13.0"
    started_copy(DATA / "torch-2.13.0", other_host)
    env = storage.read_env(other_host)
    storage.write_env(other_host, replace(env, hostname="gpu-box-2", gpus=[{"name": "H100"}]))
    pairing = pair_runs(base, head)
    assert [(b.name, h.name) for b, h in pairing.pairs] == [
        ("20260101T000000-torch-2.13.0", "20260103T000000-torch-2.13.0"),
        ("20260101T000000-torch-2.4.1", "20260102T000000-torch-2.4.1"),
    ]
    left_out = "\n".join(pairing.left_out)
    assert (
        "20260102T000000-torch-2.13.0: not compared: 20260103T000000-torch-2.13.0 started later"
        in left_out
    )
    assert f"{other_host}: no run of torch 2.13.0+cpu · H100 in {base}" in left_out
    assert len(pairing.left_out) == 2
    one = base / "20260101T000000-torch-2.4.1"
    with pytest.raises(storage.ResultsError, match="the same run on both sides"):
        pair_runs(one, one)  # compared with itself, nothing could fail
    assert str(storage.read_env(one).torch_version).startswith("2.4.1")


@pytest.mark.parametrize(
    ("version", "release"),
    [("2.13.0+cpu", "2.13.0"), ("2.4.1+cu121", "2.4.1"), ("2.11.0", "2.11.0"), (None, "?")],
)
def test_a_torch_release_is_named_without_its_build(version: str | None, release: str) -> None:
    """One helper names a release wherever a view shows one (harness.schema.releases)."""
    assert torch_release(version) == release
