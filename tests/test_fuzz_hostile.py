"""Hostile input thrown at ``report``, ``compare``, ``bisect`` and ``run --resume`` as a
user runs them (``harness.cli.main``): generated folder names (``javascript:``, terminal
escapes, bidi overrides, line breaks, ``|``, ``[``, undecodable bytes, very long names),
results files (JSON nested thousands deep, lines over the size limit, values of the wrong
type at any depth, other encodings, a folder in place of a file) and arguments.

Every command must end with exit code 0, 1, 2 or 3 and either its output or one line
``ampmatrix: error: ...``: never a traceback, never a ``javascript:`` link or source in the
HTML it writes, never a raw control character (but newline and tab) on the terminal. The
examples are derandomized and no database is kept, so CI runs the same ones every time;
``AMPMATRIX_FUZZ_SCALE`` multiplies their number to explore further."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from hypothesis import HealthCheck, currently_in_test_context, event, example, given, settings
from hypothesis import strategies as st

from harness import cli
from harness.report import plots
from harness.results import storage
from harness.runner import run as runner
from harness.schema.config import RunConfig
from harness.schema.records import CellRecord, MalformedRecord
from harness.schema.run_files import RunPlan
from tests.conftest import ROOT

SOURCE = ROOT / "tests" / "data" / "runs" / "torch-2.13.0"
SCALE = float(os.environ.get("AMPMATRIX_FUZZ_SCALE", "1"))
#: The size limits of a line of ``cells.jsonl`` and of a JSON file while fuzzing: small, so
#: going over them is cheap.
LINE_LIMIT = 4096
FILE_LIMIT = 65536


def examples(count: int) -> settings:
    """Reproducible (derandomized, no example database) and quick: ``count`` examples, no
    deadline (a report takes a tenth of a second, a first one longer)."""
    return settings(
        max_examples=max(1, int(count * SCALE)),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.function_scoped_fixture,
            HealthCheck.data_too_large,
        ],
    )


# --- hostile text -------------------------------------------------------------------------

#: Pieces that mean something to a browser, a terminal, Markdown or a file system.
PIECES = (
    "javascript:alert(1)", "JaVaScRiPt:", " javascript:", "java\tscript:", "data:text/html,",
    "\x1b[2J", "\x1b]0;title\x07", "\x9b31m", "\r", "\n", "\t", "\x7f", "\x00", "\x85",
    "\u202e", "\u2066", "\u200f", "\u2028", "\ufeff", "|", "[", "]", "(", "#", "*", "`",
    "<script>alert(1)</script>", "<img src=x onerror=alert(1)>", "&lt;", "&#106;", "%3A",
    "%2F", "..", "\\", "'", '"', "é", "日本", "\U0001f600", " ", "\udcff",
)  # fmt: skip
#: Characters of any kind but lone surrogates (those come in ``PIECES``, as a file name's
#: undecodable byte).
ANY_CHARACTER = st.characters(max_codepoint=0xD7FF) | st.characters(min_codepoint=0xE000)
#: Every piece at once (a third of the draws), or a few pieces and characters of any kind.
hostile_text = st.one_of(
    st.just("".join(PIECES)),
    st.lists(st.sampled_from(PIECES), min_size=1, max_size=4).map("".join),
    st.lists(
        st.sampled_from(PIECES) | st.text(ANY_CHARACTER, max_size=4), min_size=1, max_size=6
    ).map("".join),
)


def folder_name(text: str) -> str:
    """``text`` as a name a folder can have: no ``/`` or NUL, not ``.`` or ``..``, at
    most 255 bytes."""
    name = text.replace("/", "%2F").replace("\x00", "%00")
    name = name if name not in ("", ".", "..") else f"{name}x"
    while len(os.fsencode(name)) > 255:
        name = name[:-1]
    return name


folder_names = st.one_of(
    hostile_text,
    st.integers(200, 255).map(lambda n: "javascript:" + "x" * n),
).map(folder_name)

#: JSON values of every type, some nested thousands deep, numbers no float holds.
json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(), hostile_text,
    st.sampled_from([10**400, -(10**30), 0, -1, 1e308, float("nan"), float("-inf")]),
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Deep:
    """A list in a list ``depth`` deep: put into a file as text (``json.dumps`` would
    recurse once per level), given to the record parser as Python lists."""

    depth: int

    #: What stands for it in ``json.dumps``'s output until it is put in.
    MARK: ClassVar[str] = "\x00deep\x00"

    def text(self) -> str:
        return "[" * self.depth + "1" + "]" * self.depth

    def value(self) -> Any:
        inner: Any = 1
        for _ in range(self.depth):
            inner = [inner]
        return inner


json_values = st.one_of(
    st.recursive(
        json_scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
        max_leaves=6,
    ),
    st.integers(30, 5000).map(Deep),
)


def dumped(document: Any, deep: Any) -> str:
    """``document`` as JSON text, with ``deep`` put in where a ``Deep`` was drawn."""
    if not isinstance(deep, Deep):
        return json.dumps(document)
    return json.dumps(document).replace(json.dumps(Deep.MARK), deep.text(), 1)


# --- a run to damage ----------------------------------------------------------------------


def base_run(folder: Path, records: int = 8) -> Path:
    """A small, valid, complete run recorded under this torch: ``--resume`` reads it all
    and finds nothing left to run."""
    folder.mkdir(parents=True)
    lines = (SOURCE / storage.CELLS_FILE).read_text().splitlines()[:records]
    (folder / storage.CELLS_FILE).write_text("\n".join(lines) + "\n")
    env = storage.read_env(SOURCE)
    storage.write_env(folder, dataclasses.replace(env, torch_version=torch.__version__))
    storage.write_cases(folder, list(storage.read_cases(SOURCE).values()))
    cells = tuple(CellRecord.from_dict(json.loads(line)).cell for line in lines)
    storage.write_run_plan(folder, RunPlan(RunConfig(timing=None), cells))
    return folder


FILES = (storage.CELLS_FILE, storage.ENV_FILE, storage.CASES_FILE, storage.RUN_PLAN_FILE)


def json_paths(value: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in a JSON document (the first items of each list)."""
    yield at
    if isinstance(value, dict):
        for key, item in value.items():
            yield from json_paths(item, (*at, key))
    elif isinstance(value, list):
        for index, item in enumerate(value[:3]):
            yield from json_paths(item, (*at, index))


