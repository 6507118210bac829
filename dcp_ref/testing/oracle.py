"""Brute-force oracles for every stage and for the whole decode step, on *your* tensors.

Each function here recomputes one stage's contract from scratch — plain Python sorting over
``(score, id)`` tuples, float64 softmax one row at a time — without calling the stage modules of
:mod:`dcp_ref` (which are themselves checked against these functions in the project's tests).
They are slow on purpose (loops, the host) and meant for small inputs: the cases the conformance
checkers generate, or a slice of a real batch you want to double-check.

:func:`decode` is the oracle of a whole decode step that takes the tensors a serving engine
actually holds — each rank's paged KV cache, block table and index scores, the sequence lengths,
the query — rather than a generated :class:`dcp_ref.pipeline.DcpProblem`::

    from dcp_ref.testing import oracle
    ref = oracle.decode(q, kv_caches, block_tables, index_scores, seq_lens, next_n=1, topk=2048,
                        sm_scale=0.1, block_size=64, interleave=1)
    torch.testing.assert_close(my_out.double(), ref.out)        # [T, H, v] float64, base-e LSE in ref.lse

The total order every selection uses (index top-K, global top-k): score descending as float32,
``-0.0 == +0.0``, then the lower id first; a NaN score or a negative id is invalid and never chosen.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..geometry import DcpGeometry  # a value (four checked ints), not a stage: the formulas below are the oracle's own

__all__ = [
    "float32_value",
    "selection_key",
    "select",
    "local_topk",
    "pack",
    "indexer",
    "deinterleave",
    "select_to_slots",
    "guard",
    "scoring",
    "INDEX_HEAD_DIM",
    "POISON_SLOT",
    "attention",
    "correct",
    "merge",
    "DecodeResult",
    "decode",
    "decode_bounds",
]

_INT = (torch.int32, torch.int64)
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _tensor(x: object, name: str, dtypes: tuple[torch.dtype, ...], ndim: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d).replace('torch.', '') for d in dtypes]}, got {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
    return x.detach().cpu()


def float32_value(v: float) -> float:
    """``v`` rounded to float32: the selections compare scores as float32 (``struct`` for speed)."""
    return (
        struct.unpack("f", struct.pack("f", v))[0]
        if math.isfinite(v) and abs(v) < 3.4e38
        else float(torch.tensor(v, dtype=torch.float64).to(torch.float32))
    )


def selection_key(score: float, ident: int) -> tuple[float, int] | None:
    """Sort key of one candidate (ascending = selection order), ``None`` when invalid.

    ``(-score, id)``: a higher float32 score first, then the lower id; ``-0.0`` counts as ``+0.0``;
    a NaN score or a negative id is invalid.
    """
    s = float32_value(score)
    if math.isnan(s) or ident < 0:
        return None
    return (-(s + 0.0), int(ident))


def _top(cands: list[tuple[float, int]], k: int) -> list[int]:
    """Ids of the ``k`` best valid candidates (score, id), in selection order."""
    keyed = [(key, ident) for s, ident in cands if (key := selection_key(s, ident)) is not None]
    keyed.sort()
    return [ident for _, ident in keyed[:k]]


def _pad(rows: list[list[int]], k: int) -> torch.Tensor:
    out = torch.full((len(rows), k), -1, dtype=torch.int64)
    for t, ids in enumerate(rows):
        if ids:
            out[t, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
    return out


def select(gathered: torch.Tensor, k: int) -> torch.Tensor:
    """Stable global top-``k`` of all-gathered candidates.

    Args:
        gathered: float32 ``[W, T, K, 2]`` (``[..., 0]`` score, ``[..., 1]`` global id; id ``-1`` or a
            NaN score = invalid). Ids are compared as integers (a NaN id is invalid).
        k: ``k >= 1``.
    Returns:
        int64 ``[T, k]``: the winners in selection order, ``-1`` after the last valid one.
    """
    g = _tensor(gathered, "gathered", (torch.float32,), 4)
    if g.shape[-1] != 2:
        raise ValueError(f"gathered must end in a (score, id) pair, got shape {tuple(g.shape)}")
    W, T = g.shape[:2]
    vals = g.tolist()
    rows = []
    for t in range(T):
        cands = []
        for w in range(W):
            for s, i in vals[w][t]:
                cands.append((s, -1 if math.isnan(i) else int(i)))
        rows.append(_top(cands, k))
    return _pad(rows, k)


def local_topk(
    scores: torch.Tensor, k: int, lengths: torch.Tensor, row_starts: torch.Tensor | None = None
) -> torch.Tensor:
    """Local stable top-``k`` of each row: local key ``j < lengths[t]`` is column ``row_starts[t] + j``.

    Returns int64 ``[T, k]`` local indices ``j`` in selection order (ties: lower ``j``), ``-1`` padded.
    """
    s = _tensor(scores, "scores", _FLOAT, 2)
    n = _tensor(lengths, "lengths", _INT, 1)
    T, C = s.shape
    st = torch.zeros(T, dtype=torch.int64) if row_starts is None else _tensor(row_starts, "row_starts", _INT, 1)
    rows = []
    for t in range(T):
        a, m = int(st[t]), int(n[t])
        if a < 0 or m < 0 or a + m > C:
            raise ValueError(f"row {t}: row_starts + lengths = {a} + {m} must lie in [0, cols={C}]")
        rows.append(_top([(float(s[t, a + j]), j) for j in range(m)], k))
    return _pad(rows, k)


def _to_global(j: int, world_size: int, rank: int, interleave: int) -> int:
    return (j // interleave) * (world_size * interleave) + rank * interleave + j % interleave


def _geometry(geometry: object) -> DcpGeometry:
    if not isinstance(geometry, DcpGeometry):
        raise TypeError(f"geometry must be a dcp_ref.geometry.DcpGeometry, got {type(geometry).__name__}")
    return geometry


def pack(
    scores: torch.Tensor,
    local_ids: torch.Tensor,
    geometry: DcpGeometry,
    row_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(score, global id)`` of each local index, position by position; ``(-inf, -1)`` for ``-1``.

    The global id of local index ``j`` on rank ``r`` is ``(j // I)*(W*I) + r*I + j % I`` (``geometry``'s
    world size, rank and interleave). Returns float32 ``[T, K, 2]``; the score is the float32 value of
    column ``row_starts[t] + j``.
    """
    g = _geometry(geometry)
    s = _tensor(scores, "scores", _FLOAT, 2)
    ids = _tensor(local_ids, "local_ids", _INT, 2)
    T, K = ids.shape
    st = torch.zeros(T, dtype=torch.int64) if row_starts is None else _tensor(row_starts, "row_starts", _INT, 1)
    out = torch.empty((T, K, 2), dtype=torch.float32)
    for t in range(T):
        for c in range(K):
            j = int(ids[t, c])
            if j < 0:
                out[t, c, 0], out[t, c, 1] = -math.inf, -1.0
            else:
                out[t, c, 0] = float(s[t, int(st[t]) + j])
                out[t, c, 1] = float(_to_global(j, g.world_size, g.rank, g.interleave))
    return out


