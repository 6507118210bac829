"""Triton kernel: the guard stage — tokens whose step metadata is out of contract come back poisoned.

The GPU twin of :func:`dcp_ref.guard.reference_guard` (the rule and its reasons are in
:mod:`dcp_ref.guard`): one program per query token reads the token's request id, bound and row
start, checks them against the block table's shape and the score width, walks the blocks its keys
need, and — only for a token out of contract — writes NaN over its partial output ``[H, v]`` and
LSE ``[H]``. One launch, no host read, no allocation: capturable. A token inside the contract costs
one read of its metadata and of its request's needed block-table entries.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dcp_ref._checks import INT_DTYPES, check_int_scalar, check_tensor, triton_interpreting
from dcp_ref.geometry import DcpGeometry

from ._util import next_pow2

__all__ = ["token_in_contract", "poison_row", "guard_kernel", "guard_triton"]


@triton.jit
def token_in_contract(
    bounds_ptr, req_ptr, starts_ptr, bt_ptr, t,
    B, M, n_cols, stride_bt,
    BS: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """Whether token ``t``'s metadata is inside the contract (:mod:`dcp_ref.guard`)."""
    bound = tl.load(bounds_ptr + t).to(tl.int64)
    req = tl.load(req_ptr + t).to(tl.int64)
    start = tl.zeros([], tl.int64)
    if HAS_STARTS:
        start = tl.load(starts_ptr + t).to(tl.int64)
    ok = (req >= 0) & (req < B) & (bound >= 0) & (start >= 0) & (start + bound <= n_cols)
    need = (tl.maximum(bound, 0) + BS - 1) // BS
    ok = ok & (need <= M)
    # every block the token's keys need must exist (entry >= 0); a bad request reads nothing
    row = bt_ptr + tl.minimum(tl.maximum(req, 0), tl.maximum(B - 1, 0)) * stride_bt
    lim = tl.where(ok, tl.minimum(need, M), 0)
    missing = tl.zeros([], tl.int32)
    for j0 in range(0, lim, BLOCK_M):
        j = j0 + tl.arange(0, BLOCK_M)
        blk = tl.load(row + j, mask=j < lim, other=0)
        missing += tl.sum((blk < 0).to(tl.int32), 0)
    return ok & (missing == 0)


@triton.jit
def poison_row(partial_ptr, lse_ptr, t, H, V, stride_pt, stride_ph, stride_lt, BLOCK: tl.constexpr):
    """NaN over token ``t``'s partial output ``[H, V]`` and LSE ``[H]``."""
    nan = float("nan")
    for h in range(0, H):
        for c0 in range(0, V, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            tl.store(partial_ptr + t.to(tl.int64) * stride_pt + h * stride_ph + c,
                     tl.full([BLOCK], nan, tl.float32).to(partial_ptr.dtype.element_ty), mask=c < V)  # fmt: skip
    hh = tl.arange(0, BLOCK)
    for h0 in range(0, H, BLOCK):
        tl.store(lse_ptr + t.to(tl.int64) * stride_lt + h0 + hh,
                 tl.full([BLOCK], nan, tl.float32).to(lse_ptr.dtype.element_ty), mask=h0 + hh < H)  # fmt: skip


@triton.jit
def guard_kernel(
    partial_ptr, lse_ptr, bounds_ptr, req_ptr, starts_ptr, bt_ptr,
    B, M, n_cols, H, V,
    stride_pt, stride_ph, stride_lt, stride_bt,
    BS: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid ``(T,)``: program ``t`` poisons token ``t`` when its metadata is out of contract."""
    t = tl.program_id(0)
    ok = token_in_contract(bounds_ptr, req_ptr, starts_ptr, bt_ptr, t, B, M, n_cols, stride_bt, BS, HAS_STARTS, BLOCK_M)
    if ok.to(tl.int32) == 0:
        poison_row(partial_ptr, lse_ptr, t, H, V, stride_pt, stride_ph, stride_lt, BLOCK)


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
) -> None:
    """Poison, in place, the tokens whose metadata is out of contract (:func:`dcp_ref.guard.reference_guard`).

    Args:
        partial: ``[T, H, v]`` (unit stride over ``v``); lse: ``[T, H]`` (unit stride over ``H``), float32/bf16/...
        local_bounds, req_of_token: int ``[T]``; block_table: int ``[B, M]`` (unit column stride);
        geometry: the cache's geometry (block size); n_cols: width of the index scores;
        row_starts: optional int ``[T]``.
    """
    if not isinstance(geometry, DcpGeometry):
        raise TypeError(f"geometry must be a DcpGeometry, got {type(geometry).__name__}")
    n_cols = check_int_scalar(n_cols, "n_cols", min_value=0)
    check_tensor(partial, "partial", ndim=3)
    dev = partial.device
    if dev.type != "cuda" and not triton_interpreting():
        raise ValueError(f"partial must be a CUDA tensor (or set TRITON_INTERPRET=1), got {dev}")
    T, H, V = partial.shape
    check_tensor(lse, "lse", ndim=2, device=dev)
    if tuple(lse.shape) != (T, H):
        raise ValueError(f"lse must be [T={T}, H={H}], got {tuple(lse.shape)}")
    for name, x in (("local_bounds", local_bounds), ("req_of_token", req_of_token), ("row_starts", row_starts)):
        if x is None:
            continue
        check_tensor(x, name, dtypes=INT_DTYPES, ndim=1, device=dev)
        if x.shape[0] != T:
            raise ValueError(f"{name} must have one entry per token ({T}), got {tuple(x.shape)}")
    check_tensor(block_table, "block_table", dtypes=INT_DTYPES, ndim=2, device=dev)
    if partial.stride(2) != 1 or lse.stride(1) != 1:
        raise ValueError("partial and lse must have unit stride in their last dimension")
    if T == 0:
        return
    B, M = block_table.shape
    bt = block_table if block_table.stride(1) == 1 or M == 0 else block_table.contiguous()
    starts = row_starts if row_starts is not None else local_bounds  # never read without HAS_STARTS
    guard_kernel[(T,)](
        partial, lse, local_bounds, req_of_token, starts, bt,
        B, M, n_cols, H, V,
        partial.stride(0), partial.stride(1), lse.stride(0), max(bt.stride(0), 1),
        BS=geometry.block_size, HAS_STARTS=row_starts is not None,
        BLOCK_M=min(next_pow2(max(M, 1)), 1024), BLOCK=min(next_pow2(max(V, H, 1)), 1024), num_warps=1,
    )  # fmt: skip
