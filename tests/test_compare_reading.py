"""How ``compare`` reads and pairs runs fast (issue 42): a run of the current schema read as
columns gives the records that parsing it line by line gives (``runs.read_records``), a
line that cannot be read still falls back to the reading that names it, and many pairs
compared by one process per core give what one process gives, in order."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness.report import compare, runs
from harness.results import storage
from harness.results.columns import parsed_run
from harness.schema.records import CellRecord

DATA = Path(__file__).parent / "data" / "runs"


def current_copy(source: Path, folder: Path) -> Path:
    """``source`` rewritten as the current schema writes it (the stored runs are older)."""
    folder.mkdir(parents=True)
    for name in (storage.ENV_FILE, storage.CASES_FILE):
        shutil.copy(source / name, folder / name)
    lines = (source / storage.CELLS_FILE).read_text().splitlines()
    records = [CellRecord.from_dict(json.loads(line)).to_dict() for line in lines]
    (folder / storage.CELLS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


def as_json(records: list[CellRecord]) -> list[str]:
    return [json.dumps(r.to_dict(), sort_keys=True) for r in records]


def test_records_read_as_columns_are_those_read_line_by_line(tmp_path: Path) -> None:
    for source in sorted(DATA.iterdir()):
        run = current_copy(source, tmp_path / source.name)
        assert parsed_run(run) is not None  # read as columns, not by the fallback
        fast = runs.read_records(run, [])
        assert fast and as_json(fast) == as_json(storage.read_records(run))


def test_a_line_that_cannot_be_read_is_named_as_before(tmp_path: Path) -> None:
    run = current_copy(DATA / "torch-2.13.0", tmp_path / "run")
    with (run / storage.CELLS_FILE).open("a") as f:
        f.write('{"schema_version": 6, "case": 3}\n')
    problems: list[str] = []
    records = runs.read_records(run, problems)
    assert len(problems) == 1 and f"{storage.CELLS_FILE}:" in problems[0]
    assert as_json(records) == as_json(storage.read_records(run, []))


def test_pairs_compared_by_several_processes_are_those_of_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compare, "PARALLEL_BYTES", 0)  # these small runs too
    pairs = []
    for n in range(4):
        base = current_copy(DATA / "torch-2.4.1", tmp_path / f"base{n}")
        head = current_copy(DATA / "torch-2.13.0", tmp_path / f"head{n}")
        pairs.append((base, head))
    one = list(compare.compared_pairs(pairs, processes=1))
    several = list(compare.compared_pairs(pairs, processes=2))
    assert [p.base for p in several] == [b for b, _ in pairs]
    assert [compare.render_comparison(p.comparison) for p in several] == [
        compare.render_comparison(p.comparison) for p in one
    ]
    assert [p.with_nothing for p in several] == [p.with_nothing for p in one]
    assert any(p.comparison.changes for p in one)
