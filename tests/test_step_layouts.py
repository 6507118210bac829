"""The planned step's layouts and exchanges against the single-device oracle (CPU; kernels interpreted).

Every combination a :class:`~dcp_ref.stages.StepSpec` can choose — the query gathered over heads or
replicated, the exchange through select + deinterleave or owner-local select-to-slots, the combine by
reduce-scatter or one all-to-all, and the tensor-parallel layout — must give the oracle's answer for
this rank's heads, read no tensor value on the host, and poison (never answer plausibly) a token whose
metadata is out of contract.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dcp_ref.geometry import DcpGeometry
from dcp_ref.group import SimulatedWorld, SingleGroup
from dcp_ref.pipeline import make_dcp_problem, single_device_decode
from dcp_ref.stages import REFERENCE_STAGES, StepSpec
from dcp_ref.step import HostSyncCounter, PlannedStep, RankShard, StepMetadata

TOPK, SCALE = 5, 0.3


def _problem(W: int, I: int = 1, seed: int = 0, heads: int | None = None):
    return make_dcp_problem(W, I, seq_lens=[30, 9, 17, 4], next_n=2, num_heads=heads or 2 * W, head_dim=8,
                            block_size=4, seed=seed)  # fmt: skip


def _spec(p, rank: int, **kw) -> StepSpec:
    _, H, D = p.q.shape
    args = dict(max_tokens=8, topk=TOPK, num_heads=H, head_dim=D, v_dim=D, sm_scale=SCALE, dtype=torch.float64,
                device="cpu")  # fmt: skip
    return StepSpec(p.geometry(rank), **{**args, **kw})


def _q_for(p, rank: int, spec: StepSpec) -> torch.Tensor:
    Hs = spec.heads_per_rank
    return p.q if spec.query_heads == spec.num_heads else p.q[:, rank * Hs : (rank + 1) * Hs].contiguous()


def _run_dcp(p, stages="reference", **kw):
    W = p.world_size
    world = SimulatedWorld(W)
    st = stages  # a name: PlannedStep resolves it for its spec

    def body(group, shard):
        spec = _spec(p, group.rank, **kw)
        step = PlannedStep(group, spec, st)
        trace: dict = {}
        out, lse = step.run(_q_for(p, group.rank, spec), shard, p.metadata(group.rank), trace=trace)
        return out.clone(), lse.clone(), trace

    res = world.run(body, p.shards)
    return torch.cat([o for o, _, _ in res], 1), torch.cat([l for _, l, _ in res], 1), [t for _, _, t in res]


def _tol(stages: str) -> float:
    return 1e-10 if stages == "reference" else 3e-6


@pytest.mark.parametrize("stages", ["reference", "kernels"])
@pytest.mark.parametrize("W,I", [(1, 1), (2, 1), (3, 2), (4, 1)])
@pytest.mark.parametrize("combine", ["reduce_scatter", "alltoall"])
@pytest.mark.parametrize("q_replicate", [True, False])
def test_dcp_combines_and_query_inputs_equal_the_oracle(stages, W, I, combine, q_replicate) -> None:
    if stages == "kernels" and W == 4:
        pytest.skip("W = 4 on the interpreted kernels adds time, not coverage (W = 3 runs them)")
    p = _problem(W, I, seed=W + I)
    out, lse, traces = _run_dcp(p, stages, combine=combine, q_replicate=q_replicate)
    ref_out, ref_lse, ref_ids = single_device_decode(p, TOPK, SCALE)
    tol = _tol(stages)
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)
    for tr in traces:
        assert [sorted(r) for r in tr["global_ids"].tolist()] == [sorted(r) for r in ref_ids.tolist()]
        last = [] if W == 1 else ["correct" if combine == "reduce_scatter" else "combine"]
        select = [] if W == 1 else ["select"]  # one rank: the local top-K is the answer
        assert list(tr["impl"]) == ["indexer", *select, "deinterleave", "attention", "guard", *last]
        if not q_replicate and W > 1:  # the gathered query is the full query, heads in rank order
            torch.testing.assert_close(tr["q_full"], p.q, rtol=0, atol=0)


def test_query_gather_at_one_token_is_a_view_not_a_copy() -> None:
    p = make_dcp_problem(2, 1, seq_lens=[30], next_n=1, num_heads=4, head_dim=8, block_size=4, seed=3)
    world = SimulatedWorld(2)

    def body(group, shard):
        spec = dataclasses.replace(_spec(p, group.rank, q_replicate=False), max_tokens=1)
        step = PlannedStep(group, spec)
        trace: dict = {}
        step.run(_q_for(p, group.rank, spec), shard, p.metadata(group.rank), trace=trace)
        return trace["q_full"], step.parts.query.gathered_buf, step.parts.query.full_buf

    for q_full, gathered, full_buffer in world.run(body, p.shards):
        assert torch.equal(q_full, p.q)
        assert gathered is not None and gathered.numel() == 2 * 1 * 2 * 8
        assert full_buffer is None  # planned for T = 1: the gathered buffer is read as [1, H, D], no copy


@pytest.mark.parametrize("stages", ["reference", "kernels"])
@pytest.mark.parametrize("W,I", [(2, 1), (4, 2)])
def test_tp_layout_is_the_oracle_for_its_heads(stages, W, I) -> None:
    """One rank of TP-W: the whole context, H/W heads, no collective; its heads equal the oracle's."""
    p = make_dcp_problem(1, I, seq_lens=[30, 9, 17, 4], next_n=2, num_heads=2 * W, head_dim=8, block_size=4,
                         seed=7)  # fmt: skip
    ref_out, ref_lse, ref_ids = single_device_decode(p, TOPK, SCALE)
    st = stages  # a name: PlannedStep resolves it for its spec
    Hs = 2
    for r in range(W):
        spec = StepSpec(DcpGeometry(W, r, I, 4), max_tokens=8, topk=TOPK, num_heads=2 * W, head_dim=8, v_dim=8,
                        sm_scale=SCALE, dtype=torch.float64, device="cpu", layout="tp")  # fmt: skip
        assert spec.cache_geometry == DcpGeometry(1, 0, I, 4) and spec.query_heads == spec.attention_heads == Hs
        step = PlannedStep(_NoCollectives(W, r), spec, st)
        trace: dict = {}
        out, lse = step.run(p.q[:, r * Hs : (r + 1) * Hs].contiguous(), p.shards[0], p.metadata(0), trace=trace)
        tol = _tol(stages)
        torch.testing.assert_close(out.double(), ref_out[:, r * Hs : (r + 1) * Hs], rtol=tol, atol=tol)
        torch.testing.assert_close(lse.double(), ref_lse[:, r * Hs : (r + 1) * Hs], rtol=tol, atol=tol)
        assert [sorted(x) for x in trace["global_ids"].tolist()] == [sorted(x) for x in ref_ids.tolist()]
        assert "correct" not in trace["impl"] and "combine" not in trace["impl"]


