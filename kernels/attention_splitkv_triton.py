"""Triton kernel: split-KV sparse MLA decode over compacted slots (the attention stage).

Why split the keys
------------------
FlashMLA's SM90 sparse kernel runs one CTA per (token, 64 heads): at T = 1, H = 128 two of the
H200's 132 SMs work, whatever K is. Here the keys of every row are also split over CTAs:

    phase 1  program (t, head group g, split s): the row's slots [s*L, min((s+1)*L, count)) in
             blocks of BLOCK_N gathered cache rows; QK^T over all Dqk dims (two dots: the Dv value
             dims + the Dqk - Dv RoPE dims, fp32 accumulation), online softmax in base 2 with
             sm_scale*log2(e) folded in, P@V over the Dv value dims. It writes its *normalised*
             partial output o_s [BLOCK_H, Dv] and its partial LSE lse_s (base 2) to an fp32 workspace.
    phase 2  program (t, head block, value block): out = sum_s w_s o_s / sum_s w_s with
             w_s = 2^(lse_s - max_s lse_s); lse = log(sum_s 2^lse_s) (returned in base e).

``L`` (keys per split) and the number of splits depend on the *shapes* only (T, H, K): nothing is
read on the host, and a row with fewer keys simply has empty splits. An empty split is never
written and never read: phase 2 knows from the row's count how many splits hold keys
(``cdiv(count, L)``), so it contributes exactly 0 (no ``-inf - -inf``). With one split the first
kernel writes the final output itself (one launch).

The stage contract (:class:`dcp_ref.stages.AttentionStage`), decided on the device
------------------------------------------------------------------------------------
* ``counts`` are clamped to ``[0, K]``; a row with no key gives output 0 and LSE ``-inf`` (from the
  count, never from a value), and no other row gives ``-inf``: a non-empty row whose scores are all
  ``-inf`` (infinite data) gives NaN.
* A *used* slot (``j < count``) outside ``[0, S)`` is never read; it poisons its row: output and
  LSE NaN. The test runs on the slot as given (int64 included) before any narrowing, so a wide
  slot can never wrap into a valid one. The split holding it writes a NaN LSE, which phase 2
  propagates (a NaN weight is never "empty").
* NaN in ``q[t, h]`` makes exactly ``(t, h)`` NaN; NaN in an attended cache row makes every head
  of the rows that attend it NaN (its score is NaN); unread rows never leak (masked loads, and a
  weight of 0 *selects away* a partial instead of multiplying it).

Registers, shared memory and the defaults
-----------------------------------------
The accumulator of a program is ``[BLOCK_H, Dv]`` fp32: 128 KiB at BLOCK_H = 64, Dv = 512, i.e. 128
registers per thread with 8 warps (one wgmma warpgroup of 64 rows per half of the value dims), so
BLOCK_H = 64 runs 8 warps; BLOCK_H = 16/32 use MMAv2. The query tile (loop invariant, ``BLOCK_H x Dqk``
bf16: 72 KiB at 64 heads) and ``num_stages`` gathered key tiles (``BLOCK_N x Dqk`` bf16: 36 KiB at 32
keys) share the 227 KiB of shared memory, so BLOCK_H = 64 takes BLOCK_N = 32. The same key tile feeds
both dots (its first Dv columns are the values). Triton's pipeliner needs one stage per level of
indirection (slots -> gathered rows): only ``num_stages >= 3`` prefetches the next tile.

Measured on the H200 (Triton 3.6, CUDA-graph replay; ``benchmarks/results/attention.json``): the kernel is
latency-bound at small T — a program's fixed cost (query load, two dependent gather round trips, the partial
store) is several µs at one program per SM (186-252 registers x 256 threads; ncu: 12 % occupancy, 6-7
cycles per issued instruction) — so the best split count gives about one program per SM with one or two key
blocks each (:func:`_default_splits`), and the block sizes follow the regime (:func:`_default_config`).
H = 128, K = 2048 (2026-12-02; FlashMLA bf16 at its planned splits / FlashMLA FP8 decode beside): T = 1 14.6 µs
(17.4 / 20.6), T = 8 41.6 (31.1 / 29.1), T = 32 125 (60.8 / 66.1), T = 128 433 (151 / 192); a TP rank's 16
heads at T = 1: 8.8 µs (FlashMLA refuses H = 16). From T = 4 split FlashMLA is faster: the step picks per shape
(``dcp_ref.kernels.stages.SPLITKV_MAX_TOKENS``).

Launch shapes, workspace and everything else are planned once per shape (:func:`splitkv_plan`,
:func:`workspace_for`); with ``validate=False`` and a planned workspace a call allocates nothing
and never synchronises: capturable in a CUDA graph. Under ``TRITON_INTERPRET=1`` the kernels run
on the CPU (the tests).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dcp_ref.attention import check_sm_scale
from dcp_ref.contracts import (
    INT_DTYPES,
    check_bool,
    check_device,
    check_int_scalar,
    check_no_aliases,
    check_out,
    check_same_device,
    check_tensor,
    check_values_readable,
    triton_interpreting,
)

from ._util import cdiv, check_flag, next_pow2, raise_if_flagged, sm_count

__all__ = [
    "SPLITKV_DTYPES",
    "NOMINAL_SM_COUNT",
    "TUNING_CONFIGS",
    "SplitKVPlan",
    "splitkv_plan",
    "workspace_for",
    "kv_rows_view",
    "sparse_mla_splitkv",
    "splitkv_attention",
    "splitkv_unsupported",
    "load_q_tile",
    "load_slot_block",
    "gather_kv_block",
    "mma",
    "online_softmax_update",
    "finish_rows",
    "combine_splits",
    "store_final",
    "splitkv_partial_kernel",
    "splitkv_combine_kernel",
]

#: Query / cache dtypes the kernel takes (fp32 runs IEEE fp32 dots: for tests and small checks).
SPLITKV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Launch configurations ``(block_h, block_n, num_warps, num_stages)`` worth trying (``bench_attention.py``
#: sweeps them x ``num_splits``; the GPU tests run each): all compile for sm_90a with at most a few bytes
#: of spilled registers (ptxas, Triton 3.9: 56 bytes at 64 heads x 32 keys, 2 stages).
TUNING_CONFIGS = (
    (16, 32, 4, 2),
    (16, 32, 4, 3),
    (16, 64, 8, 2),
    (32, 32, 8, 2),
    (32, 64, 8, 2),
    (32, 32, 4, 2),
    (64, 16, 8, 3),
    (64, 32, 8, 2),
    (64, 32, 8, 3),
    (32, 32, 8, 3),
)
_COMBINE_TILE = 2048  # fp32 elements of phase 2's [splits, heads, values] tile (32 registers per thread, 2 warps)
#: SMs assumed when the tensors are not on a GPU (the interpreter): an H200's, so that a CPU plan is
#: the plan the GPU would make.
NOMINAL_SM_COUNT = 132

LN2_C: tl.constexpr = tl.constexpr(math.log(2.0))


# ---- the @triton.jit helpers ---------------------------------------------------------------------------
@triton.jit
def load_q_tile(
    q_ptr, t, heads, hmask, s_qt, s_qh, s_qd, COL0: tl.constexpr, NCOLS: tl.constexpr, BLOCK_D: tl.constexpr
):
    """``q[t, heads, COL0 : COL0 + NCOLS]`` as a ``[BLOCK_H, BLOCK_D]`` tile (0 outside: adds nothing to a dot)."""
    d = tl.arange(0, BLOCK_D)
    ptrs = q_ptr + t * s_qt + heads[:, None].to(tl.int64) * s_qh + (COL0 + d)[None, :].to(tl.int64) * s_qd
    return tl.load(ptrs, mask=hmask[:, None] & (d < NCOLS)[None, :], other=0.0)


@triton.jit
def load_slot_block(slots_ptr, t, offs, valid, s_st, s_sk, S, KV_BS, s_kvb, s_kvr, PAGED: tl.constexpr):
    """The cache addresses of row ``t``'s slots at positions ``offs`` (``valid``: ``offs`` < the split's end).

    Returns ``(row_off int64 [BLOCK_N], ok, bad)``: ``ok`` = used and inside ``[0, S)`` (read), ``bad`` =
    used and outside (never read; poisons the row). The range test runs on the slot as stored (int64
    stays int64). ``PAGED``: flat slot ``s`` is row ``s % KV_BS`` of block ``s // KV_BS`` (blocks of any
    stride); else row ``s`` at ``s * s_kvr`` (no 64-bit division)."""
    s = tl.load(slots_ptr + t * s_st + offs.to(tl.int64) * s_sk, mask=valid, other=0).to(tl.int64)
    inside = (s >= 0) & (s < S)
    ok = valid & inside
    bad = valid & (inside == 0)
    s = tl.where(ok, s, 0)
    if PAGED:
        row_off = (s // KV_BS) * s_kvb + (s % KV_BS) * s_kvr
    else:
        row_off = s * s_kvr
    return row_off, ok, bad


@triton.jit
def gather_kv_block(kv_ptr, row_off, ok, s_kvd, COL0: tl.constexpr, NCOLS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Columns ``[COL0, COL0 + NCOLS)`` of the gathered cache rows, ``[BLOCK_N, BLOCK_D]``; rows not read are 0
    (a masked load: a row that is not ours is never touched, so its NaN cannot leak through ``0 * NaN``)."""
    d = tl.arange(0, BLOCK_D)
    ptrs = kv_ptr + row_off[:, None] + (COL0 + d)[None, :].to(tl.int64) * s_kvd
    return tl.load(ptrs, mask=ok[:, None] & (d < NCOLS)[None, :], other=0.0)


