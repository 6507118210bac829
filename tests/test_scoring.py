"""The scoring stage: FP8 index-key cache, quantizers, the float64 oracle and the Triton kernel.

Independent references written here: the cache bytes are decoded by hand (e4m3 bit fields, float32
scales with ``struct``), and the scores are summed in plain Python floats (float64) key by key.
The quantizer's rounding is checked against the nearest of all 254 finite e4m3 codes (ties to the
even code), decoded by hand too. Owner-only writes are checked against the read side
(``global_ids_to_local_slots``). The kernels run under the Triton interpreter on small shapes and
are compared with the oracle: exactly on "dyadic" inputs (small integers in FP8, weights in eighths,
power-of-two scales: every float32 sum is exact, so ties are real ties), within float32 rounding
on random ones. ``-m gpu``: the compiled kernels against the oracle, and the scoring kernel followed by the
indexer's top-K + pack (``indexer_topk_pack``, compared with ``pack_candidates(local_topk(scores))`` as per-row
sets of (score, id) bit patterns) captured in a CUDA graph and replayed with new inputs, with no host sync.
"""

from __future__ import annotations

import itertools
import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from opcount import HOST_READS, OpCount

from dcp_ref.cache_write import write_tokens
from dcp_ref.deinterleave import global_ids_to_local_slots
from dcp_ref.geometry import DcpGeometry
from dcp_ref.index_cache import (
    INDEX_K_FP8,
    UNWRITTEN_INDEX_BYTE,
    as_deepgemm_kv_cache,
    build_sharded_index_caches,
    dequantize_index_keys,
    index_cache_blocks,
    index_cache_slots,
    make_index_cache,
    quantize_index_keys,
    quantize_index_queries,
    read_index_keys,
    write_index_keys,
    write_index_tokens,
)
from dcp_ref.indexer import local_topk
from dcp_ref.ownership import owner_rank
from dcp_ref.pipeline import make_dcp_problem
from dcp_ref.scoring import index_scores, reference_scoring
from dcp_ref.topk import pack_candidates

NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------------------------------------
# Independent decoding (bit fields by hand) and brute force
# ---------------------------------------------------------------------------------------------
from fp8_bits import E4M3  # noqa: E402  (tests/ is on sys.path: the independent decoder)
from scoring_problems import paged_index_keys, width  # noqa: E402


def f32(b: bytes) -> float:
    return struct.unpack("<f", b)[0]


def relu(x: float) -> float:
    return x if (x != x or x >= 0) else 0.0  # NaN stays NaN


def brute_key(cache: bytes, slot: int, bs: int) -> tuple[list[float], float]:
    """The 128 values and the scale of one slot, decoded from the raw block bytes by hand."""
    b, o = divmod(slot, bs)
    base = b * bs * 132
    vals = [E4M3[cache[base + o * 128 + d]] for d in range(128)]
    return vals, f32(cache[base + bs * 128 + 4 * o : base + bs * 128 + 4 * o + 4])


def brute_scores(q, w, cache, bt, req, bounds, bs, L, starts=None) -> list[list[float]]:
    """Plain-Python float64 scores ``[T][L]``: -inf off the keys, in-contract inputs only."""
    raw = bytes(cache.contiguous().view(torch.uint8).reshape(-1).tolist())
    qf = q.to(torch.float64).tolist()
    wf = w.to(torch.float64).tolist()
    out = []
    for t in range(len(qf)):
        row = [-INF] * L
        s0 = 0 if starts is None else int(starts[t])
        r = int(req[t])
        for j in range(int(bounds[t])):
            blk = int(bt[r][j // bs])
            vals, scale = brute_key(raw, blk * bs + j % bs, bs)
            acc = 0.0
            for h in range(len(qf[t])):
                acc += wf[t][h] * relu(sum(a * b for a, b in zip(qf[t][h], vals)))
            row[s0 + j] = acc * scale
        out.append(row)
    return out


def assert_close_scores(got: torch.Tensor, want, rel: float = 1e-6) -> None:
    """Same NaN and -inf positions; finite scores within ``rel`` of ``|want| + the row's largest |want|``
    (a float32 sum over heads may cancel: its error follows the terms, not the result)."""
    want = torch.tensor(want, dtype=torch.float64) if not isinstance(want, torch.Tensor) else want.double().cpu()
    got = got.double().cpu()
    assert got.shape == want.shape
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN positions differ"
    assert torch.equal(torch.isinf(got) & (got < 0), torch.isinf(want) & (want < 0)), "-inf positions differ"
    fin = torch.isfinite(want)
    row_max = torch.where(fin, want.abs(), 0.0).amax(dim=1, keepdim=True).expand_as(want)
    err = (got - want)[fin].abs()
    assert bool((err <= rel * (want[fin].abs() + row_max[fin])).all()), f"max err {float(err.max())}"


# ---------------------------------------------------------------------------------------------
# Problem builder: requests' keys written into a paged cache, tokens with bounds
# ---------------------------------------------------------------------------------------------
def make_problem(seed, *, T=5, B=3, bs=8, H=64, lens=(24, 40, 9), M=None, NB=None, exact=False, starts=False,
                 unwritten=False, q_dtype=torch.float8_e4m3fn):  # fmt: skip
    """Keys of B requests (``lens`` local keys each) in shuffled blocks; T tokens with random bounds.

    ``exact``: integer keys with amax 4 (scale 2**-6 exactly) drawn from a pool of 6 (ties), FP8
    queries in [-3, 3], weights in eighths — every float32 score is exact. ``unwritten``: bounds may
    reach past a request's written keys into its last allocated block (NaN bytes).
    """
    g = torch.Generator().manual_seed(seed)
    cache, bt, nblk = paged_index_keys(g, lens, B=B, bs=bs, M=M, NB=NB, exact=exact)
    req = torch.randint(0, B, (T,), generator=g)
    cap = torch.tensor([nblk[int(r)] * bs if unwritten else lens[int(r)] for r in req])
    bounds = (torch.rand(T, generator=g) * (cap + 1)).long().clamp(max=cap)
    bounds[0] = cap[0]  # at least one full row
    if exact:
        q = torch.randint(-3, 4, (T, H, 128), generator=g).float().to(q_dtype)
        w = torch.randint(-8, 9, (T, H), generator=g).float() / 8
    else:
        q = (torch.randn(T, H, 128, generator=g) * 2).to(q_dtype)
        w = torch.randn(T, H, generator=g)
    rs = torch.randint(0, 7, (T,), generator=g) if starts else None
    return q, w, cache, bt, req, bounds, rs


# ---------------------------------------------------------------------------------------------
# Layout and quantizers
# ---------------------------------------------------------------------------------------------
def test_layout_bytes_follow_deepgemm() -> None:
    """132 bytes per token; in a block all values first (token o at o*128), then all scales (at bs*128 + 4o)."""
    L = INDEX_K_FP8
    assert (L.head_dim, L.bytes_per_token, L.block_bytes(64)) == (128, 132, 8448)
    for bs in (1, 4, 64):
        segs = L.segments(bs)
        assert segs[0][0] == 0 and segs[-1][1] == bs * 132
        assert all(a[1] == b[0] for a, b in itertools.pairwise(segs)), "no gap, no overlap"
        for o in range(bs):
            assert L.value_offset(bs, o) == o * 128 and L.scale_offset(bs, o) == bs * 128 + 4 * o
    # DeepGEMM's test builds the cache exactly so (kv_cache_cast_to_fp8): values, then scales, per block
    keys = torch.randn(2 * 4, 128)
    vals, scales = quantize_index_keys(keys)
    cache = make_index_cache(2, 4)
    write_index_keys(cache, torch.arange(8), keys, 4)
    dg = torch.empty(2, 4 * 132, dtype=torch.uint8)
    dg[:, : 4 * 128] = vals.view(2, 4 * 128)
    dg[:, 4 * 128 :] = scales.view(2, 4).view(torch.uint8)
    assert torch.equal(cache, dg)
    view = as_deepgemm_kv_cache(cache, 4)
    assert view.shape == (2, 4, 1, 132) and view.data_ptr() == cache.data_ptr()
    for shaped in (cache, cache.view(2, 4, 132), view):
        assert index_cache_blocks(shaped, 4).data_ptr() == cache.data_ptr()
        assert index_cache_slots(shaped, 4) == 8


def brute_e4m3_round(y: torch.Tensor) -> torch.Tensor:
    """Nearest finite e4m3 code of each value (ties to the even code), by search over all codes."""
    codes = torch.tensor([b for b in range(256) if not math.isnan(E4M3[b])], dtype=torch.int64)
    table = torch.tensor([E4M3[b] for b in codes.tolist()], dtype=torch.float64)
    d = (y.double().reshape(-1, 1) - table).abs()
    best = d.min(dim=1, keepdim=True).values
    tie = d == best
    # among tied codes prefer an even mantissa, then y's sign (a zero or a tiny value keeps its sign)
    same_sign = (codes >= 128) == torch.signbit(y.reshape(-1, 1))
    pref = tie.double() * 4 + (tie & (codes % 2 == 0)).double() * 2 + (tie & same_sign).double()
    return codes[pref.argmax(dim=1)].reshape(y.shape).to(torch.uint8)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), mag=st.sampled_from([0.0, 1e-9, 1e-5, 1e-2, 1.0, 7.3, 1e4, 3e30]))
