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
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType

import nox

nox.options.sessions = ["matrix"]
nox.options.reuse_venv = "yes"


def load_variables() -> ModuleType:
    """The declaration of ampmatrix's environment variables, ``harness/schema/env_vars.py``,
    loaded by its path: nox's own Python need not have ampmatrix installed, and the file
    needs only the standard library."""
    path = Path(__file__).resolve().parent / "harness" / "schema" / "env_vars.py"
    spec = importlib.util.spec_from_file_location("ampmatrix_env_vars", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def refuse_bad_variables(environ: Mapping[str, str]) -> None:
    """A bad value of a variable the noxfile reads ends nox as it loads, in one line naming
    it (every command, ``nox -l`` too), not in a traceback."""
    for error in env_vars.refused(env_vars.NOXFILE, environ):
        print(f"nox: error: {error}", file=sys.stderr)
        raise SystemExit(2)


env_vars = load_variables()
refuse_bad_variables(os.environ)

#: The torch releases under test, oldest first: the newest patch of every minor release from
#: 2.1 to the newest this machine's pip allows (the one place they are listed).
TORCH_VERSIONS = (
    "2.1.2", "2.2.2", "2.3.1", "2.4.1", "2.5.1", "2.6.0", "2.7.1",
    "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1",
)  # fmt: skip
#: The default: the release a fresh machine installs fastest (a CPU wheel on this machine's
#: disk; the others are CUDA builds from PyPI, about 5 GB each).
DEFAULT_TORCH = "2.13.0"
#: The Lightning release of each torch release's time (as users of that torch would have).
#: Lightning before 2.4 imports pkg_resources, which setuptools 70 dropped.
LIGHTNING_FOR_TORCH = {
    "2.1.2": ("lightning==2.1.4", "setuptools<70"),
    "2.2.2": ("lightning==2.2.5", "setuptools<70"),
    "2.3.1": ("lightning==2.3.3", "setuptools<70"),
    "2.4.1": ("lightning==2.3.3", "setuptools<70"),
    "2.5.1": ("lightning==2.4.0",),
    "2.6.0": ("lightning==2.5.0.post0",),
    "2.7.1": ("lightning==2.5.1",),
    "2.8.0": ("lightning==2.5.3",),
    "2.9.1": ("lightning==2.5.6",),
    "2.10.0": ("lightning==2.6.0",),
    "2.11.0": ("lightning==2.6.1",),
    "2.12.1": ("lightning==2.6.4",),
    "2.13.0": ("lightning==2.6.6",),
    "2.14.1": ("lightning==2.6.6",),
}
#: torch releases built against NumPy 1.x.
NUMPY_PIN = {v: "numpy<2" for v in ("2.1.2", "2.2.2", "2.3.1", "2.4.1")}
PYTHON = "3.11"
#: uv where it is installed (environments in seconds, hard-linked from its cache), else
#: virtualenv and pip.
VENV_BACKEND = "uv|virtualenv"
#: Matrix environments kept after a matrix session (the most recently used ones; 0: keep
#: all), and the free disk below which uv's cache of pruned releases is cleaned too.
KEEP_ENVS: int = env_vars.KEEP_ENVS.read()
MIN_FREE_GB: float = env_vars.MIN_FREE_GB.read()


def default_version() -> str:
    return str(env_vars.TORCH.read() or DEFAULT_TORCH)


def configured_versions() -> tuple[str, ...]:
    """TORCH_VERSIONS, plus a version asked for with AMPMATRIX_TORCH."""
    extra = default_version()
    return TORCH_VERSIONS + (() if extra in TORCH_VERSIONS else (extra,))


def every_version_requested() -> bool:
    """True for ``nox -s "matrix(torch='X')"`` and ``nox -t ...``: they run what they name.
    A bare ``nox -s matrix`` (or plain ``nox``) runs the default version only."""
    args = sys.argv[1:]
    return any("matrix(" in a for a in args) or any(a.startswith(("-t", "--tags")) for a in args)


def session_versions() -> tuple[str, ...]:
    """The releases given a matrix session in this nox call: every one to list them or
    where named, else only the default, so that a plain ``nox -s matrix`` creates no
    environment for the releases it skips."""
    listing = any(a in ("-l", "--list", "--list-sessions", "--json") for a in sys.argv[1:])
    if listing or every_version_requested():
        return configured_versions()
    return (default_version(),)


def install_with_torch(session: nox.Session, version: str, *packages: str) -> None:
    """Install packages next to an exact torch pin (so torch is never replaced), unless this
    environment already holds exactly these requirements (then nothing is reinstalled)."""
    requirements = (f"torch=={version}", NUMPY_PIN.get(version, "numpy"), *packages)
    # A bare uv environment has no setuptools; inductor on older torch imports it.
    requirements += ("setuptools",)
    stamp = hashlib.sha256(
        json.dumps([requirements, INSTALL_OPTIONS, Path("pyproject.toml").read_text()]).encode()
    ).hexdigest()
    location = Path(str(session.virtualenv.location))
    (location / USED_MARKER).touch()
    marker = location / INSTALLED_MARKER
    if marker.exists() and marker.read_text() == stamp:
        session.log("requirements unchanged: reusing this environment without installing")
    else:
        session.env.update(uv_settings(pip_settings(), os.environ))
        install(session, *requirements)
        compile_environment(session)
        marker.write_text(stamp)
    compile_project(session)


#: How every session installs: compiled to bytecode as it installs. uv compiles nothing
#: unless asked, and pip's compiling can be turned off (``no-compile`` in pip.conf, or
#: PIP_NO_COMPILE=0, which pip reads as "compile: no"); where PYTHONDONTWRITEBYTECODE is set,
#: as CI images and containers often set it, no bytecode is written at import either, and
#: every start compiled pandas', matplotlib's and torch's Python again (``import pandas,
#: matplotlib.pyplot`` 3.8 s against 1.3 s compiled). ``--compile`` says it to pip and to uv
#: alike, and wins over their settings. Part of the requirements' stamp, so an environment
#: installed without it is compiled once when next used.
INSTALL_OPTIONS = ("--compile",)
#: The project's own packages (pyproject's ``packages.find``): an editable install runs them
#: from this checkout, where no installer compiles them.
PROJECT_PACKAGES = ("harness", "cases")
#: Compiles an environment's site-packages, quietly: a file there that is not valid for this
#: Python (torch ships an example for 3.12) is left to source, as installers leave it.
COMPILE_SITE_PACKAGES = (
    "import compileall, sysconfig; compileall.compile_dir(sysconfig.get_path('purelib'), quiet=2)"
)


def install(session: nox.Session, *args: str) -> None:
    """Every install of every session: ``session.install`` with INSTALL_OPTIONS."""
    session.install(*INSTALL_OPTIONS, *args)


def compile_environment(session: nox.Session) -> None:
    """Bytecode for what an install left uncompiled in site-packages: the packages of an
    environment installed before INSTALL_OPTIONS, which an installer does not install (nor
    compile) again. A second where all is compiled (one process: a pool of workers took
    five seconds to find nothing to do). An install step: it runs under ``--install-only``
    too, as images are built."""
    session.run_install("python", "-c", COMPILE_SITE_PACKAGES, silent=True)


def compile_project(session: nox.Session) -> None:
    """Bytecode for the project's own modules, each time a session uses its environment
    (the checkout changes between sessions; only changed modules are compiled again), so
    ``python -m harness`` starts compiled where PYTHONDONTWRITEBYTECODE is set. An install
    step: under ``--install-only`` too, not under ``--no-install`` (nox skips every install
    step of a reused environment there)."""
    root = Path(__file__).resolve().parent
    packages = [str(root / package) for package in PROJECT_PACKAGES]
    session.run_install("python", "-m", "compileall", "-q", *packages, silent=True)


#: pip's settings and the uv variables that mean the same, so uv finds what pip would (this
#: machine's wheels on disk, its index mirrors, its constraints).
PIP_TO_UV = {
    "index-url": "UV_INDEX_URL",
    "extra-index-url": "UV_EXTRA_INDEX_URL",
    "find-links": "UV_FIND_LINKS",
    "constraint": "UV_CONSTRAINT",
    "cert": "SSL_CERT_FILE",
}


def pip_settings() -> dict[str, str]:
    """``pip config list`` as name -> value; settings from PIP_* variables win over files."""
    listed = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True
    ).stdout
    files: dict[str, str] = {}
    env: dict[str, str] = {}
    for line in listed.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            origin, _, name = key.partition(".")
            (env if origin == ":env:" else files)[name] = value.strip().strip("'\"")
    return files | env


