"""A fresh round of hostile inputs on the surfaces of issue 41: the runner's own plan
files, a resume's unreadable records, run plans edited at random, and files, variables
and labels a new user gets wrong. Each holds as one line (an error or a warning) and a
non-zero exit, or as a correct outcome; never a traceback, a forged line or a lost figure."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from harness import cli
from harness.measure.authoring.model_case import ModelCheckError
from harness.measure.figures import peaks
from harness.plugin import parse_expect
from harness.results import storage
from harness.runner import cell_items, run
from harness.runner.matrix import Plan
from harness.schema import env_vars
from harness.schema.axes import Cell
from tests.test_gates import resumable_run

#: The exit code of a user error: one line.
ERROR = 2


def write_plan(run_dir: Path, text: str) -> Path:
    path = run_dir / storage.PLAN_FILE
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"batches": []}', "'run_dir': expected the run folder's path"),
        ('{"run_dir": 5}', "'run_dir': expected the run folder's path"),
        ('{"run_dir": "x", "batches": {"a": 1}}', "'batches': expected a list"),
        ('{"run_dir": "x", "batches": [[]]}', "'batches': expected a list"),
        ('{"run_dir": "x", "batches": [["cell"]]}', "'batches': expected a list"),
        ('{"run_dir": "x", "timing_batches": [{"col": {}}]}', "'timing_batches': expected"),
        ('{"run_dir": "x", "batches": [', "not valid JSON"),
    ],
)
def test_a_damaged_plan_file_is_named_in_one_line(tmp_path: Path, text: str, problem: str) -> None:
    """``plan.json`` was read with a bare ``json.loads``: a damaged one gave a KeyError or
    a TypeError deep in collection, naming no file."""
    path = write_plan(tmp_path, text)
    with pytest.raises(storage.ResultsError) as raised:
        cell_items.load_plan(path)
    assert str(raised.value).startswith(f"{path}: ") and problem in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_plan_file_as_the_runner_writes_it_is_read(tmp_path: Path) -> None:
    """No false refusal: the shapes ``write_plan`` gives both plan files."""
    cell = Cell("dia-sdpa-kv-cache", "none", "cpu", "float16", "half", "sdpa")
    written = {"run_dir": str(tmp_path), "batches": [[cell.to_dict()]]}
    assert cell_items.load_plan(write_plan(tmp_path, json.dumps(written))) == written
    timing = {"run_dir": str(tmp_path), "timing_batches": [{"sdpa": [cell.to_dict()]}]}
    path = tmp_path / storage.TIMING_PLAN_FILE
    path.write_text(json.dumps(timing))
    assert cell_items.load_plan(path) == timing


def test_a_plan_file_linking_out_of_the_run_folder_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"run_dir": str(tmp_path), "batches": []}))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / storage.PLAN_FILE).symlink_to(outside)
    with pytest.raises(storage.ResultsError, match="a link out of the run folder"):
        cell_items.load_plan(run_dir / storage.PLAN_FILE)


def test_a_resume_names_the_record_lines_it_cannot_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``saved_state`` read ``cells.jsonl`` with ``problems=[]`` and dropped them: a
    damaged line's cell ran again with no word why."""
    run_dir = resumable_run(tmp_path)
    (run_dir / storage.CELLS_FILE).write_bytes(b'{"case": 1}\n\xff\xfe junk\n')
    saved = run.saved_state(run_dir)
    assert len(saved.plan.to_run) == 1  # the cell has no record: it runs again
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2
    path = run_dir / storage.CELLS_FILE
    assert all(w.startswith(f"ampmatrix: warning: {path}") for w in warnings), warnings


# --- a hypothesis fuzz of run plans fed to ``run --resume`` ------------------------------

