#!/usr/bin/env python3
"""Benchmark the scoring stage on one H200: FP8 index keys -> index scores (next_n 1 and 2), then -> top-K -> pack.

    python3 benchmarks/bench_scoring.py --out $OUT [--peers .gpu/peers/vllm] [--deepgemm $OUT/deepgemm_logits.json]
        [--no-chain] [--no-sweep | --sweep-budget 300] [--next-n 1,2] [--ncu-json ncu.json ...]
    python3 benchmarks/bench_scoring.py --quick --no-sweep --out /tmp/s   # a smoke test
    python3 benchmarks/bench_scoring.py --print-plans benchmarks/results/scoring.json   # CPU: the PLANS table

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
in ``peer_errors``; the rest runs.) ``--no-chain --no-sweep`` times ours (and reads DeepGEMM's JSON) only: the
quick loop while tuning the kernel.

Shapes (``_scoring_inputs.py``: the same bytes as the DeepGEMM peer's): ``next_n = 1`` — ``T`` in {1, 32, 128}
query tokens, one request each (``B = T``, every key valid) — and ``next_n = 2`` (MTP) — ``T`` in {2, 64, 256},
``B = T / 2`` requests of two consecutive tokens, the first seeing ``L - 1`` keys and the second ``L`` — each
x local ``L`` in {4096, 32768, 131072}; 64 index heads x 128, block size 64, random FP8 keys. Per shape:

* ``ours`` — :func:`dcp_ref.kernels.scoring_triton.index_scores_triton` (``out=``, ``validate=False``,
  ``next_n=``), default plan; its relative error against the float64 oracle (:func:`dcp_ref.scoring.index_scores`)
  on the first rows (``max_rel_err``: ``max |err| / max |score|``);
* ``ours_chain`` — the scoring kernel + ``indexer_topk_pack`` (``k = 2048``) on its scores, every shape (a kernel
  that fused the two, scores never written, measured slower than this chain at every shape on 2026-12-02 and was
  removed: ``results/scoring.md``);
* ``vllm`` — vLLM's indexer top-K (``top_k_per_row_decode``, ctypes, no CuTeDSL needed) and pack
  (``pack_dcp_topk_candidates``, its module imports cutlass: needs the CuTeDSL bundle) on our scores (per-row
  lengths), from ``--peers DIR`` (``../shared/peers/vllm``); skipped when absent;
* ``deepgemm`` — read from ``--deepgemm JSON`` (written by ``peer_deepgemm_logits.py`` in its own process),
  joined on ``(T, L, next_n)``: ``fp8_paged_mqa_logits`` (+ its metadata call, reported separately) and its
  relative error on the same inputs; ``peer_chain_us`` = DeepGEMM logits + vLLM top-K + vLLM pack;
* floors: the read floor (the keys once per request, ``B * L * 132`` bytes, + the output, at the copy bandwidth
  measured in this run) and the FP8 compute floor (``2 * T * L * 64 * 128`` FLOP at 1979 TFLOP/s dense), and
  which binds; the target ``target_us = 1.3 * read_floor_us + 3`` (``meets_target``).

``--no-chain`` skips the chain and vLLM columns. FlashInfer 0.7's ``fp8_paged_mqa_logits`` is an
SM100-only CuTeDSL kernel: it is not a peer on the H200.

Times: device time per call from replaying a CUDA graph of back-to-back calls, L2 flushed before each replay
(``_timing.py``: median of its samples / calls), as ``bench_local_topk.py``. The sweep (default on;
``--no-sweep``): the scoring kernel's launch configurations
:data:`SWEEP_SPACE` and :data:`SWEEP_EXTRA`, each made into a plan (``scoring_plan(T, L, device, **config)``, passed
as ``plan=``) (after the plan's own, ``config: {}``; a config the plan resolves to one
already timed at that shape, or with more tiles than the row has, is skipped) at every shape of both ``next_n``,
configurations in the outer loop (a seeded shuffle) and shapes inner, so that a cut by ``--sweep-budget`` seconds
leaves every shape with the same configurations; each checked (``max_rel_err`` against the oracle rows,
``vs_default_rel_err`` against the default plan's whole output) and timed with a cheaper timer
(:func:`sweep_row`: a CUDA graph of ``reps`` calls under ``_timing.SWEEP``, fewer samples). :func:`best_plans`
picks, per ``(next_n, T, L)``, the fastest configuration within 1e-3; ``--print-plans scoring.json`` prints them as
the ``PLANS`` literal of ``kernels/scoring_triton.py`` (no GPU needed). ``--ncu-json FILE``
(repeatable): summaries written by ``profile_scoring.py --summarize``, kept under ``ncu`` and tabulated.

Writes ``scoring.json`` under ``--out``: ``summary`` rows ``{"T", "B", "L", "next_n", "ours_us", "read_floor_us",
"compute_floor_us", "binds", "target_us", "meets_target", "max_rel_err", "plan", "deepgemm_us",
"deepgemm_max_rel_err", "deepgemm_metadata_us", "vs_deepgemm"}`` (+ ``ours_unfused_chain_us``,
``vllm_topk_pack_us``, ``peer_chain_us``
where measured, else ``None``), ``results`` (the per-shape details), ``sweep`` (records ``{"kernel": "scoring",
"T", "B", "L", "next_n", "config", "plan", "graph": {"median_us", ...}, "max_rel_err", "vs_default_rel_err"}`` or
``"error"``), ``sweep_best`` (per shape: the default and the best plan and times), ``ncu``; and ``scoring.md``
(the summary table, the sweep's best against the default plan, the ncu summaries).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import random
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from typing import Any

import _meta
import _scoring_inputs as si
import _timing
import torch

RANK, W, I = 0, 1, 1  # the id arithmetic only (one rank's keys); scoring does not depend on it
DEV = "cuda"
#: the target: ``TARGET_FACTOR * read floor + TARGET_SLACK_US`` (a launch and its tail on top of the read)
TARGET_FACTOR, TARGET_SLACK_US = 1.3, 3.0
#: the largest relative error (against the float64 oracle) a sweep configuration may have to be picked
MAX_REL_ERR = 1e-3
#: the scoring kernel's sweep space (``tiles`` = tiles of ``block_n`` keys per program; ``tma``: the values by the
#: bulk tensor copy engine, else ``cp.async``; ``pair_dot``: MTP pairs by one dot of N = 2 x heads). Explored first
#: on the H200 (2026-12-01, 22 configurations x 12 shapes, then 60 x 18): a register cap (``maxnreg``), loading the
#: scales in place and 128-key tiles were never faster, so they are gone; the number of stages moved times by a few
#: percent at most, the tiles per program (how many programs, so how full the last wave) by up to 2x.
SWEEP_SPACE: dict[str, tuple[Any, ...]] = {
    "tiles": (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
    "num_stages": (4, 6),
    "tma": (True,),
    "pair_dot": (True, False),  # (the same plan at next_n = 1: timed once there)
}
SWEEP_EXTRA = [dict(block_n=64, num_warps=4, tiles=t, num_stages=5, tma=False) for t in (4, 16, 24)]
PLAN_FIELDS = ("block_n", "tiles", "num_warps", "num_stages", "tma", "pair_dot")


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


def graph_row(fn: Callable[[], Any]) -> dict[str, Any]:
    """Device time per call (``_timing``: a CUDA graph of ``reps`` calls, L2 flushed before each replay; eager
    CUDA events when the call cannot be captured)."""
    return _timing.graph_row(fn, flush_l2=True, fallback=True)


def sweep_row(fn: Callable[[], Any], reps: int) -> dict[str, Any]:
    """The sweep's cheaper timer: :func:`graph_row` under ``_timing.SWEEP``; a call that cannot be captured raises."""
    return _timing.graph_row(fn, calls=reps, flush_l2=True, rule=_timing.SWEEP) | {"timing": "graph, SWEEP rule"}


