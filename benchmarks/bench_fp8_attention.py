#!/usr/bin/env python3
"""FP8 masked decode vs bf16 compact decode vs FlashInfer FA3, on the H200 (sparse MLA, H = 128).

    source .gpu/flashinfer/env.sh && python3 benchmarks/bench_fp8_attention.py --out DIR   # -> DIR/fp8_attention.json
    python3 benchmarks/bench_fp8_attention.py --smoke --out /tmp/x                          # tiny shapes, any machine

Three ways to run one rank's sparse attention, for T in {1, 32, 128} query tokens and K in
{1024, 2048} chosen keys per token, on one GPU (W = 1: every key is local) and on one rank's
share under W = 2 (each key is local with probability 1/2, so about K/2 valid entries per row):

* ``flashmla_fp8_masked`` — :class:`dcp_ref.kernels.flashmla_fp8.FlashMLAFp8Decode`: FlashMLA's
  FP8 sparse decode over the 656-byte cache, fed the **uncompacted** ``[T, K]`` slots (``-1``
  scattered where the key lives on the other rank); the wrapper's index prep and LSE/out finish
  included. The kernel walks all K entries.
* ``flashmla_bf16_compact`` — ``flash_mla.flash_mla_sparse_fwd(..., topk_length=counts,
  use_legacy=True)`` over the bf16 cache (1152 bytes per token), slots compacted to the front
  with per-row lengths: work over the valid entries only.
* ``flashinfer_fa3`` — :class:`dcp_ref.kernels.flashinfer_mla.FlashInferSparseMLA` (bf16,
  compact CSR). ``plan()`` (a host sync, 0.6–1.1 ms) runs before capture and is *not* timed.

``graph_us``: median time per call of a CUDA-graph replay of the call (``_timing.graph``: replays back to back;
no L2 flush; the caches hold 131072 rows: 86 MB FP8, 151 MB bf16, above the
50 MB L2). ``rel_err``: ``||out - ref||_F / ||ref||_F`` against the float64 reference over the
cache the kernel reads (FP8: :func:`dcp_ref.fp8_cache.sparse_mla_attention_fp8`, which
dequantizes as the kernel does; bf16: :func:`dcp_ref.attention.sparse_mla_attention`). Each
output buffer is poisoned with NaN before the checked call.

Details per configuration (``details``): the FP8 error against the *unquantized* bf16 values
(what FP8 costs), the raw FlashMLA FP8 call with a reused schedule and with a fresh
``get_mla_metadata()`` per call (the issue's 58 µs / 77 µs included the scheduler), and for W = 2
the slot stage on the Triton kernels: conversion alone (what the masked layout needs) vs
conversion + compaction (what the compact layouts need).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
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
from dcp_ref.geometry import DcpGeometry  # noqa: E402

H, DQK, DV = 128, 576, 512
SM_SCALE = 192**-0.5  # DeepSeek V3.2: 1 / sqrt(128 + 64)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def make_rows(T: int, K: int, S: int, W: int, gen: torch.Generator, dev: torch.device) -> dict:
    """Chosen rows (distinct per token), the masked layout for this rank and its compaction."""
    slots = torch.rand(T, S, generator=gen, device=dev).topk(K, dim=1).indices  # K distinct rows per token
    if W > 1:
        local = torch.rand(T, K, generator=gen, device=dev) < 1.0 / W  # which chosen keys live here
        masked = torch.where(local, slots, -1)
    else:
        masked = slots
    valid = masked >= 0
    counts = valid.sum(1).to(torch.int32)
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    compact = torch.where(torch.arange(K, device=dev) < counts[:, None].long(), torch.gather(masked, 1, order), -1)
    return dict(masked=masked.int().contiguous(), compact=compact.int().contiguous(), counts=counts)


def bench_config(T: int, K: int, W: int, data: dict, gen: torch.Generator, quick: bool) -> tuple[list, dict]:
    dev = data["kv"].device
    rows = make_rows(T, K, data["kv"].shape[0], W, gen, dev)
    q = torch.randn(T, H, DQK, generator=gen, device=dev).bfloat16()
    kv, fp8 = data["kv"], data["fp8"]
    summary, det = [], {"T": T, "K": K, "W": W, "valid_per_row_mean": rows["counts"].float().mean().item()}
    rule = _timing.SWEEP if quick else _timing.STANDARD
    timer = lambda fn: _timing.graph(fn, rule=rule).median_us  # noqa: E731

    def record(
        impl: str, run: Callable[[], tuple[torch.Tensor, torch.Tensor]], ref: tuple, out: torch.Tensor, extra=None
    ):
        entry = {"impl": impl, "T": T, "K": K, "W": W, "graph_us": None, "rel_err": None}
        try:
            out.fill_(math.nan)
            o, l = run()
            torch.cuda.synchronize()
            entry["rel_err"] = rel_err(o, ref[0])
            fin = torch.isfinite(ref[1])
            det[f"{impl}_lse_max_abs_err"] = (
                (l[fin].double() - ref[1][fin]).abs().max().item() if bool(fin.any()) else 0.0
            )
            det[f"{impl}_empty_rows_ok"] = bool(torch.isneginf(l[~fin]).all()) if bool((~fin).any()) else True
            try:
                entry["graph_us"] = timer(run)
            except Exception as e:  # a library call that cannot be captured: time it eagerly instead
                det[f"{impl}_graph_error"] = f"{type(e).__name__}: {e}"[:300]
                entry["eager_us"] = _timing.eager(run, flush_l2=True).median_us
        except Exception as e:
            entry["error"] = f"{type(e).__name__}: {e}"[:300]
            traceback.print_exc()
        if extra:
            entry.update(extra)
        summary.append(entry)

    def setup_failed(impl: str, e: Exception) -> None:
        """An implementation that could not even be set up (missing library, unsupported shape): recorded."""
        summary.append(
            {"impl": impl, "T": T, "K": K, "W": W, "graph_us": None, "rel_err": None,
             "error": f"{type(e).__name__}: {e}"[:300]}
        )  # fmt: skip
        traceback.print_exc()

    # -- FP8, masked layout (FlashMLA sparse decode) --
    ref_fp8 = sparse_mla_attention_fp8(q, fp8, rows["masked"], None, SM_SCALE)
    ref_bf16 = sparse_mla_attention(q, kv, rows["compact"], rows["counts"], SM_SCALE)
    det["fp8_vs_unquantized_rel_err_of_reference"] = rel_err(ref_fp8[0], ref_bf16[0])
    ob = torch.empty(T, H, DV, device=dev, dtype=torch.bfloat16)
    lb = torch.empty(T, H, device=dev, dtype=torch.float32)
    masked = rows["masked"]
    try:
        from dcp_ref.kernels.flashmla_fp8 import FlashMLAFp8Decode

        attn = FlashMLAFp8Decode(dev, validate=False)
    except Exception as e:
        setup_failed("flashmla_fp8_masked", e)
    else:
        record(
            "flashmla_fp8_masked",
            lambda: attn.attention(q, fp8, masked, None, SM_SCALE, out=ob, out_lse=lb),
            ref_fp8,
            ob,
        )
        det["flashmla_fp8_masked_vs_unquantized_rel_err"] = rel_err(ob, ref_bf16[0])
    try:
        # The bare FlashMLA call: schedule reused (what the wrapper does) / recomputed per call.
        import flash_mla

        from dcp_ref.kernels.flashmla_fp8 import prepare_indices

        idx, _ = prepare_indices(masked, None, fp8.shape[0])
        cache4 = fp8.view(torch.float8_e4m3fn).view(-1, 1, 1, FP8_DS_MLA.bytes_per_token)
        sched = flash_mla.get_mla_metadata()[0]

        def raw(s):
            return flash_mla.flash_mla_with_kvcache(
                q.unsqueeze(1),
                cache4,
                None,
                None,
                DV,
                s,
                softmax_scale=SM_SCALE,
                is_fp8_kvcache=True,
                indices=idx,
                use_legacy=True,
            )

        raw(sched)
        det["flashmla_fp8_raw_reused_schedule_graph_us"] = timer(lambda: raw(sched))
        det["flashmla_fp8_raw_fresh_schedule_graph_us"] = timer(lambda: raw(flash_mla.get_mla_metadata()[0]))
    except Exception as e:
        det["flashmla_fp8_raw_error"] = f"{type(e).__name__}: {e}"[:300]
        traceback.print_exc()

    # -- bf16, compact layout with lengths (FlashMLA sparse prefill kernel used for decode) --
    try:
        import flash_mla

        idx_c = rows["compact"].unsqueeze(1).contiguous()
        counts = rows["counts"]
        kv3 = kv.unsqueeze(1)
        holder = {}

        def bf16_run():
            o, _, l = flash_mla.flash_mla_sparse_fwd(
                q, kv3, idx_c, SM_SCALE, d_v=DV, topk_length=counts, use_legacy=True
            )
            holder["o"] = o
            return o, torch.where(counts[:, None] > 0, l, -math.inf)  # its +inf empty rows, made -inf

        record("flashmla_bf16_compact", bf16_run, ref_bf16, ob)
    except Exception as e:
        setup_failed("flashmla_bf16_compact", e)

    # -- FlashInfer FA3, compact CSR (plan outside the graph) --
    try:
        from dcp_ref.kernels.flashinfer_mla import FlashInferSparseMLA

        fi = data.setdefault("flashinfer", {}).get(T)
        if fi is None:
            fi = data["flashinfer"][T] = FlashInferSparseMLA(H, SM_SCALE, device=dev)
        fi.plan(rows["compact"], rows["counts"])
        record("flashinfer_fa3", lambda: fi.run(q, kv, out=ob, lse=lb), ref_bf16, ob)
    except Exception as e:
        setup_failed("flashinfer_fa3", e)

    # -- the slot stage for this rank (W = 2): conversion only vs conversion + compaction --
    if W > 1:
        try:
            from dcp_ref.kernels.deinterleave_triton import (
                METHODS,
                deinterleave_compact,
                global_ids_to_local_slots_triton,
                workspace_numel,
            )

            bs = 64
            L = W * data["kv"].shape[0]  # global positions; this rank holds every W-th (I = 1)
            ids = torch.rand(T, L, generator=gen, device=dev).topk(K, dim=1).indices.int()
            table = torch.randperm(L // W // bs, generator=gen, device=dev).int()[None, :]
            req = torch.zeros(T, dtype=torch.int32, device=dev)
            s_out = torch.empty(T, K, dtype=torch.int32, device=dev)
            c_out = torch.empty(T, dtype=torch.int32, device=dev)
            ws = torch.zeros(max(workspace_numel(m, T, K) for m in METHODS) + 1, dtype=torch.int64, device=dev)
            det["slots_convert_only_graph_us"] = timer(
                lambda: global_ids_to_local_slots_triton(ids, req, table, DcpGeometry(W, 0, 1, bs), out=s_out)
            )
            for ordered in (False, True):
                det[f"slots_convert_compact_{'ordered' if ordered else 'unordered'}_graph_us"] = timer(
                    lambda o=ordered: deinterleave_compact(
                        ids, req, table, DcpGeometry(W, 0, 1, bs), ordered=o, out=s_out, counts=c_out, workspace=ws
                    )
                )
        except Exception as e:
            det["slots_error"] = f"{type(e).__name__}: {e}"[:300]
            traceback.print_exc()
    return summary, det


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, few replays (checks the script, not the GPU)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device=dev).manual_seed(0)
    S = 4096 if args.smoke else 131072
    Ts = (1, 4) if args.smoke else (1, 32, 128)
    Ks = (64, 128) if args.smoke else (1024, 2048)
    kv = torch.randn(S, DQK, generator=gen, device=dev).bfloat16()
    data = {"kv": kv, "fp8": quantize_kv_fp8(kv)}
    summary, details = [], []
    result = {
        "benchmark": "bench_fp8_attention",
        "what": "sparse MLA decode of one rank: FlashMLA FP8 masked vs FlashMLA bf16 compact vs FlashInfer FA3",
        "device": _meta.device()["device"],
        "versions": {**_meta.device(), **_meta.versions()},
        "date_utc": _meta.now_utc(),
        "config": {
            "H": H,
            "Dqk": DQK,
            "Dv": DV,
            "sm_scale": SM_SCALE,
            "cache_rows": S,
            "fp8_bytes_per_token": FP8_DS_MLA.bytes_per_token,
            "bf16_bytes_per_token": FP8_DS_MLA.bf16_bytes_per_token,
            "timing": _timing.describe("graph", 1)
            + ", no L2 flush (--quick: the SWEEP rule); eager_us: "
            + _timing.describe("eager", flush_l2=True),
            "rel_err": "||out - ref||_F / ||ref||_F, float64 reference over the cache the kernel reads",
            "W=2": "one rank's share: each chosen key local with probability 1/2, -1 elsewhere (masked) "
            "or compacted with per-row counts (compact)",
        },
        "summary": summary,
        "details": details,
    }
    for T in Ts:
        for K in Ks:
            for W in (1, 2):
                s, d = bench_config(T, K, W, data, gen, args.smoke)
                summary.extend(s)
                details.append(d)
                (out_dir / "fp8_attention.json").write_text(
                    json.dumps(result, indent=1) + "\n"
                )  # partial results survive
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
    (out_dir / "fp8_attention.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'impl':24s} {'T':>4s} {'K':>5s} {'W':>2s} {'graph_us':>9s} {'rel_err':>9s}")
    for e in summary:
        g = f"{e['graph_us']:9.1f}" if e.get("graph_us") is not None else f"{'-':>9s}"
        r = f"{e['rel_err']:9.1e}" if e.get("rel_err") is not None else f"{'-':>9s}"
        print(
            f"{e['impl']:24s} {e['T']:4d} {e['K']:5d} {e['W']:2d} {g} {r}"
            + (f"  ERROR {e['error'][:60]}" if "error" in e else "")
        )
    print("wrote", out_dir / "fp8_attention.json")


if __name__ == "__main__":
    main()
