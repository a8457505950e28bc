"""``compare BASE HEAD`` as a regression gate that cannot pass by losing data: a cell of
BASE with no record in HEAD fails it (exit 3, the cells named) unless ``--allow-missing``."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from harness import cli
from harness.report.compare import NAMED_MISSING
from harness.results import storage
from harness.schema.records import CellRecord

DATA = Path(__file__).parent / "data" / "runs"
NEW = DATA / "torch-2.13.0"
#: The exit code of a compare whose HEAD lacks cells of BASE (as a run that left planned
#: cells without a record).
MISSING = 3


def run_keeping(folder: Path, lines: int | None) -> Path:
    """A copy of a stored run with only the first ``lines`` records (None: all of them)."""
    shutil.copytree(NEW, folder)
    cells = folder / storage.CELLS_FILE
    kept = cells.read_text().splitlines()[:lines]
    cells.write_text("".join(f"{line}\n" for line in kept))
    return folder


def run_without(folder: Path, cells: int) -> tuple[Path, set[str]]:
    """A copy of a stored run without any line of its last ``cells`` cells, and their ids."""
    run_keeping(folder, None)
    lost = {record.cell.id for record in storage.read_records(folder)[-cells:]}
    path = folder / storage.CELLS_FILE
    lines = zip(path.read_text().splitlines(), storage.read_record_lines(folder), strict=True)
    kept = [line for line, record in lines if record.cell.id not in lost]
    path.write_text("".join(f"{line}\n" for line in kept))
    return folder, lost


def compare(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = cli.main(["compare", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def cell_count(run_dir: Path) -> int:
    return len(storage.read_records(run_dir))


def test_a_head_that_lost_every_cell_fails_the_gate_naming_the_cells(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, head = run_keeping(tmp_path / "base", None), run_keeping(tmp_path / "head", 0)
    total = cell_count(base)
    code, _, err = compare(capsys, base, head)
    assert code == MISSING, err
    (line,) = [line for line in err.splitlines() if line.startswith("ampmatrix: error:")]
    assert f"{total} cells of {base} have no record in {head}" in line
    first = sorted(r.cell for r in storage.read_records(base))[0]
    assert first.id in line
    assert line.endswith(f"... and {total - NAMED_MISSING} more (--allow-missing accepts it)")
    assert "Traceback" not in err


def test_a_head_that_lost_a_few_cells_names_each_of_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = run_keeping(tmp_path / "base", None)
    head, lost = run_without(tmp_path / "head", 2)
    code, _, err = compare(capsys, base, head)
    assert code == MISSING
    assert f"{len(lost)} cells of {base} have no record in {head}: " in err
    assert all(cell in err for cell in lost) and "more" not in err


def test_allow_missing_passes_the_gate_and_still_says_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, head = run_keeping(tmp_path / "base", None), run_keeping(tmp_path / "head", 5)
    code, _, err = compare(capsys, base, head, "--allow-missing")
    assert code == 0
    assert re.search(rf"ampmatrix: \d+ cells of {re.escape(str(base))} have no record", err)
    assert "allowed by --allow-missing" in err and "error" not in err


def test_a_head_that_kept_every_cell_passes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, head = run_keeping(tmp_path / "base", 5), run_keeping(tmp_path / "head", None)
    code, out, err = compare(capsys, base, head)  # cells only in HEAD lose nothing
    assert code == 0, err
    assert "only in head" in out and "no record" not in err


def test_a_results_folder_without_a_run_of_a_base_environment_fails_the_gate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A nightly whose run of one release broke before it wrote anything: HEAD has no run
    of that environment, and every cell of BASE's is missing. (A HEAD without any run is
    refused outright: ``tests/test_gates.py``.)"""
    base_root, head_root = tmp_path / "base", tmp_path / "head"
    base_root.mkdir()
    head_root.mkdir()
    base = run_keeping(base_root / "20260101T000000-torch-2.13.0", None)
    other = run_keeping(head_root / "20260102T000000-torch-2.13.0", None)
    storage.write_env(other, replace(storage.read_env(other), hostname="another-host"))
    code, _, err = compare(capsys, base_root, head_root)
    assert code == MISSING, err
    assert f"{cell_count(base)} cells of {base} have no record in {head_root}" in err
    assert f"no run of torch {storage.read_env(base).torch_version}" in err


def test_a_regression_exits_1_even_where_cells_are_missing_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base, head = run_keeping(tmp_path / "base", None), run_keeping(tmp_path / "head", 3)
    cells = head / storage.CELLS_FILE
    lines = cells.read_text().splitlines()
    passing = next(i for i, line in enumerate(lines) if '"outcome": "passes"' in line)
    lines[passing] = lines[passing].replace('"outcome": "passes"', '"outcome": "crashed"')
    cells.write_text("".join(f"{line}\n" for line in lines))
    code, out, err = compare(capsys, base, head)
    assert code == 1 and "REGRESSION" in out
    assert "have no record" in err


def test_the_help_of_compare_documents_allow_missing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    assert "--allow-missing" in capsys.readouterr().out


@pytest.mark.parametrize("median", [0.0, -1.0, float("nan"), float("inf")])
def test_a_median_that_is_no_positive_finite_time_is_no_speed_change(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], median: float
) -> None:
    """A damaged or hand-made record's median (0 s divided by) compares nothing, in
    either direction, and the rest of the runs still do."""
    base, head = run_keeping(tmp_path / "base", None), run_keeping(tmp_path / "head", None)
    cells = base / storage.CELLS_FILE
    lines = cells.read_text().splitlines()
    timed = next(i for i, line in enumerate(lines) if '"time_median_s": null' not in line)
    record = json.loads(lines[timed])
    record["time_median_s"] = median
    lines[timed] = json.dumps(record)
    cells.write_text("".join(f"{line}\n" for line in lines))
    cell = CellRecord.from_dict(record).cell.id
    for args in ((base, head), (head, base)):
        code, out, err = compare(capsys, *args)
        assert code == 0, err
        assert not [line for line in out.splitlines() if cell in line and " speed " in line]
        assert "0 regression" in out
