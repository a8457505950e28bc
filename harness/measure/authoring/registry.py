"""The one case registry, filled by the :func:`register` decorator, and case discovery."""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TypeVar

from harness.measure.authoring import import_probe
from harness.measure.authoring.case import Case, FailureSignature, Size
from harness.measure.host import torch_state
from harness.schema.axes import AXES, CONTROL_FIX, FORWARD_STAGE, SIZES, SMALL_SIZE, Axis
from harness.schema.records import SettingChange

RELEASE = re.compile(r"^\d+\.\d+(\.\d+)?$")
CASE_NAME = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
BUILTIN_CASES_DIR = Path(__file__).resolve().parents[3] / "cases"

_REGISTRY: dict[str, Case] = {}
#: The module object each case was registered from.
_MODULES: dict[str, ModuleType] = {}
#: What importing a module of the run (a case module, a model ``check`` names) changed of
#: torch's global settings, by the module's file: each change was put back at once, so no
#: cell starts from it, and the run reports it once.
_IMPORT_CHANGES: dict[str, tuple[str, ...]] = {}

C = TypeVar("C", bound=type[Case])
T = TypeVar("T")


class CaseContractError(Exception):
    """A case that breaks the Case contract; the message names the file and the problem."""


def register(cls: C) -> C:
    """Class decorator: validate the case and add one instance of it to the registry."""
    case = cls()
    case.source_file = sys.modules[cls.__module__].__file__ or cls.__module__
    problems = contract_problems(case)
    if not case.has_known_failure:
        problems.append("has_known_failure is False: only a model you check has no known failure")
    module = sys.modules[cls.__module__]
    if case.name in _REGISTRY and not reimported(case, module):
        other = _REGISTRY[case.name].source_file
        problems.append(f"duplicate case name {case.name!r} (already registered by {other})")
    if problems:
        raise CaseContractError(f"{case.source_file}: " + "; ".join(problems))
    _REGISTRY[case.name] = case
    _MODULES[case.name] = module
    return cls


def reimported(case: Case, module: ModuleType) -> bool:
    """The same file run again as a new module (its old module was dropped from
    ``sys.modules``): the case replaces its earlier self rather than duplicating it."""
    earlier = _REGISTRY[case.name]
    return earlier.source_file == case.source_file and _MODULES.get(case.name) is not module


def contract_problems(case: Case) -> list[str]:
    """Everything wrong with a case, as readable sentences (empty when it is valid)."""
    problems = []
    if not CASE_NAME.match(case.name or ""):
        problems.append(f"name {case.name!r} must be lower-case words joined by '-'")
    for attr in required_attributes(case):
        if not getattr(case, attr):
            problems.append(f"missing {attr}")
    problems += unknown_axis_values(case)
    if FORWARD_STAGE not in case.stages:
        problems.append(f"stages must include {FORWARD_STAGE!r} (every case runs its forward)")
    problems += _fix_problems(case)
    problems += _size_problems(case)
    problems += _failure_problems(case)
    if type(case).build is Case.build:
        problems.append("no build() method")
    if case.min_torch is not None and not RELEASE.match(str(case.min_torch)):
        problems.append(f"min_torch {case.min_torch!r} must be a release such as '2.4'")
    return problems


def _failure_problems(case: Case) -> list[str]:
    """A known failure that is a ``FailureSignature`` declaring something: raised (both
    ``error_type`` and ``message``, a regex), silent (its symptoms), or both."""
    declared = [("failure", case.failure)] if case.failure is not None else []
    declared += [(f"failure_variants[{i}]", f) for i, f in enumerate(case.failure_variants)]
    problems = []
    for where, failure in declared:
        if not isinstance(failure, FailureSignature):
            problems.append(f"{where} must be a FailureSignature, not {type(failure).__name__}")
            continue
        problems += [f"{where}: {problem}" for problem in failure.problems()]
    return problems


def required_attributes(case: Case) -> tuple[str, ...]:
    """What a case must declare: a failure pattern its known failure too, a model you check
    (``has_known_failure`` False) none."""
    failure = ("failure",) if case.has_known_failure else ()
    return ("title", "upstream", *failure, "reference_fix")