def uv_settings(pip: dict[str, str], environ: Mapping[str, str]) -> dict[str, str]:
    """The uv variables for the pip settings, leaving any UV_* already set alone. Like pip,
    uv then takes the best match across every index."""
    settings = {}
    for name, variable in PIP_TO_UV.items():
        if name in pip and variable not in environ:
            value = pip[name]
            settings[variable] = ",".join(value.split()) if name == "find-links" else value
    if "UV_EXTRA_INDEX_URL" in settings and "UV_INDEX_STRATEGY" not in environ:
        settings["UV_INDEX_STRATEGY"] = "unsafe-best-match"
    return settings


#: AMPMATRIX_FLASH_ATTN: which flash-attn the matrix session installs on a GPU box.
FLASH_ATTN_SETTINGS = {
    "": None,
    "0": None,
    "1": "2",  # flash-attn 2, built from source against the CUDA toolkit (tens of minutes)
    "2": "2",
    "4": "4",  # flash-attn 4 (CuTe-DSL), wheels only: Hopper and Blackwell (sm90+)
    "auto": "auto",  # 4 on an sm90+ GPU, 2 on an older one, none without a GPU
}


def flash_attn_choice(setting: str, gpu_major: int | None) -> str | None:
    """The flash-attn major version AMPMATRIX_FLASH_ATTN asks for (``2``, ``4``), or None."""
    if setting not in FLASH_ATTN_SETTINGS:
        raise ValueError(
            f"AMPMATRIX_FLASH_ATTN={setting!r}: expected one of "
            + ", ".join(repr(k) for k in FLASH_ATTN_SETTINGS if k)
        )
    choice = FLASH_ATTN_SETTINGS[setting]
    if choice != "auto":
        return choice
    if gpu_major is None:
        return None
    return "4" if gpu_major >= 9 else "2"


