"""The report across stages: each fix's forward, train and fit outcomes side by side, the
train step's time and memory over the forward pass's, each fit's loss curve against the
float64 fit's, and a recommendation that passes at every stage that ran (a fix that passes
inference and fails training is named with why). Records are built here, written to a run
folder as a run writes them, and read back as the report reads them."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import pytest

from harness.report import aggregate, plots, stages
from harness.report.markdown import render_markdown
from harness.report.stages import fit_reason
from harness.report.writing import render_report
from harness.results import storage
from harness.schema.axes import Cell
from harness.schema.fit_rule import shortfall
from harness.schema.records import (
    CellRecord,
    FitFigures,
    Note,
    NoteKind,
    Numerics,
    Outcome,
    Perf,
)
from harness.schema.run_files import Environment
from tests.test_report import check_golden

CASE, ATTENTION = "pure-weights", "attention"
#: A fit of four steps whose float64 fit goes from 1.0 to 0.6.
REFERENCE = (1.0, 0.9, 0.8, 0.7, 0.6)


def perf(seconds: float, memory: int) -> Perf:
    return Perf(
        time_samples=[seconds] * 5,
        time_block=1,
        time_median_s=seconds,
        time_iqr_s=0.0,
        time_min_s=seconds,
        time_count=5,
        time_noisy=False,
        timer="perf_counter",
        threads=2,
        flops=None,
        gflops=None,
        peak_gflops=None,
        peak_fraction=None,
        peak_mem_bytes=memory,
        mem_method="tracemalloc",
    )


def numerics(error: float, tolerance: float = 1e-2, leaf: str | None = None) -> Numerics:
    return Numerics(error, error, None, tolerance, "10 x rounding", True, leaf, error / 10,
                    "rounding to bfloat16", 10.0)  # fmt: skip


def cell(case: str, fix: str, stage: str, dtype: str = "bfloat16", mode: str = "half") -> Cell:
    return Cell(case, fix, "cpu", dtype, mode, "eager", stage=stage)


def timed(case: str, fix: str, stage: str, seconds: float, memory: int, **kw: str) -> CellRecord:
    """A cell that passes, with its figures."""
    return CellRecord(
        cell(case, fix, stage, **kw), "2.13.0", Outcome.PASSES, out_dtypes=("bfloat16",),
        numerics=numerics(1e-3), perf=perf(seconds, memory),
    )  # fmt: skip


def fitted(fix: str, losses: tuple[float, ...], lost: float, scale: float | None = None,
           skipped: int = 0) -> CellRecord:  # fmt: skip
    """A fit cell judged as the harness judges one: inaccurate (with its note) when more
    than half its updates were lost or its loss fell more than half short."""
    short = max(0.0, (losses[-1] - REFERENCE[-1]) / (REFERENCE[0] - REFERENCE[-1]))
    figures = FitFigures(losses, REFERENCE, skipped, scale, lost, short)
    stalled = lost > 0.5 or short > 0.5
    worst = max(lost, short)
    return CellRecord(
        cell(CASE, fix, "fit"),
        "2.13.0",
        Outcome.INACCURATE if stalled else Outcome.PASSES,
        out_dtypes=("bfloat16",),
        numerics=Numerics(0.0, worst, None, 0.5, "fit", True, "updates lost"),
        notes=(Note(NoteKind.FIT, "the fit stalls"),) if stalled else (),
        fit=figures,
    )


def records() -> list[CellRecord]:
    """``pure-weights``: ``none`` passes inference and the train step, and its fit stalls
    (65% of its updates lost); ``master`` and ``kahan`` pass everywhere. ``attention``:
    ``upcast`` passes inference and its float16 train step is inaccurate; ``sdpa`` passes
    both. Train steps take 3x (none), 4x (master) and 2x (kahan) the forward's time."""
    ms, kib = 1e-3, 1024
    return [
        timed(CASE, "none", "forward", 1 * ms, 100 * kib),
        timed(CASE, "master", "forward", 1 * ms, 120 * kib),
        timed(CASE, "kahan", "forward", 2 * ms, 110 * kib),
        timed(CASE, "none", "train", 3 * ms, 200 * kib),
        timed(CASE, "master", "train", 4 * ms, 360 * kib),
        timed(CASE, "kahan", "train", 4 * ms, 220 * kib),
        fitted("none", (1.0, 0.97, 0.93, 0.9, 0.86), lost=0.65),
        fitted("master", (1.0, 0.9, 0.8, 0.72, 0.62), lost=0.0),
        fitted("kahan", (1.0, 0.9, 0.81, 0.72, 0.63), lost=0.01),
        *(
            timed(ATTENTION, fix, stage, 1 * ms, 100 * kib, dtype=dtype, mode="autocast")
            for fix in ("upcast", "sdpa")
            for stage in ("forward", "train")
            for dtype in ("float16", "bfloat16")
            if (fix, stage, dtype) != ("upcast", "train", "float16")
        ),
        CellRecord(
            cell(ATTENTION, "upcast", "train", "float16", "autocast"),
            "2.13.0",
            Outcome.INACCURATE,
            out_dtypes=("float16",),
            numerics=numerics(0.0116, 3.33e-3, "grad.qkv.bias"),
        ),
    ]


