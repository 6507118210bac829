"""The owner-local exchange stage — gathered candidates straight to *this* rank's KV slots, in one stage.

Today's exchange runs two stages on every rank: the select stage (:func:`dcp_ref.topk.stable_topk`) computes
the *whole* global top-``k`` from the all-gathered candidates, and the deinterleave stage
(:func:`dcp_ref.deinterleave.deinterleave_and_compact`) maps the chosen ids to this rank's slots and throws
away the ``(W-1)/W`` of them that other ranks own. :func:`select_to_slots` does both at once and keeps only
what this rank owns::

    gathered candidates ──(global threshold)──▶ winners ──(owned here?)──▶ local index ──block table──▶ slot

Every rank still finds the same global threshold (the selection is the same total order everywhere), so
the union over ranks of the emitted slots is exactly the single-device top-``k`` mapped to slots: nothing
dropped, nothing twice. Only the *output* is owner-local.

Two total orders (both exact; see :func:`order_difference_example` for where they differ)
-----------------------------------------------------------------------------------------
``order="global_id"`` (vLLM's; today's wire format)
    ``gathered`` float32 ``[W, T, K, 2]`` = ``(score, float(global id))`` pairs, as
    :func:`dcp_ref.topk.pack_candidates` packs them. Order: score descending (as float32, ``-0.0 == +0.0``),
    then lower global id. Invalid: NaN score, or a negative / NaN id. The winners are exactly
    :func:`dcp_ref.topk.stable_topk`'s; this rank keeps those it owns (owner ``(gid // I) % W``) and maps
    them through the block table as :func:`dcp_ref.deinterleave.global_ids_to_local_slots` does.
``order="rank_local"`` (ids never travel)
    ``gathered`` float32 ``[W, T, K]`` = scores only (NaN = invalid / padding), half the bytes on the
    wire. Each rank writes its ``K`` candidates in *ascending local-index order*, so a candidate's position
    ``w*K + c`` in the gathered row is its tie-break: score descending, then lower rank, then lower
    local index. This rank keeps its own local indices, ``own_ids`` int32 ``[T, K]`` (row ``geometry.rank``
    of the gathered scores; ``-1`` for padding), and maps its winners ``c`` through ``own_ids[t, c]``.

Output layout
-------------
Compact: ``slots[t, :counts[t]]`` are this rank's winners' slots, ``-1`` after; ``counts[t]`` how many. The
reference writes them in *selection order* (the order of the total order above); a kernel may use any order
(compare as sets, :func:`dcp_ref.deinterleave.canonicalize`). The layout serves both attention layouts: a
"masked" attention (FlashMLA's FP8 decode, which skips ``-1`` anywhere) reads the same rows.

Contract
--------
Checked always (free): types, dtypes, ranks, shapes, devices, the geometry, ``out_`` buffers. With
``validate=True`` also the values (host syncs), each error naming its argument: ids that are not ``-1`` or an
integer in ``[0, 2**24)``, a global id twice in a row, ``own_ids`` not ascending or ``-1`` under a real
score, request ids outside ``[0, B)``, a winner of this rank with no block (past the table or a negative
entry), and slots beyond int32. With ``validate=False`` nothing is read on the host, and an out-of-contract
row is **poisoned**, never answered plausibly: a winner owned here whose request id is outside ``[0, B)``,
whose local index is missing (``own_ids`` ``-1``) or whose block is missing (past the table, or a negative
entry), or whose slot exceeds int32, gets the saturated sentinel slot ``2**31 - 1``, which no cache holds:
the attention stage turns that row into NaN. Ids outside the contract (not integers, ``>= 2**24``,
duplicates) give an unspecified but memory-safe answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .contracts import (
    INT_DTYPES,
    check_bool,
    check_int_scalar,
    check_no_aliases,
    check_out,
    check_tensor,
    check_values_readable,
)
from .deinterleave import POISON_SLOT
from .geometry import DcpGeometry
from .topk import INVALID_KEY, check_candidate_ids, stable_key

__all__ = [
    "ORDERS",
    "SENTINEL_SLOT",
    "SelectToSlotsInputs",
    "Selection",
    "check_select_to_slots_inputs",
    "select_winners",
    "select_to_slots",
    "reference_select_to_slots",
    "OrderDifference",
    "order_difference_example",
]

#: The two total orders of the exchange (module docstring).
ORDERS = ("global_id", "rank_local")
#: The slot a poisoned winner gets: beyond int32's range of real slots, so the attention stage rejects it
#: (validated) or turns the row into NaN (``validate=False``).
SENTINEL_SLOT = POISON_SLOT  # the one constant of the poison rule (dcp_ref.deinterleave), under this stage's name
_INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class SelectToSlotsInputs:
    """The checked shapes of one :func:`select_to_slots` call (see :func:`check_select_to_slots_inputs`).

    Attributes:
        order: ``"global_id"`` or ``"rank_local"``.
        geometry: this rank's geometry (``W``, ``rank``, ``I``, block size).
        rows: ``T``, query tokens.  kloc: ``K``, candidates per rank.  k: winners of the global order.
        n_req: ``B``, rows of the block table.  n_blocks: ``M``, its columns.
        selection: the winners, when the values were validated (they had to be computed for it).
    """

    order: str
    geometry: DcpGeometry
    rows: int
    kloc: int
    k: int
    n_req: int
    n_blocks: int
    selection: Selection | None = None


@dataclass(frozen=True)
class Selection:
    """This rank's winners of the global order, before compaction (int64, ``[T, min(k, W*K)]``).

    Attributes:
        owned: bool: the ``j``-th winner of row ``t`` (in selection order) is valid and owned by this rank.
        local: its local index on this rank (meaningful where ``owned``; may be ``-1`` in ``rank_local`` order
            when ``own_ids`` has no index there — out of contract).
        slot: int64 slot where owned (``-1`` elsewhere), :data:`SENTINEL_SLOT` where poisoned, and the raw
            (unsaturated) value where it exceeds int32.
        block_ok: owned and its request, local index and block all exist.
    """

    owned: torch.Tensor
    local: torch.Tensor
    slot: torch.Tensor
    block_ok: torch.Tensor


def check_select_to_slots_inputs(
    gathered: object,
    req_of_token: object,
    block_table: object,
    geometry: object,
    k: object,
    *,
    order: object = "global_id",
    own_ids: object = None,
    out_slots: object = None,
    out_counts: object = None,
    validate: object = True,
) -> SelectToSlotsInputs:
    """Every check of :func:`select_to_slots`, shared with its kernels (same inputs, same messages).

    Always (free, no host read): types, dtypes, ranks, shapes, devices, the geometry and the ``out_`` buffers.
    When ``validate``: the values (host syncs), in this order — ``gathered``'s ids (``global_id``) or
    ``own_ids`` (``rank_local``), ``req_of_token``, then the winners' blocks and slots, for which the selection
    is computed (returned in ``selection`` so that the caller need not compute it again).
    """
    validate = check_bool(validate, "validate")
    if not isinstance(geometry, DcpGeometry):
        raise TypeError(f"geometry must be a dcp_ref.geometry.DcpGeometry, got {type(geometry).__name__}")
    if not isinstance(order, str) or order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    k = check_int_scalar(k, "k", min_value=1)
    w = geometry.world_size
    if order == "global_id":
        check_tensor(gathered, "gathered", dtypes=(torch.float32,), ndim=4)
        assert isinstance(gathered, torch.Tensor)
        if gathered.shape[-1] != 2:
            raise ValueError(
                "gathered must end in a (score, id) pair dimension of size 2 for order='global_id', "
                f"got shape {tuple(gathered.shape)}"
            )
        if own_ids is not None:
            raise ValueError(
                "own_ids must be None for order='global_id': the global ids travel with the scores in gathered"
            )
    else:
        check_tensor(gathered, "gathered", dtypes=(torch.float32,), ndim=3)
        assert isinstance(gathered, torch.Tensor)
    if gathered.shape[0] != w:
        raise ValueError(
            f"gathered must hold world_size={w} ranks in dim 0 (the all-gather of geometry's group), "
            f"got shape {tuple(gathered.shape)}"
        )
    rows, kloc = gathered.shape[1], gathered.shape[2]
    dev = gathered.device
    if order == "rank_local":
        if own_ids is None:
            raise ValueError(
                "own_ids is required for order='rank_local': int32 [T, K], this rank's local indices of its "
                "own candidates (ascending, -1 for padding)"
            )
        check_tensor(own_ids, "own_ids", dtypes=(torch.int32,), ndim=2, device=dev)
        assert isinstance(own_ids, torch.Tensor)
        if tuple(own_ids.shape) != (rows, kloc):
            raise ValueError(
                f"own_ids must have shape [T, K]=[{rows}, {kloc}] (gathered's rows and candidates per rank), "
                f"got {tuple(own_ids.shape)}"
            )
    check_tensor(block_table, "block_table", dtypes=INT_DTYPES, ndim=2, device=dev)
    assert isinstance(block_table, torch.Tensor)
    n_req, n_blocks = block_table.shape
    if req_of_token is None:
        if rows > n_req:
            raise ValueError(
                f"req_of_token=None needs one block_table row per token: gathered has {rows} rows, "
                f"block_table has {n_req}"
            )
    else:
        check_tensor(req_of_token, "req_of_token", dtypes=INT_DTYPES, ndim=1, device=dev)
        assert isinstance(req_of_token, torch.Tensor)
        if req_of_token.shape[0] != rows:
            raise ValueError(
                f"req_of_token must have shape [T]=[{rows}] (one entry per row of gathered), "
                f"got {tuple(req_of_token.shape)}"
            )
    if out_slots is not None:
        check_out(out_slots, "out_slots", (rows, k), torch.int32, dev)
    if out_counts is not None:
        check_out(out_counts, "out_counts", (rows,), torch.int32, dev)
    check_no_aliases(
        {"out_slots": out_slots, "out_counts": out_counts},
        dict(gathered=gathered, req_of_token=req_of_token, block_table=block_table, own_ids=own_ids),
    )
    spec = SelectToSlotsInputs(order, geometry, rows, kloc, k, n_req, n_blocks)
    if not validate or rows == 0:
        return spec
    # ---- values (host syncs) ----
    check_values_readable(gathered, "gathered")
    check_values_readable(block_table, "block_table")
    if req_of_token is not None:
        check_values_readable(req_of_token, "req_of_token")
    if order == "global_id":
        check_candidate_ids(gathered[..., 1], "gathered")
        _check_unique_ids(gathered)
    else:
        assert isinstance(own_ids, torch.Tensor)
        check_values_readable(own_ids, "own_ids")
        _check_own_ids(own_ids, gathered[geometry.rank], geometry.rank)
    if req_of_token is not None:
        req = req_of_token.long()
        if bool(((req < 0) | (req >= n_req)).any()):
            raise ValueError(
                f"req_of_token values must be in [0, {n_req}) (rows of block_table), "
                f"got min {int(req.min())}, max {int(req.max())}"
            )
    sel = select_winners(gathered, req_of_token, block_table, geometry, k, order=order, own_ids=own_ids)  # type: ignore[arg-type]
    missing = sel.owned & ~sel.block_ok
    if bool(missing.any()):
        t, j = (int(v) for v in missing.nonzero()[0])
        b = t if req_of_token is None else int(req_of_token[t])
        loc = int(sel.local[t, j])
        bs = geometry.block_size
        where = (
            f"block index {loc // bs} is past its {n_blocks} columns"
            if loc // bs >= n_blocks
            else f"block_table[{b}, {loc // bs}] is {int(block_table[b, loc // bs])}"
        )
        raise ValueError(
            f"block_table has no block for a selected key of this rank: row {t} (request {b}) selects local index "
            f"{loc}, but {where} (every key the indexer scored must have a block)"
        )
    if sel.owned.any():
        top = int(torch.where(sel.owned, sel.slot, -1).max())
        if top > _INT32_MAX:
            bs = geometry.block_size
            raise ValueError(
                f"block_table holds a block id whose slots exceed int32 (max slot {top}); "
                f"block ids must be < {(_INT32_MAX + 1) // bs} for block_size={bs}"
            )
    return SelectToSlotsInputs(order, geometry, rows, kloc, k, n_req, n_blocks, sel)


def _check_unique_ids(gathered: torch.Tensor) -> None:
    """A selectable global id (id >= 0, score not NaN) appears at most once per row, across all ranks."""
    w, rows, kloc, _ = gathered.shape
    c = gathered.permute(1, 0, 2, 3).reshape(rows, w * kloc, 2)
    ids = c[..., 1]
    selectable = (ids >= 0) & ~torch.isnan(c[..., 0])
    key = torch.where(selectable, ids.to(torch.int64), torch.full_like(ids, -1, dtype=torch.int64))
    # Non-selectable entries get distinct negative keys so that they never compare equal.
    fill = -2 - torch.arange(w * kloc, device=ids.device).expand(rows, w * kloc)
    key = torch.where(selectable, key, fill)
    s = torch.sort(key, dim=1).values
    dup = s[:, 1:] == s[:, :-1]
    if bool(dup.any()):
        t, j = (int(v) for v in dup.nonzero()[0])
        raise ValueError(
            f"gathered holds global id {int(s[t, j])} twice in row {t}: global ids must be unique across ranks "
            "(a duplicated key would be attended twice)"
        )


def _check_own_ids(own_ids: torch.Tensor, own_scores: torch.Tensor, rank: int) -> None:
    """``own_ids``: ``-1`` or ``>= 0``; the valid ones strictly ascending per row; ``>= 0`` under every real score."""
    ids = own_ids.long()
    if bool((ids < -1).any()):
        raise ValueError(f"own_ids entries must be -1 (padding) or a local index >= 0, found {int(ids.min())}")
    valid = ids >= 0
    # The previous valid entry of each position (a running max works: the valid ones must ascend).
    prev = torch.cummax(torch.where(valid, ids, torch.full_like(ids, -1)), dim=1).values
    prev = torch.cat([torch.full_like(prev[:, :1], -1), prev[:, :-1]], dim=1)
    bad = valid & (ids <= prev)
    if bool(bad.any()):
        t, c = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"own_ids must list each row's local indices in strictly ascending order (the order is the tie-break), "
            f"row {t} has {int(ids[t, c])} at position {c} after {int(prev[t, c])}"
        )
    unnamed = ~valid & ~torch.isnan(own_scores)
    if bool(unnamed.any()):
        t, c = (int(v) for v in unnamed.nonzero()[0])
        raise ValueError(
            f"own_ids is -1 at row {t}, position {c}, but gathered[{rank}, {t}, {c}] holds a score "
            f"({float(own_scores[t, c])}): a padding candidate must have a NaN score"
        )


def select_winners(
    gathered: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    k: int,
    *,
    order: str = "global_id",
    own_ids: torch.Tensor | None = None,
) -> Selection:
    """The global winners in selection order and their slots on this rank (no checks, no host read).

    Inputs as :func:`select_to_slots` (assumed checked). The selection is :func:`dcp_ref.topk.stable_key`'s
    order over ``(score, tie-break)``: the global id (``global_id``) or the position ``w*K + c`` in the
    gathered row (``rank_local``) — the same int64 keys either way, so one exact ``torch.topk`` serves both.
    """
    g = geometry
    w, rows, kloc = gathered.shape[0], gathered.shape[1], gathered.shape[2]
    n = w * kloc
    kk = min(k, n)
    dev = gathered.device
    if order == "global_id":
        c = gathered.permute(1, 0, 2, 3).reshape(rows, n, 2)
        scores, tie = c[..., 0], c[..., 1]
    else:
        scores = gathered.permute(1, 0, 2).reshape(rows, n)
        tie = torch.arange(n, device=dev, dtype=torch.int64).expand(rows, n)
    key = stable_key(scores, tie)
    # torch.topk on int64 keys is exact; distinct candidates have distinct keys (positions always; global
    # ids by contract), so the result does not depend on how torch breaks ties.
    top, pos = torch.topk(key, kk, dim=1, largest=True, sorted=True)
    valid = top != INVALID_KEY
    if order == "global_id":
        gid = torch.gather(tie, 1, pos)
        gid = torch.where(torch.isnan(gid), torch.full_like(gid, -1), gid).to(torch.int64).clamp(min=0)
        owned = valid & ((gid // g.interleave) % g.world_size == g.rank)
        local = (gid // g.stripe) * g.interleave + gid % g.interleave
    else:
        assert own_ids is not None
        c_own = pos - g.rank * kloc
        owned = valid & (c_own >= 0) & (c_own < kloc)
        idx = torch.where(owned, c_own, torch.zeros_like(c_own))
        local = torch.gather(own_ids.long(), 1, idx) if kloc else torch.zeros_like(idx)
    slot, block_ok = _slots(local, owned, req_of_token, block_table, g.block_size)
    return Selection(owned, local, slot, block_ok)


def _slots(
    local: torch.Tensor,
    owned: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    bs: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 slots of the owned winners (``-1`` elsewhere, :data:`SENTINEL_SLOT` where a block is missing)."""
    rows = local.shape[0]
    n_req, n_blocks = block_table.shape
    req = torch.arange(rows, device=local.device) if req_of_token is None else req_of_token.long()
    req_ok = (req >= 0) & (req < n_req)
    blk_idx = torch.div(local, bs, rounding_mode="floor")
    ok = owned & req_ok.unsqueeze(1) & (local >= 0) & (blk_idx < n_blocks)
    if n_req and n_blocks and local.numel():
        r = torch.where(req_ok, req, 0).unsqueeze(1).expand_as(local)
        block = block_table.long()[r, torch.where(ok, blk_idx, 0)]
    else:
        block = torch.full_like(local, -1)
    ok &= block >= 0
    slot = torch.where(ok, block * bs + local % bs, torch.full_like(local, SENTINEL_SLOT))
    return torch.where(owned, slot, torch.full_like(slot, -1)), ok