def put(document: Any, at: tuple[Any, ...], value: Any) -> Any:
    if not at:
        return value
    parent = document
    for key in at[:-1]:
        parent = parent[key]
    parent[at[-1]] = value
    return document


def documents(path: Path) -> list[str]:
    """The JSON texts of a file: one per line of ``cells.jsonl``, else the whole file."""
    text = path.read_text()
    return text.splitlines() if path.name == storage.CELLS_FILE else [text]


def write_documents(path: Path, texts: list[str]) -> None:
    path.write_text("".join(f"{text}\n" for text in texts))


def replace_a_value(path: Path, data: st.DataObject) -> str:
    """A value anywhere in the file (one line of ``cells.jsonl``) replaced by any JSON."""
    texts = documents(path)
    line = data.draw(st.integers(0, len(texts) - 1))
    document = json.loads(texts[line])
    at = data.draw(st.sampled_from(list(json_paths(document))))
    value = data.draw(json_values)
    shown = Deep.MARK if isinstance(value, Deep) else value
    texts[line] = dumped(put(document, at, shown), value)
    write_documents(path, texts)
    return f"value at {at} of line {line + 1}"


def hostile_names(path: Path, data: st.DataObject) -> str:
    """Every string value of the file's names and messages replaced by hostile text."""
    texts = documents(path)
    text = data.draw(hostile_text)
    keys = {"case", "fix", "error_message", "error_type", "hostname", "torch_version",
            "title", "name", "url", "repo", "cpu", "skip_reason"}  # fmt: skip

    def swap(value: Any) -> Any:
        if isinstance(value, dict):
            return {
                k: text if k in keys and isinstance(v, str) else swap(v) for k, v in value.items()
            }
        return [swap(v) for v in value] if isinstance(value, list) else value

    write_documents(path, [json.dumps(swap(json.loads(t))) for t in texts])
    return f"names {text!r}"


