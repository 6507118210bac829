#!/usr/bin/env python3
"""Benchmark the scoring stage on one H200: FP8 index keys -> index scores, and fused -> top-K -> pack.

    python3 benchmarks/bench_scoring.py --out $OUT [--peers .gpu/peers/vllm] [--deepgemm $OUT/deepgemm_logits.json]
    python3 benchmarks/bench_scoring.py --quick --no-sweep --out /tmp/s   # a smoke test

On the H200 (``../shared/gpu/README.md``): the CuTeDSL bundle (59 MiB), DeepGEMM's source build (``.gpu/dgsrc``,
2.6 MiB: ``../shared/gpu/deepgemm-src/README.md``) and the tracked tree do not fit one call's 64 MiB together,
so make two calls back to back (the machine stays warm, ``/tmp/dcp-gpu-site`` keeps CuTeDSL), with
``../shared/peers/vllm`` copied to ``.gpu/peers/vllm`` beforehand:

    run(carry=[".gpu/cute"], command="source .gpu/cute/env.sh && python3 -m pytest -m gpu -q tests/test_scoring.py")
    run(carry=[".gpu/dgsrc", ".gpu/peers"], command="bash tools/dgsrc_unpack.sh && PYTHONPATH=/tmp/dg \
        DG_JIT_CACHE_DIR=/tmp/dgjit python3 benchmarks/peer_deepgemm_logits.py --out $OUT/deepgemm_logits.json; \
        python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1; \
        PYTHONPATH=/tmp/dcp-gpu-site:/tmp/dcp-gpu-site/nvidia_cutlass_dsl/dsl_packages CUTE_DSL_ARCH=sm_90a \
        python3 benchmarks/bench_scoring.py --out $OUT --peers .gpu/peers/vllm --deepgemm $OUT/deepgemm_logits.json")

(If the second call lands on a fresh machine, CuTeDSL is missing: vLLM's pack column is skipped and recorded
in ``peer_errors``; the rest runs.)

Shapes: ``T`` in {1, 32, 128} x local ``L`` in {4096, 32768, 131072}, 64 index heads x 128, block size 64, one
request per token (``B = T``, ``next_n = 1``), every key valid, random FP8 keys (``_scoring_inputs.py``: the
same bytes as the DeepGEMM peer's). Per shape:

* ``ours`` — :func:`dcp_ref.kernels.scoring_triton.index_scores_triton` (``out=``, ``validate=False``), default
  plan; its relative error against the float64 oracle (:func:`dcp_ref.scoring.index_scores`) on the first
  rows (``max_rel_err``: ``max |err| / max |score|``);
* ``fused`` — :func:`dcp_ref.kernels.scored_indexer_triton.scored_topk_pack` with ``k = 2048`` (scores never
  written) and, for comparison, ``ours_chain`` = the scoring kernel + ``indexer_topk_pack`` on its scores; the
  fused candidates are compared with the chain's as per-row sets of (score, id) bit patterns
  (``fused_same_as_chain``: rows equal; last-bit differences between the two kernels' float32 sums can swap
  a near-tie at the threshold, so ``fused_tolerant_ok`` also checks the selection against the chain's scores
  within 1e-5 relative);
* ``vllm`` — vLLM's indexer top-K (``top_k_per_row_decode``, ctypes, no CuTeDSL needed) and pack
  (``pack_dcp_topk_candidates``, its module imports cutlass: needs the CuTeDSL bundle) on our scores, from
  ``--peers DIR`` (``../shared/peers/vllm``); skipped when absent;
* ``deepgemm`` — read from ``--deepgemm JSON`` (written by ``peer_deepgemm_logits.py`` in its own process:
  DeepGEMM 0.2.0's apache-tvm-ffi clashes with FlashInfer's): ``fp8_paged_mqa_logits`` (+ its metadata call,
  reported separately) and its relative error on the same inputs; ``peer_chain_us`` = DeepGEMM logits + vLLM
  top-K + vLLM pack;
* floors: the read floor (``T * L * 132`` bytes of keys + the output, at the copy bandwidth measured in this
  run) and the FP8 compute floor (``2 * T * L * 64 * 128`` FLOP at 1979 TFLOP/s dense), and which binds.

FlashInfer 0.7's ``fp8_paged_mqa_logits`` is an SM100-only CuTeDSL kernel: it is not a peer on the H200.

Times: device time per call from replaying a CUDA graph of back-to-back calls (``do_bench`` median / calls),
as ``bench_local_topk.py``. ``--sweep`` (default on): launch configurations of both kernels at a few shapes,
each checked (``same_as_default`` / error) and timed, within ``--sweep-budget`` seconds, so that one device run
picks the defaults. Writes ``scoring.json`` (summary rows ``{"T", "L", "ours_us", "fused_chain_us",
"deepgemm_us", "peer_chain_us", "max_rel_err"}``, details, sweep) and ``scoring.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
from typing import Any

import _meta
import _scoring_inputs as si
import torch

RANK, W, I = 0, 1, 1  # the id arithmetic only (one rank's keys); scoring does not depend on it
DEV = "cuda"
#: (T, L) where alternative launch configurations are timed.
SWEEP_SHAPES = [(32, 32768), (128, 131072), (1, 131072), (128, 4096)]
SCORING_SWEEP = [
    dict(block_n=bn, tiles=tl, num_warps=nw, num_stages=ns)
    for bn, tl, nw, ns in [
        (64, 1, 4, 3), (64, 2, 4, 3), (64, 4, 4, 4), (64, 4, 4, 2), (64, 2, 8, 3), (32, 4, 4, 3),
        (128, 1, 4, 3), (128, 1, 8, 3), (128, 2, 8, 3), (256, 1, 8, 3),
    ]
]  # fmt: skip
#: (sm_90a, compiled here: 16 warps x 8192-key segments use 128 registers per thread -> one program per SM;
#: 4 warps with a streamed select (sel_tile < seg) ~140-160 -> three per SM, so that one program's scoring
#: overlaps another's selection.)
FUSED_SWEEP = [
    dict(seg=sg, num_warps=nw, block_n=bn, num_stages=ns, programs_per_sm=pp, sel_tile=st)
    for sg, nw, bn, ns, pp, st in [
        (8192, 16, 64, 3, 1, None), (8192, 32, 128, 2, 1, None), (8192, 8, 64, 3, 2, 2048),
        (8192, 8, 128, 2, 2, 1024), (8192, 4, 64, 3, 3, 1024), (8192, 4, 64, 3, 4, 1024),
        (4096, 4, 64, 3, 3, 512), (4096, 8, 64, 3, 2, None), (2048, 4, 64, 3, 4, None),
    ]
]  # fmt: skip


def load_peers(folder: str | None) -> tuple[dict[str, Any], dict[str, str]]:
    """vLLM's ``topk_decode`` (ctypes) and ``vllm_dcp_topk`` (its pack; imports cutlass) from ``folder``."""
    mods: dict[str, Any] = {}
    errors: dict[str, str] = {}
    if not folder or not os.path.isdir(folder):
        return mods, {"peers": f"no folder {folder!r}"}
    for name in ("topk_decode", "vllm_dcp_topk"):
        path = os.path.join(folder, f"{name}.py")
        try:
            spec = importlib.util.spec_from_file_location(f"peer_{name}", path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[f"peer_{name}"] = mod
            spec.loader.exec_module(mod)
            mods[name] = mod
        except Exception as e:  # noqa: BLE001 - a missing bundle (cutlass) skips that column, recorded
            errors[name] = f"{type(e).__name__}: {e}"[:300]
    return mods, errors


def pair_bits(packed: torch.Tensor) -> torch.Tensor:
    return torch.sort(packed.contiguous().view(torch.int64).squeeze(-1), 1).values


def tolerant_selection_ok(cand: torch.Tensor, scores: torch.Tensor, k: int, rel: float = 1e-5) -> bool:
    """``cand``'s ids are a valid top-k of ``scores`` up to ``rel``: each chosen score matches the row's score at
    that id, and no unchosen score beats the smallest chosen one by more than ``rel * max |score|``."""
    ids = cand[..., 1].long()
    if bool((ids < 0).any()):
        return False
    got = torch.gather(scores, 1, ids)
    scale = scores.abs().amax(1, keepdim=True).clamp_min(1e-30)
    if not bool(((got - cand[..., 0]).abs() <= rel * scale).all()):
        return False
    kth = cand[..., 0].amin(1, keepdim=True)
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ids, True)
    beats = (scores > kth + rel * scale) & ~chosen
    return not bool(beats.any())


