"""The stage protocol: what each stage of one decode layer takes and returns.

One layer on rank ``r`` of ``W`` (names, not numbers; which stages run depends on the
:class:`StepSpec`: its ``layout``, ``exchange``, ``combine``, and whether the step scores the index
keys itself)::

    ownership    global lengths -> this rank's local causal bound per query token      (the step's metadata)
    -- query gather: all-gather q over heads, [T, H/W, D] -> [T, H, D]  (dcp, unless the query is replicated)
    scoring      FP8 index query x this rank's FP8 index keys -> index scores [T, L]    (or precomputed scores)
    indexer      local stable top-K of the scores -> candidates
    -- all-gather of the candidates (W > 1)
    exchange "allgather":  select (stable global top-k ids) then deinterleave (ids -> this rank's slots)
    exchange "owner":      select_to_slots (the gathered candidates -> this rank's winners' slots, one stage)
    attention    sparse MLA over (slots, counts): partial output + LSE (base e, -inf when empty)
    guard        tokens whose metadata is out of contract -> NaN output and LSE (:mod:`dcp_ref.guard`)
    combine "reduce_scatter": all-gather LSEs, merge (correct this rank's partial), reduce-scatter over heads
    combine "alltoall":       partials of rank j's heads + their LSEs to rank j, combine the W partials

The ``"tp"`` layout is the same machinery with the whole context on every rank and ``H/W`` heads:
no query gather, no exchange across ranks (``W = 1`` for the cache), no combine.

A :class:`Stages` value names one implementation per stage. :data:`REFERENCE_STAGES` is the
plain-PyTorch reference (this module, built on the oracle functions of :mod:`dcp_ref`); the GPU
kernels register theirs in :mod:`dcp_ref.kernels.stages` (``dcp_ref`` never imports kernels: a
caller hands the step the ``Stages`` it wants). Replace any stage with your own callable::

    mine = REFERENCE_STAGES.with_(select=my_select)        # a function with select's signature
    step = PlannedStep(group, spec, mine)                  # dcp_ref.step

Every stage accepts caller-provided output buffers (``out=`` ...) and must write its result
there when given, so that the planned step allocates nothing while it runs. Each stage's
contract (shapes, dtypes, what an empty row produces) is in its ``Protocol`` below; the
conformance kit :mod:`dcp_ref.testing` checks an implementation against it.

**Out-of-contract metadata** (a ``validate=False`` run): the guard stage poisons the affected tokens
(NaN output and LSE on every rank), so no stage needs to raise on the device; stages that meet such a
row themselves clamp their reads and, where they can tell (a request id outside the block table, a
selected key without a block), emit the poison slot ``2**31 - 1``, which the attention turns into NaN.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from ._checks import (
    FLOAT_DTYPES,
    check_choice,
    check_device,
    check_int_scalar,
    check_no_alias,
    check_no_aliases,
    check_tensor,
)
from .attention import check_sm_scale, sparse_mla_attention
from .deinterleave import deinterleave_and_compact
from .geometry import DcpGeometry
from .index_cache import INDEX_K_FP8
from .indexer import local_topk
from .lse import correct_partial, merge_partials
from .topk import pack_candidates, stable_topk

__all__ = [
    "STAGE_NAMES",
    "StageInfo",
    "STAGE_MAP",
    "AWAITING_DEVICE",
    "ATTENTION_LAYOUTS",
    "LAYOUTS",
    "EXCHANGES",
    "ORDERS",
    "COMBINES",
    "ScoringSpec",
    "StepSpec",
    "Stages",
    "REFERENCE_STAGES",
    "IndexerStage",
    "SelectStage",
    "DeinterleaveStage",
    "AttentionStage",
    "MergeStage",
    "ScoringStage",
    "SelectToSlotsStage",
    "GuardStage",
    "CombineStage",
    "reference_scoring",
    "reference_indexer",
    "reference_select",
    "reference_deinterleave",
    "reference_attention",
    "reference_merge",
    "reference_select_to_slots",
    "reference_guard",
    "reference_combine",
    "compose_indexer",
    "impl_name",
    "write_into",
    "write_outs",
    "STAGE_PROVIDERS",
    "register_stages",
    "resolve_stages",
    "KV_FORMATS",
    "kv_format_of",
    "reference_attention_fp8",
    "FP8_REFERENCE_STAGES",
]

#: The stages a :class:`Stages` value implements, in step order (a run uses the ones its spec needs).
STAGE_NAMES = (
    "scoring",
    "indexer",
    "select",
    "deinterleave",
    "select_to_slots",
    "attention",
    "guard",
    "merge",
    "combine",
)
#: ``"dcp"``: the KV cache (and the FP8 index keys) sharded by token over the W ranks, every head on every
#: rank. ``"tp"``: tensor parallelism, the layout DCP is compared with: every rank holds the whole context and
#: ``H/W`` heads (no collective inside attention).
LAYOUTS = ("dcp", "tp")
#: How the candidates are exchanged and selected: ``"allgather"`` (every rank selects the whole global top-k,
#: then maps the ids it owns to slots: select + deinterleave) or ``"owner"`` (one select_to_slots stage emits
#: only this rank's winners' slots).
EXCHANGES = ("allgather", "owner")
#: Total orders of the global selection, both exact (:mod:`dcp_ref.select_to_slots`): ``"global_id"`` (score
#: descending, then lower global id: vLLM's; candidates travel as (score, id) pairs, 8 bytes) and
#: ``"rank_local"`` (score descending, then lower rank, then lower local index; scores only, 4 bytes).
ORDERS = ("global_id", "rank_local")
#: How partial outputs become this rank's ``H/W`` heads: ``"reduce_scatter"`` (all-gather the LSEs, correct,
#: reduce-scatter: two collectives) or ``"alltoall"`` (one all-to-all of partials + LSEs, then a merge of W
#: partials over ``H/W`` heads).
COMBINES = ("reduce_scatter", "alltoall")
#: ``"compact"``: attention reads ``slots[t, :counts[t]]`` (valid slots compacted to the front).
#: ``"masked"``: attention reads every entry of ``slots[t]`` and skips ``-1`` itself (FlashMLA's FP8
#: decode); the deinterleave stage then need not compact, but must still give ``-1`` for others' keys.
ATTENTION_LAYOUTS = ("compact", "masked")
#: KV cache formats a step can run on: ``"native"`` (float rows ``[S, Dqk]``, e.g. bf16) and ``"fp8_ds_mla"``
#: (DeepSeek V3.2 / FlashMLA's FP8 rows, 656 bytes per token: :mod:`dcp_ref.fp8_cache`).
KV_FORMATS = ("native", "fp8_ds_mla")


@dataclass(frozen=True)
class StageInfo:
    """Where one stage lives: its reference, its kernels, the chapter that teaches it, the benchmark that times it.

    Attributes:
        stage: the stage's name (a :class:`Stages` field, or a step-level stage: ``ownership``, ``query_gather``).
        what: one line: what the stage does.
        reference: ``"module:function"`` of the plain-PyTorch reference (the oracle).
        kernels: modules of :mod:`dcp_ref.kernels` implementing it (``()``: a collective or host-side stage).
        chapter: the notebook stem that teaches it (``notebooks/<chapter>.ipynb``).
        benchmark: the script that times it (``benchmarks/<benchmark>``), or ``""``.
        results: the results file it writes (``benchmarks/results/<results>``), or ``""``; listed in
            :data:`AWAITING_DEVICE` while it has not been run on the H200 yet.
    """

    stage: str
    what: str
    reference: str
    kernels: tuple[str, ...]
    chapter: str
    benchmark: str
    results: str


#: Results files whose benchmark exists but has not run on the H200 yet (the session that wrote it ran out of
#: device time): a stage pointing at one of these has no measurement to show.
AWAITING_DEVICE: tuple[str, ...] = ()

#: One table of stages, in step order: the single source for the README's stage table, chapter 00's, the API
#: page and CONTRIBUTING (``tests/test_stage_map.py`` checks that they agree with it).
STAGE_MAP: tuple[StageInfo, ...] = (
    StageInfo("ownership", "global lengths -> this rank's local bound per query token (expand first, localize after)",
              "dcp_ref.step:decode_metadata", (), "01_ownership", "", ""),
    StageInfo("query_gather", "q arrives as this rank's H/W heads; all-gathered over heads (or replicated)",
              "dcp_ref.step:PlannedStep", (), "07_end_to_end", "bench_layer.py", "layer.json"),
    StageInfo("scoring", "FP8 index query x this rank's FP8 index keys -> index scores [T, L]",
              "dcp_ref.scoring:index_scores", ("scoring_triton",), "02_indexer", "bench_scoring.py", "scoring.json"),
    StageInfo("indexer", "local stable top-K of the scores, packed as (score, global id), or scores + local ids",
              "dcp_ref.indexer:local_topk", ("indexer_triton", "pack_triton"), "02_indexer", "bench_local_topk.py",
              "local_topk.json"),
    StageInfo("select", "stable global top-k of the all-gathered candidates (score desc, then lower id)",
              "dcp_ref.topk:stable_topk", ("topk_cutedsl",), "03_stable_topk_cutedsl", "bench_topk.py", "topk.json"),
    StageInfo("deinterleave", "chosen global ids -> this rank's KV slots through its block table, compacted",
              "dcp_ref.deinterleave:deinterleave_and_compact", ("deinterleave_triton",), "04_triton_deinterleave",
              "bench_deinterleave.py", "deinterleave.json"),
    StageInfo("select_to_slots", "owner-local selection: gathered candidates -> this rank's winners' slots",
              "dcp_ref.select_to_slots:select_to_slots", ("select_to_slots_cutedsl",), "03_stable_topk_cutedsl",
              "bench_exchange.py", "exchange.json"),
    StageInfo("attention", "sparse MLA over (slots, counts) -> partial output + LSE (base e, -inf when empty)",
              "dcp_ref.attention:sparse_mla_attention",
              ("flashmla_sparse", "attention_splitkv_triton", "flashinfer_mla", "flashmla_fp8"), "06_lse_base2_to_e",
              "bench_attention.py", "attention.json"),
    StageInfo("guard", "tokens whose metadata is out of contract -> NaN output and LSE",
              "dcp_ref.guard:reference_guard", ("guard_triton",), "07_end_to_end", "bench_layer.py", "layer.json"),
    StageInfo("merge", "this rank's partial corrected by the all-gathered LSEs, then reduce-scattered over heads",
              "dcp_ref.lse:correct_partial", ("lse_merge_triton",), "06_lse_base2_to_e", "bench_lse_merge.py",
              "lse_merge.json"),
    StageInfo("combine", "after one all-to-all: the W partials of this rank's H/W heads merged by their LSEs",
              "dcp_ref.lse:merge_partials", ("lse_merge_triton",), "06_lse_base2_to_e", "bench_exchange.py",
              "exchange.json"),
)  # fmt: skip


def kv_format_of(kv_cache: torch.Tensor) -> str:
    """``"fp8_ds_mla"`` for a uint8 / float8_e4m3fn cache whose rows are 656 bytes, else ``"native"``."""
    from .fp8_cache import FP8_DS_MLA

    fp8_dtypes = (torch.uint8, getattr(torch, "float8_e4m3fn", torch.uint8))
    if kv_cache.dtype in fp8_dtypes and kv_cache.shape[-1] == FP8_DS_MLA.bytes_per_token:
        return "fp8_ds_mla"
    return "native"


@dataclass(frozen=True)
class ScoringSpec:
    """How a step computes its index scores from FP8 index keys (the scoring stage), when it does.

    Attributes:
        max_keys: ``L``, the columns of the planned score buffer: the most local keys a query token may have
            on this rank (dcp: about ``context / W``; tp: the whole context). A token whose bound exceeds it is
            out of contract (poisoned, or refused with ``validate=True``).
        index_heads: index heads of the lightning indexer (64 for DeepSeek V3.2).
        index_dim: dims per index head: 128, the index-key cache's (``dcp_ref.index_cache.INDEX_K_FP8``), the
            only width the scoring stage reads (refused here otherwise, naming this field, not at the first run).
        next_n: query tokens per request in decode (MTP / speculative: the draft tokens with the last one), laid
            out as the ownership stage does (consecutive tokens of one request): the scoring stage then reads each
            key once for a request's tokens. A run whose groups of ``next_n`` tokens name two requests is out of
            contract (poisoned, or refused with ``validate=True``).
    """

    max_keys: int
    _: KW_ONLY
    index_heads: int = 64
    index_dim: int = 128
    next_n: int = 1

    def __post_init__(self) -> None:
        for name in ("max_keys", "index_heads", "index_dim", "next_n"):
            object.__setattr__(self, name, check_int_scalar(getattr(self, name), name, min_value=1))
        if self.index_dim != INDEX_K_FP8.head_dim:
            raise ValueError(
                f"index_dim must be {INDEX_K_FP8.head_dim}: the scoring stage reads the index-key cache's layout "
                f"(dcp_ref.index_cache.INDEX_K_FP8, {INDEX_K_FP8.head_dim} e4m3 values per key), got {self.index_dim}"
            )


@dataclass(frozen=True)
class StepSpec:
    """Everything a step is planned for: fixed for the life of a :class:`dcp_ref.step.PlannedStep`.

    Every field after ``geometry`` is keyword-only.

    Attributes:
        geometry: this rank's :class:`~dcp_ref.geometry.DcpGeometry` in its group of ``W`` ranks (``"tp"``: the
            group's; the cache itself is then unsharded, see :attr:`cache_geometry`).
        max_tokens: the largest number of query tokens ``T`` a run may have (buffers are this big).
        topk: ``k``, the global top-k (also the per-rank candidate count ``K``: exactness needs
            ``K = k``, since all winners may live on one rank).
        num_heads: ``H``, the model's query heads (dcp: every rank attends with all ``H``; both layouts end
            with ``H/W`` per rank).
        head_dim: ``Dqk`` (576 for DeepSeek: 512 latent + 64 RoPE).
        v_dim: value width (512 for DeepSeek).
        sm_scale: the softmax scale (a layer constant), finite and > 0.
        dtype: query / KV dtype.
        device: where everything lives (``"cuda"`` is pinned to the current device).
        layout: ``"dcp"`` or ``"tp"`` (:data:`LAYOUTS`).
        exchange: ``"allgather"`` or ``"owner"`` (:data:`EXCHANGES`).
        order: ``"global_id"`` or ``"rank_local"`` (:data:`ORDERS`; ``"rank_local"`` needs ``exchange="owner"``).
        combine: ``"reduce_scatter"`` or ``"alltoall"`` (:data:`COMBINES`).
        q_replicate: dcp only. ``True``: the caller passes all ``H`` query heads (the query projection is
            replicated on every rank: more weight memory, no collective). ``False``: ``q`` arrives as this
            rank's ``H/W`` heads (the TP layout DCP runs in) and the step all-gathers it over heads.
        scoring: a :class:`ScoringSpec` when the step scores FP8 index keys itself (the layer's inputs:
            ``index_q``, ``index_weights`` and ``shard.index_cache``); ``None``: the shard carries precomputed
            ``index_scores`` (the chapters that teach the indexer).
    """

    geometry: DcpGeometry
    _: KW_ONLY
    max_tokens: int
    topk: int
    num_heads: int
    head_dim: int
    v_dim: int
    sm_scale: float
    dtype: torch.dtype
    device: torch.device | str
    layout: str = "dcp"
    exchange: str = "allgather"
    order: str = "global_id"
    combine: str = "reduce_scatter"
    q_replicate: bool = True
    scoring: ScoringSpec | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.geometry, DcpGeometry):
            raise TypeError(f"geometry must be a DcpGeometry, got {type(self.geometry).__name__}")
        for name, lo in (("max_tokens", 1), ("topk", 1), ("num_heads", 1), ("head_dim", 1), ("v_dim", 1)):
            object.__setattr__(self, name, check_int_scalar(getattr(self, name), name, min_value=lo))
        if self.v_dim > self.head_dim:
            raise ValueError(f"v_dim must be <= head_dim={self.head_dim}, got {self.v_dim}")
        if self.num_heads % self.geometry.world_size:
            raise ValueError(
                f"num_heads (H={self.num_heads}) must be divisible by the world size W={self.geometry.world_size}: "
                "each rank ends with H/W heads"
            )
        object.__setattr__(self, "sm_scale", check_sm_scale(self.sm_scale))  # numpy floats are floats
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(self.dtype).__name__}")
        if self.dtype not in FLOAT_DTYPES:  # the query's and the bf16 cache's dtype: what attention computes in
            allowed = ", ".join(str(d).replace("torch.", "") for d in FLOAT_DTYPES)
            raise TypeError(f"dtype must be one of ({allowed}), got {str(self.dtype).replace('torch.', '')}")
        dev = check_device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device must be one this machine has: {self.device!r}, but CUDA is not available")
        if dev.type == "cuda" and dev.index is None:  # "cuda" means the current device: pin it (tensors say cuda:N)
            dev = torch.device("cuda", torch.cuda.current_device())
        object.__setattr__(self, "device", dev)
        check_choice(self.layout, "layout", LAYOUTS)
        check_choice(self.exchange, "exchange", EXCHANGES)
        check_choice(self.order, "order", ORDERS)
        check_choice(self.combine, "combine", COMBINES)
        if self.order == "rank_local" and self.exchange != "owner":
            raise ValueError(
                "order='rank_local' needs exchange='owner' (ids do not travel, so only owners can map them)"
            )
        if not isinstance(self.q_replicate, bool):
            raise TypeError(f"q_replicate must be a bool, got {type(self.q_replicate).__name__}")
        if self.scoring is not None and not isinstance(self.scoring, ScoringSpec):
            raise TypeError(f"scoring must be a ScoringSpec or None, got {type(self.scoring).__name__}")
        if self.scoring is not None and self.scoring.next_n > self.max_tokens:
            raise ValueError(
                f"scoring.next_n={self.scoring.next_n} must be <= max_tokens={self.max_tokens}: a run's T is a "
                "multiple of next_n (groups of one request's tokens), so no run but an empty one could fit"
            )

    @property
    def heads_per_rank(self) -> int:
        """``H/W``: the heads each rank ends with (both layouts)."""
        return self.num_heads // self.geometry.world_size

    @property
    def cache_geometry(self) -> DcpGeometry:
        """The geometry the KV cache and index keys are sharded by: dcp, :attr:`geometry`; tp, one rank (unsharded)."""
        g = self.geometry
        return g if self.layout == "dcp" else DcpGeometry(1, 0, g.interleave, g.block_size)

    @property
    def attention_heads(self) -> int:
        """Heads the attention stage runs on this rank: ``H`` (dcp) or ``H/W`` (tp)."""
        return self.num_heads if self.layout == "dcp" else self.heads_per_rank

    @property
    def query_heads(self) -> int:
        """Heads of the ``q`` a run takes: ``H`` (dcp, replicated query), else ``H/W``."""
        return self.num_heads if self.layout == "dcp" and self.q_replicate else self.heads_per_rank


# ---- the protocols: one per stage ------------------------------------------------------------------
class IndexerStage(Protocol):
    def __call__(
        self,
        scores: torch.Tensor,
        lengths: torch.Tensor,
        geometry: DcpGeometry,
        k: int,
        *,
        row_starts: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Local stable top-``k`` of each row, packed for the all-gather.

        With ``order="rank_local"`` (passed only then, as a keyword, together with ``out_ids``) the stage
        returns ``(scores float32 [T, k], ids int32 [T, k])`` instead: the row's top-k scores in ascending
        *local index* order, NaN padding, and their local indices (``-1`` padding) — the scores travel, the
        ids stay on this rank (:data:`ORDERS`).

        Args:
            scores: float32 ``[T, L]`` this rank's index scores (column = local index; columns at or past
                ``lengths[t]`` are garbage and must not be read as candidates).
            lengths: int32/int64 ``[T]`` local causal bound of each row (``0`` = empty row).
            geometry: this rank's geometry (local index -> global id).
            k: candidates per row, ``k >= 1``.
            row_starts: optional int ``[T]``: row ``t``'s local key ``j`` is column ``row_starts[t] + j``.
            out: optional float32 ``[T, k, 2]`` buffer.
        Returns:
            float32 ``[T, k, 2]``: ``(score, global id)`` of the row's top-k by score descending, then lower
            id; the order within the row is free (a set); rows with fewer than ``k`` valid keys are padded
            with invalid candidates exactly as :func:`dcp_ref.topk.pack_candidates` pads ``-1``.
        """
        ...


