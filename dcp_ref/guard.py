"""The guard stage: rows whose step metadata is outside the contract come back poisoned.

A planned step run with ``validate=False`` reads nothing on the host, so it cannot *raise* when a
caller hands it metadata that contradicts the shard. Clamping such metadata would give a plausible
wrong answer — a negative bound clamped to 0 is "no keys": output 0, LSE ``-inf`` — which a
caller cannot tell from a real empty row. The rule, written once here and applied by the step to
every layout and exchange:

    **A query token whose metadata is out of contract gets NaN output and NaN LSE** (every head),
    decided on the device, with no host read.

Out of contract, for token ``t`` of request ``b = req_of_token[t]`` (``B`` rows in the block table,
``n_cols`` columns of index scores, ``bs`` the block size):

- ``b < 0`` or ``b >= B`` (a request the block table does not have);
- ``local_bounds[t] < 0``, or ``row_starts[t] < 0`` (prefill);
- ``row_starts[t] + local_bounds[t] > n_cols`` (the token's keys reach past the scores it was given);
- one of the blocks ``0 .. ceil(local_bounds[t] / bs) - 1`` of request ``b`` is missing
  (``block_table[b, j] < 0``, or ``j`` past the table's width): a key the token may attend to has no
  KV row.

When the step scores its keys (``spec.scoring``), the scoring stage's own row rule joins in — its poisoned
rows are NaN *scores*, and the indexer reads a NaN score as a masked key, so without the guard such a row
would come back as "no keys" (output 0, LSE ``-inf``), the plausible wrong answer the rule forbids:

- one of those blocks is not a block of the index-key cache (``block_table[b, j] >= num_blocks``: an index
  shard shorter than the table — a short KV cache poisons through its slots, a short index cache here);
- with ``next_n > 1`` (MTP), the group of ``next_n`` consecutive tokens holding ``t`` names more than one
  request;
- ``index_q[t]`` or ``index_weights[t]`` holds a non-finite value (NaN from real data propagates: a NaN
  query scores every key NaN, which would read as an empty row).

The NaN then travels through the combine like any corrupt data (a NaN LSE is never "empty"), so the
token's output is NaN on every rank. With ``validate=True`` the step raises on these inputs before
any stage runs (:meth:`dcp_ref.step.PlannedStep._check_values`), with a message naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .contracts import FLOAT_DTYPES, INT_DTYPES, check_int_scalar, check_no_aliases, check_tensor
from .geometry import DcpGeometry

__all__ = ["GuardRows", "check_guard_inputs", "check_guard_rows", "metadata_row_ok", "reference_guard"]


@dataclass(frozen=True)
class GuardRows:
    """The guard's inputs other than the partial it poisons, as one value: what an attention kernel that takes the
    guard in (poisoning in its own epilogue instead of a guard launch after it) is handed. Fields as
    :func:`reference_guard`'s arguments of the same names."""

    local_bounds: torch.Tensor
    req_of_token: torch.Tensor
    block_table: torch.Tensor
    geometry: DcpGeometry
    n_cols: int
    row_starts: torch.Tensor | None = None
    num_blocks: int | None = None
    next_n: int = 1
    index_q: torch.Tensor | None = None
    index_weights: torch.Tensor | None = None

    def check(self, T: int, device: torch.device, outs: dict[str, object]) -> int:
        """:func:`check_guard_rows` of these rows for ``T`` tokens on ``device`` (the guard's messages), and no
        tensor of ``outs`` (name -> the buffers the kernel that takes the guard in writes) sharing memory with
        them. Returns ``n_cols``."""
        n = check_guard_rows(T, device, self)
        check_no_aliases(outs, self.tensors())
        return n

    def tensors(self) -> dict[str, object]:
        """The rows' tensors by name."""
        return dict(local_bounds=self.local_bounds, req_of_token=self.req_of_token, block_table=self.block_table,
                    row_starts=self.row_starts, index_q=self.index_q, index_weights=self.index_weights)  # fmt: skip

    def row_ok(self) -> torch.Tensor:
        """:func:`metadata_row_ok` of these rows: bool ``[T]``, device ops only."""
        return metadata_row_ok(
            self.local_bounds, self.req_of_token, self.block_table, self.geometry, self.n_cols, self.row_starts,
            num_blocks=self.num_blocks, next_n=self.next_n, index_q=self.index_q, index_weights=self.index_weights,
        )  # fmt: skip