@triton.jit
def mma(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """``a @ b + acc`` with fp32 accumulation. ``UPCAST``: the operands are converted to fp32 first (exact for
    16-bit floats): Triton's interpreter computes bf16 ``tl.dot`` wrongly (3.9, measured), so under
    ``TRITON_INTERPRET=1`` bf16 tiles are multiplied as the fp32 numbers they are."""
    if UPCAST:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        r = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return r


@triton.jit
def online_softmax_update(m_i, l_i, qk, valid):
    """One block of base-2 scores ``qk [BLOCK_H, BLOCK_N]`` (already scaled by sm_scale*log2 e) into the
    running max ``m_i`` and sum ``l_i``; returns ``(m_new, l_new, alpha, p)`` with ``acc`` to be rescaled by
    ``alpha`` before ``+= p @ V``. Positions not ``valid`` weigh exactly 0. A running max still ``-inf`` (all
    scores so far ``-inf``: infinite data) is replaced by 0 for the exponentials, so ``-inf - -inf`` never
    makes a NaN that the data did not contain."""
    qk = tl.where(valid[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_new = l_i * alpha + tl.sum(p, 1)
    return m_new, l_new, alpha, p


@triton.jit
def finish_rows(m_i, l_i, acc, poisoned):
    """A program's rows at the end of its keys: ``(o = acc / l, lse2 = m + log2 l)`` (base 2).

    ``l == 0`` (no key, or every score ``-inf``) gives ``o = 0`` and ``lse2 = -inf`` (the caller decides
    what that means for a non-empty row); ``poisoned`` (a used slot outside the cache) gives NaN for both;
    a NaN score has already made ``l`` NaN, hence both NaN."""
    zero = l_i == 0
    l_safe = tl.where(zero, 1.0, l_i)
    o = acc / l_safe[:, None]
    o = tl.where(zero[:, None], 0.0, o)
    lse2 = tl.where(zero, float("-inf"), m_i + tl.log2(l_safe))
    o = tl.where(poisoned, float("nan"), o)
    lse2 = tl.where(poisoned, float("nan"), lse2)
    return o, lse2


@triton.jit
def combine_splits(
    ws_o_ptr, ws_lse_ptr, t, heads, hmask, v, vmask, n_act, H, NUM_SPLITS, DV: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """LSE-weighted sum of the first ``n_act`` splits' partials of row ``t`` (the others hold no key and are
    not read). Returns ``(acc [BLOCK_HC, BLOCK_VC], m_safe, total)`` in base 2: ``acc = sum_s w_s o_s``,
    ``w_s = 2^(lse_s - m_safe)``, ``total = sum_s w_s``. A NaN or ``+inf`` partial LSE (a poisoned split,
    NaN data) is corrupt, never empty: its weight is NaN, so the head's output and LSE are NaN. A weight of
    exactly 0 *selects away* its partial (``0 * NaN`` would leak).

    All splits are loaded as one ``[BLOCK_S, BLOCK_HC, BLOCK_VC]`` tile: one memory round trip instead of one
    per split (a loop over splits waits for each load in turn; this kernel is latency-bound at small T)."""
    sp = tl.arange(0, BLOCK_S)
    smask = sp < n_act
    rows = (t * NUM_SPLITS + sp).to(tl.int64) * H  # [BLOCK_S]: offset of (t, split, head 0)
    x = tl.load(ws_lse_ptr + rows[:, None] + heads[None, :], mask=smask[:, None] & hmask[None, :], other=float("-inf"))
    corrupt = (x != x) | (x == float("inf"))
    m = tl.max(tl.where(corrupt, float("-inf"), x), 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(tl.where(corrupt, float("-inf"), x) - m_safe[None, :])  # 0 for the splits past n_act
    w = tl.where(corrupt, float("nan"), w)  # [BLOCK_S, BLOCK_HC]
    offs = (rows[:, None, None] + heads[None, :, None]) * DV + v[None, None, :]
    mask = smask[:, None, None] & hmask[None, :, None] & vmask[None, None, :]
    o = tl.load(ws_o_ptr + offs, mask=mask, other=0.0)
    w3 = w[:, :, None]
    acc = tl.sum(tl.where(w3 == 0, 0.0, w3 * o), 0)
    total = tl.sum(w, 0)
    return acc, m_safe, total


@triton.jit
def store_final(out_ptr, lse_ptr, t, heads, hmask, v, vmask, o, lse2, nonempty, s_ot, s_oh, s_ov, s_lt, s_lh, lse_mask):
    """The stage's outputs for ``(t, heads)``: an empty row (``nonempty`` false) gives 0 and ``-inf``; a
    non-empty row whose ``lse2`` is ``-inf`` (no finite score) gives NaN; else ``o`` and ``lse2 * ln 2``.
    The LSE is stored where ``lse_mask`` (one program per head writes it)."""
    dead = nonempty & (lse2 == float("-inf"))
    o = tl.where(dead[:, None], float("nan"), o)
    o = tl.where(nonempty, o, 0.0)
    lse = tl.where(dead, float("nan"), lse2 * LN2_C)
    lse = tl.where(nonempty, lse, float("-inf"))
    optrs = out_ptr + t * s_ot + heads[:, None].to(tl.int64) * s_oh + v[None, :].to(tl.int64) * s_ov
    tl.store(optrs, o.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & vmask[None, :])
    tl.store(lse_ptr + t * s_lt + heads.to(tl.int64) * s_lh, lse, mask=lse_mask)


# ---- the kernels -------------------------------------------------------------------------------------
# Sizes that only bound loops and masks are not specialised (a new compile per "== 1" / "% 16" pattern of
# T, H, K, splits ... would multiply the compiles of a sweep); strides are (alignment, vector loads).
_NO_SPEC = ["H", "K", "S", "KV_BS", "NUM_SPLITS", "SPLIT_LEN", "HEAD_GROUPS"]


@triton.jit(do_not_specialize=_NO_SPEC)
def splitkv_partial_kernel(
    q_ptr, kv_ptr, slots_ptr, counts_ptr, ws_o_ptr, ws_lse_ptr, out_ptr, lse_ptr,
    H, K, S, KV_BS, scale_log2, NUM_SPLITS, SPLIT_LEN, HEAD_GROUPS,
    s_qt, s_qh, s_qd, s_kvb, s_kvr, s_kvd, s_st, s_sk,  # q, kv rows, slots
    s_ot, s_oh, s_ov, s_lt, s_lh,  # out, lse
    DV: tl.constexpr, DR: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_DR: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FINAL: tl.constexpr, PAGED: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    chk_ptr=None, CHECK: tl.constexpr = False,
):  # fmt: skip
    """Phase 1: program ``(head group, split, token)`` (head group fastest: the programs that gather the same
    rows run together and share them through L2). ``FINAL`` (one split): write the stage's outputs directly.

    ``CHECK`` (``validate=True``): what :func:`dcp_ref.attention.check_attention_slots` refuses sets ``chk[0]``
    to 1 with an atomic max — a count outside ``[0, K]`` (seen by program ``(0, 0, t)``, before an empty split
    returns) or a used slot outside ``[0, S)`` (seen by the split that holds it: every used slot is in exactly
    one non-empty split, whose programs poison the row). A good row writes nothing."""
    pid = tl.program_id(0)
    g = pid % HEAD_GROUPS
    rest = pid // HEAD_GROUPS
    sp = rest % NUM_SPLITS
    t = (rest // NUM_SPLITS).to(tl.int64)
    raw = tl.load(counts_ptr + t).to(tl.int64)
    cnt = tl.minimum(tl.maximum(raw, 0), K)
    if CHECK:
        if (g == 0) & (sp == 0) & ((raw < 0) | (raw > K)):
            tl.atomic_max(chk_ptr, 1)
    start = sp.to(tl.int64) * SPLIT_LEN
    end = tl.minimum(start + SPLIT_LEN, cnt)
    if not FINAL:
        if start >= end:
            return  # an empty split: never written, never read (phase 2 counts the splits that hold keys)

    heads = g * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < H
    q_v = load_q_tile(q_ptr, t, heads, hmask, s_qt, s_qh, s_qd, 0, DV, BLOCK_DV)
    if DR > 0:
        q_r = load_q_tile(q_ptr, t, heads, hmask, s_qt, s_qh, s_qd, DV, DR, BLOCK_DR)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], dtype=tl.float32)
    bad_any = tl.zeros([BLOCK_N], dtype=tl.int32)
    for j0 in range(start, end, BLOCK_N):
        offs = j0 + tl.arange(0, BLOCK_N)
        valid = offs < end
        row_off, ok, bad = load_slot_block(slots_ptr, t, offs, valid, s_st, s_sk, S, KV_BS, s_kvb, s_kvr, PAGED)
        bad_any = bad_any | bad.to(tl.int32)
        kv_v = gather_kv_block(kv_ptr, row_off, ok, s_kvd, 0, DV, BLOCK_DV)  # [BLOCK_N, BLOCK_DV]: keys and values
        qk = mma(q_v, tl.trans(kv_v), None, DOT_PRECISION, UPCAST)
        if DR > 0:
            kv_r = gather_kv_block(kv_ptr, row_off, ok, s_kvd, DV, DR, BLOCK_DR)
            qk = mma(q_r, tl.trans(kv_r), qk, DOT_PRECISION, UPCAST)
        m_i, l_i, alpha, p = online_softmax_update(m_i, l_i, qk * scale_log2, valid)
        acc = acc * alpha[:, None]
        acc = mma(p.to(kv_v.dtype), kv_v, acc, DOT_PRECISION, UPCAST)
    poisoned = tl.max(bad_any, 0) != 0
    if CHECK:
        if poisoned & (g == 0):
            tl.atomic_max(chk_ptr, 1)
    o, lse2 = finish_rows(m_i, l_i, acc, poisoned)
    v = tl.arange(0, BLOCK_DV)
    vmask = v < DV
    if FINAL:
        store_final(out_ptr, lse_ptr, t, heads, hmask, v, vmask, o, lse2, cnt > 0, s_ot, s_oh, s_ov, s_lt, s_lh, hmask)
    else:
        base = (t * NUM_SPLITS + sp) * H
        tl.store(ws_o_ptr + (base + heads[:, None]) * DV + v[None, :], o, mask=hmask[:, None] & vmask[None, :])
        tl.store(ws_lse_ptr + base + heads, lse2, mask=hmask)


@triton.jit(do_not_specialize=["H", "K", "NUM_SPLITS", "SPLIT_LEN", "HEAD_BLOCKS", "V_BLOCKS"])
def splitkv_combine_kernel(
    ws_o_ptr, ws_lse_ptr, counts_ptr, out_ptr, lse_ptr,
    H, K, NUM_SPLITS, SPLIT_LEN, HEAD_BLOCKS, V_BLOCKS,
    s_ot, s_oh, s_ov, s_lt, s_lh,  # out, lse
    DV: tl.constexpr, BLOCK_HC: tl.constexpr, BLOCK_VC: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Phase 2: program ``(value block, head block, token)``: the row's non-empty splits merged by LSE."""
    pid = tl.program_id(0)
    vb = pid % V_BLOCKS
    rest = pid // V_BLOCKS
    hb = rest % HEAD_BLOCKS
    t = (rest // HEAD_BLOCKS).to(tl.int64)
    cnt = tl.minimum(tl.maximum(tl.load(counts_ptr + t).to(tl.int64), 0), K)
    n_act = tl.cdiv(cnt, SPLIT_LEN)  # the splits that hold keys; the others were never written
    heads = hb * BLOCK_HC + tl.arange(0, BLOCK_HC)
    hmask = heads < H
    v = vb * BLOCK_VC + tl.arange(0, BLOCK_VC)
    vmask = v < DV
    acc, m_safe, total = combine_splits(
        ws_o_ptr, ws_lse_ptr, t, heads, hmask, v, vmask, n_act, H, NUM_SPLITS, DV, BLOCK_S
    )
    nz = total != 0
    o = acc / tl.where(nz, total, 1.0)[:, None]
    lse2 = tl.where(nz, m_safe + tl.log2(tl.where(nz, total, 1.0)), float("-inf"))
    lse_mask = hmask & ((heads * 0 + vb) == 0)  # the first value block of a head writes its LSE
    store_final(out_ptr, lse_ptr, t, heads, hmask, v, vmask, o, lse2, cnt > 0, s_ot, s_oh, s_ov, s_lt, s_lh, lse_mask)


# ---- planning --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SplitKVPlan:
    """How :func:`sparse_mla_splitkv` runs one shape (made by :func:`splitkv_plan`; shapes only, no data).

    Attributes:
        T, H, K: query tokens, heads, slots per row.  head_dim, v_dim: Dqk and Dv.
        block_h: heads per phase-1 program; ``head_groups = cdiv(H, block_h)``.
        block_n: gathered keys per block (one pair of dots).
        num_splits: phase-1 programs per (token, head group); ``split_len`` keys each (a multiple of
            ``block_n``; ``num_splits * split_len >= K``). ``num_splits == 1``: phase 1 writes the outputs.
        num_warps, num_stages: phase-1 launch options.
        combine_block_h, combine_block_v, combine_warps: phase-2 tiles (programs ``T * cdiv(H, bh) * cdiv(Dv, bv)``).
        sm_count: the SMs planned for.
        device: the device planned for, ``str(torch.device)`` with its index (``"cuda:0"``, ``"cpu"``):
            :func:`sparse_mla_splitkv` refuses a plan whose ``T``, ``H``, ``K``, ``head_dim``, ``v_dim`` or
            ``device`` differ from its call's.
    """

    T: int
    H: int
    K: int
    head_dim: int
    v_dim: int
    block_h: int
    block_n: int
    num_splits: int
    split_len: int
    num_warps: int
    num_stages: int
    combine_block_h: int
    combine_block_v: int
    combine_warps: int
    sm_count: int
    device: str = ""

    @property
    def head_groups(self) -> int:
        return cdiv(self.H, self.block_h)

    @property
    def ctas(self) -> int:
        """Phase-1 programs launched (``T * head_groups * num_splits``), the 'SMs busy' of a figure."""
        return self.T * self.head_groups * self.num_splits

    @property
    def combine_ctas(self) -> int:
        if self.num_splits == 1:
            return 0
        return self.T * cdiv(self.H, self.combine_block_h) * cdiv(self.v_dim, self.combine_block_v)

    @property
    def workspace_numel(self) -> int:
        """fp32 elements of the workspace: partial outputs ``[T, splits, H, Dv]`` then partial LSEs
        ``[T, splits, H]``; 0 with one split."""
        if self.num_splits == 1:
            return 0
        return self.T * self.num_splits * self.H * (self.v_dim + 1)

    @property
    def workspace_shape(self) -> tuple[int]:
        return (self.workspace_numel,)


def _device_sms(device: torch.device) -> int:
    if device.type == "cuda" and not triton_interpreting():
        return sm_count(device)
    return NOMINAL_SM_COUNT


def _default_config(T: int, H: int) -> tuple[int, int, int, int]:
    """``(block_h, block_n, num_warps, num_stages)`` by regime, from the H200 sweep (``bench_attention.py``,
    Triton 3.6; ``benchmarks/results/attention.json``, key ``sweep``):

    * many token-heads (``T * H >= 2048`` with ``H`` a multiple of 64: T >= 16 at 128 heads): 64 heads (one
      wgmma warpgroup of rows, 8 warps), 32 keys, 3 stages (the gathered tiles are then prefetched with
      cp.async: the pipeliner needs a stage per level of indirection, slots -> rows). T = 32, H = 128:
      126 us against 144 with 2 stages, 143 with 32 heads;
    * 128+ heads, few tokens: 32 heads, 64 keys, 8 warps (T = 1, 2, 4, 8 at H = 128: 14.6 / 18.5 / 25.7 /
      41.5 us with the default splits, within 0.5 us of the best configuration tried but T = 8: 42.2);
    * up to 64 heads, few tokens (TP ranks): 16 heads, 32 keys, 4 warps (two programs per SM; T = 1: 8.8 us
      at 16 heads, 10.2 at 32, 12.7 at 64)."""
    if H % 64 == 0 and T * H >= 2048:
        return 64, 32, 8, 3
    if H >= 128:
        return 32, 64, 8, 2
    return 16, 32, 4, 2


def _default_splits(T: int, head_groups: int, K: int, block_n: int, sm_count: int, ctas_per_sm: int) -> int:
    """Splits per (token, head group): the power of two nearest to one wave of programs
    (``sm_count * ctas_per_sm / (T * head_groups)``), at most one per key block, at least 1.

    Measured (the sweep): the best split count gave ~one program per SM (two at 16 heads x 4 warps) in every
    shape, i.e. one or two key blocks per program at T = 1: a program's fixed latency (query load, gather
    round trips, partial store) dominates, and more splits only add partial-output traffic to phase 2."""
    want = sm_count * ctas_per_sm / max(T * head_groups, 1)
    blocks = max(cdiv(K, block_n), 1)
    splits = 1
    while (
        splits * 2 <= blocks
        and splits * 2 <= 128
        and abs(math.log2(want) - math.log2(splits * 2)) < abs(math.log2(want) - math.log2(splits))
    ):
        splits *= 2
    return splits


def _device(device: object) -> torch.device:
    """``device`` as a plan records it: a CUDA device with its index (the current one when it has none)."""
    dev = check_device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _pow2_or_none(value: int | None, name: str, lo: int, hi: int) -> int | None:
    if value is None:
        return None
    v = check_int_scalar(value, name)
    if not lo <= v <= hi or v & (v - 1):
        raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {v}")
    return v


def splitkv_plan(
    T: int,
    H: int,
    K: int,
    device: torch.device | str,
    *,
    head_dim: int = 576,
    v_dim: int = 512,
    num_splits: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> SplitKVPlan:
    """The launch configuration of :func:`sparse_mla_splitkv` for ``T`` tokens, ``H`` heads, ``K`` slots per row.

    Depends on the shapes (and the device's SM count) only, never on counts or slot values. ``None``
    picks the default (see the module docstring); a given value is used as is (``num_splits`` is
    capped so that no split is entirely past ``K``). Cached per arguments. The plan records the shape and
    the device it was made for: pass it to :func:`sparse_mla_splitkv` (``plan=``) for a call of that shape on
    that device only (another is refused, naming ``plan``).
    """
    dev = _device(device)
    T, H, K = (check_int_scalar(x, n, min_value=lo) for x, n, lo in ((T, "T", 0), (H, "H", 1), (K, "K", 0)))
    head_dim = check_int_scalar(head_dim, "head_dim", min_value=1)
    v_dim = check_int_scalar(v_dim, "v_dim", min_value=1)
    if v_dim > head_dim:
        raise ValueError(f"v_dim must be <= head_dim={head_dim}, got {v_dim}")
    if num_splits is not None:
        num_splits = check_int_scalar(num_splits, "num_splits", min_value=1)
    if num_stages is not None:
        num_stages = check_int_scalar(num_stages, "num_stages", min_value=1)
        if num_stages > 8:
            raise ValueError(f"num_stages must be in [1, 8], got {num_stages}")
    # Powers of two (tl.arange); >= 16 for a tl.dot operand; the upper bounds keep a tile within registers
    # and shared memory (a bad value would otherwise surface as a compiler error deep inside Triton).
    block_h = _pow2_or_none(block_h, "block_h", 16, 128)
    block_n = _pow2_or_none(block_n, "block_n", 16, 128)
    num_warps = _pow2_or_none(num_warps, "num_warps", 1, 16)
    return _plan(
        T, H, K, head_dim, v_dim, _device_sms(dev), num_splits, block_h, block_n, num_warps, num_stages, str(dev)
    )


@functools.lru_cache(maxsize=256)
def _plan(
    T: int,
    H: int,
    K: int,
    head_dim: int,
    v_dim: int,
    sms: int,
    num_splits: int | None,
    block_h: int | None,
    block_n: int | None,
    num_warps: int | None,
    num_stages: int | None,
    device: str,
) -> SplitKVPlan:
    d_bh, d_bn, d_nw, d_ns = _default_config(T, H)
    bh = block_h if block_h is not None else d_bh
    # Registers (ptxas for sm_90a): 64 heads x 32 keys at 8 warps (wgmma) 252, no spill (Triton 3.6); 32 heads
    # x 64 keys at 8 warps 198; 16 heads x 32 keys at 4 warps 251 (3.9). Shared memory: the query tile (72 KiB
    # at 64 heads) + num_stages gathered tiles (36 KiB at 32 keys) within 227 KiB.
    bn = block_n if block_n is not None else (d_bn if block_h is None or bh == d_bh else 32)
    nw = num_warps if num_warps is not None else (d_nw if bh == d_bh else (4 if bh <= 16 else 8))
    ns_stages = num_stages if num_stages is not None else (d_ns if bh == d_bh else 2)
    groups = cdiv(H, bh)
    blocks = max(cdiv(K, bn), 1)
    ctas_per_sm = 2 if nw <= 4 else 1  # registers: 128 threads x 251 fit twice in 64K; 256 x 186+ once
    splits = num_splits if num_splits is not None else _default_splits(T, groups, K, bn, sms, ctas_per_sm)
    splits = max(1, min(splits, blocks))
    split_len = cdiv(blocks, splits) * bn
    splits = max(1, cdiv(max(K, 1), split_len))  # no split lies entirely past K
    # Phase 2 loads every split of a [heads x values] tile at once. Latency-bound at small T (ncu, T = 1: 4 heads
    # x 128 values per program of 4 warps sat at 7-12 % occupancy): one head per program and <= 2048 fp32 per
    # tile (32 per thread at 2 warps) put many more loads in flight.
    cbh = 1
    cbv = min(max(16, next_pow2(v_dim)), max(16, _COMBINE_TILE // max(2, next_pow2(splits))))
    return SplitKVPlan(
        T=T, H=H, K=K, head_dim=head_dim, v_dim=v_dim, block_h=bh, block_n=bn, num_splits=splits,
        split_len=split_len, num_warps=nw, num_stages=ns_stages, combine_block_h=cbh, combine_block_v=cbv,
        combine_warps=2, sm_count=sms, device=device,
    )  # fmt: skip


def _check_plan(plan: object, T: int, H: int, K: int, head_dim: int, v_dim: int, device: torch.device) -> SplitKVPlan:
    """``plan`` when it was made for this call — ``T``, ``H``, ``K``, ``head_dim``, ``v_dim`` and the device
    (:func:`splitkv_plan` records them) — a ``ValueError`` naming ``plan`` otherwise (a ``TypeError`` when it
    is not a :class:`SplitKVPlan`)."""
    if not isinstance(plan, SplitKVPlan):
        raise TypeError(f"plan must be a SplitKVPlan (splitkv_plan makes it) or None, got {type(plan).__name__}")
    have = (plan.T, plan.H, plan.K, plan.head_dim, plan.v_dim, plan.device)
    want = (T, H, K, head_dim, v_dim, str(device))
    if have != want:
        # another shape's splits, head groups and workspace would cover the wrong keys or overrun the workspace
        raise ValueError(
            f"plan was made for T={plan.T}, H={plan.H}, K={plan.K}, head_dim={plan.head_dim}, v_dim={plan.v_dim} on "
            f"{plan.device!r}, not for this call's T={T}, H={H}, K={K}, head_dim={head_dim}, v_dim={v_dim} on "
            f"{want[5]!r}: make it with splitkv_plan(T, H, K, device, head_dim=..., v_dim=..., ...) for this call"
        )
    return plan


def workspace_for(plan: SplitKVPlan, device: torch.device | str) -> torch.Tensor:
    """The ``workspace=`` of :func:`sparse_mla_splitkv` for ``plan``: float32 ``[plan.workspace_numel]`` on
    ``device`` (empty with one split). Allocate it once, outside a CUDA graph, and pass it on every call."""
    return torch.empty(plan.workspace_shape, dtype=torch.float32, device=torch.device(device))


# ---- the host wrapper --------------------------------------------------------------------------------------
def kv_rows_view(kv_cache: torch.Tensor, head_dim: int, name: str = "kv_cache") -> tuple[int, int, int, int, int]:
    """How the kernel addresses flat slot ``s`` of a cache: ``(num_slots, rows_per_block, block_stride,
    row_stride, col_stride)`` (elements), no copy. When ``block_stride == rows_per_block * row_stride`` (every
    flat or contiguous cache) slot ``s`` is simply at ``s * row_stride``.

    Accepted shapes (as :mod:`dcp_ref.attention` and FlashMLA): ``[S, Dqk]``, ``[S, 1, Dqk]`` /
    ``[blocks, block_size, Dqk]`` and ``[blocks, block_size, 1, Dqk]``; slot ``s`` is row
    ``s % block_size`` of block ``s // block_size`` whatever the block stride.
    """
    if kv_cache.shape[-1] != head_dim:
        raise ValueError(f"{name} row width must equal q.shape[-1]={head_dim}, got shape {tuple(kv_cache.shape)}")
    if kv_cache.ndim == 2:
        return kv_cache.shape[0], 1, kv_cache.stride(0), kv_cache.stride(0), kv_cache.stride(1)
    if kv_cache.ndim == 4 and kv_cache.shape[2] != 1:
        raise ValueError(
            f"{name} must be [S, Dqk], [S, 1, Dqk], [blocks, block_size, Dqk] or [blocks, block_size, 1, Dqk], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    nb, bs = kv_cache.shape[0], kv_cache.shape[1]
    if bs <= 1:  # one row per block (a size-1 dimension's stride means nothing): rows at the block stride
        return nb * bs, 1, kv_cache.stride(0), kv_cache.stride(0), kv_cache.stride(-1)
    return nb * bs, bs, kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(-1)


def _validate_values(slots: torch.Tensor, counts: torch.Tensor, num_slots: int) -> None:
    """The reference's host checks, with its messages: ``0 <= counts <= K``; used slots in ``[0, num_slots)``.

    Run only after the kernel raised its flag (a validated call checks in phase 1, then reads the flag once)."""
    from dcp_ref.fp8_cache import check_fp8_slots  # the compact layout's checks, with the reference's messages

    check_values_readable(counts, "counts")
    check_values_readable(slots, "slots")
    check_fp8_slots(slots, counts, num_slots, "compact")


def sparse_mla_splitkv(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    sm_scale: float,
    v_dim: int = 512,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    validate: bool = True,
    plan: SplitKVPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode of every head over its row's compacted slots, split over the keys (two launches).

    ``score[t, h, j] = sm_scale * <q[t, h], kv[slots[t, j]]>`` over all ``Dqk`` columns for ``j < counts[t]``;
    ``out[t, h] = softmax_j(score) @ kv[slots[t, j], :v_dim]``; ``lse[t, h] = log sum_j exp(score)``.

    Args:
        q: ``[T, H, Dqk]`` bf16 / fp16 (fp32: IEEE dots), any strides; any ``H >= 1`` (16, 32, 64, 128 ...).
        kv_cache: same dtype, ``[S, Dqk]``, ``[S, 1, Dqk]``, ``[blocks, bs, Dqk]`` or ``[blocks, bs, 1, Dqk]``
            (flat slot ``s`` = block ``s // bs``, row ``s % bs``), any strides. Values: the first ``v_dim``
            columns.
        slots: int32/int64 ``[T, K]``: row ``t`` attends to ``slots[t, :counts[t]]`` (the rest is never read).
        counts: int32/int64 ``[T]``.
        sm_scale: softmax scale (finite, > 0).  v_dim: value width, ``1 <= v_dim <= Dqk`` (512 for DeepSeek).
        out: optional ``[T, H, v_dim]`` buffer of q's dtype (any strides).  out_lse: optional float32 ``[T, H]``.
        workspace: float32 ``[plan.workspace_numel]`` from :func:`workspace_for` (allocated per call when the
            plan splits and none is given).
        validate: check ``counts`` and the used ``slots`` as the reference does (its messages): phase 1 raises
            a flag (this call's :func:`~dcp_ref.kernels._util.check_flag`) for a row the reference refuses, and
            the call reads it once, after both launches (no extra launch; only a failing call reads more, to
            name the culprit; ``out`` then holds the poisoned rows). ``False``: nothing is read on the host;
            counts are clamped to ``[0, K]`` on the device and a row whose used slots leave ``[0, S)`` reads
            none of them and is poisoned (output and LSE NaN).
        plan: how the call runs, a :class:`SplitKVPlan` from :func:`splitkv_plan` — every launch decision (splits,
            heads and keys per program, warps, stages, the combine's tiles) — made for this call's ``T``, ``H``,
            ``K``, ``Dqk``, ``v_dim`` and device, and used as is; a ``ValueError`` naming ``plan`` when it was made
            for another. ``None``: ``splitkv_plan(T, H, K, q.device, head_dim=Dqk, v_dim=v_dim)``, the default
            plan by shape. The tuning (``num_splits``, ``block_h``, ``block_n``, ``num_warps``,
            ``num_stages``) goes to :func:`splitkv_plan`.

    Returns:
        ``(out [T, H, v_dim] q.dtype, lse float32 [T, H])``, LSE base e; a row with ``counts[t] <= 0`` gives
        output 0 and LSE ``-inf``; NaN in ``q`` or an attended row propagates (module docstring).

    Raises:
        TypeError / ValueError naming the argument (shapes, dtypes, devices, and with ``validate`` values).
    """
    validate = check_bool(validate, "validate")
    check_tensor(q, "q", dtypes=SPLITKV_DTYPES, ndim=3)
    check_tensor(kv_cache, "kv_cache", ndim=(2, 3, 4))
    if kv_cache.dtype != q.dtype:
        raise TypeError(f"kv_cache must have q's dtype {q.dtype}, got {kv_cache.dtype}")
    check_tensor(slots, "slots", dtypes=INT_DTYPES, ndim=2)
    check_tensor(counts, "counts", dtypes=INT_DTYPES, ndim=1)
    dev = check_same_device(q=q, kv_cache=kv_cache, slots=slots, counts=counts)
    if dev.type not in ("cuda", "meta") and not triton_interpreting():
        raise ValueError(f"q must be a CUDA tensor (or set TRITON_INTERPRET=1 for the CPU interpreter), got {dev}")
    T, H, dqk = q.shape
    S, kv_bs, s_kvb, s_kvr, s_kvd = kv_rows_view(kv_cache, dqk)
    v = check_int_scalar(v_dim, "v_dim", min_value=1)
    if v > dqk:
        raise ValueError(f"v_dim must be <= q.shape[-1]={dqk}, got {v}")
    if slots.shape[0] != T:
        raise ValueError(f"slots must be [T={T}, K], got shape {tuple(slots.shape)}")
    if counts.shape != (T,):
        raise ValueError(f"counts must be [T={T}], got shape {tuple(counts.shape)}")
    scale = check_sm_scale(sm_scale)
    K = slots.shape[1]
    if plan is None:
        plan = splitkv_plan(T, H, K, dev, head_dim=dqk, v_dim=v)
    else:
        plan = _check_plan(plan, T, H, K, dqk, v, dev)
    if out is None:
        out = torch.empty((T, H, v), dtype=q.dtype, device=dev)
    else:
        check_out(out, "out", (T, H, v), q.dtype, dev)
    if out_lse is None:
        out_lse = torch.empty((T, H), dtype=torch.float32, device=dev)
    else:
        check_out(out_lse, "out_lse", (T, H), torch.float32, dev)
    if workspace is not None:
        check_tensor(workspace, "workspace", dtypes=(torch.float32,), ndim=1, device=dev)
    if plan.num_splits > 1:
        if workspace is None:
            workspace = workspace_for(plan, dev)
        if workspace.shape[0] < plan.workspace_numel or not workspace.is_contiguous():
            raise ValueError(
                f"workspace must be a contiguous float32 tensor of at least {plan.workspace_numel} elements "
                f"(workspace_for(plan, device)), got shape {tuple(workspace.shape)}"
            )
    # the outputs (and a given workspace, which phase 1 writes while phase 2 reads) share no memory with an input
    # or with each other: a kernel writing what another program still reads gives a schedule-dependent answer
    check_no_aliases(
        {"out": out, "out_lse": out_lse, "workspace": workspace},
        dict(q=q, kv_cache=kv_cache, slots=slots, counts=counts),
    )
    check = validate and T > 0
    if check:  # the reference refuses a meta tensor before reading any value
        check_values_readable(counts, "counts")
        check_values_readable(slots, "slots")
    if T == 0 or dev.type == "meta":
        return out, out_lse  # nothing to compute (meta tensors: the shapes only, nothing read)
    chk = check_flag(dev) if check else None

    split = plan.num_splits > 1
    ws_o, ws_lse = out, out_lse  # never touched with one split (the kernel writes the outputs)
    if split:
        assert workspace is not None  # checked (or made) above
        n_ws = T * plan.num_splits * H * v
        ws_o, ws_lse = workspace[:n_ws], workspace[n_ws : n_ws + T * plan.num_splits * H]
    dr = dqk - v
    precision = "ieee" if q.dtype == torch.float32 else "tf32"  # ignored for 16-bit inputs
    splitkv_partial_kernel[(plan.ctas,)](
        q, kv_cache, slots, counts, ws_o, ws_lse, out, out_lse,
        H, K, S, kv_bs, scale / math.log(2.0), plan.num_splits, plan.split_len, plan.head_groups,
        q.stride(0), q.stride(1), q.stride(2), s_kvb, s_kvr, s_kvd, slots.stride(0), slots.stride(1),
        out.stride(0), out.stride(1), out.stride(2), out_lse.stride(0), out_lse.stride(1),
        DV=v, DR=dr, BLOCK_DV=max(16, next_pow2(v)), BLOCK_DR=max(16, next_pow2(dr)) if dr else 16,
        BLOCK_H=plan.block_h, BLOCK_N=plan.block_n, FINAL=not split, PAGED=s_kvb != kv_bs * s_kvr,
        DOT_PRECISION=precision, UPCAST=triton_interpreting() and q.dtype == torch.bfloat16,
        num_warps=plan.num_warps, num_stages=plan.num_stages, chk_ptr=chk, CHECK=chk is not None,
    )  # fmt: skip
    if split:
        cbh, cbv = plan.combine_block_h, plan.combine_block_v
        hb, vb = cdiv(H, cbh), cdiv(v, cbv)
        splitkv_combine_kernel[(T * hb * vb,)](
            ws_o, ws_lse, counts, out, out_lse, H, K, plan.num_splits, plan.split_len, hb, vb,
            out.stride(0), out.stride(1), out.stride(2), out_lse.stride(0), out_lse.stride(1),
            DV=v, BLOCK_HC=cbh, BLOCK_VC=cbv, BLOCK_S=max(2, next_pow2(plan.num_splits)),
            num_warps=plan.combine_warps,
        )  # fmt: skip
    # after both launches: phase 1 raised the flag for a row the reference refuses (poisoned in `out`; nothing
    # outside the cache was read)
    raise_if_flagged(chk, lambda: _validate_values(slots, counts, S), "the split-KV kernel")
    return out, out_lse


# ---- the attention stage --------------------------------------------------------------------------------
def splitkv_unsupported(device: torch.device, dtype: torch.dtype, num_heads: int, head_dim: int, v_dim: int) -> str:
    """Why :func:`splitkv_attention` cannot run this attention (``""`` when it can)."""
    if device.type != "cuda" and not triton_interpreting():
        return f"tensors are on {device}, not CUDA (set TRITON_INTERPRET=1 to interpret Triton on the CPU)"
    if dtype not in SPLITKV_DTYPES:
        return f"the split-KV kernel takes bf16/fp16/fp32 queries, got {dtype}"
    if not (1 <= v_dim <= head_dim) or num_heads < 1:
        return f"needs H >= 1 and 1 <= v_dim <= head_dim, got H={num_heads}, head_dim={head_dim}, v_dim={v_dim}"
    return ""


def splitkv_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor,
    sm_scale: float,
    v_dim: int,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention stage (:class:`dcp_ref.stages.AttentionStage`, compact layout) on the split-KV kernel.

    ``validate=False`` (no host read; device-side clamping and poisoning) and the default plan of the shape. Called
    directly, it makes this call's workspace; the stage a :class:`~dcp_ref.step.PlannedStep` planned
    (``dcp_ref.kernels.stages``) owns one workspace per plan instead, made on its first call and reused, so a
    captured graph keeps reading the same addresses.
    """
    T, H, dqk = q.shape
    plan = splitkv_plan(T, H, slots.shape[1], q.device, head_dim=dqk, v_dim=v_dim)
    return sparse_mla_splitkv(q, kv_cache, slots, counts, sm_scale, v_dim, out=out, out_lse=out_lse, validate=False,
                              plan=plan)  # fmt: skip


splitkv_attention.impl_name = "triton-splitkv"  # type: ignore[attr-defined]  # how the step's trace names it