def flash_attn_2_requirements(choice: str | None) -> tuple[str, ...]:
    """flash-attn 2, built against the CUDA toolkit, where it is the choice."""
    return ("flash-attn", "--no-build-isolation") if choice == "2" else ()


def flash_attn_4_extra(torch_cuda: str) -> str:
    """ampmatrix's extra for flash-attn 4: its CUTLASS DSL libraries for torch's CUDA."""
    return "flash4-cu13" if torch_cuda.startswith("13") else "flash4"


def gpu_major() -> int | None:
    """The first GPU's compute capability major (nvidia-smi), None without a GPU."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.strip().splitlines()[:1]
    return int(float(first[0])) if first and first[0].strip() else None


def install_flash_attn_4(session: nox.Session, version: str) -> None:
    """flash-attn 4 from PyPI wheels, with the CUTLASS DSL libraries for this torch's CUDA
    (the torch pin again, so nothing replaces it)."""
    cuda = session.run(
        "python", "-c", "import torch; print(torch.version.cuda or '')", silent=True
    )
    extra = flash_attn_4_extra(str(cuda or "").strip())
    install(session, "-e", f".[{extra}]", f"torch=={version}")


def lightning_requirements(version: str) -> tuple[str, ...]:
    return LIGHTNING_FOR_TORCH.get(version, ("lightning",))


@nox.session(python=PYTHON, tags=["all-versions"], venv_backend=VENV_BACKEND)
@nox.parametrize("torch", session_versions())
def matrix(session: nox.Session, torch: str) -> None:
    """Run every case on every available device; arguments after -- go to `harness run`."""
    if torch != default_version() and not every_version_requested():
        session.skip(
            f"`nox -s matrix` runs torch {default_version()} only; run "
            f"`nox -s \"matrix(torch='{torch}')\"` or `nox -t all-versions`"
        )
    for error in env_vars.refused(env_vars.HARNESS):  # before minutes of installs
        session.error(str(error))
    flash = flash_attn_choice(env_vars.FLASH_ATTN.read(), gpu_major())
    install_with_torch(
        session,
        torch,
        "-e",
        ".",
        *lightning_requirements(torch),
        *flash_attn_2_requirements(flash),
    )
    if flash == "4":
        install_flash_attn_4(session, torch)
    session.run("python", "-m", "harness", "run", "--report-dir", "reports", *session.posargs)
    if KEEP_ENVS:
        prune_environments(session, KEEP_ENVS)


@nox.session(python=False)
def prune(session: nox.Session) -> None:
    """`nox -s prune -- [N]`: delete all but the N most recently used matrix environments
    (default AMPMATRIX_KEEP_ENVS, 4), and uv's cached torch builds if disk runs low."""
    keep = int(session.posargs[0]) if session.posargs else max(KEEP_ENVS, 1)
    prune_environments(session, keep)


