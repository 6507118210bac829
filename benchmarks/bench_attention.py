#!/usr/bin/env python3
"""Sparse MLA decode attention on the H200: the split-KV Triton kernel vs FlashMLA (bf16 sparse, FP8 decode).

    source .gpu/flashinfer/env.sh && python3 benchmarks/bench_attention.py --out DIR   # -> DIR/attention.json
    python3 benchmarks/bench_attention.py --smoke --out /tmp/x                          # tiny shapes, a few configs

One rank's attention stage (W = 1: every chosen key is local), ``T`` query tokens x ``H`` heads over ``K``
chosen slots per token (distinct random rows of a 131072-row cache: 151 MB bf16 / 86 MB FP8, above the 50 MB
L2), DeepSeek's geometry (Dqk = 576, Dv = 512, sm_scale = 192**-0.5):

* ``splitkv`` — :func:`dcp_ref.kernels.attention_splitkv_triton.splitkv_attention` (the stage, its default
  plan; bf16 cache, compact slots + counts), for H in {16, 32, 64, 128} (the heads of a TP rank);
* ``flashmla_bf16`` — :func:`dcp_ref.kernels.flashmla_sparse.sparse_mla_flashmla` (the stage: FlashMLA's SM90
  sparse kernel with its prologue / epilogue), H = 128 (it takes 64 or 128);
* ``flashmla_fp8`` — :class:`dcp_ref.kernels.flashmla_fp8.FlashMLAFp8Decode` over the 656-byte FP8 cache
  (masked layout; at W = 1 the same slots), H = 128.

Rows of ``summary``: ``{"impl", "T", "K", "H", "cache", "graph_us", "floor_us", "rel_err", "ctas", "sm_busy"}``.
``graph_us``: median per call of a CUDA graph of 20 back-to-back calls (``_timing.graph``: its warm-up and
median of replays; no L2 flush). ``floor_us``: ``max(bytes / copy bandwidth measured in this run,
FLOPs / 989 TFLOPS)`` with bytes =
``T*K*bytes_per_row + q + out`` and FLOPs = ``2*T*H*K*(576 + 512)``. ``rel_err``: ``||out - ref|| / ||ref||``
against the float64 reference (:mod:`dcp_ref.attention`, :func:`dcp_ref.fp8_cache.sparse_mla_attention_fp8`
for FP8) on the inputs timed (T <= 32; outputs poisoned with NaN first). ``ctas``: phase-1 programs of the
split-KV kernel (``sm_busy = min(ctas, SMs) / SMs``); for FlashMLA's bf16 kernel, ``T * H / 64`` per split.

The ``flashmla_splits`` section times FlashMLA's bf16 stage at each ``splits`` (each token's slots cut into that
many kernel rows, merged by LSE: :mod:`dcp_ref.kernels.flashmla_sparse`) for H in {64, 128}, K = 2048 and T from 1
to 128 (``--only-splits``: that section alone, into ``attention_flashmla_splits.json``); ``flashmla_splits_best``
is the fastest per shape, the data of :data:`~dcp_ref.kernels.flashmla_sparse.FLASHMLA_SPLITS`. The main table's
``flashmla_bf16`` rows run the planned splits (:func:`~dcp_ref.kernels.flashmla_sparse.flashmla_splits` of T, H and
K: a step of topk = K at one rank; ``ctas`` = ``T * H / 64`` times the splits).

The ``sweep`` section times launch configurations (``block_h``, ``block_n``, ``num_warps``, ``num_stages``)
x ``num_splits`` per shape and prints the best per shape next to the default plan's time, i.e. what
:func:`splitkv_plan`'s defaults should be.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import _meta  # noqa: E402
import _timing  # noqa: E402  (the benchmarks' folder is on sys.path)

from dcp_ref.attention import sparse_mla_attention  # noqa: E402
from dcp_ref.fp8_cache import FP8_DS_MLA, quantize_kv_fp8, sparse_mla_attention_fp8  # noqa: E402
from dcp_ref.kernels.attention_splitkv_triton import TUNING_CONFIGS as SWEEP_CONFIGS  # noqa: E402

DQK, DV = 576, 512
SM_SCALE = 192**-0.5  # DeepSeek V3.2: 1 / sqrt(128 + 64)
PEAK_BF16_FLOPS = 989e12  # H200 SXM, dense bf16 tensor cores
CACHE_ROWS = 131072

SWEEP_SPLITS = (1, 2, 4, 8, 16, 32, 64)
FLASHMLA_SWEEP_SPLITS = (1, 2, 4, 8, 16)  # K = 2048: a split is at least the kernel's 128-slot width multiple
FLASHMLA_SWEEP_T = (1, 2, 4, 8, 16, 32, 64, 128)


def floor_us(T: int, H: int, K: int, row_bytes: int, bw: float) -> tuple[float, float, float]:
    nbytes = T * K * row_bytes + T * H * (DQK + DV) * 2
    flops = 2.0 * T * H * K * (DQK + DV)
    mem, comp = nbytes / bw * 1e6, flops / PEAK_BF16_FLOPS * 1e6
    return max(mem, comp), mem, comp


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    fin = torch.isfinite(ref)
    return ((out.double()[fin] - ref[fin]).norm() / ref[fin].norm().clamp_min(1e-300)).item()


class Inputs:
    """One shape's inputs (on the device), the cache shared by all shapes."""

    def __init__(self, data: dict, T: int, H: int, K: int, gen: torch.Generator) -> None:
        dev = data["kv"].device
        S = data["kv"].shape[0]
        self.T, self.H, self.K = T, H, K
        self.q = torch.randn(T, H, DQK, generator=gen, device=dev).bfloat16()
        self.slots = torch.rand(T, S, generator=gen, device=dev).topk(K, dim=1).indices.int().contiguous()
        self.counts = torch.full((T,), K, dtype=torch.int32, device=dev)
        self.out = torch.empty(T, H, DV, dtype=torch.bfloat16, device=dev)
        self.lse = torch.empty(T, H, dtype=torch.float32, device=dev)
        self._ref: dict = {}

    def reference(self, data: dict, cache: str) -> tuple[torch.Tensor, torch.Tensor]:
        if cache not in self._ref:
            if cache == "bf16":
                self._ref[cache] = sparse_mla_attention(self.q, data["kv"], self.slots, self.counts, SM_SCALE)
            else:
                self._ref[cache] = sparse_mla_attention_fp8(self.q, data["fp8"], self.slots, None, SM_SCALE)
        return self._ref[cache]


