"""``benchmarks/bench_validation.py --smoke`` on the CPU: the script runs, every Triton row's inputs are valid.

The timings of a smoke run are the interpreter's and claim nothing (the verdict ``validated <= one-read floor +
10 µs`` is the H200 run's); what this checks is that each row the H200 run will time is built
on valid inputs — its validated call passes — so that the GPU run measures the validated *success* path, that
the guard row says it has no validated form, and that the CUDA-only rows are skipped with a reason.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The rows that run interpreted (Triton), per T.
TRITON_ROWS = {
    "deinterleave_compact (rowscan)",
    "deinterleave_masked_triton",
    "global_ids_to_local_slots_triton",
    "lse_correct",
    "lse_merge",
    "pack_candidates_triton",
    "indexer_topk_pack",
    "index_scores_triton (fp8)",
    "sparse_mla_splitkv (triton)",
}
NO_VALIDATED_FORM = {"guard_triton"}
CUDA_ONLY = {
    "sparse_mla_flashmla (bf16)",
    "FlashMLAFp8Decode (masked)",
    "select_to_slots_cutedsl (global_id)",
    "select_to_slots_cutedsl (rank_local)",
}


def test_bench_validation_smoke_runs_every_triton_row(tmp_path: Path) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUTE_DSL_ARCH": "sm_90a"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_validation.py"), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads((tmp_path / "validation.json").read_text())
    assert result["smoke"] is True and result["all_meet_target"] is False  # no verdict from a smoke run
    rows = result["rows"]
    assert not [r for r in rows if "failed" in r], [r for r in rows if "failed" in r]
    for T in (1, 2):
        got = {r["wrapper"]: r for r in rows if r["T"] == T}
        assert set(got) == TRITON_ROWS | NO_VALIDATED_FORM | CUDA_ONLY
        for name in TRITON_ROWS:
            r = got[name]
            assert "skipped" not in r, r
            assert r["validated_call_ok"] is True  # valid inputs: the validated call passes
            assert r["validated"]["median_us"] > 0 and r["unvalidated"]["median_us"] > 0
            assert "meets_target" not in r
        for name in NO_VALIDATED_FORM:
            r = got[name]
            assert r["no_validated_form"].startswith("no validated form") and "validated" not in r
            assert r["unvalidated"]["median_us"] > 0
        for name in CUDA_ONLY:
            assert got[name]["skipped"], got[name]  # with its reason (no CUDA / no package here)
