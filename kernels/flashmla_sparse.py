"""FlashMLA's SM90 sparse MLA kernel as the attention stage: no host-side plan, capturable.

``flash_mla.flash_mla_sparse_fwd`` (PyPI ``sgl-flash-mla``, SGLang's packaging of deepseek-ai/FlashMLA)
reads the compacted ``(slots, counts)`` of the deinterleave stage directly: ``indices [T, 1, K]``
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
import threading
from typing import Any

import torch
import triton
import triton.language as tl

from dcp_ref._checks import (
    INT_DTYPES,
    check_bool,
    check_int_scalar,
    check_no_alias,
    check_out,
    check_tensor,
    check_values_readable,
    triton_interpreting,
)
from dcp_ref.attention import check_attention_slots, check_sm_scale

from ._util import cdiv, check_flag, next_pow2, per_thread, raise_if_flagged

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
    return ""


#: FlashMLA's SM90 sparse kernel walks a row's indices two tiles of 64 at a time and asserts
#: ``topk % 128 == 0`` (measured: a width of 64 fails ``params.topk % (2*B_TOPK) == 0``). Narrower or
#: ragged widths are padded with ``-1`` past every row's count (never read: ``topk_length`` stops first).
INDEX_WIDTH_MULTIPLE = 128


@triton.jit
def _prologue_kernel(
    slots_ptr, counts_ptr, safe_ptr, cnt_ptr, poison_ptr, K, KP, S, stride_t, stride_k, BLOCK: tl.constexpr,
    chk_ptr=None, CHECK: tl.constexpr = False,
):  # fmt: skip
    """Row ``t``: ``cnt = clamp(counts[t], 0, K)``; ``safe[t, :K] = slots[t]`` as int32, except that a used
    entry (``j < cnt``) outside ``[0, S)`` becomes slot 0 and marks the row poisoned; ``safe[t, K:KP] = -1``
    (the padding to FlashMLA's width multiple). The range test runs on the slot as given (int64 included),
    *before* the narrowing to int32, so a wide slot can never wrap into a valid one.

    ``CHECK`` (``validate=True``): a row that :func:`dcp_ref.attention.check_attention_slots` would refuse
    (``counts[t]`` outside ``[0, K]``, or a poisoned row) sets ``chk[0]`` to 1 with an atomic max; a good
    row writes nothing, so the validated call's value checks are this launch plus one read of ``chk``."""
    t = tl.program_id(0).to(tl.int64)
    raw = tl.load(counts_ptr + t).to(tl.int64)
    c = tl.minimum(tl.maximum(raw, 0), K)
    bad = tl.zeros([BLOCK], tl.int32)
    for j0 in range(0, KP, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        s = tl.load(slots_ptr + t * stride_t + j * stride_k, mask=j < K, other=-1).to(tl.int64)
        outside = (j < c) & ((s < 0) | (s >= S))
        bad = bad | outside.to(tl.int32)
        tl.store(safe_ptr + t * KP + j, tl.where(outside, 0, s).to(tl.int32), mask=j < KP)
    tl.store(cnt_ptr + t, c.to(tl.int32))
    poisoned = tl.max(bad, 0)
    tl.store(poison_ptr + t, poisoned)
    if CHECK:
        if (poisoned != 0) | (raw < 0) | (raw > K):
            tl.atomic_max(chk_ptr, 1)


@triton.jit
def _epilogue_kernel(
    o_ptr, lse_ptr, cnt_ptr, poison_ptr, out_ptr, out_lse_ptr,
    V,
    o_st, o_sh, o_sv, lse_st, lse_sh,  # FlashMLA's o, lse
    out_st, out_sh, out_sv, olse_st, olse_sh,  # the stage's out, out_lse
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    """Head ``h`` of row ``t``: ``out = o`` (NaN when the row is poisoned) and ``out_lse = lse``, ``-inf``
    where the row has no keys (FlashMLA says ``+inf``; emptiness is the count, never the LSE's value), NaN
    when poisoned."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    poisoned = tl.load(poison_ptr + t) != 0
    empty = tl.load(cnt_ptr + t) == 0
    v = tl.arange(0, BLOCK_V)
    x = tl.load(o_ptr + t * o_st + h * o_sh + v * o_sv, mask=v < V, other=0.0)
    x = tl.where(poisoned, float("nan"), x.to(tl.float32))
    tl.store(out_ptr + t * out_st + h * out_sh + v * out_sv, x.to(out_ptr.dtype.element_ty), mask=v < V)
    lse = tl.load(lse_ptr + t * lse_st + h * lse_sh).to(tl.float32)
    lse = tl.where(empty, float("-inf"), lse)
    lse = tl.where(poisoned, float("nan"), lse)
    tl.store(out_lse_ptr + t * olse_st + h * olse_sh, lse)


_SCRATCH = threading.local()  # per thread (a SimulatedWorld rank is a thread): the prologue's buffers by shape


def _scratch(device: torch.device, T: int, KP: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The prologue's ``(indices int32 [T, KP], counts int32 [T], poisoned int32 [T])``, made once per thread,
    device and shape and reused by every later call: the hot path allocates none of them, and a CUDA graph
    that captured a call keeps reading the same addresses. Calls of one thread are ordered on its stream,
    so a call rewrites them only after the previous kernel has read them."""

    def make() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        i32 = torch.int32
        return (
            torch.empty((T, KP), dtype=i32, device=device),
            torch.empty((T,), dtype=i32, device=device),
            torch.empty((T,), dtype=i32, device=device),
        )

    return per_thread(_SCRATCH, (device, T, KP), make)


def _use_triton(device: torch.device) -> bool:
    """The fused prologue / epilogue (two launches instead of ~15 torch ops) on CUDA and under the interpreter."""
    return device.type == "cuda" or triton_interpreting()


def _prologue_torch(
    slots: torch.Tensor, counts: torch.Tensor, S: int, KP: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_prologue_kernel` in torch ops (CPU without the Triton interpreter)."""
    K = slots.shape[1]
    cnt = counts.clamp(0, K).to(torch.int32)
    used = torch.arange(K, device=slots.device) < cnt.unsqueeze(1)
    outside = used & ((slots < 0) | (slots >= S))  # on the slots as given, before narrowing
    safe = torch.nn.functional.pad(slots.masked_fill(outside, 0), (0, KP - K), value=-1).to(torch.int32)
    return safe, cnt, outside.any(1).to(torch.int32)


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
    validate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over compacted slots on FlashMLA (the attention stage's contract, :mod:`dcp_ref.stages`).

    Args:
        q: bf16 CUDA ``[T, H, 576]``, ``H`` in :data:`FLASHMLA_HEADS`.
        kv_cache: bf16 ``[S, 576]`` (or ``[S, 1, 576]``).
        slots: int32/int64 ``[T, K]``, any ``K >= 1`` (padded to a multiple of 128 for the kernel): row ``t``
            attends to ``slots[t, :counts[t]]`` (the rest is ignored).
        counts: int32 ``[T]``, ``0 <= counts[t] <= K``.
        sm_scale: softmax scale.  v_dim: must be 512.
        out: optional bf16 ``[T, H, 512]``.  out_lse: optional float32 ``[T, H]``. Neither may share
            memory with an input or with the other (``ValueError``).
        validate: ``True``: the reference's value checks (:func:`dcp_ref.attention.check_attention_slots`,
            same messages), decided by the prologue the call runs anyway: it raises a flag (the shared
            :func:`~dcp_ref.kernels._util.check_flag`) for a row the reference refuses, so a validated
            call adds **no launch**, only one host read of that flag, before the attention kernel runs
            (a bad input never reaches it; only a failing call reads more, to build the message).
            ``False`` (the default, and the one exception to the wrappers' ``validate=True``: this
            function *is* the attention stage's hot path, which ``kernels/stages.py`` runs inside the
            captured step) reads nothing on the host: counts are clamped and a row whose used slots
            leave the cache (e.g. the deinterleave stage's poison slot ``2**31 - 1``) is poisoned (NaN
            output and LSE).
    Returns:
        ``(out [T, H, 512] bf16, lse [T, H] float32)``: LSE in base e, ``-inf`` where ``counts == 0``.
    """
    validate = check_bool(validate, "validate")
    check_tensor(q, "q", dtypes=(torch.bfloat16,), ndim=3)
    check_tensor(kv_cache, "kv_cache", dtypes=(torch.bfloat16,), ndim=(2, 3), device=q.device)
    check_tensor(slots, "slots", dtypes=INT_DTYPES, ndim=2, device=q.device)
    check_tensor(counts, "counts", dtypes=INT_DTYPES, ndim=1, device=q.device)
    T, H, D = q.shape
    v_dim = check_int_scalar(v_dim, "v_dim", min_value=1)
    sm_scale = check_sm_scale(sm_scale)
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
    KP = max(cdiv(K, INDEX_WIDTH_MULTIPLE), 1) * INDEX_WIDTH_MULTIPLE
    fused = _use_triton(q.device)
    if out is not None:
        check_out(out, "out", (T, H, _DV), q.dtype, q.device)
    if out_lse is not None:
        check_out(out_lse, "out_lse", (T, H), torch.float32, q.device)
    check_no_alias(out, "out", q=q, kv_cache=kv_cache, slots=slots, counts=counts)
    check_no_alias(out_lse, "out_lse", q=q, kv_cache=kv_cache, slots=slots, counts=counts, out=out)
    check = validate and T > 0
    if check:
        check_values_readable(counts, "counts")
        check_values_readable(slots, "slots")
    if fused:
        safe, cnt, poisoned = _scratch(q.device, T, KP)
        chk = check_flag(q.device) if check else None
        if T:
            _prologue_kernel[(T,)](
                slots, counts, safe, cnt, poisoned, K, KP, S, slots.stride(0), slots.stride(1),
                BLOCK=min(max(next_pow2(KP), 16), 1024), chk_ptr=chk, CHECK=chk is not None,
            )  # fmt: skip
    else:
        safe, cnt, poisoned = _prologue_torch(slots, counts, S, KP)
        chk = ((poisoned != 0) | (counts < 0) | (counts > K)).any().view(1) if check else None
    # before the kernel: the prologue raised the flag for a row the reference refuses (a count outside [0, K], a
    # used slot outside the cache)
    raise_if_flagged(chk, lambda: check_attention_slots(slots, counts, S), "the FlashMLA prologue")
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
    if FLASHMLA_LSE_BASE != "e":  # pragma: no cover - the measured convention is base e
        lse = lse * math.log(2.0)
    out = o if out is None else out
    out_lse = torch.empty((T, H), dtype=torch.float32, device=q.device) if out_lse is None else out_lse
    if fused:
        if T:
            _epilogue_kernel[(T, H)](
                o, lse, cnt, poisoned, out, out_lse, _DV,
                o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
                out.stride(0), out.stride(1), out.stride(2), out_lse.stride(0), out_lse.stride(1),
                BLOCK_V=next_pow2(_DV),
            )  # fmt: skip
        return out, out_lse
    if out is not o:
        out.copy_(o)
    out_lse.copy_(lse)
    # Emptiness is a count of zero (FlashMLA says +inf there); never inferred from the LSE's value.
    out_lse.masked_fill_((cnt == 0).unsqueeze(1), -math.inf)
    bad = poisoned.bool()
    out_lse.masked_fill_(bad.unsqueeze(1), math.nan)
    out.masked_fill_(bad.view(T, 1, 1), math.nan)
    return out, out_lse
