#!/usr/bin/env python3
"""Benchmark the indexer stage on a GPU: the fused local top-K + pack kernel vs torch.

    python3 benchmarks/bench_local_topk.py --out $OUT            # -> $OUT/local_topk.json, local_topk.md
    python3 benchmarks/bench_local_topk.py --quick --no-tuning   # a few shapes, a smoke test

Shapes (issue 11): T ∈ {1, 32, 128, 1024} × L ∈ {4096, 32768, 131072}, plus T = 32, L = 8192;
k = 2048. Scores are standard normal float32 ``[T, L]``, every local key valid (``lengths = L``),
geometry W = 2, rank 0, I = 1 (the geometry only changes the id arithmetic). Per shape:

* ``fused`` — ``indexer_topk_pack(..., out=, validate=False)`` with its default launch plan;
* ``torch_path`` — today's path: ``torch.topk`` of the scores (keys past the length masked to
  -inf) + the Triton pack (``pack_candidates_triton``); **not exact** at ties (``torch.topk``'s tie
  order is unspecified), so its ``same_result`` is informative only;
* ``stable_torch`` — the exact stable torch version: ``local_topk``'s int64 composite key +
  ``torch.topk`` + gather (its checks removed so that it can be captured), then the Triton pack.

Times are device times per call: a CUDA graph of ``reps`` back-to-back calls replayed under
``triton.testing.do_bench`` (median, 20/80 % quantiles), divided by ``reps``. The fused output
is poisoned, then compared as a per-row set of (score, id) bit patterns with
``pack_candidates(local_topk(...))`` (``same_result``); so are the baselines.

``--tuning`` (default on) also times alternative launch plans (tile, warps, split, digit width)
at the shapes that decide the defaults, each checked the same way. The read floor is
``T * L * 4`` bytes at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import torch
from _graphs import capture  # the benchmarks' folder is on sys.path

SHAPES = [(t, n) for t in (1, 32, 128, 1024) for n in (4096, 32768, 131072)] + [(32, 8192)]
QUICK = [(32, 8192), (1, 131072), (1024, 32768)]
K = 2048
W, RANK, I = 2, 0, 1
DEV = "cuda"
#: (T, L) where alternative plans are timed; (tile, num_warps, split, radix_bits), None = default.
TUNING_SHAPES = [(32, 4096), (32, 8192), (1, 8192), (1, 4096), (1024, 32768), (1, 131072), (32, 131072), (128, 32768)]
TUNINGS = (
    # digit width (the histogram's cost grows with 2**bits / 32 bins per lane), default tile and warps
    [(None, None, None, b) for b in (5, 6, 7, 8, 11)]
    # warps per program at the default width and at 5 bits
    + [(None, w, None, b) for b in (6, 5) for w in (4, 8, 16, 32)]
    # a smaller tile (streamed rows) and the split of long rows
    + [(4096, None, None, 6), (2048, 8, None, 6), (None, None, 1, 6), (None, None, 4, 6), (None, None, 16, 6)]
)


def versions() -> dict:
    import triton

    out = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
    }
    for name, mod in (("cutlass_dsl", "cutlass"), ("flashinfer", "flashinfer")):
        try:
            out[name] = getattr(__import__(mod), "__version__", "unknown")
        except Exception:  # not installed on this image: recorded as such
            out[name] = None
    return out


def bench(fn) -> dict:
    import triton.testing

    q = triton.testing.do_bench(fn, warmup=10, rep=60, quantiles=[0.5, 0.2, 0.8])
    return {"median_us": q[0] * 1e3, "p20_us": q[1] * 1e3, "p80_us": q[2] * 1e3}


def graph_time(fn, reps: int) -> dict:
    """Device time per call: a CUDA graph of ``reps`` calls, replayed under do_bench."""
    g = capture(fn, calls=reps)
    r = bench(g.replay)
    del g
    return {k: v / reps for k, v in r.items()} | {"reps": reps}


def reps_for(fn) -> int:
    """About 2 ms of work per graph replay, 1..20 calls."""
    import triton.testing

    t_us = triton.testing.do_bench(fn, warmup=2, rep=10) * 1e3
    return max(1, min(20, int(2000 / max(t_us, 1e-3))))


def copy_bandwidth() -> float:
    import triton.testing

    n = 1 << 28
    src = torch.empty(n, dtype=torch.int32, device=DEV).random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
    return 2 * n * 4 / (ms * 1e-3)


def stable_torch(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """``local_topk`` without its host checks (capturable): int64 composite key + topk + gather."""
    from dcp_ref.topk import INVALID_KEY, stable_key

    rows, cols = scores.shape
    idx = torch.arange(cols, device=scores.device).expand(rows, cols)
    idx = torch.where(idx < lengths[:, None], idx, -1)
    key = stable_key(scores, idx)
    top, pos = torch.topk(key, min(k, cols), dim=1)
    return torch.where(top == INVALID_KEY, -1, torch.gather(idx, 1, pos))


def torch_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Today's selection: ``torch.topk`` of the scores, keys past the length masked to -inf."""
    col = torch.arange(scores.shape[1], device=scores.device)
    masked = torch.where(col < lengths[:, None], scores, float("-inf"))
    return torch.topk(masked, k, dim=1).indices


