"""The run configuration is declared once, on its fields: the flags of ``run`` and
``check``, the configuration built from them, its stored form and the checks of both
sides all come from ``option(...)`` on the fields of ``harness.schema.config``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from harness.cli import check as check_command
from harness.cli import options
from harness.cli import run as run_command
from harness.schema.config import (
    Limits,
    Rule,
    RunConfig,
    TimingConfig,
    declared_options,
    from_flags,
    option,
    read_fields,
    stored,
)
from harness.schema.selection import Selection


def parser_of(fill: Any) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampmatrix")
    fill(parser)
    return parser


COMMANDS = {"run": run_command.fill, "check": check_command.fill}


def by_flag(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {name: action for action in parser._actions for name in action.option_strings}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_option_field_is_a_flag_with_its_declared_help_and_default(command: str) -> None:
    parser = parser_of(COMMANDS[command])
    actions = by_flag(parser)
    declared = declared_options(RunConfig)
    assert [d.option.flag for d in declared] == [
        "--out", "--workers", "--no-trace", "--profile", "--no-timing", "--time-budget",
        "--flush-l2", "--timeout", "--memory-limit", "--batch", "--fit-steps",
    ]  # fmt: skip
    text = parser.format_help()
    for d in declared:
        action = actions[d.option.flag]
        assert action.help == d.help and " ".join(d.help.split()[:4]) in text
        assert action.metavar == d.option.metavar
        if d.option.short:
            assert actions[d.option.short] is action
        if not (d.option.negated or d.kind is bool):
            assert action.default == d.default
    helps = {d.option.flag: d.help for d in declared}
    assert helps["--timeout"].endswith("(default 300)")
    assert helps["--batch"].startswith("cells of one case sharing a forked process (default 16;")
    assert helps["--out"].endswith("(default results)")


def parse(argv: list[str], command: str = "run") -> argparse.Namespace:
    return parser_of(COMMANDS[command]).parse_args(argv)


def test_the_flags_build_the_configuration_of_their_fields(tmp_path: Path) -> None:
    argv = [
        "--case", "a", "--cases-dir", str(tmp_path), "--out", "elsewhere", "-n", "2",
        "--no-trace", "--time-budget", "0.25", "--flush-l2", "--timeout", "9",
        "--memory-limit", "0.5", "--batch", "1", "--fit-steps", "3",
    ]  # fmt: skip
    config = options.config_from(parse(argv), ["run", *argv])
    assert config == RunConfig(
        selection=Selection(cases=("a",)),
        cases_dirs=(tmp_path,),
        results_root=Path("elsewhere"),
        workers="2",
        command=("python -m harness", "run", *argv),
        trace=False,
        timing=TimingConfig(budget_s=0.25, flush_l2=True),
        limits=Limits(timeout_s=9.0, memory_bytes=2**29),
        batch=1,
        fit_steps=3,
    )
    defaults = options.config_from(parse([]), ["run"])
    assert defaults == RunConfig(command=("python -m harness", "run"))
    assert options.config_from(parse(["--no-timing"]), []).timing is None


def test_a_configuration_round_trips_through_its_stored_form(tmp_path: Path) -> None:
    config = RunConfig(
        selection=Selection(cases=("a",), dtypes=("float16", "bfloat16")),
        cases_dirs=(tmp_path,),
        results_root=Path("out"),
        workers="0",
        command=("python -m harness", "check", "m:f"),
        trace=False,
        timing=TimingConfig(budget_s=2.0, flush_l2=True, min_samples=3),
        limits=Limits(timeout_s=12.5, memory_bytes=2**31),
        batch=4,
        fit_steps=7,
        models=("m:f",),
        models_path=str(tmp_path),
        keep_fp32=("norm",),
        losses=("m:loss",),
    )
    data = config.to_dict()
    assert data["timing"]["budget_s"] == 2.0 and data["cases_dirs"] == [str(tmp_path.resolve())]
    assert data["results_root"] == "out" and data["selection"]["dtypes"] == ["float16", "bfloat16"]
    assert RunConfig.from_dict(data) == config
    assert RunConfig.from_dict(RunConfig(timing=None).to_dict()) == RunConfig(timing=None)
    # what older runs stored: no batch (a cell per process), no timing (correctness only)
    older = RunConfig.from_dict({"workers": "2"})
    assert (older.batch, older.timing, older.fit_steps, older.workers) == (1, None, 20, "2")


#: For each option with a rule: a command line it refuses with its message, and a stored
#: value out of range under the field's name.
BAD: dict[str, tuple[list[str], str, dict[str, Any], str]] = {
    "--time-budget": (
        ["--time-budget", "3e6"],
        "'3e6' seconds is longer than a run can wait",
        {"timing": {"budget_s": 3e6}},
        "timing.budget_s",
    ),
    "--timeout": (
        ["--timeout", "1e12"],
        "'1e12' seconds is longer than a run can wait",
        {"limits": {"timeout_s": 0}},
        "limits.timeout_s",
    ),
    "--memory-limit": (
        ["--memory-limit", "8589934592"],
        "'8589934592' GiB is more memory than a limit can hold",
        {"limits": {"memory_bytes": 0}},
        "limits.memory_bytes",
    ),
    "--workers": (
        ["-n", "some"],
        "'some' is not 'auto' or a number of workers",
        {"workers": "some"},
        "workers",
    ),
    "--batch": (
        ["--batch", "0"],
        "'0' is not a whole number of cells, 1 or more",
        {"batch": 0},
        "batch",
    ),
    "--fit-steps": (
        ["--fit-steps", "10001"],
        "'10001' is not a whole number of steps from 1 to 10000",
        {"fit_steps": 10001},
        "fit_steps",
    ),
}


def test_every_rule_has_a_bad_value_here() -> None:
    assert {d.option.flag for d in declared_options(RunConfig) if d.rule} == set(BAD)


@pytest.mark.parametrize("flag", BAD)
def test_each_rule_refuses_a_bad_value_on_the_command_line_and_stored(
    flag: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    argv, refused, data, name = BAD[flag]
    # a machine that does not say its memory: the ceiling is setrlimit()'s, and the rule's
    monkeypatch.setattr(options, "physical_memory_gib", lambda: None)
    with pytest.raises(SystemExit) as exited:
        parse(argv)
    assert exited.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"error: argument {'-n/' if flag == '--workers' else ''}{flag}: {refused}" in error
    (rule,) = (d.rule for d in declared_options(RunConfig) if d.option.flag == flag)
    assert rule is not None
    with pytest.raises(ValueError, match=rf"^{name}: expected {rule.expected}, got "):
        RunConfig.from_dict(data)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"trace": None}, "trace: expected bool, got NoneType None"),
        ({"batch": "7"}, "batch: expected int, got str '7'"),
        ({"limits": {"timeout_s": "3"}}, "limits.timeout_s: expected a number, got str '3'"),
        ({"timing": {"rounds": 3}}, "timing.rounds: not a field of TimingConfig"),
        ({"results_root": 5}, "results_root: expected str, got int 5"),
        ({"cases_dirs": ["relative"]}, "cases_dirs[0]: expected an absolute path"),
        ({"selection": {"cases": [1]}}, "selection.cases[0]: expected str, got int 1"),
    ],
)
def test_a_stored_value_of_the_wrong_type_is_refused_naming_its_field(
    data: dict[str, Any], message: str
) -> None:
    with pytest.raises((TypeError, ValueError)) as refused:
        RunConfig.from_dict(data)
    assert str(refused.value).startswith(message)


@dataclass(frozen=True)
class Toy:
    """A configuration of its own: one field with a rule, one switch."""

    rounds: int = field(
        default=3,
        metadata=option(
            flag="--rounds",
            metavar="N",
            help="rounds to play (default {default})",
            rule=Rule(lambda n: 1 <= n <= 9, "1 to 9 rounds", "{text} is not 1 to 9 rounds"),
        ),
    )
    loud: bool = field(default=True, metadata=option(flag="--no-loud", help="play quietly"))


def test_a_new_field_declares_its_flag_stored_form_and_rule_in_one_place(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser(prog="toy")
    for declared in declared_options(Toy):
        options.add_option(parser, declared)
    assert "rounds to play (default 3)" in parser.format_help()
    assert from_flags(Toy, vars(parser.parse_args([]))) == Toy()
    toy = from_flags(Toy, vars(parser.parse_args(["--rounds", "5", "--no-loud"])))
    assert toy == Toy(rounds=5, loud=False)
    assert stored(toy) == {"rounds": 5, "loud": False}
    assert Toy(**read_fields(Toy, stored(toy), "", strict=True)) == toy
    with pytest.raises(SystemExit):
        parser.parse_args(["--rounds", "12"])
    assert "argument --rounds: '12' is not 1 to 9 rounds" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"^toy\.rounds: expected 1 to 9 rounds, got 12$"):
        read_fields(Toy, {"rounds": 12}, "toy.", strict=True)