def run_shape(t: int, n: int, bw: float, peers: dict[str, Any]) -> dict[str, Any]:
    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.kernels import scored_indexer_triton as fused
    from dcp_ref.kernels.indexer_triton import indexer_topk_pack, workspace_for
    from dcp_ref.kernels.scoring_triton import index_scores_triton, scoring_plan

    k = si.TOPK
    g = DcpGeometry(W, RANK, I, si.BLOCK)
    rec: dict[str, Any] = {"T": t, "L": n, "k": k}
    inp = si.build_inputs(t, n, DEV)
    args = [inp[x] for x in ("index_q", "weights", "index_cache", "block_table", "req_of_token", "local_bounds")]
    bounds = inp["local_bounds"]
    ref = si.reference_rows(inp)
    rec["ref_rows"] = ref.shape[0]
    rec["floors_scores"] = si.floors(t, n, bw, t * n * 4)
    rec["floors_fused"] = si.floors(t, n, bw, t * k * 8)
    # ---- ours: the scoring kernel
    scores = torch.full((t, n), float("nan"), device=DEV)
    rec["plan"] = scoring_plan(t, n, scores.device)._asdict()
    ours = lambda: index_scores_triton(*args, g, out=scores, validate=False)  # noqa: E731
    ours()
    torch.cuda.synchronize()
    rec["max_rel_err"] = si.rel_error(scores, ref)
    rec["ours_all_finite"] = bool(torch.isfinite(scores).all())
    rec["ours"] = si.graph_time(ours)
    # ---- ours, unfused chain: scores + indexer_topk_pack
    chain_out = torch.empty((t, k, 2), device=DEV)
    ws = workspace_for(scores, k)
    chain = lambda: (ours(), indexer_topk_pack(scores, bounds, k, g, out=chain_out, validate=False,  # noqa: E731
                                               workspace=ws))  # fmt: skip
    chain()
    torch.cuda.synchronize()
    rec["ours_chain"] = si.graph_time(chain)
    # ---- fused
    plan = fused.scored_plan(t, n, k, scores.device)
    rec["fused_plan"] = plan._asdict()
    scratch, fws = fused.scratch_for(plan, DEV), fused.workspace_for(plan, t, k, DEV)
    cand = torch.full((t, k, 2), float("nan"), device=DEV)
    fz = lambda: fused.scored_topk_pack(*args, g, k, n_cols=n, out=cand, workspace=fws, scratch=scratch,  # noqa: E731
                                        validate=False)  # fmt: skip
    fz()
    torch.cuda.synchronize()
    same = (pair_bits(cand) == pair_bits(chain_out)).all(1)
    rec["fused_same_as_chain"] = float(same.float().mean())
    rec["fused_tolerant_ok"] = tolerant_selection_ok(cand, scores, k)
    rec["fused"] = si.graph_time(fz)
    # ---- vLLM's top-K + pack on our scores
    if "topk_decode" in peers:
        try:
            v_idx = torch.empty((t, k), dtype=torch.int32, device=DEV)
            aux = (torch.empty((t, 10, k), dtype=torch.int32, device=DEV),
                   torch.empty((t, 10, k), dtype=torch.float32, device=DEV))  # fmt: skip
            seq = bounds.to(torch.int32)
            vt = lambda: peers["topk_decode"].top_k_per_row_decode(scores, seq, k, out=v_idx, aux=aux)  # noqa: E731
            vt()
            torch.cuda.synchronize()
            rec["vllm_topk"] = si.graph_time(vt)
            if "vllm_dcp_topk" in peers:
                packed = torch.empty((t, k, 2), device=DEV)
                vp = lambda: peers["vllm_dcp_topk"].pack_dcp_topk_candidates(scores, v_idx, packed, RANK, W, I)  # noqa: E731
                vboth = lambda: (vt(), vp())  # noqa: E731
                vboth()
                torch.cuda.synchronize()
                rec["vllm_pack"] = si.graph_time(vp)
                rec["vllm_topk_pack"] = si.graph_time(vboth)
                # informative: vLLM's top-K is not stable at ties
                rec["vllm_tolerant_ok"] = tolerant_selection_ok(packed, scores, k)
        except Exception as e:  # noqa: BLE001 - recorded, the shape goes on
            rec["vllm_error"] = f"{type(e).__name__}: {e}"[:500]
    return rec


