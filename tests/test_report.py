"""Report aggregation and compare, against golden files from stored result sets; the HTML
report's escaping, tolerance of bad input, and a look at it in a real browser."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from harness.report import aggregate, case_tables, grouping
from harness.report.compare import compare_runs, render_comparison
from harness.report.markdown import render_markdown
from harness.report.writing import render_report, write_report
from harness.results import storage
from harness.results.computed_in import ComputedIn
from harness.schema.records import Flag, FlagKind
from harness.schema.run_files import Environment
from harness.schema.trail_records import Promotion, Site, Trail
from tests.conftest import harness

DATA = Path(__file__).parent / "data" / "runs"
GOLDEN = Path(__file__).parent / "golden"
OLD, NEW = DATA / "torch-2.4.1", DATA / "torch-2.13.0"
ROOT = Path(__file__).resolve().parent.parent
#: How a case's error-vs-time picture (an inline SVG) begins.
PLOT = '<svg xmlns="http://www.w3.org/2000/svg" class="error-time"'


def check_golden(name: str, text: str) -> None:
    """Compare with the stored golden file; AMPMATRIX_UPDATE_GOLDEN=1 rewrites it."""
    path = GOLDEN / name
    if os.environ.get("AMPMATRIX_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


@pytest.fixture(scope="module")
def frame():
    return aggregate.records_frame(aggregate.load_runs([OLD, NEW]))


def test_summary_matrix_golden(frame) -> None:
    check_golden("summary_matrix.csv", aggregate.summary_matrix(frame).fillna("-").to_csv())


def test_version_view_golden(frame) -> None:
    view = aggregate.version_view(frame)
    assert list(view.columns) == ["2.4.1+cu121", "2.13.0+cpu"]  # 2.4 sorts before 2.13
    check_golden("version_view.csv", view.to_csv())


def test_first_passing_release_golden(frame) -> None:
    view = aggregate.passing_by_version(frame)
    assert list(view.columns) == ["2.4.1+cu121", "2.13.0+cpu", "first passing"]
    check_golden("first_passing.csv", view.to_csv())


def test_first_passing_needs_every_later_release_to_pass() -> None:
    def cells(*labels: str) -> tuple[int, int]:
        """(cells passing with no flag, cells that ran) of one release."""
        return sum(label == "passes" for label in labels), len(labels)

    first = aggregate._first_passing
    assert first({"2.1": cells("raises:repro"), "2.4": cells("passes")}) == "2.4"
    assert first({"2.1": cells("passes"), "2.4": cells("passes", "passes")}) == (
        "passes on every release from 2.1"
    )
    regressed = {"2.1": cells("passes"), "2.4": cells("passes", "inaccurate")}
    assert first(regressed) == "fails on every release through 2.4"
    flagged = {"2.1": cells("raises:repro"), "2.4": cells("passes[drift]"), "2.5": cells("passes")}
    assert first(flagged) == "2.5"
    assert first({"2.1": cells(), "2.4": cells("passes")}) == "passes on every release from 2.4"


def test_markdown_summary_golden(tmp_path: Path) -> None:
    """`report --markdown` appends (a job summary holds every step's part) the golden text."""
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    runs = [str(DATA / name) for name in ("torch-2.4.1", "torch-2.13.0")]
    result = harness(
        "report", *runs, "--out", str(tmp_path / "r.html"), "--markdown", str(summary)
    )
    assert result.returncode == 0, result.stderr
    text = summary.read_text()
    assert text.startswith("earlier step\n")
    check_golden("summary.md", text.removeprefix("earlier step\n"))


def test_recommendations_golden(frame) -> None:
    lines = [
        f"{r.case}: {r.fix}: {r.reason}\n  criterion: {r.criterion}\n"
        + "".join(f"  not recommended: {cost}\n" for cost in r.fallbacks)
        for r in (aggregate.recommend(frame, c) for c in sorted(frame["case"].unique()))
    ]
    check_golden("recommendations.txt", "".join(lines))


def test_no_recommendation_is_an_fp32_fallback_while_a_half_fix_passes(frame) -> None:
    """Dia's ``fp32`` fix passes everywhere and used to win on a CPU, where half arithmetic
    is slow; it runs the attention in float32, so it is named as a fallback instead."""
    dia = aggregate.recommend(frame, "dia-sdpa-kv-cache")
    assert dia.fix != "fp32" and dia.fix is not None
    assert dia.criterion == aggregate.CRITERION
    assert "fp32" in [c.split(":")[0] for c in dia.fallbacks]
    assert all("passes by falling back to fp32" in cost for cost in dia.fallbacks)
    levels = aggregate.precision_by_fix(frame[frame["case"] == "dia-sdpa-kv-cache"])
    assert levels["fp32"] is ComputedIn.FALLBACK and levels[dia.fix] is ComputedIn.HALF


def narrowed_runs(root: Path) -> list[Path]:
    """Both stored runs, where Sana's ``sdpa`` ran only its ``autocast`` cells (a fix
    narrowed to the mode it passes in) and a twin of the upstream path,
    ``upstream-under-autocast``, ran only the ``autocast`` cells, where ``none`` passes."""
    runs = []
    for source in (OLD, NEW):
        run = root / source.name
        shutil.copytree(source, run)
        records = storage.read_records(run)
        (run / "cells.jsonl").unlink()
        sana = [r for r in records if r.cell.case == "sana-softmax-float"]
        twins = [
            dataclasses.replace(r, cell=dataclasses.replace(r.cell, fix="upstream-under-autocast"))
            for r in sana
            if r.cell.fix == "none" and r.cell.mode == "autocast"
        ]
        for record in records + twins:
            cell = record.cell
            if (cell.case, cell.fix, cell.mode) != ("sana-softmax-float", "sdpa", "half"):
                storage.append_record(run, record)
        runs.append(run)
    return runs


def test_no_fix_that_ran_fewer_cells_than_the_others_is_recommended(tmp_path: Path) -> None:
    """A fix that passes every cell it ran, but ran fewer than the upstream path and the
    other fixes, says nothing of the cells it never ran: ``sdpa`` and the upstream path's
    twin (each 4 cells, ``autocast`` only) are named with what they missed, and the fix
    recommended ran all 8 (before, ``sdpa`` was: "passes in all 4 cells")."""
    loaded = aggregate.load_runs(narrowed_runs(tmp_path))
    frame = aggregate.records_frame(loaded)
    found = aggregate.recommend(frame, "sana-softmax-float")
    assert found.fix not in (None, "sdpa", "upstream-under-autocast")
    assert "passes in all 8 cells" in found.reason
    assert [fix for fix, _ in found.narrower] == ["sdpa", "upstream-under-autocast"]
    sana = frame[frame["case"] == "sana-softmax-float"]
    assert {"sdpa", "upstream-under-autocast"}.isdisjoint(aggregate.fixes_passing_everywhere(sana))
    lines = [
        f"{found.fix}: {found.reason}",
        *(f"  not recommended: {f}: {why}" for f, why in found.narrower),
    ]
    check_golden("recommendations_narrowed.txt", "\n".join(lines) + "\n")
    html = render_report(loaded)
    assert "Not recommended: <strong>sdpa</strong>: passes in the 4 cells it ran, of the 8" in html
    summary = render_markdown(loaded)
    assert (
        "| sana-softmax-float | upstream-under-autocast | not recommended | passes in the 4"
        in summary
    )


def test_compare_golden() -> None:
    comparison = compare_runs(aggregate.load_run(OLD), aggregate.load_run(NEW))
    check_golden("compare.txt", render_comparison(comparison) + "\n")
    changed = {c.cell.id: c.verdict for c in comparison.changes if c.kind == "outcome"}
    assert changed["dia-sdpa-kv-cache[none,cpu,float16,half,sdpa]"] == "improvement"


def test_compare_exits_non_zero_on_a_regression(tmp_path: Path) -> None:
    forward = subprocess.run(
        [sys.executable, "-m", "harness", "compare", str(OLD), str(NEW)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    backward = subprocess.run(
        [sys.executable, "-m", "harness", "compare", str(NEW), str(OLD)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert "regression" in backward.stdout.lower()
    assert backward.returncode == 1
    assert forward.returncode == (1 if "REGRESSION" in forward.stdout else 0)


def test_report_over_two_versions_shows_both_side_by_side(tmp_path: Path) -> None:
    html = render_report(aggregate.load_runs([OLD, NEW]))
    assert "torch 2.4.1 · cpu" in html and "torch 2.13.0 · cpu" in html
    assert html.count(PLOT) == 2  # one plot per case
    assert "Recommended:" in html and "https://github.com/NVlabs/Sana" in html
    # one script, the summary's filters, inline: nothing the report loads from elsewhere
    assert html.count("<script") == 1 and "<script>" in html and " src=" not in html
    assert "http://" not in html.replace("http://www.w3.org", "")


def test_strings_from_runs_are_escaped(tmp_path: Path) -> None:
    run = tmp_path / "evil"
    shutil.copytree(NEW, run)
    lines = (run / storage.CELLS_FILE).read_text().splitlines()
    # the last line is a cell's final record (earlier lines of a cell are superseded)
    evil = lines[-1].replace('"note": null', '"note": "<script>alert(1)</script>"')
    evil = evil.replace('"fix": "', '"fix": "<b>x</b>')
    (run / storage.CELLS_FILE).write_text("\n".join([*lines[:-1], evil]) + "\n")
    html = render_report(aggregate.load_runs([run]))
    assert "<script>alert" not in html and "<b>x</b>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html and "&lt;b&gt;x&lt;/b&gt;" in html


@pytest.mark.parametrize(
    "url", ["javascript:alert(1)", " JavaScript:alert(1)", "data:text/html,<b>x</b>"]
)
def test_an_upstream_address_that_is_not_http_is_not_a_link(tmp_path: Path, url: str) -> None:
    run = tmp_path / "evil"
    shutil.copytree(NEW, run)
    cases = run / storage.CASES_FILE
    cases.write_text(
        cases.read_text().replace('"https://github.com/nari-labs/dia/issues/108"', json.dumps(url))
    )
    html = render_report(aggregate.load_runs([run]))
    assert not re.search(r'href="\s*(javascript|data):', html, re.IGNORECASE)
    assert "link (not linked: " in html
    assert 'href="https://github.com/nari-labs/dia"' in html  # the other links stay


def test_report_reads_everything_valid_and_names_bad_lines(tmp_path: Path) -> None:
    run = tmp_path / "damaged"
    shutil.copytree(NEW, run)
    cells = run / storage.CELLS_FILE
    good = len(storage.read_records(NEW))
    with cells.open("a") as f:
        f.write('{"schema_version": 1, "case": "trunc')
    (run / storage.ENV_FILE).unlink()
    before = cells.read_bytes()
    loaded = aggregate.load_run(run)
    assert len(loaded.records) == good
    assert any(re.search(r"cells\.jsonl:\d+:", p) for p in loaded.problems)
    assert any("env.json: missing" in p for p in loaded.problems)
    html = render_report([loaded])
    assert "Some input could not be read" in html and "cells.jsonl:" in html
    assert cells.read_bytes() == before  # input never rewritten


def test_a_byte_that_is_not_utf8_costs_only_its_line(tmp_path: Path) -> None:
    """report, compare, bisect and --resume all read records through the same reader."""
    run = tmp_path / "bytes"
    shutil.copytree(NEW, run)
    cells = run / storage.CELLS_FILE
    lines = cells.read_bytes().split(b"\n")
    lines[0] = lines[0].replace(b'"case": "', b'"case": "\xff', 1)
    cells.write_bytes(b"\n".join(lines))
    problems: list[str] = []
    records = storage.read_records(run, problems)
    assert len(problems) == 1 and problems[0].startswith(f"{cells}:1: not UTF-8 (invalid start")
    assert len(records) == len(storage.read_records(NEW))  # line 1 was superseded anyway
    for command in (("report", str(run), "--out", str(tmp_path / "r.html")),
                    ("bisect", str(run)), ("compare", str(NEW), str(run))):  # fmt: skip
        result = harness(*command)
        assert "Traceback" not in result.stderr and "not UTF-8" in result.stderr, command


def test_report_of_runs_without_timing(tmp_path: Path) -> None:
    run = tmp_path / "untimed"
    shutil.copytree(NEW, run)
    lines = (run / storage.CELLS_FILE).read_text().splitlines()
    untimed = [line for line in lines if '"time_median_s": null' in line]
    (run / storage.CELLS_FILE).write_text("\n".join(untimed) + "\n")
    frame = aggregate.records_frame(aggregate.load_runs([run]))
    assert frame["median_s"].isna().all()
    recommendation = aggregate.recommend(frame, "sana-softmax-float")
    assert recommendation.fix and "no timing in these runs" in recommendation.reason
    assert "Recommended:" in render_report(aggregate.load_runs([run]))


def test_empty_run_is_reported_not_fatal(tmp_path: Path) -> None:
    run = tmp_path / "empty"
    run.mkdir()
    storage.write_env(run, Environment(torch_version="2.13.0"))
    loaded = aggregate.load_run(run)
    assert loaded.problems == [f"{run / storage.CELLS_FILE}: no records (an empty run)"]
    assert "No cell ran" in render_report([loaded])


def test_a_report_is_written_again_but_a_foreign_index_is_left_alone(tmp_path: Path) -> None:
    html = render_report(aggregate.load_runs([NEW]))
    (tmp_path / "index.html").write_text("mine")
    write_report(html, tmp_path / "a.html")
    again = harness("report", str(NEW), "--out", str(tmp_path / "a.html"))
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "index.html").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.html", "index.html"]


def test_index_lists_reports_newest_first(tmp_path: Path) -> None:
    html = render_report(aggregate.load_runs([NEW]))
    first = write_report(html, tmp_path / "a.html")
    os.utime(first, (1, 1))
    write_report(html, tmp_path / "b.html")
    index = (tmp_path / "index.html").read_text()
    assert index.index("b.html") < index.index("a.html")


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("run/cells.jsonl", "refusing to write into the run"),
        ("run/run-plan.json", "refusing to write into the run"),
        ("base/cells.jsonl", "refusing to write into the run"),
        ("reports/index.html", "index.html is the folder's list of reports"),
        ("reports", "a folder; name the file to write"),
        ("reports/notes.html", "not an ampmatrix report; refusing to overwrite it"),
    ],
)
def test_report_cli_refuses_to_overwrite_what_it_did_not_write(
    tmp_path: Path, where: str, message: str
) -> None:
    shutil.copytree(NEW, tmp_path / "run")
    shutil.copytree(OLD, tmp_path / "base")
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "index.html").write_text("mine")
    (tmp_path / "reports" / "notes.html").write_text("<html>someone's notes</html>")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    result = harness(
        "report", str(tmp_path / "run"), "--baseline", str(tmp_path / "base"),
        "--out", str(tmp_path / where),
    )  # fmt: skip
    assert result.returncode == 2 and message in result.stderr
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


needs_chromium = pytest.mark.skipif(
    chromium() is None,
    reason="Chromium is not installed (Debian package "
    "'chromium'; nox -s tests installs it where it can)",
)


def open_in_chromium(report: Path, tmp_path: Path) -> tuple[Path, list[str], str]:
    """A screenshot, the console messages, and the DOM after loading ``report`` headless."""
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
    ]
    shot = tmp_path / "shot.png"
    result = subprocess.run(
        [
            str(chromium()),
            *flags,
            "--window-size=1400,1800",
            f"--screenshot={shot}",
            report.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists(), result.stderr[-2000:]
    console = [line for line in result.stderr.splitlines() if "CONSOLE" in line]
    dom = subprocess.run(
        [str(chromium()), *flags, "--dump-dom", report.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return shot, console, dom


def bench_report() -> Any:
    """``benchmarks/bench_report.py``, a script, loaded by its path."""
    spec = importlib.util.spec_from_file_location(
        "bench_report", ROOT / "benchmarks" / "bench_report.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_chromium
def test_report_opens_in_headless_chromium_without_console_errors(tmp_path: Path) -> None:
    report = write_report(render_report(aggregate.load_runs([OLD, NEW])), tmp_path / "r.html")
    shot, console, dom = open_in_chromium(report, tmp_path)
    assert shot.stat().st_size > 50_000
    assert console == []
    assert 'id="summary-matrix"' in dom and dom.count(PLOT) == 2


@needs_chromium
def test_a_report_over_ten_thousand_cells_stays_readable_in_chromium(tmp_path: Path) -> None:
    """A nightly's worth of runs (14 torch releases on a few hosts, as ``bench_report``
    builds them): the browser shows every case, a plot per timed case, not a row per cell."""
    runs, cells = bench_report().synthetic_runs(tmp_path / "runs", 10_000)
    loaded = aggregate.load_runs(runs)
    report = write_report(render_report(loaded), tmp_path / "large.html")
    assert cells >= 10_000 and report.stat().st_size < 2_000_000
    shot, console, dom = open_in_chromium(report, tmp_path)
    assert console == [] and shot.stat().st_size > 50_000
    cases = {record.cell.case for run in loaded for record in run.records}
    for case in cases:
        assert f'<h2 id="case-{case}">{case}</h2>' in dom
    assert 'id="summary-matrix"' in dom and "What differs between runs" in dom
    assert dom.count(PLOT) == 2  # one plot per timed case
    assert dom.count("<tr") < cells / 10  # environments aggregated, not a row per cell
    assert re.search(r"Cells: \d+ row\(s\) for \d+ cell\(s\) in \d+ environment\(s\)", dom)
    assert "torch 2.1.2\u20132.14.1 · cpu · gpu-host-0" in dom  # releases named as a range


def test_the_benchs_default_run_has_the_default_matrix_shape(tmp_path: Path) -> None:
    """``bench_report``'s default run (what its 2 s target is measured on): every case of
    its shape with a plot, its CUDA cells skipped, the CPU's that ran timed but raises and
    trained controls, every line a record."""
    bench = bench_report()
    written = bench.default_run(tmp_path / "run")
    lines = storage.read_record_lines(tmp_path / "run")
    records = storage.read_records(tmp_path / "run")
    expected = sum(3 * len(bench.DEFAULT_COLUMNS) * f * b * s for f, b, s in bench.DEFAULT_CASES)
    assert written == len(lines) and len(records) == expected
    assert len({r.cell.case for r in records}) == len(bench.DEFAULT_CASES)
    assert all(r.outcome.value == "skipped" for r in records if r.cell.device == "cuda")
    ran = [r for r in records if r.cell.device == "cpu" and r.outcome.value != "raises"]
    trained_controls = [r for r in ran if r.cell.mode == "fp32" and r.cell.stage != "forward"]
    assert sum(r.perf is not None for r in ran) == len(ran) - len(trained_controls)
    html = render_report(aggregate.load_runs_for_report([tmp_path / "run"]))
    assert html.count(PLOT) == len(bench.DEFAULT_CASES)


def test_a_flagged_cell_is_shown_flagged_and_never_recommended(tmp_path: Path) -> None:
    run = tmp_path / "flagged"
    shutil.copytree(NEW, run)
    records = storage.read_records(run)
    target = next(r for r in records if r.cell.fix == "fp32-then-cast" and r.perf)
    flag = Flag(
        FlagKind.NO_AUTOCAST, "the mode enters torch.autocast, but no torch op ran with it on"
    )
    storage.append_record(run, dataclasses.replace(target, flags=(flag,)))
    frame = aggregate.records_frame(aggregate.load_runs([run]))
    assert "fp32-then-cast" not in aggregate.fixes_passing_everywhere(
        frame[frame["case"] == target.cell.case]
    )
    drifting = next(r for r in records if r.cell.fix == "sdpa" and r.perf)
    trail = Trail(
        promotion=Promotion(Site("aten::_to_copy", None, "cases/s.py:9"), "float32", "a cast")
    )
    drift = Flag(FlagKind.DRIFT, "attention computed in float32")
    storage.append_record(run, dataclasses.replace(drifting, flags=(drift,), trail=trail))
    html = render_report(aggregate.load_runs([run]))
    assert 'class="o passes flagged">passes[no-autocast]<' in html
    assert 'class="o passes flagged drift">passes[drift]<' in html
    assert "float32 enters via a cast at aten::_to_copy (cases/s.py:9)" in html
    assert "no-autocast: the mode enters torch.autocast" in html
    assert "<b>half-autocast</b>: weights and inputs cast to the dtype, and run under" in html


def test_a_plain_pass_that_starts_to_drift_is_a_regression() -> None:
    from harness.report.compare import outcome_verdict

    base = next(r for r in storage.read_records(NEW) if r.outcome.value == "passes")
    drifted = dataclasses.replace(
        base, flags=(Flag(FlagKind.DRIFT, "attention computed in float32"),)
    )
    assert outcome_verdict(base, drifted) == "regression"
    assert outcome_verdict(drifted, base) == "improvement"
    assert outcome_verdict(base, base) is None


def environments(*labels: str) -> grouping.Environments:
    """The environments of a frame with one cell in each of ``labels``."""
    rows = [
        {"env": label, "torch_version": label.split(" · ")[0].removeprefix("torch "),
         "device": label.split(" · ")[1], "host": [*label.split(" · "), ""][2]}
        for label in labels
    ]  # fmt: skip
    return grouping.Environments(pd.DataFrame(rows))


def test_environments_are_named_by_release_ranges_and_hosts() -> None:
    releases = ("2.1.2", "2.2.2", "2.3.1", "2.4.1")
    labels = [f"torch {r} · cpu · {h}" for h in ("a", "b") for r in releases]
    envs = environments(*labels, "torch 2.4.1 · cuda:0 · a")
    both = envs.describe(labels, labels)
    assert both.summary == "all 8 environments"
    assert both.text == "torch 2.1.2\u20132.4.1 · cpu · a, b"
    gap = envs.describe([labels[0], labels[1], labels[3]], [*labels, "torch 2.4.1 · cuda:0 · a"])
    assert (
        gap.text == "torch 2.1.2\u20132.2.2, 2.4.1 · cpu · a" and gap.summary == "3 environments"
    )
    assert envs.describe([labels[2]], labels).text == "torch 2.3.1 · cpu · a"


def test_a_cell_whose_outcome_differs_between_environments_shows_each_outcome() -> None:
    frame = aggregate.records_frame(aggregate.load_runs([OLD, NEW]))
    envs, styles = grouping.Environments(frame), case_tables.label_styles(frame)
    rows = [
        row
        for case, mine in frame.groupby("case")
        for row in case_tables.cell_rows(mine[mine["outcome"] != "skipped"], envs, styles)
    ]
    differing = [r for r in rows if r.variants > 1]
    assert differing, "the stored runs of torch 2.4.1 and 2.13.0 differ somewhere"
    assert sum(r.cells for r in rows) == (frame["outcome"] != "skipped").sum()
    html = render_report(aggregate.load_runs([OLD, NEW]))
    assert "differs (2 outcomes)" in html


def test_numbers_measured_in_several_environments_keep_their_range() -> None:
    assert grouping.spread(2.0, 1.0, 4.0, lambda v: f"{v:.1f}") == "2.0 (1.0\u20134.0)"
    assert grouping.spread(1.0, 1.0, 1.0, lambda v: f"{v:.1f}") == "1.0"
    assert grouping.spread(float("nan"), None, None, str) == ""


def test_a_run_at_two_sizes_shows_each_size_apart(tmp_path: Path) -> None:
    """The same records again at the upstream size, ten times slower: rows say their size,
    each timed size gets its own plot, and no speed ratio mixes the sizes."""
    run = tmp_path / "sized"
    shutil.copytree(NEW, run)
    upstream = []
    for line in (run / storage.CELLS_FILE).read_text().splitlines():
        record = json.loads(line) | {"size": "upstream"}
        if record.get("time_median_s"):
            record["time_median_s"] *= 10
        upstream.append(json.dumps(record))
    with (run / storage.CELLS_FILE).open("a") as cells:
        cells.write("\n".join(upstream) + "\n")
    runs = aggregate.load_runs([run])
    frame = aggregate.records_frame(runs)
    assert set(frame["size"]) == {"small", "upstream"}
    sized = frame[frame["row"].str.endswith(" @upstream")]
    assert len(sized) == len(frame) / 2 and set(sized["size"]) == {"upstream"}
    small = frame[frame["size"] == "small"].set_index(["case", "fix", "dtype", "mode"])
    big = sized.set_index(["case", "fix", "dtype", "mode"])
    ratios = pd.concat([small["vs_fastest"], big["vs_fastest"]], axis=1).dropna()
    assert len(ratios) and (ratios.iloc[:, 0] - ratios.iloc[:, 1]).abs().max() < 1e-9
    html = render_report(runs)
    timed_cases = frame.loc[frame["median_s"].notna(), "case"].nunique()
    assert html.count(PLOT) == 2 * timed_cases
    assert "never compared across sizes" in html and "none @upstream" in html


def test_runs_read_in_parallel_give_the_same_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("harness.report.runs.PARALLEL_BYTES", 0)
    parallel = aggregate.load_runs_for_report([OLD, NEW], processes=2)
    assert all(run.rows and not run.records for run in parallel)
    expected = aggregate.records_frame(aggregate.load_runs([OLD, NEW]))
    pd.testing.assert_frame_equal(aggregate.records_frame(parallel), expected)


#: What reads results files: none of it may import torch (its import alone takes seconds,
#: and a report is rendered where no torch is installed, from a CI artifact say).
READ_SIDE = ("harness.results.storage", "harness.schema.records", "harness.results.summary",
             "harness.results.speed", "harness.results.versions", "harness.cli")  # fmt: skip

NO_TORCH_SCRIPT = """
import importlib, json, pkgutil, runpy, sys
import harness.report
report = (f"harness.report.{{m.name}}" for m in pkgutil.iter_modules(harness.report.__path__))
names = [*{read_side!r}, *report]
for name in names:
    importlib.import_module(name)
codes = []
for argv in {commands!r}:
    sys.argv = ["harness", *argv]
    try:
        runpy.run_module("harness", run_name="__main__", alter_sys=True)
    except SystemExit as done:
        codes.append(done.code)
print(json.dumps({{"imported": names, "codes": codes,
                   "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}}))
"""


def test_the_read_side_never_imports_torch(tmp_path: Path) -> None:
    """``report``, ``compare`` and ``bisect`` as ``python -m harness`` runs them, after
    importing every module of the read side: torch is never imported."""
    out, markdown = tmp_path / "r.html", tmp_path / "summary.md"
    commands = [
        ["report", str(NEW), "--out", str(out), "--markdown", str(markdown)],
        ["report", str(OLD), str(NEW), "--out", str(out), "--baseline", str(OLD)],
        ["compare", str(OLD), str(NEW)],
        ["bisect", str(OLD), str(NEW)],
    ]
    script = NO_TORCH_SCRIPT.format(read_side=READ_SIDE, commands=commands)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    assert "harness.report.render" in found["imported"]
    assert found["codes"][:2] == [0, 0] and found["codes"][3] == 0, result.stderr
    assert out.stat().st_size > 0 and markdown.stat().st_size > 0
    assert found["torch"] == []


def test_a_cells_style_comes_from_its_outcome_and_flags_not_its_labels_text() -> None:
    frame = pd.DataFrame(
        {
            "label": ["passes", "passes[not-half,drift]", "raises:repro[no-autocast]", "odd"],
            "base_label": ["passes", "passes", "raises:repro", "inaccurate"],
            "drift": [False, True, None, True],
        }
    )
    styles = case_tables.label_styles(frame)
    assert {label: style.css for label, style in styles.items()} == {
        "passes": "passes",
        "passes[not-half,drift]": "passes flagged drift",
        "raises:repro[no-autocast]": "raises-repro flagged",
        "odd": "inaccurate flagged drift",  # read off the columns, whatever the text says
    }
    assert [label for label, style in styles.items() if style.plain_pass] == ["passes"]
