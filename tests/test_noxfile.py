"""The noxfile's own logic: the release list, pip settings carried over to uv, which
environments a prune removes, and installs compiled to bytecode."""

from __future__ import annotations

import ast
import os
import re
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
import tomllib

from harness.results.search import search_order

ROOT = Path(__file__).resolve().parent.parent


def test_the_release_list_is_every_minor_from_2_1_oldest_first(nf: ModuleType) -> None:
    releases = nf.TORCH_VERSIONS
    assert tuple(search_order(releases)) == releases
    minors = [int(r.split(".")[1]) for r in releases]
    assert minors == list(range(1, minors[-1] + 1)) and releases[0].startswith("2.1.")
    assert nf.DEFAULT_TORCH in releases
    assert set(nf.LIGHTNING_FOR_TORCH) == set(releases)
    assert set(nf.NUMPY_PIN) <= set(releases)


def test_pip_settings_become_uv_variables(nf: ModuleType) -> None:
    pip = {
        "find-links": "/wheels /more-wheels",
        "extra-index-url": "file:///mirror/simple file:///other/simple",
        "constraint": "/etc/constraints.txt",
        "cert": "/etc/ca.pem",
        "timeout": "60",
    }
    settings = nf.uv_settings(pip, {})
    assert settings == {
        "UV_FIND_LINKS": "/wheels,/more-wheels",
        "UV_EXTRA_INDEX_URL": "file:///mirror/simple file:///other/simple",
        "UV_CONSTRAINT": "/etc/constraints.txt",
        "SSL_CERT_FILE": "/etc/ca.pem",
        "UV_INDEX_STRATEGY": "unsafe-best-match",
    }
    # what the user set for uv stays
    settings = nf.uv_settings(pip, {"UV_FIND_LINKS": "/mine", "UV_INDEX_STRATEGY": "first-index"})
    assert "UV_FIND_LINKS" not in settings and "UV_INDEX_STRATEGY" not in settings