def nn_kw(next_n: int) -> dict[str, int]:
    """The ``next_n=`` keyword, only where it is not 1 (so that a kernel without it still runs the next_n = 1 rows)."""
    return {} if next_n == 1 else {"next_n": next_n}


def target_us(read_floor_us: float) -> float:
    return TARGET_FACTOR * read_floor_us + TARGET_SLACK_US


def shape_list(quick: bool, next_ns: Iterable[int]) -> list[tuple[int, int, int]]:
    """``(T, L, next_n)`` of the families in ``next_ns`` (1: ``si.SHAPES``, 2: ``si.MTP_SHAPES``)."""
    want = set(next_ns)
    return [s for s in si.all_shapes(quick) if s[2] in want]


def run_shape(t: int, n: int, nn: int, bw: float, peers: dict[str, Any], chain_cols: bool = True) -> dict[str, Any]:
    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.kernels.scoring_triton import index_scores_triton, scoring_plan

    k = si.TOPK
    g = DcpGeometry(W, RANK, I, si.BLOCK)
    rec: dict[str, Any] = {"T": t, "B": t // nn, "L": n, "next_n": nn, "k": k}
    inp = si.build_inputs(t, n, DEV, next_n=nn)
    args = [inp[x] for x in ("index_q", "weights", "index_cache", "block_table", "req_of_token", "local_bounds")]
    bounds = inp["local_bounds"]
    ref = si.reference_rows(inp)
    rec["ref_rows"] = ref.shape[0]
    rec["floors_scores"] = si.floors(t, n, bw, t * n * 4, next_n=nn)
    # ---- ours: the scoring kernel
    scores = torch.full((t, n), float("nan"), device=DEV)
    rec["plan"] = scoring_plan(t, n, scores.device, **nn_kw(nn))._asdict()
    ours = lambda: index_scores_triton(*args, g, out=scores, validate=False, **nn_kw(nn))  # noqa: E731
    ours()
    torch.cuda.synchronize()
    rec["max_rel_err"] = si.rel_error(scores, ref)
    inside = torch.arange(n, device=DEV)[None, :] < bounds[:, None].long()
    rec["ours_all_finite"] = bool(torch.isfinite(scores[inside]).all())  # each token's own columns
    rec["ours_neginf_past_bounds"] = bool((scores[~inside] == float("-inf")).all())
    del inside
    rec["ours"] = graph_row(ours)
    if not chain_cols:
        return rec
    from dcp_ref.kernels.indexer_triton import indexer_topk_pack, workspace_for

    # ---- ours, unfused chain: scores + indexer_topk_pack (per-row lengths: any next_n)
    chain_out = torch.empty((t, k, 2), device=DEV)
    ws = workspace_for(scores, k)
    chain = lambda: (ours(), indexer_topk_pack(scores, bounds, k, g, out=chain_out, validate=False,  # noqa: E731
                                               workspace=ws))  # fmt: skip
    chain()
    torch.cuda.synchronize()
    rec["ours_chain"] = graph_row(chain)
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
            rec["vllm_topk"] = graph_row(vt)
            if "vllm_dcp_topk" in peers:
                packed = torch.empty((t, k, 2), device=DEV)
                vp = lambda: peers["vllm_dcp_topk"].pack_dcp_topk_candidates(scores, v_idx, packed, RANK, W, I)  # noqa: E731
                vboth = lambda: (vt(), vp())  # noqa: E731
                vboth()
                torch.cuda.synchronize()
                rec["vllm_pack"] = graph_row(vp)
                rec["vllm_topk_pack"] = graph_row(vboth)
                # informative: vLLM's top-K is not stable at ties
                rec["vllm_tolerant_ok"] = tolerant_selection_ok(packed, scores, k)
        except Exception as e:  # noqa: BLE001 - recorded, the shape goes on
            rec["vllm_error"] = f"{type(e).__name__}: {e}"[:500]
    return rec


# ---- the scoring kernel's sweep ----------------------------------------------------------------------------
def scoring_configs(seed: int = 0) -> list[dict[str, Any]]:
    """Every configuration of :data:`SWEEP_SPACE` (64-key tiles, 4 warps) and :data:`SWEEP_EXTRA`, in a seeded
    shuffle: a budget cut after any prefix still leaves a spread of each parameter's values."""
    keys = list(SWEEP_SPACE)
    cfgs = [dict(block_n=64, num_warps=4) | dict(zip(keys, vals, strict=True))
            for vals in itertools.product(*(SWEEP_SPACE[k] for k in keys))]  # fmt: skip
    cfgs += [dict(c) for c in SWEEP_EXTRA]
    random.Random(seed).shuffle(cfgs)
    return cfgs


def plan_key(plan: dict[str, Any]) -> tuple[Any, ...]:
    """The plan's launch as the ``PLANS`` value: ``(block_n, tiles, num_warps, num_stages, tma, pair_dot)``."""
    return tuple(bool(plan.get(f, False)) if f in ("tma", "pair_dot") else int(plan[f]) for f in PLAN_FIELDS)


PlanOf = Callable[[tuple[int, int, int], dict[str, int]], dict[str, Any]]


def sweep_schedule(
    shapes: list[tuple[int, int, int]], configs: list[dict[str, int]], plan_of: PlanOf
) -> list[tuple[tuple[int, int, int], dict[str, int], dict[str, Any] | str]]:
    """The sweep's (shape, config, resolved plan or error text) in run order: the plan's own ``{}`` at every shape
    first, then ``configs`` in the outer loop and ``shapes`` inner. At a shape, a config is dropped when its plan
    repeats one already scheduled there (the plan clamps ``tiles`` to the row), when it asks for more tiles than
    the row has, or when its plan has no program per row; a config the plan refuses is kept with the error."""
    out: list[tuple[tuple[int, int, int], dict[str, int], dict[str, Any] | str]] = []
    seen: dict[tuple[int, int, int], set[tuple[Any, ...]]] = {s: set() for s in shapes}
    for cfg in [{}, *configs]:
        for shape in shapes:
            try:
                plan = plan_of(shape, cfg)
            except Exception as e:  # noqa: BLE001 - a config the plan refuses: recorded as that shape's error
                out.append((shape, cfg, f"{type(e).__name__}: {e}"[:400]))
                continue
            n_tiles = -(-shape[1] // int(plan["block_n"]))
            if cfg and (int(plan.get("programs", 1)) < 1 or cfg.get("tiles", 1) > n_tiles):
                continue
            key = plan_key(plan)
            if key in seen[shape]:
                continue
            seen[shape].add(key)
            out.append((shape, cfg, plan))
    return out


def sweep_scoring(budget: float, shapes: list[tuple[int, int, int]], configs: list[dict[str, int]]) -> dict[str, Any]:
    """Time :func:`sweep_schedule`'s configurations within ``budget`` seconds; ``{"records", "budget_s",
    "elapsed_s", "scheduled", "run", "cut"}``."""
    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.kernels.scoring_triton import index_scores_triton, scoring_plan

    g = DcpGeometry(W, RANK, I, si.BLOCK)
    t0 = time.monotonic()
    state: dict[tuple[int, int, int], dict[str, Any]] = {}
    for t, n, nn in shapes:
        inp = si.build_inputs(t, n, DEV, next_n=nn)
        args = [inp[x] for x in ("index_q", "weights", "index_cache", "block_table", "req_of_token", "local_bounds")]
        state[(t, n, nn)] = {"args": args, "ref": si.reference_rows(inp), "out": torch.empty((t, n), device=DEV),
                             "base": None, "reps": None}  # fmt: skip
    dev = torch.device(DEV)
    plan_of: PlanOf = lambda s, c: scoring_plan(s[0], s[1], dev, **nn_kw(s[2]), **c)._asdict()  # noqa: E731
    sched = sweep_schedule(shapes, configs, plan_of)
    records: list[dict[str, Any]] = []
    failed: dict[tuple[int, ...], str] = {}  # (plan, next_n) -> the resource error it met (not shape-dependent)
    cut = False
    for shape, cfg, plan in sched:
        if time.monotonic() - t0 > budget:
            cut = True
            break
        t, n, nn = shape
        st = state[shape]
        rec: dict[str, Any] = {"kernel": "scoring", "T": t, "B": t // nn, "L": n, "next_n": nn, "config": cfg}
        if isinstance(plan, str):
            rec["error"] = plan
            records.append(rec)
            continue
        rec["plan"] = plan
        fkey = (*plan_key(plan), nn)
        if fkey in failed:
            rec["error"] = f"skipped: {failed[fkey]}"
            records.append(rec)
            continue
        try:
            o = st["out"]
            o.fill_(float("nan"))
            # the configuration reaches the kernel as a plan (the wrapper takes no tuning of its own): the plan
            # scheduled above, made again from the same keywords (a plan is a small tuple, made on the host)
            sp = scoring_plan(t, n, dev, **nn_kw(nn), **cfg)
            fn = lambda: index_scores_triton(*st["args"], g, out=o, validate=False, plan=sp, **nn_kw(nn))  # noqa: E731
            fn()
            torch.cuda.synchronize()
            rec["max_rel_err"] = si.rel_error(o, st["ref"])
            if st["base"] is None:  # the default plan's output: every later config is compared with all of it
                st["base"] = o.clone()
                st["reps"] = _timing.reps_for(fn)
            else:
                rec["vs_default_rel_err"] = si.rel_error(o, st["base"])
                rec["mask_same_as_default"] = bool(torch.equal(torch.isfinite(o), torch.isfinite(st["base"])))
            rec["graph"] = sweep_row(fn, st["reps"])
        except Exception as e:  # noqa: BLE001 - a config that fails to compile or run is recorded
            rec["error"] = f"{type(e).__name__}: {e}"[:400]
            if "OutOfResources" in rec["error"] or "out of resource" in rec["error"].lower():
                failed[fkey] = rec["error"][:200]
            try:
                torch.cuda.synchronize()
            except Exception as e2:  # noqa: BLE001 - a sticky CUDA error: every later config will say so too
                rec["sync_error"] = f"{type(e2).__name__}: {e2}"[:200]
        records.append(rec)
        print(f"sweep scoring T={t} L={n} next_n={nn} {cfg} -> {rec.get('graph', {}).get('median_us')} "
              f"err={rec.get('max_rel_err')} {rec.get('error', '')[:120]}", flush=True)  # fmt: skip
    return {"records": records, "budget_s": budget, "elapsed_s": time.monotonic() - t0, "scheduled": len(sched),
            "run": len(records), "cut": cut}  # fmt: skip


def valid_record(r: dict[str, Any], max_rel_err: float = MAX_REL_ERR) -> bool:
    """A timed scoring record without error, within ``max_rel_err`` of the oracle rows (and, where recorded, of
    the default plan's whole output, with the same ``-inf`` columns)."""
    if r.get("kernel", "scoring") != "scoring" or "error" in r or "plan" not in r:
        return False
    us = r.get("graph", {}).get("median_us")
    err = r.get("max_rel_err")
    if not isinstance(us, (int, float)) or not isinstance(err, (int, float)) or not err <= max_rel_err:
        return False
    vs = r.get("vs_default_rel_err")
    return (vs is None or vs <= max_rel_err) and r.get("mask_same_as_default", True) is not False


def shape_key(r: dict[str, Any]) -> tuple[int, int, int]:
    """``(next_n, T, L)``: the key of ``PLANS``."""
    return int(r.get("next_n", 1)), int(r["T"]), int(r["L"])


def best_plans(records: list[dict[str, Any]]) -> dict[tuple[int, int, int], tuple[Any, ...]]:
    """Per ``(next_n, T, L)``: ``(block_n, tiles, num_warps, num_stages, tma, pair_dot)`` of the fastest valid
    scoring record (:func:`valid_record`: no error, ``max_rel_err <= 1e-3``), from its resolved ``plan``."""
    return {k: plan_key(v["plan"]) for k, v in best_records(records).items()}


def best_records(records: list[dict[str, Any]]) -> dict[tuple[int, int, int], dict[str, Any]]:
    best: dict[tuple[int, int, int], dict[str, Any]] = {}
    for r in records:
        if not valid_record(r):
            continue
        k = shape_key(r)
        if k not in best or r["graph"]["median_us"] < best[k]["graph"]["median_us"]:
            best[k] = r
    return best


def sweep_best(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per shape: the default plan (``config: {}``) and the best valid one, their times, and how many
    configurations were timed / failed."""
    best = best_records(records)
    rows = []
    for k in sorted({shape_key(r) for r in records if r.get("kernel", "scoring") == "scoring"}):
        mine = [r for r in records if r.get("kernel", "scoring") == "scoring" and shape_key(r) == k]
        d = next((r for r in mine if r.get("config") == {}), None)
        b = best.get(k)
        d_us = d.get("graph", {}).get("median_us") if d else None
        b_us = b["graph"]["median_us"] if b else None
        rows.append({
            "next_n": k[0], "T": k[1], "L": k[2],
            "default_plan": list(plan_key(d["plan"])) if d and "plan" in d else None, "default_us": d_us,
            "best_plan": list(plan_key(b["plan"])) if b else None, "best_us": b_us,
            "best_config": b.get("config") if b else None,
            "speedup": d_us / b_us if d_us and b_us else None,
            "timed": sum(1 for r in mine if "graph" in r), "errors": sum(1 for r in mine if "error" in r),
        })  # fmt: skip
    return rows


def plans_literal(records: list[dict[str, Any]]) -> str:
    """:func:`best_plans` as a Python dict literal, sorted, one entry per line, each with its time (and the
    default plan's) as a comment: ``ast.literal_eval`` reads it back."""
    rows = {(r["next_n"], r["T"], r["L"]): r for r in sweep_best(records)}
    lines = ["{"]
    for k, v in sorted(best_plans(records).items()):
        r = rows.get(k, {})
        note = f"  # {r['best_us']:.2f} us" if r.get("best_us") else ""
        if r.get("default_us"):
            note += f"; default {tuple(r['default_plan'])} {r['default_us']:.2f} us"
        lines.append(f"    {k!r}: {v!r},{note}")
    lines.append("}")
    return "\n".join(lines)


# ---- the JSON, the tables ---------------------------------------------------------------------------------
def load_json(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        with open(path) as fh:
            return json.load(fh)
    except Exception as e:  # noqa: BLE001 - a missing peer run: recorded
        return {"error": f"reading {path}: {type(e).__name__}: {e}"}


def load_deepgemm(path: str | None) -> dict[str, Any]:
    return load_json(path)


def load_ncu(paths: list[str] | None) -> list[dict[str, Any]]:
    """``profile_scoring.py --summarize`` outputs, each with its ``file``."""
    return [{"file": os.path.basename(p)} | load_json(p) for p in paths or []]


def summarize(results: list[dict[str, Any]], dg: dict[str, Any]) -> list[dict[str, Any]]:
    by = {(s["T"], s["L"], s.get("next_n", 1)): s for s in dg.get("shapes", []) if "error" not in s}
    rows = []
    for r in results:
        med = lambda key: r.get(key, {}).get("median_us")  # noqa: E731
        nn = r.get("next_n", 1)
        d = by.get((r["T"], r["L"], nn), {})
        ours, vllm, dgu = med("ours"), med("vllm_topk_pack"), d.get("deepgemm_us")
        read = r["floors_scores"]["read_floor_us"]
        tgt = target_us(read)
        rows.append(
            {
                "T": r["T"],
                "B": r.get("B", r["T"] // nn),
                "L": r["L"],
                "next_n": nn,
                "ours_us": ours,
                "read_floor_us": read,
                "compute_floor_us": r["floors_scores"]["compute_floor_us"],
                "binds": r["floors_scores"]["binds"],
                "target_us": tgt,
                "meets_target": ours is not None and ours <= tgt,
                "max_rel_err": r.get("max_rel_err"),
                "plan": r.get("plan"),
                "deepgemm_us": dgu,
                "deepgemm_max_rel_err": d.get("max_rel_err"),
                "deepgemm_metadata_us": d.get("metadata_us"),
                "vs_deepgemm": ours / dgu if ours is not None and dgu else None,
                "ours_unfused_chain_us": med("ours_chain"),
                "vllm_topk_pack_us": vllm,
                "peer_chain_us": dgu + vllm if dgu is not None and vllm is not None else None,
            }
        )
    return rows


def fmt(v: Any, spec: str = ".1f") -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def ncu_markdown(entries: list[dict[str, Any]]) -> list[str]:
    lines = [
        "",
        "## Nsight Compute (one launch each: `profile_scoring.py`)",
        "",
        "| file | label | kernel | grid | block | µs | DRAM % | DRAM GB/s | SM % | occupancy (achieved / theoretical) "
        "| regs | smem/block | L2 hit % | top stalls |",
        "|---|---|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for e in entries:
        if "error" in e:
            lines.append(f"| {e.get('file')} | - | error: {e['error'][:100]} | | | | | | | | | | | |")
            continue
        for k in e.get("kernels", []):
            stalls = ", ".join(f"{n} {v:.1f}" for n, v in k.get("warp_stalls_top5", [])) or "-"
            occ = f"{fmt(k.get('achieved_occupancy_pct'))} / {fmt(k.get('theoretical_occupancy_pct'))}"
            lines.append(
                f"| {e.get('file')} | {e.get('label') or '-'} | {str(k.get('name'))[:60]} "
                f"| {k.get('grid_size') or '-'} "
                f"| {k.get('block_size') or '-'} | {fmt(k.get('duration_us'), '.2f')} "
                f"| {fmt(k.get('dram_throughput_pct'))} | {fmt(k.get('dram_bandwidth_GBps'), '.0f')} "
                f"| {fmt(k.get('compute_sm_throughput_pct'))} | {occ} | {fmt(k.get('registers_per_thread'), '.0f')} "
                f"| {fmt(k.get('shared_memory_per_block_bytes'), '.0f')} | {fmt(k.get('l2_hit_rate_pct'))} | {stalls} |"
            )
    return lines


def markdown(data: dict[str, Any]) -> str:
    f = fmt
    lines = [
        f"# Scoring stage on {data['device']['name']} — torch {data['versions']['torch']}, triton "
        f"{data['versions']['triton']}, {data['date_utc']}",
        "",
        f"64 index heads x 128, block 64, k = {si.TOPK}, random FP8 keys; next_n = 2: two tokens per request, the "
        f"first seeing L - 1 keys. Device µs per call (CUDA-graph replay). Copy bandwidth "
        f"{data['copy_bandwidth_TBps']:.2f} TB/s. *target* = {TARGET_FACTOR} x read floor + {TARGET_SLACK_US:.0f} µs; "
        "*read floor*: the keys once per request + the scores; *peer chain* = DeepGEMM logits + vLLM top-K + vLLM "
        "pack; *our chain* = our scoring + our local top-K + pack.",
        "",
        "| next_n | T | B | L | ours | target | meets | DeepGEMM | ours / DG "
        "| our chain | peer chain | read floor | compute floor | binds | rel err | DG rel err |",
        "|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for s in data["summary"]:
        lines.append(
            f"| {s['next_n']} | {s['T']} | {s['B']} | {s['L']} | {f(s['ours_us'])} | {f(s['target_us'])} "
            f"| {f(s['meets_target'])} | {f(s['deepgemm_us'])} | {f(s['vs_deepgemm'], '.2f')} "
            f"| {f(s['ours_unfused_chain_us'])} | {f(s['peer_chain_us'])} "
            f"| {f(s['read_floor_us'])} | {f(s['compute_floor_us'])} | {s['binds']} | {f(s['max_rel_err'], '.2e')} "
            f"| {f(s['deepgemm_max_rel_err'], '.2e')} |"
        )
    if data.get("sweep_best"):
        sw = data.get("sweep_meta", {})
        lines += [
            "",
            "## Sweep: best vs default plan",
            "",
            "Plan = (block_n, tiles, num_warps, num_stages, tma, pair_dot). "
            f"{sw.get('run', '?')} of {sw.get('scheduled', '?')} "
            f"(shape, config) pairs run in {sw.get('elapsed_s', 0):.0f} s (budget {sw.get('budget_s', 0):.0f} s"
            f"{', cut' if sw.get('cut') else ''}); best = fastest with max rel err <= {MAX_REL_ERR:g}.",
            "",
            "| next_n | T | L | default plan | default µs | best plan | best µs | default / best | timed | errors |",
            "|---:|---:|---:|---|---:|---|---:|---:|---:|---:|",
        ]
        for r in data["sweep_best"]:
            dp = tuple(r["default_plan"]) if r["default_plan"] else None
            bp = tuple(r["best_plan"]) if r["best_plan"] else None
            lines.append(
                f"| {r['next_n']} | {r['T']} | {r['L']} | {f(dp)} | {f(r['default_us'], '.2f')} | {f(bp)} "
                f"| {f(r['best_us'], '.2f')} | {f(r['speedup'], '.2f')} | {r['timed']} | {r['errors']} |"
            )
    if data.get("ncu"):
        lines += ncu_markdown(data["ncu"])
    if data.get("findings"):  # what the profiles and the sweep taught (kept in scoring.json, carried by --findings)
        lines += ["", "## Findings", ""] + [f"- {x}" for x in data["findings"]]
    return "\n".join(lines) + "\n"


def write(out_dir: str, data: dict[str, Any]) -> None:
    with open(os.path.join(out_dir, "scoring.json"), "w") as fh:
        json.dump(data, fh, indent=1)
    if data.get("summary"):
        with open(os.path.join(out_dir, "scoring.md"), "w") as fh:
            fh.write(markdown(data))


def print_plans(path: str) -> int:
    """``--print-plans``: the ``PLANS`` literal from a ``scoring.json``'s sweep (CPU only)."""
    data = load_json(path)
    if "error" in data:
        print(data["error"], file=sys.stderr)
        return 2
    records = data.get("sweep", [])
    if not best_plans(records):
        print(f"{path}: no valid scoring sweep record", file=sys.stderr)
        return 1
    print(plans_literal(records))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results", help="directory for scoring.json / scoring.md")
    ap.add_argument("--peers", help="folder with vLLM's peer modules (../shared/peers/vllm, copied under .gpu/)")
    ap.add_argument("--deepgemm", help="JSON written by peer_deepgemm_logits.py in its own process")
    ap.add_argument("--quick", action="store_true", help=f"only {si.QUICK} (next_n 1) and {si.QUICK_MTP} (next_n 2)")
    ap.add_argument("--next-n", default="1,2", help="shape families: 1 (SHAPES), 2 (MTP_SHAPES) or 1,2 (default)")
    ap.add_argument("--no-chain", dest="chain", action="store_false", help="skip the chain and vLLM columns")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the scoring launch-config sweep")
    ap.add_argument("--sweep-budget", type=float, default=300.0, help="seconds for the scoring sweep")
    ap.add_argument("--ncu-json", action="append", default=None, help="profile_scoring.py --summarize output "
                    "(repeatable): kept under 'ncu', tabulated in scoring.md")  # fmt: skip
    ap.add_argument(
        "--findings", help="a JSON list of sentences to keep in scoring.json / scoring.md (the profiles' lessons)"
    )
    ap.add_argument("--print-plans", metavar="SCORING_JSON", help="print the PLANS literal from that file's sweep "
                    "(no GPU needed) and exit")  # fmt: skip
    args = ap.parse_args(argv)
    if args.print_plans:
        return print_plans(args.print_plans)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    next_ns = [int(v) for v in args.next_n.split(",") if v.strip()]
    shapes = shape_list(args.quick, next_ns)
    peers, peer_errors = load_peers(args.peers) if args.chain else ({}, {"peers": "--no-chain"})
    bw = _meta.copy_bandwidth()
    data: dict[str, Any] = {
        "benchmark": "scoring stage: FP8 index keys -> index scores (kernels/scoring_triton.py; next_n 1 and 2), "
        "then our local top-K + pack on its scores; peers: DeepGEMM "
        "fp8_paged_mqa_logits, vLLM top-K + pack",
        "device": si.device_info(),
        "versions": _meta.versions(),
        "date_utc": _meta.now_utc(),
        "argv": sys.argv[1:] if argv is None else argv,
        "copy_bandwidth_TBps": bw / 1e12,
        "fp8_peak_TFLOPs": si.FP8_PEAK_FLOPS / 1e12,
        "timing": _timing.describe("graph", "`reps`", flush_l2=True)
        + "; 'events' when a call could not be captured; the sweep: the same under the SWEEP rule "
        + _timing.describe("graph", "`reps`", _timing.SWEEP, flush_l2=True),
        "target": f"target_us = {TARGET_FACTOR} * read_floor_us + {TARGET_SLACK_US}",
        "peers": sorted(peers),
        "peer_errors": peer_errors,
        "inputs": {"heads": si.HEADS, "dim": si.DIM, "block_size": si.BLOCK, "k": si.TOPK, "B": "T / next_n",
                   "next_n": "per row: 1 (SHAPES) or 2 (MTP_SHAPES: token i of a request sees L - 1 + i keys)",
                   "keys": "random e4m3 bytes, power-of-two scales 2**-9..2**-6", "ref_rows": si.REF_ROWS},
    }  # fmt: skip
    dg = load_deepgemm(args.deepgemm)
    data["deepgemm"] = dg
    if args.ncu_json:
        data["ncu"] = load_ncu(args.ncu_json)
    if args.findings:
        data["findings"] = load_json(args.findings)
    results: list[dict[str, Any]] = []
    for t, n, nn in shapes:
        try:
            rec = run_shape(t, n, nn, bw, peers, chain_cols=args.chain)
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - a failing shape is recorded; the others still run
            rec = {
                "T": t,
                "B": t // nn,
                "L": n,
                "next_n": nn,
                "error": f"{type(e).__name__}: {e}"[:1000],
                "traceback": traceback.format_exc()[-3000:],
            }
            torch.cuda.empty_cache()
        results.append(rec)
        print(
            f"T={t:4d} L={n:6d} next_n={nn} ours={rec.get('ours', {}).get('median_us', float('nan')):9.1f} "
            f"chain={rec.get('ours_chain', {}).get('median_us', float('nan')):9.1f} "
            f"vllm={rec.get('vllm_topk_pack', {}).get('median_us', float('nan')):8.1f} "
            f"err={rec.get('max_rel_err')} {rec.get('error', '')[:200]}",
            flush=True,
        )
        data["results"] = results
        write(args.out, data)  # after every shape: a timeout keeps what was measured
    data["summary"] = summarize([r for r in results if "error" not in r], dg)
    write(args.out, data)
    if args.sweep:
        extra = [] if args.quick else [s for s in si.SWEEP_ONLY if s[2] in next_ns]
        sw = sweep_scoring(args.sweep_budget, shapes + extra, scoring_configs())
        data["sweep"] = sw.pop("records")
        data["sweep_meta"] = sw | {"space": {k: list(v) for k, v in SWEEP_SPACE.items()}, "extra": SWEEP_EXTRA}
        data["sweep_best"] = sweep_best(data["sweep"])
        write(args.out, data)
    print(json.dumps(data["summary"], indent=1))
    if data.get("sweep_best"):
        print(plans_literal(data["sweep"]))
    ok = all("error" not in r and r.get("max_rel_err", 1.0) < MAX_REL_ERR for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
