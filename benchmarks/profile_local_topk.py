#!/usr/bin/env python3
"""Profile one launch of the local top-K (ours, and vLLM's beside it) under Nsight Compute, on the H200.

    ncu --profile-from-start off --clock-control none --set full --csv --page details --log-file $OUT/ncu.csv \
        python benchmarks/profile_local_topk.py --shape 1024x32768 [--cute 1,1024,8] [--peers .gpu/ix_peers/vllm]
    python benchmarks/profile_scoring.py --summarize $OUT/ncu.csv --out $OUT/ncu_topk.json --label local_topk

Builds standard normal float32 scores ``[T, L]`` (every key valid, k = 2048, the benchmark's inputs), warms each
kernel up and checks ours against the reference (sets of pairs), then launches each once between
``cudaProfilerStart`` / ``cudaProfilerStop`` (``--profile-from-start off`` profiles those launches only): ours with
the default plan (or ``--cute cluster,threads,first_bits``), then vLLM's ``top_k_per_row_decode`` when ``--peers``
has it. The summary is :func:`profile_scoring.summarize_ncu`'s (one record per kernel).
"""

from __future__ import annotations

import argparse
import sys

import torch

from dcp_ref.geometry import DcpGeometry


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="1024x32768", help="TxL")
    ap.add_argument("--cute", default="", help="cluster,threads,first_bits of the CuTeDSL plan (default: by shape)")
    ap.add_argument("--peers", default="", help="folder with vLLM's topk_decode.py + .so")
    args = ap.parse_args()
    t, n = (int(x) for x in args.shape.split("x"))
    k = 2048
    from bench_local_topk import reference, same_rows  # the benchmark's checks (benchmarks/ is on sys.path)

    from dcp_ref.kernels.indexer_triton import indexer_topk_pack, launch_plan, scores_vec

    g = torch.Generator(device="cuda").manual_seed(t * 7 + n)
    scores = torch.randn(t, n, device="cuda", generator=g)
    lengths = torch.full((t,), n, dtype=torch.int32, device="cuda")
    cute = tuple(int(x) for x in args.cute.split(",")) if args.cute else None
    out = torch.empty((t, k, 2), device="cuda")
    plan = launch_plan(t, n, k, scores.device, cute=cute, vec=scores_vec(scores))

    def ours() -> None:
        indexer_topk_pack(scores, lengths, k, DcpGeometry(2, 0), out=out, validate=False, plan=plan)

    ours()
    torch.cuda.synchronize()
    if not same_rows(out, reference(scores, lengths)):
        print("ours differs from the reference", file=sys.stderr)
        return 1
    vllm = None
    if args.peers:
        sys.path.insert(0, args.peers)
        from topk_decode import top_k_per_row_decode  # type: ignore[import-not-found]

        idx = torch.empty((t, k), dtype=torch.int32, device="cuda")

        def vllm() -> None:
            top_k_per_row_decode(scores, lengths, k, out=idx)

        vllm()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    ours()
    if vllm is not None:
        vllm()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled T={t} L={n} ours (cute={cute}){' and vLLM' if vllm else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
