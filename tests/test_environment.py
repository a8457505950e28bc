"""Environment variables, each declared once (``harness/schema/env_vars.py``): a bad value
is one line naming the variable and a non-zero exit, in the harness's command line and in
the noxfile, before any work; a good one is read as its type; the docs list them from the
declaration; nothing reads one around it."""

from __future__ import annotations

import ast
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from harness.measure.figures import peaks
from harness.schema import env_vars
from harness.schema.env_vars import EnvironmentVariableError
from tests.conftest import ROOT

#: The hostile values of issue 41 that met no check, and more of the same kinds.
HARNESS_HOSTILE = [
    ("AMPMATRIX_PEAK_MAX_AGE_DAYS", "nan", "a finite number of days between 0 and 3650"),
    ("AMPMATRIX_PEAK_MAX_AGE_DAYS", "1e12", "a finite number of days between 0 and 3650"),
    ("AMPMATRIX_PEAK_MAX_AGE_DAYS", "inf", "a finite number of days between 0 and 3650"),
    ("AMPMATRIX_PEAK_MAX_AGE_DAYS", "-1", "a finite number of days between 0 and 3650"),
    ("AMPMATRIX_IMPORT_TIMEOUT", "soon", "a finite number of seconds above 0 and at most 86400"),
    ("AMPMATRIX_IMPORT_TIMEOUT", "0", "a finite number of seconds above 0 and at most 86400"),
    ("AMPMATRIX_THREADS", "0", "a whole number of threads from 1 to 4096"),
    ("AMPMATRIX_THREADS", "2.5", "a whole number of threads from 1 to 4096"),
]
NOX_HOSTILE = [
    ("AMPMATRIX_KEEP_ENVS", "abc", "a whole number of environments from 0 to 1000"),
    ("AMPMATRIX_KEEP_ENVS", "-1", "a whole number of environments from 0 to 1000"),
    ("AMPMATRIX_MIN_FREE_GB", "lots", "a finite number of GB between 0 and 1000000"),
    ("AMPMATRIX_MIN_FREE_GB", "nan", "a finite number of GB between 0 and 1000000"),
    ("AMPMATRIX_FLASH_ATTN", "banana", "one of '0', '1', '2', '4', 'auto'"),
    ("AMPMATRIX_TORCH", "2.4.1'", "a torch release such as 2.4.1 or 2.6.0rc1"),
    ("AMPMATRIX_NO_BROWSER", "maybe", "a switch: 1, true, yes or on; 0, false, no or off"),
]


def without_variables() -> dict[str, str]:
    """This process's environment without any declared variable a user may have set (the
    tests' own cache folder kept, so no run writes into the user's)."""
    return {
        k: v
        for k, v in os.environ.items()
        if k not in env_vars.BY_NAME or k == env_vars.CACHE_DIR.name
    }


def harness_with(name: str, value: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harness", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**without_variables(), name: value},
    )


def nox_with(environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``nox -l`` on the project's noxfile, in nox's own process as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "nox", "-f", str(ROOT / "noxfile.py"), "-l"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**without_variables(), **environ},
    )


def test_the_issues_message_names_the_variable_the_value_and_the_rule() -> None:
    with pytest.raises(EnvironmentVariableError) as caught:
        env_vars.PEAK_MAX_AGE_DAYS.read({"AMPMATRIX_PEAK_MAX_AGE_DAYS": "nan"})
    assert str(caught.value) == (
        "AMPMATRIX_PEAK_MAX_AGE_DAYS: 'nan' is not a finite number of days between 0 and 3650"
    )
    error = caught.value
    assert (error.variable, error.value) == ("AMPMATRIX_PEAK_MAX_AGE_DAYS", "nan")
    assert error.expected == "a finite number of days between 0 and 3650"


@pytest.mark.parametrize(("name", "value", "rule"), HARNESS_HOSTILE)
def test_a_bad_harness_variable_is_one_line_before_any_work(
    name: str, value: str, rule: str
) -> None:
    """``compare`` of two folders that do not exist: the variable is refused before the
    command looks at them."""
    result = harness_with(name, value, "compare", "no-such-base", "no-such-head")
    assert result.returncode == 2
    assert result.stderr == f"ampmatrix: error: {name}: {value!r} is not {rule}\n"


