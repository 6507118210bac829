#!/usr/bin/env python3
"""Benchmark the indexer stage on a GPU: the fused Triton local top-K + pack against vLLM's and torch's.

    python3 benchmarks/bench_local_topk.py --out $OUT --peers .gpu/ix_peers/vllm    # -> local_topk.json / .md
    python3 benchmarks/bench_local_topk.py --out $OUT --quick --no-sweep            # a few shapes, a smoke test

Shapes: T in {1, 32, 128, 1024} x L in {4096, 8192, 32768, 131072}, k = 2048, plus three heavy-ties rows
(16 distinct values: long ties at the threshold). Scores are standard normal float32 ``[T, L]``, every
local key valid (``lengths = L``), geometry W = 2, rank 0, I = 1 (the geometry only changes the id
arithmetic). Per shape, each timed as the device time per call of a CUDA graph of back-to-back calls
(L2 flushed before each replay; ``_timing.py``: median of the replays, divided by the calls):

* ``fused`` — ours: ``indexer_topk_pack(..., out=, workspace=, validate=False)`` with the default launch
  plan; tie rule: *stable* (score descending, then lower index: exact). Its output is poisoned first and
  compared per row, as a set of ``(score, id)`` bit patterns, with ``pack_candidates(local_topk(...))``.
  Compacted plans also report how many rows took each path (list / ties at the bound / relisted / fallback).
* ``streamed`` / ``compacted`` — at every shape whose rows are longer than a tile (``L > MAX_TILE``, normal
  scores), ``fused`` with ``compact=False`` and with ``compact=True`` (the default plan is one of the two: its
  record is reused, the other is timed the same way). The summary ``compact_vs_streamed`` says per shape which is
  faster and whether the plan's rule (``prefer_compact`` in ``kernels/indexer_triton.py``) picks the faster one
  (``rule_agrees``): the data that rule's constants are refined from.
* ``vllm`` — vLLM's ``top_k_per_row_decode`` (``--peers``: ``topk_decode.py`` + ``vllm_topk_decode.so``,
  ctypes, torch's stream) then vLLM's pack (``vllm_dcp_topk.pack_dcp_topk_candidates``; that module
  imports CuTeDSL: when it cannot be imported the pack is ours, ``pack_candidates_triton``, and the JSON
  says so); tie rule: *unstable* (a set with ties broken arbitrarily). ``vllm_topk`` is its top-K alone.
* ``torch`` — ``torch.topk`` of the scores (keys past the length masked to -inf) + our Triton pack; tie
  rule: whatever ``torch.topk`` does (unspecified: not stable).

Floors beside each row: the **read floor** ``T * L * 4`` bytes at the copy bandwidth measured in the same
run, and the **launch floor**, one empty Triton launch per call in the same graph harness (vLLM's path
takes two launches). The **validation** section times a validated eager call against an unvalidated
one (the in-kernel checks + one host read). The **sweep** (on by default, within ``--sweep-budget``
seconds; JSON key ``tuning``, each record with its full ``plan``) times alternative launch plans —
split factors, tiles, warps, digit widths, radix vs search, pivots, sample sizes —
at the shapes that decide the defaults, each checked the same way, so that one run picks the defaults.
The whole script takes about 4 minutes on an H200 (most of it compiling the variants; the second path at the
eight long-row shapes adds their compilations and well under a minute).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time

import _meta
import _timing  # the benchmarks' folder is on sys.path
import torch

from dcp_ref.geometry import DcpGeometry

SHAPES = [(t, n) for t in (1, 32, 128, 1024) for n in (4096, 8192, 32768, 131072)]
QUICK = [(32, 8192), (1, 131072), (1024, 32768), (128, 32768)]
TIES = [(32, 8192), (1024, 32768), (1, 131072)]
K = 2048
W, RANK, I = 2, 0, 1
DEV = "cuda"
TIE_RULES = {
    "fused": "stable: score descending, then lower index (exact)",
    "vllm": "unstable: a set, ties broken arbitrarily",
    "torch": "torch.topk's (unspecified; not stable)",
}
#: The issue's targets (µs): fused at these shapes, besides "faster than vLLM's top-K + pack everywhere"
#: and "within 3x of the read floor or the launch floor".
TARGETS_US = {(32, 8192): 8.0, (1024, 32768): 150.0, (1, 131072): 20.0, (128, 32768): 25.0}

#: The Triton kernel's launch-plan sweep (``--triton-sweep``), in priority order: (T, L, tuning). Tunings not given
#: take the default plan's.
TRITON_SWEEP = (
    # rows held in registers: radix vs search, warps, pivots
    [(32, 8192, dict(select=s, num_warps=w)) for s in ("search", "radix") for w in (8, 16, 32)]
    + [(32, 8192, dict(select="search", pivots=1)), (32, 8192, dict(radix_bits=6, select="radix"))]
    # long rows: segments, tiles, warps, sample, select of the list (compacted against streamed: compare_paths)
    + [(1, 131072, dict(split=s)) for s in (8, 16, 32)]
    + [(1024, 32768, dict(tile=t, num_warps=w)) for t, w in ((1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16))]
    + [(128, 32768, dict(split=s)) for s in (1, 2, 4)]
    + [(1024, 32768, dict(select="search"))]
    + [(1, 131072, dict(select="search")), (32, 8192, dict(compact=True, split=4, select="search"))]
    + [(1, 131072, dict(sample=s)) for s in (4096, 8192)]
    + [(1, 131072, dict(num_warps=w)) for w in (8, 16)]
    + [(32, 4096, dict(select=s, num_warps=w)) for s in ("search", "radix") for w in (4, 8, 16)]
    + [(1024, 4096, dict(select=s, num_warps=w)) for s in ("search", "radix") for w in (4, 8)]
    + [(32, 131072, dict(split=s)) for s in (1, 2, 4, 8)]
    + [(32, 8192, dict(compact=True, split=s)) for s in (1, 2, 4)]
    + [(128, 131072, dict(split=s, tile=t)) for s, t in ((1, 2048), (1, 4096), (2, 2048))]
    + [(1024, 8192, dict(select=s)) for s in ("search", "radix")]
)


#: The CuTeDSL kernel's sweep (the default ``--sweep``), shapes in priority order: every (cluster, threads) that holds
#: the row at 8, 16 or 32 keys a thread with an 8-bit first digit, then the default plan's CTAs with 11 and 12 bits.
CUTE_SWEEP_SHAPES = [
    (32, 8192), (1024, 32768), (128, 32768), (1, 131072), (1024, 8192), (1024, 4096), (32, 32768),
    (1, 32768), (1024, 131072), (128, 131072), (32, 131072), (1, 4096), (1, 8192), (32, 4096),
]  # fmt: skip


def cute_sweep() -> list[tuple[int, int, dict]]:
    from dcp_ref.kernels.local_topk_cutedsl import CLUSTERS, plan_for

    out = []
    for t, n in CUTE_SWEEP_SHAPES:
        for c in CLUSTERS:
            for th in (256, 512, 1024):
                if -(-n // (c * th)) in (8, 16, 32) or (n // (c * th) < 8 and th == 256 and c == 1):
                    out.append((t, n, {"engine": "cutedsl", "cute": (c, th, 8)}))
        base = plan_for(t, n, K, 4)
        if base is not None:
            out += [(t, n, {"engine": "cutedsl", "cute": (base[0], base[1], fb)}) for fb in (11, 12)]
    return out


def graph_time(fn, calls: int | None = None) -> dict:
    """Device time per call (``_timing.graph_row``: a CUDA graph of ``reps`` calls, about 2 ms of work unless
    given, L2 flushed before each replay): ``{"median_us", "p20_us", "p80_us", "reps"}``."""
    return _timing.graph_row(fn, calls=calls, flush_l2=True)


def launch_floor() -> dict:
    """One empty Triton launch per call, in the same graph harness: the least any one-launch kernel costs."""
    import triton
    import triton.language as tl

    @triton.jit
    def _empty(x_ptr):
        pid = tl.program_id(0)
        if pid < 0:  # never: keeps the pointer argument alive
            tl.store(x_ptr, pid)

    x = torch.empty(1, dtype=torch.int32, device=DEV)
    return graph_time(lambda: _empty[(1,)](x), calls=20)


def same_rows(got: torch.Tensor, want: torch.Tensor) -> bool:
    g = torch.sort(got.contiguous().view(torch.int64).squeeze(-1), 1).values
    h = torch.sort(want.contiguous().view(torch.int64).squeeze(-1), 1).values
    return bool(torch.equal(g, h))


def make_scores(t: int, n: int, seed: int, dist: str = "normal") -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    if dist == "ties":  # 16 distinct values: long ties at the threshold
        return torch.randint(0, 16, (t, n), device=DEV, generator=g).float()
    return torch.randn(t, n, device=DEV, generator=g)


def reference(scores: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    from dcp_ref.indexer import local_topk
    from dcp_ref.topk import pack_candidates

    return pack_candidates(scores, local_topk(scores, K, lengths), DcpGeometry(W, RANK, I, I))


class Peers:
    """vLLM's kernels from ``--peers`` (never part of the project): top-K through ctypes, the pack guarded."""

    def __init__(self, path: str | None) -> None:
        self.topk = self.pack = None
        self.note: dict = {"path": path}
        if not path or not os.path.isdir(path):
            self.note["topk"] = "absent (no --peers folder)"
            return
        sys.path.insert(0, path)
        try:
            from topk_decode import top_k_per_row_decode  # type: ignore[import-not-found]

            self.topk = top_k_per_row_decode
            self.note["topk"] = "top_k_per_row_decode (csrc/sampler.cu @ 00e831b2, ctypes)"
        except Exception as e:  # a missing or foreign .so: the peer columns are skipped
            self.note["topk"] = f"unavailable: {type(e).__name__}: {e}"[:300]
        try:
            if importlib.util.find_spec("cutlass") is None:
                raise ImportError("vllm_dcp_topk imports cutlass (CuTeDSL), not installed here")
            from vllm_dcp_topk import pack_dcp_topk_candidates  # type: ignore[import-not-found]

            self.pack = pack_dcp_topk_candidates
            self.note["pack"] = "vllm_dcp_topk.pack_dcp_topk_candidates (Triton, @ 4b5c627c)"
        except Exception as e:  # CuTeDSL missing: vLLM's top-K is then packed by ours, and the JSON says so
            self.note["pack"] = f"ours (pack_candidates_triton): vLLM's pack unavailable: {type(e).__name__}: {e}"[:300]

    def call(self, scores, lengths, idx, out):
        """vLLM's top-K into ``idx`` then the pack into ``out`` (float32 [T, k, 2])."""
        self.topk(scores, lengths, K, out=idx)
        if self.pack is not None:
            self.pack(scores, idx, out, RANK, W, I)
        else:
            from dcp_ref.kernels.pack_triton import pack_candidates_triton

            pack_candidates_triton(scores, idx, DcpGeometry(W, RANK, I, I), out=out, validate=False)