def stored_run(folder: Path, hostname: str = "host") -> Path:
    """``folder`` made a run of :func:`records` on torch 2.13.0 and ``hostname``."""
    storage.write_env(folder, Environment(torch_version="2.13.0", hostname=hostname))
    for record in records():
        storage.append_record(folder, record)
    return folder


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return stored_run(tmp_path_factory.mktemp("staged"))


@pytest.fixture(scope="module")
def frame(run: Path):
    return aggregate.records_frame(aggregate.load_runs([run]))


@pytest.fixture(scope="module")
def html(run: Path) -> str:
    return render_report(aggregate.load_runs([run]))


def test_a_fix_that_passes_inference_and_stalls_in_its_fit_is_named_with_why(frame) -> None:
    found = aggregate.recommend(frame, CASE)
    assert found.fix in ("master", "kahan")
    assert "at every stage (forward, train, fit)" in found.reason
    assert "A fix must pass at every stage that ran (forward, train, fit)" in found.criterion
    assert [f.describe() for f in found.stage_failures] == [
        "none: passes inference and the train step; bfloat16/half fit stalls: its loss ends "
        "at 0.86, 65% short of the float64 fit's progress (1 to 0.6), 65% of its updates "
        "lost to rounding"
    ]


def test_a_fits_reason_says_the_scale_its_verdict_used() -> None:
    """A fit that went far is judged by the float64 fit's last loss, and says so; a slow one
    by its progress (the case above)."""
    far = (6.02, 1.0, 0.0105)
    figures = FitFigures((6.02, 1.1, 0.0483), far, 0, None, 0.02, shortfall(0.0483, far))
    assert fit_reason(figures) == (
        "its loss ends at 0.0483, 4.6x the float64 fit's 0.0105, 2% of its updates lost to "
        "rounding"
    )


def test_a_fix_that_passes_inference_and_fails_its_train_step_is_not_recommended(frame) -> None:
    found = aggregate.recommend(frame, ATTENTION)
    assert found.fix == "sdpa"
    assert [f.describe() for f in found.stage_failures] == [
        "upcast: passes inference; float16/autocast train step is inaccurate: rel_err 0.0116 "
        "in grad.qkv.bias > tolerance 0.00333 (10 x rounding to bfloat16)"
    ]


def test_no_fix_that_fails_a_later_stage_is_recommended(frame) -> None:
    """Without ``sdpa``, ``upcast`` passes every forward cell and is still no candidate."""
    without = frame[frame["fix"] != "sdpa"]
    found = aggregate.recommend(without, ATTENTION)
    assert found.fix is None
    assert found.reason == "no fix passes at every stage and in every environment measured"
    assert [f.fix for f in found.stage_failures] == ["upcast"]


def test_each_fix_across_stages(frame) -> None:
    view = stages.side_by_side(frame[frame["case"] == CASE])
    assert view is not None and view.stages == ["forward", "train", "fit"]
    rows = {row["row"]: row for row in view.fixes}
    assert list(rows) == ["none", "kahan", "master"]  # none first, then by name
    forward, train, fit = rows["none"]["stages"]
    assert (forward.text, train.text, fit.text) == ("passes (1)", "passes (1)", "0/1 pass")
    assert fit.label == "inaccurate" and fit.misses == ("inaccurate: bfloat16/half",)
    assert [rows[f]["time_ratio"] for f in rows] == ["3.00x", "2.00x", "4.00x"]
    assert [rows[f]["memory_ratio"] for f in rows] == ["2.00x", "2.00x", "3.00x"]
    # the train step against the fastest fix's train step (none's, at 3 ms)
    assert [rows[f]["train_vs_fastest"] for f in rows] == ["1.00x", "1.33x", "1.33x"]
    assert view.across == (
        "Across fixes, the train step takes 2.00x (kahan) to 4.00x (master) the forward "
        "pass's time and 2.00x (kahan) to 3.00x (master) the forward pass's peak memory."
    )


def test_fit_figures_per_column(frame) -> None:
    view = stages.side_by_side(frame[frame["case"] == CASE])
    assert view is not None
    rows = {row["row"]: row for row in view.columns}
    fit = rows["none"]["fit"]
    assert fit.label == "inaccurate" and fit.losses == "1 \u2192 0.86 (float64 1 \u2192 0.6)"
    assert (fit.skipped, fit.final_scale, fit.lost, fit.shortfall) == ("0 of 4", "-", "65%", "65%")
    assert rows["master"]["fit"].shortfall == "5%" and rows["kahan"]["fit"].lost == "1%"


