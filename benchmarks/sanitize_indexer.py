#!/usr/bin/env python3
"""A few fused indexer launches for compute-sanitizer (memcheck, racecheck) on the H200.

    compute-sanitizer --tool memcheck  --error-exitcode 9 python3 benchmarks/sanitize_indexer.py
    compute-sanitizer --tool racecheck --error-exitcode 9 python3 benchmarks/sanitize_indexer.py

Small shapes (the sanitizers slow kernels down ~100x) that still reach every code path of
``kernels/indexer_triton.py``: a row held in registers, a streamed row (several tiles), split rows
(segment launches, one and two levels, then the packed-candidate launch), prefill ``row_starts``,
``k`` larger than the row, and bad windows with ``validate=False`` (the clamps on the device).
Adversarial rows (ties, ±0, NaN, ±inf, short and empty rows) from ``tests/test_indexer_kernel.py``;
every output is checked against ``pack_candidates(local_topk(...))``. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():  # a CPU smoke run goes through the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, "tests")
from test_indexer_kernel import make_cases, reference, same_sets

from dcp_ref.geometry import DcpGeometry
from dcp_ref.kernels.indexer_triton import indexer_topk_pack, launch_plan, scores_vec

# (rows, cols, k, W, I, rank, row_starts, tuning)
CONFIGS = [
    (8, 3000, 256, 2, 1, 1, False, {}),  # one tile in registers
    (8, 2000, 300, 3, 4, 2, True, {"tile": 512}),  # streamed: 4 tiles per pass
    (8, 4000, 128, 2, 1, 0, False, {"split": 4}),  # split rows: segments + candidates
    (8, 700, 1000, 1, 1, 0, True, {}),  # k > row
    (16, 257, 16, 8, 64, 5, False, {"radix_bits": 13}),  # widest digit
    (8, 5000, 64, 2, 2, 1, False, {"split": 3, "tile": 1024}),  # split with streamed segments
    (4, 6000, 16, 2, 1, 0, True, {"split": 24, "tile": 256}),  # two split levels: 24 -> 2 segments
]


def main() -> int:
    """``--configs 0,3``: only those entries of CONFIGS (a sanitizer run that must fit a time limit)."""
    pick = range(len(CONFIGS))
    if "--configs" in sys.argv:
        pick = [int(x) for x in sys.argv[sys.argv.index("--configs") + 1].split(",")]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bad = 0
    for c, (rows, cols, k, w, i, rank, with_starts, tune) in enumerate(CONFIGS):
        if c not in pick:
            continue
        s, lengths, starts = make_cases(rows, cols, 70 + c, dev, with_starts)
        out = torch.full((rows, k, 2), float("nan"), device=dev)
        plan = launch_plan(rows, cols, k, dev, vec=scores_vec(s), **tune)
        got = indexer_topk_pack(s, lengths, k, DcpGeometry(w, rank, i, i), starts, out=out, validate=False, plan=plan)
        ok = bool(same_sets(got, reference(s, lengths, k, DcpGeometry(w, rank, i, i), starts)).all())
        bad += not ok
        print(f"config {c} rows={rows} cols={cols} k={k} W={w} I={i} {tune}: {'ok' if ok else 'MISMATCH'}", flush=True)
    # Bad windows, no host checks: the device clamps must keep every read inside `scores`.
    s, _, _ = make_cases(4, 900, 99, dev)
    lengths = torch.tensor([5000, -3, 900, 2**40], device=dev)
    starts = torch.tensor([800, 0, -9, 950], device=dev)
    got = indexer_topk_pack(s, lengths, 64, DcpGeometry(2, 0), starts, validate=False)
    cs = starts.clamp(0, 900)
    ok = bool(
        same_sets(got, reference(s, torch.minimum(lengths.clamp(min=0), 900 - cs), 64, DcpGeometry(2, 0), cs)).all()
    )
    bad += not ok
    print(f"clamped windows: {'ok' if ok else 'MISMATCH'}", flush=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    print(f"{bad} mismatching launches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
