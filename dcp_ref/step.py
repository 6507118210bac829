"""The planned decode layer: plan once, run many times, capture whole in a CUDA graph.

Why a plan: a decode step runs once per layer per token (61 layers for DeepSeek V3). Everything
that does not change between those calls — the geometry, the largest batch, the head geometry,
every intermediate buffer, the compiled kernels, the collectives' buffers — is fixed once by
:class:`PlannedStep`; its :meth:`~PlannedStep.run` then makes **no host synchronisation** and, with
allocation-free stages (the kernels of :mod:`dcp_ref.kernels`), **no allocation**, so the whole run,
collectives included, can be captured in one CUDA graph (:meth:`~PlannedStep.capture`) and
replayed per layer. Checks that need tensor values on the host happen only with ``validate=True``.

One run on rank ``r`` of ``W`` (``T`` query tokens, ``H`` heads, ``k`` = top-k; the
:class:`~dcp_ref.stages.StepSpec` chooses the layout, the exchange and the combine)::

    (ownership      seq_lens, next_n -> local bound per token [T]: once per decode step, in StepMetadata)
    query gather    q [T, H/W, D] -> all-gather over heads -> [T, H, D]      (dcp with q_replicate=False)
    scoring         index_q, index_weights x shard.index_cache -> scores [T, L]   (spec.scoring; else the
                    shard's precomputed index_scores)
    indexer         scores -> candidates: (score, id) [T, k, 2], or scores [T, k] + local ids ("rank_local")
    all-gather      -> gathered [W, T, k, 2] / [W, T, k]                      (W > 1)
    exchange        "allgather": select -> ids [T, k], deinterleave -> slots [T, k], counts [T]
                    "owner":     select_to_slots -> this rank's slots [T, k], counts [T]
    attention       q over kv_cache[slots] -> partial [T, Ha, v], lse [T, Ha] (base e; Ha = H, or H/W for tp)
    guard           tokens with out-of-contract metadata -> NaN (dcp_ref.guard)
    combine         "reduce_scatter": all-gather LSEs, correct, reduce-scatter over heads
                    "alltoall": one all-to-all of partials + LSEs, combine W partials of H/W heads
                    -> out [T, H/W, v], lse [T, H/W]

``layout="tp"`` is tensor parallelism with the same stages: every rank holds the whole context and
``H/W`` heads; no query gather, nothing exchanged, no combine (``W = 1`` for the cache).

Usage::

    spec = StepSpec(geometry, max_tokens=T, topk=2048, num_heads=128, head_dim=576, v_dim=512,
                    sm_scale=192**-0.5, dtype=torch.bfloat16, device="cuda")
    step = PlannedStep(group, spec, stages)           # stages: REFERENCE_STAGES or dcp_ref.kernels.stages
    meta = decode_metadata(seq_lens, next_n, geometry)  # once per decode step, shared by all layers
    out, lse = step.run(q, shard, meta)               # per layer
    graph = step.capture(q, shard, meta)              # or capture it and...
    graph.replay()                                    # ...replay (inputs updated in place)
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Any

import torch

from .axes import Candidates, Dtypes, Selection, indexer_order, plan_parts, stage_names
from .contracts import FLOAT_DTYPES, INT_DTYPES, check_device, check_tensor
from .fp8_cache import FP8_DS_MLA
from .geometry import DcpGeometry
from .group import Group
from .ownership import localize_decode_bounds, localize_prefill_chunk
from .protocols import GUARD_SCORED_KEYWORDS, RANK_LOCAL_INDEXER_KEYWORDS, STAGE_KEYWORDS
from .stages import REFERENCE_STAGES, Stages, StepSpec, impl_name, kv_format_of, resolve_stages

__all__ = [
    "PLAN_LOCK",
    "RankShard",
    "StepMetadata",
    "decode_metadata",
    "prefill_metadata",
    "PlannedStep",
    "CapturedStep",
    "HostSyncCounter",
    "plan_for",
]

#: Planning (kernel compilation in ``Stages.prepare``) runs under this lock: CuTeDSL compilation is
#: not thread-safe, and the ranks of a :class:`~dcp_ref.group.SimulatedWorld` are threads.
PLAN_LOCK = threading.RLock()


@dataclass
class RankShard:
    """What one rank holds for one layer.

    Attributes:
        kv_cache: the paged local KV: float ``[num_blocks * block_size, D]`` (slot-major), or an FP8 cache
            (:mod:`dcp_ref.fp8_cache`, 656 bytes per token).
        block_table: int32 ``[B, max_blocks]`` — physical block of each request's local block ``j``
            (``-1`` past the request's blocks). The FP8 index keys share it.
        index_scores: float32 ``[T, L]`` — precomputed indexer scores of this rank's keys for every query
            token (column = local index; garbage past the token's local bound), or ``None`` when the step
            scores the index keys itself (``StepSpec.scoring``).
        geometry: the :class:`~dcp_ref.geometry.DcpGeometry` the shard was built for (the cache's: for the
            ``"tp"`` layout one rank, the whole context). A step checks it against its own, so a shard of
            one geometry is never run with another.
        index_cache: this rank's FP8 index-key cache (:mod:`dcp_ref.scoring`), paged with ``block_table``, or
            ``None`` (precomputed scores).
    """

    kv_cache: torch.Tensor
    block_table: torch.Tensor
    index_scores: torch.Tensor | None = None
    geometry: DcpGeometry | None = None
    index_cache: torch.Tensor | None = None


@dataclass(frozen=True)
class StepMetadata:
    """Per-decode-step metadata of one rank, shared by every layer's run (the ownership stage's output).

    Built once per decode step (:func:`decode_metadata`, :func:`prefill_metadata`), outside any graph:
    the ownership math validates its inputs on the host. A captured step reads these tensors at fixed
    addresses: give it new values with :meth:`copy_`.

    Attributes:
        local_bounds: int32 ``[T]``: query token ``t`` may attend to this rank's local keys ``[0, local_bounds[t])``
            (the global causal bound expanded per token *first*, localized *after*).
        req_of_token: int32 ``[T]``: the request (block-table row) of each query token.
        row_starts: optional int32 ``[T]``: local key ``j`` of token ``t`` is column ``row_starts[t] + j`` of the
            index scores (a prefill chunk's layout); ``None``: column ``j`` (decode).
    """

    local_bounds: torch.Tensor
    req_of_token: torch.Tensor
    row_starts: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.local_bounds.shape[0])

    def copy_(self, other: StepMetadata) -> StepMetadata:
        """Copy ``other``'s values into these tensors (same shapes): how a captured graph gets new metadata."""
        self.local_bounds.copy_(other.local_bounds)
        self.req_of_token.copy_(other.req_of_token)
        if (self.row_starts is None) != (other.row_starts is None):
            raise ValueError("other.row_starts must be given exactly when this metadata has row_starts")
        if self.row_starts is not None and other.row_starts is not None:
            self.row_starts.copy_(other.row_starts)
        return self


def _req_of_token(num_requests: int, query_lens: Any) -> torch.Tensor:
    if isinstance(query_lens, int) and not isinstance(query_lens, bool):
        return torch.arange(num_requests, dtype=torch.int32).repeat_interleave(query_lens)
    per = torch.as_tensor(query_lens).to("cpu", torch.int64)
    return torch.arange(num_requests, dtype=torch.int32).repeat_interleave(per)


def decode_metadata(
    seq_lens: Any, next_n: Any, geometry: DcpGeometry, device: torch.device | str | None = None
) -> StepMetadata:
    """The ownership stage of a decode step, for one rank (validates on the host; once per decode step).

    Args:
        seq_lens: int ``[B]`` global lengths, including this step's query tokens.
        next_n: query tokens per request: an int (all requests; MTP / speculative decode), or int ``[B]``.
        geometry: this rank's :class:`~dcp_ref.geometry.DcpGeometry`.
        device: where the metadata lives (default: ``seq_lens``' device, CPU for lists).
    """
    if not isinstance(geometry, DcpGeometry):
        raise TypeError(f"geometry must be a DcpGeometry, got {type(geometry).__name__}")
    g = geometry
    bounds = localize_decode_bounds(seq_lens, next_n, g.world_size, g.rank, g.interleave).reshape(-1)
    dev = check_device(device) if device is not None else bounds.device
    req = _req_of_token(torch.as_tensor(seq_lens).numel(), next_n)
    return StepMetadata(bounds.to(dev, torch.int32), req.to(dev))


def prefill_metadata(
    context_lens: Any, query_lens: Any, geometry: DcpGeometry, device: torch.device | str | None = None
) -> StepMetadata:
    """The ownership stage of a prefill chunk, for one rank (see :func:`dcp_ref.ownership.localize_prefill_chunk`).

    The chunk's index scores hold this rank's keys of all the chunk's requests side by side; token ``t``
    may attend to columns ``[token_ks[t], token_ke[t])``, so ``row_starts = token_ks`` and
    ``local_bounds = token_ke - token_ks``.
    """
    if not isinstance(geometry, DcpGeometry):
        raise TypeError(f"geometry must be a DcpGeometry, got {type(geometry).__name__}")
    g = geometry
    m = localize_prefill_chunk(context_lens, query_lens, g.world_size, g.rank, g.interleave)
    dev = check_device(device) if device is not None else m.token_ks.device
    req = _req_of_token(torch.as_tensor(query_lens).numel(), torch.as_tensor(query_lens))
    return StepMetadata((m.token_ke - m.token_ks).to(dev, torch.int32), req.to(dev), m.token_ks.to(dev, torch.int32))


class HostSyncCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every aten op that reads tensor values back to the host (a device sync on CUDA).

    Works on the CPU too, so CPU CI can check that a step's run is capture-safe::

        with HostSyncCounter() as c:
            step.run(...)
        assert c.syncs == []
    """

    #: ops that need a tensor's values on the host (or produce data-dependent shapes).
    SYNC_OPS = frozenset(
        {
            "aten::_local_scalar_dense",
            "aten::item",
            "aten::is_nonzero",
            "aten::nonzero",
            "aten::nonzero_static",
            "aten::masked_select",
            "aten::unique",
            "aten::_unique2",
            "aten::equal",
            "aten::allclose",
            "aten::repeat_interleave",
            "aten::bincount",
            "aten::histc",
        }
    )

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        self.ops.append(name)
        if name in self.SYNC_OPS:
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def _check_group(group: object, needs_all_to_all: bool) -> None:
    """A group must look like :class:`~dcp_ref.group.Group` (checked once, at plan time)."""
    for attr in ("rank", "world_size"):
        v = getattr(group, attr, None)
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"group must be a dcp_ref.group.Group (an int {attr} and collectives), got {group!r}")
    need = ["all_gather", "reduce_scatter"] + (["all_to_all"] if needs_all_to_all else [])
    for name in need:
        if not callable(getattr(group, name, None)):
            raise TypeError(f"group must be a dcp_ref.group.Group with a callable {name}(), got {type(group).__name__}")


def _check_stage_keywords(stage: str, fn: Any, extra: tuple[str, ...] = ()) -> None:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or an object inspect cannot read: trust it
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = [kw for kw in STAGE_KEYWORDS[stage] + extra if kw not in params]
    if missing:
        raise TypeError(
            f"stage {stage!r} ({impl_name(fn)}) must accept the keyword argument(s) {missing}: the planned step "
            "passes its buffers and options by keyword (see its Protocol in dcp_ref.stages)"
        )


def _num_slots(cache: torch.Tensor) -> int:
    """Rows (token slots) of a paged cache ``[S, row]`` or ``[blocks, block_size, (1,) row]``."""
    return cache.numel() // max(cache.shape[-1], 1) if cache.ndim else 0


class PlannedStep:
    """One rank's decode layer, planned for a :class:`~dcp_ref.stages.StepSpec`.

    Args:
        group: this rank's group; its ``world_size`` / ``rank`` must equal the spec's geometry
            (``layout="tp"``: the TP group; the step calls no collective).
        spec: what to plan for (geometry, largest ``T``, top-k, heads, dims, dtype, device, layout,
            exchange, combine, query input, scoring).
        stages: the implementation of each stage (default: the reference), or a provider's name
            (``"reference"``, ``"kernels"``: :func:`~dcp_ref.stages.resolve_stages` builds them for ``spec``).
        validate: check tensor *values* on every run (host reads: not capturable). Shapes, dtypes,
            devices and the shard's geometry are always checked (host-side, no sync).

    Buffers are allocated here, once, for ``spec.max_tokens``; a run with fewer tokens uses the
    front of each. The results of :meth:`run` are views of the step's buffers: the next run
    overwrites them (copy them if you need them later).
    """

    def __init__(
        self, group: Group, spec: StepSpec, stages: Stages | str = REFERENCE_STAGES, *, validate: bool = False
    ) -> None:
        if not isinstance(spec, StepSpec):
            raise TypeError(f"spec must be a StepSpec, got {type(spec).__name__}")
        if isinstance(stages, str):  # a name: the provider builds the stages for this spec (resolve_stages)
            stages = resolve_stages(stages, spec)
        if not isinstance(stages, Stages):
            raise TypeError(f"stages must be a dcp_ref.stages.Stages or a provider's name, got {type(stages).__name__}")
        if not isinstance(validate, bool):
            raise TypeError(f"validate must be a bool, got {type(validate).__name__}")
        g, cg = spec.geometry, spec.cache_geometry
        # The all-to-all is needed only when the cache is split over more than one rank.
        _check_group(group, needs_all_to_all=spec.combine == "alltoall" and cg.world_size > 1)
        if (group.world_size, group.rank) != (g.world_size, g.rank):
            raise ValueError(
                f"group (world_size={group.world_size}, rank={group.rank}) does not match spec.geometry "
                f"(world_size={g.world_size}, rank={g.rank})"
            )
        self.group, self.spec, self.validate = group, spec, validate
        with PLAN_LOCK:
            if stages.prepare is not None:
                chosen = stages.prepare(spec, stages)
                if chosen is not None:
                    if not isinstance(chosen, Stages):
                        raise TypeError(f"stages.prepare must return a Stages or None, got {type(chosen).__name__}")
                    stages = chosen
        self.stages = stages
        self._used = stage_names(spec)
        for stage in self._used:
            extra: tuple[str, ...] = RANK_LOCAL_INDEXER_KEYWORDS if self._rank_local_indexer(stage) else ()
            if stage == "guard" and spec.scoring is not None:
                extra = GUARD_SCORED_KEYWORDS
            _check_stage_keywords(stage, getattr(stages, stage), extra)
        pdt = stages.partial_dtype(spec.dtype)
        # LSEs in float32 (what kernels write), float64 when the partials are (the reference oracle path).
        self._partial_dtype, self._lse_dtype = pdt, torch.float64 if pdt == torch.float64 else torch.float32
        self.parts = plan_parts(spec, stages, group, Dtypes(pdt, self._lse_dtype))
        self.impls = stages.impls(self._used)
        #: Stages that run inside another stage's kernel (stage -> the stage that runs it), as the plan fused them.
        self.fused: dict[str, str] = {"guard": "attention"} if self.parts.attention.guard_fused else {}

    # ------------------------------------------------------------------------------------------
    def _rank_local_indexer(self, stage: str) -> bool:
        return stage == "indexer" and indexer_order(self.spec) == "rank_local"

    @property
    def collectives(self) -> tuple[str, ...]:
        """The collectives a run calls, in order (:data:`dcp_ref.axes.COLLECTIVE_NAMES`), as the parts chose them."""
        return self.parts.collectives

    # ------------------------------------------------------------------------------------------
    def _n_cols(self, shard: Any) -> int:
        """Columns of the index scores the indexer reads (the planned L, or the shard's precomputed scores)."""
        sc = self.spec.scoring
        return sc.max_keys if sc is not None else int(shard.index_scores.shape[1])

    def _check_run(self, q: torch.Tensor, shard: Any, meta: StepMetadata, index_q: Any, index_weights: Any) -> int:
        s = self.spec
        cg = s.cache_geometry
        check_tensor(q, "q", dtypes=(s.dtype,), ndim=3, device=s.device)
        T, H, D = q.shape
        if not 0 <= T <= s.max_tokens or (H, D) != (s.query_heads, s.head_dim):
            whose = " (this rank's H/W heads)" if s.query_heads != s.num_heads else ""
            raise ValueError(
                f"q must be [T, {s.query_heads}, {s.head_dim}] with 0 <= T <= max_tokens={s.max_tokens}{whose}, "
                f"got {tuple(q.shape)}"
            )
        if not isinstance(shard, RankShard):
            raise TypeError(f"shard must be a dcp_ref.step.RankShard, got {type(shard).__name__}")
        sg = shard.geometry
        if not isinstance(sg, DcpGeometry):
            raise ValueError("shard.geometry must be the DcpGeometry the shard was built for (a RankShard field)")
        if sg != cg:
            what = "the planned geometry" if s.layout == "dcp" else "the tp layout's unsharded cache geometry"
            raise ValueError(f"shard.geometry {sg} does not match {what} {cg}")
        check_tensor(shard.kv_cache, "shard.kv_cache", ndim=(2, 3, 4), device=s.device)
        check_tensor(shard.block_table, "shard.block_table", dtypes=INT_DTYPES, ndim=2, device=s.device)
        if s.scoring is None:
            scores = check_tensor(shard.index_scores, "shard.index_scores", dtypes=(torch.float32,), ndim=2,
                                  device=s.device)  # fmt: skip
            if scores.shape[0] != T:
                raise ValueError(
                    f"shard.index_scores must have one row per query token ({T}), got {tuple(scores.shape)}"
                )
        else:
            sc = s.scoring
            check_tensor(shard.index_cache, "shard.index_cache", ndim=(2, 3, 4), device=s.device)
            fp8 = getattr(torch, "float8_e4m3fn", None)
            check_tensor(index_q, "index_q", dtypes=(*FLOAT_DTYPES, *(() if fp8 is None else (fp8,))), ndim=3,
                         device=s.device)  # fmt: skip
            if tuple(index_q.shape) != (T, sc.index_heads, sc.index_dim):
                raise ValueError(
                    f"index_q must be [T={T}, {sc.index_heads}, {sc.index_dim}], got {tuple(index_q.shape)}"
                )
            check_tensor(index_weights, "index_weights", dtypes=(torch.float32,), ndim=2, device=s.device)
            if tuple(index_weights.shape) != (T, sc.index_heads):
                raise ValueError(f"index_weights must be [T={T}, {sc.index_heads}], got {tuple(index_weights.shape)}")
            if T % sc.next_n:
                raise ValueError(f"spec.scoring.next_n={sc.next_n} must divide the T={T} query tokens (groups of "
                                 "next_n tokens of one request)")  # fmt: skip
        if not isinstance(meta, StepMetadata):
            raise TypeError(f"meta must be a StepMetadata (see decode_metadata), got {type(meta).__name__}")
        for name in ("local_bounds", "req_of_token", "row_starts"):
            t = getattr(meta, name)
            if t is None and name == "row_starts":
                continue
            check_tensor(t, f"meta.{name}", dtypes=INT_DTYPES, ndim=1, device=s.device)
            if t.shape[0] != T:
                raise ValueError(f"meta.{name} must have one entry per query token ({T}), got {tuple(t.shape)}")
        if self.validate and T > 0:
            self._check_values(T, shard, meta, index_q, index_weights)
        return T

    def _check_values(self, T: int, shard: Any, meta: StepMetadata, index_q: Any, index_weights: Any) -> None:
        """Value checks (host reads): only with ``validate=True``. The guard's contract, as errors."""
        if self.spec.scoring is not None:  # a non-finite query would score every key NaN: read as masked keys
            for name, x in (("index_q", index_q), ("index_weights", index_weights)):
                bad = ~torch.isfinite(x.float()).flatten(1).all(1)
                if bool(bad.any()):
                    t = int(bad.nonzero()[0, 0])
                    raise ValueError(f"{name} must be finite: query token {t} holds a non-finite value (it would "
                                     "score every key NaN, which reads as no keys)")  # fmt: skip
        g = self.spec.cache_geometry
        bs = g.block_size
        local = meta.local_bounds.long()
        starts = meta.row_starts.long() if meta.row_starts is not None else torch.zeros_like(local)
        if int(local.min()) < 0:
            raise ValueError(f"meta.local_bounds must be >= 0, found {int(local.min())}")
        if int(starts.min()) < 0:
            raise ValueError(f"meta.row_starts must be >= 0, found {int(starts.min())}")
        B, M = shard.block_table.shape
        req = meta.req_of_token.long()
        if int(req.min()) < 0 or int(req.max()) >= B:
            raise ValueError(f"meta.req_of_token must lie in [0, {B}) (rows of shard.block_table)")
        nn = self.spec.scoring.next_n if self.spec.scoring is not None else 1
        if nn > 1 and bool((req.view(-1, nn) != req.view(-1, nn)[:, :1]).any()):
            raise ValueError(f"meta.req_of_token must name one request per group of spec.scoring.next_n={nn} tokens "
                             "(the ownership stage's layout: a request's query tokens are consecutive)")  # fmt: skip
        n_cols = self._n_cols(shard)
        over = local > n_cols - starts  # never starts + local: two int64 near 2**63 wrap
        if bool(over.any()):
            need = max(a + b for a, b in zip(starts[over].tolist(), local[over].tolist()))  # Python ints: exact
            what = "spec.scoring.max_keys" if self.spec.scoring is not None else "shard.index_scores"
            raise ValueError(f"{what} has {n_cols} columns, but a token's keys reach column {need}")
        blocks_needed = (local + bs - 1) // bs
        if int(blocks_needed.max()) > M:
            raise ValueError(
                f"shard.block_table is too short: it has {M} columns, but a token's local length needs "
                f"{int(blocks_needed.max())} "
                f"blocks of block_size={bs} (was the shard built for another block_size or interleave than "
                f"shard.geometry says?)"
            )
        rows = shard.block_table[req].long()  # [T, M]
        j = torch.arange(M, device=rows.device)
        missing = (rows < 0) & (j[None, :] < blocks_needed[:, None])
        if bool(missing.any()):
            raise ValueError(
                "shard.block_table is missing a block of a token's local keys (an entry < 0 below its local length;"
                f" block_size={bs}, interleave={g.interleave}): a selected key would have no KV row"
            )
        if M and B:
            top = int(shard.block_table.max())
            if top >= 0:
                last_slot = (top + 1) * bs - 1
                if last_slot >= 2**31:
                    raise ValueError(f"shard.block_table holds block {top}: its slots exceed int32 (block_size={bs})")
                for name in ("kv_cache", "index_cache"):
                    cache = getattr(shard, name)
                    if cache is None or (name == "index_cache" and self.spec.scoring is None):
                        continue
                    rows_n = self._cache_slots(name, cache)
                    if last_slot >= rows_n:
                        raise ValueError(
                            f"shard.{name} has {rows_n} slots, but shard.block_table names block {top} (slots up to "
                            f"{last_slot}, block_size={bs})"
                        )

    def _scored_rows(self, shard: Any, index_q: Any, index_weights: Any) -> dict[str, Any]:
        """The guard's scoring rows (:mod:`dcp_ref.guard`): when the step scores, a token the scoring stage
        poisons (a block past the index cache, a mixed MTP group, a non-finite query) has NaN scores, which the
        indexer reads as masked keys — the guard poisons its output instead, so the row is never "no keys"."""
        sc = self.spec.scoring
        if sc is None:
            return {}
        blocks = self._cache_slots("index_cache", shard.index_cache) // self.spec.cache_geometry.block_size
        return dict(num_blocks=blocks, next_n=sc.next_n, index_q=index_q, index_weights=index_weights)

    def _cache_slots(self, name: str, cache: torch.Tensor) -> int:
        if name == "kv_cache":
            return _num_slots(cache)
        from .index_cache import index_cache_slots

        return index_cache_slots(cache, self.spec.cache_geometry.block_size, "shard.index_cache")

    # ------------------------------------------------------------------------------------------
    def run(
        self,
        q: torch.Tensor,
        shard: Any,
        meta: StepMetadata,
        *,
        index_q: torch.Tensor | None = None,
        index_weights: torch.Tensor | None = None,
        trace: dict | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the layer on this rank (collectives included).

        Args:
            q: ``[T, spec.query_heads, Dqk]`` in ``spec.dtype``, ``T <= spec.max_tokens``: all ``H`` heads (dcp with
                a replicated query), else this rank's ``H/W`` heads (heads ``[r*H/W, (r+1)*H/W)``).
            shard: this rank's :class:`RankShard` (``geometry`` = ``spec.cache_geometry``; ``index_scores``, or
                ``index_cache`` when the spec scores).
            meta: the step's :class:`StepMetadata` (the cache geometry's ownership).
            index_q: FP8 ``[T, 64, 128]`` index query (``spec.scoring``; replicated on every rank).
            index_weights: float32 ``[T, 64]`` index head weights (``spec.scoring``).
            trace: if a dict, receives a copy of every intermediate and ``impl`` (stage -> implementation, for the
                stages this run called, in order).
        Returns:
            ``(out [T, H/W, v], lse [T, H/W])`` (base e) for this rank's heads: views of the step's buffers, valid
            until the next run. ``T = 0`` gives empty results (no stage runs, no collective).
        """
        T = self._check_run(q, shard, meta, index_q, index_weights)
        if T == 0:
            return self._empty()
        p = self.parts
        q_full = p.query.run(q)
        cand = p.indexing.run(shard, meta, index_q, index_weights)
        sel = p.exchange.run(cand, shard, meta)
        partial, lse = p.attention.run(q_full, shard, meta, sel, self._n_cols(shard),
                                       self._scored_rows(shard, index_q, index_weights))  # fmt: skip
        out, lse_shard = p.combine.run(partial, lse)
        if trace is not None:
            self._trace(trace, q, q_full, meta, cand, sel, partial, lse)
        return out, lse_shard

    def _empty(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.spec
        empty = torch.empty((0, s.heads_per_rank, s.v_dim), dtype=self._partial_dtype, device=s.device)
        return empty, torch.empty((0, s.heads_per_rank), dtype=self._lse_dtype, device=s.device)

    def _trace(self, trace: dict, q: torch.Tensor, q_full: torch.Tensor, meta: StepMetadata, cand: Candidates,
               sel: Selection, partial: torch.Tensor, lse: torch.Tensor) -> None:  # fmt: skip
        """A copy of every intermediate of the run just made, and ``impl`` (stage -> implementation)."""
        T = partial.shape[0]  # a partial written with its heads in groups (the all-to-all's send buffer) as [T, H, v]
        trace.update(local_bounds=meta.local_bounds.clone(), packed=cand.packed.clone(), slots=sel.slots.clone(),
                     counts=sel.counts.clone(), partial_out=partial.reshape(T, -1, partial.shape[-1]).clone(),
                     partial_lse=lse.reshape(T, -1).clone(), impl=dict(self.impls))  # fmt: skip
        if sel.ids is not None:
            trace["global_ids"] = sel.ids.clone()
        if cand.own_ids is not None:
            trace["own_ids"] = cand.own_ids.clone()
        if self.spec.scoring is not None:
            trace["scores"] = cand.scores.clone()
        if q_full is not q:  # a query read with its heads in groups ([T, W, H/W, D]) as [T, H, D]
            trace["q_full"] = q_full.reshape(q_full.shape[0], -1, q_full.shape[-1]).clone()

    def capture(
        self,
        q: torch.Tensor,
        shard: Any,
        meta: StepMetadata,
        *,
        index_q: torch.Tensor | None = None,
        index_weights: torch.Tensor | None = None,
        warmup: int = 1,
    ) -> CapturedStep:
        """Capture one whole run (collectives included) in a CUDA graph.

        The graph reads ``q``, ``index_q``, ``index_weights``, ``shard``'s tensors and ``meta``'s tensors at their
        current addresses: update them in place (``copy_``) and call :meth:`CapturedStep.replay`. NCCL
        collectives can be captured once the process group has run one collective (the warm-up run does that).
        """
        # The batch first: an empty one is refused by name on any device (the CPU tests reach this check).
        if isinstance(q, torch.Tensor) and q.ndim == 3 and q.shape[0] == 0:
            raise ValueError("q has T = 0 query tokens: an empty batch has nothing to capture (run() returns it)")
        # StepSpec.__post_init__ stores a torch.device; the field's type also admits the str callers pass.
        if torch.device(self.spec.device).type != "cuda":
            raise ValueError(f"capture needs a CUDA step, this one is planned for {self.spec.device}")
        if self.validate:
            raise ValueError("capture needs validate=False (value checks read tensors on the host)")
        side = torch.cuda.Stream(self.spec.device)
        side.wait_stream(torch.cuda.current_stream(self.spec.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.run(q, shard, meta, index_q=index_q, index_weights=index_weights)
        torch.cuda.current_stream(self.spec.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = self.run(q, shard, meta, index_q=index_q, index_weights=index_weights)
        return CapturedStep(graph, out, lse)


@dataclass
class CapturedStep:
    """A captured :class:`PlannedStep` run: ``replay()`` recomputes ``out`` / ``lse`` from the captured inputs."""

    graph: Any
    out: torch.Tensor
    lse: torch.Tensor

    def replay(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.graph.replay()
        return self.out, self.lse


def plan_for(
    group: Group,
    q: torch.Tensor,
    shard: Any,
    topk: int,
    sm_scale: float,
    *,
    v_dim: int | None = None,
    stages: Stages | str = "reference",
    validate: bool = True,
    max_tokens: int | None = None,
) -> PlannedStep:
    """Plan a step sized for these inputs (``q [T, H, D]``, ``shard``) — the convenience path of
    :func:`dcp_ref.pipeline.dcp_decode_step`; ``max_tokens`` defaults to ``T``. The cache's format
    (native or FP8, :func:`dcp_ref.stages.kv_format_of`) picks the attention (FP8: ``v_dim`` 512, masked)."""
    check_tensor(q, "q", ndim=3)
    geometry = getattr(shard, "geometry", None)
    if not isinstance(geometry, DcpGeometry):
        raise ValueError("shard.geometry must be a DcpGeometry (the geometry the shard was built for)")
    T, H, D = q.shape
    kv_format = kv_format_of(shard.kv_cache)
    if v_dim is not None:
        v = v_dim
    elif kv_format == "fp8_ds_mla":
        v = FP8_DS_MLA.nope_dim  # the FP8 layout's values are its NoPE dims (512)
    else:
        v = D
    spec = StepSpec(
        geometry,
        max_tokens=max_tokens or max(T, 1),
        topk=topk,
        num_heads=H,
        head_dim=D,
        v_dim=v,
        sm_scale=sm_scale,
        dtype=q.dtype,
        device=q.device,
        kv_format=kv_format,
    )
    return PlannedStep(group, spec, stages, validate=validate)
