"""A machine's peak matmul throughput, measured once and reused across runs.

Measuring the peak (a large square GEMM) costs about a second per device and dtype, in
every timing process of every run. The figure belongs to the machine, not the run: it is
stored in a cache file with the date it was measured, keyed by host, device model, dtype,
torch release and thread count, and reused for ``AMPMATRIX_PEAK_MAX_AGE_DAYS`` (default 30).
Set ``AMPMATRIX_CACHE_DIR`` to move the cache (default ``$XDG_CACHE_HOME/ampmatrix``).
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from harness.results import storage
from harness.schema import env_vars
from harness.schema.text import one_line

CACHE_FILE = "peaks.json"


def cache_dir() -> Path:
    explicit = env_vars.CACHE_DIR.read()
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ampmatrix"


def max_age() -> timedelta:
    """How long a cached peak is reused; a value out of its rule (``nan``, ``1e12``) is
    refused naming the variable (the command line checks it before any work)."""
    return timedelta(days=env_vars.PEAK_MAX_AGE_DAYS.read())


def peak_key(device_model: str, dtype: str, torch_version: str, threads: int) -> str:
    host = socket.gethostname()
    return f"{host}|{device_model}|{dtype}|torch {torch_version}|{threads} threads"


#: The most GFLOP/s a cached peak may claim: 100 PFLOP/s, fifty times the densest GPU's
#: float8 figure. A larger one (or zero, a negative or a non-finite figure) was not measured
#: by this harness, and would make every timing's share of the peak a wrong number.
MAX_GFLOPS = 1e8


def read_cache(say: bool = True) -> dict[str, Any]:
    """The cached peaks as the file holds them. A cache that cannot be used (not a regular
    file: a FIFO's read would wait for ever; not JSON; not an object) is ignored, it is
    only a cache, and (``say``) named in one warning line: its peaks are measured again
    and replace it. Each entry is checked where it is used (:func:`entry_problem`)."""
    path = cache_dir() / CACHE_FILE
    if not path.exists():
        return {}
    try:
        if not path.is_file():
            raise ValueError("not a regular file")
        data = storage.read_json(path, "missing")
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    except (storage.ResultsError, ValueError) as error:
        if say:
            print(
                one_line(
                    f"ampmatrix: warning: {path}: {str(error).removeprefix(f'{path}: ')}: "
                    "ignored, its peaks measured again"
                ),
                file=sys.stderr,
                flush=True,
            )
        return {}
    return data


def entry_problem(entry: object, now: datetime) -> str | None:
    """What is wrong with a cached entry, or None for one that can be used: its figure a
    finite number of GFLOP/s in (0, ``MAX_GFLOPS``], its time an ISO time with its zone (a
    naive time's age cannot be told) and not in the future (it would be reused forever)."""
    if not isinstance(entry, dict):
        return f"not an object ({type(entry).__name__})"
    gflops = entry.get("gflops")
    if isinstance(gflops, bool) or not isinstance(gflops, int | float):
        return f"gflops {gflops!r} is not a number"
    if not 0 < gflops <= MAX_GFLOPS:  # NaN fails too
        return f"gflops {gflops!r} is not a finite figure in (0, {MAX_GFLOPS:g}]"
    measured_at = entry.get("measured_at")
    try:
        measured = datetime.fromisoformat(measured_at) if isinstance(measured_at, str) else None
    except ValueError:
        measured = None
    if measured is None:
        return f"measured_at {measured_at!r} is not an ISO time"
    if measured.utcoffset() is None:
        return f"measured_at {measured_at!r} has no zone"
    if measured > now:
        return f"measured_at {measured_at!r} is in the future"
    return None


def cached_peak(key: str, now: datetime | None = None) -> dict[str, Any] | None:
    """``{"gflops": ..., "measured_at": ...}`` when measured recently enough, else None. A
    bad entry is named in a warning and ignored: the peak is measured again and replaces it."""
    now = now or datetime.now(timezone.utc)
    entries = read_cache()
    if key not in entries:
        return None
    entry = entries[key]
    problem = entry_problem(entry, now)
    if problem is not None:
        warn_bad_entry(key, problem)
        return None
    if now - datetime.fromisoformat(entry["measured_at"]) > max_age():
        return None
    return {"gflops": float(entry["gflops"]), "measured_at": entry["measured_at"]}


def warn_bad_entry(key: str, problem: str) -> None:
    """One line on stderr naming the cache file, the entry and what is wrong with it."""
    print(
        one_line(
            f"ampmatrix: warning: {cache_dir() / CACHE_FILE}: peak {key!r}: {problem}: "
            "ignored, measured again"
        ),
        file=sys.stderr,
        flush=True,
    )


def store_peak(key: str, gflops: float, now: datetime | None = None) -> dict[str, Any]:
    """Add a measured peak to the cache (under a lock: workers measure side by side); a
    cache that cannot be written is left as it is."""
    now = now or datetime.now(timezone.utc)
    entry = {"gflops": gflops, "measured_at": now.isoformat()}
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / ".lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            storage.write_json_atomic(folder / CACHE_FILE, {**usable_entries(now), key: entry})
    except (OSError, storage.ResultsError):
        pass
    return entry


def usable_entries(now: datetime) -> dict[str, Any]:
    """The cache's entries that pass :func:`entry_problem` (old ones too: another thread
    count's may still be recent enough for its max age); a bad one is dropped as the cache
    is written again."""
    return {k: v for k, v in read_cache(say=False).items() if entry_problem(v, now) is None}
