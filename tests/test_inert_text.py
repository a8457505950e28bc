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