def measure(
    impl: str, cache: str, inp: Inputs, run: Callable[[], object], data: dict, bw: float, check: bool, extra: dict
) -> dict:
    T, H, K = inp.T, inp.H, inp.K
    row_bytes = FP8_DS_MLA.bytes_per_token if cache == "fp8" else FP8_DS_MLA.bf16_bytes_per_token
    fl, mem, comp = floor_us(T, H, K, row_bytes, bw)
    entry = {"impl": impl, "T": T, "K": K, "H": H, "cache": cache, "graph_us": None, "floor_us": fl,
             "floor_mem_us": mem, "floor_compute_us": comp, "rel_err": None, **extra}  # fmt: skip
    try:
        if check:
            inp.out.fill_(math.nan)
            inp.lse.fill_(math.nan)
            run()
            torch.cuda.synchronize()
            ref_o, ref_l = inp.reference(data, cache)
            entry["rel_err"] = rel_err(inp.out, ref_o)
            fin = torch.isfinite(ref_l)
            entry["lse_max_abs_err"] = (inp.lse[fin].double() - ref_l[fin]).abs().max().item()
        entry["graph_us"] = _timing.graph(run, calls=20).median_us
    except Exception as e:
        entry["error"] = f"{type(e).__name__}: {e}"[:400]
        traceback.print_exc()
    return entry


