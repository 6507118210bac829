"""The cache-write stage: only the owner of position p writes it, at its local slot, in both formats.

Checked against independent constructions: ``make_dcp_problem``'s shards (built there by one
direct scatter per rank) for any W, I, block size and prefill length — float caches equal,
FP8 caches equal the quantized shard rows, unwritten rows untouched; the read side
(``global_ids_to_local_slots``) finds every token where the write side put it; every token is
written exactly once over the group. Then the FP8 DCP attention on W simulated ranks (masked
slots per rank, the float64 FP8 reference, the LSE merge) equals single-device FP8 attention over
the unsharded cache. Bad input: a table of errors naming the argument.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_ref.cache_write import UNWRITTEN_FP8_BYTE, build_sharded_caches, token_slots, write_cache_rows, write_tokens
from dcp_ref.deinterleave import global_ids_to_local_slots
from dcp_ref.fp8_cache import quantize_kv_fp8, sparse_mla_attention_fp8
from dcp_ref.geometry import DcpGeometry
from dcp_ref.lse import merge_partials
from dcp_ref.pipeline import make_dcp_problem

geometries = st.tuples(st.integers(1, 4), st.sampled_from([1, 2, 3]), st.integers(1, 3))  # W, I, block_size / I
lengths = st.lists(st.integers(1, 26), min_size=1, max_size=3)


def _problem(W, I, mult, lens, seed, head_dim=576):
    bs = I * mult
    p = make_dcp_problem(W, I, seq_lens=lens, head_dim=head_dim, block_size=bs, seed=seed)
    return p, DcpGeometry(W, 0, I, bs)


@settings(max_examples=40, deadline=None)
@given(geo=geometries, lens=lengths, prefill=st.sampled_from([0, 1, 7]), seed=st.integers(0, 10**6))
def test_writes_build_the_shards_make_dcp_problem_holds(geo, lens, prefill, seed) -> None:
    W, I, mult = geo
    p, g = _problem(W, I, mult, lens, seed)
    tables = [s.block_table for s in p.shards]
    sizes = [s.kv_cache.shape[0] for s in p.shards]
    floats = build_sharded_caches(p.kv_global, tables, g, sizes, fp8=False, dtype=torch.float64, prefill=prefill)
    fp8s = build_sharded_caches(p.kv_global, tables, g, sizes, prefill=prefill)
    for r, shard in enumerate(p.shards):
        want = shard.kv_cache  # NaN rows: never written
        assert floats[r].shape == want.shape and torch.equal(floats[r].nan_to_num(7.5), want.nan_to_num(7.5))
        written = ~torch.isnan(want).any(1)
        assert fp8s[r].dtype == torch.uint8 and fp8s[r].shape == (want.shape[0], 656)
        assert torch.equal(fp8s[r][written], quantize_kv_fp8(want[written]))
        assert bool((fp8s[r][~written] == UNWRITTEN_FP8_BYTE).all())


@settings(max_examples=60, deadline=None)
@given(geo=geometries, lens=lengths, seed=st.integers(0, 10**6))
def test_write_slot_is_where_the_read_side_looks(geo, lens, seed) -> None:
    W, I, mult = geo
    p, g = _problem(W, I, mult, lens, seed, head_dim=4)
    B = len(lens)
    req = torch.arange(B).repeat_interleave(torch.tensor(lens))
    pos = torch.cat([torch.arange(n) for n in lens])
    hits = torch.zeros(req.numel(), dtype=torch.int64)
    for r, shard in enumerate(p.shards):
        wrote = token_slots(g.with_rank(r), shard.block_table, req, pos)
        # the read side: the same positions as "selected ids", one row per token
        read = global_ids_to_local_slots(pos[:, None], req, shard.block_table, DcpGeometry(W, r, I, g.block_size))[:, 0]
        assert torch.equal(wrote, read.long())
        hits += (wrote >= 0).long()
    assert hits.tolist() == [1] * req.numel()  # every token on exactly one rank


@settings(max_examples=20, deadline=None)
@given(geo=geometries, lens=lengths, K=st.integers(1, 12), seed=st.integers(0, 10**6))
def test_fp8_dcp_attention_on_simulated_ranks_equals_single_device(geo, lens, K, seed) -> None:
    W, I, mult = geo
    p, g = _problem(W, I, mult, lens, seed)
    caches = build_sharded_caches(
        p.kv_global, [s.block_table for s in p.shards], g, [s.kv_cache.shape[0] for s in p.shards]
    )
    gen = torch.Generator().manual_seed(seed)
    req = p.req_of_token
    T = req.numel()
    q = (torch.randn(T, 2, 576, generator=gen) * 0.3).bfloat16()
    # K chosen global positions per query token (-1 = none, anywhere)
    ids = torch.stack([torch.randint(0, int(p.seq_lens[b]), (K,), generator=gen) for b in req.tolist()])
    ids[torch.rand(T, K, generator=gen) < 0.3] = -1
    sm = 192**-0.5
    outs, lses = [], []
    for r, shard in enumerate(p.shards):
        slots = global_ids_to_local_slots(
            ids, req, shard.block_table, DcpGeometry(W, r, I, g.block_size)
        )  # masked: no compaction
        o, l = sparse_mla_attention_fp8(q, caches[r], slots, None, sm)
        outs.append(o)
        lses.append(l)
    out, lse = merge_partials(torch.stack(outs), torch.stack(lses))
    # single device: every request's rows quantized into one flat cache, slot = offset + position
    flat = quantize_kv_fp8(torch.cat(p.kv_global))
    offset = torch.tensor([0] + [int(n) for n in p.seq_lens.cumsum(0)[:-1]])
    single = torch.where(ids >= 0, offset[req][:, None] + ids, -1)
    ref_o, ref_l = sparse_mla_attention_fp8(q, flat, single, None, sm)
    assert torch.allclose(out, ref_o, rtol=1e-9, atol=1e-11)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l))
    fin = torch.isfinite(ref_l)
    assert torch.allclose(lse[fin], ref_l[fin], rtol=1e-12, atol=1e-12)


def test_write_tokens_one_step_on_every_rank() -> None:
    g = DcpGeometry(2, 0, 2, 4)
    table = torch.tensor([[1, 0], [2, -1]], dtype=torch.int32)  # request 1 has one block
    kv = torch.arange(3 * 576, dtype=torch.float32).reshape(3, 576)
    req = torch.tensor([0, 0, 1])
    pos = torch.tensor([5, 6, 3])  # ranks: (5//2)%2=0, (6//2)%2=1, (3//2)%2=1
    c0 = torch.full((12, 576), math.nan)
    c1 = torch.full((12, 576), math.nan)
    s0 = write_tokens(c0, g, table, req, pos, kv)
    s1 = write_tokens(c1, g.with_rank(1), table, req, pos, kv)
    # rank 0: p=5 -> local (5//4)*2 + 1 = 3 -> block 0 of req 0 = physical 1 -> slot 4 + 3 = 7
    # rank 1: p=6 -> local 2 -> slot 1*4 + 2 = 6; p=3 (req 1) -> local 1 -> slot 2*4 + 1 = 9
    assert s0.tolist() == [7, -1, -1] and s1.tolist() == [-1, 6, 9]
    assert torch.equal(c0[7], kv[0]) and torch.equal(c1[6], kv[1]) and torch.equal(c1[9], kv[2])
    assert int((~torch.isnan(c0).any(1)).sum()) == 1 and int((~torch.isnan(c1).any(1)).sum()) == 2
    f8 = torch.zeros(12, 656, dtype=torch.float8_e4m3fn)  # FP8 cache in FlashMLA's dtype
    write_tokens(f8, g.with_rank(1), table, req, pos, kv)
    assert torch.equal(f8.view(torch.uint8)[[6, 9]], quantize_kv_fp8(kv[1:]))


def _args(**kw):
    a = dict(
        cache=torch.zeros(8, 576),
        geometry=DcpGeometry(1, 0, 1, 4),
        block_table=torch.tensor([[0, 1]]),
        req_ids=torch.tensor([0, 0]),
        positions=torch.tensor([0, 1]),
        kv=torch.zeros(2, 576),
    )
    a.update(kw)
    return a


BAD = [
    (_args(geometry=(1, 0, 1, 4)), TypeError, "geometry must be a dcp_ref.geometry.DcpGeometry"),
    (_args(block_table=torch.tensor([[0.0, 1.0]])), TypeError, "block_table must have dtype"),
    (_args(req_ids=torch.tensor([0, 1])), ValueError, r"req_ids must lie in \[0, B=1\)"),
    (_args(positions=torch.tensor([0, -1])), ValueError, "positions must be >= 0"),
    (_args(positions=torch.tensor([0, 8])), ValueError, "block_table has 2 blocks per request, but position 8"),
    (
        _args(block_table=torch.tensor([[0, -1]]), positions=torch.tensor([0, 5])),
        ValueError,
        r"block_table\[0, 1\] is -1",
    ),
    (_args(req_ids=torch.tensor([0])), ValueError, "req_ids and positions must have one entry per token"),
    (_args(kv=torch.zeros(2, 575)), ValueError, r"kv must be \[N=2, 576\]"),
    (_args(kv=torch.zeros(2, 576, dtype=torch.int32)), TypeError, "kv must have dtype"),
    (
        _args(cache=torch.zeros(8, 576, dtype=torch.uint8)),
        ValueError,
        r"an FP8 cache \(torch.uint8\) must be \[num_slots, 656\]",
    ),
    (_args(cache=torch.zeros(8, 576, dtype=torch.int32)), TypeError, "cache must have dtype"),
    (
        _args(cache=torch.zeros(1, 576)),
        ValueError,
        r"slots must be -1 \(not written here\) or lie in \[0, num_slots=1\)",
    ),
    (_args(positions=torch.tensor([1, 1])), ValueError, "must not repeat a cache row"),
]


@pytest.mark.parametrize("args,exc,msg", BAD, ids=[b[2][:30] for b in BAD])
def test_write_tokens_rejects_bad_input(args, exc, msg) -> None:
    cache = args["cache"]
    before = cache.clone()
    with pytest.raises(exc, match=msg):
        write_tokens(cache, args["geometry"], args["block_table"], args["req_ids"], args["positions"], args["kv"])
    assert torch.equal(cache, before)  # nothing half-written


def test_write_cache_rows_skips_minus_one_and_rejects_other_negatives() -> None:
    c = torch.zeros(4, 3)
    write_cache_rows(c, torch.tensor([-1, 2]), torch.ones(2, 3))
    assert c.sum().item() == 3 and c[2].tolist() == [1, 1, 1]
    with pytest.raises(ValueError, match="slots must be -1"):
        write_cache_rows(c, torch.tensor([-2, 1]), torch.ones(2, 3))


def test_build_sharded_caches_rejects_bad_input() -> None:
    g = DcpGeometry(2, 0, 1, 4)
    kv = [torch.zeros(5, 576)]
    t = [torch.tensor([[0, 1]])] * 2
    with pytest.raises(ValueError, match=r"one table per rank \(2\)"):
        build_sharded_caches(kv, t[:1], g, 8)
    with pytest.raises(ValueError, match=r"one per rank \(2\)"):
        build_sharded_caches(kv, t, g, [8])
    with pytest.raises(ValueError, match="fp8=True needs kv_global rows of 576"):
        build_sharded_caches([torch.zeros(5, 24)], t, g, 8)
    with pytest.raises(TypeError, match="geometry must be"):
        build_sharded_caches(kv, t, (2, 0, 1, 4), 8)  # type: ignore[arg-type]
