"""The whole decode layer on one H200: W = 1, and one rank's work of DCP-W against one rank's work of TP-W.

    python benchmarks/bench_layer.py --out DIR [--W 1,2,4,8] [--T 1,32,128] [--ctx 8192,65536,131072]
                                     [--cache bf16,fp8] [--budget-s 420]

What a row measures (graph replay of the planned step, :class:`dcp_ref.step.PlannedStep`, with the
``"kernels"`` stages; every stage of the layer from its inputs):

- ``layout="dcp"``, ``W`` ranks: rank 0's work — the query arrives as its ``H/W`` heads and is gathered,
  FP8 index keys of its ``ctx/W`` tokens are scored, its local top-K is packed (rank-local order: scores
  only travel), the candidates of all ``W`` ranks are selected to its own slots, attention over all ``H``
  heads, the guard, and the merge of the ``W`` partials of its ``H/W`` heads after the all-to-all.
- ``layout="tp"``, ``W`` ranks: rank 0 of tensor parallelism — ``H/W`` heads, the whole context (KV and
  index keys duplicated on every rank), scoring and selection over all ``ctx`` keys, attention over ``k``
  keys, no collective inside attention.

On one GPU both are exact shapes of a real rank *minus the collectives*: the step runs with
:class:`LocalRankGroup`, whose collectives only move this rank's own slice (the other ranks' slices were
filled once, before timing, with perturbed copies of this rank's, so that selection sees realistic
candidates). The collectives' time is added from the cost model's line fitted to the NCCL collectives
measured on two H200s (``collectives_us``, ``collectives_source``) — a prediction for W > 2, labelled so.

Rows: ``{"layout", "W", "T", "ctx", "cache", "options", "graph_us", "collectives_us", "source", "stages_us", ...}``
with ``source = "measured (one H200, collectives excluded)"``; ``eager_us``, host syncs and launches per
step (torch.profiler), allocations per run at steady state, and each stage's isolated graph time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import _meta
import _timing
import torch
from bench_step import _eager_time_us, _graph_time_us, _profile_counts  # benchmarks/ is on sys.path

from dcp_ref.options import PLANNED, LayerOptions

H, DQK, DV, TOPK, BLOCK = 128, 576, 512, 2048, 64
INDEX_HEADS, INDEX_DIM = 64, 128
SCALE = 192**-0.5


class LocalRankGroup:
    """One rank of a ``W``-rank group, alone on this GPU: collectives copy this rank's own slice only.

    ``prefill = True`` (one run before timing): every slot gets this rank's slice, float32 candidate slices of
    the other ranks perturbed (so selection across ranks is not all ties). Then the other ranks' slices stay
    as they are while the timed runs move only this rank's: exactly the work of a real rank, minus the link.
    """

    def __init__(self, world_size: int, rank: int = 0) -> None:
        self.world_size, self.rank = world_size, rank
        self.prefill = True
        self._gen = torch.Generator(device="cuda").manual_seed(1)

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        assert out is not None
        if self.prefill:
            out.copy_(x.unsqueeze(0).expand_as(out))
            if out.dtype == torch.float32 and self.world_size > 1:
                noise = torch.randn(out.shape, device=out.device, generator=self._gen) * 1e-2
                others = torch.ones(self.world_size, dtype=torch.bool, device=out.device)
                others[self.rank] = False
                view = out.view(self.world_size, -1)
                view[others] = view[others] * (1 + noise.view(self.world_size, -1)[others])
        else:
            out[self.rank].copy_(x)
        return out

    def all_to_all(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        assert out is not None
        if self.prefill:
            out.copy_(x[self.rank].unsqueeze(0).expand_as(out))
        else:
            out[self.rank].copy_(x[self.rank])
        return out

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0, *, out: torch.Tensor | None = None) -> torch.Tensor:
        raise AssertionError("the layer benchmark combines by all-to-all")


def _index_cache(num_blocks: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """A random FP8 index-key cache in DeepSeek V3.2's paged layout (values then float32 scales per block)."""
    from dcp_ref.index_cache import INDEX_K_FP8

    bb = INDEX_K_FP8.block_bytes(BLOCK)
    cache = torch.empty(num_blocks, bb, dtype=torch.uint8, device=device)
    vals = (torch.randn(num_blocks, BLOCK * INDEX_DIM, device=device, generator=gen)).to(torch.float8_e4m3fn)
    cache[:, : BLOCK * INDEX_DIM] = vals.view(torch.uint8)
    scales = torch.rand(num_blocks, BLOCK, device=device, generator=gen) * 0.01 + 1e-3
    cache[:, BLOCK * INDEX_DIM :] = scales.view(torch.uint8).view(num_blocks, BLOCK * 4)
    return cache


