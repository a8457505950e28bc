"""Hypothesis fuzz of what the harness shows of outside text (issue 41): hostile text in
env.json (a GPU's name, the host), in the records (case and fix names, error messages,
warnings) and in a hand-edited peaks cache. The terminal shows exactly the lines the harness
means and no raw control character; the Markdown summary and the HTML report carry no raw
tag; a cache entry is used only when it is a finite figure with a time in its zone."""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.measure.figures import peaks
from harness.report.aggregate import load_runs
from harness.report.compare import Change, describe_key, environment_key
from harness.report.markdown import render_markdown
from harness.report.nightly import (
    Judged,
    Judgement,
    NightVerdict,
    render_verdict,
    render_verdict_markdown,
)
from harness.report.writing import render_report
from harness.results import storage
from harness.results.summary import render_summary
from tests.test_fuzz_hostile import examples, hostile_text, json_scalars
from tests.test_inert_text import RAW_CONTROL, RAW_TAG

DATA = Path(__file__).parent / "data" / "runs"
STORED = DATA / "torch-2.13.0"
#: A record refuses a lone surrogate (no text can hold one); the records get the rest.
record_text = hostile_text.map(lambda text: re.sub("[\ud800-\udfff]", "?", text))


def hostile_verdict(text: str) -> NightVerdict:
    """A night of one failing and one other change and two noise lines, every name in it
    (the environment from env.json's GPU and host, the cell's case and fix, the outcomes)
    carrying ``text``."""
    env = replace(storage.read_env(STORED), gpus=[{"name": f"H100{text}"}], hostname=text)
    where = describe_key(environment_key(env))
    record = storage.read_records(STORED)[0]
    cell = replace(record.cell, case=f"case{text}", fix=f"fix{text}")
    changes = [Change(cell, "outcome", f"passes{text}", f"raises{text}", "regression")] * 2
    return NightVerdict(
        judged=[
            Judged(where, changes[0], Judgement.STOPPED_PASSING),
            Judged(where, changes[1], Judgement.OTHER),
        ],
        noise=[f"{where}: speed on cpu{text}", f"{where}: no machine factor"],
        compared=1,
        cells_compared=2,
    )


@examples(60)
@given(text=hostile_text)
def test_the_nightly_verdict_has_its_lines_whatever_the_names(text: str) -> None:
    """Two judged changes, two noise lines and the verdict: five terminal lines, the real
    verdict last, no raw control; the Markdown as many lines as for plain names, no raw
    tag or control."""
    verdict = hostile_verdict(text)
    lines = render_verdict(verdict).split("\n")
    assert len(lines) == 5, lines
    assert lines[-1].startswith("nightly verdict: FAIL")
    assert not RAW_CONTROL.findall("\n".join(lines))
    markdown = render_verdict_markdown(verdict)
    plain = render_verdict_markdown(hostile_verdict("plain"))
    assert markdown.count("\n") == plain.count("\n")
    assert not RAW_TAG.search(markdown) and not RAW_CONTROL.findall(markdown)


@contextmanager
def hostile_copy(text: str) -> Iterator[Path]:
    """The stored run with ``text`` in its records' names, errors and warnings and in its
    env.json's GPU and host, in a folder of its own (hypothesis runs many examples in one
    test)."""
    with tempfile.TemporaryDirectory() as folder:
        run = Path(folder) / "run"
        shutil.copytree(STORED, run)
        cells = run / storage.CELLS_FILE
        records = [json.loads(line) for line in cells.read_text().splitlines()]
        for record in records:
            record["case"] += text
            record["fix"] += text if record["fix"] != "none" else ""
            if record["error_message"] is not None:
                record["error_message"] += text
            record["warnings"] = [f"warned{text}"]
        cells.write_text("".join(f"{json.dumps(r)}\n" for r in records))
        env = json.loads((run / storage.ENV_FILE).read_text())
        env["gpus"], env["hostname"] = [{"name": f"H100{text}"}], f"host{text}"
        (run / storage.ENV_FILE).write_text(json.dumps(env))
        yield run


def outputs(text: str) -> tuple[str, str]:
    """The run's terminal summary and its Markdown summary."""
    with hostile_copy(text) as run:
        records = storage.read_records(run)
        names = {r.cell.device: f"H100{text}" for r in records}
        return render_summary(records, names), render_markdown(load_runs([run]))


PLAIN = outputs("plain")


@examples(25)
@given(text=record_text)
def test_the_summaries_keep_their_lines_whatever_the_records_say(text: str) -> None:
    """The run's summary has as many lines as with plain names, none raw; the Markdown
    summary too, with no raw tag."""
    summary, markdown = outputs(text)
    assert summary.count("\n") == PLAIN[0].count("\n")
    assert not RAW_CONTROL.findall(summary)
    assert markdown.count("\n") == PLAIN[1].count("\n")
    assert not RAW_TAG.search(markdown) and not RAW_CONTROL.findall(markdown)


@examples(6)
@given(text=record_text)
def test_the_html_report_escapes_whatever_the_records_say(text: str) -> None:
    """No tag of the records' or env.json's text reaches the page: it has no ``<img`` (its
    own plots are inline SVG)."""
    with hostile_copy(text) as run:
        page = render_report(load_runs([run]))
    assert "<img" not in page
    assert "<script>alert" not in page


# --- the peaks cache ------------------------------------------------------------------------

NOW = datetime(2026, 11, 27, tzinfo=timezone.utc)

#: A time as a hand-edited cache may hold it: with a zone, naive, in the future, not a time.
times = st.one_of(
    st.datetimes(timezones=st.just(timezone.utc)).map(datetime.isoformat),
    st.datetimes().map(datetime.isoformat),
    st.just((NOW + timedelta(days=3)).isoformat()),
    json_scalars,
)
entries = st.one_of(
    st.fixed_dictionaries({"gflops": json_scalars, "measured_at": times}),
    st.fixed_dictionaries({"gflops": st.floats(), "measured_at": times}),
    json_scalars,
    st.lists(json_scalars, max_size=2),
)


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("AMPMATRIX_CACHE_DIR", str(tmp_path))
    return tmp_path


@examples(150)
@given(entry=entries)
def test_a_cached_peak_is_used_only_when_sound(
    entry: Any, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Whatever a hand-edited entry holds: no exception, and a peak used only as a finite
    figure in range measured at a time with its zone, not after now; an entry refused is
    named in one warning line (a file that is not text, a lone surrogate in it, is named by
    its file)."""
    try:
        text = json.dumps({"k": entry})
    except (ValueError, OverflowError):
        return
    (cache_dir / peaks.CACHE_FILE).write_text(text)
    capsys.readouterr()
    found = peaks.cached_peak("k", now=NOW)
    warned = capsys.readouterr().err
    if found is None:  # the entry refused by its key, or the whole file by its name
        named = "'k'" in warned or peaks.CACHE_FILE in warned
        assert warned == "" or (warned.count("\n") == 1 and named)
        return
    assert warned == ""
    assert math.isfinite(found["gflops"]) and 0 < found["gflops"] <= peaks.MAX_GFLOPS
    measured = datetime.fromisoformat(found["measured_at"])
    assert measured.utcoffset() is not None and measured <= NOW
