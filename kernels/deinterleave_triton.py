"""Triton kernels for the deinterleave and compaction stages: global token ids → this rank's physical KV slots,
compacted.

Reference (the oracle): :mod:`dcp_ref.deinterleave`. One query token's row of ``K`` selected
global ids becomes a row of physical slots with the valid ones first, ``-1`` after, plus a count.

Three compaction strategies (all fuse the conversion, all one row per ``program_id(0)``):

``"atomic"`` (unordered) — grid ``(T, cdiv(K, BLOCK))``. Every tile converts its ids, counts its
    valid and invalid entries and reserves room with **one** 64-bit ``atomic_add`` on a per-row
    word packing three counters (valid so far | invalid so far | tiles done). Valid slots go to
    ``base_valid + exclusive prefix`` from the front, ``-1`` go to the mirrored place from the
    back, so every output entry is written exactly once: no ``-1`` pre-fill pass. The tile that
    arrives last (``tiles done == n_tiles - 1``) writes the row count and resets the word to 0,
    so the workspace is zero again for the next launch: no zeroing pass either. One launch.
    Order across tiles is whatever order tiles reach the atomic — unspecified on a GPU.
``"rowscan"`` (ordered) — grid ``(T,)``. One program walks its row tile by tile, carrying the
    running valid / invalid counts: a row-wide prefix scan, deterministic, any ``K``.
``"twopass"`` (ordered) — grid ``(T, n_tiles)`` twice: pass 1 stores each tile's valid count,
    pass 2 re-converts and writes at the exclusive prefix of the tile counts. Deterministic,
    more parallel for few rows, but two launches and the conversion done twice.

Measured on the H200 (``benchmarks/results/deinterleave.md``, K = 2048): ``rowscan`` is within
0.5 µs of ``atomic`` at 32 rows and 3-5 % faster at 1024-4096 rows, and 13-19 % faster than
``twopass`` at 1024-4096 rows, so it is the default for ordered *and* unordered calls.

The DCP geometry (``DCP_SIZE``, ``DCP_RANK``, ``DCP_INTERLEAVE``) and the KV block size are
compile-time constants, so the divisions become shifts/multiplies (``W = 1`` compiles to the
plain conversion). ``token_ids`` / ``block_table`` may have any strides. Wrappers accept
caller-provided ``out`` / ``counts`` / ``workspace`` buffers: with them the GPU path allocates
nothing and never synchronises with the host, so it can be captured in a CUDA graph.

Validation is the reference's own (:func:`dcp_ref.deinterleave.check_deinterleave_inputs`): the
same inputs (int32 or int64 ids, request ids and block tables) are accepted and rejected with the
same messages. ``validate=False`` — the hot path, CUDA-graph capturable — reads nothing on the
host; out-of-contract metadata is handled on the device with exactly the reference's answer (the
rule of :mod:`dcp_ref.deinterleave`, written once there): never read out of bounds, and *poisoned*
with :data:`~dcp_ref.deinterleave.POISON_SLOT` (``2**31 - 1``, counted like a slot, outside every
cache: the attention stage gives its row NaN) — every entry of a row whose request id is outside
``[0, B)``, an id this rank owns whose block is past the table or negative, a slot that does not
fit below ``2**31 - 1`` (computed in int64, never wrapped into a plausible small slot).
``validate=True`` (the default) runs the same launch with its ``CHECK`` switch on: a tile (a row, for
the row scan) that writes :data:`~dcp_ref.deinterleave.POISON_SLOT` into a counted entry — exactly
where the reference's value checks fail — raises a flag with one atomic max (the shared per-stream
:func:`~dcp_ref.kernels._util.check_flag`; a good tile writes nothing), and the call reads **one**
value, that flag, after the launch: no extra launch. Only a raised flag is cleared and the reference's
checker run, which raises its precise message. ``CHECK=False`` compiles the check out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dcp_ref.contracts import (
    check_bool,
    check_int_scalar,
    check_no_aliases,
    check_pow2,
    check_tensor,
    triton_interpreting,
)
from dcp_ref.deinterleave import (
    check_deinterleave_inputs,
    check_deinterleave_readable,
    raise_deinterleave_violation,
)
from dcp_ref.geometry import DcpGeometry
from dcp_ref.kernels._util import cdiv, check_flag, next_pow2, raise_if_flagged

__all__ = [
    "deinterleave_compact",
    "global_ids_to_local_slots_triton",
    "deinterleave_masked_triton",
    "workspace_numel",
    "METHODS",
    "DEFAULT_ORDERED_METHOD",
    "DEFAULT_UNORDERED_METHOD",
    "BLOCK_RANGE",
    "WARPS_RANGE",
    "deinterleave_kernel",
    "convert_tile",
    "flag_poisoned",
    "row_setup",
    "compact_tile_atomic",
    "rowscan_kernel",
    "twopass_count_kernel",
    "twopass_scatter_kernel",
]

METHODS = ("atomic", "rowscan", "twopass")
# Chosen from benchmarks/results/deinterleave.json (H200, K = 2048): the row-wide scan beat the
# two-pass scan on every shape (e.g. 34-37 vs 39-43 µs at 4096 rows, CUDA-graph medians), and it
# was as fast as the atomic kernel (within noise at 32 and 4096 rows, ~12 % faster at 1024) — so
# it is the default for unordered calls too: determinism costs nothing here. method="atomic"
# stays available (and is the only choice that parallelises one long row over many programs).
DEFAULT_ORDERED_METHOD = "rowscan"
DEFAULT_UNORDERED_METHOD = "rowscan"

# Field widths of the packed per-row counter of the atomic kernel (valid | invalid | tiles).
_FIELD_BITS = 21
_MAX_K_ATOMIC = (1 << _FIELD_BITS) - 1


@triton.jit
def convert_tile(
    ids_row_ptr, offs, K, stride_ik,
    bt_row_ptr, stride_btc, n_blocks, req_ok,
    DCP_SIZE: tl.constexpr, DCP_RANK: tl.constexpr, DCP_INTERLEAVE: tl.constexpr, KV_BLOCK: tl.constexpr,
):  # fmt: skip
    """Slots and validity of ids ``offs`` of one row (masked tail → invalid).

    ``valid``: the entry is counted — an id this rank owns, or *any* entry of a row whose request id
    is out of range. ``slot``: its physical slot, or ``POISON_SLOT`` (``2**31 - 1``) where the metadata
    is out of contract: an owned id with no block (past the table or a negative entry), a slot that
    does not fit below ``2**31 - 1``, a bad request id. The rule of :mod:`dcp_ref.deinterleave`.
    """
    in_row = offs < K
    t = tl.load(ids_row_ptr + offs * stride_ik, mask=in_row, other=-1)
    # Do the arithmetic on clamped ids: negative ids are masked out below, and C-style division
    # of a negative id would otherwise produce a plausible-looking rank / local index.
    tc = tl.maximum(t, 0)
    if DCP_SIZE == 1:
        owned = t >= 0
        local = tc
    else:
        owned = (t >= 0) & (((tc // DCP_INTERLEAVE) % DCP_SIZE) == DCP_RANK)
        local = (tc // (DCP_SIZE * DCP_INTERLEAVE)) * DCP_INTERLEAVE + tc % DCP_INTERLEAVE
    blk_idx = local // KV_BLOCK
    # Read the table only inside it, never out of bounds. A bad request id is folded into the bound
    # (0 usable blocks) rather than and-ed in as a scalar bool: one vector compare, and the
    # interpreter rejects broadcast scalar-bool masks.
    readable = owned & (blk_idx < tl.where(req_ok, n_blocks, 0))
    blk = tl.load(bt_row_ptr + blk_idx * stride_btc, mask=readable, other=-1).to(tl.int64)
    # Saturate the block id before the multiplication (int64): a corrupt block id must neither wrap
    # into a plausible small slot nor overflow.
    blk_sat = tl.minimum(blk, 2147483647 // KV_BLOCK + 1)
    slot = tl.minimum(blk_sat * KV_BLOCK + (local % KV_BLOCK).to(tl.int64), 2147483647)
    # No block (past the table, a negative entry, or a bad request: nothing was read) -> the poison slot.
    slot = tl.where(blk >= 0, slot, 2147483647).to(tl.int32)
    # A bad request poisons its whole row: every entry counts (as the poison slot).
    bad_req = tl.where(req_ok, 0, 1)
    valid = in_row & (owned | ((offs * 0 + bad_req) != 0))
    return slot, valid


@triton.jit
def flag_poisoned(chk_ptr, slot, valid):
    """``validate=True``: raise the flag ``chk[0]`` (an atomic max to 1) when a counted entry of this tile holds
    :data:`~dcp_ref.deinterleave.POISON_SLOT` — exactly where the reference's value checks fail. A good tile
    writes nothing; the wrapper reads the flag once after the launch."""
    if tl.max((valid & (slot == 2147483647)).to(tl.int32), axis=0) != 0:
        tl.atomic_max(chk_ptr, 1)


@triton.jit
def row_setup(req_ptr, row, n_reqs, bt_ptr, stride_btr, HAS_REQ: tl.constexpr):
    """The block-table row of query token ``row`` and whether its request id is in range."""
    if HAS_REQ:
        req = tl.load(req_ptr + row)
    else:
        req = row
    req_ok = (req >= 0) & (req < n_reqs)
    req_safe = tl.where(req_ok, req, 0)
    return bt_ptr + req_safe.to(tl.int64) * stride_btr, req_ok


@triton.jit
def compact_tile_atomic(out_row_ptr, counts_ptr, ws_ptr, row, row64, slot, valid, in_row, K, stride_ok):
    """Write one tile's slots compacted into its row: valid ones to the front, ``-1`` to the back.

    ``ws_ptr[row]`` is the row's packed int64 counter (valid so far | invalid so far | tiles done,
    21 bits each; zero on entry). One ``atomic_add`` per tile reserves both of the tile's ranges
    and takes a ticket; the tile that arrives last writes the row's count to ``counts_ptr[row]``
    and zeroes the word again. Order across tiles: whichever reaches the atomic first.
    """
    v = valid.to(tl.int32)
    inv = (in_row & (valid == 0)).to(tl.int32)
    n_valid = tl.sum(v, axis=0)
    n_inv = tl.sum(inv, axis=0)
    # One atomic per tile reserves both its front (valid) and back (-1) ranges and takes a
    # ticket: fields are 21 bits wide (K < 2**21 is checked by the wrapper).
    packed = (1 << 42) + (n_inv.to(tl.int64) << 21) + n_valid.to(tl.int64)
    old = tl.atomic_add(ws_ptr + row64, packed)
    base_v = (old & 0x1FFFFF).to(tl.int32)
    base_i = ((old >> 21) & 0x1FFFFF).to(tl.int32)
    done = (old >> 42).to(tl.int32)
    # Front: base + exclusive prefix of valid. Back: mirrored, so each entry is written once.
    pos_v = base_v + tl.cumsum(v, axis=0) - v
    pos_i = K - 1 - (base_i + tl.cumsum(inv, axis=0) - inv)
    dest = tl.where(valid, pos_v, pos_i)
    # A workspace that was not zero on entry (caller bug) would push `dest` out of the row:
    # keep such writes in bounds; the counts then come out wrong, memory stays intact.
    tl.store(out_row_ptr + dest * stride_ok, tl.where(valid, slot, -1), mask=in_row & (dest >= 0) & (dest < K))
    if done == tl.num_programs(1) - 1:
        # Last tile of this row: every other tile's atomic is already in `old`.
        tl.store(counts_ptr + row, base_v + n_valid)
        tl.atomic_xchg(ws_ptr + row64, 0)  # leave the workspace zeroed for the next launch


@triton.jit
def deinterleave_kernel(
    ids_ptr, req_ptr, bt_ptr, out_ptr, counts_ptr, ws_ptr,
    K, n_reqs, n_blocks,
    stride_ir, stride_ik, stride_btr, stride_btc, stride_or, stride_ok,
    HAS_REQ: tl.constexpr,
    DCP_SIZE: tl.constexpr, DCP_RANK: tl.constexpr, DCP_INTERLEAVE: tl.constexpr, KV_BLOCK: tl.constexpr,
    COMPACT_TO_FRONT: tl.constexpr, BLOCK: tl.constexpr,
    chk_ptr=None, CHECK: tl.constexpr = False,
):  # fmt: skip
    """Grid ``(T, cdiv(K, BLOCK))``. Convert one tile; with ``COMPACT_TO_FRONT`` compact it with
    the packed atomic counter ``ws_ptr[row]`` (int64, zero on entry, zero again on exit).
    ``CHECK`` (``validate=True``): a tile with a poisoned entry raises ``chk[0]`` (:func:`flag_poisoned`)."""
    row = tl.program_id(0)
    tile = tl.program_id(1)
    row64 = row.to(tl.int64)
    bt_row_ptr, req_ok = row_setup(req_ptr, row, n_reqs, bt_ptr, stride_btr, HAS_REQ)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    slot, valid = convert_tile(
        ids_ptr + row64 * stride_ir, offs, K, stride_ik, bt_row_ptr, stride_btc, n_blocks, req_ok,
        DCP_SIZE, DCP_RANK, DCP_INTERLEAVE, KV_BLOCK,
    )  # fmt: skip
    in_row = offs < K
    out_row_ptr = out_ptr + row64 * stride_or
    if CHECK:
        flag_poisoned(chk_ptr, slot, valid)
    if COMPACT_TO_FRONT:
        compact_tile_atomic(out_row_ptr, counts_ptr, ws_ptr, row, row64, slot, valid, in_row, K, stride_ok)
    else:
        tl.store(out_row_ptr + offs * stride_ok, tl.where(valid, slot, -1), mask=in_row)


@triton.jit
def rowscan_kernel(
    ids_ptr, req_ptr, bt_ptr, out_ptr, counts_ptr,
    K, n_reqs, n_blocks,
    stride_ir, stride_ik, stride_btr, stride_btc, stride_or, stride_ok,
    HAS_REQ: tl.constexpr,
    DCP_SIZE: tl.constexpr, DCP_RANK: tl.constexpr, DCP_INTERLEAVE: tl.constexpr, KV_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr, COMPACT: tl.constexpr,
    chk_ptr=None, CHECK: tl.constexpr = False,
):  # fmt: skip
    """Grid ``(T,)``: ordered compaction of one row by a sequential scan over its tiles, and its count.

    ``COMPACT=False`` (the masked layout): every entry stays at its position (``-1`` where not
    here) and only the count is carried: conversion and count in one launch. ``CHECK``
    (``validate=True``): a row with a poisoned entry raises ``chk[0]`` once, after its scan."""
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    bt_row_ptr, req_ok = row_setup(req_ptr, row, n_reqs, bt_ptr, stride_btr, HAS_REQ)
    ids_row_ptr = ids_ptr + row64 * stride_ir
    out_row_ptr = out_ptr + row64 * stride_or
    carry_v = tl.sum(tl.zeros((BLOCK,), dtype=tl.int32), axis=0)  # int32 scalar 0 (loop-carried)
    carry_i = carry_v
    if CHECK:
        poisoned = tl.zeros((BLOCK,), dtype=tl.int32)  # entries that hold the poison slot, over the tiles
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        slot, valid = convert_tile(
            ids_row_ptr, offs, K, stride_ik, bt_row_ptr, stride_btc, n_blocks, req_ok,
            DCP_SIZE, DCP_RANK, DCP_INTERLEAVE, KV_BLOCK,
        )  # fmt: skip
        in_row = offs < K
        v = valid.to(tl.int32)
        if COMPACT:
            inv = (in_row & (valid == 0)).to(tl.int32)
            pos_v = carry_v + tl.cumsum(v, axis=0) - v
            pos_i = K - 1 - (carry_i + tl.cumsum(inv, axis=0) - inv)
            dest = tl.where(valid, pos_v, pos_i)
            carry_i += tl.sum(inv, axis=0)
        else:
            dest = offs
        tl.store(out_row_ptr + dest * stride_ok, tl.where(valid, slot, -1), mask=in_row)
        carry_v += tl.sum(v, axis=0)
        if CHECK:
            poisoned = poisoned | (valid & (slot == 2147483647)).to(tl.int32)
    tl.store(counts_ptr + row, carry_v)
    if CHECK:
        if tl.max(poisoned, axis=0) != 0:
            tl.atomic_max(chk_ptr, 1)


@triton.jit
def twopass_count_kernel(
    ids_ptr, req_ptr, bt_ptr, ws_ptr,
    K, n_reqs, n_blocks, n_tiles,
    stride_ir, stride_ik, stride_btr, stride_btc,
    HAS_REQ: tl.constexpr,
    DCP_SIZE: tl.constexpr, DCP_RANK: tl.constexpr, DCP_INTERLEAVE: tl.constexpr, KV_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """Pass 1, grid ``(T, n_tiles)``: ``ws[row * n_tiles + tile]`` = valid entries of the tile."""
    row = tl.program_id(0)
    tile = tl.program_id(1)
    row64 = row.to(tl.int64)
    bt_row_ptr, req_ok = row_setup(req_ptr, row, n_reqs, bt_ptr, stride_btr, HAS_REQ)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    _slot, valid = convert_tile(  # the count pass needs only the validity
        ids_ptr + row64 * stride_ir, offs, K, stride_ik, bt_row_ptr, stride_btc, n_blocks, req_ok,
        DCP_SIZE, DCP_RANK, DCP_INTERLEAVE, KV_BLOCK,
    )  # fmt: skip
    tl.store(ws_ptr + row64 * n_tiles + tile, tl.sum(valid.to(tl.int32), axis=0).to(tl.int64))


@triton.jit
def twopass_scatter_kernel(
    ids_ptr, req_ptr, bt_ptr, out_ptr, counts_ptr, ws_ptr,
    K, n_reqs, n_blocks, n_tiles,
    stride_ir, stride_ik, stride_btr, stride_btc, stride_or, stride_ok,
    HAS_REQ: tl.constexpr,
    DCP_SIZE: tl.constexpr, DCP_RANK: tl.constexpr, DCP_INTERLEAVE: tl.constexpr, KV_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr, TILES_POW2: tl.constexpr,
    chk_ptr=None, CHECK: tl.constexpr = False,
):  # fmt: skip
    """Pass 2, grid ``(T, n_tiles)``: exclusive prefix of the tile counts, then the ordered write.
    ``CHECK`` (``validate=True``): a tile with a poisoned entry raises ``chk[0]`` (:func:`flag_poisoned`)."""
    row = tl.program_id(0)
    tile = tl.program_id(1)
    row64 = row.to(tl.int64)
    t_idx = tl.arange(0, TILES_POW2)
    tile_counts = tl.load(ws_ptr + row64 * n_tiles + t_idx, mask=t_idx < n_tiles, other=0).to(tl.int32)
    base_v = tl.sum(tl.where(t_idx < tile, tile_counts, 0), axis=0)
    base_i = tile * BLOCK - base_v  # every earlier tile is full (BLOCK entries)
    bt_row_ptr, req_ok = row_setup(req_ptr, row, n_reqs, bt_ptr, stride_btr, HAS_REQ)
    offs = tile * BLOCK + tl.arange(0, BLOCK)
    slot, valid = convert_tile(
        ids_ptr + row64 * stride_ir, offs, K, stride_ik, bt_row_ptr, stride_btc, n_blocks, req_ok,
        DCP_SIZE, DCP_RANK, DCP_INTERLEAVE, KV_BLOCK,
    )  # fmt: skip
    in_row = offs < K
    v = valid.to(tl.int32)
    inv = (in_row & (valid == 0)).to(tl.int32)
    pos_v = base_v + tl.cumsum(v, axis=0) - v
    pos_i = K - 1 - (base_i + tl.cumsum(inv, axis=0) - inv)
    dest = tl.where(valid, pos_v, pos_i)
    tl.store(out_ptr + row64 * stride_or + dest * stride_ok, tl.where(valid, slot, -1), mask=in_row)
    if CHECK:
        flag_poisoned(chk_ptr, slot, valid)
    if tile == 0:
        tl.store(counts_ptr + row, tl.sum(tile_counts, axis=0))


# ----------------------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------------------


def _default_config(method: str, rows: int, k: int) -> tuple[int, int]:
    """(tile width, num_warps) measured best on the H200 for K = 2048
    (benchmarks/results/deinterleave.json, CUDA-graph medians).

    ``rowscan`` has one program per row, so few rows want wide tiles and more warps (latency),
    many rows narrower tiles (more rows resident per SM). Tiles never exceed the row's width.
    """
    if method == "rowscan":
        block, warps = (2048, 8) if rows <= 128 else (512, 4) if rows <= 2048 else (1024, 4)
    else:  # atomic and twopass: 512-wide tiles, 4 warps, were best or within 3 % on every shape
        block, warps = 512, 4
    return max(16, min(block, next_pow2(max(k, 1)))), warps


def _default_block(method: str, k: int, rows: int = 1) -> int:
    return _default_config(method, rows, k)[0]


#: Launch-parameter ranges (checked on the host): tiles are powers of two from 16 lanes up to 64 Ki
#: entries, warps a power of two up to 32.
BLOCK_RANGE = (16, 1 << 16)
WARPS_RANGE = (1, 32)


def workspace_numel(method: str, rows: int, k: int, block: int | None = None) -> int:
    """int64 elements of ``workspace`` that ``method`` needs for ``rows`` rows of width ``k``.

    ``"atomic"``: ``rows`` (must be zero before the first launch; each launch leaves it zero).
    ``"twopass"``: ``rows * cdiv(k, block)`` (any contents). ``"rowscan"``: 0.
    """
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    rows = check_int_scalar(rows, "rows", min_value=0)
    k = check_int_scalar(k, "k", min_value=0)
    b = (
        _default_block(method, k, rows)
        if block is None
        else check_pow2(block, "block", lo=BLOCK_RANGE[0], hi=BLOCK_RANGE[1])
    )
    if method == "rowscan":
        return 0
    if method == "atomic":
        return rows
    return rows * cdiv(max(k, 1), b)


def _check_common(
    token_ids: object, req_of_token: object, block_table: object, geometry: object, validate: object
) -> tuple[DcpGeometry, torch.device, bool]:
    """The reference's free checks (shapes, dtypes, devices, geometry; no value read), then the device.

    Returns ``(geometry, device, validate)``. A validated call also refuses meta tensors here, before any
    launch (host only: no device op); its value checks run *in* the launch (:func:`_raise_if_flagged`)."""
    g = check_deinterleave_inputs(token_ids, req_of_token, block_table, geometry, False)
    assert isinstance(token_ids, torch.Tensor) and isinstance(block_table, torch.Tensor)
    assert req_of_token is None or isinstance(req_of_token, torch.Tensor)
    validate = check_bool(validate, "validate")
    if validate and token_ids.numel():
        check_deinterleave_readable(token_ids, req_of_token, block_table)
    dev = token_ids.device
    if dev.type != "cuda" and not triton_interpreting():
        raise ValueError(
            f"token_ids must be on a CUDA device (or set TRITON_INTERPRET=1 before importing this "
            f"module to run on the CPU), got {dev}"
        )
    return g, dev, validate


def _constexprs(g: DcpGeometry) -> dict[str, int]:
    """The geometry as the kernels' compile-time constants (the divisions become shifts/multiplies)."""
    return dict(DCP_SIZE=g.world_size, DCP_RANK=g.rank, DCP_INTERLEAVE=g.interleave, KV_BLOCK=g.block_size)


