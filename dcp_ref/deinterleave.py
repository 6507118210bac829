"""The deinterleave and compaction stages — global token ids to this rank's physical KV slots, then compaction
to the front.

After the global top-K (the select stage) every rank holds, for each query token, the same ``K`` selected
*global* token positions (``-1`` = no selection). Each rank must now find the ones it stores and
where they live in its paged KV cache:

    global id t ──owner──▶ rank (t // I) % W          (keep only t owned by this rank)
                ──local──▶ l = (t // (W*I))*I + t % I  (index in this rank's local KV)
                ──block──▶ b = block_table[req, l // block_size]
                ──slot───▶ b * block_size + l % block_size

Everything that is not a valid local slot becomes ``-1``. The sparse-attention kernel of the next
stage reads only the first ``count`` entries of each row, so the valid slots are then *compacted*
to the front of the row (``-1`` after them) and a per-row count is returned.

An attention kernel that masks ``-1`` entries anywhere in a row itself (FlashMLA's FP8 decode: the
*masked* layout) needs no compaction: :func:`deinterleave_masked` gives the uncompacted slots and
the per-row counts in one pass.

Two compaction modes:

* **ordered** — valid slots keep their top-K order (deterministic, what a stable partition gives).
* **unordered** — only the *set* of valid slots and the count are defined; this is what a GPU
  kernel with an atomic counter per row produces (tiles of a row race for their base offset).
  The reference returns a canonical representative (valid slots sorted ascending) so that results
  are easy to compare: compare a kernel's unordered output with :func:`canonicalize` first.

This module is the oracle for ``dcp_ref.kernels.deinterleave_triton``: plain PyTorch, CPU-first,
values validated on the host.
"""

from __future__ import annotations

import torch

from ._checks import INT_DTYPES, check_bool, check_int_scalar, check_tensor, check_values_readable, check_world

__all__ = [
    "check_block_table",
    "global_ids_to_local_slots",
    "compact_to_front",
    "deinterleave_and_compact",
    "deinterleave_masked",
    "canonicalize",
]

_INT32_MAX = 2**31 - 1


def _check_block_geometry(block_size: object, interleave: int) -> int:
    bs = check_int_scalar(block_size, "block_size", min_value=1)
    if bs % interleave:
        # vLLM's DCP layout keeps each rank's interleave stripe inside one KV block; a stripe that
        # straddles blocks is a configuration error, not something to silently support.
        raise ValueError(
            f"block_size must be a multiple of interleave (block_size % interleave == 0), "
            f"got block_size={bs}, interleave={interleave}"
        )
    return bs


def _check_geometry(
    world_size: object, rank: object, interleave: object, block_size: object
) -> tuple[int, int, int, int]:
    w, r, i = check_world(world_size, rank, interleave)
    if r is None:
        raise ValueError(f"rank must be an int in [0, world_size={w}), got None")
    return w, r, i, _check_block_geometry(block_size, i)


def check_deinterleave_inputs(
    token_ids: object,
    req_of_token: object,
    block_table: object,
    block_size: object,
    world_size: object,
    rank: object,
    interleave: object,
    validate: object,
) -> tuple[int, int, int, int]:
    """Every check of :func:`global_ids_to_local_slots`, shared with the Triton kernels so that both
    accept and reject the same inputs with the same message. Returns ``(W, rank, I, block_size)``.

    Always (free): types, dtypes (int32/int64), ranks, shapes, devices, the geometry. When
    ``validate``: the values (one host sync) — request ids in ``[0, B)`` and slots that fit int32.
    """
    validate = check_bool(validate, "validate")
    w, r, i, bs = _check_geometry(world_size, rank, interleave, block_size)
    check_tensor(token_ids, "token_ids", dtypes=INT_DTYPES, ndim=2)
    assert isinstance(token_ids, torch.Tensor)
    check_tensor(block_table, "block_table", dtypes=INT_DTYPES, ndim=2, device=token_ids.device)
    assert isinstance(block_table, torch.Tensor)
    t_rows = token_ids.shape[0]
    n_req = block_table.shape[0]
    if req_of_token is None:
        if t_rows > n_req:
            raise ValueError(
                f"req_of_token=None needs one block_table row per token: token_ids has {t_rows} rows, "
                f"block_table has {n_req}"
            )
    else:
        check_tensor(req_of_token, "req_of_token", dtypes=INT_DTYPES, ndim=1, device=token_ids.device)
        assert isinstance(req_of_token, torch.Tensor)
        if req_of_token.shape[0] != t_rows:
            raise ValueError(
                f"req_of_token must have shape [T]=[{t_rows}] (one entry per row of token_ids), "
                f"got {tuple(req_of_token.shape)}"
            )
    if not validate or not token_ids.numel():
        return w, r, i, bs
    check_values_readable(token_ids, "token_ids")
    check_values_readable(block_table, "block_table")
    if req_of_token is not None:
        check_values_readable(req_of_token, "req_of_token")
        req = req_of_token.long()
        if bool(((req < 0) | (req >= n_req)).any()):
            raise ValueError(
                f"req_of_token values must be in [0, {n_req}) (rows of block_table), "
                f"got min {int(req.min())}, max {int(req.max())}"
            )
    slots = _slots64(token_ids, req_of_token, block_table, bs, w, r, i)
    if int(slots.max()) > _INT32_MAX:
        raise ValueError(
            f"block_table holds a block id whose slots exceed int32 (max slot {int(slots.max())}); "
            f"block ids must be < {(_INT32_MAX + 1) // bs} for block_size={bs}"
        )
    return w, r, i, bs


