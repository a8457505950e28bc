"""The nightly's verdict (``nightly-verdict TONIGHT [LAST]``) on stored runs of two nights,
each night two torch releases on two GPU kinds: a fix that stopped passing fails naming its
cell and environment, a new unexpected error fails, an expected change (the upstream path
now reproducing its case's known failure) passes, two identical nights pass, and so does a
first night with nothing to compare."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from harness import cli
from harness.report.compare import Change
from harness.report.nightly import Judgement, judge
from harness.results import storage
from harness.schema.records import CellRecord, Outcome
from harness.schema.text import markdown_safe

DATA = Path(__file__).parent / "data" / "runs"
RELEASES = {"2.13.0": DATA / "torch-2.13.0", "2.4.1": DATA / "torch-2.4.1"}
GPUS = ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3")
#: The exit codes: a failing change, and cells tonight has no record of.
FAILED, MISSING = 1, 3

Record = dict[str, Any]


def run_name(release: str, gpu: str) -> str:
    return f"20261125T0300-torch{release}-{gpu.split()[1].lower()}"


def night(root: Path) -> Path:
    """One night's results: every stored release on every GPU kind, one run each (as the
    jobs' artifacts land in one folder)."""
    for release, stored in RELEASES.items():
        for gpu in GPUS:
            run = root / run_name(release, gpu)
            shutil.copytree(stored, run)
            env = storage.read_env(run)
            storage.write_env(run, replace(env, gpus=[{"name": gpu}]))
    return root


def edit_cell(run: Path, chosen: Callable[[Record], bool], **fields: Any) -> str:
    """Change the cell of the first record ``chosen`` picks in a run (each of its records:
    the timing phase writes a cell's record again); the cell's id."""
    path = run / storage.CELLS_FILE
    records = [json.loads(line) for line in path.read_text().splitlines()]
    cells = [CellRecord.from_dict(r).cell for r in records]
    cell = cells[next(i for i, r in enumerate(records) if chosen(r))]
    for record, its_cell in zip(records, cells, strict=True):
        if its_cell == cell:
            record.update(fields)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return cell.id


def passing(fix: str, dtype: str = "float16", mode: str = "half") -> Callable[[Record], bool]:
    def chosen(r: Record) -> bool:
        return (r["case"], r["fix"], r["dtype"], r["mode"], r["outcome"]) == (
            "dia-sdpa-kv-cache",
            fix,
            dtype,
            mode,
            "passes",
        )

    return chosen


KNOWN_FAILURE = {
    "outcome": "raises",
    "reproduces": True,
    "error_type": "RuntimeError",
    "error_message": "Expected query, key, and value to have the same dtype",
}
OTHER_ERROR = {
    "outcome": "raises",
    "reproduces": False,
    "error_type": "ValueError",
    "error_message": "a shape nobody expected",
}


@pytest.fixture
def nights(tmp_path: Path) -> tuple[Path, Path]:
    return night(tmp_path / "last"), night(tmp_path / "tonight")


def verdict(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: object
) -> tuple[int, str, str]:
    out = tmp_path / "reports" / "nightly.html"
    code = cli.main(["nightly-verdict", *map(str, args), "--out", str(out)])
    stdout, stderr = capsys.readouterr()
    assert out.exists(), stderr  # tonight's report, whatever the verdict
    return code, stdout, stderr


def failing_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("FAIL ")]


