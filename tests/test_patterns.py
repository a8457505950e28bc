"""Every line the six reference repros print (``tests/data/patterns/results_*.txt``, observed
on the CPU under torch 2.13.0 and 2.4.1) has a cell with the same verdict in the stored run
of the same torch version (``tests/data/runs/patterns-torch-*``).

Verdicts: OK = ``passes`` (a flag the repro does not look at may be on it); FAIL = ``raises``
and it reproduces; SILENT = never a plain ``passes`` (``inaccurate``, or a flag); WARN =
``passes`` with the warning recorded on the cell. ``fp16-attn-overflow`` computes both input
scales in every cell (one output leaf each, ``hot36`` and ``hot100``): its lines are judged on
their scale's leaf.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.results import storage
from harness.schema.axes import Cell
from harness.schema.records import CellRecord, Outcome

DATA = Path(__file__).parent / "data"
VERSIONS = ("2.13.0", "2.4.1")


@dataclass(frozen=True)
class Where:
    """The cell a repro variant corresponds to (dtype and torch version come from the line)."""

    case: str
    fix: str
    mode: str = "half"
    backend: str = "sdpa"
    compile: str = "eager"


MASK, ROPE, T5 = "sdpa-attn-mask-dtype", "rope-fp32-cache", "t5-wo-keep-fp32"
OVERFLOW, FINFO, COMPILE = (
    "fp16-attn-overflow",
    "mask-finfo-min-overflow",
    "compile-dtype-divergence",
)
CELLS = {
    "sdpa_attn_mask_dtype": {
        "mha_cpu_autocast_fp32_mask": Where(MASK, "mha-cpu-autocast-fp32-mask", "autocast"),
        "sdpa_fp32_mask": Where(MASK, "sdpa-fp32-mask"),
        "sdpa_other_half_mask": Where(MASK, "none"),
        "sdpa_mask_cast_to_q": Where(MASK, "sdpa-mask-cast-to-q"),
        "mha_bool_kpm_float_mask": Where(MASK, "mha-bool-kpm-float-mask"),
    },
    "rope_fp32_cache": {
        "neox_eager_attn": Where(ROPE, "none", backend="eager"),
        "sdpa_no_cast": Where(ROPE, "sdpa-no-cast"),
        "sdpa_type_as_v": Where(ROPE, "sdpa-type-as-v"),
        "cache_built_in_half": Where(ROPE, "cache-built-in-half"),
    },
    "t5_wo_keep_fp32": {
        "all_half_no_clamp": Where(T5, "none", backend="eager"),
        "all_half_T5Block_clamp": Where(T5, "t5block-clamp", backend="eager"),
        "keep_wo_fp32": Where(T5, "keep-wo-fp32", backend="eager"),
        "keep_wo_fp32_strict_norm*": Where(T5, "keep-wo-fp32-strict-norm", backend="eager"),
        "keep_wo_fp32_cast_back": Where(T5, "keep-wo-fp32-cast-back", backend="eager"),
    },
    "fp16_attn_overflow": {
        "eager_fp16_default": Where(OVERFLOW, "none", backend="eager"),
        "eager_upcast_softmax_only": Where(OVERFLOW, "upcast-softmax-only", backend="eager"),
        "eager_upcast_attention": Where(OVERFLOW, "upcast-attention", backend="eager"),
        "sdpa_fused_cpu": Where(OVERFLOW, "sdpa-fused", backend="eager"),
    },
    "mask_finfo_min_overflow": {
        "hf_add_mask": Where(FINFO, "none", backend="eager"),
        "sum_two_planes": Where(FINFO, "sum-two-planes", backend="eager"),
        "clamp_fix": Where(FINFO, "clamp-fix", backend="eager"),
        "where_fix": Where(FINFO, "where-fix", backend="eager"),
        "sdpa_mask_plus_bias": Where(FINFO, "sdpa-mask-plus-bias"),
    },
    "compile_dtype_divergence": {
        "a_default_dtype_eager": Where(COMPILE, "none"),
        "a_default_dtype_inductor": Where(COMPILE, "none", compile="inductor"),
        "b_mixed_matmul_eager": Where(COMPILE, "fp32-basis-matmul"),
        "b_mixed_matmul_inductor": Where(COMPILE, "fp32-basis-matmul", compile="inductor"),
    },
}
LINE = re.compile(
    r"^\[(?P<pattern>\w+)\] torch=(?P<version>[\d.]+) (?P<dtype>\w+)\s+"
    r"(?:hot=(?P<hot>[\d.]+)\s+)?(?P<variant>\S+)\s+(?P<verdict>OK|FAIL|SILENT|WARN) \|"
)


@dataclass(frozen=True)
class Line:
    pattern: str
    version: str
    dtype: str
    variant: str
    verdict: str
    leaf: str | None

    @property
    def name(self) -> str:
        leaf = f" {self.leaf}" if self.leaf else ""
        return f"{self.pattern} {self.version} {self.dtype}{leaf} {self.variant} {self.verdict}"


def result_lines(version: str) -> list[Line]:
    lines = []
    for text in (DATA / "patterns" / f"results_{version}.txt").read_text().splitlines():
        match = LINE.match(text)
        assert match, f"unparsed line: {text}"
        hot = match["hot"]
        leaf = f"hot{float(hot):g}" if hot else None
        lines.append(
            Line(
                match["pattern"], version, match["dtype"], match["variant"], match["verdict"], leaf
            )
        )
    return lines


def stored(version: str) -> dict[Cell, CellRecord]:
    run = DATA / "runs" / f"patterns-torch-{version}"
    return {r.cell: r for r in storage.read_records(run)}


def verdict_holds(line: Line, record: CellRecord) -> bool:
    if line.verdict == "FAIL":
        return record.outcome is Outcome.RAISES and bool(record.reproduces)
    if line.leaf is not None:  # judged on its scale's output leaf
        assert record.leaves is not None and line.leaf in record.leaves
        leaf = record.leaves[line.leaf]
        leaf_passes = leaf.finite and leaf.rel_err <= leaf.tolerance
        return leaf_passes if line.verdict == "OK" else not leaf_passes
    if line.verdict == "OK":
        return record.outcome is Outcome.PASSES
    if line.verdict == "WARN":
        return record.outcome is Outcome.PASSES and bool(record.warnings)
    return record.outcome is Outcome.INACCURATE or bool(record.flags)  # SILENT


@pytest.mark.parametrize("version", VERSIONS)
def test_every_repro_line_has_a_cell_with_its_verdict(version: str) -> None:
    records = stored(version)
    lines = result_lines(version)
    assert len(lines) == 58  # 10 + 8 + 10 + 12 + 10 + 8
    wrong = []
    for line in lines:
        where = CELLS[line.pattern][line.variant]
        cell = Cell(
            where.case, where.fix, "cpu", line.dtype, where.mode, where.backend, where.compile
        )
        record = records.get(cell)
        assert record is not None, f"{line.name}: no cell {cell.id} in the stored run"
        assert record.torch_version.startswith(version)
        if not verdict_holds(line, record):
            wrong.append(f"{line.name}: {cell.id} is {record.outcome.value} {record.flags}")
    assert not wrong, "\n".join(wrong)