def same_rows(got: torch.Tensor, want: torch.Tensor) -> bool:
    g = torch.sort(got.contiguous().view(torch.int64).squeeze(-1), 1).values
    h = torch.sort(want.contiguous().view(torch.int64).squeeze(-1), 1).values
    return bool(torch.equal(g, h))


def make_scores(t: int, n: int, seed: int, dist: str = "normal") -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    if dist == "ties":  # 16 distinct values: long ties at the threshold, the slow path
        return torch.randint(0, 16, (t, n), device=DEV, generator=g).float()
    return torch.randn(t, n, device=DEV, generator=g)


def fused_call(scores, lengths, out, ws, **tune):
    from dcp_ref.kernels.indexer_triton import indexer_topk_pack

    return indexer_topk_pack(scores, lengths, K, RANK, W, I, out=out, validate=False, workspace=ws, **tune)


def run_fused(scores, lengths, want, tune: dict) -> dict:
    from dcp_ref.kernels.indexer_triton import DEFAULT_RADIX_BITS, launch_plan

    t, n = scores.shape
    plan = launch_plan(
        t, n, K, scores.device, split=tune.get("split"), tile=tune.get("tile"), num_warps=tune.get("num_warps")
    )
    rec = {"plan": plan._asdict(), "radix_bits": tune.get("radix_bits") or DEFAULT_RADIX_BITS}
    try:
        out = torch.full((t, K, 2), float("nan"), device=DEV)
        n_ws = sum(plan.levels)
        ws = torch.empty((t, n_ws, K, 2), device=DEV) if n_ws else None
        fn = lambda: fused_call(scores, lengths, out, ws, **tune)  # noqa: E731
        fn()
        torch.cuda.synchronize()
        rec["same_result"] = same_rows(out, want)
        rec["graph"] = graph_time(fn, reps_for(fn))
        rec["eager"] = bench(fn)
    except Exception as e:  # a plan that fails to compile or run is recorded, not fatal
        rec["error"] = f"{type(e).__name__}: {e}"[:400]
    return rec


def run_shape(t: int, n: int, bw: float, dist: str = "normal") -> dict:
    from dcp_ref.indexer import local_topk
    from dcp_ref.kernels.pack_triton import pack_candidates_triton
    from dcp_ref.topk import pack_candidates

    scores = make_scores(t, n, seed=t * 7 + n, dist=dist)
    lengths = torch.full((t,), n, dtype=torch.int32, device=DEV)
    want = pack_candidates(scores, local_topk(scores, K, lengths), RANK, W, I)
    rec = {"T": t, "L": n, "k": K, "dist": dist, "read_floor_us": t * n * 4 / bw * 1e6}
    rec["fused"] = run_fused(scores, lengths, want, {})
    pout = torch.empty((t, K, 2), device=DEV)
    path = lambda: pack_candidates_triton(  # noqa: E731
        scores, torch_topk(scores, lengths, K), RANK, W, I, out=pout, validate=False
    )
    path()
    rec["torch_path_same_result"] = same_rows(pout, want)  # informative: torch.topk's ties are unordered
    rec["torch_path"] = graph_time(path, reps_for(path))
    sout = torch.empty((t, K, 2), device=DEV)
    stable = lambda: pack_candidates_triton(  # noqa: E731
        scores, stable_torch(scores, lengths, K), RANK, W, I, out=sout, validate=False
    )
    stable()
    rec["stable_torch_same_result"] = same_rows(sout, want)
    rec["stable_torch"] = graph_time(stable, reps_for(stable))
    rec["local_topk_pack_eager"] = bench(lambda: pack_candidates(scores, local_topk(scores, K, lengths), RANK, W, I))
    return rec


def summarize(results: list[dict]) -> list[dict]:
    out = []
    for r in results:
        if r.get("dist", "normal") != "normal":
            continue
        f = r["fused"]
        out.append(
            {
                "T": r["T"],
                "L": r["L"],
                "k": r["k"],
                "fused_us": f.get("graph", {}).get("median_us"),
                "torch_path_us": r["torch_path"]["median_us"],
                "stable_torch_us": r["stable_torch"]["median_us"],
                "read_floor_us": r["read_floor_us"],
                "same_result": bool(f.get("same_result", False)),
            }
        )
    return out


