#!/usr/bin/env python3
"""A few stable top-K launches for compute-sanitizer (memcheck, racecheck) on the H200.

    compute-sanitizer --tool racecheck python benchmarks/sanitize_topk.py

Small row counts (the sanitizers slow kernels down ~100x), every variant, sorted and unsorted,
adversarial rows (heavy ties, invalid entries, fewer valid than k, odd sizes); each output is
checked against the reference. Exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys

import torch

sys.path.insert(0, "tests")
from test_topk import make_gpu_cases  # type: ignore[import-not-found]

from dcp_ref.kernels.topk_cutedsl import VARIANTS, stable_topk_cutedsl
from dcp_ref.topk import stable_topk

CONFIGS = [
    (8, 2048, 2048, False, 14),
    (2, 5, 8, False, 14),
    (3, 33, 17, True, 14),
    (4, 1023, 1023, False, 14),
    (8, 4096, 4096, False, 7),
    (7, 511, 2048, True, 7),
    (1, 4096, 2000, False, 7),
    (8, 2048, 2048, True, 7),
]


def main() -> int:
    """``--configs 0,3``: only those entries of CONFIGS (a sanitizer run that must fit a time limit)."""
    pick: list[int] = list(range(len(CONFIGS)))
    if "--configs" in sys.argv:
        pick = [int(x) for x in sys.argv[sys.argv.index("--configs") + 1].split(",")]
    bad = 0
    for c, (W, K, k, sorted_, rows) in enumerate(CONFIGS):
        if c not in pick:
            continue
        g = make_gpu_cases(W, K, rows, 50 + c, torch.device("cuda"))
        want = stable_topk(g, k, sorted=True)
        for variant in VARIANTS:
            for fb in (8, 12):
                got = stable_topk_cutedsl(g, k, sorted=sorted_, variant=variant, first_bits=fb)
                ok = (
                    torch.equal(got, want)
                    if sorted_
                    else torch.equal(torch.sort(got, 1).values, torch.sort(want, 1).values)
                )
                bad += not ok
                print(f"W={W} K={K} k={k} sorted={sorted_} {variant}/{fb}: {'ok' if ok else 'MISMATCH'}", flush=True)
    print(f"{bad} mismatching launches")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
