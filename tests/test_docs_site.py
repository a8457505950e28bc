"""The documentation site: the real docs build with MkDocs in strict mode without a single
warning, and each kind of breakage a strict build exists to catch fails it, saying what
broke: a link to a page that does not exist, an anchor no heading makes, a nav entry
whose page is missing, an API reference to a name the code does not define.

Each build runs on a copy of mkdocs.yml and docs/ (the harness is read from the checkout,
statically, as `nox -s docs` reads it): a second or two each."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: The docs toolchain's modules: mkdocs, mkdocs-material, mkdocstrings[python], griffe-sphinx.
TOOLCHAIN = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers", "griffe_sphinx")

pytestmark = pytest.mark.skipif(
    any(importlib.util.find_spec(module) is None for module in TOOLCHAIN),
    reason="the docs toolchain is not installed here (mkdocs, mkdocs-material, "
    "mkdocstrings[python], griffe-sphinx: the docs and test extras)",
)


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A copy of the site's sources, with the harness (for the API reference) linked in."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "harness").symlink_to(ROOT / "harness", target_is_directory=True)
    return tmp_path


def build(site: Path) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` as ``nox -s docs`` runs it; stdout and stderr together."""
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site / "site")],
        cwd=site,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=120,
    )


def append(page: Path, text: str) -> None:
    page.write_text(page.read_text() + "\n" + text + "\n")


def assert_fails(result: subprocess.CompletedProcess[str], *said: str) -> None:
    assert result.returncode != 0, result.stdout
    for text in said:
        assert text in result.stdout, result.stdout


def test_the_docs_build_strict_without_a_warning(site: Path) -> None:
    result = build(site)
    assert result.returncode == 0, result.stdout
    assert "WARNING" not in result.stdout and "ERROR" not in result.stdout, result.stdout
    assert (site / "site" / "api" / "index.html").exists()
    # the API reference holds the docstrings, read from the code
    api = (site / "site" / "api" / "index.html").read_text()
    assert "A failure pattern from a real project" in api  # Case's docstring
    # a docstring's Sphinx roles are shown as code, not as written (docs/griffe_roles.py)
    assert ":class:`" not in api and ":func:`" not in api


def test_a_link_to_a_missing_page_fails_the_build(site: Path) -> None:
    append(site / "docs" / "api.md", "See [the lost page](missing.md).")
    assert_fails(
        build(site),
        "Doc file 'api.md' contains a link 'missing.md', but the target is not found among "
        "documentation files",
        "Aborted with",
    )


def test_links_to_missing_anchors_fail_the_build(site: Path) -> None:
    append(
        site / "docs" / "api.md",
        "See [nothing](#no-such-heading) and [nothing there](writing-a-case.md#no-such-one).",
    )
    assert_fails(
        build(site),
        "Doc file 'api.md' contains a link '#no-such-heading', but there is no such anchor "
        "on this page",
        "Doc file 'api.md' contains a link 'writing-a-case.md#no-such-one', but the doc "
        "'writing-a-case.md' does not contain an anchor '#no-such-one'",
        "Aborted with 2 warnings in strict mode",
    )


def test_a_nav_entry_to_a_missing_page_fails_the_build(site: Path) -> None:
    import yaml  # mkdocs's own dependency

    config = yaml.safe_load((site / "mkdocs.yml").read_text())
    config["nav"].append({"Nowhere": "nowhere.md"})
    (site / "mkdocs.yml").write_text(yaml.safe_dump(config, sort_keys=False))
    assert_fails(
        build(site),
        "A reference to 'nowhere.md' is included in the 'nav' configuration, which is not "
        "found in the documentation files",
        "Aborted with",
    )


def test_an_api_reference_to_a_name_the_code_lacks_fails_the_build(site: Path) -> None:
    append(site / "docs" / "api.md", "::: harness.schema.records.NoSuchRecord")
    assert_fails(build(site), "Could not collect 'harness.schema.records.NoSuchRecord'")
