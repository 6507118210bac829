#!/usr/bin/env python3
"""Profile one stable top-K launch under Nsight Compute (on the H200).

    ncu --profile-from-start off --set full -o rep python benchmarks/profile_topk.py \
        --rows 1024 --W 8 --K 2048 --tuning lean/8

Builds the benchmark's input (random normal scores, distinct ids), compiles and warms the kernel
up, checks it against the reference, then launches it once between cudaProfilerStart/Stop, so
that only that launch is profiled.
"""

from __future__ import annotations

import argparse

import torch
from bench_topk import make_input, parse_tuning

from dcp_ref.kernels.topk_cutedsl import stable_topk_cutedsl
from dcp_ref.topk import stable_topk


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--W", type=int, default=8)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--tuning", action="append", default=None, help="variant/first_bits[/threads/min_ctas]")
    args = ap.parse_args()
    g = make_input(args.rows, args.W, args.K)
    want = torch.sort(stable_topk(g, args.K), 1).values
    for t in args.tuning or ["lean/8"]:
        tune = parse_tuning(t)
        out = torch.empty((args.rows, args.K), dtype=torch.int32, device="cuda")
        for _ in range(3):
            stable_topk_cutedsl(g, args.K, out=out, tvm_ffi=False, **tune)
        assert torch.equal(torch.sort(out, 1).values, want), t
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        stable_topk_cutedsl(g, args.K, out=out, tvm_ffi=False, **tune)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled {t}: rows={args.rows} W={args.W} K={args.K}")


if __name__ == "__main__":
    main()
