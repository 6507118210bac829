"""Triton kernel: the indexer stage's local top-K, fused with the candidate pack.

The GPU twin of ``pack_candidates(scores, local_topk(scores, k, lengths, row_starts), rank, W, I,
row_starts)`` (:mod:`dcp_ref.indexer`, :mod:`dcp_ref.topk`): each program reads one row of this
rank's indexer scores, selects its top-``k`` local keys by the stable order (score descending as
float32 with ``-0.0 == +0.0``, NaN invalid, then lower index) and writes them straight into the
all-gather buffer as ``(score, float(global id))`` pairs. One launch, no torch ops in between.

How one program selects (one row; the ids are implicit in the column):

1. **Keys.** Every score becomes a 32-bit unsigned key whose unsigned order is the score order
   (:func:`order_key`); NaN and columns outside the row's window get key ``0`` (invalid). The
   index is not part of the key: keys that tie on all 32 bits are resolved by position at the end.
2. **Radix select** (:func:`select_threshold`). MSB-first digits of ``RADIX_BITS`` bits (5 by
   default: at most 7 passes over 32 bits). Each pass histograms the digit of the valid keys that
   still match the prefix chosen so far (:func:`digit_histogram`: ``tl.histogram``), and
   :func:`choose_bin` picks the bin holding the k-th largest key. It stops as soon as that bin
   holds exactly the keys still needed. Why narrow digits: Triton lowers ``tl.histogram`` to one
   warp ballot per digit bit and, per element, work on each of the ``2**bits / 32`` bins a lane
   owns, then one shared-memory atomic per bin and lane; a 2048-bin (11-bit) histogram therefore
   costs ~100x the work per key of a 32-bin one, far more than the extra passes save (measured in
   ``benchmarks/results/local_topk.json``, ``tuning``).
3. **Commit** (:func:`commit_tile`). The winners are the keys above the threshold prefix, plus,
   when keys tie with the threshold on all 32 bits, the lowest-index ones (an exclusive prefix
   count). A winner's output slot is its rank among the winners in index order (a prefix sum):
   dense, deterministic, ordered by local index. Its score is re-read (exact bits: ``-0.0`` stays
   ``-0.0``, as in the reference) and packed with ``local_to_global`` of its column.
4. **Padding** (:func:`write_padding`). Slots ``[min(k, valid keys), k)`` get ``(-inf, -1)``: what
   ``pack_candidates`` writes for a ``-1`` entry.

A row of up to one tile (8192 keys by default) is read once and kept in registers; a longer row
is streamed tile by tile in every pass (re-read from L1/L2 on a GPU, the next tile's load issued
before the current tile is processed).

**Split rows** (``split=S > 1``, for few long rows, where one program per row would leave most
of the GPU idle): a first launch runs the same program on ``S`` segments of each row, each
keeping its own top-``k`` (into a ``[T, S, k, 2]`` workspace, in index order); a second launch
selects the top-``k`` of those ``S*k`` candidates. This is exact for the reason the DCP step is:
a key of the row's top-``k`` is beaten by at most ``k - 1`` keys of the row, hence of its segment,
so it is in its segment's top-``k`` (chapter 02 makes the same argument for ranks). Candidates
stay in index order across segments, so ties still go to the lower index.

Every load is masked by the row's window, clamped on the device, so even with ``validate=False``
nothing outside ``scores`` is read. No host synchronisation with ``validate=False``, no allocation
with ``out=`` (and ``workspace=`` when split): capturable in a CUDA graph.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dcp_ref._checks import FLOAT_DTYPES, INT_DTYPES, check_int_scalar, check_tensor, check_world, triton_interpreting

__all__ = [
    "order_key",
    "row_window",
    "load_keys",
    "digit_histogram",
    "row_histogram",
    "choose_bin",
    "select_threshold",
    "local_to_global_ids",
    "pack_pair",
    "commit_tile",
    "write_padding",
    "indexer_topk_pack_kernel",
    "MAX_TILE",
    "DEFAULT_RADIX_BITS",
    "LaunchPlan",
    "launch_plan",
    "workspace_for",
    "indexer_topk_pack",
]

_MAX_EXACT_ID = 1 << 24


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
def load_keys(row_ptr, offs, n, stride_c):
    """Keys of local keys ``offs`` of one row (masked: ``offs >= n`` reads nothing, key 0)."""
    in_row = offs < n
    x = tl.load(row_ptr + offs * stride_c, mask=in_row, other=0.0).to(tl.float32)
    key = order_key(x)
    return tl.where(in_row, key, tl.zeros_like(key))


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
def commit_tile(
    row_ptr,
    out_row_ptr,
    offs,
    j0,
    stride_c,
    keys,
    hi_mask,
    prefix,
    need,
    partial,
    eq_seen,
    base,
    rank,
    WORLD: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    PACKED_INPUT: tl.constexpr,
):
    """Write the winners among keys ``offs`` of one tile, in index order.

    ``base`` winners and ``eq_seen`` threshold-equal keys came before this tile (returned
    updated). A winner's slot is its rank among the row's winners. Its global id is
    ``local_to_global(j0 + offs)``, or, for packed candidates (the second launch of a split
    row), the id stored next to the score.
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
    win = (top > prefix) | take
    wi = win.to(tl.int32)
    slot = base + tl.cumsum(wi, 0) - 1
    ptr = row_ptr + offs * stride_c
    score = tl.load(ptr, mask=win, other=0.0).to(tl.float32)  # exact bits: -0.0 stays -0.0
    if PACKED_INPUT:
        gid_f = tl.load(ptr + 1, mask=win, other=-1.0)
    else:
        gid_f = local_to_global_ids(j0 + offs, rank, WORLD, INTERLEAVE).to(tl.float32)
    tl.store(out_row_ptr + slot, pack_pair(score, gid_f), mask=win)
    return base + tl.sum(wi, 0), eq_seen


