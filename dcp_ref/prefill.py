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

:func:`dcp_prefill_step` is what one rank runs; :func:`chunk_scores_from_local` builds the chunk
layout from per-request local scores (what a test or a notebook has). The result equals
:func:`dcp_ref.pipeline.dcp_decode_step` with ``next_n = query_lens`` and, through it, the
single-device oracle (``tests/test_prefill.py``).
"""

from __future__ import annotations

import torch

from ._checks import FLOAT_DTYPES, INT_DTYPES, check_int_scalar, check_tensor
from .attention import sparse_mla_attention
from .deinterleave import deinterleave_and_compact
from .group import Group
from .indexer import local_topk
from .lse import dcp_merge_collective
from .ownership import PrefillChunkMetadata, localize_prefill_chunk
from .topk import merge_topk_global

__all__ = ["chunk_scores_from_local", "dcp_prefill_step"]


def chunk_scores_from_local(local_scores: torch.Tensor, query_lens: torch.Tensor, meta: PrefillChunkMetadata) -> torch.Tensor:
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
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    chunk_scores: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: torch.Tensor,
    topk: int,
    sm_scale: float,
    block_size: int,
    interleave: int = 1,
    *,
    v_dim: int | None = None,
    trace: dict | None = None,
    backend: str = "reference",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's DSA step for a prefill chunk (SPMD over ``group``).

    Args:
        group: this rank's group.
        q: float ``[T, H, D]``, the chunk's query tokens, ``T = sum(query_lens)``, request 0 first.
        kv_cache: float ``[num_slots, D]``, this rank's paged cache (the chunk's keys included).
        block_table: int32 ``[B, M]`` physical blocks of each request's local keys.
        chunk_scores: float ``[T, C]`` indexer scores in the chunk layout (module docstring;
            ``C >= local_total``); :func:`chunk_scores_from_local` builds it from per-request scores.
        context_lens, query_lens: int ``[B]``: tokens already cached / added by this chunk.
        topk: the global top-k per query token.  sm_scale: softmax scale.
        block_size: tokens per KV block.  interleave: ``I`` of the DCP layout.
        v_dim: value width (default: all of ``D``).
        trace: optional dict that receives ``meta``, ``local_ids``, ``global_ids``, ``slots``,
            ``counts``, ``partial_out``, ``partial_lse`` (and ``impl`` with the kernels).
        backend: ``"reference"`` or ``"kernels"``, as in :func:`dcp_ref.pipeline.dcp_decode_step`
            (stages 3-5 by :func:`dcp_ref.pipeline.kernel_stages_3_to_5`).
    Returns:
        ``(out [T, H/W, v_dim], lse [T, H/W])`` of this rank's head shard (base e).
    """
    from .pipeline import STEP_BACKENDS, kernel_stages_3_to_5

    if backend not in STEP_BACKENDS:
        raise ValueError(f"backend must be one of {STEP_BACKENDS}, got {backend!r}")
    W, r = group.world_size, group.rank
    topk = check_int_scalar(topk, "topk", min_value=1)
    meta = localize_prefill_chunk(context_lens, query_lens, W, r, interleave)
    check_tensor(chunk_scores, "chunk_scores", dtypes=FLOAT_DTYPES, ndim=2)
    T = q.shape[0]
    if chunk_scores.shape[0] != T or chunk_scores.shape[1] < meta.local_total:
        raise ValueError(f"chunk_scores must be [T={T}, >= local_total={meta.local_total}], got {tuple(chunk_scores.shape)}")
    # 1. per-token causal windows [ks, ke) in the chunk layout (expand first, localize after)
    starts, lengths = meta.token_ks, meta.token_ke - meta.token_ks
    # 2. local top-K inside each token's window: local key indices j of the token's request
    local_ids = local_topk(chunk_scores, topk, lengths, row_starts=starts)
    req_of_token = torch.arange(query_lens.numel(), device=q.device).repeat_interleave(query_lens.to(q.device).long())
    if backend == "kernels":
        if trace is not None:
            trace.update(meta=meta)
        return kernel_stages_3_to_5(group, q, kv_cache, block_table, chunk_scores, local_ids, starts, req_of_token, topk,
                                    sm_scale, block_size, interleave, v_dim=v_dim, trace=trace)
    # 3. pack (score at column ks + j, global id of j) -> all-gather -> stable global top-K
    global_ids = merge_topk_global(group, chunk_scores, local_ids, topk, interleave, row_starts=starts)
    # 4-5. exactly as in decode
    slots, counts = deinterleave_and_compact(global_ids, req_of_token, block_table, block_size, W, r, interleave)
    out, lse = sparse_mla_attention(q, kv_cache, slots, counts, sm_scale, "e", v_dim=v_dim or q.shape[-1])
    if trace is not None:
        trace.update(meta=meta, local_ids=local_ids, global_ids=global_ids, slots=slots, counts=counts,
                     partial_out=out, partial_lse=lse)
    return dcp_merge_collective(group, out, lse, "e")