def unknown_axis_values(case: Case, axes: tuple[Axis, ...] = AXES) -> list[str]:
    """Each axis with a vocabulary: the case declares some values, all of them known."""
    problems = []
    for axis in axes:
        if not axis.vocabulary or (axis.name == "size" and not _sizes_well_formed(case)):
            continue
        values = getattr(case, axis.declared_as or axis.plural)
        if not values:
            problems.append(f"{axis.plural} is empty")
        for value in values:
            if value not in axis.vocabulary:
                known = ", ".join(axis.vocabulary)
                problems.append(f"unknown {axis.name} {value!r} (known: {known})")
    return problems


def _sizes_well_formed(case: Case) -> bool:
    return all(isinstance(size, Size) for size in case.sizes)


def _size_problems(case: Case) -> list[str]:
    if not _sizes_well_formed(case):
        return ["sizes must be a tuple of Size(name, dims, source)"]
    names = [size.name for size in case.sizes]
    problems = []
    if names and names[0] != SMALL_SIZE:
        problems.append(f"sizes must start with {SMALL_SIZE!r} (the size CI runs)")
    if len(set(names)) != len(names):
        problems.append(f"sizes repeat a name: {', '.join(names)}")
    for size in case.sizes:
        if size.name in SIZES and size.name != SMALL_SIZE and not size.source.strip():
            problems.append(f"size {size.name!r} does not cite where its dimensions come from")
    return problems


def _fix_problems(case: Case) -> list[str]:
    fixes = case.fixes
    problems = []
    if CONTROL_FIX not in fixes:
        problems.append("no fix named 'none' (the upstream code path)")
    if case.reference_fix and case.reference_fix not in fixes:
        problems.append(f"reference_fix {case.reference_fix!r} is not one of its fixes")
    for name, fix in fixes.items():
        if not CASE_NAME.match(name):
            problems.append(f"fix name {name!r} must be lower-case words joined by '-'")
        if not callable(fix.func):
            problems.append(f"fix {name!r} has no code")
        if not fix.rationale.strip():
            problems.append(f"fix {name!r} has no rationale")
        for mode in fix.modes or ():
            if mode not in case.modes:
                problems.append(f"fix {name!r} names mode {mode!r} the case does not declare")
        for backend in fix.backends or ():
            if backend not in case.backends:
                problems.append(f"fix {name!r} names backend {backend!r} the case lacks")
        for dtype in fix.dtypes or ():
            if dtype not in case.dtypes:
                problems.append(f"fix {name!r} names dtype {dtype!r} the case does not declare")
        for kept in fix.keep_fp32 or ():
            if kept not in case.keep_fp32:
                problems.append(
                    f"fix {name!r} keeps {kept!r} in float32, which the case's keep_fp32 "
                    "does not name (a fix can only narrow it)"
                )
    return problems


def add_model_case(case: Case) -> Case:
    """Register a case made from a user's model (``harness.measure.authoring.model_case``): it
    has no known failure or upstream to check, only axes and a name."""
    problems = contract_problems(case)
    if problems:
        raise CaseContractError(f"{case.name}: " + "; ".join(problems))
    if case.name in _REGISTRY:
        raise CaseContractError(f"a case named {case.name!r} is already registered")
    _REGISTRY[case.name] = case
    return copy.copy(case)


def get(name: str) -> Case:
    """A copy of the registered case ``name`` (KeyError if unknown)."""
    return copy.copy(_REGISTRY[name])


def find(name: str) -> Case | None:
    """A copy of the registered case ``name``, or None."""
    return get(name) if name in _REGISTRY else None


def names() -> list[str]:
    return sorted(_REGISTRY)


def all_cases() -> list[Case]:
    return [get(name) for name in names()]


def clear() -> None:
    """Empty the registry (tests use this)."""
    _REGISTRY.clear()
    _MODULES.clear()
    _IMPORT_CHANGES.clear()


def import_confined(path: str, load: Callable[[], T]) -> T:
    """``load()`` (the import of the run's module ``path``), with torch's global settings put
    back as they were before it: a module that sets the default dtype or the matmul precision
    as it is imported (a training script's often does) changes no cell's baseline. What it
    changed is remembered for the run to report (``import_changes``)."""
    changed: list[SettingChange] = []
    with torch_state.restored(changed):
        loaded = load()
    if changed:
        _IMPORT_CHANGES[path] = tuple(torch_state.worded(changed))
    return loaded


def import_changes() -> dict[str, tuple[str, ...]]:
    """What each module of the run changed of torch's global settings as it was imported
    (and was put back), by file."""
    return dict(_IMPORT_CHANGES)


@dataclass(frozen=True)
class Discovery:
    """Which modules were imported and which cases each registered."""

    modules: dict[str, tuple[str, ...]]