def run_fused(scores, lengths, want, tune: dict, *, time_it: bool = True) -> dict:
    from dcp_ref.kernels.indexer_triton import DEFAULT_RADIX_BITS, compact_paths, launch_plan, workspace_for
    from dcp_ref.kernels.local_topk_cutedsl import vec_for

    t, n = scores.shape
    knobs = ("split", "tile", "num_warps", "compact", "select", "sample", "pivots", "engine", "cute", "radix_bits")
    plan_args = {a: tune[a] for a in knobs if a in tune}
    vec = vec_for(scores) if tune.get("engine") != "triton" else 0
    plan = launch_plan(t, n, K, scores.device, vec=vec, **plan_args)  # the one launch the call takes
    rec = {"tune": tune, "plan": plan._asdict(), "radix_bits": tune.get("radix_bits", DEFAULT_RADIX_BITS)}
    try:
        from dcp_ref.kernels.indexer_triton import indexer_topk_pack

        ws = workspace_for(scores, K, plan=plan)
        out = torch.full((t, K, 2), float("nan"), device=DEV)
        fn = lambda: indexer_topk_pack(  # noqa: E731
            scores, lengths, K, DcpGeometry(W, RANK, I, I), out=out, validate=False, workspace=ws, plan=plan
        )
        t0 = time.monotonic()
        fn()
        torch.cuda.synchronize()
        rec["first_call_s"] = time.monotonic() - t0  # compile included
        rec["same_result"] = same_rows(out, want)
        if plan.compact:
            paths = compact_paths(ws).tolist()
            names = ((1, "list"), (2, "ties_at_bound"), (3, "relisted"), (4, "fallback"))
            rec["paths"] = {name: paths.count(p) for p, name in names}
        if time_it:
            rec["graph"] = graph_time(fn)
    except Exception as e:  # a plan that fails to compile or run is recorded, not fatal
        rec["error"] = f"{type(e).__name__}: {e}"[:400]
    return rec