class _NoCollectives:
    """A group handle whose collectives fail: the tp layout (and W = 1) must call none."""

    def __init__(self, world_size: int = 1, rank: int = 0) -> None:
        self.world_size, self.rank = world_size, rank

    def all_gather(self, x, *, out=None):  # type: ignore[no-untyped-def]
        raise AssertionError("all_gather called")

    def reduce_scatter(self, x, dim=0, *, out=None):  # type: ignore[no-untyped-def]
        raise AssertionError("reduce_scatter called")

    def all_to_all(self, x, *, out=None):  # type: ignore[no-untyped-def]
        raise AssertionError("all_to_all called")


def test_tp_refuses_a_sharded_cache() -> None:
    p = _problem(2)
    spec = _spec(p, 0, layout="tp")
    step = PlannedStep(_NoCollectives(2, 0), spec)
    with pytest.raises(ValueError, match="tp layout's unsharded cache geometry"):
        step.run(p.q[:, :2].contiguous(), p.shards[0], p.metadata(0))


@pytest.mark.parametrize("stages", ["reference", "kernels"])
@pytest.mark.parametrize("combine", ["reduce_scatter", "alltoall"])
def test_run_reads_no_tensor_value_on_the_host(stages, combine) -> None:
    p = _problem(2, 2, seed=5)
    st = stages  # a name: PlannedStep resolves it for its spec

    def body(group, shard):
        spec = _spec(p, group.rank, combine=combine, q_replicate=False)
        step = PlannedStep(group, spec, st)
        q, meta = _q_for(p, group.rank, spec), p.metadata(group.rank)
        step.run(q, shard, meta)  # warm-up: per-shape caches
        with HostSyncCounter() as c:
            step.run(q, shard, meta)
        return c.syncs, len(c.ops)

    for syncs, n_ops in SimulatedWorld(2).run(body, p.shards):
        assert syncs == [] and n_ops > 10


