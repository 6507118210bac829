"""Triton kernel: pack one rank's local top-K as (score, global id) float32 pairs.

The GPU twin of :func:`dcp_ref.topk.pack_candidates`. One program handles ``BLOCK`` candidates of
one row; every access is masked, so any ``K`` works and an out-of-range local index can never read
outside ``logits`` (it is packed as invalid — and rejected up front when ``validate=True``); a row
start outside ``[0, cols]`` is clamped on the device. The host checks are the reference's own
(:func:`dcp_ref.topk._check_pack`): both accept and reject the same inputs with the same message.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dcp_ref._checks import check_out
from dcp_ref.topk import _check_pack

__all__ = ["pack_candidates_kernel", "pack_candidates_triton"]


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
        # Clamped: with validate=False a bad row start must not move the reads outside the row.
        start = tl.minimum(tl.maximum(tl.load(starts_ptr + row).to(tl.int64), 0), n_cols)
    else:
        start = 0
    col = start + idx
    # Masked: a bad index is packed as invalid instead of reading out of bounds (compared without
    # the sum start + idx, which a huge int64 index would overflow).
    valid = in_row & (idx >= 0) & (idx < n_cols - start)
    score = tl.load(logits_ptr + row * stride_lr + col * stride_lc, mask=valid, other=0.0).to(tl.float32)
    # local -> global: (l // I) * (W*I) + rank*I + l % I   (the ownership layout)
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
    """Triton :func:`~dcp_ref.topk.pack_candidates`; same arguments, result and errors.

    Args:
        out: optional float32 ``[rows, K, 2]`` contiguous buffer (CUDA-graph path).
        validate: check index ranges and the ``2**24`` id bound on the host (one sync). Pass
            ``False`` inside CUDA graphs: no host read; the kernel still never reads out of
            bounds (row starts clamped to ``[0, cols]``, an out-of-range entry packed as
            invalid). With ``validate=False`` the shapes must rule out ids ``>= 2**24``
            (``logits`` at most about ``2**24 / W`` columns), else ``ValueError``.
    Returns:
        float32 ``[rows, K, 2]``.
    """
    w, r, i = _check_pack(logits, local_topk, rank, world_size, interleave, row_starts, validate)
    rows, cols = logits.shape
    K = local_topk.shape[1]
    if out is None:
        out = torch.empty((rows, K, 2), dtype=torch.float32, device=logits.device)
    else:
        check_out(out, "out", (rows, K, 2), torch.float32, logits.device, contiguous=True)
    if rows == 0 or K == 0:
        return out
    starts = row_starts if row_starts is not None else local_topk  # dummy pointer when absent
    grid = (rows, triton.cdiv(K, block))
    pack_candidates_kernel[grid](
        logits,
        local_topk,
        starts,
        out,
        cols,
        K,
        logits.stride(0),
        logits.stride(1),
        local_topk.stride(0),
        local_topk.stride(1),
        r,
        WORLD=w,
        INTERLEAVE=i,
        HAS_STARTS=row_starts is not None,
        BLOCK=block,
    )
    return out