#: Written in an environment once its requirements are installed (their hash).
INSTALLED_MARKER = ".ampmatrix-requirements"
#: Touched in a matrix environment each time a session uses it.
USED_MARKER = ".ampmatrix-used"


def matrix_environments(root: Path = Path(".nox")) -> list[Path]:
    """Matrix environments, most recently used first."""
    envs = [p for p in root.glob("matrix-*") if p.is_dir()]
    return sorted(envs, key=last_used, reverse=True)


def last_used(env: Path) -> float:
    marker = env / USED_MARKER
    return (marker if marker.exists() else env).stat().st_mtime


def protected_environments() -> set[str]:
    """The matrix environments a prune never removes: the default release's (and the one
    AMPMATRIX_TORCH names), which a plain ``nox -s matrix`` uses. A bisect or a sweep
    runs many releases one after another, each session pruning after itself; without this
    the default's environment went with the rest and the next plain run rebuilt it."""
    return {environment_of(release).name for release in (DEFAULT_TORCH, default_version())}


def environments_to_prune(envs: list[Path], keep: int, protected: set[str]) -> list[Path]:
    """All but the ``keep`` most recently used of ``envs`` (most recent first), less the
    protected ones."""
    return [env for env in envs[keep:] if env.name not in protected]


def prune_environments(session: nox.Session, keep: int) -> None:
    pruned = environments_to_prune(matrix_environments(), keep, protected_environments())
    heavy = sorted({name for env in pruned for name in heavy_distributions(env)})
    for env in pruned:
        session.log(
            f"prune: removing {env} (kept the {keep} most recently used and the default's)"
        )
        shutil.rmtree(env)
    free_gb = shutil.disk_usage(".").free / 2**30
    if heavy and free_gb < MIN_FREE_GB and shutil.which("uv"):
        session.log(f"prune: {free_gb:.1f} GB free (< {MIN_FREE_GB:g}): cleaning uv's cache")
        session.run("uv", "cache", "clean", *heavy, external=True)


def heavy_distributions(env: Path) -> list[str]:
    """The large distributions installed in an environment: torch, triton and the nvidia-*
    libraries a CUDA build brings."""
    names = [
        d.name.split("-")[0].replace("_", "-") for d in env.glob("lib/*/site-packages/*.dist-info")
    ]
    return [n for n in names if n in ("torch", "triton") or n.startswith("nvidia-")]


