"""FlashMLA's FP8 sparse decode (DeepSeek V3.2 cache layout) as the attention stage, masked layout.

What this wraps
---------------
``sgl-flash-mla`` (SGLang's packaging of deepseek-ai/FlashMLA; its SM90 kernels are the "legacy"
half, ``use_legacy=True``) runs sparse MLA decode over the 656-byte FP8 cache of
:mod:`dcp_ref.fp8_cache`::

    flash_mla.flash_mla_with_kvcache(q [T, 1, H, 576] bf16, cache [blocks, block_size, 1, 656] float8_e4m3fn,
                                     None, None, 512, sched_meta, softmax_scale=..., is_fp8_kvcache=True,
                                     indices [T, 1, K] int32, use_legacy=True) -> (out [T, 1, H, 512] bf16, lse)

Facts (verified on the H200 with sgl-flash-mla 1.0.0, and in FlashMLA's source):

* it **refuses per-row lengths** for this layout ("V3.2 does not support dynamic topk length")
  and masks ``-1`` entries **anywhere** in a row itself. So the DCP step feeds it the
  *uncompacted* slots of the deinterleave stage — no compaction — and the kernel walks all
  ``K`` entries of every row: :attr:`FlashMLAFp8Decode.attention_layout` is ``"masked"``;
* only ``-1`` means "none": any other out-of-range index is read (no bounds check). The wrapper
  hands the kernel ``-1`` for every entry outside ``[0, num_slots)``, so it never reads out of
  bounds, and *poisons* a row that held such an entry (output and LSE NaN, never a plausible
  answer without a key), exactly as the reference does with ``validate=False``;
  ``validate=True`` raises instead, with the reference's message;
* ``K`` must be a multiple of 64 (the kernel's top-K block): the wrapper pads rows with ``-1``;
  ``H`` must be 64 or 128;
* the LSE is base e, shaped ``[T, H, 1]``; an empty row gives output 0 and LSE **+inf**. The
  wrapper returns ``[T, H]`` and ``-inf`` for rows with no valid index (decided from the indices,
  not from the LSE value), the convention of :mod:`dcp_ref.lse`;
* the kernel allocates its own outputs; given ``out``, the wrapper copies into it (fused with the
  LSE fix in one small Triton kernel);
* the split-KV schedule ("metadata") depends only on the shapes when no lengths are passed, so it
  is computed once per shape (first call) and reused: a CUDA-graph replay runs prep, attention,
  combine and finish kernels, no scheduler.

``flash_mla`` is imported lazily: this module imports without it (its two Triton helpers,
:func:`prepare_indices` and :func:`finish_outputs`, run on the CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
import triton
import triton.language as tl

from dcp_ref.contracts import (
    INT_DTYPES,
    check_bool,
    check_int_scalar,
    check_no_alias,
    check_same_device,
    check_tensor,
    check_values_readable,
)
from dcp_ref.fp8_cache import FP8_CACHE_DTYPES, FP8_DS_MLA, check_attention_layout, check_fp8_slots

from ._util import cdiv, check_flag, next_pow2, raise_if_flagged

__all__ = [
    "TOPK_BLOCK",
    "ROW_EMPTY",
    "ROW_READ",
    "ROW_POISONED",
    "SUPPORTED_HEADS",
    "prepare_indices",
    "read_check",
    "finish_outputs",
    "FlashMLAFp8Decode",
    "sparse_mla_fp8_flashmla",
]

#: FlashMLA's sparse decode processes a row's indices in blocks of 64 (``topk % 64 == 0``).
TOPK_BLOCK = 64
#: Head counts FlashMLA's SM90 sparse decode is compiled for.
SUPPORTED_HEADS = (64, 128)
_V_DIM = FP8_DS_MLA.nope_dim  # 512: the values are the NoPE part
_DQK = FP8_DS_MLA.head_dim  # 576


def _flash_mla() -> Any:
    try:
        import flash_mla
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError(
            "FlashMLA is needed for dcp_ref.kernels.flashmla_fp8 (pip install sgl-flash-mla, "
            "or on the device: source .gpu/flashinfer/env.sh)"
        ) from e
    if hasattr(flash_mla, "has_legacy") and not flash_mla.has_legacy():  # pragma: no cover
        raise ImportError("this flash_mla build lacks the legacy SM90 kernels (FLASH_MLA_BUILD_LEGACY=0)")
    return flash_mla


#: Row states written by :func:`prepare_indices` and read by :func:`finish_outputs`.
ROW_EMPTY, ROW_READ, ROW_POISONED = 0, 1, 2


@triton.jit
def prepare_indices_kernel(
    slots_ptr, counts_ptr, idx_ptr, state_ptr,
    K, K_PAD, num_slots,
    stride_s0, stride_s1,
    HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr,
    chk_ptr=None, CHECK: tl.constexpr = False,
):  # fmt: skip
    """One program per row: ``idx[row, j] = slots[row, j]`` if it is read, else ``-1``.

    Masked layout (no counts): an entry in ``[0, num_slots)`` is read, ``-1`` is none, anything
    else may not be read. Compact layout: the entries ``j < counts[row]`` are used and must be in
    ``[0, num_slots)``; the rest is ignored. Columns ``K .. K_PAD-1`` are padding (``-1``).
    ``state[row]``: 0 nothing to read, 1 something to read, 2 an entry that may not be read (the
    row is poisoned: NaN, as in the reference with ``validate=False``).

    ``CHECK`` (``validate=True``): a row that :func:`dcp_ref.fp8_cache.check_fp8_slots` would refuse (a
    poisoned row, or in the compact layout ``counts[row]`` outside ``[0, K]``) sets ``chk[0]`` to 1 with an
    atomic max; a good row writes nothing, so the validated call's value checks are this launch plus one
    read of ``chk``.
    """
    row = tl.program_id(0)
    limit = K
    if HAS_COUNTS:
        raw = tl.load(counts_ptr + row).to(tl.int64)
        limit = tl.minimum(tl.maximum(raw, 0), K)
    seen = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, K_PAD, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        in_row = offs < K
        s = tl.load(slots_ptr + row * stride_s0 + offs * stride_s1, mask=in_row, other=-1).to(tl.int64)
        in_cache = (s >= 0) & (s < num_slots)
        if HAS_COUNTS:
            used = in_row & (offs < limit)
            ok = used & in_cache
            bad = used & (in_cache == 0)
        else:
            ok = in_row & in_cache
            bad = in_row & (in_cache == 0) & (s != -1)
        tl.store(idx_ptr + row * K_PAD + offs, tl.where(ok, s, -1).to(tl.int32), mask=offs < K_PAD)
        seen = tl.maximum(seen, tl.where(bad, 2, ok.to(tl.int32)))
    tl.store(state_ptr + row, tl.max(seen, axis=0))
    if CHECK:
        refused = tl.max(seen, axis=0) == 2
        if HAS_COUNTS:
            refused = refused | (raw < 0) | (raw > K)
        if refused:
            tl.atomic_max(chk_ptr, 1)


@triton.jit
def finish_outputs_kernel(
    o_src_ptr, o_dst_ptr, lse_src_ptr, lse_dst_ptr, state_ptr,
    H, D,
    s_os0, s_os1, s_os2, s_od0, s_od1, s_od2,  # o_src, o_dst
    s_ls0, s_ls1, s_ld0, s_ld1,  # lse_src, lse_dst
    COPY_OUT: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per (row, head): the kernel's values for a row that was read; 0 and ``-inf``
    for an empty row; NaN for a poisoned one."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    state = tl.load(state_ptr + row)
    lse = tl.load(lse_src_ptr + row * s_ls0 + h * s_ls1)
    lse = tl.where(state == 1, lse, tl.where(state == 0, float("-inf"), float("nan")))
    tl.store(lse_dst_ptr + row * s_ld0 + h * s_ld1, lse)
    fill = tl.where(state == 0, 0.0, float("nan"))  # what a row not read gets
    read_to = tl.where(state == 1, D, 0)  # columns taken from the kernel's output: all, or none
    for start in range(0, D, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        m = offs < D
        dst = o_dst_ptr + row * s_od0 + h * s_od1 + offs * s_od2
        if COPY_OUT:
            v = tl.load(o_src_ptr + row * s_os0 + h * s_os1 + offs * s_os2, mask=offs < read_to, other=0.0)
            v = tl.where(offs < read_to, v.to(tl.float32), fill)
            tl.store(dst, v.to(o_dst_ptr.dtype.element_ty), mask=m)
        else:
            # In place: only a row that was not read is rewritten, whatever the kernel left there.
            v = tl.zeros([BLOCK_D], dtype=tl.float32) + fill
            tl.store(dst, v.to(o_dst_ptr.dtype.element_ty), mask=m & (offs >= read_to))


def prepare_indices(
    slots: torch.Tensor,
    counts: torch.Tensor | None,
    num_slots: int,
    *,
    out: torch.Tensor | None = None,
    row_state: torch.Tensor | None = None,
    validate: bool = False,
    defer_read: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's indices from the step's slots: int32 ``[T, 1, K_pad]`` and a per-row flag.

    ``K_pad`` = ``K`` rounded up to a multiple of :data:`TOPK_BLOCK`. Every entry that is not read
    (``-1``, out of range, past ``counts[t]`` when counts are given, padding) is ``-1``: the kernel
    never reads out of bounds. No host sync (unless ``validate``).

    Args:
        slots: int32/int64 ``[T, K]``. counts: ``None`` (masked layout) or int32/int64 ``[T]``.
        num_slots: rows of the cache (an int ``>= 0``).
        out: optional int32 ``[T, 1, K_pad]`` buffer. row_state: optional int32 ``[T]`` buffer.
            Neither may share memory with an input or with the other.
        validate: ``True``: the reference's value checks (:func:`dcp_ref.fp8_cache.check_fp8_slots`, the
            masked layout's without ``counts``, the compact layout's with them; same messages), decided by
            this launch: its ``CHECK`` switch raises a flag (the shared
            :func:`~dcp_ref.kernels._util.check_flag`) for a row the reference refuses, so a validated call
            adds **no launch**, only one host read of that flag after it (only a failing call reads more,
            to build the message, after clearing the flag). ``False`` (the default): nothing is read.
        defer_read: with ``validate``, raise the flag but do not read it: the caller launches work that is safe
            on any input (FlashMLA over these indices: a poisoned row is never read), then reads it with
            :func:`read_check` — the host does not wait between the launches.
    Returns:
        ``(indices, row_state)``: ``row_state[t]`` is :data:`ROW_EMPTY` (nothing to read),
        :data:`ROW_READ` or :data:`ROW_POISONED` (an entry that may not be read: never read, and
        the row's output and LSE become NaN).
    """
    check_tensor(slots, "slots", dtypes=INT_DTYPES, ndim=2)
    num_slots = check_int_scalar(num_slots, "num_slots", min_value=0)
    validate = check_bool(validate, "validate")
    defer_read = check_bool(defer_read, "defer_read")
    T, K = slots.shape
    dev = slots.device
    if counts is not None:
        check_tensor(counts, "counts", dtypes=INT_DTYPES, ndim=1, device=dev)
        if counts.shape != (T,):
            raise ValueError(f"counts must be [T={T}], got shape {tuple(counts.shape)}")
    if validate:  # host only (no device op): a value check needs values
        check_values_readable(slots, "slots")
        if counts is not None:
            check_values_readable(counts, "counts")
    k_pad = max(TOPK_BLOCK, cdiv(K, TOPK_BLOCK) * TOPK_BLOCK)
    if out is None:
        out = torch.empty((T, 1, k_pad), dtype=torch.int32, device=dev)
    else:
        check_tensor(out, "out", dtypes=(torch.int32,), ndim=3, device=dev)
        if tuple(out.shape) != (T, 1, k_pad) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous int32 [{T}, 1, {k_pad}] tensor, got {tuple(out.shape)}")
    if row_state is None:
        row_state = torch.empty((T,), dtype=torch.int32, device=dev)
    else:
        check_tensor(row_state, "row_state", dtypes=(torch.int32,), ndim=1, device=dev)
        if row_state.shape != (T,) or not row_state.is_contiguous():
            raise ValueError(f"row_state must be a contiguous int32 [{T}] tensor, got {tuple(row_state.shape)}")
    check_no_alias(out, "out", slots=slots, counts=counts)
    check_no_alias(row_state, "row_state", slots=slots, counts=counts, out=out)
    if T == 0:
        return out, row_state
    chk = check_flag(dev) if validate else None  # CHECK=False compiles the check out
    _launch_prepare(slots, counts, num_slots, out, row_state, chk)
    if chk is not None and not defer_read:
        read_check(slots, counts, num_slots, chk)
    return out, row_state