def run_shape(t: int, n: int, bw: float, floor_us: float, peers: Peers, dist: str = "normal") -> dict:
    from dcp_ref.kernels.indexer_triton import MAX_TILE
    from dcp_ref.kernels.pack_triton import pack_candidates_triton

    scores = make_scores(t, n, seed=t * 7 + n, dist=dist)
    lengths = torch.full((t,), n, dtype=torch.int32, device=DEV)
    want = reference(scores, lengths)
    rec = {
        "T": t,
        "L": n,
        "k": K,
        "dist": dist,
        "read_floor_us": t * n * 4 / bw * 1e6,
        "launch_floor_us": floor_us,
        "tie_rules": TIE_RULES,
    }
    rec["fused"] = run_fused(scores, lengths, want, {})
    rec["triton"] = run_fused(scores, lengths, want, {"engine": "triton"})
    if dist == "normal" and n > MAX_TILE:
        # The Triton kernel's two paths of a row longer than a tile, timed alike: its default plan's is the record
        # above, the other is forced (compact=True / False, every other tuning the default's).
        ours = "compacted" if rec["triton"]["plan"]["compact"] else "streamed"
        other = "streamed" if ours == "compacted" else "compacted"
        rec[ours] = rec["triton"] | {"timed_as": "triton (its default plan)"}
        rec[other] = run_fused(scores, lengths, want, {"compact": other == "compacted"})
    if peers.topk is not None:
        idx = torch.empty((t, K), dtype=torch.int32, device=DEV)
        vout = torch.empty((t, K, 2), device=DEV)
        try:
            peers.call(scores, lengths, idx, vout)
            torch.cuda.synchronize()
            rec["vllm_same_result"] = same_rows(vout, want)  # informative: vLLM's ties are arbitrary
            rec["vllm_topk"] = graph_time(lambda: peers.topk(scores, lengths, K, out=idx))
            rec["vllm"] = graph_time(lambda: peers.call(scores, lengths, idx, vout))
        except Exception as e:
            rec["vllm_error"] = f"{type(e).__name__}: {e}"[:400]
    col = torch.arange(n, device=DEV)
    pout = torch.empty((t, K, 2), device=DEV)

    def torch_path():
        masked = torch.where(col < lengths[:, None], scores, float("-inf"))
        pack_candidates_triton(
            scores, torch.topk(masked, K, dim=1).indices, DcpGeometry(W, RANK, I, I), out=pout, validate=False
        )

    torch_path()
    rec["torch_same_result"] = same_rows(pout, want)  # informative: torch.topk's ties are unordered
    rec["torch"] = graph_time(torch_path)
    return rec


