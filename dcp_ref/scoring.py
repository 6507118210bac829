"""The scoring stage — the lightning indexer's index scores of this rank's keys, from FP8 index keys.

Before the indexer stage selects each rank's local top-K (:mod:`dcp_ref.indexer`), DeepSeek V3.2's
lightning indexer scores every (query token, key) pair with 64 small heads::

    scores[t, col] = sum_h  w[t, h] * relu(q[t, h, :] . k_fp8[j, :]) * scale[j]      col = row_starts[t] + j

over this rank's local keys ``j < local_bounds[t]`` (``-inf`` in every other column), where
``q`` is the FP8 index query ``[T, 64, 128]``, ``w`` the per-head weights (vLLM folds the query's
own FP8 scale, the softmax scale and ``64 ** -0.5`` into them: :func:`dcp_ref.index_cache.quantize_index_queries`),
and ``k_fp8[j], scale[j]`` local key ``j``'s 128 e4m3 values and float32 scale in the paged FP8
index-key cache (:mod:`dcp_ref.index_cache`), found through the KV cache's block table::

    slot(j) = block_table[req_of_token[t], j // block_size] * block_size + j % block_size

With MTP (speculative decode, ``next_n > 1``) the query tokens come in consecutive groups of
``next_n`` tokens of one request — tokens ``g * next_n .. g * next_n + next_n - 1`` — so that a kernel
may score a whole group from one read of each key. The scores are unchanged: each token still has
its own query, weights, bound and row start.

Under DCP a rank holds only its own keys (the index keys are sharded with the KV rows), so it
scores ``[T, L]`` local columns, not the whole context; the indexer stage then keeps its stable
top-K and the exchange merges the ranks' candidates exactly (chapter 02).

Where the formula comes from: DeepGEMM's ``fp8_paged_mqa_logits`` (deepseek-ai/DeepGEMM
``csrc/apis/attention.hpp``; the SM90 kernel ``sm90_fp8_paged_mqa_logits.cuh`` computes
``fmaxf(q.k, 0) * w`` summed over heads, then times the key's scale) and its test oracle
``ref_paged_mqa_logits`` (``tests/test_attention.py``: ``relu(q @ k) * w`` summed over heads on
the dequantized keys); vLLM calls it from ``sparse_attn_indexer`` with the weights folded as above.
Two deliberate differences from the kernel: ``relu`` keeps a NaN (``fmaxf(NaN, 0)`` is 0 in
DeepGEMM; here NaN data propagates, as everywhere in this package), and the columns past a
token's bound hold ``-inf`` (DeepGEMM leaves them unwritten unless ``clean_logits``).

The oracle computes in float64 from the exactly dequantized values (:func:`index_scores`) and
returns float32. The GPU kernel is ``dcp_ref.kernels.scoring_triton.index_scores_triton`` (same
arguments, same checks and messages). (A kernel that fused the scoring into the indexer's top-K and pack, so
that the ``[T, L]`` scores never reached memory, measured slower than the two stages one after the other at every
shape on the H200 and was removed: ``benchmarks/results/scoring.md``.)

The ``validate=False`` rule (the hot path: nothing read on the host)
--------------------------------------------------------------------
A row whose metadata is out of contract — ``req_of_token[t]`` outside ``[0, B)``, a negative
``local_bounds[t]`` or ``row_starts[t]``, ``row_starts[t] + local_bounds[t]`` beyond the output's
columns, more keys than the table's blocks cover, or a needed block (``j // block_size`` for some
``j < local_bounds[t]``) that is ``-1`` or not a block of the cache — is **poisoned**: every column
of that row is NaN. So is every row of a group of ``next_n`` tokens whose request ids differ (the
group is out of contract as a whole). The comparisons are exact for any int64 values (no
``row_starts + local_bounds`` that wraps around near ``2**63`` passes as in range). Nothing outside
the cache or the table is read, and no plausible score is produced. (The indexer stage treats NaN
as a masked key, so a poisoned row yields no candidate.)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .contracts import (
    INT_DTYPES,
    check_bool,
    check_int_scalar,
    check_no_alias,
    check_tensor,
    check_values_readable,
)
from .geometry import DcpGeometry
from .index_cache import INDEX_K_FP8, IndexKeyLayout, index_cache_blocks, index_cache_slots, index_key_fields

__all__ = [
    "SCORING_Q_DTYPES",
    "ScoringArgs",
    "check_scoring_inputs",
    "index_cache_slots",
    "index_scores",
    "reference_scoring",
]

#: dtypes the reference accepts for ``index_q``: FP8 (what the kernels take) or any float (teaching).
SCORING_Q_DTYPES = (torch.float8_e4m3fn, torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The oracle scores a chunk of columns at a time: [T, chunk, head_dim + H] float64 stays below this.
_BUDGET_ELEMS = 1 << 24


class ScoringArgs(NamedTuple):
    """What :func:`check_scoring_inputs` learned from the shapes (no value read)."""

    T: int  #: query tokens
    H: int  #: index heads
    L: int  #: output columns
    B: int  #: requests (rows of the block table)
    M: int  #: blocks per request in the table
    num_blocks: int  #: blocks of the cache
    block_size: int  #: tokens per block (the geometry's)
    blocks: torch.Tensor  #: the cache as uint8 ``[num_blocks, block_size * 132]``
    next_n: int = 1  #: query tokens per group of one request (MTP; ``T % next_n == 0``)


def _check_index_vector(t: object, name: str, T: int, dev: torch.device) -> torch.Tensor:
    check_tensor(t, name, dtypes=INT_DTYPES, ndim=1)
    assert isinstance(t, torch.Tensor)
    if t.device != dev:
        raise ValueError(f"{name} must be on device {dev} (index_q's), got {t.device}")
    if t.shape[0] != T:
        raise ValueError(f"{name} must have shape [T={T}] (one entry per query token), got {tuple(t.shape)}")
    return t


def check_scoring_inputs(
    index_q: object,
    weights: object,
    index_cache: object,
    block_table: object,
    req_of_token: object,
    local_bounds: object,
    geometry: object,
    row_starts: object,
    out: object,
    validate: object,
    *,
    q_dtypes: tuple[torch.dtype, ...] = SCORING_Q_DTYPES,
    n_cols: object = None,
    layout: IndexKeyLayout = INDEX_K_FP8,
    next_n: object = 1,
) -> ScoringArgs:
    """Every check of :func:`index_scores`, shared with the Triton kernels (same inputs, same messages).

    Always (free): types, dtypes, ranks, shapes, devices, contiguity of ``out``. With ``validate``:
    the values (one host sync) — request ids in range, one request per group of ``next_n`` tokens,
    non-negative bounds and starts, the blocks each token needs present in the table and the cache,
    and every row inside ``out`` (all exact in Python ints: no int64 wrap-around).
    ``n_cols`` (with ``out=None``): the width ``L`` of a score matrix the caller will make (checked as ``out``'s
    width would be; the Triton kernel passes 0 where a validated call takes the width from the values). ``next_n``
    (an int ``>= 1`` dividing ``T``): the query tokens come in consecutive groups of ``next_n`` tokens of one
    request (MTP).
    """
    validate = check_bool(validate, "validate")
    if not isinstance(geometry, DcpGeometry):
        raise TypeError(f"geometry must be a dcp_ref.geometry.DcpGeometry, got {type(geometry).__name__}")
    bs = geometry.block_size
    check_tensor(index_q, "index_q", dtypes=q_dtypes, ndim=3)
    assert isinstance(index_q, torch.Tensor)
    T, H, D = index_q.shape
    if D != layout.head_dim or H < 1:
        raise ValueError(
            f"index_q must be [T, H, {layout.head_dim}] (H >= 1 index heads of {layout.head_dim} values), "
            f"got shape {tuple(index_q.shape)}"
        )
    dev = index_q.device
    check_tensor(weights, "weights", dtypes=(torch.float32,), ndim=2, device=dev)
    assert isinstance(weights, torch.Tensor)
    if weights.shape != (T, H):
        raise ValueError(f"weights must be [T={T}, H={H}] (one weight per token and head), got {tuple(weights.shape)}")
    next_n = check_int_scalar(next_n, "next_n", min_value=1)
    if T % next_n:
        raise ValueError(f"next_n={next_n} must divide the T={T} query tokens (groups of next_n tokens of one request)")
    blocks = index_cache_blocks(index_cache, bs, layout=layout)
    if blocks.device != dev:
        raise ValueError(f"index_cache must be on device {dev} (index_q's), got {blocks.device}")
    check_tensor(block_table, "block_table", dtypes=INT_DTYPES, ndim=2, device=dev)
    assert isinstance(block_table, torch.Tensor)
    req = _check_index_vector(req_of_token, "req_of_token", T, dev)
    bounds = _check_index_vector(local_bounds, "local_bounds", T, dev)
    starts = None if row_starts is None else _check_index_vector(row_starts, "row_starts", T, dev)
    B, M = block_table.shape
    nb = blocks.shape[0]
    L: int | None = None
    if out is not None:
        check_tensor(out, "out", dtypes=(torch.float32,), ndim=2)
        assert isinstance(out, torch.Tensor)
        if out.device != dev:
            raise ValueError(f"out must be on device {dev} (index_q's), got {out.device}")
        if out.shape[0] != T:
            raise ValueError(f"out must be [T={T}, L] (one row per query token), got shape {tuple(out.shape)}")
        if not out.is_contiguous():
            raise ValueError("out must be contiguous (each row is written as L consecutive floats)")
        check_no_alias(
            out, "out", index_q=index_q, weights=weights, index_cache=index_cache, block_table=block_table,
            req_of_token=req_of_token, local_bounds=local_bounds, row_starts=row_starts,
        )  # fmt: skip
        L = out.shape[1]
    elif n_cols is not None:
        L = check_int_scalar(n_cols, "n_cols", min_value=0)
    elif not validate:
        if starts is not None:
            raise ValueError(
                "out must be given when validate=False and row_starts is given: the width "
                "max(row_starts + local_bounds) cannot be read without a host sync"
            )
        L = M * bs  # decode: the widest in-contract row (shapes only, no host read)
    if validate and T:
        readable = (
            ("req_of_token", req),
            ("local_bounds", bounds),
            ("row_starts", starts),
            ("block_table", block_table),
        )
        for name, tensor in readable:
            if tensor is not None:
                check_values_readable(tensor, name)
        r = req.long()
        if bool(((r < 0) | (r >= B)).any()):
            raise ValueError(
                f"req_of_token values must be in [0, B={B}) (rows of block_table), got min {int(r.min())}, "
                f"max {int(r.max())}"
            )
        if next_n > 1:
            groups = r.reshape(-1, next_n)
            mixed = groups != groups[:, :1]
            if bool(mixed.any()):
                g, k = (int(v) for v in mixed.nonzero()[0])
                t0, t = g * next_n, g * next_n + k
                raise ValueError(
                    f"req_of_token must name one request per group of next_n={next_n} tokens, but token {t0} "
                    f"names {int(r[t0])} and token {t} names {int(r[t])}"
                )
        n = bounds.long()
        if bool((n < 0).any()):
            raise ValueError(f"local_bounds must be non-negative, found {int(n.min())}")
        s = torch.zeros_like(n) if starts is None else starts.long()
        if bool((s < 0).any()):
            raise ValueError(f"row_starts must be non-negative, found {int(s.min())}")
        need = _blocks_needed(n, M, bs)
        if bool((need > M).any()):
            t = int((need > M).nonzero()[0, 0])
            raise ValueError(
                f"local_bounds[{t}]={int(n[t])} needs {-(-int(n[t]) // bs)} blocks of {bs} keys, but block_table "
                f"has {M} per request"
            )
        if M:
            rows = block_table.long()[r]  # [T, M]
            needed = torch.arange(M, device=dev).unsqueeze(0) < need.unsqueeze(1)
            bad = needed & ((rows < 0) | (rows >= nb))
            if bool(bad.any()):
                t, j = (int(v) for v in bad.nonzero()[0])
                v = int(rows[t, j])
                what = "(no block)" if v == -1 else f"(not a block of index_cache, which has {nb})"
                raise ValueError(
                    f"block_table[{int(r[t])}, {j}] is {v} {what}, but token {t} reads local keys up to "
                    f"{int(n[t])} through it"
                )
        what = "row_starts + local_bounds" if starts is not None else "local_bounds"
        if L is None:
            wraps = s > _INT64_MAX - n  # s + n would wrap around (n >= 0 here: the test itself cannot)
            if bool(wraps.any()):
                t = int(wraps.nonzero()[0, 0])
                raise ValueError(
                    f"{what} must fit int64 (the width of the score matrix), but token {t} needs "
                    f"{int(s[t]) + int(n[t])}"
                )
            L = int((s + n).max())
        else:
            past = _past_end(n, s, L)
            if bool(past.any()):
                t = int(past.nonzero()[0, 0])
                has = f"out has {L} columns" if out is not None else f"n_cols={L}"
                raise ValueError(f"{has}, but token {t} needs {what} = {int(s[t]) + int(n[t])}")
    if L is None:  # validate with T == 0
        L = 0
    return ScoringArgs(T, H, L, B, M, nb, bs, blocks, next_n)


_INT64_MAX = 2**63 - 1


def _blocks_needed(n: torch.Tensor, M: int, bs: int) -> torch.Tensor:
    """``ceil(n / bs)`` for int64 ``n >= 0``, without wrapping near ``2**63``: a bound above ``M * bs``
    (already more keys than the table covers) is clamped to ``M * bs + 1``, which needs ``M + 1`` blocks."""
    return torch.div(n.clamp_max(M * bs + 1) + bs - 1, bs, rounding_mode="floor")


def _past_end(n: torch.Tensor, s: torch.Tensor, L: int) -> torch.Tensor:
    """``s + n > L`` for int64 ``n >= 0`` (any ``s``) and ``0 <= L < 2**63``, exactly: never computes ``s + n``."""
    return (n > L) | (s > L - n)


def _row_state(
    a: ScoringArgs,
    block_table: torch.Tensor,
    req_of_token: torch.Tensor,
    local_bounds: torch.Tensor,
    row_starts: torch.Tensor | None,
    n_cols: int | None,
    next_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Device-side row metadata, no host read: ``(bad [T], rows [T, M], bound [T], start [T], req_ok [T])``.

    ``bad`` is the poison rule of the module docstring (``n_cols=None``: no width to check; every
    row of a group of ``next_n`` tokens with different request ids is bad; ``next_n=None``: the
    checked ``a.next_n``); ``rows`` the table row of each token (zeros for a bad request id).
    All comparisons are exact for any int64 values (nothing wraps around near ``2**63``).
    """
    dev = local_bounds.device
    B, M, bs, nb = a.B, a.M, a.block_size, a.num_blocks
    r = req_of_token.long()
    n = local_bounds.long()
    s = torch.zeros_like(n) if row_starts is None else row_starts.long()
    req_ok = (r >= 0) & (r < B)
    n0 = n.clamp_min(0)  # a negative bound is bad already; clamped, nothing below wraps
    need = _blocks_needed(n0, M, bs)
    bad = ~req_ok | (n < 0) | (s < 0) | (need > M)
    if n_cols is not None:
        bad |= _past_end(n0, s, n_cols)
    g = a.next_n if next_n is None else next_n
    if g > 1 and r.shape[0]:
        groups = r.reshape(-1, g)
        bad |= (groups != groups[:, :1]).any(dim=1, keepdim=True).expand(-1, g).reshape(-1)
    if B and M:
        rows = block_table.long()[torch.where(req_ok, r, 0)]  # [T, M]
        needed = torch.arange(M, device=dev).unsqueeze(0) < need.unsqueeze(1)
        bad |= (needed & ((rows < 0) | (rows >= nb))).any(dim=1)
    else:
        rows = torch.zeros((r.shape[0], M), dtype=torch.int64, device=dev)
    return bad, rows, n, s, req_ok


