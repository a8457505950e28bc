"""The version every stored file carries, checked one way for all of them: each record of
``cells.jsonl`` and each file of a run folder beside it (``env.json``, ``cases.json``,
``run-plan.json``, and any file added later) declare theirs under :data:`VERSION_KEY`.

A version newer than the reader's is refused, with what to do (upgrade ampmatrix); an older
one is the caller's to migrate or read as it is. A file written before its kind had
versions is read as the version its caller names (``absent``); where the key is required
(a record), its absence is refused like any value that is not a version.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from harness.schema.typed import mismatch

#: The key of a version, in a record and in every file of a run folder.
VERSION_KEY = "schema_version"


def checked_version(data: Mapping[str, Any], newest: int, absent: int | None = None) -> int:
    """The version ``data`` declares: a whole number from 1 up to ``newest``, or ``absent``
    where it declares none and ``absent`` is given. A ``ValueError`` otherwise: a version
    newer than ``newest`` says to upgrade, anything else (a text, a bool, null, 0) that it
    is no version number."""
    version = data.get(VERSION_KEY, absent)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(mismatch(VERSION_KEY, "a version number", version))
    if version > newest:
        raise ValueError(
            f"{VERSION_KEY} {version} is newer than this ampmatrix reads (up to {newest}); "
            "upgrade ampmatrix to read it"
        )
    return version
