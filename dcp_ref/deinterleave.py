"""The deinterleave and compaction stages — global token ids to this rank's physical KV slots, then compaction
to the front.

After the global top-K (the select stage) every rank holds, for each query token, the same ``K`` selected
*global* token positions (``-1`` = no selection). Each rank must now find the ones it stores and
where they live in its paged KV cache:

    global id t ──owner──▶ rank (t // I) % W          (keep only t owned by this rank)
                ──local──▶ l = (t // (W*I))*I + t % I  (index in this rank's local KV)
                ──block──▶ b = block_table[req, l // block_size]
                ──slot───▶ b * block_size + l % block_size

An id that is negative or owned by another rank becomes ``-1`` ("not here"). Metadata out of
contract never gives a plausible answer: an id this rank owns whose block is missing (past the
table, or a negative entry), a slot that does not fit below ``2**31 - 1``, and every entry of a row
whose request id is outside the block table become :data:`POISON_SLOT` (``2**31 - 1``) — counted
like a slot, and outside every cache, so the attention stage turns the row into NaN output and NaN
LSE. With ``validate=True`` the same inputs raise instead. The sparse-attention kernel of the next
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

from .contracts import INT_DTYPES, check_bool, check_int_scalar, check_tensor, check_values_readable
from .geometry import DcpGeometry, check_geometry

__all__ = [
    "POISON_SLOT",
    "poisoned_rows",
    "check_deinterleave_inputs",
    "check_deinterleave_readable",
    "raise_deinterleave_violation",
    "check_block_table",
    "global_ids_to_local_slots",
    "compact_to_front",
    "deinterleave_and_compact",
    "deinterleave_masked",
    "canonicalize",
]

_INT32_MAX = 2**31 - 1
#: The slot a deinterleave stage writes where the metadata is out of contract (a request id outside the
#: block table, a selected key that has no block, a slot that does not fit int32). No cache holds it
#: (valid slots are ``< 2**31 - 1``, checked when validating), so the attention stage, which treats a
#: slot outside its cache as poison, gives that row NaN output and NaN LSE: never a plausible answer.
POISON_SLOT = _INT32_MAX


def check_deinterleave_inputs(
    token_ids: object,
    req_of_token: object,
    block_table: object,
    geometry: object,
    validate: object,
) -> DcpGeometry:
    """Every check of :func:`global_ids_to_local_slots`, shared with the Triton kernels so that both
    accept and reject the same inputs with the same message. Returns the geometry.

    Always (free): types, dtypes (int32/int64), ranks, shapes, devices, that ``geometry`` is a
    :class:`~dcp_ref.geometry.DcpGeometry` (validated when it was built: ``W >= 1``,
    ``0 <= rank < W``, ``I >= 1``, ``block_size`` a multiple of ``I``). When
    ``validate``: the values, with **one** device reduction and one host read (the maximum of the
    slots :func:`_slots64` computes — :data:`POISON_SLOT` marks every violation), and on a violation a
    precise message (:func:`raise_deinterleave_violation`): request ids in ``[0, B)``, slots below
    ``2**31 - 1``, and a block for every id this rank owns.
    """
    validate = check_bool(validate, "validate")
    g = check_geometry(geometry)
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
        return g
    check_deinterleave_readable(token_ids, req_of_token, block_table)
    slots = _slots64(token_ids, req_of_token, block_table, g)
    if int(slots.max()) >= POISON_SLOT:  # the one host read of the validated path
        raise_deinterleave_violation(token_ids, req_of_token, block_table, g)
    return g


def check_deinterleave_readable(
    token_ids: torch.Tensor, req_of_token: torch.Tensor | None, block_table: torch.Tensor
) -> None:
    """A validated call needs values: meta tensors (shapes only) are refused, naming the argument."""
    check_values_readable(token_ids, "token_ids")
    check_values_readable(block_table, "block_table")
    if req_of_token is not None:
        check_values_readable(req_of_token, "req_of_token")


def raise_deinterleave_violation(
    token_ids: torch.Tensor, req_of_token: torch.Tensor | None, block_table: torch.Tensor, geometry: DcpGeometry
) -> None:
    """Raise the precise ``ValueError`` for inputs whose slots hold :data:`POISON_SLOT` (the error path:
    it may read the host several times). In order: a request id outside ``[0, B)``, a slot that does not
    fit below ``2**31 - 1``, an id this rank owns without a block (past the table, or a negative entry).
    Returns only if the inputs are in fact valid."""
    bs = geometry.block_size
    t_rows = token_ids.shape[0]
    n_req, n_blocks = block_table.shape
    req = torch.arange(t_rows, device=token_ids.device) if req_of_token is None else req_of_token.long()
    req_ok = (req >= 0) & (req < n_req)
    if t_rows and not bool(req_ok.all()):
        raise ValueError(
            f"req_of_token values must be in [0, {n_req}) (rows of block_table), "
            f"got min {int(req.min())}, max {int(req.max())}"
        )
    owned, local, blk_idx, blocks = _lookup(token_ids, req, block_table, geometry)
    has_block = owned & (blk_idx < n_blocks) & (blocks >= 0)
    raw = blocks.clamp(max=(1 << 62) // bs) * bs + local % bs  # unsaturated (clamped only against int64 overflow)
    raw = torch.where(has_block, raw, -1)
    if raw.numel() and int(raw.max()) >= POISON_SLOT:
        raise ValueError(
            f"block_table holds a block id whose slots exceed int32 or reach the poison slot 2**31 - 1 "
            f"(max slot {int(raw.max())}); block ids must be < {POISON_SLOT // bs} for block_size={bs}"
        )
    missing = owned & ~has_block
    if bool(missing.any()):
        t, c = (int(v) for v in missing.nonzero()[0])
        b, j = int(req[t]), int(blk_idx[t, c])
        where = (
            f"block_table[{b}, {j}] is {int(block_table[b, j])}"
            if j < n_blocks
            else f"block {j} is past the table's {n_blocks} columns"
        )
        raise ValueError(
            f"block_table has no block for a key this rank owns: token_ids[{t}, {c}] = {int(token_ids[t, c])} "
            f"(request {b}, local index {int(local[t, c])}) needs its local block {j}, but {where}; "
            "a selected key must have a KV block"
        )


def _lookup(
    token_ids: torch.Tensor, req: torch.Tensor, block_table: torch.Tensor, geometry: DcpGeometry
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(owned, local, blk_idx, blocks)`` of every id, int64, no checks and no host read: ``blocks`` is
    the block-table entry (``-1`` where none is read: not owned, past the table, or a bad request)."""
    w, r, i, bs = geometry.world_size, geometry.rank, geometry.interleave, geometry.block_size
    n_req, n_blocks = block_table.shape
    req_ok = (req >= 0) & (req < n_req)
    t = token_ids.long()
    tc = t.clamp(min=0)  # keep the arithmetic on non-negative ids; negatives are masked below
    owned = (t >= 0) & ((tc // i) % w == r)
    local = (tc // (w * i)) * i + tc % i
    blk_idx = local // bs
    readable = owned & (blk_idx < n_blocks) & req_ok.unsqueeze(1)
    if not t.numel() or not n_req or not n_blocks:
        return owned, local, blk_idx, torch.full_like(t, -1)
    # Gather block ids only where the indices are in range (clamped elsewhere, then masked out).
    safe_idx = torch.where(readable, blk_idx, torch.zeros_like(blk_idx))
    rows = torch.where(req_ok, req, 0).unsqueeze(1).expand_as(safe_idx)
    blocks = torch.where(readable, block_table.long()[rows, safe_idx], -1)
    return owned, local, blk_idx, blocks


def _slots64(
    token_ids: torch.Tensor, req_of_token: torch.Tensor | None, block_table: torch.Tensor, geometry: DcpGeometry
) -> torch.Tensor:
    """int64 slots in ``[-1, POISON_SLOT]``, no checks and no host read — the rule of the stage, exactly
    what the Triton kernels compute:

    * ``-1`` (not here): a negative id, or an id another rank owns;
    * the slot ``block * bs + local % bs`` of an id this rank owns whose block exists;
    * :data:`POISON_SLOT` where the metadata is out of contract: an owned id whose local block is past
      the table or whose entry is negative (a selected key with no KV row), a slot that would not fit
      below ``2**31 - 1``, and *every* entry of a row whose request id is outside ``[0, B)``.
    """
    bs = geometry.block_size
    t_rows = token_ids.shape[0]
    n_req = block_table.shape[0]
    if req_of_token is None:
        req = torch.arange(t_rows, device=token_ids.device, dtype=torch.int64)
    else:
        req = req_of_token.long()
    req_ok = (req >= 0) & (req < n_req)
    owned, local, _blk_idx, blocks = _lookup(token_ids, req, block_table, geometry)
    # Saturate the block id before the multiplication: a corrupt int64 block id must not wrap into a
    # plausible small slot.
    slot = (blocks.clamp(max=POISON_SLOT // bs + 1) * bs + local % bs).clamp(max=POISON_SLOT)
    slot = torch.where(blocks >= 0, slot, POISON_SLOT)
    counted = owned | ~req_ok.unsqueeze(1)
    return torch.where(counted, slot, -1)


def poisoned_rows(slots: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """bool ``[T]``: the rows of a deinterleave result that hold :data:`POISON_SLOT` (out-of-contract
    metadata; the attention stage turns them into NaN). ``counts`` given (the compact layout): only the
    first ``counts[t]`` entries of row ``t`` are looked at. No host read."""
    check_tensor(slots, "slots", dtypes=INT_DTYPES, ndim=2)
    hit = slots == POISON_SLOT
    if counts is not None:
        check_tensor(counts, "counts", dtypes=INT_DTYPES, ndim=1, device=slots.device)
        if counts.shape[0] != slots.shape[0]:
            raise ValueError(f"counts must have shape [{slots.shape[0]}], got {tuple(counts.shape)}")
        hit &= torch.arange(slots.shape[1], device=slots.device) < counts.unsqueeze(1)
    return hit.any(dim=1)


def global_ids_to_local_slots(
    token_ids: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
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
        block_table: int32/int64 ``[B, M]`` (``M`` may be 0): physical block ids of each request's
            *local* KV (block ``j`` holds local indices ``[j*block_size, (j+1)*block_size)``); a
            negative entry means "no block".
        geometry: this rank's :class:`~dcp_ref.geometry.DcpGeometry` (``world_size``, ``rank``,
            ``interleave`` and the cache's ``block_size``); anything else is a ``TypeError``.
        validate: check values on the host (one device reduction, one read). ``False``: no host read;
            out-of-contract metadata *poisons* instead (below) — exactly what the Triton kernels do.
    Returns:
        int32 ``[T, K]`` on the device of ``token_ids``, entries at their positions (no compaction):
        ``-1`` where the id is negative or owned by another rank (not here); the physical slot
        ``block*block_size + local % block_size`` of an id this rank owns; and :data:`POISON_SLOT`
        (``2**31 - 1``, which no cache holds: the attention stage turns its row into NaN) where the
        metadata is out of contract — an id this rank owns with no block (its local block index
        ``>= M`` or its entry negative: a selected key without a KV row), a slot that does not fit
        below ``2**31 - 1``, and every entry of a row whose request id is outside ``[0, B)``.
        Poisoned entries count as valid (``>= 0``), so a compaction keeps them and its count covers them.
    Raises:
        TypeError / ValueError naming the argument: wrong dtype, rank, shape, device, and — validated —
        request ids out of range, a slot that does not fit below ``2**31 - 1``, an owned id without a
        block (all named after ``req_of_token`` / ``block_table``); ``geometry`` not a ``DcpGeometry``.

    The stage does not know the local lengths: that the block table covers every request's local
    length is a plan-time check of the caller (:func:`check_block_table`); a selected key past it is
    poisoned here, never silently dropped.
    """
    g = check_deinterleave_inputs(token_ids, req_of_token, block_table, geometry, False)
    slots = _slots64(token_ids, req_of_token, block_table, g)
    if check_bool(validate, "validate") and token_ids.numel():
        check_deinterleave_readable(token_ids, req_of_token, block_table)
        if int(slots.max()) >= POISON_SLOT:  # one reduction, one host read
            raise_deinterleave_violation(token_ids, req_of_token, block_table, g)
    return slots.to(torch.int32)


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
        are ``-1``. No entry is dropped or duplicated (:data:`POISON_SLOT` entries are valid entries
        and stay). A row with no valid entry: all ``-1``, count 0. Values beyond int32 are rejected
        (``ValueError`` naming ``slots``, validated) or saturate to :data:`POISON_SLOT`.
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
    geometry: DcpGeometry,
    *,
    ordered: bool = True,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deinterleave + compaction in one call: :func:`global_ids_to_local_slots` then :func:`compact_to_front`.

    Returns ``(slots, counts)``: int32 ``[T, K]`` (valid slots first, ``-1`` after) and int32
    ``[T]`` — the contract the sparse-attention stage consumes. Arguments (``ordered`` and
    ``validate`` keyword-only, as in the Triton kernel) and errors as in the two functions; an
    empty row (nothing selected is local) gives count 0 and all ``-1``. With ``validate=False``
    out-of-contract metadata gives :data:`POISON_SLOT` entries, compacted like slots (the count
    covers them), so the attention stage poisons the row.
    """
    ordered = check_bool(ordered, "ordered")
    slots = global_ids_to_local_slots(token_ids, req_of_token, block_table, geometry, validate=validate)
    return compact_to_front(slots, ordered=ordered, validate=False)


def deinterleave_masked(
    token_ids: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    *,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deinterleave without compaction (the masked layout), with per-row counts.

    For an attention kernel that skips ``-1`` entries anywhere in a row (FlashMLA's FP8 decode):
    compaction would buy it nothing, but the step still wants to know how many keys each row has
    here (emptiness is a count of zero).

    Returns ``(slots, counts)``: int32 ``[T, K]`` exactly as :func:`global_ids_to_local_slots`
    (entries keep their positions, ``-1`` where not here, :data:`POISON_SLOT` where the metadata
    is out of contract) and int32 ``[T]``, the number of entries ``>= 0`` in each row (poisoned
    entries included). Arguments (``validate`` keyword-only) and errors as in
    :func:`global_ids_to_local_slots`.
    """
    slots = global_ids_to_local_slots(token_ids, req_of_token, block_table, geometry, validate=validate)
    return slots, (slots >= 0).sum(dim=1, dtype=torch.int32)


def check_block_table(
    block_table: torch.Tensor,
    block_size: int,
    local_lens: torch.Tensor | None = None,
    *,
    max_local_len: int | None = None,
) -> None:
    """Check that a block table covers every request's local length (what the stages cannot see).

    The deinterleave stage poisons an id this rank owns whose block is past the table or ``-1``
    (:data:`POISON_SLOT`: the row becomes NaN), so a table that is too short turns valid tokens into
    NaN. The step knows the lengths and checks them with this function:

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
