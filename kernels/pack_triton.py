"""Triton kernel: pack one rank's local top-K as (score, global id) float32 pairs.

The GPU twin of :func:`dcp_ref.topk.pack_candidates`. One program handles ``BLOCK`` candidates of
one row; every access is masked, so any ``K`` works and an out-of-range local index can never read
outside ``logits`` (it is packed as invalid — and rejected up front when ``validate=True``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dcp_ref._checks import FLOAT_DTYPES, INT_DTYPES, check_tensor, check_world

__all__ = ["pack_candidates_kernel", "pack_candidates_triton"]

_MAX_EXACT_ID = 1 << 24


@triton.jit
def pack_candidates_kernel(
    logits_ptr,
    topk_ptr,
    starts_ptr,
    out_ptr,
    n_cols,
    K,
    stride_lr,
    stride_lc,
    stride_tr,
    stride_tc,
    rank,
    WORLD: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    HAS_STARTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = j < K
    idx = tl.load(topk_ptr + row * stride_tr + j * stride_tc, mask=in_row, other=-1).to(tl.int64)
    if HAS_STARTS:
        start = tl.load(starts_ptr + row).to(tl.int64)
    else:
        start = 0
    col = start + idx
    # Masked: a bad index is packed as invalid instead of reading out of bounds.
    valid = in_row & (idx >= 0) & (col < n_cols)
    score = tl.load(logits_ptr + row * stride_lr + col * stride_lc, mask=valid, other=0.0).to(tl.float32)
    # local -> global: (l // I) * (W*I) + rank*I + l % I   (stage 1's layout)
    gid = (idx // INTERLEAVE) * (WORLD * INTERLEAVE) + rank * INTERLEAVE + idx % INTERLEAVE
    score = tl.where(valid, score, float("-inf"))
    gidf = tl.where(valid, gid, -1).to(tl.float32)
    base = out_ptr + (row * K + j) * 2
    tl.store(base, score, mask=in_row)
    tl.store(base + 1, gidf, mask=in_row)


def pack_candidates_triton(
    logits: torch.Tensor,
    local_topk: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int = 1,
    row_starts: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    validate: bool = True,
    block: int = 256,
) -> torch.Tensor:
    """Triton :func:`~dcp_ref.topk.pack_candidates`; same arguments and result.

    Args:
        out: optional float32 ``[rows, K, 2]`` contiguous buffer (CUDA-graph path).
        validate: check index ranges and the ``2**24`` id bound on the host (one sync). Pass
            ``False`` inside CUDA graphs; the kernel still never reads out of bounds, and packs
            an out-of-range entry as invalid. When the shapes alone cannot rule out ids
            ``>= 2**24`` (``logits`` wider than ``2**24 / W`` columns) the values are checked
            anyway: a lossy id must raise, not be packed silently.
    Returns:
        float32 ``[rows, K, 2]``.
    """
    w, r, i = check_world(world_size, rank, interleave)
    check_tensor(logits, "logits", dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor(local_topk, "local_topk", dtypes=INT_DTYPES, ndim=2)
    if local_topk.shape[0] != logits.shape[0]:
        raise ValueError(f"local_topk must have logits' row count {logits.shape[0]}, got shape {tuple(local_topk.shape)}")
    if local_topk.device != logits.device:
        raise ValueError(f"local_topk must be on logits' device {logits.device}, got {local_topk.device}")
    rows, cols = logits.shape
    K = local_topk.shape[1]
    if row_starts is not None:
        check_tensor(row_starts, "row_starts", dtypes=INT_DTYPES, ndim=1, device=logits.device)
        if row_starts.shape[0] != rows:
            raise ValueError(f"row_starts must have shape ({rows},), got {tuple(row_starts.shape)}")
    if out is None:
        out = torch.empty((rows, K, 2), dtype=torch.float32, device=logits.device)
    else:
        check_tensor(out, "out", dtypes=(torch.float32,), ndim=3, device=logits.device)
        if tuple(out.shape) != (rows, K, 2) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous float32 [{rows}, {K}, 2] tensor, got {tuple(out.shape)}")
    # Largest possible global id from the shapes alone: no sync needed when it is small enough.
    id_bound = (cols // i + 1) * w * i
    if validate or id_bound > _MAX_EXACT_ID:
        # Value checks (index ranges, the 2**24 bound): ValueError, like the reference.
        if rows and K:
            _validate(logits, local_topk, r, w, i, row_starts)
    if rows == 0 or K == 0:
        return out
    starts = row_starts if row_starts is not None else local_topk  # dummy pointer when absent
    grid = (rows, triton.cdiv(K, block))
    pack_candidates_kernel[grid](
        logits, local_topk, starts, out, cols, K,
        logits.stride(0), logits.stride(1), local_topk.stride(0), local_topk.stride(1), r,
        WORLD=w, INTERLEAVE=i, HAS_STARTS=row_starts is not None, BLOCK=block,
    )
    return out


def _validate(
    logits: torch.Tensor, local_topk: torch.Tensor, r: int, w: int, i: int, row_starts: torch.Tensor | None
) -> None:
    """Value checks shared with the reference (index range, id < 2**24)."""
    idx = local_topk.long()
    if bool((idx < -1).any()):
        raise ValueError(f"local_topk entries must be -1 or >= 0, found {int(idx.min())}")
    starts = torch.zeros(idx.shape[0], dtype=torch.int64, device=idx.device) if row_starts is None else row_starts.long()
    if bool(((starts < 0) | (starts > logits.shape[1])).any()):
        raise ValueError(f"row_starts must lie in [0, cols={logits.shape[1]}]")
    valid = idx >= 0
    if bool((valid & (starts.unsqueeze(1) + idx >= logits.shape[1])).any()):
        raise ValueError(f"local_topk + row_starts must be < logits.shape[1]={logits.shape[1]} for valid entries")
    gmax = int(idx.max())
    if gmax >= 0:
        g = (gmax // i) * (w * i) + r * i + gmax % i
        if g >= _MAX_EXACT_ID:
            raise ValueError(f"global id {g} >= 2**24 is not exactly representable in float32; the (score, id) packing needs ids < 16777216")