def test_pip_config_list_is_read_with_environment_settings_winning(
    nf: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    listing = (
        "global.find-links='/from-file'\n"
        ":env:.find-links='/from-env'\n"
        "global.constraint='/c.txt'\n"
        "not a setting\n"
    )

    class Done:
        stdout = listing

    monkeypatch.setattr(nf.subprocess, "run", lambda *a, **k: Done())
    assert nf.pip_settings() == {"find-links": "/from-env", "constraint": "/c.txt"}


def make_env(root: Path, name: str, used: float, packages: tuple[str, ...] = ()) -> Path:
    """A stand-in matrix environment: its dist-info folders and its last-use marker."""
    env = root / name
    site = env / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    for package in packages:
        (site / f"{package}-1.0.dist-info").mkdir()
    marker = env / ".ampmatrix-used"  # the noxfile's USED_MARKER (checked below)
    marker.touch()
    os.utime(marker, (used, used))
    return env


def test_environments_are_ordered_by_last_use_and_heavy_packages_found(
    nf: ModuleType, tmp_path: Path
) -> None:
    now = time.time()
    make_env(
        tmp_path,
        "matrix-torch-2-1-2",
        now - 300,
        ("torch", "torchmetrics", "nvidia_cublas_cu12", "numpy"),
    )
    make_env(tmp_path, "matrix-torch-2-13-0", now)
    make_env(tmp_path, "matrix-torch-2-4-1", now - 100, ("triton",))
    (tmp_path / "tests").mkdir()
    order = [p.name for p in nf.matrix_environments(tmp_path)]
    assert order == ["matrix-torch-2-13-0", "matrix-torch-2-4-1", "matrix-torch-2-1-2"]
    heavy = nf.heavy_distributions(tmp_path / "matrix-torch-2-1-2")
    assert sorted(heavy) == ["nvidia-cublas-cu12", "torch"]
    assert nf.USED_MARKER == ".ampmatrix-used"


def test_a_bisect_finds_each_release_run_folder(nf: ModuleType, tmp_path: Path) -> None:
    for name in ("20261123T0100-torch2.1.2", "20261123T0101-torch2.13.0+cpu"):
        (tmp_path / name).mkdir()
    assert nf.run_of(tmp_path, "2.13.0").name.endswith("torch2.13.0+cpu")
    assert nf.run_of(tmp_path, "2.1.2").name.endswith("torch2.1.2")
    with pytest.raises(FileNotFoundError, match=re.escape("no run of torch 2.1.20")):
        nf.run_of(tmp_path, "2.1.20")
    assert nf.environment_of("2.13.0") == Path(".nox") / "matrix-torch-2-13-0"


@pytest.mark.parametrize(
    ("argv", "every"),
    [
        (["nox", "-s", "matrix"], False),
        (["nox"], False),
        (["nox", "-s", "matrix(torch='2.4.1')"], True),
        (["nox", "-t", "all-versions"], True),
        (["nox", "--tags=all-versions"], True),
        (["nox", "--list"], True),
        (["nox", "-l", "--json"], True),
    ],
)
def test_a_plain_matrix_call_parametrizes_only_the_default_release(
    nf: ModuleType, monkeypatch: pytest.MonkeyPatch, argv: list[str], every: bool
) -> None:
    """Otherwise nox creates an empty environment for every release it then skips."""
    monkeypatch.setattr(sys, "argv", argv)
    expected = nf.configured_versions() if every else (nf.default_version(),)
    assert nf.session_versions() == expected


@pytest.mark.parametrize(
    ("setting", "gpu", "choice"),
    [
        ("", 9, None),
        ("0", 9, None),
        ("1", None, "2"),
        ("2", 8, "2"),
        ("4", 9, "4"),
        ("auto", 9, "4"),
        ("auto", 10, "4"),
        ("auto", 8, "2"),
        ("auto", None, None),
    ],
)
def test_which_flash_attn_the_matrix_session_installs(
    nf: ModuleType, setting: str, gpu: int | None, choice: str | None
) -> None:
    assert nf.flash_attn_choice(setting, gpu) == choice
    built = ("flash-attn", "--no-build-isolation")
    assert nf.flash_attn_2_requirements(choice) == (built if choice == "2" else ())


def test_a_bad_flash_attn_setting_is_refused(nf: ModuleType) -> None:
    with pytest.raises(ValueError, match="AMPMATRIX_FLASH_ATTN='3': expected one of"):
        nf.flash_attn_choice("3", 9)


def test_flash_attn_4_gets_the_cutlass_libraries_for_torchs_cuda(nf: ModuleType) -> None:
    assert nf.flash_attn_4_extra("13.0") == "flash4-cu13"
    assert nf.flash_attn_4_extra("12.8") == "flash4"
    extras = (ROOT / "pyproject.toml").read_text()
    assert 'flash4 = ["flash-attn-4>=4.0.0b36"]' in extras
    assert 'flash4-cu13 = ["flash-attn-4[cu13]>=4.0.0b36"]' in extras


class RecordingSession:
    """Stands in for a nox session: what it logged and ran."""

    def __init__(self) -> None:
        self.logged: list[str] = []
        self.ran: list[tuple[str, ...]] = []

    def log(self, message: str) -> None:
        self.logged.append(message)

    def run(self, *args: str, **kwargs: object) -> None:
        self.ran.append(args)


def test_a_prune_never_lists_the_default_release(nf: ModuleType, tmp_path: Path) -> None:
    now = time.time()
    default = nf.environment_of(nf.DEFAULT_TORCH).name
    envs = [make_env(tmp_path, f"matrix-torch-2-{minor}-0", now - minor) for minor in range(1, 7)]
    envs.append(make_env(tmp_path, default, now - 100))  # the least recently used
    order = nf.matrix_environments(tmp_path)
    assert order[-1].name == default
    pruned = nf.environments_to_prune(order, 2, nf.protected_environments())
    assert [p.name for p in pruned] == [f"matrix-torch-2-{minor}-0" for minor in (3, 4, 5, 6)]
    assert default in nf.protected_environments()


def test_a_bisect_keeps_the_default_releases_environment(
    nf: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bisect measures one release after another, each matrix session pruning to the
    most recently used four: the default's environment, used before it, stays."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AMPMATRIX_TORCH", raising=False)
    root = tmp_path / ".nox"
    now = time.time()
    default = nf.environment_of(nf.DEFAULT_TORCH)
    make_env(root, default.name, now - 1000)
    session = RecordingSession()
    measured = [r for r in nf.TORCH_VERSIONS if r != nf.DEFAULT_TORCH][:7]
    for step, release in enumerate(measured):
        make_env(root, nf.environment_of(release).name, now - 900 + step)
        nf.prune_environments(session, 4)
        assert default.is_dir(), session.logged
    left = sorted(p.name for p in root.iterdir())
    kept = sorted([default.name, *(nf.environment_of(r).name for r in measured[-4:])])
    assert left == kept
    assert len(session.logged) == len(measured) - 4
    assert all("the default's" in line for line in session.logged)


class InstallingSession(RecordingSession):
    """A recording session with an environment folder: what it installed and ran as install
    steps (which nox runs under ``--install-only`` too), and its env."""

    def __init__(self, location: Path) -> None:
        super().__init__()
        self.installed: list[tuple[str, ...]] = []
        self.install_steps: list[tuple[str, ...]] = []
        self.env: dict[str, str] = {}
        self.virtualenv = type("Env", (), {"location": str(location)})()

    def install(self, *args: str) -> None:
        self.installed.append(args)

    def run_install(self, *args: str, **kwargs: object) -> None:
        self.install_steps.append(args)


def compiles(session: InstallingSession, nf: ModuleType) -> tuple[bool, bool]:
    """Whether a session's install steps compiled site-packages, and the project's packages."""
    environment = ("python", "-c", nf.COMPILE_SITE_PACKAGES) in session.install_steps
    packages = [str(ROOT / package) for package in nf.PROJECT_PACKAGES]
    project = ("python", "-m", "compileall", "-q", *packages) in session.install_steps
    return environment, project


def test_installs_are_compiled_and_the_project_each_time_an_environment_is_used(
    nf: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uv compiles nothing unless told, and where PYTHONDONTWRITEBYTECODE is set nothing is
    compiled at import either: every start compiled the environment's Python again."""
    monkeypatch.setattr(nf, "pip_settings", dict)
    monkeypatch.chdir(ROOT)  # the stamp reads pyproject.toml
    session = InstallingSession(tmp_path)
    nf.install_with_torch(session, "2.13.0", "-e", ".")
    assert session.installed == [("--compile", "torch==2.13.0", "numpy", "-e", ".", "setuptools")]
    assert compiles(session, nf) == (True, True)
    # the same requirements again: nothing installed, the project compiled (it changes)
    session = InstallingSession(tmp_path)
    nf.install_with_torch(session, "2.13.0", "-e", ".")
    assert session.installed == [] and compiles(session, nf) == (False, True)


def test_an_environment_installed_before_installs_compiled_is_compiled_once(
    nf: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its stamp was made without INSTALL_OPTIONS; an installer does not compile what is
    already installed, so site-packages is compiled after the install."""
    monkeypatch.setattr(nf, "pip_settings", dict)
    monkeypatch.chdir(ROOT)
    with monkeypatch.context() as before:
        before.setattr(nf, "INSTALL_OPTIONS", ())
        nf.install_with_torch(InstallingSession(tmp_path), "2.13.0", "-e", ".")
    session = InstallingSession(tmp_path)
    nf.install_with_torch(session, "2.13.0", "-e", ".")
    assert [args[0] for args in session.installed] == ["--compile"]
    assert compiles(session, nf) == (True, True)


def test_every_install_goes_through_the_one_that_compiles(nf: ModuleType) -> None:
    """One declaration of how a session installs: no session calls session.install but
    ``install``, which adds INSTALL_OPTIONS."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    callers = {
        function.name
        for function in ast.walk(tree)
        if isinstance(function, ast.FunctionDef)
        for call in ast.walk(function)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr == "install"
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "session"
    }
    assert callers == {"install"}
    assert nf.INSTALL_OPTIONS == ("--compile",)  # pip's and uv's flag (uv: --compile-bytecode)


def test_the_project_packages_compiled_are_those_pyproject_installs(nf: ModuleType) -> None:
    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    top_level = {name for name in found["packages"]["find"]["include"] if "." not in name}
    assert set(nf.PROJECT_PACKAGES) == top_level
