"""The ownership stage — ownership math against brute-force enumeration.

The brute-force oracles below walk positions one by one with the *definition* of the layout
(deal runs of I tokens round-robin to W ranks), never with the closed forms under test.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_ref import (
    expand_decode_bounds,
    global_to_local,
    local_seq_lens,
    local_to_global,
    localize_decode_bounds,
    localize_prefill_chunk,
    owner_rank,
)
from dcp_ref.ownership import localize_decode_bounds_wrong_order  # a teaching bug: not in the top level

W_ST = st.integers(1, 16)
I_ST = st.integers(1, 8)


# ----------------------------------------------------------------------------- brute force
def deal(n: int, w: int, i: int) -> list[tuple[int, int]]:
    """(rank, local index) of positions 0..n-1 by literally dealing runs of ``i`` to ``w`` ranks."""
    counts = [0] * w
    out = []
    rank, in_run = 0, 0
    for _ in range(n):
        out.append((rank, counts[rank]))
        counts[rank] += 1
        in_run += 1
        if in_run == i:
            in_run, rank = 0, (rank + 1) % w
    return out


def brute_local_len(length: int, w: int, r: int, i: int) -> int:
    return sum(1 for rank, _ in deal(length, w, i) if rank == r)


# ----------------------------------------------------------------------------- position maps
@settings(max_examples=200, deadline=None)
@given(w=W_ST, i=I_ST, n=st.integers(0, 3000))
def test_position_maps_match_dealing(w: int, i: int, n: int) -> None:
    pos = torch.arange(n)
    expected = deal(n, w, i)
    ranks = owner_rank(pos, w, i).tolist()
    locs = global_to_local(pos, w, i).tolist()
    assert list(zip(ranks, locs)) == expected


@settings(max_examples=200, deadline=None)
@given(w=W_ST, i=I_ST, n=st.integers(1, 3000))
def test_bijection_global_local(w: int, i: int, n: int) -> None:
    pos = torch.arange(n)
    ranks = owner_rank(pos, w, i)
    locs = global_to_local(pos, w, i)
    # global -> (rank, local) -> global is the identity ...
    for r in range(w):
        sel = ranks == r
        assert torch.equal(local_to_global(locs[sel], w, r, i), pos[sel])
        # ... and each rank's local indices are exactly 0..count-1 (no gap, no duplicate).
        assert torch.equal(locs[sel], torch.arange(int(sel.sum())))
    # (rank, local) -> global -> (rank, local) is the identity too.
    for r in range(w):
        loc = torch.arange(n)
        g = local_to_global(loc, w, r, i)
        assert torch.equal(owner_rank(g, w, i), torch.full_like(g, r))
        assert torch.equal(global_to_local(g, w, i), loc)


@given(w=W_ST, i=I_ST, data=st.data())
def test_local_to_global_old_argument_order_always_raises(w: int, i: int, data: st.DataObject) -> None:
    """``local_to_global(local, world_size, rank, interleave)``: a call written in the old order
    ``(local, rank, world_size, interleave)`` with a valid geometry can never answer: the old rank is
    below the old world size, so read as ``world_size, rank`` it is out of range (rank 0 as a world
    size of 0, any other as a rank past its world size). Never a silently wrong position."""
    r = data.draw(st.integers(0, w - 1))
    loc = data.draw(st.integers(0, 1000))
    want = (loc // i) * (w * i) + r * i + loc % i  # the formula, independent of the code under test
    assert local_to_global(loc, w, r, i) == want
    assert local_to_global(loc, world_size=w, rank=r, interleave=i) == want
    with pytest.raises(ValueError, match=r"^(world_size|rank)"):
        local_to_global(loc, r, w, i)  # the old order
    with pytest.raises(ValueError, match=r"^(world_size|rank)"):
        local_to_global(torch.tensor([loc]), r, w, i)


def test_python_ints_in_and_out() -> None:
    assert owner_rank(5, 2, 2) == 0 and isinstance(owner_rank(5, 2, 2), int)
    assert global_to_local(5, 2, 2) == 3
    assert local_to_global(3, 2, 0, 2) == 5
    assert local_seq_lens(10, 2, 1) == 5 and isinstance(local_seq_lens(10, 2, 1), int)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_dtype_and_shape_preserved(dtype: torch.dtype) -> None:
    x = torch.arange(24, dtype=dtype).reshape(2, 3, 4)
    for out in (owner_rank(x, 3, 2), global_to_local(x, 3, 2), local_to_global(x, 3, 1, 2), local_seq_lens(x, 3, 1, 2)):
        assert out.dtype == dtype and out.shape == x.shape
    assert local_seq_lens(x, 3, None, 2).shape == (2, 3, 4, 3)


# ----------------------------------------------------------------------------- local lengths
@settings(max_examples=200, deadline=None)
@given(w=W_ST, i=I_ST, lengths=st.lists(st.integers(0, 3000), min_size=1, max_size=6))
def test_local_seq_lens_closed_form_equals_brute_force(w: int, i: int, lengths: list[int]) -> None:
    t = torch.tensor(lengths)
    per_rank = local_seq_lens(t, w, None, i)
    for b, length in enumerate(lengths):
        for r in range(w):
            expected = brute_local_len(length, w, r, i)
            assert per_rank[b, r].item() == expected
            assert local_seq_lens(t, w, r, i)[b].item() == expected
    # Sum over ranks is the global length.
    assert torch.equal(per_rank.sum(-1), t)


@settings(max_examples=100, deadline=None)
@given(w=W_ST, i=I_ST, n=st.integers(0, 2000))
def test_local_seq_lens_monotone_and_balanced(w: int, i: int, n: int) -> None:
    lens = torch.arange(n + 1)
    per_rank = local_seq_lens(lens, w, None, i)  # [n+1, W]
    steps = per_rank[1:] - per_rank[:-1]
    # Adding one token adds exactly one key to exactly one rank: its owner.
    assert bool(((steps == 0) | (steps == 1)).all())
    assert torch.equal(steps.sum(-1), torch.ones(n, dtype=steps.dtype))
    if n:
        assert torch.equal(steps.argmax(-1), owner_rank(torch.arange(n), w, i))
    # Ranks never differ by more than one interleave run.
    assert int((per_rank.max(-1).values - per_rank.min(-1).values).max()) <= i


# ----------------------------------------------------------------------------- decode bounds
def brute_decode_bounds(seq_lens: list[int], q_lens: list[int], w: int, r: int, i: int) -> list[int]:
    """Enumerate every query token's visible keys and count those on rank r."""
    owners = [rank for rank, _ in deal(max(seq_lens, default=0), w, i)]
    out = []
    for length, q in zip(seq_lens, q_lens):
        for j in range(q):
            pos = length - q + j  # the query token's own position
            out.append(sum(1 for p in range(pos + 1) if owners[p] == r))
    return out


