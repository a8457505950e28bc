"""The examples in README.md and docs/ run, so they cannot drift from the code.

The convention
--------------
Every fenced block in ``README.md`` and ``docs/**/*.md`` whose info string is ``bash``,
``sh``, ``shell``, ``console`` or ``python`` is an example, and it RUNS in the test suite
(``nox -s tests``), on the CPU, in seconds. Output goes in ```` ```text ```` blocks, which never
run (nor do blocks with any other info string, or none).

- A **Python** block runs with the tests' interpreter, in a temporary copy of the checkout,
  with the repository's root on ``PYTHONPATH``.
- A **shell** block (``bash``, ``sh``, ``shell``) runs with ``bash -e`` in a temporary copy of
  the checkout (so ``cases/``, ``zoo/`` and ``docs/`` are there, and ``results/`` and
  ``reports/`` start empty): ``python`` is the tests' interpreter, ``python -m harness``
  works, and the environment's scripts (``nox``, ``pytest``) are on ``PATH``. A ``console``
  block's commands are its lines that start with ``$ `` (and the lines a trailing ``\\``
  continues); its other lines are output and are not compared.
- An example has ``AMPMATRIX_EXAMPLE_TIMEOUT`` seconds (60 by default); one that runs longer
  is killed and fails, named by its file and line.
- An example that cannot run there in seconds (it needs a GPU, the network, or takes
  minutes) is marked on the line just before its opening fence, with the reason::

      <!-- example: syntax-only: needs a GPU -->
      ```sh
      python -m harness run --device cuda
      ```

  It is then only checked for syntax: ``bash -n`` for shell, ``compile()`` for Python. The
  comment shows neither on GitHub nor in the rendered site.
- A block that needs the state an earlier block left (a shell session, a Python variable)
  is joined to it with ``<!-- example: continues -->`` on the line before its fence; the
  two run as one example, named by the first block's line. Prefer self-contained blocks.

Each example is one test, named by its file and line: ``test_runs[README.md:42]`` for a
runnable one, ``test_syntax[docs/gpus.md:17]`` for a syntax-only one. Run only these with
``pytest tests/test_examples.py``; ``-k README`` picks one file's.

A marker the convention does not know, a marker that marks no block, and a block whose
info string looks like a shell or Python but is not one of the five (``py``, ``pycon``,
``zsh``, ``shell-session``...) fail ``test_documents_follow_the_convention``: such a block
would otherwise escape the tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import examples
from tests.examples import Example, MarkdownError, extract

# ---------------------------------------------------------------------------- collection


def _collect() -> tuple[list[Example], list[str]]:
    """The documentation's examples, and the files whose markers break the convention
    (reported by their own test rather than failing the collection)."""
    found: list[Example] = []
    broken: list[str] = []
    for path in examples.documents():
        rel = path.relative_to(examples.ROOT).as_posix()
        try:
            found += extract(path.read_text(encoding="utf-8"), rel)
        except MarkdownError:
            broken.append(rel)
    return found, broken


EXAMPLES, _BROKEN = _collect()
RUNNABLE = [e for e in EXAMPLES if e.syntax_only is None]
SYNTAX_ONLY = [e for e in EXAMPLES if e.syntax_only is not None]


def _params(selected: list[Example]) -> list[object]:
    return [pytest.param(e, id=e.where) for e in selected]


# ----------------------------------------------------------------- the documentation's


@pytest.mark.parametrize("document", [d.relative_to(examples.ROOT).as_posix() for d in
                                      examples.documents()])  # fmt: skip
def test_documents_follow_the_convention(document: str) -> None:
    extract((examples.ROOT / document).read_text(encoding="utf-8"), document)


@pytest.mark.parametrize("example", _params(RUNNABLE))
def test_runs(example: Example, tmp_path: Path) -> None:
    """A runnable example runs and exits 0 within the time limit."""
    examples.check_syntax(example)
    examples.copy_checkout(tmp_path)
    outcome = examples.run(example, tmp_path)
    tail = outcome.output[-4000:]
    hint = (
        "(an example that cannot run on the CPU in seconds is marked "
        "'<!-- example: syntax-only: <reason> -->' on the line before its fence)"
    )
    if outcome.returncode is None:
        pytest.fail(
            f"{example.where}: the example ran past {examples.TIMEOUT:g} s and was killed "
            f"{hint}\n{example.code}\n--- its output ---\n{tail}",
            pytrace=False,
        )
    if outcome.returncode:
        pytest.fail(
            f"{example.where}: the example exited {outcome.returncode}\n{example.code}\n"
            f"--- its output ---\n{tail}",
            pytrace=False,
        )


@pytest.mark.parametrize("example", _params(SYNTAX_ONLY))
def test_syntax(example: Example) -> None:
    """A syntax-only example parses (it says why it does not run)."""
    assert example.syntax_only
    examples.check_syntax(example)


# ----------------------------------------------------------------- the extractor itself

SAMPLE = """\
# A page

Run this:

```sh
python -c "print('ran')" > ran.txt
```

<!-- example: syntax-only: needs a GPU -->
```bash
python -m harness run --no-such-flag --device cuda | tee out.txt
```

Its output:

```text
rm -rf / && this is not run
```

