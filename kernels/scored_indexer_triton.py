"""Triton kernel: scoring -> local top-K -> pack, fused, so that the ``[T, L]`` index scores never reach HBM.

The GPU twin of ``indexer_topk_pack(index_scores(...), local_bounds, k, geometry, row_starts)``
(:mod:`.scoring_triton` then :mod:`.indexer_triton`; the oracle is
``pack_candidates(s, local_topk(s, k, local_bounds, row_starts), ...)`` on the reference scores
:func:`dcp_ref.scoring.index_scores`): the same ``(score, global id)`` pairs per row, as a set, bit
for bit (given the same scores: the scoring helpers are the same code), written straight into the
all-gather buffer. The indexer's selection (stable order: score descending, ``-0.0 == +0.0``, NaN
invalid, then lower index) is the one of :mod:`.indexer_triton`, reused as is — its ``@triton.jit``
helpers ``load_keys``, ``select_threshold``, ``commit_tile``, ``write_padding`` and, for the last
selection, ``indexer_topk_pack_kernel``.

How it runs
-----------
Each row's local keys are cut into **segments** of ``SEG`` keys (a power of two <= 8192: what the
indexer keeps in registers). A **persistent grid** of ``P`` programs (about what fits on the GPU at
once) walks the ``T * S`` (row, segment) items; for each item a program

1. scores the segment tile by tile (``BLOCK_N`` keys per FP8 ``tl.dot``, the helpers of
   :mod:`.scoring_triton`: paged reads through the block table, every access masked, int64
   addresses) into **its own scratch row** — ``scratch[P, SEG]`` float32, small enough to stay in L2
   (132 SMs x 3 programs x 32 KiB = 13 MiB) — then ``tl.debug_barrier()`` (the CTA's writes become
   visible to all its threads);
2. runs the indexer's radix select on that scratch row (``select_threshold`` on the keys held in
   registers, ``commit_tile`` re-reading the winners' exact scores, ``write_padding``) exactly as
   ``indexer_topk_pack_kernel`` does for one chunk — or, with ``sel_tile < seg``, streaming the row
   from the scratch in every radix pass as that kernel does for a long row (fewer registers, more
   programs per SM: one's scoring overlaps another's select) — and a second barrier before the
   scratch row is reused.

A row of one segment writes its top-``k`` straight into ``out``. A longer row writes each segment's
top-``k`` into the split workspace ``[T, sum(levels), k, 2]`` (NaN-padded: invalid), and
``indexer_topk_pack_kernel`` with ``PACKED_INPUT=True`` selects the row's top-``k`` of those —
exact for the indexer's reason (a key of the row's top-``k`` is in its segment's top-``k``), with
further levels while the candidates exceed one tile, as ``indexer_topk_pack`` splits rows.

Metadata out of contract (``validate=False``) poisons the row as in :mod:`dcp_ref.scoring` (its
scores would all be NaN): here the row simply has no valid key, so it gets ``k`` padding pairs —
exactly what the unfused pipeline gives for an all-NaN score row. The width ``n_cols`` of the score
matrix the call stands for decides, as ``out``'s width does there, which rows overflow; with
``row_starts`` (prefill) the columns do not matter otherwise (a candidate's id is the global
position of its local index).
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dcp_ref._checks import check_int_scalar, check_tensor, max_global_id_bound
from dcp_ref.geometry import DcpGeometry
from dcp_ref.index_cache import INDEX_K_FP8
from dcp_ref.scoring import check_scoring_inputs

from ._util import cdiv, next_pow2, per_thread, sm_count
from .indexer_triton import (
    DEFAULT_RADIX_BITS,
    MAX_TILE,
    _split_levels,
    commit_tile,
    indexer_topk_pack_kernel,
    launch_plan,
    load_keys,
    select_threshold,
    write_padding,
)
from .scoring_triton import (
    NO_WIDTH,
    SCAN,
    _check_device,
    kernel_views,
    key_slots,
    load_key_tile,
    load_query,
    row_meta,
    row_poisoned,
    score_keys,
)

__all__ = [
    "score_segment",
    "select_segment",
    "scored_topk_pack_kernel",
    "ScoredPlan",
    "scored_plan",
    "scratch_for",
    "workspace_for",
    "scored_topk_pack",
    "fused_scored_indexer",
]

_MAX_EXACT_ID = 1 << 24


@triton.jit
def score_segment(
    q, w, cache_u8, cache_f32, bt_row, sbt_c, j0, n, block_size, scratch_row,
    Q_FP8: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Scores of local keys ``j0 .. j0 + n - 1`` into ``scratch_row[0 .. n)``, ``BLOCK_N`` keys at a time (the
    innermost loop with a dot: the one the launch's ``num_stages`` software-pipelines)."""
    for c in range(0, n, BLOCK_N):
        o = c + tl.arange(0, BLOCK_N)
        valid = o < n
        phys, off = key_slots(bt_row, sbt_c, j0 + o, valid, block_size)
        keys, scale = load_key_tile(cache_u8, cache_f32, phys, off, valid, block_size, D)
        tl.store(scratch_row + o, score_keys(keys, scale, q, w, Q_FP8), mask=valid)


