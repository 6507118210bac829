"""The ownership stage — ownership math: which rank holds which token, and global lengths made local.

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

All functions take Python (or NumPy) ints or int32/int64 tensors (CPU or CUDA) and return the
same kind: int in → int out, tensor in → tensor of the same dtype and device out. The arithmetic
runs in int64 whatever the input dtype (an int32 ``W*I`` or ``l // I * W*I`` must not wrap), and
a result that does not fit the input's dtype raises ``ValueError`` instead of wrapping.

Contract (every function): negative positions / lengths raise ``ValueError`` naming the argument;
``world_size < 1``, ``interleave < 1`` or a rank outside ``[0, W)`` raise ``ValueError``; a float,
bool or list where an int belongs raises ``TypeError``. An empty tensor gives an empty result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import overload

import numpy as np
import torch

from .contracts import as_int_tensor, check_bool, check_int_scalar, check_non_negative, check_world

IntLike = int | torch.Tensor

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


_INT_MAX = {torch.int32: 2**31 - 1, torch.int64: 2**63 - 1}


def _positions(pos: object, name: str) -> tuple[torch.Tensor, bool]:
    """Return (int tensor, was_python_int) after checking values are >= 0."""
    scalar = isinstance(pos, (int, np.integer)) and not isinstance(pos, (bool, np.bool_))
    t = as_int_tensor(pos, name)
    check_non_negative(t, name)
    return t, scalar


def _out(t: torch.Tensor, scalar: bool, like: torch.Tensor) -> IntLike:
    """The int64 result ``t`` back in the input's kind: a Python int, or ``like``'s dtype."""
    return int(t.item()) if scalar else t.to(like.dtype)


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
    t64 = t.long()
    return _out(torch.div(t64, i, rounding_mode="floor") % w, scalar, t)


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
    t64 = t.long()
    # a stripe W*I beyond int64 holds every int64 position in its first stripe (and is no torch scalar)
    stripes = torch.div(t64, w * i, rounding_mode="floor") if w * i <= _INT_MAX[torch.int64] else torch.zeros_like(t64)
    return _out(stripes * i + t64 % i, scalar, t)


@overload
def local_to_global(local: int, world_size: int, rank: int, interleave: int = 1) -> int: ...
@overload
def local_to_global(local: torch.Tensor, world_size: int, rank: int, interleave: int = 1) -> torch.Tensor: ...
def local_to_global(local, world_size, rank, interleave=1):
    """Global position of local index ``local`` on ``rank``: ``(l // I)*(W*I) + rank*I + l % I``.

    The geometry in the project's one order, ``world_size, rank, interleave``. (A call in the old order
    ``local, rank, world_size`` raises: a valid rank is below its world size, so swapped it is not.)
    Exact inverse of ``(owner_rank, global_to_local)`` for every ``I >= 1``. The global position
    is about ``W`` times the local one: a result that does not fit ``local``'s dtype (int32, or
    int64) raises ``ValueError`` naming ``local`` (pass int64 tensors) instead of wrapping.
    """
    w, r, i = check_world(world_size, rank, interleave)
    if r is None:
        raise ValueError(f"rank must be an int in [0, world_size={w}), got None")
    t, scalar = _positions(local, "local")
    t64 = t.long()
    limit = _INT_MAX[torch.int64 if scalar else t.dtype]
    # Largest local index whose global position (l // I)*W*I + r*I + l % I fits (Python ints, exact): the last
    # stripe b whose first position on this rank fits, then as far into its I positions as still fits.
    b_max = (limit - r * i) // (w * i)
    max_local = b_max * i + min(i - 1, limit - b_max * w * i - r * i) if limit >= r * i else -1
    if t.numel() and int(t64.max()) > max_local:
        raise ValueError(
            f"local must be <= {max_local} for world_size={w}, interleave={i}: its global position would "
            f"overflow {'int64' if scalar else str(t.dtype).replace('torch.', '')}, got max {int(t64.max())}"
            + ("" if scalar or t.dtype == torch.int64 else " (pass an int64 tensor)")
        )
    blocks = torch.div(t64, i, rounding_mode="floor")
    # W*I beyond int64 (no torch scalar): every local index that fits is in stripe 0 (checked above)
    stripe = blocks * (w * i) if w * i <= _INT_MAX[torch.int64] else torch.zeros_like(blocks)
    return _out(stripe + r * i + t64 % i, scalar, t)


@overload
def local_seq_lens(seq_lens: int, world_size: int, rank: int, interleave: int = 1) -> int: ...
@overload
def local_seq_lens(
    seq_lens: torch.Tensor, world_size: int, rank: int | None = None, interleave: int = 1
) -> torch.Tensor: ...
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
    out = _local_lens(t, w, r, i)
    return out if r is None else _out(out, scalar, t)


def _local_lens(t: torch.Tensor, w: int, r: int | None, i: int) -> torch.Tensor:
    """The closed form of :func:`local_seq_lens` without checks (int64 arithmetic, ``t``'s dtype out
    for ``r=None``, int64 otherwise). Negative lengths count as 0 (the unvalidated path's clamp)."""
    t64 = t.long().clamp(min=0)
    span = w * i
    full = torch.div(t64, span, rounding_mode="floor")
    rem = t64 - full * span
    if r is None:
        ranks = torch.arange(w, device=t.device, dtype=torch.int64)
        return (full.unsqueeze(-1) * i + torch.clamp(rem.unsqueeze(-1) - ranks * i, min=0, max=i)).to(t.dtype)
    return full * i + torch.clamp(rem - r * i, min=0, max=i)


def expand_decode_bounds(
    seq_lens: object, query_lens: object, *, num_tokens: int | None = None, validate: bool = True
) -> torch.Tensor:
    """Per-query-token *global* key bounds for (speculative / MTP) decode.

    Request ``b`` has ``L_b = seq_lens[b]`` tokens in total, the last ``q_b`` of which are this
    step's query tokens. Query token ``j`` (``0 <= j < q_b``) sits at position ``L_b - q_b + j``
    and attends causally to keys ``[0, L_b - q_b + j + 1)``; that exclusive bound is returned.

    Args:
        seq_lens: int32/int64 ``[B]`` (or a list / NumPy array of ints), ``L_b >= q_b``.
        query_lens: either an int ``next_n >= 1`` (every request has ``next_n`` query tokens —
            the 2-D form), or int32/int64 ``[B]`` per-request counts ``>= 0`` (the 1-D flattened
            form, tokens of request 0 first).
        num_tokens: the number of query tokens ``T`` the caller has (e.g. ``q.shape[0]``).
            Checked against ``B * next_n`` / ``sum(query_lens)`` (``ValueError`` naming
            ``query_lens`` on a mismatch). Required with ``validate=False`` for a tensor
            ``query_lens``: the output size must not depend on tensor values.
        validate: check values on the host (one sync). ``False``: no host read; negative
            lengths / counts are clamped to 0 and bounds to ``>= 0`` on the device.
    Returns:
        ``[B, next_n]`` for an int ``query_lens``, else ``[sum(query_lens)]``; dtype/device of
        ``seq_lens``.
    Raises:
        ValueError: negative ``seq_lens`` / ``query_lens``, ``seq_lens < query_lens``, a
            ``num_tokens`` mismatch, shapes that disagree. TypeError: non-integer inputs.
    """
    validate = check_bool(validate, "validate")
    lens = as_int_tensor(seq_lens, "seq_lens", allow_scalar=False)
    if lens.ndim != 1:
        raise ValueError(f"seq_lens must be 1-D [B], got shape {tuple(lens.shape)}")
    if validate:
        check_non_negative(lens, "seq_lens")
    return _expand(lens, query_lens, check_bounds=True, validate=validate, num_tokens=num_tokens)


def _expand(
    lens: torch.Tensor, query_lens: object, *, check_bounds: bool, validate: bool = True, num_tokens: object = None
) -> torch.Tensor:
    """Shared body of the right and the deliberately wrong expansion (see callers)."""
    n_tok = None if num_tokens is None else check_int_scalar(num_tokens, "num_tokens", min_value=0)
    B = lens.numel()
    if isinstance(query_lens, (int, np.integer)) and not isinstance(query_lens, (bool, np.bool_)):
        next_n = check_int_scalar(query_lens, "query_lens", min_value=1)
        if n_tok is not None and B * next_n != n_tok:
            raise ValueError(
                f"query_lens={next_n} per request for {B} requests gives {B * next_n} query tokens, "
                f"but num_tokens={n_tok} (q has that many rows)"
            )
        if validate and check_bounds and B and bool((lens < next_n).any()):
            raise ValueError(f"seq_lens must be >= query_lens={next_n} (each query token is part of the sequence)")
        j = torch.arange(next_n, device=lens.device, dtype=torch.int64)
        out = lens.long().unsqueeze(1) - next_n + 1 + j
        return (out if validate else out.clamp(min=0)).to(lens.dtype)
    q = as_int_tensor(query_lens, "query_lens", allow_scalar=False)
    if tuple(q.shape) != tuple(lens.shape):
        raise ValueError(f"query_lens must have the shape of seq_lens {tuple(lens.shape)}, got {tuple(q.shape)}")
    q = q.to(device=lens.device, dtype=torch.int64)
    if validate:
        check_non_negative(q, "query_lens")
        if check_bounds and B and bool((lens < q).any()):
            raise ValueError("seq_lens must be >= query_lens elementwise (each query token is part of the sequence)")
        total = int(q.sum()) if B else 0
        if n_tok is not None and total != n_tok:
            raise ValueError(f"query_lens must add up to num_tokens={n_tok} (q has that many rows), got sum {total}")
    else:
        if n_tok is None:
            raise ValueError(
                "num_tokens is required with validate=False when query_lens is a tensor "
                "(the number of query tokens must not be read from the device)"
            )
        if B == 0 and n_tok:
            raise ValueError(f"query_lens is empty (no request) but num_tokens={n_tok}")
        total = n_tok
        q = q.clamp(min=0)
    # Request and index-within-request of each flattened token, by a search in the cumulative
    # counts: always in bounds (repeat_interleave with a wrong output_size is not, on CUDA).
    ends = torch.cumsum(q, 0)
    tok = torch.arange(total, device=lens.device, dtype=torch.int64)
    req = torch.searchsorted(ends, tok, right=True).clamp(max=max(B - 1, 0))
    j = tok - (ends - q)[req]
    out = lens.long()[req] - q[req] + 1 + j
    return (out if validate else out.clamp(min=0)).to(lens.dtype)


def localize_decode_bounds(
    seq_lens: object,
    query_lens: object,
    world_size: int,
    rank: int | None,
    interleave: int = 1,
    *,
    num_tokens: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """This rank's per-query-token key bounds: expand globally first, localize each bound after.

    ``local_seq_lens(expand_decode_bounds(seq_lens, query_lens), W, rank, I)``. Shapes as in
    :func:`expand_decode_bounds` (with a trailing ``[W]`` dimension when ``rank is None``).

    Example (W=2, rank 1, I=1; one request, L=10, 3 query tokens): global bounds ``[8, 9, 10]``
    → local ``[4, 4, 5]``.

    Contract: valid inputs are those of :func:`expand_decode_bounds` plus the geometry
    (``W >= 1``, ``0 <= rank < W`` or ``None``, ``I >= 1``). ``num_tokens`` (``q.shape[0]``) is
    checked against the query counts. ``validate=False`` reads nothing on the host (pass
    ``num_tokens`` for a tensor ``query_lens``); bad values are clamped to 0 on the device. A
    request with ``L = 0`` keys on this rank gives bound 0 (an empty row downstream).
    """
    check_world(world_size, rank, interleave)
    bounds = expand_decode_bounds(seq_lens, query_lens, num_tokens=num_tokens, validate=validate)
    w, r, i = check_world(world_size, rank, interleave)
    out = _local_lens(bounds, w, r, i)
    return out.to(bounds.dtype)


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
    over = q.long() > _INT_MAX[ctx.dtype] - ctx.long()  # never ctx + q: the sum may wrap
    if bool(over.any()):
        b = int(over.nonzero()[0, 0])
        raise ValueError(
            f"context_lens + query_lens must fit {str(ctx.dtype).replace('torch.', '')}: request {b} has "
            f"{int(ctx[b])} + {int(q[b])} tokens" + ("" if ctx.dtype == torch.int64 else " (pass int64 tensors)")
        )

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
    totals = all_local.sum(0) if all_local.numel() else torch.zeros(w, dtype=ctx.dtype, device=ctx.device)
    return PrefillChunkMetadata(
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        token_ks=ks.to(ctx.dtype),
        token_ke=ke.to(ctx.dtype),
        local_total=int(cu_k[-1]),
        max_local_total=int(totals.max()),
    )
