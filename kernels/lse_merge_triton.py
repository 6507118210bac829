"""Triton kernels for the DCP LSE merge: the per-rank correction and the full W-way merge.

Both are memory-bound: per ``(t, h)`` they read ``W`` floats of LSE (tiny) and ``D`` (= 512)
output values per partial, and write ``D`` values. The arithmetic (a max, W ``exp2``, one
``log2``) is free next to the bytes, so the kernels are written for bandwidth:

* one program per ``(token t, block of BLOCK_H heads)``, the whole ``D`` row in one tile
  (``[BLOCK_H, BLOCK_D]``, ``BLOCK_D = next_pow2(D)``) so every load is a wide contiguous read;
* all W LSEs of a head block are loaded as one ``[BLOCK_W, BLOCK_H]`` tile (one load, max and
  sum in registers), and every partial output exactly once; ``W`` is a compile-time constant so
  the loop over partials is unrolled and its loads are in flight together;
* everything in the log2 domain with ``exp2``/``log2`` (the hardware MUFU instructions); a base-e
  LSE is converted on load (``× log2 e``) and back on store (``× ln 2``).

Emptiness is ``lse == -inf`` (the attention stage writes it exactly when a row's count is 0): an
empty rank's weight is exactly 0 and its output is *selected away* (``where``), never multiplied
(``0 × NaN = NaN``). All ranks empty → output 0, LSE ``-inf``. A NaN or ``+inf`` LSE is corrupt
data, never "empty": the merged output and LSE of that ``(t, h)`` are NaN (and nothing else is);
a NaN in a non-empty rank's output propagates through its weight. Exactly the semantics of
:func:`dcp_ref.lse.merge_partials` (tested against it, NaN patterns included).

Kernels:

* :func:`lse_correct` — one rank's step (vLLM's ``correct_attn_out``): given the all-gathered
  LSEs ``[W, T, H]``, rescale this rank's ``[T, H, D]`` output by ``2^(lse_r - lse)``; may be in
  place. A reduce-scatter over ranks then finishes the merge.
* :func:`lse_merge` — all W partials ``[W, T, H, D]`` in one place → merged ``[T, H, D]``.

Measured on the H200 (``benchmarks/results/lse_merge.json``, ``lse_floor.json``; H = 128,
D = 512, bf16, W = 2/4/8): ``lse_correct`` 72–74 µs at T = 1024 (86–88 % of the 4.25 TB/s copy;
vLLM's ``correct_attn_out`` 98–104 µs), 6.3–7.6 µs for an isolated launch at T = 32 (a plain copy
of the same bytes: 6.5 µs) and 4.2 µs per launch back to back in a CUDA graph; ``lse_merge``
88–90 % of copy bandwidth at T = 1024.

Numerics: the LSEs are read in their own dtype (float32 or float64) and the max is subtracted in it
*before* any base conversion or exponentiation, so finite LSEs up to the float32 maximum merge to a
finite result (``3.3e38 * log2(e)`` would overflow float32) and float64 LSEs are not rounded to
float32 first; only the differences (``<= 0``) become float32 exponents. A float64 merged LSE may be
stored into a float64 buffer.

Output buffers are caller-provided (no allocation, no host sync: CUDA-graph safe); shapes,
dtypes, devices, memory overlap (an output may not share memory with an input; the correction's
``corrected`` may be exactly ``out``, in place) and launch parameters are checked, values are not
(the merge has no value checks: NaN is data). On a machine without a GPU, set
``TRITON_INTERPRET=1`` before importing this module and pass CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dcp_ref.contracts import (
    check_bool,
    check_int_scalar,
    check_lse_base,
    check_no_alias,
    check_pow2,
    triton_interpreting,
)
from dcp_ref.kernels._util import cdiv, next_pow2
from dcp_ref.lse import LN2

__all__ = [
    "lse_correct",
    "lse_merge",
    "lse_correct_kernel",
    "lse_merge_kernel",
    "merge_weights",
    "BLOCK_H_RANGE",
    "WARPS_RANGE",
]

_INTERPRET = triton_interpreting()  # snapshot: @triton.jit read it at import, too
_LSE_DTYPES = (torch.float32, torch.float64)
_OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Kernels may read module globals only when they are constexpr.
LN2_C: tl.constexpr = tl.constexpr(LN2)  # base 2 -> base e: lse_e = lse_2 * ln 2
LOG2E_C: tl.constexpr = tl.constexpr(1.0 / LN2)  # base e -> base 2: lse_2 = lse_e * log2(e)


@triton.jit
def merge_weights(lse_row, s_lw, offs_hs, mask_h, W: tl.constexpr, BLOCK_W: tl.constexpr, IS_BASE2: tl.constexpr):
    """All W ranks' LSEs for BLOCK_H heads in one [BLOCK_W, BLOCK_H] tile (one load, no second pass).

    Returns ``(e, m_safe, total, empty)``: ``e[w, h] = b^(lse[w, h] - m_safe[h])`` as float32 (``b`` the
    base; exactly 0 for an empty rank, NaN for a corrupt — NaN or ``+inf`` — LSE), ``m_safe`` the max of
    the other LSEs **in the LSEs' own dtype and base** (0 where every rank is empty, so that
    ``(-inf) - (-inf)`` = NaN never happens), ``total = sum_w e[w]`` (NaN when any rank is corrupt: it
    poisons that head) and ``empty[w, h]`` = 1.0 where ``lse == -inf``, else 0.0.

    The max is subtracted *before* any scaling or exponentiation, in the input's dtype: finite LSEs
    near the float32 maximum (3.3e38, whose base-2 form overflows float32) stay finite, and float64
    LSEs keep their precision (their differences are rounded to float32 only as exponents, ``<= 0``).
    """
    offs_w = tl.arange(0, BLOCK_W)
    mask = (offs_w < W)[:, None] & mask_h[None, :]
    x = tl.load(lse_row + offs_w[:, None] * s_lw + offs_hs[None, :], mask=mask, other=float("-inf"))
    empty = tl.where(x == float("-inf"), 1.0, 0.0)
    # x != x only for NaN. NaN / +inf are corrupt data, not "empty": kept out of the max, then
    # given a NaN weight so that they poison their head instead of vanishing.
    corrupt = (x != x) | (x == float("inf"))
    x = tl.where(corrupt, float("-inf"), x)
    m = tl.max(x, axis=0)
    m_safe = tl.where(m > float("-inf"), m, 0.0)
    d = x - m_safe[None, :]  # <= 0 (or -inf): never inf - inf, never an overflow to +inf
    if not IS_BASE2:
        d = d * LOG2E_C  # base e -> base 2, after the subtraction (a huge LSE times log2(e) overflows)
    e = tl.exp2(d.to(tl.float32))  # 2^-inf = 0: empty ranks weigh exactly 0
    e = tl.where(corrupt, float("nan"), e)
    total = tl.sum(e, axis=0)
    return e, m_safe, total, empty


@triton.jit
def weight_row(e, offs_w, w):
    """Row ``w`` of the [BLOCK_W, BLOCK_H] tile ``e`` (a masked sum: registers, no memory)."""
    return tl.sum(tl.where(offs_w[:, None] == w, e, 0.0), axis=0)


@triton.jit
def store_merged_lse(res_lse_ptr, offs_hs, mask_h, m_safe, total, IS_BASE2: tl.constexpr):
    """``merged = m_safe + log_b(total)`` in the LSEs' dtype, stored in the buffer's dtype.

    Guard log2(0): all-empty rows get -inf without ever evaluating log2 of 0; a NaN total (a corrupt
    rank) gives NaN."""
    lg = tl.log2(tl.where(total == 0, 1.0, total))
    if not IS_BASE2:
        lg = lg * LN2_C  # base 2 -> base e (log_e(total), a small number)
    merged = tl.where(total == 0, float("-inf"), m_safe + lg.to(m_safe.dtype))
    tl.store(res_lse_ptr + offs_hs, merged.to(res_lse_ptr.dtype.element_ty), mask=mask_h)


@triton.jit
def lse_correct_kernel(
    out_ptr, lses_ptr, res_ptr, res_lse_ptr,
    H, D, rank,
    s_ot, s_oh, s_od,  # out [T, H, D]
    s_lw, s_lt, s_lh,  # lses [W, T, H]
    s_rt, s_rh, s_rd,  # res [T, H, D]
    s_qt, s_qh,  # res_lse [T, H]
    W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_BASE2: tl.constexpr, STORE_LSE: tl.constexpr,
):  # fmt: skip
    """res[t, h, :] = 2^(lse2[rank, t, h] - merged2[t, h]) * out[t, h, :] (0 if that factor is 0)."""
    t = tl.program_id(0).to(tl.int64)  # int64: T*H*D offsets overflow int32 at large batches
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_h[:, None] & (offs_d < D)[None, :]
    # Issue the big load first: its memory latency then overlaps the LSE arithmetic below.
    x = tl.load(out_ptr + t * s_ot + offs_h[:, None] * s_oh + offs_d[None, :] * s_od, mask=mask, other=0.0)
    e, m_safe, total, empty = merge_weights(lses_ptr + t * s_lt, s_lw, offs_h * s_lh, mask_h, W, BLOCK_W, IS_BASE2)
    offs_w = tl.arange(0, BLOCK_W)
    mine = weight_row(e, offs_w, rank)
    mine_empty = weight_row(empty, offs_w, rank) > 0
    factor = mine / tl.where(total == 0, 1.0, total)  # NaN total (a corrupt rank) -> NaN factor
    # where(), not factor * x: an empty rank's output may be NaN and 0 * NaN = NaN.
    y = tl.where(mine_empty[:, None], 0.0, factor[:, None] * x.to(tl.float32))
    tl.store(
        res_ptr + t * s_rt + offs_h[:, None] * s_rh + offs_d[None, :] * s_rd, y.to(res_ptr.dtype.element_ty), mask=mask
    )
    if STORE_LSE:
        store_merged_lse(res_lse_ptr + t * s_qt, offs_h * s_qh, mask_h, m_safe, total, IS_BASE2)


@triton.jit
def lse_merge_kernel(
    outs_ptr, lses_ptr, res_ptr, res_lse_ptr,
    H, D,
    s_ow, s_ot, s_oh, s_od,  # outs [W, T, H, D]
    s_lw, s_lt, s_lh,  # lses [W, T, H]
    s_rt, s_rh, s_rd,  # res [T, H, D]
    s_qt, s_qh,  # res_lse [T, H]
    W: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    IS_BASE2: tl.constexpr, STORE_LSE: tl.constexpr,
):  # fmt: skip
    """res[t, h, :] = sum_w 2^(lse2[w] - merged2) * outs[w, t, h, :], empty ranks selected away."""
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    offs_d = tl.arange(0, BLOCK_D)
    mask = mask_h[:, None] & (offs_d < D)[None, :]
    e, m_safe, total, empty = merge_weights(lses_ptr + t * s_lt, s_lw, offs_h * s_lh, mask_h, W, BLOCK_W, IS_BASE2)
    inv_total = 1.0 / tl.where(total == 0, 1.0, total)  # NaN total (a corrupt rank) -> NaN
    offs_w = tl.arange(0, BLOCK_W)
    tile = t * s_ot + offs_h[:, None] * s_oh + offs_d[None, :] * s_od
    acc = tl.zeros((BLOCK_H, BLOCK_D), tl.float32)
    # W is a compile-time constant: the loop is unrolled, so the W partial loads can all be in
    # flight at once instead of one load -> FMA -> next load.
    for w in tl.static_range(W):
        f = weight_row(e, offs_w, w) * inv_total
        x = tl.load(outs_ptr + w * s_ow + tile, mask=mask, other=0.0).to(tl.float32)
        acc += tl.where((weight_row(empty, offs_w, w) > 0)[:, None], 0.0, f[:, None] * x)
    tl.store(
        res_ptr + t * s_rt + offs_h[:, None] * s_rh + offs_d[None, :] * s_rd,
        acc.to(res_ptr.dtype.element_ty),
        mask=mask,
    )
    if STORE_LSE:
        store_merged_lse(res_lse_ptr + t * s_qt, offs_h * s_qh, mask_h, m_safe, total, IS_BASE2)


# --------------------------------------------------------------------------------------------
# Host wrappers: shape / dtype / device checks only (no value checks: they would sync the host).
# --------------------------------------------------------------------------------------------


def _check(
    t: object, name: str, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).replace('torch.', '')}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} must be on device {device}, got {t.device}")
    return t


def _check_device(device: torch.device, name: str) -> None:
    if device.type == "cpu" and not _INTERPRET:
        raise ValueError(
            f"{name} is on the CPU: CPU tensors need the Triton interpreter "
            "(set TRITON_INTERPRET=1 before importing this module)"
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be on a CUDA device (or the CPU under TRITON_INTERPRET=1), got {device}")


#: Launch-parameter ranges (checked on the host): heads per program and warps, powers of two; a
#: program's tile (``block_h * next_pow2(D)`` values) must stay within Triton's 2**20 elements.
BLOCK_H_RANGE = (1, 256)
WARPS_RANGE = (1, 32)
_MAX_TILE = 1 << 20


def _launch_params(block_h: object, num_warps: object, block_d: int) -> tuple[int, int]:
    bh = check_pow2(block_h, "block_h", lo=BLOCK_H_RANGE[0], hi=BLOCK_H_RANGE[1])
    nw = check_pow2(num_warps, "num_warps", lo=WARPS_RANGE[0], hi=WARPS_RANGE[1])
    if bh * block_d > _MAX_TILE:
        raise ValueError(
            f"block_h must keep a program's tile within {_MAX_TILE} values: block_h={bh} x next_pow2(D)={block_d}"
        )
    return bh, nw


def _lse_out(buf: object, name: str, lses: torch.Tensor, shape: tuple[int, ...], dev: torch.device) -> torch.Tensor:
    """The merged-LSE buffer: float32, or float64 when the LSEs are float64 (their precision kept)."""
    allowed = (torch.float32, torch.float64) if lses.dtype == torch.float64 else (torch.float32,)
    return _check(buf, name, allowed, shape, dev)


def _lse_strides(lse_buf: torch.Tensor, merged_lse: torch.Tensor | None) -> tuple[int, int]:
    """``(s_qt, s_qh)`` of the merged-LSE buffer, ``(0, 0)`` when none is stored (``lse_buf`` is then a dummy)."""
    return (lse_buf.stride(-2), lse_buf.stride(-1)) if merged_lse is not None else (0, 0)


def _settings(W: int, bh: int, block_d: int, is_b2: bool, merged_lse: torch.Tensor | None, nw: int) -> dict:
    """The compile-time constants and warps of both kernels (the same for the correction and the merge)."""
    return dict(
        W=W, BLOCK_W=max(2, next_pow2(W)), BLOCK_H=bh, BLOCK_D=block_d,
        IS_BASE2=is_b2, STORE_LSE=merged_lse is not None, num_warps=nw,
    )  # fmt: skip


def lse_correct(
    out: torch.Tensor,
    all_lses: torch.Tensor,
    rank: int,
    *,
    base: str = "e",
    corrected: torch.Tensor | None = None,
    merged_lse: torch.Tensor | None = None,
    block_h: int = 4,
    num_warps: int = 4,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rescale this rank's partial output by its merge weight (the per-rank DCP step).

    Args:
        out: ``[T, H, D]`` fp16/bf16/fp32 — this rank's partial attention output (any strides).
        all_lses: ``[W, T, H]`` fp32/fp64 — all ranks' LSEs in ``base`` (after the all-gather). Read in
            their own dtype: the max is subtracted in it (finite LSEs up to the float32 maximum stay
            finite; float64 LSEs are never rounded to float32 before the subtraction).
        rank: this rank, ``0 <= rank < W``.
        base: ``"e"`` or ``"2"``, the base of ``all_lses`` and of ``merged_lse``.
        corrected: output buffer ``[T, H, D]`` (fp16/bf16/fp32); may be ``out`` itself — exactly the
            same view — for an in-place correction, and may share memory with nothing else.
            ``None`` allocates one (not CUDA-graph friendly: pass a buffer on the hot path).
        merged_lse: optional output buffer ``[T, H]`` for the merged LSE (in ``base``): float32, or
            float64 when ``all_lses`` is float64.
        block_h, num_warps: launch shape (heads per program, warps per program), powers of two
            (:data:`BLOCK_H_RANGE`, :data:`WARPS_RANGE`).
        validate: accepted for the stage's uniform signature (:func:`dcp_ref.lse.correct_partial`):
            the merge has no value checks (NaN is data, not an error), so nothing is read on the host
            either way.
    Returns:
        ``(corrected, merged_lse)`` — the buffers written (``merged_lse`` is ``None`` if not given).
    """
    check_bool(validate, "validate")
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.ndim != 3:
        raise ValueError(f"out must be 3-D [T, H, D], got shape {tuple(out.shape)}")
    T, H, D = out.shape
    dev = out.device
    _check(out, "out", _OUT_DTYPES, (T, H, D), dev)
    _check_device(dev, "out")
    if not isinstance(all_lses, torch.Tensor) or all_lses.ndim != 3:
        got = getattr(all_lses, "shape", type(all_lses).__name__)
        raise ValueError(f"all_lses must be a 3-D tensor [W, T={T}, H={H}], got {got}")
    W = all_lses.shape[0]
    _check(all_lses, "all_lses", _LSE_DTYPES, (W, T, H), dev)
    if W < 1:
        raise ValueError("all_lses must hold at least one rank (W >= 1)")
    rank = check_int_scalar(rank, "rank")
    if not 0 <= rank < W:
        raise ValueError(f"rank must satisfy 0 <= rank < W={W}, got {rank}")
    is_b2 = check_lse_base(base) == "2"
    block_d = next_pow2(D)
    bh, nw = _launch_params(block_h, num_warps, block_d)
    if corrected is None:
        corrected = torch.empty_like(out)
    _check(corrected, "corrected", _OUT_DTYPES, (T, H, D), dev)
    check_no_alias(corrected, "corrected", same_ok=("out",), out=out, all_lses=all_lses)
    if merged_lse is not None:
        _lse_out(merged_lse, "merged_lse", all_lses, (T, H), dev)
        check_no_alias(merged_lse, "merged_lse", out=out, all_lses=all_lses, corrected=corrected)
    if T == 0 or H == 0 or D == 0:
        return corrected, merged_lse
    lse_buf = merged_lse if merged_lse is not None else all_lses  # dummy pointer when not stored
    lse_correct_kernel[(T, cdiv(H, bh))](
        out, all_lses, corrected, lse_buf,
        H, D, rank,
        *out.stride(), *all_lses.stride(), *corrected.stride(), *_lse_strides(lse_buf, merged_lse),
        **_settings(W, bh, block_d, is_b2, merged_lse, nw),
    )  # fmt: skip
    return corrected, merged_lse