#: Values a hand edit puts in place of a field: wrong types, unknown axis values, huge
#: numbers, nested junk.
JUNK = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats()
    | st.sampled_from(["float8", "tpu", "no-such-case", "", "all", "cuda:99", "\n", "1e309"])
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def paths_of(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON value (the value itself first)."""
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += paths_of(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            found += paths_of(item, (*prefix, index))
    return found


def edited(plan: Any, where: tuple[Any, ...], drop: bool, junk: Any) -> Any:
    """``plan`` with the value at ``where`` dropped (from its object or list) or replaced by
    ``junk``."""
    if not where:
        return junk
    parent = plan
    for step in where[:-1]:
        parent = parent[step]
    if drop:
        del parent[where[-1]]
    else:
        parent[where[-1]] = junk
    return plan


class Ran(Exception):
    """The stand-in for running cells: a clean resume got this far."""


def resume_here(run_dir: Path) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["run", "--resume", str(run_dir), "-n", "1"])
    return code, err.getvalue()


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_run_plan_edited_at_random_resumes_cleanly_or_is_one_error_line(
    data: st.DataObject,
) -> None:
    """Random edits of a real ``run-plan.json`` (keys dropped, values of the wrong type,
    unknown axis values, huge numbers, nested junk): the resume either runs the plan's
    cells (each a cell its case declares) or is refused in one ``ampmatrix: error:`` line
    and exit 2 before any record is written; never a traceback."""
    with tempfile.TemporaryDirectory() as folder:
        run_dir = resumable_run(Path(folder))
        path = run_dir / storage.RUN_PLAN_FILE
        plan = json.loads(path.read_text())
        plan["skipped"] = [[{**plan["cells"][0], "device": "cuda"}, "no CUDA device visible"]]
        for _ in range(data.draw(st.integers(1, 3), label="edits")):
            where = data.draw(st.sampled_from(paths_of(plan)), label="where")
            drop = bool(where) and data.draw(st.booleans(), label="drop")
            plan = edited(plan, where, drop, None if drop else data.draw(JUNK, label="junk"))
        path.write_text(json.dumps(plan, allow_nan=True))
        handed: list[Plan] = []

        def ran(run_dir: Path, plan: Plan, *_: Any) -> Path:
            handed.append(plan)
            raise Ran

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(run, "run_cells", ran)
            try:
                code, err = resume_here(run_dir)
            except Ran:
                code, err = 0, ""
        assert "Traceback" not in err
        event("ran" if handed else f"exit {code}")
        if handed:
            (given_plan,) = handed
            assert all(isinstance(cell, Cell) for cell in given_plan.to_run)
            run.check_plan(run.cases_of_run(storage.read_run_config(run_dir)),
                           storage.read_run_plan(run_dir))  # fmt: skip
        elif code == ERROR:
            lines = err.splitlines()
            assert len(lines) == 1 and lines[0].startswith("ampmatrix: error: "), lines
        else:  # nothing left to run: the plan's cells were all checked and none is left
            assert code in (0, 3) and "error" not in err, (code, err)
        assert not (run_dir / storage.CELLS_FILE).exists()


# --- a fresh round of hostile files, folders and labels ----------------------------------

DATA = Path(__file__).parent / "data" / "runs" / "torch-2.13.0"


def main_here(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = cli.main([*map(str, args)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


def copied_run(tmp_path: Path, name: str = "run") -> Path:
    run_dir = tmp_path / name
    shutil.copytree(DATA, run_dir)
    return run_dir


@pytest.mark.parametrize("name", [storage.CELLS_FILE, storage.ENV_FILE, storage.RUN_PLAN_FILE])
def test_a_run_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path: Path, name: str) -> None:
    """A FIFO for ``cells.jsonl`` or ``env.json``: ``report`` waited for ever on its read."""
    run_dir = copied_run(tmp_path)
    (run_dir / name).unlink(missing_ok=True)
    os.mkfifo(run_dir / name)
    with pytest.raises(storage.ResultsError, match="not a regular file; refusing it"):
        storage.run_file(run_dir, name)
    problems: list[str] = []
    if name == storage.CELLS_FILE:
        assert storage.read_records(run_dir, problems) == []
        assert problems == [f"{run_dir / name}: not a regular file; refusing it"]


def test_the_files_of_a_run_folder_are_still_read(tmp_path: Path) -> None:
    """No false refusal: a run's regular files, and a link inside the folder."""
    run_dir = copied_run(tmp_path)
    assert storage.read_records(run_dir) and storage.read_env(run_dir).torch_version
    (run_dir / "env-copy.json").symlink_to(run_dir / storage.ENV_FILE)
    assert storage.run_file(run_dir, "env-copy.json") == run_dir / "env-copy.json"


@pytest.mark.parametrize("how", ["same", "trailing slash", "link"])
def test_compare_of_a_run_with_itself_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str
) -> None:
    """``compare RUN RUN`` said "no outcome changes" and exited 0: a gate on nothing."""
    run_dir = copied_run(tmp_path)
    other = {"same": run_dir, "trailing slash": Path(f"{run_dir}/"), "link": tmp_path / "ln"}
    if how == "link":
        other[how].symlink_to(run_dir)
    code, _, err = main_here(capsys, "compare", run_dir, other[how])
    assert code == ERROR
    assert errors_of(err) == [f"ampmatrix: error: {run_dir}: the same run on both sides: "
                              "compared with itself, nothing could fail"]  # fmt: skip