def test_the_html_shows_stages_side_by_side_with_loss_curves(html: str) -> None:
    assert html.count("<h3>Each fix across stages</h3>") == 2
    assert html.count('<svg class="spark"') == 3  # one loss curve per fit column
    assert html.count("stroke-dasharray") == 3  # each beside the float64 fit's
    assert re.search(r'<td class="stage inaccurate">0/1 pass<br><span class="note">'
                     r"inaccurate: bfloat16/half</span></td>", html)  # fmt: skip
    assert "Not recommended: <strong>none</strong>: passes inference and the train step; " in html
    assert "65% of its updates lost to rounding" in html
    assert "Across fixes, the train step takes 2.00x (kahan) to 4.00x (master)" in html


def test_a_fix_reads_across_its_stages_in_the_summary_matrix(frame) -> None:
    rows = [row for case, row in aggregate.summary_matrix(frame).index if case == CASE]
    assert rows == ["none", "none · train", "none · fit", "kahan", "kahan · train",
                    "kahan · fit", "master", "master · train", "master · fit"]  # fmt: skip


def test_stages_golden(frame, run: Path) -> None:
    """The recommendations, the side-by-side rows and the Markdown summary of the staged
    run, as text (AMPMATRIX_UPDATE_GOLDEN=1 rewrites them)."""
    lines = []
    for case in (ATTENTION, CASE):
        found = aggregate.recommend(frame, case)
        lines += [f"{case}: {found.fix}: {found.reason}", f"  criterion: {found.criterion}"]
        lines += [f"  not recommended: {f.describe()}" for f in found.stage_failures]
        view = stages.side_by_side(frame[frame["case"] == case])
        assert view is not None
        for row in view.fixes:
            outcomes = " | ".join(o.text if o else "not run" for o in row["stages"])
            lines.append(f"  {row['row']}: {outcomes} | time {row['time_ratio']} | "
                         f"memory {row['memory_ratio']}")  # fmt: skip
    check_golden("stages.txt", "\n".join(lines) + "\n")
    check_golden("summary_stages.md", render_markdown(aggregate.load_runs([run])))


def test_a_loss_curve_is_an_svg_of_numbers() -> None:
    curve = plots.loss_sparkline((1.0, 0.9, float("nan")), (1.0, 0.8, 0.6), passes=False)
    assert curve.startswith('<svg class="spark"') and curve.endswith("</svg>")
    assert "#7b1fa2" in curve and 'stroke="#c00"' in curve  # stalled; not finite from step 2
    assert "to not finite; float64 fit (dashed): 1 to 0.6" in curve
    assert plots.loss_sparkline((), REFERENCE, passes=True) == ""
    flat = plots.loss_sparkline((1.0, 1.0), (1.0, 1.0), passes=True)
    assert 'points="2.0,17.0 138.0,17.0"' in flat


def test_across_fixes_compares_the_columns_every_fix_has() -> None:
    """``none`` alone has the fp32 control's column: it is left out of the comparison."""
    time = {("none", "bfloat16", "half", "e"): 2.0, ("none", "float32", "fp32", "e"): 9.0,
            ("sdpa", "bfloat16", "half", "e"): 3.0}  # fmt: skip
    memory = {("none", "bfloat16", "half", "e"): 1.5, ("sdpa", "bfloat16", "half", "e"): 1.5}
    costed = stages.Costed("train", "forward")
    assert stages.across_fixes(time, memory, costed) == (
        "Across fixes, the train step takes 2.00x (none) to 3.00x (sdpa) the forward pass's "
        "time and 1.50x (every fix) the forward pass's peak memory."
    )
    assert stages.across_fixes({}, {}, costed) is None
    assert stages.across_fixes(time, memory, None) is None


@pytest.mark.parametrize(
    ("outcome", "label", "verb"),
    [
        ("raises", "raises:repro[drift]", "raises"),
        ("inaccurate", "inaccurate[not-half]", "is inaccurate"),
        ("timeout", "timeout", "timed out"),
        ("passes", "passes[drift]", "is passes[drift]"),
    ],
)
def test_a_miss_is_worded_by_its_outcome_not_its_label(
    outcome: str, label: str, verb: str
) -> None:
    miss = stages.StageMiss("train", "bfloat16/half", label, outcome, "")
    assert miss.describe() == f"bfloat16/half train step {verb}"


def test_a_stage_outcome_ranks_labels_by_their_base_label() -> None:
    Row = collections.namedtuple("Row", "dtype mode label base_label")
    rows = [
        Row("float16", "half", "passes[drift]", "passes"),
        Row("bfloat16", "half", "raises:repro[drift]", "raises:repro"),
        Row("float32", "fp32", "passes", "passes"),
    ]
    outcome = stages.stage_outcome(rows)
    assert outcome.label == "raises:repro[drift]" and outcome.passed == 1
    assert outcome.misses[0].startswith("raises:repro[drift]: bfloat16/half")
