"""The FP8 index-key cache of DeepSeek V3.2's lightning indexer: layout, quantizer, owner-only writes.

The indexer scores every (query token, key) pair with its own small keys (one 128-wide key per
token and layer, shared by its 64 index heads), kept in a paged FP8 cache next to the KV cache:
**132 bytes per token** — 128 float8_e4m3fn values and one float32 scale — paged with the KV
cache's own block table and block size. Inside one block of ``block_size`` tokens, the bytes are::

    bytes  0 .. block_size*128 - 1                  the 128 e4m3 values of token 0, token 1, ...
    bytes  block_size*128 .. block_size*132 - 1      the float32 scale of token 0, token 1, ...

(all values of the block first, then all scales), and a stored value ``v`` of token ``i`` stands
for ``v * scale[i]``. The canonical cache here is uint8 ``[num_blocks, block_size * 132]`` (one row
per block, the byte order above); the same bytes viewed as ``[num_blocks, block_size, 132]``
(vLLM's allocation) or ``[num_blocks, block_size, 1, 132]`` (DeepGEMM's argument shape) are
accepted too — those shapes are only containers: row ``i`` of a block is **not** token ``i``'s
132 bytes.

Where the conventions come from (checked in the stored sources)
----------------------------------------------------------------
* **Block byte order** — DeepGEMM ``csrc/apis/attention.hpp`` (``fp8_fp4_paged_mqa_logits``,
  deepseek-ai/DeepGEMM @ 54e2261, and the sgl-deep-gemm 0.2.0 wheel's headers) views the
  ``[num_blocks, block_kv, 1, 132]`` uint8 cache as values ``[num_blocks, block_kv, 128]`` at byte
  0 of each block and float32 scales ``[num_blocks, block_kv]`` at byte ``block_kv * 128``; its test
  (``tests/test_attention.py``, ``kv_cache_cast_to_fp8``) builds the cache the same way. vLLM's
  writer ``indexer_k_quant_and_cache_kernel`` (vllm-project/vllm ``csrc/cache_kernels.cu``) stores
  token ``o`` of block ``b`` at byte ``b*block_size*132 + o*128`` and its scale at
  ``b*block_size*132 + block_size*128 + 4*o``; its reader ``cp_gather_indexer_k_quant_cache_kernel``
  reads the same places. *Disagreement:* one stored version of vLLM's ROCm fallback
  ``fp8_paged_mqa_logits_torch`` (``vllm/v1/attention/ops/rocm_aiter_mla_sparse.py``) reads the
  4-D view per row (``kv_cache[..., :128]`` / ``kv_cache[..., 128:]``), i.e. as if each token's
  132 bytes were contiguous — which is not what its own writer produces; later vLLM versions read
  the blocked layout. This module follows DeepGEMM's paged layout (= vLLM's writer).
* **Scale rule** (:func:`index_key_scales`) — vLLM's writer: ``scale = max(amax, 1e-4) / 448``,
  then, with ``scale_fmt == "ue8m0"`` (what vLLM's DeepSeek V3.2 ``Indexer`` sets,
  ``vllm/model_executor/models/deepseek_v2.py``), rounded **up** to a power of two
  (``exp2f(ceilf(log2f(scale)))``); values are ``x / scale`` rounded to e4m3 (one scale per token:
  ``quant_block_size = head_dim = 128``). DeepGEMM's test quantizer keeps ``amax / 448`` (not a
  power of two); both kinds of caches are read identically (the scale is stored as float32).
* **Queries** (:func:`quantize_index_queries`) — vLLM quantizes the index query per (token, head)
  with ``per_token_group_quant_fp8`` (group 128, ``eps = 1e-10``, ue8m0 scales) and folds the
  query scale into the head weights:
  ``weights = weights * q_scale * softmax_scale * n_heads ** -0.5`` with
  ``softmax_scale = head_dim ** -0.5`` (``Indexer.forward`` in ``deepseek_v2.py``); DeepGEMM's
  kernels take the FP8 query unscaled and these weights.

Decisions this module makes (and tests)
---------------------------------------
* The power-of-two exponent is computed exactly (``frexp``), not through a rounded ``log2f``:
  for a scale within a float32 ulp above a power of two, vLLM's ``log2f`` may round down to the
  power itself, and its values then saturate at ±448; here the scale rounds up and nothing
  saturates.
* Non-finite keys: ``validate=True`` raises (``ValueError`` naming ``keys``); unvalidated, the
  token's scale is NaN, so every one of its scores is NaN — the damage stays visible.

Owner-only writes
-----------------
Under DCP the index keys are sharded exactly as the KV rows: position ``p`` is written only by
its owner rank, at the same slot its KV row gets. :func:`write_index_tokens` therefore takes the
slots from :func:`dcp_ref.cache_write.token_slots` (the KV cache's write) — a token's index key and
KV row land in the same slot of the same rank, and the read side
(:func:`dcp_ref.deinterleave.global_ids_to_local_slots`) finds both there.
:func:`build_sharded_index_caches` replays a whole server run for tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .cache_write import UNWRITTEN_FP8_BYTE, token_slots
from .contracts import (
    FLOAT_DTYPES,
    INT_DTYPES,
    check_bool,
    check_int_scalar,
    check_tensor,
    check_values_readable,
)
from .geometry import DcpGeometry

__all__ = [
    "IndexKeyLayout",
    "INDEX_K_FP8",
    "UNWRITTEN_INDEX_BYTE",
    "index_key_scales",
    "quantize_index_keys",
    "dequantize_index_keys",
    "quantize_index_queries",
    "make_index_cache",
    "index_cache_blocks",
    "index_cache_slots",
    "as_deepgemm_kv_cache",
    "read_index_keys",
    "write_index_keys",
    "write_index_tokens",
    "build_sharded_index_caches",
]

#: Bytes of a freshly made cache: e4m3fn ``0xFF`` and float32 ``0xFFFFFFFF`` are NaN, so a score
#: read from a slot nobody wrote is NaN (never a plausible number).
UNWRITTEN_INDEX_BYTE = UNWRITTEN_FP8_BYTE


@dataclass(frozen=True)
class IndexKeyLayout:
    """The byte layout of the FP8 index-key cache (defaults: DeepSeek V3.2, 132 bytes per token).

    Attributes:
        head_dim: values per key (128), stored as e4m3 bytes, all tokens of a block first.
        fp8_max: largest finite e4m3fn magnitude (448).
        amax_floor: a key's largest magnitude is clamped at this before dividing by ``fp8_max``
            (vLLM's ``fmaxf(amax, 1e-4)``): an all-zero key gets the smallest scale.
        power_of_two: round the scale up to a power of two (vLLM's ``scale_fmt = "ue8m0"``).
    """

    head_dim: int = 128
    fp8_max: float = 448.0
    amax_floor: float = 1e-4
    power_of_two: bool = True

    def __post_init__(self) -> None:
        check_int_scalar(self.head_dim, "head_dim", min_value=1)
        if self.head_dim % 16:
            raise ValueError(f"head_dim must be a multiple of 16 (an FP8 MMA's K step), got {self.head_dim}")
        if not (self.fp8_max == 448.0):
            raise ValueError(f"fp8_max must be 448.0 (float8_e4m3fn), got {self.fp8_max}")
        if not (isinstance(self.amax_floor, float) and self.amax_floor > 0 and math.isfinite(self.amax_floor)):
            raise ValueError(f"amax_floor must be a finite float > 0, got {self.amax_floor!r}")
        check_bool(self.power_of_two, "power_of_two")

    @property
    def scale_bytes(self) -> int:
        """Bytes of one scale (4: float32)."""
        return 4

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in a block (132)."""
        return self.head_dim + self.scale_bytes

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block of ``block_size`` tokens (``block_size * 132``)."""
        return block_size * self.bytes_per_token

    def value_offset(self, block_size: int, offset: int) -> int:
        """Byte offset, inside its block, of the first value of the token at ``offset``."""
        return offset * self.head_dim

    def scale_offset(self, block_size: int, offset: int) -> int:
        """Byte offset, inside its block, of the float32 scale of the token at ``offset``."""
        return block_size * self.head_dim + self.scale_bytes * offset

    def segments(self, block_size: int) -> list[tuple[int, int, str]]:
        """``(first_byte, end_byte, what)`` of every field of one block, in byte order."""
        d, s = self.head_dim, self.scale_bytes
        segs = [(o * d, (o + 1) * d, f"token {o}: {d} x e4m3") for o in range(block_size)]
        segs += [
            (block_size * d + o * s, block_size * d + (o + 1) * s, f"scale {o}: float32") for o in range(block_size)
        ]
        return segs


#: DeepSeek V3.2's index-key layout (vLLM ``DeepseekV32IndexerCache``, DeepGEMM paged MQA logits).
INDEX_K_FP8 = IndexKeyLayout()


def _ceil_pow2(x: torch.Tensor) -> torch.Tensor:
    """``2 ** ceil(log2(x))`` for positive finite float32 ``x``, exactly (``frexp``)."""
    m, e = torch.frexp(x)  # x = m * 2**e, 0.5 <= m < 1
    e = e - (m == 0.5).to(e.dtype)  # an exact power of two keeps its exponent
    return torch.ldexp(torch.ones_like(x), e)


def _as_f32_rows(t: torch.Tensor, name: str, width: int) -> torch.Tensor:
    check_tensor(t, name, dtypes=FLOAT_DTYPES, ndim=2)
    if t.shape[1] != width:
        raise ValueError(f"{name} must be [N, {width}] (one key of {width} values per row), got shape {tuple(t.shape)}")
    return t.to(torch.float32)


def index_key_scales(keys: torch.Tensor, layout: IndexKeyLayout = INDEX_K_FP8) -> torch.Tensor:
    """The float32 scale of every key: ``max(amax, 1e-4) / 448``, rounded up to a power of two.

    Computed in float32 as vLLM's writer does (``fmaxf(amax, 1e-4) / 448.0f``), the power of two
    exactly (see the module docstring).

    Args:
        keys: float ``[N, head_dim]`` (bf16/fp16/fp32/fp64; converted to float32 first).
        layout: the cache layout (default :data:`INDEX_K_FP8`).
    Returns:
        float32 ``[N]``; ``NaN`` for a key holding NaN or ±inf (after the conversion to float32).
    """
    x = _as_f32_rows(keys, "keys", layout.head_dim)
    finite = torch.isfinite(x).all(dim=1)
    amax = torch.where(finite, x.abs().amax(dim=1), 0.0)
    scale = torch.clamp_min(amax, layout.amax_floor) / layout.fp8_max
    if layout.power_of_two:
        scale = _ceil_pow2(scale)
    return torch.where(finite, scale, math.nan)


def quantize_index_keys(
    keys: torch.Tensor, *, layout: IndexKeyLayout = INDEX_K_FP8, validate: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize index keys per token: ``[N, 128]`` float -> (e4m3 bytes ``[N, 128]``, scales ``[N]``).

    ``values = e4m3(x / scale)`` (round to nearest even; ``x / scale`` is exact for power-of-two
    scales and never exceeds 448 in magnitude), ``scale`` from :func:`index_key_scales`.

    Args:
        keys: float ``[N, head_dim]`` (bf16/fp16/fp32/fp64), any device.
        layout: the cache layout (default :data:`INDEX_K_FP8`).
        validate: check that every key is finite (one host sync): ``ValueError`` naming ``keys``.
            ``False``: a non-finite key gets scale NaN (and NaN values), no host read.
    Returns:
        ``(values, scales)``: uint8 ``[N, head_dim]`` (``.view(torch.float8_e4m3fn)`` gives the
        e4m3 values) and float32 ``[N]``, on ``keys``' device.
    """
    validate = check_bool(validate, "validate")
    x = _as_f32_rows(keys, "keys", layout.head_dim)
    if validate and x.numel():
        check_values_readable(x, "keys")
        if not bool(torch.isfinite(x).all()):
            row = int((~torch.isfinite(x)).any(dim=1).nonzero()[0, 0])
            raise ValueError(
                f"keys must be finite (as float32): key {row} holds NaN or ±inf (pass validate=False to store it as "
                "a NaN scale)"
            )
    scales = index_key_scales(x, layout)
    y = x / scales.unsqueeze(1)  # exact for power-of-two scales; a NaN scale gives NaN values
    if not layout.power_of_two:  # amax / 448 may round so that |y| lands a hair above 448
        y = y.clamp(-layout.fp8_max, layout.fp8_max)
    return y.to(torch.float8_e4m3fn).view(torch.uint8), scales


def dequantize_index_keys(
    values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``values * scale`` per token, as the scoring kernels see the keys.

    Args:
        values: uint8 or float8_e4m3fn ``[N, head_dim]``.  scales: float32 ``[N]``.
        dtype: result dtype (float64 by default: every product of an e4m3 value and a float32
            scale is exact in float64).
    Returns:
        ``[N, head_dim]`` in ``dtype``.
    """
    check_tensor(values, "values", dtypes=(torch.uint8, torch.float8_e4m3fn), ndim=2)
    check_tensor(scales, "scales", dtypes=(torch.float32,), ndim=1, device=values.device)
    if scales.shape[0] != values.shape[0]:
        raise ValueError(f"scales must be [N={values.shape[0]}], got shape {tuple(scales.shape)}")
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of bf16/fp16/fp32/fp64, got {dtype}")
    v = values.view(torch.float8_e4m3fn).to(torch.float64)
    return (v * scales.to(torch.float64).unsqueeze(1)).to(dtype)


def quantize_index_queries(
    q: torch.Tensor,
    weights: torch.Tensor,
    *,
    softmax_scale: float | None = None,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's index-query quantization and weight folding (DeepSeek V3.2 ``Indexer.forward``).

    Each (token, head) query row is quantized with its own power-of-two scale
    ``2 ** ceil(log2(max(amax, 1e-10) / 448))`` (``per_token_group_quant_fp8``, group 128, ue8m0),
    and that scale moves into the head weights, so the scoring kernels take the FP8 query as is::

        weights' = weights * q_scale * softmax_scale * n_heads ** -0.5

    Args:
        q: float ``[T, H, head_dim]`` index queries (after RoPE), bf16/fp16/fp32/fp64.
        weights: float ``[T, H]`` per-head gates (``weights_proj`` of the hidden state).
        softmax_scale: default ``head_dim ** -0.5``.
        validate: check that ``q`` and ``weights`` are finite (``ValueError`` naming them). ``False``: no host
            read; a (token, head) query row holding NaN or ±inf gets scale NaN — NaN values and a NaN weight, so
            its scores are NaN, never a plausible number — the key quantizer's rule (:func:`index_key_scales`).
    Returns:
        ``(q_fp8, weights')``: float8_e4m3fn ``[T, H, head_dim]`` and float32 ``[T, H]``.
    """
    validate = check_bool(validate, "validate")
    check_tensor(q, "q", dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor(weights, "weights", dtypes=FLOAT_DTYPES, ndim=2, device=q.device)
    T, H, D = q.shape
    if weights.shape != (T, H):
        raise ValueError(f"weights must be [T={T}, H={H}] (one gate per token and head), got {tuple(weights.shape)}")
    if softmax_scale is None:
        softmax_scale = D**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a finite float > 0, got {softmax_scale!r}")
    x = q.to(torch.float32)
    if validate and x.numel():
        for name, t in (("q", x), ("weights", weights)):
            check_values_readable(t, name)
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} must be finite, found NaN or ±inf")
    finite = torch.isfinite(x).all(dim=2)  # [T, H]
    amax = torch.where(finite, x.abs().amax(dim=2), 0.0) if D else x.new_zeros((T, H))
    # a non-finite row: scale NaN (an inf amax would round to scale 1 and clamp +inf to a finite 448)
    scale = torch.where(finite, _ceil_pow2(torch.clamp_min(amax, 1e-10) / 448.0), math.nan)  # [T, H]
    q_fp8 = (x / scale.unsqueeze(2)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    w = weights.to(torch.float32) * scale * float(softmax_scale) * H**-0.5
    return q_fp8, w


# ---- the paged cache ----------------------------------------------------------------------------------
def make_index_cache(
    num_blocks: int, block_size: int, device: torch.device | str = "cpu", *, layout: IndexKeyLayout = INDEX_K_FP8
) -> torch.Tensor:
    """A new index-key cache: uint8 ``[num_blocks, block_size * 132]``, every byte ``0xFF``.

    ``0xFF`` reads as a NaN value and a NaN scale: a slot nobody wrote scores NaN.
    """
    nb = check_int_scalar(num_blocks, "num_blocks", min_value=0)
    bs = check_int_scalar(block_size, "block_size", min_value=1)
    return torch.full((nb, layout.block_bytes(bs)), UNWRITTEN_INDEX_BYTE, dtype=torch.uint8, device=device)


def index_cache_blocks(
    index_cache: object, block_size: int, name: str = "index_cache", *, layout: IndexKeyLayout = INDEX_K_FP8
) -> torch.Tensor:
    """The cache as its canonical uint8 ``[num_blocks, block_size * 132]`` view (no copy).

    Accepts ``[num_blocks, block_size * 132]``, vLLM's ``[num_blocks, block_size, 132]`` and
    DeepGEMM's ``[num_blocks, block_size, 1, 132]`` — contiguous uint8, the same bytes.
    Raises ``TypeError`` / ``ValueError`` naming ``name``.
    """
    check_tensor(index_cache, name, dtypes=(torch.uint8,), ndim=(2, 3, 4))
    assert isinstance(index_cache, torch.Tensor)
    w, bb = layout.bytes_per_token, layout.block_bytes(block_size)
    want = {
        2: f"[num_blocks, {bb}]",
        3: f"[num_blocks, {block_size}, {w}]",
        4: f"[num_blocks, {block_size}, 1, {w}]",
    }[index_cache.ndim]
    ok = {
        2: index_cache.shape[1:] == (bb,),
        3: index_cache.shape[1:] == (block_size, w),
        4: index_cache.shape[1:] == (block_size, 1, w),
    }[index_cache.ndim]
    if not ok:
        raise ValueError(
            f"{name} must be {want} for block_size={block_size} ({w} bytes per token: {layout.head_dim} e4m3 values, "
            f"then all the block's float32 scales), got shape {tuple(index_cache.shape)}"
        )
    if not index_cache.is_contiguous():
        raise ValueError(f"{name} must be contiguous (each block is {bb} consecutive bytes)")
    return index_cache.view(index_cache.shape[0], bb)


def index_cache_slots(
    index_cache: object, block_size: int, name: str = "index_cache", *, layout: IndexKeyLayout = INDEX_K_FP8
) -> int:
    """Slots (tokens) the cache holds: ``num_blocks * block_size`` (shape checks of :func:`index_cache_blocks`)."""
    return index_cache_blocks(index_cache, block_size, name, layout=layout).shape[0] * block_size


def as_deepgemm_kv_cache(
    index_cache: torch.Tensor, block_size: int, *, layout: IndexKeyLayout = INDEX_K_FP8
) -> torch.Tensor:
    """The same bytes as DeepGEMM's ``fp8_paged_mqa_logits`` takes them: uint8 ``[num_blocks, block_size, 1, 132]``."""
    blocks = index_cache_blocks(index_cache, block_size, layout=layout)
    return blocks.view(blocks.shape[0], block_size, 1, layout.bytes_per_token)


def index_key_fields(
    blocks: torch.Tensor, block_size: int, layout: IndexKeyLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values uint8 [num_blocks, block_size, head_dim], scales float32 [num_blocks, block_size])`` views."""
    nb, d = blocks.shape[0], layout.head_dim
    values = blocks[:, : block_size * d].view(nb, block_size, d)
    scales = blocks[:, block_size * d :].view(torch.float32)  # a contiguous row of 4*block_size bytes per block
    return values, scales


def _check_slots(slots: object, name: str, num_slots: int, allow_skip: bool, device: torch.device) -> torch.Tensor:
    check_tensor(slots, name, dtypes=INT_DTYPES, ndim=1, device=device)
    assert isinstance(slots, torch.Tensor)
    if slots.numel():
        check_values_readable(slots, name)
        lo = -1 if allow_skip else 0
        bad = (slots < lo) | (slots >= num_slots)
        if bool(bad.any()):
            what = "be -1 (not written here) or lie in" if allow_skip else "lie in"
            raise ValueError(f"{name} must {what} [0, num_slots={num_slots}), found {int(slots[bad][0])}")
    return slots


def read_index_keys(
    index_cache: torch.Tensor, slots: torch.Tensor, block_size: int, *, layout: IndexKeyLayout = INDEX_K_FP8
) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored ``(values, scales)`` of the given slots (``slot = block * block_size + offset``).

    Args:
        index_cache: the cache (see :func:`index_cache_blocks` for the accepted shapes).
        slots: int32/int64 ``[N]`` in ``[0, num_blocks * block_size)`` (checked on the host).
        block_size: tokens per block.
    Returns:
        uint8 ``[N, head_dim]`` and float32 ``[N]``.
    """
    bs = check_int_scalar(block_size, "block_size", min_value=1)
    blocks = index_cache_blocks(index_cache, bs, layout=layout)
    _check_slots(slots, "slots", blocks.shape[0] * bs, allow_skip=False, device=blocks.device)
    values, scales = index_key_fields(blocks, bs, layout)
    s = slots.long()
    b, o = torch.div(s, bs, rounding_mode="floor"), s % bs
    return values[b, o], scales[b, o]


def write_index_keys(
    index_cache: torch.Tensor,
    slots: torch.Tensor,
    keys: torch.Tensor,
    block_size: int,
    *,
    layout: IndexKeyLayout = INDEX_K_FP8,
    validate: bool = True,
) -> None:
    """Quantize ``keys[i]`` (:func:`quantize_index_keys`) into slot ``slots[i]`` in place; ``-1`` skips it.

    Args:
        index_cache: the cache (any accepted shape; written through its canonical view).
        slots: int32/int64 ``[N]``: a slot in ``[0, num_blocks * block_size)``, or ``-1``. The
            written slots must be distinct.
        keys: float ``[N, head_dim]``.
        block_size: tokens per block.
        validate: passed to the quantizer (the slot checks always run: a write is not a hot path).
    """
    bs = check_int_scalar(block_size, "block_size", min_value=1)
    blocks = index_cache_blocks(index_cache, bs, layout=layout)
    _check_slots(slots, "slots", blocks.shape[0] * bs, allow_skip=True, device=blocks.device)
    _as_f32_rows(keys, "keys", layout.head_dim)
    if keys.device != blocks.device:
        raise ValueError(f"keys must be on device {blocks.device} (index_cache's), got {keys.device}")
    if keys.shape[0] != slots.shape[0]:
        raise ValueError(
            f"keys must be [N={slots.shape[0]}, {layout.head_dim}] (one per slot), got {tuple(keys.shape)}"
        )
    keep = slots >= 0
    rows = slots[keep].long()
    if rows.numel() != torch.unique(rows).numel():
        raise ValueError("slots must not repeat a slot: two tokens written to one slot would lose one")
    if not rows.numel():
        return
    values, scales = quantize_index_keys(keys[keep], layout=layout, validate=validate)
    v_view, s_view = index_key_fields(blocks, bs, layout)
    b, o = torch.div(rows, bs, rounding_mode="floor"), rows % bs
    v_view[b, o] = values
    s_view[b, o] = scales


def write_index_tokens(
    index_cache: torch.Tensor,
    geometry: DcpGeometry,
    block_table: torch.Tensor,
    req_ids: torch.Tensor,
    positions: torch.Tensor,
    keys: torch.Tensor,
    *,
    layout: IndexKeyLayout = INDEX_K_FP8,
) -> torch.Tensor:
    """One rank's index-key write: store the new tokens this rank owns, skip the others.

    The slots are the KV cache's (:func:`dcp_ref.cache_write.token_slots`: the same ownership
    math, the same block table), so a token's index key and its KV row share a slot on the same
    rank. Every rank calls this with the same new tokens; each token is written exactly once.

    Args:
        index_cache: this rank's cache (in place).
        geometry: this rank's geometry (``block_size`` is the cache's).
        block_table, req_ids, positions: as in :func:`dcp_ref.cache_write.token_slots`.
        keys: float ``[N, head_dim]`` index keys of the new tokens.
    Returns:
        int64 ``[N]``: the slot each token was written to, ``-1`` where another rank owns it.
    """
    slots = token_slots(geometry, block_table, req_ids, positions)
    write_index_keys(index_cache, slots, keys, geometry.block_size, layout=layout)
    return slots


def build_sharded_index_caches(
    keys_global: Sequence[torch.Tensor],
    block_tables: Sequence[torch.Tensor],
    geometry: DcpGeometry,
    num_blocks: int | Sequence[int],
    *,
    prefill: int = 0,
    layout: IndexKeyLayout = INDEX_K_FP8,
) -> list[torch.Tensor]:
    """Every rank's index-key cache after a server has written each request's keys step by step.

    Mirrors :func:`dcp_ref.cache_write.build_sharded_caches`: step ``s`` appends position ``s`` of
    every request at least ``s + 1`` long (``prefill > 0``: the first step writes positions
    ``[0, prefill)`` at once); every rank sees every new token and writes those it owns
    (:func:`write_index_tokens`).

    Args:
        keys_global: per request ``b``, float ``[L_b, head_dim]``: the index keys of its positions.
        block_tables: per rank, int ``[B, M_r]``: that rank's block table (the KV cache's).
        geometry: the group's geometry (any rank; all ``world_size`` ranks are built).
        num_blocks: blocks of each rank's cache (one int for all, or one per rank).
        prefill: positions written by the first step.
    Returns:
        ``world_size`` caches, uint8 ``[num_blocks, block_size * 132]``; bytes never written stay
        :data:`UNWRITTEN_INDEX_BYTE` (NaN).
    """
    if not isinstance(geometry, DcpGeometry):
        raise TypeError(f"geometry must be a dcp_ref.geometry.DcpGeometry, got {type(geometry).__name__}")
    w = geometry.world_size
    if len(block_tables) != w:
        raise ValueError(f"block_tables must hold one table per rank ({w}), got {len(block_tables)}")
    sizes = [num_blocks] * w if isinstance(num_blocks, int) else list(num_blocks)
    if len(sizes) != w:
        raise ValueError(f"num_blocks must be an int or one per rank ({w}), got {len(sizes)}")
    sizes = [check_int_scalar(s, "num_blocks", min_value=0) for s in sizes]
    p0 = check_int_scalar(prefill, "prefill", min_value=0)
    if not keys_global:
        raise ValueError("keys_global must hold at least one request")
    for b, k in enumerate(keys_global):
        _as_f32_rows(k, f"keys_global[{b}]", layout.head_dim)
    dev = keys_global[0].device
    caches = [make_index_cache(s, geometry.block_size, dev, layout=layout) for s in sizes]
    lens = [k.shape[0] for k in keys_global]
    ranks = geometry.all_ranks()

    def step(req: list[int], pos: list[int]) -> None:
        if not req:
            return
        r_t = torch.tensor(req, dtype=torch.int64, device=dev)
        p_t = torch.tensor(pos, dtype=torch.int64, device=dev)
        rows = torch.stack([keys_global[b][p] for b, p in zip(req, pos)])
        for geo, cache, table in zip(ranks, caches, block_tables):
            write_index_tokens(cache, geo, table.to(dev), r_t, p_t, rows, layout=layout)

    if p0:
        step([b for b, n in enumerate(lens) for _ in range(min(p0, n))], [p for n in lens for p in range(min(p0, n))])
    for s in range(p0, max(lens)):
        req = [b for b, n in enumerate(lens) if n > s]
        step(req, [s] * len(req))
    return caches