def test_decode_bound_order_bug_numbers() -> None:
    """The seed PR's review: W=2, rank 1, global bounds [8, 9, 10] -> [4, 4, 5], not [3, 4, 5]."""
    assert expand_decode_bounds([10], 3).tolist() == [[8, 9, 10]]
    right = localize_decode_bounds([10], 3, world_size=2, rank=1)
    wrong = localize_decode_bounds_wrong_order([10], 3, world_size=2, rank=1)
    assert right.tolist() == [[4, 4, 5]]
    assert wrong.tolist() == [[3, 4, 5]]
    assert brute_decode_bounds([10], [3], 2, 1, 1) == [4, 4, 5]


@settings(max_examples=150, deadline=None)
@given(
    w=W_ST,
    i=I_ST,
    data=st.data(),
)
def test_decode_bounds_flattened_equal_brute_force(w: int, i: int, data: st.DataObject) -> None:
    b = data.draw(st.integers(1, 5))
    q_lens = data.draw(st.lists(st.integers(0, 6), min_size=b, max_size=b))
    seq_lens = [q + data.draw(st.integers(0, 2000)) for q in q_lens]
    r = data.draw(st.integers(0, w - 1))
    got = localize_decode_bounds(torch.tensor(seq_lens), torch.tensor(q_lens), w, r, i)
    assert got.tolist() == brute_decode_bounds(seq_lens, q_lens, w, r, i)
    # All ranks at once; the per-rank bounds sum to the global bound.
    every = localize_decode_bounds(torch.tensor(seq_lens), torch.tensor(q_lens), w, None, i)
    assert torch.equal(every[..., r], got)
    assert torch.equal(every.sum(-1), expand_decode_bounds(torch.tensor(seq_lens), torch.tensor(q_lens)))


