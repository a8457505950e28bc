"""A machine's peak matmul throughput, measured once and reused across runs.

Measuring the peak (a large square GEMM) costs about a second per device and dtype, in
every timing process of every run. The figure belongs to the machine, not the run: it is
stored in a cache file with the date it was measured, keyed by host, device model, dtype,
torch release and thread count, and reused for ``AMPMATRIX_PEAK_MAX_AGE_DAYS`` (default 30).
Set ``AMPMATRIX_CACHE_DIR`` to move the cache (default ``$XDG_CACHE_HOME/ampmatrix``).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from harness.results import storage
from harness.schema import env_vars

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


def read_cache() -> dict[str, Any]:
    """The cached peaks; an unreadable cache is ignored (it is only a cache)."""
    try:
        data = json.loads((cache_dir() / CACHE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def cached_peak(key: str, now: datetime | None = None) -> dict[str, Any] | None:
    """``{"gflops": ..., "measured_at": ...}`` when measured recently enough, else None."""
    entry = read_cache().get(key)
    if not isinstance(entry, dict) or not isinstance(entry.get("gflops"), int | float):
        return None
    try:
        measured = datetime.fromisoformat(str(entry["measured_at"]))
    except (KeyError, ValueError):
        return None
    if (now or datetime.now(timezone.utc)) - measured > max_age():
        return None
    return entry


def store_peak(key: str, gflops: float, now: datetime | None = None) -> dict[str, Any]:
    """Add a measured peak to the cache (under a lock: workers measure side by side); a
    cache that cannot be written is left as it is."""
    entry = {"gflops": gflops, "measured_at": (now or datetime.now(timezone.utc)).isoformat()}
    folder = cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with (folder / ".lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            storage.write_json_atomic(folder / CACHE_FILE, {**read_cache(), key: entry})
    except (OSError, storage.ResultsError):
        pass
    return entry
