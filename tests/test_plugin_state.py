"""The plugin's state is its session's (``config.stash``), and an ``expect`` key is read
once, as ``check_model`` receives it."""

from __future__ import annotations

import pytest
import torch

from harness.measure.authoring.model_case import ModelCheckError
from harness.plugin import MARK, ModelTest, check_model, expected_label, parse_expect
from harness.results import storage
from harness.schema.axes import AXIS, Cell
from harness.schema.records import NoteKind
from tests.conftest import PLUGIN_ARGS

ONE_CELL_MODEL = """
import torch
from torch import nn
from harness import check_model


@check_model(dtypes=("bfloat16",), modes=("autocast",))
def test_linear():
    return nn.Linear(8, 8), {"input": torch.randn(2, 8)}
"""


def test_two_sessions_in_one_process_keep_their_state_apart(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second session's conftest sets a torch setting before its tests: that is its
    own starting point (no cell of it is put back to the first session's settings), its
    records go to its own folder and its env.json names its own command."""
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)
    pytester.makepyfile(**{"one/test_one": ONE_CELL_MODEL, "two/test_two": ONE_CELL_MODEL})
    pytester.makeconftest("")
    (pytester.path / "two" / "conftest.py").write_text(
        "import torch\ntorch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark\n"
    )
    first, second = pytester.path / "first", pytester.path / "second"
    args = (*PLUGIN_ARGS, "-p", "no:cacheprovider", "--ampmatrix-results")
    pytester.runpytest_inprocess("one", *args, str(first)).assert_outcomes(passed=2)
    ran_first = storage.read_records(first)
    pytester.runpytest_inprocess("two", *args, str(second)).assert_outcomes(passed=2)

    assert storage.read_records(first) == ran_first  # nothing of the second session
    records = storage.read_records(second)
    assert len(records) == 2
    settled = [n for r in records for n in r.notes if n.kind is NoteKind.WORKER_SETTLED]
    assert settled == []
    assert "two" in (storage.read_env(second).command or [])


def test_expect_keys_are_parsed_once_into_axis_values() -> None:
    """``check_model`` holds each key as the values it names, each with its axes; the
    cells match them with no key read again."""

    @check_model(expect={"float16/half": "raises", "cuda/eager": "passes[drift]"})
    def factory() -> None:
        return None

    spec: ModelTest = getattr(factory, MARK)
    half, eager = spec.expect
    assert half.values == (("float16", (AXIS["dtype"],)), ("half", (AXIS["mode"],)))
    assert half.label == "raises"
    assert eager.values == (
        ("cuda", (AXIS["device"],)),
        ("eager", (AXIS["backend"], AXIS["compile"])),
    )

    def cell(device: str, dtype: str, mode: str, backend: str = "sdpa") -> Cell:
        return Cell("m", "none", device, dtype, mode, backend)

    assert expected_label(spec.expect, cell("cpu", "float16", "half")) == "raises"
    assert expected_label(spec.expect, cell("cpu", "bfloat16", "half")) is None
    assert expected_label(spec.expect, cell("cuda:1", "bfloat16", "autocast")) == "passes[drift]"
    assert expected_label(spec.expect, cell("cpu", "bfloat16", "autocast")) is None


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("float16/hlaf", "expect key 'float16/hlaf': 'hlaf' is no value of a model axis"),
        ("float16//half", "expect key 'float16//half': axis values joined by '/', none empty"),
        ("", "expect key '': axis values joined by '/', none empty"),
        ("cuda:x", "expect key 'cuda:x': 'cuda:x' is no value of a model axis"),
    ],
)
def test_a_bad_expect_key_is_refused_naming_it(key: str, message: str) -> None:
    with pytest.raises(ModelCheckError, match=message):
        parse_expect({key: "raises"})


def test_a_bad_expect_key_is_an_error_at_collection(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_bad=ONE_CELL_MODEL.replace(
            '("autocast",))', '("autocast",), expect={"bf16": "raises"})'
        )
    )
    result = pytester.runpytest_inprocess(*PLUGIN_ARGS, "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(
        ["*expect key 'bf16': 'bf16' is no value of a model axis (devices*"]
    )


def test_an_indexed_device_is_a_value_of_expect() -> None:
    (only,) = parse_expect({"cuda:1/half": "raises"})
    assert only.matches(Cell("m", "none", "cuda:1", "float16", "half", "sdpa"))
    assert not only.matches(Cell("m", "none", "cuda:0", "float16", "half", "sdpa"))
