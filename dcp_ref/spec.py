"""What a step is planned for: :class:`StepSpec` (and :class:`ScoringSpec`), fixed for the life of a plan.

The layer's option axes are one :class:`~dcp_ref.options.LayerOptions` (``StepSpec.options``); the rest is the
problem's size (geometry, largest ``T``, top-k, heads, dims), its dtype and device, whether the step scores FP8
index keys itself (:class:`ScoringSpec`) and the KV cache's format.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch

from .attention import check_sm_scale
from .contracts import FLOAT_DTYPES, check_choice, check_device, check_int_scalar
from .geometry import DcpGeometry
from .index_cache import INDEX_K_FP8
from .options import COMBINES, DEFAULT, EXCHANGES, LAYOUTS, ORDERS, LayerOptions

__all__ = [
    "ATTENTION_LAYOUTS",
    "KV_FORMATS",
    "LAYOUTS",
    "EXCHANGES",
    "ORDERS",
    "COMBINES",
    "kv_format_of",
    "ScoringSpec",
    "StepSpec",
]

#: ``"compact"``: attention reads ``slots[t, :counts[t]]`` (valid slots compacted to the front).
#: ``"masked"``: attention reads every entry of ``slots[t]`` and skips ``-1`` itself (FlashMLA's FP8
#: decode); the deinterleave stage then need not compact, but must still give ``-1`` for others' keys.
ATTENTION_LAYOUTS = ("compact", "masked")
#: KV cache formats a step can run on: ``"native"`` (float rows ``[S, Dqk]``, e.g. bf16) and ``"fp8_ds_mla"``
#: (DeepSeek V3.2 / FlashMLA's FP8 rows, 656 bytes per token: :mod:`dcp_ref.fp8_cache`).
KV_FORMATS = ("native", "fp8_ds_mla")


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
        kv_format: the KV cache's format, ``"native"`` or ``"fp8_ds_mla"`` (:data:`KV_FORMATS`,
            :func:`kv_format_of`): it decides the attention kernel and its layout.

    The five option axes (``layout`` ... ``q_replicate``) are one :class:`~dcp_ref.options.LayerOptions`
    (:attr:`options`; build a spec from one with :meth:`for_options`); their defaults and checks are its.
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
    layout: str = DEFAULT.layout
    exchange: str = DEFAULT.exchange
    order: str = DEFAULT.order
    combine: str = DEFAULT.combine
    q_replicate: bool = DEFAULT.q_replicate
    scoring: ScoringSpec | None = None
    kv_format: str = "native"

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
        LayerOptions(
            layout=self.layout,
            exchange=self.exchange,
            order=self.order,
            combine=self.combine,
            q_replicate=self.q_replicate,
        )  # fmt: skip  (checks every axis, one place: dcp_ref.options)
        check_choice(self.kv_format, "kv_format", KV_FORMATS)
        if self.scoring is not None and not isinstance(self.scoring, ScoringSpec):
            raise TypeError(f"scoring must be a ScoringSpec or None, got {type(self.scoring).__name__}")
        if self.scoring is not None and self.scoring.next_n > self.max_tokens:
            raise ValueError(
                f"scoring.next_n={self.scoring.next_n} must be <= max_tokens={self.max_tokens}: a run's T is a "
                "multiple of next_n (groups of one request's tokens), so no run but an empty one could fit"
            )

    @property
    def options(self) -> LayerOptions:
        """The layer's option axes as one :class:`~dcp_ref.options.LayerOptions` value."""
        return LayerOptions(
            layout=self.layout, exchange=self.exchange, order=self.order, combine=self.combine,
            q_replicate=self.q_replicate,
        )  # fmt: skip

    @classmethod
    def for_options(cls, geometry: DcpGeometry, options: LayerOptions, **fields: Any) -> StepSpec:
        """A spec whose option axes are ``options`` (the other fields by keyword)."""
        if not isinstance(options, LayerOptions):
            raise TypeError(f"options must be a dcp_ref.options.LayerOptions, got {type(options).__name__}")
        return cls(geometry, **options.as_dict(), **fields)

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
