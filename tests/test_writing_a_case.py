""" "Writing a case" tells the truth: its training example is shown as it is in
``docs/examples/`` and prints what the guide shows; helpers shared between case modules
work as the guide says, and a case module that imports another is refused with the way out.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.measure.authoring import registry
from harness.measure.authoring.registry import CaseContractError
from harness.results import storage
from harness.schema.records import outcome_label
from tests.conftest import ROOT, harness, only_run_dir

GUIDE = ROOT / "docs" / "writing-a-case.md"
TRAINING_GUIDE = ROOT / "docs" / "case-training.md"
EXAMPLE = ROOT / "docs" / "examples" / "fp16_small_gradients.py"


def shown_after(command: str, text: str) -> list[str]:
    """The lines of the ``text`` block that follows the block holding ``command``."""
    after = text[text.index(command) :]
    block = re.search(r"```text\n(.*?)```", after, re.S)
    assert block is not None, f"no output shown after {command}"
    return block.group(1).splitlines()


def test_the_training_example_is_shown_as_it_is_and_prints_what_the_guide_shows(
    tmp_path: Path,
) -> None:
    guide = TRAINING_GUIDE.read_text()
    assert f"```python\n{EXAMPLE.read_text()}```" in guide
    command = next(line for line in guide.splitlines() if "guide-fp16-small-gradients" in line
                   and line.startswith("python -m harness run"))  # fmt: skip
    args = command.removeprefix("python -m harness ").split()
    result = harness(*args, "-n", "2", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    printed = {line.rstrip() for line in result.stdout.splitlines()}
    shown = shown_after(command, guide)
    assert [line for line in shown if line.rstrip() not in printed] == []
    records = storage.read_records(only_run_dir(tmp_path))
    train = {
        r.cell.scaler: r for r in records if r.cell.stage == "train" and r.cell.dtype == "float16"
    }
    assert outcome_label(train["none"]) == "inaccurate"
    worst = train["none"].numerics
    assert worst is not None and (worst.leaf or "").startswith("grad.aux.")
    assert outcome_label(train["dynamic"]) == "passes"
    assert {r.cell.fix for r in records} == {"none"}
    assert {r.cell.stage for r in records} == {"forward", "train", "fit"}


@pytest.fixture
def case_folder(tmp_path: Path, clean_registry: None) -> Iterator[Path]:
    """A case folder whose two case modules share a helper, ``_guide_blocks``; the helper's
    module and the folder on ``sys.path`` are taken back after the test."""
    folder = tmp_path / "my_cases"
    folder.mkdir()
    (folder / "_guide_blocks.py").write_text(HELPER)
    for name in ("first", "second"):
        (folder / f"{name}.py").write_text(CASE_MODULE.format(name=name))
    path = list(sys.path)
    yield folder
    sys.path[:] = path
    sys.modules.pop("_guide_blocks", None)
    sys.modules.pop("first", None)


HELPER = '''
import torch
from torch import nn

from harness import Case, FailureSignature, RunContext, Upstream, Workload, fix


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class BlockCase(Case):
    """A base class both case modules subclass; registered by neither here."""

    upstream = Upstream(repo="example/guide", file="-", commit="-")
    failure = FailureSignature("RuntimeError", "never")
    reference_fix = "none"

    def build(self, ctx: RunContext) -> Workload:
        return Workload(model=Block(), inputs={"x": torch.randn(2, 8)})

    @fix("none", rationale="the block as it is")
    def none(self, w: Workload, ctx: RunContext) -> torch.Tensor:
        return w.model(w.inputs["x"])
'''

CASE_MODULE = """
from _guide_blocks import BlockCase

from harness import register


@register
class {name}(BlockCase):
    name = "guide-{name}"
    title = "the shared block, as the {name} case"
"""


def test_case_modules_share_a_helper_as_the_guide_says(case_folder: Path) -> None:
    found = registry.discover([case_folder])
    by_file = {Path(path).name: names for path, names in found.modules.items()}
    assert by_file["first.py"] == ("guide-first",) and by_file["second.py"] == ("guide-second",)
    assert "_guide_blocks.py" not in by_file
    assert registry.get("guide-first").fixes.keys() == {"none"}


def test_a_case_module_that_imports_another_is_refused_with_the_way_out(
    case_folder: Path,
) -> None:
    second = case_folder / "second.py"
    second.write_text("import first  # noqa: F401\n" + second.read_text())
    with pytest.raises(CaseContractError) as refused:
        registry.discover([case_folder])
    message = str(refused.value)
    assert message.startswith(f"{second}: registers 2 cases, expected exactly one")
    assert f"it imports the case module of guide-first ({case_folder / 'first.py'})" in message
    assert "a module whose name starts with _" in message
    guide = " ".join(GUIDE.read_text().split())
    assert "registers 2 cases, expected exactly one; it imports the case module of" in guide