@nox.session(python=False)
def bisect(session: nox.Session) -> None:
    """`nox -s bisect -- CASE [--fix F] [--dtype D] [run options]`: which torch release
    changed each cell's outcome, by a search over the release list
    (see harness/results/search.py)."""
    if not session.posargs or session.posargs[0].startswith("-"):
        session.error("usage: nox -s bisect -- CASE [--fix FIX] [other `harness run` options]")
    case, *options = session.posargs
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from harness.results.search import ReleaseSearch, labels_of_run, search_order

    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    out = Path("results") / f"bisect-{case}-{stamp}"
    search = ReleaseSearch(search_order(configured_versions()))
    created = []
    while (release := search.next_release()) is not None:
        if not (environment_of(release) / INSTALLED_MARKER).exists():
            created.append(release)
        session.log(f"bisect: measuring torch {release}")
        run_matrix_session(
            session, release, "--case", case, "--no-timing", "--out", str(out), *options
        )
        search.add(release, labels_of_run(run_of(out, release)))
    summary = search.render() + f"\nenvironments created: {len(created)} ({', '.join(created)})"
    (out / "bisect.txt").write_text(summary + "\n")
    print(summary)
    print(f"runs: {out} (`nox -s report -- {out}/*/` shows them)")


def environment_of(release: str) -> Path:
    """Where nox keeps the matrix environment of a release."""
    return Path(".nox") / f"matrix-torch-{release.replace('.', '-')}"


def run_matrix_session(session: nox.Session, release: str, *args: str) -> None:
    session.run(
        sys.executable, "-m", "nox", "-s", f"matrix(torch='{release}')", "--", *args,
        external=True,
    )  # fmt: skip


def run_of(out: Path, release: str) -> Path:
    """The run folder of one release under a bisect's output folder."""
    runs = sorted(p for p in out.iterdir() if p.name.split("-torch")[-1].split("+")[0] == release)
    if not runs:
        raise FileNotFoundError(f"no run of torch {release} under {out}")
    return runs[-1]


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


@nox.session(name="nightly-verdict", python=PYTHON)
def nightly_verdict(session: nox.Session) -> None:
    """`nox -s nightly-verdict -- TONIGHT [LAST] [--out FILE] [--markdown FILE]
    [--allow-missing]`: the nightly's combine step. One report over tonight's runs (every
    release on every GPU kind), then each release and GPU against last night's; fails on a
    cell that stopped passing or a new error, not on a case's known failure reproduced
    (harness/report/nightly.py). Without LAST it says so and passes."""
    if not session.posargs or session.posargs[0].startswith("-"):
        session.error("usage: nox -s nightly-verdict -- TONIGHT [LAST] [options]")
    install_with_torch(session, DEFAULT_TORCH, "-e", ".")
    session.run("python", "-m", "harness", "nightly-verdict", *session.posargs)


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
    if shutil.which("chromium") or env_vars.NO_BROWSER.read():
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
    """Benchmark of the harness itself: start-up of ``report`` and ``check`` with and without
    compiled bytecode, timer agreement, overhead, wall time, the timing phase's share in
    measured calls, repeatability, the correctness phase against plain pytest-xdist,
    ``check`` against a plain script, report rendering from 11 to 100k cells,
    on a GPU box the CUDA figures against triton's do_bench, and what the divergence
    profile adds to a failing cell and to a passing one."""
    install_with_torch(session, DEFAULT_TORCH, "-e", ".", *lightning_requirements(DEFAULT_TORCH))
    session.run("python", "benchmarks/bench_startup.py")
    session.run("python", "benchmarks/bench_harness.py", *session.posargs)
    session.run("python", "benchmarks/bench_timing_noise.py")
    session.run("python", "benchmarks/bench_overhead.py")
    session.run("python", "benchmarks/bench_check.py")
    session.run("python", "benchmarks/bench_report.py")
    session.run("python", "benchmarks/bench_gpu_timing.py")
    session.run("python", "benchmarks/bench_divergence.py", "--cost")


#: The model libraries the zoo installs, per torch release: releases of its time. (timm
#: is left out: it needs torchvision, and PyPI's torchvision is built for CUDA torch, so
#: with a CPU build of torch it fails at import: "operator torchvision::nms does not exist".)
ZOO_FOR_TORCH = {
    "2.13.0": ("transformers==5.23.0", "diffusers==0.42.1"),
    "2.4.1": ("transformers==4.46.3", "diffusers==0.31.0"),
}
#: pytest's exit codes that mean the zoo's tests ran: 0 every cell passed, 1 some cells
#: failed (findings about the models, kept in the results and the report).
ZOO_RAN = [0, 1]


