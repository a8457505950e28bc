"""The docs' screenshots (docs/screenshots.py, ``nox -s screenshots``): taken afresh where
Chromium is installed, and the committed ones in docs/images/ as the script takes them."""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import ROOT
from tests.test_report import chromium, needs_chromium

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def screenshots_script() -> ModuleType:
    """``docs/screenshots.py``, a script, loaded by its path."""
    spec = importlib.util.spec_from_file_location("screenshots", ROOT / "docs" / "screenshots.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def png_size(path: Path) -> tuple[int, int]:
    """A PNG's width and height, from its header (fails on anything but a PNG)."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_SIGNATURE and head[12:16] == b"IHDR", f"{path} is not a PNG"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def distinct_colours(path: Path) -> int:
    Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed here")
    with Image.open(path) as image:
        return len(image.convert("RGB").getcolors(maxcolors=1 << 24) or [])


def test_the_committed_screenshots_are_the_pngs_the_script_takes() -> None:
    """The docs build uses the committed images (it needs no browser): each is there, a
    PNG of the size the script takes, and small enough to commit."""
    script = screenshots_script()
    assert set(script.SIZES) == {"report-overview.png", "report-case.png", "terminal.png"}
    for name, size in script.SIZES.items():
        image = script.IMAGES / name
        assert image.exists(), f"{image} missing: run `nox -s screenshots`"
        assert png_size(image) == size
        assert image.stat().st_size < script.MAX_BYTES


def test_the_terminal_page_is_the_runs_summary_escaped() -> None:
    script = screenshots_script()
    text = script.terminal_text()
    page = script.terminal_page()
    assert "sana-softmax-float" in text and "raises:repro" in text
    assert "outcomes: 30 passes, 2 raises" in text
    assert "c: ratio to the case&#x27;s fp32 control" in page  # escaped, not raw
    assert str(ROOT) not in page  # no machine path in a committed picture


@needs_chromium
def test_the_screenshots_are_taken_afresh(tmp_path: Path) -> None:
    script = screenshots_script()
    browser = chromium()
    assert browser is not None
    shots = script.take_screenshots(tmp_path / "images", browser)
    assert [shot.name for shot in shots] == list(script.SIZES)
    for shot in shots:
        assert png_size(shot) == script.SIZES[shot.name]
        assert shot.stat().st_size < script.MAX_BYTES
        # not blank: text, table colours and (in the report) a plot's markers
        assert distinct_colours(shot) > 50, f"{shot.name} looks blank"