def _launch_prepare(
    slots: torch.Tensor,
    counts: torch.Tensor | None,
    num_slots: int,
    out: torch.Tensor,
    row_state: torch.Tensor,
    chk: torch.Tensor | None,
) -> None:
    """:func:`prepare_indices`' one launch on arguments already checked (``T >= 1``; ``out`` / ``row_state`` its
    contiguous buffers; ``chk``: the check flag, or ``None`` to compile the check out). The FP8 stage calls it
    directly on its planned buffers: the wrapper's argument checks would only repeat the stage's own."""
    T, K = slots.shape
    k_pad = out.shape[-1]
    prepare_indices_kernel[(T,)](
        slots, counts if counts is not None else slots, out, row_state,
        K, k_pad, num_slots,
        slots.stride(0), slots.stride(1),
        HAS_COUNTS=counts is not None, BLOCK=min(1024, next_pow2(k_pad)),
        chk_ptr=chk, CHECK=chk is not None,
    )  # fmt: skip


def read_check(
    slots: torch.Tensor, counts: torch.Tensor | None, num_slots: int, chk: torch.Tensor | None = None
) -> None:
    """The one host read of a validated :func:`prepare_indices` (``slots`` / ``counts`` / ``num_slots`` as given
    to it; ``chk``: the flag it raised, :func:`~dcp_ref.kernels._util.check_flag` of ``slots``' device when not
    given): when its kernel raised the flag for a row the reference refuses (a slot that may not be read, a count
    outside ``[0, K]``), the flag is cleared for the next call and the reference's checker names the culprit."""
    layout = "masked" if counts is None else "compact"
    raise_if_flagged(
        check_flag(slots.device) if chk is None else chk,
        lambda: check_fp8_slots(slots, counts, num_slots, layout),
        "prepare_indices",
    )


