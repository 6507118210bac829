"""The stage protocol: what each stage of one DCP decode step takes and returns.

A decode step on one rank is five local computations joined by three collectives::

    ownership   global lengths -> this rank's local causal bound per query token   (the step itself)
    indexer     local stable top-K of this rank's index scores, packed as (score, global id)
    -- all-gather of the packed candidates (the step) --
    select      stable global top-k of the gathered candidates -> global ids
    deinterleave  global ids -> this rank's physical KV slots (+ compaction: valid first, counts)
    attention   sparse MLA over (slots, counts): partial output + LSE (base e, -inf when empty)
    -- all-gather of the LSEs (the step) --
    merge       rescale this rank's partial by its LSE weight
    -- reduce-scatter over heads (the step) --

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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

from ._checks import check_int_scalar
from .attention import sparse_mla_attention
from .deinterleave import deinterleave_and_compact
from .geometry import DcpGeometry
from .indexer import local_topk
from .lse import correct_partial
from .topk import pack_candidates, stable_topk

__all__ = [
    "STAGE_NAMES",
    "ATTENTION_LAYOUTS",
    "StepSpec",
    "Stages",
    "REFERENCE_STAGES",
    "IndexerStage",
    "SelectStage",
    "DeinterleaveStage",
    "AttentionStage",
    "MergeStage",
    "reference_indexer",
    "reference_select",
    "reference_deinterleave",
    "reference_attention",
    "reference_merge",
    "compose_indexer",
    "impl_name",
    "write_into",
    "STAGE_PROVIDERS",
    "register_stages",
    "resolve_stages",
    "KV_FORMATS",
    "kv_format_of",
    "reference_attention_fp8",
    "FP8_REFERENCE_STAGES",
]

#: The stages a :class:`Stages` value implements, in step order.
STAGE_NAMES = ("indexer", "select", "deinterleave", "attention", "merge")
#: ``"compact"``: attention reads ``slots[t, :counts[t]]`` (valid slots compacted to the front).
#: ``"masked"``: attention reads every entry of ``slots[t]`` and skips ``-1`` itself (FlashMLA's FP8
#: decode); the de-interleave stage then need not compact, but must still give ``-1`` for others' keys.
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
class StepSpec:
    """Everything a step is planned for: fixed for the life of a :class:`dcp_ref.step.PlannedStep`.

    Attributes:
        geometry: this rank's :class:`~dcp_ref.geometry.DcpGeometry`.
        max_tokens: the largest number of query tokens ``T`` a run may have (buffers are this big).
        topk: ``k``, the global top-k (also the per-rank candidate count ``K``: exactness needs
            ``K = k``, since all winners may live on one rank).
        num_heads: ``H`` query heads (every rank computes all ``H``; the merge leaves ``H/W``).
        head_dim: ``Dqk`` (576 for DeepSeek: 512 latent + 64 RoPE).
        v_dim: value width (512 for DeepSeek).
        sm_scale: the softmax scale (a layer constant), finite and > 0.
        dtype: query / KV dtype.
        device: where everything lives.
    """

    geometry: DcpGeometry
    max_tokens: int
    topk: int
    num_heads: int
    head_dim: int
    v_dim: int
    sm_scale: float
    dtype: torch.dtype
    device: torch.device | str

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
                "the merge leaves H/W heads on each rank"
            )
        sc = self.sm_scale
        if isinstance(sc, bool) or not isinstance(sc, (int, float)):  # numpy floats are floats
            raise TypeError(f"sm_scale must be a float, got {type(sc).__name__}")
        if not math.isfinite(sc) or sc <= 0:
            raise ValueError(f"sm_scale must be a finite float > 0, got {sc!r}")
        object.__setattr__(self, "sm_scale", float(sc))
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(self.dtype).__name__}")
        dev = torch.device(self.device)
        if dev.type == "cuda" and dev.index is None:  # "cuda" means the current device: pin it (tensors say cuda:N)
            dev = torch.device("cuda", torch.cuda.current_device())
        object.__setattr__(self, "device", dev)

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.geometry.world_size


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
            slots, counts: from the de-interleave stage (layout per ``Stages.attention_layout``).
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


# ---- helpers ---------------------------------------------------------------------------------------
def write_into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``result`` copied into ``out`` when a buffer is given (cast to its dtype), else ``result``."""
    if out is None:
        return result
    if tuple(out.shape) != tuple(result.shape):
        raise ValueError(f"out must have shape {tuple(result.shape)}, got {tuple(out.shape)}")
    return out.copy_(result)


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
def reference_indexer(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    geometry: DcpGeometry,
    k: int,
    *,
    row_starts: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`dcp_ref.indexer.local_topk` then :func:`dcp_ref.topk.pack_candidates`."""
    g = geometry
    ids = local_topk(scores, k, lengths, row_starts, validate=False)
    return write_into(pack_candidates(scores, ids, g.rank, g.world_size, g.interleave, row_starts, validate=False), out)


@named_impl("torch")
def reference_select(gathered: torch.Tensor, k: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`dcp_ref.topk.stable_topk` (sorted: the reference always is)."""
    return write_into(stable_topk(gathered, k, validate=False), out)


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
        slots, counts = deinterleave_and_compact(
            global_ids, req_of_token, block_table, g.block_size, g.world_size, g.rank, g.interleave, validate=False
        )
    else:
        slots, counts = deinterleave_masked(
            global_ids, req_of_token, block_table, g.block_size, g.world_size, g.rank, g.interleave, validate=False
        )
    return write_into(slots, out_slots), write_into(counts, out_counts)


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
    return write_into(o, out), write_into(lse, out_lse)


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
    return write_into(corrected, out), write_into(merged, out_lse)


def compose_indexer(
    select_local: Callable[..., torch.Tensor], pack: Callable[..., torch.Tensor], name: str | None = None
) -> IndexerStage:
    """An indexer stage from a local top-K and a pack, each with the reference's signature.

    ``select_local(scores, k, lengths, row_starts) -> int [T, k]`` local indices (``-1`` padded), as
    :func:`dcp_ref.indexer.local_topk`; ``pack(scores, ids, rank, world_size, interleave, row_starts, out=)``
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
        ids = select_local(scores, k, lengths, row_starts)
        g = geometry
        try:
            packed = pack(scores, ids, g.rank, g.world_size, g.interleave, row_starts, out=out)
        except TypeError:  # a pack without out=
            packed = pack(scores, ids, g.rank, g.world_size, g.interleave, row_starts)
        return packed if out is None or packed is out else write_into(packed, out)

    return indexer


@dataclass(frozen=True)
class Stages:
    """One implementation per stage (see the module docstring and each stage's ``Protocol``).

    Attributes:
        indexer, select, deinterleave, attention, merge: the stage callables.
        attention_layout: ``"compact"`` or ``"masked"`` (see :data:`ATTENTION_LAYOUTS`): what the
            attention stage reads, hence whether the step asks the de-interleave stage to compact.
        partial_dtype: the dtype of the attention stage's output buffer for a query dtype (a kernel
            writes bf16 for bf16 queries; the reference keeps the query dtype).
        prepare: optional hook ``prepare(spec)`` run once at plan time (compile and warm kernels); the
            step calls it under :data:`dcp_ref.step.PLAN_LOCK` (CuTeDSL compilation is not thread-safe).
        name: a label for the set.
        notes: why each stage runs what it runs (e.g. a kernel's fallback reason), for the trace.
    """

    indexer: IndexerStage = reference_indexer
    select: SelectStage = reference_select
    deinterleave: DeinterleaveStage = reference_deinterleave
    attention: AttentionStage = reference_attention
    merge: MergeStage = reference_merge
    attention_layout: str = "compact"
    partial_dtype: Callable[[torch.dtype], torch.dtype] = field(default=lambda d: d)
    prepare: Callable[[StepSpec], None] | None = None
    name: str = "reference"
    notes: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for stage in STAGE_NAMES:
            if not callable(getattr(self, stage)):
                raise TypeError(f"{stage} must be callable, got {type(getattr(self, stage)).__name__}")
        if self.attention_layout not in ATTENTION_LAYOUTS:
            raise ValueError(f"attention_layout must be one of {ATTENTION_LAYOUTS}, got {self.attention_layout!r}")

    def with_(self, **stages: Any) -> Stages:
        """A copy with some stages (or ``attention_layout``, ``partial_dtype``, ``prepare``, ``name``) replaced."""
        unknown = set(stages) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ValueError(f"unknown stage(s) {sorted(unknown)}; stages are {STAGE_NAMES}")
        if "name" not in stages and set(stages) & set(STAGE_NAMES):
            stages["name"] = f"{self.name}+custom"
        return dataclasses.replace(self, **stages)

    def impls(self) -> dict[str, str]:
        """``{stage: implementation name}`` in step order (what ``trace["impl"]`` records)."""
        return {stage: impl_name(getattr(self, stage)) for stage in STAGE_NAMES}


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