def deep_text(path: Path, data: st.DataObject) -> str:
    depth = data.draw(st.integers(100, 100_000))
    deep = data.draw(
        st.sampled_from(["[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth])
    )
    texts = documents(path) if path.name == storage.CELLS_FILE else []
    texts.insert(data.draw(st.integers(0, len(texts))), deep)
    write_documents(path, texts)
    return f"nested {depth} deep"


def too_large(path: Path, data: st.DataObject) -> str:
    """A line of ``cells.jsonl`` over its limit, or a JSON file over its own."""
    if path.name != storage.CELLS_FILE:
        size = data.draw(st.integers(FILE_LIMIT, 2 * FILE_LIMIT))
        path.write_text(json.dumps({"padding": "x" * size}))
        return f"a file of {size} bytes"
    texts = documents(path)
    size = data.draw(st.integers(LINE_LIMIT, 4 * LINE_LIMIT))
    texts.insert(data.draw(st.integers(0, len(texts))), json.dumps({"case": "x" * size}))
    write_documents(path, texts)
    return f"a line of {size} bytes"


def other_bytes(path: Path, data: st.DataObject) -> str:
    text = path.read_text()
    encoding = data.draw(st.sampled_from(["utf-16", "utf-8-sig", "latin-1", "bytes"]))
    if encoding == "bytes":
        path.write_bytes(data.draw(st.binary(max_size=200)))
    else:
        path.write_bytes(text.replace('"', '"é', 1).encode(encoding, errors="replace"))
    return encoding


def gone(path: Path, data: st.DataObject) -> str:
    path.unlink()
    if data.draw(st.booleans()):
        path.mkdir()  # a folder where the file belongs
        return "a folder"
    return "removed"


Damage = Callable[[Path, st.DataObject], str]
DAMAGES: dict[str, Damage] = {
    "value": replace_a_value,
    "names": hostile_names,
    "deep": deep_text,
    "large": too_large,
    "bytes": other_bytes,
    "gone": gone,
}


# --- what every command must do -----------------------------------------------------------

#: What a terminal acts on: C0 and C1 controls (but newline and tab), DEL, bidi controls,
#: line and paragraph separators, lone surrogates.
RAW_CONTROL = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff]"
)
#: The one line of an error: ampmatrix's own, or argparse's for a bad argument.
ERROR_LINE = re.compile(r"^ampmatrix(?: [a-z]+)?: error: ")


