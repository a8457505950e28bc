"""Where in the source a traced op ran or an error was raised: the case's or model's own
``file:line`` (torch's, the harness's and the standard library's frames skipped), the
dotted path of the module running, and the call a Python-level check raised from."""

from __future__ import annotations

import ast
import importlib.util
import linecache
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch
from torch import nn

from harness.measure.host import caches
from harness.measure.precision.dtypes import dtype_name
from harness.schema.trail_records import Site

TORCH_DIR = str(Path(torch.__file__).resolve().parent)


HARNESS_DIR = Path(__file__).resolve().parents[2]


STDLIB_DIRS = tuple(
    str(Path(sysconfig.get_paths()[key]).resolve()) for key in ("stdlib", "platstdlib")
)


def package_dirs(names: tuple[str, ...]) -> tuple[str, ...]:
    """The folders of the installed packages ``names`` (found, not imported)."""
    found = []
    for name in names:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            found += [str(Path(d).resolve()) for d in spec.submodule_search_locations]
    return tuple(found)


#: The test runner's packages, whose frames call the harness (and so the model) in a run's
#: workers and the plugin's tests: never the model's code, though they live in
#: site-packages beside the models' libraries.
RUNNER_DIRS = package_dirs(("_pytest", "pluggy", "xdist", "execnet"))


def is_library_file(filename: str) -> bool:
    """Frames of torch, of the harness, of the test runner and of the standard library are
    not the model's code."""
    try:
        path = str(Path(filename).resolve())
    except (OSError, ValueError):
        return True
    if path.startswith(STDLIB_DIRS) and "site-packages" not in path:
        return True
    return path.startswith((TORCH_DIR, str(HARNESS_DIR), *RUNNER_DIRS)) or filename.startswith("<")


def shown_path(filename: str | Path) -> str:
    """A source file as the terminal shows it: relative to the working folder where it can be."""
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(filename)


def shown(filename: str, line: int) -> str:
    return f"{shown_path(filename)}:{line}"


def frames_outward(frame: FrameType | None) -> Iterator[FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


def user_location(frame: FrameType | None) -> str | None:
    """The innermost frame in the case's or model's own code, as ``file:line``."""
    for f in frames_outward(frame):
        if not is_library_file(f.f_code.co_filename):
            return shown(f.f_code.co_filename, f.f_lineno)
    return None


def module_path(frame: FrameType | None, root: nn.Module | None = None) -> str | None:
    """The dotted path of the innermost module running: named from the workload's model
    (``root``) when it holds that module, else from the outermost module on the stack; the
    class name for the root itself."""
    modules = [
        module
        for f in frames_outward(frame)
        if isinstance(module := f.f_locals.get("self"), nn.Module)
    ]
    if not modules:
        return None
    inner = modules[0]
    for outer in (root, modules[-1]):
        if outer is None:
            continue
        for name, candidate in outer.named_modules():
            if candidate is inner:
                return name or type(inner).__name__
    return type(inner).__name__


def failure_from_traceback(
    error: BaseException, root: nn.Module | None = None
) -> tuple[Site | None, list[torch.Tensor]]:
    """Where an error that no traced op raised (an input check in a composite op such as
    SDPA, or a Python-level check) came from: the call in the case's or model's own code
    that raised it, with the floating tensors it passed (and their dtypes)."""
    frames = list(traceback_entries(error.__traceback__))
    user = [tb for tb in frames if not is_library_file(tb.tb_frame.f_code.co_filename)]
    if not user:
        return None, []
    entry = user[-1]
    frame, line = entry.tb_frame, entry.tb_lineno
    callee, tensors = call_at(frame.f_code.co_filename, line, position(entry), frame.f_locals)
    site = Site(
        op=callee or "?",
        module=module_path(frames[-1].tb_frame, root),
        location=shown(frame.f_code.co_filename, line),
        input_dtypes=tuple(dtype_name(t.dtype) for t in tensors),
    )
    return site, tensors


def position(entry: TracebackType) -> tuple[int, int] | None:
    """(line, column) where the raising instruction starts (Python 3.11+), else None."""
    positions = getattr(entry.tb_frame.f_code, "co_positions", None)
    if positions is None:
        return None
    found = list(positions())[entry.tb_lasti // 2]
    return (found[0], found[2]) if found[0] is not None and found[2] is not None else None


def traceback_entries(tb: TracebackType | None) -> Iterator[TracebackType]:
    while tb is not None:
        yield tb
        tb = tb.tb_next


def call_at(
    filename: str, line: int, start: tuple[int, int] | None, local_vars: dict[str, Any]
) -> tuple[str | None, list[torch.Tensor]]:
    """The call that raised, as written (the call starting at ``start`` when known, else the
    innermost call on the line), and the floating tensors among the names it passes."""
    spanning = [n for n in calls_in(filename) if n.lineno <= line <= (n.end_lineno or n.lineno)]
    exact = [n for n in spanning if start and (n.lineno, n.col_offset) == start]
    if not (exact or spanning):
        return None, []
    call = (exact or sorted(spanning, key=lambda n: (n.lineno, n.col_offset)))[-1]
    passed = [*call.args, *(k.value for k in call.keywords)]
    names = [a.id for a in passed if isinstance(a, ast.Name)]
    values = [local_vars.get(n) for n in names]
    floats = [t for t in values if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return ast.unparse(call.func), floats


@caches.lru_cache(maxsize=64)
def calls_in(filename: str) -> tuple[ast.Call, ...]:
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return ()
    return tuple(node for node in ast.walk(tree) if isinstance(node, ast.Call))
