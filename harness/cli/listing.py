"""``list``: each case with its upstream source, axes, stages, sizes and fixes; the modes."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from harness.cli.options import add_cases_dir
from harness.schema.axes import EAGER, MODES
from harness.schema.text import terminal_lines

if TYPE_CHECKING:
    from harness.measure.authoring.case import Case, FailureSignature

HELP = "list cases, fixes, axes, upstream links"


def fill(parser: argparse.ArgumentParser) -> None:
    add_cases_dir(parser)


def failure_text(failure: FailureSignature) -> str:
    """A known failure in one line: ``RuntimeError: /regex/``, its silent symptoms, or both."""
    parts = [f"{failure.error_type}: /{failure.message}/"] if failure.raised else []
    if failure.silent:
        parts.append("silent: " + ", ".join(symptom.value for symptom in failure.silent))
    return "; ".join(parts)


def describe_case(case: Case) -> list[str]:
    up = case.upstream
    assert up is not None and case.failure is not None
    lines = [
        f"{case.name}: {case.title}",
        f"  upstream: {up.repo} {up.file} @ {up.commit}"
        + (f" (issues {', '.join(up.issues)})" if up.issues else ""),
    ]
    if up.url:
        lines.append(f"  link:     {up.url}")
    lines += [
        *(f"  failure:  {failure_text(f)}" for f in case.known_failures),
        f"  devices:  {', '.join(case.devices)}   dtypes: {', '.join(case.dtypes)}",
        f"  modes:    {', '.join(case.modes)}   backends: {', '.join(case.backends)}",
        stages_line(case),
    ]
    if case.compiles != (EAGER,):
        lines.append(f"  compiles: {', '.join(case.compiles)}")
    lines += size_lines(case)
    if case.keep_fp32:
        lines.append(f"  keeps fp32: {', '.join(case.keep_fp32)}")
    if case.manages_precision:
        lines.append("  precision: managed by the case's upstream code (the harness only places)")
    if case.requires:
        lines.append(f"  requires: {', '.join(case.requires)}")
    lines.append("  fixes:")
    for fix in case.fixes.values():
        ref = f" [{fix.upstream}]" if fix.upstream else ""
        lines.append(f"    {fix.name:<24} {fix.rationale}{ref}")
    return lines


def stages_line(case: Case) -> str:
    """The stages a case declares: those a run covers unless ``--stage`` says otherwise,
    then those it runs only when asked (``fit``), so a user sees which flag reaches them."""
    from harness.runner.matrix import concrete_stages

    by_default = concrete_stages(case, ())
    asked = [stage for stage in case.stages if stage not in by_default]
    line = f"  stages:   {', '.join(by_default)}"
    if asked:
        line += f"; on request (--stage): {', '.join(asked)}"
    return line


def size_lines(case: Case) -> list[str]:
    """Each declared size with its dimensions and, past the small one, its source."""
    from harness.measure.authoring.case import size_metadata

    lines = []
    for size in case.sizes:
        described = size_metadata(size)
        dims = ", ".join(f"{k}={v}" for k, v in described["dims"].items())
        lines.append(f"  size {size.name + ':':<9} {dims}")
        if described["source"]:
            lines.append(f"    from: {described['source']}")
    return lines


def command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from harness.runner.run import discover_cases

    for case in discover_cases(args.cases_dir):
        print(terminal_lines(describe_case(case)), end="\n\n")  # a title is one line
    print("modes:")
    for mode in MODES.values():
        print(f"  {mode.name:<14} {mode.meaning}")
    return 0