def test_quantizer_is_vllms_rule_and_rounds_to_nearest(seed, mag) -> None:
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(6, 128, generator=g, dtype=torch.float64) * mag
    keys[1] = 0.0
    values, scales = quantize_index_keys(keys)
    x = keys.to(torch.float32)
    for i in range(6):
        amax = float(x[i].abs().max())
        # vLLM: fmaxf(amax, 1e-4) / 448.0f in float32, then exp2f(ceilf(log2f(.))) -- exact here
        raw = struct.unpack("<f", struct.pack("<f", max(amax, struct.unpack("<f", struct.pack("<f", 1e-4))[0])))[0]
        raw = struct.unpack("<f", struct.pack("<f", raw / 448.0))[0]
        want = 2.0 ** math.ceil(math.log2(raw))
        assert float(scales[i]) == want
    y = (x.double() / scales.double().unsqueeze(1)).float()  # exact: power-of-two scales
    assert bool((y.abs() <= 448).all())
    assert torch.equal(values, brute_e4m3_round(y))
    assert bool((values[1] == 0).all())  # a zero key stores zeros (and the floor scale)
    deq = dequantize_index_keys(values, scales)
    assert bool(((deq - x.double()).abs() <= x.double().abs() * 2**-4 + scales.double().unsqueeze(1) * 2**-10).all())


def test_quantizer_nonfinite_keys() -> None:
    keys = torch.randn(3, 128)
    keys[1, 5] = NAN
    keys[2, 0] = INF
    with pytest.raises(ValueError, match=r"^keys must be finite"):
        quantize_index_keys(keys)
    values, scales = quantize_index_keys(keys, validate=False)
    assert math.isfinite(float(scales[0])) and math.isnan(float(scales[1])) and math.isnan(float(scales[2]))
    assert bool(torch.isnan(dequantize_index_keys(values, scales)[1:]).all())
    big = torch.full((1, 128), 1e39, dtype=torch.float64)  # finite in float64, inf as float32
    with pytest.raises(ValueError, match=r"^keys"):
        quantize_index_keys(big)


def test_query_quantization_folds_its_scale_into_the_weights() -> None:
    """``sum_h w' relu(q_fp8 . k)`` equals ``sum_h w * D**-0.5 * H**-0.5 * relu(deq(q) . k)``: the
    power-of-two query scale moves into the weights exactly."""
    g = torch.Generator().manual_seed(3)
    T, H = 3, 8
    q = torch.randn(T, H, 128, generator=g) * torch.tensor([0.01, 1.0, 300.0]).view(3, 1, 1)
    w = torch.randn(T, H, generator=g)
    q8, w2 = quantize_index_queries(q, w)
    assert q8.dtype == torch.float8_e4m3fn and w2.dtype == torch.float32
    amax = q.abs().amax(dim=2).double()
    qs = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-10) / 448)))  # vLLM's ue8m0 group scale
    assert torch.allclose(w2.double(), w.double() * qs * 128**-0.5 * H**-0.5, rtol=1e-6, atol=0)
    deq = q8.double() * qs.unsqueeze(2)
    assert bool(((deq - q.double()).abs() <= q.double().abs() * 2**-4 + qs.unsqueeze(2) * 2**-10).all())
    k = torch.randn(5, 128, generator=g, dtype=torch.float64)
    lhs = (w2.double().unsqueeze(2) * (q8.double() @ k.T).clamp_min(0)).sum(1)
    rhs = ((w.double() * 128**-0.5 * H**-0.5).unsqueeze(2) * (deq @ k.T).clamp_min(0)).sum(1)
    assert torch.allclose(lhs, rhs, rtol=1e-5)
    with pytest.raises(ValueError, match=r"^q must be finite"):
        quantize_index_queries(q.masked_fill(q > 1, NAN), w)


