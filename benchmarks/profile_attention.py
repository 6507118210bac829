#!/usr/bin/env python3
"""Profile the split-KV attention kernels under Nsight Compute, and print what each compiled variant uses.

    ncu --profile-from-start off --section SpeedOfLight --section WarpStateStats -o rep \
        python3 benchmarks/profile_attention.py --shape 1,128,2048 --shape 32,128,2048 [--config 64,32,8,3,2]

For each shape (``T,H,K``; DeepSeek's 576 / 512 dims, bf16, a 131072-row cache, distinct random slots)
the default plan (or ``--config block_h,block_n,num_warps,num_stages,num_splits``) is compiled, warmed up,
checked against the reference, then launched once between cudaProfilerStart/Stop: only that call (phase 1
and the combine) is profiled. Last, every compiled kernel variant's registers, spills and shared memory
(Triton's own numbers) are printed as JSON lines.
"""

from __future__ import annotations

import argparse
import json

import torch

from dcp_ref.attention import sparse_mla_attention
from dcp_ref.kernels import attention_splitkv_triton as sk


def compiled_stats() -> list[dict]:
    """Registers / spills / shared memory of every compiled variant of the two kernels (Triton 3.x caches)."""
    rows = []
    for name in ("splitkv_partial_kernel", "splitkv_combine_kernel"):
        fn = getattr(sk, name)
        caches = getattr(fn, "device_caches", {}) or {}
        for entry in caches.values():
            kernels = entry[0] if isinstance(entry, tuple) else entry
            for key, k in getattr(kernels, "items", dict)():
                md = getattr(k, "metadata", None)
                rows.append(
                    {
                        "kernel": name,
                        "n_regs": getattr(k, "n_regs", None),
                        "n_spills": getattr(k, "n_spills", None),
                        "shared": getattr(md, "shared", None),
                        "num_warps": getattr(md, "num_warps", None),
                        "num_stages": getattr(md, "num_stages", None),
                        "key": str(key)[-300:],
                    }
                )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", action="append", default=None, help="T,H,K (repeatable)")
    ap.add_argument("--config", default=None, help="block_h,block_n,num_warps,num_stages,num_splits")
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    S = 131072
    kv = torch.randn(S, 576, generator=gen, device=dev).bfloat16()
    for shape in args.shape or ["1,128,2048"]:
        T, H, K = (int(x) for x in shape.split(","))
        q = torch.randn(T, H, 576, generator=gen, device=dev).bfloat16()
        slots = torch.rand(T, S, generator=gen, device=dev).topk(K, dim=1).indices.int().contiguous()
        counts = torch.full((T,), K, dtype=torch.int32, device=dev)
        kw = {}
        if args.config:
            bh, bn, nw, ns, splits = (int(x) for x in args.config.split(","))
            kw = {"block_h": bh, "block_n": bn, "num_warps": nw, "num_stages": ns, "num_splits": splits}
        plan = sk.splitkv_plan(T, H, K, dev, **kw)
        ws = sk.workspace_for(plan, dev)
        out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=dev)
        lse = torch.empty(T, H, device=dev)

        def call(q=q, slots=slots, counts=counts, plan=plan, ws=ws, out=out, lse=lse):
            return sk.sparse_mla_splitkv(
                q, kv, slots, counts, 192**-0.5, 512, out=out, out_lse=lse, workspace=ws, plan=plan, validate=False
            )

        for _ in range(3):
            call()
        ref, _ = sparse_mla_attention(q, kv, slots, counts, 192**-0.5)
        err = ((out.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, err
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled T={T} H={H} K={K}: {plan} rel_err {err:.1e}", flush=True)
    for row in compiled_stats():
        print(json.dumps(row))


if __name__ == "__main__":
    main()
