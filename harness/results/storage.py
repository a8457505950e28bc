"""Results on disk: ``results/<run-id>/cells.jsonl``, and the files beside it declared in
:mod:`harness.schema.run_files` (``env.json``, ``cases.json``, ``run-plan.json``).

Each record is appended as one line with a single write under an exclusive lock, then
flushed and fsynced, so parallel workers never interleave partial lines and a killed run
still has every cell that finished.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from harness.schema.config import RunConfig
from harness.schema.records import CellRecord
from harness.schema.releases import torch_release
from harness.schema.run_files import CaseInfo, CaseList, Environment, RunPlan
from harness.schema.typed import MAX_DEPTH, deeper_than

ENV_FILE = Environment.FILE
CASES_FILE = CaseList.FILE
CELLS_FILE = "cells.jsonl"
PLAN_FILE = "plan.json"
RUN_PLAN_FILE = RunPlan.FILE
TIMING_PLAN_FILE = "timing-plan.json"
PLAN_FILES = (PLAN_FILE, TIMING_PLAN_FILE)


#: The most bytes ``env.json``, ``cases.json`` or ``run-plan.json`` may hold: a run plan of
#: 100,000 cells takes about 20 MB. A larger file is refused, not read into memory.
MAX_FILE_BYTES = 256 * 2**20
#: The most bytes a line of ``cells.jsonl`` may hold: a record, its timing samples and a
#: 4,000-character error message included, takes a few kB. A longer line is a problem of
#: its own, not parsed.
MAX_LINE_BYTES = 16 * 2**20


class ResultsError(Exception):
    """A results file that cannot be read; the message names the file (and line)."""


def new_run_id(torch_version: str, now: datetime | None = None) -> str:
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-torch{torch_release(torch_version)}"


def create_run_dir(results_root: Path, run_id: str) -> Path:
    """A new, empty run directory; never reuses an existing one."""
    results_root.mkdir(parents=True, exist_ok=True)
    candidate, n = results_root / run_id, 1
    while True:
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            n += 1
            candidate = results_root / f"{run_id}-{n}"


def write_atomic(path: Path, text: str) -> None:
    """Write a file whole or not at all: into a temporary file of a fresh name beside it
    (so no existing file is touched), fsynced, then renamed over ``path``. A failure (a
    full disk) leaves ``path`` as it was and no temporary file behind."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)
            # a lone surrogate (a folder name's byte that is not UTF-8) written as ``\udcff``
            f.write(text.encode("utf-8", errors="backslashreplace"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(error, OSError):
            raise ResultsError(
                f"{path}: could not be written ({error.strerror or error})"
            ) from None
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: Path, missing: str, max_depth: int | None = None) -> Any:
    """A file of the run folder as JSON; ``missing``: what a missing file means. A file
    that cannot be read, is over ``MAX_FILE_BYTES``, is not JSON, or (given ``max_depth``)
    nests deeper than that raises ResultsError naming it."""
    try:
        data = parsed_json(read_text(path))
    except FileNotFoundError as error:
        raise ResultsError(f"{path}: {missing}") from error
    except OSError as error:
        raise ResultsError(f"{path}: could not be read ({error.strerror or error})") from None
    except ValueError as error:
        raise ResultsError(f"{path}: {error}") from error
    if max_depth is not None and deeper_than(data, max_depth):
        raise ResultsError(f"{path}: a value nested deeper than {max_depth} levels")
    return data


def read_text(path: Path) -> str:
    """A whole JSON file as UTF-8 text: a ``ValueError`` for one over ``MAX_FILE_BYTES``
    (read no further: it may be endless) or not UTF-8."""
    with path.open("rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"over the {MAX_FILE_BYTES} bytes a results file may take")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"not valid JSON ({error})") from None


def parsed_json(text: str) -> Any:
    """JSON text as Python values; a ``ValueError`` naming what is wrong, a value nested
    past the recursion limit and a string with a lone surrogate included."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not valid JSON ({error})") from error
    except RecursionError:
        raise ValueError("not readable JSON (nested too deep)") from None
    if "\\u" in text and SURROGATE_ESCAPE.search(text) and holds_lone_surrogate(data):
        raise ValueError("a string with a lone surrogate (not text)")
    return data


#: A JSON escape of half a UTF-16 pair: ``"\ud83d\ude00"`` is one character, but either
#: half alone is no text (it cannot be written as UTF-8, URL-quoted or shown).
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def holds_lone_surrogate(value: Any) -> bool:
    """Whether a string of a JSON value (a key or a value, at any depth) holds a lone
    surrogate (walked without recursion)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str) and LONE_SURROGATE.search(item):
            return True
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def run_file(run_dir: Path, name: str) -> Path:
    """The file ``name`` of a run folder, to read or append to; one that is a link leading
    out of the folder (to another run's records, to a file of the machine), or that is a
    FIFO or a device (a read of it waits for ever), is refused with a ``ResultsError``
    naming it: a run is what its folder holds, and a resume must not append to, or cut, a
    file elsewhere."""
    path = run_dir / name
    if path.exists() and not path.is_file() and not path.is_dir():
        # a FIFO or a device would block the read (or the append) for ever
        raise ResultsError(f"{path}: not a regular file; refusing it")
    if not path.is_symlink():
        return path
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError):  # a dangling link, a loop
        raise ResultsError(f"{path}: a link that cannot be followed; refusing it") from None
    if not target.is_relative_to(run_dir.resolve()):
        raise ResultsError(f"{path}: a link out of the run folder (to {target}); refusing it")
    return path