def targets(summary: list[dict]) -> list[dict]:
    """The issue's targets, checked (a shape whose fused run failed counts as missed)."""
    by = {(s["T"], s["L"]): s for s in summary}
    res = []
    s = by.get((32, 8192))
    if s:
        res.append(
            {
                "target": "<= 15 us at T=32, L=8192, k=2048",
                "measured_us": s["fused_us"],
                "met": bool(s["fused_us"]) and s["fused_us"] <= 15,
            }
        )
    s = by.get((1024, 32768))
    if s:
        res.append(
            {
                "target": "<= 2x the read floor at T=1024, L=32768",
                "measured_us": s["fused_us"],
                "floor_us": s["read_floor_us"],
                "ratio": s["fused_us"] / s["read_floor_us"] if s["fused_us"] else None,
                "met": bool(s["fused_us"]) and s["fused_us"] <= 2 * s["read_floor_us"],
            }
        )
    ok = [s for s in summary if s["fused_us"]]
    if summary:
        worst = min(ok, key=lambda s: s["torch_path_us"] / s["fused_us"]) if ok else None
        res.append(
            {
                "target": ">= 5x faster than torch.topk + Triton pack everywhere",
                "min_speedup": worst["torch_path_us"] / worst["fused_us"] if worst else None,
                "at": [worst["T"], worst["L"]] if worst else None,
                "met": len(ok) == len(summary) and all(s["torch_path_us"] >= 5 * s["fused_us"] for s in ok),
            }
        )
    res.append(
        {
            "target": "same result as local_topk + pack_candidates everywhere",
            "met": all(s["same_result"] for s in summary),
        }
    )
    return res


def fmt_split(plan: dict) -> str:
    """``1``, or the segments of every level, e.g. ``16→4``."""
    return "→".join(str(s) for s in plan.get("levels") or [plan["split"]])


