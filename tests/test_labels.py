"""Labels are checked where they enter: an ``expect=`` label of the pytest plugin is read
against the outcomes a model check's cell can have and the kinds of flag, as the test
module is collected, with the nearest valid label suggested (as a selection's names are)."""

from __future__ import annotations

import itertools

import pytest

from harness.measure.authoring.model_case import ModelCheckError
from harness.plugin import ExpectedOutcome, expected_outcome, model_check_outcomes, parse_expect
from harness.schema.axes import Cell
from harness.schema.records import (
    RAISES_OTHER,
    REPRODUCES,
    CellRecord,
    Flag,
    FlagKind,
    Outcome,
    outcome_label,
)
from tests.conftest import PLUGIN_ARGS
from tests.test_plugin_state import ONE_CELL_MODEL

CELL = Cell("m", "none", "cpu", "float16", "half", "sdpa")


def model_record(outcome: Outcome, *kinds: FlagKind) -> CellRecord:
    """A model check's record: a raised cell's ``reproduces`` is None (no known failure)."""
    flags = tuple(Flag(kind, "detail") for kind in kinds)
    return CellRecord(cell=CELL, outcome=outcome, torch_version="2.13.0", flags=flags)


@pytest.mark.parametrize("outcome", list(Outcome))
def test_every_label_a_model_check_records_is_accepted_as_it_is_printed(
    outcome: Outcome,
) -> None:
    """No valid label is refused: each outcome alone and with flags, as ``outcome_label``
    prints it, reads back and accepts the record it was printed from."""
    for kinds in ((), (FlagKind.DRIFT,), (FlagKind.NOT_HALF, FlagKind.NO_AUTOCAST)):
        record = model_record(outcome, *kinds)
        read = expected_outcome("float16/half", outcome_label(record))
        assert read == ExpectedOutcome(outcome.value, frozenset(kinds))
        assert read.accepts(record)
    assert outcome.value in model_check_outcomes()


def test_flags_are_accepted_in_any_order_and_only_all_of_them() -> None:
    record = model_record(Outcome.PASSES, FlagKind.NOT_HALF, FlagKind.DRIFT)
    assert outcome_label(record) == "passes[not-half,drift]"
    assert expected_outcome("k", "passes[drift,not-half]").accepts(record)
    assert not expected_outcome("k", "passes[drift]").accepts(record)
    assert not expected_outcome("k", "passes").accepts(record)
    assert not expected_outcome("k", "inaccurate[drift,not-half]").accepts(record)


@pytest.mark.parametrize(
    ("label", "message"),
    [
        ("rasies", "expect 'float16/half': 'rasies': no outcome 'rasies'; did you mean raises?"),
        ("Passes", "no outcome 'Passes'; did you mean passes?"),
        ("", "expect 'float16/half': '': no outcome ''"),
        ("passes[drfit]", "'passes[drfit]': no flag 'drfit'; did you mean drift? (flags: drift,"),
        ("passes[drift,]", "no flag ''"),
        ("passes[]", "no flag ''"),
        ("passes[drift", "no outcome 'passes[drift'"),
        ("passes[drift]x", "no outcome 'passes[drift]x'"),
    ],
)
def test_a_label_of_no_outcome_or_flag_is_refused_with_the_nearest(
    label: str, message: str
) -> None:
    with pytest.raises(ModelCheckError) as refused:
        parse_expect({"float16/half": label})
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("label", [REPRODUCES, RAISES_OTHER, f"{REPRODUCES}[drift]"])
def test_a_label_only_a_case_with_a_known_failure_has_is_refused_saying_why(label: str) -> None:
    with pytest.raises(ModelCheckError) as refused:
        parse_expect({"float16/half": label})
    assert str(refused.value).startswith(
        f"expect 'float16/half': {label!r} is never a model check's label: "
    )
    assert "a model you check has none (a cell that raises is 'raises')" in str(refused.value)


def test_the_labels_offered_are_those_a_model_check_can_have() -> None:
    """Every outcome's label but the two a raised cell of a case gets by whether it
    reproduces its known failure."""
    assert set(model_check_outcomes()) == {outcome.value for outcome in Outcome}
    assert not {REPRODUCES, RAISES_OTHER} & set(model_check_outcomes())


@pytest.mark.parametrize(
    ("label", "line"),
    [
        ("rasies", "*expect 'bfloat16': 'rasies': no outcome 'rasies'; did you mean raises?*"),
        ("raises:repro", "*expect 'bfloat16': 'raises:repro' is never a model check's label*"),
    ],
)
def test_a_bad_label_is_one_error_at_collection(
    pytester: pytest.Pytester, label: str, line: str
) -> None:
    """Before, ``"rasies"`` collected and its cell, passing, said "it passes now: drop it
    from expect"; ``"raises:repro"`` never matched a raised cell, and said nothing of why."""
    pytester.makepyfile(
        test_bad=ONE_CELL_MODEL.replace(
            '("autocast",))', f'("autocast",), expect={{"bfloat16": {label!r}}})'
        )
    )
    result = pytester.runpytest_inprocess(*PLUGIN_ARGS, "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([line])
    assert "drop it from expect" not in result.stdout.str()


def test_each_flag_combination_reads_as_a_set() -> None:
    kinds = [kind.value for kind in FlagKind]
    for pair in itertools.permutations(kinds, 2):
        read = expected_outcome("k", f"inaccurate[{','.join(pair)}]")
        assert read.flags == frozenset(FlagKind(name) for name in pair)
