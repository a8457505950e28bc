"""Text from outside (case code, results files, folder names, error messages) is inert
wherever the harness shows it: in the terminal its control characters are shown escaped,
in the reports' index its links are relative paths, in a Markdown summary it stays inside
its table cell and formats nothing."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from harness.cli import main
from harness.report.aggregate import load_runs
from harness.report.markdown import render_markdown
from harness.results import storage
from tests.conftest import harness, only_run_dir

DATA = Path(__file__).parent / "data" / "runs"

#: Sets the terminal's title, clears the screen, moves the cursor, and a C1 CSI and a bidi
#: override that repaint what follows.
HOSTILE = "\x1b]0;pwned\x07\x1b[2J\rover\x9b31m\u202egnp.exe\x7f"
#: What must not reach a terminal: C0 but newline and tab, DEL, C1, bidi controls.
RAW_CONTROL = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]"
)
#: Injection attempts in a name shown in a Markdown table.
MARKDOWN_HOSTILE = "x\n# heading | [x](javascript:alert(1)) ![i](y.png) <b>t</b> `c"


def hostile_run(source: Path, folder: Path, text: str = HOSTILE) -> Path:
    """A copy of a stored run whose case names, fix names (but ``none``, the known failure's
    own), error messages and hostname carry ``text``."""
    shutil.copytree(source, folder)
    lines = []
    for line in (folder / storage.CELLS_FILE).read_text().splitlines():
        record = json.loads(line)
        record["case"] += text
        record["fix"] += text if record["fix"] != "none" else ""
        if record["error_message"] is not None:
            record["error_message"] = f"{record['error_message']} {text}"
        lines.append(json.dumps(record))
    lines.append('{"cut short' + text)  # a damaged line: a warning that names the file
    (folder / storage.CELLS_FILE).write_text("\n".join(lines) + "\n")
    env = json.loads((folder / storage.ENV_FILE).read_text())
    env["hostname"] += text
    (folder / storage.ENV_FILE).write_text(json.dumps(env))
    return folder


def shown(capsys: pytest.CaptureFixture[str]) -> str:
    out, err = capsys.readouterr()
    return out + err


def assert_inert(text: str, shows_hostile: bool = True) -> None:
    """No raw control character, and the hostile text shown escaped (not dropped)."""
    assert not RAW_CONTROL.findall(text), RAW_CONTROL.findall(text)
    assert not shows_hostile or r"\x1b]0;pwned\x07\x1b[2J\rover\x9b31m\u202egnp.exe\x7f" in text


def test_terminal_safe_escapes_control_characters_but_newline_and_tab() -> None:
    from harness.schema.text import terminal_safe

    assert terminal_safe("a\tb\nc") == "a\tb\nc"
    assert terminal_safe("\x1b[2J\r\x00\x7f\x9b\u202e\u2066\udc9bé·\u2013") == (
        "\\x1b[2J\\r\\x00\\x7f\\x9b\\u202e\\u2066\\udc9bé·\u2013"
    )


@pytest.mark.parametrize("command", ["compare", "bisect"])
def test_compare_and_bisect_show_results_files_inert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """Names, error messages and hostnames from the records, and the folders' names in the
    warnings about a damaged line."""
    base = hostile_run(DATA / "torch-2.4.1", tmp_path / f"base{HOSTILE}")
    head = hostile_run(DATA / "torch-2.13.0", tmp_path / f"head{HOSTILE}")
    assert main([command, str(base), str(head)]) in (0, 1)
    assert_inert(shown(capsys))


def test_errors_and_warnings_show_folder_names_inert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bisect", str(tmp_path / f"missing{HOSTILE}")]) == 2
    assert_inert(shown(capsys))


def test_report_index_links_are_relative_quoted_paths(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = hostile_run(DATA / "torch-2.13.0", tmp_path / "javascript:alert(document.cookie)")
    reports = tmp_path / "reports"
    assert main(["report", str(run), "--out", str(reports / f"{run.name}.html")]) == 0
    assert_inert(shown(capsys), shows_hostile=False)
    hrefs = re.findall(r'href="([^"]*)"', (reports / "index.html").read_text())
    assert hrefs
    for href in hrefs:
        assert href.startswith("./") and not urlsplit(href).scheme, href
        assert (reports / unquote(href)).is_file()


def test_markdown_summary_keeps_outside_text_in_its_cell(tmp_path: Path) -> None:
    clean = render_markdown(load_runs([DATA / "torch-2.13.0"]))
    run = hostile_run(DATA / "torch-2.13.0", tmp_path / "run", MARKDOWN_HOSTILE)
    summary = render_markdown(load_runs([run]))
    lines = summary.splitlines()
    assert len(lines) == len(clean.splitlines())  # no line break injected
    headings = [line for line in lines if line.startswith("#")]
    assert headings == [line for line in clean.splitlines() if line.startswith("#")]
    data_rows = [line for line in lines if "heading" in line]
    assert data_rows
    for row in data_rows:
        columns = len(re.findall(r"(?<!\\)\|", row))
        header = next(h for h in reversed(lines[: lines.index(row)]) if h.startswith("| case"))
        assert columns == header.count("|")  # no cell break injected
        assert not re.search(r"(?<!\\)[\[\]<>`!]", row), row  # no link, image, tag, code
    assert "javascript" in summary and "heading" in summary  # shown, escaped


HOSTILE_CASE = """
import torch

