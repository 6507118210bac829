"""``benchmarks/sanitize_all.py`` (the compute-sanitizer driver) as a CPU smoke test: its Triton families run under
the interpreter and must agree with the references.

The script itself is what the H200 runs under compute-sanitizer memcheck / racecheck; here it runs in a subprocess
(``TRITON_INTERPRET=1``, as on CI) on the Triton families, and its ``--out`` record must show every listed family
run (at least one checked launch), with no mismatch and no crashed case, and the script must exit 0. Left out for
time (the interpreter; CI runs two workers on two cores): ``deinterleave`` (~15 s alone, its kernels have their own
tests in ``tests/test_deinterleave.py``). The CUDA-only families (CuTeDSL top-K and select-to-slots, FlashInfer,
FlashMLA) are skipped by the script on the CPU, with a reason; that is checked too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "sanitize_all.py"
#: The Triton families the smoke test runs (every one but deinterleave; see the module docstring).
TRITON_FAMILIES = (
    "pack",
    "lse_merge",
    "indexer",
    "indexer_compact",
    "guard",
    "scoring",
    "splitkv",
)


#: Families that need CUDA (and CuTeDSL / FlashInfer / FlashMLA): skipped on the CPU, with a reason.
CUDA_FAMILIES = ("topk_cutedsl", "select_to_slots", "flashinfer", "flashmla", "flashmla_fp8")


def test_triton_families_run_and_match_the_references(tmp_path: Path) -> None:
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    env.setdefault("CUTE_DSL_ARCH", "sm_90a")
    only = TRITON_FAMILIES + CUDA_FAMILIES
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", ",".join(only), "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, tail
    assert proc.stdout.strip().splitlines()[-1].endswith("status 0"), tail
    fams = json.loads((tmp_path / "sanitize_all.json").read_text())["families"]
    assert list(fams) == list(only)
    for name in TRITON_FAMILIES:
        rec = fams[name]
        assert "skipped" not in rec, (name, rec)
        assert rec["launches"] >= 1, (name, rec)
        assert rec["mismatches"] == [] and rec["crashes"] == [], (name, rec)
        assert rec["seconds"] >= 0
    for name in CUDA_FAMILIES:
        rec = fams[name]
        if torch.cuda.is_available() and "skipped" not in rec:
            assert rec["launches"] >= 1 and rec["mismatches"] == [] and rec["crashes"] == [], (name, rec)
        else:
            assert rec["skipped"], (name, rec)  # a stated reason (a missing package, or no CUDA)
