"""Triton kernel: the lightning indexer's scoring stage — FP8 index keys -> index scores ``[T, L]``.

The GPU twin of :func:`dcp_ref.scoring.index_scores` (same arguments, same checks and messages,
the same ``validate=False`` poison rule)::

    scores[t, row_starts[t] + j] = sum_h w[t, h] * relu(q[t, h] . k_fp8[j]) * scale[j]     (j < local_bounds[t])

How one program works (grid ``(T / group, cdiv(L, BLOCK_N * tiles))``; program ``(g, p)`` owns keys and columns
``[p * chunk, (p + 1) * chunk)`` of the ``group`` tokens of group ``g``: 1, or 2 for an MTP pair of one request):

1. **Row metadata** (:func:`token_meta`): each token's request, bound and start, and whether its scalars are out of
   contract (overflow-safe); both tokens of a pair that names two requests are poisoned.
2. **The query** (:func:`load_query`): ``[H_PAD, 128]`` FP8 query and ``[H_PAD]`` weights per token, loaded once.
3. **Per tile** of ``BLOCK_N`` keys: with ``BLOCK_N`` = the cache block (64 for V3.2) a tile is one block — one
   table entry and 8 KiB of contiguous values (:func:`tile_values`: the bulk tensor copy engine (TMA) or 16-byte
   ``cp.async``, pipelined by the compiler ``num_stages`` deep), and 256 bytes of scales (:func:`tile_blocks`,
   :func:`tile_scales`, asked for one tile ahead: the pipeliner prefetches only dot operands). Then
   :func:`score_keys`: one FP8 ``wgmma`` per token, ``[BLOCK_N, 128] x [128, H]`` (keys on the M side, so the
   weighted head sum stays in a thread's quad), ReLU that keeps NaN, times the scale; stored at ``start + j``.
   An MTP pair is scored by one ``wgmma`` of ``N = 2H`` (:func:`score_key_pairs`, the plan's ``pair_dot``) or by
   one per token: the sweep picks per shape (one dot is faster at few keys per SM, two at many).
4. **The table verdict and the fill** (:func:`first_entries`, :func:`group_entries_bad`, :func:`fill_columns`): a
   needed entry that is not a block poisons the row (decode: the first ``SCAN`` entries are loaded before the key
   loop and checked after it, so their latency hides behind the key stream; with ``row_starts``: checked first);
   the program's columns that hold no key get ``-inf``, a poisoned row NaN.

The launch is a :class:`ScoringPlan`: the caller's ``plan=`` (made by :func:`scoring_plan`, checked against the
call), or by default :func:`scoring_plan` of the call's shape (:data:`PLANS`, the committed H200 sweep).

Every load is masked (by the row's bound and the row's verdict), addresses are int64, so even with
``validate=False`` nothing outside the cache, the table or ``out`` is touched. No allocation with
``out=``, no host synchronisation with ``validate=False``: capturable in a CUDA graph.

``index_q`` may be float8_e4m3fn (the FP8 ``tl.dot``) or fp16 / bf16 / float32 (teaching: the keys are
widened to float32 and the dot runs in IEEE float32); float64 queries are the reference's only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dcp_ref.contracts import check_bool, check_int_scalar, check_values_readable, triton_interpreting
from dcp_ref.geometry import DcpGeometry
from dcp_ref.index_cache import INDEX_K_FP8
from dcp_ref.scoring import ScoringArgs, check_scoring_inputs

from ._util import cdiv, check_flag, nearest_shapes, next_pow2, raise_if_flagged, sm_count

__all__ = [
    "load_query",
    "token_meta",
    "count_bad_entries",
    "first_entries",
    "group_entries_bad",
    "tile_values",
    "tile_blocks",
    "tile_scales",
    "score_keys",
    "load_query_pair",
    "score_key_pairs",
    "fill_columns",
    "index_scores_kernel",
    "index_scores_check_kernel",
    "KERNEL_Q_DTYPES",
    "PLANS",
    "ScoringPlan",
    "group_size",
    "scoring_plan",
    "kernel_views",
    "index_scores_triton",
]

#: ``index_q`` dtypes the kernel takes (float64 is the reference's only).
KERNEL_Q_DTYPES = (torch.float8_e4m3fn, torch.float16, torch.bfloat16, torch.float32)
#: Table entries read per step of the row check (:func:`count_bad_entries`; the first ones by :func:`first_entries`).
SCAN = 1024
#: The validated check kernel's "no width to check" (above every column a row can reach).
NO_WIDTH = 1 << 62
#: Output columns per store of the fill (the ``-inf`` / NaN columns that hold no key).
FILL = 256


@triton.jit
def load_query(
    q_ptr, w_ptr, t, n_heads, sq_t, sq_h, sq_d, sw_t, sw_h, Q_FP8: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr
):
    """Token ``t``'s query ``[H_PAD, D]`` (float8e4nv, or float32 when not FP8) and weights ``[H_PAD]``.

    Padded heads (``h >= n_heads``) read nothing: zero query rows and zero weights, so they add 0.
    """
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D)
    hm = h < n_heads
    qp = q_ptr + t.to(tl.int64) * sq_t + h[:, None].to(tl.int64) * sq_h + d[None, :].to(tl.int64) * sq_d
    if Q_FP8:
        q = tl.load(qp, mask=hm[:, None], other=0).to(tl.float8e4nv, bitcast=True)
    else:
        q = tl.load(qp, mask=hm[:, None], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + t.to(tl.int64) * sw_t + h.to(tl.int64) * sw_h, mask=hm, other=0.0)
    return q, w


@triton.jit
def token_meta(req_ptr, bound_ptr, start_ptr, t, n_req, n_tbl, n_cols, BS: tl.constexpr, HAS_STARTS: tl.constexpr):
    """``(request, bound, start, blocks needed, bad)`` of token ``t`` (int64 scalars; ``start = 0`` without starts).

    ``bad``: the token's scalars are out of contract — the request outside ``[0, n_req)``, a negative bound or
    start, ``start + bound`` past ``n_cols`` (tested as ``bound > n_cols`` or ``start > n_cols - bound``, so that
    values near 2**63 cannot wrap), or more blocks than the table has. The table entries are checked separately
    (:func:`count_bad_entries`).
    """
    req = tl.load(req_ptr + t).to(tl.int64)
    bound = tl.load(bound_ptr + t).to(tl.int64)
    start = tl.zeros([], tl.int64)
    if HAS_STARTS:
        start = tl.load(start_ptr + t).to(tl.int64)
    bad = (req < 0) | (req >= n_req) | (bound < 0) | (start < 0) | (bound > n_cols) | (start > n_cols - bound)
    need = (tl.minimum(tl.maximum(bound, 0), n_cols) + BS - 1) // BS  # (clamped: no wrap; a bad bound is bad anyway)
    bad = bad | (need > n_tbl)
    return req, bound, start, tl.where(bad, 0, need), bad


@triton.jit
def count_bad_entries(bt_row, sbt_c, lo, hi, n_blocks, SCAN_N: tl.constexpr):
    """How many of the table entries ``lo .. hi - 1`` of one row are not a block of the cache (``< 0`` or
    ``>= n_blocks``), read ``SCAN_N`` at a time (int32 scalar)."""
    wrong = tl.zeros([], tl.int32)
    for c in range(lo, hi, SCAN_N):
        o = c + tl.arange(0, SCAN_N)
        m = o < hi
        blk = tl.load(bt_row + o.to(tl.int64) * sbt_c, mask=m, other=0).to(tl.int64)
        wrong += tl.sum((m & ((blk < 0) | (blk >= n_blocks))).to(tl.int32), 0)
    return wrong


@triton.jit
def first_entries(bt_row, sbt_c, need0, need1, SCAN_N: tl.constexpr):
    """The first ``SCAN_N`` table entries a group needs (int64 ``[SCAN_N]``; 0 past ``max(need0, need1)``).

    Decode loads them before the key loop and reads them after it (:func:`group_entries_bad`), so the verdict of a
    row of up to ``SCAN_N`` blocks adds no exposed load latency at the program's end (it overlaps the key stream).
    """
    o = tl.arange(0, SCAN_N)
    return tl.load(bt_row + o.to(tl.int64) * sbt_c, mask=o < tl.maximum(need0, need1), other=0).to(tl.int64)


@triton.jit
def group_entries_bad(bt_row, sbt_c, first, need0, need1, n_blocks, SCAN_N: tl.constexpr):
    """Whether token 0 / token 1 of a group needs a table entry that is not a block (each entry read once:
    ``first`` (:func:`first_entries`) holds entries ``0 .. SCAN_N - 1``; the rest are read here — the entries both
    need, then those only the one with more blocks needs)."""
    lo = tl.minimum(need0, need1)
    hi = tl.maximum(need0, need1)
    o = tl.arange(0, SCAN_N)
    wrong = (o < hi) & ((first < 0) | (first >= n_blocks))
    both = tl.sum((wrong & (o < lo)).to(tl.int32), 0) + count_bad_entries(bt_row, sbt_c, SCAN_N, lo, n_blocks, SCAN_N)
    more = both + tl.sum((wrong & (o >= lo)).to(tl.int32), 0)
    more += count_bad_entries(bt_row, sbt_c, tl.maximum(lo, SCAN_N), hi, n_blocks, SCAN_N)
    return tl.where(need0 > need1, more, both) > 0, tl.where(need1 > need0, more, both) > 0


@triton.jit
def tile_values(cache_u8, desc_v, bt_row, sbt_c, j0, n_keys, n_blocks, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                D: tl.constexpr, TMA: tl.constexpr):  # fmt: skip
    """The e4m3 values ``[BLOCK_N, D]`` (float8e4nv) of local keys ``j0 .. j0 + BLOCK_N - 1`` of one request;
    0 where ``j >= n_keys`` or the table entry is not a block (nothing is read there).

    A cache block of ``BS`` keys is ``BS * D`` value bytes, then ``BS`` float32 scales. With ``BLOCK_N == BS``
    (tiles aligned to blocks) the tile is one block: one table entry and 8 KiB of contiguous bytes, which the
    compiler streams with 16-byte ``cp.async`` copies ``num_stages - 3`` tiles ahead (the entry's load is the first
    stage). Otherwise every key finds its own block (``BS`` is a compile-time constant, so each key's ``D`` values
    are still known to be 16-byte aligned when ``BS`` is even). ``TMA``: the tile is one block, loaded by the bulk
    tensor copy engine through ``desc_v`` (the cache as float8 rows of ``D`` bytes, ``BS * (D + 4) / D`` rows per
    block: the values are its first ``BS`` rows), straight into shared memory for the ``wgmma``; keys past
    ``n_keys`` are read too (they are in the block) and their scores are never stored.
    """
    r = tl.arange(0, BLOCK_N)
    j = j0 + r
    if TMA:  # one bulk tensor copy of the block's [BS, D] values; a row outside the cache is zero-filled by it
        phys = tl.load(bt_row + (j0 // BS) * sbt_c)
        row = tl.where((phys >= 0) & (phys < n_blocks), phys, n_blocks) * (BS * (D + 4) // D)
        return desc_v.load([row.to(tl.int32), 0])
    if BLOCK_N == BS:
        phys = tl.load(bt_row + (j0 // BS) * sbt_c).to(tl.int64)  # one entry for the tile (j0: int64)
        ok = j < tl.where((phys >= 0) & (phys < n_blocks), n_keys, 0)  # (scalars first: one compare per key)
        off = r.to(tl.int64)
    else:
        valid = j < n_keys
        phys = tl.load(bt_row + (j // BS).to(tl.int64) * sbt_c, mask=valid, other=0).to(tl.int64)
        ok = valid & (phys >= 0) & (phys < n_blocks)
        off = (j % BS).to(tl.int64)
    d = tl.arange(0, D)
    vals = tl.load(cache_u8 + (phys * (BS * (D + 4)) + off * D)[:, None] + d[None, :], mask=ok[:, None], other=0)
    return vals.to(tl.float8e4nv, bitcast=True)


@triton.jit
def tile_blocks(bt_row, sbt_c, j0, n_keys, BS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The table entries (int64 ``[BLOCK_N]``, one per key; 0 where ``j >= n_keys``) of keys ``j0 ..``."""
    j = j0 + tl.arange(0, BLOCK_N)
    return tl.load(bt_row + (j // BS).to(tl.int64) * sbt_c, mask=j < n_keys, other=0).to(tl.int64)


@triton.jit
def tile_scales(cache_f32, phys, j0, n_keys, n_blocks, BS: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """The float32 scales ``[BLOCK_N]`` of keys ``j0 ..`` in blocks ``phys`` (:func:`tile_blocks`); 0 where
    ``j >= n_keys`` or the entry is not a block."""
    j = j0 + tl.arange(0, BLOCK_N)
    ok = (j < n_keys) & (phys >= 0) & (phys < n_blocks)
    return tl.load(cache_f32 + phys * (BS * (D + 4) // 4) + BS * D // 4 + (j % BS).to(tl.int64), mask=ok, other=0.0)


@triton.jit
def score_keys(keys, scale, q, w, Q_FP8: tl.constexpr):
    """``sum_h w[h] * relu(keys[n] . q[h]) * scale[n]`` -> float32 ``[N]``.

    Keys are the dot's M side (``[N, D] x [D, H]``, as DeepGEMM orients it): each warp's accumulator rows are
    keys and its columns heads, so the sum over heads stays inside a thread and its quad (shuffles), never
    through shared memory. FP8: float8e4nv operands, float32 accumulation (``wgmma`` on sm_90a); otherwise the
    keys are widened to float32 (exact) and the dot runs in IEEE float32. ReLU as ``maximum(s, 0)`` with NaN
    propagation (PTX ``max.NaN``: one instruction per score, where ``where(s < 0, 0, s)`` took a compare and a
    select; the plain ``maximum`` would drop NaN).
    """
    if Q_FP8:
        s = tl.dot(keys, tl.trans(q))
    else:
        s = tl.dot(keys.to(tl.float32), tl.trans(q), input_precision="ieee")
    s = tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL)
    return tl.sum(s * w[None, :], 1) * scale


@triton.jit
def load_query_pair(
    q_ptr, w_ptr, t, n_heads, sq_t, sq_h, sq_d, sw_t, sw_h, Q_FP8: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr
):
    """The queries of tokens ``t`` and ``t + 1`` as one ``[2 * H_PAD, D]`` operand (token ``t``'s heads first) and
    their weights ``[2 * H_PAD]``: one dot of ``N = 2 * H_PAD`` scores a key for both (padded heads read nothing)."""
    r = tl.arange(0, 2 * H_PAD)
    h = r % H_PAD
    tok = (t + r // H_PAD).to(tl.int64)
    d = tl.arange(0, D)
    hm = h < n_heads
    qp = q_ptr + (tok * sq_t + h.to(tl.int64) * sq_h)[:, None] + d[None, :].to(tl.int64) * sq_d
    if Q_FP8:
        q = tl.load(qp, mask=hm[:, None], other=0).to(tl.float8e4nv, bitcast=True)
    else:
        q = tl.load(qp, mask=hm[:, None], other=0.0).to(tl.float32)
    w = tl.load(w_ptr + tok * sw_t + h.to(tl.int64) * sw_h, mask=hm, other=0.0)
    return q, w


@triton.jit
def score_key_pairs(keys, scale, qq, ww, Q_FP8: tl.constexpr, H_PAD: tl.constexpr):
    """Both tokens' scores ``[N]``, ``[N]`` of keys ``keys`` from one dot ``[N, D] x [D, 2 * H_PAD]``
    (:func:`load_query_pair`): ReLU (NaN kept), the weights, then each token's half summed."""
    if Q_FP8:
        s = tl.dot(keys, tl.trans(qq))
    else:
        s = tl.dot(keys.to(tl.float32), tl.trans(qq), input_precision="ieee")
    s = tl.maximum(s, 0.0, propagate_nan=tl.PropagateNan.ALL) * ww[None, :]
    pair = tl.sum(tl.reshape(s, [s.shape[0], 2, H_PAD]), 2)
    a, b = tl.split(pair)
    return a * scale, b * scale


@triton.jit
def fill_columns(out_row, c_lo, c_hi, start, n_keys, bad, FILL_N: tl.constexpr):
    """Columns ``c_lo .. c_hi - 1`` of one output row that hold no key (keys are ``[start, start + n_keys)``):
    ``-inf``; every column when ``bad`` (a poisoned row): NaN. Tiles with no such column are skipped."""
    fill = tl.where(bad, float("nan"), float("-inf"))
    k_lo = tl.where(bad, c_hi, start)  # a poisoned row: every column is "before its keys"
    k_hi = start + n_keys
    for c0 in range(c_lo, c_hi, FILL_N):
        if (c0 < k_lo) | (c0 + FILL_N > k_hi):
            cols = c0 + tl.arange(0, FILL_N)
            m = (cols < c_hi) & ((cols < k_lo) | (cols >= k_hi))
            tl.store(out_row + cols, fill + tl.zeros([FILL_N], tl.float32), mask=m)


@triton.jit
def index_scores_kernel(
    q_ptr, w_ptr, cache_u8, cache_f32, desc_v, bt_ptr, req_ptr, bound_ptr, start_ptr, out_ptr,
    n_req, n_tbl, n_blocks, n_cols, n_heads, chunk,
    sq_t, sq_h, sq_d, sw_t, sw_h, sbt_r, sbt_c, so_t,
    HAS_STARTS: tl.constexpr, Q_FP8: tl.constexpr, NEXT_N: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, BLOCK_N: tl.constexpr, SCAN_N: tl.constexpr, FILL_N: tl.constexpr,
    TMA: tl.constexpr = False, chk_ptr=None, CHECK: tl.constexpr = False, CLEAR: tl.constexpr = False,
    PAIR_DOT: tl.constexpr = False,
):  # fmt: skip
    """Grid ``(T / NEXT_N, cdiv(n_cols, chunk))``: program ``(g, p)`` scores local keys ``[p * chunk, (p + 1) *
    chunk)`` for the ``NEXT_N`` (1 or 2) tokens of group ``g`` — each key tile read once for them all — and owns
    output columns ``[p * chunk, (p + 1) * chunk)`` of their rows (the fill).

    Row rule (:func:`token_meta`, :func:`count_bad_entries`): a token whose scalars, or whose needed table
    entries, are out of contract, and both tokens of a group that names two requests, are poisoned (NaN
    everywhere). Decode (no ``row_starts``): key ``j`` is column ``j``, inside this program's own columns, so the
    table scan runs after the keys are scored (its reads overlap the key stream's instead of delaying it; a
    poisoned row's columns are then overwritten, after a barrier). With ``row_starts`` a key may land in another
    program's columns, so the scan runs first and a poisoned row scores nothing.

    ``CHECK`` (``validate=True``): program ``(g, 0)`` of a group with a poisoned row sets ``chk[0]`` to 1 (atomic
    max); ``CLEAR``: program ``(0, 0)`` zeroes it first (the width the check kernel left there).
    """
    g = tl.program_id(0)
    p = tl.program_id(1)
    t0 = g * NEXT_N
    if CLEAR:
        if (g == 0) & (p == 0):
            tl.store(chk_ptr, tl.zeros([], tl.int64))
    req0, b0, s0, need0, bad0 = token_meta(req_ptr, bound_ptr, start_ptr, t0, n_req, n_tbl, n_cols, BS, HAS_STARTS)
    req1, b1, s1, need1, bad1 = req0, b0, s0, need0, bad0
    if NEXT_N == 2:
        req1, b1, s1, need1, bad1 = token_meta(req_ptr, bound_ptr, start_ptr, t0 + 1, n_req, n_tbl, n_cols, BS,
                                               HAS_STARTS)  # fmt: skip
        mixed = req1 != req0
        bad0 = bad0 | mixed
        bad1 = bad1 | mixed
        need0 = tl.where(mixed, 0, need0)
        need1 = tl.where(mixed, 0, need1)
    bt_row = bt_ptr + tl.minimum(tl.maximum(req0, 0), tl.maximum(n_req - 1, 0)) * sbt_r
    first = first_entries(bt_row, sbt_c, need0, need1, SCAN_N)  # (decode: read after the key loop)
    if HAS_STARTS:  # keys may land in other programs' columns: the whole verdict first
        e0, e1 = group_entries_bad(bt_row, sbt_c, first, need0, need1, n_blocks, SCAN_N)
        bad0 = bad0 | e0
        bad1 = bad1 | e1
    nk0 = tl.where(bad0, 0, b0)
    nk1 = tl.where(bad1, 0, b1)
    if PAIR_DOT:
        qq, ww = load_query_pair(q_ptr, w_ptr, t0, n_heads, sq_t, sq_h, sq_d, sw_t, sw_h, Q_FP8, H_PAD, D)
    else:
        q0, w0 = load_query(q_ptr, w_ptr, t0, n_heads, sq_t, sq_h, sq_d, sw_t, sw_h, Q_FP8, H_PAD, D)
        q1, w1 = q0, w0
        if NEXT_N == 2:
            q1, w1 = load_query(q_ptr, w_ptr, t0 + 1, n_heads, sq_t, sq_h, sq_d, sw_t, sw_h, Q_FP8, H_PAD, D)
    out0 = out_ptr + t0.to(tl.int64) * so_t
    out1 = out0 + so_t
    c_lo = p.to(tl.int64) * chunk
    c_hi = tl.minimum(c_lo + chunk, n_cols)
    j_hi = tl.minimum(c_lo + chunk, tl.maximum(nk0, nk1))
    nk = tl.maximum(nk0, nk1)
    # The scales are not a dot operand, so the compiler's pipeliner does not prefetch them: each tile's scales are
    # asked for one tile ahead, and the table entries they need two tiles ahead (no load is used in the iteration
    # that issues it; measured 2-4% faster at the median of 36 configurations than loading them in place).
    sc_next = tile_scales(cache_f32, tile_blocks(bt_row, sbt_c, c_lo, nk, BS, BLOCK_N), c_lo, nk, n_blocks, BS,
                          BLOCK_N, D)  # fmt: skip
    blk_next = tile_blocks(bt_row, sbt_c, c_lo + BLOCK_N, nk, BS, BLOCK_N)
    for j0 in range(c_lo, j_hi, BLOCK_N):
        keys = tile_values(cache_u8, desc_v, bt_row, sbt_c, j0, nk, n_blocks, BS, BLOCK_N, D, TMA)
        scale = sc_next
        sc_next = tile_scales(cache_f32, blk_next, j0 + BLOCK_N, nk, n_blocks, BS, BLOCK_N, D)
        blk_next = tile_blocks(bt_row, sbt_c, j0 + 2 * BLOCK_N, nk, BS, BLOCK_N)
        j = j0 + tl.arange(0, BLOCK_N)
        if PAIR_DOT:
            sa, sb = score_key_pairs(keys, scale, qq, ww, Q_FP8, H_PAD)
            tl.store(out0 + s0 + j, sa, mask=j < nk0)
            tl.store(out1 + s1 + j, sb, mask=j < nk1)
        else:
            tl.store(out0 + s0 + j, score_keys(keys, scale, q0, w0, Q_FP8), mask=j < nk0)
            if NEXT_N == 2:
                tl.store(out1 + s1 + j, score_keys(keys, scale, q1, w1, Q_FP8), mask=j < nk1)
    if not HAS_STARTS:  # decode: the table verdict now (this program's key columns are its own)
        e0, e1 = group_entries_bad(bt_row, sbt_c, first, need0, need1, n_blocks, SCAN_N)
        if e0 | e1:
            tl.debug_barrier()  # the scores just stored (by other threads) are overwritten below
        bad0 = bad0 | e0
        bad1 = bad1 | e1
    if CHECK:
        if (bad0 | bad1) & (p == 0):
            tl.atomic_max(chk_ptr, 1)
    fill_columns(out0, c_lo, c_hi, s0, nk0, bad0, FILL_N)
    if NEXT_N == 2:
        fill_columns(out1, c_lo, c_hi, s1, nk1, bad1, FILL_N)


@triton.jit
def index_scores_check_kernel(
    bt_ptr, req_ptr, bound_ptr, start_ptr, chk_ptr,
    n_req, n_tbl, n_blocks, n_cols, sbt_r, sbt_c,
    HAS_STARTS: tl.constexpr, NEXT_N: tl.constexpr, WIDTH: tl.constexpr, BS: tl.constexpr, SCAN_N: tl.constexpr,
):  # fmt: skip
    """Grid ``(T,)``: a validated call's value checks where the scoring kernel cannot run them — its width is
    not known yet (``out=None``), or it has no column to score (``L == 0``) and is not launched.

    Row ``t`` out of contract (:func:`token_meta` and its table entries, width ``n_cols``; or its group of
    ``NEXT_N`` tokens names two requests) raises ``chk[0]`` with an atomic max: to 1, or with ``WIDTH``
    (``n_cols`` is then :data:`NO_WIDTH`: no width to check) to ``NO_WIDTH``; a good row with ``WIDTH`` raises it
    to ``row_starts[t] + local_bounds[t]``, so the one host read gives the width ``L = max(row_starts +
    local_bounds)`` and the verdict together (an end at or past ``NO_WIDTH`` gives ``NO_WIDTH`` too: the host's
    own check decides)."""
    t = tl.program_id(0)
    req, bound, start, need, bad = token_meta(req_ptr, bound_ptr, start_ptr, t, n_req, n_tbl, n_cols, BS, HAS_STARTS)
    if NEXT_N > 1:
        bad = bad | (req != tl.load(req_ptr + (t // NEXT_N) * NEXT_N).to(tl.int64))
    row = bt_ptr + tl.minimum(tl.maximum(req, 0), tl.maximum(n_req - 1, 0)) * sbt_r
    bad = bad | (count_bad_entries(row, sbt_c, 0, tl.where(bad, 0, need), n_blocks, SCAN_N) > 0)
    if WIDTH:
        code = tl.where(bad, n_cols, start + bound)  # (not bad: both below NO_WIDTH, no wrap)
        if code > 0:
            tl.atomic_max(chk_ptr, code)
    else:
        if bad:
            tl.atomic_max(chk_ptr, 1)


#: The launch the plan takes per measured shape: ``(group size, T, L) -> (block_n, tiles, num_warps, num_stages,
#: tma, pair_dot)``, the fastest valid configuration of the committed device sweep :data:`PLANS_SOURCE` (printed by
#: ``benchmarks/bench_scoring.py --print-plans``; ``tests/test_scoring_plans.py`` checks that the two agree). The
#: group size is 2 for MTP (``next_n`` even: two tokens per read of a key; ``T`` counts tokens), else 1. Other
#: shapes take the nearest measured one (in log2 T and log2 L); block sizes other than 64 the heuristic below.
PLANS: dict[tuple[int, int, int], tuple[int, int, int, int, bool, bool]] = {
    (1, 1, 4096): (64, 1, 4, 3, True, False),  # 3.15 us
    (1, 1, 8192): (64, 1, 4, 4, True, False),  # 3.31 us
    (1, 1, 32768): (64, 2, 4, 4, True, False),  # 4.36 us
    (1, 1, 131072): (64, 4, 4, 4, True, False),  # 7.65 us
    (1, 32, 4096): (64, 4, 4, 4, True, False),  # 6.95 us
    (1, 32, 8192): (64, 8, 4, 4, True, False),  # 11.17 us
    (1, 32, 32768): (64, 24, 4, 6, True, False),  # 40.73 us
    (1, 32, 131072): (64, 48, 4, 6, True, False),  # 148.05 us
    (1, 128, 4096): (64, 16, 4, 6, True, False),  # 23.20 us
    (1, 128, 8192): (64, 24, 4, 6, True, False),  # 40.68 us
    (1, 128, 32768): (64, 48, 4, 6, True, False),  # 146.71 us
    (1, 128, 131072): (64, 48, 4, 6, True, False),  # 554.82 us
    (2, 2, 4096): (64, 1, 4, 4, True, True),  # 3.63 us
    (2, 2, 32768): (64, 2, 4, 4, True, True),  # 5.26 us
    (2, 2, 131072): (64, 8, 4, 6, True, True),  # 10.21 us
    (2, 64, 4096): (64, 8, 4, 6, True, True),  # 9.96 us
    (2, 64, 8192): (64, 8, 4, 6, True, False),  # 15.55 us
    (2, 64, 32768): (64, 32, 4, 6, True, False),  # 48.92 us
    (2, 64, 131072): (64, 64, 4, 6, True, False),  # 181.81 us
    (2, 256, 4096): (64, 16, 4, 6, True, False),  # 29.07 us
    (2, 256, 32768): (64, 64, 4, 6, True, False),  # 181.27 us
    (2, 256, 131072): (64, 48, 4, 6, True, False),  # 709.25 us
}
#: The sweep :data:`PLANS` was read from (H200, 2026-12-02).
PLANS_SOURCE = "benchmarks/results/scoring_sweep.json"
#: The cache block the table was measured for (DeepSeek V3.2's index-key cache).
PLANS_BLOCK_SIZE = 64


class ScoringPlan(NamedTuple):
    """How one call runs (see :func:`scoring_plan`; :func:`index_scores_triton` takes it as ``plan=`` and refuses,
    naming ``plan``, one that cannot run its call: another group size, too few columns, TMA its cache forbids)."""

    block_n: int  #: keys per tile (a power of two >= 16): the dot's M side
    tiles: int  #: tiles per program (each program scores ``block_n * tiles`` keys of its group)
    num_warps: int
    num_stages: int  #: software-pipelining depth of the key stream
    programs: int  #: programs per group of tokens (grid axis 1)
    group: int = 1  #: tokens per program that share each key read (2: MTP pairs)
    tma: bool = False  #: values by the bulk tensor copy engine (a tile is one block of 32 * k keys)
    pair_dot: bool = False  #: MTP pairs scored by one dot of N = 2 * heads (else one dot per token)
    #: ``tma=True`` was asked for (``scoring_plan(..., tma=True)``), not chosen by the plan: a cache the bulk copy
    #: cannot address (:func:`tma_fits`) is then refused, naming ``plan``, instead of falling back to ``cp.async``
    tma_forced: bool = False


def _pow2_arg(v: object, name: str, lo: int, hi: int) -> int:
    x = check_int_scalar(v, name, min_value=lo)
    if x & (x - 1) or x > hi:
        raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {x}")
    return x


def group_size(next_n: int) -> int:
    """Tokens one program scores from each key read: 2 when ``next_n`` is even (MTP pairs), else 1."""
    return 2 if next_n % 2 == 0 else 1


def _nearest_plan(group: int, rows: int, n_cols: int) -> tuple[int, int, int, int, bool, bool] | None:
    shapes = [(k[1], k[2]) for k in PLANS if k[0] == group]
    if not shapes:
        return None
    t, n = nearest_shapes(shapes, rows, n_cols)[0]
    return PLANS[(group, t, n)]


def scoring_plan(
    rows: int,
    n_cols: int,
    device: torch.device,
    *,
    next_n: int = 1,
    block_size: int = PLANS_BLOCK_SIZE,
    block_n: int | None = None,
    tiles: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    tma: bool | None = None,
    pair_dot: bool | None = None,
) -> ScoringPlan:
    """How :func:`index_scores_triton` scores ``rows`` query tokens (``next_n`` per request) over ``n_cols``
    columns of a cache of ``block_size``-key blocks (shapes only, no sync).

    Block size 64 (V3.2): the launch of the nearest shape in :data:`PLANS` (the committed sweep). Otherwise:
    ``block_n`` = the block size when it is a power of two in [16, 128] (a tile is then one block: one table
    entry, contiguous bytes), else 64; 4 warps; 4 pipeline stages; tiles per program such that about 8 programs
    per SM stay busy (1-32); the bulk tensor copy (``tma``) wherever a tile is one block of a multiple of 32 keys;
    MTP pairs by one dot (``pair_dot``; it has no effect without pairs). Each keyword overrides its part
    (``tma=True`` where a tile is not such a block: ``ValueError``; an explicit ``tma=True`` is recorded as
    ``tma_forced``, so that the call refuses a cache the bulk copy cannot address instead of falling back).

    The tuning keywords live here only: pass the plan to ``index_scores_triton(..., plan=)`` (made for at least
    the call's width, its ``next_n`` and its cache's ``block_size``).
    """
    rows = check_int_scalar(rows, "rows", min_value=0)
    n_cols = check_int_scalar(n_cols, "n_cols", min_value=0)
    next_n = check_int_scalar(next_n, "next_n", min_value=1)
    group = group_size(next_n)
    groups = max(1, rows // group)
    table = _nearest_plan(group, rows, n_cols) if block_size == PLANS_BLOCK_SIZE else None
    d_tma: bool | None = None  # (the heuristic: the bulk copy wherever a tile is one block of whole rows)
    d_pair = True  # (the heuristic: MTP pairs by one dot)
    if table is not None:
        d_bn, d_tiles, d_warps, d_stages, d_tma, d_pair = table
    else:
        d_bn = block_size if block_size in (16, 32, 64, 128) else 64
        n_tiles = cdiv(max(n_cols, 1), d_bn)
        d_tiles = max(1, min(32, (groups * n_tiles) // max(1, 8 * sm_count(device))))
        d_warps, d_stages = 4, 4
    block_n = _pow2_arg(d_bn if block_n is None else block_n, "block_n", 16, 512)
    if block_n > max(16, next_pow2(max(n_cols, 1))) and block_n == d_bn:
        block_n = max(16, next_pow2(max(n_cols, 1)))  # a short row: no tile wider than it
    n_tiles = cdiv(max(n_cols, 1), block_n)
    tiles = check_int_scalar(d_tiles if tiles is None else tiles, "tiles", min_value=1)
    tiles = max(min(tiles, n_tiles), cdiv(n_tiles, 65535))  # grid axis 1 <= 65535
    num_warps = _pow2_arg(d_warps if num_warps is None else num_warps, "num_warps", 1, 32)
    num_stages = check_int_scalar(d_stages if num_stages is None else num_stages, "num_stages", min_value=1)
    tma_ok = block_n == block_size and block_size % 32 == 0  # a tile is one block of whole 128-byte rows
    forced = False  # tma=True asked for, not chosen (ScoringPlan.tma_forced)
    if tma is None:
        tma = tma_ok and (d_tma is None or d_tma or block_n != d_bn)
    elif check_bool(tma, "tma") and not tma_ok:
        raise ValueError(f"tma=True needs block_n == block_size, a multiple of 32 (got {block_n}, {block_size})")
    else:
        forced = tma
    pair_dot = d_pair if pair_dot is None else check_bool(pair_dot, "pair_dot")
    pair_dot = group == 2 and pair_dot  # (no pairs at an odd next_n: one token per read)
    return ScoringPlan(block_n, tiles, num_warps, num_stages, cdiv(n_tiles, tiles), group, tma, pair_dot, forced)


def _plan_int(plan: ScoringPlan, field: str, lo: int, hi: int, pow2: bool = False) -> int:
    """A field of a caller's plan, a plain int in ``[lo, hi]`` (a power of two when ``pow2``); never read from a
    tensor (a ``validate=False`` call makes no host read)."""
    v = getattr(plan, field)
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"plan.{field} must be an int, got {type(v).__name__}: make the plan with scoring_plan")
    if not lo <= v <= hi or (pow2 and v & (v - 1)):
        kind = "a power of two" if pow2 else "an int"
        raise ValueError(f"plan.{field} must be {kind} in [{lo}, {hi}], got {v}: make the plan with scoring_plan")
    return v


def _check_plan(plan: object, a: ScoringArgs, n_cols: int | None) -> ScoringPlan:
    """``plan`` when it can run this call — well formed, ``a.next_n``'s group size, TMA only where a tile is one
    block of the cache (``block_n == block_size``, a multiple of 32 keys), and (``n_cols`` given) its programs
    covering the ``n_cols`` columns; a ``ValueError`` naming ``plan`` otherwise (a ``TypeError`` when it is not a
    :class:`ScoringPlan`). ``n_cols=None``: the width is not known yet (a validated call without ``out``), and
    the call checks the plan again once the values gave it."""
    if not isinstance(plan, ScoringPlan):
        raise TypeError(f"plan must be a ScoringPlan (scoring_plan makes it) or None, got {type(plan).__name__}")
    for field, lo, hi, pow2 in (
        ("block_n", 16, 512, True),
        ("tiles", 1, 2**31 - 1, False),
        ("num_warps", 1, 32, True),
        ("num_stages", 1, 2**31 - 1, False),
        ("programs", 1, 65535, False),  # (grid axis 1 <= 65535)
    ):
        _plan_int(plan, field, lo, hi, pow2)
    for field in ("tma", "pair_dot", "tma_forced"):
        check_bool(getattr(plan, field), f"plan.{field}")
    group = group_size(a.next_n)
    if plan.group != group:  # the grid and every token's row come from the group: another one skips or overruns rows
        raise ValueError(
            f"plan scores groups of {plan.group} token(s), but this call's next_n={a.next_n} needs groups of "
            f"{group}: make it with scoring_plan(rows, n_cols, device, next_n={a.next_n}, ...)"
        )
    if plan.pair_dot and plan.group != 2:  # one dot for a pair reads and writes the row after the group's token
        raise ValueError("plan has pair_dot=True, which needs groups of 2 tokens (an even next_n)")
    if plan.tma and not (plan.block_n == a.block_size and a.block_size % 32 == 0):
        # the bulk copy loads one block's [block_size, 128] values per tile: no other tile is one copy
        raise ValueError(
            f"plan has tma=True, which needs block_n == the cache's block_size, a multiple of 32 (got block_n="
            f"{plan.block_n}, block_size={a.block_size}): make it with scoring_plan(..., block_size={a.block_size})"
        )
    if n_cols is not None and plan.programs * plan.tiles * plan.block_n < n_cols:
        # program p owns columns [p * chunk, (p + 1) * chunk): columns past the last program's would stay unwritten
        raise ValueError(
            f"plan covers {plan.programs * plan.tiles * plan.block_n} columns ({plan.programs} programs x "
            f"{plan.tiles} tiles x {plan.block_n} keys), fewer than this call's {n_cols}: make it with "
            f"scoring_plan(rows, n_cols, device, ...) for n_cols >= {n_cols}"
        )
    return plan


def kernel_views(a: ScoringArgs, index_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, cache as uint8, cache as float32)``: the views the kernels read (no copy).

    An FP8 query is passed as its bytes (bitcast back in the kernel).
    """
    q = index_q.view(torch.uint8) if index_q.dtype == torch.float8_e4m3fn else index_q
    flat = a.blocks.reshape(-1)
    return q, flat, flat.view(torch.float32)


def tma_fits(a: ScoringArgs, cache_u8: torch.Tensor) -> bool:
    """Whether the bulk copy can address this cache: 16-byte aligned, under 2**31 rows of 128 bytes (int32 rows)."""
    rows = a.num_blocks * (a.block_size * (INDEX_K_FP8.head_dim + 4) // INDEX_K_FP8.head_dim)
    return rows < 2**31 and cache_u8.data_ptr() % 16 == 0


def value_descriptor(a: ScoringArgs, cache_u8: torch.Tensor) -> object:
    """The bulk-copy (TMA) descriptor of the cache's values: the bytes as float8 rows of 128, ``block_size * 132 /
    128`` rows per block, a box of ``[block_size, 128]`` (a block's values). Built per call on the host (a small
    object; the driver encodes it at launch, and a CUDA graph keeps it as a kernel parameter)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    D = INDEX_K_FP8.head_dim
    rows = a.num_blocks * (a.block_size * (D + 4) // D)
    if not tma_fits(a, cache_u8):
        raise ValueError("tma=True needs a 16-byte aligned index_cache of fewer than 2**31 rows of 128 bytes")
    flat = cache_u8.view(torch.float8_e4m3fn)[: rows * D].view(rows, D)
    return TensorDescriptor(flat, [rows, D], [D, 1], [a.block_size, D])


def _check_device(index_q: torch.Tensor) -> None:
    """After the shared checks (same inputs, same messages as the reference): what only the kernel refuses."""
    if index_q.dtype not in KERNEL_Q_DTYPES:
        raise TypeError(
            "index_q must be float8_e4m3fn, float16, bfloat16 or float32 for the Triton kernel (float64 is the "
            f"reference's only), got {str(index_q.dtype).replace('torch.', '')}"
        )
    dev = index_q.device
    if dev.type != "cuda" and not triton_interpreting():
        raise ValueError(
            f"index_q must be a CUDA tensor (or set TRITON_INTERPRET=1 for the CPU interpreter), got {dev}"
        )


def index_scores_triton(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_of_token: torch.Tensor,
    local_bounds: torch.Tensor,
    geometry: DcpGeometry,
    *,
    row_starts: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    validate: bool = True,
    next_n: int = 1,
    plan: ScoringPlan | None = None,
) -> torch.Tensor:
    """This rank's index scores ``[T, L]`` from its FP8 index-key cache, on the GPU (one launch with ``out``).

    Same arguments, result (up to float32 rounding: the kernel accumulates in float32, the
    reference in float64), checks and messages as :func:`dcp_ref.scoring.index_scores`, whose
    docstring states the contract and the ``validate=False`` poison rule; ``index_q`` may be
    float8_e4m3fn, fp16, bf16 or float32 here.

    ``next_n`` (MTP): tokens come in groups of ``next_n`` consecutive tokens of one request; with an even
    ``next_n`` each program scores two of them from one read of each key (half the bytes per token).

    ``validate=True`` checks the values on the device, from the rule the kernel poisons by (a row the
    reference refuses is exactly a poisoned row): the scoring launch raises a flag (the shared
    :func:`~dcp_ref.kernels._util.check_flag`) and the call reads it once, after the launch; only a failing
    call reads more, to raise the reference's message (``out`` then holds the poisoned rows). Without
    ``out`` the width ``max(row_starts + local_bounds)`` is the values' too: a small check kernel first
    gives it and the verdict in the same one read (two launches).

    ``plan``: how the call runs, a :class:`ScoringPlan` from :func:`scoring_plan` (which alone takes the tuning:
    ``block_n``, ``tiles``, ``num_warps``, ``num_stages``, ``tma``, ``pair_dot``), used as is. It must fit the
    call, else a ``ValueError`` naming ``plan`` (a ``TypeError`` when it is not a ScoringPlan): the group size of
    ``next_n``, programs that cover the width ``L`` (``programs * tiles * block_n >= L``; without ``out`` in a
    validated call it is checked once the values gave ``L``), and ``tma=True`` only where a tile is one cache block
    of a multiple of 32 keys. A plan with ``tma=True`` on a cache the bulk copy cannot address (:func:`tma_fits`:
    not 16-byte aligned, or 2**31 rows or more) falls back to ``cp.async`` (the same scores) when the plan chose
    TMA itself, and raises a ``ValueError`` naming ``plan`` when ``tma=True`` was asked for
    (``plan.tma_forced``). ``None``: ``scoring_plan(T, L, index_q.device, next_n=next_n,
    block_size=<the cache's>)``, the default plan by shape (re-made once a validated call without ``out`` knows
    ``L``).

    Returns:
        float32 ``[T, L]`` (``out`` when given).
    """
    validate = check_bool(validate, "validate")
    # The reference's free checks, in its order (types, shapes, devices); its value checks run on the device.
    # Without `out`, a validated call's width is max(row_starts + local_bounds), which only the values give:
    # n_cols=0 stands for it here, and the check kernel reads it with the verdict.
    width_from_values = validate and out is None
    args = (index_q, weights, index_cache, block_table, req_of_token, local_bounds, geometry, row_starts, out)
    a = check_scoring_inputs(*args, False, n_cols=0 if width_from_values else None, next_n=next_n)
    T, L = a.T, a.L
    dev = index_q.device
    check = validate and T > 0
    reference_check = lambda: check_scoring_inputs(*args, True, next_n=next_n)  # noqa: E731  (raises its message)
    if check:  # the reference refuses a meta tensor before reading any value
        for name, tensor in (("req_of_token", req_of_token), ("local_bounds", local_bounds),
                             ("row_starts", row_starts), ("block_table", block_table)):  # fmt: skip
            if tensor is not None:
                check_values_readable(tensor, name)
    own_plan = plan is None
    try:
        _check_device(index_q)
        if plan is None:  # (re-planned below once the width is known, without `out`)
            plan = scoring_plan(T, L, dev, next_n=a.next_n, block_size=a.block_size)
        else:  # (without `out` its width is checked below, once the values gave it)
            plan = _check_plan(plan, a, None if width_from_values else L)
    except (TypeError, ValueError):
        if check:  # the reference's value checks came first: a bad value is still the error reported
            reference_check()
        raise
    starts = row_starts if row_starts is not None else local_bounds  # never read without HAS_STARTS
    meta = (block_table, req_of_token, local_bounds, starts)
    chk = check_flag(dev) if check else None
    clear = False  # whether the scoring launch zeroes the flag (the width the check kernel left in it)
    if chk is not None and (width_from_values or L == 0):
        # No scoring launch can check these values (the width is not known yet, or there is no column to score):
        # the check kernel does, and its flag is the one host read (without `out` it carries the width too).
        index_scores_check_kernel[(T,)](
            *meta, chk, a.B, a.M, a.num_blocks, NO_WIDTH if width_from_values else L,
            block_table.stride(0), block_table.stride(1),
            HAS_STARTS=row_starts is not None, NEXT_N=a.next_n, WIDTH=width_from_values, BS=a.block_size,
            SCAN_N=SCAN,
        )  # fmt: skip
        code = int(chk.item())  # the one host read of this validated call
        if width_from_values and code < NO_WIDTH:
            L, clear = code, code > 0  # every row is in contract; a width of 0 left the flag at 0
        elif code:
            chk.zero_()
            a = reference_check()  # raises the reference's message
            if not width_from_values:
                raise AssertionError("the scoring check flagged a row that the reference accepts (a kernel bug)")
            L = a.L  # an end too large for the flag's code (>= 2**62): the host's width
        chk, check = (chk if clear else None), False
    try:
        if width_from_values:
            if own_plan:
                plan = scoring_plan(T, L, dev, next_n=a.next_n, block_size=a.block_size)
            else:
                plan = _check_plan(plan, a, L)
            out = torch.empty((T, L), dtype=torch.float32, device=dev)
        elif out is None:
            out = torch.empty((T, L), dtype=torch.float32, device=dev)
        if T == 0 or L == 0:
            return out
        q, cache_u8, cache_f32 = kernel_views(a, index_q)
        if plan.tma and not tma_fits(a, cache_u8):
            # TMA the plan chose (by shape, before any cache was seen) gives way to cp.async: the same scores. TMA
            # the caller asked for (scoring_plan(tma=True): a sweep or a test that must run the bulk copy) is refused
            # instead, so that what runs is never silently another kernel than the one asked for.
            if not plan.tma_forced:
                plan = plan._replace(tma=False)
            else:
                if check:  # a bad value is still the error reported (as for every other refusal)
                    reference_check()
                raise ValueError(
                    "plan asks for tma=True (scoring_plan(..., tma=True)), which needs a 16-byte aligned index_cache "
                    "of fewer than 2**31 rows of 128 bytes: make the plan with tma=None (the bulk copy where it "
                    "fits) or tma=False for this cache"
                )
        desc_v = value_descriptor(a, cache_u8) if plan.tma else None
        index_scores_kernel[(T // plan.group, plan.programs)](
            q, weights, cache_u8, cache_f32, desc_v, *meta, out,
            a.B, a.M, a.num_blocks, L, a.H, plan.block_n * plan.tiles,
            q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
            block_table.stride(0), block_table.stride(1), out.stride(0),
            HAS_STARTS=row_starts is not None, Q_FP8=index_q.dtype == torch.float8_e4m3fn, NEXT_N=plan.group,
            H_PAD=max(16, next_pow2(a.H)), D=INDEX_K_FP8.head_dim, BS=a.block_size, BLOCK_N=plan.block_n,
            SCAN_N=SCAN, FILL_N=FILL, TMA=plan.tma, num_warps=plan.num_warps, num_stages=plan.num_stages,
            chk_ptr=chk, CHECK=check, CLEAR=clear, PAIR_DOT=plan.pair_dot,
        )  # fmt: skip
    except BaseException:
        if clear:  # the launch that was to zero the flag did not run
            assert chk is not None
            chk.zero_()
        raise
    if check:  # the kernel raised the flag for a row the reference refuses (that row is poisoned in `out`)
        raise_if_flagged(chk, reference_check, "the scoring kernel")
    return out
