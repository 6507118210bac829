"""The indexer stage — each rank's *local* top-K over the indexer scores of its own keys.

DSA's lightning indexer scores every (query token, key) pair; under DCP a rank can only score the
keys it stores, so it keeps its local top-``K`` and hands those candidates to the global
selection (:mod:`dcp_ref.topk`). For the global selection to be exact, the local order must be the
*same total order* restricted to this rank: score descending (as float32, ``-0.0 == +0.0``, NaN
invalid), then lower index first. Local indices increase with global positions on one rank, so
"lower local index" and "lower global id" agree — this module reuses
:func:`dcp_ref.topk.stable_key` to make that true by construction. Each rank keeps ``K = k``
candidates, never ``k / W``: all ``k`` winners may live on one rank (chapter 02 shows both
counterexamples).

This is the oracle. On a GPU the whole stage — this selection and
:func:`dcp_ref.topk.pack_candidates` — is one Triton launch,
``dcp_ref.kernels.indexer_triton.indexer_topk_pack`` (the same ``(score, id)`` pairs per row,
bit for bit; tested against ``pack_candidates(scores, local_topk(...))``).

**Rank-local output** (:func:`local_topk_rank_local`, the exchange that carries scores only): the
same winners, written as their scores in *ascending local index* order (NaN padding) plus their
local indices (``-1`` padding). The ids never travel: a candidate's position ``w*K + c`` in the
gathered ``[W, T, K]`` scores is its place among equal scores (lower rank, then lower local index),
which is the global id order restricted to ties, so the global selection stays exact. ``-inf`` is a
valid score that can win; only NaN marks padding.
"""

from __future__ import annotations

import torch

from .contracts import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_bool,
    check_int_scalar,
    check_no_aliases,
    check_non_negative,
    check_out,
    check_tensor,
)
from .geometry import DcpGeometry
from .topk import INVALID_KEY, stable_key

__all__ = ["local_topk", "local_topk_rank_local", "reference_indexer_rank_local"]


