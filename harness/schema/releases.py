"""A torch release as every view names it: ``2.13.0+cpu`` -> ``2.13.0``. The local version
suffix (``+cpu``, ``+cu121``) says how torch was built, not which release it is; the build
is recorded beside it (``env.json``'s CUDA version)."""

from __future__ import annotations


def torch_release(version: object) -> str:
    """The release of a torch version string (``?`` where none was recorded)."""
    return str(version or "?").split("+", 1)[0]