def _raise_if_flagged(chk: torch.Tensor, token_ids, req_of_token, block_table, g: DcpGeometry) -> None:
    """A validated call's value check, after the launch: the kernel raised ``chk`` exactly where it wrote
    :data:`~dcp_ref.deinterleave.POISON_SLOT` into a counted entry, i.e. where the reference's value
    checks fail (a request id outside ``[0, B)``, an owned id without a block, a slot that does not fit
    below ``2**31 - 1``), so **one** host read of the flag decides, with no launch of its own. Only a
    raised flag is cleared (it is shared by the calls of this stream) and the reference's checker run,
    to raise its precise message."""
    raise_if_flagged(
        chk, lambda: raise_deinterleave_violation(token_ids, req_of_token, block_table, g), "the deinterleave kernel"
    )


def _check_out(buf, name, shape, dtype, dev):
    check_tensor(buf, name, dtypes=(dtype,), ndim=len(shape), device=dev)
    if tuple(buf.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(buf.shape)}")
    return buf


def _tiling(method: str, t_rows: int, k: int, block: int | None, num_warps: int | None) -> tuple[int, int]:
    """``(tile width, warps)``: the caller's (checked: powers of two in :data:`BLOCK_RANGE` /
    :data:`WARPS_RANGE`) or the method's measured default."""
    def_block, def_warps = _default_config(method, t_rows, k)
    b = def_block if block is None else check_pow2(block, "block", lo=BLOCK_RANGE[0], hi=BLOCK_RANGE[1])
    nw = def_warps if num_warps is None else check_pow2(num_warps, "num_warps", lo=WARPS_RANGE[0], hi=WARPS_RANGE[1])
    return b, nw