@nox.session(python=PYTHON)
def zoo(session: nox.Session) -> None:
    """Real models (transformers, diffusers, timm; small configs, random weights) through
    the pytest plugin: results in results/zoo-torch<version>-<time>, its report, a summary."""
    version = default_version()
    if version not in ZOO_FOR_TORCH:
        session.error(
            f"no zoo requirements for torch {version} (known: {', '.join(ZOO_FOR_TORCH)})"
        )
    install_with_torch(session, version, "-e", ".[test]", *ZOO_FOR_TORCH[version])
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S")
    run_dir = Path("results") / f"zoo-torch{version}-{stamp}"
    session.run(
        "pytest", "zoo", "-n", "auto", "-p", "no:cacheprovider", "-q", "-rfx",
        f"--ampmatrix-results={run_dir}", *session.posargs, success_codes=ZOO_RAN,
    )  # fmt: skip
    session.run(
        "python", "-m", "harness", "report", str(run_dir), "--out", f"reports/{run_dir.name}.html"
    )
    session.run("python", "zoo/summarize.py", str(run_dir))


@nox.session(python=PYTHON)
def verdicts(session: nox.Session) -> None:
    """Calibration of the tolerance rule: the zoo, twelve more real architectures and
    silent precision bugs with their healthy twins, each cell's error over the error of
    rounding its data; fails if a cell is misjudged (`-- --device cuda` on a GPU). Then the
    fit stage's limits: healthy and broken fits side by side, on the CPU (bench_fit.py); and
    the training families, each healthy model beside its buggy twin and their truth
    (bench_training.py)."""
    version = default_version()
    if version not in ZOO_FOR_TORCH:
        session.error(
            f"no zoo requirements for torch {version} (known: {', '.join(ZOO_FOR_TORCH)})"
        )
    install_with_torch(session, version, "-e", ".[test]", *ZOO_FOR_TORCH[version])
    session.run("python", "benchmarks/bench_verdicts.py", "--markdown", *session.posargs)
    session.run("python", "benchmarks/bench_fit.py", "--markdown")
    session.run("python", "benchmarks/bench_training.py", "--markdown")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The harness's own tests, spread over all cores."""
    install_with_torch(
        session, DEFAULT_TORCH, "-e", ".[test]", *lightning_requirements(DEFAULT_TORCH)
    )
    install_browser(session)
    session.run("pytest", "-n", "auto", *session.posargs)


@nox.session(python=PYTHON)
def screenshots(session: nox.Session) -> None:
    """The docs' screenshots, regenerated: the report of the stored run
    tests/data/runs/torch-2.13.0 and its terminal summary, taken by headless Chromium
    (installed as for ``tests``) into docs/images/ (see docs/screenshots.py). The images
    are committed, so the docs build needs no browser. `-- DIR` writes them to DIR."""
    install_with_torch(session, DEFAULT_TORCH, "-e", ".")
    install_browser(session)
    if not (shutil.which("chromium") or shutil.which("chromium-browser")):
        session.error("screenshots: Chromium is needed (Debian package 'chromium')")
    out = session.posargs[0] if session.posargs else str(Path("docs") / "images")
    session.run("python", "docs/screenshots.py", out)
    session.log(f"screenshots: written to {out}/ (commit them with the docs)")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff (lint and format check), mypy, and the GitHub workflows (``lint_workflows``)."""
    install_with_torch(
        session, DEFAULT_TORCH, "-e", ".[lint,test]", "nox", *lightning_requirements(DEFAULT_TORCH)
    )
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")
    session.run("mypy")
    session.run("mypy", ".github/scripts")
    lint_workflows(session)


#: The workflows the lint session checks.
WORKFLOWS = Path(".github") / "workflows"


def lint_workflows(session: nox.Session) -> None:
    """The workflows against check-jsonschema's built-in GitHub workflow schema, then
    zizmor's security audit (pinning, permissions, template injection, credentials left
    in artifacts); both offline, both failing on any finding."""
    workflows = sorted(str(path) for path in WORKFLOWS.glob("*.yml"))
    session.run("check-jsonschema", "--builtin-schema", "vendor.github-workflows", *workflows)
    session.run("zizmor", "--offline", str(WORKFLOWS))


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The documentation site (mkdocs.yml, docs/) into site/, strict: a warning (a broken
    link or anchor, a page missing from the nav, a name the API reference cannot find)
    fails the build. Only the ``docs`` extra is installed: mkdocstrings reads the
    docstrings from the source without importing it, so neither torch nor a browser is
    needed. Arguments after -- go to ``mkdocs build``."""
    import tomllib

    project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
    install(session, *project["optional-dependencies"]["docs"])
    # Material's notice about MkDocs 2.0 is not about this site; it would read as a warning.
    session.env["NO_MKDOCS_2_WARNING"] = "1"
    session.run("mkdocs", "build", "--strict", "--site-dir", "site", *session.posargs)


