#!/usr/bin/env python3
"""Benchmark the DCP LSE merge kernels and FlashInfer sparse MLA on the H200.

    python3 benchmarks/bench_lse_merge.py --out DIR          # -> DIR/lse_merge.json, DIR/attention_flashinfer.json
    python3 benchmarks/bench_lse_merge.py --sanitize         # small launches for compute-sanitizer

Measured (all bf16 outputs, fp32 LSEs, H = 128, D = 512):

* copy bandwidth of this GPU (``dst.copy_(src)``, 2 GiB moved), the ceiling for a memory-bound
  kernel (the issue quotes 4.23 TB/s);
* Triton ``lse_correct`` — the per-rank step (vLLM's ``correct_attn_out``): reads this rank's
  ``[T, H, D]`` partial and all ``[W, T, H]`` LSEs, writes ``[T, H, D]``; swept over launch shapes;
* Triton ``lse_merge`` — all W partials ``[W, T, H, D]`` → ``[T, H, D]``;
* a plain torch merge of all W partials (max, exp, weights, weighted sum) as a baseline;
* FlashInfer FA3 sparse MLA (page_size 1, compact CSR) for T ∈ {32, 128}, K = 2048 valid slots
  per row, H = 128: ``run()`` alone, ``plan()`` alone, and ``plan() + run()``.

Every kernel is checked against the float64 reference (outputs poisoned with NaN first) before
it is timed, on random (non-zero) data. Times are ``_timing.eager`` medians (L2 flushed before every
call) with 20/80 % quantiles.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

H, D = 128, 512
ISSUE_COPY_TBPS = 4.23

import _meta  # noqa: E402
import _timing  # noqa: E402
from _progress import progress  # noqa: E402  (the benchmarks' folder is on sys.path)


def bench(fn) -> dict:
    """``{"median_us", "p20_us", "p80_us"}`` of the eager call, L2 flushed before each sample (``_timing``)."""
    return _timing.eager(fn, flush_l2=True).as_dict()


def host_us(fn) -> float:
    """Host wall µs per call of 10 back-to-back calls, the device synchronised around them (``_timing.host``)."""
    return _timing.host(fn, calls=10, device="cuda").median_us


def torch_merge(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Plain torch merge of all W partials (base 2), as a framework would write it."""
    m = lses.amax(0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp2(lses - m)
    w = e / e.sum(0).clamp_min(1e-30)
    return (w.unsqueeze(-1) * outs.float()).sum(0).to(outs.dtype)


def make_partials(W: int, T: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    outs = torch.randn(W, T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    lses = torch.randn(W, T, H, device="cuda", dtype=torch.float32, generator=g) * 3 + 5
    lses[0, : max(1, T // 8)] = -math.inf  # some empty (t, rank) pairs, as in real DCP
    return outs, lses


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def bench_merge(copy_tbps: float) -> dict:
    from dcp_ref.kernels.lse_merge_triton import lse_correct, lse_merge
    from dcp_ref.lse import correct_partial, merge_partials

    rows = []
    configs = [(bh, nw) for bh in (1, 2, 4, 8) for nw in (2, 4, 8)]
    bar = progress(total=3 * 2, desc="merge sweep (W, T)")
    for W in (2, 4, 8):
        for T in (32, 1024):
            bar.set_postfix_str(f"W={W} T={T}")
            outs, lses = make_partials(W, T, seed=W * 7 + T)
            ref_m, ref_ml = merge_partials(outs, lses.double(), "2")  # outs bf16 -> merged bf16 (computed in fp64)
            ref_m64 = merge_partials(outs.double(), lses.double(), "2")[0]
            ref_c64 = correct_partial(outs[1].double(), lses.double(), 1, "2")[0]
            bytes_corr = 2 * T * H * D * 2 + W * T * H * 4
            bytes_merge = (W + 1) * T * H * D * 2 + W * T * H * 4
            row: dict[str, Any] = {
                "W": W,
                "T": T,
                "H": H,
                "D": D,
                "dtype": "bfloat16",
                "lse_dtype": "float32",
                "bytes_correct": bytes_corr,
                "bytes_merge": bytes_merge,
            }
            # --- per-rank correction: check, then sweep launch shapes
            sweep = []
            for bh, nw in configs:
                res = torch.full((T, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
                lse_correct(outs[1], lses, 1, base="2", corrected=res, block_h=bh, num_warps=nw)
                err = rel_err(res, ref_c64)
                assert err < 1e-2, f"lse_correct wrong: W={W} T={T} bh={bh} nw={nw} rel err {err}"
                t = bench(lambda: lse_correct(outs[1], lses, 1, base="2", corrected=res, block_h=bh, num_warps=nw))  # noqa: F821
                sweep.append({"block_h": bh, "num_warps": nw, **t, "rel_err": err})
            best = min(sweep, key=lambda s: s["median_us"])
            default = next(s for s in sweep if s["block_h"] == 4 and s["num_warps"] == 4)
            for name, s in (("correct_best", best), ("correct_default", default)):
                row[name] = {**s, "eff_TBps": bytes_corr / (s["median_us"] * 1e-6) / 1e12}
                row[name]["frac_of_copy"] = row[name]["eff_TBps"] / copy_tbps
            # --- full W-way merge
            msweep = []
            for bh, nw in configs:
                res = torch.full((T, H, D), float("nan"), dtype=torch.bfloat16, device="cuda")
                mlse = torch.full((T, H), float("nan"), dtype=torch.float32, device="cuda")
                lse_merge(outs, lses, base="2", merged=res, merged_lse=mlse, block_h=bh, num_warps=nw)
                err = rel_err(res, ref_m64)
                lerr = (mlse.double() - ref_ml).abs().max().item()
                assert err < 1e-2 and lerr < 1e-4, f"lse_merge wrong: W={W} T={T} rel err {err} lse err {lerr}"
                t = bench(
                    lambda: lse_merge(outs, lses, base="2", merged=res, merged_lse=mlse, block_h=bh, num_warps=nw)  # noqa: F821
                )
                msweep.append({"block_h": bh, "num_warps": nw, **t, "rel_err": err})
            mbest = min(msweep, key=lambda s: s["median_us"])
            row["merge_best"] = {**mbest, "eff_TBps": bytes_merge / (mbest["median_us"] * 1e-6) / 1e12}
            row["merge_best"]["frac_of_copy"] = row["merge_best"]["eff_TBps"] / copy_tbps
            # --- torch baseline
            tm = torch_merge(outs, lses)
            row["torch_merge"] = {**bench(lambda: torch_merge(outs, lses)), "rel_err": rel_err(tm, ref_m64)}  # noqa: F821
            row["correct_sweep"] = sweep
            row["merge_sweep"] = msweep
            rows.append(row)
            print(
                f"W={W} T={T:5d}  correct best {best['median_us']:7.2f} us "
                f"(bh={best['block_h']},nw={best['num_warps']}, "
                f"{row['correct_best']['frac_of_copy'] * 100:5.1f}% copy)  default {default['median_us']:7.2f} us  "
                f"merge {mbest['median_us']:8.2f} us ({row['merge_best']['frac_of_copy'] * 100:5.1f}%)  "
                f"torch {row['torch_merge']['median_us']:8.2f} us",
                flush=True,
            )
            # Freed before the next shape (the timed lambdas above are done with them).
            del outs, lses, ref_m, ref_ml, ref_m64, ref_c64
            torch.cuda.empty_cache()
            bar.update()
    bar.close()
    return {"rows": rows}


def bench_flashinfer() -> dict:
    from dcp_ref.attention import sparse_mla_attention
    from dcp_ref.kernels.flashinfer_mla import FlashInferSparseMLA

    K, N, scale = 2048, 1 << 17, 192**-0.5
    g = torch.Generator(device="cuda").manual_seed(1)
    kv = torch.randn(N, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    rows = []
    for T in (32, 128):
        q = torch.randn(T, H, 576, device="cuda", dtype=torch.bfloat16, generator=g)
        slots = torch.stack([torch.randperm(N, device="cuda", generator=g)[:K] for _ in range(T)]).to(torch.int32)
        counts = torch.full((T,), K, dtype=torch.int32, device="cuda")
        attn = FlashInferSparseMLA(H, scale, device="cuda")
        attn.plan(slots, counts)
        out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
        lse = torch.full((T, H), float("nan"), dtype=torch.float32, device="cuda")
        attn.run(q, kv, out=out, lse=lse, lse_base="2")
        ref_o, ref_l = sparse_mla_attention(q[:8], kv, slots[:8], counts[:8], scale, "2")
        err = rel_err(out[:8], ref_o)
        lerr = (lse[:8].double() - ref_l).abs().max().item()
        assert err <= 1e-2 and lerr <= 1e-3, f"flashinfer wrong: rel err {err}, lse err {lerr}"
        run_t = bench(lambda: attn.run(q, kv, out=out, lse=lse, lse_base="2"))
        run_e_t = bench(lambda: attn.run(q, kv, out=out, lse=lse, lse_base="e"))
        plan_t = bench(lambda: attn.plan(slots, counts))

        def plan_run():
            attn.plan(slots, counts)
            attn.run(q, kv, out=out, lse=lse, lse_base="2")

        both_t = bench(plan_run)
        # Host wall time of plan() (what the CPU loses per layer), measured with the GPU idle.
        plan_host_us = host_us(lambda: attn.plan(slots, counts))
        bytes_kv = T * K * 576 * 2
        rows.append(
            {
                "T": T,
                "H": H,
                "K_valid": K,
                "num_slots": N,
                "page_size": 1,
                "backend": "fa3",
                "dtype": "bfloat16",
                "run": run_t,
                "run_with_base_e_conversion": run_e_t,
                "plan": plan_t,
                "plan_plus_run": both_t,
                "plan_host_wall_us": plan_host_us,
                "kv_bytes_gathered": bytes_kv,
                "kv_gather_TBps": bytes_kv / (run_t["median_us"] * 1e-6) / 1e12,
                "rel_err_vs_fp64_first8": err,
                "lse_base2_abs_err_first8": lerr,
                "accepts_out_buffers": attn.accepts_out_buffers,
            }
        )
        print(
            f"flashinfer T={T:4d}  run {run_t['median_us']:8.2f} us  run+ln2 {run_e_t['median_us']:8.2f} us  "
            f"plan {plan_t['median_us']:8.2f} us  plan+run {both_t['median_us']:8.2f} us  "
            f"(plan host wall {plan_host_us:.1f} us; rel err {err:.2e})",
            flush=True,
        )
    return {"rows": rows}


def graph_time_us(make_call, n: int = 20) -> float:
    """Per-call time of ``n`` back-to-back launches replayed from one CUDA graph (no launch gaps).

    ``make_call(i)`` returns the i-th call; each should touch its own buffers so that the ``n``
    calls together exceed the 50 MB L2 (the data comes from HBM, as after attention).
    """
    calls = [make_call(i) for i in range(n)]
    # one graph call runs all n (each warmed up before the capture); the median replay over n
    return _timing.graph(lambda: [c() for c in calls]).median_us / n


def floor() -> dict:
    """What bounds the T = 32 case: launch floor, a plain copy of the same bytes, graph replay;
    and where plan()'s host time goes."""

    import triton
    import triton.language as tl

    from dcp_ref.kernels.flashinfer_mla import FlashInferSparseMLA, build_compact_csr
    from dcp_ref.kernels.lse_merge_triton import lse_correct, lse_merge

    @triton.jit
    def _noop(p):
        tl.store(p, 1.0)

    one = torch.zeros(1, device="cuda")
    res: dict[str, Any] = {"empty_triton_kernel": bench(lambda: _noop[(1,)](one))}
    T = 32
    src = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    res["torch_copy_T32"] = bench(lambda: dst.copy_(src))
    srcs = [torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(20)]
    dsts = [torch.empty_like(x) for x in srcs]
    res["torch_copy_T32_graph_us"] = graph_time_us(lambda i: lambda: dsts[i].copy_(srcs[i]))
    rows = []
    for W in (2, 4, 8):
        outs = [torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(20)]
        lses = torch.randn(W, T, H, device="cuda") * 3
        bufs = [torch.empty_like(x) for x in outs]
        row: dict[str, Any] = {
            "W": W,
            "T": T,
            "correct_do_bench": [
                bench(lambda: lse_correct(outs[0], lses, 1, base="2", corrected=bufs[0]))["median_us"] for _ in range(3)
            ],
            "correct_graph_us": graph_time_us(
                lambda i: lambda: lse_correct(outs[i], lses, 1, base="2", corrected=bufs[i])
            ),
        }
        parts = [torch.randn(W, T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        mbufs = [torch.empty(T, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(8)]
        row["merge_graph_us"] = graph_time_us(
            lambda i: lambda: lse_merge(parts[i], lses, base="2", merged=mbufs[i]), n=8
        )
        rows.append(row)
        print(
            f"floor W={W}: correct do_bench {row['correct_do_bench']} us, graph {row['correct_graph_us']:.2f} us; "
            f"merge graph {row['merge_graph_us']:.2f} us",
            flush=True,
        )
    res["rows"] = rows
    print(
        f"empty kernel {res['empty_triton_kernel']['median_us']:.2f} us, "
        f"torch copy T=32 {res['torch_copy_T32']['median_us']:.2f} us, "
        f"graph {res['torch_copy_T32_graph_us']:.2f} us",
        flush=True,
    )
    # plan() breakdown (host wall, GPU idle), T = 32, K = 2048
    K, N = 2048, 1 << 17
    slots = torch.stack([torch.randperm(N, device="cuda")[:K] for _ in range(T)]).to(torch.int32)
    counts = torch.full((T,), K, dtype=torch.int32, device="cuda")
    attn = FlashInferSparseMLA(H, 192**-0.5, device="cuda")
    attn.plan(slots, counts)

    csr = build_compact_csr(slots, counts)
    total = int(csr.kv_indptr[-1])
    meta = attn._fmla.MLAPlanMetadata.csr(csr.qo_indptr, csr.kv_indptr, csr.kv_indices[:total], csr.kv_len)
    kw = dict(
        metadata=meta,
        num_heads=H,
        head_dim_ckv=512,
        head_dim_kpe=64,
        page_size=1,
        causal=False,
        sm_scale=192**-0.5,
        q_data_type=torch.bfloat16,
        kv_data_type=torch.bfloat16,
        lse_mode="base2",
    )
    res["plan_breakdown_T32_K2048_host_us"] = {
        "build_compact_csr": host_us(lambda: build_compact_csr(slots, counts)),
        "flashinfer_wrapper_plan_only": host_us(lambda: attn._wrapper.plan(**kw)),
        "FlashInferSparseMLA.plan_total": host_us(lambda: attn.plan(slots, counts)),
    }
    print(
        "plan breakdown (host us):",
        {k: round(v, 1) for k, v in res["plan_breakdown_T32_K2048_host_us"].items()},
        flush=True,
    )
    return res


def sanitize() -> None:
    """Small launches with ragged shapes (H, D not multiples of the block) for compute-sanitizer."""
    from dcp_ref.kernels.lse_merge_triton import lse_correct, lse_merge

    for W, T, h, d, bh in ((3, 5, 13, 40, 4), (8, 2, 128, 512, 8), (1, 3, 7, 512, 2)):
        outs = torch.randn(W, T, h, d, device="cuda", dtype=torch.bfloat16)
        lses = torch.randn(W, T, h, device="cuda")
        lses[0, 0] = float("nan")
        lse_merge(outs, lses, base="e", merged_lse=torch.empty(T, h, device="cuda"), block_h=bh)
        lse_correct(
            outs[W - 1],
            lses,
            W - 1,
            base="2",
            corrected=outs[W - 1],
            merged_lse=torch.empty(T, h, device="cuda"),
            block_h=bh,
        )
    torch.cuda.synchronize()
    print("sanitize launches done")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--skip-flashinfer", action="store_true")
    ap.add_argument(
        "--floor", action="store_true", help="only the T=32 floor study and the plan() breakdown -> lse_floor.json"
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.sanitize:
        sanitize()
        return 0
    meta = {**_meta.device(), **_meta.versions(), "date_utc": _meta.now_utc()}
    if args.floor:
        out = args.out or Path(os.environ.get("OUT", "."))
        out.mkdir(parents=True, exist_ok=True)
        (out / "lse_floor.json").write_text(json.dumps({**meta, **floor()}, indent=1))
        return 0
    copy_tbps = _meta.copy_bandwidth() / 1e12
    print(f"{meta['device']}: copy bandwidth {copy_tbps:.2f} TB/s (issue: {ISSUE_COPY_TBPS})", flush=True)
    merge = bench_merge(copy_tbps)
    common = {
        **meta,
        "copy_TBps_measured": copy_tbps,
        "copy_TBps_issue": ISSUE_COPY_TBPS,
        "timing": _timing.describe("eager", flush_l2=True)
        + "; *_graph_us: "
        + _timing.describe("graph", "n")
        + "; host_us: "
        + _timing.describe("host", 10),
    }
    res_merge = {
        **common,
        "targets": {
            "T1024_frac_of_copy": 0.8,
            "T32_us": 5.0,
            "vllm_correct_attn_out_us": {"T32": [7.4, 7.7], "T1024": [98, 104]},
            "torch_merge_us": {"T32": [155, 190], "T1024": [1300, 4400]},
        },
        **merge,
    }
    out = args.out or Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    (out / "lse_merge.json").write_text(json.dumps(res_merge, indent=1))
    if not args.skip_flashinfer:
        fi = bench_flashinfer()
        (out / "attention_flashinfer.json").write_text(json.dumps({**common, **fi}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
