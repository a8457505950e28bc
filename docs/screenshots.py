"""The screenshots the docs show, taken by headless Chromium (``nox -s screenshots``).

From the run stored in ``tests/data/runs/torch-2.13.0`` (two cases, timed, so its report
has a plot), into ``docs/images/`` (or the folder given as the one argument):

* ``report-overview.png``: the top of its HTML report (title, contents, summary matrix);
* ``report-case.png``: the report opened at one case's section (``#case-<case>``, the
  anchor the report's contents link to). Headless Chromium draws a page scrolled to a
  fragment blank in its screenshot, so this one shows the report in a frame filling the
  window, the frame opened at the fragment;
* ``terminal.png``: the summary ``python -m harness run`` prints when a run ends, the same
  text ``harness/cli/output.py``'s ``show_run`` prints, drawn as a terminal would
  (light text on a dark page, monospace).

The report is rendered with ``python -m harness report RUN --out`` into a temporary folder;
only its "Generated <time>" line changes from one regeneration to the next. The docs build
reads the committed images and needs no browser.
"""

from __future__ import annotations

import html
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The stored run the screenshots show.
RUN = ROOT / "tests" / "data" / "runs" / "torch-2.13.0"
#: Where the images go by default (committed: the docs build needs no browser).
IMAGES = ROOT / "docs" / "images"
#: The case whose report section ``report-case.png`` shows (its known failure reproduces).
CASE = "sana-softmax-float"
#: Each image: its file name and its size in pixels (width, height): the browser window's.
SIZES = {
    "report-overview.png": (1280, 900),
    "report-case.png": (1280, 960),
    "terminal.png": (1080, 920),
}
#: Above this, an image is stored with a palette of 256 colours (Pillow, where installed).
MAX_BYTES = 300_000

#: The page the terminal summary is drawn in: a terminal 132 columns wide.
TERMINAL_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>ampmatrix: the end of a run</title>
<style>
html, body {{ margin: 0; background: #1e1e1e; }}
.bar {{ background: #333; color: #bbb; font: 13px sans-serif; padding: 6px 12px; }}
pre {{ margin: 0; padding: 10px 12px; color: #d4d4d4; width: 132ch;
       font: 13px/1.35 "DejaVu Sans Mono", "Liberation Mono", monospace;
       white-space: pre-wrap; overflow-wrap: anywhere; }}
.prompt {{ color: #8ae234; }} .dim {{ color: #888; }}
</style></head>
<body><div class="bar">{title}</div><pre><span class="prompt">$ python -m harness run</span>
<span class="dim">...</span>
{summary}</pre></body></html>
"""


def find_chromium() -> str | None:
    """Chromium's executable (Debian's package ``chromium``), None where it is missing."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def terminal_text(run: Path = RUN) -> str:
    """What ``python -m harness run`` prints at its end for ``run``: its summary, the
    same call as ``show_run``'s."""
    from harness.cli.output import device_names
    from harness.results import storage
    from harness.results.summary import render_summary

    records = storage.read_records(run)
    return render_summary(records, device_names(run, records))


def terminal_page(run: Path = RUN) -> str:
    """The terminal summary of ``run`` as an HTML page, its text escaped."""
    title = f"the summary at the end of a run (the run stored in {run.relative_to(ROOT)})"
    return TERMINAL_PAGE.format(title=html.escape(title), summary=html.escape(terminal_text(run)))


#: A page that is the report, in a frame filling the window, opened at one fragment.
FRAME_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>ampmatrix report</title>
<style>html, body {{ margin: 0; overflow: hidden; }}
iframe {{ border: 0; width: 100vw; height: 100vh; display: block; }}</style></head>
<body><iframe src="{src}"></iframe></body></html>
"""


def frame_page(url: str) -> str:
    return FRAME_PAGE.format(src=html.escape(url, quote=True))


def render_report(run: Path, out: Path) -> Path:
    """``python -m harness report RUN --out OUT``: the report as a user renders it, run
    from the checkout with the run's relative path (the path the report names)."""
    shown = run.relative_to(ROOT) if run.is_relative_to(ROOT) else run
    subprocess.run(
        [sys.executable, "-m", "harness", "report", str(shown), "--out", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return out


def screenshot(browser: str, url: str, size: tuple[int, int], shot: Path, profile: Path) -> Path:
    """One headless Chromium screenshot of ``url`` in a window of ``size``."""
    width, height = size
    shot.unlink(missing_ok=True)
    result = subprocess.run(
        [
            browser,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
            "--disable-background-networking",
            "--disable-component-update",
            "--no-first-run",
            "--disable-sync",
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            f"--screenshot={shot}",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if not shot.exists():
        raise RuntimeError(f"{browser} wrote no screenshot of {url}:\n{result.stderr[-2000:]}")
    shrink(shot)
    return shot


def shrink(png: Path, limit: int = MAX_BYTES) -> None:
    """Re-encode ``png`` smaller with Pillow where it is installed: optimized, and with a
    palette of 256 colours if it is still over ``limit`` bytes."""
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(png) as image:
        rgb = image.convert("RGB")
    rgb.save(png, optimize=True)
    if png.stat().st_size > limit:
        rgb.quantize(colors=256).save(png, optimize=True)


def take_screenshots(out: Path, browser: str, run: Path = RUN) -> list[Path]:
    """The three images into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ampmatrix-shots-") as temp:
        work = Path(temp)
        profile = work / "profile"
        report = render_report(run, work / "report.html")
        terminal = work / "terminal.html"
        terminal.write_text(terminal_page(run), encoding="utf-8")
        case = work / "case.html"
        case.write_text(frame_page(f"{report.as_uri()}#case-{CASE}"), encoding="utf-8")
        urls = {
            "report-overview.png": report.as_uri(),
            "report-case.png": case.as_uri(),
            "terminal.png": terminal.as_uri(),
        }
        return [
            screenshot(browser, urls[name], size, out / name, profile)
            for name, size in SIZES.items()
        ]


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else IMAGES
    sys.path.insert(0, str(ROOT))  # this checkout's harness, installed or not
    browser = find_chromium()
    if browser is None:
        print(
            "screenshots: Chromium is not installed (Debian package 'chromium'; "
            "`nox -s screenshots` installs it where it can)",
            file=sys.stderr,
        )
        return 1
    for shot in take_screenshots(out, browser):
        print(f"screenshots: {shot} ({shot.stat().st_size // 1000} kB)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