class SelectStage(Protocol):
    def __call__(self, gathered: torch.Tensor, k: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Stable global top-``k`` of the all-gathered candidates.

        Args:
            gathered: float32 ``[W, T, K, 2]`` (rank order).  k: ``k >= 1``.  out: optional int32 ``[T, k]``.
        Returns:
            int32 ``[T, k]``: the winners' global ids, valid ones first in any order (a set), ``-1`` after.
        """
        ...


class DeinterleaveStage(Protocol):
    def __call__(
        self,
        global_ids: torch.Tensor,
        req_of_token: torch.Tensor,
        block_table: torch.Tensor,
        geometry: DcpGeometry,
        *,
        compact: bool = True,
        out_slots: torch.Tensor | None = None,
        out_counts: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Global ids -> this rank's physical KV slots through the block table.

        Args:
            global_ids: int32 ``[T, k]`` (``-1`` = none).  req_of_token: int32 ``[T]`` request of each row.
            block_table: int32 ``[B, M]`` physical block of each request's local block (``-1`` past the end).
            geometry: this rank's geometry.
            compact: ``True``: valid slots first (any order), ``-1`` after, ``counts`` = valid per row.
                ``False`` (masked layout): ``slots[t, j]`` is the slot of ``global_ids[t, j]`` or ``-1``.
            out_slots: optional int32 ``[T, k]``.  out_counts: optional int32 ``[T]``.
        Returns:
            ``(slots int32 [T, k], counts int32 [T])``. Never drops or duplicates a slot.
        """
        ...


class AttentionStage(Protocol):
    def __call__(
        self,
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
        """Sparse MLA of every head over this rank's chosen slots.

        Args:
            q: ``[T, H, Dqk]``.  kv_cache: ``[S, Dqk]`` (values: the first ``v_dim`` columns).
            slots, counts: from the deinterleave stage (layout per ``Stages.attention_layout``).
            out: optional ``[T, H, v_dim]``.  out_lse: optional float32 ``[T, H]``.
        Returns:
            ``(out [T, H, v_dim], lse float32 [T, H])``: the LSE in base e; a row with ``counts[t] == 0``
            gives ``out = 0`` and ``lse = -inf`` (each kernel's own convention — base 2, ``+inf`` — is
            normalised by its stage). NaN from real data propagates.
        """
        ...


class MergeStage(Protocol):
    def __call__(
        self,
        partial: torch.Tensor,
        all_lse: torch.Tensor,
        rank: int,
        *,
        out: torch.Tensor | None = None,
        out_lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the LSE merge (the reduce-scatter over ranks finishes it).

        Args:
            partial: ``[T, H, v]`` this rank's partial output.  all_lse: float32 ``[W, T, H]`` base e.
            rank: this rank.  out: optional ``[T, H, v]`` (may be ``partial``).  out_lse: optional float32 ``[T, H]``.
        Returns:
            ``(corrected [T, H, v], merged_lse float32 [T, H])``: ``partial * exp(lse_rank - merged)``; a
            rank with ``lse = -inf`` contributes exactly 0; NaN propagates.
        """
        ...


class ScoringStage(Protocol):
    def __call__(
        self,
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
        """The lightning indexer's scores of this rank's keys (:mod:`dcp_ref.scoring`).

        Args:
            index_q: ``[T, Hi, Di]`` FP8 (e4m3) index query (64 x 128 for DeepSeek V3.2).
            weights: float32 ``[T, Hi]`` per-head weights (the query's scale folded in).
            index_cache: this rank's FP8 index-key cache, paged with ``block_table`` (layout: :mod:`dcp_ref.scoring`).
            block_table: int ``[B, M]``.  req_of_token: int ``[T]``.  local_bounds: int ``[T]``.
            geometry: the cache's geometry.  row_starts: optional int ``[T]`` (prefill).
            out: optional float32 ``[T, L]``.  next_n: MTP — the query tokens come in consecutive groups of
                ``next_n`` tokens of one request (a group naming two requests is poisoned whole).
        Returns:
            float32 ``[T, L]``: ``sum_h w[t,h] * relu(q[t,h] . k[j]) * scale[j]`` at column ``row_starts[t] + j``
            for ``j < local_bounds[t]``, ``-inf`` elsewhere.
        """
        ...


class SelectToSlotsStage(Protocol):
    def __call__(
        self,
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
        """This rank's winners of the global top-``k``, straight to its KV slots (:mod:`dcp_ref.select_to_slots`).

        Args:
            gathered: ``order="global_id"``: float32 ``[W, T, K, 2]`` (score, global id); ``"rank_local"``:
                float32 ``[W, T, K]`` scores (NaN = none), each rank's in ascending local-index order.
            own_ids: ``"rank_local"``: int32 ``[T, K]`` local indices of this rank's own candidates; else ``None``.
            req_of_token, block_table, geometry: as the deinterleave stage.  k: the global top-k.
            out_slots: optional int32 ``[T, k]``.  out_counts: optional int32 ``[T]``.
        Returns:
            ``(slots int32 [T, k], counts int32 [T])``: this rank's winners' slots first, ``-1`` after. Over
            all ranks, exactly the global top-k of ``order`` — no slot dropped or duplicated.
        """
        ...


class GuardStage(Protocol):
    def __call__(
        self,
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
        """Poison, in place, the tokens whose metadata is out of contract (:mod:`dcp_ref.guard`). A scoring step
        also passes the scoring stage's row rule: ``num_blocks`` (the index cache's blocks), ``next_n`` (MTP
        groups of one request) and the index query ``index_q`` / ``index_weights`` (non-finite poisons)."""
        ...


class CombineStage(Protocol):
    def __call__(
        self,
        outs: torch.Tensor,
        lses: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
        out_lse: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge the ``W`` partials of this rank's heads (after the all-to-all).

        Args:
            outs: ``[W, T, H/W, v]`` (any strides): rank ``w``'s partial output for this rank's heads.
            lses: ``[W, T, H/W]`` base e (any strides).  out: optional ``[T, H/W, v]``.  out_lse: optional ``[T, H/W]``.
        Returns:
            ``(out [T, H/W, v], lse [T, H/W])``: the LSE-weighted merge; an empty rank (``lse = -inf``) adds
            exactly 0; a NaN or ``+inf`` LSE is corrupt and gives NaN.
        """
        ...


# ---- helpers ---------------------------------------------------------------------------------------
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
def reference_merge(
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


def compose_indexer(
    select_local: Callable[..., torch.Tensor], pack: Callable[..., torch.Tensor], name: str | None = None
) -> IndexerStage:
    """An indexer stage from a local top-K and a pack, each with the reference's signature.

    ``select_local(scores, k, lengths, row_starts) -> int [T, k]`` local indices (``-1`` padded), as
    :func:`dcp_ref.indexer.local_topk`; ``pack(scores, ids, geometry, row_starts, out=)``
    as :func:`dcp_ref.topk.pack_candidates` (``out`` may be ignored: the result is copied in).
    """
    label = name or f"{impl_name(select_local)}+{impl_name(pack)}"

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
        try:
            packed = pack(scores, ids, geometry, row_starts, out=out)
        except TypeError:  # a pack without out=
            packed = pack(scores, ids, geometry, row_starts)
        if out is None or packed is out:
            return packed
        return write_into(packed, out, dtypes=_F32, scores=scores, lengths=lengths, row_starts=row_starts)

    return indexer


@dataclass(frozen=True)
class Stages:
    """One implementation per stage (see the module docstring and each stage's ``Protocol``).

    Attributes:
        scoring, indexer, select, deinterleave, select_to_slots, attention, guard, merge, combine:
            the stage callables (:data:`STAGE_NAMES`); a step calls the ones its :class:`StepSpec` needs.
        attention_layout: ``"compact"`` or ``"masked"`` (see :data:`ATTENTION_LAYOUTS`): what the
            attention stage reads, hence whether the step asks the deinterleave stage to compact.
        partial_dtype: the dtype of the attention stage's output buffer for a query dtype (a kernel
            writes bf16 for bf16 queries; the reference keeps the query dtype).
        prepare: optional hook ``prepare(spec)`` run once at plan time (compile and warm kernels, choose a
            kernel per shape); the step calls it under :data:`dcp_ref.step.PLAN_LOCK` (CuTeDSL compilation is
            not thread-safe). It may return a :class:`Stages` to plan with instead (e.g. the faster attention
            for this shape), or ``None``.
        name: a label for the set.
        notes: why each stage runs what it runs (e.g. a kernel's fallback reason), for the trace.

    Every stage field is checked when the value is built (a callable); :meth:`with_` checks the rest.
    """

    scoring: ScoringStage = reference_scoring
    indexer: IndexerStage = reference_indexer
    select: SelectStage = reference_select
    deinterleave: DeinterleaveStage = reference_deinterleave
    select_to_slots: SelectToSlotsStage = reference_select_to_slots
    attention: AttentionStage = reference_attention
    guard: GuardStage = reference_guard
    merge: MergeStage = reference_merge
    combine: CombineStage = reference_combine
    attention_layout: str = "compact"
    partial_dtype: Callable[[torch.dtype], torch.dtype] = field(default=lambda d: d)
    prepare: Callable[[StepSpec], Stages | None] | None = None
    name: str = "reference"
    notes: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for stage in STAGE_NAMES:
            if not callable(getattr(self, stage)):
                raise TypeError(f"{stage} must be callable, got {type(getattr(self, stage)).__name__}")
        if self.attention_layout not in ATTENTION_LAYOUTS:
            raise ValueError(f"attention_layout must be one of {ATTENTION_LAYOUTS}, got {self.attention_layout!r}")
        if not callable(self.partial_dtype):
            raise TypeError(f"partial_dtype must be callable, got {type(self.partial_dtype).__name__}")
        if self.prepare is not None and not callable(self.prepare):
            raise TypeError(f"prepare must be callable or None, got {type(self.prepare).__name__}")
        if not isinstance(self.name, str):
            raise TypeError(f"name must be a str, got {type(self.name).__name__}")
        if not isinstance(self.notes, tuple) or not all(
            isinstance(n, tuple) and len(n) == 2 and all(isinstance(x, str) for x in n) for n in self.notes
        ):
            raise TypeError("notes must be a tuple of (stage, reason) string pairs")

    def with_(self, **stages: Any) -> Stages:
        """A copy with some stages (or ``attention_layout``, ``partial_dtype``, ``prepare``, ``name``) replaced.

        Every value is checked here, when the copy is built (a stage that is not callable, an unknown
        layout), not when the step first calls it."""
        unknown = set(stages) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown stage(s) {sorted(unknown)}; stages are {STAGE_NAMES}")
        if "name" not in stages and set(stages) & set(STAGE_NAMES):
            stages["name"] = f"{self.name}+custom"
        return dataclasses.replace(self, **stages)

    def impls(self, names: tuple[str, ...] = STAGE_NAMES) -> dict[str, str]:
        """``{stage: implementation name}`` for ``names`` (default: every stage), in step order."""
        return {stage: impl_name(getattr(self, stage)) for stage in names}


#: The plain-PyTorch reference of every stage (float64 attention over a native-format cache).
REFERENCE_STAGES = Stages()
#: The reference over an FP8 (``fp8_ds_mla``) cache: the attention dequantizes exactly as FlashMLA's FP8
#: decode and reads the uncompacted slots (``attention_layout="masked"``), so no compaction runs.
FP8_REFERENCE_STAGES = Stages(attention=reference_attention_fp8, attention_layout="masked", name="reference-fp8")


#: Named sets of stages that live outside :mod:`dcp_ref` (it never imports them itself): name ->
#: ``"module:factory"``, loaded on first use. A factory takes ``(device, dtype, head_dim, v_dim, *, num_heads, topk,
#: kv_format)`` and
#: returns a :class:`Stages`. :mod:`dcp_ref.kernels.stages` provides ``"kernels"``; register your own
#: with :func:`register_stages`.
STAGE_PROVIDERS: dict[str, str] = {"kernels": "dcp_ref.kernels.stages:kernel_stages"}


def register_stages(name: str, factory: str | Callable[..., Stages]) -> None:
    """Make ``resolve_stages(name, ...)`` build stages with ``factory`` (a callable or ``"module:function"``)."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    if name == "reference":
        raise ValueError("name 'reference' is reserved for REFERENCE_STAGES")
    _FACTORIES.pop(name, None)
    if callable(factory):
        _FACTORIES[name] = factory
        STAGE_PROVIDERS[name] = f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', '?')}"
    elif isinstance(factory, str) and ":" in factory:
        STAGE_PROVIDERS[name] = factory
    else:
        raise TypeError(f"factory must be a callable or 'module:function', got {factory!r}")


_FACTORIES: dict[str, Callable[..., Stages]] = {}


def resolve_stages(
    stages: Stages | str,
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int,
    v_dim: int,
    *,
    num_heads: int | None = None,
    topk: int | None = None,
    kv_format: str = "native",
) -> Stages:
    """The :class:`Stages` that ``stages`` names for these tensors.

    ``stages``: a :class:`Stages` (returned as is), ``"reference"``, or a name in :data:`STAGE_PROVIDERS`
    (e.g. ``"kernels"``: each stage on its kernel where it can run on ``device``, the reference otherwise,
    with the reason logged once and kept in ``Stages.notes``). A provider's factory is called as
    ``factory(device, dtype, head_dim, v_dim, num_heads=..., topk=..., kv_format=...)`` (the first two
    hints may be ``None``); ``kv_format`` is one of :data:`KV_FORMATS` (see :func:`kv_format_of`).
    """
    if kv_format not in KV_FORMATS:
        raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
    if isinstance(stages, Stages):
        return stages
    if not isinstance(stages, str):
        raise TypeError(f"stages must be a Stages value or a name, got {type(stages).__name__}")
    if stages == "reference":
        return FP8_REFERENCE_STAGES if kv_format == "fp8_ds_mla" else REFERENCE_STAGES
    if stages not in STAGE_PROVIDERS:
        raise ValueError(
            f"stages must be 'reference', one of {sorted(STAGE_PROVIDERS)} or a Stages value, got {stages!r}"
        )
    factory = _FACTORIES.get(stages)
    if factory is None:
        import importlib

        mod, _, fn = STAGE_PROVIDERS[stages].partition(":")
        factory = getattr(importlib.import_module(mod), fn)
        _FACTORIES[stages] = factory
    result = factory(torch.device(device), dtype, head_dim, v_dim, num_heads=num_heads, topk=topk, kv_format=kv_format)
    if not isinstance(result, Stages):
        raise TypeError(f"the {stages!r} stage provider returned {type(result).__name__}, not Stages")
    return result
