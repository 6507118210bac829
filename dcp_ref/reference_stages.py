"""The plain-PyTorch reference of every stage, and the helpers a stage of your own writes its results with.

Each ``reference_<stage>`` calls the oracle function of its module (without host-side value checks: no sync, so a
step on the reference stays capture-safe) and writes into the caller's buffers through :func:`write_outs` /
:func:`write_into`, which check them first (dtype, shape, device, no alias). :func:`impl_name` is how a trace
names an implementation; :func:`named_impl` sets it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from .attention import sparse_mla_attention
from .contracts import FLOAT_DTYPES, check_no_alias, check_no_aliases, check_tensor
from .deinterleave import deinterleave_and_compact
from .geometry import DcpGeometry
from .indexer import local_topk
from .lse import correct_partial, merge_partials
from .options import ORDERS
from .protocols import IndexerStage
from .topk import pack_candidates, stable_topk

__all__ = [
    "FLOAT_OUT",
    "write_outs",
    "write_into",
    "impl_name",
    "named_impl",
    "reference_scoring",
    "reference_indexer",
    "reference_select",
    "reference_deinterleave",
    "reference_attention",
    "reference_attention_fp8",
    "reference_correct",
    "reference_select_to_slots",
    "reference_guard",
    "reference_combine",
    "compose_indexer",
]


#: The dtypes a stage's float output buffer may have (the result is cast into it); an LSE buffer is float32 (the
#: protocols'), or float64 (a float64 reference step's); packed candidates are float32.
FLOAT_OUT = FLOAT_DTYPES
_LSE = (torch.float32, torch.float64)
_F32 = (torch.float32,)
_I32 = (torch.int32,)


_Out = tuple[str, "torch.Tensor | None", torch.Tensor, Sequence[torch.dtype]]


def _write(outs: Sequence[_Out], inputs: Mapping[str, object], same_ok: Sequence[str] = ()) -> list[torch.Tensor]:
    for name, buf, res, dtypes in outs:
        if buf is None:
            continue
        check_tensor(buf, name, dtypes=dtypes)
        if tuple(buf.shape) != tuple(res.shape):
            raise ValueError(f"{name} must have shape {tuple(res.shape)}, got {tuple(buf.shape)}")
        if buf.device != res.device:
            raise ValueError(f"{name} must be on device {res.device}, got {buf.device}")
    check_no_aliases({name: buf for name, buf, _, _ in outs}, dict(inputs), same_ok=same_ok)
    return [res if buf is None else buf.copy_(res) for _, buf, res, _ in outs]


def write_outs(
    first: _Out, second: _Out, *, inputs: Mapping[str, object], same_ok: Sequence[str] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of ``first`` / ``second``, ``(name, buffer, result, dtypes)``: ``result`` copied into ``buffer`` when
    one is given, else ``result``. Both buffers are checked before either is written, as a kernel stage checks
    its own: a tensor of one of ``dtypes`` (``TypeError`` naming it), ``result``'s shape and device, sharing no
    memory with ``inputs``, with the other buffer or with itself (``ValueError`` naming it; ``same_ok``: inputs
    a buffer may be exactly, an in-place mode)."""
    a, b = _write((first, second), inputs, same_ok)
    return a, b


def write_into(
    result: torch.Tensor,
    out: torch.Tensor | None,
    name: str = "out",
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    **inputs: object,
) -> torch.Tensor:
    """:func:`write_outs` for one buffer: ``result`` copied into ``out`` (checked), else ``result``.

    ``dtypes``: what ``out`` may be (the result is cast into it); default, any floating dtype for a floating
    result (a float32 output into a bf16 or float64 buffer), else ``result``'s own dtype only (an id or count is
    never narrowed). A stage of your own passes what it reads as ``inputs`` (``name=tensor``), so that an
    aliased ``out`` is refused."""
    if dtypes is None:
        dtypes = FLOAT_OUT if result.is_floating_point() else (result.dtype,)
    return _write(((name, out, result, dtypes),), inputs)[0]