def compact_rule() -> dict:
    """The default plan's choice between the two paths (``kernels/indexer_triton.py``), as this run used it."""
    from dcp_ref.kernels import indexer_triton as ix

    bounds = ("COMPACT_MIN_COLS", "COMPACT_LONG_COLS", "COMPACT_LONE_ROWS", "COMPACT_MANY_ROWS")
    return {
        "rule": "prefer_compact: L >= COMPACT_MIN_COLS and (L < COMPACT_LONG_COLS or T <= COMPACT_LONE_ROWS or "
        "T >= COMPACT_MANY_ROWS), rows longer than a tile, k <= MAX_TILE / 2",
        **{b: getattr(ix, b) for b in bounds},
    }


def compare_paths(results: list[dict]) -> list[dict]:
    """Per shape timed both ways (:func:`run_shape`): the streamed and the compacted path's device times, which is
    faster, the path the default plan takes (``prefer_compact``'s choice) and whether that is the faster one."""
    out = []
    for r in results:
        if "streamed" not in r or "compacted" not in r:
            continue
        st, co = (r[p].get("graph", {}).get("median_us") for p in ("streamed", "compacted"))
        faster = None if st is None or co is None else ("compacted" if co < st else "streamed")
        picks = "compacted" if r["triton"]["plan"]["compact"] else "streamed"
        out.append(
            {
                "T": r["T"],
                "L": r["L"],
                "k": r["k"],
                "streamed_us": st,
                "compacted_us": co,
                "streamed_over_compacted": st / co if st and co else None,
                "faster": faster,
                "rule_picks": picks,
                "rule_agrees": None if faster is None else picks == faster,
                "same_result": bool(r["streamed"].get("same_result")) and bool(r["compacted"].get("same_result")),
                "errors": {p: r[p]["error"] for p in ("streamed", "compacted") if "error" in r[p]} or None,
                "plans": {p: r[p]["plan"] for p in ("streamed", "compacted")},
            }
        )
    return out


def summarize(results: list[dict]) -> list[dict]:
    out = []
    for r in results:
        f = r["fused"]
        fu = f.get("graph", {}).get("median_us")
        floor = max(r["read_floor_us"], r["launch_floor_us"])
        out.append(
            {
                "T": r["T"],
                "L": r["L"],
                "k": r["k"],
                "dist": r["dist"],
                "fused_us": fu,
                "triton_us": r.get("triton", {}).get("graph", {}).get("median_us"),
                "vllm_us": r.get("vllm", {}).get("median_us"),
                "vllm_topk_us": r.get("vllm_topk", {}).get("median_us"),
                "torch_us": r["torch"]["median_us"],
                "read_floor_us": r["read_floor_us"],
                "launch_floor_us": r["launch_floor_us"],
                "fused_over_floor": fu / floor if fu else None,
                "plan": f["plan"],
                "paths": f.get("paths"),
                "same_result": bool(f.get("same_result", False)),
            }
        )
    return out