def index_scores(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_of_token: torch.Tensor,
    local_bounds: torch.Tensor,
    geometry: DcpGeometry,
    *,
    row_starts: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    validate: bool = True,
    layout: IndexKeyLayout = INDEX_K_FP8,
    next_n: int = 1,
) -> torch.Tensor:
    """This rank's index scores ``[T, L]`` from its FP8 index-key cache (the oracle, float64 inside).

    ``scores[t, row_starts[t] + j] = sum_h w[t, h] * relu(q[t, h] . k[j]) * scale[j]`` for the local
    keys ``j < local_bounds[t]`` (computed in float64 from the exactly dequantized e4m3 values, then
    rounded once to float32); ``-inf`` in every other column. ``relu`` keeps NaN; NaN or inf in the
    query, the weights or a key (an unwritten slot reads NaN) propagate into the scores they touch.

    Args:
        index_q: ``[T, H, 128]`` index queries: float8_e4m3fn (what the kernels take), or any
            float dtype (teaching; used as given, no quantization).
        weights: float32 ``[T, H]`` per-head weights (query scale folded in, as vLLM does).
        index_cache: this rank's FP8 index-key cache, uint8 ``[num_blocks, block_size * 132]`` (or
            ``[num_blocks, block_size, 132]`` / ``[num_blocks, block_size, 1, 132]``, contiguous;
            :mod:`dcp_ref.index_cache`).
        block_table: int32/int64 ``[B, M]``: the KV cache's block table (``-1`` = no block).
        req_of_token: int32/int64 ``[T]``: each token's request (row of ``block_table``).
        local_bounds: int32/int64 ``[T]``: token ``t`` scores this rank's local keys ``[0, bound)``
            (the causal bound in local coordinates, from the ownership stage).
        geometry: this rank's :class:`~dcp_ref.geometry.DcpGeometry` (its ``block_size`` is the
            cache's and the table's).
        row_starts: optional int32/int64 ``[T]`` (prefill): local key ``j`` of token ``t`` goes to
            column ``row_starts[t] + j``.
        out: optional float32 ``[T, L]`` contiguous buffer; ``L = out.shape[1]``. Without it ``L`` is
            ``max(row_starts + local_bounds)`` (validated), or ``M * block_size`` with
            ``validate=False`` (decode only: with ``row_starts`` an ``out`` is required).
        validate: check the values on the host (one sync; see :func:`check_scoring_inputs`).
            ``False``: no host read; an out-of-contract row is poisoned (all NaN), see the module
            docstring.
        layout: the cache layout (default :data:`~dcp_ref.index_cache.INDEX_K_FP8`).
        next_n: query tokens per group of one request (MTP / speculative decode; an int ``>= 1``
            dividing ``T``): tokens ``g * next_n .. g * next_n + next_n - 1`` must name the same
            request (validated; ``validate=False``: every row of a mixed group is poisoned). The
            scores do not depend on it.
    Returns:
        float32 ``[T, L]`` (``out`` when given).
    Raises:
        TypeError / ValueError whose message starts with the argument's name.
    """
    a = check_scoring_inputs(
        index_q, weights, index_cache, block_table, req_of_token, local_bounds, geometry, row_starts, out, validate,
        layout=layout, next_n=next_n,
    )  # fmt: skip
    T, H, L, bs = a.T, a.H, a.L, a.block_size
    dev = index_q.device
    result = out if out is not None else torch.empty((T, L), dtype=torch.float32, device=dev)
    if T == 0 or L == 0:
        return result
    bad, rows, n, s, _ = _row_state(a, block_table, req_of_token, local_bounds, row_starts, L, a.next_n)
    values, scales = index_key_fields(a.blocks, bs, layout)
    qf = index_q.to(torch.float64)  # e4m3 -> float64 is exact
    wf = weights.to(torch.float64).unsqueeze(2)  # [T, H, 1]
    D = layout.head_dim
    chunk = max(1, _BUDGET_ELEMS // max(1, T * (H + D)))
    for c0 in range(0, L, chunk):
        cols = torch.arange(c0, min(L, c0 + chunk), device=dev)
        j = cols.unsqueeze(0) - s.unsqueeze(1)  # [T, C] local key of each column
        key = (j >= 0) & (j < n.unsqueeze(1)) & ~bad.unsqueeze(1)
        blk = torch.div(j.clamp_min(0), bs, rounding_mode="floor")
        if a.M and a.num_blocks:
            phys = rows.gather(1, blk.clamp_max(a.M - 1))
            b = torch.where(key, phys, 0)
            o = torch.where(key, j % bs, 0)
            k = values[b, o].view(torch.float8_e4m3fn).to(torch.float64)  # [T, C, D]
            sc = torch.einsum("thd,tcd->thc", qf, k)
            sc = torch.where(sc < 0, 0.0, sc)  # relu that keeps NaN
            score = (sc * wf).sum(dim=1) * scales[b, o].to(torch.float64)
        else:  # no table or no cache: no row has a key (the poison rule made them all bad)
            score = torch.zeros(key.shape, dtype=torch.float64, device=dev)
        fill = torch.where(bad, math.nan, -math.inf).unsqueeze(1).to(torch.float64)
        result[:, c0 : c0 + cols.shape[0]] = torch.where(key, score, fill).to(torch.float32)
    return result


def reference_scoring(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    block_table: torch.Tensor,
    req_of_token: torch.Tensor,
    local_bounds: torch.Tensor,
    geometry: DcpGeometry,
    *,
    row_starts: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    next_n: int = 1,
) -> torch.Tensor:
    """The scoring stage on the reference: :func:`index_scores` with ``validate=False`` (no host read).

    Writes into ``out`` (float32 ``[T, L]``) when given; out-of-contract rows are poisoned (NaN),
    including every row of a group of ``next_n`` tokens (MTP) whose request ids differ.
    """
    return index_scores(
        index_q, weights, index_cache, block_table, req_of_token, local_bounds, geometry,
        row_starts=row_starts, out=out, validate=False, next_n=next_n,
    )  # fmt: skip


reference_scoring.impl_name = "torch"  # type: ignore[attr-defined]  # the trace's name (dcp_ref.stages.impl_name)
