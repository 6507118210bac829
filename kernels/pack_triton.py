"""Triton kernel: pack one rank's local top-K as (score, global id) float32 pairs.

The GPU twin of :func:`dcp_ref.topk.pack_candidates`. One program handles ``BLOCK`` candidates of
one row; every access is masked, so any ``K`` works and an out-of-range local index can never read
outside ``logits`` (it is packed as invalid — and rejected when ``validate=True``); a row start
outside ``[0, cols]`` is clamped on the device. The checks are the reference's own
(:func:`dcp_ref.topk.check_pack_inputs`): both accept and reject the same inputs with the same message.

``validate=True`` costs one host read, after the launch: the kernel itself checks the values it reads
(a row start outside ``[0, cols]``, an entry below ``-1``, an entry past its row) and raises a flag —
an atomic max, issued only by a block that found a bad value — and the call reads that flag back
once. When it is raised, the reference's host checks run for the precise message (``out`` may then
hold the clamped result). Only rows wide enough for a global id to reach ``2**24`` (``cols`` near
``2**24 / W``) take the reference's host checks before the launch, as they always did.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dcp_ref.contracts import (
    check_bool,
    check_no_alias,
    check_out,
    check_pow2,
    check_values_readable,
    max_global_id_bound,
)
from dcp_ref.geometry import DcpGeometry, check_geometry
from dcp_ref.topk import MAX_EXACT_ID, check_pack_inputs

from ._util import cdiv, check_flag

__all__ = ["pack_candidates_kernel", "pack_candidates_triton"]


@triton.jit
def pack_candidates_kernel(
    logits_ptr, topk_ptr, starts_ptr, out_ptr,
    n_cols, K,
    stride_lr, stride_lc, stride_tr, stride_tc,
    rank,
    WORLD: tl.constexpr, INTERLEAVE: tl.constexpr, HAS_STARTS: tl.constexpr, BLOCK: tl.constexpr,
    chk_ptr=None, CHECK: tl.constexpr = False,
):  # fmt: skip
    """Grid ``(rows, cdiv(K, BLOCK))``. ``CHECK`` (``validate=True``): a block that meets a value the
    reference rejects sets ``chk[0]`` to 1 (a good block writes nothing)."""
    row = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = j < K
    idx = tl.load(topk_ptr + row * stride_tr + j * stride_tc, mask=in_row, other=-1).to(tl.int64)
    if HAS_STARTS:
        raw = tl.load(starts_ptr + row).to(tl.int64)
        # Clamped: with validate=False a bad row start must not move the reads outside the row.
        start = tl.minimum(tl.maximum(raw, 0), n_cols)
    else:
        raw = tl.zeros([], tl.int64)
        start = tl.zeros([], tl.int64)
    if CHECK:
        # _check_pack's value checks: the row start in [0, cols]; entries -1 or >= 0; a valid entry inside its row
        # (compared without the sum start + idx, which a huge int64 entry would overflow)
        bad = in_row & ((idx < -1) | ((idx >= 0) & (idx >= n_cols - start)))
        bad = bad | ((raw < 0) | (raw > n_cols))
        if tl.max(bad.to(tl.int32), 0) > 0:
            tl.atomic_max(chk_ptr, 1)
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
    geometry: DcpGeometry,
    row_starts: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    validate: bool = True,
    block: int = 256,
) -> torch.Tensor:
    """Triton :func:`~dcp_ref.topk.pack_candidates`; same arguments, result and errors.

    Args:
        logits, local_topk, geometry, row_starts: as in the reference (``geometry`` a
            :class:`~dcp_ref.geometry.DcpGeometry`: world size, rank and interleave give the global ids).
        out: optional float32 ``[rows, K, 2]`` contiguous buffer (CUDA-graph path).
        validate: check index ranges and the ``2**24`` id bound: in the kernel, then one host read
            of its flag (see the module docstring; a bad input raises the reference's message). Pass
            ``False`` inside CUDA graphs: no host read; the kernel still never reads out of
            bounds (row starts clamped to ``[0, cols]``, an out-of-range entry packed as
            invalid). With ``validate=False`` the shapes must rule out ids ``>= 2**24``
            (``logits`` at most about ``2**24 / W`` columns), else ``ValueError``.
    Returns:
        float32 ``[rows, K, 2]``.
    """
    # The reference's checks, in its order (validate, the geometry, then the tensors). Its value checks run on the
    # host only for rows whose global ids may reach 2**24 (from the shapes alone); otherwise the kernel runs them
    # (one flag, one host read).
    validate = check_bool(validate, "validate")
    block = check_pow2(block, "block", lo=16, hi=4096)  # the kernel's tl.arange width
    g0 = check_geometry(geometry)
    cols = logits.shape[1] if isinstance(logits, torch.Tensor) and logits.ndim == 2 else 0
    host_values = validate and max_global_id_bound(cols, g0.world_size, g0.interleave) > MAX_EXACT_ID
    g = check_pack_inputs(logits, local_topk, geometry, row_starts, host_values)
    rows, K = local_topk.shape
    fused = validate and not host_values and local_topk.numel() > 0
    if fused:  # what the reference's value checks would refuse before reading anything
        check_values_readable(local_topk, "local_topk")
        if row_starts is not None:
            check_values_readable(row_starts, "row_starts")
    if out is None:
        out = torch.empty((rows, K, 2), dtype=torch.float32, device=logits.device)
    else:
        check_out(out, "out", (rows, K, 2), torch.float32, logits.device, contiguous=True)
        check_no_alias(out, "out", logits=logits, local_topk=local_topk, row_starts=row_starts)
    if rows == 0 or K == 0:
        return out
    chk = check_flag(logits.device) if fused else None
    starts = row_starts if row_starts is not None else local_topk  # dummy pointer when absent
    grid = (rows, cdiv(K, block))
    pack_candidates_kernel[grid](
        logits, local_topk, starts, out,
        cols, K,
        logits.stride(0), logits.stride(1), local_topk.stride(0), local_topk.stride(1),
        g.rank,
        WORLD=g.world_size, INTERLEAVE=g.interleave, HAS_STARTS=row_starts is not None, BLOCK=block,
        chk_ptr=chk, CHECK=chk is not None,
    )  # fmt: skip
    if chk is not None and int(chk.item()):  # the one host read of a validated call
        chk.zero_()
        check_pack_inputs(logits, local_topk, geometry, row_starts, True)  # raises the reference's error
        raise ValueError("local_topk / row_starts hold values the reference rejects")  # unreachable: the host agrees
    return out
