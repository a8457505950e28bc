"""``nox -s gpu-acceptance`` (``benchmarks/gpu_acceptance.py``) on the CPU: the session with
fake commands and fake figures (the Markdown, PASS/MISS, exit statuses, skip reasons, time
limits), the figures each step reads from records, the CUDA-start hook, and the refusal of a
machine without CUDA, as a user meets it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from harness.schema.axes import Cell
from harness.schema.records import CellRecord, Note, NoteKind, Outcome, Perf
from harness.schema.trail_records import Promotion, Site, Trail

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_acceptance.py"
H100 = {"device": "cuda:0", "name": "NVIDIA H100 80GB HBM3", "capability": "9.0"}
ENVIRONMENT = {
    "torch": "2.11.0+cu130",
    "cuda": "13.0",
    "cuda_available": True,
    "gpus": [{**H100, "memory_gib": 79.2}],
    "cpu_count": 16,
    "python": "3.12.3",
    "packages": {"triton": "3.6.0"},
}


def load_acceptance() -> ModuleType:
    """The script, loaded by its path (``benchmarks/`` is not a package)."""
    spec = importlib.util.spec_from_file_location("gpu_acceptance", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_acceptance"] = module
    spec.loader.exec_module(module)
    return module


ga = load_acceptance()


class FakeRunner:
    """Records each command; the environment probe writes ``environment`` as its JSON."""

    def __init__(self, environment: Mapping[str, Any] = ENVIRONMENT) -> None:
        self.environment = environment
        self.commands: list[list[str]] = []

    def __call__(
        self, argv: Sequence[str], timeout_s: float, log: Path, env: Mapping[str, str], cwd: Path
    ) -> int:
        self.commands.append(list(argv))
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("fake\n")
        if "environment" in argv:
            Path(argv[argv.index("--json") + 1]).write_text(json.dumps(self.environment))
            return 0
        return 1


def figure_step(name: str, *figures: Any) -> Any:
    """A step whose function returns ``figures`` (or raises the one exception given)."""

    def function(ctx: Any) -> list[Any]:
        if figures and isinstance(figures[0], BaseException):
            raise figures[0]
        return [
            ga.Figure(name, f"{name} figure", value, "target", verdict)
            for value, verdict in figures
        ]

    return ga.Step(name, f"what {name} shows", 60, function)


def run_session(tmp_path: Path, steps: Sequence[Any], runner: Any = None, **kw: Any) -> int:
    return ga.session(
        ga.Options(out=tmp_path / "out"),
        runner=runner or FakeRunner(),
        steps=steps,
        importable=kw.pop("importable", lambda name: True),
        **kw,
    )


# --- the session ---


def test_fake_figures_become_one_markdown_with_pass_miss_and_skips(tmp_path, capsys) -> None:
    steps = [
        figure_step("fast", ("1.2x", ga.Verdict.PASS)),
        figure_step("slow", ("5.5x", ga.Verdict.MISS)),
        figure_step("flash", ga.Skipped("flash-attn 4 needs sm90+ (cuda:0 is sm80)")),
    ]
    assert run_session(tmp_path, steps) == ga.EXIT_MISS
    text = (tmp_path / "out" / ga.REPORT_FILE).read_text()
    assert text.startswith("# GPU acceptance: torch 2.11.0 · H100 80GB HBM3 (sm90)\n")
    assert "- `cuda:0`: torch 2.11.0 · H100 80GB HBM3 (sm90), 79.2 GiB" in text
    assert "**MISS**: 1 targets met, 1 missed." in text
    assert "| fast | fast figure | 1.2x | target | PASS |" in text
    assert "| slow | slow figure | 5.5x | target | MISS |" in text
    assert "## Skipped\n\n- flash: flash-attn 4 needs sm90+ (cuda\\:0 is sm80)" in text
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("gpu-acceptance: MISS: 1 missed (slow: slow figure)")


def test_every_target_met_exits_zero_and_a_skip_is_not_a_miss(tmp_path, capsys) -> None:
    steps = [figure_step("fast", ("1.2x", ga.Verdict.PASS)), figure_step("x", ga.Skipped("why"))]
    assert run_session(tmp_path, steps) == ga.EXIT_PASS
    assert (
        capsys.readouterr()
        .out.strip()
        .splitlines()[-1]
        .startswith("gpu-acceptance: PASS: 1 targets met, 1 skipped")
    )


def test_a_failing_step_is_a_miss_with_its_reason_and_the_next_step_runs(tmp_path) -> None:
    steps = [
        figure_step("broken", ValueError("no records")),
        figure_step("next", ("ok", ga.Verdict.PASS)),
    ]
    assert run_session(tmp_path, steps) == ga.EXIT_MISS
    text = (tmp_path / "out" / ga.REPORT_FILE).read_text()
    assert "| broken | failed | ValueError\\: no records | runs | MISS |" in text
    assert "| next | next figure | ok | target | PASS |" in text


def test_a_step_asked_to_be_skipped_says_so(tmp_path) -> None:
    options = ga.Options(out=tmp_path / "out", skip=frozenset({"fast"}))
    code = ga.session(
        options,
        runner=FakeRunner(),
        steps=[figure_step("fast", ga.Skipped("x"))],
        importable=lambda name: True,
    )
    assert code == ga.EXIT_PASS
    assert "- fast: not asked for (--skip)" in (tmp_path / "out" / ga.REPORT_FILE).read_text()


def test_a_command_past_its_step_limit_is_killed_and_the_step_missed(tmp_path) -> None:
    def sleeper(ctx: Any) -> list[Any]:
        ctx.run("sleep", [sys.executable, "-c", "import time; time.sleep(60)"])
        return []

    ctx = ga.Context(ga.Options(out=tmp_path), dict(ENVIRONMENT))
    started = time.monotonic()
    [run] = ga.run_steps([ga.Step("sleepy", "sleeps", 1.0, sleeper)], ctx)
    assert time.monotonic() - started < 20
    [figure] = run.figures
    assert figure.verdict == ga.Verdict.MISS and figure.name == "time limit"
    assert figure.value.startswith("ran past its limit of 1 s")


def test_a_step_that_returns_after_its_limit_is_missed(tmp_path) -> None:
    clock = iter([0.0, 500.0]).__next__
    ctx = ga.Context(ga.Options(out=tmp_path), dict(ENVIRONMENT), clock=clock)
    step = figure_step("slow", ("done", ga.Verdict.PASS))
    [run] = ga.run_steps([ga.Step("slow", "", 60, step.function)], ctx)
    assert [f.verdict for f in run.figures] == [ga.Verdict.PASS, ga.Verdict.MISS]
    assert run.figures[-1].value == "ran past its limit of 60 s (500 s)"


def test_the_markdown_is_written_after_each_step(tmp_path) -> None:
    seen: list[str] = []

    def peek(ctx: Any) -> list[Any]:
        seen.append((tmp_path / "out" / ga.REPORT_FILE).read_text())
        return []

    steps = [figure_step("first", ("done", ga.Verdict.PASS)), ga.Step("second", "", 60, peek)]
    run_session(tmp_path, steps)
    assert "| first | first figure | done | target | PASS |" in seen[0]


def test_no_cuda_refuses_in_one_line_before_any_step(tmp_path, capsys) -> None:
    def never(ctx: Any) -> list[Any]:
        raise AssertionError("a step ran on a machine without CUDA")

    runner = FakeRunner({"torch": "2.13.0+cpu", "cuda": None, "cuda_available": False, "gpus": []})
    assert run_session(tmp_path, [ga.Step("x", "", 60, never)], runner) == ga.EXIT_CANNOT
    out = capsys.readouterr().out
    assert out == (
        "gpu-acceptance: no CUDA device visible (torch 2.13.0+cpu, built with no CUDA): "
        "nothing to accept on this machine\n"
    )
    assert not (tmp_path / "out").exists()


def test_a_missing_package_refuses_without_running_or_installing_anything(
    tmp_path, capsys
) -> None:
    runner = FakeRunner()
    code = run_session(tmp_path, ga.STEPS, runner, importable=lambda name: name != "xdist")
    assert code == ga.EXIT_CANNOT and runner.commands == []
    assert capsys.readouterr().out.startswith("gpu-acceptance: xdist not importable by ")


def test_the_steps_install_nothing_and_use_this_interpreter(tmp_path) -> None:
    runner = FakeRunner()
    run_session(tmp_path, ga.STEPS, runner)
    assert len(runner.commands) >= len(ga.STEPS)
    for argv in runner.commands:
        assert argv[0] == sys.executable
        assert not {"pip", "install", "uv", "--install-only"} & set(argv), argv


def test_an_optional_package_missing_skips_its_step_with_the_reason(tmp_path) -> None:
    ctx = ga.Context(ga.Options(out=tmp_path), dict(ENVIRONMENT), runner=FakeRunner())
    ctx.importable = lambda name: name not in ("triton", "timm")
    figures = {r.step.name: r.figures for r in ga.run_steps(ga.STEPS[2:4], ctx)}
    assert figures["do-bench"][0].value == "triton is not importable here (do_bench is triton's)"
    assert figures["check-vs-plain"][0].value == (
        "timm not importable here (the GPU models need them)"
    )


# --- figures from records ---


def cell(**fields: Any) -> Cell:
    base = {
        "case": ga.VAR, "fix": "none", "device": "cuda:0", "dtype": "bfloat16",
        "mode": "autocast", "backend": "flash-attn", "size": "upstream",
    }  # fmt: skip
    return Cell(**{**base, **fields})


def perf(seconds: float) -> Perf:
    return Perf([seconds], 1, seconds, 0.0, seconds, 1, False, "cuda-events", 1, None, None,
                None, None, 0, "allocator")  # fmt: skip


REAL_NOTE = Note(NoteKind.BACKEND, "flash-attn: the real kernel, flash-attn-4 4.0.0b36")
PROMOTION = Promotion(Site("aten::mul", "VarSelfAttention"), "float32", "parameter scale_mul")
FAILURE = Site("self.flash_attn_func", "VarSelfAttention", None, ("float32", "bfloat16"))


def record(c: Cell, outcome: Outcome, **fields: Any) -> CellRecord:
    return CellRecord(cell=c, torch_version="2.11.0", outcome=outcome, **fields)


def var_on_flash(none_outcome: Outcome = Outcome.RAISES) -> list[CellRecord]:
    """VAR's cells as the real kernel gives them: ``none`` refuses where float32 enters q
    (autocast), runs where nothing enters (half); the fix passes, on both backends."""
    repro = {"reproduces": True, "error_type": "AssertionError",
             "error_message": "q, k, v, and qv must have the same dtype"}  # fmt: skip
    failing = repro if none_outcome == Outcome.RAISES else {}
    return [
        record(cell(), none_outcome, notes=(REAL_NOTE,),
               trail=Trail(promotion=PROMOTION, failure_site=FAILURE), **failing),
        record(cell(mode="half"), Outcome.PASSES, notes=(REAL_NOTE,)),
        record(cell(fix="fix", mode="half"), Outcome.PASSES, notes=(REAL_NOTE,),
               perf=perf(1e-3), trail=Trail(compute_dtypes={"attention": ("bfloat16",)})),
        record(cell(fix="fix", mode="half", backend="sdpa"), Outcome.PASSES, perf=perf(4e-3)),
    ]  # fmt: skip


def by_name(figures: Sequence[Any]) -> dict[str, Any]:
    return {f.name: f for f in figures}


def test_var_on_the_real_kernel_passes_every_target() -> None:
    figures = by_name(ga.flash_figures("flash-attn", var_on_flash()))
    assert {name: f.verdict for name, f in figures.items()} == {
        "cuda:0 kernel": ga.Verdict.PASS,
        "cuda:0 none raises:repro": ga.Verdict.PASS,
        "cuda:0 fixes pass": ga.Verdict.PASS,
        "cuda:0 dtype trail at the kernel call": ga.Verdict.PASS,
        "cuda:0 fix time beside SDPA": ga.Verdict.INFO,
    }
    assert figures["cuda:0 none raises:repro"].value.startswith(
        "1 of the 1 cells where float32 enters q (1 where none enters); AssertionError: q, k"
    )
    assert figures["cuda:0 fix time beside SDPA"].value == (
        "flash-attn 1.000 ms, SDPA 4.000 ms (0.25x; median of 1 cells)"
    )
    trail = figures["cuda:0 dtype trail at the kernel call"].value
    assert "fails at self.flash_attn_func [float32, bfloat16]" in trail
    assert "fix: attention [bfloat16]" in trail


def test_a_float32_query_the_kernel_accepts_is_a_miss() -> None:
    figures = by_name(ga.flash_figures("flash-attn", var_on_flash(Outcome.PASSES)))
    assert figures["cuda:0 none raises:repro"].verdict == ga.Verdict.MISS


def test_the_contract_stand_in_is_not_the_real_kernel() -> None:
    records = [
        r.noted() if r.cell.backend == "sdpa" else
        record(r.cell, r.outcome, reproduces=r.reproduces, trail=r.trail,
               notes=(Note(NoteKind.BACKEND, "flash-attn-contract: not the real kernel"),))
        for r in var_on_flash()
    ]  # fmt: skip
    assert by_name(ga.flash_figures("f", records))["cuda:0 kernel"].verdict == ga.Verdict.MISS


def test_flash_cells_all_skipped_skip_the_step_with_the_runs_reason() -> None:
    reason = "neither flash-attn 2 (flash_attn) nor flash-attn 4 (flash_attn.cute) is installed"
    skipped = [record(cell(), Outcome.SKIPPED, skip_reason=reason)]
    with pytest.raises(ga.Skipped, match=r"neither flash-attn 2 \(flash_attn\)"):
        ga.flash_figures("flash-attn", skipped)
    with pytest.raises(ga.Skipped, match="the matrix ran no var-normalize-promotion cell"):
        ga.flash_figures("flash-attn", [])


def test_matrix_figures_name_crashed_cells_and_a_size_that_did_not_run() -> None:
    crash = {"error_type": "RuntimeError", "error_message": "Cannot re-initialize CUDA in forked"}
    records = [
        record(cell(size="small"), Outcome.PASSES, perf=perf(1e-3)),
        record(cell(size="upstream", fix="fix"), Outcome.CRASHED, **crash),
        record(cell(size="upstream"), Outcome.SKIPPED),
    ]
    figures = by_name(ga.matrix_figures("matrix", records, ["cuda:0"], ("small", "upstream")))
    cells = figures["cuda:0 cells"]
    assert cells.verdict == ga.Verdict.MISS
    assert cells.value == (
        "3 cells (1 at small, 2 at upstream): 1 passes, 1 crashed, 1 skipped; none ran at upstream"
    )
    broken = figures["cuda:0 crashed, timed out or untimed"]
    assert broken.verdict == ga.Verdict.MISS
    assert broken.value == (
        f"1: {records[1].cell.id}; RuntimeError: Cannot re-initialize CUDA in forked"
    )
    assert figures["cuda:0 cells timed"].value == "1 of 3"


def test_a_lost_timing_is_a_miss_and_a_clean_matrix_passes() -> None:
    good = [record(cell(size=s), Outcome.PASSES, perf=perf(1e-3)) for s in ("small", "upstream")]
    figures = ga.matrix_figures("m", good, ["cuda:0"], ("small", "upstream"))
    assert {f.verdict for f in figures} == {ga.Verdict.PASS, ga.Verdict.INFO}
    untimed = [*good, record(cell(fix="x"), Outcome.PASSES, timing_error="RuntimeError: boom")]
    broken = by_name(ga.matrix_figures("m", untimed, ["cuda:0"], ()))
    assert broken["cuda:0 crashed, timed out or untimed"].value.endswith(
        "timing: RuntimeError: boom"
    )


def test_stage_figures_per_gpu_and_stage() -> None:
    records = [
        record(cell(stage="train", backend="sdpa"), Outcome.PASSES),
        record(cell(stage="fit", backend="sdpa"), Outcome.SKIPPED),
    ]
    figures = by_name(ga.stage_figures("stages", records, ["cuda:0", "cuda:1"]))
    assert figures["cuda:0 train cells"].verdict == ga.Verdict.PASS
    assert figures["cuda:0 fit cells"].verdict == ga.Verdict.MISS
    assert figures["cuda:1 train cells"].value == "no selected case has this stage"


def bench_row(call: str, wall: float, device: float, bench: float) -> dict[str, Any]:
    return {"call": call, "wall": wall, "device": device, "do_bench": bench, "utils": wall}


def test_do_bench_differing_is_a_miss_unless_launch_bound() -> None:
    rows = [
        bench_row("tiny", 16e-6, 4.4e-6, 12.9e-6),  # launch-bound: judged by device time
        bench_row("large", 490e-6, 482e-6, 478e-6),  # agrees within 5%
        bench_row("medium", 43.5e-6, 41.8e-6, 46.5e-6),  # differs by 6.5%, not launch-bound
    ]
    figures = by_name(ga.do_bench_figures("do-bench", rows, 0.05))
    assert figures["tiny"].verdict == ga.Verdict.PASS
    assert "(launch-bound)" in figures["tiny"].value and figures["tiny"].value.endswith("0.341x")
    assert figures["large"].verdict == ga.Verdict.PASS
    assert figures["medium"].verdict == ga.Verdict.MISS
    assert figures["calls measured"].verdict == ga.Verdict.PASS


def test_do_bench_needs_three_measured_calls() -> None:
    rows = [bench_row("a", 1e-3, 1e-3, 1e-3), bench_row("b", 1e-3, float("nan"), 1e-3)]
    figures = by_name(ga.do_bench_figures("do-bench", rows, 0.05))
    assert figures["b"].verdict == ga.Verdict.MISS
    assert figures["calls measured"].value == "1"
    assert figures["calls measured"].verdict == ga.Verdict.MISS


def test_check_against_the_plain_script_and_its_cells() -> None:
    got = {"models": ["a"] * 14, "rounds": 3, "check_s": 41.0, "plain_s": 20.0, "target": 2.0,
           "outcomes": {"passes": 60, "crashed": 10}}  # fmt: skip
    speed, cells = ga.check_figures("check", got)
    assert speed.verdict == ga.Verdict.MISS
    assert speed.value == (
        "check 41.00 s, plain script 20.00 s: 2.05x (14 models, median of 3 rounds)"
    )
    assert cells.verdict == ga.Verdict.MISS and cells.value == "10 crashed, 60 passes"
    speed, cells = ga.check_figures("check", {**got, "check_s": 30.0, "outcomes": {"passes": 70}})
    assert (speed.verdict, cells.verdict) == (ga.Verdict.PASS, ga.Verdict.PASS)


def test_two_cuda_starts_a_batch_are_a_miss_with_their_cost() -> None:
    log = "".join(f"{pid} 1 0.31\n" for pid in range(6)) + "99 0 0.0003\n"
    per_batch, cost = ga.cuda_start_figures("starts", log, 3, 0.5, 6.4)
    assert per_batch.verdict == ga.Verdict.MISS
    assert per_batch.value.startswith("2 (6 in forked processes for 3 models of one batch each; 1")
    assert cost.value == "0.50 s a batch (0.50 s a start): 8% of check's 6.40 s a model"
    once = "".join(f"{pid} 1 0.31\n" for pid in range(3))
    assert ga.cuda_start_figures("starts", once, 3, 0.5, None)[0].verdict == ga.Verdict.PASS
    with pytest.raises(ga.CommandFailed, match="no CUDA start was counted"):
        ga.cuda_start_figures("starts", "", 3, 0.5, None)


def test_the_start_hook_counts_starts_in_forked_processes(tmp_path) -> None:
    """The hook around a stand-in for torch's ``_cuda_init`` (a CPU build has none):
    one start in the interpreter and one in a process forked from it, each one line."""
    hook = tmp_path / "hook.py"
    hook.write_text(ga.START_HOOK)
    log = tmp_path / "starts.log"
    program = textwrap.dedent(
        f"""
        import os, torch
        torch._C._cuda_init = lambda: None
        exec(open({str(hook)!r}).read())
        pid = os.fork()
        if pid == 0:
            torch._C._cuda_init()
            os._exit(0)
        os.waitpid(pid, 0)
        torch._C._cuda_init()
        """
    )
    env = {**os.environ, "AMPMATRIX_CUDA_START_LOG": str(log)}
    subprocess.run([sys.executable, "-c", program], env=env, check=True, timeout=120)
    lines = [line.split() for line in log.read_text().splitlines()]
    assert sorted(forked for _, forked, _ in lines) == ["0", "1"]
    assert len({pid for pid, _, _ in lines}) == 2


def test_the_counted_check_has_three_models_of_one_block() -> None:
    namespace: dict[str, Any] = {}
    exec(ga.block_source(), namespace)
    for name in ga.START_MODELS:
        model, inputs = namespace[name]()
        assert model(**inputs).shape == inputs["x"].shape


def test_junit_figures_fail_on_a_failure_and_group_skip_reasons(tmp_path) -> None:
    junit = tmp_path / "tests.xml"
    junit.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_ok"/>'
        '<testcase classname="tests.test_a" name="test_bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_b" name="t1"><skipped message="nox is not installed"/>'
        "</testcase>"
        '<testcase classname="tests.test_b" name="t2"><skipped message="nox is not installed"/>'
        "</testcase>"
        '<testcase classname="tests.test_b" name="t3"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    figures = by_name(ga.test_figures("tests", junit, 1, installed=False))
    assert figures["tests"].verdict == ga.Verdict.MISS
    assert figures["tests"].value == (
        "1 passed, 1 failed, 3 skipped; pytest exited 1; ampmatrix not installed "
        "(PYTHONPATH=.); failed: tests.test_a::test_bad"
    )
    assert figures["skips without a reason"].verdict == ga.Verdict.MISS
    assert figures["skipped (2x)"].value == "nox is not installed"


# --- as a user meets it on a machine without CUDA ---

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")


@needs_no_cuda
def test_the_script_without_cuda_prints_one_line_and_exits_non_zero(tmp_path) -> None:
    out = tmp_path / "acceptance"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == ga.EXIT_CANNOT
    assert done.stderr == ""
    [line] = done.stdout.splitlines()
    assert line.startswith("gpu-acceptance: no CUDA device visible (torch ")
    assert not out.exists()


@needs_no_cuda
def test_nox_session_without_a_gpu_is_one_line_and_non_zero(nf: ModuleType) -> None:
    if nf.gpus_listed():
        pytest.skip("nvidia-smi lists a GPU here")
    done = subprocess.run(
        [sys.executable, "-m", "nox", "-s", "gpu-acceptance"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0
    ours = [line for line in (done.stdout + done.stderr).splitlines() if "gpu-acceptance:" in line]
    assert len(ours) == 1 and "no CUDA device visible" in ours[0]
    assert "Traceback" not in done.stdout + done.stderr


class FakeSession:
    """What the gpu-acceptance session calls of nox's session."""

    def __init__(self, posargs: Sequence[str] = ()) -> None:
        self.posargs = list(posargs)
        self.runs: list[tuple[str, ...]] = []

    def run(self, *args: str, **kw: Any) -> None:
        self.runs.append(args)

    def install(self, *args: str, **kw: Any) -> None:
        raise AssertionError(f"installed {args}")

    def log(self, message: str) -> None:
        pass

    def error(self, message: str) -> None:
        raise SystemExit(message)