def test_two_identical_nights_pass(
    nights: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    last, tonight = nights
    summary = tmp_path / "summary.md"
    code, out, err = verdict(capsys, tmp_path, tonight, last, "--markdown", summary)
    assert code == 0, out + err
    assert failing_lines(out) == []
    assert "nightly verdict: pass: 4 environments compared with last night" in out
    assert "4 runs" in out  # one report over every release and GPU
    text = summary.read_text()
    assert "### Against last night" in text and "nightly verdict: pass" in text
    # the noise each environment's speed was judged against, said once per device
    noise = [line for line in out.splitlines() if "judged against this pair's" in line]
    noise += [line for line in out.splitlines() if "no machine factor" in line]
    assert noise and all(line.startswith("torch ") for line in noise)
    assert all(f"- {markdown_safe(line)}" in text for line in noise)  # shown as said


def test_a_fix_that_stopped_passing_fails_naming_its_cell_and_environment(
    nights: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fix now raises the very failure it fixes, on one GPU of one release: that is a
    regression (the upstream path may reproduce it, a fix may not)."""
    last, tonight = nights
    h100 = tonight / run_name("2.13.0", GPUS[1])
    cell = edit_cell(h100, passing("cast-kv-to-q"), **KNOWN_FAILURE)
    code, out, _ = verdict(capsys, tmp_path, tonight, last)
    assert code == FAILED
    (line,) = failing_lines(out)
    assert f"stopped passing: {cell} on torch 2.13.0" in line
    assert "H100" in line and "passes -> raises:repro" in line
    assert "nightly verdict: FAIL" in out and "1 stopped passing" in out


def test_a_new_unexpected_error_fails(
    nights: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The upstream path raised its known failure last night and tonight raises another
    error: not a fix that stopped passing, but a new error all the same."""
    last, tonight = nights
    a100 = tonight / run_name("2.4.1", GPUS[0])

    def reproducing(r: Record) -> bool:
        return r["outcome"] == "raises" and r["reproduces"] is True

    cell = edit_cell(a100, reproducing, **OTHER_ERROR)
    code, out, _ = verdict(capsys, tmp_path, tonight, last)
    assert code == FAILED
    (line,) = failing_lines(out)
    assert f"new error: {cell} on torch 2.4.1" in line and "A100" in line
    assert "raises:repro -> raises:OTHER" in line


def test_the_upstream_path_reproducing_its_known_failure_is_expected(
    nights: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    last, tonight = nights
    summary = tmp_path / "summary.md"
    runs = [tonight / run_name("2.13.0", gpu) for gpu in GPUS]
    cells = {edit_cell(run, passing("none"), **KNOWN_FAILURE) for run in runs}
    code, out, err = verdict(capsys, tmp_path, tonight, last, "--markdown", summary)
    assert code == 0, out + err
    assert failing_lines(out) == []
    (cell,) = cells
    assert sum(f"expected: {cell} on torch 2.13.0" in line for line in out.splitlines()) == 2
    assert "2 expected" in out
    assert f"| expected | {cell} |" in summary.read_text().replace("\\[", "[").replace("\\]", "]")


def test_the_float32_control_reproducing_the_failure_is_not_expected(
    nights: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    last, tonight = nights
    run = tonight / run_name("2.4.1", GPUS[1])
    cell = edit_cell(run, passing("none", "float32", "fp32"), **KNOWN_FAILURE)
    code, out, _ = verdict(capsys, tmp_path, tonight, last)
    assert code == FAILED
    assert [f"stopped passing: {cell}" in line for line in failing_lines(out)] == [True]


def test_a_first_night_says_there_is_nothing_to_compare_and_passes(
    nights: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _, tonight = nights
    code, out, _ = verdict(capsys, tmp_path, tonight)
    assert code == 0
    assert "no last night's results: nothing to compare" in out


def test_a_job_that_left_no_run_fails_unless_allowed(
    nights: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Tonight the H100 job of torch 2.4.1 uploaded nothing: every cell of its last run is
    missing (exit 3), named; ``--allow-missing`` passes the night and still names them."""
    last, tonight = nights
    shutil.rmtree(tonight / run_name("2.4.1", GPUS[1]))
    lost = last / run_name("2.4.1", GPUS[1])
    code, out, err = verdict(capsys, tmp_path, tonight, last)
    assert code == MISSING
    assert f"cells of {lost} have no record in {tonight}" in err
    assert "3 environments compared" in out and "nightly verdict: FAIL" in out
    code, out, err = verdict(capsys, tmp_path, tonight, last, "--allow-missing")
    assert code == 0 and "allowed by --allow-missing" in err
    assert "nightly verdict: pass" in out


def test_tonight_without_a_run_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    code = cli.main(["nightly-verdict", str(tmp_path / "empty")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip() == f"ampmatrix: error: {tmp_path / 'empty'}: no run folder in it " + (
        "(expected tonight's runs)"
    )


def stored(fix: str, mode: str, outcome: Outcome, reproduces: bool | None = None) -> CellRecord:
    """A record of the stored run with the given fix and mode, its outcome replaced."""
    record = next(
        r
        for r in storage.read_records(RELEASES["2.13.0"])
        if (r.cell.fix, r.cell.mode) == (fix, mode)
    )
    return replace(record, outcome=outcome, reproduces=reproduces)


PASSES, RAISES, CRASHED = Outcome.PASSES, Outcome.RAISES, Outcome.CRASHED
SKIPPED, INACCURATE = Outcome.SKIPPED, Outcome.INACCURATE


@pytest.mark.parametrize(
    ("fix", "mode", "last", "tonight", "judgement"),
    [
        ("none", "half", (PASSES, None), (RAISES, True), Judgement.EXPECTED),
        ("none", "half", (SKIPPED, None), (RAISES, True), Judgement.EXPECTED),
        ("none", "fp32", (PASSES, None), (RAISES, True), Judgement.STOPPED_PASSING),
        ("cast-kv-to-q", "half", (PASSES, None), (RAISES, True), Judgement.STOPPED_PASSING),
        ("cast-kv-to-q", "half", (PASSES, None), (SKIPPED, None), Judgement.STOPPED_PASSING),
        ("cast-kv-to-q", "half", (PASSES, None), (INACCURATE, None), Judgement.STOPPED_PASSING),
        ("cast-kv-to-q", "half", (PASSES, None), (RAISES, False), Judgement.NEW_ERROR),
        ("cast-kv-to-q", "half", (INACCURATE, None), (CRASHED, None), Judgement.NEW_ERROR),
        ("none", "half", (RAISES, True), (RAISES, False), Judgement.NEW_ERROR),
        ("cast-kv-to-q", "half", (RAISES, False), (PASSES, None), Judgement.OTHER),
        ("cast-kv-to-q", "half", (SKIPPED, None), (INACCURATE, None), Judgement.OTHER),
        ("none", "half", (RAISES, True), (PASSES, None), Judgement.OTHER),
    ],
)
def test_what_each_change_of_outcome_means(
    fix: str,
    mode: str,
    last: tuple[Outcome, bool | None],
    tonight: tuple[Outcome, bool | None],
    judgement: Judgement,
) -> None:
    before, after = stored(fix, mode, *last), stored(fix, mode, *tonight)
    change = Change(after.cell, "outcome", last[0].value, tonight[0].value, "changed")
    assert judge(change, before, after) is judgement


@pytest.mark.parametrize(
    ("verdict", "judgement"),
    [
        ("regression", Judgement.SLOWER),
        ("improvement", Judgement.OTHER),
        ("ambiguous", Judgement.OTHER),
    ],
)
def test_only_a_speed_regression_beyond_the_noise_fails(
    verdict: str, judgement: Judgement
) -> None:
    record = stored("cast-kv-to-q", "half", PASSES)
    change = Change(record.cell, "speed", "1 ms", "2 ms (2.00x)", verdict)
    assert judge(change, record, record) is judgement


def test_a_damaged_line_of_last_night_is_named_and_the_rest_compared(
    nights: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    last, tonight = nights
    run = last / run_name("2.13.0", GPUS[0])
    with (run / storage.CELLS_FILE).open("a") as cells:
        cells.write('{"outcome": "passes", "case": \n')
    code, out, err = verdict(capsys, tmp_path, tonight, last)
    assert code == 0, out + err
    (warning,) = [line for line in err.splitlines() if "warning" in line]
    assert str(run / storage.CELLS_FILE) in warning
    assert "nightly verdict: pass: 4 environments compared" in out
