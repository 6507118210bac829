"""The cache write: new tokens' KV rows into this rank's paged cache (bf16/float or FP8).

Every decode (or prefill) step computes the latent KV row of each new token — on every rank of
the DCP group, since they all run the same layers on the same tokens — and then **only the owner
of position** ``p`` stores it, at its local index, through the request's block table::

    owner  = (p // I) % W                                   (nobody else writes p)
    local  = (p // (W*I)) * I + p % I
    slot   = block_table[req, local // block_size] * block_size + local % block_size

This is vLLM's ``slot_mapping`` under DCP: ``-1`` for the tokens another rank stores, which the
write kernel (``concat_and_cache_mla`` / ``concat_and_cache_ds_mla``) skips. The slot a token is
written to is the one the read side (:func:`dcp_ref.deinterleave.global_ids_to_local_slots`)
finds for the same position later; the tests check the two agree.

Two cache formats:

* float cache ``[num_blocks * block_size, D]`` (bf16, fp16, fp32 or fp64): the row is stored as is
  (cast to the cache's dtype);
* FP8 cache ``[num_blocks * block_size, 656]`` (uint8 or float8_e4m3fn): the row is quantized to
  DeepSeek V3.2's layout (:func:`dcp_ref.fp8_cache.quantize_kv_fp8`).

:func:`build_sharded_caches` replays a whole server run for tests: the tokens of every request
written step by step on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

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
from .fp8_cache import FP8_CACHE_DTYPES, FP8_DS_MLA, Fp8CacheLayout, check_layout, quantize_kv_fp8
from .geometry import DcpGeometry
from .ownership import global_to_local, owner_rank

__all__ = ["token_slots", "write_cache_rows", "write_tokens", "build_sharded_caches", "UNWRITTEN_FP8_BYTE"]

#: FP8 caches built by :func:`build_sharded_caches` start filled with this byte: every field of an
#: unwritten row then reads as NaN (e4m3fn ``0xFF``, float32 ``0xFFFFFFFF``, bf16 ``0xFFFF``), the
#: FP8 analogue of the NaN that :func:`dcp_ref.pipeline.make_dcp_problem` puts in unused float rows.
UNWRITTEN_FP8_BYTE = 0xFF


def _check_geometry(geometry: object) -> DcpGeometry:
    if not isinstance(geometry, DcpGeometry):
        raise TypeError(f"geometry must be a dcp_ref.geometry.DcpGeometry, got {type(geometry).__name__}")
    return geometry


def token_slots(
    geometry: DcpGeometry, block_table: torch.Tensor, req_ids: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Where this rank writes each new token: its cache row, or ``-1`` when another rank owns it.

    Args:
        geometry: this rank's :class:`~dcp_ref.geometry.DcpGeometry` (``block_size`` is the cache's).
        block_table: int32/int64 ``[B, M]``: physical block of each request's local block ``j``
            (``-1`` = none allocated).
        req_ids: int32/int64 ``[N]``: the request (row of ``block_table``) of each new token,
            in ``[0, B)``.
        positions: int32/int64 ``[N]``: each token's global position, ``>= 0``.
    Returns:
        int64 ``[N]`` on ``positions``' device: ``block * block_size + local % block_size`` for the
        tokens this rank owns, ``-1`` for the others.
    Raises:
        TypeError / ValueError naming the argument; ``block_table`` when an owned token's local
        block lies past the table or has no block (``-1``) — writing it would lose the token.
    """
    g = _check_geometry(geometry)
    check_tensor(block_table, "block_table", dtypes=INT_DTYPES, ndim=2)
    check_tensor(req_ids, "req_ids", dtypes=INT_DTYPES, ndim=1)
    check_tensor(positions, "positions", dtypes=INT_DTYPES, ndim=1)
    check_same_device(block_table=block_table, req_ids=req_ids, positions=positions)
    if req_ids.shape != positions.shape:
        raise ValueError(
            f"req_ids and positions must have one entry per token, got {tuple(req_ids.shape)} and "
            f"{tuple(positions.shape)}"
        )
    B, M = block_table.shape
    n = positions.shape[0]
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=positions.device)
    check_values_readable(req_ids, "req_ids")
    check_values_readable(positions, "positions")
    check_values_readable(block_table, "block_table")
    req = req_ids.long()
    pos = positions.long()
    req_ok = (req >= 0) & (req < B)
    pos_c = pos.clamp(min=0)
    mine = (pos >= 0) & (owner_rank(pos_c, g.world_size, g.interleave) == g.rank)
    local = global_to_local(pos_c, g.world_size, g.interleave)
    blk = torch.div(local, g.block_size, rounding_mode="floor")
    readable = mine & req_ok & (blk < M)
    if M and B:
        phys = block_table[torch.where(req_ok, req, 0), torch.where(readable, blk, 0)].long()
    else:  # no blocks at all: fine as long as this rank owns none of the tokens (checked below)
        phys = torch.full_like(pos, -1)
    phys = torch.where(readable, phys, -1)
    # Every value condition in one device reduction and one host read; the messages read more.
    n_bad_req, n_neg, n_past, n_noblock = host_values(
        (~req_ok).sum(), (pos < 0).sum(), (mine & req_ok & (blk >= M)).sum(), (readable & (phys < 0)).sum()
    )
    if n_bad_req:
        raise ValueError(
            f"req_ids must lie in [0, B={B}) (rows of block_table), got min {int(req_ids.min())}, "
            f"max {int(req_ids.max())}"
        )
    if n_neg:
        raise ValueError(f"positions must be >= 0, found {int(positions.min())}")
    if n_past:
        i = int((mine & (blk >= M)).nonzero()[0, 0])
        raise ValueError(
            f"block_table has {M} blocks per request, but position {int(pos[i])} (owned by rank {g.rank}) needs "
            f"local block {int(blk[i])}: allocate the block before writing"
        )
    if n_noblock:
        i = int((readable & (phys < 0)).nonzero()[0, 0])
        raise ValueError(
            f"block_table[{int(req_ids[i])}, {int(blk[i])}] is {int(phys[i])} (no block), but position {int(pos[i])} "
            f"owned by rank {g.rank} must be written there"
        )
    slot = phys * g.block_size + local % g.block_size
    return torch.where(mine, slot, -1)