def finish_outputs(
    o_src: torch.Tensor,
    lse_src: torch.Tensor,
    row_state: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's raw ``(out, lse)`` as the stage returns them (one launch, no host sync).

    Args:
        o_src: ``[T, H, D]`` (any strides; a view of FlashMLA's ``[T, 1, H, D]``).
        lse_src: float32 ``[T, H]`` (a view of FlashMLA's ``[T, H, 1]``), base e.
        row_state: int32 ``[T]`` from :func:`prepare_indices`.
        out: optional ``[T, H, D]`` buffer: ``o_src`` is copied into it. Without it, ``o_src``'s
            rows that were not read are rewritten in place and ``o_src`` is returned.
        out_lse: optional float32 ``[T, H]`` buffer (else a new one).
    Returns:
        ``(out, lse)``: the kernel's values for rows that were read; ``0`` / ``-inf`` for empty
        rows; NaN / NaN for poisoned rows.
    """
    T, H, D = o_src.shape
    dev = o_src.device
    if tuple(lse_src.shape) != (T, H):
        raise ValueError(f"lse_src must be [T={T}, H={H}], got {tuple(lse_src.shape)}")
    if out is None:
        dst, copy = o_src, False
    else:
        check_tensor(out, "out", ndim=3, device=dev)
        if tuple(out.shape) != (T, H, D):
            raise ValueError(f"out must have shape {(T, H, D)}, got {tuple(out.shape)}")
        dst, copy = out, True
    if out_lse is None:
        out_lse = torch.empty((T, H), dtype=torch.float32, device=dev)
    else:
        check_tensor(out_lse, "out_lse", dtypes=(torch.float32,), ndim=2, device=dev)
        if tuple(out_lse.shape) != (T, H):
            raise ValueError(f"out_lse must have shape {(T, H)}, got {tuple(out_lse.shape)}")
    # Each program reads and writes only its own (row, head): an output may be exactly its source.
    if out is not None:
        check_no_alias(out, "out", same_ok=("o_src",), o_src=o_src, lse_src=lse_src, row_state=row_state)
    check_no_alias(out_lse, "out_lse", same_ok=("lse_src",), o_src=o_src, lse_src=lse_src, row_state=row_state, out=out)
    if T == 0 or H == 0:
        return dst, out_lse
    finish_outputs_kernel[(T, H)](
        o_src, dst, lse_src, out_lse, row_state,
        H, D,
        *o_src.stride(), *dst.stride(), *lse_src.stride(), *out_lse.stride(),
        COPY_OUT=copy, BLOCK_D=min(512, next_pow2(max(D, 16))),
    )  # fmt: skip
    return dst, out_lse


def _check_cache(kv_cache: object) -> int:
    """Shape/dtype/stride checks of an FP8 cache for FlashMLA (no copy); returns its row count."""
    w = FP8_DS_MLA.bytes_per_token
    check_tensor(kv_cache, "kv_cache", dtypes=FP8_CACHE_DTYPES, ndim=(2, 3, 4))
    assert isinstance(kv_cache, torch.Tensor)
    if kv_cache.shape[-1] != w or (kv_cache.ndim == 4 and kv_cache.shape[2] != 1):
        raise ValueError(
            f"kv_cache must be [num_slots, {w}], [num_blocks, block_size, {w}] or [num_blocks, block_size, 1, {w}] "
            f"(FP8 rows of {w} bytes), got shape {tuple(kv_cache.shape)}"
        )
    row_dim = 0 if kv_cache.ndim == 2 else 1
    if (
        kv_cache.stride(-1) != 1
        or kv_cache.stride(row_dim) != w
        or (kv_cache.ndim == 2 and not kv_cache.is_contiguous())
    ):
        raise ValueError(
            f"kv_cache must hold contiguous {w}-byte rows (FlashMLA reads slot r of a block at byte {w}*r), "
            f"got strides {kv_cache.stride()}"
        )
    return kv_cache.numel() // w


class FlashMLAFp8Decode:
    """FlashMLA's FP8 sparse decode behind the attention stage's signature (masked layout).

    Usage::

        attn = FlashMLAFp8Decode(device="cuda", validate=False)
        out, lse = attn.attention(q, fp8_cache, slots, None, sm_scale, 512)   # slots: [T, K], -1 anywhere

    Shapes: ``q`` bf16 ``[T, H, 576]`` (``H`` = 64 or 128); ``kv_cache`` uint8/float8_e4m3fn
    ``[num_slots, 656]``, ``[num_blocks, block_size, 656]`` or ``[num_blocks, block_size, 1, 656]``
    (rows contiguous); ``slots`` int32/int64 ``[T, K]`` flat cache rows (``-1`` = none, anywhere);
    ``counts`` is not read in the masked layout (the default; may be ``None``); with
    ``attention_layout="compact"`` entries past ``counts[t]`` are masked too. Returns bf16
    ``[T, H, 512]`` and float32 ``[T, H]`` base-e LSE, ``-inf`` and output 0 for a row with
    nothing to read.

    Per shape ``(T, H, K_pad, block layout)`` and calling thread the object keeps FlashMLA's
    schedule and an index buffer: call it once eagerly before capturing it in a CUDA graph.

    Args:
        device: the CUDA device.
        validate: check slot values (``ValueError`` like the reference
            :func:`dcp_ref.fp8_cache.sparse_mla_attention_fp8`), in the :func:`prepare_indices` launch
            the call runs anyway: no extra launch, one host read of its flag after FlashMLA's kernel is
            launched (its indices never let it read an unreadable entry; a refused call's outputs hold the
            ``validate=False`` answer). ``False`` for the hot path: no host read; an entry that
            may not be read is then never read, and its row's output and LSE are NaN.
    """

    #: The step feeds this attention the uncompacted slots (``-1`` scattered): no compaction.
    attention_layout = "masked"

    def __init__(self, device: torch.device | str = "cuda", *, validate: bool = True) -> None:
        dev = torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"device must be a CUDA device (FlashMLA runs on Hopper GPUs), got {dev}")
        if not isinstance(validate, bool):
            raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
        self.device = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.validate = validate
        self._fm = _flash_mla()
        self._plans: dict[tuple, tuple[Any, torch.Tensor, torch.Tensor]] = {}

    def _plan(self, T: int, H: int, k_pad: int, cache_shape: tuple[int, ...]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        # Per thread too: the ranks of a SimulatedWorld are threads sharing one object, and one
        # index buffer written by two ranks before either kernel runs would mix their rows.
        key = (threading.get_ident(), T, H, k_pad, cache_shape[1])
        plan = self._plans.get(key)
        if plan is None:
            sched = self._fm.get_mla_metadata()[0]
            idx = torch.empty((T, 1, k_pad), dtype=torch.int32, device=self.device)
            row_state = torch.empty((T,), dtype=torch.int32, device=self.device)
            plan = self._plans[key] = (sched, idx, row_state)
        return plan

    def attention(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        slots: torch.Tensor,
        counts: torch.Tensor | None,
        sm_scale: float,
        v_dim: int = _V_DIM,
        *,
        out: torch.Tensor | None = None,
        out_lse: torch.Tensor | None = None,
        validate: bool | None = None,
        attention_layout: str = "masked",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sparse MLA over the FP8 cache; see the class docstring for shapes.

        ``out`` (bf16 ``[T, H, 512]``) and ``out_lse`` (float32 ``[T, H]``) may be caller
        buffers (the kernel's own output is copied into ``out``). ``validate=None`` uses the
        object's setting.
        """
        check_attention_layout(attention_layout)
        validate = self.validate if validate is None else check_bool(validate, "validate")
        if attention_layout == "masked":
            counts = None  # the masked layout reads every entry; counts (valid per row) are not needed
        elif counts is None:
            raise ValueError("counts must be given for attention_layout='compact' (row t reads slots[t, :counts[t]])")
        check_tensor(q, "q", dtypes=(torch.bfloat16,), ndim=3)
        T, H, dqk = q.shape
        if dqk != _DQK:
            raise ValueError(f"q must be [T, H, {_DQK}] (FlashMLA's V3.2 head size), got shape {tuple(q.shape)}")
        if H not in SUPPORTED_HEADS:
            raise ValueError(f"q must have 64 or 128 heads (FlashMLA's sparse decode), got H={H}")
        if isinstance(v_dim, bool) or v_dim != _V_DIM:
            raise ValueError(f"v_dim must be {_V_DIM} (the FP8 layout's values are its NoPE part), got {v_dim!r}")
        if (
            isinstance(sm_scale, bool)
            or not isinstance(sm_scale, (int, float))
            or not (math.isfinite(sm_scale) and sm_scale > 0)
        ):
            raise ValueError(f"sm_scale must be a finite float > 0, got {sm_scale!r}")
        num_slots = _check_cache(kv_cache)
        check_tensor(slots, "slots", dtypes=INT_DTYPES, ndim=2)
        if slots.shape[0] != T:
            raise ValueError(f"slots must be [T={T}, K], got shape {tuple(slots.shape)}")
        tensors = dict(q=q, kv_cache=kv_cache, slots=slots)
        if counts is not None:
            tensors["counts"] = counts
        if check_same_device(**tensors) != self.device:
            raise ValueError(f"tensors must be on {self.device}, got {q.device}")
        if counts is not None:
            check_tensor(counts, "counts", dtypes=INT_DTYPES, ndim=1)
            if counts.shape != (T,):
                raise ValueError(f"counts must be [T={T}], got shape {tuple(counts.shape)}")
        if validate:
            check_values_readable(slots, "slots")
            if counts is not None:
                check_values_readable(counts, "counts")
        if out is not None:
            check_tensor(out, "out", dtypes=(torch.bfloat16,), ndim=3, device=self.device)
            if tuple(out.shape) != (T, H, _V_DIM):
                raise ValueError(f"out must have shape {(T, H, _V_DIM)}, got {tuple(out.shape)}")
        if out_lse is not None:
            check_tensor(out_lse, "out_lse", dtypes=(torch.float32,), ndim=2, device=self.device)
            if tuple(out_lse.shape) != (T, H):
                raise ValueError(f"out_lse must have shape {(T, H)}, got {tuple(out_lse.shape)}")
        check_no_alias(out, "out", q=q, kv_cache=kv_cache, slots=slots, counts=counts)
        check_no_alias(out_lse, "out_lse", q=q, kv_cache=kv_cache, slots=slots, counts=counts, out=out)
        K = slots.shape[1]
        if T == 0 or K == 0:  # nothing to attend to (the kernel rejects topk = 0): every row is empty
            if validate and T:
                check_fp8_slots(slots, counts, num_slots, attention_layout)  # counts must be 0 here
            o = out if out is not None else torch.empty((T, H, _V_DIM), dtype=torch.bfloat16, device=self.device)
            lse = out_lse if out_lse is not None else torch.empty((T, H), dtype=torch.float32, device=self.device)
            o.zero_()
            lse.fill_(-math.inf)
            return o, lse

        # FlashMLA's cache view: [blocks, block_size, 1, 656] float8. The block size does not
        # change addressing (row r of block b is byte (b*block_size + r)*656), so a flat cache
        # is viewed with block_size 1.
        cache4 = kv_cache.view(torch.float8_e4m3fn)
        if cache4.ndim == 2:
            cache4 = cache4.view(num_slots, 1, 1, FP8_DS_MLA.bytes_per_token)
        elif cache4.ndim == 3:
            cache4 = cache4.unsqueeze(2)
        k_pad = max(TOPK_BLOCK, cdiv(K, TOPK_BLOCK) * TOPK_BLOCK)
        sched, idx, row_state = self._plan(T, H, k_pad, tuple(cache4.shape))
        # validate: the value checks run in this launch; its flag is read once, after FlashMLA's kernel is
        # launched (the indices never let it read an unreadable slot), so the host does not wait in between.
        # On a refused call the outputs then hold the validate=False answer (NaN rows), as the other stages.
        # Every argument is checked above and idx / row_state are this plan's own buffers, so the launch is
        # made directly (prepare_indices would repeat the checks: host time on every call of the hot path).
        chk = check_flag(self.device) if validate else None
        _launch_prepare(slots, counts, num_slots, idx, row_state, chk)
        try:
            o_raw, lse_raw = self._fm.flash_mla_with_kvcache(
                q.unsqueeze(1),
                cache4,
                None,
                None,
                _V_DIM,
                sched,
                softmax_scale=float(sm_scale),
                is_fp8_kvcache=True,
                indices=idx,
                use_legacy=True,
            )
            # out [T, 1, H, 512]; lse [T, H, 1] (legacy) or [T, 1, H]: one dim is 1 either way.
            res = finish_outputs(
                o_raw.reshape(T, H, _V_DIM), lse_raw.reshape(T, H), row_state, out=out, out_lse=out_lse
            )
        except BaseException:
            if chk is not None:
                chk.zero_()  # a call that stops before its read leaves the shared flag clear
            raise
        if chk is not None:
            read_check(slots, counts, num_slots, chk)
        return res

    __call__ = attention


def sparse_mla_fp8_flashmla(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor | None,
    sm_scale: float,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    validate: bool = True,
    attention_layout: str = "masked",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One-shot :class:`FlashMLAFp8Decode` call (for tests and notebooks; not the hot path).

    Same contract as :func:`dcp_ref.fp8_cache.sparse_mla_attention_fp8` with ``v_dim = 512``, in
    bf16 on a GPU: returns ``(out [T, H, 512] bf16, lse [T, H] float32 base e)``.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    return FlashMLAFp8Decode(q.device, validate=validate).attention(
        q, kv_cache, slots, counts, sm_scale, _V_DIM, out=out, out_lse=out_lse, attention_layout=attention_layout
    )
