"""The recorded PTX comparison of the CuTeDSL top-K refactor still describes the current kernel.

``benchmarks/results/topk_refactor_ptx.json`` (written by ``tools/compare_topk_ptx.py``) records,
per configuration, the SHA-256 of the normalised sm_90a PTX before the kernel was split into
``@cute.jit`` helpers and after. Equal hashes mean the refactor changed neither behaviour nor
speed. Here a few of those configurations are compiled again (CPU only): the current kernel must
still emit exactly the recorded PTX. If you change the kernel on purpose, re-run the tool
against the last benchmarked revision and re-benchmark when the PTX differs.
"""

from __future__ import annotations

import importlib.util
import json
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "results" / "topk_refactor_ptx.json"

spec = importlib.util.spec_from_file_location("compare_topk_ptx", ROOT / "tools" / "compare_topk_ptx.py")
assert spec is not None and spec.loader is not None
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)

# A spread of the recorded configurations: both variants, sorted, 64-bit offsets, a 12-bit digit.
CHECKED = [
    (3, 7, 5, False, "lean", True, 8),
    (2, 5, 4, True, "regs", True, 8),
    (8, 2048, 2048, False, "lean", True, 8),
    (8, 2048, 2048, True, "regs", True, 12),
    (4, 2048, 2048, False, "regs", False, 8),
]


def _record() -> dict:
    return json.loads(RECORD.read_text())


def _key(row: dict) -> tuple:
    return (row["world"], row["kloc"], row["k"], row["sorted"], row["variant"], row["small"], row["first_bits"])


def test_record_covers_the_tool_configs_and_says_identical() -> None:
    rec = _record()
    rows = {_key(r): r for r in rec["configs"]}
    assert set(rows) == set(tool.CONFIGS)
    assert rec["before"] != rec["after"]
    for row in rows.values():
        assert row["identical"] == (row["sha256_before"] == row["sha256_after"])
    assert rec["identical"] == all(r["identical"] for r in rows.values())
    assert rec["identical"], "the refactor changed the PTX: benchmark it instead"


def test_normalize_ptx_keeps_instructions_and_drops_names_and_comments() -> None:
    a = ".visible .entry kernel_a_1(\n\t// a comment\n\tadd.s32 %r1, %r2, 1;  // x\n\n}\n"
    b = ".visible .entry kernel_b_22(\n\tadd.s32 %r1, %r2, 1;\n}\n"
    assert tool.normalize_ptx(a) == tool.normalize_ptx(b)
    assert tool.normalize_ptx(a) != tool.normalize_ptx(b.replace(", 1;", ", 2;"))


@pytest.mark.parametrize("cfg", CHECKED, ids=lambda c: "-".join(map(str, c)))
def test_current_kernel_emits_the_recorded_ptx(cfg: tuple) -> None:
    pytest.importorskip("cutlass")
    rec = _record()
    if metadata.version("nvidia-cutlass-dsl") != rec["versions"]["nvidia-cutlass-dsl"]:
        pytest.skip(f"PTX recorded with nvidia-cutlass-dsl {rec['versions']['nvidia-cutlass-dsl']}")
    from dcp_ref.kernels import topk_cutedsl

    row = {_key(r): r for r in rec["configs"]}[cfg]
    got = tool.digest(tool.compile_ptx(topk_cutedsl, cfg))
    assert got == row["sha256_after"], (
        f"{cfg}: the kernel's PTX changed since {rec['after']}; run tools/compare_topk_ptx.py and re-benchmark"
    )