def discover(extra_dirs: Iterable[Path] = (), probe: bool = False) -> Discovery:
    """Import every case module of ``cases/`` and of each extra folder.

    Each module must register exactly one case; a module that does not is a contract error.
    With ``probe``, each module of an extra folder is first imported in a forked process, so
    one that ends the process it is imported into (``os._exit``), crashes it or hangs is
    named, not fatal. Whatever a module changes of torch's global settings as it is imported
    is put back (``import_confined``).
    """
    modules: dict[str, tuple[str, ...]] = {}
    folders: list[Path] = []
    for directory in (BUILTIN_CASES_DIR, *extra_dirs):
        if Path(directory).is_dir() and Path(directory).resolve() in folders:
            continue  # the same folder named twice (``--cases-dir cases``): read once
        paths = case_module_paths(Path(directory))
        folders.append(Path(directory).resolve())
        if folders[-1] != BUILTIN_CASES_DIR:
            importable_siblings(Path(directory))
            if probe:
                probe_imports(paths)
        for path in paths:
            modules[str(path)] = _import_case_module(path)
    return Discovery(modules)


def case_module_paths(directory: Path) -> list[Path]:
    """The case modules of a folder: every ``*.py`` whose name does not start with ``_``
    (those are helpers the case modules import)."""
    if not directory.is_dir():
        raise CaseContractError(f"{directory}: cases folder does not exist")
    return sorted(p for p in directory.glob("*.py") if not p.name.startswith("_"))


def importable_siblings(directory: Path) -> None:
    """Let the modules of an external cases folder import each other as users write it:
    ``import _helpers`` or ``from _helpers import ...`` (the folder goes on ``sys.path``)."""
    folder = str(directory.resolve())
    if folder not in sys.path:
        sys.path.append(folder)


def _import_case_module(path: Path) -> tuple[str, ...]:
    before = dict(_REGISTRY)
    module_name = _module_name_for(path)
    if module_name in sys.modules:
        registered = tuple(n for n, c in _REGISTRY.items() if c.source_file == str(path))
        if registered:
            return registered
        del sys.modules[module_name]  # imported before the registry was cleared: run it again
    try:
        import_confined(str(path), lambda: _load_module(module_name, path))
    except CaseContractError:
        raise
    except SystemExit as error:  # a module must not end the run it is imported into
        raise CaseContractError(f"{path}: called sys.exit({error.code!r}) at import") from error
    except Exception as error:
        raise CaseContractError(f"{path}: failed to import: {error!r}") from error
    # new names, and names the module registered again (run anew, it replaces its cases)
    added = tuple(sorted(n for n, case in _REGISTRY.items() if before.get(n) is not case))
    if len(added) != 1:
        imported = imported_cases(path, added)
        raise CaseContractError(
            f"{path}: registers {len(added)} cases, expected exactly one{imported}"
        )
    return added


def imported_cases(path: Path, added: tuple[str, ...]) -> str:
    """What a module that registered cases of other files imported, and how to share code
    instead: a module whose name starts with ``_`` is a helper, never a case module."""
    others = [
        f"{name} ({_REGISTRY[name].source_file})"
        for name in added
        if Path(_REGISTRY[name].source_file).resolve() != path.resolve()
    ]
    if not others:
        return ""
    return (
        f"; it imports the case module of {', '.join(others)}: put code that case modules "
        "share in a module whose name starts with _ (a helper, which registers nothing)"
    )


def probe_imports(paths: list[Path]) -> None:
    """Import a folder's case modules in one forked child first, in order, within a time
    limit; raise CaseContractError naming the module whose import ended the child or
    outlived the limit (errors the imports raise are reported by the real imports)."""
    todo = [p for p in paths if _module_name_for(p) not in sys.modules]
    steps = [lambda path=path: _load_module(_module_name_for(path), path) for path in todo]
    fatal = import_probe.first_fatal(steps)
    if fatal is not None:
        raise CaseContractError(f"{todo[fatal.step]}: {fatal.how}")


def _module_name_for(path: Path) -> str:
    if path.parent == BUILTIN_CASES_DIR:
        return f"cases.{path.stem}"
    digest = hashlib.sha1(str(path.resolve().parent).encode()).hexdigest()[:8]
    return f"ampmatrix_external_{digest}.{path.stem}"


def _load_module(module_name: str, path: Path) -> None:
    if module_name.startswith("cases."):
        importlib.import_module(module_name)
        return
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise CaseContractError(f"{path}: not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
