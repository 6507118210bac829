"""A prefill chunk under DCP: dcp_prefill_step in the chunk's gathered-keys layout equals the
single-device oracle and the decode step with next_n = query_lens."""

from __future__ import annotations

import pytest
import torch
from idsets import same_sets

from dcp_ref.group import SimulatedWorld
from dcp_ref.ownership import localize_prefill_chunk
from dcp_ref.pipeline import RankShard, dcp_decode_step, make_dcp_problem, single_device_decode
from dcp_ref.prefill import chunk_scores_from_local, dcp_prefill_step


def run_prefill(problem, context_lens, query_lens, topk, scale, traces=None, backend="reference"):
    W, I = problem.world_size, problem.interleave
    traces = traces if traces is not None else [None] * W

    def step(group, shard, tr):
        meta = localize_prefill_chunk(context_lens, query_lens, W, group.rank, I)
        scores = chunk_scores_from_local(shard.index_scores, query_lens, meta)
        chunk_shard = RankShard(shard.kv_cache, shard.block_table, scores, shard.geometry)
        return dcp_prefill_step(
            group, problem.q, chunk_shard, context_lens, query_lens, topk, scale, trace=tr, stages=backend
        )

    res = SimulatedWorld(W).run(step, problem.shards, traces)
    return torch.cat([o for o, _ in res], 1), torch.cat([l for _, l in res], 1)


@pytest.mark.parametrize("world_size,interleave", [(1, 1), (2, 1), (3, 2), (4, 4)])
@pytest.mark.parametrize("query_lens", [[5, 1, 12], [1, 1, 1], [20, 3, 0]])
def test_prefill_chunk_equals_single_device(world_size, interleave, query_lens) -> None:
    seq_lens = [37, 5, 64]
    problem = make_dcp_problem(
        world_size,
        interleave,
        seq_lens=seq_lens,
        next_n=query_lens,
        num_heads=2 * world_size,
        head_dim=8,
        block_size=8,
        seed=world_size + 7 * interleave + sum(query_lens),
    )
    qlens = torch.tensor(query_lens)
    ctx = torch.tensor(seq_lens) - qlens
    traces = [dict() for _ in range(world_size)]
    out, lse = run_prefill(problem, ctx, qlens, 6, 0.35, traces)
    ref_out, ref_lse, ref_ids = single_device_decode(problem, 6, 0.35)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    for tr in traces:
        assert same_sets(tr["global_ids"], ref_ids)
        # every token's window lies inside its own request's segment of the chunk layout
        m = tr["meta"]
        req = problem.req_of_token
        assert bool((m.cu_seqlens_k[req] <= m.token_ks).all() and (m.token_ks <= m.token_ke).all())
        assert bool((m.token_ke <= m.cu_seqlens_k[req + 1]).all())


def test_prefill_equals_decode_with_next_n_query_lens() -> None:
    """Same problem, two layouts: decode (scores by local index) and prefill (gathered chunk)."""
    problem = make_dcp_problem(
        3, 2, seq_lens=[30, 9, 50], next_n=[4, 2, 7], num_heads=6, head_dim=8, block_size=4, seed=2
    )
    qlens = torch.tensor([4, 2, 7])
    ctx = problem.seq_lens - qlens
    p_out, p_lse = run_prefill(problem, ctx, qlens, 5, 0.3)
    res = SimulatedWorld(3).run(
        lambda g, shard: dcp_decode_step(g, problem.q, shard, problem.seq_lens, problem.next_n, 5, 0.3),
        problem.shards,
    )
    d_out, d_lse = torch.cat([o for o, _ in res], 1), torch.cat([l for _, l in res], 1)
    assert torch.equal(p_out, d_out) and torch.equal(p_lse, d_lse)


def test_chunk_scores_layout_and_errors() -> None:
    meta = localize_prefill_chunk([3, 0], [2, 3], world_size=2, rank=0, interleave=1)
    # request 0: 5 keys -> local 0,2,4 (3 on rank 0); request 1: 3 keys -> local 0,2 (2 on rank 0)
    assert meta.cu_seqlens_k.tolist() == [0, 3, 5]
    local = torch.arange(5 * 4, dtype=torch.float32).reshape(5, 4)  # 5 query tokens, local keys by index
    got = chunk_scores_from_local(local, torch.tensor([2, 3]), meta)
    assert got.shape == (5, 5)
    assert got[0, :3].tolist() == local[0, :3].tolist() and torch.isnan(got[0, 3:]).all()
    assert got[4, 3:].tolist() == local[4, :2].tolist() and torch.isnan(got[4, :3]).all()
    with pytest.raises(ValueError, match="add up"):
        chunk_scores_from_local(local, torch.tensor([2, 2]), meta)
    problem = make_dcp_problem(1, 1, seq_lens=[6], next_n=2, num_heads=1, head_dim=4)
    with pytest.raises(ValueError, match=r"shard\.index_scores must be"):
        SimulatedWorld(1).run(
            lambda g, s: dcp_prefill_step(
                g,
                problem.q,
                RankShard(s.kv_cache, s.block_table, torch.zeros(2, 1), s.geometry),
                torch.tensor([4]),
                torch.tensor([2]),
                2,
                0.5,
            ),
            problem.shards,
        )


def test_make_dcp_problem_checks_query_counts() -> None:
    with pytest.raises(ValueError, match="one value per request"):
        make_dcp_problem(2, seq_lens=[5, 6], next_n=[1, 2, 3])
    with pytest.raises(ValueError, match="hold"):
        make_dcp_problem(2, seq_lens=[5, 6], next_n=[6, 1])


@pytest.mark.parametrize("world_size,interleave", [(1, 1), (3, 2)])
def test_prefill_chunk_on_the_kernels(world_size, interleave) -> None:
    """backend="kernels": the Triton pack with row_starts (and the other kernels) on a chunk."""
    seq_lens, query_lens = [37, 5, 64], [5, 1, 12]
    problem = make_dcp_problem(
        world_size,
        interleave,
        seq_lens=seq_lens,
        next_n=query_lens,
        num_heads=2 * world_size,
        head_dim=8,
        block_size=8,
        seed=4,
    )
    qlens = torch.tensor(query_lens)
    traces = [dict() for _ in range(world_size)]
    out, lse = run_prefill(problem, torch.tensor(seq_lens) - qlens, qlens, 6, 0.35, traces, backend="kernels")
    ref_out, ref_lse, ref_ids = single_device_decode(problem, 6, 0.35)
    assert out.dtype == torch.float32 and traces[0]["impl"]["indexer"] in ("torch+triton", "fused")
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-6, atol=2e-6)
    for tr in traces:
        assert same_sets(tr["global_ids"], ref_ids)