def local_topk(
    logits: torch.Tensor,
    k: int,
    lengths: torch.Tensor | None = None,
    row_starts: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Stable top-``k`` local key indices of each row.

    Args:
        logits: float ``[rows, cols]`` — indexer scores of this rank's keys. Local key ``j`` of row
            ``r`` is column ``row_starts[r] + j`` (column ``j`` when ``row_starts`` is ``None``).
        k: how many to keep, ``k >= 1`` (more than the valid keys → ``-1`` padding).
        lengths: optional int32/int64 ``[rows]``: only local keys ``j < lengths[r]`` are valid for
            row ``r`` (the causal bound in local coordinates, e.g. from
            :func:`dcp_ref.localize_decode_bounds`); ``0`` gives an all-``-1`` row. ``None``: every
            column from the row's start on.
        row_starts: optional int32/int64 ``[rows]`` column offsets, ``0 <= row_starts[r] <= cols``
            and ``row_starts[r] + lengths[r] <= cols`` — a prefill chunk's scores hold several
            requests' local keys side by side (``token_ks`` of
            :class:`dcp_ref.ownership.PrefillChunkMetadata`).
        validate: check ``lengths`` / ``row_starts`` values on the host (one sync). ``False``: no
            host read; on the device ``row_starts`` is clamped to ``[0, cols]`` and ``lengths`` to
            ``[0, cols - row_starts]`` (never a read outside ``logits``).
    Returns:
        int64 ``[rows, k]`` local indices ``j`` (relative to the row's start) in selection order,
        ``-1`` padded.

    Contract: the selection order is score descending (as float32; ``-0.0 == +0.0``), then lower
    index. A NaN score marks a masked key: never selected. An empty row (``lengths[r] == 0``)
    gives all ``-1``; ``rows == 0`` gives ``[0, k]``.
    Raises (naming the argument): ``TypeError`` for a non-float ``logits``, a non-int ``k`` or
    ``lengths`` / ``row_starts`` that are not int32/int64 tensors; ``ValueError`` for wrong
    ranks / shapes / devices, ``k < 1``, negative ``lengths`` / ``row_starts``, and (validated)
    a row window outside ``logits``: ``lengths > cols`` (index scores narrower than the local
    bound: keys would be dropped silently) or ``row_starts + lengths > cols``.
    """
    validate = check_bool(validate, "validate")
    check_tensor(logits, "logits", dtypes=FLOAT_DTYPES, ndim=2)
    k = check_int_scalar(k, "k", min_value=1)
    rows, cols = logits.shape
    idx = torch.arange(cols, device=logits.device).expand(rows, cols)
    starts = None
    if row_starts is not None:
        check_tensor(row_starts, "row_starts", dtypes=INT_DTYPES, ndim=1, device=logits.device)
        if row_starts.shape[0] != rows:
            raise ValueError(f"row_starts must have shape [{rows}] (one per logits row), got {tuple(row_starts.shape)}")
        if validate:
            check_non_negative(row_starts, "row_starts")
            if rows and int(row_starts.max()) > cols:
                raise ValueError(f"row_starts must be <= cols={cols}, got max {int(row_starts.max())}")
        starts = row_starts.long().clamp(min=0, max=cols)  # a no-op for validated values
        idx = idx - starts[:, None]  # local index j of each column (negative: before the row's keys)
    if lengths is not None:
        check_tensor(lengths, "lengths", dtypes=INT_DTYPES, ndim=1, device=logits.device)
        if lengths.shape[0] != rows:
            raise ValueError(f"lengths must have shape [{rows}] (one per logits row), got {tuple(lengths.shape)}")
        if validate:
            check_non_negative(lengths, "lengths")
            if starts is not None:
                if rows and bool((starts + lengths.long() > cols).any()):
                    raise ValueError(f"row_starts + lengths must be <= cols={cols} (a row's keys lie inside logits)")
            elif rows and int(lengths.max()) > cols:
                raise ValueError(
                    f"lengths must be <= logits.shape[1]={cols} (the index scores are narrower than the local "
                    f"bound: keys past column {cols} would be dropped), got max {int(lengths.max())}"
                )
        idx = torch.where(idx < lengths.long().clamp(min=0)[:, None], idx, torch.full_like(idx, -1))
    idx = torch.where(idx >= 0, idx, torch.full_like(idx, -1))
    out = torch.full((rows, k), -1, dtype=torch.int64, device=logits.device)
    kk = min(k, cols)
    if kk == 0 or rows == 0:
        return out
    key = stable_key(logits, idx)
    top, pos = torch.topk(key, kk, dim=1, largest=True, sorted=True)
    local = torch.gather(idx, 1, pos)
    out[:, :kk] = torch.where(top == INVALID_KEY, torch.full_like(pos, -1), local)
    return out


def local_topk_rank_local(
    logits: torch.Tensor,
    k: int,
    lengths: torch.Tensor | None = None,
    row_starts: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The row's stable top-``k`` for the rank-local exchange: scores in ascending local index order.

    The winners are those of :func:`local_topk` (same arguments, same checks and errors); only the
    layout differs: no global ids, valid entries first in ascending local index, then padding.

    Returns:
        ``(scores, ids)``: float32 ``[rows, k]`` — the winners' scores (exact float32 bits of
        ``logits``, ``-0.0`` stays ``-0.0``), NaN after the row's ``min(k, valid keys)`` winners; and
        int32 ``[rows, k]`` — their local indices ``j`` (relative to the row's start), ascending, ``-1``
        padding. An empty row is all NaN / all ``-1``.
    Raises:
        as :func:`local_topk`; ``ValueError`` when ``logits`` has ``>= 2**31`` columns (int32 ids).
    """
    ids = local_topk(logits, k, lengths, row_starts, validate=validate)
    rows, cols = logits.shape
    if cols > 2**31:
        raise ValueError(f"logits must have at most 2**31 columns (local indices are int32), got {cols}")
    # Ascending local index with the padding last: -1 sorts as the largest int64.
    big = torch.iinfo(torch.int64).max
    srt = torch.sort(torch.where(ids >= 0, ids, big), dim=1).values
    valid = srt != big
    local = torch.where(valid, srt, -1)
    if cols:
        starts = torch.zeros(rows, dtype=torch.int64, device=logits.device)
        if row_starts is not None:
            starts = row_starts.long().clamp(min=0, max=cols)  # as local_topk read them (a no-op when validated)
        col = (starts[:, None] + local.clamp(min=0)).clamp(max=cols - 1)
        score = torch.gather(logits, 1, col).to(torch.float32)
    else:  # no key at all: every entry is padding
        score = torch.zeros(local.shape, dtype=torch.float32, device=logits.device)
    scores = torch.where(valid, score, torch.full_like(score, float("nan")))
    return scores, local.to(torch.int32)


def reference_indexer_rank_local(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    geometry: DcpGeometry,
    k: int,
    *,
    row_starts: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer stage with ``order="rank_local"``: :func:`local_topk_rank_local` with ``validate=False``.

    Args:
        scores: float ``[T, L]`` this rank's index scores.  lengths: int32/int64 ``[T]`` local bounds.
        geometry: this rank's geometry (part of the stage protocol; the ids stay local, so it is not used).
        k: candidates per row.  row_starts: optional int ``[T]`` column offsets.
        out: optional float32 ``[T, k]`` buffer for the scores; out_ids: optional int32 ``[T, k]`` for the ids.
    Returns:
        ``(scores float32 [T, k], ids int32 [T, k])`` (``out`` / ``out_ids`` when given): see
        :func:`local_topk_rank_local`.
    """
    if not isinstance(geometry, DcpGeometry):
        raise TypeError(f"geometry must be a dcp_ref.geometry.DcpGeometry, got {type(geometry).__name__}")
    check_tensor(scores, "scores", dtypes=FLOAT_DTYPES, ndim=2)
    k = check_int_scalar(k, "k", min_value=1)
    rows = scores.shape[0]
    if out is not None:
        check_out(out, "out", (rows, k), torch.float32, scores.device)
    if out_ids is not None:
        check_out(out_ids, "out_ids", (rows, k), torch.int32, scores.device)
    check_no_aliases(dict(out=out, out_ids=out_ids), dict(scores=scores, lengths=lengths, row_starts=row_starts))
    s, ids = local_topk_rank_local(scores, k, lengths, row_starts, validate=False)
    return (s if out is None else out.copy_(s)), (ids if out_ids is None else out_ids.copy_(ids))
