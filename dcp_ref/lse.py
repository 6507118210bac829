"""The correct and combine stages — log-sum-exp (LSE) bookkeeping and the DCP merge of partial attention outputs.

Why the merge is a *rescale*, never a bare add
----------------------------------------------
Rank ``r`` attends over its own subset ``S_r`` of the chosen keys and returns a normalized
partial output and the log of its softmax denominator::

    o_r = sum_{j in S_r} exp(s_j - lse_r) v_j          lse_r = log sum_{j in S_r} exp(s_j)

Attention over the union ``S = ∪ S_r`` has ``lse = log sum_r exp(lse_r)`` and::

    o = sum_j exp(s_j - lse) v_j = sum_r exp(lse_r - lse) * o_r

so each partial is rescaled by ``w_r = exp(lse_r - lse)`` (the weights sum to 1) before the sum.
Adding the ``o_r`` directly would count every rank as if it held the whole softmax mass.

Bases
-----
GPU kernels compute ``exp`` with the hardware ``exp2`` instruction and many (FlashInfer,
FlashMLA) return ``lse2 = log2 sum exp(s)``. ``lse_e = lse2 * ln 2``. Mixing the two bases makes
every weight wrong: the merge needs all LSEs in one base, and the formula for that base
(``exp`` for e, ``exp2`` for 2).

Empty ranks and NaN
-------------------
An *empty* rank (no chosen key on it: a count of zero) reports ``lse = -inf`` — the attention
stage writes ``-inf`` exactly when the count is 0 — and its partial output is meaningless (0, or
NaN from a 0/0 in some kernels). It contributes *exactly* zero: its weight is 0 and its output
is *selected away* (never multiplied in), so its garbage cannot leak. When every rank is empty
the merged output is 0 and the merged LSE is ``-inf`` (the LSE of an empty set), so a later
merge treats it as empty again.

Emptiness is never inferred from a NaN. A NaN LSE (NaN in the query or in an attended KV row of
a non-empty rank) or a ``+inf`` LSE (an overflow) is corrupt data: the merged output and LSE of
that ``(t, h)`` are NaN on every rank, and no other ``(t, h)`` is affected. A NaN in a non-empty
rank's partial output propagates the same way (its weight times NaN is NaN, even when the weight
underflows to 0 — as in the single-device softmax).
"""

from __future__ import annotations

import math

import torch

from .contracts import FLOAT_DTYPES, check_bool, check_int_scalar, check_lse_base, check_same_device, check_tensor
from .group import Group

__all__ = [
    "LN2",
    "lse_base2_to_e",
    "lse_e_to_base2",
    "normalize_lse_shape",
    "sanitize_lse",
    "merge_partials",
    "merge_partials_naive_add",
    "correct_partial",
    "dcp_merge_collective",
]

LN2 = math.log(2.0)  #: ``lse_e = lse_2 * LN2``


def lse_base2_to_e(lse: torch.Tensor) -> torch.Tensor:
    """``log2``-domain LSE → natural-log LSE: ``lse * ln 2`` (``±inf`` and NaN map to themselves).

    Args: ``lse`` float tensor of any shape. Returns a new tensor, same shape/dtype/device.
    """
    check_tensor(lse, "lse", dtypes=FLOAT_DTYPES)
    return lse * LN2


def lse_e_to_base2(lse: torch.Tensor) -> torch.Tensor:
    """Natural-log LSE → ``log2``-domain LSE: ``lse / ln 2``. Shape/dtype/device kept."""
    check_tensor(lse, "lse", dtypes=FLOAT_DTYPES)
    return lse / LN2


def normalize_lse_shape(lse: torch.Tensor, num_tokens: int, num_heads: int) -> torch.Tensor:
    """Bring the LSE layouts attention backends return to ``[T, H]`` (a view when possible).

    Accepted: ``[T, H]`` (also the flattened ``[B·q, H]`` of speculative decode), ``[T, 1, H]``,
    ``[T, H, 1]``, and ``[B, q, H]`` with ``B·q == T``. Anything else — notably a transposed
    ``[H, T]`` (``T != H``) or a wrong total size — raises ``ValueError`` saying what was expected,
    instead of being silently reshaped into scrambled heads.
    """
    check_tensor(lse, "lse", dtypes=FLOAT_DTYPES)
    t = check_int_scalar(num_tokens, "num_tokens", min_value=0)
    h = check_int_scalar(num_heads, "num_heads", min_value=1)
    shape = tuple(lse.shape)
    if shape == (t, h):
        return lse
    if lse.ndim == 3:
        if shape == (t, 1, h):
            return lse[:, 0, :]
        if shape == (t, h, 1):
            return lse[:, :, 0]
        if shape[2] == h and shape[0] * shape[1] == t:
            return lse.reshape(t, h)
    raise ValueError(
        f"lse must have shape [T, H], [T, 1, H], [T, H, 1] or [B, q, H] with B*q == T (T={t}, H={h}), got {shape}"
    )