@triton.jit
def select_segment(
    scratch_row, out_row_ptr, n, j0, k, rank,
    WORLD: tl.constexpr, INTERLEAVE: tl.constexpr, NAN_PAD: tl.constexpr, RADIX_BITS: tl.constexpr,
    TILE: tl.constexpr, ONE_CHUNK: tl.constexpr, PAD_BLOCK: tl.constexpr,
):  # fmt: skip
    """The indexer's selection (``indexer_topk_pack_kernel`` for one chunk) over the ``n`` scores of a
    scratch row: its top-``k`` as ``(score, global id of j0 + column)`` pairs in index order, then
    padding. ``ONE_CHUNK``: the ``n <= TILE`` keys are read once and held in registers; otherwise
    every radix pass streams the row from the scratch (L2) ``TILE`` keys at a time — fewer registers,
    so that more programs fit on an SM and one's scoring overlaps another's selection."""
    offs = tl.arange(0, TILE)
    if ONE_CHUNK:
        keys = load_keys(scratch_row, offs, n, 1)
    else:
        keys = tl.zeros([TILE], tl.uint32)  # unused: every pass streams the row
    hi_mask, prefix, need, count, n_sel = select_threshold(scratch_row, n, 1, keys, k, RADIX_BITS, TILE, ONE_CHUNK)
    partial = need < count
    base = tl.zeros([], tl.int32)
    eq_seen = tl.zeros([], tl.int32)
    if ONE_CHUNK:
        commit_tile(
            scratch_row, out_row_ptr, offs, j0, 1, keys, hi_mask, prefix, need, partial, eq_seen, base, rank,
            WORLD, INTERLEAVE, False,
        )  # fmt: skip
    else:
        nxt = load_keys(scratch_row, offs, n, 1)
        for c in range(0, n, TILE):
            cur = nxt
            nxt = load_keys(scratch_row, c + TILE + offs, n, 1)
            base, eq_seen = commit_tile(
                scratch_row, out_row_ptr, c + offs, j0, 1, cur, hi_mask, prefix, need, partial, eq_seen, base, rank,
                WORLD, INTERLEAVE, False,
            )  # fmt: skip
    write_padding(out_row_ptr, n_sel, k, PAD_BLOCK, NAN_PAD)