def targets(summary: list[dict]) -> list[dict]:
    """The issue's targets, checked (a shape whose fused run failed counts as missed)."""
    normal = [s for s in summary if s["dist"] == "normal"]
    by = {(s["T"], s["L"]): s for s in normal}
    res = []
    for (t, n), lim in TARGETS_US.items():
        s = by.get((t, n))
        if s:
            res.append(
                {
                    "target": f"<= {lim:g} us at T={t}, L={n}, k={K}",
                    "measured_us": s["fused_us"],
                    "met": bool(s["fused_us"]) and s["fused_us"] <= lim,
                }
            )
    with_peer = [s for s in summary if s["vllm_us"]]
    if with_peer:
        slow = [[s["T"], s["L"], s["dist"]] for s in with_peer if not s["fused_us"] or s["fused_us"] >= s["vllm_us"]]
        worst = max(with_peer, key=lambda s: (s["fused_us"] or float("inf")) / s["vllm_us"])
        res.append(
            {
                "target": "faster than vLLM's top-K + pack at every measured shape and ties row",
                "worst_ratio": (worst["fused_us"] or float("inf")) / worst["vllm_us"],
                "at": [worst["T"], worst["L"], worst["dist"]],
                "faster_at": len(with_peer) - len(slow),
                "of": len(with_peer),
                "slower_at": slow,
                "met": not slow,
            }
        )
    far = [[s["T"], s["L"]] for s in normal if not s["fused_over_floor"] or s["fused_over_floor"] > 3]
    res.append({"target": "within 3x of the read floor or the launch floor", "missed_at": far, "met": not far})
    res.append(
        {
            "target": "same result as local_topk + pack_candidates everywhere",
            "met": all(s["same_result"] for s in summary),
        }
    )
    return res


def validation_cost(shapes: list[tuple[int, int]]) -> list[dict]:
    """Eager device time of a validated call (lengths given: in-kernel checks + one host read) against an
    unvalidated one, same plan and buffers. Target: <= 1.5x + 10 µs."""
    from dcp_ref.kernels.indexer_triton import indexer_topk_pack, workspace_for

    res = []
    for t, n in shapes:
        scores = make_scores(t, n, seed=3)
        lengths = torch.full((t,), n, dtype=torch.int32, device=DEV)
        out = torch.empty((t, K, 2), device=DEV)
        ws = workspace_for(scores, K)
        times = {}
        for v in (False, True):
            fn = lambda v=v: indexer_topk_pack(  # noqa: E731
                scores, lengths, K, DcpGeometry(W, RANK, I, I), out=out, validate=v, workspace=ws
            )
            fn()
            times["validated" if v else "unvalidated"] = _timing.eager(fn, flush_l2=True).median_us
        lim = 1.5 * times["unvalidated"] + 10
        res.append({"T": t, "L": n, **{f"{a}_eager_us": b for a, b in times.items()}, "limit_us": lim,
                    "met": times["validated"] <= lim})  # fmt: skip
    return res


def rank_local_times(shapes: list[tuple[int, int]]) -> list[dict]:
    """``order="rank_local"`` (scores + local ids) against the pairs, graph time, checked against the reference."""
    from dcp_ref.indexer import local_topk_rank_local
    from dcp_ref.kernels.indexer_triton import indexer_topk_pack, workspace_for

    res = []
    for t, n in shapes:
        scores = make_scores(t, n, seed=5)
        lengths = torch.full((t,), n, dtype=torch.int32, device=DEV)
        ws = workspace_for(scores, K)
        so = torch.full((t, K), 7.0, device=DEV)
        io = torch.full((t, K), 7, dtype=torch.int32, device=DEV)
        fn = lambda: indexer_topk_pack(  # noqa: E731
            scores,
            lengths,
            K,
            DcpGeometry(W, RANK, I, I),
            out=so,
            out_ids=io,
            order="rank_local",
            validate=False,
            workspace=ws,
        )
        fn()
        ws_, wi = local_topk_rank_local(scores, K, lengths)
        ok = torch.equal(io, wi) and torch.equal(so.view(torch.int32), ws_.view(torch.int32))
        res.append({"T": t, "L": n, "same_result": ok, "graph": graph_time(fn)})
    return res


def fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def plan_str(p: dict) -> str:
    if p.get("engine") == "cutedsl":
        c, t, cpt, fb, *rest = p["cute"]  # (the commit since the bitmap commit: older runs' plans have 4 fields)
        commit = f" / {rest[0]} commit" if rest else ""
        return f"cutedsl {c}×{t} / {cpt * p['vec']} keys a thread / first {fb} bits{commit}"
    if p.get("compact") and "cap" in p:
        return (
            f"compact S={p['split']} tile {p['tile']} cap {p['cap']} sample {p['sample']} / {p['num_warps']}w / "
            f"{p['select']}"
        )
    split = "→".join(str(s) for s in p.get("levels") or [p["split"]])
    streamed = "" if p["one_chunk"] else " (streamed)"
    return f"{p['tile']}{streamed} / {p['num_warps']}w / {split} / {p.get('select', 'radix')}"


