"""A prefill chunk under DCP with DSA: the same five stages, in the chunk's layout.

A chunk adds ``query_lens[b]`` tokens to request ``b``, which already has ``context_lens[b]`` in the
cache. Every rank computes *every* query token of the chunk against its own keys (queries are not
sharded), so the stages are those of a decode step with many query tokens per request — and the
bounds are the same per-token causal bounds, expanded first and localized after. What differs is
the layout: the indexer scores of a chunk cover the rank's keys of *all* the chunk's requests,
gathered side by side into one buffer, request after request, as
:func:`dcp_ref.ownership.localize_prefill_chunk` describes it (``cu_seqlens_k``; token ``t`` may
attend to columns ``[token_ks[t], token_ke[t])``). Local key ``j`` of token ``t``'s request is
column ``token_ks[t] + j`` — which is what ``row_starts`` means in :func:`dcp_ref.indexer.local_topk`
and :func:`dcp_ref.topk.pack_candidates`.

:func:`dcp_prefill_step` is what one rank runs (the planned step of :mod:`dcp_ref.step` with
:func:`dcp_ref.step.prefill_metadata`); :func:`chunk_scores_from_local` builds the chunk
layout from per-request local scores (what a test or a notebook has). The result equals
:func:`dcp_ref.pipeline.dcp_decode_step` with ``next_n = query_lens`` and, through it, the
single-device oracle (``tests/test_prefill.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .contracts import FLOAT_DTYPES, INT_DTYPES, check_int_scalar, check_non_negative, check_tensor
from .group import Group
from .ownership import PrefillChunkMetadata, localize_prefill_chunk
from .stages import Stages
from .step import prefill_metadata

if TYPE_CHECKING:
    from .step import RankShard

__all__ = ["chunk_scores_from_local", "dcp_prefill_step"]


def chunk_scores_from_local(
    local_scores: torch.Tensor, query_lens: torch.Tensor, meta: PrefillChunkMetadata
) -> torch.Tensor:
    """Re-lay per-token scores indexed by local key into the chunk's gathered-keys layout.

    Args:
        local_scores: float ``[T, L]``: score of query token ``t`` for local key ``j`` of its own
            request at column ``j`` (the decode layout of :class:`dcp_ref.pipeline.RankShard`).
        query_lens: int ``[B]`` query tokens per request (tokens of request 0 first).
        meta: this rank's :func:`dcp_ref.ownership.localize_prefill_chunk`.
    Returns:
        float ``[T, max(local_total, 1)]``: column ``cu_seqlens_k[b] + j`` of token ``t`` (of
        request ``b``) holds ``local_scores[t, j]``; columns of other requests are NaN (invalid;
        never inside the token's window).
    """
    check_tensor(local_scores, "local_scores", dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor(query_lens, "query_lens", dtypes=INT_DTYPES, ndim=1)
    if not isinstance(meta, PrefillChunkMetadata):
        raise TypeError(f"meta must be a PrefillChunkMetadata (from localize_prefill_chunk), got {type(meta).__name__}")
    if query_lens.numel() != meta.cu_seqlens_k.numel() - 1:
        raise ValueError(
            f"query_lens must have one entry per request of meta ({meta.cu_seqlens_k.numel() - 1}), "
            f"got {query_lens.numel()}"
        )
    check_non_negative(query_lens, "query_lens")
    T = local_scores.shape[0]
    if int(query_lens.sum()) != T:
        raise ValueError(f"query_lens must add up to local_scores' rows ({T}), got {int(query_lens.sum())}")
    cu_k = meta.cu_seqlens_k.long()
    n_local = cu_k[1:] - cu_k[:-1]  # [B] local keys of each request on this rank
    out = torch.full((T, max(meta.local_total, 1)), float("nan"), dtype=local_scores.dtype, device=local_scores.device)
    req = torch.arange(query_lens.numel(), device=local_scores.device).repeat_interleave(query_lens.long())
    for t in range(T):
        b = int(req[t])
        n = int(n_local[b])
        if n > local_scores.shape[1]:
            raise ValueError(f"local_scores has {local_scores.shape[1]} columns, request {b} has {n} local keys")
        out[t, int(cu_k[b]) : int(cu_k[b]) + n] = local_scores[t, :n]
    return out


def dcp_prefill_step(
    group: Group,
    q: torch.Tensor,
    shard: RankShard,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
    topk: int,
    sm_scale: float,
    *,
    v_dim: int | None = None,
    trace: dict | None = None,
    stages: Stages | str = "reference",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's DSA step for a prefill chunk (SPMD over ``group``).

    Args:
        group: this rank's group.
        q: float ``[T, H, D]``, the chunk's query tokens, ``T = sum(query_lens)``, request 0 first.
        shard: this rank's :class:`~dcp_ref.pipeline.RankShard`: its paged ``kv_cache`` (the chunk's keys
            included), ``block_table``, and as ``index_scores`` the chunk's scores in the chunk layout
            (float ``[T, C]``, ``C >= local_total``; :func:`chunk_scores_from_local` builds it); its
            ``geometry`` gives ``W``, the rank, ``I`` and the block size.
        context_lens, query_lens: int ``[B]``: tokens already cached / added by this chunk.
        topk: the global top-k per query token.  sm_scale: softmax scale.
        v_dim, trace, stages, validate: as in :func:`dcp_ref.pipeline.dcp_decode_step` (``trace`` also
            receives ``meta``, the chunk's :class:`~dcp_ref.ownership.PrefillChunkMetadata`).
    Returns:
        ``(out [T, H/W, v_dim], lse [T, H/W])`` of this rank's head shard (base e).
    """
    from .pipeline import run_step, shard_geometry

    g = shard_geometry(shard, group)
    topk = check_int_scalar(topk, "topk", min_value=1)
    check_tensor(q, "q", dtypes=FLOAT_DTYPES, ndim=3)
    chunk = localize_prefill_chunk(context_lens, query_lens, g.world_size, g.rank, g.interleave)
    scores = check_tensor(shard.index_scores, "shard.index_scores", dtypes=FLOAT_DTYPES, ndim=2)
    T = q.shape[0]
    if chunk.cu_seqlens_q.numel() and int(chunk.cu_seqlens_q[-1]) != T:
        raise ValueError(
            f"query_lens must add up to q's {T} query tokens (q.shape[0]), got {int(chunk.cu_seqlens_q[-1])}"
        )
    if scores.shape[0] != T or scores.shape[1] < chunk.local_total:
        raise ValueError(
            f"shard.index_scores must be [T={T}, >= local_total={chunk.local_total}] (the chunk layout), "
            f"got {tuple(scores.shape)}"
        )
    meta = prefill_metadata(context_lens, query_lens, g, device=q.device)
    if trace is not None:
        trace["meta"] = chunk
    return run_step(group, q, shard, meta, topk, sm_scale, v_dim=v_dim, trace=trace, stages=stages, validate=validate)