def main_table(data: dict, Ts, Ks, Hs_ours, gen, bw: float, sms: int, result: dict, save) -> None:
    from dcp_ref.kernels.attention_splitkv_triton import splitkv_attention, splitkv_plan

    try:
        import flash_mla  # noqa: F401

        from dcp_ref.kernels.flashmla_fp8 import FlashMLAFp8Decode
        from dcp_ref.kernels.flashmla_sparse import flashmla_splits, sparse_mla_flashmla

        fp8_dec = FlashMLAFp8Decode(data["kv"].device, validate=False)
        have_fm = True
    except Exception as e:
        result["flashmla_error"] = f"{type(e).__name__}: {e}"[:300]
        have_fm = False
    summary = result["summary"]
    for K in Ks:
        for T in Ts:
            for H in sorted(set(Hs_ours) | {128}):
                inp = Inputs(data, T, H, K, gen)
                check = T <= 32
                plan = splitkv_plan(T, H, K, inp.q.device)
                cfg = {"block_h": plan.block_h, "block_n": plan.block_n, "num_splits": plan.num_splits,
                       "num_warps": plan.num_warps, "num_stages": plan.num_stages}  # fmt: skip
                if H in Hs_ours:
                    summary.append(
                        measure(
                            "splitkv", "bf16", inp,
                            lambda inp=inp: splitkv_attention(inp.q, data["kv"], inp.slots, inp.counts, SM_SCALE, DV,
                                                              out=inp.out, out_lse=inp.lse),
                            data, bw, check,
                            {"ctas": plan.ctas, "combine_ctas": plan.combine_ctas,
                             "sm_busy": min(plan.ctas, sms) / sms, "config": cfg},
                        )
                    )  # fmt: skip
                if H == 128 and have_fm:
                    fm_kw = (
                        {"validate": False} if "validate" in inspect.signature(sparse_mla_flashmla).parameters else {}
                    )
                    n_split = flashmla_splits(T, H, K)  # what a step of topk = K plans at one rank
                    summary.append(
                        measure(
                            "flashmla_bf16", "bf16", inp,
                            lambda inp=inp, n=n_split: sparse_mla_flashmla(
                                inp.q, data["kv"], inp.slots, inp.counts, SM_SCALE, DV, out=inp.out, out_lse=inp.lse,
                                splits=n, **fm_kw),
                            data, bw, check,
                            {"ctas": T * H // 64 * n_split, "sm_busy": min(T * H // 64 * n_split, sms) / sms,
                             "splits": n_split},
                        )
                    )  # fmt: skip
                    summary.append(
                        measure(
                            "flashmla_fp8", "fp8", inp,
                            lambda inp=inp: fp8_dec.attention(inp.q, data["fp8"], inp.slots, None, SM_SCALE, DV,
                                                              out=inp.out, out_lse=inp.lse),
                            data, bw, check, {"ctas": None, "sm_busy": None},
                        )
                    )  # fmt: skip
                for e in summary[-3:]:
                    if e["T"] == T and e["K"] == K and e["H"] == H:
                        g = f"{e['graph_us']:8.1f}" if e.get("graph_us") is not None else "       -"
                        r = f"{e['rel_err']:.1e}" if e.get("rel_err") is not None else "-"
                        print(f"  {e['impl']:14s} T={T:4d} K={K:5d} H={H:4d} {g} us  floor {e['floor_us']:6.1f}  "
                              f"err {r}  ctas {e.get('ctas')}", flush=True)  # fmt: skip
                save()
                del inp
                torch.cuda.empty_cache()