@pytest.mark.parametrize("bad", [math.inf, -math.inf, NAN])
def test_query_quantization_of_a_non_finite_row_is_nan_as_for_keys(bad) -> None:
    """``validate=False``: a query row holding ±inf or NaN gets scale NaN — its FP8 values and its folded weight
    are NaN (a score from it is NaN, never plausible), as a non-finite key gets a NaN scale; the other rows of
    that token and of other tokens are quantized as if it were not there. ``validate=True`` refuses it."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 4, 128, generator=g)
    w = torch.randn(3, 4, generator=g)
    q_bad = q.clone()
    q_bad[1, 2, 17] = bad
    q8, w2 = quantize_index_queries(q_bad, w, validate=False)
    good8, good_w = quantize_index_queries(q, w)
    assert bool(torch.isnan(q8[1, 2].float()).all()) and bool(torch.isnan(w2[1, 2]))
    keep = torch.ones(3, 4, dtype=torch.bool)
    keep[1, 2] = False
    assert torch.equal(q8[keep].view(torch.uint8), good8[keep].view(torch.uint8)) and torch.equal(
        w2[keep], good_w[keep]
    )
    k = torch.randn(128, 128, generator=g)
    _, k_scale = quantize_index_keys(k.masked_fill(k > 2.5, bad), validate=False)
    assert bool(torch.isnan(k_scale[(k > 2.5).any(1)]).all())  # the key quantizer's rule, the same
    with pytest.raises(ValueError, match=r"^q must be finite"):
        quantize_index_queries(q_bad, w)


# ---------------------------------------------------------------------------------------------
# The cache and the owner-only writes
# ---------------------------------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(W=st.integers(1, 4), I=st.sampled_from([1, 2, 3]), mult=st.integers(1, 3),
       lens=st.lists(st.integers(1, 23), min_size=1, max_size=3), prefill=st.sampled_from([0, 1, 6]),
       seed=st.integers(0, 10**6))  # fmt: skip
def test_owner_only_writes_land_where_the_read_side_looks(W, I, mult, lens, prefill, seed) -> None:
    bs = I * mult
    p = make_dcp_problem(W, I, seq_lens=lens, head_dim=4, block_size=bs, seed=seed)
    g = DcpGeometry(W, 0, I, bs)
    tables = [s.block_table for s in p.shards]
    nblocks = [max(1, -(-s.kv_cache.shape[0] // bs)) for s in p.shards]
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(n, 128, generator=gen) for n in lens]
    caches = build_sharded_index_caches(keys, tables, g, nblocks, prefill=prefill)
    written = [torch.zeros(nb * bs, dtype=torch.bool) for nb in nblocks]
    for b, n in enumerate(lens):
        want_v, want_s = quantize_index_keys(keys[b])
        for pos in range(n):
            owner = int(owner_rank(pos, W, I))
            for r in range(W):
                slot = global_ids_to_local_slots(
                    torch.tensor([[pos]]), torch.tensor([b]), tables[r], DcpGeometry(W, r, I, bs)).item()  # fmt: skip
                if r != owner:
                    assert slot == -1
                    continue
                assert slot >= 0
                v, s = read_index_keys(caches[r], torch.tensor([slot]), bs)
                assert torch.equal(v[0], want_v[pos]) and float(s[0]) == float(want_s[pos])
                written[r][slot] = True
    for r in range(W):  # every other slot of every rank is untouched (each token written on one rank only)
        blocks = caches[r].view(nblocks[r], bs * 132)
        vals = blocks[:, : bs * 128].reshape(-1, 128)
        sc = blocks[:, bs * 128 :].reshape(-1, 4)
        assert bool((vals[~written[r]] == UNWRITTEN_INDEX_BYTE).all()) and bool((sc[~written[r]] == 0xFF).all())


def test_index_keys_share_the_kv_rows_slots() -> None:
    """write_index_tokens and the KV cache write put a token in the same slot of the same rank."""
    p = make_dcp_problem(3, 2, seq_lens=(17, 9), head_dim=4, block_size=4, seed=5)
    req = torch.tensor([0] * 17 + [1] * 9)
    pos = torch.cat([torch.arange(17), torch.arange(9)])
    for r, shard in enumerate(p.shards):
        g = DcpGeometry(3, r, 2, 4)
        kv = torch.full_like(shard.kv_cache, NAN)
        kv_slots = write_tokens(kv, g, shard.block_table, req, pos, torch.randn(26, 4, dtype=torch.float64))
        cache = make_index_cache(-(-kv.shape[0] // 4), 4)
        ix_slots = write_index_tokens(cache, g, shard.block_table, req, pos, torch.randn(26, 128))
        assert torch.equal(kv_slots, ix_slots)


# ---------------------------------------------------------------------------------------------
# The oracle against the brute force
# ---------------------------------------------------------------------------------------------
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10**6), bs=st.sampled_from([1, 3, 4, 8]), starts=st.booleans(), unwritten=st.booleans(),
       T=st.integers(1, 4))  # fmt: skip
def test_reference_equals_brute_force(seed, bs, starts, unwritten, T) -> None:
    q, w, cache, bt, req, bounds, rs = make_problem(seed, T=T, bs=bs, H=3, lens=(11, 5, 16), starts=starts,
                                                    unwritten=unwritten, q_dtype=torch.float32)  # fmt: skip
    g = DcpGeometry(2, 1, 1, bs)  # the geometry's rank and W do not enter the scores
    L = width(bounds, rs) + 2
    got = index_scores(q, w, cache, bt, req, bounds, g, row_starts=rs, out=torch.empty(T, L))
    assert_close_scores(got, brute_scores(q, w, cache, bt, req, bounds, bs, L, rs))  # unwritten slots: NaN in both


def test_reference_fp8_queries_and_width_rules() -> None:
    q, w, cache, bt, req, bounds, _ = make_problem(1, T=4, H=2)
    g = DcpGeometry(1, 0, 1, 8)
    got = index_scores(q, w, cache, bt, req, bounds, g)
    assert got.shape == (4, int(bounds.max()))  # validated: L = max bound
    assert_close_scores(got, brute_scores(q, w, cache, bt, req, bounds, 8, got.shape[1]))
    unval = index_scores(q, w, cache, bt, req, bounds, g, validate=False)
    assert unval.shape == (4, bt.shape[1] * 8)  # unvalidated: L from the shapes alone
    assert torch.equal(unval[:, : got.shape[1]].nan_to_num(), got.nan_to_num())
    assert bool((unval[:, got.shape[1] :] == -INF).all())
    out = torch.full((4, 50), 7.0)
    assert reference_scoring(q, w, cache, bt, req, bounds, g, out=out) is out
    assert torch.equal(out[:, : got.shape[1]].nan_to_num(), got.nan_to_num())
    e = index_scores(q[:0], w[:0], cache, bt, req[:0], bounds[:0], g)
    assert e.shape == (0, 0)


def test_validate_false_poisons_out_of_contract_rows() -> None:
    """Each bad row is all NaN; the good rows are the validated answer."""
    q, w, cache, bt, req, bounds, rs = make_problem(2, T=8, bs=4, H=2, lens=(10, 7, 13), M=5, starts=True)
    g = DcpGeometry(1, 0, 1, 4)
    L = 30
    good = index_scores(q, w, cache, bt, req, bounds, g, row_starts=rs, out=torch.empty(8, L))
    bt2 = bt.clone()
    bt2[1, 0] = -1  # request 1's first block missing
    bt2[2, 1] = 10**6  # not a block of the cache
    req2, b2, s2 = req.clone(), bounds.clone(), rs.clone()
    req2[0], b2[1], s2[2], b2[3] = 5, -2, -1, 5 * 4 + 1  # bad request, negative bound / start, past the table
    s2[4], b2[4] = L - 1, 2  # past the output's width
    got = index_scores(q, w, cache, bt2, req2, b2, g, row_starts=s2, out=torch.empty(8, L), validate=False)
    bad_row = torch.zeros(8, dtype=torch.bool)
    bad_row[:5] = True
    bad_row |= ((req2 == 1) & (b2 > 0)) | ((req2 == 2) & (b2 > 4))
    assert bool(torch.isnan(got[bad_row]).all())
    assert torch.equal(got[~bad_row].nan_to_num(), good[~bad_row].nan_to_num())


def test_nan_data_propagates_to_exactly_its_scores() -> None:
    q, w, cache, bt, req, bounds, _ = make_problem(4, T=3, H=4, q_dtype=torch.float32)
    g = DcpGeometry(1, 0, 1, 8)
    base = index_scores(q, w, cache, bt, req, bounds, g)
    q2, w2 = q.clone(), w.clone()
    q2[0, 2, 7] = NAN
    w2[1, 3] = NAN
    got = index_scores(q2, w2, cache, bt, req, bounds, g)
    for t in (0, 1):
        keys = torch.arange(got.shape[1]) < bounds[t]
        assert bool(torch.isnan(got[t, keys]).all()) and bool((got[t, ~keys] == -INF).all())
    assert torch.equal(got[2], base[2])


# ---------------------------------------------------------------------------------------------
# The Triton kernel (interpreter) against the oracle
# ---------------------------------------------------------------------------------------------
st_kernel = pytest.importorskip("dcp_ref.kernels.scoring_triton")


def _dev(kernel_device, *ts):
    return [None if t is None else t.to(kernel_device) for t in ts]


#: the tuning arguments of scoring_plan (index_scores_triton takes them only through its plan)
KNOBS = ("block_n", "tiles", "num_warps", "num_stages", "tma", "pair_dot")


def scores_triton(*args, **kw):  # noqa: ANN002, ANN003, ANN201
    """``st_kernel.index_scores_triton(*args, **kw)`` with any tuning arguments in ``kw`` made into this call's
    plan, ``scoring_plan(T, L, index_q.device, next_n=, block_size=<the geometry's>, **tuning)`` for the width
    ``L`` the call will have: ``out``'s columns; without ``out`` the values' ``max(row_starts + local_bounds)``
    (validated) or the table's ``M * block_size`` (not). No tuning: the default plan (``plan=None``)."""
    knobs = {name: kw.pop(name) for name in KNOBS if name in kw}
    if knobs:
        q, bt, bounds, g = args[0], args[3], args[5], args[6]
        out, rs = kw.get("out"), kw.get("row_starts")
        if out is not None:
            n_cols = out.shape[1]
        elif not kw.get("validate", True):
            n_cols = bt.shape[1] * g.block_size
        else:  # (bad values raise the reference's message before the plan's width is checked)
            ends = bounds.long() + (0 if rs is None else rs.long())
            n_cols = max(0, int(ends.max())) if ends.numel() else 0
        kw["plan"] = st_kernel.scoring_plan(q.shape[0], n_cols, q.device, next_n=kw.get("next_n", 1),
                                            block_size=g.block_size, **knobs)  # fmt: skip
    return st_kernel.index_scores_triton(*args, **kw)


@pytest.mark.parametrize(
    "bs,block_n,tiles,starts,H,q_dtype",
    [
        (8, 16, 1, False, 64, torch.float8_e4m3fn),  # keys of one tile span two blocks
        (4, 32, 2, True, 64, torch.float8_e4m3fn),  # prefill columns, two tiles per program
        (16, 16, 3, False, 5, torch.float8_e4m3fn),  # heads padded to 16
        (1, 16, 1, True, 3, torch.bfloat16),  # block size 1, teaching dtype
        (8, 32, 1, False, 17, torch.float32),
    ],
)
def test_kernel_matches_reference(kernel_device, bs, block_n, tiles, starts, H, q_dtype) -> None:
    q, w, cache, bt, req, bounds, rs = make_problem(10 + bs, T=4, bs=bs, H=H, starts=starts, q_dtype=q_dtype)
    g = DcpGeometry(1, 0, 1, bs)
    L = width(bounds, rs) + 5
    want = index_scores(q, w, cache, bt, req, bounds, g, row_starts=rs, out=torch.empty(4, L))
    args = _dev(kernel_device, q, w, cache, bt, req, bounds)
    out = torch.full((4, L), 12345.0, device=kernel_device)  # poisoned: every entry must be written
    got = scores_triton(*args, g, row_starts=_dev(kernel_device, rs)[0], out=out,
                        block_n=block_n, tiles=tiles)  # fmt: skip
    assert got is out
    assert_close_scores(got, want, rel=1e-5)


@pytest.mark.parametrize("W,I,bs", [(1, 1, 8), (2, 1, 4), (4, 2, 8)])
def test_kernel_exact_on_dyadic_inputs_with_ties(kernel_device, W, I, bs) -> None:
    """Integer keys and queries, eighths for weights: every score is exact, so kernel == oracle bit for bit."""
    q, w, cache, bt, req, bounds, rs = make_problem(20 + W, T=5, bs=bs, exact=True, starts=W > 1, unwritten=True)
    g = DcpGeometry(W, W - 1, I, bs)
    L = width(bounds, rs) + 3
    want = index_scores(q, w, cache, bt, req, bounds, g, row_starts=rs, out=torch.empty(5, L))
    got = scores_triton(*_dev(kernel_device, q, w, cache, bt, req, bounds), g,
                        row_starts=_dev(kernel_device, rs)[0],
                        out=torch.empty(5, L, device=kernel_device), block_n=16)  # fmt: skip
    assert torch.equal(got.cpu().nan_to_num(nan=7.0), want.nan_to_num(nan=7.0))
    fin = want[torch.isfinite(want)]
    assert fin.numel() > fin.unique().numel()  # real ties


def test_kernel_poisons_like_the_reference(kernel_device) -> None:
    q, w, cache, bt, req, bounds, rs = make_problem(3, T=6, bs=4, H=4, lens=(10, 7, 13), M=5, starts=True)
    bt[1, 0] = -1
    bt[2, 2] = 99
    req[0], bounds[1], rs[2] = -1, -3, -1
    bounds[3] = 30
    g = DcpGeometry(1, 0, 1, 4)
    L = 24
    want = index_scores(q, w, cache, bt, req, bounds, g, row_starts=rs, out=torch.empty(6, L), validate=False)
    got = scores_triton(*_dev(kernel_device, q, w, cache, bt, req, bounds), g,
                        row_starts=_dev(kernel_device, rs)[0],
                        out=torch.empty(6, L, device=kernel_device), validate=False,
                        block_n=16)  # fmt: skip
    assert bool(torch.isnan(want).all(1).any())
    assert_close_scores(got, want, rel=1e-5)
    # unvalidated decode without out: the width comes from the table
    got2 = scores_triton(*_dev(kernel_device, q, w, cache, bt, req, bounds), g, validate=False,
                         block_n=16)  # fmt: skip
    assert got2.shape == (6, bt.shape[1] * 4)


def mtp_problem(seed, *, B=3, next_n=2, bs=8, lens=(24, 40, 9), exact=False):
    """``B`` requests with ``next_n`` query tokens each, as the ownership stage lays them out: consecutive tokens
    of one request, causal bounds ``len - next_n + 1 + i``."""
    q, w, cache, bt, _, _, _ = make_problem(seed, T=B * next_n, B=B, bs=bs, lens=lens, exact=exact)
    req = torch.arange(B).repeat_interleave(next_n)
    bounds = torch.tensor([max(0, lens[b] - next_n + 1 + i) for b in range(B) for i in range(next_n)])
    return q, w, cache, bt, req, bounds


_INTERP39 = pytest.mark.xfail(
    strict=False,
    reason="flaky under Triton 3.9's CPU interpreter (the failing cases change run to run; 45776dd too, "
    "found 2026-12-03); the same cases pass on the H200 (tests/test_scoring.py -m gpu)",
)
_MTP_CASES = [(2, 8, 16, False), (2, 16, 16, False), (3, 16, 16, False), (4, 4, 32, False), (2, 64, 64, False),
              (2, 64, 64, True), (3, 32, 32, True)]  # fmt: skip


@pytest.mark.parametrize("next_n,bs,block_n,tma", [pytest.param(*c, marks=_INTERP39) for c in _MTP_CASES])
def test_kernel_mtp_groups_score_like_single_tokens(kernel_device, next_n, bs, block_n, tma) -> None:
    """MTP: the tokens of a request scored from one read of each key give each token's own scores — equal to
    the brute-force sums, and bit for bit to the same kernel scoring the tokens one by one."""
    lens = (70, 130, 9) if bs >= 32 else (24, 40, 9)
    q, w, cache, bt, req, bounds = mtp_problem(7 + next_n, next_n=next_n, bs=bs, lens=lens)
    g = DcpGeometry(1, 0, 1, bs)
    T, L = q.shape[0], int(bounds.max()) + 3
    want = brute_scores(q, w, cache, bt, req, bounds, bs, L)
    args = _dev(kernel_device, q, w, cache, bt, req, bounds)
    got = scores_triton(*args, g, out=torch.full((T, L), 7.0, device=kernel_device), next_n=next_n,
                        block_n=block_n, tiles=2, tma=tma)  # fmt: skip
    single = scores_triton(*args, g, out=torch.empty(T, L, device=kernel_device), block_n=block_n,
                           tiles=2, tma=tma)  # fmt: skip
    assert_close_scores(got, want, rel=1e-5 if got.device.type == "cpu" else 2e-3)  # (FP8 tensor-core sums)
    assert torch.equal(got.cpu(), single.cpu())
    plan = st_kernel.scoring_plan(T, L, got.device, next_n=next_n, block_size=bs, block_n=block_n, tiles=2)
    assert plan.group == (2 if next_n % 2 == 0 else 1)


@pytest.mark.parametrize("next_n,bad_block,pair_dot", [
    (1, 3, None), (1, 40, None), (2, 3, True), (2, 40, True), (2, 40, False), (2, "last", True), (2, "last", False),
    (2, None, True),
])  # fmt: skip
def test_kernel_verdict_past_the_first_entries(kernel_device, monkeypatch, next_n, bad_block, pair_dot) -> None:
    """Decode reads a row's first ``SCAN`` table entries before its key loop and the rest after it: a bad entry
    in either part poisons the tokens that need it — with MTP, "last" is a block only the pair's longer token
    needs, so only that token is poisoned — and the pair scored by one dot or by two gives the reference's scores
    (``SCAN`` made 32 here, so that rows of 45 blocks have entries past the first part)."""
    monkeypatch.setattr(st_kernel, "SCAN", 32)
    bs, lens = 4, (177, 60)  # request 0: token bounds 176 and 177 -> 44 and 45 blocks
    q, w, cache, bt, req, bounds = mtp_problem(11, B=2, next_n=next_n, bs=bs, lens=lens)
    if bad_block is not None:
        bt[0, 44 if bad_block == "last" else bad_block] = -1
    g = DcpGeometry(1, 0, 1, bs)
    T, L = q.shape[0], bt.shape[1] * bs
    want = index_scores(q, w, cache, bt, req, bounds, g, out=torch.empty(T, L), validate=False, next_n=next_n)
    poisoned = [bool(torch.isnan(want[t]).all()) for t in range(T)]
    if bad_block is None:
        assert not any(poisoned)
    elif bad_block == "last":
        assert poisoned == [False, True, False, False]  # only token 1 needs block 44
    else:
        assert poisoned == [r == 0 for r in req.tolist()]
    tuning = dict(block_n=16, tiles=3) | ({} if pair_dot is None else dict(pair_dot=pair_dot))
    args = _dev(kernel_device, q, w, cache, bt, req, bounds)
    got = scores_triton(*args, g, out=torch.full((T, L), 7.0, device=kernel_device),
                        validate=False, next_n=next_n, **tuning)  # fmt: skip
    assert_close_scores(got, want, rel=1e-5 if got.device.type == "cpu" else 2e-3)
    plan = st_kernel.scoring_plan(T, L, got.device, next_n=next_n, block_size=bs, **tuning)
    assert plan.pair_dot == (next_n == 2 and pair_dot is not False)
    if bad_block is not None:
        with pytest.raises(ValueError) as kernel_err:
            scores_triton(*args, g, out=torch.empty(T, L, device=kernel_device), next_n=next_n,
                          **tuning)  # fmt: skip
        with pytest.raises(ValueError) as ref_err:
            index_scores(q, w, cache, bt, req, bounds, g, out=torch.empty(T, L), next_n=next_n)
        assert str(kernel_err.value) == str(ref_err.value)


def test_kernel_mtp_group_of_two_requests_is_poisoned_or_refused(kernel_device) -> None:
    q, w, cache, bt, req, bounds = mtp_problem(5, next_n=2)
    req[3] = 0  # tokens 2 and 3 (group 1) name requests 1 and 0
    g = DcpGeometry(1, 0, 1, 8)
    T, L = q.shape[0], int(bounds.max())
    args = _dev(kernel_device, q, w, cache, bt, req, bounds)
    want = index_scores(q, w, cache, bt, req, bounds, g, out=torch.empty(T, L), validate=False, next_n=2)
    got = scores_triton(*args, g, out=torch.empty(T, L, device=kernel_device), validate=False,
                        next_n=2, block_n=16)  # fmt: skip
    assert bool(torch.isnan(got[2:4]).all()) and bool(torch.isfinite(got[0, : int(bounds[0])]).all())
    assert_close_scores(got, want, rel=1e-5)
    for out in (torch.empty(T, L, device=kernel_device), None):
        with pytest.raises(ValueError) as kernel_err:
            scores_triton(*args, g, out=out, next_n=2, block_n=16)
        with pytest.raises(ValueError) as ref_err:
            index_scores(q, w, cache, bt, req, bounds, g, out=None if out is None else torch.empty(T, L), next_n=2)
        assert str(kernel_err.value) == str(ref_err.value) and str(kernel_err.value).startswith("req_of_token")
    with pytest.raises(ValueError, match=r"^next_n"):
        st_kernel.index_scores_triton(
            args[0][:5], args[1][:5], *args[2:4], args[4][:5], args[5][:5], g, next_n=2
        )  # T = 5: no whole groups


def test_kernel_unaligned_cache_falls_back_from_the_bulk_copy(kernel_device) -> None:
    """A cache view that is not 16-byte aligned: the plan's TMA choice falls back to cp.async (same scores), also
    when that plan is passed in; a plan made with tma=True asked for (``tma_forced``) is refused there, naming
    ``plan``, and runs the bulk copy on the aligned cache."""
    q, w, cache, bt, req, bounds = mtp_problem(4, next_n=1, bs=64, lens=(70, 130, 9))
    g = DcpGeometry(1, 0, 1, 64)
    args = _dev(kernel_device, q, w, cache, bt, req, bounds)
    flat = torch.empty(cache.numel() + 4, dtype=torch.uint8, device=kernel_device)
    shifted = flat[4:].view(cache.shape)  # 4 bytes off the allocation's alignment
    shifted.copy_(args[2])
    T, L = q.shape[0], int(bounds.max())
    want = st_kernel.index_scores_triton(*args, g, out=torch.empty(T, L, device=kernel_device))
    got = st_kernel.index_scores_triton(*args[:2], shifted, *args[3:], g, out=torch.empty(T, L, device=kernel_device))
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    chosen = st_kernel.scoring_plan(T, L, kernel_device, block_size=64)
    assert chosen.tma and not chosen.tma_forced  # the plan's own choice: it falls back
    passed = st_kernel.index_scores_triton(*args[:2], shifted, *args[3:], g,
                           out=torch.empty(T, L, device=kernel_device), plan=chosen)  # fmt: skip
    assert torch.equal(passed.nan_to_num(7.0), want.nan_to_num(7.0))
    forced = st_kernel.scoring_plan(T, L, kernel_device, block_size=64, tma=True)
    assert forced.tma and forced.tma_forced and forced._replace(tma_forced=False) == chosen
    for validate in (True, False):
        with pytest.raises(ValueError, match=r"^plan asks for tma=True .* 16-byte aligned index_cache"):
            st_kernel.index_scores_triton(*args[:2], shifted, *args[3:], g, validate=validate,
                          out=torch.empty(T, L, device=kernel_device), plan=forced)  # fmt: skip
    aligned = st_kernel.index_scores_triton(*args, g, out=torch.empty(T, L, device=kernel_device), plan=forced)
    assert torch.equal(aligned.nan_to_num(7.0), want.nan_to_num(7.0))


def test_kernel_ends_near_int64_max_are_poisoned_not_wrapped(kernel_device) -> None:
    """A row start near 2**63 must not wrap ``start + bound`` past the width check (an out-of-bounds store)."""
    q, w, cache, bt, req, bounds, rs = make_problem(9, T=3, bs=8, starts=True)
    rs = rs.long()
    rs[1] = 2**63 - 4
    bounds = bounds.long()
    g = DcpGeometry(1, 0, 1, 8)
    L = 64
    want = index_scores(q, w, cache, bt, req, bounds, g, row_starts=rs, out=torch.empty(3, L), validate=False)
    got = st_kernel.index_scores_triton(*_dev(kernel_device, q, w, cache, bt, req, bounds), g,
                                        row_starts=_dev(kernel_device, rs)[0],
                                        out=torch.empty(3, L, device=kernel_device), validate=False)  # fmt: skip
    assert bool(torch.isnan(got[1]).all()) and bool(torch.isnan(want[1]).all())
    assert_close_scores(got, want, rel=1e-5 if got.device.type == "cpu" else 2e-3)  # (FP8 tensor-core sums)


def test_kernel_empty_cases(kernel_device) -> None:
    q, w, cache, bt, req, bounds, _ = make_problem(5, T=3, H=2)
    g = DcpGeometry(1, 0, 1, 8)
    q, w, cache, bt, req, bounds = args = _dev(kernel_device, q, w, cache, bt, req, bounds)
    assert st_kernel.index_scores_triton(q[:0], w[:0], cache, bt, req[:0], bounds[:0], g).shape == (0, 0)
    zero = torch.zeros(3, dtype=torch.int64, device=kernel_device)
    got = st_kernel.index_scores_triton(*args[:5], zero, g, out=torch.empty(3, 9, device=kernel_device))
    assert bool((got == -INF).all())
    assert st_kernel.index_scores_triton(*args[:5], zero, g, out=torch.empty(3, 0, device=kernel_device)).shape == (
        3,
        0,
    )


# ---------------------------------------------------------------------------------------------
# The validated call: value checks in the kernel, one flag, one host read
# ---------------------------------------------------------------------------------------------


def _wrapper_ops(monkeypatch: pytest.MonkeyPatch, fn) -> list[str]:  # noqa: ANN001
    """What ``fn()`` runs in the wrapper's own code, in order (``tests/opcount.py``): each Triton launch and every
    non-view aten op outside the launches (the ops a device would launch, and host reads)."""
    counter = OpCount()
    with counter.recording([(st_kernel, "index_scores_kernel"), (st_kernel, "index_scores_check_kernel")]):
        fn()
    return counter.ops


def _reads(ops: list[str]) -> list[str]:
    return [op for op in ops if op in HOST_READS]


def _flag(dev: torch.device) -> int:
    from dcp_ref.kernels._util import check_flag

    return int(check_flag(dev).item())


@pytest.mark.parametrize("starts", [False, True])
def test_validated_call_is_the_unvalidated_launch_plus_one_read(kernel_device, monkeypatch, starts) -> None:
    """With ``out``: the validated call is the unvalidated call's one launch (its CHECK switch on) and one read of
    the flag it raised. (Before the fold: 26-27 torch ops and 6 host reads ahead of the launch.) Without ``out``
    the width comes from the values: the check kernel, the one read (verdict and width), the output, the launch."""
    q, w, cache, bt, req, bounds, rs = make_problem(31, T=4, bs=4, H=4, starts=starts)
    g = DcpGeometry(1, 0, 1, 4)
    args = _dev(kernel_device, q, w, cache, bt, req, bounds)
    rs_d = _dev(kernel_device, rs)[0]
    L = width(bounds, rs)
    out = torch.empty(4, L + 2, device=kernel_device)
    plan = st_kernel.scoring_plan(4, L + 2, kernel_device, block_size=4, block_n=16)  # (made once: no op counted)

    def call(v: bool, o: torch.Tensor | None = out) -> torch.Tensor:
        return st_kernel.index_scores_triton(*args, g, row_starts=rs_d, out=o, validate=v, plan=plan)

    call(False), call(True), call(True, None)  # warm: compiled
    plain = _wrapper_ops(monkeypatch, lambda: call(False))
    checked = _wrapper_ops(monkeypatch, lambda: call(True))
    assert plain == ["triton:index_scores_kernel"], plain
    # the validated call's own flag (made per call, no cache), the launch, the one read
    assert len(_reads(checked)) == 1 and checked == ["aten::zeros", *plain, *_reads(checked)], checked
    got: list[torch.Tensor] = []
    free = _wrapper_ops(monkeypatch, lambda: got.append(call(True, None)))
    assert free == ["aten::zeros", "triton:index_scores_check_kernel", *_reads(free), "aten::empty",
                    "triton:index_scores_kernel"]  # fmt: skip
    assert len(_reads(free)) == 1, free
    assert got[0].shape == (4, L) and _flag(kernel_device) == 0  # the width was the read; the launch cleared it
    want = index_scores(q, w, cache, bt, req, bounds, g, row_starts=rs, out=torch.empty(4, L))
    assert_close_scores(got[0], want, rel=1e-5)


def _bad_scoring_cases():
    """``(label, changes)`` of a valid problem (T=6, bs=4, M=5, L=24): each a row the reference refuses."""
    return [
        ("request id -1", dict(req={0: -1})),
        ("request id past the table", dict(req={2: 3})),
        ("negative bound", dict(bounds={1: -3})),
        ("negative row start", dict(rs={2: -1})),
        ("more keys than the table's blocks", dict(bounds={3: 21})),
        ("a missing block", dict(bt={(1, 0): -1})),
        ("a block past the cache", dict(bt={(2, 2): 99})),
        ("past out's columns", dict(rs={4: 20})),
        ("several at once", dict(req={5: 7}, bounds={1: -2}, bt={(0, 1): -1})),
    ]


def _apply(problem, changes):
    q, w, cache, bt, req, bounds, rs = (t.clone() if isinstance(t, torch.Tensor) else t for t in problem)
    for name, t in (("req", req), ("bounds", bounds), ("rs", rs), ("bt", bt)):
        for i, v in changes.get(name, {}).items():
            t[i] = v
    return q, w, cache, bt, req, bounds, rs


@pytest.mark.parametrize("with_out", [True, False])
@pytest.mark.parametrize("int_dtype", [torch.int32, torch.int64])
def test_validated_bad_inputs_raise_the_references_message_and_clear_the_flag(kernel_device, with_out, int_dtype):
    """Every bad row raises exactly the reference's message (the same ValueError), and the flag is left at 0;
    unvalidated calls on the same inputs never raise it (poisoned rows, no raise), and a good call passes."""
    q, w, cache, bt, req, bounds, rs = make_problem(3, T=6, bs=4, H=4, lens=(10, 7, 13), M=5, starts=True)
    req[:], bounds[:], rs[:] = torch.tensor([0, 1, 2, 2, 0, 1]), torch.tensor([10, 7, 13, 9, 6, 0]), 0
    base = tuple(
        t.to(int_dtype) if t.dtype in (torch.int32, torch.int64) else t for t in (q, w, cache, bt, req, bounds, rs)
    )
    g = DcpGeometry(1, 0, 1, 4)
    for label, changes in _bad_scoring_cases():
        q, w, cache, bt, req, bounds, rs = _apply(base, changes)
        if not with_out and "rs" not in changes:
            rs = None
        if not with_out and label == "past out's columns":
            continue  # without out the width is the values': nothing to be past
        kw_ref = dict(row_starts=rs, out=torch.empty(6, 24) if with_out else None)
        with pytest.raises(ValueError) as ref:
            index_scores(q, w, cache, bt, req, bounds, g, **kw_ref)
        out = torch.full((6, 24), 5.0, device=kernel_device) if with_out else None
        dev = _dev(kernel_device, q, w, cache, bt, req, bounds)
        rs_d = _dev(kernel_device, rs)[0]
        with pytest.raises(ValueError) as ker:
            scores_triton(*dev, g, row_starts=rs_d, out=out, block_n=16)
        assert str(ker.value) == str(ref.value), label
        assert _flag(kernel_device) == 0, label  # cleared: the next validated call starts clean
        if rs_d is not None or with_out:  # unvalidated (it needs out with row starts): poisoned, never raised
            o = torch.empty(6, 24, device=kernel_device)
            scores_triton(*dev, g, row_starts=rs_d, out=o, validate=False, block_n=16)
            assert bool(torch.isnan(o).all(1).any()), label
            assert _flag(kernel_device) == 0, label
    q, w, cache, bt, req, bounds, rs = base
    st_kernel.index_scores_triton(*_dev(kernel_device, q, w, cache, bt, req, bounds), g,
                                  row_starts=_dev(kernel_device, rs)[0],
                                  out=torch.empty(6, 24, device=kernel_device) if with_out else None)  # fmt: skip
    assert _flag(kernel_device) == 0


def test_validated_no_column_and_huge_ends(kernel_device) -> None:
    """``out`` without columns launches no scoring, so the check kernel checks (one read). Without ``out``, row
    ends too large for the check kernel's width code (>= 2**62) are decided by the host, as the reference does;
    a width read from the flag but too large for a tensor fails as the reference's, and the flag is cleared."""
    q, w, cache, bt, req, bounds, rs = make_problem(5, T=3, H=2, starts=True)
    g = DcpGeometry(1, 0, 1, 8)
    dev = _dev(kernel_device, q, w, cache, bt, req, bounds)
    with pytest.raises(ValueError) as ref:
        index_scores(q, w, cache, bt, req, bounds, g, out=torch.empty(3, 0))
    with pytest.raises(ValueError) as ker:
        st_kernel.index_scores_triton(*dev, g, out=torch.empty(3, 0, device=kernel_device))
    assert str(ker.value) == str(ref.value) and _flag(kernel_device) == 0
    zero = torch.zeros(3, dtype=torch.int64)
    empty = st_kernel.index_scores_triton(
        *dev[:5], zero.to(kernel_device), g, out=torch.empty(3, 0, device=kernel_device)
    )
    assert empty.shape == (3, 0) and _flag(kernel_device) == 0
    assert st_kernel.index_scores_triton(*dev[:5], zero.to(kernel_device), g).shape == (3, 0)  # width 0: no launch
    for start in (2**62, 2**62 - 9):  # a width no tensor has: the host decides / the output cannot be made
        big = rs.clone()
        big[1] = start  # (bound 2: an end of 2**62 + 2, or 2**62 - 7 read as the width, the flag then cleared)
        with pytest.raises(RuntimeError) as ref_err:
            index_scores(q, w, cache, bt, req, bounds, g, row_starts=big)
        with pytest.raises(RuntimeError) as ker_err:
            st_kernel.index_scores_triton(*dev, g, row_starts=big.to(kernel_device))
        assert str(ker_err.value) == str(ref_err.value) and _flag(kernel_device) == 0


def test_scoring_plan_from_shapes_only() -> None:
    """The plan reads shapes only (its table: tests/test_scoring_plans.py)."""
    cpu = torch.device("cpu")
    p = st_kernel.scoring_plan(32, 8192, cpu)
    assert p.programs * p.tiles * p.block_n >= 8192 and p.group == 1
    with pytest.raises(ValueError, match=r"^next_n"):
        st_kernel.scoring_plan(32, 8192, cpu, next_n=0)


class _Launches:
    """Stands in for ``index_scores_kernel``: records each launch's grid and keywords, then runs the real one."""

    def __init__(self, kernel) -> None:  # noqa: ANN001
        self.kernel, self.seen = kernel, []

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            consts = {k: kwargs[k] for k in ("BLOCK_N", "NEXT_N", "TMA", "PAIR_DOT", "num_warps", "num_stages")}
            self.seen.append((grid, consts, args[15]))  # (args[15]: chunk, the columns of one program)
            return self.kernel[grid](*args, **kwargs)

        return launch


def test_a_plan_passed_in_runs_as_the_same_knobs_did(kernel_device, monkeypatch) -> None:
    """The tuning reaches the kernel only through ``plan=``: the wrapper has no knob of its own, ``plan=None`` runs
    ``scoring_plan`` of the call's shape (bit for bit the same as passing that plan), and a plan made with knobs
    launches exactly that plan (grid, tile, warps, stages: what the knobs launched when the wrapper forwarded them
    to ``scoring_plan``), with the reference's scores — also validated without ``out``, where the plan meets the
    width the values give."""
    import inspect

    params = inspect.signature(st_kernel.index_scores_triton).parameters
    assert not set(KNOBS) & set(params) and params["plan"].default is None
    assert set(KNOBS) <= set(inspect.signature(st_kernel.scoring_plan).parameters)
    q, w, cache, bt, req, bounds, rs = make_problem(41, T=4, bs=8, H=4, starts=True)
    g = DcpGeometry(1, 0, 1, 8)
    L = width(bounds, rs) + 5  # (at most a few dozen columns: the interpreter is slow)
    args = _dev(kernel_device, q, w, cache, bt, req, bounds)
    rs_d = _dev(kernel_device, rs)[0]
    want = index_scores(q, w, cache, bt, req, bounds, g, row_starts=rs, out=torch.empty(4, L))
    rec = _Launches(st_kernel.index_scores_kernel)
    monkeypatch.setattr(st_kernel, "index_scores_kernel", rec)
    default = st_kernel.scoring_plan(4, L, kernel_device, block_size=8)
    a = st_kernel.index_scores_triton(*args, g, row_starts=rs_d, out=torch.empty(4, L, device=kernel_device))
    b = st_kernel.index_scores_triton(*args, g, row_starts=rs_d, out=torch.empty(4, L, device=kernel_device),
                      plan=default)  # fmt: skip
    assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) and rec.seen[0] == rec.seen[1]
    for knobs in (dict(block_n=16, tiles=1), dict(block_n=16, tiles=2, num_warps=2, num_stages=2),
                  dict(block_n=32, num_warps=1, num_stages=3)):  # fmt: skip
        plan = st_kernel.scoring_plan(4, L, kernel_device, block_size=8, **knobs)
        assert plan != default
        rec.seen.clear()
        out = torch.full((4, L), 7.0, device=kernel_device)
        got = st_kernel.index_scores_triton(*args, g, row_starts=rs_d, out=out, plan=plan)
        assert_close_scores(got, want, rel=1e-5)
        [(grid, consts, chunk)] = rec.seen
        assert grid == (4, plan.programs) and chunk == plan.block_n * plan.tiles, knobs
        assert consts == dict(BLOCK_N=plan.block_n, NEXT_N=1, TMA=False, PAIR_DOT=False, num_warps=plan.num_warps,
                              num_stages=plan.num_stages), knobs  # fmt: skip
    # validated without out: the width comes from the values (L - 5 here), and the plan is checked against it
    narrow = st_kernel.scoring_plan(4, L - 5, kernel_device, block_size=8, block_n=16, tiles=1)
    rec.seen.clear()
    got = st_kernel.index_scores_triton(*args, g, row_starts=rs_d, plan=narrow)
    assert got.shape == (4, L - 5) and rec.seen[0][0] == (4, narrow.programs)
    assert_close_scores(got, want[:, : L - 5], rel=1e-5)


