"""FlashMLA's SM90 sparse MLA kernel as the attention stage: no host-side plan, capturable.

``flash_mla.flash_mla_sparse_fwd`` (PyPI ``sgl-flash-mla``, SGLang's packaging of deepseek-ai/FlashMLA)
reads the compacted ``(slots, counts)`` of the de-interleave stage directly: ``indices [T, 1, K]``
with the valid slots first and ``topk_length = counts``. Unlike FlashInfer's MLA wrapper it has no
``plan()`` that reads lengths on the host, so it can run inside a CUDA graph.

Conventions, verified on the H200 (sgl-flash-mla 1.0.0; ``../shared/gpu/README.md``) and checked by
the ``gpu`` tests against :func:`dcp_ref.attention.sparse_mla_attention`:

- LSE in base e (:data:`FLASHMLA_LSE_BASE`), shape ``[T, H]``;
- a row with no keys gives output 0 and LSE **+inf**; this wrapper normalises it to ``-inf`` (the
  merge's "empty" value), deciding emptiness from ``counts == 0``, never from the LSE's value;
- ``H`` must be 64 or 128, ``q`` and the cache bf16, ``Dqk = 576``, ``v = 512``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dcp_ref._checks import INT_DTYPES, check_tensor

__all__ = ["FLASHMLA_LSE_BASE", "FLASHMLA_HEADS", "flashmla_unsupported", "sparse_mla_flashmla"]

#: The base of the LSE that ``flash_mla_sparse_fwd`` returns (checked by tests/test_flashmla.py on a GPU).
FLASHMLA_LSE_BASE = "e"
#: Query head counts the SM90 sparse kernel takes.
FLASHMLA_HEADS = (64, 128)
_DQK, _DV = 576, 512


def _flash_mla() -> Any:
    try:
        import flash_mla
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the FlashMLA attention stage needs sgl-flash-mla (pip install sgl-flash-mla)") from e
    return flash_mla


def flashmla_unsupported(
    device: torch.device, dtype: torch.dtype, num_heads: int, head_dim: int, v_dim: int, topk: int
) -> str:
    """Why FlashMLA cannot run this attention (``""`` when it can)."""
    from dcp_ref._checks import has_module

    if device.type != "cuda":
        return f"tensors are on {device}, not CUDA"
    if not has_module("flash_mla"):
        return "sgl-flash-mla is not installed"
    if dtype != torch.bfloat16:
        return f"FlashMLA's sparse kernel takes bf16, got {dtype}"
    if (head_dim, v_dim) != (_DQK, _DV):
        return f"FlashMLA takes head_dim={_DQK}, v_dim={_DV}, got {head_dim}, {v_dim}"
    if num_heads not in FLASHMLA_HEADS:
        return f"FlashMLA's SM90 sparse kernel takes H in {FLASHMLA_HEADS}, got {num_heads}"
    if topk % 64:
        return f"FlashMLA's sparse kernel walks the top-k in tiles of 64, got topk={topk}"
    return ""


def sparse_mla_flashmla(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    sm_scale: float,
    v_dim: int = _DV,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over compacted slots on FlashMLA (the attention stage's contract, :mod:`dcp_ref.stages`).

    Args:
        q: bf16 CUDA ``[T, H, 576]``, ``H`` in :data:`FLASHMLA_HEADS`.
        kv_cache: bf16 ``[S, 576]`` (or ``[S, 1, 576]``).
        slots: int32 ``[T, K]``: row ``t`` attends to ``slots[t, :counts[t]]`` (the rest is ignored).
        counts: int32 ``[T]``, ``0 <= counts[t] <= K``.
        sm_scale: softmax scale.  v_dim: must be 512.
        out: optional bf16 ``[T, H, 512]``.  out_lse: optional float32 ``[T, H]``.
    Returns:
        ``(out [T, H, 512] bf16, lse [T, H] float32)``: LSE in base e, ``-inf`` where ``counts == 0``.
    """
    check_tensor(q, "q", dtypes=(torch.bfloat16,), ndim=3)
    check_tensor(kv_cache, "kv_cache", dtypes=(torch.bfloat16,), ndim=(2, 3), device=q.device)
    check_tensor(slots, "slots", dtypes=INT_DTYPES, ndim=2, device=q.device)
    slots = slots.to(torch.int32)  # FlashMLA reads int32 indices (a no-op for int32)
    check_tensor(counts, "counts", dtypes=INT_DTYPES, ndim=1, device=q.device)
    T, H, D = q.shape
    if (D, v_dim, kv_cache.shape[-1]) != (_DQK, _DV, _DQK):
        raise ValueError(
            f"q and kv_cache must be {_DQK} wide with v_dim={_DV}, got q {tuple(q.shape)}, "
            f"kv_cache {tuple(kv_cache.shape)}, v_dim={v_dim}"
        )
    if H not in FLASHMLA_HEADS:
        raise ValueError(f"q.shape[1] (H) must be one of {FLASHMLA_HEADS}, got {H}")
    if slots.shape[0] != T or counts.shape[0] != T:
        raise ValueError(f"slots and counts must have T={T} rows, got {tuple(slots.shape)} and {tuple(counts.shape)}")
    # No host check of values (capturable); instead, on the device: counts clamped to [0, K], and a row whose
    # used slots leave the cache reads only slot 0 there and is poisoned (NaN output and LSE) afterwards, as
    # the reference does with validate=False — never an out-of-bounds read, never a silently dropped key.
    K, S = slots.shape[1], kv_cache.reshape(-1, _DQK).shape[0]
    cnt = counts.clamp(0, K).to(torch.int32)
    used = torch.arange(K, device=q.device) < cnt.unsqueeze(1)
    outside = used & ((slots < 0) | (slots >= S))
    poisoned = outside.any(1)
    safe = slots.masked_fill(outside, 0)
    o, _max_logits, lse = _flash_mla().flash_mla_sparse_fwd(
        q,
        kv_cache.reshape(-1, 1, _DQK),
        safe.unsqueeze(1),
        sm_scale,
        d_v=_DV,
        topk_length=cnt,
        use_legacy=True,
    )
    lse = lse.reshape(T, H)
    out = o if out is None else out.copy_(o)
    out_lse = torch.empty((T, H), dtype=torch.float32, device=q.device) if out_lse is None else out_lse
    out_lse.copy_(lse if FLASHMLA_LSE_BASE == "e" else lse * math.log(2.0))
    # Emptiness is a count of zero (FlashMLA says +inf there); never inferred from the LSE's value.
    out_lse.masked_fill_((cnt == 0).unsqueeze(1), -math.inf)
    out_lse.masked_fill_(poisoned.unsqueeze(1), math.nan)
    out.masked_fill_(poisoned.view(T, 1, 1), math.nan)
    return out, out_lse
