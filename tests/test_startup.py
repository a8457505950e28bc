"""The command line's start and end (``harness.cli.startup``): the run machinery imported
with the collector paused and frozen out of its passes, once; the heap frozen for the exit.
Each test runs in a fresh interpreter, whose heap is its own to freeze."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def fresh(script: str) -> dict[str, object]:
    """What ``script`` printed as JSON on its last line, run in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return dict(json.loads(done.stdout.splitlines()[-1]))


def test_the_run_machinery_is_imported_once_frozen_with_the_collector_left_on() -> None:
    seen = fresh(
        "import gc, json, sys\n"
        "from harness.cli import startup\n"
        "before = gc.get_freeze_count()\n"
        "startup.import_run_machinery()\n"
        "first = gc.get_freeze_count()\n"
        "startup.import_run_machinery()\n"
        "print(json.dumps({'before': before, 'first': first, 'again': gc.get_freeze_count(),\n"
        "    'enabled': gc.isenabled(), 'torch': 'torch' in sys.modules}))\n"
    )
    assert seen["before"] == 0
    assert isinstance(seen["first"], int) and seen["first"] > 100_000  # torch's heap, frozen
    assert seen["again"] == seen["first"]  # the second call froze nothing more
    assert seen["enabled"] is True
    assert seen["torch"] is True


def test_a_collector_turned_off_before_stays_off() -> None:
    seen = fresh(
        "import gc, json\n"
        "from harness.cli import startup\n"
        "gc.disable()\n"
        "startup.import_run_machinery()\n"
        "print(json.dumps({'enabled': gc.isenabled()}))\n"
    )
    assert seen == {"enabled": False}


def test_a_reading_command_imports_no_torch_and_the_exit_freezes_its_heap(
    tmp_path: Path,
) -> None:
    seen = fresh(
        "import gc, json, sys\n"
        "from harness.cli import entry\n"
        f"sys.argv = ['ampmatrix', 'compare', {str(tmp_path)!r}, {str(tmp_path)!r}]\n"
        "code = entry()\n"
        "print(json.dumps({'code': code, 'frozen': gc.get_freeze_count(),\n"
        "    'torch': 'torch' in sys.modules}))\n"
    )
    assert seen["code"] == 2  # no run there: one line, exit code 2
    assert seen["torch"] is False
    assert isinstance(seen["frozen"], int) and seen["frozen"] > 0