def markdown(data: dict) -> str:
    m = data
    lines = [
        f"# Indexer stage (local top-K + pack) on {m['device']['name']} — torch {m['versions']['torch']}, "
        f"triton {m['versions']['triton']}, {m['date_utc']}",
        "",
        f"k = {K}, W = {W}, rank {RANK}, I = {I}; standard normal float32 scores (and 16-value ties rows), every key "
        "valid. Device time per call (CUDA-graph replay), µs medians. *fused* = ours, the default plan (stable, "
        "exact); "
        '*Triton* = ours on the Triton kernel (`engine="triton"`, its default plan); *vLLM* = '
        f"`top_k_per_row_decode` + pack ({m['peers'].get('pack', '-')}), not stable at ties; *vLLM top-K* alone; "
        "*torch* = `torch.topk` + our pack. Read floor = T·L·4 bytes at the measured copy bandwidth "
        f"({m['copy_bandwidth_TBps']:.2f} TB/s); launch floor = one empty launch ({m['launch_floor_us']:.1f} µs). "
        "Paths = rows per path of the compacted plan (list / ties at the bound / relisted above it / fallback).",
        "",
        "| T | L | fused | Triton | vLLM | vLLM top-K | torch | read floor | launch floor | fused ÷ floor | plan "
        "| paths | same |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|:---:|",
    ]
    for s in m["summary"]:
        paths = "-" if not s["paths"] else "/".join(str(v) for v in s["paths"].values())
        lines.append(
            f"| {s['T']} | {s['L']}{'' if s['dist'] == 'normal' else ' (' + s['dist'] + ')'} | {fmt(s['fused_us'])} | "
            f"{fmt(s.get('triton_us'))} | {fmt(s['vllm_us'])} | {fmt(s['vllm_topk_us'])} | {fmt(s['torch_us'])} | "
            f"{fmt(s['read_floor_us'], '.3g')} | "
            f"{fmt(s['launch_floor_us'])} | {fmt(s['fused_over_floor'])}× | {plan_str(s['plan'])} | {paths} | "
            f"{'✓' if s['same_result'] else '✗'} |"
        )
    lines += ["", "## Targets", "", "| target | measured | met? |", "|---|---|:---:|"]
    for t in m["targets"]:
        meas = ", ".join(
            f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in t.items() if k not in ("target", "met")
        )
        lines.append(f"| {t['target']} | {meas} | {'✓' if t['met'] else '✗'} |")
    if m.get("compact_vs_streamed"):
        rule = m.get("compact_rule", {})
        lines += ["", f"## Compacted vs streamed path (graph µs; the rule: {rule.get('rule', '-')})", "",
                  "| T | L | streamed | compacted | streamed ÷ compacted | faster | rule picks | agrees | same |",
                  "|---:|---:|---:|---:|---:|---|---|:---:|:---:|"]  # fmt: skip
        for c in m["compact_vs_streamed"]:
            agrees = "-" if c["rule_agrees"] is None else ("✓" if c["rule_agrees"] else "✗")
            lines.append(
                f"| {c['T']} | {c['L']} | {fmt(c['streamed_us'])} | {fmt(c['compacted_us'])} | "
                f"{fmt(c['streamed_over_compacted'], '.2f')} | {c['faster'] or '-'} | {c['rule_picks']} | {agrees} | "
                f"{'✓' if c['same_result'] else '✗'} |"
            )
    if m.get("validation"):
        lines += ["", "## Validated calls (eager µs)", "", "| T | L | unvalidated | validated | limit | met? |",
                  "|---:|---:|---:|---:|---:|:---:|"]  # fmt: skip
        for v in m["validation"]:
            lines.append(
                f"| {v['T']} | {v['L']} | {v['unvalidated_eager_us']:.1f} | {v['validated_eager_us']:.1f} | "
                f"{v['limit_us']:.1f} | {'✓' if v['met'] else '✗'} |"
            )
    if m.get("rank_local"):
        lines += ["", '## order="rank_local" (graph µs)', "", "| T | L | µs | same |", "|---:|---:|---:|:---:|"]
        for v in m["rank_local"]:
            lines.append(
                f"| {v['T']} | {v['L']} | {v['graph']['median_us']:.1f} | {'✓' if v['same_result'] else '✗'} |"
            )
    if m.get("tuning"):
        lines += ["", "## Launch-plan sweep (graph µs; ✗ = wrong result or error)", "",
                  "| T | L | tuning | plan | µs | paths | same |", "|---:|---:|---|---|---:|---|:---:|"]  # fmt: skip
        for r in m["tuning"]:
            g = r.get("graph", {}).get("median_us")
            paths = "-" if not r.get("paths") else "/".join(str(v) for v in r["paths"].values())
            lines.append(
                f"| {r['T']} | {r['L']} | {r.get('tune', {'radix_bits': r.get('radix_bits')})} | "
                f"{plan_str(r['plan'])} | "
                f"{fmt(g)} | {paths} | "
                f"{'✓' if r.get('same_result') else '✗ ' + r.get('error', '')[:60]} |"
            )
    return "\n".join(lines + design_section()) + "\n"


