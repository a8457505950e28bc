"""A gate never passes on nothing, and nothing a run folder holds is used unchecked.

``compare``, ``nightly-verdict`` and ``report --baseline`` refuse a side that holds no run
(exit 2, one line) and fail when one side has fewer environments than the other (exit 3,
unless ``--allow-missing``); which run of an environment is tonight's is read from the
start time each records, never from its folder's name; an edited ``run-plan.json`` is
refused before any cell runs on it; a file of a run folder that links out of it is refused.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import torch

from harness import cli
from harness.results import storage
from harness.runner import run
from harness.schema.axes import Cell
from harness.schema.config import RunConfig
from harness.schema.run_files import Environment, RunPlan
from harness.schema.selection import Selection
from tests.conftest import harness

DATA = Path(__file__).parent / "data" / "runs"
NEW, OLD = DATA / "torch-2.13.0", DATA / "torch-2.4.1"
#: The exit codes: a regression, a user error (one line), cells left uncompared.
REGRESSED, ERROR, MISSING = 1, 2, 3
NIGHT = datetime(2026, 11, 25, 3, 0, tzinfo=timezone.utc)


def copy_run(stored: Path, run_dir: Path, started: datetime | None = NIGHT) -> Path:
    """A copy of a stored run that started at ``started`` (None: records no start time)."""
    shutil.copytree(stored, run_dir)
    at = None if started is None else started.isoformat()
    storage.write_env(run_dir, replace(storage.read_env(run_dir), started_at=at))
    return run_dir


def main(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = cli.main([*map(str, args)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("ampmatrix: error: ")]


def regress_one_cell(run_dir: Path) -> str:
    """Turn the first passing cell of a run into a crash (every line of it); its id."""
    path = run_dir / storage.CELLS_FILE
    records = [json.loads(line) for line in path.read_text().splitlines()]
    chosen = next(r for r in records if r["outcome"] == "passes")
    cell = Cell.from_dict(chosen)
    for record in records:
        if Cell.from_dict(record) == cell:
            record.update(outcome="crashed", error_type="ProcessDied", error_message="killed")
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return cell.id


@pytest.fixture
def tonight(tmp_path: Path) -> Path:
    """Tonight's results: two torch releases, one run each."""
    root = tmp_path / "tonight"
    copy_run(NEW, root / "20261125T030000-torch2.13.0", NIGHT)
    copy_run(OLD, root / "20261125T030000-torch2.4.1", NIGHT)
    return root


def not_a_run(tmp_path: Path, kind: str) -> Path:
    """A folder that holds no run: empty, junk (files, a folder of models), a run's
    folder's parent's sibling."""
    folder = tmp_path / kind
    folder.mkdir()
    if kind == "junk":
        (folder / "notes.txt").write_text("not a run")
        (folder / "models").mkdir()
        (folder / "models" / "weights.json").write_text("{}")
    return folder


