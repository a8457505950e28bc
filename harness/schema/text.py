"""Text from outside (case code, results files, folder names, error messages) made inert
where it is shown: in a terminal its control characters cannot move the cursor, clear the
screen, set the title or repaint text; in Markdown it formats and links nothing and stays
on its line and in its table cell.

A character that is not shown as itself is written as its Python escape (ESC as the four
characters ``\\x1b``), so the text can still be read and searched for."""

from __future__ import annotations

import re

#: What a terminal acts on instead of showing: C0 controls, DEL, C1 controls (``\x9b`` is
#: CSI on some terminals), the bidi controls that reorder text after them, the line and
#: paragraph separators, and lone surrogates (a file name's undecodable bytes, which an
#: output stream with ``surrogateescape`` would write out as the raw bytes).
CONTROL = r"\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff"
#: Newline and tab are the harness's own layout; every other control is escaped.
TERMINAL_UNSAFE = re.compile(f"[{CONTROL}]")
#: In Markdown newline and tab too (a line break ends a table row); in a line that must
#: stay one line (an error) the line breaks.
MARKDOWN_CONTROL = re.compile(f"[{CONTROL}\\n\\t]")
LINE_BREAK = re.compile(r"[\n]")
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
    """``text`` on one line: a line break in it (a folder's name, say) shown as ``\\n``."""
    return LINE_BREAK.sub(lambda match: escaped(match.group()), text)
