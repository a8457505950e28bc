"""The packages of ``harness`` are layers: each imports only the layers under it, none
imports torch on the read side, and no module imports itself back through a circle.

The imports are read from the source (every ``import`` and ``from ... import``, at module
level or inside a function), so a lazy import that reaches up a layer fails here too.
"""

from __future__ import annotations

import ast
import importlib
import json
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT

HARNESS = ROOT / "harness"

#: Each layer and the layers it may import. The read side (schema, results, report) never
#: imports torch, so a report renders where no torch is installed.
LAYERS: dict[str, set[str]] = {
    "schema": set(),
    "results": {"schema"},
    "report": {"schema", "results"},
    "measure": {"schema", "results"},
    "runner": {"schema", "results", "measure"},
    "cli": {"schema", "results", "report", "measure", "runner"},
    "plugin": {"schema", "results", "measure", "runner"},
}
READ_SIDE = ("schema", "results", "report")

#: ``harness.measure``'s subpackages, each with those it may import (``execute``, the
#: package's top module, ties them together and may import any).
MEASURE_PARTS: dict[str, set[str]] = {
    "host": set(),
    "precision": set(),
    "tracing": {"host", "precision"},
    "authoring": {"host", "precision", "tracing"},
    "running": {"host", "precision", "tracing", "authoring"},
    "judge": {"host", "precision", "tracing", "authoring", "running"},
    "figures": {"host", "precision", "tracing", "authoring", "running"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def harness_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(HARNESS.rglob("*.py"))}


def layer_of(module: str) -> str | None:
    """``harness.results.storage`` -> ``results``; the package's root (the authoring API
    and ``python -m harness``) belongs to no layer."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] != "__main__" else None


def imported_modules(module: str, path: Path, known: set[str]) -> Iterator[tuple[str, bool]]:
    """Each harness module ``module`` imports, and whether the import is at module level."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            if name in known and name != module:
                yield name, id(node) in top_level
                break


def import_graph(module_level_only: bool) -> dict[str, set[str]]:
    modules = harness_modules()
    return {
        name: {
            target
            for target, at_top in imported_modules(name, path, set(modules))
            if at_top or not module_level_only
        }
        for name, path in modules.items()
    }


def test_every_module_belongs_to_a_declared_layer() -> None:
    unplaced = [m for m in harness_modules() if layer_of(m) not in (*LAYERS, None)]
    assert unplaced == []


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = [
        f"{source} imports {target}"
        for source, targets in import_graph(module_level_only=False).items()
        for target in targets
        if (mine := layer_of(source)) is not None
        and (theirs := layer_of(target)) is not None
        and theirs != mine
        and theirs not in LAYERS[mine]
    ]
    assert upward == []


def measure_part(module: str) -> str | None:
    """``harness.measure.host.caches`` -> ``host``; None outside a subpackage of measure."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "measure" else None


def test_every_measure_module_is_in_a_declared_subpackage() -> None:
    placed = [m for m in harness_modules() if layer_of(m) == "measure"]
    loose = [
        m
        for m in placed
        if measure_part(m) is None
        and m not in ("harness.measure", "harness.measure.execute")
        and m.split(".")[2] not in MEASURE_PARTS
    ]
    assert loose == []
    assert {measure_part(m) for m in placed} - {None} == set(MEASURE_PARTS)


def test_no_measure_subpackage_imports_one_after_it() -> None:
    upward = [
        f"{source} imports {target}"
        for source, targets in import_graph(module_level_only=False).items()
        for target in targets
        if (mine := measure_part(source)) is not None
        and (theirs := measure_part(target)) is not None
        and theirs != mine
        and theirs not in MEASURE_PARTS[mine]
    ] + [
        f"{source} imports {target}"
        for source, targets in import_graph(module_level_only=False).items()
        for target in targets
        if measure_part(source) is not None and target == "harness.measure.execute"
    ]
    assert upward == []


@pytest.mark.parametrize("part", sorted(MEASURE_PARTS))
def test_each_measure_subpackage_says_what_it_holds(part: str) -> None:
    module = importlib.import_module(f"harness.measure.{part}")
    assert module.__doc__ and "import" in module.__doc__, f"harness.measure.{part}"


def test_no_layer_imports_the_package_root() -> None:
    """``harness/__init__`` loads the authoring API from the layers: importing it from a
    layer would go up."""
    graph = import_graph(module_level_only=False)
    assert [m for m, targets in graph.items() if layer_of(m) and "harness" in targets] == []


def import_circle(graph: dict[str, set[str]]) -> list[str]:
    """The first circle of imports in ``graph``, as the modules it passes through (its
    first module again at the end), or an empty list where there is none."""
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return []
        for target in sorted(graph[module]):
            circle = visit(target, (*path, module))
            if circle:
                return circle
        done.add(module)
        return []

    return next((circle for module in graph if (circle := visit(module, ()))), [])


def test_the_module_level_imports_have_no_circle() -> None:
    assert " -> ".join(import_circle(import_graph(module_level_only=True))) == ""


def test_no_modules_import_each_other_even_lazily() -> None:
    """No circle among all the imports of ``harness``, modules inside one package and
    across packages alike: every import counts, at module level, inside a function or
    under ``TYPE_CHECKING``. A lazy import that closes a circle runs only because of the
    order modules happen to load in, and hides that neither module can be read (or moved,
    or tested) without the other; a type checker's import is the same dependency. So the
    modules form one order, each depending only on those before it."""
    assert " -> ".join(import_circle(import_graph(module_level_only=False))) == ""


def test_the_circle_test_finds_a_lazy_circle_inside_a_package(tmp_path: Path) -> None:
    """The circle ``schema.migrations`` and ``schema.records`` made (records imported the
    migrations inside a function, the migrations records' enums at module level) is found,
    and the harness's graph without it has none."""
    graph = import_graph(module_level_only=False)
    records, migrations = "harness.schema.records", "harness.schema.migrations"
    circle = import_circle({**graph, migrations: {*graph[migrations], records}})
    assert sorted(circle) == sorted([migrations, records, circle[0]])
    lazy = tmp_path / "records.py"
    lazy.write_text("def read():\n    from harness.schema.migrations import migrated\n")
    assert dict(imported_modules(records, lazy, set(graph))) == {migrations: False}


def test_the_layer_test_catches_an_upward_import(tmp_path: Path) -> None:
    """The import reader sees a lazy, relative import that reaches up a layer."""
    source = tmp_path / "speed.py"
    source.write_text("def f():\n    from ..runner import run\n")
    known = {"harness.runner.run", "harness.runner"}
    found = list(imported_modules("harness.results.speed", source, known))
    assert found == [("harness.runner.run", False)]
    assert "runner" not in LAYERS[layer_of("harness.results.speed") or ""]


def test_no_read_side_module_imports_torch() -> None:
    """Every module of schema, results and report imported one after the other in a fresh
    interpreter; torch is looked for after each, so the one that brings it in is named."""
    modules = [m for m in harness_modules() if layer_of(m) in READ_SIDE]
    assert len(modules) > 15
    script = (
        "import importlib, json, sys\n"
        "for name in sys.argv[1:]:\n"
        "    importlib.import_module(name)\n"
        "    if 'torch' in sys.modules:\n"
        "        print(json.dumps(name)); break\n"
        "else:\n"
        "    print(json.dumps(None))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, *modules], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) is None, "this module imports torch"


@pytest.mark.parametrize("package", sorted(set(LAYERS) - {"plugin"}))
def test_each_package_serves_its_surface_from_its_modules(package: str) -> None:
    """Every name of a layer's ``SURFACE`` is the object its module defines, and no name
    is also a module of the package (which, once imported, would shadow it)."""
    module = importlib.import_module(f"harness.{package}")
    surface: dict[str, str] = getattr(module, "SURFACE", {})
    if package != "cli":
        assert surface, f"harness.{package} declares no public surface"
    submodules = {m.name for m in pkgutil.iter_modules(module.__path__)}
    for name, source in surface.items():
        assert name not in submodules
        assert getattr(module, name) is getattr(
            importlib.import_module(f"harness.{package}.{source}"), name
        )
    assert sorted(surface) == sorted(getattr(module, "__all__", []))


def test_the_package_map_names_every_module() -> None:
    """``docs/architecture.md`` is a newcomer's map: a module missing from it is a gap."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    unnamed = [
        m
        for m, path in harness_modules().items()
        if layer_of(m) and path.name != "__init__.py" and f"`{path.name}`" not in text
    ]
    assert unnamed == []


def test_every_dispatch_mode_of_the_harness_leaves_dynamo_unimported() -> None:
    """torch's own wrapper of a dispatch mode imports ``torch._dynamo`` on first use (over a
    second: the float32 control's yardstick once took a forward ``check`` from 1.8 s to
    3.2 s); each of the harness's modes derives from ``LazyDynamoMode``, which does not."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from harness.measure.tracing.dispatch_mode import LazyDynamoMode

    for info in pkgutil.walk_packages([str(ROOT / "harness")], "harness."):
        if not info.name.endswith("__main__"):  # it runs the command line
            importlib.import_module(info.name)
    modes = [
        mode
        for mode in all_subclasses(TorchDispatchMode)
        if mode.__module__.startswith("harness.") and mode is not LazyDynamoMode
    ]
    assert modes, "no dispatch mode found: the search finds nothing to check"
    assert [m.__qualname__ for m in modes if not issubclass(m, LazyDynamoMode)] == []


def all_subclasses(cls: type) -> list[type]:
    found: list[type] = []
    subclasses: list[type] = type.__subclasses__(cls)
    for sub in subclasses:
        found += [sub, *all_subclasses(sub)]
    return found
