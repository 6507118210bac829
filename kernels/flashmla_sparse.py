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

**Splits.** The kernel gives one CTA to 64 heads of one query token and walks all of its ``K`` slots, so a step of
``T`` tokens at ``H = 128`` fills ``2 T`` of the H200's 132 SMs (``T = 32``: 64) and a CTA's time is its whole row's
(measured: about 60 µs at ``K = 2048`` whatever ``T``). With ``splits = S`` the wrapper hands the kernel ``S T``
rows instead: token ``t``'s ``q`` repeated ``S`` times, and its ``counts[t]`` used slots dealt out evenly, row
``t S + s`` holding slots ``[s c, (s + 1) c)`` with ``c = ceil(counts[t] / S)`` — written by the prologue, which
writes every slot anyway, into the int32 buffer the kernel reads as ``[T S, K/S]`` — so a token with few used
slots in a wide row (a DCP rank's share of the ``k`` winners) splits its work too; the epilogue merges a token's
``S`` partial outputs by their LSEs (a partial with no slots weighs exactly zero, emptiness again the count).
Measured on the H200 (``benchmarks/results/attention_flashmla_splits.json``): at ``T = 8`` 61.5 µs unsplit, 30.7 with
4 splits; at ``T = 32`` 70.1 and 60.6 with 2. :data:`FLASHMLA_SPLITS` is the measured choice per CTA count.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from dcp_ref.attention import check_attention_slots, check_sm_scale
from dcp_ref.contracts import (
    INT_DTYPES,
    check_bool,
    check_int_scalar,
    check_no_alias,
    check_out,
    check_tensor,
    check_values_readable,
    triton_interpreting,
)
from dcp_ref.guard import GuardRows

from ._util import cdiv, check_flag, next_pow2, raise_if_flagged
from .guard_triton import token_verdict, verdict_args

__all__ = [
    "FLASHMLA_LSE_BASE",
    "FLASHMLA_HEADS",
    "FLASHMLA_SPLITS",
    "FlashMLAScratch",
    "flashmla_splits",
    "flashmla_unsupported",
    "sparse_mla_flashmla",
]

#: The base of the LSE that ``flash_mla_sparse_fwd`` returns (checked by tests/test_flashmla.py on a GPU).
FLASHMLA_LSE_BASE = "e"
#: Query head counts the SM90 sparse kernel takes.
FLASHMLA_HEADS = (64, 128)
_DQK, _DV = 576, 512
#: ``(most CTAs, splits)``, ascending: a call whose kernel would have at most that many CTAs unsplit
#: (``T * H / 64``) runs with that many splits of each token's slots (:func:`flashmla_splits`; past the last entry,
#: 1). From ``benchmarks/results/attention.json`` (``flashmla_splits_best``, H200, K = 2048).
FLASHMLA_SPLITS: tuple[tuple[int, int], ...] = ((2, 16), (8, 8), (32, 4), (64, 2))


#: The used slots per token :data:`FLASHMLA_SPLITS` was measured at (every slot of a ``K = 2048`` row). With fewer a
#: split measured slower, not faster (the same sweep, T = 32, H = 128: 256 used slots 18.7 µs unsplit, 31.0 with
#: 2 splits; 512 used: 26.4 and 36.5): a CTA's fixed cost outweighs the shorter walk, so a DCP rank's share of the
#: ``k`` winners (``k / W``) runs unsplit.
FLASHMLA_SPLITS_KEYS = 2048


def flashmla_splits(
    T: int, H: int = 128, keys: int = FLASHMLA_SPLITS_KEYS, table: tuple[tuple[int, int], ...] | None = None
) -> int:
    """The splits ``table`` (default :data:`FLASHMLA_SPLITS`, read at the call) plans for ``T`` query tokens of ``H``
    heads that each use about ``keys`` slots: 1 past the table's last entry, and 1 below :data:`FLASHMLA_SPLITS_KEYS`
    used slots."""
    T = check_int_scalar(T, "T", min_value=0)
    H = check_int_scalar(H, "H", min_value=1)
    keys = check_int_scalar(keys, "keys", min_value=0)
    table = FLASHMLA_SPLITS if table is None else table
    if not isinstance(table, tuple) or not all(
        isinstance(e, tuple) and len(e) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in e)
        for e in table
    ):
        raise TypeError(f"table must be a tuple of (most CTAs, splits) int pairs, got {table!r}")
    if keys < FLASHMLA_SPLITS_KEYS:
        return 1
    ctas = T * max(H // 64, 1)
    return next((s for c, s in table if ctas <= c), 1)


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
    from dcp_ref.contracts import has_module

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
    chk_ptr=None, CHECK: tl.constexpr = False, SPLITS: tl.constexpr = 1,
    g_bounds=None, g_req=None, g_starts=None, g_bt=None, g_q=None, g_w=None,
    gB=0, gM=0, g_ncols=0, g_nb=0, g_nn=1, gHi=0, gD=0,
    gs_bound=0, gs_req=0, gs_start=0, gs_bt_r=0, gs_bt_c=0, gs_qt=0, gs_qh=0, gs_qd=0, gs_wt=0, gs_wh=0,
    GUARD: tl.constexpr = False, G_BS: tl.constexpr = 1, G_HAS_STARTS: tl.constexpr = False,
    G_HAS_Q: tl.constexpr = False, G_Q_FP8: tl.constexpr = False, G_BLOCK_M: tl.constexpr = 1,
    G_BLOCK_D: tl.constexpr = 1, G_BLOCK_HI: tl.constexpr = 1,
):  # fmt: skip
    """Row ``t``: ``cnt = clamp(counts[t], 0, K)``; ``safe[t, :K] = slots[t]`` as int32, except that a used
    entry (``j < cnt``) outside ``[0, S)`` becomes slot 0 and marks the row poisoned; ``safe[t, K:KP] = -1``
    (the padding to FlashMLA's width multiple). The range test runs on the slot as given (int64 included),
    *before* the narrowing to int32, so a wide slot can never wrap into a valid one. ``SPLITS > 1``: the
    token's used slots are dealt out evenly, ``chunk = ceil(cnt / SPLITS)`` to a split: the kernel's row
    ``t SPLITS + s`` (``safe[t, s KS : (s + 1) KS]``, ``KS = KP / SPLITS``) starts with slots
    ``[s chunk, (s + 1) chunk)`` and its count is ``clamp(cnt - s chunk, 0, chunk)`` (:func:`split_layout`), so a
    row of few used slots in a wide buffer (a DCP rank's share) still splits its work; the rest is ``-1``.

    ``GUARD``: the guard stage taken in (``g_*``: :func:`~.guard_triton.verdict_args`): a token out of the step's
    contract (:func:`~.guard_triton.token_verdict`) is poisoned too, by the epilogue that poisons anyway — the
    guard's rule without its launch.

    ``CHECK`` (``validate=True``): a row that :func:`dcp_ref.attention.check_attention_slots` would refuse
    (``counts[t]`` outside ``[0, K]``, or a poisoned row) sets ``chk[0]`` to 1 with an atomic max; a good
    row writes nothing, so the validated call's value checks are this launch plus one read of ``chk``. (The
    guard's verdict never raises: out-of-contract metadata is the step's to refuse, before any stage runs.)"""
    t = tl.program_id(0).to(tl.int64)
    raw = tl.load(counts_ptr + t).to(tl.int64)
    c = tl.minimum(tl.maximum(raw, 0), K)
    bad = tl.zeros([BLOCK], tl.int32)
    chunk = split_layout(cnt_ptr, t, c, KP, SPLITS)
    for d0 in range(0, KP, BLOCK):
        d = d0 + tl.arange(0, BLOCK)  # the kernel's entry: split d // KS, its entry d % KS
        j = (d // (KP // SPLITS)) * chunk + d % (KP // SPLITS)  # the token's slot it holds
        has = (d % (KP // SPLITS) < chunk) & (j < K)
        s = tl.load(slots_ptr + t * stride_t + j * stride_k, mask=has, other=-1).to(tl.int64)
        outside = has & (j < c) & ((s < 0) | (s >= S))
        bad = bad | outside.to(tl.int32)
        tl.store(safe_ptr + t * KP + d, tl.where(outside, 0, s).to(tl.int32), mask=d < KP)
    poisoned = tl.max(bad, 0)
    if CHECK:
        if (poisoned != 0) | (raw < 0) | (raw > K):
            tl.atomic_max(chk_ptr, 1)
    if GUARD:
        ok = token_verdict(t, g_bounds, g_req, g_starts, g_bt, g_q, g_w, gB, gM, g_ncols, g_nb, g_nn, gHi, gD,
                           gs_bound, gs_req, gs_start, gs_bt_r, gs_bt_c, gs_qt, gs_qh, gs_qd, gs_wt, gs_wh,
                           G_BS, G_HAS_STARTS, G_HAS_Q, G_Q_FP8, G_BLOCK_M, G_BLOCK_D, G_BLOCK_HI)  # fmt: skip
        poisoned = poisoned | (1 - ok.to(tl.int32))
    tl.store(poison_ptr + t, poisoned)


@triton.jit
def split_layout(cnt_ptr, t, c, KP, SPLITS: tl.constexpr):
    """``chunk``, the used slots of token ``t`` (count ``c``) each of its kernel rows starts with; writes the rows'
    counts ``clamp(c - s chunk, 0, chunk)``. One split: the row as it is (``chunk = KP``, count ``c``)."""
    # (c * 0 + KP: the int64 tensor of the other branch, so that both give the index arithmetic one type)
    chunk = c * 0 + KP if SPLITS == 1 else (c + SPLITS - 1) // SPLITS
    s = tl.arange(0, SPLITS)
    tl.store(cnt_ptr + t * SPLITS + s, tl.minimum(tl.maximum(c - s * chunk, 0), chunk).to(tl.int32))
    return chunk


@triton.jit
def merge_splits(o_ptr, lse_ptr, cnt_ptr, t, h, v, V, o_st, o_sh, o_sv, lse_st, lse_sh, SPLITS: tl.constexpr):
    """``(out [BLOCK_V] float32, lse)`` of head ``h`` of token ``t`` from its ``SPLITS`` kernel rows: the
    LSE-weighted mean of the partial outputs. A row of no slots weighs exactly zero (decided by its count, not
    FlashMLA's ``+inf`` LSE); a NaN partial (NaN in ``q`` or a used key) makes the result NaN; with no slots
    at all, ``(0, -inf)``. One split is the partial itself, bit for bit."""
    r = t * SPLITS
    if SPLITS == 1:
        x = tl.load(o_ptr + r * o_st + h * o_sh + v * o_sv, mask=v < V, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + r * lse_st + h * lse_sh).to(tl.float32)
        return x, tl.where(tl.load(cnt_ptr + r) == 0, float("-inf"), lse)
    m = float("-inf")
    for s in tl.static_range(SPLITS):  # the largest LSE of a row with slots (NaN kept)
        lse_s = tl.load(lse_ptr + (r + s) * lse_st + h * lse_sh).to(tl.float32)
        lse_s = tl.where(tl.load(cnt_ptr + r + s) > 0, lse_s, float("-inf"))
        m = tl.maximum(m, lse_s, propagate_nan=tl.PropagateNan.ALL)
    base = tl.where(m == float("-inf"), 0.0, m)  # every split empty: weights 0, not exp(-inf - -inf)
    acc = tl.zeros(v.shape, tl.float32)
    den = 0.0
    for s in tl.static_range(SPLITS):
        lse_s = tl.load(lse_ptr + (r + s) * lse_st + h * lse_sh).to(tl.float32)
        used = tl.load(cnt_ptr + r + s) > 0
        w = tl.where(used, tl.exp(lse_s - base), 0.0)
        x = tl.load(o_ptr + (r + s) * o_st + h * o_sh + v * o_sv, mask=v < V, other=0.0).to(tl.float32)
        acc += w * tl.where(used, x, 0.0)  # an empty split's output is never read into the sum
        den += w
    out = tl.where(den > 0, acc / den, acc)
    return out, tl.where(den > 0, base + tl.log(tl.where(den > 0, den, 1.0)), m)


@triton.jit
def _epilogue_kernel(
    o_ptr, lse_ptr, cnt_ptr, poison_ptr, out_ptr, out_lse_ptr,
    V, HG, LHG,
    o_st, o_sh, o_sv, lse_st, lse_sh,  # FlashMLA's o, lse
    out_st, out_sg, out_sh, out_sv, olse_st, olse_sg, olse_sh,  # out (heads in groups of HG), out_lse (of LHG)
    BLOCK_V: tl.constexpr, SPLITS: tl.constexpr = 1,
):  # fmt: skip
    """Head ``h`` of token ``t``: ``out`` and ``out_lse`` from its kernel rows (:func:`merge_splits`), ``-inf``
    where the token has no keys (FlashMLA says ``+inf``; emptiness is the count, never the LSE's value), both NaN
    when poisoned. Head ``h`` is written at group ``h // HG``, head ``h % HG`` of it (one group: ``HG = H``; the LSE
    likewise by ``LHG``), so the output can land straight in a layout a collective sends (``[W, T, H/W, v]``)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    poisoned = tl.load(poison_ptr + t) != 0
    v = tl.arange(0, BLOCK_V)
    x, lse = merge_splits(o_ptr, lse_ptr, cnt_ptr, t, h, v, V, o_st, o_sh, o_sv, lse_st, lse_sh, SPLITS)
    x = tl.where(poisoned, float("nan"), x)
    tl.store(out_ptr + t * out_st + (h // HG) * out_sg + (h % HG) * out_sh + v * out_sv,
             x.to(out_ptr.dtype.element_ty), mask=v < V)  # fmt: skip
    tl.store(out_lse_ptr + t * olse_st + (h // LHG) * olse_sg + (h % LHG) * olse_sh,
             tl.where(poisoned, float("nan"), lse))  # fmt: skip


@triton.jit
def _queries_kernel(src_ptr, dst_ptr, D, HG, s_t, s_g, s_h, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program ``(t, h)``: head ``h`` of query ``t`` (group ``h // HG``, head ``h % HG`` of it, through the source's
    strides) into the kernel's rows ``t SPLITS + s`` for every split ``s`` (``[T SPLITS, H, D]``, contiguous): the
    query's one copy, its heads regrouped and repeated per split in the same pass."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    H = tl.num_programs(1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    x = tl.load(src_ptr + t * s_t + (h // HG) * s_g + (h % HG) * s_h + d, mask=d < D)
    for s in tl.static_range(SPLITS):
        tl.store(dst_ptr + ((t * SPLITS + s) * H + h) * D + d, x, mask=d < D)


class FlashMLAScratch:
    """The buffers of :func:`sparse_mla_flashmla`'s prologue (and its split queries), by shape, owned by whoever
    holds this object: the attention stage a :class:`~dcp_ref.step.PlannedStep` planned (one per step, so one per
    rank of a SimulatedWorld), or nobody (a direct call without ``workspace=`` makes a fresh one: nothing cached).

    Each buffer is made on the first call of its shape and reused by every later call: the hot path allocates
    none of them, and a CUDA graph that captured a call keeps reading the same addresses for as long as the
    object lives. Calls through one object are ordered on one stream, so a call rewrites them only after the
    previous kernel has read them.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple, Any] = {}

    def prologue(
        self, device: torch.device, T: int, KP: int, splits: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(indices int32 [T, KP], counts int32 [T * splits], poisoned int32 [T])``."""
        key = ("prologue", device, T, KP, splits)
        bufs = self._bufs.get(key)
        if bufs is None:
            i32 = torch.int32
            bufs = self._bufs[key] = (
                torch.empty((T, KP), dtype=i32, device=device),
                torch.empty((T * splits,), dtype=i32, device=device),
                torch.empty((T,), dtype=i32, device=device),
            )
        return bufs

    def kernel_queries(self, q: torch.Tensor, splits: int) -> torch.Tensor:
        """The query as the kernel reads it, ``[T * splits, H, D]`` contiguous (row ``t * splits + s`` = query
        ``t``), from ``q [T, H, D]`` or ``[T, G, H/G, D]`` (heads in groups, any strides, ``D`` contiguous), in this
        object's buffer of that shape: one copy (:func:`_queries_kernel`; torch ops off the Triton path)."""
        T, D = q.shape[0], q.shape[-1]
        H = q.shape[1] * (q.shape[2] if q.dim() == 4 else 1)
        key = ("q", q.device, q.dtype, T, H, D, splits)
        buf = self._bufs.get(key)
        if buf is None:
            buf = self._bufs[key] = q.new_empty((T * splits, H, D))
        if not _use_triton(q.device):
            buf.view(T, splits, H, D).copy_(q.reshape(T, 1, H, D).expand(T, splits, H, D))
            return buf
        g4 = q if q.dim() == 4 else q.unsqueeze(1)  # one group of H heads
        if T:
            _queries_kernel[(T, H)](
                g4, buf, D, g4.shape[2], g4.stride(0), g4.stride(1), g4.stride(2), SPLITS=splits,
                BLOCK_D=next_pow2(D), num_warps=2,
            )  # fmt: skip
        return buf


def _use_triton(device: torch.device) -> bool:
    """The fused prologue / epilogue (two launches instead of ~15 torch ops) on CUDA and under the interpreter."""
    return device.type == "cuda" or triton_interpreting()


def _prologue_torch(
    slots: torch.Tensor, counts: torch.Tensor, S: int, KP: int, splits: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_prologue_kernel` in torch ops (CPU without the Triton interpreter)."""
    K = slots.shape[1]
    cnt = counts.clamp(0, K).to(torch.int32)
    used = torch.arange(K, device=slots.device) < cnt.unsqueeze(1)
    outside = used & ((slots < 0) | (slots >= S))  # on the slots as given, before narrowing
    safe = torch.nn.functional.pad(slots.masked_fill(outside, 0), (0, KP - K), value=-1).to(torch.int32)
    if splits == 1:
        return safe, cnt, outside.any(1).to(torch.int32)
    chunk = (cnt.long() + splits - 1) // splits  # [T]: the used slots dealt out evenly (see _prologue_kernel)
    s = torch.arange(splits, device=slots.device)
    per_split = (cnt.long().unsqueeze(1) - s * chunk.unsqueeze(1)).clamp(min=0).minimum(chunk.unsqueeze(1))
    d = torch.arange(KP, device=slots.device)
    j = (d // (KP // splits)) * chunk.unsqueeze(1) + d % (KP // splits)  # [T, KP]: the slot entry d holds
    has = (d % (KP // splits) < chunk.unsqueeze(1)) & (j < K)
    dealt = torch.where(has, safe.long().gather(1, j.clamp(max=KP - 1)), -1).to(torch.int32)
    return dealt, per_split.reshape(-1).to(torch.int32), outside.any(1).to(torch.int32)


def _merge_torch(
    o: torch.Tensor, lse: torch.Tensor, cnt: torch.Tensor, T: int, S: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_splits` in torch ops: ``o [T S, H, V]``, ``lse [T S, H]``, ``cnt [T S]`` -> ``(out [T, H, V]
    (float32; ``o`` itself when ``S == 1``), lse [T, H])``, the LSE ``-inf`` where a token has no keys."""
    H, V = o.shape[1], o.shape[2]
    used = (cnt.view(T, S) > 0).unsqueeze(2)
    if S == 1:  # the partial itself (the caller copies it only into a buffer of its own)
        return o, lse.float().masked_fill(~used[:, 0], -math.inf)
    l_s = lse.float().view(T, S, H).masked_fill(~used, -math.inf)
    m = l_s.amax(1)  # NaN kept
    base = m.masked_fill(m == -math.inf, 0.0)
    w = torch.exp(l_s - base.unsqueeze(1)).masked_fill(~used, 0.0)
    x = o.float().view(T, S, H, V).masked_fill(~used.unsqueeze(3), 0.0)
    acc, den = (w.unsqueeze(3) * x).sum(1), w.sum(1)
    out = torch.where(den.unsqueeze(2) > 0, acc / den.unsqueeze(2), acc)
    return out, torch.where(den > 0, base + torch.log(den), m)


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
    splits: int = 1,
    workspace: FlashMLAScratch | None = None,
    guard: GuardRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA over compacted slots on FlashMLA (the attention stage's contract, :mod:`dcp_ref.stages`).

    Args:
        q: bf16 CUDA ``[T, H, 576]``, ``H`` in :data:`FLASHMLA_HEADS`; or ``[T, G, H/G, 576]``, its heads in ``G``
            groups (head ``h`` at ``[t, h // (H/G), h % (H/G)]``, any strides with the last dimension contiguous:
            the query all-gathered over heads, ``[W, T, H/W, D]`` transposed, read without a copy of its own).
        kv_cache: bf16 ``[S, 576]`` (or ``[S, 1, 576]``).
        slots: int32/int64 ``[T, K]``, any ``K >= 1`` (padded to a multiple of 128 for the kernel): row ``t``
            attends to ``slots[t, :counts[t]]`` (the rest is ignored).
        counts: int32 ``[T]``, ``0 <= counts[t] <= K``.
        sm_scale: softmax scale.  v_dim: must be 512.
        out: optional bf16 ``[T, H, 512]``, or ``[T, G, H/G, 512]`` (heads in groups, as ``q``: e.g. the
            all-to-all's send buffer ``[W, T, H/W, v]`` transposed, written in place of a copy into it).
            out_lse: optional float32 ``[T, H]`` or ``[T, G, H/G]``. Neither may share memory with an input or
            with the other (``ValueError``).
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
        splits: a power of two: each token's used slots dealt out evenly to this many rows of the kernel, merged
            by LSE afterwards (the module's **Splits**; a planned step takes :func:`flashmla_splits`). Each row is
            at least the kernel's width multiple (128) wide, so ``K`` is padded to ``128 * splits``.
        workspace: a :class:`FlashMLAScratch` whose buffers the call uses (the planned attention stage's: made
            once per shape, so a captured graph keeps reading them); ``None``: this call's own.
        guard: the guard stage taken in (:class:`dcp_ref.guard.GuardRows`): tokens out of the step's contract come
            out NaN as :func:`dcp_ref.guard.reference_guard` would make them, decided in the prologue and written by
            the epilogue this call runs anyway (no launch of its own). Checked as the guard checks its inputs.
    Returns:
        ``(out, lse)``: ``out`` bf16 ``[T, H, 512]`` (or the given ``out``, in its layout), ``lse`` float32
        ``[T, H]`` (or the given ``out_lse``): LSE in base e, ``-inf`` where ``counts == 0``.
    """
    validate = check_bool(validate, "validate")
    check_tensor(q, "q", dtypes=(torch.bfloat16,), ndim=(3, 4))
    check_tensor(kv_cache, "kv_cache", dtypes=(torch.bfloat16,), ndim=(2, 3), device=q.device)
    check_tensor(slots, "slots", dtypes=INT_DTYPES, ndim=2, device=q.device)
    check_tensor(counts, "counts", dtypes=INT_DTYPES, ndim=1, device=q.device)
    T, D = q.shape[0], q.shape[-1]
    H = q.shape[1] * (q.shape[2] if q.dim() == 4 else 1)
    if q.stride(-1) != 1:
        raise ValueError(f"q must be contiguous in its last dimension, got strides {q.stride()}")
    v_dim = check_int_scalar(v_dim, "v_dim", min_value=1)
    splits = check_int_scalar(splits, "splits", min_value=1)
    if splits & (splits - 1):
        raise ValueError(f"splits must be a power of two, got {splits}")
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
    KP = max(cdiv(K, INDEX_WIDTH_MULTIPLE * splits), 1) * INDEX_WIDTH_MULTIPLE * splits
    fused = _use_triton(q.device)
    if out is not None:
        _check_grouped_out(out, "out", T, H, (_DV,), q.dtype, q.device)
    if out_lse is not None:
        _check_grouped_out(out_lse, "out_lse", T, H, (), torch.float32, q.device)
    check_no_alias(out, "out", q=q, kv_cache=kv_cache, slots=slots, counts=counts)
    check_no_alias(out_lse, "out_lse", q=q, kv_cache=kv_cache, slots=slots, counts=counts, out=out)
    if workspace is None:
        workspace = FlashMLAScratch()  # this call's buffers only
    elif not isinstance(workspace, FlashMLAScratch):
        raise TypeError(f"workspace must be a FlashMLAScratch or None, got {type(workspace).__name__}")
    if guard is not None:
        if not isinstance(guard, GuardRows):
            raise TypeError(f"guard must be a GuardRows or None, got {type(guard).__name__}")
        guard.check(T, q.device, {"out": out, "out_lse": out_lse})  # the guard's checks and messages
    check = validate and T > 0
    if check:
        check_values_readable(counts, "counts")
        check_values_readable(slots, "slots")
    if fused:
        safe, cnt, poisoned = workspace.prologue(q.device, T, KP, splits)
        chk = check_flag(q.device) if check else None
        if T:
            _prologue_kernel[(T,)](
                slots, counts, safe, cnt, poisoned, K, KP, S, slots.stride(0), slots.stride(1),
                BLOCK=min(max(next_pow2(KP), 16), 1024), chk_ptr=chk, CHECK=chk is not None, SPLITS=splits,
                **_guard_launch_args(guard),
            )  # fmt: skip
    else:
        safe, cnt, poisoned = _prologue_torch(slots, counts, S, KP, splits)
        chk = ((poisoned != 0) | (counts < 0) | (counts > K)).any().view(1) if check else None
    # before the kernel: the prologue raised the flag for a row the reference refuses (a count outside [0, K], a
    # used slot outside the cache)
    raise_if_flagged(chk, lambda: check_attention_slots(slots, counts, S), "the FlashMLA prologue")
    # one kernel row per (token, split): the same int32 buffer read as [T * splits, KP / splits]
    o, _max_logits, lse = _flash_mla().flash_mla_sparse_fwd(
        q if splits == 1 and q.dim() == 3 and q.is_contiguous() else workspace.kernel_queries(q, splits),
        kv_cache.reshape(-1, 1, _DQK),
        safe.view(T * splits, 1, KP // splits),
        sm_scale,
        d_v=_DV,
        topk_length=cnt,
        use_legacy=True,
    )
    lse = lse.reshape(T * splits, H)
    if FLASHMLA_LSE_BASE != "e":  # pragma: no cover - the measured convention is base e
        lse = lse * math.log(2.0)
    if out is None:  # one split: the epilogue rewrites FlashMLA's own output in place
        out = o if splits == 1 else torch.empty((T, H, _DV), dtype=q.dtype, device=q.device)
    out_lse = torch.empty((T, H), dtype=torch.float32, device=q.device) if out_lse is None else out_lse
    out4 = out if out.dim() == 4 else out.unsqueeze(1)  # [T, G, H/G, v]: one group of H heads
    lse3 = out_lse if out_lse.dim() == 3 else out_lse.unsqueeze(1)
    if fused:
        if T:
            _epilogue_kernel[(T, H)](
                o, lse, cnt, poisoned, out4, lse3, _DV, out4.shape[2], lse3.shape[2],
                o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1),
                out4.stride(0), out4.stride(1), out4.stride(2), out4.stride(3),
                lse3.stride(0), lse3.stride(1), lse3.stride(2),
                BLOCK_V=next_pow2(_DV), SPLITS=splits,
            )  # fmt: skip
        return out, out_lse
    # Emptiness is a count of zero (FlashMLA says +inf there); never inferred from the LSE's value.
    merged, merged_lse = _merge_torch(o, lse, cnt, T, splits)
    bad = poisoned.bool()
    if guard is not None:
        bad = bad | ~guard.row_ok()
    merged = merged.masked_fill(bad.view(T, 1, 1), math.nan)
    merged_lse = merged_lse.masked_fill(bad.unsqueeze(1), math.nan)
    out.copy_(merged.view(out.shape))  # [T, H, v] contiguous: views as [T, H, v] or [T, G, H/G, v]
    out_lse.copy_(merged_lse.view(out_lse.shape))
    return out, out_lse


def _check_grouped_out(
    buf: object, name: str, T: int, H: int, tail: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> None:
    """An output buffer ``[T, H, *tail]``, or ``[T, G, H/G, *tail]`` with its heads in ``G`` groups (``G`` dividing
    ``H``): :func:`~dcp_ref.contracts.check_out`'s checks and messages, for either layout."""
    if isinstance(buf, torch.Tensor) and buf.dim() == 3 + len(tail):
        G = buf.shape[1]
        if G < 1 or H % G:
            raise ValueError(f"{name}'s head groups must divide the H={H} heads, got {tuple(buf.shape)}")
        check_out(buf, name, (T, G, H // G, *tail), dtype, device)
    else:
        check_out(buf, name, (T, H, *tail), dtype, device)


def _guard_launch_args(guard: GuardRows | None) -> dict[str, Any]:
    """The prologue's ``g_*`` keyword arguments for the guard taken in (none: ``GUARD`` off)."""
    if guard is None:
        return {}
    va = verdict_args(guard)
    names = ("g_bounds", "g_req", "g_starts", "g_bt", "g_q", "g_w")
    scalars = ("gB", "gM", "g_ncols", "g_nb", "g_nn", "gHi", "gD", "gs_bound", "gs_req", "gs_start", "gs_bt_r",
               "gs_bt_c", "gs_qt", "gs_qh", "gs_qd", "gs_wt", "gs_wh")  # fmt: skip
    return (dict(zip(names, va.tensors, strict=True)) | dict(zip(scalars, va.scalars, strict=True))
            | {"GUARD": True} | {"G_" + k: v for k, v in va.constexprs.items()})  # fmt: skip