def markdown(data: dict) -> str:
    m = data
    lines = [
        f"# Indexer stage (local top-K + pack) on {m['device']['name']} — torch {m['versions']['torch']}, "
        f"triton {m['versions']['triton']}, {m['date_utc']}",
        "",
        f"k = {K}, W = {W}, rank {RANK}, I = {I}; standard normal float32 scores, every key valid. Device time per "
        "call (CUDA-graph replay), µs medians. *torch path* = `torch.topk` + Triton pack (today's; not exact at "
        "ties); *stable torch* = `local_topk`'s int64 key + `torch.topk` + Triton pack. Read floor = T·L·4 bytes "
        f"at the measured copy bandwidth ({m['copy_bandwidth_TBps']:.2f} TB/s). Plan = tile / warps / split "
        "(segments per row at each level, e.g. 16→4).",
        "",
        "| T | L | fused | plan | same result | torch path | speed-up | stable torch | speed-up | read floor "
        "| fused ÷ floor |",
        "|---:|---:|---:|---|:---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in m["results"]:
        f = r["fused"]
        g = f.get("graph", {}).get("median_us")
        p = f["plan"]
        plan = f"{p['tile']}{'' if p['one_chunk'] else ' (streamed)'} / {p['num_warps']} / {fmt_split(p)}"
        tp, st = r["torch_path"]["median_us"], r["stable_torch"]["median_us"]
        gs = "error" if g is None else f"{g:.1f}"
        ratio = "-" if g is None else f"{g / r['read_floor_us']:.0f}×"
        lines.append(
            f"| {r['T']} | {r['L']}{'' if r['dist'] == 'normal' else ' (' + r['dist'] + ')'} | {gs} | {plan} | "
            f"{'✓' if f.get('same_result') else '✗'} | {tp:.1f} | {'-' if g is None else f'{tp / g:.1f}×'} | "
            f"{st:.1f} | "
            f"{'-' if g is None else f'{st / g:.1f}×'} | {r['read_floor_us']:.3g} | {ratio} |"
        )
    lines += ["", "## Targets (issue 11)", "", "| target | measured | met? |", "|---|---|:---:|"]
    for t in m["targets"]:
        meas = ", ".join(
            f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in t.items() if k not in ("target", "met")
        )
        lines.append(f"| {t['target']} | {meas} | {'✓' if t['met'] else '✗'} |")
    if m.get("tuning"):
        lines += [
            "",
            "## Launch plans tried (fused, graph µs; ✗ = wrong result or error)",
            "",
            "| T | L | tile / warps / split / digit bits | graph µs | eager µs | same result |",
            "|---:|---:|---|---:|---:|:---:|",
        ]
        for r in m["tuning"]:
            p = r["plan"]
            g = r.get("graph", {}).get("median_us")
            e = r.get("eager", {}).get("median_us")
            lines.append(
                f"| {r['T']} | {r['L']} | {p['tile']}{'' if p['one_chunk'] else 's'} / {p['num_warps']} / "
                f"{fmt_split(p)} / {r['radix_bits']} | {'-' if g is None else f'{g:.1f}'} | "
                f"{'-' if e is None else f'{e:.1f}'} | "
                f"{'✓' if r.get('same_result') else '✗ ' + r.get('error', '')[:60]} |"
            )
    return "\n".join(lines) + "\n"


def write(out_dir: str, data: dict) -> None:
    with open(os.path.join(out_dir, "local_topk.json"), "w") as fh:
        json.dump(data, fh, indent=1)
    with open(os.path.join(out_dir, "local_topk.md"), "w") as fh:
        fh.write(markdown(data))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results", help="directory for local_topk.json / local_topk.md")
    ap.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    ap.add_argument("--no-tuning", dest="tuning", action="store_false", help="skip the launch-plan sweep")
    ap.add_argument("--no-ties", dest="ties", action="store_false", help="skip the heavy-ties inputs")
    ap.add_argument("--tuning-budget", type=float, default=150.0, help="seconds for the launch-plan sweep")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    bw = copy_bandwidth()
    data = {
        "benchmark": "indexer stage: fused local top-K + pack (kernels/indexer_triton.py) vs torch",
        "device": {
            "name": props.name,
            "sms": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}",
        },
        "versions": versions(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "argv": sys.argv[1:],
        "copy_bandwidth_TBps": bw / 1e12,
        "timing": "device time per call: CUDA graph of `reps` calls replayed under triton.testing.do_bench "
        "(median, p20/p80), / reps; eager = do_bench of the Python call",
        "inputs": {
            "k": K,
            "world_size": W,
            "rank": RANK,
            "interleave": I,
            "scores": "standard normal float32",
            "lengths": "L (every key valid)",
        },
    }
    results = []
    for t, n in QUICK if args.quick else SHAPES:
        rec = run_shape(t, n, bw)
        results.append(rec)
        f = rec["fused"]
        print(
            f"T={t:5d} L={n:6d} fused={f.get('graph', {}).get('median_us', float('nan')):9.1f} "
            f"plan={tuple(f['plan'].values())} ok={f.get('same_result')} torch={rec['torch_path']['median_us']:9.1f} "
            f"stable={rec['stable_torch']['median_us']:9.1f} floor={rec['read_floor_us']:7.1f} {f.get('error', '')}",
            flush=True,
        )
    if args.ties:
        for t, n in [(32, 8192), (1024, 32768), (1, 131072)]:
            rec = run_shape(t, n, bw, dist="ties")
            results.append(rec)
            f = rec["fused"]
            print(f"ties T={t} L={n} fused={f.get('graph', {}).get('median_us')} ok={f.get('same_result')}", flush=True)
    data["results"] = results
    data["summary"] = summarize(results)
    data["targets"] = targets(data["summary"])
    write(args.out, data)  # now, in case the sweep below runs out of time
    if args.tuning:
        from dcp_ref.indexer import local_topk
        from dcp_ref.topk import pack_candidates

        tuning = []
        t0 = time.monotonic()
        for t, n in TUNING_SHAPES:
            if time.monotonic() - t0 > args.tuning_budget:
                print(f"tuning stopped after {args.tuning_budget} s", flush=True)
                break
            scores = make_scores(t, n, seed=t * 7 + n)
            lengths = torch.full((t,), n, dtype=torch.int32, device=DEV)
            want = pack_candidates(scores, local_topk(scores, K, lengths), RANK, W, I)
            for tile, warps, split, bits in TUNINGS:
                tune = {"tile": tile, "num_warps": warps, "split": split, "radix_bits": bits}
                rec = {"T": t, "L": n} | run_fused(scores, lengths, want, tune)
                tuning.append(rec)
                print(
                    f"tune T={t} L={n} {tune} -> {rec.get('graph', {}).get('median_us')} ok={rec.get('same_result')} "
                    f"{rec.get('error', '')}",
                    flush=True,
                )
            data["tuning"] = tuning
            write(args.out, data)
    print(json.dumps(data["targets"], indent=1))
    return 0 if all(s["same_result"] for s in data["summary"]) else 1


if __name__ == "__main__":
    sys.exit(main())
