"""ampmatrix sessions: ``nox -s matrix``, ``nox -s tests``, ``nox -s lint``.

The torch version under test is pinned here (``DEFAULT_TORCH``) and can be overridden with
the environment variable ``AMPMATRIX_TORCH`` (``AMPMATRIX_TORCH=2.4.1 nox -s matrix``).
Every install names the torch pin too, so no other package can swap torch for another build.
"""

from __future__ import annotations

import os

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
    session.run("python", "-m", "harness", "run", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Benchmark of the harness itself: timer agreement, overhead, wall time, repeatability."""
    version = torch_version()
    install_with_torch(session, version, "-e", ".", *lightning_requirements(version))
    session.run("python", "benchmarks/bench_harness.py", *session.posargs)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The harness's own tests, spread over all cores."""
    install_with_torch(
        session, DEFAULT_TORCH, "-e", ".[test]", *lightning_requirements(DEFAULT_TORCH)
    )
    session.run("pytest", "-n", "auto", *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) and mypy."""
    install_with_torch(session, DEFAULT_TORCH, "-e", ".[lint,test]", "nox")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")