def check_guard_inputs(
    partial: object,
    lse: object,
    local_bounds: object,
    req_of_token: object,
    block_table: object,
    geometry: object,
    n_cols: object,
    row_starts: object = None,
    *,
    num_blocks: object = None,
    next_n: object = 1,
    index_q: object = None,
    index_weights: object = None,
) -> int:
    """The guard's argument checks, shared by :func:`reference_guard` and the kernel
    (:func:`dcp_ref.kernels.guard_triton.guard_triton`), so both accept and refuse the same inputs with the same
    message (``TypeError`` / ``ValueError`` naming the argument). No value is read: out-of-contract *values* are
    what the guard poisons. Returns ``n_cols`` as an int.

    ``partial`` floating ``[T, H, v]``; ``lse`` floating ``[T, H]`` on its device; ``local_bounds``,
    ``req_of_token`` (and ``row_starts``) int ``[T]``; ``block_table`` int ``[B, M]``; any strides (a stride-0
    expanded table included: every view is read through its own strides). The scoring rows (module docstring):
    ``num_blocks`` an int ``>= 0`` or ``None``; ``next_n`` an int ``>= 1`` dividing ``T``; ``index_q``
    ``[T, Hi, D]`` (FP8 or floating) and ``index_weights`` floating ``[T, Hi]``, both or neither."""
    check_tensor(partial, "partial", dtypes=FLOAT_DTYPES, ndim=3)
    assert isinstance(partial, torch.Tensor)
    dev = partial.device
    T, H, _ = partial.shape
    check_tensor(lse, "lse", dtypes=FLOAT_DTYPES, ndim=2, device=dev)
    assert isinstance(lse, torch.Tensor)
    if tuple(lse.shape) != (T, H):
        raise ValueError(f"lse must be [T={T}, H={H}], got {tuple(lse.shape)}")
    rows = GuardRows(local_bounds, req_of_token, block_table, geometry, n_cols, row_starts,  # type: ignore[arg-type]
                     num_blocks=num_blocks, next_n=next_n, index_q=index_q, index_weights=index_weights)  # type: ignore[arg-type]  # fmt: skip
    n = check_guard_rows(T, dev, rows)
    for name, out in (("partial", partial), ("lse", lse)):  # written in place: one element, one location
        if any(st == 0 and size > 1 for st, size in zip(out.stride(), out.shape, strict=True)):
            raise ValueError(f"{name} must not be an expanded (stride-0) view: it is poisoned in place, row by row")
    check_no_aliases(
        {"partial": partial, "lse": lse},
        dict(local_bounds=local_bounds, req_of_token=req_of_token, block_table=block_table, row_starts=row_starts,
             index_q=index_q, index_weights=index_weights),
    )  # fmt: skip
    return n


def check_guard_rows(T: int, device: torch.device, rows: GuardRows) -> int:
    """The checks of :func:`check_guard_inputs` that do not involve the partial: the guard's ``rows`` for ``T``
    tokens on ``device`` (what an attention kernel that takes the guard in checks, beside its own). The fields are
    checked here, not when ``rows`` is made (a :class:`GuardRows` holds what it is given). Returns ``n_cols``."""
    local_bounds, req_of_token, block_table, row_starts = rows.local_bounds, rows.req_of_token, rows.block_table, \
        rows.row_starts  # fmt: skip
    geometry, n_cols, num_blocks, next_n = rows.geometry, rows.n_cols, rows.num_blocks, rows.next_n
    index_q, index_weights = rows.index_q, rows.index_weights
    if not isinstance(geometry, DcpGeometry):
        raise TypeError(f"geometry must be a DcpGeometry, got {type(geometry).__name__}")
    n = check_int_scalar(n_cols, "n_cols", min_value=0)
    dev = device
    for name, x in (("local_bounds", local_bounds), ("req_of_token", req_of_token), ("row_starts", row_starts)):
        if x is None and name == "row_starts":
            continue
        check_tensor(x, name, dtypes=INT_DTYPES, ndim=1, device=dev)
        assert isinstance(x, torch.Tensor)
        if x.shape[0] != T:
            raise ValueError(f"{name} must have one entry per token ({T}), got {tuple(x.shape)}")
    check_tensor(block_table, "block_table", dtypes=INT_DTYPES, ndim=2, device=dev)
    if num_blocks is not None:
        check_int_scalar(num_blocks, "num_blocks", min_value=0)
    nn = check_int_scalar(next_n, "next_n", min_value=1)
    if T % nn:
        raise ValueError(f"next_n={nn} must divide the T={T} query tokens (groups of next_n tokens of one request)")
    if (index_q is None) != (index_weights is None):
        given, missing = ("index_q", "index_weights") if index_weights is None else ("index_weights", "index_q")
        raise ValueError(f"{missing} must be given with {given}")
    if index_q is not None:
        check_tensor(index_q, "index_q", dtypes=(torch.float8_e4m3fn, *FLOAT_DTYPES), ndim=3, device=dev)
        check_tensor(index_weights, "index_weights", dtypes=FLOAT_DTYPES, ndim=2, device=dev)
        assert isinstance(index_q, torch.Tensor) and isinstance(index_weights, torch.Tensor)
        if index_q.shape[0] != T or index_weights.shape != (T, index_q.shape[1]):
            raise ValueError(
                f"index_weights must be [T={T}, Hi={index_q.shape[1]}] beside index_q [T={T}, Hi, D], got index_q "
                f"{tuple(index_q.shape)} and index_weights {tuple(index_weights.shape)}"
            )
    return n