def select_to_slots(
    gathered: torch.Tensor,
    req_of_token: torch.Tensor | None,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    k: int,
    *,
    order: str = "global_id",
    own_ids: torch.Tensor | None = None,
    out_slots: torch.Tensor | None = None,
    out_counts: torch.Tensor | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The global top-``k`` of the gathered candidates, as *this* rank's physical KV slots (module docstring).

    Args:
        gathered: the all-gathered candidates, rank 0's first. ``order="global_id"``: float32
            ``[W, T, K, 2]`` ``(score, float(global id))`` pairs (:func:`dcp_ref.topk.pack_candidates`; an
            invalid candidate has a NaN score or a negative id). ``order="rank_local"``: float32 ``[W, T, K]``
            scores, each rank's candidates in ascending local-index order, NaN for padding.
        req_of_token: int32/int64 ``[T]``: the request (row of ``block_table``) of each query token, in
            ``[0, B)``; ``None`` means token ``t`` belongs to request ``t`` (needs ``T <= B``).
        block_table: int32/int64 ``[B, M]``: this rank's physical block of each request's local block ``j``
            (local indices ``[j*bs, (j+1)*bs)``); negative = no block.
        geometry: this rank's :class:`~dcp_ref.geometry.DcpGeometry` (``W`` must be ``gathered.shape[0]``).
        k: winners of the global order, ``k >= 1`` (``k > W*K`` is fine).
        order: ``"global_id"`` or ``"rank_local"`` (the total order and the wire format; module docstring).
        own_ids: ``rank_local`` only (required there): int32 ``[T, K]``, this rank's local index of each of its
            own candidates (``gathered[geometry.rank]``), strictly ascending per row, ``-1`` for padding.
        out_slots, out_counts: optional int32 ``[T, k]`` / ``[T]`` buffers, written and returned.
        validate: check values on the host (syncs). ``False``: no host read; out-of-contract winners of this
            rank get :data:`SENTINEL_SLOT` (module docstring), which poisons their row in the attention stage.
    Returns:
        ``(slots, counts)``: int32 ``[T, k]`` — this rank's winners' slots first, in selection order, ``-1``
        after — and int32 ``[T]``, how many. A row with no winner here: count 0, all ``-1``. The union over
        the ranks of ``slots[t, :counts[t]]`` is the single-device top-``k`` of row ``t`` mapped to slots.
    Raises:
        TypeError / ValueError whose message starts with the argument's name (module docstring).
    """
    spec = check_select_to_slots_inputs(
        gathered,
        req_of_token,
        block_table,
        geometry,
        k,
        order=order,
        own_ids=own_ids,
        out_slots=out_slots,
        out_counts=out_counts,
        validate=validate,
    )
    rows, k = spec.rows, spec.k
    dev = gathered.device
    sel = spec.selection
    if sel is None:
        sel = select_winners(gathered, req_of_token, block_table, geometry, k, order=order, own_ids=own_ids)
    owned = sel.owned
    # Compaction in selection order: a stable sort on "not owned" keeps the winners' order.
    order_idx = torch.sort((~owned).to(torch.int8), dim=1, stable=True).indices
    compact = torch.gather(sel.slot, 1, order_idx).clamp(max=SENTINEL_SLOT).to(torch.int32)
    counts = owned.sum(dim=1, dtype=torch.int32)
    slots = torch.full((rows, k), -1, dtype=torch.int32, device=dev) if out_slots is None else out_slots
    if out_slots is not None:
        slots.fill_(-1)
    kk = compact.shape[1]
    if kk:
        head = torch.arange(kk, device=dev) < counts.unsqueeze(1)
        slots[:, :kk] = torch.where(head, compact, torch.full_like(compact, -1))
    if out_counts is None:
        return slots, counts
    out_counts.copy_(counts)
    return slots, out_counts


def reference_select_to_slots(
    gathered: torch.Tensor,
    own_ids: torch.Tensor | None,
    req_of_token: torch.Tensor,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    k: int,
    *,
    order: str = "global_id",
    out_slots: torch.Tensor | None = None,
    out_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stage-protocol form of :func:`select_to_slots` (``validate=False``: no host read, capture-safe).

    ``own_ids`` is ``None`` for ``order="global_id"``. Writes into ``out_slots`` / ``out_counts`` when given.
    """
    return select_to_slots(
        gathered,
        req_of_token,
        block_table,
        geometry,
        k,
        order=order,
        own_ids=own_ids,
        out_slots=out_slots,
        out_counts=out_counts,
        validate=False,
    )


reference_select_to_slots.impl_name = "torch"  # type: ignore[attr-defined]  # how the step's trace names it


# ---------------------------------------------------------------------------------------------
# The two orders, side by side (for the chapter).
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OrderDifference:
    """A case where the two exact orders select different sets: a tie at the threshold (W = 2, I = 1, k = 2).

    Global positions ``0..3`` have index scores ``0.9, 0.5, 0.5, 0.1``; rank ``p % 2`` owns position ``p`` at
    local index ``p // 2``. Position 0 wins in both orders; the second winner is one of the tied 0.5s:
    ``global_id`` takes position 1 (lower global id, on rank 1), ``rank_local`` takes position 2 (lower rank,
    0). Each rank's local top-2 is *both* of its keys, so the union of local top-Ks is all four positions:
    neither answer.

    Attributes:
        scores: float32 ``[1, 4]`` global index scores (one query token).
        world_size, k: 2 and 2 (``K = k``).
        gathered_pairs: float32 ``[2, 1, 2, 2]`` the ``global_id`` exchange.
        gathered_scores: float32 ``[2, 1, 2]`` the ``rank_local`` exchange.
        own_ids: int32 ``[1, 2]`` per rank (``own_ids[r]``): local indices ``[0, 1]`` on both ranks.
        winners_global_id, winners_rank_local: the global positions each order selects.
        union_of_local_topk: what attending to every rank's local top-K would select.
    """

    scores: torch.Tensor
    world_size: int
    k: int
    gathered_pairs: torch.Tensor
    gathered_scores: torch.Tensor
    own_ids: tuple[torch.Tensor, ...]
    winners_global_id: tuple[int, ...]
    winners_rank_local: tuple[int, ...]
    union_of_local_topk: tuple[int, ...]


def order_difference_example() -> OrderDifference:
    """Both orders are exact, and they differ exactly on threshold ties (:class:`OrderDifference`).

    **Why each is exact.** Let ``<`` be a total order on all keys that, restricted to one rank, ranks its keys
    the way that rank's local top-``K`` ranks them (score descending, then local index ascending: for
    ``global_id`` because the global id grows with the local index on one rank; for ``rank_local`` because
    the rank is fixed). A global winner is beaten by at most ``k-1`` keys overall, hence by at most ``k-1``
    keys of its owner, so it is in its owner's local top-``K`` for any ``K >= k``: the ``W*K`` exchanged
    candidates contain every global winner, and selecting the top-``k`` among them under ``<`` gives the
    top-``k`` of *all* keys. ``global_id`` sorts ties by global id; ``rank_local`` by ``(rank, local index)``,
    which is the candidate's position ``w*K + c`` because each rank lists its candidates in ascending
    local-index order — so the ids need not travel.

    **Why they differ only at ties.** Both orders sort by score first: every key scoring strictly above the
    ``k``-th score wins in both, and both take the same *number* of keys at the ``k``-th score; only *which*
    tied keys fill the remaining places depends on the tie-break. Both answers are exact top-``k`` sets of the
    scores; a step must use one order on every rank.

    **Why neither is the union of local top-Ks.** A rank cannot know the global threshold from its own keys:
    here each rank's local top-2 is both of its keys, and the union (all four) contains keys that lose to
    another rank's (see also :func:`dcp_ref.topk.union_counterexample`).
    """
    scores = torch.tensor([[0.9, 0.5, 0.5, 0.1]], dtype=torch.float32)
    w, k = 2, 2
    pos = torch.arange(4)
    pairs, sc, own = [], [], []
    for r in range(w):
        mine = pos[pos % w == r]  # ascending local index = ascending global position on one rank
        s = scores[:, mine]
        pairs.append(torch.stack([s, mine.to(torch.float32).expand_as(s)], -1))
        sc.append(s)
        own.append((mine // w).to(torch.int32).unsqueeze(0))
    return OrderDifference(
        scores=scores,
        world_size=w,
        k=k,
        gathered_pairs=torch.stack(pairs),
        gathered_scores=torch.stack(sc),
        own_ids=tuple(own),
        winners_global_id=(0, 1),
        winners_rank_local=(0, 2),
        union_of_local_topk=(0, 1, 2, 3),
    )