#: The GPU acceptance script (``benchmarks/gpu_acceptance.py``), which says whether an
#: interpreter has every package it needs (``--ready``).
ACCEPTANCE = "benchmarks/gpu_acceptance.py"


@nox.session(name="gpu-acceptance", python=False)
def gpu_acceptance(session: nox.Session) -> None:
    """`nox -s gpu-acceptance -- [--out DIR] [options]`: everything only a GPU can show, in
    one command, with PASS/MISS against each target in one Markdown file (see
    benchmarks/gpu_acceptance.py). Run by an interpreter here that already has what it
    needs, installing nothing; only where none has, the tests' environment is installed."""
    if not gpus_listed():
        session.error(
            "gpu-acceptance: no CUDA device visible (nvidia-smi lists none): nothing to accept "
            "on this machine"
        )
    python = ready_interpreter(acceptance_interpreters(), acceptance_ready)
    if python is None:
        session.log("no interpreter here has what the acceptance needs: installing `tests`")
        session.run(sys.executable, "-m", "nox", "-s", "tests", "--install-only", external=True)
        python = str(Path(".nox") / "tests" / "bin" / "python")
    else:
        session.log(f"{python} has every package the acceptance needs: nothing installed")
    session.run(python, ACCEPTANCE, *session.posargs, external=True, env=project_path())


def gpus_listed() -> bool:
    """Whether nvidia-smi lists a GPU (``GPU 0: ...``)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return any(line.startswith("GPU ") for line in out.splitlines())


def acceptance_interpreters() -> list[str]:
    """Interpreters that may already have what the acceptance needs, in the order tried:
    AMPMATRIX_PYTHON, python3 and python on PATH, nox's own, the tests' environment."""
    tests_python = Path(".nox") / "tests" / "bin" / "python"
    names = [
        env_vars.PYTHON.read(),
        shutil.which("python3"),
        shutil.which("python"),
        sys.executable,
        str(tests_python) if tests_python.exists() else None,
    ]
    return list(dict.fromkeys(name for name in names if name))


def ready_interpreter(candidates: list[str], ready: Callable[[str], bool]) -> str | None:
    """The first interpreter that has every package the acceptance needs, or None."""
    return next((python for python in candidates if ready(python)), None)


def acceptance_ready(python: str) -> bool:
    """``python ACCEPTANCE --ready``: it finds every package it needs (without importing
    torch, so a second or two per interpreter)."""
    try:
        done = subprocess.run(
            [python, str(Path(__file__).resolve().parent / ACCEPTANCE), "--ready"],
            capture_output=True,
            timeout=120,
            env={**os.environ, **project_path()},
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def project_path() -> dict[str, str]:
    """PYTHONPATH with this checkout first: the project runs as it is, installed or not."""
    root = str(Path(__file__).resolve().parent)
    return {"PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