def _cache_kind(cache: object, layout: Fp8CacheLayout) -> str:
    check_tensor(cache, "cache", dtypes=FLOAT_DTYPES + FP8_CACHE_DTYPES, ndim=2)
    assert isinstance(cache, torch.Tensor)
    if cache.dtype in FP8_CACHE_DTYPES:
        if cache.shape[1] != layout.bytes_per_token:
            raise ValueError(
                f"an FP8 cache ({cache.dtype}) must be [num_slots, {layout.bytes_per_token}], "
                f"got shape {tuple(cache.shape)}"
            )
        return "fp8"
    return "float"


def write_cache_rows(
    cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor, *, layout: Fp8CacheLayout = FP8_DS_MLA
) -> None:
    """Store ``kv[i]`` into cache row ``slots[i]`` (in place); ``slots[i] == -1`` skips the row.

    Args:
        cache: float ``[num_slots, D]`` or FP8 (uint8/float8_e4m3fn) ``[num_slots, 656]``.
        slots: int32/int64 ``[N]``: a row in ``[0, num_slots)``, or ``-1`` (not written here).
            The written rows must be distinct: two tokens in one row would silently lose one.
        kv: float ``[N, D]`` (``D = 576`` for an FP8 cache: it is quantized here).
        layout: the FP8 layout (default :data:`~dcp_ref.fp8_cache.FP8_DS_MLA`).
    Raises:
        TypeError / ValueError naming the argument.
    """
    kind = _cache_kind(cache, layout)
    check_tensor(slots, "slots", dtypes=INT_DTYPES, ndim=1)
    check_tensor(kv, "kv", dtypes=FLOAT_DTYPES, ndim=2)
    check_same_device(cache=cache, slots=slots, kv=kv)
    width = layout.head_dim if kind == "fp8" else cache.shape[1]
    if kv.shape != (slots.shape[0], width):
        raise ValueError(f"kv must be [N={slots.shape[0]}, {width}] (one row per slot), got shape {tuple(kv.shape)}")
    check_no_alias(cache, "cache", slots=slots, kv=kv)  # written while kv is read
    num_slots = cache.shape[0]
    if not slots.numel():
        return
    check_values_readable(slots, "slots")
    s64 = slots.long()
    bad = (s64 < -1) | (s64 >= num_slots)
    keep = s64 >= 0
    # Repeats among the written rows: sort them (unwritten entries get distinct negative keys).
    srt = torch.sort(torch.where(keep, s64, -2 - torch.arange(s64.numel(), device=s64.device))).values
    first_at = torch.argmax(bad.to(torch.int8)).reshape(1)  # a device index: no host read
    n_bad, first_bad, n_dup = host_values(
        bad.sum(), s64.gather(0, first_at), ((srt[1:] == srt[:-1]) & (srt[1:] >= 0)).sum()
    )
    if n_bad:
        raise ValueError(f"slots must be -1 (not written here) or lie in [0, num_slots={num_slots}), found {first_bad}")
    if n_dup:
        raise ValueError("slots must not repeat a cache row: two tokens written to one row would lose one")
    rows = s64[keep]
    if rows.numel() == 0:
        return
    if kind == "fp8":
        cache.view(torch.uint8)[rows] = quantize_kv_fp8(kv[keep], layout)
    else:
        cache[rows] = kv[keep].to(cache.dtype)


