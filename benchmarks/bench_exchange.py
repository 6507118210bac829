#!/usr/bin/env python3
"""Benchmark the owner-local exchange ("One exchange", part 1) on one H200: select-to-slots and the combine merge.

    python3 benchmarks/bench_exchange.py --out results.json [--peers DIR] [--sweep] [--resources] [--quick]

**select_to_slots** — rows ∈ {1, 32, 128, 1024} × W ∈ {2, 4, 8} × K = k = 2048 × both orders, rank 0:

* ``ours_us`` — :func:`dcp_ref.kernels.select_to_slots_cutedsl.select_to_slots_cutedsl`: gathered candidates
  → this rank's slots + counts, one launch (``order="global_id"``: (score, id) pairs ``[W, T, K, 2]``;
  ``"rank_local"``: scores ``[W, T, K]`` + ``own_ids``);
* ``chain_us`` — today's two stages: the CuTeDSL stable top-K (``stable_topk_cutedsl``, unsorted) + the Triton
  deinterleave (``deinterleave_compact``, its default method), on the pairs;
* ``vllm_chain_us`` — vLLM's: its stable top-K (``vllm_dcp_topk.stable_topk_from_gathered_candidates``, CuTeDSL,
  on the pairs laid out ``[T, W*K, 2]`` as it wants them; the re-layout is not timed) + its convert
  (``vllm_convert.triton_filter_and_convert_dcp_index``, compacting, with counts; it allocates its outputs per
  call, inside the graph). From ``--peers DIR`` (a folder holding ``vllm_dcp_topk.py``, ``vllm_convert.py``,
  ``vllm_merge.py``; ``../shared/peers/vllm``); skipped when absent;
* ``same_set`` — ours equals the reference's (:func:`dcp_ref.select_to_slots.select_to_slots`) as sets, with
  equal counts (outputs poisoned first).

Inputs: each rank's K candidates are distinct ascending local indices of a 65536-token context (a request per
row), with standard-normal scores (as ``bench_topk.py``); the global ids are the ranks' own
(``local_to_global``), so about ``k / W`` winners are rank 0's; block size 64, shuffled block tables.

**combine_merge** — H = 128, D = 512, bf16, T ∈ {1, 32, 128}, W ∈ {2, 4, 8}: ``ours_us`` = the all-to-all
combine's merge, :func:`dcp_ref.kernels.lse_merge_triton.lse_merge` over the received partials
``[W, T, H/W, D]`` and LSEs ``[W, T, H/W]``; ``chain_us`` = today's per-rank correction
:func:`dcp_ref.kernels.lse_merge_triton.lse_correct` over ``[T, H, D]`` with the all-gathered LSEs ``[W, T, H]``
(before its reduce-scatter); ``vllm_chain_us`` = vLLM's ``correct_attn_out`` on the same.

Every summary row also carries the bytes on the wire per token of both exchanges (:func:`exchange_bytes`,
:func:`combine_bytes`). Times: device time per call from replaying a CUDA graph of ``REPS`` back-to-back calls
(L2 flushed before each replay; ``_timing.py``: median of the replays / ``REPS``), as ``bench_topk.py``.

``--sweep``: the kernel's tunings (:data:`SWEEP`: CTA shape, first digit, vector width, variant, split) at rows
1, 32, 128 and 1024, W = 8, both orders — each correct-checked and timed — so that one device run picks the
defaults.
``--resources``: the default configurations' registers and local-memory frame (spills), from their cubins.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import tempfile
from typing import Any

import _meta
import _timing
import torch
from _progress import progress

ROWS = (1, 32, 128, 1024)
WORLDS = (2, 4, 8)
K = 2048
BLOCK_SIZE = 64
CONTEXT = 65536
HEADS = 128
HEAD_V = 512
MERGE_ROWS = (1, 32, 128)
REPS = 20


# ---- bytes on the wire per token -------------------------------------------------------------------
def allgather_pairs_bytes(world: int, kloc: int) -> int:
    """The all-gathered (score, id) float32 pairs of one token: ``8 * W * K`` bytes (each rank receives
    ``(W-1)/W`` of them)."""
    return 8 * world * kloc


def allgather_scores_bytes(world: int, kloc: int) -> int:
    """The all-gathered float32 scores of one token (``order="rank_local"``: ids stay home): ``4 * W * K``."""
    return 4 * world * kloc


def combine_alltoall_bytes(world: int, heads: int, dv: int = HEAD_V, out_bytes: int = 2, lse_bytes: int = 4) -> int:
    """Bytes one rank sends per token in the all-to-all combine: to each of the ``W-1`` others, the partial of
    that rank's ``H/W`` heads (``dv`` values of ``out_bytes``) and their LSEs:
    ``(W-1) * (H/W) * (dv*out_bytes + lse_bytes)``."""
    return (world - 1) * (heads // world) * (dv * out_bytes + lse_bytes)


def combine_ag_rs_bytes(world: int, heads: int, dv: int = HEAD_V, out_bytes: int = 2, lse_bytes: int = 4) -> int:
    """Bytes one rank sends per token in today's combine: the all-gather of its ``H`` LSEs to ``W-1`` ranks,
    plus a ring reduce-scatter of the ``[H, dv]`` output (``(W-1)/W`` of it):
    ``(W-1)*H*lse_bytes + (W-1)*(H/W)*dv*out_bytes``."""
    return (world - 1) * heads * lse_bytes + (world - 1) * (heads // world) * dv * out_bytes


def exchange_bytes(order: str, world: int, kloc: int) -> dict[str, int]:
    """The candidate exchange of ``order`` and today's (pairs), per token."""
    ours = allgather_scores_bytes(world, kloc) if order == "rank_local" else allgather_pairs_bytes(world, kloc)
    return {"wire_bytes_per_token": ours, "wire_bytes_per_token_today": allgather_pairs_bytes(world, kloc)}