def make_layer_inputs(
    layout: str, W: int, T: int, ctx: int, cache: str, device: torch.device, seed: int = 0, rank: int = 0
):
    """Rank ``rank``'s inputs: ``(q, shard, meta, index_q, index_weights, cache_geometry, local_keys)``."""
    from dcp_ref.fp8_cache import quantize_kv_fp8
    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.step import RankShard, decode_metadata

    cg = DcpGeometry(W, rank, 1, BLOCK) if layout == "dcp" else DcpGeometry(1, 0, 1, BLOCK)
    gen = torch.Generator(device=device).manual_seed(seed * 100 + rank)
    local = -(-ctx // cg.world_size)
    nblk = -(-local // BLOCK)
    kv = (torch.randn(T * nblk * BLOCK, DQK, device=device, generator=gen) * 0.5).to(torch.bfloat16)
    if cache == "fp8":
        kv = quantize_kv_fp8(kv)
    table = torch.randperm(T * nblk, device=device, generator=gen).to(torch.int32).view(T, nblk)
    q_heads = H // W if (layout == "tp" or W > 1) else H
    q = torch.randn(T, q_heads, DQK, device=device, generator=gen).to(torch.bfloat16)
    index_q = torch.randn(T, INDEX_HEADS, INDEX_DIM, device=device, generator=gen).to(torch.float8_e4m3fn)
    weights = torch.rand(T, INDEX_HEADS, device=device, generator=gen)
    meta = decode_metadata(torch.full((T,), ctx, dtype=torch.int64), 1, cg, device=device)
    shard = RankShard(kv, table, None, cg, _index_cache(T * nblk, device, gen))
    return q, shard, meta, index_q, weights, cg, local


def collectives_us(layout: str, W: int, T: int) -> tuple[float, str]:
    """The layer's collectives on one rank (graph replay), from the cost model's NCCL line fitted on 2 x H200."""
    if layout == "tp" or W == 1:
        return 0.0, "none (no collective inside attention)"
    from dcp_ref import costmodel as cm

    results = Path("benchmarks/results")
    c = cm.fit_constants(results).constants if results.exists() else cm.DEFAULT_CONSTANTS
    hs = H // W
    qb = T * hs * DQK * 2  # the query's all-gather over heads (bf16)
    cand = T * TOPK * 4  # rank-local candidates: scores only
    a2a = W * (T * hs * DV * 2 + T * hs * 4)  # partials + LSEs, one chunk per destination
    us = 1e6 * (
        cm.collective_time_s("all_gather", qb, W, c)
        + cm.collective_time_s("all_gather", cand, W, c)
        + cm.collective_time_s("all_to_all", a2a, W, c)
    )
    src = "NCCL line fitted to 2 x H200 (W = 2 fitted range; W > 2 a prediction)"
    return us, src


def _stage_times(step, q, shard, meta, index_q, weights, timer=_graph_time_us) -> dict[str, float]:
    """Each stage alone (captured, replayed) on the intermediates of one real run of this step, timed by
    ``timer`` (µs per call: back to back by default, ``_cold_time_us`` from a cold L2)."""
    st, s = step.stages, step.spec
    cg, k = s.cache_geometry, s.topk
    trace: dict = {}
    step.run(q, shard, meta, index_q=index_q, index_weights=weights, trace=trace)
    T = q.shape[0]
    parts = step.parts
    qv, iv, xv, av = (part.views(T) for part in (parts.query, parts.indexing, parts.exchange, parts.attention))
    cv = parts.combine.views(T)  # None for no combine
    times: dict[str, float] = {}
    bt, req, bounds = shard.block_table, meta.req_of_token, meta.local_bounds
    n_cols = s.scoring.max_keys
    times["scoring"] = timer(lambda: st.scoring(
        index_q, weights, shard.index_cache, bt, req, bounds, cg, out=iv.scores))  # fmt: skip
    kw = dict(order="rank_local", out_ids=iv.own_ids) if iv.own_ids is not None else {}
    times["indexer"] = timer(lambda: st.indexer(iv.scores, bounds, cg, k, out=iv.packed, **kw))
    if "select_to_slots" in parts.stages:
        times["select_to_slots"] = timer(lambda: st.select_to_slots(
            xv.gathered, iv.own_ids, req, bt, cg, k, order=s.order, out_slots=xv.slots,
            out_counts=xv.counts))  # fmt: skip
    elif "deinterleave" in parts.stages and "select" not in parts.stages:  # one rank: the local top-K's slots
        times["deinterleave"] = timer(lambda: st.deinterleave(
            iv.own_ids, req, bt, cg, compact=st.attention_layout == "compact", out_slots=xv.slots,
            out_counts=xv.counts))  # fmt: skip
    if qv.full is not None or qv.gathered is None:
        q_full = qv.full if qv.full is not None else q
    elif T == 1:
        q_full = qv.gathered.view(T, s.num_heads, DQK)
    else:  # the attention reads the gathered query with its heads in groups
        q_full = qv.gathered.transpose(0, 1)
    slots, counts = trace["slots"], trace["counts"]
    scored_rows = step._scored_rows(shard, index_q, weights)  # the scoring rows the step's guard also checks
    if parts.attention.guard_fused:  # the guard runs inside the attention call: timed with it, not alone
        from dcp_ref.guard import GuardRows

        rows = GuardRows(bounds, req, bt, cg, n_cols, **scored_rows)
        times["attention"] = timer(lambda: st.attention(
            q_full, shard.kv_cache, slots, counts, SCALE, DV, out=av.partial, out_lse=av.lse, guard=rows))  # fmt: skip
    else:
        times["attention"] = timer(lambda: st.attention(
            q_full, shard.kv_cache, slots, counts, SCALE, DV, out=av.partial, out_lse=av.lse))  # fmt: skip
        times["guard"] = timer(lambda: st.guard(av.partial, av.lse, bounds, req, bt, cg, n_cols,
                                                         **scored_rows))  # fmt: skip
    if cv is not None and hasattr(cv, "recv_out"):  # the all-to-all combine
        times["combine"] = timer(lambda: st.combine(cv.recv_out, cv.recv_lse, out=cv.out, out_lse=cv.out_lse))
        W, Hs = s.geometry.world_size, s.heads_per_rank
        if not parts.combine.packed_by_attention:  # else the attention wrote the send buffer itself
            times["pack_for_alltoall"] = timer(lambda: (
                cv.send_out.copy_(av.partial.view(T, W, Hs, DV).transpose(0, 1)),
                cv.send_lse.copy_(av.lse.view(T, W, Hs).transpose(0, 1))))  # fmt: skip
    if qv.full is not None:
        W, Hs = s.geometry.world_size, s.heads_per_rank
        full, gathered = qv.full, qv.gathered
        times["query_transpose"] = timer(lambda: full.view(T, W, Hs, DQK).copy_(gathered.transpose(0, 1)))
    return times


def _cold_time_us(fn) -> float:
    """One stage alone from a cold L2 (``_timing.cold``: a flush before each of the graph's calls, subtracted)."""
    return _timing.cold(fn).median_us


def check_kernels_ran(impls: dict[str, str], notes: dict[str, str]) -> None:
    """Refuse to time a layer whose stages fell back to the reference (``"torch"``): a machine without the bundle's
    environment plans one silently, and its rows (several times slower) would read as the kernels'."""
    fell = {stage: notes.get(stage, "") for stage, impl in impls.items() if impl in ("torch", "reference")}
    if fell:
        raise RuntimeError(f"stages fell back to the reference, not timed: {fell}")


def row_options(layout: str, W: int) -> LayerOptions:
    """The layer options a row ``layout:W:T:ctx:cache`` times: the planned layer (:data:`dcp_ref.options.PLANNED`:
    owner exchange, one all-to-all combine, the query gathered over heads) in ``layout``, the candidates' order
    ``rank_local`` only where there is an exchange (dcp over W > 1; else ``global_id``), and the query replicated at
    W = 1 (nothing to gather). The row records it as ``"options"`` (:attr:`LayerOptions.label`)."""
    options = PLANNED.replace(layout=layout)
    if layout == "tp" or W == 1:
        options = options.replace(order="global_id")
    return options.replace(q_replicate=True) if W == 1 else options


def bench_row(
    layout: str, W: int, T: int, ctx: int, cache: str, device: torch.device, group: Any = None
) -> dict[str, Any]:
    """One row. ``group``: a real group of ``W`` ranks (several GPUs: the collectives are measured, not
    modelled), else this rank alone (:class:`LocalRankGroup`)."""
    from dcp_ref.group import SingleGroup
    from dcp_ref.kernels.stages import kernel_stages
    from dcp_ref.stages import ScoringSpec, StepSpec
    from dcp_ref.step import PlannedStep

    rank = group.rank if group is not None else 0
    q, shard, meta, index_q, weights, _, local = make_layer_inputs(layout, W, T, ctx, cache, device, rank=rank)
    kv_format = "fp8_ds_mla" if cache == "fp8" else "native"
    from dcp_ref.geometry import DcpGeometry

    options = row_options(layout, W)
    order = options.order
    spec = StepSpec.for_options(DcpGeometry(W, 0, 1, BLOCK), options, max_tokens=T, topk=TOPK, num_heads=H,
                                head_dim=DQK, v_dim=DV, sm_scale=SCALE, dtype=torch.bfloat16, device=device,
                                scoring=ScoringSpec(local), kv_format=kv_format)  # fmt: skip
    stages = kernel_stages(spec)  # the attention runs spec.attention_heads: H (dcp) or H / W (tp)
    real = group is not None
    if real and rank != 0:
        spec = dataclasses.replace(spec, geometry=DcpGeometry(W, rank, 1, BLOCK))
    if group is None:
        group = SingleGroup() if W == 1 else LocalRankGroup(W)
    t0 = time.perf_counter()
    step = PlannedStep(group, spec, stages)
    plan_ms = (time.perf_counter() - t0) * 1e3
    check_kernels_ran(step.impls, dict(step.stages.notes))

    def run() -> Any:
        return step.run(q, shard, meta, index_q=index_q, index_weights=weights)

    run()  # prefill the other ranks' slices; compile; per-shape caches
    torch.cuda.synchronize()
    if isinstance(group, LocalRankGroup):
        group.prefill = False
    run()
    torch.cuda.synchronize()
    mem0 = torch.cuda.memory_stats(device).get("allocation.all.allocated", 0)
    run()
    torch.cuda.synchronize()
    allocs = torch.cuda.memory_stats(device).get("allocation.all.allocated", 0) - mem0
    row: dict[str, Any] = {
        "layout": layout, "W": W, "T": T, "ctx": ctx, "cache": cache, "local_keys": local,
        "scoring": "unfused", "order": order, "options": options.label, "impl": step.impls, "fused": step.fused,
        "notes": dict(step.stages.notes), "plan_ms": plan_ms, "allocations_per_run": allocs,
    }  # fmt: skip
    row["eager_us"] = _eager_time_us(run)
    row.update(_profile_counts(run))
    graph = step.capture(q, shard, meta, index_q=index_q, index_weights=weights)
    row["graph_us"] = _timing.replay(graph, replays=20).median_us  # back to back, as layers replay
    row["kernels_us"] = _timing.kernel_breakdown(graph)  # each kernel of one replay, in launch order
    row["stages_us"] = _stage_times(step, q, shard, meta, index_q, weights)
    row["stages_sum_us"] = sum(row["stages_us"].values())
    # The same stages and the whole layer each from a cold L2 (a flush before every call, subtracted): a layer
    # meets its inputs evicted by the layer before, and so does a stage "alone" (as triton's do_bench times it).
    # Back to back, a stage alone re-reads what its last call left in L2 (the W = 1 index keys fit in it), which
    # no stage inside the layer does: the cold pair is the like-for-like test of "the graph costs no more than
    # its parts".
    row["graph_cold_us"] = _timing.cold(run, calls=5).median_us
    row["stages_cold_us"] = _stage_times(step, q, shard, meta, index_q, weights, timer=_cold_time_us)
    row["stages_cold_sum_us"] = sum(row["stages_cold_us"].values())
    if real:
        row["collectives_us"], row["collectives_source"] = 0.0, "inside graph_us (measured)"
        row["source"] = "measured"
        row["transport"] = type(group).__name__ + (f" ({group.transport})" if hasattr(group, "transport") else "")
    else:
        row["collectives_us"], row["collectives_source"] = collectives_us(layout, W, T)
        row["source"] = "measured (one H200, collectives excluded)"
    row["total_us"] = row["graph_us"] + row["collectives_us"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--W", default="1,2,4,8")
    ap.add_argument("--T", default="1,32,128")
    ap.add_argument("--ctx", default="8192,65536,131072")
    ap.add_argument("--cache", default="bf16,fp8")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting rows after this many seconds")
    ap.add_argument("--transport", default="nccl", help="under torch.distributed.run: nccl, symm (symmetric memory)")
    ap.add_argument("--configs", default=None, help="explicit rows in this order: layout:W:T:ctx:cache,...")
    args = ap.parse_args()
    group = None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # several GPUs: every rank runs its own work, the collectives are real and measured
        import torch.distributed as dist

        from dcp_ref.group import SymmetricMemoryGroup, TorchDistributedGroup

        rank = int(os.environ["RANK"])
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        group = TorchDistributedGroup()
        if args.transport == "symm":
            group = SymmetricMemoryGroup(group, capacity_bytes=64 << 20)
        args.W = str(world)
    dev = torch.device("cuda", torch.cuda.current_device())
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    configs = []
    if args.configs:
        for c in args.configs.split(","):
            lay, w_, t_, ctx_, cache_ = c.split(":")
            configs.append((lay, int(w_), int(t_), int(ctx_), cache_))
    for W in [] if args.configs else ints(args.W):
        for T in ints(args.T):
            for ctx in ints(args.ctx):
                for cache in args.cache.split(","):
                    for layout in ("dcp",) if W == 1 else ("dcp", "tp"):
                        configs.append((layout, W, T, ctx, cache))
    name = "layer.json" if group is None else f"layer_W{world}_{args.transport}.json"

    def result() -> dict[str, Any]:
        return {
            "device": torch.cuda.get_device_name(dev),
            "versions": _meta.versions(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "shapes": {"H": H, "Dqk": DQK, "Dv": DV, "topk": TOPK, "block_size": BLOCK, "index_heads": INDEX_HEADS},
            "how": __doc__.split("\n\n")[1] if __doc__ else "",
            "rows": rows,
            "errors": errors,
            "summary": [
                {k: r[k] for k in ("layout", "W", "T", "ctx", "cache", "graph_us", "collectives_us", "source")}
                | {"scoring": r["scoring"]}
                for r in rows
            ],
        }

    for cfg in configs:
        if time.perf_counter() - t_start > args.budget_s:
            errors.append({"config": cfg, "error": "skipped: time budget spent"})
            continue
        try:
            row = bench_row(*cfg, device=dev, group=group)
            torch.cuda.empty_cache()  # the row's caches (up to ~20 GB at 128K context) go before the next
            rows.append(row)
            print(f"{cfg}: graph {row['graph_us']:.1f} us (+{row['collectives_us']:.1f} collectives), "
                  f"stages {row['stages_sum_us']:.1f}; cold: graph {row['graph_cold_us']:.1f}, stages "
                  f"{row['stages_cold_sum_us']:.1f}; eager {row['eager_us']:.0f}, syncs {row['host_syncs_per_step']}",
                  flush=True)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - recorded: one failed shape must not cost the others
            errors.append({"config": cfg, "error": f"{type(e).__name__}: {e}"[:500]})
            print(f"{cfg}: FAILED {e}", flush=True)
            torch.cuda.empty_cache()
        if group is None:  # written after every row: a run stopped at its time limit keeps what it measured
            (out_dir / name).write_text(json.dumps(result(), indent=1, default=str))
    out = result()
    if group is not None:
        out["world_size"], out["transport"] = world, args.transport
        import torch.distributed as dist

        dist.barrier()
        if dist.get_rank() != 0:
            os._exit(0)  # NCCL teardown after captured collectives hung on these machines: leave without it
    (out_dir / name).write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {out_dir / name}: {len(rows)} rows, {len(errors)} errors", flush=True)
    if group is not None:
        os._exit(0)


if __name__ == "__main__":
    main()
