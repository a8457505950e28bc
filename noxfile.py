"""ampmatrix sessions: ``nox -s matrix``, ``nox -s tests``, ``nox -s lint``.

The torch version under test is pinned here (``DEFAULT_TORCH``) and can be overridden with
the environment variable ``AMPMATRIX_TORCH`` (``AMPMATRIX_TORCH=2.4.1 nox -s matrix``).
Every install names the torch pin too, so no other package can swap torch for another build.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.sessions = ["matrix"]
nox.options.reuse_venv = "yes"

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


def torch_version() -> str:
    return os.environ.get("AMPMATRIX_TORCH", DEFAULT_TORCH)


def install_with_torch(session: nox.Session, version: str, *packages: str) -> None:
    """Install packages next to an exact torch pin (so torch is never replaced)."""
    session.install(f"torch=={version}", NUMPY_PIN.get(version, "numpy"), *packages)


def lightning_requirements(version: str) -> tuple[str, ...]:
    return LIGHTNING_FOR_TORCH.get(version, ("lightning",))


@nox.session(python=PYTHON)
def matrix(session: nox.Session) -> None:
    """Run every case on every available device; arguments after -- go to `harness run`."""
    version = torch_version()
    install_with_torch(session, version, "-e", ".", *lightning_requirements(version))
    session.run("python", "-m", "harness", "run", "--report-dir", "reports", *session.posargs)


@nox.session(python=PYTHON)
def report(session: nox.Session) -> None:
    """Render one HTML report: `nox -s report -- RUN_DIR... [--baseline BASE]`
    (default: the newest run under results/)."""
    install_with_torch(session, DEFAULT_TORCH, "-e", ".")
    args = session.posargs or [str(newest_run(session))]
    session.run("python", "-m", "harness", "report", *args)


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
    version = torch_version()
    install_with_torch(session, version, "-e", ".", *lightning_requirements(version))
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