def test_a_nightly_against_itself_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``nightly-verdict TONIGHT TONIGHT`` passed: "1 environments compared"."""
    tonight = tmp_path / "tonight"
    copied_run(tonight, "20261125T030000-torch2.13.0")
    code, out, err = main_here(
        capsys, "nightly-verdict", tonight, tonight, "--out", tmp_path / "n.html"
    )
    assert code == ERROR and "nightly verdict: pass" not in out
    (line,) = errors_of(err)
    assert "the same run on both sides" in line


def test_a_report_with_its_own_run_as_baseline_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``report RUN --baseline RUN`` showed "No outcome changes"."""
    run_dir = copied_run(tmp_path)
    code, _, err = main_here(
        capsys, "report", run_dir, "--baseline", run_dir, "--out", tmp_path / "r.html"
    )
    assert code == ERROR and len(errors_of(err)) == 1
    assert not (tmp_path / "r.html").exists()


def test_two_copies_of_a_run_still_compare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No false refusal: the check is on the folder, not on what the runs hold."""
    code, out, _ = main_here(
        capsys, "compare", copied_run(tmp_path, "a"), copied_run(tmp_path, "b")
    )
    assert code == 0 and "no outcome changes" in out


def errors_of(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("ampmatrix: error: ")]


@pytest.mark.parametrize("expect", [["bfloat16"], "bfloat16", ("bfloat16", "raises")])
def test_an_expect_that_is_not_a_dict_is_a_model_check_error(expect: Any) -> None:
    """``expect=["bfloat16"]`` or a bare label: an AttributeError at collection."""
    with pytest.raises(ModelCheckError, match="a dict of axis values to an outcome label"):
        parse_expect(expect)


@pytest.mark.parametrize(
    ("make", "problem"),
    [
        (os.mkfifo, "not a regular file"),
        (Path.mkdir, "not a regular file"),
        (lambda path: path.write_text("[1, 2]"), "expected a JSON object, got list"),
        (lambda path: path.write_text("{"), "not valid JSON"),
    ],
)
def test_a_peaks_cache_that_cannot_be_used_is_named_and_ignored(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    make: Callable[[Path], object],
    problem: str,
) -> None:
    """A FIFO for the peaks cache made every timed run wait for ever; a cache that is a
    list or not JSON was ignored with no word."""
    monkeypatch.setenv(env_vars.CACHE_DIR.name, str(tmp_path))
    path = tmp_path / peaks.CACHE_FILE
    make(path)
    assert peaks.read_cache() == {}
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"ampmatrix: warning: {path}: {problem}") and "measured again" in line
    assert peaks.read_cache(say=False) == {} and capsys.readouterr().err == ""
