"""The documentation's examples: found in Markdown, checked for syntax, run.

The convention is written out in ``tests/test_examples.py``; this module does the work:
``extract`` finds the examples in one Markdown text, ``check_syntax`` checks one with
``bash -n`` or ``compile()``, and ``run`` runs one in a copy of the checkout.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: The info strings whose blocks are examples, and the language each is run as.
LANGUAGES = {
    "bash": "shell",
    "sh": "shell",
    "shell": "shell",
    "console": "shell",
    "python": "python",
}
#: Info strings that look like a shell session or Python but are none of the above: a block
#: with one would silently escape the tests, so the tests refuse it (use a name above, or
#: ``text`` for output).
LOOKALIKES = frozenset(
    {"py", "python3", "pycon", "ipython", "zsh", "fish", "shell-session", "shellsession",
     "sh-session", "bash-session", "terminal", "powershell", "ps1", "cmd", "bat"}
)  # fmt: skip
#: The Markdown the examples live in, relative to the repository's root.
DOC_GLOBS = ("README.md", "docs/**/*.md")
#: Seconds one runnable example may take before it fails (``AMPMATRIX_EXAMPLE_TIMEOUT``).
TIMEOUT = float(os.environ.get("AMPMATRIX_EXAMPLE_TIMEOUT", "60"))

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_MARKER = re.compile(r"^\s*<!--\s*example:\s*(?P<body>.*?)\s*-->\s*$")
_MARKER_START = re.compile(r"^\s*<!--\s*example\b")


class MarkdownError(ValueError):
    """A marker the convention does not know, or one that marks no block."""


@dataclass(frozen=True)
class Example:
    """One example: where it is, its language, its code and how it is checked."""

    path: str  #: the Markdown file, relative to the repository's root
    line: int  #: the line of its opening fence, from 1
    info: str  #: the fence's language (``bash``, ``sh``, ``shell``, ``console``, ``python``)
    code: str  #: what runs: a ``console`` block's commands, else the block's text
    syntax_only: str | None = None  #: why it is only checked for syntax; None: it runs

    @property
    def language(self) -> str:
        return LANGUAGES[self.info]

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def console_commands(text: str) -> str:
    """A ``console`` block's commands: its lines that start with ``$ `` (without it), with
    the lines a trailing backslash continues; every other line is output."""
    commands: list[str] = []
    continuing = False
    for line in text.splitlines():
        if continuing:
            commands.append(line)
        elif line.startswith("$ ") or line == "$":
            commands.append(line[2:])
        else:
            continue
        continuing = line.endswith("\\")
    return "".join(command + "\n" for command in commands)


def _marker(line: str, path: str, number: int) -> tuple[str, str] | None:
    """The marker on a line, as (kind, reason): ``("syntax-only", reason)`` or
    ``("continues", "")``; None where the line is no marker."""
    if not _MARKER_START.match(line):
        return None
    match = _MARKER.match(line)
    body = match["body"] if match else ""
    if body == "continues":
        return ("continues", "")
    kind, _, reason = body.partition(":")
    if kind.strip() == "syntax-only" and reason.strip():
        return ("syntax-only", reason.strip())
    raise MarkdownError(
        f"{path}:{number}: unknown example marker {line.strip()!r}; write "
        "'<!-- example: syntax-only: <reason> -->' or '<!-- example: continues -->'"
    )


def extract(text: str, path: str = "<text>") -> list[Example]:
    """The examples in a Markdown text, in order: every fenced block whose info string is
    one of ``LANGUAGES``, joined to the one before where marked ``continues``."""
    lines = text.splitlines()
    examples: list[Example] = []
    pending: tuple[int, tuple[str, str]] | None = None  # a marker waiting for its fence
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = _marker(line, path, i + 1)
        if marker is not None:
            if pending is not None:
                raise MarkdownError(f"{path}:{pending[0]}: this example marker marks no block")
            pending = (i + 1, marker)
            i += 1
            continue
        opening = _FENCE.match(line)
        if opening is None:
            if pending is not None:
                raise MarkdownError(
                    f"{path}:{pending[0]}: an example marker must be the line just before "
                    "a block's opening fence (no blank line between)"
                )
            i += 1
            continue
        fence, info = opening["fence"], opening["info"].strip()
        if fence[0] == "`" and "`" in info:  # inline code, not a fence
            i += 1
            continue
        # the block's text: up to a closing fence of the same character, at least as long
        indent = len(line) - len(line.lstrip())
        body: list[str] = []
        j = i + 1
        closing = re.compile(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        while j < len(lines) and not closing.match(lines[j]):
            strip = min(indent, len(lines[j]) - len(lines[j].lstrip(" ")))
            body.append(lines[j][strip:])
            j += 1
        language = info.split()[0].lower() if info else ""
        if pending is not None and language not in LANGUAGES:
            raise MarkdownError(
                f"{path}:{pending[0]}: an example marker before a block that is no example "
                f"({language or 'no language'!r})"
            )
        if language in LOOKALIKES:
            raise MarkdownError(
                f"{path}:{i + 1}: a ```{language} block escapes the example tests; write "
                f"```{' or ```'.join(sorted(LANGUAGES))} (it runs, or is marked syntax-only), "
                "or ```text for output"
            )
        if language in LANGUAGES:
            text_ = "\n".join(body) + "\n" if body else ""
            code = console_commands(text_) if language == "console" else text_
            kind, reason = pending[1] if pending else ("", "")
            if kind == "continues":
                if not examples:
                    raise MarkdownError(f"{path}:{i + 1}: 'continues' with no example before")
                before = examples[-1]
                if before.language != LANGUAGES[language]:
                    raise MarkdownError(
                        f"{path}:{i + 1}: a {language} block cannot continue {before.where}'s "
                        f"{before.info} block"
                    )
                examples[-1] = Example(
                    before.path, before.line, before.info, before.code + code, before.syntax_only
                )
            else:
                examples.append(
                    Example(path, i + 1, language, code, reason if kind == "syntax-only" else None)
                )
        pending = None
        i = j + 1
    if pending is not None:
        raise MarkdownError(f"{path}:{pending[0]}: this example marker marks no block")
    return examples


def documents(root: Path = ROOT) -> list[Path]:
    """README.md and every Markdown file under docs/, sorted."""
    found = {path for pattern in DOC_GLOBS for path in root.glob(pattern) if path.is_file()}
    return sorted(found)


def collect(root: Path = ROOT) -> list[Example]:
    """Every example in the documentation."""
    examples: list[Example] = []
    for path in documents(root):
        examples += extract(path.read_text(encoding="utf-8"), path.relative_to(root).as_posix())
    return examples


def check_syntax(example: Example) -> None:
    """Raise SyntaxError, naming the file and line, where the example does not parse."""
    if example.language == "python":
        compile(example.code, example.where, "exec")
        return
    result = subprocess.run(
        ["bash", "-n"], input=example.code, capture_output=True, text=True, timeout=30
    )
    if result.returncode:
        raise SyntaxError(f"{example.where}: bash -n: {result.stderr.strip()}")


#: Top-level entries of the checkout not copied for an example: VCS, caches, environments,
#: and the outputs of earlier runs (an example starts with empty results/ and reports/).
_NOT_COPIED = {".git", ".nox", ".venv", "build", ".mypy_cache", ".ruff_cache", ".pytest_cache"}


def _checkout_files(root: Path) -> list[Path]:
    """The files an example sees: git's tracked and unignored files where this is a git
    checkout, else every file outside ``_NOT_COPIED``, caches and egg-info."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=root,
            capture_output=True,
            check=True,
            timeout=30,
        ).stdout.decode()
        paths = [Path(p) for p in listed.split("\0") if p]
    except (OSError, subprocess.SubprocessError):
        paths = [
            p.relative_to(root)
            for p in root.rglob("*")
            if p.is_file()
            and not {"__pycache__"} & set(p.parts)
            and not p.relative_to(root).parts[0].endswith(".egg-info")
        ]
    return [
        p
        for p in paths
        if p.parts[0] not in _NOT_COPIED and (root / p).is_file() and "__pycache__" not in p.parts
    ]


