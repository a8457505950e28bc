"""Text from outside (case code, results files, env.json, folder names, error messages) made
inert where it is shown, by one escaping per output:

- the terminal: :func:`one_line` for a field that is one line (a GPU's name, a cell's id,
  an error's first line, a warning) and for each line the harness composes of such fields
  (:func:`terminal_lines`), so a line break in a field cannot forge a line of its own (a
  ``nightly verdict: pass`` above the real ``FAIL``); :func:`terminal_safe` for text whose
  lines are its own (a traceback excerpt), each line escaped. Its control characters can
  never move the cursor, clear the screen, set the title or repaint text.
- Markdown: :func:`markdown_safe`, which formats and links nothing and stays on its line
  and in its table cell.
- HTML: Jinja2's autoescaping (``harness.report.writing``), and ``html.escape`` in the
  SVG pictures built as strings.

A character that is not shown as itself is written as its Python escape (ESC as the four
characters ``\\x1b``, a line break as ``\\n``), so the text can still be read and
searched for."""

from __future__ import annotations

import re
from collections.abc import Iterable

#: What a terminal acts on instead of showing: C0 controls, DEL, C1 controls (``\x9b`` is
#: CSI on some terminals), the bidi controls that reorder text after them, the line and
#: paragraph separators, and lone surrogates (a file name's undecodable bytes, which an
#: output stream with ``surrogateescape`` would write out as the raw bytes).
CONTROL = r"\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff"
#: Newline and tab are the harness's own layout; every other control is escaped.
TERMINAL_UNSAFE = re.compile(f"[{CONTROL}]")
#: In Markdown newline and tab too (a line break ends a table row).
MARKDOWN_CONTROL = re.compile(f"[{CONTROL}\\n\\t]")
#: In a field that is one line, the line break too (the other line breaks, ``\r``, ``\x85``,
#: ``\u2028``, are controls already); tab stays (it moves along the line, never off it).
ONE_LINE_UNSAFE = re.compile(f"[{CONTROL}\\n]")
#: The ASCII punctuation that starts Markdown syntax anywhere on a line (emphasis, code,
#: links and images, HTML tags and entities, table cells, headings, autolinks); each is
#: shown as itself when escaped with a backslash (CommonMark).
MARKDOWN_SYNTAX = re.compile(r"([\\`*_~\[\]<>|#!&:])")


def escaped(char: str) -> str:
    """``\\x1b``, ``\\r``, ``\\u202e``: the character as Python escapes it."""
    return char.encode("unicode_escape").decode("ascii")


def terminal_safe(text: str) -> str:
    """``text`` with every control character but newline and tab shown escaped."""
    return TERMINAL_UNSAFE.sub(lambda match: escaped(match.group()), text)


def markdown_safe(text: str) -> str:
    """``text`` as Markdown that shows it as it is, on one line: control characters
    (newline included) escaped as in the terminal, Markdown's syntax backslash-escaped."""
    plain = MARKDOWN_CONTROL.sub(lambda match: escaped(match.group()), text)
    return MARKDOWN_SYNTAX.sub(r"\\\1", plain)


def one_line(text: str) -> str:
    """``text`` as one line of a terminal: a line break in it (a GPU's name in env.json, a
    folder's name, an error message) shown as ``\\n``, every other control escaped as
    :func:`terminal_safe` escapes it."""
    return ONE_LINE_UNSAFE.sub(lambda match: escaped(match.group()), text)


def terminal_lines(lines: Iterable[str]) -> str:
    """Lines the harness composed (each of its own text and fields from outside) as the
    terminal's text: each made :func:`one_line`, then joined, so the output has exactly as
    many lines as the harness meant."""
    return "\n".join(one_line(line) for line in lines)