def write_tokens(
    cache: torch.Tensor,
    geometry: DcpGeometry,
    block_table: torch.Tensor,
    req_ids: torch.Tensor,
    positions: torch.Tensor,
    kv: torch.Tensor,
    *,
    layout: Fp8CacheLayout = FP8_DS_MLA,
) -> torch.Tensor:
    """The cache-write stage of one rank: store the new tokens this rank owns, skip the others.

    :func:`token_slots` then :func:`write_cache_rows`. Every rank of the group calls this with
    the same new tokens; each token ends up in exactly one rank's cache.

    Args:
        cache: this rank's float ``[num_slots, D]`` or FP8 ``[num_slots, 656]`` cache (in place).
        geometry, block_table, req_ids, positions: as in :func:`token_slots`.
        kv: float ``[N, D]`` rows of the new tokens (``D = 576`` for FP8).
    Returns:
        int64 ``[N]``: the row each token was written to, ``-1`` where another rank owns it.
    """
    slots = token_slots(geometry, block_table, req_ids, positions)
    write_cache_rows(cache, slots, kv, layout=layout)
    return slots


def build_sharded_caches(
    kv_global: Sequence[torch.Tensor],
    block_tables: Sequence[torch.Tensor],
    geometry: DcpGeometry,
    num_slots: int | Sequence[int],
    *,
    fp8: bool = True,
    dtype: torch.dtype = torch.float64,
    prefill: int = 0,
    layout: Fp8CacheLayout = FP8_DS_MLA,
) -> list[torch.Tensor]:
    """Every rank's cache after a server has written each request's tokens, one step at a time.

    Step ``s`` appends position ``s`` of every request that is at least ``s + 1`` long (a decode
    step over the batch); with ``prefill > 0`` the first step writes positions ``[0, prefill)``
    of every request at once (a prefill). Every rank sees every new token and writes the ones it
    owns (:func:`write_tokens`).

    Args:
        kv_global: per request ``b``, float ``[L_b, D]``: the KV rows of positions ``0 .. L_b-1``.
        block_tables: per rank ``r``, int ``[B, M_r]``: that rank's block table.
        geometry: the group's geometry (any rank; all ``world_size`` ranks are built).
        num_slots: rows of each rank's cache (one int for all, or one per rank).
        fp8: build FP8 caches ``[num_slots, 656]`` uint8 (``D`` must be 576); else float caches
            ``[num_slots, D]`` in ``dtype``.
        dtype: the float caches' dtype.
        prefill: positions written by the first step (``0``: decode steps only).
    Returns:
        ``world_size`` caches. Rows never written hold NaN (float) or :data:`UNWRITTEN_FP8_BYTE`
        bytes (FP8; every field reads as NaN).
    """
    g = _check_geometry(geometry)
    w = g.world_size
    fp8 = check_bool(fp8, "fp8")
    check_layout(layout)
    if not isinstance(kv_global, (list, tuple)):
        raise TypeError(f"kv_global must be a list of tensors (one per request), got {type(kv_global).__name__}")
    if not isinstance(block_tables, (list, tuple)):
        raise TypeError(f"block_tables must be a list of tensors (one per rank), got {type(block_tables).__name__}")
    if len(block_tables) != w:
        raise ValueError(f"block_tables must hold one table per rank ({w}), got {len(block_tables)}")
    if isinstance(num_slots, (list, tuple)):
        sizes = list(num_slots)
        if len(sizes) != w:
            raise ValueError(f"num_slots must be an int or one per rank ({w}), got {len(sizes)}")
    else:
        sizes = [num_slots] * w
    sizes = [check_int_scalar(s, "num_slots", min_value=0) for s in sizes]
    p0 = check_int_scalar(prefill, "prefill", min_value=0)
    if not kv_global:
        raise ValueError("kv_global must hold at least one request")
    check_tensor(kv_global[0], "kv_global[0]", dtypes=FLOAT_DTYPES, ndim=2)
    for b, kv in enumerate(kv_global):
        check_tensor(kv, f"kv_global[{b}]", dtypes=FLOAT_DTYPES, ndim=2, device=kv_global[0].device)
    for r, table in enumerate(block_tables):
        check_tensor(table, f"block_tables[{r}]", dtypes=INT_DTYPES, ndim=2)
        if table.shape[0] != len(kv_global):
            raise ValueError(
                f"block_tables[{r}] must have one row per request ({len(kv_global)}), got shape {tuple(table.shape)}"
            )
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
    d = kv_global[0].shape[1]
    if any(kv.shape[1] != d for kv in kv_global):
        raise ValueError(f"kv_global rows must all be {d} wide, got {[kv.shape[1] for kv in kv_global]}")
    if fp8 and d != layout.head_dim:
        raise ValueError(f"fp8=True needs kv_global rows of {layout.head_dim} values, got {d}")
    dev = kv_global[0].device
    if fp8:
        caches = [
            torch.full((s, layout.bytes_per_token), UNWRITTEN_FP8_BYTE, dtype=torch.uint8, device=dev) for s in sizes
        ]
    else:
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of bf16/fp16/fp32/fp64, got {dtype}")
        caches = [torch.full((s, d), float("nan"), dtype=dtype, device=dev) for s in sizes]
    lens = [kv.shape[0] for kv in kv_global]
    ranks = g.all_ranks()

    def step(req: list[int], pos: list[int]) -> None:
        if not req:
            return
        r_t = torch.tensor(req, dtype=torch.int64, device=dev)
        p_t = torch.tensor(pos, dtype=torch.int64, device=dev)
        rows = torch.stack([kv_global[b][p] for b, p in zip(req, pos)])
        for geo, cache, table in zip(ranks, caches, block_tables):
            write_tokens(cache, geo, table.to(dev), r_t, p_t, rows, layout=layout)

    if p0:
        req = [b for b, n in enumerate(lens) for _ in range(min(p0, n))]
        step(req, [p for n in lens for p in range(min(p0, n))])
    for s in range(p0, max(lens)):
        req = [b for b, n in enumerate(lens) if n > s]
        step(req, [s] * len(req))
    return caches