@triton.jit
def scored_topk_pack_kernel(
    q_ptr, w_ptr, cache_u8, cache_f32, bt_ptr, req_ptr, bound_ptr, start_ptr, scratch_ptr, out_ptr,
    n_rows, n_segs, n_req, n_tbl, n_blocks, no_width, n_heads, block_size,
    sq_t, sq_h, sq_d, sw_t, sw_h, sbt_r, sbt_c, out_stride_r,
    k, rank,
    HAS_STARTS: tl.constexpr, Q_FP8: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, SEG: tl.constexpr, SEL_TILE: tl.constexpr, SCAN_N: tl.constexpr,
    WORLD: tl.constexpr, INTERLEAVE: tl.constexpr, NAN_PAD: tl.constexpr, RADIX_BITS: tl.constexpr,
    PAD_BLOCK: tl.constexpr,
):  # fmt: skip
    """Persistent grid ``(P,)``: program ``p`` handles items ``p, p + P, ...`` of the ``n_rows * n_segs``
    (row, segment) items, through its scratch row ``scratch[p, :SEG]``; segment ``s`` of row ``r``
    writes ``out[r * out_stride_r + s * k : ... + k]`` (``out``: the int64 view of the float32 pairs)."""
    pid = tl.program_id(0)
    scratch_row = scratch_ptr + pid.to(tl.int64) * SEG
    for item in range(pid, n_rows * n_segs, tl.num_programs(0)):
        row = item // n_segs
        seg = item % n_segs
        req, bound, start = row_meta(req_ptr, bound_ptr, start_ptr, row, HAS_STARTS)
        bad = row_poisoned(
            bt_ptr, sbt_r, sbt_c, req, bound, start, n_req, n_tbl, n_blocks, no_width, block_size, SCAN_N
        )
        j0 = seg * SEG
        n = tl.where(bad, 0, tl.minimum(tl.maximum(bound - j0, 0), SEG)).to(tl.int32)
        q, w = load_query(q_ptr, w_ptr, row, n_heads, sq_t, sq_h, sq_d, sw_t, sw_h, Q_FP8, H_PAD, D)
        bt_row = bt_ptr + tl.minimum(tl.maximum(req, 0), tl.maximum(n_req - 1, 0)) * sbt_r
        score_segment(q, w, cache_u8, cache_f32, bt_row, sbt_c, j0, n, block_size, scratch_row, Q_FP8, D, BLOCK_N)
        tl.debug_barrier()  # the segment's scores (written by all threads) are read by all threads next
        out_row_ptr = out_ptr + row.to(tl.int64) * out_stride_r + seg * k
        select_segment(
            scratch_row, out_row_ptr, n, j0, k, rank,
            WORLD, INTERLEAVE, NAN_PAD, RADIX_BITS, SEL_TILE, SEL_TILE == SEG, PAD_BLOCK,
        )  # fmt: skip
        tl.debug_barrier()  # every read of this scratch row is done before the next item overwrites it


class ScoredPlan(NamedTuple):
    """How one :func:`scored_topk_pack` call runs (see :func:`scored_plan`)."""

    seg: int  #: keys per segment (a power of two <= MAX_TILE)
    segments: int  #: segments per row (``S``)
    sel_tile: int  #: keys the select holds in registers: ``seg`` (read once), or less (streamed from the scratch)
    block_n: int  #: keys per scoring tile
    num_warps: int
    num_stages: int  #: software-pipeline stages of the scoring loop
    programs: int  #: persistent programs ``P`` (= rows of the scratch)
    levels: tuple[int, ...]  #: segments per row of every splitting level (``()`` when ``S == 1``)


