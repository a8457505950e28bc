"""ampmatrix sessions: ``nox -s matrix``, ``nox -s tests``, ``nox -s lint`` and more.

The torch versions under test live here, in ``TORCH_VERSIONS``; each has its own
parametrized session and environment (``nox -s "matrix(torch='2.4.1')"``). ``nox -s matrix``
runs the default version, ``nox -t all-versions`` runs every one, and
``AMPMATRIX_TORCH=X nox -s matrix`` runs another version (added to the list, with its own
environment). Every install names the torch pin too, so no other package can swap torch for
another build, and an environment whose requirements have not changed is reused as it is.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from datetime import datetime, timezone
from pathlib import Path

import nox

nox.options.sessions = ["matrix"]
nox.options.reuse_venv = "yes"

#: The torch versions under test: the one place they are listed.
TORCH_VERSIONS = ("2.4.1", "2.13.0")
DEFAULT_TORCH = "2.13.0"
#: Torch versions this project knows, with the Lightning release that matches each
#: (the oldest Lightning that supports a torch release is used for it, as users would have).
LIGHTNING_FOR_TORCH = {
    "2.4.1": ("lightning==2.3.3", "setuptools<70"),  # 2.3.3 imports pkg_resources
    "2.13.0": ("lightning==2.6.6",),
}
#: torch releases built against NumPy 1.x.
NUMPY_PIN = {"2.4.1": "numpy<2"}
PYTHON = "3.11"


def default_version() -> str:
    return os.environ.get("AMPMATRIX_TORCH", DEFAULT_TORCH)


def configured_versions() -> tuple[str, ...]:
    """TORCH_VERSIONS, plus a version asked for with AMPMATRIX_TORCH."""
    extra = default_version()
    return TORCH_VERSIONS + (() if extra in TORCH_VERSIONS else (extra,))


def every_version_requested() -> bool:
    """True for ``nox -s "matrix(torch='X')"`` and ``nox -t ...``: they run what they name.
    A bare ``nox -s matrix`` (or plain ``nox``) runs the default version only."""
    args = sys.argv[1:]
    return any("matrix(" in a for a in args) or any(a in ("-t", "--tags") for a in args)


def install_with_torch(session: nox.Session, version: str, *packages: str) -> None:
    """Install packages next to an exact torch pin (so torch is never replaced), unless this
    environment already holds exactly these requirements (then nothing is reinstalled)."""
    requirements = (f"torch=={version}", NUMPY_PIN.get(version, "numpy"), *packages)
    stamp = hashlib.sha256(
        json.dumps([requirements, Path("pyproject.toml").read_text()]).encode()
    ).hexdigest()
    marker = Path(str(session.virtualenv.location)) / ".ampmatrix-requirements"
    if marker.exists() and marker.read_text() == stamp:
        session.log("requirements unchanged: reusing this environment without installing")
        return
    session.install(*requirements)
    marker.write_text(stamp)


def flash_attn_requirements() -> tuple[str, ...]:
    """flash-attn, an optional extra for GPU boxes: installed when AMPMATRIX_FLASH_ATTN=1."""
    return ("flash-attn", "--no-build-isolation") if os.environ.get("AMPMATRIX_FLASH_ATTN") else ()


def lightning_requirements(version: str) -> tuple[str, ...]:
    return LIGHTNING_FOR_TORCH.get(version, ("lightning",))


@nox.session(python=PYTHON, tags=["all-versions"])
@nox.parametrize("torch", configured_versions())
def matrix(session: nox.Session, torch: str) -> None:
    """Run every case on every available device; arguments after -- go to `harness run`."""
    if torch != default_version() and not every_version_requested():
        session.skip(
            f"`nox -s matrix` runs torch {default_version()} only; run "
            f"`nox -s \"matrix(torch='{torch}')\"` or `nox -t all-versions`"
        )
    install_with_torch(
        session, torch, "-e", ".", *lightning_requirements(torch), *flash_attn_requirements()
    )
    session.run("python", "-m", "harness", "run", "--report-dir", "reports", *session.posargs)


@nox.session(python=PYTHON)
def bisect(session: nox.Session) -> None:
    """`nox -s bisect -- CASE [--fix F] [run options]`: run one case under every configured
    torch version and print the versions between which its outcome changes."""
    if not session.posargs or session.posargs[0].startswith("-"):
        session.error("usage: nox -s bisect -- CASE [--fix FIX] [other `harness run` options]")
    case, *options = session.posargs
    install_with_torch(session, DEFAULT_TORCH, "-e", ".")
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    out = Path("results") / f"bisect-{case}-{stamp}"
    for version in configured_versions():
        session.run(
            sys.executable,
            "-m",
            "nox",
            "-s",
            f"matrix(torch='{version}')",
            "--",
            "--case",
            case,
            "--no-timing",
            "--out",
            str(out),
            *options,
            external=True,
        )
    run_dirs = sorted(str(p) for p in out.iterdir())
    fixes = [a for i, a in enumerate(options) if i and options[i - 1] == "--fix"]
    session.run(
        "python",
        "-m",
        "harness",
        "bisect",
        *run_dirs,
        "--case",
        case,
        *(f"--fix={f}" for f in fixes),
    )


@nox.session(python=PYTHON)
def report(session: nox.Session) -> None:
    """Render one HTML report: `nox -s report -- RUN_DIR... [--baseline BASE]`
    (default: the newest run under results/)."""
    install_with_torch(session, DEFAULT_TORCH, "-e", ".")
    args = session.posargs or [str(newest_run(session))]
    session.run("python", "-m", "harness", "report", *args)


@nox.session(python=PYTHON)
def compare(session: nox.Session) -> None:
    """`nox -s compare -- BASE HEAD`: outcome and speed changes; fails on a regression.
    BASE and HEAD are runs, or results folders compared torch version by version."""
    install_with_torch(session, DEFAULT_TORCH, "-e", ".")
    session.run("python", "-m", "harness", "compare", *session.posargs)


def newest_run(session: nox.Session) -> Path:
    runs = sorted(
        (p for p in Path("results").glob("*") if (p / "env.json").exists()),
        key=lambda p: p.stat().st_mtime,
    )
    if not runs:
        session.error("no run under results/: run `nox -s matrix` first")
    return runs[-1]


def install_browser(session: nox.Session) -> None:
    """Chromium for the report's browser test, where this machine lets us install it."""
    if shutil.which("chromium") or os.environ.get("AMPMATRIX_NO_BROWSER"):
        return
    if not (hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get")):
        session.log("chromium not installed and apt-get unavailable: the browser test skips")
        return
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run("apt-get", "update", "-qq", external=True, env=env, success_codes=[0, 100])
    session.run(
        "apt-get",
        "install",
        "-y",
        "-qq",
        "chromium",
        external=True,
        env=env,
        success_codes=[0, 100],
    )


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmark of the harness itself: timer agreement, overhead, wall time, repeatability,
    and report rendering over a thousand cells."""
    install_with_torch(session, DEFAULT_TORCH, "-e", ".", *lightning_requirements(DEFAULT_TORCH))
    session.run("python", "benchmarks/bench_harness.py", *session.posargs)
    session.run("python", "benchmarks/bench_report.py")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The harness's own tests, spread over all cores."""
    install_with_torch(
        session, DEFAULT_TORCH, "-e", ".[test]", *lightning_requirements(DEFAULT_TORCH)
    )
    install_browser(session)
    session.run("pytest", "-n", "auto", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) and mypy."""
    install_with_torch(
        session, DEFAULT_TORCH, "-e", ".[lint,test]", "nox", *lightning_requirements(DEFAULT_TORCH)
    )
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")