def flashmla_splits_sweep(
    data: dict, Ts, Hs, K: int, splits_list, gen, bw: float, result: dict, save, shares=((32, 256), (32, 512))
) -> None:
    """FlashMLA's bf16 stage at every ``splits`` per ``(T, H)``; the fastest per shape into ``flashmla_splits_best``
    (each row checked against the float64 reference where ``T <= 32``). ``shares``: ``(T, count)`` at H = 128 with
    only ``count`` of the ``K`` slots used (a DCP rank's share of the winners: ``k / W``), rows with ``"count"``."""
    try:
        from dcp_ref.kernels.flashmla_sparse import sparse_mla_flashmla
    except Exception as e:  # pragma: no cover - depends on the device
        result["flashmla_splits_error"] = f"{type(e).__name__}: {e}"[:300]
        return
    rows, best = result["flashmla_splits"], result["flashmla_splits_best"]

    def at_splits(inp: Inputs, n: int, check: bool, extra: dict) -> dict:  # one timed row of FlashMLA at n splits
        e = measure(
            "flashmla_bf16", "bf16", inp,
            lambda: sparse_mla_flashmla(inp.q, data["kv"], inp.slots, inp.counts, SM_SCALE, DV, out=inp.out,
                                        out_lse=inp.lse, splits=n),
            data, bw, check, {"splits": n, "ctas": inp.T * inp.H // 64 * n, **extra},
        )  # fmt: skip
        rows.append(e)
        print(f"  flashmla T={inp.T:4d} H={inp.H:4d} K={K:5d} splits={n:3d} {extra}: {e['graph_us']} us  "
              f"err {e['rel_err']}", flush=True)  # fmt: skip
        return e

    for H in Hs:
        for T in Ts:
            inp = Inputs(data, T, H, K, gen)
            shape_rows = [at_splits(inp, n, T <= 32, {}) for n in splits_list]
            from dcp_ref.kernels.attention_splitkv_triton import splitkv_attention

            sk = measure(  # the other bf16 kernel at the same shape, in the same run: where the step's crossover lies
                "splitkv", "bf16", inp,
                lambda inp=inp: splitkv_attention(inp.q, data["kv"], inp.slots, inp.counts, SM_SCALE, DV,
                                                  out=inp.out, out_lse=inp.lse),
                data, bw, T <= 32, {},
            )  # fmt: skip
            rows.append(sk)
            print(f"  splitkv  T={T:4d} H={H:4d} K={K:5d}: {sk['graph_us']} us", flush=True)
            ok = [e for e in shape_rows if e.get("graph_us") is not None]
            if ok:
                b = min(ok, key=lambda e: e["graph_us"])
                one = next((e["graph_us"] for e in ok if e["splits"] == 1), None)
                best.append({"T": T, "H": H, "K": K, "ctas_unsplit": T * H // 64, "splits": b["splits"],
                             "graph_us": b["graph_us"], "one_split_us": one, "splitkv_us": sk.get("graph_us"),
                             "floor_us": b["floor_us"]})  # fmt: skip
            save()
            del inp
            torch.cuda.empty_cache()
    for T, n_used in shares:
        inp = Inputs(data, T, 128, K, gen)
        inp.counts.fill_(n_used)
        for n in splits_list:
            at_splits(inp, n, True, {"count": n_used})
        save()
        del inp
        torch.cuda.empty_cache()


def sweep(data: dict, shapes, gen, sms: int, result: dict, save, configs, splits_list, deadline: float) -> None:
    from dcp_ref.kernels.attention_splitkv_triton import sparse_mla_splitkv, splitkv_plan, workspace_for

    rows = result["sweep"]
    best_rows = result["sweep_best"]
    for T, H, K in shapes:
        if time.time() > deadline:
            result["sweep_stopped"] = f"deadline reached before T={T}, H={H}, K={K}"
            break
        inp = Inputs(data, T, H, K, gen)
        default = splitkv_plan(T, H, K, inp.q.device)
        tried = set()
        shape_rows = []
        cands = [(default.block_h, default.block_n, default.num_warps, default.num_stages, default.num_splits, True)]
        for bh, bn, nw, ns in configs:
            if bh > max(16, H):
                continue
            for s in splits_list:
                blocks = -(-K // bn)
                ctas = T * -(-H // bh) * s
                if s > blocks or ctas > 16 * sms:
                    continue  # a split with no key at all, or far more programs than the SMs can hold
                cands.append((bh, bn, nw, ns, s, False))
        for bh, bn, nw, ns, s, is_default in cands:
            if time.time() > deadline:
                result["sweep_stopped"] = f"deadline reached in T={T}, H={H}, K={K}"
                break
            plan = splitkv_plan(T, H, K, inp.q.device, num_splits=s, block_h=bh, block_n=bn, num_warps=nw,
                                num_stages=ns)  # fmt: skip
            key = (plan.block_h, plan.block_n, plan.num_warps, plan.num_stages, plan.num_splits)
            if key in tried and not is_default:
                continue
            tried.add(key)
            ws = workspace_for(plan, inp.q.device)
            entry = {"T": T, "H": H, "K": K, "block_h": bh, "block_n": bn, "num_warps": nw, "num_stages": ns,
                     "num_splits": plan.num_splits, "split_len": plan.split_len, "ctas": plan.ctas,
                     "default": is_default, "graph_us": None}  # fmt: skip
            try:

                def run(plan=plan, ws=ws, inp=inp):
                    return sparse_mla_splitkv(inp.q, data["kv"], inp.slots, inp.counts, SM_SCALE, DV, out=inp.out,
                                              out_lse=inp.lse, workspace=ws, validate=False, plan=plan)  # fmt: skip

                inp.out.fill_(math.nan)
                run()
                torch.cuda.synchronize()
                if not bool(torch.isfinite(inp.out).all()):
                    raise RuntimeError("non-finite output on finite data")
                entry["graph_us"] = _timing.graph(run, calls=10, rule=_timing.SWEEP).median_us
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(entry)
            shape_rows.append(entry)
        ok = [r for r in shape_rows if r.get("graph_us") is not None]
        if ok:
            best = min(ok, key=lambda r: r["graph_us"])
            dflt = next((r for r in ok if r["default"]), None)
            best_rows.append({"T": T, "H": H, "K": K, "best": best, "default_us": dflt["graph_us"] if dflt else None,
                              "default_config": {k: dflt[k] for k in ("block_h", "block_n", "num_warps",
                                                 "num_stages", "num_splits")} if dflt else None})  # fmt: skip
            d = f"{dflt['graph_us']:7.1f}" if dflt else "      -"
            print(f"  sweep T={T:4d} H={H:4d} K={K:5d}: default {d} us | best {best['graph_us']:7.1f} us "
                  f"bh={best['block_h']} bn={best['block_n']} nw={best['num_warps']} ns={best['num_stages']} "
                  f"splits={best['num_splits']} ctas={best['ctas']}", flush=True)  # fmt: skip
        save()
        del inp
        torch.cuda.empty_cache()


def kernel_breakdown(data: dict, shapes, gen, result: dict, save) -> None:
    """Device time of each kernel of the stage (torch.profiler, 20 eager calls after warm-up): phase 1 vs the
    combine, next to FlashMLA's kernels at H = 128."""
    from torch.profiler import ProfilerActivity, profile

    from dcp_ref.kernels.attention_splitkv_triton import splitkv_attention

    fns: dict = {"splitkv": lambda *a, splits, **k: splitkv_attention(*a, **k)}
    try:
        from dcp_ref.kernels.flashmla_sparse import flashmla_splits, sparse_mla_flashmla

        # FlashMLA as the stage plans it for the shape (its splits), the prologue / epilogue included
        fns["flashmla_bf16"] = lambda *a, splits, **k: sparse_mla_flashmla(*a, **k, validate=False, splits=splits)
    except Exception:
        pass
    for T, H, K in shapes:
        inp = Inputs(data, T, H, K, gen)
        for impl, fn in fns.items():
            if impl != "splitkv" and H not in (64, 128):
                continue
            try:
                n = flashmla_splits(T, H, K) if impl == "flashmla_bf16" else 1

                def call(fn=fn, inp=inp, n=n):
                    return fn(inp.q, data["kv"], inp.slots, inp.counts, SM_SCALE, DV, out=inp.out, out_lse=inp.lse,
                              splits=n)  # fmt: skip

                for _ in range(3):
                    call()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(20):
                        call()
                    torch.cuda.synchronize()
                kernels = {}
                for evt in prof.key_averages():
                    tot = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
                    if tot and evt.count:
                        kernels[evt.key[:80]] = {"us": tot / evt.count, "count": evt.count}
                result["kernel_breakdown"].append({"impl": impl, "T": T, "H": H, "K": K, "splits": n,
                                                   "kernels": kernels})  # fmt: skip
                print(f"  {impl:14s} T={T} H={H} K={K}: "
                      + ", ".join(f"{k[:40]} {v['us']:.1f}us x{v['count'] // 20}" for k, v in kernels.items()),
                      flush=True)  # fmt: skip
            except Exception as e:
                result["kernel_breakdown"].append({"impl": impl, "T": T, "H": H, "K": K, "error": str(e)[:300]})
        save()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, a few configs (checks the script)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the launch-config sweep")
    ap.add_argument("--sweep-only", action="store_true", help="only the launch-config sweep")
    ap.add_argument("--only-splits", action="store_true", help="only FlashMLA's splits sweep")
    ap.add_argument("--budget-s", type=float, default=520.0, help="stop the sweep after this many seconds in all")
    ap.add_argument("--note", default="", help="how the run was made (kept in the JSON)")
    args = ap.parse_args()
    t_start = time.time()
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention.py needs a CUDA GPU")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    gen = torch.Generator(device=dev).manual_seed(0)
    S = 8192 if args.smoke else CACHE_ROWS
    kv = torch.randn(S, DQK, generator=gen, device=dev).bfloat16()
    data = {"kv": kv, "fp8": quantize_kv_fp8(kv)}
    bw = _meta.copy_bandwidth(dev)
    result: dict = {
        "benchmark": "bench_attention",
        "what": "sparse MLA decode attention of one rank: split-KV Triton kernel vs FlashMLA bf16 sparse / FP8 decode",
        "device": _meta.device()["device"],
        "versions": {**_meta.device(), **_meta.versions()},
        "date_utc": _meta.now_utc(),
        "note": args.note,
        "config": {
            "Dqk": DQK,
            "Dv": DV,
            "sm_scale": SM_SCALE,
            "cache_rows": S,
            "sm_count": sms,
            "copy_bandwidth_TBps": bw / 1e12,
            "peak_bf16_TFLOPS": PEAK_BF16_FLOPS / 1e12,
            "timing": _timing.describe("graph", 20)
            + "; no L2 flush (sweep: "
            + _timing.describe("graph", 10, _timing.SWEEP)
            + ")",
            "slots": "K distinct random rows per token (all valid, counts = K), the same for every implementation",
        },
        "summary": [],
        "sweep": [],
        "sweep_best": [],
        "flashmla_splits": [],
        "flashmla_splits_best": [],
        "kernel_breakdown": [],
    }
    path = out_dir / ("attention_flashmla_splits.json" if args.only_splits else "attention.json")

    def save() -> None:
        path.write_text(json.dumps(result, indent=1) + "\n")

    print(f"copy bandwidth {bw / 1e12:.2f} TB/s, {sms} SMs", flush=True)
    if args.smoke:
        Ts, Ks, Hs = (1, 4), (256,), (16, 128)
        shapes = [(1, 128, 256), (4, 16, 256)]
        configs, splits = SWEEP_CONFIGS[:2] + SWEEP_CONFIGS[-1:], (1, 4)
    else:
        Ts, Ks, Hs = (1, 2, 4, 8, 32, 128), (1024, 2048), (16, 32, 64, 128)
        shapes = [(T, 128, 2048) for T in (1, 2, 4, 8, 32, 128)]
        shapes += [(1, 16, 2048), (32, 16, 2048), (1, 64, 2048), (32, 64, 2048), (1, 128, 1024), (32, 128, 1024)]
        shapes += [(1, 32, 2048), (8, 16, 2048)]
        configs, splits = SWEEP_CONFIGS, SWEEP_SPLITS
    if args.only_splits:
        print("== FlashMLA splits", flush=True)
        fs_T = (1, 32) if args.smoke else FLASHMLA_SWEEP_T
        flashmla_splits_sweep(data, fs_T, (128,) if args.smoke else (64, 128), 256 if args.smoke else 2048,
                              (1, 2) if args.smoke else FLASHMLA_SWEEP_SPLITS, gen, bw, result, save)  # fmt: skip
        result["elapsed_s"] = time.time() - t_start
        save()
        for b in result["flashmla_splits_best"]:
            print(
                f"  T={b['T']:4d} H={b['H']:4d}: best splits {b['splits']:3d} {b['graph_us']:7.1f} us "
                f"(1 split: {b['one_split_us']}; split-KV {b['splitkv_us']}; floor {b['floor_us']:.1f})"
            )
        print("wrote", path)
        return
    if not args.sweep_only:
        print("== main table", flush=True)
        main_table(data, Ts, Ks, Hs, gen, bw, sms, result, save)
    if not args.sweep_only:
        print("== kernel breakdown", flush=True)
        kernel_breakdown(data, [(1, 128, 2048), (32, 128, 2048), (128, 128, 2048)][: 1 if args.smoke else 3], gen,
                         result, save)  # fmt: skip
    if not args.no_sweep:
        print("== sweep", flush=True)
        sweep(data, shapes, gen, sms, result, save, configs, splits, t_start + args.budget_s)
    result["elapsed_s"] = time.time() - t_start
    save()
    print(f"{'impl':14s} {'T':>4s} {'K':>5s} {'H':>4s} {'graph_us':>9s} {'floor_us':>9s} {'rel_err':>9s} {'ctas':>5s}")
    for e in result["summary"]:
        g = f"{e['graph_us']:9.1f}" if e.get("graph_us") is not None else f"{'-':>9s}"
        r = f"{e['rel_err']:9.1e}" if e.get("rel_err") is not None else f"{'-':>9s}"
        c = f"{e['ctas']:5d}" if e.get("ctas") is not None else f"{'-':>5s}"
        print(f"{e['impl']:14s} {e['T']:4d} {e['K']:5d} {e['H']:4d} {g} {e['floor_us']:9.1f} {r} {c}"
              + (f"  ERROR {e['error'][:60]}" if "error" in e else ""))  # fmt: skip
    print("suggested defaults (best sweep config per shape):")
    for b in result["sweep_best"]:
        x = b["best"]
        print(f"  T={b['T']:4d} H={b['H']:4d} K={b['K']:5d}: block_h={x['block_h']} block_n={x['block_n']} "
              f"num_warps={x['num_warps']} num_stages={x['num_stages']} num_splits={x['num_splits']} "
              f"({x['graph_us']:.1f} us; default {b['default_us']})")  # fmt: skip
    print("wrote", path, f"in {result['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