def run_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``ampmatrix ARGV`` in this process: its exit code, stdout and stderr. Anything
    raised but ``SystemExit`` (argparse's) is the traceback a user would have seen."""
    try:
        code: Any = cli.main(argv)
    except SystemExit as done:
        code = done.code
    out, err = capsys.readouterr()
    if currently_in_test_context():  # --hypothesis-show-statistics: what was reached
        event(f"{argv[0]} exit {code or 0}")
    return int(code or 0), out, err


def check_terminal(argv: list[str], code: int, out: str, err: str) -> None:
    assert code in (0, 1, 2, 3), (argv, code, err[-2000:])
    assert "Traceback" not in out + err, (argv, err[-2000:])
    raw = RAW_CONTROL.findall(out + err)
    assert not raw, (argv, "raw control characters on the terminal:", sorted(set(raw)))
    if code == 2:
        assert one_error_line(err), (argv, "not one error line:", err[-2000:])


def one_error_line(err: str) -> bool:
    """stderr ends with one line ``ampmatrix: error: ...`` (or argparse's), after any
    warnings: a line break in the text an error names stays on its line."""
    lines = err.rstrip("\n").splitlines()
    errors = [i for i, line in enumerate(lines) if ERROR_LINE.match(line)]
    return len(errors) == 1 and errors[0] == len(lines) - 1


class Links(HTMLParser):
    """Every address an HTML page links to or loads."""

    def __init__(self) -> None:
        super().__init__()
        self.addresses: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("href", "src", "action", "formaction", "xlink:href") and value:
                self.addresses.append(value)


def script_addresses(html: str) -> list[str]:
    """The addresses a browser would run as script: ``javascript:`` (or ``vbscript:``, an
    HTML ``data:``) once it drops the whitespace and controls it ignores in a URL."""
    parser = Links()
    parser.feed(html)
    plain = ["".join(c for c in a if c > " " and c != "\x7f").lower() for a in parser.addresses]
    return [a for a in plain if a.startswith(("javascript:", "vbscript:", "data:text/html"))]


def check_html(folder: Path) -> None:
    for page in folder.glob("*.html"):
        found = script_addresses(page.read_text(errors="replace"))
        assert not found, (page, found)


def every_command(run_dir: Path, other: Path, reports: Path) -> list[list[str]]:
    """report (with a Markdown summary and a baseline), compare both ways, bisect and
    ``--resume``, on one run."""
    out = reports / f"{run_dir.name[:200]}.html"
    return [
        ["report", str(run_dir), "--out", str(out), "--markdown", str(reports / "summary.md")],
        ["report", str(other), str(run_dir), "--out", str(reports / "two.html"),
         "--baseline", str(other)],
        ["compare", str(other), str(run_dir)],
        ["compare", str(run_dir), str(other), "--allow-missing"],
        ["bisect", str(other), str(run_dir)],
        ["run", "--resume", str(run_dir)],
    ]  # fmt: skip


def check_every_command(
    run_dir: Path, other: Path, reports: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in every_command(run_dir, other, reports):
        code, out, err = run_command(argv, capsys)
        check_terminal(argv, code, out, err)
        if argv[0] == "report" and code == 0:
            page = Path(argv[argv.index("--out") + 1])
            assert page.read_text().startswith("<!DOCTYPE html>"), (argv, "no report")
    check_html(reports)


@pytest.fixture
def contained(
    monkeypatch: pytest.MonkeyPatch, clean_registry: None, tmp_path: Path
) -> Iterator[None]:
    """Plots left out (drawn from valid numbers, for real in the report tests) and
    ``--resume``'s cells not run (a damaged run may lack records; reading it is what is
    fuzzed here), so the examples fit in a minute. The case folders a run plan names join
    ``sys.path`` only for the test, the size limits are small, and a report without
    ``--out`` goes to the test's own ``reports/``."""
    monkeypatch.setattr(plots, "error_vs_time", lambda *args: None)
    monkeypatch.setattr(runner, "run_cells", lambda run_dir, *_: run_dir)
    monkeypatch.setattr(storage, "MAX_LINE_BYTES", LINE_LIMIT)
    monkeypatch.setattr(storage, "MAX_FILE_BYTES", FILE_LIMIT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    yield


@pytest.fixture
def pristine(tmp_path: Path) -> tuple[Path, Path]:
    """A complete run to copy and damage, and another to compare it with."""
    return base_run(tmp_path / "pristine"), base_run(tmp_path / "other", records=4)


def fresh_folder() -> Path:
    return Path(tempfile.mkdtemp(prefix="ampmatrix-fuzz-"))


# --- the fuzz tests -----------------------------------------------------------------------


@examples(25)
@given(name=folder_names)
@example(name=folder_name("".join(PIECES)))
@example(name="javascript:alert(document.cookie)")
@example(name="run\udcff")
@example(name="a\nb\x1b[2J\u202e")
@example(name="x" * 255)
def test_hostile_folder_names(
    contained: None, pristine: tuple[Path, Path], capsys: pytest.CaptureFixture[str], name: str
) -> None:
    source, other = pristine
    work = fresh_folder()
    try:
        run_dir = work / name
        shutil.copytree(source, run_dir)
        check_every_command(run_dir, other, work / "reports", capsys)
    finally:
        shutil.rmtree(work)


@examples(60)
@given(damage=st.sampled_from(sorted(DAMAGES)), file=st.sampled_from(FILES), data=st.data())
def test_hostile_file_contents(
    contained: None,
    pristine: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
    damage: str,
    file: str,
    data: st.DataObject,
) -> None:
    source, other = pristine
    work = fresh_folder()
    try:
        run_dir = work / "run"
        shutil.copytree(source, run_dir)
        done = DAMAGES[damage](run_dir / file, data)
        data.draw(st.just(done), label=f"{file}: {damage}")
        check_every_command(run_dir, other, work / "reports", capsys)
    finally:
        shutil.rmtree(work)


#: Arguments of every kind: paths that are runs, files, missing or hostile; numbers no
#: option takes; hostile names for --case and --fix; flags no command has.
def arguments(run_dir: Path, other: Path, work: Path) -> st.SearchStrategy[list[str]]:
    paths = st.one_of(
        st.sampled_from([str(run_dir), str(other), str(work), str(run_dir / storage.ENV_FILE),
                         "", "-", str(work / "missing")]),
        folder_names.map(lambda name: str(work / name)),
    )  # fmt: skip
    numbers = st.one_of(
        st.sampled_from(["nan", "inf", "-inf", "0", "-1", "1e400", "", "0x10", "1_0"]),
        hostile_text,
        st.floats().map(str),
    )
    outs = st.one_of(
        st.sampled_from([str(work), str(run_dir / "r.html"), str(work / "index.html"),
                         str(run_dir / storage.CELLS_FILE)]),
        folder_names.map(lambda name: str(work / "reports" / name)),
    )  # fmt: skip
    options = st.one_of(
        st.tuples(st.sampled_from(["--min-ratio", "--alpha"]), numbers).map(list),
        st.tuples(st.sampled_from(["--case", "--fix"]), hostile_text).map(list),
        st.tuples(st.sampled_from(["--out", "--markdown"]), outs).map(list),
        st.tuples(st.just("--baseline"), paths).map(list),
        st.sampled_from([["--allow-missing"], ["--help"], ["--"], ["--no-such-flag"]]),
        hostile_text.map(lambda text: [text]),
    )
    return st.builds(
        command_line,
        st.sampled_from([["report"], ["compare"], ["bisect"], ["run", "--resume"]]),
        st.just([str(other), str(run_dir)]) | st.lists(paths, max_size=3),
        st.lists(options, max_size=3),
    )


def command_line(command: list[str], positional: list[str], options: list[list[str]]) -> list[str]:
    return [*command, *positional, *(word for option in options for word in option)]


@examples(150)
@given(data=st.data())
def test_hostile_arguments(
    contained: None, pristine: tuple[Path, Path], capsys: pytest.CaptureFixture[str], data: Any
) -> None:
    source, other = pristine
    work = fresh_folder()
    try:
        run_dir = work / "run"
        shutil.copytree(source, run_dir)
        argv = data.draw(arguments(run_dir, other, work))
        code, out, err = run_command(argv, capsys)
        check_terminal(argv, code, out, err)
        check_html(work / "reports")
        check_html(work)
    finally:
        shutil.rmtree(work)


def record_documents() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (SOURCE / storage.CELLS_FILE).read_text().splitlines()]


@examples(400)
@given(record=st.sampled_from(record_documents()), data=st.data())
def test_the_record_parser_raises_only_its_own_error_for_any_json(
    record: dict[str, Any], data: st.DataObject
) -> None:
    """Any JSON value anywhere in a record (or as the record), of any depth: a record,
    or ``MalformedRecord`` naming what is wrong."""
    document = json.loads(json.dumps(record))
    at = data.draw(st.sampled_from([*json_paths(document), ("schema_version",)]))
    value = data.draw(json_values)
    document = put(document, at, value.value() if isinstance(value, Deep) else value)
    try:
        CellRecord.from_dict(document)
    except MalformedRecord as error:
        assert str(error), "an error that names nothing"


# --- the two defects this fuzz found, each failing before its fix ---------------------------


def test_an_error_naming_a_line_break_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run_command(["report", str(tmp_path / "a\nb")], capsys)
    assert code == 2 and err.count("\n") == 1, err


def test_a_report_named_with_a_byte_that_is_not_utf8_is_linked(
    contained: None,
    pristine: tuple[Path, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    source, _ = pristine
    out = tmp_path / "reports" / "run\udcff.html"
    code, _, err = run_command(["report", str(source), "--out", str(out)], capsys)
    assert code == 0 and out.is_file(), err
    check_html(out.parent)