@pytest.mark.parametrize("layout", ["dcp", "tp"])
def test_an_empty_batch_gives_empty_results(layout) -> None:
    p = _problem(2)
    spec = _spec(p, 0, layout=layout, q_replicate=False)
    step = PlannedStep(_NoCollectives(2, 0), spec)  # T = 0 calls no collective and no stage
    shard = p.shards[0] if layout == "dcp" else make_dcp_problem(1, 1, seq_lens=[30], num_heads=4, head_dim=8,
                                                                 block_size=4).shards[0]  # fmt: skip
    empty = torch.empty(0, dtype=torch.int32)
    shard = RankShard(shard.kv_cache, shard.block_table, shard.index_scores[:0], shard.geometry)
    out, lse = step.run(torch.empty(0, 2, 8, dtype=torch.float64), shard, StepMetadata(empty, empty))
    assert out.shape == (0, 2, 8) and lse.shape == (0, 2)
    with pytest.raises(ValueError, match="T = 0 query tokens: an empty batch has nothing to capture"):
        step.capture(torch.empty(0, 2, 8, dtype=torch.float64), shard, StepMetadata(empty, empty))


def _bad_metadata_cases(meta: StepMetadata, B: int) -> dict[str, StepMetadata]:
    b, r = meta.local_bounds.clone(), meta.req_of_token.clone()

    def with_(i: int, bound: int | None = None, req: int | None = None) -> StepMetadata:
        bb, rr = b.clone(), r.clone()
        if bound is not None:
            bb[i] = bound
        if req is not None:
            rr[i] = req
        return StepMetadata(bb, rr)

    return {
        "request id past the block table": with_(1, req=B),
        "negative request id": with_(1, req=-1),
        "negative bound": with_(1, bound=-3),
        "bound past the scores": with_(1, bound=10_000),
    }


@pytest.mark.parametrize("stages", ["reference", "kernels"])
@pytest.mark.parametrize("combine", ["reduce_scatter", "alltoall"])
def test_out_of_contract_tokens_are_poisoned_not_answered(stages, combine) -> None:
    """validate=False: a token whose metadata is out of contract is NaN on every rank (all its heads); the other
    tokens still equal the oracle."""
    p = _problem(2, 1, seed=9)
    ref_out, ref_lse, _ = single_device_decode(p, TOPK, SCALE)
    st = stages  # a name: PlannedStep resolves it for its spec
    B = p.seq_lens.numel()
    for what in _bad_metadata_cases(p.metadata(0), B):

        def body(group, shard, what=what):
            step = PlannedStep(group, _spec(p, group.rank, combine=combine), st)
            meta = _bad_metadata_cases(p.metadata(group.rank), B)[what]
            out, lse = step.run(p.q, shard, meta)
            return out.clone(), lse.clone()

        res = SimulatedWorld(2).run(body, p.shards)
        out, lse = torch.cat([o for o, _ in res], 1), torch.cat([l for _, l in res], 1)
        assert bool(out[1].isnan().all()) and bool(lse[1].isnan().all()), what
        keep = [t for t in range(out.shape[0]) if t != 1]
        tol = _tol(stages)
        torch.testing.assert_close(out[keep].double(), ref_out[keep], rtol=tol, atol=tol)
        torch.testing.assert_close(lse[keep].double(), ref_lse[keep], rtol=tol, atol=tol)


def test_a_missing_block_poisons_and_validate_names_it() -> None:
    p = _problem(1, 1, seed=2)
    shard = p.shards[0]
    table = shard.block_table.clone()
    table[0, 1] = -1  # request 0 (30 tokens, 8 blocks of 4) lost its second block
    holey = RankShard(shard.kv_cache, table, shard.index_scores, shard.geometry)
    out, lse = PlannedStep(SingleGroup(), _spec(p, 0)).run(p.q, holey, p.metadata(0))
    req = p.metadata(0).req_of_token
    assert bool(out[req == 0].isnan().all()) and not bool(out[req != 0].isnan().any())
    assert bool(lse[req == 0].isnan().all()) and not bool(lse[req != 0].isnan().any())
    with pytest.raises(ValueError, match=r"shard\.block_table is missing a block"):
        PlannedStep(SingleGroup(), _spec(p, 0), validate=True).run(p.q, holey, p.metadata(0))