def _slots64(
    token_ids: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    bs: int,
    w: int,
    r: int,
    i: int,
) -> torch.Tensor:
    """int64 slots (``-1`` where not local), no checks and no host read: a request id outside
    ``[0, B)`` gives an all-``-1`` row, exactly as the Triton kernels do."""
    t_rows = token_ids.shape[0]
    n_req, n_blocks = block_table.shape
    if req_of_token is None:
        req = torch.arange(t_rows, device=token_ids.device, dtype=torch.int64)
    else:
        req = req_of_token.long()
    req_ok = (req >= 0) & (req < n_req)
    t = token_ids.long()
    tc = t.clamp(min=0)  # keep the arithmetic on non-negative ids; negatives are masked below
    owner = (tc // i) % w
    local = (tc // (w * i)) * i + tc % i
    blk_idx = local // bs
    valid = (t >= 0) & (owner == r) & (blk_idx < n_blocks) & req_ok.unsqueeze(1)
    if not t.numel() or not n_req:
        return torch.full_like(t, -1)
    # Gather block ids only where the indices are in range (clamped elsewhere, then masked out).
    safe_idx = torch.where(valid, blk_idx, torch.zeros_like(blk_idx))
    rows = torch.where(req_ok, req, 0).unsqueeze(1).expand_as(safe_idx)
    blocks = block_table.long()[rows, safe_idx]
    valid &= blocks >= 0
    return torch.where(valid, blocks * bs + local % bs, torch.full_like(t, -1))


def global_ids_to_local_slots(
    token_ids: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    block_size: int,
    world_size: int,
    rank: int,
    interleave: int = 1,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Map selected global token ids to this rank's physical KV slots (``-1`` when not here).

    Args:
        token_ids: int32/int64 ``[T, K]``: row ``i`` holds the global positions selected for query
            token ``i``; any negative value (conventionally ``-1``) means "no selection".
        req_of_token: int32/int64 ``[T]``: the request (row of ``block_table``) of each query
            token, values in ``[0, B)``; ``None`` means token ``i`` belongs to request ``i``
            (requires ``T <= B``).
        block_table: int32/int64 ``[B, M]``: physical block ids of each request's *local* KV
            (block ``j`` holds local indices ``[j*block_size, (j+1)*block_size)``). A negative
            entry means "no block" and maps to ``-1``.
        block_size: tokens per KV block, ``>= 1`` and a multiple of ``interleave``.
        world_size, rank, interleave: the DCP geometry (``W >= 1``, ``0 <= rank < W`` — an int,
            ``None`` is rejected — and ``I >= 1``).
        validate: check values on the host (one sync). ``False``: no host read; a request id
            outside ``[0, B)`` gives an all-``-1`` row and a slot beyond int32 saturates to
            ``2**31 - 1`` (which no cache holds: the attention stage rejects it, or with
            ``validate=False`` poisons its row with NaN) — exactly what the Triton kernels do.
    Returns:
        int32 ``[T, K]`` on the device of ``token_ids``: the physical slot
        ``block*block_size + local % block_size``, or ``-1`` where the id is negative, owned by
        another rank, or its block index ``local // block_size`` is ``>= M`` or its block entry
        negative. Entries keep their positions (no compaction).
    Raises:
        TypeError / ValueError naming the argument: wrong dtype, rank, shape, device, request
        ids out of range, ``block_size % interleave != 0``, or a slot that does not fit int32.

    The stage does not know the local lengths: an id past the block table is "not here". That
    the block table covers every request's local length is a plan-time check of the caller
    (``block_table.shape[1] * block_size`` at least the largest local length; see
    :func:`check_block_table`).
    """
    w, r, i, bs = check_deinterleave_inputs(
        token_ids, req_of_token, block_table, block_size, world_size, rank, interleave, validate
    )
    slots = _slots64(token_ids, req_of_token, block_table, bs, w, r, i)
    return slots.clamp(max=_INT32_MAX).to(torch.int32)  # saturate (validated values never reach it)


def compact_to_front(
    slots: torch.Tensor, *, ordered: bool = True, validate: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Move each row's valid (``>= 0``) entries to the front, ``-1`` after them; count them.

    Args:
        slots: int32/int64 ``[T, K]``; negative entries are "invalid".
        ordered: ``True`` — valid entries keep their order (a stable partition). ``False`` — the
            order of the valid entries is unspecified (what atomics give); this reference returns
            them sorted ascending, the canonical form that :func:`canonicalize` produces.
        validate: accepted for a uniform stage signature; this function reads no value on the
            host either way.
    Returns:
        ``(compacted, counts)``: int32 ``[T, K]`` and int32 ``[T]`` on the device of ``slots``.
        ``compacted[i, :counts[i]]`` are row ``i``'s valid entries, ``compacted[i, counts[i]:]``
        are ``-1``. No entry is dropped or duplicated. A row with no valid entry: all ``-1``,
        count 0. Values beyond int32 are rejected (``ValueError`` naming ``slots``, validated).
    """
    check_tensor(slots, "slots", dtypes=INT_DTYPES, ndim=2)
    ordered = check_bool(ordered, "ordered")
    validate = check_bool(validate, "validate")
    if validate and slots.dtype == torch.int64 and slots.numel():
        check_values_readable(slots, "slots")
        if int(slots.max()) > _INT32_MAX:
            raise ValueError(f"slots must fit int32 (the result is int32), got max {int(slots.max())}")
    s = slots.long()
    valid = s >= 0
    counts = valid.sum(dim=1)
    if ordered:
        # Stable sort on "is invalid" (0 before 1) keeps valid entries in their original order.
        key = (~valid).to(torch.int8)
        order = torch.sort(key, dim=1, stable=True).indices
        out = torch.gather(s, 1, order)
    else:
        # Canonical representative of the set: valid ascending; -1 sorted last via a large key.
        big = torch.iinfo(torch.int64).max
        out = torch.sort(torch.where(valid, s, torch.full_like(s, big)), dim=1).values
    out = torch.where(torch.arange(s.shape[1], device=s.device) < counts.unsqueeze(1), out, torch.full_like(out, -1))
    return out.clamp(max=_INT32_MAX).to(torch.int32), counts.to(torch.int32)


def deinterleave_and_compact(
    token_ids: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    block_size: int,
    world_size: int,
    rank: int,
    interleave: int = 1,
    *,
    ordered: bool = True,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deinterleave + compaction in one call: :func:`global_ids_to_local_slots` then :func:`compact_to_front`.

    Returns ``(slots, counts)``: int32 ``[T, K]`` (valid slots first, ``-1`` after) and int32
    ``[T]`` — the contract the sparse-attention stage consumes. Arguments (``ordered`` and
    ``validate`` keyword-only, as in the Triton kernel) and errors as in the two functions; an
    empty row (nothing selected is local) gives count 0 and all ``-1``.
    """
    ordered = check_bool(ordered, "ordered")
    slots = global_ids_to_local_slots(
        token_ids, req_of_token, block_table, block_size, world_size, rank, interleave, validate=validate
    )
    return compact_to_front(slots, ordered=ordered, validate=False)


def deinterleave_masked(
    token_ids: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    block_size: int,
    world_size: int,
    rank: int,
    interleave: int = 1,
    *,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deinterleave without compaction (the masked layout), with per-row counts.

    For an attention kernel that skips ``-1`` entries anywhere in a row (FlashMLA's FP8 decode):
    compaction would buy it nothing, but the step still wants to know how many keys each row has
    here (emptiness is a count of zero).

    Returns ``(slots, counts)``: int32 ``[T, K]`` exactly as :func:`global_ids_to_local_slots`
    (entries keep their positions, ``-1`` where not here) and int32 ``[T]``, the number of
    entries ``>= 0`` in each row. Arguments (``validate`` keyword-only) and errors as in
    :func:`global_ids_to_local_slots`.
    """
    slots = global_ids_to_local_slots(
        token_ids, req_of_token, block_table, block_size, world_size, rank, interleave, validate=validate
    )
    return slots, (slots >= 0).sum(dim=1, dtype=torch.int32)


def check_block_table(
    block_table: torch.Tensor,
    block_size: int,
    local_lens: torch.Tensor | None = None,
    *,
    max_local_len: int | None = None,
) -> None:
    """Check that a block table covers every request's local length (what the stages cannot see).

    The de-interleave stage maps an id past the table, or on a ``-1`` block, to ``-1`` ("not
    here"): with a table that is too short, selected keys would be dropped silently. The step
    knows the lengths and checks them with this function:

    * ``max_local_len`` (an int, free — a plan-time check): ``block_table.shape[1] * block_size``
      must be ``>= max_local_len``;
    * ``local_lens`` (int ``[B]``, this rank's local length of each request; one host read): every
      block ``j < ceil(local_lens[b] / block_size)`` of request ``b`` must exist (``>= 0``).

    Raises ``ValueError`` naming ``block_table`` (or the argument that is malformed).
    """
    check_tensor(block_table, "block_table", dtypes=INT_DTYPES, ndim=2)
    bs = check_int_scalar(block_size, "block_size", min_value=1)
    n_req, n_blocks = block_table.shape
    if max_local_len is not None:
        need = check_int_scalar(max_local_len, "max_local_len", min_value=0)
        if n_blocks * bs < need:
            raise ValueError(
                f"block_table has {n_blocks} blocks of {bs} per request ({n_blocks * bs} local tokens), too short "
                f"for the local length {need}: selected keys past it would be dropped"
            )
    if local_lens is None:
        return
    check_tensor(local_lens, "local_lens", dtypes=INT_DTYPES, ndim=1, device=block_table.device)
    if local_lens.shape[0] != n_req:
        raise ValueError(f"local_lens must have one entry per block_table row ({n_req}), got {tuple(local_lens.shape)}")
    check_values_readable(local_lens, "local_lens")
    check_values_readable(block_table, "block_table")
    lens = local_lens.long()
    if n_req and bool((lens < 0).any()):
        raise ValueError(f"local_lens must be non-negative, found {int(lens.min())}")
    needed = (lens + bs - 1) // bs  # blocks request b needs
    if n_req and int(needed.max()) > n_blocks:
        b = int(torch.argmax(needed))
        raise ValueError(
            f"block_table is too short: request {b} has {int(lens[b])} local tokens ({int(needed[b])} blocks of {bs}), "
            f"the table has {n_blocks} blocks per request"
        )
    used = torch.arange(n_blocks, device=block_table.device).unsqueeze(0) < needed.unsqueeze(1)
    missing = used & (block_table.long() < 0)
    if bool(missing.any()):
        b, j = (int(v) for v in missing.nonzero()[0])
        raise ValueError(
            f"block_table[{b}, {j}] is {int(block_table[b, j])} (no block), but request {b} has "
            f"{int(lens[b])} local tokens: the keys of that block would be dropped"
        )


def canonicalize(slots: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Canonical form of an *unordered* compaction: each row's first ``counts[i]`` entries sorted
    ascending, the rest ``-1`` (whatever they held).

    Two unordered compactions of the same input are equal as sets iff their canonical forms are
    equal. ``slots``: int ``[T, K]``; ``counts``: int ``[T]`` with ``0 <= counts <= K``.
    Returns int32 ``[T, K]``.
    """
    check_tensor(slots, "slots", dtypes=INT_DTYPES, ndim=2)
    check_tensor(counts, "counts", dtypes=INT_DTYPES, ndim=1, device=slots.device)
    if counts.shape[0] != slots.shape[0]:
        raise ValueError(f"counts must have shape [{slots.shape[0]}], got {tuple(counts.shape)}")
    c = counts.long()
    k = slots.shape[1]
    if c.numel() and bool(((c < 0) | (c > k)).any()):
        raise ValueError(f"counts values must be in [0, {k}], got min {int(c.min())}, max {int(c.max())}")
    head = torch.arange(k, device=slots.device) < c.unsqueeze(1)
    big = torch.iinfo(torch.int64).max
    keyed = torch.where(head, slots.long(), torch.full_like(slots, big, dtype=torch.int64))
    out = torch.sort(keyed, dim=1).values
    return torch.where(head, out, torch.full_like(out, -1)).to(torch.int32)