def test_a_plan_that_does_not_fit_the_call_is_refused_naming_plan(kernel_device) -> None:
    """Each way a plan can miss its call — another group size, too few columns, TMA where a tile is no cache block,
    pair_dot without pairs, a field no plan has — is a ValueError naming ``plan`` (validated or not, with ``out``
    or once the values gave the width); a value that is no ScoringPlan a TypeError. No scoring launch runs, and the
    flag is left clear. A bad value in a validated call is still the reference's error."""
    T, bs = 4, 64
    q, w, cache, bt, req, bounds = mtp_problem(43, B=2, next_n=2, bs=bs, lens=(150, 90))
    g = DcpGeometry(1, 0, 1, bs)
    L = int(bounds.max())  # 150: three tiles of 64 keys
    args = _dev(kernel_device, q, w, cache, bt, req, bounds)
    cpu = kernel_device
    pairs = st_kernel.scoring_plan(T, L, cpu, next_n=2, block_size=bs)  # fits the next_n=2 call
    single = st_kernel.scoring_plan(T, L, cpu, block_size=bs)  # fits the next_n=1 call
    assert pairs.tma and pairs.group == 2 and single.group == 1
    misfits = {  # (next_n of the call, plan, what the message says)
        "groups of 1 for next_n=2": (2, single, r"^plan scores groups of 1 token\(s\), but this call's next_n=2"),
        "groups of 2 for next_n=1": (1, pairs, r"^plan scores groups of 2 token\(s\), but this call's next_n=1"),
        "too few columns": (
            2,
            st_kernel.scoring_plan(T, 64, cpu, next_n=2, block_size=bs, tiles=1),
            r"^plan covers 64 columns \(1 programs x 1 tiles x 64 keys\), fewer than this call's 150",
        ),
        "tma with 32-key tiles of 64-key blocks": (
            2,
            st_kernel.scoring_plan(T, L, cpu, next_n=2, block_size=32),
            r"^plan has tma=True, which needs block_n",
        ),
        "tma with 128-key tiles": (2, pairs._replace(block_n=128, programs=2), r"^plan has tma=True"),
        "pair_dot without pairs": (1, single._replace(pair_dot=True), r"^plan has pair_dot=True"),
        "block_n 24": (2, pairs._replace(block_n=24), r"^plan\.block_n must be a power of two"),
        "no program": (2, pairs._replace(programs=0), r"^plan\.programs must be"),
        "num_warps 3": (2, pairs._replace(num_warps=3), r"^plan\.num_warps"),
    }
    assert misfits["tma with 32-key tiles of 64-key blocks"][1].tma  # (a tile is one 32-key block there)
    for why, (next_n, plan, msg) in misfits.items():
        for validate, out in ((False, torch.empty(T, L, device=cpu)), (True, torch.empty(T, L, device=cpu)),
                              (True, None)):  # fmt: skip
            with pytest.raises(ValueError, match=msg):
                st_kernel.index_scores_triton(*args, g, out=out, validate=validate, next_n=next_n, plan=plan)
            assert _flag(cpu) == 0, why
    for field, v in (("tiles", 2.0), ("tma", 1), ("num_stages", True)):
        with pytest.raises(TypeError, match=rf"^plan\.{field} must be"):
            st_kernel.index_scores_triton(*args, g, out=torch.empty(T, L, device=cpu), next_n=2,
                          plan=pairs._replace(**{field: v}))  # fmt: skip
    for not_a_plan in (tuple(pairs), pairs._asdict(), "default", 1):
        for out in (torch.empty(T, L, device=cpu), None):
            with pytest.raises(TypeError, match=r"^plan must be a ScoringPlan \(scoring_plan makes it\) or None"):
                st_kernel.index_scores_triton(*args, g, out=out, next_n=2, plan=not_a_plan)
    bad = [t.clone() for t in args]
    bad[4][1] = 5  # a request past the table: the reference's message, not the plan's
    with pytest.raises(ValueError) as ref:
        index_scores(*(t.cpu() for t in bad), g, out=torch.empty(T, L), next_n=2)
    for p in (single, "default"):
        with pytest.raises(ValueError) as ker:
            st_kernel.index_scores_triton(*bad, g, out=torch.empty(T, L, device=cpu), next_n=2, plan=p)
        assert str(ker.value) == str(ref.value) and str(ker.value).startswith("req_of_token")