from harness.measure.authoring.case import (
    Case, FailureSignature, RunContext, Upstream, Workload, fix,
)
from harness.measure.authoring.registry import register


@register
class ToyHostileError(Case):
    name = "toy-hostile-error"
    title = "Toy: a fix whose error message carries terminal escape sequences"
    upstream = Upstream(repo="example/toy", file="toy.py", commit="0000000")
    failure = FailureSignature("RuntimeError", "never")
    reference_fix = "none"
    devices = ("cpu",)
    dtypes = ("bfloat16",)
    modes = ("half",)
    backends = ("eager",)

    def build(self, ctx: RunContext) -> Workload:
        return Workload(model=torch.randn(4, 4), inputs={"x": torch.randn(2, 4)})

    @fix("none", rationale="runs normally")
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return w.inputs["x"].to(w.model.dtype) @ w.model

    @fix("hostile", rationale="raises an error that would repaint the terminal")
    def hostile(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        print(HOSTILE)
        raise ValueError(HOSTILE)


HOSTILE = %r
"""


@pytest.mark.parametrize("workers", ["0", "1"])
def test_live_run_shows_a_fixs_error_inert(tmp_path: Path, workers: str) -> None:
    """The progress line and the summary show the error's first line escaped; in the run's
    own process (``-n 0``) the fix's print too."""
    cases = tmp_path / "cases"
    cases.mkdir()
    (cases / "toy_hostile_error.py").write_text(HOSTILE_CASE % HOSTILE)
    result = harness(
        "run", "--cases-dir", str(cases), "--case", "toy-hostile-error", "--device", "cpu",
        "--no-timing", "-n", workers, "--out", str(tmp_path / "out"),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    records = storage.read_records(only_run_dir(tmp_path / "out"))
    assert any(HOSTILE in str(r.error_message) for r in records)  # stored as raised
    printed = result.stdout + result.stderr
    assert_inert(printed, shows_hostile=workers == "0")
    assert printed.count(r"ValueError: \x1b]0;pwned\x07\x1b[2J") == 2  # progress, summary


#: A GPU's name in env.json that would print forged verdict lines above the real one.
FORGED = "H100\n" + "\n".join(["nightly verdict: pass: 4 environments compared"] * 8)
#: What a page's summary must not carry raw: a tag that runs script, ESC, a line break.
PAGE_HOSTILE = "<img src=x onerror=alert(1)>\x1b[2J\nnightly verdict: pass"
#: A tag Markdown would pass on to the page: ``<`` not escaped with a backslash.
RAW_TAG = re.compile(r"(?<!\\)<img")


def test_one_line_shows_every_line_break_escaped() -> None:
    from harness.schema.text import one_line, terminal_lines

    assert one_line("a\tb") == "a\tb"  # a tab moves along the line, never off it
    for br in ("\n", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\u2029"):
        assert len(f"x{one_line(f'a{br}b')}y".splitlines()) == 1, repr(br)
    assert one_line("H100\nnightly\x1b[2J") == "H100\\nnightly\\x1b[2J"
    assert terminal_lines(["a\nb", "c"]).splitlines() == ["a\\nb", "c"]


def forge_night(root: Path, text: str) -> None:
    """Each run of a night: its GPU's name and the error messages of its records carry
    ``text``."""
    from tests.test_nightly import GPUS, RELEASES, run_name

    for release in RELEASES:
        for gpu in GPUS:
            run = root / run_name(release, gpu)
            env = json.loads((run / storage.ENV_FILE).read_text())
            env["gpus"] = [{"name": f"{gpu}{text}"}]
            (run / storage.ENV_FILE).write_text(json.dumps(env))


def nightly_outputs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> tuple[int, list[str], str, str]:
    """nightly-verdict over two nights whose GPUs are named with ``text``, one fix of one
    environment stopped passing: the exit, the terminal's lines, the Markdown summary and
    the HTML report."""
    from tests.test_nightly import GPUS, KNOWN_FAILURE, edit_cell, night, passing, run_name

    last, tonight = night(tmp_path / "last"), night(tmp_path / "tonight")
    forge_night(last, text)
    forge_night(tonight, text)
    failure = {**KNOWN_FAILURE, "error_message": f"boom{text}"}
    edit_cell(tonight / run_name("2.13.0", GPUS[1]), passing("cast-kv-to-q"), **failure)
    summary, report = tmp_path / "summary.md", tmp_path / "nightly.html"
    args = [tonight, last, "--markdown", summary, "--out", report]
    code = main(["nightly-verdict", *map(str, args)])
    return code, shown(capsys).splitlines(), summary.read_text(), report.read_text()


def test_a_gpu_named_with_line_breaks_forges_no_verdict_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPU named ``H100\\nnightly verdict: pass: ...`` in env.json: the terminal has as many
    lines as with a plain name, one verdict line (the real FAIL), the name shown escaped."""
    code, plain, _, _ = nightly_outputs(tmp_path / "plain", capsys, "")
    assert code == 1
    code, lines, summary, _ = nightly_outputs(tmp_path / "forged", capsys, FORGED)
    assert code == 1
    assert len(lines) == len(plain)
    (verdict,) = [line for line in lines if "nightly verdict:" in line.split("\\n")[0]]
    assert verdict.startswith("nightly verdict: FAIL") and verdict == lines[-1]
    assert "H100\\nnightly verdict: pass" in "\n".join(lines)  # shown, escaped
    assert summary.count("nightly verdict:") == 1  # the summary's line breaks escaped too
    assert not RAW_CONTROL.findall(summary)


def test_the_nightly_markdown_and_report_carry_no_raw_tag_escape_or_line_break(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Markdown summary's tables and noise lines and the HTML report show the text of
    env.json and the records as text: no ``<img``, no ESC, no line of their own."""
    code, plain_lines, plain, _ = nightly_outputs(tmp_path / "plain", capsys, "")
    code, lines, summary, page = nightly_outputs(tmp_path / "hostile", capsys, PAGE_HOSTILE)
    assert code == 1 and len(lines) == len(plain_lines)
    assert len(summary.splitlines()) == len(plain.splitlines())
    assert not RAW_TAG.search(summary) and "\x1b" not in summary
    noise = [line for line in summary.splitlines() if line.startswith("- torch ")]
    assert noise and all("\\<img src=x onerror=alert(1)\\>" in line for line in noise)
    assert "<img src=x" not in page and "\x1b[2J" not in page  # its own plots are <img>
    assert "&lt;img src=x onerror=alert(1)&gt;" in page  # shown, escaped
    assert not RAW_CONTROL.search(page)  # no ESC, no bidi override reordering the text


def without_damage(run: Path) -> Path:
    """The run without :func:`hostile_run`'s damaged line (which a line break in the text
    makes two lines of the file, each rightly warned of)."""
    cells = run / storage.CELLS_FILE
    lines = cells.read_text().splitlines(keepends=True)
    cells.write_text(
        "".join(line for line in lines if line.startswith("{") and "cut short" not in line)
    )
    return run


def test_a_record_with_line_breaks_keeps_the_summary_and_compare_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Case and fix names, error messages and the host name with line breaks in them: the
    run's summary and compare print as many lines as for plain text."""
    from harness.cli.output import device_names
    from harness.results.summary import render_summary

    counts = []
    for name, text in (("plain", "-x"), ("forged", "\nnightly verdict: pass")):
        base = without_damage(hostile_run(DATA / "torch-2.4.1", tmp_path / name / "base", text))
        run = without_damage(hostile_run(DATA / "torch-2.13.0", tmp_path / name / "head", text))
        records = storage.read_records(run)
        print(render_summary(records, device_names(run, records)))
        assert main(["compare", str(base), str(run)]) == 0  # changes, none a regression
        counts.append(len(shown(capsys).splitlines()))
    assert counts[0] == counts[1]


def test_the_html_report_shows_outside_text_with_its_controls_escaped(tmp_path: Path) -> None:
    """Case and fix names, error messages and the host name carrying ESC sequences and a
    bidi override: the page shows them escaped (``\\u202e``), never raw, so no text of the
    page is reordered or hidden."""
    from harness.report import aggregate, writing

    run = without_damage(hostile_run(DATA / "torch-2.13.0", tmp_path / "run"))
    page = writing.render_report([aggregate.load_run(run)])
    assert not RAW_CONTROL.search(page)
    assert "\\u202egnp.exe" in page  # shown, escaped