def combine_bytes(world: int, heads: int) -> dict[str, int]:
    """The all-to-all combine and today's all-gather + reduce-scatter, per token and rank."""
    return {
        "wire_bytes_per_token": combine_alltoall_bytes(world, heads),
        "wire_bytes_per_token_today": combine_ag_rs_bytes(world, heads),
    }


# ---- metadata, timing ------------------------------------------------------------------------------
def graph_us(fn) -> float:
    """Device time per call: ``_timing.graph`` of ``REPS`` calls, L2 flushed before each replay (median)."""
    return _timing.graph(fn, calls=REPS, flush_l2=True).median_us


def load_peers(folder: str | None) -> dict[str, Any]:
    """vLLM's modules from ``folder`` (never copied into the project); ``{}`` when absent or broken."""
    if not folder or not os.path.isdir(folder):
        return {}
    mods: dict[str, Any] = {}
    for name in ("vllm_dcp_topk", "vllm_convert", "vllm_merge"):
        path = os.path.join(folder, f"{name}.py")
        if not os.path.exists(path):
            continue
        try:
            spec = importlib.util.spec_from_file_location(f"peer_{name}", path)
            assert spec is not None and spec.loader is not None
            mod = importlib.util.module_from_spec(spec)
            sys.modules[f"peer_{name}"] = mod
            spec.loader.exec_module(mod)
            mods[name] = mod
        except Exception as e:  # noqa: BLE001 - a broken peer is reported, not fatal
            print(f"peer {name} not loaded: {type(e).__name__}: {e}", file=sys.stderr)
    return mods


