"""The FP8 KV cache DeepSeek V3.2 deploys with: FlashMLA's "V3.2" layout (vLLM's ``fp8_ds_mla``).

On Hopper, DeepSeek-V3.2-style models are served with an FP8 latent cache. Every token of every
layer is one **656-byte** row (instead of 576 bf16 values = 1152 bytes)::

    bytes   0 .. 511   NoPE: 512 latent values as float8_e4m3fn, in 4 tiles of 128
    bytes 512 .. 527   4 float32 scales, one per tile (little endian)
    bytes 528 .. 655   RoPE: the 64 RoPE values as bfloat16, not quantized

A stored NoPE value ``v`` (fp8) of tile ``i`` stands for ``v * scale[i]``. The 64 RoPE dims only
enter the scores; the values (the first 512 dims) come from the NoPE part alone.

The scale rule (:func:`fp8_tile_scales`)
----------------------------------------
A tile's scale is the smallest power of two that maps the tile's largest magnitude into e4m3's
range (``±448``)::

    scale = 2 ** ceil(log2(max(amax / 448, 1e-4)))

This is the rule of FlashMLA's own reference quantizer (``tests/quant.py``: ``quantize_k_cache``
for ``FP8KVCacheLayout.V32_FP8Sparse``, which clamps ``amax / 448`` at ``1e-4`` — HFAI FP8's
``FP8_AMAX_MARGIN`` — before rounding the exponent up). The power of two makes ``x / scale`` exact,
so the only rounding is the one to e4m3, and makes the dequantized value ``v * scale`` exact in
bf16 (see below). Here the exponent is computed exactly (``frexp``), not through a rounded
``log2``.

Decisions this module makes (and tests):

* **All-zero tile** (and any tile with ``amax / 448 < 1e-4``): the floor gives ``scale = 2**-13``.
  A zero tile stores 128 zero bytes and dequantizes to exact zeros; small tiles keep their values
  to within half an e4m3 step of ``2**-13`` (subnormal steps ``2**-22``).
* **Non-finite input**: a tile holding a NaN or ±inf gets ``scale = NaN``, so all 128 of its
  values dequantize to NaN — the damage stays visible instead of being clipped to ±448·scale
  (what FlashMLA's quantizer does differently: an inf tile gets ``scale = inf``, which also
  dequantizes to NaN). RoPE values are stored as bf16, inf and NaN included.
* **The very top of the range**: finite values within half an e4m3 step of ``2**128`` (``|x| >=
  248 * 2**120 ≈ 3.3e38``, i.e. the largest bf16/float32 values) would round to ``256 * 2**120 =
  2**128``, which dequantizes to inf. The quantizer stores the next lower e4m3 code (``240``)
  instead, so a finite input never comes back infinite. (FlashMLA's quantizer, not guarding this,
  gives inf there.) The error bound there is one e4m3 step instead of half of one.
* vLLM's own writer (``concat_and_cache_ds_mla``) stores ``scale = amax / 448`` (not a power of
  two); the dequantization below reads both kinds of caches exactly as the kernel does.

Dequantization, exactly as the kernel does it (:func:`dequantize_kv_fp8`)
-------------------------------------------------------------------------
FlashMLA's SM90 sparse FP8 decode (``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh``) converts each
float32 scale to bf16, each e4m3 value to bf16 (exact), and multiplies the two in bf16
(``cvt_fp8x8_bf16x8``: ``__float22bfloat162_rn(fp8) * scale_bf162``): one round-to-nearest-even
to bf16. RoPE bytes are used as stored. So the key the kernel sees is::

    k_nope = bf16(bf16(v) * bf16(scale))        k_rope = the stored bf16 values

With power-of-two scales both roundings are exact. The reference attention
(:func:`sparse_mla_attention_fp8`) dequantizes this way and then computes in float64.

Slots: masked or compact
------------------------
FlashMLA's FP8 decode kernel takes ``[T, K]`` indices with ``-1`` entries scattered anywhere (it
refuses per-row lengths for this layout), so the DCP step can skip compaction on this path: the
*masked* layout (:data:`dcp_ref.stages.ATTENTION_LAYOUTS`). The reference reads both:
``attention_layout="masked"`` (the default) reads every entry ``>= 0`` of a row and does not look
at ``counts``; ``"compact"`` reads ``slots[t, :counts[t]]`` (the layout of
:func:`dcp_ref.attention.sparse_mla_attention`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention import check_attention_slots, sparse_mla_attention
from .contracts import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_bool,
    check_int_scalar,
    check_no_alias,
    check_same_device,
    check_tensor,
    check_values_readable,
    host_values,
)

__all__ = [
    "Fp8CacheLayout",
    "FP8_DS_MLA",
    "FP8_CACHE_DTYPES",
    "fp8_tile_scales",
    "quantize_kv_fp8",
    "dequantize_kv_fp8",
    "fp8_cache_rows",
    "check_fp8_slots",
    "check_attention_layout",
    "check_layout",
    "sparse_mla_attention_fp8",
]

#: dtypes an FP8 cache may have: raw bytes, or FlashMLA's float8 view of the same bytes.
FP8_CACHE_DTYPES = (torch.uint8, torch.float8_e4m3fn)
# The reference dequantizes the rows of a few query rows at a time: [rows, K, 576] float64 stays
# below this many elements (T = 128, K = 2048 at once would be 1.2 GB).
_DEQUANT_BUDGET_ELEMS = 1 << 23


@dataclass(frozen=True)
class Fp8CacheLayout:
    """The byte layout of one FP8 cache row (defaults: DeepSeek V3.2, 656 bytes).

    Attributes:
        nope_dim: latent (NoPE) values per token, stored as e4m3 bytes first.
        rope_dim: RoPE values per token, stored as bf16 after the scales.
        tile_size: NoPE values sharing one float32 scale.
        fp8_max: largest finite e4m3fn magnitude (448).
        scale_inv_floor: ``amax / fp8_max`` is clamped at this before the exponent is rounded
            up (FlashMLA's ``1e-4``): the scale is never below ``2**ceil(log2(floor))``.
    """

    nope_dim: int = 512
    rope_dim: int = 64
    tile_size: int = 128
    fp8_max: float = 448.0
    scale_inv_floor: float = 1e-4

    def __post_init__(self) -> None:
        for name in ("nope_dim", "rope_dim", "tile_size"):
            check_int_scalar(getattr(self, name), name, min_value=1 if name != "rope_dim" else 0)
        if self.nope_dim % self.tile_size:
            raise ValueError(f"nope_dim must be a multiple of tile_size, got {self.nope_dim} and {self.tile_size}")
        for name in ("fp8_max", "scale_inv_floor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{name} must be a float, got {type(v).__name__}")
        if not (self.fp8_max == 448.0):
            raise ValueError(f"fp8_max must be 448.0 (float8_e4m3fn), got {self.fp8_max}")
        if not (self.scale_inv_floor > 0 and math.isfinite(self.scale_inv_floor)):
            raise ValueError(f"scale_inv_floor must be a finite float > 0, got {self.scale_inv_floor!r}")
        # Normalise (NumPy / 0-d tensor ints become Python ints) without breaking frozenness.
        for name in ("nope_dim", "rope_dim", "tile_size"):
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("fp8_max", "scale_inv_floor"):
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def num_tiles(self) -> int:
        """Scales per row (4)."""
        return self.nope_dim // self.tile_size

    @property
    def head_dim(self) -> int:
        """Values per token before quantization: NoPE + RoPE (576)."""
        return self.nope_dim + self.rope_dim

    @property
    def scale_offset(self) -> int:
        """Byte offset of the first float32 scale (512)."""
        return self.nope_dim

    @property
    def rope_offset(self) -> int:
        """Byte offset of the first bf16 RoPE value (528)."""
        return self.nope_dim + 4 * self.num_tiles

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one row (656)."""
        return self.rope_offset + 2 * self.rope_dim

    @property
    def bf16_bytes_per_token(self) -> int:
        """Bytes of the same token in a bf16 cache (1152): what FP8 saves against."""
        return 2 * self.head_dim

    def segments(self) -> list[tuple[int, int, str]]:
        """``(first_byte, end_byte, what)`` for every field of a row, in byte order."""
        segs = [
            (i * self.tile_size, (i + 1) * self.tile_size, f"NoPE tile {i}: {self.tile_size} x e4m3")
            for i in range(self.num_tiles)
        ]
        segs += [
            (self.scale_offset + 4 * i, self.scale_offset + 4 * (i + 1), f"scale {i}: float32")
            for i in range(self.num_tiles)
        ]
        segs.append((self.rope_offset, self.bytes_per_token, f"RoPE: {self.rope_dim} x bf16"))
        return segs

    @property
    def min_scale_exponent(self) -> int:
        """``ceil(log2(scale_inv_floor))``: the exponent of the smallest scale (-13)."""
        m, e = math.frexp(self.scale_inv_floor)
        return e - 1 if m == 0.5 else e


#: DeepSeek V3.2's layout: FlashMLA ``V32_FP8Sparse`` = vLLM ``fp8_ds_mla`` (656 bytes per token).
FP8_DS_MLA = Fp8CacheLayout()


def check_layout(layout: object, name: str = "layout") -> Fp8CacheLayout:
    """``layout`` must be an :class:`Fp8CacheLayout` (``TypeError`` naming ``name``)."""
    if not isinstance(layout, Fp8CacheLayout):
        raise TypeError(f"{name} must be a dcp_ref.fp8_cache.Fp8CacheLayout, got {type(layout).__name__}")
    return layout


def _ceil_pow2(x: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(x))`` for positive finite float32 ``x``, computed exactly with ``frexp``."""
    m, e = torch.frexp(x)  # x = m * 2**e, 0.5 <= m < 1
    e = e - (m == 0.5).to(e.dtype)  # an exact power of two keeps its exponent
    return torch.ldexp(torch.ones_like(x), e)


def fp8_tile_scales(nope: torch.Tensor, layout: Fp8CacheLayout = FP8_DS_MLA) -> torch.Tensor:
    """The float32 scale of every tile: ``2 ** ceil(log2(max(amax / 448, floor)))``.

    Args:
        nope: float ``[..., nope_dim]`` (bf16/fp16/fp32/fp64; converted to float32 first, as
            FlashMLA's quantizer does).
        layout: the row layout (default :data:`FP8_DS_MLA`).
    Returns:
        float32 ``[..., num_tiles]``. A tile containing NaN or ±inf gets ``NaN``.
    """
    check_layout(layout)
    check_tensor(nope, "nope", dtypes=FLOAT_DTYPES)
    if nope.ndim < 1 or nope.shape[-1] != layout.nope_dim:
        raise ValueError(f"nope must be [..., {layout.nope_dim}], got shape {tuple(nope.shape)}")
    tiles = nope.to(torch.float32).reshape(*nope.shape[:-1], layout.num_tiles, layout.tile_size)
    finite = torch.isfinite(tiles).all(dim=-1)
    amax = torch.where(finite, tiles.abs().amax(dim=-1), 0.0)
    scale_inv = torch.clamp_min(amax / layout.fp8_max, layout.scale_inv_floor)
    return torch.where(finite, _ceil_pow2(scale_inv), math.nan)


def quantize_kv_fp8(kv: torch.Tensor, layout: Fp8CacheLayout = FP8_DS_MLA) -> torch.Tensor:
    """Quantize cache rows to the FP8 layout: ``[..., 576]`` float -> ``[..., 656]`` uint8.

    The NoPE part (first ``nope_dim`` values) is converted to float32, divided tile by tile by
    its power-of-two scale (:func:`fp8_tile_scales`; exact) and rounded to float8_e4m3fn (round
    to nearest even). The RoPE part is rounded to bf16 (bf16 input: stored bit-exactly).

    Args:
        kv: float ``[..., head_dim]`` (bf16/fp16/fp32/fp64), on any device.
        layout: the row layout (default :data:`FP8_DS_MLA`).
    Returns:
        uint8 ``[..., bytes_per_token]`` on ``kv``'s device (``.view(torch.float8_e4m3fn)`` gives
        the dtype FlashMLA takes). See the module docstring for all-zero, non-finite and
        near-overflow tiles.
    """
    check_layout(layout)
    check_tensor(kv, "kv", dtypes=FLOAT_DTYPES)
    if kv.ndim < 1 or kv.shape[-1] != layout.head_dim:
        raise ValueError(
            f"kv must be [..., {layout.head_dim}] ({layout.nope_dim} NoPE + {layout.rope_dim} RoPE), "
            f"got shape {tuple(kv.shape)}"
        )
    lead = kv.shape[:-1]
    flat = kv.reshape(-1, layout.head_dim)
    n = flat.shape[0]
    nope = flat[:, : layout.nope_dim].to(torch.float32).reshape(n, layout.num_tiles, layout.tile_size)
    scales = fp8_tile_scales(flat[:, : layout.nope_dim], layout)  # [n, tiles] float32
    y = nope / scales.unsqueeze(-1)  # exact: the scale is a power of two (NaN tile -> NaN)
    codes = y.to(torch.float8_e4m3fn).view(torch.uint8)
    # Near 2**128 the rounded code times the scale overflows float32/bf16 (inf). Step down to the
    # next lower e4m3 magnitude (the code below it), so that a finite input stays finite.
    deq = codes.view(torch.float8_e4m3fn).to(torch.float32) * scales.unsqueeze(-1)
    overflow = torch.isinf(deq) & torch.isfinite(y)
    codes = torch.where(overflow, codes - 1, codes)
    out = torch.empty((n, layout.bytes_per_token), dtype=torch.uint8, device=kv.device)
    out[:, : layout.nope_dim] = codes.reshape(n, layout.nope_dim)
    out[:, layout.scale_offset : layout.rope_offset] = scales.contiguous().view(torch.uint8)
    if layout.rope_dim:
        out[:, layout.rope_offset :] = flat[:, layout.nope_dim :].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out.reshape(*lead, layout.bytes_per_token)


def fp8_cache_rows(kv_cache: torch.Tensor, name: str = "kv_cache", layout: Fp8CacheLayout = FP8_DS_MLA) -> torch.Tensor:
    """An FP8 cache as uint8 rows ``[num_slots, bytes_per_token]`` (a view when possible).

    Accepts ``[num_slots, 656]``, ``[num_blocks, block_size, 656]`` or FlashMLA's
    ``[num_blocks, block_size, 1, 656]``, as uint8 or float8_e4m3fn. Row ``s`` of the result is
    the flat slot id ``block * block_size + offset`` that the slots / indices refer to.
    """
    check_layout(layout)
    check_tensor(kv_cache, name, dtypes=FP8_CACHE_DTYPES, ndim=(2, 3, 4))
    w = layout.bytes_per_token
    if kv_cache.shape[-1] != w or (kv_cache.ndim == 4 and kv_cache.shape[2] != 1):
        raise ValueError(
            f"{name} must be [num_slots, {w}], [num_blocks, block_size, {w}] or [num_blocks, block_size, 1, {w}] "
            f"(FP8 rows of {w} bytes), got shape {tuple(kv_cache.shape)}"
        )
    return kv_cache.view(torch.uint8).reshape(-1, w)


def dequantize_kv_fp8(
    rows: torch.Tensor, layout: Fp8CacheLayout = FP8_DS_MLA, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """FP8 rows back to values, exactly as FlashMLA's SM90 decode kernel sees them.

    ``nope = bf16(bf16(e4m3) * bf16(scale))`` per tile (one round-to-nearest-even; exact for
    power-of-two scales), ``rope`` = the stored bf16 values.

    Args:
        rows: uint8 or float8_e4m3fn ``[..., bytes_per_token]``.
        layout: the row layout (default :data:`FP8_DS_MLA`).
        dtype: result dtype (bf16 by default: the kernel's values; float32/float64 hold them
            exactly).
    Returns:
        ``[..., head_dim]`` in ``dtype``.
    """
    check_layout(layout)
    check_tensor(rows, "rows", dtypes=FP8_CACHE_DTYPES)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of bf16/fp16/fp32/fp64, got {dtype}")
    w = layout.bytes_per_token
    if rows.ndim < 1 or rows.shape[-1] != w:
        raise ValueError(f"rows must be [..., {w}] (FP8 rows of {w} bytes), got shape {tuple(rows.shape)}")
    lead = rows.shape[:-1]
    b = rows.view(torch.uint8).reshape(-1, w)
    n = b.shape[0]
    codes = b[:, : layout.nope_dim].contiguous().view(torch.float8_e4m3fn)
    scales = b[:, layout.scale_offset : layout.rope_offset].contiguous().view(torch.float32)  # [n, tiles]
    nope = codes.to(torch.float32).to(torch.bfloat16).reshape(n, layout.num_tiles, layout.tile_size)
    nope = (nope * scales.to(torch.bfloat16).unsqueeze(-1)).reshape(n, layout.nope_dim)  # bf16 product: one rounding
    out = torch.empty((n, layout.head_dim), dtype=dtype, device=rows.device)
    out[:, : layout.nope_dim] = nope.to(dtype)
    if layout.rope_dim:
        out[:, layout.nope_dim :] = b[:, layout.rope_offset :].contiguous().view(torch.bfloat16).to(dtype)
    return out.reshape(*lead, layout.head_dim)


def check_fp8_slots(slots: object, counts: object, num_slots: int, attention_layout: str = "masked") -> torch.Tensor:
    """Validate ``slots`` (and ``counts``) against a cache of ``num_slots`` rows; return the read mask.

    ``"masked"`` layout: every entry is ``-1`` (none) or a row in ``[0, num_slots)`` — FlashMLA's
    FP8 kernel treats only ``-1`` as "none" and reads any other value; ``counts`` is not read.
    ``"compact"`` layout: ``0 <= counts[t] <= K`` and ``slots[t, :counts[t]]`` lie in
    ``[0, num_slots)``; entries after the prefix are ignored.

    One device reduction and one host read (the error path reads more, to name the culprit); the
    kernel wrapper runs these checks only with ``validate=True``.

    Returns:
        bool ``[T, K]``: which entries are read.
    Raises:
        TypeError / ValueError naming ``slots`` or ``counts``.
    """
    check_attention_layout(attention_layout)
    n = check_int_scalar(num_slots, "num_slots", min_value=0)
    check_tensor(slots, "slots", dtypes=INT_DTYPES, ndim=2)
    assert isinstance(slots, torch.Tensor)
    T, K = slots.shape
    if attention_layout == "masked":
        valid = slots >= 0
        if slots.numel():
            check_values_readable(slots, "slots")
            bad = (slots < -1) | (slots >= n)
            first_at = torch.argmax(bad.reshape(-1).to(torch.int8)).reshape(1)  # a device index: no host read
            n_bad, first = host_values(bad.sum(), slots.reshape(-1).gather(0, first_at))
            if n_bad:
                raise ValueError(f"slots entries must be -1 (none) or lie in [0, num_slots={n}), found {first}")
        return valid
    if counts is None:
        raise ValueError("counts must be given for attention_layout='compact' (row t reads slots[t, :counts[t]])")
    check_tensor(counts, "counts", dtypes=INT_DTYPES, ndim=1)
    assert isinstance(counts, torch.Tensor)
    check_same_device(slots=slots, counts=counts)
    if counts.shape != (T,):
        raise ValueError(f"counts must be [T={T}], got shape {tuple(counts.shape)}")
    check_attention_slots(slots, counts, n)  # the compact layout's checks and messages (one host read)
    return torch.arange(K, device=slots.device).unsqueeze(0) < counts.unsqueeze(1)


def check_attention_layout(attention_layout: object) -> str:
    """``"masked"`` (every entry ``>= 0`` is read, ``-1`` anywhere means none) or ``"compact"``."""
    if not isinstance(attention_layout, str) or attention_layout not in ("masked", "compact"):
        raise ValueError(f"attention_layout must be 'masked' or 'compact', got {attention_layout!r}")
    return attention_layout


def sparse_mla_attention_fp8(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor | None,
    sm_scale: float,
    v_dim: int = 512,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    attention_layout: str = "masked",
    validate: bool = True,
    layout: Fp8CacheLayout = FP8_DS_MLA,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse MLA decode over an FP8 cache: the float64 oracle for FlashMLA's FP8 decode.

    Every row read is dequantized exactly as the kernel does (:func:`dequantize_kv_fp8`), then
    the attention is computed in float64 by :func:`dcp_ref.attention.sparse_mla_attention`::

        score[t, h, j] = sm_scale * <q[t, h], k[slot]>,   out[t, h] = softmax_j(score) @ k[slot, :v_dim]

    Args:
        q: float ``[T, H, 576]`` (bf16 for the kernel).
        kv_cache: FP8 cache, uint8/float8_e4m3fn ``[num_slots, 656]`` (or blocked, see
            :func:`fp8_cache_rows`).
        slots: int32/int64 ``[T, K]`` flat cache row ids (``-1`` = none).
        counts: int ``[T]``: row ``t`` reads ``slots[t, :counts[t]]`` in the compact layout; not
            read in the masked layout (may be ``None`` there).
        sm_scale: softmax scale (finite, > 0).
        v_dim: value width (512 for DeepSeek; ``1 <= v_dim <= 576``).
        out, out_lse: optional ``[T, H, v_dim]`` / ``[T, H]`` float buffers on ``q``'s device,
            sharing no memory with an input or each other: the results are copied into them (cast to
            their dtype) and they are returned.
        attention_layout: ``"masked"`` (default; every entry ``>= 0`` is read, ``-1`` anywhere
            means none: what FlashMLA's FP8 decode reads) or ``"compact"``.
        validate: check the slot values on the host (one sync; :func:`check_fp8_slots`).
            ``False``: no host read and no data-dependent shape; ``counts`` is clamped to
            ``[0, K]``, and a row holding an entry that may not be read (masked: anything but
            ``-1`` outside ``[0, num_slots)``; compact: a used entry outside it) reads nothing
            out of range and is *poisoned*: its output and LSE are NaN, as in
            :func:`dcp_ref.attention.sparse_mla_attention`.
        layout: the row layout (default :data:`FP8_DS_MLA`).

    Returns:
        ``(out, lse)``: float64 ``[T, H, v_dim]`` and float64 ``[T, H]`` base e (or the given
        buffers). A row with nothing to read gives ``out = 0`` and ``lse = -inf``; no other row
        has ``lse = -inf`` (NaN data gives NaN).

    Raises:
        TypeError / ValueError naming the argument (see :func:`check_fp8_slots` for slot values).
    """
    validate = check_bool(validate, "validate")
    rows = fp8_cache_rows(kv_cache, "kv_cache", layout)
    check_tensor(q, "q", dtypes=FLOAT_DTYPES, ndim=3)
    T, H, dqk = q.shape
    if dqk != layout.head_dim:
        raise ValueError(f"q must be [T, H, {layout.head_dim}], got shape {tuple(q.shape)}")
    v = check_int_scalar(v_dim, "v_dim", min_value=1)
    if v > dqk:
        raise ValueError(f"v_dim must be <= {dqk}, got {v}")
    check_attention_layout(attention_layout)
    check_tensor(slots, "slots", dtypes=INT_DTYPES, ndim=2)
    if slots.shape[0] != T:
        raise ValueError(f"slots must be [T={T}, K], got shape {tuple(slots.shape)}")
    check_same_device(q=q, kv_cache=rows, slots=slots)
    if attention_layout == "compact":
        if counts is None:
            raise ValueError("counts must be given for attention_layout='compact' (row t reads slots[t, :counts[t]])")
        check_tensor(counts, "counts", dtypes=INT_DTYPES, ndim=1)
        check_same_device(slots=slots, counts=counts)
        if counts.shape != (T,):
            raise ValueError(f"counts must be [T={T}], got shape {tuple(counts.shape)}")
    for buf, name, shape in ((out, "out", (T, H, v)), (out_lse, "out_lse", (T, H))):
        if buf is not None:
            check_tensor(buf, name, dtypes=FLOAT_DTYPES, device=q.device)
            if tuple(buf.shape) != shape:
                raise ValueError(f"{name} must have shape {shape}, got {tuple(buf.shape)}")
    check_no_alias(out, "out", q=q, kv_cache=kv_cache, slots=slots, counts=counts)
    check_no_alias(out_lse, "out_lse", q=q, kv_cache=kv_cache, slots=slots, counts=counts, out=out)
    num_slots, K = rows.shape[0], slots.shape[1]
    if validate and T:
        check_fp8_slots(slots, counts, num_slots, attention_layout)

    # What each entry is: read, none, or an entry that may not be read (poisons its row). Static
    # shapes only, no host read: this runs inside a captured step too.
    s64 = slots.long()
    in_cache = (s64 >= 0) & (s64 < num_slots)
    if attention_layout == "masked":
        read = in_cache
        bad = ~in_cache & (s64 != -1)
    else:
        assert counts is not None
        used = torch.arange(K, device=slots.device).unsqueeze(0) < counts.long().clamp(0, K).unsqueeze(1)
        read = used & in_cache
        bad = used & ~in_cache
    poisoned = bad.any(dim=1)
    n_read = read.sum(dim=1)
    order = torch.argsort((~read).to(torch.int8), dim=1, stable=True)  # entries to read first, in order

    res_out = torch.zeros((T, H, v), dtype=torch.float64, device=q.device)
    res_lse = torch.full((T, H), -math.inf, dtype=torch.float64, device=q.device)
    if T and K and num_slots:
        # Dequantize the gathered rows of a few query rows at a time (a cache may hold millions of
        # rows; only those read matter), then run the float64 oracle on them as a small cache.
        chunk = max(1, _DEQUANT_BUDGET_ELEMS // (K * dqk))
        local = torch.arange(K, device=slots.device)
        for t0 in range(0, T, chunk):
            t1 = min(T, t0 + chunk)
            idx = s64[t0:t1].clamp(0, num_slots - 1)  # unread entries fetch some row; never used
            small = dequantize_kv_fp8(rows[idx.reshape(-1)], layout, torch.float64)  # [(t1-t0)*K, 576]
            compact = torch.gather(
                (local + K * torch.arange(t1 - t0, device=slots.device).unsqueeze(1)), 1, order[t0:t1]
            )
            o, lse = sparse_mla_attention(
                q[t0:t1], small, compact, n_read[t0:t1], sm_scale, "e", v_dim=v, validate=False
            )
            res_out[t0:t1] = o
            res_lse[t0:t1] = lse
    res_out = res_out.masked_fill(poisoned.view(T, 1, 1), math.nan)
    res_lse = res_lse.masked_fill(poisoned.view(T, 1), math.nan)
    if out is not None:
        out.copy_(res_out)
        res_out = out
    if out_lse is not None:
        out_lse.copy_(res_lse)
        res_lse = out_lse
    return res_out, res_lse