def scored_plan(
    rows: int,
    max_keys: int,
    k: int,
    device: torch.device,
    *,
    seg: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    programs_per_sm: int | None = None,
    sel_tile: int | None = None,
    select_limit: int = MAX_TILE,
) -> ScoredPlan:
    """How :func:`scored_topk_pack` runs ``rows`` rows of up to ``max_keys`` local keys (shapes only).

    Defaults: segments of ``min(8192, next_pow2(max_keys))`` keys (at least ``block_n``), 128-key
    scoring tiles, 16 warps for 8192-key segments (the indexer's 16 keys per thread), 2 pipeline
    stages, as many persistent programs per SM as fit (1 at 16+ warps, 2 at 8, 3 at 4; at most 4
    programs under the CPU interpreter).
    ``sel_tile``: keys of a segment the select holds in registers (default ``seg``: all, read once; a
    smaller power of two streams them from the scratch in every radix pass, with fewer registers).
    ``select_limit``: candidates the last selection holds in registers (the indexer's ``MAX_TILE``;
    smaller values force extra split levels — for tests).
    """
    if seg is not None:
        seg = check_int_scalar(seg, "seg", min_value=16)
        if seg & (seg - 1) or seg > MAX_TILE:
            raise ValueError(f"seg must be a power of two in [16, {MAX_TILE}], got {seg}")
    if block_n is None:
        block_n = 128 if seg is None else min(128, seg)
    block_n = check_int_scalar(block_n, "block_n", min_value=16)
    if block_n & (block_n - 1) or block_n > 512:
        raise ValueError(f"block_n must be a power of two in [16, 512], got {block_n}")
    if seg is None:
        seg = min(MAX_TILE, max(next_pow2(max(max_keys, 1)), block_n, 64))
    if seg < block_n:
        raise ValueError(f"seg must be >= block_n={block_n} (a segment is scored in whole tiles), got {seg}")
    segments = max(1, cdiv(max_keys, seg))
    if num_warps is None:
        num_warps = max(4, min(32, seg // 512))
    num_warps = check_int_scalar(num_warps, "num_warps", min_value=1)
    if num_warps & (num_warps - 1) or num_warps > 32:
        raise ValueError(f"num_warps must be a power of two <= 32, got {num_warps}")
    num_stages = 2 if num_stages is None else check_int_scalar(num_stages, "num_stages", min_value=1)
    if programs_per_sm is None:  # what fits (sm_90a, ~128-200 registers per thread): 1 at 16+ warps, 3 at 4
        programs_per_sm = 1 if num_warps >= 16 else (2 if num_warps == 8 else 3)
    pps = check_int_scalar(programs_per_sm, "programs_per_sm", min_value=1)
    resident = pps * sm_count(device) if device.type == "cuda" else 4
    programs = max(1, min(rows * segments, resident))
    limit = check_int_scalar(select_limit, "select_limit", min_value=16)
    if sel_tile is None:
        sel_tile = seg
    sel_tile = check_int_scalar(sel_tile, "sel_tile", min_value=16)
    if sel_tile & (sel_tile - 1) or sel_tile > seg:
        raise ValueError(f"sel_tile must be a power of two in [16, seg={seg}], got {sel_tile}")
    levels = _split_levels(segments, k, limit)  # indexer_topk_pack's split levels
    return ScoredPlan(seg, segments, sel_tile, block_n, num_warps, num_stages, programs, levels)


def scratch_for(plan: ScoredPlan, device: torch.device | str) -> torch.Tensor:
    """The ``scratch=`` buffer of a plan: float32 ``[programs, seg]`` (allocate once, outside a graph)."""
    return torch.empty((plan.programs, plan.seg), dtype=torch.float32, device=device)


def workspace_for(plan: ScoredPlan, rows: int, k: int, device: torch.device | str) -> torch.Tensor | None:
    """The ``workspace=`` buffer of a plan: float32 ``[rows, sum(levels), k, 2]``, or ``None`` (no split)."""
    n = sum(plan.levels)
    return torch.empty((rows, n, k, 2), dtype=torch.float32, device=device) if n else None


def _check_buffer(buf: object, name: str, shape: tuple[int, ...], dev: torch.device, *, pairs: bool) -> torch.Tensor:
    check_tensor(buf, name, dtypes=(torch.float32,), ndim=len(shape), device=dev)
    assert isinstance(buf, torch.Tensor)
    if tuple(buf.shape) != shape or not buf.is_contiguous():
        raise ValueError(f"{name} must be a contiguous float32 {list(shape)} tensor, got shape {tuple(buf.shape)}")
    if pairs and (buf.storage_offset() % 2 or buf.data_ptr() % 8):
        raise ValueError(f"{name} must be 8-byte aligned (each (score, id) pair is written as one 8-byte store)")
    return buf


def _check_ids(local_bounds: torch.Tensor, max_keys: int, g: DcpGeometry) -> None:
    """Global ids must be exact in float32 (< 2**24): from the shapes when they suffice, else by value."""
    if max_global_id_bound(max_keys, g.world_size, g.interleave) <= _MAX_EXACT_ID or not local_bounds.numel():
        return
    n = int(local_bounds.long().clamp(0, max_keys).max())  # a bound past the table poisons its row: no id
    if n:
        j = n - 1
        gid = (j // g.interleave) * g.stripe + g.rank * g.interleave + j % g.interleave
        if gid >= _MAX_EXACT_ID:
            raise ValueError(
                f"local_bounds reach local key {j}, global id {gid} >= 2**24: not exactly representable in float32 "
                "(the (score, id) packing needs ids < 16777216)"
            )


def scored_topk_pack(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_of_token: torch.Tensor,
    local_bounds: torch.Tensor,
    geometry: DcpGeometry,
    k: int,
    *,
    n_cols: int | None = None,
    row_starts: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    validate: bool = True,
    seg: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    programs_per_sm: int | None = None,
    sel_tile: int | None = None,
    radix_bits: int = DEFAULT_RADIX_BITS,
    select_limit: int = MAX_TILE,
) -> torch.Tensor:
    """Scoring, local stable top-``k`` and pack in one pass: this rank's candidates for the all-gather.

    Same result, as a set of ``(score, id)`` pairs per row, bit for bit, as
    ``indexer_topk_pack(index_scores_triton(..., out=[T, n_cols]), local_bounds, k, geometry, row_starts)``
    with the same scoring tile (and hence as ``pack_candidates(s, local_topk(s, k, local_bounds,
    row_starts), geometry, row_starts)`` of those scores); the winners of each row are written in increasing
    id order, then ``(-inf, -1)`` padding.

    Args:
        index_q, weights, index_cache, block_table, req_of_token, local_bounds, geometry, row_starts:
            as in :func:`dcp_ref.scoring.index_scores` (``index_q``: float8_e4m3fn, fp16, bf16 or
            float32); ``geometry`` also gives the rank, ``W`` and ``I`` of the global ids.
        k: candidates per row, ``k >= 1``.
        n_cols: ``L``, the width of the score matrix this call stands for: a row with
            ``row_starts + local_bounds > n_cols`` is out of contract, as it would be for ``out`` in
            :func:`dcp_ref.scoring.index_scores`. ``None``: no width (any row inside the block table).
            Also sizes the segments: no row has more than ``n_cols`` (else ``M * block_size``) keys.
        out: optional float32 ``[T, k, 2]`` contiguous, 8-byte aligned buffer.
        workspace: float32 ``[T, sum(levels), k, 2]`` for rows of several segments
            (:func:`workspace_for`); allocated when needed and not given.
        scratch: float32 ``[programs, seg]`` (:func:`scratch_for`); allocated when not given. One
            call at a time may use a scratch (concurrent streams need their own).
        validate: check values on the host (one sync; the checks of
            :func:`dcp_ref.scoring.check_scoring_inputs`). ``False``: no host read (unless the shapes
            allow a global id ``>= 2**24``: then the bounds are read, as in ``indexer_topk_pack``);
            out-of-contract rows get no candidate (``k`` padding pairs).
        seg, block_n, num_warps, num_stages, programs_per_sm, sel_tile, select_limit: tuning, see
            :func:`scored_plan`. radix_bits: the select's digit width (5-13).
    Returns:
        float32 ``[T, k, 2]`` (``out`` when given).
    """
    a = check_scoring_inputs(
        index_q, weights, index_cache, block_table, req_of_token, local_bounds, geometry, row_starts, None, validate,
        width=n_cols is not None, n_cols=n_cols,
    )  # fmt: skip
    _check_device(index_q)
    k = check_int_scalar(k, "k", min_value=1)
    radix_bits = check_int_scalar(radix_bits, "radix_bits")
    if not 5 <= radix_bits <= 13:
        raise ValueError(f"radix_bits must be in [5, 13], got {radix_bits}")
    dev = index_q.device
    T = a.T
    if out is None:
        out = torch.empty((T, k, 2), dtype=torch.float32, device=dev)
    out = _check_buffer(out, "out", (T, k, 2), dev, pairs=True)
    # No in-contract row has more local keys than the table covers, nor than the width allows.
    max_keys = a.M * a.block_size if a.L is None else min(a.L, a.M * a.block_size)
    _check_ids(local_bounds, max_keys, geometry)
    plan = scored_plan(
        T, max_keys, k, dev, seg=seg, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
        programs_per_sm=programs_per_sm, sel_tile=sel_tile, select_limit=select_limit,
    )  # fmt: skip
    if scratch is None:
        scratch = scratch_for(plan, dev)
    scratch = _check_buffer(scratch, "scratch", (plan.programs, plan.seg), dev, pairs=False)
    n_ws = sum(plan.levels)
    if workspace is not None or n_ws:
        workspace = _check_buffer(
            workspace_for(plan, T, k, dev) if workspace is None else workspace, "workspace", (T, n_ws, k, 2), dev,
            pairs=True,
        )  # fmt: skip
    if T == 0:
        return out
    g = geometry
    pad_block = min(next_pow2(k), 1024)
    common = dict(
        k=k, rank=g.rank, WORLD=g.world_size, INTERLEAVE=g.interleave, RADIX_BITS=radix_bits, PAD_BLOCK=pad_block
    )
    out64 = out.view(torch.int64)
    split = plan.segments > 1
    assert not split or workspace is not None
    target, target_stride = (workspace.view(torch.int64), n_ws * k) if split else (out64, k)  # type: ignore[union-attr]
    q, cache_u8, cache_f32 = kernel_views(a, index_q)
    starts = row_starts if row_starts is not None else local_bounds  # never read without HAS_STARTS
    scored_topk_pack_kernel[(plan.programs,)](
        q, weights, cache_u8, cache_f32, block_table, req_of_token, local_bounds, starts, scratch, target,
        T, plan.segments, a.B, a.M, a.num_blocks, NO_WIDTH if a.L is None else a.L, a.H, a.block_size,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
        block_table.stride(0), block_table.stride(1), target_stride,
        HAS_STARTS=row_starts is not None, Q_FP8=index_q.dtype == torch.float8_e4m3fn,
        H_PAD=max(16, next_pow2(a.H)), D=INDEX_K_FP8.head_dim, BLOCK_N=plan.block_n, SEG=plan.seg,
        SEL_TILE=plan.sel_tile, SCAN_N=SCAN, NAN_PAD=split, num_warps=plan.num_warps, num_stages=plan.num_stages,
        **common,
    )  # fmt: skip
    if not split:
        return out
    # The rows' segment candidates -> the rows' top-k: indexer_topk_pack's split levels over packed input.
    assert workspace is not None
    ws64 = workspace.view(torch.int64)
    row_pairs = n_ws * k
    dummy = out  # lengths / row starts: never read (HAS_LENGTHS / HAS_STARTS are False)
    src, src_stride, n, off = workspace[:, : plan.segments], (2 * row_pairs, 2), plan.segments * k, plan.segments
    for s in plan.levels[1:]:
        seg_n = cdiv(n, s)
        lp = launch_plan(T, seg_n, k, dev, split=1, compact=False)  # the streamed kernel's tile and warps
        indexer_topk_pack_kernel[(T, s)](
            src, dummy, dummy, ws64[:, off:], n, seg_n, *src_stride, row_pairs,
            HAS_LENGTHS=False, HAS_STARTS=False, PACKED_INPUT=True, NAN_PAD=True,
            TILE=lp.tile, ONE_CHUNK=lp.one_chunk, num_warps=lp.num_warps, **common,
        )  # fmt: skip
        src, src_stride, n = workspace[:, off : off + s], (2 * row_pairs, 2), s * k
        off += s
    lp = launch_plan(T, n, k, dev, split=1, compact=False)
    indexer_topk_pack_kernel[(T, 1)](
        src, dummy, dummy, out64, n, n, *src_stride, k,
        HAS_LENGTHS=False, HAS_STARTS=False, PACKED_INPUT=True, NAN_PAD=False,
        TILE=lp.tile, ONE_CHUNK=lp.one_chunk, num_warps=lp.num_warps, **common,
    )  # fmt: skip
    return out


_PLANNED = threading.local()  # scratch + split workspace of the fused stage, per thread (rank) and shape


def fused_scored_indexer(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_of_token: torch.Tensor,
    local_bounds: torch.Tensor,
    geometry: DcpGeometry,
    k: int,
    *,
    n_cols: int,
    row_starts: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The scoring + indexer stages fused, as a stage: :func:`scored_topk_pack` with ``validate=False``
    (the ``ScoredIndexerStage`` protocol of :mod:`dcp_ref.stages`; ``n_cols``: the planned ``L``).

    Its scratch and split workspace are made once per thread (rank) and shape, on the first
    (warm-up) call, so that later calls — and a captured CUDA graph — allocate nothing. Returns
    float32 ``[T, k, 2]`` ``(score, global id)`` pairs (the indexer stage's contract).
    """
    from .stages import _launch

    T, dev = index_q.shape[0], index_q.device
    key = (T, tuple(block_table.shape), geometry.block_size, k, n_cols, dev)

    def make() -> tuple[torch.Tensor, torch.Tensor | None]:
        plan = scored_plan(T, min(n_cols, block_table.shape[1] * geometry.block_size), k, dev)
        return scratch_for(plan, dev), workspace_for(plan, T, k, dev)

    scratch, ws = per_thread(_PLANNED, key, make)
    with _launch(dev):
        return scored_topk_pack(
            index_q, weights, index_cache, block_table, req_of_token, local_bounds, geometry, k,
            n_cols=n_cols, row_starts=row_starts, out=out, workspace=ws, scratch=scratch, validate=False,
        )  # fmt: skip


fused_scored_indexer.impl_name = "triton-fused-scoring"  # type: ignore[attr-defined]  # the trace's name
