#!/usr/bin/env python3
"""Profile one top-K launch under Nsight Compute (on the H200): the stable top-K (CuTeDSL) or the indexer's.

    ncu --profile-from-start off --set full -o rep python benchmarks/profile_topk.py \
        --rows 1024 --W 8 --K 2048 --tuning lean/8
    ncu --profile-from-start off --section SourceCounters -o rep python benchmarks/profile_topk.py \
        --indexer 32x8192 --indexer 1024x32768:compact=true,select=search

Builds the benchmark's input (random normal scores, distinct ids), compiles and warms the kernel
up, checks it against the reference, then launches it once between cudaProfilerStart/Stop, so
that only that launch is profiled. ``--indexer TxL[:name=value,...]`` profiles
``indexer_topk_pack`` (k = ``--K``, every key valid; the tuning names are its keyword arguments) instead
of the CuTeDSL top-K, which then need not be installed.
"""

from __future__ import annotations

import argparse

import torch

from dcp_ref.geometry import DcpGeometry


def parse_indexer(spec: str) -> tuple[int, int, dict]:
    """``"TxL[:name=value,...]"`` -> ``(T, L, tuning)`` (values: ``true``/``false``, ints, else strings)."""
    shape, _, rest = spec.partition(":")
    t, n = (int(v) for v in shape.lower().split("x"))
    tune: dict = {}
    for item in filter(None, rest.split(",")):
        name, _, value = item.partition("=")
        low = value.lower()
        tune[name] = low == "true" if low in ("true", "false") else int(value) if value.isdigit() else value
    return t, n, tune


def profile_indexer(spec: str, k: int) -> None:
    from dcp_ref.indexer import local_topk
    from dcp_ref.kernels.indexer_triton import indexer_topk_pack, launch_plan, scores_vec, workspace_for
    from dcp_ref.topk import pack_candidates

    t, n, tune = parse_indexer(spec)
    scores = torch.randn(t, n, device="cuda")
    lengths = torch.full((t,), n, dtype=torch.int32, device="cuda")
    plan = launch_plan(t, n, k, scores.device, vec=scores_vec(scores), **tune)  # the spec's knobs
    ws = workspace_for(scores, k, plan=plan)
    out = torch.empty((t, k, 2), device="cuda")
    for _ in range(3):
        indexer_topk_pack(scores, lengths, k, DcpGeometry(2, 0), out=out, validate=False, workspace=ws, plan=plan)
    want = pack_candidates(scores, local_topk(scores, k, lengths), DcpGeometry(2, 0))
    same = torch.equal(out.view(torch.int64).sort(1).values, want.view(torch.int64).sort(1).values)
    assert same, spec
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    indexer_topk_pack(scores, lengths, k, DcpGeometry(2, 0), out=out, validate=False, workspace=ws, plan=plan)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled indexer {spec}: k={k}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--W", type=int, default=8)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--tuning", action="append", default=None, help="variant/first_bits[/threads/min_ctas]")
    ap.add_argument("--indexer", action="append", default=None, help="TxL[:name=value,...]: the indexer's top-K")
    args = ap.parse_args()
    if args.indexer:
        for spec in args.indexer:
            profile_indexer(spec, args.K)
        return
    from bench_topk import make_input, parse_tuning

    from dcp_ref.kernels.topk_cutedsl import stable_topk_cutedsl
    from dcp_ref.topk import stable_topk

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
