"""A case's known failure is raised, silent, or both, and a cell reproduces it either way:
the record's ``reproduces`` is decided once (``judging.reproduces``) and the version view,
the nightly and the bisect read it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from harness.measure.authoring.case import Case, FailureSignature, Symptom
from harness.measure.authoring.registry import contract_problems
from harness.measure.judge.judging import reproduces, symptoms_shown
from harness.report import aggregate
from harness.report.markdown import render_markdown
from harness.report.nightly import reproduces_its_known_failure
from harness.results import storage
from harness.results.search import reproduction_label
from harness.results.versions import render_bisect
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, Flag, FlagKind, Numerics, Outcome
from tests.conftest import harness, only_run_dir

RAISED = FailureSignature("RuntimeError", r"mat1 and mat2 must have the same dtype")
NON_FINITE = FailureSignature(silent=(Symptom.NON_FINITE,))
BEYOND = FailureSignature(silent=(Symptom.BEYOND_YARDSTICK,))
WIDER = FailureSignature(silent=(Symptom.WIDER_DTYPE,))


def case_with(failure: FailureSignature | None, known: bool = True) -> Case:
    """An unregistered case declaring ``failure`` (``known`` False: a model you check)."""
    kind = type("Declared", (Case,), {"failure": failure, "has_known_failure": known})
    return kind()


def numerics(finite: bool = True, rel_err: float = 1e-4) -> Numerics:
    return Numerics(
        max_abs_err=rel_err,
        rel_err=rel_err,
        baseline_rel_err=None,
        tolerance=1e-3,
        tolerance_rule="rel_err <= max(10 * rounding_rel_err, eps(float16))",
        finite=finite,
    )


def record(
    outcome: Outcome,
    finite: bool | None = True,
    drift: bool = False,
    error: tuple[str, str] | None = None,
    version: str = "2.13.0+cpu",
    reproduced: bool | None = None,
) -> CellRecord:
    """A ``none`` cell in float16 ``half`` with the given verdict and evidence."""
    flags = (Flag(FlagKind.DRIFT, "matmul computed in float32", 1.0),) if drift else ()
    error_type, message = error or (None, None)
    return CellRecord(
        Cell("c", "none", "cpu", "float16", "half", "eager"),
        version,
        outcome,
        reproduces=reproduced,
        numerics=None if finite is None else numerics(finite, 1e-4 if finite else float("nan")),
        flags=flags,
        error_type=error_type,
        error_message=message,
    )


def test_a_known_failure_is_still_declared_by_its_error_type_and_message() -> None:
    assert RAISED.raised and RAISED.silent == ()
    assert RAISED.matches("RuntimeError", "mat1 and mat2 must have the same dtype, but got")
    assert not RAISED.matches("ValueError", "mat1 and mat2 must have the same dtype")
    assert not NON_FINITE.raised and not NON_FINITE.matches("RuntimeError", "")


def test_symptoms_are_given_as_the_enum_or_its_value_and_nothing_else() -> None:
    assert FailureSignature(silent=("non-finite",)).silent == (Symptom.NON_FINITE,)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        FailureSignature(silent=("nan",))  # type: ignore[arg-type]


def test_a_declaration_that_says_nothing_is_a_broken_contract() -> None:
    assert FailureSignature().problems() != []
    assert FailureSignature(error_type="RuntimeError").problems() != []
    assert FailureSignature("RuntimeError", "(unclosed").problems() != []
    assert RAISED.problems() == [] and NON_FINITE.problems() == []
    problems = contract_problems(case_with(FailureSignature()))
    assert any(p.startswith("failure: declares neither") for p in problems)


def test_a_silent_non_finite_failure_reproduces_on_an_inaccurate_non_finite_cell() -> None:
    case = case_with(NON_FINITE)
    assert reproduces(case, record(Outcome.INACCURATE, finite=False)) is True
    assert reproduces(case, record(Outcome.PASSES)) is False
    assert reproduces(case, record(Outcome.INACCURATE, finite=True)) is False


def test_beyond_the_yardstick_is_a_finite_inaccurate_cell_only() -> None:
    case = case_with(BEYOND)
    assert reproduces(case, record(Outcome.INACCURATE, finite=True)) is True
    assert reproduces(case, record(Outcome.PASSES, finite=True)) is False
    assert reproduces(case, record(Outcome.INACCURATE, finite=False)) is False
    # an output that cannot be compared (misshapen) has no figures to say it
    assert reproduces(case, record(Outcome.INACCURATE, finite=None)) is False


def test_a_wider_dtype_is_the_drift_flag_whatever_the_verdict() -> None:
    case = case_with(WIDER)
    assert reproduces(case, record(Outcome.PASSES, drift=True)) is True
    assert reproduces(case, record(Outcome.INACCURATE, finite=False, drift=True)) is True
    assert reproduces(case, record(Outcome.PASSES)) is False
    assert symptoms_shown(record(Outcome.PASSES, drift=True)) == {Symptom.WIDER_DTYPE}


def test_a_raised_signature_does_not_count_a_silent_inaccurate_cell() -> None:
    case = case_with(RAISED)
    assert reproduces(case, record(Outcome.INACCURATE, finite=False)) is False
    known = ("RuntimeError", "mat1 and mat2 must have the same dtype, but got Half")
    assert reproduces(case, record(Outcome.RAISES, None, error=known)) is True
    other = ("RuntimeError", "CUDA out of memory")
    assert reproduces(case, record(Outcome.RAISES, None, error=other)) is False


def test_a_failure_both_raised_and_silent_reproduces_either_way() -> None:
    both = FailureSignature(RAISED.error_type, RAISED.message, silent=(Symptom.NON_FINITE,))
    case = case_with(both)
    known = ("RuntimeError", "mat1 and mat2 must have the same dtype")
    assert reproduces(case, record(Outcome.RAISES, None, error=known)) is True
    assert reproduces(case, record(Outcome.INACCURATE, finite=False)) is True
    assert reproduces(case, record(Outcome.PASSES)) is False


def test_a_derived_error_class_matches_its_base_by_the_raised_error() -> None:
    class TorchRuntimeError(RuntimeError):
        pass

    raised = record(
        Outcome.RAISES, None, error=("TorchRuntimeError", "mat1 and mat2 must have the same dtype")
    )
    assert reproduces(case_with(RAISED), raised) is False  # the name alone is not RuntimeError
    assert reproduces(case_with(RAISED), raised, TorchRuntimeError("x")) is True


def test_no_known_failure_or_no_verdict_leaves_reproduces_unknown() -> None:
    model = case_with(None, known=False)
    assert reproduces(model, record(Outcome.INACCURATE, finite=False)) is None
    assert reproduces(model, record(Outcome.RAISES, None, error=("RuntimeError", "x"))) is None
    case = case_with(NON_FINITE)
    for outcome in (Outcome.SKIPPED, Outcome.CRASHED, Outcome.TIMEOUT):
        assert reproduces(case, record(outcome, None)) is None


def test_the_nightly_expects_a_silent_reproduction() -> None:
    assert reproduces_its_known_failure(record(Outcome.INACCURATE, False, reproduced=True))
    assert not reproduces_its_known_failure(record(Outcome.INACCURATE, False, reproduced=None))


def upstream_frame(reproduced: list[bool | None]) -> pd.DataFrame:
    """Fix ``none`` cells of case ``c`` on torch 2.13.0, inaccurate (non-finite) where
    ``reproduced`` is True, passing where False."""
    return pd.DataFrame(
        {
            "case": "c",
            "fix": "none",
            "torch_version": "2.13.0+cpu",
            "outcome": ["inaccurate" if r else "passes" for r in reproduced],
            "reproduces": reproduced,
            "dtype": ["float16", "bfloat16", "float32"][: len(reproduced)],
            "mode": ["half", "half", "fp32"][: len(reproduced)],
        }
    )


def test_the_version_view_says_a_silent_failure_reproduces() -> None:
    view = aggregate.version_view(upstream_frame([True, False, False]))
    assert view.loc["c", "2.13.0+cpu"] == "reproduces (float16/half); 1 of 3 cells"
    unknown = aggregate.version_view(upstream_frame([None, None]))
    assert unknown.loc["c", "2.13.0+cpu"] == "does not reproduce"


def test_the_bisect_finds_the_release_where_a_silent_failure_stops() -> None:
    failing = record(Outcome.INACCURATE, False, version="2.4.1+cpu", reproduced=True)
    fixed = record(Outcome.PASSES, version="2.13.0+cpu", reproduced=False)
    assert reproduction_label(failing) == "inaccurate:repro"
    assert reproduction_label(fixed) == "passes"
    drifted = record(Outcome.PASSES, drift=True, reproduced=True)
    assert reproduction_label(drifted) == "passes:repro[drift]"
    text = render_bisect([failing, fixed])
    assert "inaccurate:repro on torch 2.4.1+cpu -> passes on torch 2.13.0+cpu" in text
    # a record that says nothing of its reproduction (a stored run's) keeps its label
    unsaid = replace(failing, reproduces=None)
    assert reproduction_label(unsaid) == "inaccurate"


def test_an_overflowing_attention_reproduces_end_to_end(tmp_path: Path) -> None:
    result = harness(
        "run",
        *("--case", "fp16-attn-overflow", "--fix", "none", "--dtype", "float16"),
        *("--mode", "half", "--device", "cpu", "--no-timing", "-n", "0"),
        *("--out", str(tmp_path)),
    )
    assert result.returncode == 0, result.stderr
    run_dir = only_run_dir(tmp_path)
    (cell,) = [r for r in storage.read_records(run_dir) if r.outcome is not Outcome.SKIPPED]
    assert cell.outcome is Outcome.INACCURATE and cell.numerics is not None
    assert not cell.numerics.finite and cell.reproduces is True
    markdown = render_markdown([aggregate.load_run(run_dir)])
    assert "| fp16-attn-overflow | reproduces (float16/half); 1 of 1 cells |" in markdown