def metadata_row_ok(
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
) -> torch.Tensor:
    """bool ``[T]``: ``True`` where token ``t``'s metadata is inside the contract (see the module docstring).

    Device ops only (no host read): safe inside a CUDA graph.

    Args:
        local_bounds: int ``[T]`` this rank's causal bound per token.
        req_of_token: int ``[T]`` block-table row of each token.
        block_table: int ``[B, M]`` physical blocks (``-1`` = none).
        geometry: the cache's geometry (its ``block_size``).
        n_cols: columns of the index scores the indexer reads.
        row_starts: optional int ``[T]`` (prefill: token ``t``'s keys start at this column).
        num_blocks, next_n, index_q, index_weights: the scoring rows (module docstring; ``None`` / 1: none).
    """
    B, M = block_table.shape
    bounds = local_bounds.long()
    req = req_of_token.long()
    ok = (req >= 0) & (req < B) & (bounds >= 0)
    starts = row_starts.long() if row_starts is not None else torch.zeros_like(bounds)
    ok &= (starts >= 0) & (starts <= n_cols) & (bounds <= n_cols - starts)  # never starts + bounds: it may wrap
    need = torch.div(bounds.clamp_min(0) + geometry.block_size - 1, geometry.block_size, rounding_mode="floor")
    ok &= need <= M
    if M > 0 and B > 0:
        rows = block_table[req.clamp(0, B - 1)]  # [T, M]: a bad request reads row 0, then is refused above
        j = torch.arange(M, device=block_table.device)
        absent = (rows < 0) if num_blocks is None else (rows < 0) | (rows >= num_blocks)
        missing = (absent & (j[None, :] < need[:, None])).any(1)
        ok &= ~missing
    if next_n > 1:
        groups = req.view(-1, next_n)
        ok &= (groups == groups[:, :1]).all(1).repeat_interleave(next_n)
    if index_q is not None and index_weights is not None:
        # finiteness in each tensor's own dtype (a float64 weight of 1e300 is finite; as float32 it is not);
        # float8 e4m3fn has no isfinite kernel everywhere: read through float32, which holds every e4m3 value
        q_fin = torch.isfinite(index_q.float() if index_q.dtype == torch.float8_e4m3fn else index_q)
        ok &= q_fin.flatten(1).all(1) & torch.isfinite(index_weights).all(1)
    return ok


def reference_guard(
    partial: torch.Tensor,
    lse: torch.Tensor,
    local_bounds: torch.Tensor,
    req_of_token: torch.Tensor,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    n_cols: int,
    *,
    row_starts: torch.Tensor | None = None,
    num_blocks: int | None = None,
    next_n: int = 1,
    index_q: torch.Tensor | None = None,
    index_weights: torch.Tensor | None = None,
) -> None:
    """Poison (NaN output, NaN LSE), in place, the rows of ``partial [T, H, v]`` / ``lse [T, H]`` whose
    metadata :func:`metadata_row_ok` refuses. Device ops only. Arguments checked by :func:`check_guard_inputs`
    (the kernel's checks, with its messages)."""
    n_cols = check_guard_inputs(
        partial, lse, local_bounds, req_of_token, block_table, geometry, n_cols, row_starts,
        num_blocks=num_blocks, next_n=next_n, index_q=index_q, index_weights=index_weights,
    )  # fmt: skip
    ok = metadata_row_ok(
        local_bounds, req_of_token, block_table, geometry, n_cols, row_starts,
        num_blocks=num_blocks, next_n=next_n, index_q=index_q, index_weights=index_weights,
    )  # fmt: skip
    bad = ~ok
    partial.masked_fill_(bad[:, None, None], math.nan)
    lse.masked_fill_(bad[:, None], math.nan)
