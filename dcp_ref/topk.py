"""The pack + select stages — candidate packing and the *stable* global top-K across DCP ranks.

Each of the ``W`` ranks scored only its own keys and kept its local top-``K`` (the indexer stage). To pick
the request's global top-``k`` every rank

1. packs its candidates as ``(score, global id)`` pairs (:func:`pack_candidates`),
2. all-gathers them in rank order (``[W, rows, K, 2]``), and
3. runs the same deterministic selection over the ``W*K`` candidates (:func:`stable_topk`).

Every rank must end up with the *identical* set (each one then attends to the chosen keys it
owns), so the selection is a total order — :func:`stable_key`:

* higher score first; equal scores → lower global id first;
* invalid candidates (id ``-1``, or a NaN score) are smaller than everything and never chosen;
  rows with fewer than ``k`` valid candidates are padded with ``-1``;
* ``-0.0`` and ``+0.0`` are the *same* score (IEEE says they are equal; the id breaks the tie).

Exactness (tested as a property): a key in the global top-``k`` is, on its owner, beaten by at most
``k-1`` local keys, so it is in its owner's local top-``K`` for any ``K >= k``. Hence the union of
the local top-``K`` lists contains the global top-``k``, and selecting from the ``W*K`` exchanged
candidates gives exactly what gathering *all* logits would. Attending to the whole union instead
is wrong: see :func:`union_counterexample`.

Global ids travel as float32 next to the score (one ``all_gather`` of one tensor), so they must
be exactly representable: ``id < 2**24`` (checked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .contracts import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_bool,
    check_int_scalar,
    check_tensor,
    check_values_readable,
    check_world,
    host_values,
    max_global_id_bound,
)
from .geometry import DcpGeometry, check_geometry
from .group import Group, SingleGroup
from .ownership import global_to_local, owner_rank

__all__ = [
    "MAX_EXACT_ID",
    "INVALID_KEY",
    "pack_candidates",
    "stable_key",
    "check_candidate_ids",
    "stable_topk",
    "merge_topk_global",
    "local_topk_by_owner",
    "global_topk_all_logits",
    "unsigned_key",
    "RadixPass",
    "radix_select_trace",
    "UnionCounterexample",
    "union_counterexample",
    "sparse_attention_reference",
]

#: Global ids must be < 2**24 so that float32 (24-bit significand) holds them exactly.
MAX_EXACT_ID = 1 << 24
#: The key of an invalid candidate: the smallest int64.
INVALID_KEY = -(1 << 63)
_U32 = 0xFFFFFFFF


def pack_candidates(
    logits: torch.Tensor,
    local_topk: torch.Tensor,
    geometry: DcpGeometry,
    row_starts: torch.Tensor | None = None,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """Pack one rank's local top-K as ``(score, global id)`` pairs, ready for the all-gather.

    Args:
        logits: float16/bfloat16/float32/float64 ``[rows, cols]`` — this rank's indexer scores;
            column ``row_starts[r] + j`` holds local key ``j`` of row ``r``.
        local_topk: int32/int64 ``[rows, K]`` local key indices, ``-1`` for an empty slot.
        geometry: this rank's :class:`~dcp_ref.geometry.DcpGeometry` (its world size, rank and interleave
            give the ownership layout; the block size is not used); anything else is a ``TypeError``.
        row_starts: optional int32/int64 ``[rows]`` tensor of column offsets (prefill chunks pack
            several requests' keys into one logits row space); ``None`` means 0.
        validate: check index values on the host (one sync). ``False``: no host read; on the
            device ``row_starts`` is clamped to ``[0, cols]`` and an entry outside
            ``[0, cols - row_start)`` is packed as invalid (never read out of bounds).
    Returns:
        float32 ``[rows, K, 2]``: ``[..., 0]`` the score (as float32), ``[..., 1]`` the global id
        ``local_to_global(j, W, rank, I)``. Empty slots get ``(-inf, -1)``. A NaN score is packed
        as is (the selection treats it as invalid).
    Raises:
        ValueError: (validated) a local index outside ``[-1, cols - row_start)``, a row start
            outside ``[0, cols]``; always: a global id that may reach ``2**24`` (not exactly
            representable in float32) — by value when validated, from the shape of ``logits``
            (``cols`` local keys) with ``validate=False``; wrong shapes / devices / geometry.
        TypeError: wrong dtypes, a non-tensor ``row_starts``.
    """
    g = check_pack_inputs(logits, local_topk, geometry, row_starts, validate)
    w, r, i = g.world_size, g.rank, g.interleave
    rows, cols = logits.shape
    starts = torch.zeros(rows, dtype=torch.int64, device=logits.device) if row_starts is None else row_starts.long()
    starts = starts.clamp(min=0, max=cols)  # a no-op for validated values
    idx = local_topk.long()
    col = starts.unsqueeze(1) + idx
    # The unvalidated path packs anything else as invalid (compared without the sum: no overflow).
    valid = (idx >= 0) & (idx < (cols - starts).unsqueeze(1))
    li = torch.where(valid, idx, 0)
    gid = torch.div(li, i, rounding_mode="floor") * (w * i) + r * i + li % i  # local_to_global, no checks
    if cols:
        score = torch.gather(logits, 1, torch.where(valid, col, 0)).to(torch.float32)
    else:  # a rank that owns no key yet: every entry is invalid
        score = torch.zeros(idx.shape, dtype=torch.float32, device=logits.device)
    out = torch.empty((rows, idx.shape[1], 2), dtype=torch.float32, device=logits.device)
    out[..., 0] = torch.where(valid, score, torch.full_like(score, float("-inf")))
    out[..., 1] = torch.where(valid, gid, -1).to(torch.float32)
    return out


def check_pack_inputs(
    logits: object,
    local_topk: object,
    geometry: object,
    row_starts: object,
    validate: object,
) -> DcpGeometry:
    """Every check of :func:`pack_candidates` (shared with the Triton kernel: same inputs, same errors).

    Shapes, dtypes, devices and the geometry always; values (one host sync) when ``validate``.
    Returns the geometry.
    """
    validate = check_bool(validate, "validate")
    g = check_geometry(geometry)
    w, r, i = g.world_size, g.rank, g.interleave
    check_tensor(logits, "logits", dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor(local_topk, "local_topk", dtypes=INT_DTYPES, ndim=2)
    assert isinstance(logits, torch.Tensor) and isinstance(local_topk, torch.Tensor)
    if local_topk.shape[0] != logits.shape[0]:
        raise ValueError(
            f"local_topk must have logits' row count {logits.shape[0]}, got shape {tuple(local_topk.shape)}"
        )
    if local_topk.device != logits.device:
        raise ValueError(f"local_topk must be on logits' device {logits.device}, got {local_topk.device}")
    rows, cols = logits.shape
    if row_starts is not None:
        check_tensor(row_starts, "row_starts", dtypes=INT_DTYPES, ndim=1, device=logits.device)
        assert isinstance(row_starts, torch.Tensor)
        if tuple(row_starts.shape) != (rows,):
            raise ValueError(f"row_starts must have shape ({rows},), got {tuple(row_starts.shape)}")
    bound = max_global_id_bound(cols, w, i)
    if not validate:
        if bound > MAX_EXACT_ID:
            raise ValueError(
                f"logits has {cols} columns: global ids could reach {bound - 1} >= 2**24, not exactly "
                "representable in float32; with validate=False the shapes must rule that out "
                "(validate=True checks the actual ids)"
            )
        return g
    if not local_topk.numel():
        return g
    idx = local_topk.long()
    check_values_readable(idx, "local_topk")
    starts = torch.zeros(rows, dtype=torch.int64, device=logits.device) if row_starts is None else row_starts.long()
    check_values_readable(starts, "row_starts")
    # Every value condition as one device reduction, read back with one transfer.
    valid = idx >= 0
    n_bad_start, n_below, n_past, g_max = host_values(
        ((starts < 0) | (starts > cols)).sum(),
        (idx < -1).sum(),
        (valid & (starts.unsqueeze(1) + idx >= cols)).sum(),
        idx.max(),
    )
    if n_bad_start:
        raise ValueError(f"row_starts must lie in [0, cols={cols}]")
    if n_below:
        raise ValueError(f"local_topk entries must be -1 or >= 0, found {int(idx.min())}")
    if n_past:
        raise ValueError(f"local_topk + row_starts must be < logits.shape[1]={cols} for valid entries")
    if bound > MAX_EXACT_ID:  # only then can an id be too large: check the largest one
        if g_max >= 0:
            gid = (g_max // i) * (w * i) + r * i + g_max % i
            if gid >= MAX_EXACT_ID:
                raise ValueError(
                    f"local_topk holds local index {g_max}: its global id {gid} is >= 2**24, not exactly "
                    f"representable in float32; the (score, id) packing needs ids < 16777216 ({g!r})"
                )
    return g


def stable_key(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The int64 key whose descending order *is* the selection order.

    ``key = hi * 2**32 + lo`` with

    * ``hi`` — the float32 score's bits made order-preserving as a signed int32: non-negative
      floats keep their bits, negative floats get their 31 magnitude bits flipped (so that a more
      negative float gets a smaller int). ``-0.0`` is first turned into ``+0.0``.
    * ``lo = 0xFFFFFFFF - id`` — the id bit-inverted, so a *lower* id gives a *larger* key.
    * invalid (``id < 0`` or NaN score) → :data:`INVALID_KEY` (``-2**63``), below every valid key.

    The GPU kernel uses the unsigned twin ``key ^ 2**63`` (the usual "flip the sign bit of
    positives, all bits of negatives" trick); the two orders agree.

    Args:
        scores: float32 tensor (any shape; other float dtypes are converted to float32 first).
        ids: integer or float tensor of the same shape and device. Keys are exact for integer ids in
            ``[0, 2**32)`` (packed float ids: ``[0, 2**24)``, :func:`check_candidate_ids`); negative
            ids and NaN are invalid. Values are not read on the host (this runs inside the stages'
            hot paths): the callers validate their ids.
    Returns:
        int64 tensor of the same shape.
    """
    check_tensor(scores, "scores", dtypes=FLOAT_DTYPES)
    check_tensor(ids, "ids", dtypes=INT_DTYPES + FLOAT_DTYPES, device=scores.device)
    if ids.shape != scores.shape:
        raise ValueError(f"ids must have the shape of scores {tuple(scores.shape)}, got {tuple(ids.shape)}")
    s = scores.to(torch.float32)
    s = torch.where(s == 0, torch.zeros_like(s), s)  # -0.0 == +0.0: same key, id breaks the tie
    bits = s.view(torch.int32).to(torch.int64)
    hi = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    if ids.is_floating_point():  # packed ids travel as float32; a NaN id is invalid too
        idl = torch.where(torch.isnan(ids), torch.full_like(ids, -1), ids).to(torch.int64)
    else:
        idl = ids.to(torch.int64)
    lo = _U32 - idl.clamp(min=0)
    key = hi * (1 << 32) + lo
    invalid = (idl < 0) | torch.isnan(s)
    return torch.where(invalid, torch.full_like(key, INVALID_KEY), key)


def _as_rows(gathered: torch.Tensor) -> torch.Tensor:
    """``[rows, N, 2]`` view of ``[rows, N, 2]`` or all-gathered ``[W, rows, K, 2]`` candidates."""
    check_tensor(gathered, "gathered", dtypes=(torch.float32,), ndim=(3, 4))
    if gathered.shape[-1] != 2:
        raise ValueError(
            f"gathered must end in a (score, id) pair dimension of size 2, got shape {tuple(gathered.shape)}"
        )
    if gathered.ndim == 4:
        w, rows, k, _ = gathered.shape
        # Candidate order inside a row: rank 0's K, then rank 1's, ... (the all-gather order).
        return gathered.permute(1, 0, 2, 3).reshape(rows, w * k, 2)
    return gathered


def _candidate_rows(ids: torch.Tensor) -> torch.Tensor:
    """Candidate ids as ``[rows, N]``: ``[W, rows, K]`` (the all-gather's ids) or ``[rows, N]`` (one
    row per query token), a 1-D tensor as one row."""
    if ids.ndim == 3:
        return ids.permute(1, 0, 2).reshape(ids.shape[1], -1)
    if ids.ndim == 2:
        return ids
    return ids.reshape(1, -1)


def check_candidate_ids(ids: torch.Tensor, name: str = "gathered", *, duplicates: bool = True) -> None:
    """Valid ids are integers in ``[0, 2**24)``; ``-1`` (or NaN) marks an invalid candidate; and (with
    ``duplicates``) no valid id appears twice in one row — ranks own disjoint keys, so a repeated id
    means two ranks packed the same key (a geometry mismatch) or one rank packed it twice.

    ``ids``: the ``[..., 1]`` part of the candidates — ``[W, rows, K]``, ``[rows, N]`` or 1-D (one
    row). One device reduction and one host read (the error path reads more, to name the culprit).
    Raises ``ValueError`` naming ``name``.
    """
    check_values_readable(ids, name)
    if not ids.numel():
        return
    ok = torch.isnan(ids) | (ids == -1) | ((ids >= 0) & (ids < MAX_EXACT_ID) & (ids == torch.floor(ids)))
    rows = _candidate_rows(ids)
    stats = [(~ok).sum()]
    if duplicates and rows.shape[1] > 1:
        stats.append(_duplicate_count(rows, _candidate_rows(ok)))
    n_bad, *n_dup = host_values(*stats)
    if n_bad:
        bad = ids[~ok][0].item()
        raise ValueError(f"{name}[..., 1] (ids) must be -1 or an integer in [0, 2**24), found {bad}")
    if n_dup and n_dup[0]:
        t, x = _first_duplicate(rows, _candidate_rows(ok))
        raise ValueError(
            f"{name}[..., 1] (ids) holds global id {x} twice in row {t}: ranks own disjoint keys, so two ranks "
            "packed the same key (they disagree on the geometry) or one rank packed it twice"
        )


def _duplicate_sorted(rows: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Each row's valid ids sorted, invalid entries replaced by distinct negative values first."""
    valid = ok & (rows >= 0)
    filler = -2.0 - torch.arange(rows.shape[1], device=rows.device, dtype=torch.float64)
    return torch.sort(torch.where(valid, rows.double(), filler), dim=1).values


def _duplicate_count(rows: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    srt = _duplicate_sorted(rows, ok)
    return ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).sum()


def _first_duplicate(rows: torch.Tensor, ok: torch.Tensor) -> tuple[int, int]:
    srt = _duplicate_sorted(rows, ok)
    dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
    t, j = (int(v) for v in dup.nonzero()[0])
    return t, int(srt[t, j + 1])


def stable_topk(gathered: torch.Tensor, k: int, sorted: bool = False, *, validate: bool = True) -> torch.Tensor:  # noqa: A002
    """Exact, deterministic top-``k`` of packed candidates (the reference; CPU or GPU tensors).

    Args:
        gathered: float32 ``[rows, N, 2]`` candidates, or the all-gather output
            ``[W, rows, K, 2]`` (then ``N = W*K``, rank 0's candidates first).
        k: how many to select, ``k >= 1`` (``k > N`` is fine: the rest is ``-1``).
        sorted: return the ids in key order (score descending, then id ascending). The
            reference always does; kernels may return another order when ``sorted=False``.
        validate: check the id values on the host (one device reduction, one read): integers in
            ``[0, 2**24)`` or ``-1``/NaN, and no valid id twice in a row (:func:`check_candidate_ids`).
            ``False``: no host read; an id that is not ``-1`` / NaN / an integer in ``[0, 2**24)``
            gives an unspecified (but in-bounds) selection, and a repeated ``(score, id)`` pair may be
            selected twice — negative ids and NaN scores are always invalid.
    Returns:
        int32 ``[rows, k]`` global ids; ``-1`` after the last valid one.

    Contract: a candidate is invalid when its id is ``-1`` (any negative) or NaN, or its score
    is NaN; invalid candidates are never selected. A row with no valid candidate is all ``-1``.
    Valid ids are distinct within a row (ranks own disjoint keys): checked when validating.
    Raises: ``TypeError`` (gathered not float32, k not an int), ``ValueError`` (rank / last
    dimension != 2, ``k < 1``, and — validated — a bad or repeated id, naming ``gathered``).
    """
    validate = check_bool(validate, "validate")
    c = _as_rows(gathered)
    k = check_int_scalar(k, "k", min_value=1)
    check_bool(sorted, "sorted")
    if validate:
        check_candidate_ids(c[..., 1])
    rows, n, _ = c.shape
    out = torch.full((rows, k), -1, dtype=torch.int32, device=c.device)
    if n == 0 or rows == 0:
        return out
    key = stable_key(c[..., 0], c[..., 1])
    kk = min(k, n)
    # torch.topk on int64 keys is exact; keys of distinct valid candidates are distinct, so the
    # result does not depend on how torch breaks ties (duplicate ids give identical outputs).
    top, pos = torch.topk(key, kk, dim=1, largest=True, sorted=True)
    ids = torch.gather(c[..., 1], 1, pos).to(torch.int32)
    out[:, :kk] = torch.where(top == INVALID_KEY, torch.full_like(ids, -1), ids)
    return out


def merge_topk_global(
    group: Group | None,
    logits: torch.Tensor,
    local_topk: torch.Tensor,
    k: int,
    interleave: int = 1,
    row_starts: torch.Tensor | None = None,
    sorted: bool = False,  # noqa: A002
    *,
    validate: bool = True,
) -> torch.Tensor:
    """One rank's pack + select: pack → ``all_gather`` over ``group`` → :func:`stable_topk`.

    Every rank of the group gets the identical result. ``W = 1`` (``group`` ``None`` or a
    :class:`~dcp_ref.group.SingleGroup`) runs the same pack and selection as any ``W``: there is
    no shortcut that would skip their checks (or pass a NaN-scored or ``-1``-first row through).

    Args:
        group: a :class:`~dcp_ref.group.Group` (``SimulatedWorld`` rank, torch.distributed, ...).
        logits, local_topk, interleave, row_starts, validate: as in :func:`pack_candidates`
            (``validate`` also goes to :func:`stable_topk`).
        k: global top-k size.  sorted: as in :func:`stable_topk`.
    Returns:
        int32 ``[rows, k]`` global ids, ``-1`` padded.
    """
    group = SingleGroup() if group is None else group
    if not isinstance(group, Group):
        raise TypeError(
            f"group must be a dcp_ref.group.Group (rank, world_size, all_gather) or None, got {type(group).__name__}"
        )
    k = check_int_scalar(k, "k", min_value=1)
    i = check_int_scalar(interleave, "interleave", min_value=1)
    # The group gives the world size and the rank; the pack needs no block size (any multiple of I will do).
    geometry = DcpGeometry(group.world_size, group.rank, i, block_size=i)
    packed = pack_candidates(logits, local_topk, geometry, row_starts, validate=validate)
    gathered = group.all_gather(packed)  # [W, rows, K, 2], rank order
    if validate and gathered.numel():
        # The packed ids are in range (pack_candidates checked them); a repeated one can only come from
        # this group's local_topk (a rank that repeats an index, or ranks that disagree on the geometry).
        check_candidate_ids(gathered[..., 1], "local_topk (packed and gathered over the group)")
    return stable_topk(gathered, k, sorted=sorted, validate=False)


def unsigned_key(key: torch.Tensor) -> list[int]:
    """The kernel's unsigned 64-bit form of int64 :func:`stable_key` values: ``key + 2**63``.

    Invalid (``-2**63``) becomes ``0``; unsigned order equals the signed order. Returns Python ints.
    ``key``: an int64 tensor (any shape), read on the host.
    """
    check_tensor(key, "key", dtypes=(torch.int64,))
    check_values_readable(key, "key")
    return [int(v) + (1 << 63) for v in key.reshape(-1).tolist()]


@dataclass(frozen=True)
class RadixPass:
    """One pass of MSB-first radix select (see :func:`radix_select_trace`).

    Attributes:
        shift: bit position of this pass's digit (``56, 48, ..., 0`` for 8-bit digits).
        hist: ``2**bits`` counts of the digit over the keys still matching the prefix.
        chosen: the bin holding the k-th largest key.
        above: keys in bins above ``chosen`` (all of them win).
        need_after: how many more winners must come from the chosen bin.
        done: the chosen bin holds exactly ``need_after`` keys — the threshold is found early.
    """

    shift: int
    hist: list[int]
    chosen: int
    above: int
    need_after: int
    done: bool


def radix_select_trace(keys: list[int], k: int, bits: int = 8, key_bits: int = 64) -> tuple[list[int], list[RadixPass]]:
    """Plain-Python spec of the kernel's radix select over unsigned keys (``0`` = invalid).

    Returns ``(winner positions in key order, passes)``. This is the algorithm the CuTeDSL
    kernel runs with a shared-memory histogram; it is tested against a plain sort.

    Args:
        keys: a list (or tuple) of ints in ``[0, 2**key_bits)``; ``0`` is an invalid candidate.
        k: how many to select (``>= 1``).  bits: digit width, ``1 <= bits <= key_bits`` and dividing
            ``key_bits`` (every bit of the key is looked at).  key_bits: key width (``>= 1``).
    """
    k = check_int_scalar(k, "k", min_value=1)
    key_bits = check_int_scalar(key_bits, "key_bits", min_value=1)
    bits = check_int_scalar(bits, "bits", min_value=1)
    if bits > key_bits or key_bits % bits:
        raise ValueError(f"bits must divide key_bits={key_bits} (a digit per pass, every bit used), got {bits}")
    if not isinstance(keys, (list, tuple)):
        raise TypeError(f"keys must be a list of ints, got {type(keys).__name__}")
    for v in keys:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"keys must contain only ints, got {type(v).__name__}")
        if not 0 <= v < 1 << key_bits:
            raise ValueError(f"keys must lie in [0, 2**{key_bits}), got {v}")
    valid = [i for i, v in enumerate(keys) if v != 0]
    passes: list[RadixPass] = []
    nb = 1 << bits
    if len(valid) <= k:
        # Every valid key wins; no pass is needed.
        return sorted(valid, key=lambda i: -keys[i]), passes
    prefix, mask, need = 0, 0, k
    for shift in range(key_bits - bits, -1, -bits):
        hist = [0] * nb
        for i in valid:
            if keys[i] & mask == prefix:
                hist[(keys[i] >> shift) & (nb - 1)] += 1
        above = 0
        for b in range(nb - 1, -1, -1):
            if above + hist[b] >= need:
                break
            above += hist[b]
        need -= above
        prefix |= b << shift
        mask |= (nb - 1) << shift
        done = hist[b] == need
        passes.append(RadixPass(shift, hist, b, above, need, done))
        if done:
            break
    wins = [i for i in valid if keys[i] & mask > prefix]
    ties = [i for i in valid if keys[i] & mask == prefix][:need]
    return sorted(wins + ties, key=lambda i: -keys[i]), passes


# ---------------------------------------------------------------------------------------------
# The exactness argument, as executable helpers (tests check them on random inputs).
# ---------------------------------------------------------------------------------------------


def global_topk_all_logits(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The "gather every logit" answer: stable top-``k`` over the full global row.

    Args:
        scores: float ``[rows, L]``; column ``p`` is global position ``p``; ``-inf`` is a valid
            (very low) score, NaN marks a masked position.
    Returns:
        int32 ``[rows, k]`` ids in key order, ``-1`` padded.
    """
    check_tensor(scores, "scores", dtypes=FLOAT_DTYPES, ndim=2)
    k = check_int_scalar(k, "k", min_value=1)
    rows, n = scores.shape
    if n > MAX_EXACT_ID:
        raise ValueError(
            f"scores has {n} columns: positions >= 2**24 are not exactly representable in float32 (the "
            "(score, id) packing); at most 16777216 columns"
        )
    ids = torch.arange(n, dtype=torch.float32, device=scores.device).expand(rows, n)
    packed = torch.stack([scores.to(torch.float32), ids], -1)
    return stable_topk(packed, k, sorted=True, validate=False)  # ids built here: distinct, in range


def local_topk_by_owner(
    scores: torch.Tensor, K: int, world_size: int, interleave: int = 1
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Split a global score row by owner and take each rank's local stable top-``K``.

    Args:
        scores: float ``[rows, L]`` global scores.  K: local top-K size.
    Returns:
        ``(logits_per_rank, local_topk_per_rank)``: rank ``r`` gets its local logits
        ``[rows, L_r]`` (local index order) and its local top-K indices int64 ``[rows, K]``
        (``-1`` padded) — exactly what the indexer stage would hand to :func:`pack_candidates`.
    """
    w, _, i = check_world(world_size, None, interleave)
    K = check_int_scalar(K, "K", min_value=1)
    check_tensor(scores, "scores", dtypes=FLOAT_DTYPES, ndim=2)
    rows, n = scores.shape
    if n > MAX_EXACT_ID:
        raise ValueError(
            f"scores has {n} columns: positions >= 2**24 are not exactly representable in float32 (the "
            "(score, id) packing); at most 16777216 columns"
        )
    pos = torch.arange(n, device=scores.device)
    own = owner_rank(pos, w, i)
    loc = global_to_local(pos, w, i)
    logits_r, topk_r = [], []
    for r in range(w):
        mine = pos[own == r]
        order = torch.argsort(loc[own == r])
        lg = scores[:, mine[order]]
        # Local stable top-K: ties broken by *global* id, consistent with the global order
        # (global id is increasing in local index on one rank, so local index works as well).
        ids = torch.arange(lg.shape[1], dtype=torch.float32, device=scores.device).expand(rows, lg.shape[1])
        sel = stable_topk(torch.stack([lg.to(torch.float32), ids], -1), K, sorted=True, validate=False).long()
        logits_r.append(lg)
        topk_r.append(sel)
    return logits_r, topk_r


@dataclass(frozen=True)
class UnionCounterexample:
    """Why ranks must agree on one global top-K instead of attending to their local top-Ks.

    One query ``q = [[1.0]]``; four keys (1-D) whose scores ``q·k`` are ``1.0, 0.9, 0.95, 0.85``;
    with ``W = 2, I = 1`` rank 0 owns positions 0, 2 (values 0) and rank 1 owns 1, 3 (values
    1000). With ``k = K = 2`` the true top-2 is positions {0, 2}, so the output is 0. Each rank's
    local top-2 is *all* its keys; attending to their union (all four keys) gives ~475.
    """

    q: torch.Tensor  # float64 [1, 1]
    keys: torch.Tensor  # float64 [4, 1]
    values: torch.Tensor  # float64 [4, 1]
    world_size: int
    k: int


def union_counterexample() -> UnionCounterexample:
    """The data of :class:`UnionCounterexample`."""
    return UnionCounterexample(
        q=torch.tensor([[1.0]], dtype=torch.float64),
        keys=torch.tensor([[1.0], [0.9], [0.95], [0.85]], dtype=torch.float64),
        values=torch.tensor([[0.0], [1000.0], [0.0], [1000.0]], dtype=torch.float64),
        world_size=2,
        k=2,
    )


def sparse_attention_reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """float64 softmax attention of ``q`` ``[T, d]`` over the keys ``ids`` (``[T, k]``, -1 skipped).

    ``keys`` ``[L, d]``, ``values`` ``[L, dv]`` (float, one device); ``ids`` int ``[T, k]`` with
    entries in ``[-1, L)`` (read on the host). No scaling (the counterexample's scores are ``q·k``).
    Returns float64 ``[T, dv]``; a row with no valid id gives zeros.
    """
    check_tensor(q, "q", dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor(keys, "keys", dtypes=FLOAT_DTYPES, ndim=2, device=q.device)
    check_tensor(values, "values", dtypes=FLOAT_DTYPES, ndim=2, device=q.device)
    check_tensor(ids, "ids", dtypes=INT_DTYPES, ndim=2, device=q.device)
    if keys.shape[1] != q.shape[1]:
        raise ValueError(f"keys must be [L, d={q.shape[1]}] (q's width), got shape {tuple(keys.shape)}")
    if values.shape[0] != keys.shape[0]:
        raise ValueError(f"values must have one row per key ({keys.shape[0]}), got shape {tuple(values.shape)}")
    if ids.shape[0] != q.shape[0]:
        raise ValueError(f"ids must have one row per query ({q.shape[0]}), got shape {tuple(ids.shape)}")
    check_values_readable(ids, "ids")
    if ids.numel():
        lo, hi = host_values(ids.min(), ids.max())
        if lo < -1 or hi >= keys.shape[0]:
            raise ValueError(f"ids must lie in [-1, L={keys.shape[0]}), got min {lo}, max {hi}")
    q64, k64, v64 = q.double().cpu(), keys.double().cpu(), values.double().cpu()
    out = torch.zeros(q.shape[0], values.shape[1], dtype=torch.float64)
    for t in range(q.shape[0]):
        sel = [int(i) for i in ids[t].tolist() if int(i) >= 0]
        if not sel:
            continue
        s = k64[sel] @ q64[t]
        p = torch.softmax(s, 0)
        out[t] = p @ v64[sel]
    return out