```
neither is this
```

<!-- example: syntax-only: the network -->
```python
import urllib.request
urllib.request.urlopen("https://example.invalid/")
```

~~~console
$ echo one \\
    two
one two
$ python -c "print(3)"
3
~~~

1. In a list:

   ```python
   x = 1
       # indented past the fence
   ```
"""


def test_extract_finds_the_examples_by_line_and_mode() -> None:
    found = extract(SAMPLE, "page.md")
    assert [(e.where, e.info, e.syntax_only) for e in found] == [
        ("page.md:5", "sh", None),
        ("page.md:10", "bash", "needs a GPU"),
        ("page.md:25", "python", "the network"),
        ("page.md:30", "console", None),
        ("page.md:40", "python", None),
    ]
    assert found[0].code == "python -c \"print('ran')\" > ran.txt\n"
    assert found[3].code == 'echo one \\\n    two\npython -c "print(3)"\n'
    assert found[4].code == "x = 1\n    # indented past the fence\n"
    assert not any("not run" in e.code or "neither" in e.code for e in found)


def test_a_syntax_only_example_with_a_broken_command_passes_the_syntax_check() -> None:
    gpu, network = (e for e in extract(SAMPLE) if e.syntax_only)
    examples.check_syntax(gpu)  # the flag does not exist, but the line parses
    examples.check_syntax(network)


@pytest.mark.parametrize(
    ("info", "code"),
    [("sh", "for x in; do\n  echo (\n"), ("console", "$ if true; then echo\n"),
     ("python", "def broken(:\n    pass\n")],
    ids=["sh", "console", "python"],
)  # fmt: skip
def test_a_syntax_error_in_a_syntax_only_example_fails(info: str, code: str) -> None:
    text = f"<!-- example: syntax-only: needs a GPU -->\n```{info}\n{code}```\n"
    (example,) = extract(text, "bad.md")
    with pytest.raises(SyntaxError, match=r"bad\.md:2"):
        examples.check_syntax(example)


def test_a_runnable_example_runs_with_this_interpreter_and_the_project(tmp_path: Path) -> None:
    text = (
        "```sh\n"
        'python -c "import sys, harness; print(sys.executable)" > exe.txt\n'
        "```\n"
        "```python\n"
        "import sys, harness\n"
        "open('py.txt', 'w').write(sys.executable)\n"
        "```\n"
    )
    shell, python = extract(text, "page.md")
    assert examples.run(shell, tmp_path).returncode == 0
    assert examples.run(python, tmp_path).returncode == 0
    assert (tmp_path / "exe.txt").read_text().strip() == sys.executable
    assert (tmp_path / "py.txt").read_text() == sys.executable


def test_a_failing_command_stops_a_shell_example(tmp_path: Path) -> None:
    (example,) = extract("```bash\necho before\nfalse\necho after\n```\n")
    outcome = examples.run(example, tmp_path)
    assert outcome.returncode == 1
    assert "before" in outcome.output and "after" not in outcome.output


def test_a_slow_example_is_killed_at_the_time_limit(tmp_path: Path) -> None:
    (example,) = extract("```sh\nsleep 30 &\nsleep 30\n```\n")
    outcome = examples.run(example, tmp_path, timeout=0.5)
    assert outcome.returncode is None


def test_continues_joins_a_block_to_the_one_before() -> None:
    text = (
        "```sh\nexport X=1\n```\n\nthen\n\n"
        '<!-- example: continues -->\n```sh\ntest "$X" = 1\n```\n'
    )
    (example,) = extract(text, "page.md")
    assert example.where == "page.md:1"
    assert example.code == 'export X=1\ntest "$X" = 1\n'


@pytest.mark.parametrize(
    "text",
    [
        "<!-- example: skip -->\n```sh\nls\n```\n",  # a marker it does not know
        "<!-- example: syntax-only -->\n```sh\nls\n```\n",  # no reason
        "<!-- example: syntax-only: GPU -->\n\n```sh\nls\n```\n",  # not the line before
        "<!-- example: syntax-only: GPU -->\n```text\nls\n```\n",  # before a non-example
        "text\n<!-- example: syntax-only: GPU -->\n",  # before nothing
        "```py\nprint(1)\n```\n",  # a look-alike that would escape the tests
        "<!-- example: continues -->\n```sh\nls\n```\n",  # continues nothing
        "```python\nx = 1\n```\n<!-- example: continues -->\n```sh\nls\n```\n",
    ],
    ids=["unknown-marker", "no-reason", "blank-line-between", "before-text", "before-nothing",
         "lookalike-py", "continues-nothing", "continues-another-language"],
)  # fmt: skip
def test_a_marker_or_block_against_the_convention_is_refused(text: str) -> None:
    with pytest.raises(MarkdownError):
        extract(text, "page.md")


def test_the_copy_of_the_checkout_has_the_cases_and_empty_results(tmp_path: Path) -> None:
    examples.copy_checkout(tmp_path)
    assert (tmp_path / "cases").is_dir() and (tmp_path / "pyproject.toml").is_file()
    assert not (tmp_path / ".git").exists() and not (tmp_path / ".nox").exists()
    assert {p.name for p in (tmp_path / "results").iterdir()} <= {"README.md"}