#: How ours and vLLM's select a row (from vLLM's source, ``csrc/sampler.cu``, and our kernel), beside the ncu reading
#: of ours (``benchmarks/results/ncu/local_topk_<T>x<L>.json``, :data:`NCU_SHAPES`; vLLM's kernel was not profiled).
DESIGN = [
    ("reads of each score from HBM", "1 (the row held in registers)",
     "1 for the histogram, then 1-3 more passes over the row (L2 when it fits)"),
    ("CTAs per row", "1, or a cluster of 2-8 (histograms summed through DSMEM)",
     "1 (512 threads); 10 + a merge launch from 200K columns"),
    ("passes", "8-bit digits of the 32 score bits: <= 4 histograms (and bin scans) over registers",
     "11-bit fp16 bins, then 11 / 11 / 10 bits of the float; stop when the bin holds <= 2048, radix-sort those"),
    ("ties", "stable: the commit's index-order scan takes the lowest indices of the threshold value",
     "unstable: the threshold bin's keys by atomic order"),
    ("output order", "winners by increasing local index: where winners are dense, one exclusive scan per vector "
     "load (staged in shared memory by slot, then written out one slot a thread); where sparse (L >= 16 k, "
     "local_topk_cutedsl.commit_for), a shared-memory bitmap of the winners' positions and one scan of its words",
     "atomic slot order"),
    ("instructions a key (sm_90a SASS, 32 keys a thread, 4 CTAs x 1024)", "load + pass 0 ~24; each later pass "
     "~11 (3 of them at 8-bit digits); commit: scan ~58 (and a 232-byte spill), bitmap ~9 (no spill)",
     "by its source, ~15 (pass 0 and the collection: convert, shift, one shared atomic; not disassembled here)"),
    ("occupancy", "1 CTA of 1024 threads per SM at 32 keys a thread (64 registers); 2 at 512 x 16",
     "512-thread CTAs, keys re-read rather than held (its occupancy not profiled here)"),
    ("what bounds it", "instruction issue at many rows (ncu below); latency of the pass chain at few; with 128K "
     "keys at many rows, waits, not issue (clusters of 4, one CTA per SM: ncu below)",
     "not profiled here"),
]  # fmt: skip


#: The committed ncu summaries the design section quotes (``results/ncu/local_topk_<T>x<L>.json``, from
#: ``profile_local_topk.py``): a shape where ours is issue-bound and one where it waits.
NCU_SHAPES = ("1024x32768", "128x131072")


def design_section() -> list[str]:
    """The design comparison and, when committed, the ncu summary of ours (markdown lines)."""
    lines = ["", "## Ours against vLLM's, by design", "", "| | ours (CuTeDSL) | vLLM `top_k_per_row_decode` |",
             "|---|---|---|"]  # fmt: skip
    lines += [f"| {a} | {b} | {c} |" for a, b, c in DESIGN]
    for shape in NCU_SHAPES:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "ncu", f"local_topk_{shape}.json")
        if not os.path.exists(path):
            continue
        with open(path) as fh:
            ncu = json.load(fh)
        k = ncu["kernels"][0]
        lines += [
            "",
            f"ncu, {ncu['label']}: {k['duration_us']:.1f} µs, DRAM {k['dram_throughput_pct']:.1f} %, "
            f"issue slots busy {k['Issue Slots Busy']}, IPC {k['Executed Ipc Active']}, achieved occupancy "
            f"{k['achieved_occupancy_pct']:.1f} %, {k['registers_per_thread']:.0f} registers. {ncu['reading']}.",
        ]
    return lines