# ---------------------------------------------------------------------------------------------
# Candidates as sets of (score, id) bit patterns (the GPU hot path below)
# ---------------------------------------------------------------------------------------------
def pair_bits(packed: torch.Tensor) -> torch.Tensor:
    return packed.contiguous().view(torch.int64).squeeze(-1)


def same_sets(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    return (torch.sort(pair_bits(got.cpu()), 1).values == torch.sort(pair_bits(want.cpu()), 1).values).all(1)


def oracle_candidates(scores, bounds, k, g, rs=None) -> torch.Tensor:
    ids = local_topk(scores, k, bounds, rs, validate=False)
    return pack_candidates(scores, ids, g, rs, validate=False)


COMPILE_SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dcp_ref.kernels.scoring_triton import index_scores_check_kernel, index_scores_kernel

PTRS = {"q_ptr": "*u8", "w_ptr": "*fp32", "cache_u8": "*u8", "cache_f32": "*fp32", "bt_ptr": "*i32", "req_ptr": "*i32",
        "bound_ptr": "*i32", "start_ptr": "*i64", "chk_ptr": "*i64", "n_cols": "i64", "chunk": "i64"}
KERNELS = {"scoring": index_scores_kernel, "check": index_scores_check_kernel}
report = []
for kind, cfg, warps, stages in json.loads(sys.argv[1]):
    kern = KERNELS[kind]
    names = kern.arg_names
    sig = {n: PTRS.get(n, "i32") for n in names}
    sig.update({"out_ptr": "*fp32"})
    sig = {n: sig[n] for n in names}
    if "desc_v" in sig:  # the bulk-copy descriptor of a TMA launch (else no descriptor: None, a constexpr)
        cfg = dict(cfg, TMA=cfg.get("TMA", False))
        if cfg["TMA"]:
            sig["desc_v"] = "tensordesc<fp8e4nv[%d, 128]>" % cfg["BS"]
        else:
            cfg = dict(cfg, desc_v=None)
    sig.update({n: "constexpr" for n in cfg})
    c = triton.compile(ASTSource(kern, signature=sig, constexprs=cfg), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    ptx = c.asm["ptx"]
    report.append({"kind": kind, "sm_90a": "sm_90a" in ptx, "wgmma": "wgmma" in ptx, "cubin": len(c.asm["cubin"]) > 0,
                   "shared": c.metadata.shared, "atomic": re.search(r"(atom|red)\.global[.\w]*\.max", ptx) is not None})
print(json.dumps(report))
"""


def test_kernels_compile_for_sm90a_on_the_cpu() -> None:
    """The interpreter does not type-check like the compiler: compile the default launch configurations to
    sm_90a PTX and cubin (no GPU needed), in a fresh process without TRITON_INTERPRET; the FP8 dot must
    become wgmma."""
    import json
    import os
    import subprocess
    import sys

    base = dict(HAS_STARTS=False, Q_FP8=True, H_PAD=64, D=128, SCAN_N=st_kernel.SCAN)
    new = dict(BS=64, FILL_N=st_kernel.FILL, PAIR_DOT=False)
    checks = dict(CHECK=False, CLEAR=False)
    configs = [
        ("scoring", base | new | checks | dict(NEXT_N=1, BLOCK_N=64), 4, 4),  # a tile is one cache block
        ("scoring", base | new | checks | dict(NEXT_N=1, BLOCK_N=64, TMA=True), 4, 6),  # ... by the bulk copy
        ("scoring", base | new | checks | dict(NEXT_N=2, BLOCK_N=64, TMA=True), 4, 5),
        ("scoring", base | new | checks | dict(NEXT_N=2, BLOCK_N=64), 4, 4),  # MTP pairs: one read, two dots
        ("scoring", base | new | checks | dict(NEXT_N=2, BLOCK_N=64, TMA=True, PAIR_DOT=True), 4, 5),  # one dot
        ("scoring", base | new | checks | dict(NEXT_N=1, BLOCK_N=128), 8, 3),  # a tile spans two blocks
        ("scoring", base | new | dict(NEXT_N=1, BLOCK_N=64, CHECK=True, CLEAR=False), 4, 4),  # validated, out given
        ("scoring", base | new | dict(NEXT_N=1, BLOCK_N=64, CHECK=False, CLEAR=True), 4, 4),  # ... without out
        ("scoring", base | new | checks | dict(NEXT_N=1, BLOCK_N=64, HAS_STARTS=True), 4, 4),  # prefill rows
        ("check", dict(HAS_STARTS=True, NEXT_N=1, WIDTH=True, BS=64, SCAN_N=st_kernel.SCAN), 4, 1),
        ("check", dict(HAS_STARTS=False, NEXT_N=2, WIDTH=False, BS=64, SCAN_N=st_kernel.SCAN), 4, 1),
    ]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, json.dumps(configs)], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    if proc.returncode and ("ModuleNotFoundError" in proc.stderr or "ImportError" in proc.stderr):
        pytest.skip(f"this Triton cannot compile ahead of time here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == len(configs)
    for r, (kind, cfg, _, _) in zip(report, configs):
        assert r["sm_90a"] and r["cubin"] and r["shared"] <= 100 * 1024, r
        assert r["wgmma"] == (kind != "check"), r  # the check kernel has no dot
        assert r["atomic"] == (kind == "check" or bool(cfg.get("CHECK"))), r  # the flag's max: only with CHECK


# ---------------------------------------------------------------------------------------------
# GPU: compiled kernels, CUDA graphs, no host sync
# ---------------------------------------------------------------------------------------------
def gpu_problem(seed, T, lens, exact, bs=64, NB_extra=8):
    q, w, cache, bt, req, bounds, _ = make_problem(seed, T=T, B=len(lens), bs=bs, lens=lens, exact=exact,
                                                   NB=sum(-(-n // bs) for n in lens) + NB_extra)  # fmt: skip
    return [t.cuda() for t in (q, w, cache, bt, req, bounds)]


@pytest.mark.gpu
def test_gpu_scoring_matches_reference(cuda_device) -> None:
    q, w, cache, bt, req, bounds = gpu_problem(50, 32, (9000, 4096, 300, 12000), exact=False)
    g = DcpGeometry(2, 1, 1, 64)
    L = bt.shape[1] * 64
    want = index_scores(q, w, cache, bt, req, bounds, g, out=torch.empty(32, L, device="cuda"))
    for kw in ({}, dict(block_n=64, num_warps=8), dict(block_n=256, tiles=2)):
        got = scores_triton(q, w, cache, bt, req, bounds, g, out=torch.full_like(want, 7.0), **kw)
        # FP8 tensor-core accumulation keeps fewer bits than float32: compare against sum|w||q.k| scale
        fin = torch.isfinite(want)
        assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.equal(got.isnan(), want.isnan())
        err = (got - want)[fin].abs()
        assert float(err.max()) <= 2e-3 * float(want[fin].abs().max()), kw
    exact = gpu_problem(51, 16, (5000, 700), exact=True)
    want = index_scores(*exact, g, out=torch.empty(16, exact[3].shape[1] * 64, device="cuda"))
    got = st_kernel.index_scores_triton(*exact, g, out=torch.empty_like(want))
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.gpu
@pytest.mark.parametrize("bad_block", [None, 7, 1060, "last"])
def test_gpu_mtp_pairs_and_long_rows_match_reference(cuda_device, bad_block) -> None:
    """On the H200: rows of more than ``SCAN`` (1024) blocks — a bad entry before or after the first ``SCAN``
    entries, or in the block only a pair's longer token needs — and MTP pairs by one dot or two, TMA or cp.async,
    at the plan's launch and at small ones: the reference's poisoned rows, ``-inf`` columns and scores (FP8
    tensor-core sums: within 2e-3 of the row's largest score); validated, the reference's message."""
    bs, lens = 64, (64 * 1093 + 1, 9000, 130)  # request 0: bounds 69952 / 69953 -> 1093 / 1094 blocks
    q, w, cache, bt, req, bounds = mtp_problem(90, B=3, next_n=2, bs=bs, lens=lens)
    if bad_block is not None:
        bt[0, 1093 if bad_block == "last" else bad_block] = -1
    g = DcpGeometry(1, 0, 1, bs)
    T, L = q.shape[0], bt.shape[1] * bs
    args = [t.cuda() for t in (q, w, cache, bt, req, bounds)]
    want = index_scores(*args, g, out=torch.empty(T, L, device="cuda"), validate=False, next_n=2)
    fin = torch.isfinite(want)
    for next_n in (2, 1):
        for kw in ({}, dict(pair_dot=False), dict(tma=False, tiles=3), dict(tiles=1, pair_dot=False, tma=False)):
            got = scores_triton(*args, g, out=torch.full_like(want, 7.0), validate=False,
                                next_n=next_n, **kw)  # fmt: skip
            assert torch.equal(got.isnan(), want.isnan()) and torch.equal(torch.isinf(got), torch.isinf(want)), kw
            err = (got - want)[fin].abs()
            assert float(err.max()) <= 2e-3 * float(want[fin].abs().max()), (next_n, kw)
    if bad_block is not None:
        with pytest.raises(ValueError) as kernel_err:
            st_kernel.index_scores_triton(*args, g, out=torch.empty_like(want), next_n=2)
        with pytest.raises(ValueError) as ref_err:
            index_scores(*args, g, out=torch.empty_like(want), next_n=2)
        assert str(kernel_err.value) == str(ref_err.value)


def hot_path(seed, T, k, lens, g, device):
    """A GPU problem and the hot path over it: ``(inputs, scores, cand, call)``, where ``call()`` runs the
    scoring kernel into ``scores`` and the indexer's top-K + pack into ``cand``, both with ``validate=False`` and
    with every buffer (the indexer's split workspace too) made once, here, so that ``call`` allocates nothing."""
    inputs = gpu_problem(seed, T, lens, exact=True)
    L = inputs[3].shape[1] * 64
    scores = torch.empty(T, L, device="cuda")
    cand = torch.empty(T, k, 2, device="cuda")
    from dcp_ref.kernels.indexer_triton import indexer_topk_pack, workspace_for

    ws = workspace_for(scores, k)

    def call() -> None:
        st_kernel.index_scores_triton(*inputs, g, out=scores, validate=False)
        indexer_topk_pack(scores, inputs[5], k, g, out=cand, workspace=ws, validate=False)

    return inputs, scores, cand, call


@pytest.mark.gpu
def test_gpu_graph_capture_and_replay_with_new_inputs(cuda_device) -> None:
    T, k = 16, 2048
    g = DcpGeometry(1, 0, 1, 64)
    (q, w, cache, bt, req, bounds), scores, cand, call = hot_path(70, T, k, (20000, 9000), g, cuda_device)
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed in (71, 72):
        q2, w2, cache2, bt2, req2, bounds2 = gpu_problem(seed, T, (20000, 9000), exact=True)
        for dst, src in ((q, q2), (w, w2), (cache, cache2), (bt, bt2), (req, req2), (bounds, bounds2)):
            dst.copy_(src)
        scores.fill_(NAN)
        cand.fill_(NAN)
        graph.replay()
        torch.cuda.synchronize()
        want = index_scores(q, w, cache, bt, req, bounds, g, out=torch.empty_like(scores))
        assert torch.equal(scores.nan_to_num(), want.nan_to_num())
        assert bool(same_sets(cand, oracle_candidates(want, bounds, k, g)).all())


@pytest.mark.gpu
def test_gpu_validate_false_makes_no_host_sync(cuda_device) -> None:
    T, k = 8, 256
    g = DcpGeometry(2, 1, 2, 64)
    (q, w, cache, bt, req, bounds), out, cand, call = hot_path(80, T, k, (9000, 3000), g, cuda_device)
    call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = index_scores(q, w, cache, bt, req, bounds, g, out=torch.empty_like(out))
    assert bool(same_sets(cand, oracle_candidates(want, bounds, k, g)).all())
