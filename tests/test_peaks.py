"""A machine's peak GEMM is measured once, cached with its date, and reused while recent."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from harness.measure.figures import peaks, perf
from harness.measure.host import caches


@pytest.fixture(autouse=True)
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_caches: None) -> Path:
    monkeypatch.setenv("AMPMATRIX_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_a_peak_is_reused_while_recent_and_measured_again_when_old() -> None:
    then = datetime(2026, 11, 1, tzinfo=timezone.utc)
    peaks.store_peak("k", 123.0, now=then)
    assert peaks.cached_peak("k", now=then + timedelta(days=29)) == {
        "gflops": 123.0,
        "measured_at": then.isoformat(),
    }
    assert peaks.cached_peak("k", now=then + timedelta(days=31)) is None
    assert peaks.cached_peak("other", now=then) is None


def test_an_unreadable_cache_is_ignored(own_cache: Path) -> None:
    (own_cache / peaks.CACHE_FILE).write_bytes(b"\xff not json")
    assert peaks.cached_peak("k") is None
    peaks.store_peak("k", 1.0)  # and replaced by a valid one
    assert (peaks.cached_peak("k") or {}).get("gflops") == 1.0


def test_the_worker_measures_once_then_reads_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    measured: list[str] = []

    def fake_measure(device: str, dtype: str) -> float:
        measured.append(dtype)
        return 42.0

    monkeypatch.setattr(perf, "measure_peak_gflops", fake_measure)
    gflops, when = perf.peak_matmul_gflops("cpu", "bfloat16")
    assert (gflops, measured) == (42.0, ["bfloat16"])
    caches.reset()  # a new process of the same machine
    assert perf.peak_matmul_gflops("cpu", "bfloat16") == (42.0, when)
    assert measured == ["bfloat16"]
    datetime.fromisoformat(when)  # recorded with its date