def test_validate_checks_that_the_cache_holds_every_slot() -> None:
    p = _problem(1, 1, seed=2)
    shard = p.shards[0]
    short = RankShard(shard.kv_cache[:20], shard.block_table, shard.index_scores, shard.geometry)
    with pytest.raises(ValueError, match=r"shard\.kv_cache has 20 slots, but shard\.block_table names block"):
        PlannedStep(SingleGroup(), _spec(p, 0), validate=True).run(p.q, short, p.metadata(0))
    big = shard.block_table.clone()
    big[0, 0] = 2**29  # 2**29 * 4 slots: beyond int32
    with pytest.raises(ValueError, match="exceed int32"):
        PlannedStep(SingleGroup(), _spec(p, 0), validate=True).run(
            p.q, RankShard(shard.kv_cache, big, shard.index_scores, shard.geometry), p.metadata(0)
        )


def test_plan_refuses_what_is_not_a_group_and_stages_without_buffers() -> None:
    p = _problem(2)  # two ranks: the select stage runs (one rank's local top-K needs none)
    with pytest.raises(TypeError, match=r"group must be a dcp_ref\.group\.Group"):
        PlannedStep(object(), _spec(p, 0))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="all_to_all"):
        PlannedStep(_GatherOnly(2, 0), _spec(_problem(2), 0, combine="alltoall"))

    def select_without_out(gathered, k):  # type: ignore[no-untyped-def]
        return REFERENCE_STAGES.select(gathered, k)

    with pytest.raises(TypeError, match=r"stage 'select' \(.*select_without_out\) must accept .*\['out'\]"):
        PlannedStep(_NoCollectives(2, 0), _spec(p, 0), REFERENCE_STAGES.with_(select=select_without_out))

    def wrong_shape(gathered, k, *, out=None):  # type: ignore[no-untyped-def]
        return torch.zeros(1, k, dtype=torch.int32)

    class SelfGather(_NoCollectives):  # every rank's slice is this rank's: enough to reach the select stage
        def all_gather(self, x, *, out=None):  # type: ignore[no-untyped-def]
            out[:] = x
            return out

    step = PlannedStep(SelfGather(2, 0), _spec(p, 0), REFERENCE_STAGES.with_(select=wrong_shape))
    with pytest.raises(ValueError, match=r"stage 'select' \(.*wrong_shape\) returned shape \(1, 5\)"):
        step.run(p.q, p.shards[0], p.metadata(0))


class _GatherOnly(_NoCollectives):
    all_to_all = None  # type: ignore[assignment]


def test_spec_choices_are_validated() -> None:
    p = _problem(2)
    with pytest.raises(ValueError, match="layout must be one of"):
        _spec(p, 0, layout="pp")
    with pytest.raises(ValueError, match="order='rank_local' needs exchange='owner'"):
        _spec(p, 0, order="rank_local")
    with pytest.raises(TypeError, match="q_replicate must be a bool"):
        _spec(p, 0, q_replicate=1)
    with pytest.raises(ValueError, match="device must name a torch device"):
        _spec(p, 0, device="gpu7")
    with pytest.raises(TypeError, match=r"device must be a torch\.device or a str"):
        _spec(p, 0, device=3)
    with pytest.raises(TypeError):  # keyword-only after geometry
        StepSpec(p.geometry(0), 8, TOPK, 4, 8, 8, SCALE, torch.float64, "cpu")  # type: ignore[misc]
    assert math.isclose(_spec(p, 0).sm_scale, SCALE)


# ---- the layer from its inputs: scoring FP8 index keys, owner-local exchange ------------------------------
def _scored_problem(W: int, I: int = 1, seed: int = 0):
    return make_dcp_problem(W, I, seq_lens=[30, 9, 17, 4], next_n=2, num_heads=2 * W, head_dim=8, block_size=4,
                            seed=seed, index_heads=4)  # fmt: skip


def _run_layer(p, stages="reference", **kw):
    from dcp_ref.stages import ScoringSpec

    W = p.world_size
    st = stages  # a name: PlannedStep resolves it for its spec
    max_keys = max(int(m.local_bounds.max()) for m in (p.metadata(r) for r in range(W)))

    next_n = kw.pop("next_n", 1)

    def body(group, shard):
        spec = _spec(p, group.rank, scoring=ScoringSpec(max_keys, index_heads=4, next_n=next_n), **kw)
        step = PlannedStep(group, spec, st)
        trace: dict = {}
        out, lse = step.run(_q_for(p, group.rank, spec), shard, p.metadata(group.rank), index_q=p.index_q,
                            index_weights=p.index_weights, trace=trace)  # fmt: skip
        return out.clone(), lse.clone(), trace

    res = SimulatedWorld(W).run(body, p.shards)
    return torch.cat([o for o, _, _ in res], 1), torch.cat([l for _, l, _ in res], 1), [t for _, _, t in res]


