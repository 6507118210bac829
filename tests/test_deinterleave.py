"""The deinterleave and compaction stages: global ids → physical slots, and compaction to the front.

The reference (:mod:`dcp_ref.deinterleave`) is checked against a brute-force Python loop built on
the ownership stage's functions; the Triton kernels (:mod:`dcp_ref.kernels.deinterleave_triton`)
are checked against the reference — exactly for the ordered methods, as sets + counts for the
atomic one. On CPU the kernels run under ``TRITON_INTERPRET=1`` (set by conftest); on a GPU the
same tests run on CUDA, and the ``gpu`` tests add large shapes and CUDA-graph capture/replay.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_ref.deinterleave import (
    POISON_SLOT,
    canonicalize,
    compact_to_front,
    deinterleave_and_compact,
    deinterleave_masked,
    global_ids_to_local_slots,
)
from dcp_ref.geometry import DcpGeometry
from dcp_ref.ownership import global_to_local, owner_rank

dk = pytest.importorskip("dcp_ref.kernels.deinterleave_triton")


# ----------------------------------------------------------------------------------------------
# Independent brute force (plain Python ints, one id at a time)
# ----------------------------------------------------------------------------------------------


POISON = 2**31 - 1  # the poison slot, written here independently of the code under test


def brute_slots(ids, req, bt, bs, w, r, i):
    """The stage's rule: -1 not here; the slot; POISON for out-of-contract metadata (a bad request id
    poisons its whole row; an owned id without a block — past the table or negative — and a slot that
    does not fit below 2**31 - 1 are poisoned)."""
    ids, bt = ids.tolist(), bt.tolist()
    req = list(range(len(ids))) if req is None else req.tolist()
    out = []
    for row, b in zip(ids, req):
        if not 0 <= b < len(bt):
            out.append([POISON] * len(row))
            continue
        res = []
        for t in row:
            if t < 0 or owner_rank(t, w, i) != r:
                res.append(-1)
                continue
            local = global_to_local(t, w, i)
            j = local // bs
            if j >= len(bt[b]) or bt[b][j] < 0:
                res.append(POISON)
                continue
            res.append(min(bt[b][j] * bs + local % bs, POISON))
        out.append(res)
    return out


def poisoned(rows) -> bool:
    return any(POISON in row for row in rows)


def brute_compact(slot_rows):
    out, counts = [], []
    for row in slot_rows:
        valid = [s for s in row if s >= 0]
        out.append(valid + [-1] * (len(row) - len(valid)))
        counts.append(len(valid))
    return out, counts


def make_case(gen, t_rows, k, w, i, bs, n_req, n_blocks, p_invalid=0.1, beyond=0.1):
    """Random inputs: ids mostly inside the table, some beyond it, some -1; unique block ids."""
    span = n_blocks * bs * w  # local capacity of the table, in global positions
    hi = max(1, int(span * (1 + beyond)))
    ids = torch.randint(0, hi, (t_rows, k), generator=gen, dtype=torch.int32)
    ids[torch.rand((t_rows, k), generator=gen) < p_invalid] = -1
    req = torch.randint(0, n_req, (t_rows,), generator=gen, dtype=torch.int32)
    bt = torch.randperm(n_req * n_blocks * 2, generator=gen)[: n_req * n_blocks].to(torch.int32).view(n_req, n_blocks)
    return ids, req, bt


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    t_rows=st.integers(0, 5),
    k=st.integers(0, 40),
    w=st.integers(1, 4),
    i=st.sampled_from([1, 2, 4]),
    bs_mult=st.integers(1, 3),
    n_blocks=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_reference_matches_brute_force(t_rows, k, w, i, bs_mult, n_blocks, seed, data):
    r = data.draw(st.integers(0, w - 1))
    bs = i * bs_mult
    gen = torch.Generator().manual_seed(seed)
    ids, req, bt = make_case(gen, t_rows, k, w, i, bs, 3, n_blocks)
    bt[torch.rand(bt.shape, generator=gen) < 0.1] = -1  # some unallocated blocks
    bt[torch.rand(bt.shape, generator=gen) < 0.05] = -7  # any negative entry means "no block"
    want = brute_slots(ids, req, bt, bs, w, r, i)
    if poisoned(want):  # out-of-contract metadata: validated, every entry point raises naming block_table
        for fn in (global_ids_to_local_slots, deinterleave_and_compact, deinterleave_masked):
            with pytest.raises(ValueError, match=r"^block_table"):
                fn(ids, req, bt, DcpGeometry(w, r, i, bs))
    else:
        assert global_ids_to_local_slots(ids, req, bt, DcpGeometry(w, r, i, bs)).tolist() == want
    slots = global_ids_to_local_slots(ids, req, bt, DcpGeometry(w, r, i, bs), validate=False)
    assert slots.dtype == torch.int32 and slots.shape == ids.shape
    assert slots.tolist() == want
    want_c, want_n = brute_compact(want)
    out, counts = deinterleave_and_compact(ids, req, bt, DcpGeometry(w, r, i, bs), ordered=True, validate=False)
    assert out.tolist() == want_c and counts.tolist() == want_n
    out_u, counts_u = deinterleave_and_compact(ids, req, bt, DcpGeometry(w, r, i, bs), ordered=False, validate=False)
    assert counts_u.tolist() == want_n
    assert out_u.tolist() == [sorted(row[:n]) + row[n:] for row, n in zip(want_c, want_n)]
    masked, counts_m = deinterleave_masked(ids, req, bt, DcpGeometry(w, r, i, bs), validate=False)
    assert masked.dtype == counts_m.dtype == torch.int32
    assert masked.tolist() == want and counts_m.tolist() == want_n


def test_reference_small_example_by_hand():
    # W=2, I=2, block_size=2, rank 1: rank 1 owns positions 2,3 | 6,7 | 10,11 ... (local 0,1 | 2,3 | 4,5)
    ids = torch.tensor([[3, 6, 0, -1, 11, 2]], dtype=torch.int32)
    bt = torch.tensor([[7, 5]], dtype=torch.int32)  # local 0,1 -> block 7 ; local 2,3 -> block 5
    slots = global_ids_to_local_slots(ids, None, bt, DcpGeometry(2, 1, 2, 2), validate=False)
    # 3 -> local 1 -> 7*2+1=15 ; 6 -> local 2 -> 5*2+0=10 ; 0 remote ; -1 ;
    # 11 -> local 5 -> block idx 2 past the table: a selected key without a block -> poisoned ; 2 -> local 0 -> 14
    assert slots.tolist() == [[15, 10, -1, -1, POISON, 14]]
    with pytest.raises(ValueError, match=r"^block_table has no block .* token_ids\[0, 4\] = 11"):
        global_ids_to_local_slots(ids, None, bt, DcpGeometry(2, 1, 2, 2))
    out, n = compact_to_front(slots, ordered=True)
    assert out.tolist() == [[15, 10, POISON, 14, -1, -1]] and n.tolist() == [4]
    out_u, n_u = compact_to_front(slots, ordered=False)
    assert out_u.tolist() == [[10, 14, 15, POISON, -1, -1]] and n_u.tolist() == [4]
    ok = torch.tensor([[3, 6, 0, -1, 2]], dtype=torch.int32)
    assert global_ids_to_local_slots(ok, None, bt, DcpGeometry(2, 1, 2, 2)).tolist() == [[15, 10, -1, -1, 14]]


def test_reference_world_size_one_is_plain_conversion():
    ids = torch.tensor([[0, 5, 9, -1, 64]], dtype=torch.int32)
    bt = torch.tensor([[3, 1]], dtype=torch.int32)
    # bs=4: id 5 -> block idx 1 -> 1*4+1 ; 9, 64 -> past the 2-entry table: poisoned (W = 1 owns every id)
    got = global_ids_to_local_slots(ids, None, bt, DcpGeometry(1, 0, 1, 4), validate=False)
    assert got.tolist() == [[12, 5, POISON, -1, POISON]]
    assert global_ids_to_local_slots(ids[:, :2], None, bt, DcpGeometry(1, 0, 1, 4)).tolist() == [[12, 5]]


def test_canonicalize_equal_for_permuted_prefixes():
    a = torch.tensor([[5, 3, 9, -1], [1, -1, -1, -1]], dtype=torch.int32)
    b = torch.tensor([[9, 5, 3, -1], [1, 7, 7, 7]], dtype=torch.int32)  # tail garbage ignored
    c = torch.tensor([3, 1], dtype=torch.int32)
    assert canonicalize(a, c).tolist() == canonicalize(b, c).tolist() == [[3, 5, 9, -1], [1, -1, -1, -1]]


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(geometry=(2, 0, 1, 4)), TypeError, "^geometry must be a dcp_ref.geometry.DcpGeometry, got tuple"),
        (dict(geometry=None), TypeError, "^geometry must be a dcp_ref.geometry.DcpGeometry, got NoneType"),
        (dict(geometry=DcpGeometry(1, 0, 1, 1)), ValueError, "^block_table has no block"),  # the table is too short
        (dict(token_ids=torch.zeros(2, 3)), TypeError, "token_ids"),
        (dict(token_ids=torch.zeros(6, dtype=torch.int32)), ValueError, "token_ids must be 2-D"),
        (dict(block_table=torch.zeros(2, 2, dtype=torch.float32)), TypeError, "block_table"),
        (
            dict(req_of_token=torch.tensor([0, 2], dtype=torch.int32)),
            ValueError,
            r"req_of_token values must be in \[0, 2\)",
        ),
        (dict(req_of_token=torch.tensor([0], dtype=torch.int32)), ValueError, r"req_of_token must have shape \[T\]"),
    ],
)
def test_reference_bad_input(kwargs, exc, match):
    args = dict(
        token_ids=torch.tensor([[0, 2, 6], [4, -1, 8]], dtype=torch.int32),
        req_of_token=torch.tensor([0, 1], dtype=torch.int32),
        block_table=torch.zeros(2, 2, dtype=torch.int32),
        geometry=DcpGeometry(2, 0, 1, 4),
    )
    global_ids_to_local_slots(**args)  # the base call is valid: each row changes one argument
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        global_ids_to_local_slots(**args)


def test_reference_rejects_slot_overflowing_int32():
    bt = torch.tensor([[2**31 // 4]], dtype=torch.int64)
    with pytest.raises(ValueError, match="exceed int32"):
        global_ids_to_local_slots(torch.tensor([[0]]), None, bt, DcpGeometry(1, 0, block_size=4))


def test_reference_req_none_needs_enough_rows():
    with pytest.raises(ValueError, match="req_of_token=None"):
        global_ids_to_local_slots(
            torch.zeros(3, 2, dtype=torch.int32),
            None,
            torch.zeros(2, 2, dtype=torch.int32),
            DcpGeometry(1, 0, block_size=4),
        )


def test_compact_bad_input():
    with pytest.raises(TypeError, match="ordered must be a bool"):
        compact_to_front(torch.zeros(1, 2, dtype=torch.int32), ordered=1)
    with pytest.raises(ValueError, match=r"counts values must be in \[0, 2\]"):
        canonicalize(torch.zeros(1, 2, dtype=torch.int32), torch.tensor([3], dtype=torch.int32))


# ----------------------------------------------------------------------------------------------
# Kernels vs reference (interpreter on CPU; CUDA on a GPU machine)
# ----------------------------------------------------------------------------------------------


def check_kernel_result(out, counts, ids, req, bt, bs, w, r, i, ordered):
    """Exact for ordered; sets + counts + -1 tail for unordered. Inputs on any device."""
    ids_c, bt_c = ids.cpu(), bt.cpu()
    req_c = None if req is None else req.cpu()
    want, want_n = deinterleave_and_compact(
        ids_c, req_c, bt_c, DcpGeometry(w, r, i, bs), ordered=ordered, validate=False
    )
    out, counts = out.cpu(), counts.cpu()
    assert counts.tolist() == want_n.tolist()
    if ordered:
        assert out.tolist() == want.tolist()
    else:
        # The -1 tail must be exactly -1, and the valid head the same set (no drop, no duplicate).
        k = out.shape[1]
        tail = torch.arange(k) >= counts.unsqueeze(1).long()
        assert bool((out[tail] == -1).all())
        assert canonicalize(out, counts).tolist() == want.tolist()


def run_method(method, ids, req, bt, bs, w, r, i, dev, block=None, poison=True, validate=False):
    ids, bt = ids.to(dev), bt.to(dev)
    req = None if req is None else req.to(dev)
    t_rows, k = ids.shape
    out = torch.full((t_rows, k), 12345, dtype=torch.int32, device=dev) if poison else None
    counts = torch.full((t_rows,), 777, dtype=torch.int32, device=dev) if poison else None
    o, c = dk.deinterleave_compact(
        ids,
        req,
        bt,
        DcpGeometry(w, r, i, bs),
        ordered=method != "atomic",
        method=method,
        out=out,
        counts=counts,
        block=block,
        validate=validate,
    )
    if poison:
        assert o.data_ptr() == out.data_ptr() and c.data_ptr() == counts.data_ptr()
    return o, c


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    method=st.sampled_from(dk.METHODS),
    t_rows=st.integers(1, 4),
    k=st.integers(1, 130),
    w=st.integers(1, 4),
    i=st.sampled_from([1, 2, 4]),
    bs_mult=st.integers(1, 2),
    n_blocks=st.integers(1, 6),
    block=st.sampled_from([16, 32, 64, None]),
    use_req=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_kernel_matches_reference_hypothesis(
    kernel_device, method, t_rows, k, w, i, bs_mult, n_blocks, block, use_req, seed, data
):
    r = data.draw(st.integers(0, w - 1))
    bs = i * bs_mult
    gen = torch.Generator().manual_seed(seed)
    ids, req, bt = make_case(gen, t_rows, k, w, i, bs, 4, n_blocks, p_invalid=0.2, beyond=0.3)
    if not use_req:
        req = None
    o, c = run_method(method, ids, req, bt, bs, w, r, i, kernel_device, block=block)
    check_kernel_result(o, c, ids, req, bt, bs, w, r, i, ordered=method != "atomic")
    # Validated: the same answer, or (ids past the table: out of contract) the reference's error.
    if poisoned(brute_slots(ids, req, bt, bs, w, r, i)):
        with pytest.raises(ValueError) as ker:
            run_method(method, ids, req, bt, bs, w, r, i, kernel_device, block=block, validate=True)
        with pytest.raises(ValueError) as ref:
            deinterleave_and_compact(ids, req, bt, DcpGeometry(w, r, i, bs), ordered=method != "atomic")
        assert str(ker.value) == str(ref.value) and str(ref.value).startswith("block_table")
    else:
        o2, c2 = run_method(method, ids, req, bt, bs, w, r, i, kernel_device, block=block, validate=True)
        check_kernel_result(o2, c2, ids, req, bt, bs, w, r, i, ordered=method != "atomic")
        assert torch.equal(c2.cpu(), c.cpu())


@pytest.mark.parametrize("method", dk.METHODS)
def test_kernel_interleave_64_multi_tile(kernel_device, method):
    # The benchmark's I=64 geometry, shrunk: W=2, rank 1, block_size 64, rows span several tiles.
    gen = torch.Generator().manual_seed(1)
    ids, req, bt = make_case(gen, 3, 200, 2, 64, 64, 2, 4)
    o, c = run_method(method, ids, req, bt, 64, 2, 1, 64, kernel_device, block=64)
    check_kernel_result(o, c, ids, req, bt, 64, 2, 1, 64, ordered=method != "atomic")
    assert 0 < int(c.min()) < 200  # really mixed rows, not a trivial all/none case


@pytest.mark.parametrize("method", dk.METHODS)
def test_kernel_rows_without_valid_slots(kernel_device, method):
    # Row 0: all -1. Row 1: all owned by the other rank. Row 2: all beyond the block table (out of
    # contract: every entry poisoned). Row 3: a real mix, so that the empty rows sit next to a non-empty one.
    w, r, i, bs = 2, 0, 1, 4
    bt = torch.tensor([[3, 8], [5, 1]], dtype=torch.int32)
    ids = torch.tensor(
        [[-1] * 40, [1, 3, 5, 7, 9] * 8, [16 + 2 * j for j in range(40)], [0, 2, 1, 4, -1, 6, 17, 3] * 5],
        dtype=torch.int32,
    )
    req = torch.tensor([0, 1, 0, 1], dtype=torch.int32)
    o, c = run_method(method, ids, req, bt, bs, w, r, i, kernel_device, block=16)
    check_kernel_result(o, c, ids, req, bt, bs, w, r, i, ordered=method != "atomic")
    assert c.cpu().tolist()[:3] == [0, 0, 40]
    assert o.cpu()[:2].eq(-1).all() and o.cpu()[2].eq(POISON).all()


@pytest.mark.parametrize("method", dk.METHODS)
def test_kernel_ids_beyond_block_table_and_negative_blocks(kernel_device, method):
    w, r, i, bs = 1, 0, 1, 4
    bt = torch.tensor([[2, -1, 6]], dtype=torch.int32)  # block 1 unallocated; table covers 12 tokens
    ids = torch.tensor([[0, 4, 11, 12, 1000, 2**30, 5, 3]], dtype=torch.int32)
    o, c = run_method(method, ids, None, bt, bs, w, r, i, kernel_device)
    check_kernel_result(o, c, ids, None, bt, bs, w, r, i, ordered=method != "atomic")
    # ids 0, 11, 3 have blocks; 4, 5 (block 1 is -1) and 12, 1000, 2**30 (past the table) are poisoned
    assert sorted(o.cpu()[0, : int(c[0])].tolist()) == sorted([8, 27, 11] + [POISON] * 5)
    with pytest.raises(ValueError, match=r"^block_table has no block .* token_ids\[0, 1\] = 4"):
        run_method(method, ids, None, bt, bs, w, r, i, kernel_device, validate=True)


@pytest.mark.parametrize("method", dk.METHODS)
def test_kernel_strided_inputs_and_output(kernel_device, method):
    # ids: every other column of a wider buffer; block table: a column slice of a wider table
    # (row stride != width); out: a column slice of a wider buffer.
    gen = torch.Generator().manual_seed(7)
    w, r, i, bs = 4, 3, 2, 4
    ids_full, req, bt_full = make_case(gen, 3, 90, w, i, bs, 3, 10)
    ids, bt = ids_full[:, ::2], bt_full[:, 2:7]
    assert not ids.is_contiguous() and not bt.is_contiguous()
    dev = kernel_device
    out_full = torch.full((3, 60), 99, dtype=torch.int32, device=dev)
    out = out_full[:, 5:50]
    o, c = dk.deinterleave_compact(
        ids.to(dev),
        req.to(dev),
        bt.to(dev),
        DcpGeometry(w, r, i, bs),
        ordered=method != "atomic",
        method=method,
        out=out,
        block=16,
        validate=False,
    )
    check_kernel_result(o, c, ids, req, bt, bs, w, r, i, ordered=method != "atomic")
    assert out_full[:, :5].eq(99).all() and out_full[:, 50:].eq(99).all()  # nothing written outside


def test_conversion_kernel_matches_reference(kernel_device):
    gen = torch.Generator().manual_seed(3)
    for w, r, i, bs in [(1, 0, 1, 4), (2, 1, 2, 4), (4, 2, 4, 8)]:
        ids, req, bt = make_case(gen, 3, 70, w, i, bs, 2, 5)
        got = dk.global_ids_to_local_slots_triton(
            ids.to(kernel_device),
            req.to(kernel_device),
            bt.to(kernel_device),
            DcpGeometry(w, r, i, bs),
            block=32,
            validate=False,
        )
        assert got.cpu().tolist() == brute_slots(ids, req, bt, bs, w, r, i)


# ---- the masked layout: conversion + counts, no compaction --------------------------------------
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    t_rows=st.integers(1, 4),
    k=st.integers(1, 130),
    w=st.integers(1, 4),
    i=st.sampled_from([1, 2, 4]),
    bs_mult=st.integers(1, 2),
    n_blocks=st.integers(1, 6),
    block=st.sampled_from([16, 32, None]),
    use_req=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_masked_kernel_matches_brute_force(
    kernel_device, t_rows, k, w, i, bs_mult, n_blocks, block, use_req, seed, data
):
    r = data.draw(st.integers(0, w - 1))
    bs = i * bs_mult
    gen = torch.Generator().manual_seed(seed)
    ids, req, bt = make_case(gen, t_rows, k, w, i, bs, 4, n_blocks, p_invalid=0.2, beyond=0.3)
    bt[torch.rand(bt.shape, generator=gen) < 0.1] = -1  # some unallocated blocks
    if not use_req:
        req = None
    dev = kernel_device
    out = torch.full((t_rows, k), 12345, dtype=torch.int32, device=dev)  # poison: every entry must be written
    counts = torch.full((t_rows,), 777, dtype=torch.int32, device=dev)
    o, c = dk.deinterleave_masked_triton(
        ids.to(dev),
        None if req is None else req.to(dev),
        bt.to(dev),
        DcpGeometry(w, r, i, bs),
        out=out,
        counts=counts,
        block=block,
        validate=False,
    )
    assert o.data_ptr() == out.data_ptr() and c.data_ptr() == counts.data_ptr()
    want = brute_slots(ids, req, bt, bs, w, r, i)
    assert o.cpu().tolist() == want
    assert c.cpu().tolist() == [sum(x >= 0 for x in row) for row in want]


def test_masked_kernel_edges(kernel_device):
    dev = kernel_device
    bt = torch.tensor([[2, -1, 6]], dtype=torch.int32, device=dev)
    # strided ids (every other column) and a strided output (a column slice of a wider buffer)
    ids_full = torch.tensor([[0, 9, 4, 9, 11, 9, 12, 9, -1, 9, 2**30, 9, 3, 9]], dtype=torch.int32, device=dev)
    out_full = torch.full((1, 12), 99, dtype=torch.int32, device=dev)
    o, c = dk.deinterleave_masked_triton(
        ids_full[:, ::2], None, bt, DcpGeometry(1, 0, block_size=4), out=out_full[:, 2:9], block=16, validate=False
    )
    assert o.cpu().tolist() == [[8, POISON, 27, POISON, -1, POISON, 11]] and c.cpu().tolist() == [6]
    assert out_full[:, :2].eq(99).all() and out_full[:, 9:].eq(99).all()  # nothing written outside
    # no rows; rows of width 0 (count 0, written even into a poisoned buffer)
    o, c = dk.deinterleave_masked_triton(
        torch.zeros(0, 5, dtype=torch.int32, device=dev), None, bt, DcpGeometry(1, 0, block_size=4)
    )
    assert o.shape == (0, 5) and c.shape == (0,)
    cnt = torch.full((2,), 5, dtype=torch.int32, device=dev)
    o, c = dk.deinterleave_masked_triton(
        torch.zeros(2, 0, dtype=torch.int32, device=dev),
        None,
        bt.expand(2, 3),
        DcpGeometry(1, 0, block_size=4),
        counts=cnt,
    )
    assert o.shape == (2, 0) and c.cpu().tolist() == [0, 0]
    # validate=False: a bad request id poisons its whole row (no host read), as the reference
    ids = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]], dtype=torch.int32)
    req = torch.tensor([0, 9], dtype=torch.int32)
    bt2 = torch.tensor([[4, 5]], dtype=torch.int32)
    with pytest.raises(ValueError, match="req_of_token values must be in"):
        dk.deinterleave_masked_triton(ids.to(dev), req.to(dev), bt2.to(dev), DcpGeometry(1, 0, block_size=2))
    want = deinterleave_masked(ids, req, bt2, DcpGeometry(1, 0, block_size=2), validate=False)
    got = dk.deinterleave_masked_triton(
        ids.to(dev), req.to(dev), bt2.to(dev), DcpGeometry(1, 0, block_size=2), validate=False
    )
    assert [g.cpu().tolist() for g in got] == [w.tolist() for w in want]
    assert want[0].tolist() == [[8, 9, 10, 11], [POISON] * 4] and want[1].tolist() == [4, 4]
    with pytest.raises(ValueError, match="block must be a power of two"):
        dk.deinterleave_masked_triton(ids.to(dev), None, bt.expand(2, 3), DcpGeometry(1, 0, block_size=4), block=24)


@pytest.mark.parametrize("method", dk.METHODS)
def test_kernel_bad_request_id_poisons_the_row(kernel_device, method):
    # The hot path (validate=False) cannot read values back to raise (no host sync); it must stay in
    # bounds and poison the row (never "no keys here"), as the reference does with validate=False.
    # (Validated, both raise.)
    ids = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]], dtype=torch.int32)
    bt = torch.tensor([[4, 5]], dtype=torch.int32)
    req = torch.tensor([0, 9], dtype=torch.int32)
    with pytest.raises(ValueError, match="req_of_token values must be in"):
        run_method(method, ids, req, bt, 2, 1, 0, 1, kernel_device, validate=True)
    o, c = run_method(method, ids, req, bt, 2, 1, 0, 1, kernel_device, validate=False)
    assert c.cpu().tolist() == [4, 4]
    assert o.cpu()[1].tolist() == [POISON] * 4
    assert sorted(o.cpu()[0].tolist()) == [8, 9, 10, 11]
    assert POISON == POISON_SLOT


def test_atomic_workspace_is_left_zeroed_and_reusable(kernel_device):
    gen = torch.Generator().manual_seed(5)
    ids, req, bt = make_case(gen, 4, 100, 2, 1, 4, 2, 8)
    dev = kernel_device
    ws = torch.zeros(dk.workspace_numel("atomic", 4, 100), dtype=torch.int64, device=dev)
    for rnk in (0, 1, 0):  # reuse: a non-zero leftover would shift every base offset
        o, c = dk.deinterleave_compact(
            ids.to(dev),
            req.to(dev),
            bt.to(dev),
            DcpGeometry(2, rnk, 1, 4),
            ordered=False,
            method="atomic",
            workspace=ws,
            block=16,
            validate=False,
        )
        check_kernel_result(o, c, ids, req, bt, 4, 2, rnk, 1, ordered=False)
        assert ws.cpu().tolist() == [0] * 4


def test_kernel_empty_shapes(kernel_device):
    dev = kernel_device
    bt = torch.zeros(2, 2, dtype=torch.int32, device=dev)
    for method in dk.METHODS:
        for rows, cols in ((0, 5), (2, 0)):  # no token; tokens with no candidate
            ids = torch.zeros(rows, cols, dtype=torch.int32, device=dev)
            geo = DcpGeometry(1, 0, block_size=4)
            o, c = dk.deinterleave_compact(ids, None, bt, geo, ordered=method != "atomic", method=method)
            assert o.shape == (rows, cols) and c.cpu().tolist() == [0] * rows


def test_defaults_are_valid():
    assert dk.DEFAULT_ORDERED_METHOD in ("rowscan", "twopass")
    assert dk.DEFAULT_UNORDERED_METHOD in dk.METHODS


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        # int64 ids / tables / request ids are accepted, as by the reference (issue 10); floats are not.
        (
            dict(token_ids=torch.zeros(2, 3, dtype=torch.float32)),
            TypeError,
            "token_ids must have dtype in \\(int32, int64\\)",
        ),
        (dict(block_table=torch.zeros(2, 2, dtype=torch.float32)), TypeError, "block_table"),
        (dict(req_of_token=torch.zeros(2, dtype=torch.int16)), TypeError, "req_of_token"),
        (dict(req_of_token=torch.zeros(3, dtype=torch.int32)), ValueError, "req_of_token must have shape"),
        (dict(geometry=(2, 0, 1, 4)), TypeError, "^geometry must be a dcp_ref.geometry.DcpGeometry, got tuple"),
        (dict(geometry=2), TypeError, "^geometry must be a dcp_ref.geometry.DcpGeometry, got int"),
        (dict(out=torch.zeros(2, 4, dtype=torch.int32)), ValueError, "out must have shape"),
        (dict(out=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "out"),
        (dict(counts=torch.zeros(3, dtype=torch.int32)), ValueError, "counts must have shape"),
        (dict(method="atomic", ordered=True), ValueError, "use ordered=False"),
        (dict(method="bogus"), ValueError, "method must be one of"),
        (
            dict(method="twopass", block=16, workspace=torch.zeros(1, dtype=torch.int64)),
            ValueError,
            "workspace must have at least 2",
        ),
        (dict(workspace=torch.zeros(4, dtype=torch.int32), method="atomic", ordered=False), TypeError, "workspace"),
        (dict(block=24), ValueError, "block must be a power of two"),
        (dict(ordered="yes"), TypeError, "ordered must be a bool"),
    ],
)
def test_kernel_bad_input(kernel_device, kwargs, exc, match):
    dev = kernel_device
    args = dict(
        token_ids=torch.zeros(2, 3, dtype=torch.int32),
        req_of_token=torch.zeros(2, dtype=torch.int32),
        block_table=torch.zeros(2, 2, dtype=torch.int32),
        geometry=DcpGeometry(2, 0, 1, 4),
    )
    args.update(kwargs)
    args = {n: (v.to(dev) if isinstance(v, torch.Tensor) else v) for n, v in args.items()}
    with pytest.raises(exc, match=match):
        dk.deinterleave_compact(**args)


def test_kernel_rejects_too_wide_rows_for_atomic(kernel_device):
    ids = torch.empty((1, 2**21), dtype=torch.int32, device=kernel_device)
    bt = torch.zeros(1, 1, dtype=torch.int32, device=kernel_device)
    with pytest.raises(ValueError, match="K <= 2097151"):
        dk.deinterleave_compact(ids, None, bt, DcpGeometry(1, 0, block_size=4), ordered=False, method="atomic")


def test_kernel_rejects_mixed_devices(kernel_device):
    if kernel_device.type != "cuda":
        pytest.skip("needs two devices (CPU + CUDA)")
    with pytest.raises(ValueError, match="block_table must be on device"):
        dk.deinterleave_compact(
            torch.zeros(2, 3, dtype=torch.int32, device="cuda"),
            None,
            torch.zeros(2, 2, dtype=torch.int32),
            DcpGeometry(1, 0, block_size=4),
        )


# ----------------------------------------------------------------------------------------------
# GPU only: real races, benchmark-sized shapes, CUDA graphs
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("method", dk.METHODS)
@pytest.mark.parametrize("w, i", [(1, 1), (2, 1), (8, 1), (2, 64), (8, 64)])
def test_gpu_benchmark_shapes(cuda_device, method, w, i):
    gen = torch.Generator().manual_seed(11)
    bs, k, t_rows = 64, 2048, 257
    # Sequences of ~64K tokens: each rank's table covers 64K/W tokens.
    n_blocks = max(1, 65536 // (w * bs))
    ids, req, bt = make_case(gen, t_rows, k, w, i, bs, 8, n_blocks, p_invalid=0.05, beyond=0.05)
    for rnk in sorted({0, w - 1}):
        for block in (None, 64):  # default tiling, and many small tiles racing per row
            o, c = run_method(method, ids, req, bt, bs, w, rnk, i, cuda_device, block=block)
            torch.cuda.synchronize()
            check_kernel_result(o, c, ids, req, bt, bs, w, rnk, i, ordered=method != "atomic")


@pytest.mark.gpu
@pytest.mark.parametrize("method", dk.METHODS)
def test_gpu_cuda_graph_capture_and_replay(cuda_device, method):
    dev = cuda_device
    w, r, i, bs, t_rows, k, n_req, n_blocks = 4, 1, 2, 16, 64, 1000, 4, 64
    ordered = method != "atomic"
    gen = torch.Generator().manual_seed(21)
    ids0, req0, bt0 = make_case(gen, t_rows, k, w, i, bs, n_req, n_blocks)
    s_ids, s_req, s_bt = ids0.to(dev), req0.to(dev), bt0.to(dev)
    out = torch.empty((t_rows, k), dtype=torch.int32, device=dev)
    counts = torch.empty((t_rows,), dtype=torch.int32, device=dev)
    ws = torch.zeros(max(1, dk.workspace_numel(method, t_rows, k, 64)), dtype=torch.int64, device=dev)

    def step():  # the hot path: validate=False (a host value check would sync inside the capture)
        dk.deinterleave_compact(
            s_ids,
            s_req,
            s_bt,
            DcpGeometry(w, r, i, bs),
            ordered=ordered,
            method=method,
            out=out,
            counts=counts,
            workspace=ws,
            block=64,
            validate=False,
        )

    # Warm up (compiles) on a side stream, as torch recommends before capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):  # new inputs each replay; the graph must pick them up
        ids, req, bt = make_case(gen, t_rows, k, w, i, bs, n_req, n_blocks)
        s_ids.copy_(ids), s_req.copy_(req), s_bt.copy_(bt)
        out.fill_(12345), counts.fill_(777)
        graph.replay()
        torch.cuda.synchronize()
        check_kernel_result(out, counts, ids, req, bt, bs, w, r, i, ordered=ordered)
    if method == "atomic":
        assert int(ws.abs().sum()) == 0


@pytest.mark.gpu
def test_gpu_masked_benchmark_shape_and_graph(cuda_device):
    """The masked layout at the step's shape (K = 2048, W = 2, 64K context), eager and replayed."""
    dev = cuda_device
    gen = torch.Generator().manual_seed(5)
    w, i, bs, k, t_rows = 2, 1, 64, 2048, 33
    ids0, req0, bt0 = make_case(gen, t_rows, k, w, i, bs, 8, 65536 // (w * bs), p_invalid=0.05, beyond=0.05)
    for rnk in range(w):
        o, c = dk.deinterleave_masked_triton(
            ids0.to(dev), req0.to(dev), bt0.to(dev), DcpGeometry(w, rnk, i, bs), validate=False
        )
        want = brute_slots(ids0, req0, bt0, bs, w, rnk, i)
        assert o.cpu().tolist() == want and c.cpu().tolist() == [sum(x >= 0 for x in row) for row in want]
    s_ids, s_req, s_bt = ids0.to(dev), req0.to(dev), bt0.to(dev)
    out = torch.empty((t_rows, k), dtype=torch.int32, device=dev)
    counts = torch.empty((t_rows,), dtype=torch.int32, device=dev)

    def step():  # validate=False: no host read inside the capture
        dk.deinterleave_masked_triton(
            s_ids, s_req, s_bt, DcpGeometry(w, 1, i, bs), out=out, counts=counts, validate=False
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(2):
        ids, req, bt = make_case(gen, t_rows, k, w, i, bs, 8, 65536 // (w * bs))
        s_ids.copy_(ids), s_req.copy_(req), s_bt.copy_(bt)
        out.fill_(12345), counts.fill_(777)
        graph.replay()
        torch.cuda.synchronize()
        want = brute_slots(ids, req, bt, bs, w, 1, i)
        assert out.cpu().tolist() == want and counts.cpu().tolist() == [sum(x >= 0 for x in row) for row in want]


# ----------------------------------------------------------------------------------------------
# Notebook helpers (dcp_ref.viz.deinterleave)
# ----------------------------------------------------------------------------------------------


def test_mapping_table_matches_brute_force():
    from dcp_ref.viz.deinterleave import mapping_table

    gen = torch.Generator().manual_seed(9)
    ids, _, bt = make_case(gen, 1, 60, 4, 2, 4, 1, 5)
    bt[0, 1] = -1
    table = mapping_table(ids[0].tolist(), bt[0].tolist(), DcpGeometry(4, 2, 2, 4))
    # The picture (dcp_ref.viz.deinterleave) still draws a poisoned entry (an owned id without a block)
    # as -1: compare it with the stage's rule up to that.
    want = [-1 if v == POISON else v for v in brute_slots(ids, None, bt, 4, 4, 2, 2)[0]]
    assert [e["slot"] for e in table] == want
    for e in table:  # owner / local agree with the ownership stage wherever they are defined
        if e["id"] >= 0:
            assert e["owner"] == owner_rank(e["id"], 4, 2)
            assert (e["local"] is None) == (e["owner"] != 2)


@settings(max_examples=40, deadline=None)
@given(slots=st.lists(st.integers(-1, 50), min_size=0, max_size=40), block=st.integers(1, 9), seed=st.integers(0, 1000))
def test_simulate_tile_race_is_a_valid_compaction(slots, block, seed):
    from dcp_ref.viz.deinterleave import simulate_tile_race

    res = simulate_tile_race(slots, block, seed=seed)
    valid = [s for s in slots if s >= 0]
    assert res["count"] == len(valid)
    assert sorted(res["out"][: res["count"]]) == sorted(valid)  # no drop, no duplicate
    assert res["out"][res["count"] :] == [-1] * (len(slots) - len(valid))
    # In arrival order, each tile's base is the number of valid entries of the tiles before it.
    seen = 0
    for tile in res["arrival"]:
        assert res["bases"][tile] == seen
        seen += sum(1 for s in slots[tile * block : (tile + 1) * block] if s >= 0)


def test_simulate_tile_race_program_order_equals_interpreter_kernel(kernel_device):
    # The interpreter runs programs in order, so the kernel must equal arrival order 0, 1, 2, ...
    from dcp_ref.viz.deinterleave import simulate_tile_race

    if kernel_device.type != "cpu":
        pytest.skip("program order is only guaranteed by the interpreter")
    gen = torch.Generator().manual_seed(4)
    ids, req, bt = make_case(gen, 1, 70, 2, 1, 4, 1, 9)
    slots = global_ids_to_local_slots(ids, req, bt, DcpGeometry(2, 1, 1, 4), validate=False)[0].tolist()
    o, c = dk.deinterleave_compact(
        ids, req, bt, DcpGeometry(2, 1, 1, 4), ordered=False, method="atomic", block=16, validate=False
    )
    sim = simulate_tile_race(slots, 16, arrival=list(range(5)))
    assert o[0].tolist() == sim["out"] and int(c[0]) == sim["count"]


def test_simulate_tile_race_orders_differ_and_bad_arrival():
    from dcp_ref.viz.deinterleave import simulate_tile_race

    slots = [5, -1, 7, 1, -1, 3, 9, -1, 2]
    a = simulate_tile_race(slots, 3, arrival=[0, 1, 2])["out"]
    b = simulate_tile_race(slots, 3, arrival=[2, 0, 1])["out"]
    assert a == [5, 7, 1, 3, 9, 2, -1, -1, -1] and b == [9, 2, 5, 7, 1, 3, -1, -1, -1]
    with pytest.raises(ValueError, match="arrival must be a permutation"):
        simulate_tile_race(slots, 3, arrival=[0, 0, 1])


def test_drawing_functions_return_small_figures():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dcp_ref.viz.deinterleave import draw_id_to_slot_map, draw_tile_race

    fig = draw_id_to_slot_map([13, 2, 6, -1, 26], [7, 3, 9], DcpGeometry(2, 1, 2, 4))
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert {"13", "2", "28", "30", "×"} <= texts and fig.dpi <= 80  # slots 28, 30 drawn; 26 crossed out
    plt.close(fig)
    fig = draw_tile_race([5, -1, 7, 1, -1, 3], 3, [[0, 1], [1, 0]])
    labels = {t.get_text() for t in fig.axes[0].texts}
    assert {"input", "arrival [0, 1]", "arrival [1, 0]"} <= labels and fig.dpi <= 80
    plt.close(fig)


def test_kernel_rejects_cpu_tensors_without_interpreter(monkeypatch):
    # Without TRITON_INTERPRET a CPU tensor cannot reach a GPU kernel: a clear error, not a crash.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="token_ids must be on a CUDA device"):
        dk.deinterleave_compact(
            torch.zeros(2, 3, dtype=torch.int32),
            None,
            torch.zeros(2, 2, dtype=torch.int32),
            DcpGeometry(1, 0, block_size=4),
        )
