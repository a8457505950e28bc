"""The registry: decorator, contract checks, duplicates, discovery."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from harness.measure.authoring import registry
from harness.measure.authoring.case import Case, FailureSignature, Upstream, Workload, fix
from harness.measure.authoring.registry import CaseContractError, register
from tests.conftest import BROKEN_CASES, TOY_CASES


def make_case_class(**overrides: object) -> type[Case]:
    attrs: dict[str, object] = {
        "name": "good-case",
        "title": "A good case",
        "upstream": Upstream(repo="r", file="f.py", commit="c"),
        "failure": FailureSignature("RuntimeError", "boom"),
        "reference_fix": "none",
        "__module__": __name__,
        "build": lambda self, ctx: Workload(model=None),
        "none": fix("none", rationale="upstream")(lambda self, w, ctx: torch.zeros(1)),
    }
    attrs.update(overrides)
    return type("Generated", (Case,), attrs)


def test_register_adds_a_case_and_get_returns_a_copy(clean_registry: None) -> None:
    register(make_case_class())
    first, second = registry.get("good-case"), registry.get("good-case")
    assert first is not second
    assert list(first.fixes) == ["none"]
    assert registry.names() == ["good-case"]


def test_duplicate_name_is_an_error_naming_both_files(clean_registry: None) -> None:
    register(make_case_class())
    with pytest.raises(CaseContractError, match="duplicate case name 'good-case'"):
        register(make_case_class())


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ({"name": "Bad Name"}, "lower-case words"),
        ({"title": ""}, "missing title"),
        ({"upstream": None}, "missing upstream"),
        ({"failure": None}, "missing failure"),
        ({"failure": None, "has_known_failure": False}, "only a model you check"),
        ({"reference_fix": "nope"}, "reference_fix 'nope' is not one of its fixes"),
        ({"modes": ("half", "turbo")}, "unknown mode 'turbo'"),
        ({"dtypes": ("float8",)}, "unknown dtype 'float8'"),
        ({"backends": ()}, "backends is empty"),
        ({"none": None}, "no fix named 'none'"),
        ({"build": Case.build}, "no build() method"),
        ({"min_torch": "two point four"}, "min_torch 'two point four' must be a release"),
    ],
)
def test_malformed_cases_are_refused_with_the_problem(
    clean_registry: None, overrides: dict[str, object], problem: str
) -> None:
    with pytest.raises(CaseContractError, match=re.escape(problem)) as info:
        register(make_case_class(**overrides))
    assert __file__.removesuffix("c") in str(info.value)
    assert registry.names() == []


def test_fix_without_rationale_is_refused(clean_registry: None) -> None:
    bare = fix("none", rationale=" ")(lambda self, w, ctx: torch.zeros(1))
    with pytest.raises(CaseContractError, match="fix 'none' has no rationale"):
        register(make_case_class(none=bare))


def test_every_builtin_module_registers_exactly_one_case(clean_registry: None) -> None:
    discovery = registry.discover()
    paths = registry.case_module_paths(registry.BUILTIN_CASES_DIR)
    assert sorted(discovery.modules) == sorted(str(p) for p in paths)
    assert all(len(names) == 1 for names in discovery.modules.values())
    assert len(registry.names()) == len(paths) >= 4


def test_seed_cases_are_discovered(clean_registry: None) -> None:
    registry.discover()
    for name in (
        "dia-sdpa-kv-cache",
        "lightning-encoder-fastpath",
        "var-normalize-promotion",
        "sana-softmax-float",
    ):
        assert name in registry.names()
        assert "none" in registry.get(name).fixes


def test_discovery_adds_external_cases_dir(clean_registry: None) -> None:
    registry.discover([TOY_CASES])
    assert "toy-mixed-matmul" in registry.names()
    assert registry.get("toy-mixed-matmul").source_file.endswith("toy_mixed_matmul.py")


def test_broken_external_case_names_its_file(clean_registry: None) -> None:
    with pytest.raises(CaseContractError) as info:
        registry.discover([BROKEN_CASES])
    message = str(info.value)
    assert "no_none_fix.py" in message
    assert "no fix named 'none'" in message
    assert "unknown mode 'turbo'" in message


def test_missing_cases_dir_is_reported(clean_registry: None, tmp_path: Path) -> None:
    with pytest.raises(CaseContractError, match="does not exist"):
        registry.discover([tmp_path / "nowhere"])


def test_module_that_fails_to_import_is_reported(clean_registry: None, tmp_path: Path) -> None:
    (tmp_path / "bad_import.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(CaseContractError, match=r"bad_import.py: failed to import"):
        registry.discover([tmp_path])
    assert not any("bad_import" in name for name in sys.modules)


def test_module_registering_no_case_is_reported(clean_registry: None, tmp_path: Path) -> None:
    (tmp_path / "empty_case.py").write_text('"""Nothing here."""\n')
    with pytest.raises(CaseContractError, match="registers 0 cases, expected exactly one"):
        registry.discover([tmp_path])


def test_a_module_calling_sys_exit_at_import_is_named(
    clean_registry: None, tmp_path: Path
) -> None:
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(CaseContractError, match=r"exits.py: called sys.exit\(3\) at import"):
        registry.discover([tmp_path])


def test_the_builtin_folder_named_again_is_read_once(
    clean_registry: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--cases-dir cases`` from the project root: not every case a duplicate of itself."""
    monkeypatch.chdir(registry.BUILTIN_CASES_DIR.parent)
    registry.discover([Path("cases"), registry.BUILTIN_CASES_DIR])
    assert "sana-softmax-float" in registry.names()


def test_a_case_module_dropped_from_sys_modules_is_registered_again(
    clean_registry: None,
) -> None:
    """A test's cleanup can drop ``cases.*`` modules while their cases stay registered (seen
    as 11 errors in a fresh clone): importing them again replaces those cases, it does not
    call them duplicates or count zero cases."""
    registry.discover()
    names = registry.names()
    for name in [n for n in sys.modules if n.startswith("cases.")]:
        del sys.modules[name]
    registry.discover()
    assert registry.names() == names