def lse_merge(
    outs: torch.Tensor,
    lses: torch.Tensor,
    *,
    base: str = "e",
    merged: torch.Tensor | None = None,
    merged_lse: torch.Tensor | None = None,
    block_h: int = 4,
    num_warps: int = 4,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge W partial outputs by their LSEs in one pass.

    Args:
        outs: ``[W, T, H, D]`` fp16/bf16/fp32 partial outputs (any strides).
        lses: ``[W, T, H]`` fp32/fp64 LSEs in ``base`` (read in their own dtype, as in
            :func:`lse_correct`); ``-inf`` means "empty" (weight 0, output selected away); NaN or
            ``+inf`` is corrupt data: that ``(t, h)`` comes out NaN.
        base: ``"e"`` or ``"2"``.
        merged: output buffer ``[T, H, D]`` (fp16/bf16/fp32; no memory shared with an input);
            ``None`` allocates ``outs.dtype``.
        merged_lse: optional output buffer ``[T, H]`` for the merged LSE in ``base``: float32, or
            float64 when ``lses`` is float64.
        block_h, num_warps, validate: as in :func:`lse_correct`.
    Returns:
        ``(merged, merged_lse)``.
    """
    check_bool(validate, "validate")
    if not isinstance(outs, torch.Tensor):
        raise TypeError(f"outs must be a torch.Tensor, got {type(outs).__name__}")
    if outs.ndim != 4:
        raise ValueError(f"outs must be 4-D [W, T, H, D], got shape {tuple(outs.shape)}")
    W, T, H, D = outs.shape
    dev = outs.device
    _check(outs, "outs", _OUT_DTYPES, (W, T, H, D), dev)
    _check_device(dev, "outs")
    if W < 1:
        raise ValueError("outs must hold at least one rank (W >= 1)")
    _check(lses, "lses", _LSE_DTYPES, (W, T, H), dev)
    is_b2 = check_lse_base(base) == "2"
    block_d = next_pow2(D)
    bh, nw = _launch_params(block_h, num_warps, block_d)
    if merged is None:
        merged = torch.empty((T, H, D), dtype=outs.dtype, device=dev)
    _check(merged, "merged", _OUT_DTYPES, (T, H, D), dev)
    check_no_alias(merged, "merged", outs=outs, lses=lses)
    if merged_lse is not None:
        _lse_out(merged_lse, "merged_lse", lses, (T, H), dev)
        check_no_alias(merged_lse, "merged_lse", outs=outs, lses=lses, merged=merged)
    if T == 0 or H == 0 or D == 0:
        return merged, merged_lse
    lse_buf = merged_lse if merged_lse is not None else lses
    lse_merge_kernel[(T, cdiv(H, bh))](
        outs, lses, merged, lse_buf,
        H, D,
        *outs.stride(), *lses.stride(), *merged.stride(), *_lse_strides(lse_buf, merged_lse),
        **_settings(W, bh, block_d, is_b2, merged_lse, nw),
    )  # fmt: skip
    return merged, merged_lse