def test_nox_uses_an_interpreter_that_has_everything_and_installs_nothing(
    nf: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nf, "gpus_listed", lambda: True)
    monkeypatch.setattr(nf, "acceptance_interpreters", lambda: ["/bare/python3", "/box/python3"])
    monkeypatch.setattr(nf, "acceptance_ready", lambda python: python == "/box/python3")
    session = FakeSession(["--out", "x"])
    nf.gpu_acceptance(session)
    assert session.runs == [("/box/python3", nf.ACCEPTANCE, "--out", "x")]


def test_nox_installs_the_tests_environment_only_where_no_interpreter_is_ready(
    nf: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nf, "gpus_listed", lambda: True)
    monkeypatch.setattr(nf, "acceptance_ready", lambda python: False)
    session = FakeSession()
    nf.gpu_acceptance(session)
    assert session.runs[0][-3:] == ("-s", "tests", "--install-only")
    assert session.runs[1] == (str(Path(".nox/tests/bin/python")), nf.ACCEPTANCE)


def test_an_interpreter_is_ready_when_the_script_finds_every_package(nf: ModuleType) -> None:
    assert nf.acceptance_ready(sys.executable)
    assert not nf.acceptance_ready(str(ROOT / "no-such-python"))
    assert nf.ready_interpreter(["a", "b", "c"], lambda p: p != "a") == "b"
    assert nf.ready_interpreter(["a"], lambda p: False) is None


def test_options_narrow_the_session_and_an_unknown_step_is_refused(tmp_path, capsys) -> None:
    options = ga.parse_options(
        ["--out", str(tmp_path), "--case", "var-normalize-promotion", "--skip", "tests",
         "--models", "3", "--rounds", "1", "--tests", "tests/test_flash_kernels.py"]
    )  # fmt: skip
    assert options == ga.Options(
        out=tmp_path, cases=("var-normalize-promotion",), rounds=1, models=3,
        tests=("tests/test_flash_kernels.py",), skip=frozenset({"tests"}),
    )  # fmt: skip
    with pytest.raises(SystemExit) as refused:
        ga.parse_options(["--skip", "benchmarks"])
    assert refused.value.code == 2
    assert "invalid choice: 'benchmarks'" in capsys.readouterr().err
