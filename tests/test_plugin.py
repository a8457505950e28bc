"""The pytest plugin as a user meets it: test files of their own, run by pytest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.results import storage
from tests.conftest import PLUGIN_ARGS, harness

PROMOTING = '''
import torch
from torch import nn
from harness import check_model


class Scaled(nn.Module):
    """A gain kept in float32 (as some models keep norms) promotes the activations."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(16))
        self.proj = nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(x * self.gain)


@check_model(modes=("half", "autocast"), keep_fp32=("gain",))
def test_scaled():
    return Scaled(), {"x": torch.randn(2, 4, 16)}
'''


def outcomes_of(result: pytest.RunResult) -> dict[str, int]:
    return {k: v for k, v in result.parseoutcomes().items() if k != "seconds"}


def test_a_promoting_model_fails_naming_the_parameter_that_promoted(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_promote=PROMOTING)
    result = pytester.runpytest_subprocess(*PLUGIN_ARGS, "-p", "no:cacheprovider")
    # half: two dtypes fail; autocast (two dtypes) and the float32 control pass
    assert outcomes_of(result) == {"failed": 2, "passed": 3}
    result.stdout.fnmatch_lines(
        [
            "*test_scaled[[]float16-half[]]*",
            "*raises: cpu float16/half; RuntimeError: mat1 and mat2 must have the same dtype*"
            "float32 enters via parameter gain at aten::mul in Scaled*"
            "fails at aten::addmm*in proj*",
        ]
    )
    assert (
        "test_scaled[float32-fp32] PASSED"
        in pytester.runpytest_subprocess(*PLUGIN_ARGS, "-v").stdout.str()
    )


def test_an_accepted_failure_is_an_xfail_and_fails_when_it_changes(
    pytester: pytest.Pytester,
) -> None:
    accepted = PROMOTING.replace(
        'keep_fp32=("gain",))',
        'keep_fp32=("gain",), expect={"float16/half": "raises", "bfloat16/autocast": "raises"})',
    )
    pytester.makepyfile(test_accepted=accepted)
    result = pytester.runpytest_subprocess(*PLUGIN_ARGS, "-p", "no:cacheprovider", "-rxf")
    assert outcomes_of(result) == {"failed": 2, "passed": 2, "xfailed": 1}
    result.stdout.fnmatch_lines(
        [
            "*test_scaled[[]bfloat16-half[]]*",
            "*bfloat16/autocast: expected raises, got passes; it passes now: drop it from expect*",
            "XFAIL*test_scaled[[]float16-half[]]*accepted: raises*",
        ]
    )


def test_results_folder_renders_as_a_report(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytester.makepyfile(test_promote=PROMOTING)
    run = tmp_path / "run"
    pytester.runpytest_subprocess(
        *PLUGIN_ARGS, "-p", "no:cacheprovider", "-n", "2", f"--ampmatrix-results={run}"
    )
    lines = (run / "cells.jsonl").read_text().splitlines()
    assert len(lines) == 5 and {json.loads(line)["case"] for line in lines} == {"test-scaled"}
    assert list(storage.read_cases(run)) == ["test-scaled"]
    command = json.loads((run / "env.json").read_text())["command"]
    assert f"--ampmatrix-results={run}" in command and "-n" in command
    report = harness("report", str(run), "--out", str(tmp_path / "report.html"))
    assert report.returncode == 0, report.stderr
    html = (tmp_path / "report.html").read_text()
    assert "test-scaled" in html and "raises" in html and "parameter gain" in html


def test_a_factory_returning_the_wrong_thing_is_told_so(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_wrong="""
import torch
from harness import check_model

@check_model(modes=("half",))
def test_wrong():
    return torch.nn.Linear(4, 4)
"""
    )
    result = pytester.runpytest_subprocess(*PLUGIN_ARGS, "-p", "no:cacheprovider")
    result.stdout.fnmatch_lines(["*test-wrong returned Linear; expected (model, inputs)*"])


def test_the_plugin_leaves_other_test_files_alone(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_plain="""
import sys

def test_plain():
    assert "torch" not in sys.modules
"""
    )
    assert outcomes_of(pytester.runpytest_subprocess(*PLUGIN_ARGS, "-p", "no:cacheprovider")) == {
        "passed": 1
    }


def check(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m harness check ...`` run from a project folder of the user's."""
    (tmp_path / "mymodels.py").write_text(MODELS)
    return subprocess.run(
        [sys.executable, "-m", "harness", "check", *args, "--out", str(tmp_path / "results")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )


MODELS = PROMOTING.replace("from harness import check_model\n", "").replace(
    '@check_model(modes=("half", "autocast"), keep_fp32=("gain",))\ndef test_scaled():',
    "def scaled():",
)


def test_check_runs_a_model_of_yours_through_the_matrix(tmp_path: Path) -> None:
    result = check(tmp_path, "mymodels:scaled", "--keep-fp32", "gain", "--device", "cpu",
                   "--no-timing", "-n", "1")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "scaled\n  fix   float16/autocast  float16/half" in result.stdout
    assert "float32 enters via parameter gain at aten::mul in Scaled" in result.stdout
    records = storage.read_records(next((tmp_path / "results").iterdir()))
    by_mode = {(r.cell.dtype, r.cell.mode): r.outcome.value for r in records}
    assert by_mode == {
        ("float16", "autocast"): "passes",
        ("bfloat16", "autocast"): "passes",
        ("float16", "half"): "raises",
        ("bfloat16", "half"): "raises",
        ("float32", "fp32"): "passes",
    }


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("mymodels", "expected MODULE:FACTORY"),
        ("nomodule:f", "cannot import nomodule"),
        ("mymodels:nothing", "mymodels has no function 'nothing'"),
    ],
)
def test_check_refuses_a_target_it_cannot_use(tmp_path: Path, target: str, message: str) -> None:
    result = check(tmp_path, target, "--no-timing")
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_each_backend_is_judged_against_its_own_model(pytester: pytest.Pytester) -> None:
    """A factory that builds another model per backend (transformers' attention classes
    draw their random weights in another order) is judged backend by backend."""
    pytester.makepyfile(
        test_backends="""
import torch
from harness import check_model

@check_model(modes=("half",), backends=("sdpa", "eager"))
def test_per_backend(ctx):
    if ctx.backend == "eager":
        torch.randn(7)  # the eager model's weights come out different
    return torch.nn.Linear(8, 8), {"input": torch.randn(2, 8)}
"""
    )
    result = pytester.runpytest_subprocess(*PLUGIN_ARGS, "-p", "no:cacheprovider")
    assert outcomes_of(result) == {"passed": 6}


def test_check_keeps_a_name_for_the_model_it_names(tmp_path: Path) -> None:
    """``FACTORY=NAME`` keeps NAME in float32 in that factory's model only: a second model
    without it is checked as it is."""
    (tmp_path / "other.py").write_text(
        "import torch\n\n\ndef plain():\n"
        "    return torch.nn.Linear(8, 8), {'input': torch.randn(2, 8)}\n"
    )
    result = check(tmp_path, "mymodels:scaled", "other:plain", "--keep-fp32", "scaled=gain",
                   "--device", "cpu", "--mode", "half", "--no-timing", "-n", "1")  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = storage.read_records(next((tmp_path / "results").iterdir()))
    outcomes = {(r.cell.case, r.cell.dtype): r.outcome.value for r in records}
    assert outcomes[("plain", "float16")] == "passes"
    assert outcomes[("scaled", "float16")] == "raises"  # gain kept: the promotion reproduces


LEAKING_TEST = """
import torch
from harness import check_model

torch.set_default_dtype(torch.float16)  # as a training script's module might
torch.set_float32_matmul_precision("medium")


@check_model(modes=("half", "autocast"))
def test_linear():
    return torch.nn.Linear(16, 16), {"input": torch.randn(2, 16)}
"""


def test_settings_a_test_module_changes_at_import_are_put_back_for_each_cell(
    pytester: pytest.Pytester,
) -> None:
    """A test module that changes torch's settings as it is imported (after a conftest has
    loaded torch) must not become the model cells' starting point."""
    pytester.makeconftest("import torch\n")
    pytester.makepyfile(test_leaking=LEAKING_TEST)
    results = pytester.path / "results"
    result = pytester.runpytest_subprocess(
        *PLUGIN_ARGS, "-p", "no:cacheprovider", f"--ampmatrix-results={results}"
    )
    assert outcomes_of(result) == {"passed": 5}, result.stdout.str()
    records = storage.read_records(results)
    settled = [n.text for r in records for n in r.notes if n.kind.value == "worker-settled"]
    # put back before the first cell; each cell leaves the settings as it found them
    assert len(settled) == 1 and "default dtype torch.float32 -> torch.float16" in settled[0]
    assert "float32 matmul precision highest -> medium" in settled[0]
    assert {r.out_dtypes for r in records if r.cell.mode == "half"} == {
        ("float16",),
        ("bfloat16",),
    }


def test_check_model_trains_the_model_where_asked(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_trained="""
import torch
from harness import check_model

@check_model(modes=("half", "autocast"), stages=("forward", "train"))
def test_mlp():
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    return layers, {"input": torch.randn(8, 16)}
"""
    )
    result = pytester.runpytest_subprocess(*PLUGIN_ARGS, "-p", "no:cacheprovider", "-v")
    assert outcomes_of(result) == {"passed": 10}
    result.stdout.fnmatch_lines(["*test_mlp?float16-autocast-train? PASSED*"])
