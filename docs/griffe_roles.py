"""A griffe extension for the API reference: the docstrings cite names with Sphinx's roles
(``:class:`Case```, ``:func:`~harness.measure.judge.numerics.judge```), which Markdown
shows as they are written. Each role becomes the code span Sphinx would show: the name as
written, or only its last part where it starts with ``~``."""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

#: ``:role:`target``` for the roles the docstrings use.
ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([^`]+)`")


def shown(match: re.Match[str]) -> str:
    short, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def plain_roles(text: str) -> str:
    return ROLE.sub(shown, text)


class SphinxRolesAsCode(Extension):
    """Rewrites every docstring of a loaded package once it is whole (after the ``#:``
    comments have become the attributes' docstrings)."""

    def on_package(self, *, pkg: Object, **kwargs: Any) -> None:
        for obj in walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = plain_roles(obj.docstring.value)


def walk(obj: Object) -> list[Object]:
    """``obj`` and every object under it (aliases, which point elsewhere, left out)."""
    found = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            found += walk(member)  # type: ignore[arg-type]
    return found