@pytest.mark.parametrize("stages", ["reference", "kernels"])
def test_the_layer_scores_a_requests_mtp_tokens_from_one_read(stages) -> None:
    """spec.scoring.next_n = 2 (the problem's two query tokens per request): the same layer, bit for bit, as
    scoring every token on its own; a step whose groups name two requests is refused when validating."""
    p = _scored_problem(2, 1, seed=5)
    kw = dict(exchange="owner", order="global_id", combine="alltoall", q_replicate=False)
    out1, lse1, _ = _run_layer(p, stages, **kw)
    out2, lse2, traces = _run_layer(p, stages, next_n=2, **kw)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    assert all(next(iter(t["impl"])) == "scoring" for t in traces)


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(index_dim=64), ValueError, r"^index_dim must be 128: the scoring stage reads"),
        (dict(index_dim=256), ValueError, r"^index_dim must be 128"),
        (dict(index_dim=128.0), TypeError, r"index_dim"),
        (dict(index_heads=0), ValueError, r"index_heads"),
        (dict(next_n=0), ValueError, r"next_n"),
        (dict(fused=True), TypeError, r"unexpected keyword argument 'fused'"),  # (removed: slower everywhere)
    ],
)
def test_a_scoring_spec_the_step_cannot_run_is_refused_when_built(kw, exc, match) -> None:
    """The spec names its own field when it is built (an ``index_dim`` the scoring stage cannot read used to plan,
    then fail at the first run naming ``index_q``); what it accepts, the step runs (the layer tests above)."""
    from dcp_ref.stages import ScoringSpec

    with pytest.raises(exc, match=match):
        ScoringSpec(8, **kw)
    assert ScoringSpec(8, index_heads=4).index_dim == 128


@pytest.mark.parametrize("stages", ["reference", "kernels"])
@pytest.mark.parametrize("W,I", [(1, 1), (2, 1), (3, 2)])
@pytest.mark.parametrize(
    "exchange,order",
    [("allgather", "global_id"), ("owner", "global_id"), ("owner", "rank_local")],
)
def test_the_layer_from_its_inputs_equals_the_oracle(stages, W, I, exchange, order) -> None:
    """Scores computed from the FP8 index keys on each rank (exact by construction), then either exchange: the
    oracle's output, and — for the owner exchange — the union of the ranks' slots is the oracle's top-k."""
    p = _scored_problem(W, I, seed=10 * W + I)
    out, lse, traces = _run_layer(p, stages, exchange=exchange, order=order, combine="alltoall", q_replicate=False)
    ref_out, ref_lse, ref_ids = single_device_decode(p, TOPK, SCALE)
    tol = _tol(stages)
    if order == "global_id":
        torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)
    else:  # rank_local breaks threshold ties by (rank, local index): equal to the oracle off threshold ties
        _assert_rank_local_selection(p, traces, ref_ids)
    assert next(iter(traces[0]["impl"])) == "scoring"
    if W == 1:  # one rank: no exchange at all, the local top-K's slots looked up
        assert "select_to_slots" not in traces[0]["impl"] and "select" not in traces[0]["impl"]
    elif exchange == "owner":
        assert "select_to_slots" in traces[0]["impl"] and "select" not in traces[0]["impl"]


def _assert_rank_local_selection(p, traces, ref_ids) -> None:
    """Per token: the slots the ranks emit, mapped back to positions, are a top-k by score (a valid top-k: every
    position above the k-th score is in, ties at the k-th score fill the rest), and no slot is repeated."""
    from dcp_ref.ownership import local_to_global

    W = p.world_size
    for t in range(p.q.shape[0]):
        b = int(p.req_of_token[t])
        chosen: list[int] = []
        for r, tr in enumerate(traces):
            table = p.shards[r].block_table[b]
            n = int(tr["counts"][t])
            for slot in tr["slots"][t, :n].tolist():
                blk, off = divmod(slot, p.block_size)
                j = int((table == blk).nonzero()[0, 0]) * p.block_size + off
                chosen.append(int(local_to_global(torch.tensor([j]), world_size=W, rank=r, interleave=p.interleave)[0]))
        assert len(chosen) == len(set(chosen))
        ref = [x for x in ref_ids[t].tolist() if x >= 0]
        assert len(chosen) == len(ref)
        s = p.scores_global[t]
        if ref:
            kth = min(float(s[x]) for x in ref)
            assert all(float(s[x]) >= kth for x in chosen)
            assert {x for x in ref if float(s[x]) > kth} <= set(chosen)