def impl_name(fn: Any) -> str:
    """How the trace names a stage implementation: its ``impl_name`` attribute, else its qualified name."""
    name = getattr(fn, "impl_name", None)
    if isinstance(name, str):
        return name
    mod = getattr(fn, "__module__", "") or ""
    qual = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{mod}.{qual}" if mod and not mod.startswith("dcp_ref") else qual


_F = TypeVar("_F", bound=Callable[..., Any])


def named_impl(name: str) -> Callable[[_F], _F]:
    """Decorator: the name the trace gives this stage implementation (see :func:`impl_name`)."""

    def deco(fn: _F) -> _F:
        fn.impl_name = name  # type: ignore[attr-defined]
        return fn

    return deco


# ---- the reference implementations -----------------------------------------------------------------
# The reference stages call the oracle functions without their host-side value checks (validate=False:
# no .item(), no sync), so that a step on the reference stays capture-safe; the step's own
# ``validate=True`` checks its inputs' values, and the public functions validate by default.
@named_impl("torch")
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
    """:func:`dcp_ref.scoring.index_scores` (dequantized, float32); ``next_n``: query tokens per request (MTP)."""
    from .scoring import reference_scoring as scoring

    return scoring(
        index_q, weights, index_cache, block_table, req_of_token, local_bounds, geometry, row_starts=row_starts,
        out=out, next_n=next_n,
    )  # fmt: skip


@named_impl("torch")
def reference_indexer(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    geometry: DcpGeometry,
    k: int,
    *,
    row_starts: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    order: str = "global_id",
    out_ids: torch.Tensor | None = None,
) -> Any:
    """:func:`dcp_ref.indexer.local_topk` then :func:`dcp_ref.topk.pack_candidates` (``order="global_id"``), or
    :func:`dcp_ref.indexer.reference_indexer_rank_local` (``"rank_local"``: scores and local ids apart)."""
    g = geometry
    if order == "rank_local":
        from .indexer import reference_indexer_rank_local

        return reference_indexer_rank_local(scores, lengths, g, k, row_starts=row_starts, out=out, out_ids=out_ids)
    if order != "global_id":
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    ids = local_topk(scores, k, lengths, row_starts, validate=False)
    return write_into(pack_candidates(scores, ids, g, row_starts, validate=False), out, dtypes=_F32, scores=scores,
                      lengths=lengths, row_starts=row_starts)  # fmt: skip