def sweep(budget: float, shapes: list[tuple[int, int]]) -> list[dict[str, Any]]:
    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.kernels import scored_indexer_triton as fused
    from dcp_ref.kernels.scoring_triton import index_scores_triton, scoring_plan

    k = si.TOPK
    g = DcpGeometry(W, RANK, I, si.BLOCK)
    out: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for t, n in shapes:
        inp = si.build_inputs(t, n, DEV)
        args = [inp[x] for x in ("index_q", "weights", "index_cache", "block_table", "req_of_token", "local_bounds")]
        base = index_scores_triton(*args, g, validate=False)
        ref = si.reference_rows(inp)
        base_cand = fused.scored_topk_pack(*args, g, k, n_cols=n, validate=False)
        for kw in [{}, *SCORING_SWEEP]:
            if time.monotonic() - t0 > budget:
                return out
            rec: dict[str, Any] = {"kernel": "scoring", "T": t, "L": n, "config": kw}
            try:
                rec["plan"] = scoring_plan(t, n, base.device, **kw)._asdict()
                o = torch.full_like(base, float("nan"))
                fn = lambda: index_scores_triton(*args, g, out=o, validate=False, **kw)  # noqa: E731
                fn()
                torch.cuda.synchronize()
                rec["max_rel_err"] = si.rel_error(o, ref)
                rec["graph"] = si.graph_time(fn)
            except Exception as e:  # noqa: BLE001 - a config that fails to compile or run is recorded
                rec["error"] = f"{type(e).__name__}: {e}"[:400]
            out.append(rec)
            print(f"sweep scoring T={t} L={n} {kw} -> {rec.get('graph', {}).get('median_us')} "
                  f"err={rec.get('max_rel_err')} {rec.get('error', '')}", flush=True)  # fmt: skip
        for kw in [{}, *FUSED_SWEEP]:
            if time.monotonic() - t0 > budget:
                return out
            rec = {"kernel": "fused", "T": t, "L": n, "config": kw}
            try:
                plan = fused.scored_plan(t, n, k, base.device, **kw)
                rec["plan"] = plan._asdict()
                scr, ws = fused.scratch_for(plan, DEV), fused.workspace_for(plan, t, k, DEV)
                c = torch.full((t, k, 2), float("nan"), device=DEV)
                fn = lambda: fused.scored_topk_pack(*args, g, k, n_cols=n, out=c, workspace=ws,  # noqa: E731
                                                    scratch=scr, validate=False, **kw)  # fmt: skip
                fn()
                torch.cuda.synchronize()
                rec["same_as_default"] = float((pair_bits(c) == pair_bits(base_cand)).all(1).float().mean())
                rec["tolerant_ok"] = tolerant_selection_ok(c, base, k)
                rec["graph"] = si.graph_time(fn)
            except Exception as e:  # noqa: BLE001
                rec["error"] = f"{type(e).__name__}: {e}"[:400]
            out.append(rec)
            print(f"sweep fused T={t} L={n} {kw} -> {rec.get('graph', {}).get('median_us')} "
                  f"same={rec.get('same_as_default')} {rec.get('error', '')}", flush=True)  # fmt: skip
    return out