# ---- what the layer's scoring cannot score is poisoned, never "no keys" (issue 32, classes 1-2) ----------------
def _index_blocks_needed(shard, meta, bs: int) -> list[set[int]]:
    """Per token, the index-cache blocks its keys are scored from (plain Python, from the block table)."""
    table = shard.block_table.tolist()
    return [
        {table[b][j] for j in range(-(-n // bs))}
        for b, n in zip(meta.req_of_token.tolist(), meta.local_bounds.tolist(), strict=True)
    ]


def _layer_run(p, shards, index_q, index_weights, stages, validate=False):
    from dcp_ref.stages import ScoringSpec

    W = p.world_size
    st = stages  # a name: PlannedStep resolves it for its spec
    max_keys = max(int(p.metadata(r).local_bounds.max()) for r in range(W))

    def body(group, shard):
        spec = _spec(p, group.rank, scoring=ScoringSpec(max_keys, index_heads=4), combine="alltoall")
        out, lse = PlannedStep(group, spec, st, validate=validate).run(
            p.q, shard, p.metadata(group.rank), index_q=index_q, index_weights=index_weights
        )
        return out.clone(), lse.clone()

    res = SimulatedWorld(W).run(body, shards)
    return torch.cat([o for o, _ in res], 1), torch.cat([l for _, l in res], 1)


@pytest.mark.parametrize("stages", ["reference", "kernels"])
@pytest.mark.parametrize("W", [1, 2])
def test_what_the_layer_cannot_score_is_poisoned_not_empty(stages, W) -> None:
    """validate=False. (1) One rank's index-key cache shorter than its block table: a token whose keys need a
    block past it is NaN on every head (before: its scores were NaN, which the indexer reads as masked keys —
    output 0 and LSE -inf, "no keys", or the other ranks' keys alone, finite and wrong). (2) A NaN in ``index_q``
    or an infinite index weight: that token is NaN. Every other token is the clean run's, bit for bit; with
    validate=True each is refused by name."""
    p = _scored_problem(W, seed=4 + W)
    clean_out, clean_lse = _layer_run(p, p.shards, p.index_q, p.index_weights, stages)
    assert not clean_out.isnan().any() and not clean_lse.isnan().any()
    bs = p.shards[0].geometry.block_size
    # (1) the last rank's index cache ends right after the block of the token whose blocks end first
    r = W - 1
    last = [max(blocks, default=-1) for blocks in _index_blocks_needed(p.shards[r], p.metadata(r), bs)]
    keep = min(last) + 1
    short = list(p.shards)
    short[r] = dataclasses.replace(p.shards[r], index_cache=p.shards[r].index_cache[:keep].clone())
    bad = torch.tensor([b >= keep for b in last])
    assert bad.any() and not bad.all()  # the case reaches both verdicts
    out, lse = _layer_run(p, short, p.index_q, p.index_weights, stages)
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    assert torch.equal(out[~bad], clean_out[~bad]) and torch.equal(lse[~bad], clean_lse[~bad])
    with pytest.raises(ValueError, match=r"^shard\.index_cache has"):
        _layer_run(p, short, p.index_q, p.index_weights, stages, validate=True)
    # (2) token 1's index query holds a NaN, token 3's weights an infinity
    iq, iw = p.index_q.clone(), p.index_weights.clone()
    iq.view(torch.uint8)[1, 2, 5] = 0x7F  # float8 e4m3fn NaN
    iw[3, 0] = float("inf")
    out, lse = _layer_run(p, p.shards, iq, iw, stages)
    hit = torch.zeros(out.shape[0], dtype=torch.bool)
    hit[[1, 3]] = True
    assert out[hit].isnan().all() and lse[hit].isnan().all()
    assert torch.equal(out[~hit], clean_out[~hit]) and torch.equal(lse[~hit], clean_lse[~hit])
    for name, (q_, w_) in (("index_q", (iq, p.index_weights)), ("index_weights", (p.index_q, iw))):
        with pytest.raises(ValueError, match=rf"^{name} must be finite"):
            _layer_run(p, p.shards, q_, w_, stages, validate=True)
