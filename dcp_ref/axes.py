"""The planned layer's parts: one object per option axis, each owning its buffers, views, stages and collectives.

:class:`~dcp_ref.step.PlannedStep` is a choice of five parts, made once at plan time from the
:class:`~dcp_ref.stages.StepSpec` (its :class:`~dcp_ref.options.LayerOptions`), and its ``run`` calls them in
order — one line each::

    QueryPath    q [T, H/W, D] -> all-gather over heads -> [T, H, D]   (dcp, query not replicated, W > 1)
                 or q as it is                                          (replicated query, tp, W = 1)
    Indexing     (scoring: FP8 index keys -> scores [T, L]) -> indexer: local stable top-K -> Candidates
    Exchange     all-gather of the candidates (W > 1), then
                 "allgather": select -> ids, deinterleave -> slots;  "owner": select_to_slots -> slots;
                 one rank's cache (W = 1, or tp): the local top-K is the answer, deinterleave -> slots only
    Attention    sparse MLA over (slots, counts) -> partial, lse; then the guard poisons out-of-contract tokens
    Combine      "reduce_scatter": all-gather LSEs, correct, reduce-scatter over heads
                 "alltoall": one all-to-all of partials + LSEs, merge the W partials of H/W heads
                 none: the cache is not split (tp, or one rank) -> the partial is the answer

The tp layout is no branch: it is the choice (QueryPath as it is, Exchange with nothing to gather, no Combine).

Each part allocates only what its choice uses, once, for ``spec.max_tokens`` (flat buffers viewed per run as
``[T, ...]``: :meth:`Part.views`, made once per ``T``), names the stages it calls (:attr:`Part.stages`, in call
order) and the collectives (:attr:`Part.collectives`, named as :data:`COLLECTIVE_NAMES`). Collectives are bound
at plan time (:func:`bind_collective`): a group whose collective takes no ``out=`` is found then, never by a
retry in the middle of a run (a retry on one rank only would desynchronise the ranks).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .group import Group
from .guard import GuardRows
from .stages import Stages, StepSpec, impl_name

__all__ = [
    "COLLECTIVE_NAMES",
    "Candidates",
    "Selection",
    "Part",
    "QueryPath",
    "Indexing",
    "Exchange",
    "Attention",
    "Combine",
    "ReduceScatterCombine",
    "AllToAllCombine",
    "NoCombine",
    "Parts",
    "Dtypes",
    "part_types",
    "plan_parts",
    "stage_names",
    "layer_collectives",
    "bind_collective",
    "takes_guard",
    "takes_grouped_heads",
    "indexer_order",
    "checked",
    "checked_pair",
]

#: The collectives a planned step can call, in the order a run calls them (``"partials all-to-all"``: the one
#: exchange of ``combine="alltoall"``, which replaces the LSE all-gather and the output reduce-scatter).
COLLECTIVE_NAMES = (
    "query all-gather over heads",
    "candidates all-gather",
    "LSE all-gather",
    "output reduce-scatter over heads",
    "partials all-to-all",
)


# ---- plan-time helpers -------------------------------------------------------------------------------
def _view(flat: torch.Tensor, *shape: int) -> torch.Tensor:
    """The front of a flat buffer as ``shape`` (contiguous)."""
    n = 1
    for d in shape:
        n *= d
    return flat[:n].view(shape)


def _align16(nbytes: int) -> int:
    return (nbytes + 15) // 16 * 16


def _accepts_out(fn: Any) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin inspect cannot read: the Group protocol says it takes out=
        return True
    return "out" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def bind_collective(group: Group, name: str) -> Callable[..., torch.Tensor]:
    """``group.<name>`` as a call that writes into ``out`` (its last argument), decided once, at plan time.

    A collective that takes ``out=`` is called with it; one that does not (a user's group) returns a tensor,
    copied into ``out``. Deciding here, not by catching a ``TypeError`` per call, keeps the ranks in step: a
    retry that happened on one rank only would leave the others waiting in a collective it never joined.
    """
    fn = getattr(group, name)
    if _accepts_out(fn):
        if name == "reduce_scatter":
            return lambda x, out: fn(x, 0, out=out)
        return lambda x, out: fn(x, out=out)
    if name == "reduce_scatter":
        return lambda x, out: out.copy_(fn(x, 0))
    return lambda x, out: out.copy_(fn(x))


def checked(stage: str, fn: Any, got: object, like: torch.Tensor, name: str = "") -> torch.Tensor:
    """What a stage returned, checked against its buffer's shape and dtype (cheap: no values read)."""
    if got is like:
        return like
    if not isinstance(got, torch.Tensor):
        raise TypeError(f"stage {stage!r} ({impl_name(fn)}) returned {type(got).__name__}{name}, expected a tensor")
    if got.shape != like.shape or got.dtype != like.dtype:
        raise ValueError(
            f"stage {stage!r} ({impl_name(fn)}) returned{name} shape {tuple(got.shape)} / {got.dtype}, "
            f"expected {tuple(like.shape)} / {like.dtype}"
        )
    return got


def checked_pair(
    stage: str, fn: Any, got: object, like: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A stage's pair of results, each checked by :func:`checked`."""
    if not isinstance(got, tuple) or len(got) != 2:
        raise TypeError(f"stage {stage!r} ({impl_name(fn)}) must return a pair of tensors, got {type(got).__name__}")
    return checked(stage, fn, got[0], like[0], " [0]"), checked(stage, fn, got[1], like[1], " [1]")


@dataclass(frozen=True)
class Dtypes:
    """The dtypes a plan's buffers use: ``partial`` (attention's output, ``Stages.partial_dtype``) and ``lse``
    (float32, what kernels write; float64 when the partials are: the reference oracle path)."""

    partial: torch.dtype
    lse: torch.dtype


class Part:
    """One option axis of the layer, planned for one spec (module docstring).

    Attributes:
        stages: the :class:`~dcp_ref.stages.Stages` fields this part calls, in call order.
        collectives: the collectives it calls (:data:`COLLECTIVE_NAMES`), in call order.
    """

    stages: tuple[str, ...] = ()
    collectives: tuple[str, ...] = ()

    def __init__(self, spec: StepSpec, impls: Stages, group: Group, dtypes: Dtypes) -> None:
        self.spec, self.impl, self.group, self.dtypes = spec, impls, group, dtypes
        self.stages, self.collectives = self.stages_for(spec), self.collectives_for(spec)
        self._views_by_t: dict[int, Any] = {}

    @classmethod
    def stages_for(cls, spec: StepSpec) -> tuple[str, ...]:
        """The stages this part calls for ``spec`` (decided without planning)."""
        return cls.stages

    @classmethod
    def collectives_for(cls, spec: StepSpec) -> tuple[str, ...]:
        """The collectives this part calls for ``spec`` (decided without planning)."""
        return cls.collectives

    def _buf(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, device=self.spec.device)

    def views(self, T: int) -> Any:
        """The ``[T, ...]`` views of this part's buffers, made once per ``T`` (a view costs host time per run)."""
        got = self._views_by_t.get(T)
        if got is None:
            got = self._views_by_t[T] = self._make_views(T)
        return got

    def _make_views(self, T: int) -> Any:
        return None


# ---- query path ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class QueryViews:
    gathered: torch.Tensor | None  # [W, T, H/W, D], rank-major
    full: torch.Tensor | None  # [T, H, D] (T > 1: the transpose's target)


class QueryPath(Part):
    """The query as attention reads it, ``[T, H, D]`` (dcp) or ``[T, H/W, D]`` (tp): all-gathered over heads when
    the layout is dcp, the query is not replicated and ``W > 1``; otherwise ``q`` as it is."""

    def __init__(self, spec: StepSpec, impls: Stages, group: Group, dtypes: Dtypes) -> None:
        super().__init__(spec, impls, group, dtypes)
        self.gathers = bool(self.collectives)
        if self.gathers:
            self._all_gather = bind_collective(group, "all_gather")
        W, T = spec.geometry.world_size, spec.max_tokens
        Hs, H, D = spec.heads_per_rank, spec.num_heads, spec.head_dim
        self.gathered_buf = self._buf(W * T * Hs * D, spec.dtype) if self.gathers else None
        #: The attention stage reads the query with its heads in groups (``[T, W, H/W, D]``, the gathered buffer
        #: transposed, a view): no transpose here (:func:`takes_grouped_heads`).
        self.grouped = takes_grouped_heads(impls)
        # At T = 1 the gathered [W, 1, H/W, D] already is [1, H, D] in memory: no transpose buffer.
        self.full_buf = self._buf(T * H * D, spec.dtype) if self.gathers and T > 1 and not self.grouped else None

    @classmethod
    def collectives_for(cls, spec: StepSpec) -> tuple[str, ...]:
        gathers = spec.layout == "dcp" and not spec.q_replicate and spec.geometry.world_size > 1
        return (COLLECTIVE_NAMES[0],) if gathers else ()

    def _make_views(self, T: int) -> QueryViews:
        s = self.spec
        W, Hs, H, D = s.geometry.world_size, s.heads_per_rank, s.num_heads, s.head_dim
        g = None if self.gathered_buf is None else _view(self.gathered_buf, W, T, Hs, D)
        return QueryViews(g, None if self.full_buf is None else _view(self.full_buf, T, H, D))

    def run(self, q: torch.Tensor) -> torch.Tensor:
        """``q [T, query_heads, D]`` -> the query attention reads."""
        if not self.gathers:
            return q
        T = q.shape[0]
        b = self.views(T)
        qg = self._all_gather(q, b.gathered)  # [W, T, H/W, D], rank-major
        if T == 1:  # [W, 1, H/W, D] is [1, H, D] in memory, no copy
            return qg.view(1, self.spec.num_heads, self.spec.head_dim)
        if b.full is None:  # the attention reads [T, W, H/W, D] as it is
            return qg.transpose(0, 1)
        W, Hs, D = self.spec.geometry.world_size, self.spec.heads_per_rank, self.spec.head_dim
        b.full.view(T, W, Hs, D).copy_(qg.transpose(0, 1))
        return b.full


# ---- indexing: scoring + the local top-K --------------------------------------------------------------
@dataclass(frozen=True)
class Candidates:
    """This rank's local top-K: ``packed`` (score, global id) ``[T, k, 2]`` (``global_id``) or scores ``[T, k]``
    with ``own_ids`` (local indices, ``rank_local``); ``scores`` the ``[T, L]`` index scores the indexer read."""

    scores: torch.Tensor
    packed: torch.Tensor
    own_ids: torch.Tensor | None


@dataclass(frozen=True)
class IndexingViews:
    scores: torch.Tensor | None  # [T, L]  (the step scores)
    packed: torch.Tensor  # [T, k, 2] or [T, k]
    own_ids: torch.Tensor | None  # [T, k]  (rank_local)


def indexer_order(spec: StepSpec) -> str:
    """The order the indexer writes its candidates in: the spec's, except where the cache is not split (W = 1, or
    tp): there nothing is exchanged, the local top-K is the answer, and its ids are wanted as integers
    (``rank_local``: scores ``[T, k]`` + ids ``[T, k]``; one rank's local index is the global id), not packed."""
    return "rank_local" if spec.cache_geometry.world_size == 1 else spec.order


class Indexing(Part):
    """Scoring (when the spec scores FP8 index keys) and the indexer (the local stable top-K, packed)."""

    def __init__(self, spec: StepSpec, impls: Stages, group: Group, dtypes: Dtypes) -> None:
        super().__init__(spec, impls, group, dtypes)
        T, k = spec.max_tokens, spec.topk
        self.rank_local = indexer_order(spec) == "rank_local"
        self.scores_buf = self._buf(T * spec.scoring.max_keys, torch.float32) if spec.scoring is not None else None
        self.packed_buf = self._buf(T * k * (1 if self.rank_local else 2), torch.float32)
        self.own_ids_buf = self._buf(T * k, torch.int32) if self.rank_local else None

    @classmethod
    def stages_for(cls, spec: StepSpec) -> tuple[str, ...]:
        return (("scoring",) if spec.scoring is not None else ()) + ("indexer",)

    def _make_views(self, T: int) -> IndexingViews:
        s, k = self.spec, self.spec.topk
        sc = None if self.scores_buf is None or s.scoring is None else _view(self.scores_buf, T, s.scoring.max_keys)
        pair = () if self.rank_local else (2,)
        ids = None if self.own_ids_buf is None else _view(self.own_ids_buf, T, k)
        return IndexingViews(sc, _view(self.packed_buf, T, k, *pair), ids)

    def run(self, shard: Any, meta: Any, index_q: Any, index_weights: Any) -> Candidates:
        s, st = self.spec, self.impl
        b = self.views(meta.local_bounds.shape[0])
        bt, req, bounds, starts, cg = shard.block_table, meta.req_of_token, meta.local_bounds, meta.row_starts, \
            s.cache_geometry  # fmt: skip
        scores = shard.index_scores
        if b.scores is not None and s.scoring is not None:
            sfn: Any = st.scoring
            scores = checked("scoring", sfn, sfn(
                index_q, index_weights, shard.index_cache, bt, req, bounds, cg, row_starts=starts, out=b.scores,
                next_n=s.scoring.next_n,
            ), b.scores)  # fmt: skip
        ifn: Any = st.indexer
        if b.own_ids is not None:  # the indexer's ids as integers (indexer_order)
            packed, own_ids = checked_pair("indexer", ifn, ifn(
                scores, bounds, cg, s.topk, row_starts=starts, out=b.packed, order="rank_local", out_ids=b.own_ids
            ), (b.packed, b.own_ids))  # fmt: skip
            return Candidates(scores, packed, own_ids)
        packed = checked("indexer", ifn, ifn(scores, bounds, cg, s.topk, row_starts=starts, out=b.packed), b.packed)
        return Candidates(scores, packed, None)


# ---- exchange -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Selection:
    """This rank's share of the global top-k: ``slots [T, k]`` int32 (compacted to the front, or masked with
    ``-1``), ``counts [T]``; ``ids [T, k]`` the global ids when the exchange selected them all (``allgather``)."""

    slots: torch.Tensor
    counts: torch.Tensor
    ids: torch.Tensor | None


@dataclass(frozen=True)
class ExchangeViews:
    gathered: torch.Tensor | None  # [W, T, k, (2)]  (the cache split over W > 1 ranks)
    ids: torch.Tensor | None  # [T, k]  (allgather)
    slots: torch.Tensor  # [T, k]
    counts: torch.Tensor  # [T]


class Exchange(Part):
    """The candidates all-gathered (when the cache is split over ``W > 1`` ranks), then ``"allgather"``: select +
    deinterleave, or ``"owner"``: select_to_slots. Where the cache is not split (W = 1, or tp) there is nothing to
    select: the indexer's ids (:func:`indexer_order`) are the answer, and only their slots are looked up."""

    def __init__(self, spec: StepSpec, impls: Stages, group: Group, dtypes: Dtypes) -> None:
        super().__init__(spec, impls, group, dtypes)
        T, k, Wc = spec.max_tokens, spec.topk, spec.cache_geometry.world_size
        self.split = Wc > 1
        self.owner = spec.exchange == "owner" and self.split
        self.pair = () if spec.order == "rank_local" else (2,)
        if self.split:
            self._all_gather = bind_collective(group, "all_gather")
        self.gathered_buf = self._buf(Wc * T * k * (1 if self.pair == () else 2), torch.float32) if self.split else None
        self.ids_buf = self._buf(T * k, torch.int32) if self.split and not self.owner else None
        self.slots_buf = self._buf(T * k, torch.int32)
        self.counts_buf = self._buf(T, torch.int32)

    @classmethod
    def stages_for(cls, spec: StepSpec) -> tuple[str, ...]:
        if spec.cache_geometry.world_size == 1:
            return ("deinterleave",)
        return ("select_to_slots",) if spec.exchange == "owner" else ("select", "deinterleave")

    @classmethod
    def collectives_for(cls, spec: StepSpec) -> tuple[str, ...]:
        return (COLLECTIVE_NAMES[1],) if spec.cache_geometry.world_size > 1 else ()

    def _make_views(self, T: int) -> ExchangeViews:
        k, Wc = self.spec.topk, self.spec.cache_geometry.world_size
        g = None if self.gathered_buf is None else _view(self.gathered_buf, Wc, T, k, *self.pair)
        ids = None if self.ids_buf is None else _view(self.ids_buf, T, k)
        return ExchangeViews(g, ids, _view(self.slots_buf, T, k), _view(self.counts_buf, T))

    def run(self, cand: Candidates, shard: Any, meta: Any) -> Selection:
        s, st, k = self.spec, self.impl, self.spec.topk
        b = self.views(cand.packed.shape[0])
        req, bt, cg = meta.req_of_token, shard.block_table, s.cache_geometry
        if not self.split:  # one rank's cache: the local top-K's ids are the selection
            assert cand.own_ids is not None
            return self._slots(cand.own_ids, req, bt, b)
        gathered = self._all_gather(cand.packed, b.gathered)
        if self.owner:
            s2s: Any = st.select_to_slots
            slots, counts = checked_pair("select_to_slots", s2s, s2s(
                gathered, cand.own_ids, req, bt, cg, k, order=s.order, out_slots=b.slots, out_counts=b.counts
            ), (b.slots, b.counts))  # fmt: skip
            return Selection(slots, counts, None)
        assert b.ids is not None
        ids = checked("select", st.select, st.select(gathered, k, out=b.ids), b.ids)
        return self._slots(ids, req, bt, b)

    def _slots(self, ids: torch.Tensor, req: Any, bt: Any, b: ExchangeViews) -> Selection:
        """The deinterleave stage: global ids ``[T, k]`` -> this rank's slots and counts."""
        dfn: Any = self.impl.deinterleave
        slots, counts = checked_pair("deinterleave", dfn, dfn(
            ids, req, bt, self.spec.cache_geometry, compact=self.impl.attention_layout == "compact",
            out_slots=b.slots, out_counts=b.counts,
        ), (b.slots, b.counts))  # fmt: skip
        return Selection(slots, counts, ids)


# ---- attention + guard --------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionViews:
    partial: torch.Tensor  # [T, Ha, v]
    lse: torch.Tensor  # [T, Ha]


class Attention(Part):
    """Sparse MLA over this rank's selected slots (partial output + LSE, base e), then the guard: tokens whose
    metadata is out of contract come out NaN (:mod:`dcp_ref.guard`).

    Two plan-time fusions, each where the attention stage offers it (:func:`takes_guard`,
    :func:`takes_grouped_heads`): the guard taken into the attention call (its rule decided in the kernel's
    prologue, written by the epilogue: no guard launch), and the partial written straight into the buffer the
    combine sends (its ``target``: no copy into it)."""

    stages = ("attention", "guard")

    def __init__(
        self, spec: StepSpec, impls: Stages, group: Group, dtypes: Dtypes,
        target: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:  # fmt: skip
        """``target(T)``: where the partial and its LSE are written (``[T, G, H/G, v]`` / ``[T, G, H/G]`` views of
        another part's buffer, the combine's send buffer); ``None``: buffers of this part's own."""
        super().__init__(spec, impls, group, dtypes)
        T, Ha, v = spec.max_tokens, spec.attention_heads, spec.v_dim
        #: The guard runs inside the attention call (no stage call of its own).
        self.guard_fused = takes_guard(impls)
        self._target = target
        self.partial_buf = self._buf(T * Ha * v, dtypes.partial) if target is None else None
        self.lse_buf = self._buf(T * Ha, dtypes.lse) if target is None else None

    def _make_views(self, T: int) -> AttentionViews:
        if self._target is not None:
            return AttentionViews(*self._target(T))
        assert self.partial_buf is not None and self.lse_buf is not None
        Ha, v = self.spec.attention_heads, self.spec.v_dim
        return AttentionViews(_view(self.partial_buf, T, Ha, v), _view(self.lse_buf, T, Ha))

    def run(
        self, q: torch.Tensor, shard: Any, meta: Any, sel: Selection, n_cols: int, scored_rows: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        s, st = self.spec, self.impl
        b = self.views(q.shape[0])
        fn: Any = st.attention
        cg, bounds, req, bt, starts = s.cache_geometry, meta.local_bounds, meta.req_of_token, shard.block_table, \
            meta.row_starts  # fmt: skip
        fused = {"guard": GuardRows(bounds, req, bt, cg, n_cols, starts, **scored_rows)} if self.guard_fused else {}
        partial, lse = checked_pair("attention", fn, fn(
            q, shard.kv_cache, sel.slots, sel.counts, s.sm_scale, s.v_dim, out=b.partial, out_lse=b.lse, **fused
        ), (b.partial, b.lse))  # fmt: skip
        if not self.guard_fused:
            st.guard(partial, lse, bounds, req, bt, cg, n_cols, row_starts=starts, **scored_rows)
        return partial, lse


def takes_guard(impls: Stages) -> bool:
    """Whether the plan folds the guard into the attention call: the attention stage takes one (``takes_guard``)
    and the guard stage is one of the project's (``standard_guard``: the rule of :mod:`dcp_ref.guard`, which the
    attention kernel then applies). A guard of the caller's own is always called as its own stage."""
    return bool(getattr(impls.attention, "takes_guard", False) and getattr(impls.guard, "standard_guard", False))


def takes_grouped_heads(impls: Stages) -> bool:
    """Whether the attention stage reads ``q`` and writes ``out`` / ``out_lse`` with their heads in groups
    (``[T, G, H/G, ...]`` views, any strides: ``grouped_heads``), so the query's transpose after its all-gather and
    the partial's copy into the all-to-all's send buffer are the kernel's own reads and writes. Only with the
    guard taken in as well (a separate guard poisons ``[T, H, v]`` buffers)."""
    return bool(getattr(impls.attention, "grouped_heads", False)) and takes_guard(impls)


# ---- combine ------------------------------------------------------------------------------------------
class Combine(Part):
    """Partial outputs of all ``H`` heads on this rank -> this rank's ``H/W`` heads, combined over the ranks."""

    def run(self, partial: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class NoCombine(Combine):
    """The rank holds all of its heads' keys (tp, or dcp over one rank): the partial is the answer."""

    def run(self, partial: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        T, Hs, v = partial.shape[0], self.spec.heads_per_rank, self.spec.v_dim
        return partial.view(T, Hs, v), lse.view(T, Hs)


@dataclass(frozen=True)
class ReduceScatterViews:
    all_lse: torch.Tensor  # [W, T, H]
    corrected: torch.Tensor  # [T, H, v]
    merged_lse: torch.Tensor  # [T, H]
    send: torch.Tensor  # [W, T, H/W, v]  (the head-major copy)
    out: torch.Tensor  # [T, H/W, v]


class ReduceScatterCombine(Combine):
    """All-gather the LSEs, correct this rank's partial by them (the ``correct`` stage), reduce-scatter over heads."""

    stages = ("correct",)
    collectives = (COLLECTIVE_NAMES[2], COLLECTIVE_NAMES[3])

    def __init__(self, spec: StepSpec, impls: Stages, group: Group, dtypes: Dtypes) -> None:
        super().__init__(spec, impls, group, dtypes)
        W, T, H, Hs, v = spec.geometry.world_size, spec.max_tokens, spec.num_heads, spec.heads_per_rank, spec.v_dim
        self._all_gather = bind_collective(group, "all_gather")
        self._reduce_scatter = bind_collective(group, "reduce_scatter")
        self.all_lse_buf = self._buf(W * T * H, dtypes.lse)
        self.corrected_buf = self._buf(T * H * v, dtypes.partial)
        self.merged_lse_buf = self._buf(T * H, dtypes.lse)
        self.send_buf = self._buf(T * H * v, dtypes.partial)
        self.out_buf = self._buf(T * Hs * v, dtypes.partial)

    def _make_views(self, T: int) -> ReduceScatterViews:
        s = self.spec
        W, H, Hs, v = s.geometry.world_size, s.num_heads, s.heads_per_rank, s.v_dim
        return ReduceScatterViews(
            _view(self.all_lse_buf, W, T, H), _view(self.corrected_buf, T, H, v), _view(self.merged_lse_buf, T, H),
            _view(self.send_buf, W, T, Hs, v), _view(self.out_buf, T, Hs, v),
        )  # fmt: skip

    def run(self, partial: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, g = self.spec, self.spec.geometry
        T, W, Hs, v = partial.shape[0], g.world_size, s.heads_per_rank, s.v_dim
        b = self.views(T)
        all_lse = self._all_gather(lse, b.all_lse)
        fn: Any = self.impl.correct
        got = fn(partial, all_lse, g.rank, out=b.corrected, out_lse=b.merged_lse)
        corrected, merged = checked_pair("correct", fn, got, (b.corrected, b.merged_lse))
        # Heads of rank w must be contiguous for the reduce-scatter: [T, H, v] -> [W, T, H/W, v] (one copy).
        b.send.copy_(corrected.view(T, W, Hs, v).transpose(0, 1))
        out = self._reduce_scatter(b.send.view(W * T, Hs, v), b.out)
        return out, merged[:, g.rank * Hs : (g.rank + 1) * Hs]


@dataclass(frozen=True)
class AllToAllViews:
    send_bytes: torch.Tensor  # uint8 [W, chunk]
    recv_bytes: torch.Tensor  # uint8 [W, chunk]
    send_out: torch.Tensor  # [W, T, H/W, v]  views into send_bytes
    send_lse: torch.Tensor  # [W, T, H/W]
    recv_out: torch.Tensor  # [W, T, H/W, v]  views into recv_bytes
    recv_lse: torch.Tensor  # [W, T, H/W]
    out: torch.Tensor  # [T, H/W, v]
    out_lse: torch.Tensor  # [T, H/W]


class AllToAllCombine(Combine):
    """Rank ``j``'s heads of this rank's partial, with their LSEs, to rank ``j`` in one all-to-all (one byte buffer:
    per destination its partial outputs, then their LSEs, each part 16-byte aligned so that any dtype views it),
    then the ``combine`` stage merges the ``W`` partials of this rank's ``H/W`` heads."""

    stages = ("combine",)
    collectives = (COLLECTIVE_NAMES[4],)

    def __init__(self, spec: StepSpec, impls: Stages, group: Group, dtypes: Dtypes) -> None:
        super().__init__(spec, impls, group, dtypes)
        W, T, Hs, v = spec.geometry.world_size, spec.max_tokens, spec.heads_per_rank, spec.v_dim
        self._all_to_all = bind_collective(group, "all_to_all")
        self.send_bytes_buf = self._buf(W * self.chunk_bytes(T), torch.uint8)
        self.recv_bytes_buf = self._buf(W * self.chunk_bytes(T), torch.uint8)
        self.out_buf = self._buf(T * Hs * v, dtypes.partial)
        self.out_lse_buf = self._buf(T * Hs, dtypes.lse)
        #: The attention writes its partial straight into the send buffer (:meth:`send_target`): no copy here.
        self.packed_by_attention = False

    def send_target(self, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The send buffer as the attention's ``out`` / ``out_lse``: ``[T, W, H/W, v]`` / ``[T, W, H/W]`` views
        (destination rank ``w`` gets heads ``[w H/W, (w + 1) H/W)``)."""
        b = self.views(T)
        return b.send_out.transpose(0, 1), b.send_lse.transpose(0, 1)

    def chunk_bytes(self, T: int) -> int:
        """Bytes per destination rank: its heads' partial outputs, then their LSEs (each 16-byte aligned)."""
        Hs, v = self.spec.heads_per_rank, self.spec.v_dim
        return _align16(T * Hs * v * self.dtypes.partial.itemsize) + _align16(T * Hs * self.dtypes.lse.itemsize)

    def _make_views(self, T: int) -> AllToAllViews:
        s, pdt, ldt = self.spec, self.dtypes.partial, self.dtypes.lse
        W, Hs, v = s.geometry.world_size, s.heads_per_rank, s.v_dim
        chunk, ob, lb = self.chunk_bytes(T), T * Hs * v * pdt.itemsize, T * Hs * ldt.itemsize
        lo = _align16(ob)
        send, recv = _view(self.send_bytes_buf, W, chunk), _view(self.recv_bytes_buf, W, chunk)
        return AllToAllViews(
            send, recv,
            send[:, :ob].view(pdt).view(W, T, Hs, v), send[:, lo : lo + lb].view(ldt).view(W, T, Hs),
            recv[:, :ob].view(pdt).view(W, T, Hs, v), recv[:, lo : lo + lb].view(ldt).view(W, T, Hs),
            _view(self.out_buf, T, Hs, v), _view(self.out_lse_buf, T, Hs),
        )  # fmt: skip

    def run(self, partial: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        T, W, Hs, v = partial.shape[0], s.geometry.world_size, s.heads_per_rank, s.v_dim
        b = self.views(T)
        if not self.packed_by_attention:
            b.send_out.copy_(partial.view(T, W, Hs, v).transpose(0, 1))
            b.send_lse.copy_(lse.view(T, W, Hs).transpose(0, 1))
        self._all_to_all(b.send_bytes, b.recv_bytes)
        fn: Any = self.impl.combine
        return checked_pair("combine", fn, fn(b.recv_out, b.recv_lse, out=b.out, out_lse=b.out_lse),
                            (b.out, b.out_lse))  # fmt: skip


def combine_for(spec: StepSpec) -> type[Combine]:
    """The combine part a spec plans: none when the cache is not split, else its ``combine`` option's."""
    if spec.cache_geometry.world_size == 1:
        return NoCombine
    return ReduceScatterCombine if spec.combine == "reduce_scatter" else AllToAllCombine


@dataclass(frozen=True)
class Parts:
    """The five parts of one planned layer, in run order."""

    query: QueryPath
    indexing: Indexing
    exchange: Exchange
    attention: Attention
    combine: Combine

    def __iter__(self) -> Any:
        return iter((self.query, self.indexing, self.exchange, self.attention, self.combine))

    @property
    def stages(self) -> tuple[str, ...]:
        """Every stage a run calls, in call order."""
        return tuple(name for part in self for name in part.stages)

    @property
    def collectives(self) -> tuple[str, ...]:
        """Every collective a run calls, in call order (:data:`COLLECTIVE_NAMES`)."""
        return tuple(name for part in self for name in part.collectives)


def part_types(spec: StepSpec) -> tuple[type[Part], ...]:
    """The part classes a spec chooses, in run order."""
    return (QueryPath, Indexing, Exchange, Attention, combine_for(spec))


def plan_parts(spec: StepSpec, impls: Stages, group: Group, dtypes: Dtypes) -> Parts:
    """The parts a spec chooses, each planned (its buffers allocated, its collectives bound). Where the attention
    stage writes grouped heads (:func:`takes_grouped_heads`), it writes straight into the all-to-all's send buffer."""
    args = (spec, impls, group, dtypes)
    combine = combine_for(spec)(*args)
    target = None
    if isinstance(combine, AllToAllCombine) and takes_grouped_heads(impls):
        combine.packed_by_attention = True
        target = combine.send_target
    return Parts(QueryPath(*args), Indexing(*args), Exchange(*args), Attention(*args, target=target), combine)


def stage_names(spec: StepSpec) -> tuple[str, ...]:
    """The stages a step planned for ``spec`` calls, in call order, as its parts decide them (no buffer made)."""
    return tuple(name for cls in part_types(spec) for name in cls.stages_for(spec))


def layer_collectives(spec: StepSpec) -> list[str]:
    """The collectives a step planned for ``spec`` calls, in order, as its parts decide them (no buffer made)."""
    return [name for cls in part_types(spec) for name in cls.collectives_for(spec)]