def load_deepgemm(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        with open(path) as fh:
            return json.load(fh)
    except Exception as e:  # noqa: BLE001 - a missing peer run: recorded
        return {"error": f"reading {path}: {type(e).__name__}: {e}"}


def summarize(results: list[dict[str, Any]], dg: dict[str, Any]) -> list[dict[str, Any]]:
    by = {(s["T"], s["L"]): s for s in dg.get("shapes", [])}
    rows = []
    for r in results:
        med = lambda key: r.get(key, {}).get("median_us")  # noqa: E731
        d = by.get((r["T"], r["L"]), {})
        vllm = med("vllm_topk_pack")
        dgu = d.get("deepgemm_us")
        rows.append(
            {
                "T": r["T"],
                "L": r["L"],
                "ours_us": med("ours"),
                "fused_chain_us": med("fused"),
                "deepgemm_us": dgu,
                "peer_chain_us": dgu + vllm if dgu is not None and vllm is not None else None,
                "max_rel_err": r.get("max_rel_err"),
                "ours_unfused_chain_us": med("ours_chain"),
                "vllm_topk_pack_us": vllm,
                "deepgemm_metadata_us": d.get("metadata_us"),
                "deepgemm_max_rel_err": d.get("max_rel_err"),
                "read_floor_us": r["floors_scores"]["read_floor_us"],
                "compute_floor_us": r["floors_scores"]["compute_floor_us"],
                "binds": r["floors_scores"]["binds"],
                "fused_read_floor_us": r["floors_fused"]["read_floor_us"],
                "fused_same_as_chain": r.get("fused_same_as_chain"),
                "fused_tolerant_ok": r.get("fused_tolerant_ok"),
            }
        )
    return rows


def markdown(data: dict[str, Any]) -> str:
    f = lambda v: "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = [
        f"# Scoring stage on {data['device']['name']} — torch {data['versions']['torch']}, triton "
        f"{data['versions']['triton']}, {data['date_utc']}",
        "",
        f"64 index heads x 128, block 64, k = {si.TOPK}, random FP8 keys, every key valid. Device µs per call "
        f"(CUDA-graph replay). Copy bandwidth {data['copy_bandwidth_TBps']:.2f} TB/s. *peer chain* = DeepGEMM "
        "logits + vLLM top-K + vLLM pack.",
        "",
        "| T | L | ours | fused (scoring+top-K+pack) | ours unfused chain | DeepGEMM | peer chain | read floor "
        "| compute floor | binds | rel err | fused = chain |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for s in data["summary"]:
        lines.append(
            f"| {s['T']} | {s['L']} | {f(s['ours_us'])} | {f(s['fused_chain_us'])} | {f(s['ours_unfused_chain_us'])} "
            f"| {f(s['deepgemm_us'])} | {f(s['peer_chain_us'])} | {f(s['read_floor_us'])} | "
            f"{f(s['compute_floor_us'])} | {s['binds']} | {s['max_rel_err']:.2e} | {s['fused_same_as_chain']} |"
        )
    return "\n".join(lines) + "\n"


def write(out_dir: str, data: dict[str, Any]) -> None:
    with open(os.path.join(out_dir, "scoring.json"), "w") as fh:
        json.dump(data, fh, indent=1)
    if data.get("summary"):
        with open(os.path.join(out_dir, "scoring.md"), "w") as fh:
            fh.write(markdown(data))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results", help="directory for scoring.json / scoring.md")
    ap.add_argument("--peers", help="folder with vLLM's peer modules (../shared/peers/vllm, copied under .gpu/)")
    ap.add_argument("--deepgemm", help="JSON written by peer_deepgemm_logits.py in its own process")
    ap.add_argument("--quick", action="store_true", help=f"only {si.QUICK}")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the launch-config sweep")
    ap.add_argument("--sweep-budget", type=float, default=150.0, help="seconds for the sweep")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    peers, peer_errors = load_peers(args.peers)
    bw = si.copy_bandwidth()
    data: dict[str, Any] = {
        "benchmark": "scoring stage: FP8 index keys -> index scores (kernels/scoring_triton.py), fused with the "
        "local top-K + pack (kernels/scored_indexer_triton.py); peers: DeepGEMM fp8_paged_mqa_logits, vLLM top-K "
        "+ pack",
        "device": si.device_info(),
        "versions": _meta.versions(),
        "date_utc": _meta.now_utc(),
        "argv": sys.argv[1:],
        "copy_bandwidth_TBps": bw / 1e12,
        "fp8_peak_TFLOPs": si.FP8_PEAK_FLOPS / 1e12,
        "timing": "device time per call: CUDA graph of `reps` calls replayed under triton.testing.do_bench "
        "(median, p20/p80) / reps; 'events' when a call could not be captured",
        "peers": sorted(peers),
        "peer_errors": peer_errors,
        "inputs": {"heads": si.HEADS, "dim": si.DIM, "block_size": si.BLOCK, "k": si.TOPK, "B": "T", "next_n": 1,
                   "keys": "random e4m3 bytes, power-of-two scales 2**-9..2**-6", "ref_rows": si.REF_ROWS},
    }  # fmt: skip
    dg = load_deepgemm(args.deepgemm)
    data["deepgemm"] = dg
    results: list[dict[str, Any]] = []
    for t, n in si.QUICK if args.quick else si.SHAPES:
        try:
            rec = run_shape(t, n, bw, peers)
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - a failing shape is recorded; the others still run
            rec = {
                "T": t,
                "L": n,
                "error": f"{type(e).__name__}: {e}"[:1000],
                "traceback": traceback.format_exc()[-3000:],
            }
            torch.cuda.empty_cache()
        results.append(rec)
        print(
            f"T={t:4d} L={n:6d} ours={rec.get('ours', {}).get('median_us', float('nan')):9.1f} "
            f"fused={rec.get('fused', {}).get('median_us', float('nan')):9.1f} "
            f"chain={rec.get('ours_chain', {}).get('median_us', float('nan')):9.1f} "
            f"vllm={rec.get('vllm_topk_pack', {}).get('median_us', float('nan')):8.1f} "
            f"err={rec.get('max_rel_err')} same={rec.get('fused_same_as_chain')} {rec.get('error', '')[:200]}",
            flush=True,
        )
        data["results"] = results
        write(args.out, data)  # after every shape: a timeout keeps what was measured
    data["summary"] = summarize([r for r in results if "error" not in r], dg)
    write(args.out, data)
    if args.sweep:
        data["sweep"] = sweep(args.sweep_budget, si.QUICK if args.quick else SWEEP_SHAPES)
        write(args.out, data)
    print(json.dumps(data["summary"], indent=1))
    ok = all("error" not in r and r.get("max_rel_err", 1.0) < 1e-3 and r.get("fused_tolerant_ok") for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