def write_env(run_dir: Path, env: Environment) -> None:
    write_json_atomic(run_dir / ENV_FILE, env.to_dict())


def write_cases(run_dir: Path, cases: Sequence[CaseInfo]) -> None:
    write_json_atomic(run_dir / CASES_FILE, CaseList(tuple(cases)).to_dict())


def write_run_plan(run_dir: Path, plan: RunPlan) -> None:
    write_json_atomic(run_dir / RUN_PLAN_FILE, plan.to_dict())


def read_cases(run_dir: Path, problems: list[str] | None = None) -> dict[str, CaseInfo]:
    """The case metadata stored with a run, by name (empty when the file is absent). A
    case with a field of the wrong type is named as a problem and left out (or raises
    ResultsError when no ``problems`` list is given)."""
    path = run_file(run_dir, CASES_FILE)
    try:
        text = read_text(path)
    except FileNotFoundError:
        return {}
    except OSError as error:
        raise ResultsError(f"{path}: could not be read ({error.strerror or error})") from None
    except ValueError as error:
        raise ResultsError(f"{path}: {error}") from error
    try:
        cases, found = checked_cases(text)
    except (TypeError, ValueError) as error:
        raise ResultsError(f"{path}: {error}") from error
    if found and problems is None:
        raise ResultsError(f"{path}: {found[0]}")
    if problems is not None:
        problems.extend(f"{path}: {problem} (left out)" for problem in found)
    return dict(cases)


@lru_cache(maxsize=16)
def checked_cases(text: str) -> tuple[dict[str, CaseInfo], tuple[str, ...]]:
    """The valid cases of a ``cases.json``, by name, and the problem of each invalid one; a
    ``TypeError`` / ``ValueError`` for a file that is not a list of cases. Kept for the
    files read last: the runs of a nightly store the same cases over and over (a report
    reads them all)."""
    data = parsed_json(text)
    problems: list[str] = []
    listed = CaseList.from_dict(data, problems)
    return {case.name: case for case in listed.cases}, tuple(problems)


class RecordNotWritten(ResultsError):
    """A record could not be written whole (the disk is full, say); none of it was written."""


def append_record(run_dir: Path, record: CellRecord) -> None:
    """Append one record as one line of strict JSON (a non-finite number is a string, see
    ``CellRecord.to_dict``): whole, or (when the disk is full) not at all."""
    path = run_file(run_dir, CELLS_FILE)
    line = (json.dumps(record.to_dict(), sort_keys=True, allow_nan=False) + "\n").encode()
    try:
        append_whole(path, line)
    except OSError as error:
        raise RecordNotWritten(
            f"{path}: the record of {record.cell.id} could not be written "
            f"({error.strerror or error})"
        ) from error