@settings(max_examples=100, deadline=None)
@given(w=W_ST, i=I_ST, data=st.data())
def test_decode_bounds_2d_form_equals_flattened(w: int, i: int, data: st.DataObject) -> None:
    b = data.draw(st.integers(1, 5))
    next_n = data.draw(st.integers(1, 4))
    seq_lens = torch.tensor([next_n + data.draw(st.integers(0, 1500)) for _ in range(b)], dtype=torch.int32)
    r = data.draw(st.integers(0, w - 1))
    two_d = localize_decode_bounds(seq_lens, next_n, w, r, i)
    flat = localize_decode_bounds(seq_lens, torch.full((b,), next_n, dtype=torch.int32), w, r, i)
    assert two_d.shape == (b, next_n) and two_d.dtype == torch.int32
    assert torch.equal(two_d.reshape(-1), flat)


def test_wrong_order_differs_often() -> None:
    """Not a corner case: for W>1 and MTP, the wrong order is wrong on most requests."""
    seq = torch.arange(3, 400)
    right = localize_decode_bounds(seq, 3, 4, 2, 1)
    wrong = localize_decode_bounds_wrong_order(seq, 3, 4, 2, 1)
    assert (right != wrong).any(-1).float().mean() > 0.5
    # With a single rank both orders agree (nothing is remote).
    assert torch.equal(localize_decode_bounds(seq, 3, 1, 0), localize_decode_bounds_wrong_order(seq, 3, 1, 0))


# ----------------------------------------------------------------------------- prefill
def brute_prefill(ctx: list[int], q: list[int], w: int, r: int, i: int):
    owners = [rank for rank, _ in deal(max((c + n for c, n in zip(ctx, q)), default=0), w, i)]
    cu_k, ks, ke = [0], [], []
    for c, n in zip(ctx, q):
        start = cu_k[-1]
        for j in range(n):
            ks.append(start)
            ke.append(start + sum(1 for p in range(c + j + 1) if owners[p] == r))
        cu_k.append(start + sum(1 for p in range(c + n) if owners[p] == r))
    totals = [sum(1 for c, n in zip(ctx, q) for p in range(c + n) if owners[p] == rr) for rr in range(w)]
    return cu_k, ks, ke, max(totals)


@settings(max_examples=150, deadline=None)
@given(w=W_ST, i=I_ST, data=st.data())
def test_prefill_chunk_equals_brute_force(w: int, i: int, data: st.DataObject) -> None:
    b = data.draw(st.integers(1, 4))
    ctx = data.draw(st.lists(st.integers(0, 1500), min_size=b, max_size=b))
    q = data.draw(st.lists(st.integers(0, 40), min_size=b, max_size=b))
    r = data.draw(st.integers(0, w - 1))
    meta = localize_prefill_chunk(torch.tensor(ctx), torch.tensor(q), w, r, i)
    cu_k, ks, ke, max_total = brute_prefill(ctx, q, w, r, i)
    assert meta.cu_seqlens_k.tolist() == cu_k
    assert meta.token_ks.tolist() == ks
    assert meta.token_ke.tolist() == ke
    assert meta.cu_seqlens_q.tolist() == [0, *torch.cumsum(torch.tensor(q), 0).tolist()]
    assert meta.local_total == cu_k[-1]
    assert meta.max_local_total == max_total
    # Causality: bounds never exceed the request's local keys, and grow along the chunk.
    assert bool((meta.token_ke >= meta.token_ks).all())