@named_impl("torch")
def reference_select(gathered: torch.Tensor, k: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`dcp_ref.topk.stable_topk` (sorted: the reference always is)."""
    return write_into(stable_topk(gathered, k, validate=False), out, dtypes=_I32, gathered=gathered)


@named_impl("torch")
def reference_deinterleave(
    global_ids: torch.Tensor,
    req_of_token: torch.Tensor,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    *,
    compact: bool = True,
    out_slots: torch.Tensor | None = None,
    out_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dcp_ref.deinterleave.deinterleave_and_compact` (ordered), or
    :func:`dcp_ref.deinterleave.deinterleave_masked` (the uncompacted slots)."""
    from .deinterleave import deinterleave_masked

    g = geometry
    if compact:
        slots, counts = deinterleave_and_compact(global_ids, req_of_token, block_table, g, validate=False)
    else:
        slots, counts = deinterleave_masked(global_ids, req_of_token, block_table, g, validate=False)
    ins = dict(global_ids=global_ids, req_of_token=req_of_token, block_table=block_table)
    return write_outs(("out_slots", out_slots, slots, _I32), ("out_counts", out_counts, counts, _I32), inputs=ins)


@named_impl("torch")
def reference_attention(
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
    """:func:`dcp_ref.attention.sparse_mla_attention` in float64 (base e)."""
    o, lse = sparse_mla_attention(q, kv_cache, slots, counts, sm_scale, "e", v_dim=v_dim, validate=False)
    ins = dict(q=q, kv_cache=kv_cache, slots=slots, counts=counts)
    return write_outs(("out", out, o, FLOAT_OUT), ("out_lse", out_lse, lse, _LSE), inputs=ins)


@named_impl("torch-fp8")
def reference_attention_fp8(
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
    """:func:`dcp_ref.fp8_cache.sparse_mla_attention_fp8` (masked layout: ``-1`` anywhere in a row), float64."""
    from .fp8_cache import sparse_mla_attention_fp8

    return sparse_mla_attention_fp8(
        q, kv_cache, slots, counts, sm_scale, v_dim, out=out, out_lse=out_lse, attention_layout="masked", validate=False
    )


@named_impl("torch")
def reference_correct(
    partial: torch.Tensor,
    all_lse: torch.Tensor,
    rank: int,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dcp_ref.lse.correct_partial` (float64 weights)."""
    corrected, merged = correct_partial(partial, all_lse, rank, "e", validate=False)
    ins = dict(partial=partial, all_lse=all_lse)
    return write_outs(
        ("out", out, corrected, FLOAT_OUT), ("out_lse", out_lse, merged, _LSE), inputs=ins, same_ok=("partial",)
    )


@named_impl("torch")
def reference_select_to_slots(
    gathered: torch.Tensor,
    own_ids: torch.Tensor | None,
    req_of_token: torch.Tensor,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    k: int,
    *,
    order: str = "global_id",
    out_slots: torch.Tensor | None = None,
    out_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dcp_ref.select_to_slots.select_to_slots` (either order)."""
    from .select_to_slots import reference_select_to_slots as fn

    return fn(gathered, own_ids, req_of_token, block_table, geometry, k, order=order, out_slots=out_slots,
              out_counts=out_counts)  # fmt: skip


@named_impl("torch")
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
    """:func:`dcp_ref.guard.reference_guard` (torch ops on the device, no host read)."""
    from .guard import reference_guard as fn

    fn(partial, lse, local_bounds, req_of_token, block_table, geometry, n_cols, row_starts=row_starts,
       num_blocks=num_blocks, next_n=next_n, index_q=index_q, index_weights=index_weights)  # fmt: skip


#: This guard applies the rule of :mod:`dcp_ref.guard` (an attention stage that takes the guard in may apply it
#: instead: :func:`dcp_ref.axes.takes_guard`).
reference_guard.standard_guard = True  # type: ignore[attr-defined]


@named_impl("torch")
def reference_combine(
    outs: torch.Tensor,
    lses: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dcp_ref.lse.merge_partials` over the ``W`` received partials (float64 weights)."""
    merged, lse = merge_partials(outs, lses, "e", validate=False)
    ins = dict(outs=outs, lses=lses)
    return write_outs(("out", out, merged, FLOAT_OUT), ("out_lse", out_lse, lse, _LSE), inputs=ins)


def _accepts_out(fn: Any) -> bool:
    """Whether ``fn`` takes an ``out=`` keyword (a callable inspect cannot read is trusted to)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return "out" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def compose_indexer(
    select_local: Callable[..., torch.Tensor], pack: Callable[..., torch.Tensor], name: str | None = None
) -> IndexerStage:
    """An indexer stage from a local top-K and a pack, each with the reference's signature.

    ``select_local(scores, k, lengths, row_starts) -> int [T, k]`` local indices (``-1`` padded), as
    :func:`dcp_ref.indexer.local_topk`; ``pack(scores, ids, geometry, row_starts, out=)``
    as :func:`dcp_ref.topk.pack_candidates` (``out`` may be ignored: the result is copied in).
    """
    label = name or f"{impl_name(select_local)}+{impl_name(pack)}"
    pack_takes_out = _accepts_out(pack)  # decided once, here: never a retry per call

    @named_impl(label)
    def indexer(
        scores: torch.Tensor,
        lengths: torch.Tensor,
        geometry: DcpGeometry,
        k: int,
        *,
        row_starts: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        check_no_alias(out, "out", scores=scores, lengths=lengths, row_starts=row_starts)  # before pack writes it
        ids = select_local(scores, k, lengths, row_starts)
        if pack_takes_out:
            packed = pack(scores, ids, geometry, row_starts, out=out)
        else:  # a pack without out=: its result is copied in below
            packed = pack(scores, ids, geometry, row_starts)
        if out is None or packed is out:
            return packed
        return write_into(packed, out, dtypes=_F32, scores=scores, lengths=lengths, row_starts=row_starts)

    # A global_id indexer only: without order / out_ids (the protocol's rank_local keywords), the step refuses it
    # at plan time for order="rank_local".
    return indexer  # type: ignore[return-value]
