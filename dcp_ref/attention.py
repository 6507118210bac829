"""The attention stage — sparse MLA decode attention over compacted KV slots (the float64 oracle).

Absorbed MLA decode (DeepSeek V3.2 / DSA)
-----------------------------------------
With the up-projections absorbed into the query, every head attends to one shared *latent* KV
cache. A cache row is ``576`` wide: ``512`` latent dims (``kv_lora_rank``) followed by ``64`` RoPE
dims. Scores use all 576 dims; values are the first 512 dims of the same row::

    score[t, h, j] = sm_scale * <q[t, h, :576], kv[slot[t, j], :576]>
    out[t, h, :]   = sum_j softmax_j(score[t, h, :]) * kv[slot[t, j], :512]
    lse[t, h]      = log sum_j exp(score[t, h, j])                 (natural log, base e)

DCP: which slots a row attends to
---------------------------------
After the global top-K and the deinterleave stage, rank ``r`` holds, for every query token
``t``, ``slots[t, :counts[t]]`` — the *physical* KV slots of the chosen tokens that live on this
rank, compacted to the front; entries at ``j >= counts[t]`` are padding (``-1``) and are never
read. A row with ``counts[t] == 0`` (every chosen token lives elsewhere) is *empty*: output 0 and
LSE ``-inf``, which the LSE merge (:mod:`dcp_ref.lse`) turns into an exact-zero contribution.

Emptiness is decided by the count, never by the numbers: the LSE is ``-inf`` *exactly* when
``counts[t] == 0``. A non-empty row whose scores are NaN (a NaN in the query or in an attended KV
row) gives a NaN output and a NaN LSE, which the merge propagates — corrupt data is never
mistaken for an empty rank and dropped. (A non-empty row whose scores are all ``-inf`` — only
possible with infinite data — gets a NaN LSE too, so that ``-inf`` keeps meaning "empty".)

Everything is computed in float64 so that this is an oracle for bf16/fp32 kernels.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .contracts import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_bool,
    check_int_scalar,
    check_lse_base,
    check_same_device,
    check_tensor,
    check_values_readable,
    host_values,
)

__all__ = ["KV_LORA_RANK", "QK_ROPE_DIM", "MLA_HEAD_DIM", "sparse_mla_attention", "check_attention_slots"]

KV_LORA_RANK = 512  #: latent (value) width of DeepSeek MLA
QK_ROPE_DIM = 64  #: RoPE width appended to the latent in the cache and the absorbed query
MLA_HEAD_DIM = KV_LORA_RANK + QK_ROPE_DIM  #: 576, the absorbed query / cache row width

# Rows are processed in chunks so that the gathered [rows, K, 576] float64 tensor stays small
# (T=128, K=2048 at once would be 1.2 GB).
_GATHER_BUDGET_ELEMS = 1 << 24


def sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    sm_scale: float,
    lse_base: str = "e",
    *,
    v_dim: int = KV_LORA_RANK,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed-MLA decode attention of each query row over its own compacted slots (float64).

    Args:
        q: ``[T, H, Dqk]`` float (fp16/bf16/fp32/fp64); ``Dqk = 576`` for DeepSeek (512 latent +
            64 RoPE dims).
        kv_cache: ``[num_slots, Dqk]`` or FlashInfer's page-size-1 layout ``[num_slots, 1, Dqk]``;
            float. Values are the first ``v_dim`` columns.
        slots: int32/int64 ``[T, K]``; row ``t`` attends to ``slots[t, :counts[t]]``, which must
            lie in ``[0, num_slots)``. Entries from ``counts[t]`` on are ignored (padding, ``-1``).
        counts: int32/int64 ``[T]``, ``0 <= counts[t] <= K``.
        sm_scale: softmax scale (a finite float or int > 0, NumPy floats too), e.g.
            ``1/sqrt(192)`` for DeepSeek V3.2.
        lse_base: ``"e"`` (natural log) or ``"2"`` (``log2``, what exp2-based kernels return).
        v_dim: value width (``0 < v_dim <= Dqk``); 512 for DeepSeek, smaller for toy examples.
        validate: check ``counts`` and the used ``slots`` on the host (one sync). ``False``: no
            host read; ``counts`` is clamped to ``[0, K]`` on the device, and a row whose used
            slots leave ``[0, num_slots)`` reads only in-range rows and is *poisoned*: its output
            and LSE are NaN (never a plausible-looking wrong answer).

    Returns:
        ``(out, lse)``: ``out`` float64 ``[T, H, v_dim]``, ``lse`` float64 ``[T, H]`` in
        ``lse_base``, on the device of ``q``. Empty rows (``counts[t] == 0``) give ``out = 0`` and
        ``lse = -inf``; ``lse`` is ``-inf`` for no other row (see the module docstring: NaN data
        gives NaN, which propagates).

    Raises:
        TypeError / ValueError naming the argument on a wrong dtype, shape, device or range.
    """
    validate = check_bool(validate, "validate")
    base = check_lse_base(lse_base, "lse_base")
    check_tensor(q, "q", dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor(kv_cache, "kv_cache", dtypes=FLOAT_DTYPES, ndim=(2, 3))
    check_tensor(slots, "slots", dtypes=INT_DTYPES, ndim=2)
    check_tensor(counts, "counts", dtypes=INT_DTYPES, ndim=1)
    check_same_device(q=q, kv_cache=kv_cache, slots=slots, counts=counts)
    if kv_cache.ndim == 3:
        if kv_cache.shape[1] != 1:
            raise ValueError(
                f"kv_cache must be [num_slots, Dqk] or [num_slots, 1, Dqk], got shape {tuple(kv_cache.shape)}"
            )
        kv_cache = kv_cache[:, 0]
    T, H, dqk = q.shape
    if kv_cache.shape[1] != dqk:
        raise ValueError(f"kv_cache row width must equal q.shape[-1]={dqk}, got shape {tuple(kv_cache.shape)}")
    v = check_int_scalar(v_dim, "v_dim", min_value=1)
    if v > dqk:
        raise ValueError(f"v_dim must be <= q.shape[-1]={dqk}, got {v}")
    if slots.shape[0] != T:
        raise ValueError(f"slots must be [T={T}, K], got shape {tuple(slots.shape)}")
    if counts.shape != (T,):
        raise ValueError(f"counts must be [T={T}], got shape {tuple(counts.shape)}")
    scale = check_sm_scale(sm_scale)
    K = slots.shape[1]
    num_slots = kv_cache.shape[0]
    if validate:
        check_attention_slots(slots, counts, num_slots)
    cnt = counts.long().clamp(min=0, max=K)  # a no-op for validated counts
    # Only the valid prefix of each row is read, so only it must be in range.
    valid = torch.arange(K, device=slots.device).unsqueeze(0) < cnt.unsqueeze(1)  # [T, K]
    s64 = slots.long()
    out_of_range = valid & ((s64 < 0) | (s64 >= num_slots))
    poisoned = out_of_range.any(dim=1)  # [T]; all False after validation

    out = torch.zeros((T, H, v), dtype=torch.float64, device=q.device)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64, device=q.device)
    if T == 0 or K == 0:
        return out, lse
    if num_slots == 0:  # nothing can be read: every non-empty row is out of range (poisoned)
        lse = torch.where((cnt > 0).unsqueeze(1), math.nan, lse)
        return out.masked_fill((cnt > 0).view(T, 1, 1), math.nan), lse
    valid &= ~out_of_range
    kv64 = kv_cache.to(torch.float64)
    q64 = q.to(torch.float64)
    rows = max(1, _GATHER_BUDGET_ELEMS // max(1, K * dqk))
    for t0 in range(0, T, rows):
        t1 = min(T, t0 + rows)
        # Padding entries may be -1: clamp them to a real row for the gather, then mask their
        # scores to -inf so they carry zero weight.
        idx = s64[t0:t1].clamp(min=0, max=num_slots - 1)
        kv = kv64[idx]  # [t, K, Dqk]
        # Zero the padding rows: the slot they were clamped to may hold garbage (NaN/inf in a
        # never-written cache block), and 0 * NaN would leak into the output through the einsum.
        kv = torch.where(valid[t0:t1].unsqueeze(-1), kv, 0.0)
        scores = torch.einsum("thd,tkd->thk", q64[t0:t1], kv) * scale
        scores = scores.masked_fill(~valid[t0:t1].unsqueeze(1), -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)  # [t, H]; NaN when a used score is NaN
        # Emptiness is the count, not the numbers: an empty row is 0 / -inf; a non-empty row is
        # the softmax as computed, so a NaN score gives NaN (it must propagate, not vanish).
        nonempty = (cnt[t0:t1] > 0).unsqueeze(1)  # [t, 1]
        # A non-empty row with lse = -inf (all scores -inf: infinite data) must not look empty.
        row_lse = torch.where(nonempty & (row_lse == -math.inf), math.nan, row_lse)
        p = torch.exp(scores - torch.where(nonempty, row_lse, 0.0).unsqueeze(-1))
        p = torch.where(nonempty.unsqueeze(-1), p, 0.0)
        out[t0:t1] = torch.einsum("thk,tkd->thd", p, kv[..., :v])
        lse[t0:t1] = torch.where(nonempty, row_lse, -math.inf)
    out = out.masked_fill(poisoned.view(T, 1, 1), math.nan)
    lse = lse.masked_fill(poisoned.view(T, 1), math.nan)
    if base == "2":
        lse = lse / math.log(2.0)
    return out, lse


def check_attention_slots(slots: torch.Tensor, counts: torch.Tensor, num_slots: int | None) -> None:
    """The attention stage's value checks on the compact layout, shared with the kernel wrappers (same
    messages): ``0 <= counts[t] <= K`` and every used slot ``slots[t, :counts[t]]`` in
    ``[0, num_slots)`` (``num_slots=None``: below ``2**31 - 1``, the poison slot).

    One device reduction and one host read (the statistics the messages need are read together).
    ``slots`` int ``[T, K]`` and ``counts`` int ``[T]`` are assumed checked for shape and device.
    Raises ``ValueError`` naming ``counts`` or ``slots``; meta tensors (no values) are refused.
    """
    T, K = slots.shape
    if not T:
        return
    check_values_readable(counts, "counts")
    check_values_readable(slots, "slots")
    cnt = counts.long()
    stats = [cnt.min(), cnt.max()]
    if K:
        valid = torch.arange(K, device=slots.device).unsqueeze(0) < cnt.clamp(0, K).unsqueeze(1)
        s64 = slots.long()
        hi = num_slots if num_slots is not None else 2**31 - 1
        big = torch.iinfo(torch.int64).max
        stats += [
            (valid & ((s64 < 0) | (s64 >= hi))).sum(),
            torch.where(valid, s64, big).amin(),
            torch.where(valid, s64, -big - 1).amax(),
        ]
    c_min, c_max, *rest = host_values(*stats)
    if c_min < 0 or c_max > K:
        raise ValueError(f"counts must satisfy 0 <= counts[t] <= K={K}, got min {c_min}, max {c_max}")
    if rest and rest[0]:
        raise ValueError(
            f"slots[t, :counts[t]] must lie in [0, num_slots={num_slots}), got min {rest[1]}, max {rest[2]}"
        )


def check_sm_scale(sm_scale: object, name: str = "sm_scale") -> float:
    """A softmax scale is a finite real number > 0 (Python / NumPy float or int; not a bool or tensor)."""
    if isinstance(sm_scale, (bool, np.bool_)) or not isinstance(sm_scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a float, got {type(sm_scale).__name__}")
    value = float(sm_scale)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite float > 0, got {sm_scale!r}")
    return value