def test_a_run_with_a_peak_age_that_is_not_a_number_measures_nothing(tmp_path: Path) -> None:
    """``AMPMATRIX_PEAK_MAX_AGE_DAYS=nan`` lost every timed figure of a run that exited 0;
    the run is refused before it starts, and no run folder is made."""
    result = harness_with(
        "AMPMATRIX_PEAK_MAX_AGE_DAYS", "nan", "run", "--device", "cpu", "--out", str(tmp_path)
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "AMPMATRIX_PEAK_MAX_AGE_DAYS: 'nan'" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_the_peaks_cache_reads_its_age_through_the_declaration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("AMPMATRIX_PEAK_MAX_AGE_DAYS", "2.5")
    assert peaks.max_age().total_seconds() == 2.5 * 86400
    monkeypatch.setenv("AMPMATRIX_PEAK_MAX_AGE_DAYS", "1e12")
    with pytest.raises(EnvironmentVariableError, match="AMPMATRIX_PEAK_MAX_AGE_DAYS"):
        peaks.max_age()
    monkeypatch.delenv("AMPMATRIX_PEAK_MAX_AGE_DAYS")
    assert peaks.max_age().days == 30


@pytest.fixture(scope="module")
def nox_here() -> None:
    pytest.importorskip("nox", reason="nox is not installed here")


@pytest.mark.parametrize(("name", "value", "rule"), NOX_HOSTILE)
def test_a_bad_noxfile_variable_is_one_line_for_nox_l(
    nox_here: None, name: str, value: str, rule: str
) -> None:
    result = nox_with({name: value})
    assert result.returncode == 2
    assert result.stderr == f"nox: error: {name}: {value!r} is not {rule}\n"


def test_nox_l_lists_the_sessions_with_good_values(nox_here: None) -> None:
    result = nox_with(
        {
            "AMPMATRIX_KEEP_ENVS": "0",
            "AMPMATRIX_MIN_FREE_GB": "5.5",
            "AMPMATRIX_FLASH_ATTN": "auto",
            "AMPMATRIX_TORCH": "2.0.1",
            "AMPMATRIX_NO_BROWSER": "1",
            # the harness's own: checked by the harness and the matrix session, not here
            "AMPMATRIX_PEAK_MAX_AGE_DAYS": "nan",
        }
    )
    assert result.returncode == 0, result.stderr
    assert "matrix(torch='2.0.1')" in result.stdout and "Traceback" not in result.stderr


def test_the_noxfile_reads_its_variables_typed(nf: ModuleType) -> None:
    assert isinstance(nf.KEEP_ENVS, int) and isinstance(nf.MIN_FREE_GB, float)
    assert nf.env_vars.KEEP_ENVS.name == env_vars.KEEP_ENVS.name  # the same declaration
    with pytest.raises(SystemExit) as stopped:
        nf.refuse_bad_variables({"AMPMATRIX_KEEP_ENVS": "abc"})
    assert stopped.value.code == 2


def test_the_flash_attn_choices_are_the_noxfiles_settings(nf: ModuleType) -> None:
    declared = env_vars.FLASH_ATTN.rule.choices
    assert set(nf.FLASH_ATTN_SETTINGS) == {env_vars.FLASH_ATTN.default, *declared}


GOOD = [
    ("AMPMATRIX_PEAK_MAX_AGE_DAYS", "0", 0.0),
    ("AMPMATRIX_PEAK_MAX_AGE_DAYS", " 7.5 ", 7.5),
    ("AMPMATRIX_PEAK_MAX_AGE_DAYS", "3650", 3650.0),
    ("AMPMATRIX_IMPORT_TIMEOUT", "2", 2.0),
    ("AMPMATRIX_THREADS", "8", 8),
    ("AMPMATRIX_KEEP_ENVS", "0", 0),
    ("AMPMATRIX_MIN_FREE_GB", "1e3", 1000.0),
    ("AMPMATRIX_FLASH_ATTN", "auto", "auto"),
    ("AMPMATRIX_TORCH", "2.4.1+cu121", "2.4.1+cu121"),
    ("AMPMATRIX_TORCH", "2.8.0.dev20250101", "2.8.0.dev20250101"),
    ("AMPMATRIX_NO_BROWSER", "1", True),
    ("AMPMATRIX_NO_BROWSER", "Off", False),
    ("AMPMATRIX_CACHE_DIR", "/var/cache/a b", "/var/cache/a b"),
    ("AMPMATRIX_FUZZ_SEED", "0", 0),
]


@pytest.mark.parametrize(("name", "text", "value"), GOOD)
def test_a_good_value_is_read_as_its_type(name: str, text: str, value: Any) -> None:
    read = env_vars.BY_NAME[name].read({name: text})
    assert read == value and type(read) is type(value)


@pytest.mark.parametrize("variable", env_vars.VARIABLES, ids=lambda v: v.name)
def test_unset_or_empty_is_the_default(variable: env_vars.Variable[Any]) -> None:
    assert variable.read({}) == variable.default
    assert variable.read({variable.name: ""}) == variable.default


def fits_its_rule(variable: env_vars.Variable[Any], value: Any) -> bool:
    rule = variable.rule
    return isinstance(value, rule.kind) and rule.fits(value)


#: Text a variable may be given: anything, and the numbers and words its rules stand near.
texts = st.one_of(
    st.text(),
    st.floats().map(repr),
    st.integers(min_value=-(10**20), max_value=10**20).map(str),
    st.sampled_from(["nan", "-inf", "Infinity", "1_000", "٣", "0x10", "auto", "Yes", "2.4.1"]),
)


@settings(max_examples=600, deadline=None, derandomize=True, database=None)
@given(variable=st.sampled_from(env_vars.VARIABLES), text=texts)
@example(variable=env_vars.PEAK_MAX_AGE_DAYS, text="1e308")
@example(variable=env_vars.KEEP_ENVS, text="9" * 5000)
@example(variable=env_vars.THREADS, text="+4\n")
@example(variable=env_vars.TORCH, text="2.4.1\nnightly verdict: pass")
def test_any_text_is_a_typed_value_within_its_rule_or_one_line_naming_it(
    variable: env_vars.Variable[Any], text: str
) -> None:
    try:
        value = variable.read({variable.name: text})
    except EnvironmentVariableError as error:
        message = str(error)
        assert message.startswith(f"{variable.name}: ") and "\n" not in message
        assert message.endswith(f" is not {variable.rule.expected}")
        return
    if text == "":
        assert value == variable.default
    else:
        assert fits_its_rule(variable, value)
        assert not (isinstance(value, float) and not math.isfinite(value))


def test_the_docs_table_is_the_declaration() -> None:
    page = (ROOT / "docs" / "environment-variables.md").read_text()
    found = re.search(r"<!-- env-vars: [^\n]*-->\n(.*?)\n<!-- end env-vars -->", page, re.S)
    assert found, "docs/environment-variables.md has lost its table's markers"
    assert found.group(1) == env_vars.docs_table(), (
        "the docs' table differs from harness/schema/env_vars.py: paste in the output of "
        "`python -m harness.schema.env_vars`"
    )


MENTIONED = re.compile(r"AMPMATRIX_[A-Z][A-Z0-9_]*")


def project_texts() -> list[Path]:
    roots = ("harness", "benchmarks", "tests", "docs", "cases", "zoo")
    files = [p for r in roots for p in (ROOT / r).rglob("*") if p.suffix in (".py", ".md")]
    return [*files, ROOT / "noxfile.py", ROOT / "README.md", *(ROOT / ".github").rglob("*.yml")]


def test_every_variable_the_project_names_is_declared() -> None:
    undeclared = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in project_texts()
        for name in MENTIONED.findall(path.read_text(errors="replace"))
        if name not in env_vars.BY_NAME
    }
    assert sorted(undeclared) == []


def variable_names_in_code(source: str) -> list[str]:
    """The string constants of ``source`` that are a variable's name, docstrings aside:
    ``os.environ.get("AMPMATRIX_...")`` and ``NAME = "AMPMATRIX_..."`` alike."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and re.fullmatch(r"AMPMATRIX_[A-Z0-9_]+", node.value)
    ]


def test_the_harness_and_the_noxfile_read_no_variable_around_its_declaration() -> None:
    """A variable's name is written once in code, in its declaration: any other place
    that names it in a string reads or sets it around the rule."""
    sources = [*(ROOT / "harness").rglob("*.py"), ROOT / "noxfile.py"]
    raw = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in sources
        if path.name != "env_vars.py"
        for name in variable_names_in_code(path.read_text())
    ]
    assert raw == []
