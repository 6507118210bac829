#!/usr/bin/env python3
"""The CuTeDSL local top-K's two commits side by side, with vLLM's top-K + pack, in one process (issue 31).

    python3 benchmarks/ab_local_topk_commit.py --out $OUT --peers .gpu/ix_peers/vllm   # -> local_topk_commit_ab.json

At every shape of ``bench_local_topk.py`` (16 shapes, 3 ties rows; k = 2048, W = 2, rank 0, standard normal or
16-value scores, every key valid) and the default launch plan, times (CUDA-graph replay, L2 flushed before each
replay, µs medians) ``commit="scan"`` (a block scan per vector load) and ``commit="bitmap"`` (winners marked in
a shared-memory bitmap by position, one scan of its words), each checked against the reference
(``pack_candidates(local_topk(...))``: same (score, id) sets), and vLLM's ``top_k_per_row_decode`` + pack.
The plan picks the commit per shape (``local_topk_cutedsl.commit_for``; ``tests/test_local_topk_plans.py`` checks
its rule against this file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _meta
from bench_local_topk import QUICK, RANK, SHAPES, TIES, K, Peers, W, graph_time, make_scores, reference, same_rows

from dcp_ref.geometry import DcpGeometry

#: The variants (LocalTopKConfig fields), whatever the plan's commit: the scan commit (the kernel at 5a45d55) and the
#: bitmap commit. (A third, the bitmap commit with the passes after pass 1 counting a shared-memory list of pass 0's
#: threshold bin, was slower than the bitmap alone at all 19 rows, 0.2-2.7 µs: measured once and deleted.)
VARIANTS = {"scan": {"commit": "scan"}, "bitmap": {"commit": "bitmap"}}


def run(t: int, n: int, dist: str, peers: Peers) -> dict:
    import dcp_ref.kernels.local_topk_cutedsl as ltk
    from dcp_ref.kernels.indexer_triton import indexer_topk_pack, launch_plan, scores_vec

    scores = make_scores(t, n, 1000 + t + n, dist)
    lengths = torch.full((t,), n, dtype=torch.int32, device="cuda")
    want = reference(scores, lengths)
    plan = launch_plan(t, n, K, scores.device, vec=scores_vec(scores))
    rec: dict = {"T": t, "L": n, "dist": dist, "plan": plan._asdict()}
    base = ltk.LocalTopKConfig
    for name, knobs in VARIANTS.items():
        out = torch.full((t, K, 2), float("nan"), device="cuda")

        def cfg(*a, _k=knobs, **kw):  # the launcher builds its configuration positionally: set the variant
            return dataclasses.replace(base(*a, **kw), **_k)

        ltk.LocalTopKConfig = cfg  # type: ignore[assignment, misc]
        try:
            fn = lambda: indexer_topk_pack(  # noqa: E731
                scores, lengths, K, DcpGeometry(W, RANK, 1, 1), out=out, validate=False, plan=plan
            )
            fn()
            torch.cuda.synchronize()
            ok = same_rows(out, want)
            rec[name] = {"same_result": ok, **(graph_time(fn) if ok else {})}
        except Exception as e:  # recorded, not fatal
            rec[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
        finally:
            ltk.LocalTopKConfig = base  # type: ignore[misc]
    if peers.topk is not None:
        idx = torch.empty((t, K), dtype=torch.int32, device="cuda")
        out = torch.empty((t, K, 2), device="cuda")
        rec["vllm"] = graph_time(lambda: peers.call(scores, lengths, idx, out))
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--peers", default=".gpu/ix_peers/vllm")
    ap.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    args = ap.parse_args()
    shapes = [(t, n, "normal") for t, n in (QUICK if args.quick else SHAPES)]
    shapes += [] if args.quick else [(t, n, "ties") for t, n in TIES]
    peers = Peers(args.peers)
    rows = []
    t0 = time.monotonic()
    for t, n, dist in shapes:
        r = run(t, n, dist, peers)
        rows.append(r)
        cells = [f"{c}={r[c].get('median_us', r[c].get('error', 'wrong'))}" for c in VARIANTS]
        print(f"T={t} L={n} {dist}: {' '.join(cells)} vllm={r.get('vllm', {}).get('median_us')}", flush=True)
    data = {
        "benchmark": "the CuTeDSL local top-K's commits (scan, bitmap) and vLLM's top-K + pack "
        "(benchmarks/ab_local_topk_commit.py)",
        "device": _meta.device(),
        "versions": _meta.versions(),
        "date_utc": _meta.now_utc(),
        "commit": os.environ.get("DCP_COMMIT", ""),
        "k": K,
        "timing": "device time per call: CUDA graph replay, L2 flushed before each replay (median µs)",
        "peers": peers.note,
        "seconds": round(time.monotonic() - t0, 1),
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "local_topk_commit_ab.json"), "w") as fh:
        json.dump(data, fh, indent=1)
    print(f"{'T':>5} {'L':>7} {'dist':>6} {'scan':>8} {'bitmap':>8} {'vllm':>8}  plan")
    for r in rows:

        def us(c):
            return r.get(c, {}).get("median_us", float("nan"))

        cells = " ".join(f"{us(c):>8.1f}" for c in (*VARIANTS, "vllm"))
        print(f"{r['T']:>5} {r['L']:>7} {r['dist']:>6} {cells}  {r['plan']['cute']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