def sanitize_lse(lse: torch.Tensor) -> torch.Tensor:
    """Replace NaN and ``+inf`` by ``-inf`` — **not** what the merge does.

    Kept for notebooks that show the old convention: reading a NaN LSE as "empty" makes corrupt
    data vanish (the rank is dropped and the answer looks fine). The merge treats only ``-inf``
    as empty and propagates NaN / ``+inf`` as NaN (module docstring).
    """
    check_tensor(lse, "lse", dtypes=FLOAT_DTYPES)
    bad = torch.isnan(lse) | (lse == math.inf)
    return lse.masked_fill(bad, -math.inf)


def _check_partials(outs: torch.Tensor, lses: torch.Tensor) -> None:
    check_tensor(outs, "outs", dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor(lses, "lses", dtypes=FLOAT_DTYPES, ndim=3)
    check_same_device(outs=outs, lses=lses)
    if tuple(lses.shape) != tuple(outs.shape[:3]):
        raise ValueError(
            f"lses must be [W, T, H] = {tuple(outs.shape[:3])} to match outs [W, T, H, D], got {tuple(lses.shape)}"
        )
    if outs.shape[0] < 1:
        raise ValueError("outs must hold at least one rank (W >= 1)")


def _weights(lses: torch.Tensor, base: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 ``(w [W,T,H], merged lse [T,H], empty [W,T,H])``, ``w_r = b^(lse_r - lse)``.

    In float64 throughout, the max subtracted before exponentiating: finite LSEs up to the float32
    maximum (``3.3e38``) merge to a finite result, and float64 LSEs keep their precision.

    ``empty`` is ``lse_r == -inf`` (weight 0, output selected away). A NaN or ``+inf`` LSE in any
    rank makes every weight and the merged LSE of that ``(t, h)`` NaN: corrupt data propagates.
    """
    l64 = lses.to(torch.float64)
    empty = l64 == -math.inf
    corrupt = torch.isnan(l64) | (l64 == math.inf)
    clean = l64.masked_fill(corrupt, -math.inf)
    m = clean.amax(dim=0)  # [T, H]; -inf iff every rank is empty (or corrupt)
    m_safe = torch.where(torch.isfinite(m), m, 0.0)  # avoid (-inf) - (-inf) = NaN
    if base == "2":
        e = torch.exp2(clean - m_safe)  # -inf -> 0: empty ranks get weight 0
        total = e.sum(0)
        merged = m_safe + torch.log2(total)  # log2(0) = -inf for all-empty rows
    else:
        e = torch.exp(clean - m_safe)
        total = e.sum(0)
        merged = m_safe + torch.log(total)
    w = torch.where(total > 0, e / torch.where(total > 0, total, 1.0), 0.0)
    bad = corrupt.any(dim=0)  # [T, H]
    w = w.masked_fill(bad.unsqueeze(0), math.nan)
    merged = merged.masked_fill(bad, math.nan)
    return w, merged, empty


def _contribution(w: torch.Tensor, out: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """``w * out`` in float64, exactly 0 for an empty rank (``where``: 0 * NaN would be NaN)."""
    return torch.where(empty.unsqueeze(-1), 0.0, w.unsqueeze(-1) * out.to(torch.float64))


def merge_partials(
    outs: torch.Tensor, lses: torch.Tensor, base: str = "e", *, validate: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge W partial attention outputs by their LSEs (computed in float64).

    Args:
        outs: ``[W, T, H, D]`` float, rank ``r``'s normalized partial output in ``outs[r]``.
        lses: ``[W, T, H]`` float, rank ``r``'s LSE in ``base``; ``-inf`` means "empty" (a count
            of zero).
        base: ``"e"`` or ``"2"`` — the base of ``lses`` (and of the returned LSE).
        validate: accepted for a uniform stage signature: the merge has no value checks (it
            reads nothing on the host either way; NaN is data, not an error).

    Returns:
        ``(out, lse)``: ``out`` ``[T, H, D]`` in ``outs.dtype``, ``lse`` ``[T, H]`` in
        ``lses.dtype`` and ``base``. Empty ranks contribute exactly 0 (their output, even NaN,
        never leaks). When every rank is empty: ``out = 0``, ``lse = -inf``. A NaN / ``+inf``
        LSE or a NaN output of a non-empty rank gives NaN for that ``(t, h)`` only.
    Raises: TypeError (non-float tensors), ValueError (ranks / shapes / devices, base).
    """
    check_bool(validate, "validate")
    b = check_lse_base(base)
    _check_partials(outs, lses)
    w, merged, empty = _weights(lses, b)
    return _contribution(w, outs, empty).sum(0).to(outs.dtype), merged.to(lses.dtype)


def merge_partials_naive_add(
    outs: torch.Tensor, lses: torch.Tensor, base: str = "e"
) -> tuple[torch.Tensor, torch.Tensor]:
    """**Deliberately wrong** — kept to demonstrate the bug in notebook 05: adds the partial
    outputs without rescaling them (the LSE returned is the correct merged one).
    Never use it for real outputs.
    """
    b = check_lse_base(base)
    _check_partials(outs, lses)
    _, merged, _ = _weights(lses, b)
    return outs.to(torch.float64).sum(0).to(outs.dtype), merged.to(lses.dtype)


def correct_partial(
    out: torch.Tensor, all_lses: torch.Tensor, rank: int, base: str = "e", *, validate: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's share of the merge: rescale its partial output by ``b^(lse_rank - lse)``.

    This is the per-rank step of DCP (vLLM's ``correct_attn_out``): after the LSEs are all-gathered,
    each rank rescales its own output; a sum over ranks (a reduce-scatter) then finishes the merge.

    Args:
        out: ``[T, H, D]`` float, this rank's partial output.
        all_lses: ``[W, T, H]`` float, every rank's LSE in ``base`` (rank order).
        rank: this rank, ``0 <= rank < W`` (a Python or NumPy int).
        validate: as in :func:`merge_partials` (no value checks exist).
    Returns:
        ``(corrected [T, H, D] in out.dtype, merged lse [T, H] in all_lses.dtype)``.
        ``sum_r correct_partial(o_r, L, r)[0] == merge_partials(stack(o), L)[0]``. An empty rank
        (``lse = -inf``) gives exactly 0; NaN propagates as in :func:`merge_partials`.
    """
    check_bool(validate, "validate")
    b = check_lse_base(base)
    check_tensor(out, "out", dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor(all_lses, "all_lses", dtypes=FLOAT_DTYPES, ndim=3)
    check_same_device(out=out, all_lses=all_lses)
    if tuple(all_lses.shape[1:]) != tuple(out.shape[:2]):
        raise ValueError(
            f"all_lses must be [W, T, H] with [T, H] = {tuple(out.shape[:2])}, got {tuple(all_lses.shape)}"
        )
    w_size = all_lses.shape[0]
    if w_size < 1:
        raise ValueError("all_lses must hold at least one rank (W >= 1)")
    r = check_int_scalar(rank, "rank", min_value=0)
    if r >= w_size:
        raise ValueError(f"rank must be < W={w_size} (all_lses.shape[0]), got {r}")
    w, merged, empty = _weights(all_lses, b)
    corrected = _contribution(w[r], out, empty[r])
    return corrected.to(out.dtype), merged.to(all_lses.dtype)


def dcp_merge_collective(
    group: Group, out: torch.Tensor, lse: torch.Tensor, base: str = "e"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DCP merge as each rank runs it: all-gather LSEs, correct, reduce-scatter over heads.

    Every rank computed attention for *all* ``H`` heads over its own keys. After the merge, rank
    ``r`` owns heads ``[r·H/W, (r+1)·H/W)`` (the layout the following TP-sharded projection wants),
    so the sum over ranks is a reduce-scatter along the head dimension — one collective moving
    ``T·H·D`` elements instead of an all-gather of every partial.

    Args:
        group: this rank's :class:`~dcp_ref.group.Group` (``SimulatedWorld`` or torch.distributed).
        out: ``[T, H, D]`` float, this rank's partial output.  lse: ``[T, H]`` float in ``base``.
    Returns:
        ``(out_shard [T, H/W, D] in out.dtype, lse_shard [T, H/W] in lse.dtype)``: the merged
        output and LSE of this rank's heads. ``H`` must be divisible by ``W``.
    """
    if not isinstance(group, Group):
        raise TypeError(f"group must be a dcp_ref.group.Group, got {type(group).__name__}")
    b = check_lse_base(base)
    check_tensor(out, "out", dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor(lse, "lse", dtypes=FLOAT_DTYPES, ndim=2)
    check_same_device(out=out, lse=lse)
    if tuple(lse.shape) != tuple(out.shape[:2]):
        raise ValueError(f"lse must be [T, H] = {tuple(out.shape[:2])}, got {tuple(lse.shape)}")
    W, r = group.world_size, group.rank
    H = out.shape[1]
    if H % W:
        raise ValueError(f"out.shape[1] (H={H}) must be divisible by the world size W={W}")
    all_lses = group.all_gather(lse.contiguous())  # [W, T, H]
    corrected, merged = correct_partial(out, all_lses, r, b)
    out_shard = group.reduce_scatter(corrected, dim=1)  # [T, H/W, D]
    hs = H // W
    return out_shard, merged[:, r * hs : (r + 1) * hs].contiguous()
