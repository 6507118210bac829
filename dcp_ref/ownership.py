"""Stage 1 — ownership math: which rank holds which token, and global lengths made local.

Layout
------
``W = world_size`` ranks share one request's KV cache *by position*, dealt out in runs of
``I = interleave`` consecutive tokens, round-robin::

    position p:   0 1 2 3 | 4 5 6 7 | 8 9 ...        (W=2, I=2)
    owner rank:   0 0 1 1 | 0 0 1 1 | 0 0 ...
    local index:  0 1 0 1 | 2 3 2 3 | 4 5 ...

    owner(p)  = (p // I) % W
    local(p)  = (p // (W*I)) * I + p % I
    global(l, r) = (l // I) * (W*I) + r*I + l % I          (inverse of the pair above)

A *length* ``L`` (positions ``0 .. L-1``) therefore has, on rank ``r``::

    local_len(L, r) = (L // (W*I)) * I + clamp(L % (W*I) - r*I, 0, I)

— every full round of ``W*I`` tokens gives each rank ``I`` tokens, and the last partial round
gives rank ``r`` whatever of its ``I``-wide stripe is covered.

Decode bounds must be expanded per query token *first* and localized *after*: a query token's
bound is a global length, and ``local_len`` is not linear in ``L`` (see
:func:`localize_decode_bounds_wrong_order` for the bug the other order produces).

All functions take Python ints or int32/int64 tensors (CPU or CUDA) and return the same kind:
int in → int out, tensor in → tensor of the same dtype and device out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union, overload

import torch

from ._checks import as_int_tensor, check_int_scalar, check_non_negative, check_world

IntLike = Union[int, torch.Tensor]

__all__ = [
    "owner_rank",
    "global_to_local",
    "local_to_global",
    "local_seq_lens",
    "expand_decode_bounds",
    "localize_decode_bounds",
    "localize_decode_bounds_wrong_order",
    "PrefillChunkMetadata",
    "localize_prefill_chunk",
]


def _positions(pos: object, name: str) -> tuple[torch.Tensor, bool]:
    """Return (int tensor, was_python_int) after checking values are >= 0."""
    scalar = isinstance(pos, int) and not isinstance(pos, bool)
    t = as_int_tensor(pos, name)
    check_non_negative(t, name)
    return t, scalar


def _out(t: torch.Tensor, scalar: bool) -> IntLike:
    return int(t.item()) if scalar else t


@overload
def owner_rank(pos: int, world_size: int, interleave: int = 1) -> int: ...
@overload
def owner_rank(pos: torch.Tensor, world_size: int, interleave: int = 1) -> torch.Tensor: ...
def owner_rank(pos, world_size, interleave=1):
    """Rank that stores global position ``pos``: ``(pos // I) % W``.

    Args:
        pos: int or int32/int64 tensor of any shape, values >= 0.
        world_size: W >= 1.  interleave: I >= 1.
    Returns:
        Same kind/shape/dtype as ``pos``; values in ``[0, W)``.
    """
    w, _, i = check_world(world_size, None, interleave)
    t, scalar = _positions(pos, "pos")
    return _out(torch.div(t, i, rounding_mode="floor") % w, scalar)


@overload
def global_to_local(pos: int, world_size: int, interleave: int = 1) -> int: ...
@overload
def global_to_local(pos: torch.Tensor, world_size: int, interleave: int = 1) -> torch.Tensor: ...
def global_to_local(pos, world_size, interleave=1):
    """Index of global position ``pos`` inside its owner's local KV: ``(pos // (W*I))*I + pos % I``.

    Args/Returns as :func:`owner_rank`. Pair it with :func:`owner_rank` to know *which* rank.
    """
    w, _, i = check_world(world_size, None, interleave)
    t, scalar = _positions(pos, "pos")
    return _out(torch.div(t, w * i, rounding_mode="floor") * i + t % i, scalar)


@overload
def local_to_global(local: int, rank: int, world_size: int, interleave: int = 1) -> int: ...
@overload
def local_to_global(local: torch.Tensor, rank: int, world_size: int, interleave: int = 1) -> torch.Tensor: ...
def local_to_global(local, rank, world_size, interleave=1):
    """Global position of local index ``local`` on ``rank``: ``(l // I)*(W*I) + rank*I + l % I``.

    Exact inverse of ``(owner_rank, global_to_local)`` for every ``I >= 1``.
    """
    w, r, i = check_world(world_size, rank, interleave)
    t, scalar = _positions(local, "local")
    return _out(torch.div(t, i, rounding_mode="floor") * (w * i) + r * i + t % i, scalar)


@overload
def local_seq_lens(seq_lens: int, world_size: int, rank: int, interleave: int = 1) -> int: ...
@overload
def local_seq_lens(seq_lens: torch.Tensor, world_size: int, rank: int | None = None, interleave: int = 1) -> torch.Tensor: ...
def local_seq_lens(seq_lens, world_size, rank=None, interleave=1):
    """Number of positions ``p < L`` with ``(p // I) % W == rank`` — closed form, no loops.

    Args:
        seq_lens: global lengths ``L``; int or int32/int64 tensor of any shape, values >= 0.
        world_size: W >= 1.
        rank: this rank in ``[0, W)``, or ``None`` for all ranks at once.
        interleave: I >= 1.
    Returns:
        ``rank`` given: same shape/dtype/device as ``seq_lens`` (int for an int input).
        ``rank=None``: shape ``seq_lens.shape + (W,)``, entry ``[..., r]`` for rank ``r``; the
        entries sum to ``seq_lens`` over the last dimension. (An int input becomes a 1-D tensor.)
    """
    w, r, i = check_world(world_size, rank, interleave)
    t, scalar = _positions(seq_lens, "seq_lens")
    span = w * i
    full = torch.div(t, span, rounding_mode="floor")
    rem = t - full * span
    if r is None:
        ranks = torch.arange(w, device=t.device, dtype=t.dtype)
        out = full.unsqueeze(-1) * i + torch.clamp(rem.unsqueeze(-1) - ranks * i, min=0, max=i)
        return out
    return _out(full * i + torch.clamp(rem - r * i, min=0, max=i), scalar)


def expand_decode_bounds(seq_lens: object, query_lens: object) -> torch.Tensor:
    """Per-query-token *global* key bounds for (speculative / MTP) decode.

    Request ``b`` has ``L_b = seq_lens[b]`` tokens in total, the last ``q_b`` of which are this
    step's query tokens. Query token ``j`` (``0 <= j < q_b``) sits at position ``L_b - q_b + j``
    and attends causally to keys ``[0, L_b - q_b + j + 1)``; that exclusive bound is returned.

    Args:
        seq_lens: int32/int64 ``[B]`` (or list of ints), ``L_b >= q_b``.
        query_lens: either an int ``next_n >= 1`` (every request has ``next_n`` query tokens —
            the 2-D form), or int32/int64 ``[B]`` per-request counts ``>= 0`` (the 1-D flattened
            form, tokens of request 0 first).
    Returns:
        ``[B, next_n]`` for an int ``query_lens``, else ``[sum(query_lens)]``; dtype/device of
        ``seq_lens``.
    """
    lens = as_int_tensor(seq_lens, "seq_lens", allow_scalar=False)
    if lens.ndim != 1:
        raise ValueError(f"seq_lens must be 1-D [B], got shape {tuple(lens.shape)}")
    check_non_negative(lens, "seq_lens")
    return _expand(lens, query_lens, check_bounds=True)


def _expand(lens: torch.Tensor, query_lens: object, *, check_bounds: bool) -> torch.Tensor:
    """Shared body of the right and the deliberately wrong expansion (see callers)."""
    if isinstance(query_lens, int) and not isinstance(query_lens, bool):
        next_n = check_int_scalar(query_lens, "query_lens", min_value=1)
        if check_bounds and lens.numel() and bool((lens < next_n).any()):
            raise ValueError(f"seq_lens must be >= query_lens={next_n} (each query token is part of the sequence)")
        j = torch.arange(next_n, device=lens.device, dtype=lens.dtype)
        return lens.unsqueeze(1) - next_n + 1 + j
    q = as_int_tensor(query_lens, "query_lens", allow_scalar=False).to(device=lens.device, dtype=lens.dtype)
    if q.shape != lens.shape:
        raise ValueError(f"query_lens must have the shape of seq_lens {tuple(lens.shape)}, got {tuple(q.shape)}")
    check_non_negative(q, "query_lens")
    if check_bounds and bool((lens < q).any()):
        raise ValueError("seq_lens must be >= query_lens elementwise (each query token is part of the sequence)")
    # Index of each flattened token within its request: arange minus the request's start offset.
    total = int(q.sum())
    req = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), q.long(), output_size=total)
    starts = torch.cumsum(q, 0) - q
    j = torch.arange(total, device=lens.device, dtype=lens.dtype) - starts[req]
    return lens[req] - q[req] + 1 + j


def localize_decode_bounds(
    seq_lens: object,
    query_lens: object,
    world_size: int,
    rank: int | None,
    interleave: int = 1,
) -> torch.Tensor:
    """This rank's per-query-token key bounds: expand globally first, localize each bound after.

    ``local_seq_lens(expand_decode_bounds(seq_lens, query_lens), W, rank, I)``. Shapes as in
    :func:`expand_decode_bounds` (with a trailing ``[W]`` dimension when ``rank is None``).

    Example (W=2, rank 1, I=1; one request, L=10, 3 query tokens): global bounds ``[8, 9, 10]``
    → local ``[4, 4, 5]``.
    """
    check_world(world_size, rank, interleave)
    bounds = expand_decode_bounds(seq_lens, query_lens)
    return local_seq_lens(bounds, world_size, rank, interleave)


def localize_decode_bounds_wrong_order(
    seq_lens: object,
    query_lens: object,
    world_size: int,
    rank: int,
    interleave: int = 1,
) -> torch.Tensor:
    """**Deliberately wrong** — kept only to demonstrate the bug in notebook 01.

    Localizes the request length first, then expands per token by subtracting the query offset
    in *local* units: ``local_len(L) - q + 1 + j``. That assumes every one of the last ``q``
    global positions lives on this rank, which is false for ``W > 1``.
    W=2, rank 1, global bounds ``[8, 9, 10]`` give ``[3, 4, 5]`` here instead of ``[4, 4, 5]``.
    Never use it for real metadata.
    """
    w, r, i = check_world(world_size, rank, interleave)
    if r is None:
        raise ValueError("rank must be an int for localize_decode_bounds_wrong_order")
    lens = as_int_tensor(seq_lens, "seq_lens", allow_scalar=False)
    local = local_seq_lens(lens, w, r, i)
    # Expand the *local* length by subtracting *global* query offsets — exactly the mistake.
    return _expand(local, query_lens, check_bounds=False)


@dataclass(frozen=True)
class PrefillChunkMetadata:
    """One prefill chunk's attention metadata, localized for one rank.

    Keys of the chunk's requests are gathered, request after request, into one contiguous local
    buffer; ``cu_seqlens_k`` indexes it. Query tokens are *not* sharded (every rank computes
    every query token against its own keys, and the partial results are merged by LSE). The
    tensors are integer, in the dtype of the inputs.

    Attributes:
        cu_seqlens_q: ``[B+1]`` query-token offsets of each request (identical on all ranks).
        cu_seqlens_k: ``[B+1]`` offsets of each request's *local* keys in the gathered buffer.
        token_ks, token_ke: ``[T]`` per query token, the local key range ``[ks, ke)`` it may attend
            to (causal; ``ke == ks`` when all its visible keys live on other ranks).
        local_total: number of local keys on this rank (``cu_seqlens_k[-1]``).
        max_local_total: the largest ``local_total`` over all ranks — the buffer size every rank
            allocates so that collective shapes agree.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    token_ks: torch.Tensor
    token_ke: torch.Tensor
    local_total: int
    max_local_total: int


def localize_prefill_chunk(
    context_lens: object,
    query_lens: object,
    world_size: int,
    rank: int,
    interleave: int = 1,
) -> PrefillChunkMetadata:
    """Local cu_seqlens and per-token causal bounds of a prefill chunk on ``rank``.

    Request ``b`` already has ``context_lens[b]`` tokens in the KV cache and this chunk adds
    ``query_lens[b]`` more (so its keys are the first ``context_lens[b] + query_lens[b]``
    positions). Query token ``j`` is global position ``context_lens[b] + j`` and sees keys
    ``[0, context_lens[b] + j + 1)``. Any ``interleave >= 1``.

    Args:
        context_lens, query_lens: int32/int64 ``[B]`` (or lists), values >= 0.
        world_size, rank, interleave: the DCP geometry.
    Returns:
        :class:`PrefillChunkMetadata`.
    """
    w, r, i = check_world(world_size, rank, interleave)
    if r is None:
        raise ValueError("rank must be an int for localize_prefill_chunk")
    ctx = as_int_tensor(context_lens, "context_lens", allow_scalar=False)
    q = as_int_tensor(query_lens, "query_lens", allow_scalar=False)
    if ctx.ndim != 1:
        raise ValueError(f"context_lens must be 1-D [B], got shape {tuple(ctx.shape)}")
    if q.shape != ctx.shape:
        raise ValueError(f"query_lens must have the shape of context_lens {tuple(ctx.shape)}, got {tuple(q.shape)}")
    check_non_negative(ctx, "context_lens")
    check_non_negative(q, "query_lens")
    q = q.to(device=ctx.device, dtype=ctx.dtype)
    zero = torch.zeros(1, dtype=ctx.dtype, device=ctx.device)

    seq = ctx + q
    all_local = local_seq_lens(seq, w, None, i)  # [B, W]
    local = all_local[:, r]
    cu_k = torch.cat([zero, torch.cumsum(local, 0)]).to(ctx.dtype)
    cu_q = torch.cat([zero, torch.cumsum(q, 0)]).to(ctx.dtype)

    # Per query token: global bound ctx + j + 1, localized *after* expansion (as for decode).
    bounds = expand_decode_bounds(seq, q) if q.numel() else torch.zeros(0, dtype=ctx.dtype, device=ctx.device)
    req = torch.repeat_interleave(torch.arange(ctx.numel(), device=ctx.device), q.long())
    ks = cu_k[:-1][req]
    ke = ks + local_seq_lens(bounds, w, r, i)
    totals = all_local.sum(0) if all_local.numel() else torch.zeros(w, dtype=ctx.dtype)
    return PrefillChunkMetadata(
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        token_ks=ks.to(ctx.dtype),
        token_ke=ke.to(ctx.dtype),
        local_total=int(cu_k[-1]),
        max_local_total=int(totals.max()),
    )