# ---- inputs ----------------------------------------------------------------------------------------
def make_inputs(rows: int, world: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """One exchange's inputs on the GPU (module docstring): pairs, scores, rank 0's own ids, req, table."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = torch.device("cuda")
    l_local = CONTEXT // world
    # distinct ascending local indices below l_local: cumulative gaps in [1, l_local // K)
    span = max(2, l_local // K)
    gaps = torch.randint(1, span, (world, rows, K), device=dev, generator=g)
    loc = torch.cumsum(gaps, -1) - 1
    scores = torch.randn(world, rows, K, device=dev, generator=g)
    w_idx = torch.arange(world, device=dev).view(world, 1, 1)
    gid = (loc // 1) * world + w_idx  # local_to_global with I = 1
    pairs = torch.stack([scores, gid.float()], -1).contiguous()
    n_blocks = l_local // BLOCK_SIZE + 1
    table = torch.randperm(rows * n_blocks * 2, device=dev, generator=g)[: rows * n_blocks]
    return {
        "pairs": pairs,
        "scores": scores.contiguous(),
        "own": loc[0].to(torch.int32).contiguous(),
        "req": torch.arange(rows, device=dev, dtype=torch.int32),
        "table": table.view(rows, n_blocks).to(torch.int32).contiguous(),
    }


def same_set(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    from dcp_ref.deinterleave import canonicalize

    s, n = got
    ws, wn = want
    if not torch.equal(n, wn):
        return False
    tail = torch.arange(s.shape[1], device=s.device) >= n.unsqueeze(1).long()
    return bool((s[tail] == -1).all()) and torch.equal(canonicalize(s, n), canonicalize(ws, wn))


# ---- select_to_slots -------------------------------------------------------------------------------
def bench_select(rows: int, world: int, peers: dict[str, Any]) -> list[dict[str, Any]]:
    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.kernels.deinterleave_triton import deinterleave_compact
    from dcp_ref.kernels.select_to_slots_cutedsl import select_to_slots_cutedsl
    from dcp_ref.kernels.topk_cutedsl import stable_topk_cutedsl
    from dcp_ref.select_to_slots import select_to_slots

    x = make_inputs(rows, world)
    geo = DcpGeometry(world, 0, 1, BLOCK_SIZE)
    k = K
    dev = x["pairs"].device
    out_s = torch.empty((rows, k), dtype=torch.int32, device=dev)
    out_n = torch.empty((rows,), dtype=torch.int32, device=dev)
    ids = torch.empty((rows, k), dtype=torch.int32, device=dev)
    ch_s = torch.empty_like(out_s)
    ch_n = torch.empty_like(out_n)

    def chain() -> None:
        stable_topk_cutedsl(x["pairs"], k, out=ids, validate=False)
        deinterleave_compact(ids, x["req"], x["table"], geo, ordered=False, out=ch_s, counts=ch_n, validate=False)

    want_g = select_to_slots(x["pairs"], x["req"], x["table"], geo, k, validate=False)
    chain()
    chain_ok = same_set((ch_s, ch_n), want_g)
    chain_t = graph_us(chain)
    vllm_t, vllm_ok = None, None
    if "vllm_dcp_topk" in peers and "vllm_convert" in peers:
        flat = x["pairs"].permute(1, 0, 2, 3).reshape(rows, world * K, 2).contiguous()
        v_ids = torch.empty((rows, k), dtype=torch.int32, device=dev)
        res: dict[str, Any] = {}

        def vchain() -> None:
            peers["vllm_dcp_topk"].stable_topk_from_gathered_candidates(flat, k, out=v_ids)
            res["out"] = peers["vllm_convert"].triton_filter_and_convert_dcp_index(
                x["req"],
                x["table"],
                v_ids,
                world,
                0,
                1,
                BLOCK_SIZE=BLOCK_SIZE,
                NUM_TOPK_TOKENS=k,
                return_valid_counts=True,
            )

        try:
            vchain()
            vllm_ok = same_set(res["out"], want_g)
            vllm_t = graph_us(vchain)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            print(f"vLLM chain failed at rows={rows} W={world}: {type(e).__name__}: {e}", file=sys.stderr)
    out = []
    for order in ("global_id", "rank_local"):
        gathered = x["pairs"] if order == "global_id" else x["scores"]
        own = None if order == "global_id" else x["own"]

        def ours(gathered: torch.Tensor = gathered, own: torch.Tensor | None = own, order: str = order) -> None:
            select_to_slots_cutedsl(
                gathered,
                x["req"],
                x["table"],
                geo,
                k,
                order=order,
                own_ids=own,
                out_slots=out_s,
                out_counts=out_n,
                validate=False,
            )

        out_s.fill_(12345)
        out_n.fill_(777)
        ours()
        want = (
            want_g
            if order == "global_id"
            else select_to_slots(gathered, x["req"], x["table"], geo, k, order=order, own_ids=own, validate=False)
        )
        ok = same_set((out_s, out_n), want)
        t = graph_us(ours)
        rec = {
            "stage": "select_to_slots",
            "rows": rows,
            "W": world,
            "K": K,
            "k": k,
            "order": order,
            "ours_us": t,
            "chain_us": chain_t,
            "vllm_chain_us": vllm_t,
            "same_set": ok,
            "chain_same_set": chain_ok,
            "vllm_same_set": vllm_ok,
            "ours_over_chain": t / chain_t,
            "own_winners_mean": float(want[1].float().mean()),
            **exchange_bytes(order, world, K),
        }
        print(json.dumps(rec), flush=True)
        out.append(rec)
    return out


# ---- combine merge ---------------------------------------------------------------------------------
def bench_merge(rows: int, world: int, peers: dict[str, Any]) -> dict[str, Any]:
    from dcp_ref.kernels.lse_merge_triton import lse_correct, lse_merge

    g = torch.Generator(device="cuda").manual_seed(rows * 10 + world)
    dev = torch.device("cuda")
    hw = HEADS // world
    recv = torch.randn(world, rows, hw, HEAD_V, device=dev, generator=g).to(torch.bfloat16)
    recv_lse = torch.randn(world, rows, hw, device=dev, generator=g)
    merged = torch.empty(rows, hw, HEAD_V, device=dev, dtype=torch.bfloat16)
    merged_lse = torch.empty(rows, hw, device=dev)
    part = torch.randn(rows, HEADS, HEAD_V, device=dev, generator=g).to(torch.bfloat16)
    all_lse = torch.randn(world, rows, HEADS, device=dev, generator=g)
    corrected = torch.empty_like(part)
    c_lse = torch.empty(rows, HEADS, device=dev)
    ours = graph_us(lambda: lse_merge(recv, recv_lse, merged=merged, merged_lse=merged_lse))
    today = graph_us(lambda: lse_correct(part, all_lse, 0, corrected=corrected, merged_lse=c_lse))
    vt = None
    if "vllm_merge" in peers:
        vpart = part.clone()
        try:
            vt = graph_us(lambda: peers["vllm_merge"].correct_attn_out(vpart, all_lse, 0))
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            print(f"vLLM correct_attn_out failed: {type(e).__name__}: {e}", file=sys.stderr)
    rec = {
        "stage": "combine_merge",
        "rows": rows,
        "W": world,
        "H": HEADS,
        "order": None,
        "ours_us": ours,
        "chain_us": today,
        "vllm_chain_us": vt,
        "same_set": None,
        **combine_bytes(world, HEADS),
    }
    print(json.dumps(rec), flush=True)
    return rec


# ---- sweep and resources ---------------------------------------------------------------------------------
#: Tunings timed by --sweep, per row count (W = 8, K = k = 2048): the CTA shape, register cap, first digit,
#: vector width, variant, and the split form (a cluster of CTAs per row; worth it only while rows are few).
SWEEP: dict[int, dict[str, list[dict[str, Any]]]] = {
    1: {
        "rank_local": [{"split": 1}, {"split": 4}, {"split": 8}],
        "global_id": [{"split": 1}, {"split": 4}],
    },
    32: {
        "rank_local": [{"split": 1}, {"split": 2}, {"split": 4}],
        "global_id": [
            {"split": 1},
            {"split": 1, "first_bits": 12},
            {"split": 2},
            {"split": 4, "config": (512, 0)},
        ],
    },
    128: {
        "rank_local": [{"split": 1}, {"split": 2}],
        "global_id": [{"split": 1}, {"split": 2}],
    },
    1024: {
        "rank_local": [
            {"split": 1},
            {"split": 1, "first_bits": 12},
            {"split": 1, "config": (1024, 0)},
        ],
        "global_id": [{"split": 1}],
    },
}


def sweep(rows_list: tuple[int, ...], world: int) -> list[dict[str, Any]]:
    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.kernels.select_to_slots_cutedsl import select_to_slots_cutedsl
    from dcp_ref.select_to_slots import select_to_slots

    out = []
    geo = DcpGeometry(world, 0, 1, BLOCK_SIZE)
    for rows in rows_list:
        x = make_inputs(rows, world, seed=1)
        for order, tunings in SWEEP[rows].items():
            gathered = x["pairs"] if order == "global_id" else x["scores"]
            own = None if order == "global_id" else x["own"]
            want = select_to_slots(gathered, x["req"], x["table"], geo, K, order=order, own_ids=own, validate=False)
            out_s = torch.empty((rows, K), dtype=torch.int32, device="cuda")
            out_n = torch.empty((rows,), dtype=torch.int32, device="cuda")
            for tune in tunings:

                def f(tune: dict = tune, gathered: torch.Tensor = gathered, own: Any = own, order: str = order) -> None:
                    select_to_slots_cutedsl(
                        gathered,
                        x["req"],
                        x["table"],
                        geo,
                        K,
                        order=order,
                        own_ids=own,
                        out_slots=out_s,
                        out_counts=out_n,
                        validate=False,
                        **tune,
                    )

                rec: dict[str, Any] = {"rows": rows, "W": world, "order": order, "tuning": {**tune}}
                try:
                    out_s.fill_(12345)
                    f()
                    rec["correct"] = same_set((out_s, out_n), want)
                    rec["us"] = graph_us(f)
                except Exception as e:  # noqa: BLE001 - reported, not fatal
                    rec["error"] = f"{type(e).__name__}: {e}"[:300]
                if "config" in rec["tuning"]:
                    rec["tuning"]["config"] = list(rec["tuning"]["config"])
                print(json.dumps(rec), flush=True)
                out.append(rec)
    return out


def resources_report() -> list[dict[str, Any]]:
    """Registers and local-memory frame (spills) of the default configurations (W = 8, K = k = 2048), read from
    the compiled cubins (:func:`dcp_ref.kernels.select_to_slots_cutedsl.cubin_resources`)."""
    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.kernels.select_to_slots_cutedsl import compile_artifacts, cubin_resources, make_config

    out = []
    geo = DcpGeometry(8, 0, 1, BLOCK_SIZE)
    for order in ("rank_local", "global_id"):
        for rows in (1, 32, 1024):
            cfg = make_config(order, 8, K, K, geo, data_ptr=256, rows=rows)
            rec: dict[str, Any] = {"order": order, "rows": rows, "config": repr(cfg)}
            try:
                with tempfile.TemporaryDirectory() as d:
                    rec.update(cubin_resources(compile_artifacts(cfg, d)[1]))
            except Exception as e:  # noqa: BLE001 - reported, not fatal
                rec["error"] = f"{type(e).__name__}: {e}"[:300]
            print(json.dumps(rec), flush=True)
            out.append(rec)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="write the results JSON here")
    ap.add_argument("--peers", help="folder with vLLM's peer modules (e.g. ../shared/peers/vllm)")
    ap.add_argument("--quick", action="store_true", help="rows 32 and W = 8 only (and T = 32 for the merge)")
    ap.add_argument("--sweep", action="store_true", help="also time the kernel's tunings (module docstring)")
    ap.add_argument("--sweep-rows", default="1,32,128,1024")
    ap.add_argument("--resources", action="store_true", help="also record registers / spills of the defaults")
    ap.add_argument("--no-main", action="store_true", help="only --sweep / --resources")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    peers = load_peers(args.peers)
    meta = {
        "benchmark": "owner-local exchange: select_to_slots and the combine merge (benchmarks/bench_exchange.py)",
        "device": torch.cuda.get_device_name(),
        "versions": _meta.versions(),
        "peers": sorted(peers),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": _timing.describe("graph", REPS, flush_l2=True),
        "inputs": f"K = k = {K}, block size {BLOCK_SIZE}, context {CONTEXT} per row, randn scores, rank 0",
        "argv": sys.argv[1:],
    }
    result: dict[str, Any] = {"meta": meta, "summary": []}

    def save() -> None:  # after every shape: a cut run keeps what it has
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)

    if args.resources:
        result["resources"] = resources_report()
        save()
    if not args.no_main:
        rows_list, worlds = ((32,), (8,)) if args.quick else (ROWS, WORLDS)
        for rows in progress(rows_list, desc="select_to_slots rows"):
            for w in worlds:
                result["summary"] += bench_select(rows, w, peers)
                save()
        for rows in (32,) if args.quick else MERGE_ROWS:
            for w in worlds:
                result["summary"].append(bench_merge(rows, w, peers))
                save()
    if args.sweep:
        result["sweep"] = sweep(tuple(int(r) for r in args.sweep_rows.split(",")), 8)
        save()
    bad = [r for r in result["summary"] if r.get("same_set") is False]
    print(f"{len(result['summary'])} summary rows, {len(bad)} with same_set False")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