@triton.jit
def write_padding(out_row_ptr, n_sel, k, PAD_BLOCK: tl.constexpr, NAN_PAD: tl.constexpr):
    """Slots ``[n_sel, k)`` get ``(-inf, -1)``: what ``pack_candidates`` writes for a ``-1`` entry.

    (``NAN_PAD``: ``(NaN, -1)`` instead, in a split row's workspace, so that the second launch
    sees the padding as invalid rather than as a valid ``-inf`` score.)
    """
    if NAN_PAD:
        pad_score = tl.full([PAD_BLOCK], float("nan"), tl.float32)
    else:
        pad_score = tl.full([PAD_BLOCK], float("-inf"), tl.float32)
    fill = pack_pair(pad_score, tl.full([PAD_BLOCK], -1.0, tl.float32))
    for s in range((n_sel // PAD_BLOCK) * PAD_BLOCK, k, PAD_BLOCK):
        o = s + tl.arange(0, PAD_BLOCK)
        tl.store(out_row_ptr + o, fill, mask=(o >= n_sel) & (o < k))


@triton.jit
def indexer_topk_pack_kernel(
    scores_ptr,
    lengths_ptr,
    starts_ptr,
    out_ptr,
    n_cols,
    seg_len,
    stride_r,
    stride_c,
    out_stride_r,
    k,
    rank,
    HAS_LENGTHS: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    WORLD: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    PACKED_INPUT: tl.constexpr,
    NAN_PAD: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    TILE: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
):
    """Grid ``(T, S)``: program ``(r, s)`` selects the top-``k`` of local keys
    ``[s*seg_len, (s+1)*seg_len)`` of row ``r`` (``S = 1``, ``seg_len >= n_cols``: the whole row)
    and writes them to ``out[r*out_stride_r + s*k : ... + k]`` (``out``: the int64 view of float32
    ``(score, id)`` pairs).
    """
    row = tl.program_id(0)
    seg = tl.program_id(1)
    start, n_row = row_window(lengths_ptr, starts_ptr, row, n_cols, HAS_LENGTHS, HAS_STARTS)
    j0 = seg * seg_len  # first local index of this segment
    n = tl.minimum(tl.maximum(n_row - j0, 0), seg_len)
    row_ptr = scores_ptr + row.to(tl.int64) * stride_r + (start + j0).to(tl.int64) * stride_c
    out_row_ptr = out_ptr + row.to(tl.int64) * out_stride_r + seg * k
    offs = tl.arange(0, TILE)
    if ONE_CHUNK:
        keys = load_keys(row_ptr, offs, n, stride_c)  # the whole row: read once, kept in registers
    else:
        keys = tl.zeros([TILE], tl.uint32)  # unused: every pass streams the row
    hi_mask, prefix, need, count, n_sel = select_threshold(row_ptr, n, stride_c, keys, k, RADIX_BITS, TILE, ONE_CHUNK)
    partial = need < count
    base = tl.zeros([], tl.int32)
    eq_seen = tl.zeros([], tl.int32)
    if ONE_CHUNK:
        commit_tile(
            row_ptr,
            out_row_ptr,
            offs,
            j0,
            stride_c,
            keys,
            hi_mask,
            prefix,
            need,
            partial,
            eq_seen,
            base,
            rank,
            WORLD,
            INTERLEAVE,
            PACKED_INPUT,
        )
    else:
        nxt = load_keys(row_ptr, offs, n, stride_c)
        for c in range(0, n, TILE):
            cur = nxt
            nxt = load_keys(row_ptr, c + TILE + offs, n, stride_c)
            base, eq_seen = commit_tile(
                row_ptr,
                out_row_ptr,
                c + offs,
                j0,
                stride_c,
                cur,
                hi_mask,
                prefix,
                need,
                partial,
                eq_seen,
                base,
                rank,
                WORLD,
                INTERLEAVE,
                PACKED_INPUT,
            )
    write_padding(out_row_ptr, n_sel, k, PAD_BLOCK, NAN_PAD)


class LaunchPlan(NamedTuple):
    """How one call runs (see :func:`launch_plan`)."""

    tile: int  #: keys per tile of the first launch (a power of two)
    one_chunk: bool  #: a row (segment) of the first launch fits one tile: read once, kept in registers
    num_warps: int  #: warps per program of the first launch
    split: int  #: segments per row in the first launch (1: one program per row, one launch)
    levels: tuple[int, ...] = ()  #: segments per row of every splitting launch (``()`` when split == 1)


#: Digit width of the radix select (bits per pass; at most 7 passes). See the module docstring for why
#: narrow digits win: on the H200, T = 32, L = 8192 took 19.9 us at 5 bits, 20.7 at 6, 31 at 8, 188 at 11.
DEFAULT_RADIX_BITS = 5

#: Keys per program that stay in registers: about 8 per thread at 32 warps. More makes the
#: per-key temporaries of the histogram and the commit spill (ptxas, sm_90a: 63 registers at
#: 8192 keys and 32 warps; 118 at 32 keys per thread).
MAX_TILE = 8192


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _tile_config(n: int, tile: int | None, num_warps: int | None) -> tuple[int, bool, int]:
    if tile is None:
        tile = max(triton.next_power_of_2(max(n, 1)), 256) if n <= MAX_TILE else MAX_TILE // 2
    one_chunk = n <= tile
    if num_warps is None:
        # Measured on the H200 (local_topk.json, "tuning"): 16 keys per thread is best for a row held in
        # registers (8192 keys: 16 warps 19.9 us vs 32 warps 23.0), 8 for a streamed tile (T = 32, L = 131072:
        # 16 warps 122 us vs 8 warps 124; T = 1024, L = 32768: 790 vs 936).
        num_warps = max(4, min(32, tile // (512 if one_chunk else 256)))
    return tile, one_chunk, num_warps


def _split_levels(n_cols: int, k: int, split: int, limit: int) -> tuple[int, ...]:
    """Segments per row of each splitting launch: ``split`` first, then, while the ``S*k``
    candidates left exceed ``limit`` keys and a level still shrinks them at least 4-fold, another
    level of ``ceil(S*k / limit)`` segments."""
    if split <= 1:
        return ()
    levels, n = [split], split * k
    while n > limit and 4 * k <= limit:
        s = triton.cdiv(n, limit)
        levels.append(s)
        n = s * k
    return tuple(levels)


def launch_plan(
    rows: int,
    n_cols: int,
    k: int,
    device: torch.device,
    *,
    split: int | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
) -> LaunchPlan:
    """How :func:`indexer_topk_pack` runs ``rows`` rows of ``n_cols`` columns (shapes only, no sync).

    A row of up to :data:`MAX_TILE` columns is one tile, held in registers; a longer one is
    streamed in tiles of ``MAX_TILE / 2``. Split (``split=None``): on a GPU, long rows
    (``n_cols >= 4 * MAX_TILE``) with ``k <= MAX_TILE / 4`` are cut into segments of
    ``MAX_TILE`` when the rows alone fill less than a quarter of the SMs; never under the
    interpreter. ``split=1`` forces one program per row. When the ``split * k`` candidates of
    the segments are still more than one tile, they are split again (``levels``), each level
    shrinking them at least 4-fold, before the last launch selects the row's top-``k``.
    """
    if split is None:
        split = 1
        if device.type == "cuda" and not triton_interpreting() and n_cols >= 4 * MAX_TILE and 4 * k <= MAX_TILE:
            if rows * 4 <= _sm_count(device.index if device.index is not None else torch.cuda.current_device()):
                split = triton.cdiv(n_cols, MAX_TILE)
    split = max(1, min(split, triton.cdiv(max(n_cols, 1), 16)))
    seg = triton.cdiv(n_cols, split) if split > 1 else n_cols
    t, one, w = _tile_config(seg, tile, num_warps)
    return LaunchPlan(t, one, w, split, _split_levels(n_cols, k, split, tile or MAX_TILE))


def workspace_for(
    scores: torch.Tensor, k: int, *, split: int | None = None, tile: int | None = None
) -> torch.Tensor | None:
    """The ``workspace=`` buffer :func:`indexer_topk_pack` needs for ``scores`` and ``k`` (the same
    ``split`` / ``tile``), or ``None`` when its plan does not split rows. Allocate it once, outside
    a CUDA graph, and pass it on every call: the call then allocates nothing.

    Returns:
        float32 ``[T, sum(levels), k, 2]`` on ``scores``' device, or ``None``.
    """
    rows, cols = scores.shape
    n = sum(launch_plan(rows, cols, k, scores.device, split=split, tile=tile).levels)
    return torch.empty((rows, n, k, 2), dtype=torch.float32, device=scores.device) if n else None


def indexer_topk_pack(
    scores: torch.Tensor,
    lengths: torch.Tensor | None,
    k: int,
    rank: int,
    world_size: int,
    interleave: int = 1,
    row_starts: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    validate: bool = True,
    workspace: torch.Tensor | None = None,
    split: int | None = None,
    radix_bits: int = DEFAULT_RADIX_BITS,
    tile: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Local stable top-``k`` of each score row, packed for the all-gather (the indexer stage).

    Same result as ``pack_candidates(scores, local_topk(scores, k, lengths, row_starts), rank,
    world_size, interleave, row_starts)`` as a *set* of ``(score, id)`` pairs per row (bit for
    bit); the kernel writes the winners ordered by local index, then the padding.

    Args:
        scores: float ``[T, cols]``, any strides (float32 expected; other float dtypes are read as
            float32, like the reference): this rank's indexer scores, local key ``j`` of row ``r``
            in column ``row_starts[r] + j``.
        lengths: int32/int64 ``[T]``: only local keys ``j < lengths[r]`` are valid (the causal
            bound from the ownership stage), or ``None`` for every column from the row's start on.
        k: candidates per row, ``k >= 1``; rows with fewer valid keys are padded.
        rank, world_size, interleave: the DCP geometry (``local_to_global``).
        row_starts: optional int32/int64 ``[T]`` column offsets (prefill rows).
        out: optional float32 ``[T, k, 2]`` contiguous, 8-byte aligned buffer (CUDA graphs).
        validate: check the values of ``lengths`` / ``row_starts`` and the ``2**24`` id bound on
            the host (one sync). ``False`` skips them (shapes, dtypes and devices are still checked):
            the kernel clamps each row's window on the device, so bad values never read out of
            bounds. When the shapes alone cannot rule out a global id ``>= 2**24``, the values are
            checked anyway: a lossy id must raise, not be packed silently.
        workspace: float32 ``[T, sum(levels), k, 2]`` contiguous buffer for split rows
            (:func:`workspace_for` makes it; ``levels`` from :func:`launch_plan`); allocated when
            needed and not given.
        split, radix_bits, tile, num_warps: tuning. ``split``: segments per row (``None``: see
            :func:`launch_plan`); ``radix_bits``: digit width, 5-13 (default :data:`DEFAULT_RADIX_BITS`);
            ``tile``: keys per tile, a power of two (a row, or segment, of at most ``tile`` keys stays
            in registers);
            ``num_warps``: warps per program.
    Returns:
        float32 ``[T, k, 2]`` (``out`` when given): ``[..., 0]`` score, ``[..., 1]`` global id;
        ``(-inf, -1)`` after the row's ``min(k, valid keys)`` winners.
    Raises:
        TypeError / ValueError naming the argument (as the reference does for the same input).
    """
    w, r_checked, i = check_world(world_size, rank, interleave)
    r = int(r_checked)  # type: ignore[arg-type]  # never None: a rank was given
    k = check_int_scalar(k, "k", min_value=1)
    check_tensor(scores, "scores", dtypes=FLOAT_DTYPES, ndim=2)
    dev = scores.device
    if dev.type != "cuda" and not triton_interpreting():
        raise ValueError(f"scores must be a CUDA tensor (or set TRITON_INTERPRET=1 for the CPU interpreter), got {dev}")
    rows, cols = scores.shape
    for name, arg in (("lengths", lengths), ("row_starts", row_starts)):
        if arg is not None:
            check_tensor(arg, name, dtypes=INT_DTYPES, ndim=1, device=dev)
            if arg.shape[0] != rows:
                raise ValueError(f"{name} must have shape [{rows}] (one per scores row), got {tuple(arg.shape)}")
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
    out = _check_pairs(out, "out", (rows, k, 2), dev)
    # Largest global id the shapes allow: no sync needed when it is exactly representable.
    id_bound = (cols // i + 1) * w * i
    if validate or id_bound > _MAX_EXACT_ID:
        _validate_values(cols, lengths, row_starts, r, w, i)
    if cols * scores.stride(1) >= 2**31:
        # The kernel's per-key column offsets are int32 (the row's base offset is int64): a column
        # stride this large (a column-major view of a huge matrix) would overflow them. Masked-off
        # lanes never dereference their (possibly wrapped) address.
        scores = scores.contiguous()
    plan = launch_plan(rows, cols, k, dev, split=split, tile=tile, num_warps=num_warps)
    n_ws = sum(plan.levels)
    if workspace is not None or n_ws:
        workspace = _check_pairs(workspace, "workspace", (rows, n_ws, k, 2), dev)
    if rows == 0:
        return out
    pad_block = min(triton.next_power_of_2(k), 1024)
    common = dict(k=k, rank=r, WORLD=w, INTERLEAVE=i, RADIX_BITS=radix_bits, PAD_BLOCK=pad_block)
    out64 = out.view(torch.int64)
    dummy = out  # never read: HAS_LENGTHS / HAS_STARTS are False
    # The kernel reads lengths[row] / row_starts[row] at unit stride: a strided view is copied first (the
    # conformance kit found a strided `lengths` read wrongly).
    lens = lengths.contiguous() if lengths is not None else dummy
    starts = row_starts.contiguous() if row_starts is not None else dummy
    if not plan.levels:
        indexer_topk_pack_kernel[(rows, 1)](
            scores, lens, starts, out64, cols, max(cols, 1), scores.stride(0), scores.stride(1), k,
            HAS_LENGTHS=lengths is not None, HAS_STARTS=row_starts is not None, PACKED_INPUT=False, NAN_PAD=False,
            TILE=plan.tile, ONE_CHUNK=plan.one_chunk, num_warps=plan.num_warps, **common,
        )  # fmt: skip
        return out
    # Split rows. Level 1: each segment's top-k into the workspace, in index order, padded with NaN
    # scores (= invalid). Every further level does the same over the previous level's candidates,
    # whose ids travel with them; the last launch selects the row's top-k into `out`.
    assert workspace is not None  # checked (or allocated) above
    ws64 = workspace.view(torch.int64)
    row_pairs = n_ws * k  # (score, id) pairs per workspace row
    src, src_stride, n, packed, off = scores, (scores.stride(0), scores.stride(1)), cols, False, 0
    for lvl, s in enumerate(plan.levels):
        seg = triton.cdiv(n, s)
        t, one, nw = _tile_config(seg, tile, num_warps)
        if lvl == 0:
            t, one, nw = plan.tile, plan.one_chunk, plan.num_warps
        indexer_topk_pack_kernel[(rows, s)](
            src, lens, starts, ws64[:, off:], n, seg, *src_stride, row_pairs,
            HAS_LENGTHS=lengths is not None and not packed, HAS_STARTS=row_starts is not None and not packed,
            PACKED_INPUT=packed, NAN_PAD=True, TILE=t, ONE_CHUNK=one, num_warps=nw, **common,
        )  # fmt: skip
        src, src_stride, n, packed = workspace[:, off : off + s], (2 * row_pairs, 2), s * k, True
        off += s
    t, one, nw = _tile_config(n, tile, num_warps)
    indexer_topk_pack_kernel[(rows, 1)](
        src, dummy, dummy, out64, n, n, *src_stride, k,
        HAS_LENGTHS=False, HAS_STARTS=False, PACKED_INPUT=True, NAN_PAD=False,
        TILE=t, ONE_CHUNK=one, num_warps=nw, **common,
    )  # fmt: skip
    return out


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


def _validate_values(
    cols: int, lengths: torch.Tensor | None, row_starts: torch.Tensor | None, r: int, w: int, i: int
) -> None:
    """Host checks of the window values (the reference's), and the float32-exact id bound."""
    starts = None if row_starts is None else row_starts.long()
    if starts is not None and starts.numel() and bool(((starts < 0) | (starts > cols)).any()):
        bad = starts[(starts < 0) | (starts > cols)][0].item()
        raise ValueError(f"row_starts must lie in [0, cols={cols}], found {bad}")
    if lengths is not None and lengths.numel():
        n = lengths.long()
        if bool((n < 0).any()):
            raise ValueError(f"lengths must be non-negative, found {int(n.min())}")
        if bool((n + (0 if starts is None else starts) > cols).any()):
            raise ValueError(f"row_starts + lengths must be <= cols={cols} (a row's keys lie inside scores)")
        n_max = int(n.max())
    elif lengths is None:
        n_max = cols if starts is None or not starts.numel() else int((cols - starts).max())
    else:
        n_max = 0
    if n_max > 0:
        j = n_max - 1  # local_to_global is increasing in j
        g = (j // i) * (w * i) + r * i + j % i
        if g >= _MAX_EXACT_ID:
            raise ValueError(
                f"global id {g} of local key {j} >= 2**24 is not exactly representable in float32; the "
                "(score, id) packing needs ids < 16777216 (lengths / row_starts too long for this geometry)"
            )
