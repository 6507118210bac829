"""Triton kernel: the lightning indexer's scoring stage — FP8 index keys -> index scores ``[T, L]``.

The GPU twin of :func:`dcp_ref.scoring.index_scores` (same arguments, same checks and messages,
the same ``validate=False`` poison rule)::

    scores[t, row_starts[t] + j] = sum_h w[t, h] * relu(q[t, h] . k_fp8[j]) * scale[j]     (j < local_bounds[t])

How one program works (grid ``(T, cdiv(L, BLOCK_N * TILES))``; program ``(t, p)`` owns tiles
``p*TILES .. p*TILES + TILES - 1`` of ``BLOCK_N`` keys of token ``t``):

1. **Row metadata** (:func:`row_meta`, :func:`row_poisoned`): the token's request, bound and start,
   and whether the row is out of contract — checked on the device from the table entries the row
   needs (every program of the row reaches the same verdict; no host read, no cross-program sync).
2. **The query** (:func:`load_query`): ``[H_PAD, 128]`` FP8 query and ``[H_PAD]`` weights, loaded once
   per program (heads padded to a power of two >= 16 with zero rows and zero weights).
3. **Per tile**: the columns of the tile that hold no key get ``-inf`` (NaN in a poisoned row);
   the tile's keys ``j`` get their slots through the block table (:func:`key_slots`: keys of one tile
   may span several blocks), their 128 e4m3 bytes and float32 scale (:func:`load_key_tile`: the
   block's values first, then its scales, as DeepGEMM and vLLM lay it out), then
   :func:`score_tile`: an FP8 ``tl.dot`` ``[H_PAD, 128] x [128, BLOCK_N]`` with float32 accumulation,
   ReLU (``where(s < 0, 0, s)``: NaN stays NaN), the weighted sum over heads in registers, times the
   scale.

Every load is masked (by the row's bound and the row's verdict), addresses are int64, so even with
``validate=False`` nothing outside the cache, the table or ``out`` is touched. No allocation with
``out=``, no host synchronisation with ``validate=False``: capturable in a CUDA graph.

``index_q`` may be float8_e4m3fn (the FP8 ``tl.dot``) or fp16 / bf16 / float32 (teaching: the keys are
widened to float32 and the dot runs in IEEE float32); float64 queries are the reference's only.
Not done (yet): tokens of one request (``next_n > 1``) read the same keys but are scored by separate
programs; sharing one key tile among them is the next step if MTP decode matters.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dcp_ref._checks import check_bool, check_int_scalar, check_values_readable, triton_interpreting
from dcp_ref.geometry import DcpGeometry
from dcp_ref.index_cache import INDEX_K_FP8
from dcp_ref.scoring import ScoringArgs, check_scoring_inputs

from ._util import cdiv, check_flag, next_pow2, raise_if_flagged, sm_count

__all__ = [
    "row_meta",
    "row_poisoned",
    "load_query",
    "key_slots",
    "load_key_tile",
    "score_tile",
    "fill_non_keys",
    "index_scores_kernel",
    "index_scores_check_kernel",
    "KERNEL_Q_DTYPES",
    "ScoringPlan",
    "scoring_plan",
    "kernel_views",
    "index_scores_triton",
]

#: ``index_q`` dtypes the kernel takes (float64 is the reference's only).
KERNEL_Q_DTYPES = (torch.float8_e4m3fn, torch.float16, torch.bfloat16, torch.float32)
#: Table entries read per step of the row check (:func:`row_poisoned`).
SCAN = 1024
#: A column beyond every row: the fused indexer has no output width to check.
NO_WIDTH = 1 << 62


@triton.jit
def row_meta(req_ptr, bound_ptr, start_ptr, t, HAS_STARTS: tl.constexpr):
    """``(request, bound, start)`` of token ``t`` as int64 (``start = 0`` without row starts)."""
    req = tl.load(req_ptr + t).to(tl.int64)
    bound = tl.load(bound_ptr + t).to(tl.int64)
    start = tl.zeros([], tl.int64)
    if HAS_STARTS:
        start = tl.load(start_ptr + t).to(tl.int64)
    return req, bound, start


@triton.jit
def row_poisoned(
    bt_ptr, sbt_r, sbt_c, req, bound, start, n_req, n_tbl, n_blocks, n_cols, block_size, SCAN_N: tl.constexpr
):
    """Whether a row's metadata is out of contract (then every column of it is NaN).

    Out of contract: the request outside ``[0, n_req)``, a negative bound or start, ``start + bound``
    past ``n_cols``, more blocks needed than the table has (``n_tbl``), or a needed table entry that
    is not a block of the cache (``< 0`` or ``>= n_blocks``). Only the entries the row needs are read,
    ``SCAN_N`` at a time, and only when the scalar checks passed (so never outside the table).
    """
    need = (tl.maximum(bound, 0) + block_size - 1) // block_size
    bad = (req < 0) | (req >= n_req) | (bound < 0) | (start < 0) | (start + bound > n_cols) | (need > n_tbl)
    n_scan = tl.where(bad, 0, need)
    row_ptr = bt_ptr + tl.minimum(tl.maximum(req, 0), tl.maximum(n_req - 1, 0)) * sbt_r
    wrong = tl.zeros([], tl.int32)
    for c in range(0, n_scan, SCAN_N):
        o = c + tl.arange(0, SCAN_N)
        m = o < n_scan
        blk = tl.load(row_ptr + o * sbt_c, mask=m, other=0).to(tl.int64)
        wrong += tl.sum((m & ((blk < 0) | (blk >= n_blocks))).to(tl.int32), 0)
    return bad | (wrong > 0)


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
def key_slots(bt_row_ptr, sbt_c, j, valid, block_size):
    """``(block id int64, offset in block)`` of local keys ``j`` (only ``valid`` ones read the table).

    The keys of one tile may span blocks: each key finds its own block, ``j // block_size``.
    """
    phys = tl.load(bt_row_ptr + (j // block_size).to(tl.int64) * sbt_c, mask=valid, other=0).to(tl.int64)
    return phys, (j % block_size).to(tl.int64)


@triton.jit
def load_key_tile(cache_u8, cache_f32, phys, off, valid, block_size, D: tl.constexpr):
    """The keys' e4m3 values ``[N, D]`` (float8e4nv) and float32 scales ``[N]`` (masked: 0 when not valid).

    Block ``b`` starts at byte ``b * block_size * (D + 4)``: the values of its tokens first
    (``D`` bytes each), then their float32 scales (``cache_f32`` is the same memory as float32).
    """
    d = tl.arange(0, D)
    row = phys * (block_size * (D + 4)) + off * D  # int64 byte offset of each key's first value
    vals = tl.load(cache_u8 + row[:, None] + d[None, :], mask=valid[:, None], other=0)
    scale = tl.load(cache_f32 + phys * (block_size * (D + 4) // 4) + block_size * (D // 4) + off, mask=valid, other=0.0)
    return vals.to(tl.float8e4nv, bitcast=True), scale


@triton.jit
def score_tile(q, w, keys, scale, Q_FP8: tl.constexpr):
    """``sum_h w[h] * relu(q[h] . keys[n]) * scale[n]`` for the ``N`` keys of a tile -> float32 ``[N]``.

    FP8: one ``tl.dot`` of float8e4nv operands with float32 accumulation; otherwise the keys are
    widened to float32 (exact) and the dot runs in IEEE float32. ReLU as ``where(s < 0, 0, s)``
    keeps NaN (``maximum`` would drop it).
    """
    if Q_FP8:
        s = tl.dot(q, tl.trans(keys))
    else:
        s = tl.dot(q, tl.trans(keys.to(tl.float32)), input_precision="ieee")
    s = tl.where(s < 0, 0.0, s)
    return tl.sum(s * w[:, None], 0) * scale


@triton.jit
def fill_non_keys(out_row, cols, n_cols, start, n_keys, bad):
    """Columns ``cols`` of one output row that hold no key (``[start, start + n_keys)`` do): ``-inf``,
    or NaN in a poisoned row (whose ``n_keys`` is 0, so that every column gets NaN)."""
    is_key = (cols >= start) & (cols < start + n_keys)
    fill = tl.where(bad, float("nan"), float("-inf")) + tl.zeros(cols.shape, tl.float32)
    tl.store(out_row + cols, fill, mask=(cols < n_cols) & ~is_key)


@triton.jit
def index_scores_kernel(
    q_ptr, w_ptr, cache_u8, cache_f32, bt_ptr, req_ptr, bound_ptr, start_ptr, out_ptr,
    n_req, n_tbl, n_blocks, n_cols, n_heads, block_size,
    sq_t, sq_h, sq_d, sw_t, sw_h, sbt_r, sbt_c, so_t,
    HAS_STARTS: tl.constexpr, Q_FP8: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, TILES: tl.constexpr, SCAN_N: tl.constexpr,
    chk_ptr=None, CHECK: tl.constexpr = False, CLEAR: tl.constexpr = False,
):  # fmt: skip
    """Grid ``(T, cdiv(n_cols, BLOCK_N * TILES))``: token ``t``'s keys and columns of ``TILES`` tiles.

    ``CHECK`` (``validate=True``): a row the reference refuses is exactly a poisoned row (the same
    conditions, :func:`row_poisoned`), so program ``(t, 0)`` of such a row sets ``chk[0]`` to 1 with an
    atomic max; a good row writes nothing. ``CLEAR``: program ``(0, 0)`` zeroes ``chk[0]`` (the width
    the check kernel left there, already read on the host)."""
    t = tl.program_id(0)
    p = tl.program_id(1)
    req, bound, start = row_meta(req_ptr, bound_ptr, start_ptr, t, HAS_STARTS)
    bad = row_poisoned(bt_ptr, sbt_r, sbt_c, req, bound, start, n_req, n_tbl, n_blocks, n_cols, block_size, SCAN_N)
    if CHECK:
        if bad & (p == 0):
            tl.atomic_max(chk_ptr, 1)
    if CLEAR:
        if (t == 0) & (p == 0):
            tl.store(chk_ptr, tl.zeros([], tl.int64))
    q, w = load_query(q_ptr, w_ptr, t, n_heads, sq_t, sq_h, sq_d, sw_t, sw_h, Q_FP8, H_PAD, D)
    out_row = out_ptr + t.to(tl.int64) * so_t
    bt_row = bt_ptr + tl.minimum(tl.maximum(req, 0), tl.maximum(n_req - 1, 0)) * sbt_r
    n_keys = tl.where(bad, 0, bound)  # a poisoned row scores no key
    for i in range(TILES):
        n0 = (p * TILES + i) * BLOCK_N
        idx = n0 + tl.arange(0, BLOCK_N)
        # columns of this tile that hold no key (-inf / NaN) ...
        fill_non_keys(out_row, idx, n_cols, start, n_keys, bad)
        # ... and the keys j = idx of this tile, written at column start + j
        valid = idx < n_keys
        phys, off = key_slots(bt_row, sbt_c, idx, valid, block_size)
        keys, scale = load_key_tile(cache_u8, cache_f32, phys, off, valid, block_size, D)
        s = score_tile(q, w, keys, scale, Q_FP8)
        tl.store(out_row + start + idx, s, mask=valid)


@triton.jit
def index_scores_check_kernel(
    bt_ptr, req_ptr, bound_ptr, start_ptr, chk_ptr,
    n_req, n_tbl, n_blocks, n_cols, block_size, sbt_r, sbt_c,
    HAS_STARTS: tl.constexpr, WIDTH: tl.constexpr, SCAN_N: tl.constexpr,
):  # fmt: skip
    """Grid ``(T,)``: a validated call's value checks where the scoring kernel cannot run them — its width is
    not known yet (``out=None``), or it has no column to score (``L == 0``) and is not launched.

    Row ``t`` out of contract (:func:`row_poisoned`, width ``n_cols``) raises ``chk[0]`` with an atomic max:
    to 1, or with ``WIDTH`` (``n_cols`` is then :data:`NO_WIDTH`: no width to check) to ``NO_WIDTH``; a good
    row with ``WIDTH`` raises it to ``row_starts[t] + local_bounds[t]``, so the one host read gives the width
    ``L = max(row_starts + local_bounds)`` and the verdict together. (An end that wrapped below 0 or reaches
    ``NO_WIDTH`` gives ``NO_WIDTH`` too: the host's own check decides.)"""
    t = tl.program_id(0)
    req, bound, start = row_meta(req_ptr, bound_ptr, start_ptr, t, HAS_STARTS)
    bad = row_poisoned(bt_ptr, sbt_r, sbt_c, req, bound, start, n_req, n_tbl, n_blocks, n_cols, block_size, SCAN_N)
    if WIDTH:
        end = start + bound
        code = tl.where(bad | (end < 0), n_cols, end)
        if code > 0:
            tl.atomic_max(chk_ptr, code)
    else:
        if bad:
            tl.atomic_max(chk_ptr, 1)


class ScoringPlan(NamedTuple):
    """How one call runs (see :func:`scoring_plan`)."""

    block_n: int  #: keys per tile (a power of two >= 16)
    tiles: int  #: tiles per program (the query is loaded once per program)
    num_warps: int
    num_stages: int
    programs: int  #: programs per row (grid axis 1)


def _pow2_arg(v: object, name: str, lo: int, hi: int) -> int:
    x = check_int_scalar(v, name, min_value=lo)
    if x & (x - 1) or x > hi:
        raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {x}")
    return x


def scoring_plan(
    rows: int,
    n_cols: int,
    device: torch.device,
    *,
    block_n: int | None = None,
    tiles: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> ScoringPlan:
    """How :func:`index_scores_triton` scores ``rows`` rows of ``n_cols`` columns (shapes only, no sync).

    Defaults: ``BLOCK_N = 64`` keys per tile (the 64 x 128 FP8 query times 64 keys: one warpgroup's
    wgmma, ``num_warps = 4``), 3 pipeline stages, and as many tiles per program (1-4) as keep about four
    programs per SM busy: the query (8 KiB) is then read once per 1-4 tiles of 8.4 KiB of keys. (Compiled
    for sm_90a: ~160-170 registers per thread and no spills at 64 x 1-4; 128-key tiles x 2+ tiles spill.)
    """
    if block_n is None:
        block_n = min(64, max(16, next_pow2(max(n_cols, 1))))
    block_n = _pow2_arg(block_n, "block_n", 16, 512)
    n_tiles = max(1, cdiv(max(n_cols, 1), block_n))
    if tiles is None:
        tiles = max(1, min(4, (rows * n_tiles) // max(1, 4 * sm_count(device))))
    tiles = max(check_int_scalar(tiles, "tiles", min_value=1), cdiv(n_tiles, 65535))  # grid axis 1 <= 65535
    num_warps = 4 if num_warps is None else _pow2_arg(num_warps, "num_warps", 1, 32)
    num_stages = 3 if num_stages is None else check_int_scalar(num_stages, "num_stages", min_value=1)
    return ScoringPlan(block_n, tiles, num_warps, num_stages, cdiv(n_tiles, tiles))


def kernel_views(a: ScoringArgs, index_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, cache as uint8, cache as float32)``: the views the kernels read (no copy).

    An FP8 query is passed as its bytes (bitcast back in the kernel).
    """
    q = index_q.view(torch.uint8) if index_q.dtype == torch.float8_e4m3fn else index_q
    flat = a.blocks.reshape(-1)
    return q, flat, flat.view(torch.float32)


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
    block_n: int | None = None,
    tiles: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """This rank's index scores ``[T, L]`` from its FP8 index-key cache, on the GPU (one launch with ``out``).

    Same arguments, result (up to float32 rounding: the kernel accumulates in float32, the
    reference in float64), checks and messages as :func:`dcp_ref.scoring.index_scores`, whose
    docstring states the contract and the ``validate=False`` poison rule; ``index_q`` may be
    float8_e4m3fn, fp16, bf16 or float32 here.

    ``validate=True`` checks the values on the device, from the rule the kernel poisons by (a row the
    reference refuses is exactly a poisoned row): the scoring launch raises a flag (the shared
    :func:`~dcp_ref.kernels._util.check_flag`) and the call reads it once, after the launch; only a failing
    call reads more, to raise the reference's message (``out`` then holds the poisoned rows). Without
    ``out`` the width ``max(row_starts + local_bounds)`` is the values' too: a small check kernel first
    gives it and the verdict in the same one read (two launches).

    Tuning (see :func:`scoring_plan`): ``block_n`` keys per tile (power of two, 16-512), ``tiles``
    tiles per program, ``num_warps``, ``num_stages``.

    Returns:
        float32 ``[T, L]`` (``out`` when given).
    """
    validate = check_bool(validate, "validate")
    # The reference's free checks, in its order (types, shapes, devices); its value checks run on the device.
    # Without `out`, a validated call's width is max(row_starts + local_bounds), which only the values give:
    # n_cols=0 stands for it here, and the check kernel reads it with the verdict.
    width_from_values = validate and out is None
    args = (index_q, weights, index_cache, block_table, req_of_token, local_bounds, geometry, row_starts, out)
    a = check_scoring_inputs(*args, False, n_cols=0 if width_from_values else None)
    assert a.L is not None
    T, L = a.T, a.L
    dev = index_q.device
    check = validate and T > 0
    if check:  # the reference refuses a meta tensor before reading any value
        for name, tensor in (("req_of_token", req_of_token), ("local_bounds", local_bounds),
                             ("row_starts", row_starts), ("block_table", block_table)):  # fmt: skip
            if tensor is not None:
                check_values_readable(tensor, name)
    tuning = dict(block_n=block_n, tiles=tiles, num_warps=num_warps, num_stages=num_stages)
    try:
        _check_device(index_q)
        plan = scoring_plan(T, L, dev, **tuning)  # (without `out`: planned again once the width is known)
    except (TypeError, ValueError):
        if check:  # the reference's value checks came first: a bad value is still the error reported
            check_scoring_inputs(*args, True)
        raise
    starts = row_starts if row_starts is not None else local_bounds  # never read without HAS_STARTS
    meta = (block_table, req_of_token, local_bounds, starts)
    chk = check_flag(dev) if check else None
    clear = False  # whether the scoring launch zeroes the flag (the width the check kernel left in it)
    if chk is not None and (width_from_values or L == 0):
        # No scoring launch can check these values (the width is not known yet, or there is no column to score):
        # the check kernel does, and its flag is the one host read (without `out` it carries the width too).
        index_scores_check_kernel[(T,)](
            *meta, chk, a.B, a.M, a.num_blocks, NO_WIDTH if width_from_values else L, a.block_size,
            block_table.stride(0), block_table.stride(1),
            HAS_STARTS=row_starts is not None, WIDTH=width_from_values, SCAN_N=SCAN,
        )  # fmt: skip
        code = int(chk.item())  # the one host read of this validated call
        if width_from_values and code < NO_WIDTH:
            L, clear = code, code > 0  # every row is in contract; a width of 0 left the flag at 0
        elif code:
            chk.zero_()
            a = check_scoring_inputs(*args, True)  # raises the reference's message
            if not width_from_values:
                raise AssertionError("the scoring check flagged a row that the reference accepts (a kernel bug)")
            assert a.L is not None
            L = a.L  # an end too large for the flag's code (>= 2**62): the host's width
        chk, check = (chk if clear else None), False
    try:
        if width_from_values:
            plan = scoring_plan(T, L, dev, **tuning)
            out = torch.empty((T, L), dtype=torch.float32, device=dev)
        elif out is None:
            out = torch.empty((T, L), dtype=torch.float32, device=dev)
        if T == 0 or L == 0:
            return out
        q, cache_u8, cache_f32 = kernel_views(a, index_q)
        index_scores_kernel[(T, plan.programs)](
            q, weights, cache_u8, cache_f32, *meta, out,
            a.B, a.M, a.num_blocks, L, a.H, a.block_size,
            q.stride(0), q.stride(1), q.stride(2), weights.stride(0), weights.stride(1),
            block_table.stride(0), block_table.stride(1), out.stride(0),
            HAS_STARTS=row_starts is not None, Q_FP8=index_q.dtype == torch.float8_e4m3fn,
            H_PAD=max(16, next_pow2(a.H)), D=INDEX_K_FP8.head_dim, BLOCK_N=plan.block_n, TILES=plan.tiles,
            SCAN_N=SCAN, num_warps=plan.num_warps, num_stages=plan.num_stages,
            chk_ptr=chk, CHECK=check, CLEAR=clear,
        )  # fmt: skip
    except BaseException:
        if clear:  # the launch that was to zero the flag did not run
            assert chk is not None
            chk.zero_()
        raise
    if check:  # the kernel raised the flag for a row the reference refuses (that row is poisoned in `out`)
        raise_if_flagged(chk, lambda: check_scoring_inputs(*args, True), "the scoring kernel")
    return out
