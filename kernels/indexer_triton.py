"""Triton kernel: the indexer stage's local top-K, fused with the candidate pack.

The GPU twin of ``pack_candidates(scores, local_topk(scores, k, lengths, row_starts), geometry,
row_starts)`` (:mod:`dcp_ref.indexer`, :mod:`dcp_ref.topk`): each row of this rank's indexer scores
gets its top-``k`` local keys by the stable order (score descending as float32 with
``-0.0 == +0.0``, NaN invalid, then lower index), written straight into the all-gather buffer as
``(score, float(global id))`` pairs — or, with ``order="rank_local"``, as their scores (float32
``[T, k]``, NaN padding) plus their local indices (int32 ``[T, k]``, ``-1`` padding), the winners in
ascending local index order (:func:`dcp_ref.indexer.local_topk_rank_local`).

**Keys.** Every score becomes a 32-bit unsigned key whose unsigned order is the score order
(:func:`order_key`); NaN and columns outside the row's window get key ``0`` (invalid). The index is
not part of the key: keys that tie on all 32 bits are resolved by position when the winners are
written (:func:`commit_tile`: an exclusive prefix count of the tied keys, so the lowest indices win).

**Selecting the k-th key of a tile held in registers** (two interchangeable ways, ``select=``):

* ``"radix"`` (:func:`select_threshold`): MSB-first digits of ``RADIX_BITS`` bits; each pass
  histograms the digit of the keys that still match the prefix chosen so far (``tl.histogram``:
  one warp ballot per digit bit per key, ~40 instructions per key and pass at 5 bits) and
  :func:`choose_bin` picks the bin holding the k-th largest key; up to 7 passes.
* ``"search"`` (:func:`search_threshold`): a bracket ``[A, B)`` of keys with known counts
  ``#(key >= A) >= k > #(key >= B)`` (from the tile's min and max), narrowed by counting the keys at
  or above ``PIVOTS`` pivots per step (~2 instructions per key and pivot, one reduction). The pivots
  interpolate the count linearly in *score* space between the bracket's ends (a secant step), and
  fall back to evenly spaced keys whenever an interpolated step failed to halve the bracket, so that
  it always ends (at most ~34 steps). It ends when a pivot holds exactly ``k`` keys at or above it,
  or when the bracket is one key wide (ties on all 32 bits). A step costs about half a radix pass
  (SASS, sm_90a) but takes more of them: a NumPy simulation of the same arithmetic needs 4-11 steps
  for 2048 of 8192 normal scores and 10-22 on 16-value ties, against ~5 and at most 7 radix passes;
  so the default is :data:`DEFAULT_SELECT` (``"radix"``) until the benchmark's sweep says otherwise.
  The compacted path's sample bound (below) always uses the search, stopped early: it only needs
  an approximate rank.

**Three ways to run a row** (:func:`launch_plan` chooses; every one exact):

1. *One tile* (a row of up to :data:`MAX_TILE` keys, :func:`indexer_topk_pack_kernel` with
   ``ONE_CHUNK``): the row is read once and kept in registers; select, then write the winners.
2. *Compacted* (longer rows where :func:`prefer_compact` says it pays, or ``compact=True``;
   :func:`filter_topk_kernel`): a strided **sample** of the row gives a lower bound ``lo`` aimed at
   about ``sqrt(k * cap)`` keys at or above it (:func:`sample_bound`);
   one streamed read **compacts** the keys ``>= lo`` — ``(score bits, local index)``, in index order —
   into a per-row list of ``cap`` entries in the planned workspace (:func:`filter_segment`); the
   row's top-``k`` is then selected among the list, held in registers, and written from it. No
   second read of the row. Exact whenever ``k <= #(key >= lo) <= cap`` (the list holds every winner);
   when the list overflowed on ties at ``lo``, either the threshold *is* ``lo`` (``#(key > lo) < k``:
   one streamed pass writes the row's keys above it plus its lowest-index ties) or the keys ``> lo``
   fit the list (one streamed pass lists them instead); any other miss (rare: a sample far from the
   row) falls back to the streamed radix select of path 3 (:func:`finish_filtered`).
   With ``split=S > 1`` (few long rows) the row is cut into ``S`` segments, one program each, every
   one filtering its segment against the same ``lo`` (the sample is the row's, taken identically by
   all); the **last** program of the row to finish (an atomic counter in the workspace,
   acquire/release) joins the ``S`` lists in segment order and selects — one launch.
3. *Streamed radix* (the other longer rows, ``compact=False``, and the fallback): every radix pass
   re-reads the row tile by tile; ``split=S`` then keeps each segment's exact top-``k`` in a
   ``[T, S, k, 2]`` workspace and a second launch selects among them (further levels while they exceed
   a tile). Exact for the indexer's own reason: a key of the row's top-``k`` is in its segment's top-``k``.

Every load is masked by the row's window, clamped on the device, so even with ``validate=False``
nothing outside ``scores`` is read. No host synchronisation with ``validate=False``, no allocation
with ``out=`` (and ``workspace=`` where the plan needs one): capturable in a CUDA graph. With
``validate=True`` the window checks run inside the kernel (a flag raised only by a bad row), and the
call reads that one flag back: one host read, after the launch.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, overload

import torch
import triton
import triton.language as tl

from dcp_ref.contracts import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_bool,
    check_int_scalar,
    check_no_aliases,
    check_tensor,
    triton_interpreting,
)
from dcp_ref.geometry import DcpGeometry, check_geometry

from ._util import cdiv, check_flag, next_pow2, sm_count

__all__ = [
    # keys and windows
    "order_key",
    "key_to_score",
    "row_window",
    "check_window",
    "load_keys",
    "load_scores",
    # the radix select
    "digit_histogram",
    "row_histogram",
    "choose_bin",
    "select_threshold",
    # the count search
    "count_at_least",
    "valid_count_max_min",
    "search_bracket",
    "search_threshold",
    # writing the winners
    "local_to_global_ids",
    "pack_pair",
    "winners",
    "commit_tile",
    "write_padding",
    "commit_row",
    "select_commit",
    # the compacted path
    "sample_bound",
    "filter_segment",
    "join_lists",
    "commit_entries",
    "select_listed",
    "finish_filtered",
    # kernels
    "indexer_topk_pack_kernel",
    "filter_topk_kernel",
    # planning and the call
    "MAX_TILE",
    "STREAM_TILE",
    "DEFAULT_RADIX_BITS",
    "DEFAULT_SELECT",
    "DEFAULT_PIVOTS",
    "COMPACT_LONE_ROWS",
    "COMPACT_LONG_COLS",
    "COMPACT_MANY_ROWS",
    "COMPACT_MIN_COLS",
    "prefer_compact",
    "SELECTS",
    "ORDERS",
    "LaunchPlan",
    "launch_plan",
    "scores_vec",
    "compact_cap",
    "workspace_for",
    "compact_paths",
    "indexer_topk_pack",
]

_MAX_EXACT_ID = 1 << 24
_INT64_MIN = -(1 << 63)


@triton.jit
def order_key(x):
    """float32 scores -> uint32 keys whose unsigned order is the score order; NaN -> 0 (invalid).

    Non-negative floats get their sign bit set, negative floats all bits flipped (a more negative
    float gets a smaller key); ``-0.0`` is first made ``+0.0`` so the two tie. Every valid key is
    ``>= key(-inf) = 0x007FFFFF``, so ``0`` is free to mean "not a candidate".
    """
    bits = x.to(tl.uint32, bitcast=True)
    bits = tl.where(x == 0.0, tl.zeros_like(bits), bits)
    key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
    return tl.where(x != x, tl.zeros_like(key), key)


@triton.jit
def key_to_score(key):
    """The float32 score of a valid key (``key(-inf) <= key <= key(+inf)``): :func:`order_key`'s inverse
    (``+0.0`` for the key of zero)."""
    bits = tl.where(key >= 0x80000000, key ^ 0x80000000, key ^ 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def row_window(lengths_ptr, starts_ptr, row, n_cols, HAS_LENGTHS: tl.constexpr, HAS_STARTS: tl.constexpr):
    """``(start, n)`` of one row: local key ``j < n`` lives in column ``start + j``.

    Clamped on the device (``0 <= start <= n_cols``, ``0 <= n <= n_cols - start``) so that bad
    ``lengths`` / ``row_starts`` can never make the kernel read outside the row, even when the host
    checks were skipped (``validate=False``).
    """
    start = tl.zeros([], tl.int64)
    if HAS_STARTS:
        start = tl.load(starts_ptr + row).to(tl.int64)
        start = tl.minimum(tl.maximum(start, 0), n_cols)
    n = n_cols - start
    if HAS_LENGTHS:
        n = tl.minimum(tl.maximum(tl.load(lengths_ptr + row).to(tl.int64), 0), n)
    return start.to(tl.int32), n.to(tl.int32)


@triton.jit
def check_window(chk_ptr, lengths_ptr, starts_ptr, row, n_cols, HAS_LENGTHS: tl.constexpr, HAS_STARTS: tl.constexpr):
    """``validate=True``: raise the flag ``chk_ptr[0]`` (an atomic max to 1) when row ``row``'s raw window
    is out of contract (``row_starts`` outside ``[0, n_cols]``, a negative ``lengths``, or a window past
    the last column). A good row writes nothing, so a good batch costs no atomic at all; the host reads
    the flag once and, when it is set, re-runs its own checks for the precise message."""
    s = tl.zeros([], tl.int64)
    bad = s != 0
    if HAS_STARTS:
        s = tl.load(starts_ptr + row).to(tl.int64)
        bad = (s < 0) | (s > n_cols)
    if HAS_LENGTHS:
        n = tl.load(lengths_ptr + row).to(tl.int64)
        # n > n_cols first: s + n cannot overflow once both are at most n_cols.
        bad = bad | (n < 0) | (n > n_cols) | (s + n > n_cols)
    if bad:
        tl.atomic_max(chk_ptr, 1)


@triton.jit
def load_keys(row_ptr, offs, n, stride_c):
    """Keys of local keys ``offs`` of one row (masked: ``offs >= n`` reads nothing, key 0)."""
    in_row = offs < n
    x = tl.load(row_ptr + offs * stride_c, mask=in_row, other=0.0).to(tl.float32)
    key = order_key(x)
    return tl.where(in_row, key, tl.zeros_like(key))


@triton.jit
def load_scores(row_ptr, offs, n, stride_c):
    """``(bits, keys)`` of local keys ``offs``: the float32 bits of each score (exact: ``-0.0`` stays
    ``-0.0``) and its key (masked: ``offs >= n`` reads nothing, key 0)."""
    in_row = offs < n
    x = tl.load(row_ptr + offs * stride_c, mask=in_row, other=0.0).to(tl.float32)
    key = order_key(x)
    return x.to(tl.uint32, bitcast=True), tl.where(in_row, key, tl.zeros_like(key))


@triton.jit
def digit_histogram(keys, hi_mask, prefix, shift, NBINS: tl.constexpr):
    """Histogram of the digit ``(key >> shift) % NBINS`` over the valid keys (``key != 0``) whose
    bits under ``hi_mask`` equal ``prefix`` (the bits chosen by earlier passes; ``hi_mask = 0`` in
    the first pass, so that its histogram counts every valid key)."""
    match = ((keys & hi_mask) == prefix) & (keys != 0)
    digit = ((keys >> shift) & (NBINS - 1)).to(tl.int32)
    return tl.histogram(digit, NBINS, mask=match)


@triton.jit
def row_histogram(
    row_ptr, n, stride_c, keys, hi_mask, prefix, shift, NBINS: tl.constexpr, TILE: tl.constexpr, ONE_CHUNK: tl.constexpr
):
    """:func:`digit_histogram` over the whole row: of the keys held in registers (``ONE_CHUNK``),
    or of the row streamed tile by tile (``keys`` unused), the next tile's load in flight while
    the current one is counted."""
    if ONE_CHUNK:
        hist = digit_histogram(keys, hi_mask, prefix, shift, NBINS)
    else:
        hist = tl.zeros([NBINS], tl.int32)
        offs = tl.arange(0, TILE)
        nxt = load_keys(row_ptr, offs, n, stride_c)
        for c in range(0, n, TILE):
            cur = nxt
            nxt = load_keys(row_ptr, c + TILE + offs, n, stride_c)
            hist += digit_histogram(cur, hi_mask, prefix, shift, NBINS)
    return hist


@triton.jit
def choose_bin(hist, need, NBINS: tl.constexpr):
    """The bin holding the ``need``-th largest key: ``(bin, keys in higher bins, keys in bin)``.

    ``at_or_above[b]`` (keys in bins ``>= b``, a suffix sum) never grows with ``b``, so the chosen
    bin is the number of bins with ``at_or_above >= need``, minus one. Requires
    ``1 <= need <= sum(hist)``.
    """
    at_or_above = tl.cumsum(hist, 0, reverse=True)
    b = tl.sum((at_or_above >= need).to(tl.int32), 0) - 1
    is_b = tl.arange(0, NBINS) == b
    count = tl.sum(tl.where(is_b, hist, 0), 0)
    above = tl.sum(tl.where(is_b, at_or_above, 0), 0) - count
    return b, above, count


@triton.jit
def select_threshold(
    row_ptr, n, stride_c, keys, k, RADIX_BITS: tl.constexpr, TILE: tl.constexpr, ONE_CHUNK: tl.constexpr
):
    """Radix select of the row's ``k``-th largest key, most significant digit first.

    Returns ``(hi_mask, prefix, need, count, n_sel)``: the winners are the keys with
    ``key & hi_mask > prefix``, plus ``need`` of the ``count`` keys with ``key & hi_mask == prefix``
    (all of them when ``need == count``; otherwise they tie on the whole key and the lowest-index
    ``need`` win). ``n_sel = min(k, valid keys)`` winners in all.
    """
    tl.static_assert(RADIX_BITS >= 5 and RADIX_BITS <= 13)
    NBINS: tl.constexpr = 1 << RADIX_BITS
    shift = tl.full([], 32 - RADIX_BITS, tl.uint32)
    zero = tl.zeros([], tl.uint32)
    hist = row_histogram(row_ptr, n, stride_c, keys, zero, zero, shift, NBINS, TILE, ONE_CHUNK)
    # The histograms count valid keys only (key != 0), so the first one sums to the valid count;
    # invalid keys (NaN, outside the row) can never be chosen, whatever the digit width.
    n_valid = tl.sum(hist, 0)
    # At most k valid keys: all of them win (key > 1; no key equals 1).
    hi_mask = tl.full([], 0xFFFFFFFF, tl.uint32)
    prefix = tl.full([], 1, tl.uint32)
    need = tl.zeros([], tl.int32)
    count = tl.zeros([], tl.int32)
    if n_valid > k:
        hi_mask = zero
        prefix = zero
        need = k + tl.zeros([], tl.int32)
        go = n_valid > k
        while go:
            b, above, count = choose_bin(hist, need, NBINS)
            # The last digit may overlap bits fixed earlier; every matching key has those bits
            # equal to the prefix's, so OR-ing them in again changes nothing.
            prefix = prefix | (b.to(tl.uint32) << shift)
            hi_mask = hi_mask | (tl.full([], NBINS - 1, tl.uint32) << shift)
            need = need - above
            go = (count > need) & (shift > 0)
            if go:
                shift = tl.where(shift > RADIX_BITS, shift - RADIX_BITS, 0).to(tl.uint32)
                hist = row_histogram(row_ptr, n, stride_c, keys, hi_mask, prefix, shift, NBINS, TILE, ONE_CHUNK)
    return hi_mask, prefix, need, count, tl.minimum(n_valid, k)


@triton.jit
def count_at_least(keys, p0, p1, p2, PIVOTS: tl.constexpr):
    """``(#(keys >= p0), #(keys >= p1), #(keys >= p2))`` over a tile held in registers, in one reduction.

    The three comparisons share one int64 sum, in 21-bit fields (so tiles of up to ``2**21`` keys).
    With ``PIVOTS == 1`` only ``p1`` is counted (and its count returned three times).
    """
    if PIVOTS == 1:
        c1 = tl.sum((keys >= p1).to(tl.int32), 0)
        c0 = c1
        c2 = c1
    else:
        v = (keys >= p0).to(tl.int64) | ((keys >= p1).to(tl.int64) << 21) | ((keys >= p2).to(tl.int64) << 42)
        s = tl.sum(v, 0)
        c0 = (s & 0x1FFFFF).to(tl.int32)
        c1 = ((s >> 21) & 0x1FFFFF).to(tl.int32)
        c2 = (s >> 42).to(tl.int32)
    return c0, c1, c2


@triton.jit
def _cnt_max_min(a0, a1, a2, b0, b1, b2):
    return a0 + b0, tl.maximum(a1, b1), tl.minimum(a2, b2)


@triton.jit
def valid_count_max_min(keys):
    """``(valid keys, largest key, smallest valid key)`` of a tile, in one reduction."""
    valid = keys != 0
    return tl.reduce((valid.to(tl.int32), keys, tl.where(valid, keys, 0xFFFFFFFF)), 0, _cnt_max_min)


@triton.jit
def search_bracket(keys, r, A, cA, B, cB, tol, PIVOTS: tl.constexpr, max_steps=1 << 30):
    """Narrow the key bracket ``[A, B)`` around the ``r``-th largest key of a tile held in registers.

    On entry and on exit ``cA = #(keys >= A) >= r > cB = #(keys >= B)`` (``A < B``: int64 keys). Each
    step counts the keys at or above ``PIVOTS`` pivots strictly inside the bracket
    (:func:`count_at_least`) and keeps the sub-bracket that holds the ``r``-th largest key. It stops
    when ``cA == r`` (the ``r`` largest keys are exactly the keys ``>= A``), when ``B == A + 1`` (the
    ``r``-th largest key is ``A``, and ``cA - cB`` keys tie on it), when at most ``tol`` keys are
    left in the bracket (``cA - cB <= tol``: an approximate rank is all the caller wants), or after
    ``max_steps`` steps (any bracket is still valid: ``A`` is then a looser lower bound).

    Pivots: the ``r``-th key's score is interpolated linearly between the bracket's end scores (from
    the two counts: a secant step), the other pivots ``dc`` keys to either side (``dc``: twice the
    square root of the keys left, the typical error of that interpolation, a quarter of them at first).
    A step whose interpolation did not halve the keys left is followed by a step of evenly spaced keys
    (the key range shrinks at least 4-fold, 2-fold with one pivot), so that the search ends after at
    most about 34 steps whatever the scores; non-finite end scores (``+-inf``, a range that overflows)
    take evenly spaced keys too. Every pivot is clamped into ``[A + 1, B - 1]``: each step shrinks the
    bracket.
    """
    m = cA - cB
    dc = (m // 4).to(tl.float32) + 1.0
    uni = tl.zeros([], tl.int32)
    steps = tl.zeros([], tl.int32)
    go = (cA != r) & (B - A > 1) & (m > tol)
    while go:
        span = B - A
        v_a = key_to_score(A.to(tl.uint32))
        v_b = key_to_score((B - 1).to(tl.uint32))
        # Only finite ends interpolate; the arithmetic never meets inf - inf (no NaN, even where unused).
        finite = (v_a > float("-inf")) & (v_b < float("inf"))
        v_a = tl.where(finite, v_a, 0.0)
        width = tl.where(finite, v_b, 1.0) - v_a  # may overflow to +inf: then evenly spaced keys
        interp = (uni == 0) & finite & (width > 0.0) & (width < float("inf"))
        width = tl.where(interp, width, 0.0)
        mf = (cA - cB).to(tl.float32)
        drop = (cA - r).to(tl.float32) - 0.5  # keys to pass from A to reach count r + 1/2
        if PIVOTS == 1:
            t1 = tl.minimum(tl.maximum(drop / mf, 0.0), 1.0)
            p1 = tl.where(interp, order_key(v_a + t1 * width).to(tl.int64), A + span // 2)
            p1 = tl.minimum(tl.maximum(p1, A + 1), B - 1)
            p0 = p1
            p2 = p1
        else:
            t0 = tl.minimum(tl.maximum((drop - dc) / mf, 0.0), 1.0)
            t1 = tl.minimum(tl.maximum(drop / mf, 0.0), 1.0)
            t2 = tl.minimum(tl.maximum((drop + dc) / mf, 0.0), 1.0)
            p0 = tl.where(interp, order_key(v_a + t0 * width).to(tl.int64), A + span // 4)
            p1 = tl.where(interp, order_key(v_a + t1 * width).to(tl.int64), A + span // 2)
            p2 = tl.where(interp, order_key(v_a + t2 * width).to(tl.int64), A + (span // 4) * 3 + (span % 4) * 3 // 4)
            # strictly inside the bracket and non-decreasing (equal pivots only waste a count)
            p0 = tl.minimum(tl.maximum(p0, A + 1), B - 1)
            p1 = tl.minimum(tl.maximum(p1, p0), B - 1)
            p2 = tl.minimum(tl.maximum(p2, p1), B - 1)
        c0, c1, c2 = count_at_least(keys, p0.to(tl.uint32), p1.to(tl.uint32), p2.to(tl.uint32), PIVOTS)
        # counts never grow with the pivot: the last pivot with count >= r is the new A, the first with
        # count < r the new B
        n_a = tl.where(c0 >= r, p0, A)
        nc_a = tl.where(c0 >= r, c0, cA)
        n_a = tl.where(c1 >= r, p1, n_a)
        nc_a = tl.where(c1 >= r, c1, nc_a)
        n_a = tl.where(c2 >= r, p2, n_a)
        nc_a = tl.where(c2 >= r, c2, nc_a)
        n_b = tl.where(c2 < r, p2, B)
        nc_b = tl.where(c2 < r, c2, cB)
        n_b = tl.where(c1 < r, p1, n_b)
        nc_b = tl.where(c1 < r, c1, nc_b)
        n_b = tl.where(c0 < r, p0, n_b)
        nc_b = tl.where(c0 < r, c0, nc_b)
        left = nc_a - nc_b
        uni = ((uni == 0) & (left * 2 > cA - cB)).to(tl.int32)
        lf = left.to(tl.float32)
        dc = tl.minimum(2.0 * tl.sqrt(lf) + 1.0, lf * 0.25 + 1.0)
        A = n_a
        cA = nc_a
        B = n_b
        cB = nc_b
        steps += 1
        go = (cA != r) & (B - A > 1) & (left > tol) & (steps < max_steps)
    return A, cA, B, cB


@triton.jit
def search_threshold(keys, k, PIVOTS: tl.constexpr):
    """:func:`select_threshold`'s result for a tile held in registers, found by :func:`search_bracket`.

    Returns ``(hi_mask, prefix, need, count, n_sel)`` with the full mask: the winners are the keys
    ``> prefix``, plus ``need`` of the ``count`` keys ``== prefix`` (all of them when ``need ==
    count``; else the lowest-index ``need``). ``n_sel = min(k, valid keys)``.
    """
    n_valid, kmax, kmin = valid_count_max_min(keys)
    hi_mask = tl.full([], 0xFFFFFFFF, tl.uint32)
    prefix = tl.full([], 1, tl.uint32)  # at most k valid keys: all of them win (key > 1; no key equals 1)
    need = tl.zeros([], tl.int32)
    count = tl.zeros([], tl.int32)
    if n_valid > k:
        zero = tl.zeros([], tl.int32)
        a, c_a, _b, c_b = search_bracket(keys, k, kmin.to(tl.int64), n_valid, kmax.to(tl.int64) + 1, zero, zero, PIVOTS)
        prefix = a.to(tl.uint32)
        exact = c_a == k  # the winners are exactly the keys >= a: take every key equal to a
        need = tl.where(exact, 0, k - c_b)
        count = tl.where(exact, 0, c_a - c_b)
    return hi_mask, prefix, need, count, tl.minimum(n_valid, k)


@triton.jit
def local_to_global_ids(j, rank, WORLD: tl.constexpr, INTERLEAVE: tl.constexpr):
    """The ownership layout: local index ``j >= 0`` on ``rank`` is global position
    ``(j // I) * (W*I) + rank*I + j % I``."""
    return (j // INTERLEAVE) * (WORLD * INTERLEAVE) + rank * INTERLEAVE + j % INTERLEAVE


@triton.jit
def pack_pair(score, gid_f):
    """One int64 holding the float32 pair ``(score, gid)`` as laid out in ``[..., 2]`` memory
    (little-endian: the score is the low word), so each candidate is a single 8-byte store."""
    lo = score.to(tl.uint32, bitcast=True).to(tl.uint64)
    hi = gid_f.to(tl.uint32, bitcast=True).to(tl.uint64)
    return ((hi << 32) | lo).to(tl.int64, bitcast=True)


@triton.jit
def winners(keys, hi_mask, prefix, need, partial, eq_seen):
    """``(win, eq_seen)``: which keys of a tile win under a select's result (see :func:`select_threshold`).

    ``eq_seen`` threshold-equal keys came before this tile (returned updated): when ``partial``, the
    tied keys win in index order, ``need`` of them over the whole row (an exclusive prefix count).
    """
    top = keys & hi_mask
    # A partial prefix (the select stopped early) can be 0 on its masked bits: invalid keys (0)
    # must never tie with it.
    eq = (top == prefix) & (keys != 0)
    if partial:  # ties on all 32 bits at the threshold: the lowest-index `need` of them win
        eqi = eq.to(tl.int32)
        eq_rank = eq_seen + tl.cumsum(eqi, 0) - eqi
        take = eq & (eq_rank < need)
        eq_seen += tl.sum(eqi, 0)
    else:
        take = eq
    return (top > prefix) | take, eq_seen


@triton.jit
def commit_tile(
    row_ptr, out_row_ptr, offs, j0, stride_c,
    keys, hi_mask, prefix, need, partial, eq_seen, base,
    rank, WORLD: tl.constexpr, INTERLEAVE: tl.constexpr, PACKED_INPUT: tl.constexpr,
    ids_row_ptr=None, LOCAL_IDS: tl.constexpr = False, SPLIT_OUT: tl.constexpr = False,
):  # fmt: skip
    """Write the winners among keys ``offs`` of one tile, in index order.

    ``base`` winners and ``eq_seen`` threshold-equal keys came before this tile (returned
    updated). A winner's slot is its rank among the row's winners. Its id is the global id
    ``local_to_global(j0 + offs)`` (its local index ``j0 + offs`` with ``LOCAL_IDS``), or, for
    packed candidates (the second launch of a split row), the id stored next to the score.
    Written as one ``(score, float(id))`` pair per slot, or, with ``SPLIT_OUT`` (the rank-local
    output), the score to ``out_row_ptr[slot]`` (float32) and the id to ``ids_row_ptr[slot]`` (int32).
    """
    win, eq_seen = winners(keys, hi_mask, prefix, need, partial, eq_seen)
    wi = win.to(tl.int32)
    slot = base + tl.cumsum(wi, 0) - 1
    ptr = row_ptr + offs * stride_c
    score = tl.load(ptr, mask=win, other=0.0).to(tl.float32)  # exact bits: -0.0 stays -0.0
    if SPLIT_OUT:
        if PACKED_INPUT:
            ident = tl.load(ptr + 1, mask=win, other=-1.0).to(tl.int32)
        else:
            ident = j0 + offs
        tl.store(out_row_ptr + slot, score, mask=win)
        tl.store(ids_row_ptr + slot, ident, mask=win)
    else:
        if PACKED_INPUT:
            gid_f = tl.load(ptr + 1, mask=win, other=-1.0)
        elif LOCAL_IDS:
            gid_f = (j0 + offs).to(tl.float32)
        else:
            gid_f = local_to_global_ids(j0 + offs, rank, WORLD, INTERLEAVE).to(tl.float32)
        tl.store(out_row_ptr + slot, pack_pair(score, gid_f), mask=win)
    return base + tl.sum(wi, 0), eq_seen


@triton.jit
def write_padding(
    out_row_ptr, n_sel, k, PAD_BLOCK: tl.constexpr, NAN_PAD: tl.constexpr,
    ids_row_ptr=None, SPLIT_OUT: tl.constexpr = False,
):  # fmt: skip
    """Slots ``[n_sel, k)`` get ``(-inf, -1)``: what ``pack_candidates`` writes for a ``-1`` entry.

    (``NAN_PAD``: ``(NaN, -1)`` instead, in a split row's workspace, so that the second launch
    sees the padding as invalid rather than as a valid ``-inf`` score. ``SPLIT_OUT``, the rank-local
    output: NaN scores to ``out_row_ptr``, ``-1`` ids to ``ids_row_ptr`` — ``-inf`` is a valid score there.)
    """
    if NAN_PAD:
        pad_score = tl.full([PAD_BLOCK], float("nan"), tl.float32)
    else:
        pad_score = tl.full([PAD_BLOCK], float("-inf"), tl.float32)
    fill = pack_pair(pad_score, tl.full([PAD_BLOCK], -1.0, tl.float32))
    for s in range((n_sel // PAD_BLOCK) * PAD_BLOCK, k, PAD_BLOCK):
        o = s + tl.arange(0, PAD_BLOCK)
        m = (o >= n_sel) & (o < k)
        if SPLIT_OUT:
            tl.store(out_row_ptr + o, tl.full([PAD_BLOCK], float("nan"), tl.float32), mask=m)
            tl.store(ids_row_ptr + o, tl.full([PAD_BLOCK], -1, tl.int32), mask=m)
        else:
            tl.store(out_row_ptr + o, fill, mask=m)


@triton.jit
def commit_row(
    row_ptr, out_row_ptr, ids_row_ptr, n, j0, stride_c, hi_mask, prefix, need, partial, rank,
    WORLD: tl.constexpr, INTERLEAVE: tl.constexpr, PACKED_INPUT: tl.constexpr, TILE: tl.constexpr,
    LOCAL_IDS: tl.constexpr, SPLIT_OUT: tl.constexpr,
):  # fmt: skip
    """:func:`commit_tile` over a row streamed tile by tile (the next tile's load in flight)."""
    offs = tl.arange(0, TILE)
    base = tl.zeros([], tl.int32)
    eq_seen = tl.zeros([], tl.int32)
    nxt = load_keys(row_ptr, offs, n, stride_c)
    for c in range(0, n, TILE):
        cur = nxt
        nxt = load_keys(row_ptr, c + TILE + offs, n, stride_c)
        base, eq_seen = commit_tile(
            row_ptr, out_row_ptr, c + offs, j0, stride_c, cur, hi_mask, prefix, need, partial, eq_seen, base, rank,
            WORLD, INTERLEAVE, PACKED_INPUT, ids_row_ptr, LOCAL_IDS, SPLIT_OUT,
        )  # fmt: skip


@triton.jit
def select_commit(
    row_ptr, out_row_ptr, ids_row_ptr, n, j0, stride_c, k, rank,
    WORLD: tl.constexpr, INTERLEAVE: tl.constexpr, PACKED_INPUT: tl.constexpr, NAN_PAD: tl.constexpr,
    RADIX_BITS: tl.constexpr, TILE: tl.constexpr, ONE_CHUNK: tl.constexpr, PAD_BLOCK: tl.constexpr,
    LOCAL_IDS: tl.constexpr, SPLIT_OUT: tl.constexpr, SELECT: tl.constexpr, PIVOTS: tl.constexpr,
):  # fmt: skip
    """One row (segment) of ``n`` keys: select its top-``k``, write them in index order, then the padding.

    ``ONE_CHUNK``: the keys are read once and kept in registers (``SELECT``: 0 radix, 1 search);
    else every radix pass streams them (the select is then always radix).
    """
    offs = tl.arange(0, TILE)
    if ONE_CHUNK:
        keys = load_keys(row_ptr, offs, n, stride_c)  # the whole row: read once, kept in registers
    else:
        keys = tl.zeros([TILE], tl.uint32)  # unused: every pass streams the row
    if SELECT == 1 and ONE_CHUNK:
        hi_mask, prefix, need, count, n_sel = search_threshold(keys, k, PIVOTS)
    else:
        hi_mask, prefix, need, count, n_sel = select_threshold(
            row_ptr, n, stride_c, keys, k, RADIX_BITS, TILE, ONE_CHUNK
        )
    partial = need < count
    if ONE_CHUNK:
        zero = tl.zeros([], tl.int32)
        commit_tile(
            row_ptr, out_row_ptr, offs, j0, stride_c, keys, hi_mask, prefix, need, partial, zero, zero, rank,
            WORLD, INTERLEAVE, PACKED_INPUT, ids_row_ptr, LOCAL_IDS, SPLIT_OUT,
        )  # fmt: skip
    else:
        commit_row(
            row_ptr, out_row_ptr, ids_row_ptr, n, j0, stride_c, hi_mask, prefix, need, partial, rank,
            WORLD, INTERLEAVE, PACKED_INPUT, TILE, LOCAL_IDS, SPLIT_OUT,
        )  # fmt: skip
    write_padding(out_row_ptr, n_sel, k, PAD_BLOCK, NAN_PAD, ids_row_ptr, SPLIT_OUT)


@triton.jit
def indexer_topk_pack_kernel(
    scores_ptr, lengths_ptr, starts_ptr, out_ptr,
    n_cols, seg_len,
    stride_r, stride_c, out_stride_r,
    k, rank,
    HAS_LENGTHS: tl.constexpr, HAS_STARTS: tl.constexpr, WORLD: tl.constexpr, INTERLEAVE: tl.constexpr,
    PACKED_INPUT: tl.constexpr, NAN_PAD: tl.constexpr, RADIX_BITS: tl.constexpr,
    TILE: tl.constexpr, ONE_CHUNK: tl.constexpr, PAD_BLOCK: tl.constexpr,
    ids_ptr=None, chk_ptr=None,
    LOCAL_IDS: tl.constexpr = False, SPLIT_OUT: tl.constexpr = False, SELECT: tl.constexpr = 0,
    PIVOTS: tl.constexpr = 3, CHECK: tl.constexpr = False,
):  # fmt: skip
    """Grid ``(T, S)``: program ``(r, s)`` selects the top-``k`` of local keys
    ``[s*seg_len, (s+1)*seg_len)`` of row ``r`` (``S = 1``, ``seg_len >= n_cols``: the whole row)
    and writes them to ``out[r*out_stride_r + s*k : ... + k]`` (``out``: the int64 view of float32
    ``(score, id)`` pairs; with ``SPLIT_OUT`` the float32 scores, and the int32 ids to ``ids``).

    ``LOCAL_IDS``: ids are local indices (the rank-local order) rather than global ids. ``SELECT``:
    0 radix, 1 search, for a row held in registers. ``CHECK``: raise ``chk[0]`` for a row whose
    window is out of contract (:func:`check_window`).
    """
    row = tl.program_id(0)
    seg = tl.program_id(1)
    if CHECK:
        if seg == 0:
            check_window(chk_ptr, lengths_ptr, starts_ptr, row, n_cols, HAS_LENGTHS, HAS_STARTS)
    start, n_row = row_window(lengths_ptr, starts_ptr, row, n_cols, HAS_LENGTHS, HAS_STARTS)
    j0 = seg * seg_len  # first local index of this segment
    n = tl.minimum(tl.maximum(n_row - j0, 0), seg_len)
    row_ptr = scores_ptr + row.to(tl.int64) * stride_r + (start + j0).to(tl.int64) * stride_c
    out_row_ptr = out_ptr + row.to(tl.int64) * out_stride_r + seg * k
    if SPLIT_OUT:
        ids_row_ptr = ids_ptr + row.to(tl.int64) * out_stride_r + seg * k
    else:
        ids_row_ptr = out_row_ptr  # unused
    select_commit(
        row_ptr, out_row_ptr, ids_row_ptr, n, j0, stride_c, k, rank, WORLD, INTERLEAVE, PACKED_INPUT, NAN_PAD,
        RADIX_BITS, TILE, ONE_CHUNK, PAD_BLOCK, LOCAL_IDS, SPLIT_OUT, SELECT, PIVOTS,
    )  # fmt: skip


@triton.jit
def sample_bound(row_ptr, n, stride_c, mid, CAP: tl.constexpr, SAMPLE: tl.constexpr, PIVOTS: tl.constexpr):
    """A lower bound ``lo`` (a key) with about ``mid`` of the row's keys at or above it, from a sample.

    ``SAMPLE`` keys spread evenly over the row (local keys ``i*n // SAMPLE``: every program of a split
    row takes the same ones) hold about ``r = mid * SAMPLE / n`` keys at or above the row's ``mid``-th
    largest; :func:`search_bracket` brackets the sample's ``r``-th largest key to within an eighth of
    ``r`` (at most 8 steps: ties at that rank stop it early) and the bracket's lower end is the bound.
    A row of at most ``CAP`` keys, or one whose sample holds too few valid keys, gets ``lo = 1``: every
    valid key. Only the accuracy depends on the sample: the callers check the counts this bound gives.
    """
    lo = tl.full([], 1, tl.uint32)
    if n > CAP:
        offs = tl.arange(0, SAMPLE)
        pos = ((offs.to(tl.int64) * n) // SAMPLE).to(tl.int32)
        keys = load_keys(row_ptr, pos, n, stride_c)
        r = ((mid.to(tl.int64) * SAMPLE) // n).to(tl.int32) + 1
        n_v, kmax, kmin = valid_count_max_min(keys)
        if n_v > r:
            zero = tl.zeros([], tl.int32)
            a, _c_a, _b, _c_b = search_bracket(
                keys, r, kmin.to(tl.int64), n_v, kmax.to(tl.int64) + 1, zero, r // 8, PIVOTS, 8
            )
            lo = a.to(tl.uint32)
    return lo


@triton.jit
def filter_segment(row_ptr, j0, n, stride_c, lo, list_ptr, CAP: tl.constexpr, TILE: tl.constexpr):
    """Compact the keys ``>= lo`` among local keys ``[j0, j0 + n)`` into ``list_ptr`` (int64 entries
    ``local index << 32 | float32 bits``, in index order; entries past ``CAP`` are dropped), the row
    streamed tile by tile. Returns ``(ge, eq)``: how many keys are ``>= lo`` and ``== lo`` (exact counts,
    also past ``CAP``). ``lo >= 1``, so an invalid key (0) is never kept."""
    tl.static_assert(TILE < 65536)
    offs = tl.arange(0, TILE)
    ge = tl.zeros([], tl.int32)
    eq = tl.zeros([], tl.int32)
    end = j0 + n
    nbits, nkeys = load_scores(row_ptr, j0 + offs, end, stride_c)
    for c in range(0, n, TILE):
        bits = nbits
        keys = nkeys
        nbits, nkeys = load_scores(row_ptr, j0 + c + TILE + offs, end, stride_c)
        keep = keys >= lo
        ki = keep.to(tl.int32)
        pos = ge + tl.cumsum(ki, 0) - 1
        entry = ((j0 + c + offs).to(tl.int64) << 32) | bits.to(tl.int64)
        tl.store(list_ptr + pos, entry, mask=keep & (pos < CAP))
        both = tl.sum(ki | ((keys == lo).to(tl.int32) << 16), 0)  # both counts in one reduction (TILE < 2**16)
        ge += both & 0xFFFF
        eq += both >> 16
    return ge, eq


@triton.jit
def join_lists(ws_row, hdr, SEGMENTS: tl.constexpr, SEG_POW2: tl.constexpr, CAP: tl.constexpr):
    """Append the lists of segments ``1 .. SEGMENTS-1`` to segment 0's, in segment (= index) order, so that
    the row's candidates are contiguous from ``ws_row``. Called when they fit ``CAP`` in all: the
    destinations then lie in segment 0's list, past its own entries, and never overlap a source.

    All segments are copied at once, ``CAP / SEG_POW2`` entries of each per step (a 2-D tile: one row per
    segment), so that a step costs one round trip to L2 whatever the number of segments (the other
    programs' lists are read from L2, ``.cg``, after the acquire of the row's counter)."""
    CHUNK: tl.constexpr = CAP // SEG_POW2
    so = tl.arange(0, SEG_POW2)
    g = tl.load(hdr + so, mask=so < SEGMENTS, other=0, cache_modifier=".cg").to(tl.int32)
    dst = tl.cumsum(g, 0) - g  # where each segment's entries go: after every earlier segment's
    g = tl.where(so >= 1, g, 0)  # segment 0's entries are in place already
    j = tl.arange(0, CHUNK)
    for c in range(0, tl.max(g, 0), CHUNK):
        m = (c + j)[None, :] < g[:, None]
        v = tl.load(ws_row + so[:, None].to(tl.int64) * CAP + c + j[None, :], mask=m, other=0, cache_modifier=".cg")
        tl.store(ws_row + dst[:, None] + c + j[None, :], v, mask=m)


@triton.jit
def commit_entries(
    entries, keys, hi_mask, prefix, need, partial, out_row_ptr, ids_row_ptr, rank,
    WORLD: tl.constexpr, INTERLEAVE: tl.constexpr, SPLIT_OUT: tl.constexpr,
):  # fmt: skip
    """Write the winners among a candidate list held in registers (entries in index order, see
    :func:`filter_segment`): slot = rank among the winners, score bits and id from the entry."""
    win, _ = winners(keys, hi_mask, prefix, need, partial, tl.zeros([], tl.int32))
    slot = tl.cumsum(win.to(tl.int32), 0) - 1
    score = (entries & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    j = (entries >> 32).to(tl.int32)
    if SPLIT_OUT:
        tl.store(out_row_ptr + slot, score, mask=win)
        tl.store(ids_row_ptr + slot, j, mask=win)
    else:
        gid_f = local_to_global_ids(j, rank, WORLD, INTERLEAVE).to(tl.float32)
        tl.store(out_row_ptr + slot, pack_pair(score, gid_f), mask=win)


@triton.jit
def select_listed(
    ws_row, count, out_row_ptr, ids_row_ptr, k, rank,
    WORLD: tl.constexpr, INTERLEAVE: tl.constexpr, CAP: tl.constexpr, SELECT: tl.constexpr, PIVOTS: tl.constexpr,
    RADIX_BITS: tl.constexpr, PAD_BLOCK: tl.constexpr, SPLIT_OUT: tl.constexpr,
):  # fmt: skip
    """The top-``k`` of the ``count <= CAP`` entries listed from ``ws_row`` (index order), held in registers:
    select (``SELECT``), write the winners from the entries, then the padding. The caller has made the
    entries visible (a barrier after its own stores; the other programs' were acquired)."""
    offs = tl.arange(0, CAP)
    in_list = offs < count
    e = tl.load(ws_row + offs, mask=in_list, other=0, cache_modifier=".cg")
    x = (e & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True)
    keys = tl.where(in_list, order_key(x), 0)
    if SELECT == 1:
        hi_mask, prefix, need, n_eq, n_sel = search_threshold(keys, k, PIVOTS)
    else:
        hi_mask, prefix, need, n_eq, n_sel = select_threshold(ws_row, count, 1, keys, k, RADIX_BITS, CAP, True)
    commit_entries(
        e, keys, hi_mask, prefix, need, need < n_eq, out_row_ptr, ids_row_ptr, rank, WORLD, INTERLEAVE, SPLIT_OUT
    )
    write_padding(out_row_ptr, n_sel, k, PAD_BLOCK, False, ids_row_ptr, SPLIT_OUT)


@triton.jit
def finish_filtered(
    row_ptr, n, stride_c, ws_row, hdr, out_row_ptr, ids_row_ptr, lo, ge, eq, k, rank,
    WORLD: tl.constexpr, INTERLEAVE: tl.constexpr, SEGMENTS: tl.constexpr, SEG_POW2: tl.constexpr,
    TILE: tl.constexpr, CAP: tl.constexpr,
    SELECT: tl.constexpr, PIVOTS: tl.constexpr, RADIX_BITS: tl.constexpr, PAD_BLOCK: tl.constexpr,
    SPLIT_OUT: tl.constexpr,
):  # fmt: skip
    """The row's top-``k`` once its ``ge`` keys ``>= lo`` (``eq`` of them ``== lo``) have been listed.

    1. ``k <= ge <= CAP`` (or ``lo == 1``: the list holds every valid key): the list holds every
       winner; select among it in registers and write the winners from it.
    2. ``ge - eq < k <= ge``, the list overflowed on ties at the bound: ``lo`` is the row's ``k``-th
       largest key; one streamed pass writes the keys ``> lo`` and the lowest-index ``k - (ge - eq)``
       keys ``== lo``.
    3. ``k <= ge - eq <= CAP``, the list overflowed but the keys ``> lo`` fit: one streamed pass lists
       them instead (over the list of segment 0), then as 1.
    4. otherwise (the sample missed): the streamed radix select of the whole row.

    Paths 2-4 stream the whole row from this one program. The path taken is stored in the row's last
    workspace word (:func:`compact_paths`: tests and the benchmark read it).
    """
    gt = ge - eq
    path_ptr = hdr + 2 * SEGMENTS + 1
    if (ge <= CAP) & ((ge >= k) | (lo <= 1)):
        tl.store(path_ptr, 1)
        if SEGMENTS > 1:
            join_lists(ws_row, hdr, SEGMENTS, SEG_POW2, CAP)
        tl.debug_barrier()  # the list's entries (this program's and, joined, the others') are all written
        select_listed(
            ws_row, ge, out_row_ptr, ids_row_ptr, k, rank, WORLD, INTERLEAVE, CAP, SELECT, PIVOTS, RADIX_BITS,
            PAD_BLOCK, SPLIT_OUT,
        )  # fmt: skip
    elif (gt < k) & (ge >= k):
        tl.store(path_ptr, 2)
        full = tl.full([], 0xFFFFFFFF, tl.uint32)
        need = k - gt
        zero = tl.zeros([], tl.int32)
        commit_row(
            row_ptr, out_row_ptr, ids_row_ptr, n, zero, stride_c, full, lo, need, need < eq, rank,
            WORLD, INTERLEAVE, False, TILE, SPLIT_OUT, SPLIT_OUT,
        )  # fmt: skip
    elif (gt >= k) & (gt <= CAP):
        tl.store(path_ptr, 3)
        tl.debug_barrier()  # every thread is past its reads of the lists (join_lists did not run): reuse list 0
        above, _ = filter_segment(row_ptr, tl.zeros([], tl.int32), n, stride_c, lo + 1, ws_row, CAP, TILE)
        tl.debug_barrier()
        select_listed(
            ws_row, above, out_row_ptr, ids_row_ptr, k, rank, WORLD, INTERLEAVE, CAP, SELECT, PIVOTS, RADIX_BITS,
            PAD_BLOCK, SPLIT_OUT,
        )  # fmt: skip
    else:
        tl.store(path_ptr, 4)
        zero = tl.zeros([], tl.int32)
        select_commit(
            row_ptr, out_row_ptr, ids_row_ptr, n, zero, stride_c, k, rank, WORLD, INTERLEAVE, False, False,
            RADIX_BITS, TILE, False, PAD_BLOCK, SPLIT_OUT, SPLIT_OUT, 0, PIVOTS,
        )  # fmt: skip


@triton.jit
def filter_topk_kernel(
    scores_ptr, lengths_ptr, starts_ptr, out_ptr, ids_ptr, ws_ptr, chk_ptr,
    n_cols, seg_len,
    stride_r, stride_c, ws_stride_r,
    k, rank, mid,
    HAS_LENGTHS: tl.constexpr, HAS_STARTS: tl.constexpr, WORLD: tl.constexpr, INTERLEAVE: tl.constexpr,
    SEGMENTS: tl.constexpr, SEG_POW2: tl.constexpr, TILE: tl.constexpr, CAP: tl.constexpr, SAMPLE: tl.constexpr,
    SELECT: tl.constexpr, PIVOTS: tl.constexpr, RADIX_BITS: tl.constexpr, PAD_BLOCK: tl.constexpr,
    SPLIT_OUT: tl.constexpr, CHECK: tl.constexpr,
):  # fmt: skip
    """The compacted path (module docstring, path 2). Grid ``(T, SEGMENTS)``: program ``(r, s)`` filters
    local keys ``[s*seg_len, (s+1)*seg_len)`` of row ``r`` against the row's sampled bound into its list
    ``ws[r, s*CAP : (s+1)*CAP]`` (int64 words); the row's last program to finish selects and writes.

    Per row, the workspace holds ``SEGMENTS`` lists of ``CAP`` entries, the lists' ``ge`` counts, their
    ``eq`` counts (both written only when ``SEGMENTS > 1``), the row's arrival counter (zero between
    calls: the last program resets it) and the path its selection took (:func:`finish_filtered`).
    """
    row = tl.program_id(0)
    seg = tl.program_id(1)
    if CHECK:
        if seg == 0:
            check_window(chk_ptr, lengths_ptr, starts_ptr, row, n_cols, HAS_LENGTHS, HAS_STARTS)
    start, n = row_window(lengths_ptr, starts_ptr, row, n_cols, HAS_LENGTHS, HAS_STARTS)
    row_ptr = scores_ptr + row.to(tl.int64) * stride_r + start.to(tl.int64) * stride_c
    out_row_ptr = out_ptr + row.to(tl.int64) * k
    if SPLIT_OUT:
        ids_row_ptr = ids_ptr + row.to(tl.int64) * k
    else:
        ids_row_ptr = out_row_ptr  # unused
    ws_row = ws_ptr + row.to(tl.int64) * ws_stride_r
    hdr = ws_row + SEGMENTS * CAP
    lo = sample_bound(row_ptr, n, stride_c, mid, CAP, SAMPLE, PIVOTS)
    j0 = seg * seg_len
    ge, eq = filter_segment(row_ptr, j0, tl.minimum(tl.maximum(n - j0, 0), seg_len), stride_c, lo, ws_row + seg * CAP,
                            CAP, TILE)  # fmt: skip
    if SEGMENTS > 1:
        tl.store(hdr + seg, ge.to(tl.int64))
        tl.store(hdr + SEGMENTS + seg, eq.to(tl.int64))
        tl.debug_barrier()  # every thread's list entries and counts precede the release below
        # acq_rel at GPU scope: releases this program's list; the last program to arrive acquires all of them
        arrived = tl.atomic_add(hdr + 2 * SEGMENTS, 1)
        if arrived == SEGMENTS - 1:
            tl.store(hdr + 2 * SEGMENTS, 0)  # every program of the row has arrived: ready for the next call
            so = tl.arange(0, SEG_POW2)
            ges = tl.load(hdr + so, mask=so < SEGMENTS, other=0, cache_modifier=".cg")
            eqs = tl.load(hdr + SEGMENTS + so, mask=so < SEGMENTS, other=0, cache_modifier=".cg")
            finish_filtered(
                row_ptr, n, stride_c, ws_row, hdr, out_row_ptr, ids_row_ptr, lo, tl.sum(ges, 0).to(tl.int32),
                tl.sum(eqs, 0).to(tl.int32), k, rank, WORLD, INTERLEAVE, SEGMENTS, SEG_POW2, TILE, CAP, SELECT,
                PIVOTS, RADIX_BITS, PAD_BLOCK, SPLIT_OUT,
            )  # fmt: skip
    else:
        finish_filtered(
            row_ptr, n, stride_c, ws_row, hdr, out_row_ptr, ids_row_ptr, lo, ge, eq, k, rank, WORLD, INTERLEAVE,
            SEGMENTS, SEG_POW2, TILE, CAP, SELECT, PIVOTS, RADIX_BITS, PAD_BLOCK, SPLIT_OUT,
        )  # fmt: skip


#: Orders of the output (:data:`dcp_ref.stages.ORDERS`): ``(score, global id)`` pairs, or rank-local
#: scores + local ids.
ORDERS = ("global_id", "rank_local")

#: How a tile held in registers is selected (see the module docstring).
SELECTS = ("radix", "search")


#: Digit width of the radix select (bits per pass; at most 7 passes). See the module docstring for why
#: narrow digits win: on the H200, T = 32, L = 8192 took 19.9 us at 5 bits, 20.7 at 6, 31 at 8, 188 at 11.
DEFAULT_RADIX_BITS = 5


class LaunchPlan(NamedTuple):
    """How one call runs (see :func:`launch_plan`), and the shape it was made for: :func:`indexer_topk_pack`
    refuses a plan whose ``rows``, ``n_cols``, ``k`` or ``device`` differ from its call's."""

    tile: int  #: keys per tile of the first launch (a power of two)
    one_chunk: bool  #: a row (segment) of the first launch fits one tile: read once, kept in registers
    num_warps: int  #: warps per program of the first launch
    split: int  #: segments per row in the first launch (1: one program per row)
    levels: tuple[int, ...] = ()  #: segments per row of every splitting launch of the streamed path (or ``()``)
    compact: bool = False  #: the compacted path (sample bound, candidate list, select among it; one launch)
    cap: int = 0  #: candidates per row the compacted path can list (its select tile), 0 if not compact
    sample: int = 0  #: sample size of the compacted path's bound, 0 if not compact
    select: str = "radix"  #: how a tile held in registers is selected (:data:`SELECTS`)
    pivots: int = 3  #: pivots per step of ``select="search"``
    engine: str = "triton"  #: ``"triton"`` (the fields above) or ``"cutedsl"`` (:mod:`.local_topk_cutedsl`)
    #: the CuTeDSL kernel's ``(cluster, threads, cpt, first_bits, commit)``
    cute: tuple[int, int, int, int, str] | None = None
    vec: int = 0  #: keys per vector load of the CuTeDSL kernel (the scores' alignment allows it)
    radix_bits: int = DEFAULT_RADIX_BITS  #: digit width of the Triton kernels' radix select (bits per pass)
    #: ``(tile, one_chunk, num_warps)`` of each launch after the first of the split streamed path: the further
    #: levels', then the last select's (``()`` for every other path)
    later: tuple[tuple[int, bool, int], ...] = ()
    rows: int = 0  #: rows of the call it was made for
    n_cols: int = 0  #: columns of that call's scores
    k: int = 0  #: winners per row of that call
    device: str = ""  #: that call's device, ``str(torch.device)`` with its index (``"cuda:0"``, ``"cpu"``)


#: Who runs the indexer stage (:func:`launch_plan` picks by shape and layout when ``engine=None``).
ENGINES = ("triton", "cutedsl")


#: Default select of a tile held in registers (``"radix"`` or ``"search"``; the launch-plan sweep of
#: ``benchmarks/bench_local_topk.py`` compares them). Radix until the sweep says otherwise: in SASS (Triton
#: 3.6, sm_90a, 16 keys per thread) a radix pass is ~640 instructions per thread and a 3-pivot search step
#: ~340, but a simulation of the search (tests of the same arithmetic in NumPy) takes 4-11 steps on normal
#: scores of 8192 keys (k = 2048) and 10-22 on 16-value ties, where the radix takes ~5 and <= 7 passes.
DEFAULT_SELECT = "radix"

#: Pivots per step of ``select="search"`` (1 or 3).
DEFAULT_PIVOTS = 3

#: Keys per program that stay in registers: about 8 per thread at 32 warps. More makes the
#: per-key temporaries of the histogram and the commit spill (ptxas, sm_90a: 63 registers at
#: 8192 keys and 32 warps; 118 at 32 keys per thread).
MAX_TILE = 8192

#: Keys per tile when the compacted path streams a row: 8 per thread at 8 warps. (ptxas, sm_90a: the whole
#: compacted kernel takes 128 registers at 2048 keys and 8 warps, 255 at 4096: two programs per SM, or one.)
STREAM_TILE = 2048

#: :func:`prefer_compact`'s bounds, from both paths timed at every long-row shape on the H200 (2026-12-01,
#: ``benchmarks/results/local_topk.json``, key ``compact_vs_streamed``; CUDA-graph replay, k = 2048, normal
#: scores; compacted vs streamed radix, us): faster at T = 1, L = 32768 (19.3 vs 37.0) and 131072 (26.5 vs 59.2);
#: at L = 32768 also for T = 32 (38.7 vs 50.7), 128 (51.6 vs 112.2) and 1024 (279.5 vs 791.6); at L = 131072 for
#: T = 1024 (1745 vs 3975) — but slower at T = 32 (491.7 vs 121.9, 4x) and T = 128 (580.7 vs 563.5). So rows of at
#: least COMPACT_MIN_COLS keys take it, except, from COMPACT_LONG_COLS keys on, a middle count of rows (more than
#: COMPACT_LONE_ROWS, fewer than COMPACT_MANY_ROWS). L = 65536 and T between 128 and 1024 were not measured: the
#: bounds keep those shapes on the streamed path, the measured one, until a run shows the compacted one faster.
COMPACT_MIN_COLS = 32768
COMPACT_LONG_COLS = 65536
COMPACT_LONE_ROWS = 1
COMPACT_MANY_ROWS = 1024

#: Aim of the compacted path's sample: about this many sample keys at or above the bound (the bound's
#: count is then known to ~1/sqrt of it: 7 %).
_SAMPLE_HITS = 180


def _tile_config(n: int, tile: int | None, num_warps: int | None) -> tuple[int, bool, int]:
    if tile is None:
        tile = max(next_pow2(max(n, 1)), 256) if n <= MAX_TILE else MAX_TILE // 2
    one_chunk = n <= tile
    if num_warps is None:
        # Measured on the H200 (local_topk.json, "tuning"): 16 keys per thread is best for a row held in
        # registers (8192 keys: 16 warps 19.9 us vs 32 warps 23.0), 8 for a streamed tile (T = 32, L = 131072:
        # 16 warps 122 us vs 8 warps 124; T = 1024, L = 32768: 790 vs 936).
        num_warps = max(4, min(32, tile // (512 if one_chunk else 256)))
    return tile, one_chunk, num_warps


def _split_levels(split: int, k: int, limit: int) -> tuple[int, ...]:
    """Segments per row of each splitting launch: ``split`` first, then, while the ``S*k``
    candidates left exceed ``limit`` keys and a level still shrinks them at least 4-fold, another
    level of ``ceil(S*k / limit)`` segments."""
    if split <= 1:
        return ()
    levels, n = [split], split * k
    while n > limit and 4 * k <= limit:
        s = cdiv(n, limit)
        levels.append(s)
        n = s * k
    return tuple(levels)


def compact_cap(k: int) -> int:
    """Candidate-list capacity per row of the compacted path: ``next_pow2(2k)`` (at least 16), or 0 when
    that exceeds :data:`MAX_TILE` (the list must fit a tile in registers: ``k <= MAX_TILE / 2``)."""
    cap = max(16, next_pow2(2 * k))
    return cap if cap <= MAX_TILE else 0


def _sample_size(n_cols: int, k: int, cap: int) -> int:
    mid = math.isqrt(k * cap)
    want = next_pow2(max(1, cdiv(n_cols * _SAMPLE_HITS, mid)))
    return max(16, min(want, MAX_TILE, next_pow2(max(n_cols, 1))))


def _auto_segments(rows: int, n_cols: int, device: torch.device) -> int:
    """Segments per row of the compacted path: 1, unless the rows alone would leave most of the GPU idle
    (``2 * rows <= SMs``); then enough segments of at least :data:`STREAM_TILE` keys to fill it, at most 32."""
    if device.type != "cuda" or triton_interpreting():
        return 1
    sms = sm_count(device)
    if 2 * rows > sms:
        return 1
    return max(1, min(cdiv(sms, rows), cdiv(n_cols, STREAM_TILE), 32))


def prefer_compact(rows: int, n_cols: int, k: int) -> bool:
    """Whether :func:`launch_plan` takes the compacted path by default (``compact=None``) for ``rows`` rows of
    ``n_cols`` columns and ``k`` winners: where it measured faster than the streamed radix — rows of at least
    :data:`COMPACT_MIN_COLS` columns, and from :data:`COMPACT_LONG_COLS` columns on only a lone row
    (:data:`COMPACT_LONE_ROWS`) or many (:data:`COMPACT_MANY_ROWS`) — and its candidate list fits a tile
    (:func:`compact_cap`). A row that fits one tile is never compacted (:func:`launch_plan`)."""
    rows = check_int_scalar(rows, "rows", min_value=0)
    n_cols = check_int_scalar(n_cols, "n_cols", min_value=0)
    k = check_int_scalar(k, "k", min_value=1)
    if n_cols < COMPACT_MIN_COLS or compact_cap(k) == 0:
        return False
    return n_cols < COMPACT_LONG_COLS or rows <= COMPACT_LONE_ROWS or rows >= COMPACT_MANY_ROWS


def launch_plan(
    rows: int,
    n_cols: int,
    k: int,
    device: torch.device,
    *,
    split: int | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
    compact: bool | None = None,
    select: str | None = None,
    sample: int | None = None,
    pivots: int | None = None,
    engine: str | None = None,
    vec: int = 0,
    cute: tuple[int | None, int | None, int | None] | None = None,
    radix_bits: int = DEFAULT_RADIX_BITS,
) -> LaunchPlan:
    """How :func:`indexer_topk_pack` runs ``rows`` rows of ``n_cols`` columns and ``k`` winners on ``device``
    (shapes only, no sync): the one place a launch is chosen. ``indexer_topk_pack(plan=None)`` takes
    ``launch_plan(rows, n_cols, k, scores.device, vec=scores_vec(scores))``; pass ``plan=`` to run another
    (the plan records the shape it was made for, and a call of any other shape refuses it).

    **Engine.** ``engine=None`` takes the CuTeDSL kernel (:mod:`dcp_ref.kernels.local_topk_cutedsl`: a row
    read once into registers, a cluster of CTAs for long rows) wherever it can run — a CUDA device, no Triton
    knob given (``split``, ``tile``, ``num_warps``, ``compact``, ``select``, ``sample``, ``pivots``), scores
    whose layout allows ``vec >= 1`` keys per vector load (:func:`scores_vec`; 0 = it cannot read them) and
    :func:`~dcp_ref.kernels.local_topk_cutedsl.plan_for` holds the row — and the Triton kernel elsewhere.
    ``"triton"`` / ``"cutedsl"`` force one (``"cutedsl"`` where it cannot run is a ``ValueError``). ``cute``:
    ``(cluster, threads, first_bits)`` overrides of the CuTeDSL plan (``None`` entries: by shape).

    A row of up to :data:`MAX_TILE` columns (``tile`` when given) is one tile, held in registers
    (``select``). A longer one takes the compacted path where :func:`prefer_compact` says so (``compact=None``:
    by shape, where it measured faster; ``True`` forces it for any row, and needs ``k <= MAX_TILE / 2``;
    ``False`` forbids it; :attr:`LaunchPlan.compact` records the choice): streamed in tiles of ``tile``
    (default :data:`STREAM_TILE`), with a candidate list of :func:`compact_cap` entries and a bound from a
    sample of ``sample`` keys; ``split`` segments per row (at most 64; ``None``: more than one only on a GPU
    whose SMs the rows alone would leave mostly idle). Otherwise the streamed radix path: split
    (``split=None``) on a GPU when long rows (``n_cols >= 4 * MAX_TILE``, ``k <= MAX_TILE / 4``) fill less
    than a quarter of the SMs, into segments of ``MAX_TILE`` whose ``split * k`` candidates are split
    again (``levels``), each level shrinking them at least 4-fold, before the last launch selects.

    The Triton kernel's tuning (any of them but ``radix_bits`` makes the plan take the Triton kernel):
    ``split``: segments per row, ``>= 1``; ``tile``: keys per tile, a power of two ``>= 16`` (a row of at most
    ``tile`` keys stays in registers; the streamed paths stream tiles of it); ``num_warps``: warps per program
    of the first launch, a power of two ``<= 32``; ``compact``: the compacted path (above); ``select``:
    ``"radix"`` or ``"search"`` (:data:`SELECTS`); ``sample``: sample size of the compacted path, a power of
    two in ``[16, MAX_TILE]``; ``pivots``: 1 or 3 per search step; ``radix_bits``: digit width of the radix
    select, 5-13 (default :data:`DEFAULT_RADIX_BITS`).

    Raises:
        TypeError / ValueError naming the argument.
    """
    rows = check_int_scalar(rows, "rows", min_value=0)
    n_cols = check_int_scalar(n_cols, "n_cols", min_value=0)
    k = check_int_scalar(k, "k", min_value=1)
    dev = _device(device)
    vec = check_int_scalar(vec, "vec", min_value=0)
    radix_bits = check_int_scalar(radix_bits, "radix_bits")
    if not 5 <= radix_bits <= 13:
        # >= 5: tl.histogram gives every lane of a warp at least one bin; <= 13: 2**13 int32 bins are
        # 32 KiB of shared memory and 8 registers per thread at 32 warps; wider digits spill.
        raise ValueError(f"radix_bits must be in [5, 13], got {radix_bits}")
    if tile is not None:
        tile = check_int_scalar(tile, "tile", min_value=16)
        if tile & (tile - 1):
            raise ValueError(f"tile must be a power of two, got {tile}")
    if num_warps is not None:
        num_warps = check_int_scalar(num_warps, "num_warps", min_value=1)
        if num_warps & (num_warps - 1) or num_warps > 32:
            raise ValueError(f"num_warps must be a power of two <= 32, got {num_warps}")
    if split is not None:
        split = check_int_scalar(split, "split", min_value=1)
    if compact is not None:
        compact = check_bool(compact, "compact")
        if compact and not compact_cap(k):
            raise ValueError(f"compact=True needs k <= {MAX_TILE // 2} (its candidate list is a tile), got k={k}")
    if select is not None and (not isinstance(select, str) or select not in SELECTS):
        raise ValueError(f"select must be one of {SELECTS}, got {select!r}")
    if sample is not None:
        sample = check_int_scalar(sample, "sample", min_value=16)
        if sample & (sample - 1) or sample > MAX_TILE:
            raise ValueError(f"sample must be a power of two in [16, {MAX_TILE}], got {sample}")
    if pivots is not None:
        pivots = check_int_scalar(pivots, "pivots")
        if pivots not in (1, 3):
            raise ValueError(f"pivots must be 1 or 3, got {pivots}")
    sel = DEFAULT_SELECT if select is None else select
    piv = DEFAULT_PIVOTS if pivots is None else pivots
    if engine is not None and engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES} or None, got {engine!r}")
    if cute is not None:
        if not isinstance(cute, (tuple, list)) or len(cute) != 3:
            raise TypeError(f"cute must be a tuple (cluster, threads, first_bits) or None, got {cute!r}")
        for name, v in zip(("cluster", "threads", "first_bits"), cute):
            if v is not None:
                check_int_scalar(v, f"cute's {name}")

    def made_for(plan: LaunchPlan) -> LaunchPlan:
        # the call checks this shape against its own (tiles, segments, lists and workspace follow it)
        return plan._replace(radix_bits=radix_bits, rows=rows, n_cols=n_cols, k=k, device=str(dev))

    triton_knobs = any(x is not None for x in (split, tile, num_warps, compact, select, sample, pivots))
    if engine == "cutedsl" and triton_knobs:
        raise ValueError(
            "engine='cutedsl' takes no Triton tuning (split, tile, num_warps, compact, select, sample, pivots)"
        )
    if engine != "triton" and not triton_knobs:
        cp = _cute_plan(rows, n_cols, k, dev, vec, cute)
        if cp is not None:
            return made_for(LaunchPlan(0, True, 0, 1, select=sel, pivots=piv, engine="cutedsl", cute=cp, vec=vec))
        if engine == "cutedsl":
            raise ValueError(
                f"engine='cutedsl' cannot run this call (CUDA device, float32 scores with unit column stride and a "
                f"row of at most 8 * 32768 keys, k <= 32768 needed): rows={rows}, cols={n_cols}, k={k}, vec={vec}"
            )
    cap = compact_cap(k)
    fits = n_cols <= (tile or MAX_TILE)
    if compact is None:
        compact = not fits and prefer_compact(rows, n_cols, k)
    if compact and cap:
        s = _auto_segments(rows, n_cols, dev) if split is None else split
        # at least 16 keys per segment; at most 64 segments, and no more than the list holds entries (the last
        # program joins the lists CAP / next_pow2(S) entries per segment at a time)
        s = max(1, min(s, cdiv(max(n_cols, 1), 16), 64, cap))
        t = tile or min(STREAM_TILE, max(16, next_pow2(max(n_cols, 1))))
        smp = sample or _sample_size(n_cols, k, cap)
        w = num_warps or max(4, min(16, max(t, cap, smp) // 512))
        return made_for(LaunchPlan(t, False, w, s, (), True, cap, smp, sel, piv))
    if split is None:
        split = 1
        if dev.type == "cuda" and not triton_interpreting() and n_cols >= 4 * MAX_TILE and 4 * k <= MAX_TILE:
            if rows * 4 <= sm_count(dev):
                split = cdiv(n_cols, MAX_TILE)
    split = max(1, min(split, cdiv(max(n_cols, 1), 16)))
    seg = cdiv(n_cols, split) if split > 1 else n_cols
    t, one, w = _tile_config(seg, tile, num_warps)
    levels = _split_levels(split, k, tile or MAX_TILE)
    # The launches after the first (split rows only): each further level selects among the previous level's
    # segments' candidates, the last launch among the last level's; their tiles follow their sizes (tile when
    # given), their warps the tile (num_warps is the first launch's).
    later, n = [], n_cols
    for lvl, s in enumerate(levels):
        if lvl:
            later.append(_tile_config(cdiv(n, s), tile, None))
        n = s * k
    if levels:
        later.append(_tile_config(n, tile, None))
    return made_for(LaunchPlan(t, one, w, split, levels, False, 0, 0, sel, piv, later=tuple(later)))


def _device(device: torch.device | str) -> torch.device:
    """``device`` as a plan records it: a CUDA device with its index (the current one when it has none)."""
    if not isinstance(device, (torch.device, str)):
        raise TypeError(f"device must be a torch.device or a str, got {type(device).__name__}")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _check_plan(plan: LaunchPlan, scores: torch.Tensor, k: int) -> LaunchPlan:
    """``plan`` when it was made for this call — ``scores``' rows, columns and device, and ``k``
    (:func:`launch_plan` records them) — and can run it (the CuTeDSL engine: a vector width the scores'
    layout allows, :func:`scores_vec`); a ``ValueError`` naming ``plan`` otherwise (a ``TypeError`` when it is
    not a :class:`LaunchPlan`)."""
    if not isinstance(plan, LaunchPlan):
        raise TypeError(f"plan must be a LaunchPlan (launch_plan makes it) or None, got {type(plan).__name__}")
    rows, cols = scores.shape
    want = (rows, cols, k, str(scores.device))
    if (plan.rows, plan.n_cols, plan.k, plan.device) != want:
        # another shape's tiles, segments, candidate list and workspace would select wrongly or overrun
        raise ValueError(
            f"plan was made for rows={plan.rows}, n_cols={plan.n_cols}, k={plan.k} on {plan.device!r}, not for this "
            f"call's rows={rows}, n_cols={cols}, k={k} on {want[3]!r}: make it with "
            "launch_plan(rows, n_cols, k, device, ...) for this shape"
        )
    if plan.engine == "cutedsl":
        v = scores_vec(scores)
        if not 1 <= plan.vec <= v:  # vector widths are powers of two: v allows every width up to it
            raise ValueError(
                f"plan takes the CuTeDSL kernel at vec={plan.vec} keys per vector load, which these scores cannot "
                f"give (their layout allows {v}, scores_vec; 0: not float32 with unit column stride on a GPU)"
            )
    return plan


def scores_vec(scores: torch.Tensor) -> int:
    """Keys per vector load the CuTeDSL kernel could read float ``[T, cols]`` ``scores`` with: 4, 2 or 1, or 0
    where it cannot run here (not a CUDA device, the Triton interpreter, nvidia-cutlass-dsl missing, or a
    layout it cannot read: :func:`~dcp_ref.kernels.local_topk_cutedsl.vec_for`). :func:`launch_plan`'s ``vec``."""
    if scores.device.type != "cuda" or triton_interpreting():
        return 0
    try:
        from .local_topk_cutedsl import vec_for
    except ImportError:
        return 0
    return vec_for(scores)


def _cute_plan(
    rows: int,
    n_cols: int,
    k: int,
    device: torch.device,
    vec: int,
    cute: tuple[int | None, int | None, int | None] | None,
) -> tuple[int, int, int, int, str] | None:
    """The CuTeDSL kernel's plan, or ``None`` where it cannot run (see :func:`launch_plan`)."""
    if vec < 1 or device.type != "cuda" or triton_interpreting() or rows < 1:
        return None
    try:
        from .local_topk_cutedsl import plan_for
    except ImportError:  # nvidia-cutlass-dsl missing: the Triton kernel runs
        return None
    cluster, threads, first_bits = cute if cute is not None else (None, None, None)
    return plan_for(rows, n_cols, k, vec, cluster=cluster, threads=threads, first_bits=first_bits)


def _compact_words(plan: LaunchPlan) -> int:
    """int64 words per row of the compacted path's workspace: the lists, their two counts each, the arrival
    counter and the path word (:func:`filter_topk_kernel`)."""
    return plan.split * (plan.cap + 2) + 2


def workspace_for(scores: torch.Tensor, k: int, *, plan: LaunchPlan | None = None) -> torch.Tensor | None:
    """The ``workspace=`` buffer :func:`indexer_topk_pack` needs for float ``[T, cols]`` ``scores``, ``k`` and
    ``plan`` (the same one the call gets; ``None``: the default plan, by shape), or ``None`` when the plan
    needs none. Allocate it once, outside a CUDA graph, and pass it on every call: the call then allocates
    nothing. One call at a time per workspace (the compacted path's counters belong to the call in flight):
    give each stream (and each thread that launches concurrently) its own.

    Returns:
        compacted path: int64 ``[T, words]``, **zeroed** (its per-row arrival counters must start at 0;
        every call leaves them at 0); streamed split path: float32 ``[T, sum(levels), k, 2]``; or ``None`` (the
        CuTeDSL engine, and the Triton paths that need none).
    Raises:
        ValueError naming ``plan`` when it was made for another shape (as :func:`indexer_topk_pack` does).
    """
    check_tensor(scores, "scores", ndim=2)
    k = check_int_scalar(k, "k", min_value=1)
    rows, cols = scores.shape
    if plan is None:
        plan = launch_plan(rows, cols, k, scores.device, vec=scores_vec(scores))
    else:
        plan = _check_plan(plan, scores, k)
    if plan.engine == "cutedsl":
        return None
    if plan.compact:
        return torch.zeros((rows, _compact_words(plan)), dtype=torch.int64, device=scores.device)
    n = sum(plan.levels)
    return torch.empty((rows, n, k, 2), dtype=torch.float32, device=scores.device) if n else None


def compact_paths(workspace: torch.Tensor) -> torch.Tensor:
    """The path each row's selection took in the compacted path's last call with this ``workspace``:
    int64 ``[T]``: 1 = among the candidate list; 2 = ties at the sampled bound (one more streamed pass);
    3 = the keys above the bound listed again (one more streamed pass); 4 = the sample missed (the
    streamed radix select). See :func:`finish_filtered`. A view: read it after the call (a host read syncs)."""
    return workspace[:, -1]


@overload
def indexer_topk_pack(
    scores: torch.Tensor,
    lengths: torch.Tensor | None,
    k: int,
    geometry: DcpGeometry,
    row_starts: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    validate: bool = True,
    workspace: torch.Tensor | None = None,
    plan: LaunchPlan | None = None,
    order: Literal["global_id"] = ...,
    out_ids: None = None,
) -> torch.Tensor: ...


@overload
def indexer_topk_pack(
    scores: torch.Tensor,
    lengths: torch.Tensor | None,
    k: int,
    geometry: DcpGeometry,
    row_starts: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    validate: bool = True,
    workspace: torch.Tensor | None = None,
    plan: LaunchPlan | None = None,
    order: Literal["rank_local"],
    out_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]: ...


def indexer_topk_pack(
    scores: torch.Tensor,
    lengths: torch.Tensor | None,
    k: int,
    geometry: DcpGeometry,
    row_starts: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    validate: bool = True,
    workspace: torch.Tensor | None = None,
    plan: LaunchPlan | None = None,
    order: str = "global_id",
    out_ids: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Local stable top-``k`` of each score row, packed for the all-gather (the indexer stage).

    ``order="global_id"``: same result as ``pack_candidates(scores, local_topk(scores, k, lengths,
    row_starts), geometry, row_starts)`` as a *set* of ``(score, id)`` pairs per row
    (bit for bit); the kernel writes the winners ordered by local index, then the padding.
    ``order="rank_local"``: the result of :func:`dcp_ref.indexer.local_topk_rank_local` exactly (the
    winners' scores in ascending local index order, NaN padding; their local indices, ``-1`` padding).

    Args:
        scores: float ``[T, cols]``, any strides (float32 expected; other float dtypes are read as
            float32, like the reference): this rank's indexer scores, local key ``j`` of row ``r``
            in column ``row_starts[r] + j``.
        lengths: int32/int64 ``[T]``: only local keys ``j < lengths[r]`` are valid (the causal
            bound from the ownership stage), or ``None`` for every column from the row's start on.
        k: candidates per row, ``k >= 1``; rows with fewer valid keys are padded.
        geometry: this rank's :class:`~dcp_ref.geometry.DcpGeometry` (world size, rank and interleave give
            the global ids, ``local_to_global``; ``order="rank_local"`` does not use them).
        row_starts: optional int32/int64 ``[T]`` column offsets (prefill rows).
        out: ``"global_id"``: optional float32 ``[T, k, 2]`` contiguous, 8-byte aligned buffer;
            ``"rank_local"``: optional float32 ``[T, k]`` contiguous buffer for the scores (CUDA graphs).
        validate: check the values of ``lengths`` / ``row_starts`` (and the ``2**24`` id bound): inside
            the kernel, then one host read of a flag after it (when it is raised, the host checks run
            for the precise message, and ``out`` may have been written). ``False`` skips them (shapes,
            dtypes and devices are still checked): the kernel clamps each row's window on the device, so
            bad values never read out of bounds. When the shapes alone cannot rule out a global id
            ``>= 2**24`` (``"global_id"`` only), the values are checked on the host before the launch
            anyway: a lossy id must raise, not be packed silently.
        workspace: the buffer :func:`workspace_for` makes (for the same ``plan``) when the plan needs
            one (compacted path: int64, zeroed; split streamed path: float32 ``[T, sum(levels), k, 2]``);
            allocated when needed and not given.
        plan: how the call runs, a :class:`LaunchPlan` from :func:`launch_plan` — the engine and every launch
            decision (tiles, warps, segments, the compacted path, select, sample, pivots, radix digit width, the
            CuTeDSL kernel's tuning) — made for this call's ``T``, ``cols``, ``k`` and device, and used as is; a
            ``ValueError`` naming ``plan`` when it was made for another shape or device, or cannot run on these
            scores. ``None``: ``launch_plan(T, cols, k, scores.device, vec=scores_vec(scores))``, the default
            plan by shape.
        order: ``"global_id"`` or ``"rank_local"`` (:data:`ORDERS`).
        out_ids: ``"rank_local"`` only: optional int32 ``[T, k]`` contiguous buffer for the local indices.
    Returns:
        ``"global_id"``: float32 ``[T, k, 2]`` (``out`` when given): ``[..., 0]`` score, ``[..., 1]`` global
        id; ``(-inf, -1)`` after the row's ``min(k, valid keys)`` winners. ``"rank_local"``: ``(scores
        float32 [T, k], ids int32 [T, k])`` (``out``, ``out_ids`` when given).
    Raises:
        TypeError / ValueError naming the argument (as the reference does for the same input).
    """
    validate = check_bool(validate, "validate")
    g = check_geometry(geometry)
    k = check_int_scalar(k, "k", min_value=1)
    check_tensor(scores, "scores", dtypes=FLOAT_DTYPES, ndim=2)
    dev = scores.device
    if dev.type != "cuda" and not triton_interpreting():
        raise ValueError(f"scores must be a CUDA tensor (or set TRITON_INTERPRET=1 for the CPU interpreter), got {dev}")
    if not isinstance(order, str) or order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    rank_local = order == "rank_local"
    rows, cols = scores.shape
    for name, arg in (("lengths", lengths), ("row_starts", row_starts)):
        if arg is not None:
            check_tensor(arg, name, dtypes=INT_DTYPES, ndim=1, device=dev)
            if arg.shape[0] != rows:
                raise ValueError(f"{name} must have shape [{rows}] (one per scores row), got {tuple(arg.shape)}")
    if rank_local:
        out = _check_flat(out, "out", (rows, k), torch.float32, dev)
        out_ids = _check_flat(out_ids, "out_ids", (rows, k), torch.int32, dev)
    else:
        if out_ids is not None:
            raise ValueError("out_ids is only written with order='rank_local'")
        out = _check_pairs(out, "out", (rows, k, 2), dev)
    # every buffer the kernel writes, against what it reads (and the other buffer): an aliased out is a
    # schedule-dependent answer
    check_no_aliases(dict(out=out, out_ids=out_ids, workspace=workspace),
                     dict(scores=scores, lengths=lengths, row_starts=row_starts))  # fmt: skip
    # Largest global id the shapes allow: no sync needed when it is exactly representable (rank-local ids
    # are int32 local indices: no bound).
    host_check = not rank_local and (cols // g.interleave + 1) * g.stripe > _MAX_EXACT_ID
    if host_check:
        _validate_values(cols, lengths, row_starts, g)
    fused_check = validate and not host_check and rows > 0 and (lengths is not None or row_starts is not None)
    if cols * scores.stride(1) >= 2**31:
        # The kernel's per-key column offsets are int32 (the row's base offset is int64): a column
        # stride this large (a column-major view of a huge matrix) would overflow them. Masked-off
        # lanes never dereference their (possibly wrapped) address.
        scores = scores.contiguous()
    if plan is None:
        plan = launch_plan(rows, cols, k, dev, vec=scores_vec(scores))
    else:
        plan = _check_plan(plan, scores, k)
    if plan.engine == "cutedsl":
        pass  # no workspace: a given one is not read
    elif plan.compact:
        workspace = _check_words(workspace, (rows, _compact_words(plan)), dev)
    else:
        n_ws = sum(plan.levels)
        if workspace is not None or n_ws:
            workspace = _check_pairs(workspace, "workspace", (rows, n_ws, k, 2), dev)
        if rank_local and n_ws and cols > _MAX_EXACT_ID:
            raise ValueError(
                f"scores has {cols} columns: the split streamed path carries local indices as float32 (exact below "
                "2**24); use a plan with compact=True (or split=1) for rank-local rows this long"
            )
    if rows == 0:
        return (out, out_ids) if rank_local else out  # type: ignore[return-value]
    chk = check_flag(dev) if fused_check else None
    if plan.engine == "cutedsl":
        from .local_topk_cutedsl import local_topk_pack_cutedsl

        assert plan.cute is not None
        local_topk_pack_cutedsl(scores, lengths, k, g.rank * g.interleave, g.stripe, g.interleave, row_starts, out,
                                out_ids, chk, plan.cute, plan.vec, order)  # fmt: skip
    else:
        dummy = out  # never read: HAS_LENGTHS / HAS_STARTS are False
        # The kernel reads lengths[row] / row_starts[row] at unit stride: a strided view is copied first (the
        # conformance kit found a strided `lengths` read wrongly).
        lens = lengths.contiguous() if lengths is not None else dummy
        starts = row_starts.contiguous() if row_starts is not None else dummy
        _launch(plan, scores, lens, starts, out, out_ids, workspace, chk, k, g, rank_local, lengths is not None,
                row_starts is not None)  # fmt: skip
    if chk is not None and int(chk.item()):  # the one host read of a validated call
        chk.zero_()
        _validate_values(cols, lengths, row_starts, g, ids=not rank_local)  # raises the precise message
        raise ValueError("lengths / row_starts put a row's window outside scores")  # unreachable: the host agrees
    return (out, out_ids) if rank_local else out  # type: ignore[return-value]


def _launch(
    plan: LaunchPlan,
    scores: torch.Tensor,
    lens: torch.Tensor,
    starts: torch.Tensor,
    out: torch.Tensor,
    out_ids: torch.Tensor | None,
    workspace: torch.Tensor | None,
    chk: torch.Tensor | None,
    k: int,
    g: DcpGeometry,
    rank_local: bool,
    has_lengths: bool,
    has_starts: bool,
) -> None:
    """The launches of one call (shapes checked, plan made)."""
    r, w, i = g.rank, g.world_size, g.interleave  # the kernels' loose ints: rank at run time, W and I constexpr
    rows, cols = scores.shape
    pad_block = min(next_pow2(k), 1024)
    sel = SELECTS.index(plan.select)
    radix_bits = plan.radix_bits
    out_arg = out if rank_local else out.view(torch.int64)
    if plan.compact:
        assert workspace is not None  # checked (or allocated) by the caller
        s = plan.split
        seg_len = cdiv(cdiv(max(cols, 1), s), 16) * 16  # a multiple of 16 keys: aligned segment starts
        filter_topk_kernel[(rows, s)](
            scores, lens, starts, out_arg, out_ids, workspace, chk, cols, seg_len, scores.stride(0), scores.stride(1),
            workspace.stride(0), k, r, math.isqrt(k * plan.cap),
            HAS_LENGTHS=has_lengths, HAS_STARTS=has_starts, WORLD=w, INTERLEAVE=i, SEGMENTS=s,
            SEG_POW2=next_pow2(s), TILE=plan.tile, CAP=plan.cap, SAMPLE=plan.sample, SELECT=sel,
            PIVOTS=plan.pivots, RADIX_BITS=radix_bits, PAD_BLOCK=pad_block, SPLIT_OUT=rank_local,
            CHECK=chk is not None, num_warps=plan.num_warps,
        )  # fmt: skip
        return
    common = dict(k=k, rank=r, WORLD=w, INTERLEAVE=i, RADIX_BITS=radix_bits, PAD_BLOCK=pad_block, SELECT=sel,
                  PIVOTS=plan.pivots, LOCAL_IDS=rank_local)  # fmt: skip
    if not plan.levels:
        indexer_topk_pack_kernel[(rows, 1)](
            scores, lens, starts, out_arg, cols, max(cols, 1), scores.stride(0), scores.stride(1), k,
            HAS_LENGTHS=has_lengths, HAS_STARTS=has_starts, PACKED_INPUT=False, NAN_PAD=False,
            TILE=plan.tile, ONE_CHUNK=plan.one_chunk, num_warps=plan.num_warps, ids_ptr=out_ids, chk_ptr=chk,
            SPLIT_OUT=rank_local, CHECK=chk is not None, **common,
        )  # fmt: skip
        return
    # Split rows. Level 1: each segment's top-k into the workspace, in index order, padded with NaN
    # scores (= invalid). Every further level does the same over the previous level's candidates,
    # whose ids travel with them; the last launch selects the row's top-k into `out`.
    assert workspace is not None  # checked (or allocated) by the caller
    ws64 = workspace.view(torch.int64)
    n_ws = workspace.shape[1]
    row_pairs = n_ws * k  # (score, id) pairs per workspace row
    src, src_stride, n, packed, off = scores, (scores.stride(0), scores.stride(1)), cols, False, 0
    configs = ((plan.tile, plan.one_chunk, plan.num_warps), *plan.later)  # every launch's (tile, one_chunk, warps)
    for lvl, s in enumerate(plan.levels):
        seg = cdiv(n, s)
        t, one, nw = configs[lvl]
        indexer_topk_pack_kernel[(rows, s)](
            src, lens, starts, ws64[:, off:], n, seg, *src_stride, row_pairs,
            HAS_LENGTHS=has_lengths and not packed, HAS_STARTS=has_starts and not packed,
            PACKED_INPUT=packed, NAN_PAD=True, TILE=t, ONE_CHUNK=one, num_warps=nw,
            chk_ptr=chk if lvl == 0 else None, CHECK=chk is not None and lvl == 0, **common,
        )  # fmt: skip
        src, src_stride, n, packed = workspace[:, off : off + s], (2 * row_pairs, 2), s * k, True
        off += s
    t, one, nw = configs[-1]
    indexer_topk_pack_kernel[(rows, 1)](
        src, out, out, out_arg, n, n, *src_stride, k,
        HAS_LENGTHS=False, HAS_STARTS=False, PACKED_INPUT=True, NAN_PAD=False,
        TILE=t, ONE_CHUNK=one, num_warps=nw, ids_ptr=out_ids, SPLIT_OUT=rank_local, **common,
    )  # fmt: skip


def _check_pairs(buf: torch.Tensor | None, name: str, shape: tuple[int, ...], dev: torch.device) -> torch.Tensor:
    """A contiguous, 8-byte aligned float32 buffer of ``shape`` (allocated when ``None``)."""
    if buf is None:
        return torch.empty(shape, dtype=torch.float32, device=dev)
    check_tensor(buf, name, dtypes=(torch.float32,), ndim=len(shape), device=dev)
    if tuple(buf.shape) != shape or not buf.is_contiguous():
        raise ValueError(f"{name} must be a contiguous float32 {list(shape)} tensor, got shape {tuple(buf.shape)}")
    if buf.storage_offset() % 2 or buf.data_ptr() % 8:
        raise ValueError(f"{name} must be 8-byte aligned (each (score, id) pair is written as one 8-byte store)")
    return buf


def _check_flat(
    buf: torch.Tensor | None, name: str, shape: tuple[int, int], dtype: torch.dtype, dev: torch.device
) -> torch.Tensor:
    """A contiguous buffer of ``shape`` and ``dtype`` (allocated when ``None``): the rank-local outputs."""
    if buf is None:
        return torch.empty(shape, dtype=dtype, device=dev)
    check_tensor(buf, name, dtypes=(dtype,), ndim=2, device=dev)
    if tuple(buf.shape) != shape or not buf.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {str(dtype).replace('torch.', '')} {list(shape)} tensor, "
                         f"got shape {tuple(buf.shape)}")  # fmt: skip
    return buf


def _check_words(buf: torch.Tensor | None, shape: tuple[int, int], dev: torch.device) -> torch.Tensor:
    """The compacted path's workspace: a contiguous int64 buffer of ``shape`` (zeroed when allocated here)."""
    if buf is None:
        return torch.zeros(shape, dtype=torch.int64, device=dev)
    check_tensor(buf, "workspace", dtypes=(torch.int64,), ndim=2, device=dev)
    if tuple(buf.shape) != shape or not buf.is_contiguous():
        raise ValueError(
            f"workspace must be a contiguous int64 {list(shape)} tensor (workspace_for makes it), "
            f"got shape {tuple(buf.shape)}"
        )
    return buf


def _validate_values(
    cols: int, lengths: torch.Tensor | None, row_starts: torch.Tensor | None, geometry: DcpGeometry, ids: bool = True
) -> None:
    """Host checks of the window values (the reference's), and (``ids``) the float32-exact id bound."""
    starts = None if row_starts is None else row_starts.long()
    if starts is not None and starts.numel() and bool(((starts < 0) | (starts > cols)).any()):
        bad = starts[(starts < 0) | (starts > cols)][0].item()
        raise ValueError(f"row_starts must lie in [0, cols={cols}], found {bad}")
    if lengths is not None and lengths.numel():
        n = lengths.long()
        if bool((n < 0).any()):
            raise ValueError(f"lengths must be non-negative, found {int(n.min())}")
        if starts is None and bool((n > cols).any()):
            raise ValueError(
                f"lengths must be <= scores.shape[1]={cols} (the index scores are narrower than the local bound: "
                f"keys past column {cols} would be dropped), got max {int(n.max())}"
            )
        if starts is not None and bool((n + starts > cols).any()):
            raise ValueError(f"row_starts + lengths must be <= cols={cols} (a row's keys lie inside scores)")
        n_max = int(n.max())
    elif lengths is None:
        n_max = cols if starts is None or not starts.numel() else int((cols - starts).max())
    else:
        n_max = 0
    if ids and n_max > 0:
        j = n_max - 1  # local_to_global is increasing in j
        w, r, i = geometry.world_size, geometry.rank, geometry.interleave
        gid = (j // i) * (w * i) + r * i + j % i
        if gid >= _MAX_EXACT_ID:
            name = "lengths" if lengths is not None else "scores"  # what makes the window this long
            raise ValueError(
                f"{name} reach local key {j}, whose global id {gid} for {geometry!r} is >= 2**24: not exactly "
                "representable in float32; the (score, id) packing needs ids < 16777216"
            )