@pytest.mark.parametrize("kind", ["empty", "junk"])
def test_nightly_against_a_last_night_without_a_run_is_one_error_line(
    tonight: Path, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said ``nightly verdict: pass: 0 environments compared`` and exited 0."""
    last = not_a_run(tmp_path, kind)
    code, out, err = main(
        capsys, "nightly-verdict", tonight, last, "--out", tmp_path / "n.html", "--allow-missing"
    )
    assert code == ERROR, out + err
    assert errors(err) == [f"ampmatrix: error: {last}: no run folder in it " + (
        "(nothing to compare: name a run or a folder of runs)"
    )]  # fmt: skip
    assert "nightly verdict" not in out


@pytest.mark.parametrize("kind", ["empty", "junk"])
@pytest.mark.parametrize("side", ["base", "head"])
def test_compare_with_a_side_without_a_run_is_one_error_line(
    tonight: Path, tmp_path: Path, kind: str, side: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``compare EMPTY TONIGHT`` exited 0; neither side may hold nothing, even where
    missing cells are allowed."""
    nothing = not_a_run(tmp_path, kind)
    sides = (nothing, tonight) if side == "base" else (tonight, nothing)
    code, out, err = main(capsys, "compare", *sides, "--allow-missing")
    assert code == ERROR, out + err
    assert len(errors(err)) == 1 and f"{nothing}: no run folder in it" in err
    assert out == ""


def test_compare_of_two_runs_without_a_record_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, head = copy_run(NEW, tmp_path / "base"), copy_run(NEW, tmp_path / "head")
    for run_dir in (base, head):
        (run_dir / storage.CELLS_FILE).write_text("")
    code, _, err = main(capsys, "compare", base, head)
    assert code == ERROR
    assert errors(err) == [f"ampmatrix: error: {base} and {head} hold no record to compare: " + (
        "nothing compared"
    )]  # fmt: skip


@pytest.mark.parametrize("baseline", ["results root", "models folder", "run without records"])
def test_report_with_a_baseline_that_is_not_a_run_is_one_error_line(
    tmp_path: Path, baseline: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said "No outcome changes" with no warning."""
    head = copy_run(NEW, tmp_path / "results" / "20261125T030000-torch2.13.0")
    base = {
        "results root": tmp_path / "results",
        "models folder": not_a_run(tmp_path, "junk") / "models",
        "run without records": copy_run(NEW, tmp_path / "empty-run"),
    }[baseline]
    (tmp_path / "empty-run" / storage.CELLS_FILE).unlink(missing_ok=True)
    out_file = tmp_path / "report.html"
    code, out, err = main(capsys, "report", head, "--baseline", base, "--out", out_file)
    assert code == ERROR, out + err
    (line,) = errors(err)
    assert line.startswith(f"ampmatrix: error: --baseline {base}: ")
    assert ("no record to compare with" if baseline == "run without records" else
            "not a run folder") in line  # fmt: skip
    assert not out_file.exists()


def test_a_baseline_run_compares_as_before(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, head = copy_run(NEW, tmp_path / "base"), copy_run(NEW, tmp_path / "head")
    cell = regress_one_cell(head)
    out_file = tmp_path / "report.html"
    code, _, err = main(capsys, "report", head, "--baseline", base, "--out", out_file)
    assert code == 0 and errors(err) == []
    assert cell in out_file.read_text()


def test_tonight_with_an_environment_last_night_lacks_fails_unless_allowed(
    tonight: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Last night ran one release, tonight two: tonight's other release is judged against
    nothing, and the night does not pass on it (the cells are named)."""
    last = tmp_path / "last"
    copy_run(NEW, last / "20261124T030000-torch2.13.0", NIGHT - timedelta(days=1))
    unjudged = tonight / "20261125T030000-torch2.4.1"
    count = len(storage.read_records(unjudged))
    report = tmp_path / "n.html"
    code, out, err = main(capsys, "nightly-verdict", tonight, last, "--out", report)
    assert code == MISSING, out + err
    (line,) = errors(err)
    assert f"{count} cells of {unjudged} have no record in {last}" in line
    assert "nightly verdict: FAIL: 1 environments compared" in out
    assert f"{count} cells of tonight with nothing to compare with last night" in out
    code, out, err = main(
        capsys, "nightly-verdict", tonight, last, "--out", report, "--allow-missing"
    )
    assert code == 0 and "nightly verdict: pass" in out and "allowed by --allow-missing" in err
    code, _, err = main(capsys, "compare", last, tonight)
    assert code == MISSING and f"{count} cells of {unjudged} have no record in {last}" in err


def test_a_last_night_run_without_records_fails_the_night(
    tonight: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    last = tmp_path / "last"
    for stored in (NEW, OLD):
        copy_run(stored, last / f"24-{stored.name}", NIGHT - timedelta(days=1))
    (last / f"24-{OLD.name}" / storage.CELLS_FILE).write_text("")
    code, out, err = main(capsys, "nightly-verdict", tonight, last, "--out", tmp_path / "n.html")
    assert code == MISSING, out + err
    assert f"have no record in {last / f'24-{OLD.name}'}" in errors(err)[0]


def test_a_healthy_older_run_renamed_newer_does_not_hide_tonights_regression(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The newest run was taken by its folder's name: last night's healthy run copied
    into tonight's folder under a later name hid tonight's regressed run, and the verdict
    passed."""
    last, tonight = tmp_path / "last", tmp_path / "tonight"
    copy_run(NEW, last / "20261124T030000-torch2.13.0", NIGHT - timedelta(days=1))
    regressed = copy_run(NEW, tonight / "20261125T030000-torch2.13.0", NIGHT)
    cell = regress_one_cell(regressed)
    renamed = tonight / "20991231T235959-torch2.13.0"
    shutil.copytree(last / "20261124T030000-torch2.13.0", renamed)
    code, out, err = main(capsys, "nightly-verdict", tonight, last, "--out", tmp_path / "n.html")
    assert code == REGRESSED, out + err
    assert any(line.startswith("FAIL ") and cell in line for line in out.splitlines())
    assert f"{renamed}: not compared: {regressed.name} started later" in err
    code, out, _ = main(capsys, "compare", last, tonight)
    assert code == REGRESSED and cell in out


@pytest.mark.parametrize("started", [None, "yesterday", "2026-11-25T03:00:00", 20261125])
def test_a_run_without_a_readable_start_time_is_named_and_refused(
    tmp_path: Path, started: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without it, which run is tonight's cannot be told (a time without its zone
    neither: which zone?)."""
    last, tonight = tmp_path / "last", tmp_path / "tonight"
    copy_run(NEW, last / "20261124T030000-torch2.13.0", NIGHT - timedelta(days=1))
    undated = copy_run(NEW, tonight / "20261125T030000-torch2.13.0")
    env = json.loads((undated / storage.ENV_FILE).read_text())
    (undated / storage.ENV_FILE).write_text(json.dumps({**env, "started_at": started}))
    for args in (("nightly-verdict", tonight, last, "--out", tmp_path / "n.html"),
                 ("compare", last, tonight)):  # fmt: skip
        code, out, err = main(capsys, *args)
        assert code == ERROR, out + err
        (line,) = errors(err)
        assert line.startswith(f"ampmatrix: error: {undated / storage.ENV_FILE}: no start time")
        assert "nightly verdict" not in out


def test_two_runs_of_one_environment_started_at_once_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    last, tonight = tmp_path / "last", tmp_path / "tonight"
    copy_run(NEW, last / "20261124T030000-torch2.13.0", NIGHT - timedelta(days=1))
    first = copy_run(NEW, tonight / "a", NIGHT)
    second = copy_run(NEW, tonight / "b", NIGHT)
    code, _, err = main(capsys, "compare", last, tonight)
    assert code == ERROR
    (line,) = errors(err)
    assert f"{second} and {first}: two runs of torch 2.13.0+cpu" in line and "keep one" in line


def resumable_run(tmp_path: Path) -> Path:
    """A run folder of one planned cell, none run yet, as ``run`` leaves it before its
    first cell ends."""
    cell = Cell("dia-sdpa-kv-cache", "none", "cpu", "float16", "half", "sdpa")
    config = RunConfig(selection=Selection(cases=[cell.case]), results_root=tmp_path)
    run_dir = tmp_path / "20261125T030000-torch2.13.0"
    run_dir.mkdir()
    storage.write_run_plan(run_dir, RunPlan(config, (cell,)))
    storage.write_env(
        run_dir, Environment(torch_version=torch.__version__, started_at=NIGHT.isoformat())
    )
    return run_dir


@pytest.mark.parametrize(
    ("where", "field", "value", "message"),
    [
        ("cells", "dtype", "float8", "cells[0] (dia-sdpa-kv-cache[none,cpu,float8,half,sdpa]): "
         "unknown dtype 'float8'; did you mean"),
        ("cells", "case", "no-such-case", "cells[0] (no-such-case[none,cpu,float16,half,sdpa]): "
         "unknown case 'no-such-case'"),
        ("cells", "device", "tpu", "unknown device 'tpu'"),
        ("cells", "stage", "bogus", "unknown stage 'bogus'"),
        ("skipped", "mode", "quarter", "skipped[0] (dia-sdpa-kv-cache[none,cuda,float16,quarter,"
         "sdpa]): unknown mode 'quarter'"),
        ("selection", "dtypes", ["float8"], "unknown dtype 'float8'"),
    ],
)  # fmt: skip
def test_an_edited_run_plan_is_refused_before_any_cell_runs(
    tmp_path: Path, where: str, field: str, value: Any, message: str
) -> None:
    """An unknown case or a ``float8`` in ``run-plan.json`` gave ``crashed harness``
    records and exit 0."""
    run_dir = resumable_run(tmp_path)
    path = run_dir / storage.RUN_PLAN_FILE
    plan = json.loads(path.read_text())
    if where == "skipped":
        plan["skipped"] = [[{**plan["cells"][0], "device": "cuda"}, "no CUDA device visible"]]
        plan["skipped"][0][0][field] = value
    elif where == "selection":
        plan["config"]["selection"][field] = value
    else:
        plan["cells"][0][field] = value
    path.write_text(json.dumps(plan))
    result = harness("run", "--resume", str(run_dir))
    assert result.returncode == ERROR, result.stdout + result.stderr
    (line,) = errors(result.stderr)
    assert line.startswith(f"ampmatrix: error: {path}: ") and message in line
    assert "Traceback" not in result.stderr
    assert not (run_dir / storage.CELLS_FILE).exists()  # nothing ran


def test_every_cell_of_a_full_plan_passes_the_plan_check() -> None:
    """No false refusal: every cell ``run`` plans over every case, device, size and stage
    (to run or skipped here) is one its case declares."""
    config = RunConfig(selection=Selection(devices=["all"], sizes=["all"], stages=["all"]))
    plan = run.plan_run(config)
    assert plan.to_run and plan.skipped
    run.check_plan(run.cases_of_run(config), RunPlan(config, tuple(plan.to_run),
                                                     tuple(plan.skipped)))  # fmt: skip


def outside_file(tmp_path: Path, text: str) -> Path:
    outside = tmp_path / "elsewhere" / "file"
    outside.parent.mkdir()
    outside.write_text(text)
    return outside


@pytest.mark.parametrize("name", [storage.ENV_FILE, storage.RUN_PLAN_FILE, storage.CASES_FILE])
def test_a_run_file_linking_out_of_its_run_folder_is_refused(tmp_path: Path, name: str) -> None:
    run_dir = copy_run(NEW, tmp_path / "run")
    other = copy_run(NEW, tmp_path / "other")
    storage.write_run_plan(other, RunPlan(RunConfig()))
    (run_dir / name).unlink(missing_ok=True)
    (run_dir / name).symlink_to(other / name)
    readers: dict[str, Callable[[Path], object]] = {
        storage.ENV_FILE: storage.read_env,
        storage.RUN_PLAN_FILE: storage.read_run_plan,
        storage.CASES_FILE: storage.read_cases,
    }
    read = readers[name]
    with pytest.raises(storage.ResultsError, match="a link out of the run folder") as raised:
        read(run_dir)
    assert str(raised.value).startswith(f"{run_dir / name}: ")
    # a link inside the folder is one of its files
    (run_dir / name).unlink()
    shutil.copy(other / name, run_dir / f"kept-{name}")
    (run_dir / name).symlink_to(f"kept-{name}")
    read(run_dir)


def test_records_linking_out_of_the_run_folder_are_named_and_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A report names the link and reads no record through it (its fast reader too);
    nothing is appended to, or cut from, the file it points at."""
    run_dir = copy_run(NEW, tmp_path / "run")
    outside = outside_file(tmp_path, (NEW / storage.CELLS_FILE).read_text() + '{"cut')
    before = outside.read_bytes()
    (run_dir / storage.CELLS_FILE).unlink()
    (run_dir / storage.CELLS_FILE).symlink_to(outside)
    problems: list[str] = []
    assert storage.read_records(run_dir, problems) == []
    assert problems == [
        f"{run_dir / storage.CELLS_FILE}: a link out of the run folder (to {outside}); refusing it"
    ]
    code, _, err = main(capsys, "report", run_dir, "--out", tmp_path / "r.html")
    assert code == 0 and "a link out of the run folder" in err
    with pytest.raises(storage.ResultsError, match="a link out of the run folder"):
        storage.drop_partial_last_line(run_dir)
    record = storage.read_records(NEW)[0]
    with pytest.raises(storage.ResultsError, match="a link out of the run folder"):
        storage.append_record(run_dir, record)
    assert outside.read_bytes() == before


def test_a_resume_through_a_link_out_of_the_run_folder_is_refused(tmp_path: Path) -> None:
    run_dir = resumable_run(tmp_path)
    outside = outside_file(tmp_path, "a file of the machine\n")
    (run_dir / storage.CELLS_FILE).symlink_to(outside)
    result = harness("run", "--resume", str(run_dir))
    assert result.returncode == ERROR, result.stdout + result.stderr
    (line,) = errors(result.stderr)
    assert "a link out of the run folder" in line
    assert outside.read_text() == "a file of the machine\n"