def copy_checkout(dest: Path, root: Path = ROOT) -> None:
    """A copy of the checkout's files in ``dest``, so an example that reads ``cases/`` or
    writes ``results/`` works as in a clone without touching this one."""
    for rel in _checkout_files(root):
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / rel, target)


@dataclass(frozen=True)
class Outcome:
    returncode: int | None  #: None: killed at the time limit
    output: str


def run(example: Example, workdir: Path, timeout: float = TIMEOUT, root: Path = ROOT) -> Outcome:
    """Run a runnable example in ``workdir`` (a copy of the checkout): Python with this
    interpreter, shell with ``bash -e``, where ``python`` is this interpreter and the
    repository's root is on PYTHONPATH; killed with its children after ``timeout`` s."""
    bindir = Path(tempfile.mkdtemp(prefix="example-bin-"))
    try:
        for name in ("python", "python3"):
            shim = bindir / name
            shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
            shim.chmod(0o755)
        env = dict(os.environ)
        env["PATH"] = os.pathsep.join(
            [str(bindir), str(Path(sys.executable).parent), env.get("PATH", "")]
        )
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
        if example.language == "python":
            script = workdir / "_example.py"
            script.write_text(example.code, encoding="utf-8")
            command = [sys.executable, str(script)]
        else:
            script = workdir / "_example.sh"
            script.write_text(example.code, encoding="utf-8")
            command = ["bash", "-e", str(script)]
        process = subprocess.Popen(
            command,
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = process.communicate(timeout=timeout)
            return Outcome(process.returncode, output)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            return Outcome(None, output)
    finally:
        shutil.rmtree(bindir, ignore_errors=True)
