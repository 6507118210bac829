"""Triton kernel: the guard stage — tokens whose step metadata is out of contract come back poisoned.

The GPU twin of :func:`dcp_ref.guard.reference_guard` (the rule and its reasons are in
:mod:`dcp_ref.guard`): one program per query token reads the token's request id, bound and row
start, checks them against the block table's shape and the score width, walks the blocks its keys
need, and — only for a token out of contract — writes NaN over its partial output ``[H, v]`` and
LSE ``[H]``. One launch, no host read, no allocation: capturable. A token inside the contract costs
one read of its metadata and of its request's needed block-table entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from dcp_ref.contracts import triton_interpreting
from dcp_ref.geometry import DcpGeometry
from dcp_ref.guard import GuardRows, check_guard_inputs

from ._util import next_pow2

__all__ = [
    "token_in_contract",
    "query_finite",
    "token_verdict",
    "poison_row",
    "guard_kernel",
    "guard_triton",
    "VerdictArgs",
    "verdict_args",
]

_NO_LIMIT = 2**62  # num_blocks=None: no block id is past the cache


@triton.jit
def token_in_contract(
    bounds_ptr, req_ptr, starts_ptr, bt_ptr, t,
    B, M, n_cols, num_blocks, next_n, s_bound, s_req, s_start, s_bt_r, s_bt_c,
    BS: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Whether token ``t``'s metadata is inside the contract (:mod:`dcp_ref.guard`; a block id at or past
    ``num_blocks`` is missing; the ``next_n`` tokens of ``t``'s group name one request). Every tensor is read
    through its own strides (an expanded, stride-0 view reads its one row)."""
    t64 = t.to(tl.int64)
    bound = tl.load(bounds_ptr + t64 * s_bound).to(tl.int64)
    req = tl.load(req_ptr + t64 * s_req).to(tl.int64)
    start = tl.zeros([], tl.int64)
    if HAS_STARTS:
        start = tl.load(starts_ptr + t64 * s_start).to(tl.int64)
    # bound <= n_cols - start, never start + bound <= n_cols: the sum of two int64 near 2**63 wraps
    ok = (req >= 0) & (req < B) & (bound >= 0) & (start >= 0) & (start <= n_cols) & (bound <= n_cols - start)
    g0 = (t64 // next_n) * next_n
    for i in range(0, next_n):  # MTP: one request per group (next_n = 1: the token itself)
        ok = ok & (tl.load(req_ptr + (g0 + i) * s_req).to(tl.int64) == req)
    need = (tl.maximum(bound, 0) + BS - 1) // BS
    ok = ok & (need <= M)
    # every block the token's keys need must exist (entry >= 0); a bad request reads nothing
    row = bt_ptr + tl.minimum(tl.maximum(req, 0), tl.maximum(B - 1, 0)) * s_bt_r
    lim = tl.where(ok, tl.minimum(need, M), 0)
    missing = tl.zeros([], tl.int32)
    for j0 in range(0, lim, BLOCK_M):
        j = j0 + tl.arange(0, BLOCK_M)
        blk = tl.load(row + j.to(tl.int64) * s_bt_c, mask=j < lim, other=0).to(tl.int64)
        missing += tl.sum(((blk < 0) | (blk >= num_blocks)).to(tl.int32), 0)
    return ok & (missing == 0)


@triton.jit
def query_finite(
    q_ptr, w_ptr, t, Hi, D, s_qt, s_qh, s_qd, s_wt, s_wh, Q_FP8: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Whether token ``t``'s index query ``[Hi, D]`` and weights ``[Hi]`` are all finite, read in tiles of
    ``[BLOCK_H, BLOCK_D]`` (a few loads in flight, not one per head). ``Q_FP8``: the query's bytes (float8 e4m3fn
    has no infinity; its NaN is ``S.1111.111``)."""
    t64 = t.to(tl.int64)
    bad = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int32)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    for h0 in range(0, Hi, BLOCK_H):
        hm = h0 + h < Hi
        for d0 in range(0, D, BLOCK_D):
            m = hm[:, None] & (d0 + d < D)[None, :]
            ptr = q_ptr + t64 * s_qt + (h0 + h).to(tl.int64)[:, None] * s_qh + (d0 + d).to(tl.int64)[None, :] * s_qd
            x = tl.load(ptr, mask=m, other=0)
            if Q_FP8:
                nonfinite = (x & 0x7F) == 0x7F
            else:  # in the query's own dtype: a finite float64 beyond float32's range is still finite
                nonfinite = (x != x) | (tl.abs(x) == float("inf"))
            bad = bad | (nonfinite & m).to(tl.int32)
        w = tl.load(w_ptr + t64 * s_wt + (h0 + h).to(tl.int64) * s_wh, mask=hm, other=0.0)  # its own dtype, as x
        bad = bad | ((((w != w) | (tl.abs(w) == float("inf"))) & hm).to(tl.int32))[:, None]
    return tl.max(tl.max(bad, 1), 0) == 0


@triton.jit
def poison_row(
    partial_ptr, lse_ptr, t, H, V, stride_pt, stride_ph, stride_pv, stride_lt, stride_lh, BLOCK: tl.constexpr
):  # fmt: skip
    """NaN over token ``t``'s partial output ``[H, V]`` and LSE ``[H]`` (any strides)."""
    nan = float("nan")
    for h in range(0, H):
        for c0 in range(0, V, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            tl.store(partial_ptr + t.to(tl.int64) * stride_pt + h * stride_ph + c.to(tl.int64) * stride_pv,
                     tl.full([BLOCK], nan, tl.float32).to(partial_ptr.dtype.element_ty), mask=c < V)  # fmt: skip
    hh = tl.arange(0, BLOCK)
    for h0 in range(0, H, BLOCK):
        tl.store(lse_ptr + t.to(tl.int64) * stride_lt + (h0 + hh).to(tl.int64) * stride_lh,
                 tl.full([BLOCK], nan, tl.float32).to(lse_ptr.dtype.element_ty), mask=h0 + hh < H)  # fmt: skip


@triton.jit
def token_verdict(
    t, bounds_ptr, req_ptr, starts_ptr, bt_ptr, q_ptr, w_ptr,
    B, M, n_cols, num_blocks, next_n, Hi, D,
    s_bound, s_req, s_start, s_bt_r, s_bt_c, s_qt, s_qh, s_qd, s_wt, s_wh,
    BS: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_Q: tl.constexpr, Q_FP8: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_HI: tl.constexpr,
):  # fmt: skip
    """Whether token ``t`` is inside the contract: its metadata (:func:`token_in_contract`) and, ``HAS_Q``, its
    index query (:func:`query_finite`). The guard's whole rule for one token, for any kernel that runs one program
    per token (the guard's own, or an attention prologue that takes the guard in)."""
    ok = token_in_contract(bounds_ptr, req_ptr, starts_ptr, bt_ptr, t, B, M, n_cols, num_blocks, next_n, s_bound,
                           s_req, s_start, s_bt_r, s_bt_c, BS, HAS_STARTS, BLOCK_M)  # fmt: skip
    if HAS_Q:
        ok = ok & query_finite(q_ptr, w_ptr, t, Hi, D, s_qt, s_qh, s_qd, s_wt, s_wh, Q_FP8, BLOCK_D, BLOCK_HI)
    return ok


@triton.jit
def guard_kernel(
    partial_ptr, lse_ptr, bounds_ptr, req_ptr, starts_ptr, bt_ptr, q_ptr, w_ptr,
    B, M, n_cols, num_blocks, next_n, H, V, Hi, D,
    stride_pt, stride_ph, stride_pv, stride_lt, stride_lh, s_bound, s_req, s_start, s_bt_r, s_bt_c,
    s_qt, s_qh, s_qd, s_wt, s_wh,
    BS: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_Q: tl.constexpr, Q_FP8: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HI: tl.constexpr,
):  # fmt: skip
    """Grid ``(T,)``: program ``t`` poisons token ``t`` when its metadata (or, ``HAS_Q``, its index query) is out
    of contract."""
    t = tl.program_id(0)
    ok = token_verdict(t, bounds_ptr, req_ptr, starts_ptr, bt_ptr, q_ptr, w_ptr, B, M, n_cols, num_blocks, next_n,
                       Hi, D, s_bound, s_req, s_start, s_bt_r, s_bt_c, s_qt, s_qh, s_qd, s_wt, s_wh,
                       BS, HAS_STARTS, HAS_Q, Q_FP8, BLOCK_M, BLOCK_D, BLOCK_HI)  # fmt: skip
    if ok.to(tl.int32) == 0:
        poison_row(partial_ptr, lse_ptr, t, H, V, stride_pt, stride_ph, stride_pv, stride_lt, stride_lh, BLOCK)


@dataclass(frozen=True)
class VerdictArgs:
    """What :func:`token_verdict` takes for one call, prepared once on the host: ``tensors`` (bounds, request,
    starts, block table, index query, weights: the pointers, in its order), ``scalars`` (``B .. s_wh``, in its
    order) and ``constexprs`` (keyword arguments)."""

    tensors: tuple[torch.Tensor, ...]
    scalars: tuple[int, ...]
    constexprs: dict[str, Any]


def verdict_args(rows: GuardRows) -> VerdictArgs:
    """:class:`VerdictArgs` of the guard's rows (already checked: :func:`dcp_ref.guard.check_guard_inputs`).

    A missing ``row_starts`` / ``index_q`` is replaced by ``local_bounds`` as a pointer its kernel never reads
    (``HAS_STARTS`` / ``HAS_Q`` off)."""
    bounds, req, bt = rows.local_bounds, rows.req_of_token, rows.block_table
    B, M = bt.shape
    starts = rows.row_starts if rows.row_starts is not None else bounds
    has_q = rows.index_q is not None and rows.index_weights is not None
    q: torch.Tensor = rows.index_q if rows.index_q is not None else bounds
    w: torch.Tensor = rows.index_weights if rows.index_weights is not None else bounds
    q_fp8 = has_q and q.dtype == torch.float8_e4m3fn
    if q_fp8:
        q = q.view(torch.uint8)  # its bytes: the NaN test needs no float8 arithmetic
    qs = q.stride() if has_q else (0, 0, 0)
    Hi, D = (q.shape[1], q.shape[2]) if has_q else (0, 0)
    bd = min(next_pow2(max(D, 1)), 256)
    bh = min(next_pow2(max(Hi, 1)), max(1, 4096 // bd))  # a tile of <= 4096 query values (64 x 128: two tiles)
    nb = _NO_LIMIT if rows.num_blocks is None else rows.num_blocks
    return VerdictArgs(
        (bounds, req, starts, bt, q, w),
        (B, M, rows.n_cols, nb, rows.next_n, Hi, D, bounds.stride(0), req.stride(0), starts.stride(0), bt.stride(0),
         bt.stride(1), *qs, w.stride(0), w.stride(-1)),
        dict(BS=rows.geometry.block_size, HAS_STARTS=rows.row_starts is not None, HAS_Q=has_q, Q_FP8=q_fp8,
             BLOCK_M=min(next_pow2(max(M, 1)), 1024), BLOCK_D=bd, BLOCK_HI=bh),
    )  # fmt: skip


def guard_triton(
    partial: torch.Tensor,
    lse: torch.Tensor,
    local_bounds: torch.Tensor,
    req_of_token: torch.Tensor,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    n_cols: int,
    *,
    row_starts: torch.Tensor | None = None,
    num_blocks: int | None = None,
    next_n: int = 1,
    index_q: torch.Tensor | None = None,
    index_weights: torch.Tensor | None = None,
) -> None:
    """Poison, in place, the tokens whose metadata is out of contract (:func:`dcp_ref.guard.reference_guard`).

    Args (checked by :func:`dcp_ref.guard.check_guard_inputs`, the reference's checks and messages):
        partial: floating ``[T, H, v]``; lse: floating ``[T, H]``; local_bounds, req_of_token: int ``[T]``;
        block_table: int ``[B, M]``; geometry: the cache's geometry (block size); n_cols: width of the index
        scores; row_starts: optional int ``[T]``; num_blocks, next_n, index_q, index_weights: the scoring rows
        (:mod:`dcp_ref.guard`). Any strides: every tensor is read (and written) through its
        own, so a stride-0 expanded view reads its one row and never past its storage.
    """
    n_cols = check_guard_inputs(
        partial, lse, local_bounds, req_of_token, block_table, geometry, n_cols, row_starts,
        num_blocks=num_blocks, next_n=next_n, index_q=index_q, index_weights=index_weights,
    )  # fmt: skip
    assert isinstance(geometry, DcpGeometry)
    dev = partial.device
    if dev.type != "cuda" and not triton_interpreting():
        raise ValueError(f"partial must be a CUDA tensor (or set TRITON_INTERPRET=1), got {dev}")
    T, H, V = partial.shape
    if T == 0:
        return
    rows = GuardRows(local_bounds, req_of_token, block_table, geometry, n_cols, row_starts, num_blocks=num_blocks,
                     next_n=next_n, index_q=index_q, index_weights=index_weights)  # fmt: skip
    va = verdict_args(rows)
    B, M, n, nb, nn, Hi, D, *strides = va.scalars
    guard_kernel[(T,)](
        partial, lse, *va.tensors, B, M, n, nb, nn, H, V, Hi, D,
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1), *strides,
        BLOCK=min(next_pow2(max(V, H, 1)), 1024), num_warps=4 if va.constexprs["HAS_Q"] else 1, **va.constexprs,
    )  # fmt: skip