def test_prefill_interleave_gt_one_small_example() -> None:
    # W=2, I=2, rank 1. Request 0: 3 cached + 2 new; request 1: 0 cached + 4 new.
    # Positions on rank 1 are 2,3 | 6,7 | ... (runs of 2, every other run).
    meta = localize_prefill_chunk([3, 0], [2, 4], world_size=2, rank=1, interleave=2)
    assert meta.cu_seqlens_k.tolist() == [0, 2, 4]
    assert meta.token_ks.tolist() == [0, 0, 2, 2, 2, 2]
    assert meta.token_ke.tolist() == [2, 2, 2, 2, 3, 4]
    assert (meta.local_total, meta.max_local_total) == (4, 5)


def test_prefill_int32_on_request() -> None:
    meta = localize_prefill_chunk(torch.tensor([5], dtype=torch.int32), torch.tensor([3], dtype=torch.int32), 2, 0)
    for t in (meta.cu_seqlens_q, meta.cu_seqlens_k, meta.token_ks, meta.token_ke):
        assert t.dtype == torch.int32


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: owner_rank(3, 0), ValueError, "world_size"),
        (lambda: owner_rank(3, 2, 0), ValueError, "interleave"),
        (lambda: owner_rank(3, 2.0), TypeError, "world_size"),
        (lambda: owner_rank(3, True), TypeError, "world_size"),
        (lambda: owner_rank(-1, 2), ValueError, "pos"),
        (lambda: owner_rank(torch.tensor([1.0]), 2), TypeError, "pos"),
        (lambda: owner_rank("3", 2), TypeError, "pos"),
        (lambda: global_to_local(torch.tensor([0, -5]), 2), ValueError, "pos"),
        (lambda: local_to_global(0, 2, 2), ValueError, "rank"),
        (lambda: local_to_global(0, 2, 5), ValueError, "rank"),
        (lambda: local_to_global(0, 2, -1), ValueError, "rank"),
        (lambda: local_to_global(-1, 2, 0), ValueError, "local"),
        (lambda: local_seq_lens(torch.tensor([-1]), 2, 0), ValueError, "seq_lens"),
        (lambda: local_seq_lens(torch.tensor([1], dtype=torch.int16), 2, 0), TypeError, "seq_lens"),
        (lambda: local_seq_lens(5, 2, 2), ValueError, "rank"),
        (lambda: expand_decode_bounds([2], 3), ValueError, "seq_lens"),
        (lambda: expand_decode_bounds([5], 0), ValueError, "query_lens"),
        (lambda: expand_decode_bounds([5, 6], [1]), ValueError, "query_lens"),
        (lambda: expand_decode_bounds([5], [-1]), ValueError, "query_lens"),
        (lambda: expand_decode_bounds([[5]], 1), ValueError, "seq_lens"),
        (lambda: expand_decode_bounds(torch.tensor([5.0]), 1), TypeError, "seq_lens"),
        (lambda: localize_decode_bounds([5], 1, 2, 3), ValueError, "rank"),
        (lambda: localize_prefill_chunk([1], [1, 2], 2, 0), ValueError, "query_lens"),
        (lambda: localize_prefill_chunk([-1], [1], 2, 0), ValueError, "context_lens"),
        (lambda: localize_prefill_chunk([1], [1], 2, None), ValueError, "rank"),
        (lambda: localize_prefill_chunk([1], [1], 2, 0, 0), ValueError, "interleave"),
    ],
)
def test_bad_input_is_named(call, exc, words) -> None:
    with pytest.raises(exc, match=words):
        call()


@pytest.mark.gpu
def test_ownership_on_cuda(cuda_device: torch.device) -> None:
    seq = torch.randint(1, 5000, (64,), device=cuda_device, dtype=torch.int32)
    got = localize_decode_bounds(seq, 2, 8, 3, 4)
    assert got.device.type == "cuda" and got.dtype == torch.int32
    assert torch.equal(got.cpu(), localize_decode_bounds(seq.cpu(), 2, 8, 3, 4))