def _slots_and_counts(
    out: torch.Tensor | None, counts: torch.Tensor | None, t_rows: int, k: int, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's ``out`` int32 ``[T, K]`` / ``counts`` int32 ``[T]`` (checked), or new ones."""
    out = (
        torch.empty((t_rows, k), dtype=torch.int32, device=dev)
        if out is None
        else _check_out(out, "out", (t_rows, k), torch.int32, dev)
    )
    counts = (
        torch.empty((t_rows,), dtype=torch.int32, device=dev)
        if counts is None
        else _check_out(counts, "counts", (t_rows,), torch.int32, dev)
    )
    return out, counts


def _check_aliases(token_ids, req_of_token, block_table, **outs) -> None:
    """No output buffer may share memory with an input or with another output."""
    check_no_aliases(outs, dict(token_ids=token_ids, req_of_token=req_of_token, block_table=block_table))


def _rowscan(
    token_ids, req_of_token, block_table, out, counts, g: DcpGeometry, b, nw, compact: bool, chk: torch.Tensor | None
) -> None:
    """One :func:`rowscan_kernel` launch over all rows (``compact``: ordered compaction; else the masked layout;
    ``chk``: a validated call's flag, switching the kernel's ``CHECK`` on)."""
    req = req_of_token if req_of_token is not None else token_ids  # dummy pointer when HAS_REQ=False
    rowscan_kernel[(token_ids.shape[0],)](
        token_ids, req, block_table, out, counts,
        token_ids.shape[1], block_table.shape[0], block_table.shape[1],
        token_ids.stride(0), token_ids.stride(1), block_table.stride(0), block_table.stride(1),
        out.stride(0), out.stride(1),
        HAS_REQ=req_of_token is not None, BLOCK=b, COMPACT=compact, num_warps=nw, **_constexprs(g),
        chk_ptr=chk, CHECK=chk is not None,
    )  # fmt: skip


def global_ids_to_local_slots_triton(
    token_ids: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    *,
    out: torch.Tensor | None = None,
    block: int | None = None,
    num_warps: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Conversion only (no compaction): int32 ``[T, K]`` slots, ``-1`` where not here.

    Same contract as :func:`dcp_ref.deinterleave.global_ids_to_local_slots` (``validate`` and the
    poison rule too); ``out`` (int32 ``[T, K]``, not sharing memory with an input) is written and
    returned when given. ``block`` / ``num_warps``: tile width and warps (powers of two).
    """
    g, dev, validate = _check_common(token_ids, req_of_token, block_table, geometry, validate)
    t_rows, k = token_ids.shape
    b, nw = _tiling("atomic", t_rows, k, block, 4 if num_warps is None else num_warps)
    out = (
        torch.empty((t_rows, k), dtype=torch.int32, device=dev)
        if out is None
        else _check_out(out, "out", (t_rows, k), torch.int32, dev)
    )
    _check_aliases(token_ids, req_of_token, block_table, out=out)
    if t_rows == 0 or k == 0:
        return out
    req = req_of_token if req_of_token is not None else token_ids  # dummy pointer when HAS_REQ=False
    chk = check_flag(dev) if validate else None  # CHECK=False compiles the check out
    deinterleave_kernel[(t_rows, cdiv(k, b))](
        token_ids, req, block_table, out, out, out,  # no counts, no workspace: COMPACT_TO_FRONT=False
        k, block_table.shape[0], block_table.shape[1],
        token_ids.stride(0), token_ids.stride(1), block_table.stride(0), block_table.stride(1),
        out.stride(0), out.stride(1),
        HAS_REQ=req_of_token is not None, COMPACT_TO_FRONT=False, BLOCK=b, num_warps=nw, **_constexprs(g),
        chk_ptr=chk, CHECK=chk is not None,
    )  # fmt: skip
    if chk is not None:
        _raise_if_flagged(chk, token_ids, req_of_token, block_table, g)
    return out


def deinterleave_masked_triton(
    token_ids: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    *,
    out: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    block: int | None = None,
    num_warps: int | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Conversion without compaction (the masked layout) and per-row counts, in one launch.

    Same contract as :func:`dcp_ref.deinterleave.deinterleave_masked` (``validate`` too):
    ``(slots int32 [T, K], counts int32 [T])``, entries at their positions, ``-1`` where not
    here. The row-scan kernel with its compaction switched off: one program per row converts it
    tile by tile and carries the count, so no atomics, no workspace and no second pass (a
    separate ``(slots >= 0).sum`` would cost three more launches and two allocations).
    ``out`` / ``counts`` (int32 ``[T, K]`` / ``[T]``) are written and returned when given: then
    nothing is allocated and, with ``validate=False``, nothing is read on the host. A validated call
    checks in the same launch and adds one host read of its flag after it (and on a ``ValueError`` the
    buffers hold the ``validate=False`` answer).
    """
    g, dev, validate = _check_common(token_ids, req_of_token, block_table, geometry, validate)
    t_rows, k = token_ids.shape
    b, nw = _tiling("rowscan", t_rows, k, block, num_warps)
    out, counts = _slots_and_counts(out, counts, t_rows, k, dev)
    _check_aliases(token_ids, req_of_token, block_table, out=out, counts=counts)
    if t_rows == 0:
        return out, counts
    if k == 0:
        counts.zero_()
        return out, counts
    chk = check_flag(dev) if validate else None  # CHECK=False compiles the check out
    _rowscan(token_ids, req_of_token, block_table, out, counts, g, b, nw, compact=False, chk=chk)
    if chk is not None:
        _raise_if_flagged(chk, token_ids, req_of_token, block_table, g)
    return out, counts


def deinterleave_compact(
    token_ids: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    *,
    ordered: bool = True,
    method: str | None = None,
    out: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    block: int | None = None,
    num_warps: int | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused conversion + compaction to the front (deinterleave + compaction).

    Args:
        token_ids: int32/int64 ``[T, K]`` selected global ids (``-1`` = none), any strides.
        req_of_token: int32/int64 ``[T]`` request of each row, or ``None`` (row ``i`` is request ``i``).
        block_table: int32/int64 ``[B, M]`` physical block ids of each request's local KV, any strides.
        geometry: this rank's :class:`~dcp_ref.geometry.DcpGeometry` (world size, rank, interleave, block
            size), as in the reference (:func:`dcp_ref.deinterleave.deinterleave_and_compact`).
        ordered: keep the valid slots in top-K order (deterministic). ``False`` allows the atomic
            kernel, whose order of valid slots is unspecified (compare as sets).
        method: ``"atomic"`` (unordered only), ``"rowscan"`` or ``"twopass"``; ``None`` picks
            :data:`DEFAULT_ORDERED_METHOD` / :data:`DEFAULT_UNORDERED_METHOD`.
        out: optional int32 ``[T, K]`` output (any strides). counts: optional int32 ``[T]``.
        workspace: optional int64 1-D scratch of at least :func:`workspace_numel` elements. For
            ``"atomic"`` it must hold zeros before its first use; every launch leaves it zeroed.
            Pass all three buffers to make the call allocation-free (CUDA-graph capturable).
        block, num_warps: tile width and warps, powers of two (:data:`BLOCK_RANGE`,
            :data:`WARPS_RANGE`); the defaults (per method and row count) are the H200 benchmark's
            best for K = 2048.
        validate: as in the reference; the values are checked in the launch, which raises a flag
            where it writes :data:`~dcp_ref.deinterleave.POISON_SLOT` (exactly where the reference's
            checks fail), and one host read of that flag follows it (on a ``ValueError`` the buffers
            hold the ``validate=False`` answer). ``False`` on the hot path: no host read, out-of-contract
            metadata poisoned on the device (module docstring).
    Returns:
        ``(out, counts)``: int32 ``[T, K]`` with the valid slots in ``out[i, :counts[i]]`` and
        ``-1`` after; int32 ``[T]``. No output buffer may share memory with an input or another
        output (``ValueError``).
    """
    g, dev, validate = _check_common(token_ids, req_of_token, block_table, geometry, validate)
    ordered = check_bool(ordered, "ordered")
    if method is None:
        method = DEFAULT_ORDERED_METHOD if ordered else DEFAULT_UNORDERED_METHOD
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if ordered and method == "atomic":
        raise ValueError("method='atomic' gives an unspecified order of valid slots: use ordered=False with it")
    t_rows, k = token_ids.shape
    if method == "atomic" and k > _MAX_K_ATOMIC:
        raise ValueError(f"token_ids must have K <= {_MAX_K_ATOMIC} columns for method='atomic', got {k}")
    b, nw = _tiling(method, t_rows, k, block, num_warps)
    out, counts = _slots_and_counts(out, counts, t_rows, k, dev)
    need = workspace_numel(method, t_rows, k, b)
    if workspace is None:
        # rowscan needs none (only atomic / twopass read it): no allocation, no zero-fill launch
        workspace = torch.zeros(need, dtype=torch.int64, device=dev) if need else None
    else:
        check_tensor(workspace, "workspace", dtypes=(torch.int64,), ndim=1, device=dev)
        if workspace.numel() < need:
            raise ValueError(
                f"workspace must have at least {need} elements for method={method!r}, got {workspace.numel()}"
            )
        if need and workspace.stride(0) != 1:
            raise ValueError("workspace must be contiguous")
    _check_aliases(token_ids, req_of_token, block_table, out=out, counts=counts, workspace=workspace)
    if t_rows == 0:
        return out, counts
    if k == 0:
        counts.zero_()
        return out, counts
    n_tiles = cdiv(k, b)
    req = req_of_token if req_of_token is not None else token_ids  # dummy pointer when HAS_REQ=False
    geo = dict(HAS_REQ=req_of_token is not None, BLOCK=b, num_warps=nw, **_constexprs(g))
    n_reqs, n_blocks = block_table.shape
    in_strides = (token_ids.stride(0), token_ids.stride(1), block_table.stride(0), block_table.stride(1))
    chk = check_flag(dev) if validate else None  # CHECK=False compiles the check out
    if method == "atomic":
        deinterleave_kernel[(t_rows, n_tiles)](
            token_ids, req, block_table, out, counts, workspace,
            k, n_reqs, n_blocks,
            *in_strides, out.stride(0), out.stride(1),
            COMPACT_TO_FRONT=True, **geo, chk_ptr=chk, CHECK=chk is not None,
        )  # fmt: skip
    elif method == "rowscan":
        _rowscan(token_ids, req_of_token, block_table, out, counts, g, b, nw, compact=True, chk=chk)
    else:
        twopass_count_kernel[(t_rows, n_tiles)](
            token_ids, req, block_table, workspace,
            k, n_reqs, n_blocks, n_tiles,
            *in_strides,
            **geo,
        )  # fmt: skip
        twopass_scatter_kernel[(t_rows, n_tiles)](
            token_ids, req, block_table, out, counts, workspace,
            k, n_reqs, n_blocks, n_tiles,
            *in_strides, out.stride(0), out.stride(1),
            TILES_POW2=next_pow2(n_tiles), **geo,
            chk_ptr=chk, CHECK=chk is not None,  # the pass that writes the slots checks them
        )  # fmt: skip
    if chk is not None:
        _raise_if_flagged(chk, token_ids, req_of_token, block_table, g)
    return out, counts