def write(out_dir: str, data: dict) -> None:
    with open(os.path.join(out_dir, "local_topk.json"), "w") as fh:
        json.dump(data, fh, indent=1)
    with open(os.path.join(out_dir, "local_topk.md"), "w") as fh:
        fh.write(markdown(data))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results", help="directory for local_topk.json / local_topk.md")
    ap.add_argument("--peers", default=".gpu/ix_peers/vllm", help="folder with vLLM's topk_decode.py + .so")
    ap.add_argument("--quick", action="store_true", help=f"only {QUICK}")
    ap.add_argument("--no-sweep", "--no-tuning", dest="sweep", action="store_false", help="skip the launch-plan sweep")
    ap.add_argument(
        "--triton-sweep", action="store_true", help="sweep the Triton kernel's plans, not the CuTeDSL one's"
    )
    ap.add_argument("--no-ties", dest="ties", action="store_false", help="skip the heavy-ties inputs")
    ap.add_argument("--sweep-budget", "--tuning-budget", dest="budget", type=float, default=110.0,
                    help="seconds for the launch-plan sweep")  # fmt: skip
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    bw = _meta.copy_bandwidth(DEV)
    floor = launch_floor()["median_us"]
    peers = Peers(args.peers)
    data = {
        "benchmark": "indexer stage: local top-K + pack (kernels/local_topk_cutedsl.py, kernels/indexer_triton.py) vs "
        "vLLM's and torch's",
        "device": {
            "name": props.name,
            "sms": props.multi_processor_count,
            "capability": f"{props.major}.{props.minor}",
        },
        "versions": _meta.versions(),
        "date_utc": _meta.now_utc(),
        "argv": sys.argv[1:],
        "copy_bandwidth_TBps": bw / 1e12,
        "launch_floor_us": floor,
        "peers": peers.note,
        "tie_rules": TIE_RULES,
        "timing": _timing.describe("graph", "`reps`", flush_l2=True),
        "inputs": {
            "k": K,
            "world_size": W,
            "rank": RANK,
            "interleave": I,
            "scores": "standard normal float32",
            "ties": "16 distinct values",
            "lengths": "L (every key valid)",
        },
    }
    results = []
    shapes = [(t, n, "normal") for t, n in (QUICK if args.quick else SHAPES)]
    shapes += [(t, n, "ties") for t, n in TIES] if args.ties else []
    for t, n, dist in shapes:
        rec = run_shape(t, n, bw, floor, peers, dist)
        results.append(rec)
        f = rec["fused"]
        print(
            f"T={t:5d} L={n:6d} {dist:6s} fused={fmt(f.get('graph', {}).get('median_us')):>8s} "
            f"ok={f.get('same_result')} "
            f"vllm={fmt(rec.get('vllm', {}).get('median_us')):>8s} torch={rec['torch']['median_us']:8.1f} "
            f"paths={f.get('paths')} compile={f.get('first_call_s', 0):.1f}s {f.get('error', '')}",
            flush=True,
        )
    data["results"] = results
    data["summary"] = summarize(results)
    data["targets"] = targets(data["summary"])
    data["compact_rule"] = compact_rule()
    data["compact_vs_streamed"] = compare_paths(results)
    for c in data["compact_vs_streamed"]:
        print(
            f"T={c['T']:5d} L={c['L']:6d} streamed={fmt(c['streamed_us']):>8s} compacted={fmt(c['compacted_us']):>8s} "
            f"faster={c['faster']} rule={c['rule_picks']} agrees={c['rule_agrees']} ok={c['same_result']}",
            flush=True,
        )
    write(args.out, data)  # now, in case a later section runs out of time
    data["validation"] = validation_cost([(32, 8192), (1024, 32768), (1, 131072)])
    data["rank_local"] = rank_local_times([(32, 8192), (1024, 32768), (1, 131072)])
    write(args.out, data)
    print(f"main table + validation + rank_local: {time.monotonic() - t_start:.0f} s", flush=True)
    if args.sweep:
        sweep, inputs = [], {}
        t0 = time.monotonic()
        for t, n, tune in TRITON_SWEEP if args.triton_sweep else cute_sweep():
            if time.monotonic() - t0 > args.budget:
                print(f"sweep stopped after {args.budget} s", flush=True)
                break
            if (t, n) not in inputs:
                scores = make_scores(t, n, seed=t * 7 + n)
                lengths = torch.full((t,), n, dtype=torch.int32, device=DEV)
                inputs = {(t, n): (scores, lengths, reference(scores, lengths))}  # one shape's inputs at a time
            scores, lengths, want = inputs[(t, n)]
            rec = {"T": t, "L": n} | run_fused(scores, lengths, want, tune)
            sweep.append(rec)
            g = fmt(rec.get("graph", {}).get("median_us"))
            print(f"sweep T={t} L={n} {tune} -> {g} ok={rec.get('same_result')} paths={rec.get('paths')} "
                  f"{rec.get('error', '')}", flush=True)  # fmt: skip
        data["tuning"] = sweep  # the key the earlier runs used (chapter 02 reads it)
        write(args.out, data)
    print(json.dumps(data["targets"], indent=1))
    print(f"total {time.monotonic() - t_start:.0f} s")
    ok = all(s["same_result"] for s in data["summary"]) and all(c["same_result"] for c in data["compact_vs_streamed"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
