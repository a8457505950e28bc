"""A machine's peak GEMM is measured once, cached with its date, and reused while recent."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch

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


THEN = datetime(2026, 11, 1, tzinfo=timezone.utc)


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ({"gflops": float("nan"), "measured_at": THEN.isoformat()}, "not a finite figure"),
        ({"gflops": float("inf"), "measured_at": THEN.isoformat()}, "not a finite figure"),
        ({"gflops": 1e12, "measured_at": THEN.isoformat()}, "not a finite figure"),
        ({"gflops": -3.0, "measured_at": THEN.isoformat()}, "not a finite figure"),
        ({"gflops": 0, "measured_at": THEN.isoformat()}, "not a finite figure"),
        ({"gflops": True, "measured_at": THEN.isoformat()}, "not a number"),
        ({"gflops": "123", "measured_at": THEN.isoformat()}, "not a number"),
        ({"gflops": 123.0, "measured_at": "2026-11-01T00:00:00"}, "has no zone"),
        ({"gflops": 123.0, "measured_at": "yesterday"}, "not an ISO time"),
        ({"gflops": 123.0, "measured_at": 1764547200}, "not an ISO time"),
        ({"gflops": 123.0}, "not an ISO time"),
        ({"gflops": 123.0, "measured_at": "2099-01-01T00:00:00+00:00"}, "in the future"),
        ([123.0, THEN.isoformat()], "not an object"),
    ],
)
def test_a_hand_edited_bad_entry_is_named_ignored_and_measured_again(
    own_cache: Path,
    capsys: pytest.CaptureFixture[str],
    entry: object,
    named: str,
) -> None:
    """A figure out of range or a time without its zone is never used as it is: a warning
    names the file, the entry and what is wrong, the peak is measured again and replaces it,
    and the good entries beside it are kept."""
    good = {"gflops": 50.0, "measured_at": THEN.isoformat()}
    cache = {"bad\nkey": entry, "good": good}
    (own_cache / peaks.CACHE_FILE).write_text(json.dumps(cache))
    assert peaks.cached_peak("bad\nkey", now=THEN + timedelta(days=1)) is None
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.startswith(f"ampmatrix: warning: {own_cache / peaks.CACHE_FILE}: ")
    assert "'bad\\nkey'" in warning and named in warning and "ignored" in warning
    assert peaks.cached_peak("good", now=THEN + timedelta(days=1)) == good
    peaks.store_peak("bad\nkey", 42.0, now=THEN + timedelta(days=1))
    stored = json.loads((own_cache / peaks.CACHE_FILE).read_text())
    assert stored == {
        "bad\nkey": {"gflops": 42.0, "measured_at": stored["bad\nkey"]["measured_at"]},
        "good": good,
    }
    assert capsys.readouterr().err == ""


def test_the_worker_measures_again_over_a_bad_entry(
    own_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A timing process that meets a bad entry for its own key measures the peak (its
    figures are never the cache's bad number) and goes on."""
    monkeypatch.setattr(perf, "measure_peak_gflops", lambda device, dtype: 42.0)
    key = peaks.peak_key(
        perf.device_model("cpu"), "bfloat16", torch.__version__, torch.get_num_threads()
    )
    (own_cache / peaks.CACHE_FILE).write_text(
        json.dumps({key: {"gflops": float("nan"), "measured_at": "2026-11-01T00:00:00"}})
    )
    gflops, _ = perf.peak_matmul_gflops("cpu", "bfloat16")
    assert gflops == 42.0
    assert "not a finite figure" in capsys.readouterr().err