def append_whole(path: Path, data: bytes) -> None:
    """Append ``data`` under an exclusive lock, fsynced: all of it, or (when a write
    fails part way) none of it, so the file still ends where it ended before."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        start = os.fstat(fd).st_size
        try:
            write_all(fd, data)
            os.fsync(fd)
        except OSError:
            os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written; a write that makes no progress is an error."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]


#: Held by the process running or resuming a run, for as long as it does.
LOCK_FILE = ".ampmatrix.lock"


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """One process at a time writes a run: a second ``run``/``--resume`` of the same folder
    is refused instead of running and timing the same cells twice."""
    fd = os.open(run_dir / LOCK_FILE, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ResultsError(
                f"{run_dir}: another ampmatrix process is running or resuming this run"
            ) from None
        yield
    finally:
        os.close(fd)


#: Taken, blocking, by processes that add to a shared run's metadata (pytest-xdist workers
#: of the pytest plugin writing one run folder).
METADATA_LOCK_FILE = ".ampmatrix-metadata.lock"


@contextmanager
def metadata_lock(run_dir: Path) -> Iterator[None]:
    fd = os.open(run_dir / METADATA_LOCK_FILE, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def read_env(run_dir: Path, problems: list[str] | None = None) -> Environment:
    """``env.json``. A field of the wrong type raises ResultsError naming it; when a
    ``problems`` list is given, the message goes there and the field is left out."""
    path = run_file(run_dir, ENV_FILE)
    # its free-form facts (flags, GPUs, timing) are printed as they are
    data = read_json(path, "missing (not a results directory?)", max_depth=MAX_DEPTH)
    found: list[str] | None = None if problems is None else []
    try:
        env = Environment.from_dict(data, found)
    except (TypeError, ValueError) as error:
        raise ResultsError(f"{path}: {error}") from error
    if problems is not None and found:
        problems.extend(f"{path}: {problem} (left out)" for problem in found)
    return env


def read_run_plan(run_dir: Path) -> RunPlan:
    """``run-plan.json``; one that cannot be used raises ResultsError naming the file and
    what is wrong in it."""
    return _read_plan(run_dir, RunPlan.from_dict)


def read_run_config(run_dir: Path) -> RunConfig:
    """The configuration in ``run-plan.json``, its cells not read."""
    return _read_plan(run_dir, RunPlan.config_from_dict)


T = TypeVar("T")


def _read_plan(run_dir: Path, read: Callable[[Any], T]) -> T:
    path = run_file(run_dir, RUN_PLAN_FILE)
    data = read_json(path, "missing: this run cannot be resumed")
    try:
        return read(data)
    except (TypeError, ValueError) as error:
        raise ResultsError(f"{path}: {error}") from error


def drop_partial_last_line(run_dir: Path) -> str | None:
    """A run killed in the middle of a write can leave half a line at the end of
    ``cells.jsonl``; cut it (it holds no complete record) so appending can go on.
    Returns what was cut."""
    path = run_file(run_dir, CELLS_FILE)
    if not path.exists():
        return None
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return None
    whole = data.rfind(b"\n") + 1
    with path.open("r+b") as f:
        f.truncate(whole)
    return data[whole:].decode(errors="replace")


@contextmanager
def paused_gc() -> Iterator[None]:
    """No cyclic garbage collection while it lasts, the collector left as it was after it.
    Reading records builds hundreds of thousands of small objects and no cycle, and the
    collector, started again and again by so many new objects, only walks them (a third
    of the time of reading a run); so does importing torch."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def read_record_lines(run_dir: Path, problems: list[str] | None = None) -> list[CellRecord]:
    """Every line of ``cells.jsonl``, in the order written.

    A line that cannot be read raises ResultsError naming the file and line; when a
    ``problems`` list is given, the message goes there instead and the line is skipped, so
    readers such as ``report`` use everything that is valid (a file that cannot be read at
    all, a link out of the run folder among them, is then one problem, and no record).
    """
    path = run_dir / CELLS_FILE
    if not path.exists() and not path.is_symlink():
        return []
    try:
        data = run_file(run_dir, CELLS_FILE).read_bytes()
    except (OSError, ResultsError) as error:
        unread = (
            error
            if isinstance(error, ResultsError)
            else ResultsError(f"{path}: could not be read ({error.strerror or error})")
        )
        if problems is None:
            raise unread from None
        problems.append(str(unread))
        return []
    records = []
    with paused_gc():
        for number, raw in enumerate(data.split(b"\n"), start=1):
            if not raw.strip():
                continue
            try:
                records.append(_parse_record(path, number, _decoded(path, number, raw)))
            except ResultsError as error:
                if problems is None:
                    raise
                problems.append(str(error))
    return records


def read_records(run_dir: Path, problems: list[str] | None = None) -> list[CellRecord]:
    """One record per cell: ``cells.jsonl`` is a log, and a later line for a cell (its
    timed record, say) supersedes an earlier one."""
    latest: dict[str, CellRecord] = {}
    for record in read_record_lines(run_dir, problems):
        key = record.cell.id
        latest.pop(key, None)
        latest[key] = record
    return list(latest.values())


def _decoded(path: Path, number: int, raw: bytes) -> str:
    if len(raw) > MAX_LINE_BYTES:
        raise ResultsError(
            f"{path}:{number}: a line of {len(raw)} bytes, over the {MAX_LINE_BYTES} a record "
            "may take"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        where = f"{path}:{number}"
        raise ResultsError(f"{where}: not UTF-8 ({error.reason} at byte {error.start})") from None


def _parse_record(path: Path, number: int, line: str) -> CellRecord:
    """A line's record; a ``ResultsError`` naming the file and line for anything else (the
    record parser raises ``MalformedRecord``, a ``ValueError``, and no other error)."""
    try:
        return CellRecord.from_dict(parsed_json(line))
    except ValueError as error:
        raise ResultsError(f"{path}:{number}: {error}") from error