def indexer(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    k: int,
    geometry: DcpGeometry,
    row_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The indexer stage: :func:`local_topk` then :func:`pack` (float32 ``[T, k, 2]``, selection order)."""
    return pack(scores, local_topk(scores, k, lengths, row_starts), geometry, row_starts)


#: The slot a deinterleave stage writes for out-of-contract metadata (``dcp_ref.deinterleave.POISON_SLOT``,
#: restated here: the oracle imports no stage module).
POISON_SLOT = 2**31 - 1


def deinterleave(
    global_ids: torch.Tensor,
    req_of_token: torch.Tensor,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
) -> torch.Tensor:
    """Physical slot of each global id on this rank, position by position (``-1`` when not here).

    With ``geometry``'s ``W``, ``rank``, ``I`` and ``block_size``: id ``p`` is here when ``p >= 0`` and
    ``(p // I) % W == rank``; its slot is
    ``block_table[req, l // block_size] * block_size + l % block_size`` with
    ``l = (p // (W*I))*I + p % I``. Out-of-contract metadata gives :data:`POISON_SLOT` (``2**31 - 1``,
    which the attention stage turns into NaN) instead of a plausible "not here": an id this rank owns
    whose local block is past the table or negative (any negative entry means "no block"), a slot that
    does not fit below ``2**31 - 1``, and *every* entry of a row whose request id is not a row of the
    block table. Returns int64 ``[T, k]`` — the *masked* layout; compact it with ``row[row >= 0]``
    (poisoned entries count as slots).
    """
    ids = _tensor(global_ids, "global_ids", _INT, 2)
    req = _tensor(req_of_token, "req_of_token", _INT, 1)
    bt = _tensor(block_table, "block_table", _INT, 2)
    T, K = ids.shape
    B, M = bt.shape
    g = _geometry(geometry)
    w, rank, i, bs = g.world_size, g.rank, g.interleave, g.block_size
    out = torch.full((T, K), -1, dtype=torch.int64)
    for t in range(T):
        b = int(req[t])
        if not 0 <= b < B:
            out[t] = POISON_SLOT  # a request the block table does not have: the whole row is poisoned
            continue
        for c in range(K):
            p = int(ids[t, c])
            if p < 0 or (p // i) % w != rank:
                continue
            loc = (p // (w * i)) * i + p % i
            blk = int(bt[b, loc // bs]) if loc // bs < M else -1
            out[t, c] = min(blk * bs + loc % bs, POISON_SLOT) if blk >= 0 else POISON_SLOT
    return out


def select_to_slots(
    gathered: torch.Tensor,
    own_ids: torch.Tensor | None,
    req_of_token: torch.Tensor,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    k: int,
    *,
    order: str = "global_id",
) -> list[list[int]]:
    """This rank's winners of the global top-``k``, as physical slots in selection order, one list per row.

    ``order="global_id"``: ``gathered`` float32 ``[W, T, K, 2]`` (score, global id), the selection order of
    :func:`select`; a winner is this rank's when ``(id // I) % W == rank``, at local index
    ``(id // (W*I))*I + id % I``. ``order="rank_local"``: ``gathered`` float32 ``[W, T, K]`` scores (NaN: none),
    ``own_ids`` int ``[T, K]`` this rank's local indices; the order is score descending, then the lower
    position ``w*K + c`` (the lower rank, then the lower local index); a winner is this rank's when
    ``w == rank``, at local index ``own_ids[t, c]``. A winner's slot is
    ``block_table[req, l // block_size] * block_size + l % block_size``; :data:`POISON_SLOT` where the request
    id is not a row of the table, the local index is negative, its block is past the table or negative, or
    the slot does not fit below ``2**31 - 1``.
    """
    req = _tensor(req_of_token, "req_of_token", _INT, 1).tolist()
    bt = _tensor(block_table, "block_table", _INT, 2).tolist()
    g = _geometry(geometry)
    w_all, rank, i, bs = g.world_size, g.rank, g.interleave, g.block_size
    B = len(bt)
    if order == "global_id":
        vals = _tensor(gathered, "gathered", (torch.float32,), 4).tolist()
        W, T, K = len(vals), len(vals[0]) if vals else 0, len(vals[0][0]) if vals and vals[0] else 0
    elif order == "rank_local":
        vals = _tensor(gathered, "gathered", (torch.float32,), 3).tolist()
        own = _tensor(own_ids, "own_ids", _INT, 2).tolist()
        W, T, K = len(vals), len(vals[0]) if vals else 0, len(vals[0][0]) if vals and vals[0] else 0
    else:
        raise ValueError(f"order must be 'global_id' or 'rank_local', got {order!r}")
    out = []
    for t in range(T):
        cands = []  # (key, local index or None when another rank's)
        for w in range(W):
            for c in range(K):
                if order == "global_id":
                    s, f = vals[w][t][c]
                    ident = -1 if math.isnan(f) else int(f)
                    key = selection_key(s, ident)
                    mine = ident >= 0 and (ident // i) % w_all == rank
                    loc = (ident // (w_all * i)) * i + ident % i if mine else None
                else:
                    key = selection_key(vals[w][t][c], w * K + c)
                    loc = own[t][c] if w == rank else None
                if key is not None:
                    cands.append((key, loc))
        cands.sort(key=lambda e: e[0])
        row = []
        for _, loc in cands[:k]:
            if loc is None:
                continue
            b = req[t]
            blk = bt[b][loc // bs] if 0 <= b < B and loc >= 0 and loc // bs < len(bt[b]) else -1
            row.append(min(blk * bs + loc % bs, POISON_SLOT) if blk >= 0 else POISON_SLOT)
        out.append(row)
    return out


def guard(
    local_bounds: torch.Tensor,
    req_of_token: torch.Tensor,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    n_cols: int,
    row_starts: torch.Tensor | None = None,
    *,
    num_blocks: int | None = None,
    next_n: int = 1,
    index_q: torch.Tensor | None = None,
    index_weights: torch.Tensor | None = None,
) -> list[bool]:
    """Per query token, whether its step metadata is inside the contract (the guard poisons the others).

    Token ``t`` of request ``b = req_of_token[t]`` (``B`` rows, ``M`` columns in the block table), bound
    ``n = local_bounds[t]``, start ``s = row_starts[t]`` (0 without): ``0 <= b < B``, ``n >= 0``, ``s >= 0``,
    ``s + n <= n_cols``, and each of the blocks ``0 .. ceil(n / block_size) - 1`` of request ``b`` exists (inside
    the table's width, entry ``>= 0``, and below ``num_blocks`` when given). A scoring step's rows too: the
    ``next_n`` tokens of ``t``'s group name one request, and ``index_q[t]`` / ``index_weights[t]`` are finite.
    """
    bounds = _tensor(local_bounds, "local_bounds", _INT, 1).tolist()
    req = _tensor(req_of_token, "req_of_token", _INT, 1).tolist()
    bt = _tensor(block_table, "block_table", _INT, 2).tolist()
    starts = [0] * len(bounds) if row_starts is None else _tensor(row_starts, "row_starts", _INT, 1).tolist()
    bs = _geometry(geometry).block_size
    lim = math.inf if num_blocks is None else num_blocks
    finite = [True] * len(bounds)
    if index_q is not None and index_weights is not None:
        q, w = index_q.double().tolist(), index_weights.double().tolist()
        finite = [all(math.isfinite(x) for row in q[t] for x in row) and all(math.isfinite(x) for x in w[t])
                  for t in range(len(bounds))]  # fmt: skip
    B = len(bt)
    out = []
    for t, (b, n, s) in enumerate(zip(req, bounds, starts)):
        need = -(-n // bs) if n >= 0 else 0
        group = req[t // next_n * next_n : (t // next_n + 1) * next_n]
        ok = 0 <= b < B and n >= 0 and s >= 0 and s + n <= n_cols and len(set(group)) == 1 and finite[t]
        ok = ok and need <= len(bt[b]) and all(0 <= bt[b][j] < lim for j in range(need))
        out.append(bool(ok))
    return out


#: The FP8 index keys' values per token (DeepSeek V3.2: 128 e4m3 bytes, then a float32 scale per token; the
#: layout ``dcp_ref.index_cache.INDEX_K_FP8`` documents, restated here: the oracle imports no stage module).
INDEX_HEAD_DIM = 128


def _fp8_values(raw: torch.Tensor) -> list[float]:
    """e4m3fn bytes as float64 values (NaN for ``S.1111.111``), decoded by hand from the format."""
    out = []
    for b in raw.tolist():
        sign = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 0xF, b & 0x7
        if e == 0xF and m == 0x7:
            out.append(math.nan)
        elif e == 0:
            out.append(sign * m / 8.0 * 2.0**-6)
        else:
            out.append(sign * (1.0 + m / 8.0) * 2.0 ** (e - 7))
    return out


def scoring(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_of_token: torch.Tensor,
    local_bounds: torch.Tensor,
    geometry: DcpGeometry,
    n_cols: int,
    row_starts: torch.Tensor | None = None,
    next_n: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scoring stage in float64: ``(scores [T, n_cols], magnitude [T, n_cols])``.

    ``scores[t, s + j] = sum_h w[t, h] * relu(q[t, h] . k[j]) * scale[j]`` for local key ``j < n`` of token ``t``
    (start ``s = row_starts[t]``, bound ``n = local_bounds[t]``), ``-inf`` in every other column; ``relu`` keeps a
    NaN (NaN data propagates: a NaN value, scale or weight makes its cells NaN). Key ``j`` is token ``j % bs`` of
    block ``block_table[b, j // bs]`` (``b = req_of_token[t]``) in ``index_cache`` (``uint8 [num_blocks,
    bs * 132]``: the block's ``bs`` tokens of 128 e4m3 bytes, then their ``bs`` float32 scales). A row out of
    contract is all NaN: a request outside the table, a negative bound or start, ``s + n > n_cols``, more keys
    than the table's columns cover, a needed block ``< 0`` or ``>= num_blocks``, or a group of ``next_n`` tokens
    naming two requests. ``magnitude`` is the same sum of absolute values (the scale of a cell's rounding error).
    """
    q = _tensor(index_q, "index_q", (torch.float8_e4m3fn, *_FLOAT), 3)
    q64 = [[_fp8_values(row.view(torch.uint8)) for row in tq] for tq in q] if q.dtype == torch.float8_e4m3fn else (
        q.double().tolist())  # fmt: skip
    w = _tensor(weights, "weights", _FLOAT, 2).double().tolist()
    cache = _tensor(index_cache, "index_cache", (torch.uint8,), 2)
    bt = _tensor(block_table, "block_table", _INT, 2).tolist()
    req = _tensor(req_of_token, "req_of_token", _INT, 1).tolist()
    bounds = _tensor(local_bounds, "local_bounds", _INT, 1).tolist()
    starts = [0] * len(bounds) if row_starts is None else _tensor(row_starts, "row_starts", _INT, 1).tolist()
    bs = _geometry(geometry).block_size
    d = INDEX_HEAD_DIM
    nb, B = cache.shape[0], len(bt)
    T = len(bounds)
    for name, value, lo in (("n_cols", n_cols, 0), ("next_n", next_n, 1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < lo:
            raise ValueError(f"{name} must be >= {lo}, got {value}")
    if T % next_n:
        raise ValueError(f"next_n={next_n} must divide the T={T} query tokens")
    if tuple(q.shape[:1]) != (T,) or len(w) != T or len(req) != T or len(starts) != T:
        raise ValueError("index_q, weights, req_of_token, local_bounds and row_starts must have one row per token")
    scores = torch.full((T, n_cols), -math.inf, dtype=torch.float64)
    mag = torch.zeros((T, n_cols), dtype=torch.float64)
    key_cache: dict[tuple[int, int], tuple[list[float], float]] = {}

    def key(block: int, off: int) -> tuple[list[float], float]:
        if (block, off) not in key_cache:
            row = cache[block]
            vals = _fp8_values(row[off * d : (off + 1) * d])
            sc = struct.unpack("<f", bytes(row[bs * d + 4 * off : bs * d + 4 * off + 4].tolist()))[0]
            key_cache[block, off] = (vals, sc)
        return key_cache[block, off]

    for t in range(T):
        b, n, s = req[t], bounds[t], starts[t]
        group = req[t // next_n * next_n : (t // next_n + 1) * next_n]
        need = -(-n // bs) if n >= 0 else 0
        ok = 0 <= b < B and n >= 0 and s >= 0 and s + n <= n_cols and len(set(group)) == 1
        ok = ok and need <= len(bt[b]) and all(0 <= bt[b][j] < nb for j in range(need))
        if not ok:
            scores[t] = math.nan
            continue
        for j in range(n):
            vals, sc = key(bt[b][j // bs], j % bs)
            total, size = 0.0, 0.0
            for h in range(len(w[t])):
                dot = math.fsum(qv * kv for qv, kv in zip(q64[t][h], vals))
                absdot = math.fsum(abs(qv * kv) for qv, kv in zip(q64[t][h], vals))
                relu = dot if (dot != dot or dot > 0) else 0.0
                total += w[t][h] * relu * sc
                size += abs(w[t][h]) * absdot * abs(sc)
            scores[t, s + j] = total
            mag[t, s + j] = size
    return scores, mag


def attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    counts: torch.Tensor | None,
    sm_scale: float,
    v_dim: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 softmax attention of every head over each row's slots.

    Args:
        q: ``[T, H, D]``.  kv_cache: ``[S, D]`` (values: the first ``v_dim`` columns).
        slots: int ``[T, K]``.  counts: int ``[T]``: row ``t`` attends to ``slots[t, :counts[t]]``
            (the compact layout); ``None``: to every ``slots[t, j] >= 0`` (the masked layout).
    Returns:
        ``(out float64 [T, H, v_dim], lse float64 [T, H])``, LSE in base e; an empty row gives
        ``out = 0`` and ``lse = -inf``. NaN in a key or value that is read propagates.
    """
    qq = _tensor(q, "q", _FLOAT, 3).double()
    kv = _tensor(kv_cache, "kv_cache", _FLOAT, 2).double()
    sl = _tensor(slots, "slots", _INT, 2)
    T, H, _ = qq.shape
    out = torch.zeros((T, H, v_dim), dtype=torch.float64)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64)
    cn = None if counts is None else _tensor(counts, "counts", _INT, 1)
    for t in range(T):
        row = sl[t, : int(cn[t])] if cn is not None else sl[t][sl[t] >= 0]
        if row.numel() == 0:
            continue
        if bool((row < 0).any()) or bool((row >= kv.shape[0]).any()):
            raise ValueError(f"row {t} reads slots {row.tolist()} outside [0, {kv.shape[0]})")
        keys = kv[row.long()]  # [n, D]
        s = (qq[t] @ keys.T) * float(sm_scale)  # [H, n]
        lse[t] = torch.logsumexp(s, dim=-1)
        out[t] = torch.softmax(s, dim=-1) @ keys[:, :v_dim]
    return out, lse


def _merge_weights(all_lse: torch.Tensor, base: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float64 ``(weights [W, T, H], merged lse [T, H], corrupt [T, H])`` in ``base``.

    ``-inf`` is an empty rank (weight 0). A NaN or ``+inf`` LSE is *corrupt* data, never "empty": the
    ``(t, h)`` it belongs to gets NaN weights and a NaN merged LSE (``corrupt[t, h]`` is True).
    """
    if base not in ("e", "2"):
        raise ValueError(f"base must be 'e' or '2', got {base!r}")
    lse = all_lse.detach().cpu().double()
    W, T, H = lse.shape
    w = torch.zeros((W, T, H), dtype=torch.float64)
    merged = torch.full((T, H), -math.inf, dtype=torch.float64)
    corrupt = torch.zeros((T, H), dtype=torch.bool)
    for t in range(T):
        for h in range(H):
            col = [float(x) for x in lse[:, t, h]]
            if any(math.isnan(x) or x == math.inf for x in col):
                corrupt[t, h] = True
                merged[t, h] = math.nan
                w[:, t, h] = math.nan
                continue
            m = max(col)
            if m == -math.inf:
                continue
            scale = math.e if base == "e" else 2.0
            terms = [scale ** (x - m) if x > -math.inf else 0.0 for x in col]
            total = sum(terms)
            merged[t, h] = m + (math.log(total) if base == "e" else math.log2(total))
            for r in range(W):
                w[r, t, h] = terms[r] / total
    return w, merged, corrupt


def correct(
    partial: torch.Tensor, all_lse: torch.Tensor, rank: int, base: str = "e"
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's share of the LSE merge: ``partial * base^(lse_rank - merged)`` in float64.

    An empty rank (its LSE is ``-inf``) contributes exactly 0, even where its partial holds NaN; a rank
    whose weight underflows to 0 contributes 0 too, unless its partial is NaN (``0 * NaN``: real data
    propagates). A NaN or ``+inf`` LSE in *any* rank is corrupt: the merged LSE of that ``(t, h)`` is
    NaN, and so is every non-empty rank's corrected output there (the sum over ranks is NaN).
    Returns ``(corrected float64 [T, H, v], merged lse float64 [T, H])``, the LSE in ``base``; all ranks
    empty -> 0 and ``-inf``.
    """
    p = _tensor(partial, "partial", _FLOAT, 3).double()
    lse = _tensor(all_lse, "all_lse", _FLOAT, 3)
    w, merged, _corrupt = _merge_weights(lse, base)
    wr = w[rank].unsqueeze(-1)  # NaN where the (t, h) is corrupt
    empty = (lse[rank].double() == -math.inf).unsqueeze(-1)
    return torch.where(empty, 0.0, wr * p), merged


def merge(outs: torch.Tensor, lses: torch.Tensor, base: str = "e") -> tuple[torch.Tensor, torch.Tensor]:
    """All ranks' partials merged in one place: ``sum_r correct(outs[r], lses, r)`` (float64)."""
    o = _tensor(outs, "outs", _FLOAT, 4)
    total = torch.zeros(o.shape[1:], dtype=torch.float64)
    merged = None
    for r in range(o.shape[0]):
        c, merged = correct(o[r], lses, r, base)
        total += c
    assert merged is not None
    return total, merged


def decode_bounds(
    seq_lens: Sequence[int] | torch.Tensor, next_n: int | Sequence[int] | torch.Tensor
) -> tuple[list[int], list[int]]:
    """``(request of each query token, exclusive global key bound of each)``, tokens of request 0 first.

    Request ``b`` of length ``L_b`` has ``q_b`` query tokens (``next_n``: one int for all, or one per
    request) at positions ``L_b - q_b .. L_b - 1``; token ``j`` sees keys ``[0, L_b - q_b + j + 1)``.
    """
    lens = [int(x) for x in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    if isinstance(next_n, torch.Tensor):
        qs = [int(x) for x in next_n.reshape(-1).tolist()] if next_n.ndim else [int(next_n)] * len(lens)
    elif isinstance(next_n, int):
        qs = [next_n] * len(lens)
    else:
        qs = [int(x) for x in next_n]
    if len(qs) != len(lens):
        raise ValueError(f"next_n must be an int or one count per request ({len(lens)}), got {len(qs)}")
    req, bound = [], []
    for b, (L, qb) in enumerate(zip(lens, qs)):
        if not 0 <= qb <= L:
            raise ValueError(f"request {b}: next_n={qb} must lie in [0, seq_len={L}]")
        for j in range(qb):
            req.append(b)
            bound.append(L - qb + j + 1)
    return req, bound


@dataclass
class DecodeResult:
    """What :func:`decode` returns.

    Attributes:
        out: float64 ``[T, H, v_dim]`` attention output of every head (all heads, not a shard).
        lse: float64 ``[T, H]`` its LSE, base e (``-inf`` for a token that selected nothing).
        ids: int64 ``[T, topk]`` the chosen global positions in selection order, ``-1`` padded.
    """

    out: torch.Tensor
    lse: torch.Tensor
    ids: torch.Tensor

    def head_shard(self, world_size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out, lse)`` of the heads rank ``rank`` of ``world_size`` holds after the merge's reduce-scatter
        (the project's order: ``world_size, rank``; ``0 <= rank < world_size``, else ``ValueError``)."""
        H = self.out.shape[1]
        if not (isinstance(world_size, int) and isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"rank must satisfy 0 <= rank < world_size, got world_size={world_size}, rank={rank}")
        if H % world_size:
            raise ValueError(f"H={H} heads must be divisible by world_size={world_size}")
        hs = H // world_size
        return self.out[:, rank * hs : (rank + 1) * hs], self.lse[:, rank * hs : (rank + 1) * hs]


def decode(
    q: torch.Tensor,
    kv_caches: Sequence[torch.Tensor],
    block_tables: Sequence[torch.Tensor],
    index_scores: Sequence[torch.Tensor],
    seq_lens: Sequence[int] | torch.Tensor,
    next_n: int | Sequence[int] | torch.Tensor,
    topk: int,
    sm_scale: float,
    *,
    block_size: int,
    interleave: int = 1,
    v_dim: int | None = None,
    order: str = "global_id",
) -> DecodeResult:
    """The whole DCP sparse-MLA decode step, from each rank's own tensors, without any sharded math.

    Rank ``r`` (``W = len(kv_caches)``) holds position ``p`` of request ``b`` when ``(p // I) % W == r``,
    at local index ``l = (p // (W*I))*I + p % I``, in slot ``block_tables[r][b, l // block_size] *
    block_size + l % block_size`` of ``kv_caches[r]``; ``index_scores[r][t, l]`` is query token ``t``'s
    index score of that key. This function reads every visible key of every query token through that
    map, picks the global stable top-``topk`` (score desc, then lower position; NaN never chosen), and
    attends in float64 — the answer a correct DCP step must reproduce on any ``W``.

    Args:
        q: ``[T, H, D]`` query tokens, tokens of request 0 first.
        kv_caches: per rank ``[S_r, D]`` (or ``[S_r, 1, D]``) paged latent cache.
        block_tables: per rank int ``[B, M_r]``.
        index_scores: per rank float ``[T, L_r]`` (columns = local index; W = 1: the global scores).
        seq_lens: ``B`` global lengths (including this step's query tokens).
        next_n: query tokens per request: one int, or one per request.
        topk: global top-k.  sm_scale: softmax scale.  block_size: tokens per block.
        interleave: ``I``.  v_dim: value width (default ``D``).
        order: the total order's tie-break: ``"global_id"`` (equal scores: the lower position first) or
            ``"rank_local"`` (the owner-local exchange that sends no ids: the lower owner rank, then the lower
            local index — :mod:`dcp_ref.select_to_slots`). Both orders pick the same keys off the ties.
    Returns:
        :class:`DecodeResult` (float64 output of *all* heads, base-e LSE, chosen ids).
    Raises:
        ValueError: a visible key with no block on its rank, or index scores too narrow for it.
    """
    if order not in ("global_id", "rank_local"):
        raise ValueError(f"order must be 'global_id' or 'rank_local', got {order!r}")
    W = len(kv_caches)
    if W < 1 or len(block_tables) != W or len(index_scores) != W:
        raise ValueError(
            f"kv_caches, block_tables and index_scores must each hold one tensor per rank (W >= 1), got "
            f"{len(kv_caches)}, {len(block_tables)}, {len(index_scores)}"
        )
    qq = _tensor(q, "q", _FLOAT, 3).double()
    T, H, D = qq.shape
    v = D if v_dim is None else int(v_dim)
    kvs = []
    for r, kv in enumerate(kv_caches):
        if isinstance(kv, torch.Tensor) and kv.ndim == 3 and kv.shape[1] == 1:
            kv = kv[:, 0]
        kvs.append(_tensor(kv, f"kv_caches[{r}]", _FLOAT, 2).double())
    bts = [_tensor(b, f"block_tables[{r}]", _INT, 2) for r, b in enumerate(block_tables)]
    scs = [_tensor(s, f"index_scores[{r}]", _FLOAT, 2) for r, s in enumerate(index_scores)]
    req, bound = decode_bounds(seq_lens, next_n)
    if len(req) != T:
        raise ValueError(f"q has {T} query tokens but seq_lens/next_n describe {len(req)}")
    I, bs = int(interleave), int(block_size)
    out = torch.zeros((T, H, v), dtype=torch.float64)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64)
    rows = []
    for t in range(T):
        b, n = req[t], bound[t]
        cands, where = [], {}
        for p in range(n):
            r, loc = (p // I) % W, (p // (W * I)) * I + p % I
            if loc >= scs[r].shape[1]:
                raise ValueError(f"index_scores[{r}] has {scs[r].shape[1]} columns; token {t} sees local key {loc}")
            if loc // bs >= bts[r].shape[1] or int(bts[r][b, loc // bs]) < 0:
                raise ValueError(
                    f"position {p} of request {b} (rank {r}, local {loc}) has no block in block_tables[{r}]"
                )
            slot = int(bts[r][b, loc // bs]) * bs + loc % bs
            if slot >= kvs[r].shape[0]:
                raise ValueError(f"position {p} of request {b} maps to slot {slot} outside kv_caches[{r}]")
            # the tie-break id: the position, or (rank, local index) as one integer (local < n <= 2**40)
            cands.append((float(scs[r][t, loc]), p if order == "global_id" else (r << 40) + loc))
            where[cands[-1][1]] = (r, slot, p)
        chosen = [where[i][2] for i in _top(cands, topk)]
        rows.append(chosen)
        if not chosen:
            continue
        at = {pos: (r, slot) for r, slot, pos in where.values()}
        keys = torch.stack([kvs[at[p][0]][at[p][1]] for p in chosen])  # [n, D]
        s = (qq[t] @ keys.T) * float(sm_scale)
        lse[t] = torch.logsumexp(s, dim=-1)
        out[t] = torch.softmax(s, dim=-1) @ keys[:, :v]
    return DecodeResult(out, lse, _pad(rows, topk))
