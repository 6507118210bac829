"""A cost model of one DCP decode step against tensor parallelism, fitted to the H200 measurements.

Pure Python (no tensors, no GPU): bytes, FLOPs and seconds of one attention layer's decode step
on one rank, for DCP over ``W`` ranks and for TP over the same ``W`` ranks.

**Units.** Byte counts are Python ints (names end in ``_bytes``), times are float *seconds*
(``_s``), FLOPs are floats (``_flops``), rates are per second (``_Bps`` bytes/s,
``_flops_per_s``). Every quantity is *per layer and per rank* unless its name says otherwise.

**The two layouts compared** (``W`` ranks, ``T`` query tokens per step, one per request, each of
context ``c`` tokens; ``H`` heads; every query attends to its request's top ``k`` keys)::

    TP W   heads split (H/W per rank), KV cache duplicated (every rank stores all c tokens)
           index scoring over c keys -> top-k over c -> slots -> attention(H/W heads, k keys)
           no communication inside attention
    DCP W  KV cache split by token (each rank stores about c/W), all H heads on every rank
           all-gather q over heads -> index scoring over c/W keys -> local top-K + pack
           -> all-gather candidates -> stable global select -> deinterleave
           -> attention(H heads, ~k/W keys) -> all-gather LSEs -> correct
           -> reduce-scatter the output over heads (H/W per rank)

The output projection's all-reduce is the same in both layouts (DCP runs inside the TP group) and
is left out. What DCP adds is four collectives; what it saves is the per-rank share of the KV cache
(capacity: :func:`kv_bytes_per_rank`) and of every context-proportional stage (index scoring and
the local top-K read ``c/W`` keys instead of ``c``).

**Bytes on the wire** (per query token; ``K`` candidates per rank, ``D = 512`` value dims):
candidates travel as ``(score, id)`` float32 pairs, so a rank sends ``8*K`` bytes and the gathered
buffer holds ``8*W*K`` (its own slice included; ``8*(W-1)*K`` cross links); the LSE all-gather
sends ``4*H`` and gathers ``4*W*H``; the output reduce-scatter takes ``2*H*D`` bytes of bf16
partials and leaves ``2*H*D/W`` (an all-reduce would leave all ``2*H*D`` and move twice the bytes).
The query all-gather sends ``2*(H/W)*576`` and gathers ``2*H*576``. See :func:`communication_bytes`.

**Time of a stage** is a fitted line ``fixed_s + per_unit_s * x`` (:class:`LineCost`) where ``x``
is the stage's bytes (select, deinterleave, correct, pack, local top-K) or FLOPs (attention),
fitted to the committed H200 kernel benchmarks (``benchmarks/results/*.json``, see
:func:`observations_from_results`). A collective on a ring of ``W`` ranks costs
``collective_s + (W - 1) * (hop_s + chunk_bytes / link_Bps)`` (``chunk`` = what one ring step
moves: one rank's contribution for an all-gather, ``1/W`` of the input for a reduce-scatter); the
link is NVLink while the group fits in one host and InfiniBand (the slowest link of the ring)
once it spans hosts. Index scoring was never measured: it is a roofline (bytes at the measured copy
bandwidth, FLOPs at the FP8 tensor-core peak) and every number that uses it is a prediction.

**The crossover** (:func:`crossover_context`). DCP's memory saving is capacity: a rank with a KV
budget of ``M`` bytes holds ``floor(M / kv(c))`` requests of context ``c`` under TP but about ``W``
times as many under DCP. Precisely, with ``B_X(c) = min(max_batch, floor(M / per_request_bytes_X(c)))``
(all layers, KV and indexer cache) and ``t_X(B, c)`` the per-layer step time of this model at
``T = B`` query tokens (plus ``other_layer_s``, the rest of the layer, equal in both layouts), the
decode throughput of the ``W``-rank group is ``B_X / t_X`` for ``X`` in {TP, DCP}. **The crossover
context is the smallest context ``c`` at which DCP's throughput is at least TP's**:
``B_DCP(c) / t_DCP(B_DCP(c), c) >= B_TP(c) / t_TP(B_TP(c), c)``. Below it DCP's collectives cost
more than its larger batch and smaller context share win; above it (up to ``max_context``) DCP
serves more tokens per second. :func:`time_crossover_context` is the narrower, batch-free variant:
the smallest ``c`` at which DCP's step is no slower than TP's at the *same* ``T``.

**Limits.** The collectives' line is fitted to three calls of 16 KiB to 4 MiB per rank on two GPUs
(:data:`NCCL_2XH200_T32`); larger messages and ``W > 2`` are its extrapolation. NCCL's bandwidth on
larger messages was not measured here: where it beats the fitted ``link_Bps`` (NVLink's nominal rate
leaves room for that), the model over-states DCP's communication at large batches. Kernel lines are
extrapolated beyond the measured shapes (rows <= 4096, W <= 8, W*K <= 16384, T <= 128 for attention).
InfiniBand, index scoring and W > 8 are never measured: every number that uses them is a prediction.

**Fitting** (:func:`fit_constants`): each stage family is a weighted least-squares line (weights
``1/measured``: relative residuals), non-negative coefficients; collectives are fitted to the
NCCL times measured on 2 x H200 (:data:`NCCL_2XH200_T32`, quoted from the project's GPU notes)
and, when ``benchmarks/results/step.json`` exists, the whole step's overhead, the local top-K rate
and the per-hop latency are fitted to the measured steps (:func:`fit_step`). Residuals are
``(predicted - measured) / measured`` (:class:`Residual`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .contracts import check_bool, check_choice, check_int_scalar
from .options import DEFAULT, PLANNED, LayerOptions

__all__ = [
    "KV_BYTES_PER_TOKEN",
    "KV_BUDGET_BYTES",
    "NCCL_2XH200_T32",
    "FLASHMLA_SPARSE_T32_H128",
    "MlaGeometry",
    "Hardware",
    "LineCost",
    "CostConstants",
    "CollectiveBytes",
    "StepCost",
    "Observation",
    "StepPoint",
    "Residual",
    "Fit",
    "DEFAULT_CONSTANTS",
    "kv_bytes_per_rank",
    "indexer_cache_bytes_per_rank",
    "tokens_on_busiest_rank",
    "communication_bytes",
    "candidate_bytes",
    "lse_bytes",
    "output_reduce_scatter_bytes",
    "output_all_reduce_bytes",
    "query_allgather_bytes",
    "attention_flops",
    "attention_bytes",
    "collective_time_s",
    "dcp_step_cost",
    "tp_step_cost",
    "max_batch",
    "throughput_ratio",
    "crossover_context",
    "time_crossover_context",
    "observations_from_results",
    "step_points_from_json",
    "fit_lines",
    "fit_collectives",
    "fit_step",
    "fit_constants",
    "scaling_table",
    "STEP_STAGES",
    "LAYER_ONLY_STAGES",
    "PLANNED_LAYER",
    "QueryProjection",
    "q_replication_bytes",
]

#: Bytes per token per layer of the MLA KV cache: ``bf16`` = 576 dims x 2 bytes (512 latent + 64 rope);
#: ``fp8`` = DeepSeek-V3.2's layout (512 e4m3 values, 4 float32 scales, 64 bf16 rope values = 656).
KV_BYTES_PER_TOKEN: dict[str, int] = {"bf16": 576 * 2, "fp8": 512 + 4 * 4 + 64 * 2}

#: HBM per GPU left for the KV and indexer caches after weights and activations: 40 GiB (``40 * 2**30`` bytes),
#: the default budget of :func:`throughput_ratio` and :func:`crossover_context`, and the budget chapter 00 counts
#: tokens with. An assumption: DeepSeek-V3.2 FP8 on 8 x H200 leaves roughly 141 - 86 - 15 GB, an estimate coarser
#: than the 7 % between GB and GiB; kept the same for every W.
KV_BUDGET_BYTES: int = 40 * 2**30

#: NCCL collectives measured on 2 x H200 (NVLink) at T = 32 query tokens, H = 128, K = 2048, D = 512,
#: through ``TorchDistributedGroup``: ``(kind, per-rank bytes, eager_s, graph_s)``. Per-rank bytes are
#: each rank's contribution to an all-gather and each rank's input to a reduce-scatter. Source: the
#: project's GPU notes (``../shared/gpu/README.md``, "Facts verified on the H200s (2026-11-30)").
NCCL_2XH200_T32: tuple[tuple[str, int, float, float], ...] = (
    ("all_gather", 32 * 2048 * 8, 49.6e-6, 13.4e-6),  # candidates: 512 KiB per rank
    ("all_gather", 32 * 128 * 4, 48.7e-6, 9.4e-6),  # LSEs: 16 KiB per rank
    ("reduce_scatter", 32 * 128 * 512 * 2, 35.6e-6, 24.6e-6),  # bf16 output: 4 MiB per rank
)

#: FlashMLA sparse decode (``flash_mla_sparse_fwd``, bf16, SM90) at T = 32, H = 128, CUDA-graph replay:
#: ``(keys per token, seconds)``. Source: the project's GPU notes (2026-11-30); the planned step's
#: kernel stages use this kernel (``dcp_ref.kernels.stages``).
FLASHMLA_SPARSE_T32_H128: tuple[tuple[int, float], ...] = ((1024, 36.6e-6), (2048, 67e-6))

#: Stages of the planned step as ``benchmarks/bench_step.py`` times it (``dcp_ref.step``: the indexer
#: scores are inputs, the query arrives with all heads).
STEP_STAGES = (
    "indexer",
    "candidates_allgather",
    "select",
    "deinterleave",
    "attention",
    "lse_allgather",
    "correct",
    "output_reduce_scatter",
    "step_overhead",
)
#: Stages a full attention layer adds to the planned step (``scope="layer"``).
LAYER_ONLY_STAGES = ("query_allgather", "index_scoring")


# ---- validation ----------------------------------------------------------------------------------
def _pos_int(value: object, name: str, min_value: int = 1) -> int:
    return check_int_scalar(value, name, min_value=min_value)


def _real(value: object, name: str, *, min_value: float = 0.0, strict: bool = False, allow_inf: bool = False) -> float:
    """``value`` as a float, or a ``TypeError``/``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number (int or float), got {type(value).__name__}")
    v = float(value)
    if math.isnan(v) or (math.isinf(v) and not allow_inf):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if v < min_value or (strict and v == min_value):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {min_value}, got {value!r}")
    return v


# ---- parameters ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class MlaGeometry:
    """The attention layer being modelled; defaults are DeepSeek-V3.2's (its ``config.json``).

    Attributes:
        num_heads: query heads ``H`` of the whole layer (128).
        qk_dim: query/key dims per head, 512 latent + 64 rope (576).
        v_dim: value dims per head (the 512-dim latent, absorbed MLA).
        topk: keys each query token attends, ``k`` (DSA's ``index_topk`` = 2048).
        local_topk: candidates each DCP rank contributes per token, ``K`` (= ``k`` in DSA decode).
        kv_layout: ``"bf16"`` (1152 bytes/token, what the committed attention benchmarks use) or
            ``"fp8"`` (DeepSeek-V3.2's 656 bytes/token cache).
        indexer_heads, indexer_dim: the lightning indexer's query heads and key dims (64, 128).
        indexer_bytes_per_token: the indexer's key cache, 128 FP8 values + one float32 scale (132).
        layers: attention layers per decode step (61).
        min_kernel_heads: the sparse MLA kernel's smallest head count; fewer heads are padded up
            (FlashMLA sparse on SM90 accepts H = 64 or 128 only; measured on the H200).
        interleave: DCP's ``I`` (consecutive tokens per rank); only the busiest rank's share uses it.
    """

    num_heads: int = 128
    qk_dim: int = 576
    v_dim: int = 512
    topk: int = 2048
    local_topk: int = 2048
    kv_layout: str = "bf16"
    indexer_heads: int = 64
    indexer_dim: int = 128
    indexer_bytes_per_token: int = 132
    layers: int = 61
    min_kernel_heads: int = 64
    interleave: int = 1

    def __post_init__(self) -> None:
        for f in (
            "num_heads",
            "qk_dim",
            "v_dim",
            "topk",
            "local_topk",
            "indexer_heads",
            "indexer_dim",
            "layers",
            "min_kernel_heads",
            "interleave",
        ):
            _pos_int(getattr(self, f), f)
        _pos_int(self.indexer_bytes_per_token, "indexer_bytes_per_token", 0)
        if self.kv_layout not in KV_BYTES_PER_TOKEN:
            raise ValueError(f"kv_layout must be one of {sorted(KV_BYTES_PER_TOKEN)}, got {self.kv_layout!r}")

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of the MLA KV cache per token and layer (1152 for bf16, 656 for fp8)."""
        return KV_BYTES_PER_TOKEN[self.kv_layout]


@dataclass(frozen=True)
class Hardware:
    """The machine: one HGX H200 host has 8 GPUs on NVLink; hosts talk over InfiniBand.

    Attributes:
        hbm_bytes: HBM per GPU (141 GB; NVIDIA H200 datasheet).
        copy_Bps: device copy bandwidth, the floor of a memory-bound kernel (4.24e12: measured in
            ``benchmarks/results/lse_merge.json``, ``copy_TBps_measured``; datasheet 4.8 TB/s).
        bf16_flops_per_s: dense BF16 tensor-core peak (989e12; datasheet 1979 "with sparsity").
        fp8_flops_per_s: dense FP8 tensor-core peak (1979e12).
        gpus_per_host: GPUs on one NVLink domain (8 on HGX H200).
        nvlink_Bps: NVLink 4 per direction per GPU (450e9: 900 GB/s bidirectional). Nominal only;
            the model uses the fitted ``CostConstants.link_Bps`` inside a host.
        ib_Bps: InfiniBand per GPU (50e9: one ConnectX-7 NDR 400 Gb/s NIC per GPU on HGX H200).
        ib_efficiency: fraction of ``ib_Bps`` NCCL reaches (0.8, an assumption: never measured here).
        ib_hop_s: latency of one ring step across hosts (5e-6, an assumption: NCCL's network
            proxy + NDR switch; never measured here).
    """

    hbm_bytes: float = 141e9
    copy_Bps: float = 4.24e12
    bf16_flops_per_s: float = 989e12
    fp8_flops_per_s: float = 1979e12
    gpus_per_host: int = 8
    nvlink_Bps: float = 450e9
    ib_Bps: float = 50e9
    ib_efficiency: float = 0.8
    ib_hop_s: float = 5e-6

    def __post_init__(self) -> None:
        for f in ("hbm_bytes", "copy_Bps", "bf16_flops_per_s", "fp8_flops_per_s", "nvlink_Bps", "ib_Bps"):
            _real(getattr(self, f), f, strict=True)
        _pos_int(self.gpus_per_host, "gpus_per_host")
        _real(self.ib_efficiency, "ib_efficiency", strict=True)
        if self.ib_efficiency > 1:
            raise ValueError(f"ib_efficiency must be <= 1, got {self.ib_efficiency!r}")
        _real(self.ib_hop_s, "ib_hop_s")


@dataclass(frozen=True)
class LineCost:
    """``time_s(x) = fixed_s + per_unit_s * x``: one stage's fitted time against its bytes or FLOPs.

    Attributes:
        fixed_s: seconds at ``x = 0`` (launch and tail latency inside a CUDA graph).
        per_unit_s: seconds per unit of ``x`` (``1 / effective rate``).
        unit: what ``x`` counts (``"bytes"`` or ``"flops"``), for the reader.
    """

    fixed_s: float
    per_unit_s: float
    unit: str = "bytes"

    def __post_init__(self) -> None:
        _real(self.fixed_s, "fixed_s")
        _real(self.per_unit_s, "per_unit_s")

    def time_s(self, x: float) -> float:
        """Seconds for ``x`` units (``x >= 0``)."""
        return self.fixed_s + self.per_unit_s * _real(x, "x")

    @property
    def rate(self) -> float:
        """Effective units per second of the slope (``inf`` for a zero slope)."""
        return math.inf if self.per_unit_s == 0 else 1.0 / self.per_unit_s


#: The kernel lines a fit can replace, by family name (an :class:`Observation`'s ``family``).
_LINE_FAMILIES = (
    "select",
    "deinterleave",
    "correct",
    "pack",
    "local_topk",
    "attention",
    "attention_splitkv",
    "select_to_slots",
    "combine",
)


@dataclass(frozen=True)
class CostConstants:
    """The model's few fitted constants (defaults: :data:`DEFAULT_CONSTANTS`, the committed fit).

    Attributes:
        collective_s: fixed latency of one collective inside a CUDA graph, excluding ring steps.
        hop_s: latency of one ring step inside a host (NVLink). With only W = 2 measured it cannot be
            told apart from ``collective_s``: it keeps its default (1e-6, an assumption of the order
            of NCCL's LL protocol step) until ``step.json`` has W = 4 or 8.
        link_Bps: effective NVLink bandwidth NCCL reaches at these message sizes (fitted).
        eager_collective_s: host latency an eager collective adds over its graph replay (fitted).
        select, deinterleave, correct, pack, local_topk: per-byte lines (:class:`LineCost`).
        attention: per-FLOP line of the sparse MLA kernel (FlashMLA; FLOPs of padded heads included).
        attention_splitkv: per-FLOP line of the split-KV Triton kernel (any head count, no padding).
        select_to_slots: per-byte line of the owner-local selection (bytes of gathered candidates read).
        combine: per-byte line of the merge of ``W`` received partials after the all-to-all.
        splitkv_max_tokens: the planned step runs the split-KV kernel up to this many tokens where FlashMLA
            could run too and splits each token's slots (the measured crossover;
            ``dcp_ref.kernels.stages.SPLITKV_MAX_TOKENS``).
        splitkv_max_tokens_unsplit: the same where FlashMLA runs unsplit: a token uses fewer than
            ``flashmla_splits_keys`` slots (``dcp_ref.kernels.stages.SPLITKV_MAX_TOKENS_UNSPLIT``,
            ``dcp_ref.kernels.flashmla_sparse.FLASHMLA_SPLITS_KEYS``).
        step_overhead_s: what the captured step costs beyond its stages (0 until ``step.json``).
        launch_s, sync_s: eager per-launch and per-host-sync costs (0 until ``step.json``).
    """

    collective_s: float = 8.0e-6
    hop_s: float = 1.0e-6
    link_Bps: float = 140e9
    eager_collective_s: float = 30e-6
    select: LineCost = LineCost(3.5e-6, 1 / 2.5e12)
    deinterleave: LineCost = LineCost(2.5e-6, 1 / 1.8e12)
    correct: LineCost = LineCost(2.0e-6, 1 / 2.0e12)
    pack: LineCost = LineCost(4.5e-6, 1 / 0.6e12)
    local_topk: LineCost = LineCost(25e-6, 1 / 0.25e12)
    attention: LineCost = LineCost(24e-6, 1 / 590e12, "flops")
    attention_splitkv: LineCost = LineCost(10e-6, 1 / 150e12, "flops")
    select_to_slots: LineCost = LineCost(5.0e-6, 1 / 3.0e12)
    combine: LineCost = LineCost(2.0e-6, 1 / 2.0e12)
    splitkv_max_tokens: int = 2
    splitkv_max_tokens_unsplit: int = 8
    flashmla_splits_keys: int = 2048
    step_overhead_s: float = 0.0
    launch_s: float = 0.0
    sync_s: float = 0.0

    def __post_init__(self) -> None:
        for f in ("collective_s", "hop_s", "eager_collective_s", "step_overhead_s", "launch_s", "sync_s"):
            _real(getattr(self, f), f)
        _real(self.link_Bps, "link_Bps", strict=True)
        _pos_int(self.splitkv_max_tokens, "splitkv_max_tokens", 0)
        _pos_int(self.splitkv_max_tokens_unsplit, "splitkv_max_tokens_unsplit", 0)
        _pos_int(self.flashmla_splits_keys, "flashmla_splits_keys", 1)
        for f in _LINE_FAMILIES:
            if not isinstance(getattr(self, f), LineCost):
                raise TypeError(f"{f} must be a LineCost, got {type(getattr(self, f)).__name__}")

    def replace(self, **changes: Any) -> CostConstants:
        """A copy with some constants changed (validated again)."""
        return dataclasses.replace(self, **changes)


#: Constants before any fit (rough values of the right order; :func:`fit_constants` replaces them).
DEFAULT_CONSTANTS = CostConstants()


# ---- bytes ---------------------------------------------------------------------------------------
def tokens_on_busiest_rank(context: int, world_size: int, interleave: int = 1) -> int:
    """Tokens of a ``context``-token request stored on rank 0, the busiest rank.

    Token ``p`` lives on rank ``(p // I) % W``; rank 0 gets ``(c // (W*I))*I + min(c % (W*I), I)``
    tokens, which is ``c / W`` when ``W*I`` divides ``c`` and at most ``I`` more than any other rank.
    """
    c = _pos_int(context, "context", 0)
    w = _pos_int(world_size, "world_size")
    i = _pos_int(interleave, "interleave")
    return (c // (w * i)) * i + min(c % (w * i), i)


def kv_bytes_per_rank(
    context: int, world_size: int, mode: str, geometry: MlaGeometry = MlaGeometry(), requests: int = 1
) -> int:
    """Bytes of MLA KV cache one rank stores for ``requests`` requests of ``context`` tokens, one layer.

    ``mode="tp"``: every rank stores every token (heads are split, the one latent KV "head" is
    not), ``requests * context * kv_bytes_per_token``. ``mode="dcp"``: the busiest rank's share,
    ``requests * tokens_on_busiest_rank(context, W) * kv_bytes_per_token`` (= TP / W when ``W*I``
    divides ``context``). The indexer's cache is separate: :func:`indexer_cache_bytes_per_rank`.
    """
    tokens = _tokens_per_rank(context, world_size, mode, geometry)
    return _pos_int(requests, "requests", 0) * tokens * geometry.kv_bytes_per_token


def indexer_cache_bytes_per_rank(
    context: int, world_size: int, mode: str, geometry: MlaGeometry = MlaGeometry(), requests: int = 1
) -> int:
    """Bytes of the indexer's key cache one rank stores (same sharding as :func:`kv_bytes_per_rank`)."""
    tokens = _tokens_per_rank(context, world_size, mode, geometry)
    return _pos_int(requests, "requests", 0) * tokens * geometry.indexer_bytes_per_token


def _tokens_per_rank(context: int, world_size: int, mode: str, geometry: MlaGeometry) -> int:
    if not isinstance(geometry, MlaGeometry):
        raise TypeError(f"geometry must be an MlaGeometry, got {type(geometry).__name__}")
    c = _pos_int(context, "context", 0)
    w = _pos_int(world_size, "world_size")
    if mode == "tp":
        return c
    if mode == "dcp":
        return tokens_on_busiest_rank(c, w, geometry.interleave)
    raise ValueError(f"mode must be 'tp' or 'dcp', got {mode!r}")


@dataclass(frozen=True)
class QueryProjection:
    """The weights that turn a token's latent query into its ``H`` attention queries (DeepSeek V3.2's
    ``config.json``): ``q_b_proj`` ``[q_lora_rank -> H * (qk_nope + qk_rope)]`` and, absorbed into the query
    (MLA's ``W_UK``), the key half of ``kv_b_proj`` ``[H * qk_nope <- kv_lora_rank]``.

    Attributes:
        q_lora_rank, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank: 1536, 128, 64, 512.
        q_b_bytes_per_param: 1 + 4/128**2 (FP8 weights with one float32 scale per 128 x 128 block, as the
            V3.2 checkpoint ships ``q_b_proj``).
        w_uk_bytes_per_param: 2 (vLLM keeps the absorbed ``W_UK`` in bf16).
    """

    q_lora_rank: int = 1536
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    kv_lora_rank: int = 512
    q_b_bytes_per_param: float = 1 + 4 / 128**2
    w_uk_bytes_per_param: float = 2.0

    def __post_init__(self) -> None:
        for f in ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "kv_lora_rank"):
            _pos_int(getattr(self, f), f)
        for f in ("q_b_bytes_per_param", "w_uk_bytes_per_param"):
            _real(getattr(self, f), f, strict=True)

    def params_per_layer(self, heads: int) -> tuple[int, int]:
        """``(q_b_proj, W_UK)`` parameters of one layer for ``heads`` query heads."""
        qb = self.q_lora_rank * heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        uk = heads * self.qk_nope_head_dim * self.kv_lora_rank
        return qb, uk


def q_replication_bytes(
    world_size: int, geometry: MlaGeometry = MlaGeometry(), projection: QueryProjection = QueryProjection()
) -> float:
    """Extra weight bytes per rank (all layers) when DCP replicates the query projection instead of gathering ``q``.

    Under TP-``W`` a rank holds ``1/W`` of ``q_b_proj`` and ``W_UK``; replicated (SGLang's
    ``--dcp-replicate-q-proj``, TensorRT-LLM Helix) it holds all of them, so that every rank computes all ``H``
    heads' queries itself and the query all-gather disappears. DeepSeek V3.2 at ``W = 8``: 2.9 GB per rank.
    """
    w = _pos_int(world_size, "world_size")
    if not isinstance(geometry, MlaGeometry):
        raise TypeError(f"geometry must be an MlaGeometry, got {type(geometry).__name__}")
    if not isinstance(projection, QueryProjection):
        raise TypeError(f"projection must be a QueryProjection, got {type(projection).__name__}")
    _check_heads_divisible(geometry, w)  # TP-W holds 1/W of the heads' projection: W must split them
    qb, uk = projection.params_per_layer(geometry.num_heads)
    per_layer = qb * projection.q_b_bytes_per_param + uk * projection.w_uk_bytes_per_param
    return (1 - 1 / w) * per_layer * geometry.layers


@dataclass(frozen=True)
class CollectiveBytes:
    """Bytes of one collective on one rank.

    Attributes:
        sent: this rank's contribution (all-gather) or input (reduce-scatter / all-reduce).
        received: the size of the result buffer on this rank (an all-gather's gathered buffer
            includes the rank's own slice).
        link: bytes this rank puts on links in a ring (``(W-1)/W`` of the total for an all-gather or
            reduce-scatter, twice that for an all-reduce); 0 when ``W = 1``.
    """

    sent: int
    received: int
    link: int


def candidate_bytes(tokens: int, world_size: int, geometry: MlaGeometry = MlaGeometry()) -> CollectiveBytes:
    """The candidates' all-gather: ``(score, id)`` float32 pairs, 8 bytes per candidate.

    Per token a rank sends ``8*K`` bytes and receives the ``8*W*K``-byte gathered buffer.
    """
    t, w = _pos_int(tokens, "tokens", 0), _pos_int(world_size, "world_size")
    per = t * geometry.local_topk * 8
    return CollectiveBytes(per, w * per, (w - 1) * per)


def lse_bytes(tokens: int, world_size: int, geometry: MlaGeometry = MlaGeometry()) -> CollectiveBytes:
    """The LSEs' all-gather: one float32 per (token, head); ``4*H`` sent, ``4*W*H`` gathered per token."""
    t, w = _pos_int(tokens, "tokens", 0), _pos_int(world_size, "world_size")
    per = t * geometry.num_heads * 4
    return CollectiveBytes(per, w * per, (w - 1) * per)


def query_allgather_bytes(tokens: int, world_size: int, geometry: MlaGeometry = MlaGeometry()) -> CollectiveBytes:
    """The query's all-gather over heads: each rank has ``H/W`` heads of bf16 ``qk_dim`` queries, needs all ``H``."""
    t, w = _pos_int(tokens, "tokens", 0), _pos_int(world_size, "world_size")
    _check_heads_divisible(geometry, w)
    per = t * (geometry.num_heads // w) * geometry.qk_dim * 2
    return CollectiveBytes(per, w * per, (w - 1) * per)


def output_reduce_scatter_bytes(tokens: int, world_size: int, geometry: MlaGeometry = MlaGeometry()) -> CollectiveBytes:
    """The corrected bf16 partial outputs reduce-scattered over heads: ``2*H*D`` in, ``2*H*D/W`` out per token."""
    t, w = _pos_int(tokens, "tokens", 0), _pos_int(world_size, "world_size")
    _check_heads_divisible(geometry, w)
    full = t * geometry.num_heads * geometry.v_dim * 2
    return CollectiveBytes(full, full // w, (w - 1) * full // w)


def output_all_reduce_bytes(tokens: int, world_size: int, geometry: MlaGeometry = MlaGeometry()) -> CollectiveBytes:
    """The same partials all-reduced instead: every rank keeps all ``H`` heads and moves twice the bytes."""
    t, w = _pos_int(tokens, "tokens", 0), _pos_int(world_size, "world_size")
    full = t * geometry.num_heads * geometry.v_dim * 2
    return CollectiveBytes(full, full, 2 * (w - 1) * full // w)


def communication_bytes(
    tokens: int, world_size: int, geometry: MlaGeometry = MlaGeometry(), scope: str = "layer"
) -> dict[str, CollectiveBytes]:
    """Every DCP collective of one step on one rank, in step order (all zero-link when ``W = 1``).

    ``scope="step"`` leaves out the query all-gather (the planned step receives all heads).
    """
    _check_scope(scope)
    out = {} if scope == "step" else {"query_allgather": query_allgather_bytes(tokens, world_size, geometry)}
    out["candidates_allgather"] = candidate_bytes(tokens, world_size, geometry)
    out["lse_allgather"] = lse_bytes(tokens, world_size, geometry)
    out["output_reduce_scatter"] = output_reduce_scatter_bytes(tokens, world_size, geometry)
    return out


def attention_flops(tokens: int, heads: int, keys: float, geometry: MlaGeometry = MlaGeometry()) -> float:
    """FLOPs of sparse MLA: ``2 * T * heads * keys * (qk_dim + v_dim)`` (QK^T over 576 dims, PV over 512)."""
    t, h = _pos_int(tokens, "tokens", 0), _pos_int(heads, "heads", 0)
    return 2.0 * t * h * _real(keys, "keys") * (geometry.qk_dim + geometry.v_dim)


def attention_bytes(tokens: int, heads: int, keys: float, geometry: MlaGeometry = MlaGeometry()) -> float:
    """HBM bytes of sparse MLA: gathered KV rows (``keys * kv_bytes_per_token`` per token, shared by the
    heads) + bf16 queries + bf16 outputs + float32 LSEs."""
    t, h = _pos_int(tokens, "tokens", 0), _pos_int(heads, "heads", 0)
    k = _real(keys, "keys")
    return t * (k * geometry.kv_bytes_per_token + h * (geometry.qk_dim * 2 + geometry.v_dim * 2 + 4))


def _check_heads_divisible(geometry: MlaGeometry, w: int) -> None:
    if geometry.num_heads % w:
        raise ValueError(f"world_size must divide num_heads={geometry.num_heads} (heads are split W ways), got {w}")


def _check_scope(scope: str) -> None:
    check_choice(scope, "scope", ("step", "layer"))


# ---- time ----------------------------------------------------------------------------------------
def collective_time_s(
    kind: str,
    bytes_per_rank: int,
    world_size: int,
    constants: CostConstants = DEFAULT_CONSTANTS,
    hardware: Hardware = Hardware(),
    *,
    graph: bool = True,
) -> float:
    """Seconds of one ring collective; 0 when ``world_size == 1`` (nothing to exchange).

    ``kind``: ``"all_gather"`` (``bytes_per_rank`` = this rank's contribution; ``W-1`` steps of that
    size), ``"reduce_scatter"`` (``bytes_per_rank`` = the input; ``W-1`` steps of ``1/W`` of it) or
    ``"all_reduce"`` (``2(W-1)`` steps of ``1/W``) or ``"all_to_all"`` (``bytes_per_rank`` = the whole send buffer;
    ``W-1`` pairwise steps of ``1/W`` of it). Time = ``collective_s + steps * (hop + chunk / bw)``
    where ``hop, bw`` are ``hop_s, link_Bps`` inside a host and ``ib_hop_s, ib_Bps * ib_efficiency``
    (the ring's slowest link) once ``W > gpus_per_host``. Eager launches add ``eager_collective_s``.
    """
    b = _pos_int(bytes_per_rank, "bytes_per_rank", 0)
    w = _pos_int(world_size, "world_size")
    if w == 1:
        return 0.0
    if kind == "all_gather":
        steps, chunk = w - 1, float(b)
    elif kind == "reduce_scatter":
        steps, chunk = w - 1, b / w
    elif kind == "all_reduce":
        steps, chunk = 2 * (w - 1), b / w
    elif kind == "all_to_all":
        steps, chunk = w - 1, b / w
    else:
        raise ValueError(f"kind must be 'all_gather', 'reduce_scatter', 'all_reduce' or 'all_to_all', got {kind!r}")
    if w <= hardware.gpus_per_host:
        hop, bw = constants.hop_s, constants.link_Bps
    else:
        hop, bw = hardware.ib_hop_s, min(constants.link_Bps, hardware.ib_Bps * hardware.ib_efficiency)
    t = constants.collective_s + steps * (hop + chunk / bw)
    return t if graph else t + constants.eager_collective_s


@dataclass(frozen=True)
class StepCost:
    """One rank's cost of one layer's decode step.

    Attributes:
        mode: ``"dcp"`` or ``"tp"``; world_size, tokens, context: the point modelled.
        stages_s: seconds per stage, in step order (collectives included, as stages).
        comm: bytes of each collective (:class:`CollectiveBytes`); empty for TP.
        attention_flops: FLOPs the attention kernel executes (padded heads included).
        attention_hbm_bytes: HBM bytes of the attention kernel.
        kv_bytes: this rank's KV cache for one request of ``context`` tokens (one layer).
    """

    mode: str
    world_size: int
    tokens: int
    context: int
    stages_s: dict[str, float]
    comm: dict[str, CollectiveBytes]
    attention_flops: float
    attention_hbm_bytes: float
    kv_bytes: int

    @property
    def total_s(self) -> float:
        """Sum of the stages (they run one after another on one stream)."""
        return sum(self.stages_s.values())

    @property
    def communication_s(self) -> float:
        """Seconds in collectives."""
        return sum(v for k, v in self.stages_s.items() if k in _COLLECTIVE_KIND)

    @property
    def communication_link_bytes(self) -> int:
        """Bytes this rank puts on links."""
        return sum(c.link for c in self.comm.values())


_COLLECTIVE_KIND = {
    "query_allgather": "all_gather",
    "candidates_allgather": "all_gather",
    "lse_allgather": "all_gather",
    "output_reduce_scatter": "reduce_scatter",
    "combine_alltoall": "all_to_all",
}


def _index_scoring_s(tokens: int, keys: int, geometry: MlaGeometry, hardware: Hardware) -> float:
    """Roofline of the lightning indexer over ``keys`` keys per token: reads its FP8 key cache and writes
    float32 scores at the copy bandwidth, or FP8 MMA at the tensor peak, whichever is slower (never measured)."""
    hbm = tokens * keys * (geometry.indexer_bytes_per_token + 4)
    flops = 2.0 * tokens * keys * geometry.indexer_heads * geometry.indexer_dim
    return max(hbm / hardware.copy_Bps, flops / hardware.fp8_flops_per_s)


def _common_args(
    world_size: object,
    tokens: object,
    context: object,
    geometry: object,
    hardware: object,
    constants: object,
    scope: str,
) -> tuple[int, int, int]:
    w = _pos_int(world_size, "world_size")
    t = _pos_int(tokens, "tokens")
    c = _pos_int(context, "context")
    if not isinstance(geometry, MlaGeometry):
        raise TypeError(f"geometry must be an MlaGeometry, got {type(geometry).__name__}")
    if not isinstance(hardware, Hardware):
        raise TypeError(f"hardware must be a Hardware, got {type(hardware).__name__}")
    if not isinstance(constants, CostConstants):
        raise TypeError(f"constants must be a CostConstants, got {type(constants).__name__}")
    _check_scope(scope)
    _check_heads_divisible(geometry, w)
    return w, t, c


def _attention_s(t: int, heads: int, keys: float, g: MlaGeometry, k: CostConstants) -> tuple[str, float, float]:
    """The attention kernel the planned step runs for ``t`` tokens and ``heads`` heads, its time and FLOPs.

    FlashMLA (heads padded to ``min_kernel_heads``; only 64 or 128 heads) or the split-KV kernel (any heads), as
    ``dcp_ref.kernels.stages`` plans it: split-KV up to ``splitkv_max_tokens`` tokens (``splitkv_max_tokens_unsplit``
    for fewer than ``flashmla_splits_keys`` keys a token) or where FlashMLA cannot run.
    """
    mla_ok = heads in (64, 128)
    most = k.splitkv_max_tokens if keys >= k.flashmla_splits_keys else k.splitkv_max_tokens_unsplit
    if mla_ok and t > most:
        f = attention_flops(t, max(heads, g.min_kernel_heads), keys, g)
        return "flashmla", k.attention.time_s(f), f
    f = attention_flops(t, heads, keys, g)
    return "splitkv", k.attention_splitkv.time_s(f), f


def _check_options(options: object) -> LayerOptions:
    """``options`` as the layer's :class:`~dcp_ref.options.LayerOptions` (its axes are checked by that class)."""
    if not isinstance(options, LayerOptions):
        raise TypeError(f"options must be a dcp_ref.options.LayerOptions, got {type(options).__name__}")
    return options


def dcp_step_cost(
    world_size: int,
    tokens: int,
    context: int,
    geometry: MlaGeometry = MlaGeometry(),
    hardware: Hardware = Hardware(),
    constants: CostConstants = DEFAULT_CONSTANTS,
    *,
    scope: str = "layer",
    graph: bool = True,
    options: LayerOptions = DEFAULT,
) -> StepCost:
    """Per-layer, per-rank cost of a DCP decode step over ``world_size`` ranks.

    Args:
        world_size: ``W >= 1``, dividing ``num_heads``. ``W = 1`` is a single rank: no collective,
            no pack, select or correct (the local top-K is the global one) — exactly :func:`tp_step_cost` at ``W = 1``
            with the same ``options`` (``combine`` and ``q_replicate`` change nothing there).
        tokens: query tokens ``T`` per step (one per request), all seen by every rank.
        context: tokens ``c`` of each request (every query token's own request).
        scope: ``"step"``: the planned step as benchmarked (``STEP_STAGES``); ``"layer"`` adds the
            query all-gather and the indexer's scoring (``LAYER_ONLY_STAGES``).
        graph: ``False`` adds each collective's eager host latency.
        options: the layer's options, one :class:`~dcp_ref.options.LayerOptions` (what
            :class:`dcp_ref.spec.StepSpec` plans for; its ``layout`` is not read: this function prices dcp):
            ``exchange="owner"`` runs the owner-local select-to-slots instead of select + deinterleave (at W > 1;
            at W = 1 the step exchanges nothing and runs the deinterleave alone),
            ``order="rank_local"`` moves 4 bytes per candidate instead of 8, ``combine="alltoall"`` one all-to-all
            of partials + LSEs and a merge of ``W`` partials over ``H/W`` heads instead of the LSE all-gather, the
            correction and the reduce-scatter; ``q_replicate=True`` (the default, as ``StepSpec``'s) drops the
            query all-gather (``scope="layer"``). The step as first measured (``step.json``) is
            ``LayerOptions(q_replicate=False)``; the recommended layer :data:`~dcp_ref.options.PLANNED`. The
            attention is the kernel the step plans for ``T`` (:func:`_attention_s`).

    Each rank attends ``min(k, c) / W`` keys per token on average (the global top-k spread over the
    ranks), with all ``H`` heads; its KV share is the busiest rank's.
    """
    w, t, c = _common_args(world_size, tokens, context, geometry, hardware, constants, scope)
    opt = _check_options(options)
    exchange, combine, order, q_replicate = opt.exchange, opt.combine, opt.order, opt.q_replicate
    graph = check_bool(graph, "graph")
    g, k = geometry, constants
    c_loc = tokens_on_busiest_rank(c, w, g.interleave)
    K = g.local_topk
    hs = g.num_heads // w
    bpc = 4 if order == "rank_local" else 8
    stages: dict[str, float] = {}
    comm = communication_bytes(t, w, g, scope)
    if scope == "layer":
        if w > 1 and not q_replicate:
            stages["query_allgather"] = collective_time_s(
                "all_gather", comm["query_allgather"].sent, w, k, hardware, graph=graph
            )
        else:
            comm.pop("query_allgather", None)
        stages["index_scoring"] = _index_scoring_s(t, c_loc, g, hardware)
    # local top-K over this rank's c/W scores (float32), then (W > 1) pack K (score, id) pairs per token
    stages["indexer"] = k.local_topk.time_s(t * c_loc * 4) + (k.pack.time_s(t * K * 14) if w > 1 else 0.0)
    if w > 1:
        sent = t * K * bpc
        comm["candidates_allgather"] = CollectiveBytes(sent, w * sent, (w - 1) * sent)
        stages["candidates_allgather"] = collective_time_s("all_gather", sent, w, k, hardware, graph=graph)
    # The exchange as the planned step's part runs it (dcp_ref.axes.Exchange.stages_for): at W = 1 nothing is
    # exchanged, the local top-K's ids are the answer and only their slots are looked up (deinterleave).
    if w > 1 and exchange == "owner":
        stages["select_to_slots"] = k.select_to_slots.time_s(t * w * K * bpc)
    else:
        if w > 1:
            stages["select"] = k.select.time_s(t * (w * K * 8 + g.topk * 4))
        stages["deinterleave"] = k.deinterleave.time_s(t * (g.topk * 8 + 4))
    keys = min(g.topk, c) / w
    kernel, attn_s, flops = _attention_s(t, g.num_heads, keys, g, k)
    stages["attention"] = attn_s
    heads = max(g.num_heads, g.min_kernel_heads) if kernel == "flashmla" else g.num_heads
    if w > 1 and combine == "reduce_scatter":
        stages["lse_allgather"] = collective_time_s(
            "all_gather", comm["lse_allgather"].sent, w, k, hardware, graph=graph
        )
        stages["correct"] = k.correct.time_s(t * g.num_heads * g.v_dim * 2 * 2 + w * t * g.num_heads * 4)
        stages["output_reduce_scatter"] = collective_time_s(
            "reduce_scatter", comm["output_reduce_scatter"].sent, w, k, hardware, graph=graph
        )
    elif w > 1:
        for name in ("lse_allgather", "output_reduce_scatter"):
            comm.pop(name, None)
        sent = w * (t * hs * g.v_dim * 2 + t * hs * 4)  # every destination's partials + LSEs
        comm["combine_alltoall"] = CollectiveBytes(sent, sent, (w - 1) * sent // w)
        stages["combine_alltoall"] = collective_time_s("all_to_all", sent, w, k, hardware, graph=graph)
        stages["combine"] = k.combine.time_s(t * (w + 1) * hs * g.v_dim * 2 + t * w * hs * 4)
    if w == 1:
        comm = {}
    stages["step_overhead"] = k.step_overhead_s
    return StepCost(
        "dcp", w, t, c, stages, comm, flops, attention_bytes(t, heads, keys, g), kv_bytes_per_rank(c, w, "dcp", g)
    )


def tp_step_cost(
    world_size: int,
    tokens: int,
    context: int,
    geometry: MlaGeometry = MlaGeometry(),
    hardware: Hardware = Hardware(),
    constants: CostConstants = DEFAULT_CONSTANTS,
    *,
    scope: str = "layer",
    graph: bool = True,
    options: LayerOptions = DEFAULT,
) -> StepCost:
    """Per-layer, per-rank cost of the same step under TP over ``world_size`` ranks.

    Every rank holds the whole KV cache and its ``H/W`` heads: the indexer scores and selects over all ``c``
    keys, the attention reads ``min(k, c)`` keys per token (FlashMLA pads the heads up to
    ``min_kernel_heads``; the split-KV kernel runs any head count: :func:`_attention_s`), and nothing is
    communicated inside attention. ``options`` (a :class:`~dcp_ref.options.LayerOptions`) are checked but change
    nothing here: with the cache not split, the planned step exchanges nothing whatever its ``exchange`` and
    ``order`` (the local top-K's ids go straight to the slot lookup, ``deinterleave``), and its ``layout`` is not
    read. ``graph`` is accepted for symmetry (no collective to launch).
    """
    w, t, c = _common_args(world_size, tokens, context, geometry, hardware, constants, scope)
    _check_options(options)
    check_bool(graph, "graph")
    g, k = geometry, constants
    stages: dict[str, float] = {}
    if scope == "layer":
        stages["index_scoring"] = _index_scoring_s(t, c, g, hardware)
    stages["indexer"] = k.local_topk.time_s(t * c * 4)
    # The cache is not split: nothing is exchanged, whatever the options (dcp_ref.axes.Exchange.stages_for); the
    # local top-K's ids are the answer and only their slots are looked up.
    stages["deinterleave"] = k.deinterleave.time_s(t * (g.topk * 8 + 4))
    keys = float(min(g.topk, c))
    kernel, attn_s, flops = _attention_s(t, g.num_heads // w, keys, g, k)
    stages["attention"] = attn_s
    heads = max(g.num_heads // w, g.min_kernel_heads) if kernel == "flashmla" else g.num_heads // w
    stages["step_overhead"] = k.step_overhead_s
    return StepCost(
        "tp", w, t, c, stages, {}, flops, attention_bytes(t, heads, keys, g), kv_bytes_per_rank(c, w, "tp", g)
    )


# ---- capacity and the crossover ------------------------------------------------------------------
def max_batch(
    context: int,
    world_size: int,
    mode: str,
    kv_budget_bytes: float,
    geometry: MlaGeometry = MlaGeometry(),
    cap: int = 256,
) -> int:
    """Requests of ``context`` tokens one rank's KV budget holds (all layers, KV + indexer cache), at most ``cap``."""
    budget = _real(kv_budget_bytes, "kv_budget_bytes", strict=True)
    cap = _pos_int(cap, "cap")
    per = geometry.layers * (
        kv_bytes_per_rank(context, world_size, mode, geometry)
        + indexer_cache_bytes_per_rank(context, world_size, mode, geometry)
    )
    return cap if per == 0 else min(cap, int(budget // per))


def throughput_ratio(
    world_size: int,
    context: int,
    geometry: MlaGeometry = MlaGeometry(),
    hardware: Hardware = Hardware(),
    constants: CostConstants = DEFAULT_CONSTANTS,
    *,
    kv_budget_bytes: float = KV_BUDGET_BYTES,
    batch_cap: int = 256,
    other_layer_s: float = 0.0,
    options: LayerOptions = DEFAULT,
) -> float:
    """DCP's decode throughput over TP's, each at the largest batch its KV budget allows (see the module doc).

    ``kv_budget_bytes``: HBM per GPU left for the KV and indexer caches after weights and activations
    (:data:`KV_BUDGET_BYTES`, 40 GiB, by default; an assumption, kept the same for every W). ``batch_cap``: the
    scheduler's most concurrent requests (vLLM's default ``max_num_seqs`` = 256). ``other_layer_s``: the rest of
    the layer's time per step (MoE, projections), equal in both layouts; 0 counts the attention path only
    (conservative for DCP).
    ``options``: the layer's :class:`~dcp_ref.options.LayerOptions` (:data:`~dcp_ref.options.PLANNED`, or
    ``LayerOptions(q_replicate=False)`` for the step as first measured), passed to :func:`dcp_step_cost` (and,
    through :func:`_tp_options`, to :func:`tp_step_cost`).
    Returns ``nan`` when TP cannot hold even one request (and ``inf`` if only DCP can).
    """
    other = _real(other_layer_s, "other_layer_s")
    opt = _check_options(options)
    b_tp = max_batch(context, world_size, "tp", kv_budget_bytes, geometry, batch_cap)
    b_dcp = max_batch(context, world_size, "dcp", kv_budget_bytes, geometry, batch_cap)
    if b_tp == 0:
        return math.inf if b_dcp > 0 else math.nan
    t_tp = tp_step_cost(world_size, b_tp, context, geometry, hardware, constants, options=_tp_options(opt)).total_s
    t_dcp = dcp_step_cost(world_size, b_dcp, context, geometry, hardware, constants, options=opt).total_s
    t_tp, t_dcp = t_tp + other, t_dcp + other
    return (b_dcp / t_dcp) / (b_tp / t_tp)


#: The layer as the planned step now runs it: :data:`dcp_ref.options.PLANNED` (the query gathered over heads, the
#: owner-local exchange of scores only, one all-to-all combine), kept under this name. Pass it as ``options=``.
PLANNED_LAYER: LayerOptions = PLANNED


def _tp_options(options: LayerOptions) -> LayerOptions:
    """The options the crossovers price TP with: ``options``' exchange, the default order (``"global_id"``: TP's
    selection is priced reading (score, id) pairs, as the crossovers always have), the rest unread by TP."""
    return options.replace(layout="tp", order=DEFAULT.order)


def _first_crossing(f: Callable[[int], float], lo: int, hi: int) -> float:
    """Smallest integer ``c`` in ``[lo, hi]`` with ``f(c) >= 0``, scanning a geometric grid and bisecting;
    ``inf`` if none on the grid (``f`` need not be monotonic; the first crossing of the grid is refined)."""
    grid = sorted({round(lo * (hi / lo) ** (i / 256)) for i in range(257)} | {lo, hi})
    prev = None
    for c in grid:
        if f(c) >= 0:
            if prev is None:
                return float(c)
            a, b = prev, c  # f(a) < 0 <= f(b)
            while b - a > 1:
                m = (a + b) // 2
                if f(m) >= 0:
                    b = m
                else:
                    a = m
            return float(b)
        prev = c
    return math.inf


def crossover_context(
    world_size: int,
    geometry: MlaGeometry = MlaGeometry(),
    hardware: Hardware = Hardware(),
    constants: CostConstants = DEFAULT_CONSTANTS,
    *,
    kv_budget_bytes: float = KV_BUDGET_BYTES,
    batch_cap: int = 256,
    other_layer_s: float = 0.0,
    min_context: int = 256,
    max_context: int = 1 << 21,
    options: LayerOptions = DEFAULT,
) -> float:
    """The context (tokens per request) where DCP's memory saving outweighs its communication.

    Precisely: the smallest ``c`` in ``[min_context, max_context]`` with
    :func:`throughput_ratio` ``>= 1``, i.e. DCP ``W`` at the batch its ``W``-times-smaller KV share
    allows serves at least as many tokens per second as TP ``W`` at its own memory-limited batch
    (both capped at ``batch_cap``). ``inf`` if DCP never catches up in that range; ``0.0`` for
    ``W = 1`` (DCP over one rank *is* TP). Contexts where TP holds no request count as DCP wins. ``options``:
    the layer's :class:`~dcp_ref.options.LayerOptions`, as in :func:`throughput_ratio`.
    """
    w = _pos_int(world_size, "world_size")
    lo, hi = _pos_int(min_context, "min_context"), _pos_int(max_context, "max_context")
    if hi < lo:
        raise ValueError(f"max_context must be >= min_context={lo}, got {hi}")
    _check_options(options)
    if w == 1:
        return 0.0

    def gain(c: int) -> float:
        r = throughput_ratio(
            w,
            c,
            geometry,
            hardware,
            constants,
            kv_budget_bytes=kv_budget_bytes,
            batch_cap=batch_cap,
            other_layer_s=other_layer_s,
            options=options,
        )
        return 1.0 if math.isnan(r) or math.isinf(r) else r - 1.0

    return _first_crossing(gain, lo, hi)


def time_crossover_context(
    world_size: int,
    tokens: int,
    geometry: MlaGeometry = MlaGeometry(),
    hardware: Hardware = Hardware(),
    constants: CostConstants = DEFAULT_CONSTANTS,
    *,
    min_context: int = 256,
    max_context: int = 1 << 21,
    options: LayerOptions = DEFAULT,
) -> float:
    """Smallest context at which DCP's per-layer step is no slower than TP's at the same ``tokens``
    (the context-proportional stages, index scoring and top-K, shrink by ``W``; the collectives do not).
    ``inf`` if never in range; ``0.0`` for ``W = 1``. ``options``: the layer's
    :class:`~dcp_ref.options.LayerOptions`, as in :func:`throughput_ratio`."""
    w = _pos_int(world_size, "world_size")
    t = _pos_int(tokens, "tokens")
    lo, hi = _pos_int(min_context, "min_context"), _pos_int(max_context, "max_context")
    if hi < lo:
        raise ValueError(f"max_context must be >= min_context={lo}, got {hi}")
    opt = _check_options(options)
    if w == 1:
        return 0.0
    tp_opt = _tp_options(opt)
    return _first_crossing(
        lambda c: (
            tp_step_cost(w, t, c, geometry, hardware, constants, options=tp_opt).total_s
            - dcp_step_cost(w, t, c, geometry, hardware, constants, options=opt).total_s
        ),
        lo,
        hi,
    )


# ---- measurements --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Observation:
    """One measured kernel time: ``family`` (a :class:`CostConstants` line name), its ``x`` (bytes or
    FLOPs), the measured ``seconds`` and a ``label`` saying where it came from."""

    family: str
    x: float
    seconds: float
    label: str


@dataclass(frozen=True)
class StepPoint:
    """One measured step (a row of ``step.json``'s ``summary``), times in seconds."""

    world_size: int
    tokens: int
    context: int
    attention: str
    graph_s: float
    eager_s: float | None = None
    launches: float | None = None
    host_syncs: float | None = None
    stages_sum_s: float | None = None


@dataclass(frozen=True)
class Residual:
    """``(predicted - measured) / measured`` of one observation under the fitted constants."""

    family: str
    label: str
    measured_s: float
    predicted_s: float

    @property
    def rel(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


@dataclass(frozen=True)
class Fit:
    """Fitted constants, every residual, and what the fit used (``sources``) or could not (``notes``);
    ``attention`` names the attention kernel of the fit and ``step_points`` the measured steps it used."""

    constants: CostConstants
    residuals: list[Residual]
    sources: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    attention: str = "flashinfer"
    step_points: list[StepPoint] = field(default_factory=list)

    def max_abs_rel(self, family: str | None = None) -> float:
        """Largest ``|relative residual|`` (of one family, or of all)."""
        rs = [abs(r.rel) for r in self.residuals if family is None or r.family == family]
        return max(rs) if rs else math.nan


def _load(path: Path) -> Any:
    with open(path) as fh:
        return json.load(fh)


def observations_from_results(results_dir: str | Path) -> list[Observation]:
    """Kernel observations from the committed benchmark JSON files (missing files are skipped).

    * ``topk.json`` ``results``: ``select`` = CuTeDSL stable top-K, CUDA-graph median, ``x = rows*(8*W*K + 4*k)``;
      ``pack`` = Triton pack (do_bench, eager), ``x = 14*rows*K`` (bf16 logit + int32 id read, 8-byte pair
      written); ``local_topk`` = ``torch.topk`` of ``k`` among ``W*K`` float32 scores in a CUDA graph,
      ``x = 4*rows*W*K`` (the stand-in for the local top-K over a rank's scores).
    * ``deinterleave.json`` ``results``: ``deinterleave`` = the fastest compacting method (atomic / rowscan /
      twopass) per (rows, W, I) by hot-graph median ``graph_us``, ``x = rows*(8*topk + 4)``.
    * ``lse_merge.json`` ``rows``: ``correct`` = ``correct_best`` (the correction the step runs before its
      reduce-scatter), ``x = bytes_correct``.
    * ``attention_flashinfer.json`` ``rows``: ``attention`` = FlashInfer FA3 sparse MLA ``run``,
      ``x = 2*T*H*K_valid*(576+512)`` FLOPs.
    * ``step.json`` ``summary[*].stages_us.indexer`` (when present): ``local_topk`` = the step's own indexer
      (fused local top-K + pack) in isolation, ``x = 4*T*ceil(ctx/W)``; it replaces the ``torch.topk`` stand-in.
    * ``attention.json`` ``summary`` (bf16 cache): ``attention`` = FlashMLA's sparse kernel (``flashmla_bf16``, the
      kernel the step runs from :attr:`CostConstants.splitkv_max_tokens` tokens on) and ``attention_splitkv`` =
      the split-KV kernel, both ``x = 2*T*H*K*(576+512)`` FLOPs; FlashMLA's rows replace
      :data:`FLASHMLA_SPARSE_T32_H128` in :func:`fit_constants`.
    * ``exchange.json`` ``summary``: ``select_to_slots`` = the owner-local selection, ``x = rows*W*K*b`` with
      ``b`` = 4 bytes per candidate (``rank_local``) or 8 (``global_id``); ``combine`` = the merge of ``W``
      received partials, ``x = rows*(W+1)*(H/W)*512*2 + rows*W*(H/W)*4`` bytes (read partials and LSEs, write one).
    """
    d = Path(results_dir)
    if not d.is_dir():
        raise ValueError(f"results_dir must be a directory, got {str(results_dir)!r}")
    obs: list[Observation] = []
    if (d / "topk.json").exists():
        for r in _load(d / "topk.json")["results"]:
            rows, w, K, k = r["rows"], r["W"], r["K"], r["k"]
            tag = f"rows={rows} W={w} K={K}"
            obs.append(Observation("select", rows * (8 * w * K + 4 * k), r["cutedsl_graph"]["median_us"] * 1e-6, tag))
            if isinstance(r.get("pack_triton"), dict) and "median_us" in r["pack_triton"]:
                obs.append(Observation("pack", 14 * rows * K, r["pack_triton"]["median_us"] * 1e-6, tag))
            if isinstance(r.get("torch_topk_graph"), dict):
                obs.append(Observation("local_topk", 4 * rows * w * K, r["torch_topk_graph"]["median_us"] * 1e-6, tag))
    if (d / "deinterleave.json").exists():
        data = _load(d / "deinterleave.json")
        k = data["shapes"]["topk"]
        best: dict[tuple[int, int, int], float] = {}
        for r in data["results"]:
            if r["method"] in ("atomic", "rowscan", "twopass") and r.get("correct") and r.get("graph_us"):
                key = (r["rows"], r["W"], r["I"])
                best[key] = min(best.get(key, math.inf), r["graph_us"])
        for (rows, w, i), us in sorted(best.items()):
            obs.append(Observation("deinterleave", rows * (8 * k + 4), us * 1e-6, f"rows={rows} W={w} I={i}"))
    if (d / "lse_merge.json").exists():
        for r in _load(d / "lse_merge.json")["rows"]:
            obs.append(
                Observation(
                    "correct", r["bytes_correct"], r["correct_best"]["median_us"] * 1e-6, f"W={r['W']} T={r['T']}"
                )
            )
    if (d / "attention_flashinfer.json").exists():
        for r in _load(d / "attention_flashinfer.json")["rows"]:
            flops = 2.0 * r["T"] * r["H"] * r["K_valid"] * (576 + 512)
            obs.append(Observation("attention", flops, r["run"]["median_us"] * 1e-6, f"T={r['T']} H={r['H']}"))
    if (d / "attention.json").exists():
        for r in _load(d / "attention.json").get("summary", []):
            if r.get("cache") != "bf16" or not r.get("graph_us"):
                continue
            flops = 2.0 * r["T"] * r["H"] * r["K"] * (576 + 512)
            fam = {"flashmla_bf16": "attention", "splitkv": "attention_splitkv"}.get(r["impl"])
            if fam is not None:
                label = f"{'FlashMLA' if fam == 'attention' else 'split-KV'} T={r['T']} H={r['H']} K={r['K']}"
                obs.append(Observation(fam, flops, r["graph_us"] * 1e-6, label))
    if (d / "exchange.json").exists():
        for r in _load(d / "exchange.json").get("summary", []):
            if r.get("stage") == "select_to_slots" and r.get("ours_us"):
                b = 4 if r["order"] == "rank_local" else 8
                x = r["rows"] * r["W"] * r["K"] * b
                label = f"rows={r['rows']} W={r['W']} {r['order']}"
                obs.append(Observation("select_to_slots", x, r["ours_us"] * 1e-6, label))
            elif r.get("stage") == "combine_merge" and r.get("ours_us"):
                hs = r["H"] // r["W"]
                x = r["rows"] * (r["W"] + 1) * hs * 512 * 2 + r["rows"] * r["W"] * hs * 4
                obs.append(Observation("combine", x, r["ours_us"] * 1e-6, f"rows={r['rows']} W={r['W']}"))
    # The planned step's own indexer (step.json rows' isolated stage times): when measured, it replaces the
    # torch.topk stand-in as the local top-K line, x = 4*T*ceil(ctx/W) bytes of scores read.
    indexer: list[Observation] = []
    if (d / "step.json").exists():
        for r in _load(d / "step.json").get("summary", []):
            indexer_us = (r.get("stages_us") or {}).get("indexer")
            if indexer_us is not None:
                local = -(-int(r["ctx"]) // int(r["W"]))
                label = f"step indexer W={r['W']} T={r['T']} ctx={r['ctx']}"
                indexer.append(Observation("local_topk", 4 * int(r["T"]) * local, float(indexer_us) * 1e-6, label))
    if indexer:
        obs = [o for o in obs if o.family != "local_topk"] + indexer
    return obs


def step_points_from_json(path: str | Path) -> list[StepPoint]:
    """The measured steps of ``step.json`` (schema ``{"summary": [{"W", "T", "ctx", "attention", "graph_us",
    "eager_us", "host_syncs_per_step", "launches_per_step", "stages_sum_us"}, ...]}``); ``[]`` if absent."""
    p = Path(path)
    if not p.exists():
        return []
    summary = _load(p).get("summary")
    if not isinstance(summary, list):
        raise ValueError(f"{p.name}: 'summary' must be a list of rows, got {type(summary).__name__}")

    def opt(row: Mapping[str, Any], key: str, scale: float = 1.0) -> float | None:
        v = row.get(key)
        return None if v is None else float(v) * scale

    out = []
    for row in summary:
        out.append(
            StepPoint(
                int(row["W"]),
                int(row["T"]),
                int(row["ctx"]),
                str(row.get("attention", "")),
                float(row["graph_us"]) * 1e-6,
                opt(row, "eager_us", 1e-6),
                opt(row, "launches_per_step"),
                opt(row, "host_syncs_per_step"),
                opt(row, "stages_sum_us", 1e-6),
            )
        )
    return out


# ---- fitting -------------------------------------------------------------------------------------
def _nnls(rows: Sequence[Sequence[float]], y: Sequence[float], weights: Sequence[float]) -> list[float]:
    """Weighted least squares with every coefficient ``>= 0`` (numpy only; no scipy).

    The fits here have at most three unknowns, so the non-negative problem is solved exactly by its active
    sets: every subset of free coefficients is an unconstrained :func:`numpy.linalg.lstsq` on the weighted
    rows (columns scaled to unit norm, for conditioning), the others held at 0, and the best feasible one is
    kept (the all-zero solution when none is: the constrained optimum is one of these subsets).
    """
    a = np.asarray(rows, dtype=np.float64) * np.asarray(weights, dtype=np.float64)[:, None]
    b = np.asarray(y, dtype=np.float64) * np.asarray(weights, dtype=np.float64)
    n = a.shape[1]
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    best, best_err = np.zeros(n), float(b @ b)
    for size in range(1, n + 1):
        for free in itertools.combinations(range(n), size):
            sub = a[:, free]
            sol, _res, rank, _sv = np.linalg.lstsq(sub, b, rcond=None)
            if rank < size or (sol < 0).any():  # singular (a column repeats another) or infeasible
                continue
            r = sub @ sol - b
            err = float(r @ r)
            if err < best_err * (1 - 1e-12):
                best = np.zeros(n)
                best[list(free)] = sol
                best_err = err
    return [float(c) for c in best / scale]


def fit_lines(observations: Iterable[Observation]) -> tuple[dict[str, LineCost], list[Residual]]:
    """One non-negative ``fixed + slope * x`` line per family, minimising relative error."""
    by: dict[str, list[Observation]] = {}
    for o in observations:
        if not isinstance(o, Observation):
            raise TypeError(f"observations must hold Observation values, got {type(o).__name__}")
        _real(o.seconds, f"seconds of {o.family} {o.label}", strict=True)
        by.setdefault(o.family, []).append(o)
    lines, res = {}, []
    for fam, os_ in by.items():
        unit = "flops" if fam.startswith("attention") else "bytes"
        if len(os_) == 1:  # one point: all of it is fixed cost (no slope can be told apart)
            line = LineCost(os_[0].seconds, 0.0, unit)
        else:
            fixed, slope = _nnls([(1.0, o.x) for o in os_], [o.seconds for o in os_], [1 / o.seconds for o in os_])
            line = LineCost(fixed, slope, unit)
        lines[fam] = line
        res += [Residual(fam, o.label, o.seconds, line.time_s(o.x)) for o in os_]
    return lines, res


def fit_collectives(
    measured: Sequence[tuple[str, int, float, float]] = NCCL_2XH200_T32,
    world_size: int = 2,
    hop_s: float = DEFAULT_CONSTANTS.hop_s,
) -> tuple[dict[str, float], list[Residual]]:
    """Fit ``collective_s`` and ``link_Bps`` (graph) and ``eager_collective_s`` to collectives measured at one W.

    ``measured``: ``(kind, bytes_per_rank, eager_s, graph_s)``. Graph time = ``collective_s + steps*hop_s +
    steps*chunk/link_Bps`` with ``hop_s`` given (at a single W it cannot be separated from ``collective_s``);
    ``eager_collective_s`` = mean of ``eager - graph``.
    """
    w = _pos_int(world_size, "world_size", 2)
    hop = _real(hop_s, "hop_s")
    if len(measured) < 2:
        raise ValueError(f"measured must hold at least 2 collectives, got {len(measured)}")
    rows, y = [], []
    for kind, b, _eager, graph in measured:
        steps, chunk = (w - 1, float(b)) if kind == "all_gather" else (w - 1, b / w)
        if kind not in ("all_gather", "reduce_scatter"):
            raise ValueError(f"measured kinds must be 'all_gather' or 'reduce_scatter', got {kind!r}")
        rows.append((1.0, steps * chunk))
        y.append(_real(graph, "graph_s", strict=True) - steps * hop)
    a, inv_bw = _nnls(rows, y, [1 / v for v in y])
    if inv_bw == 0:
        raise ValueError("measured collectives show no growth with bytes: link bandwidth cannot be fitted")
    consts = {
        "collective_s": a,
        "link_Bps": 1 / inv_bw,
        "hop_s": hop,
        "eager_collective_s": max(0.0, sum(e - g for _, _, e, g in measured) / len(measured)),
    }
    tmp = DEFAULT_CONSTANTS.replace(**consts)
    res = [
        Residual("collective", f"{kind} {b} B/rank W={w}", g, collective_time_s(kind, b, w, tmp))
        for kind, b, _, g in measured
    ]
    res += [
        Residual("collective_eager", f"{kind} {b} B/rank W={w}", e, collective_time_s(kind, b, w, tmp, graph=False))
        for kind, b, e, _ in measured
    ]
    return consts, res


def fit_step(
    points: Sequence[StepPoint],
    constants: CostConstants,
    geometry: MlaGeometry = MlaGeometry(),
    hardware: Hardware = Hardware(),
) -> tuple[CostConstants, list[Residual], list[str]]:
    """Fit the whole-step constants to measured steps (``scope="step"``), the kernel lines held fixed.

    Unknowns (each only when the points can tell it apart, otherwise kept): ``step_overhead_s``
    (always); the local top-K's per-byte cost (when the context varies); ``hop_s`` (when W varies
    and some W > 2). Then ``launch_s`` and ``sync_s`` from ``eager - graph`` when eager times exist.
    Returns the new constants, the graph (``step``) and eager (``step_eager``) residuals, and notes.
    """
    pts = [p for p in points if isinstance(p, StepPoint)]
    if len(pts) != len(points):
        raise TypeError("points must hold StepPoint values")
    notes: list[str] = []
    if not pts:
        return constants, [], ["no step measurements: step constants keep their defaults"]
    names = ["step_overhead_s", "local_topk_per_byte", "hop_s"]
    use = [
        True,
        len({p.context for p in pts}) > 1,
        len({p.world_size for p in pts}) > 1 and max(p.world_size for p in pts) > 2,
    ]
    if not use[1]:
        notes.append("one context only: the local top-K keeps its kernel-benchmark rate")
    if not use[2]:
        notes.append("W = 2 only (or one W): hop_s keeps its default")
    # the baseline zeroes exactly the constants being fitted; the others keep their values
    base = constants.replace(step_overhead_s=0.0)
    if use[1]:
        base = base.replace(local_topk=LineCost(constants.local_topk.fixed_s, 0.0))
    if use[2]:
        base = base.replace(hop_s=0.0)

    def features(p: StepPoint) -> tuple[float, float, float, float]:
        c0 = dcp_step_cost(p.world_size, p.tokens, p.context, geometry, hardware, base, scope="step").total_s
        c_loc = tokens_on_busiest_rank(p.context, p.world_size, geometry.interleave)
        n_coll = 3 if p.world_size > 1 else 0
        steps = n_coll * (p.world_size - 1) * (1 if p.world_size <= hardware.gpus_per_host else 0)
        return c0, 1.0, float(p.tokens * c_loc * 4), float(steps)

    feats = [features(p) for p in pts]
    cols = [i for i in range(3) if use[i]]
    y = [p.graph_s - f[0] for p, f in zip(pts, feats)]
    coef = _nnls([[f[1 + i] for i in cols] for f in feats], y, [1 / p.graph_s for p in pts])
    vals = dict(zip([names[i] for i in cols], coef))
    new = constants.replace(step_overhead_s=vals.get("step_overhead_s", 0.0))
    if "local_topk_per_byte" in vals:
        new = new.replace(local_topk=LineCost(constants.local_topk.fixed_s, vals["local_topk_per_byte"]))
    if "hop_s" in vals:
        new = new.replace(hop_s=vals["hop_s"])
    res = [
        Residual(
            "step",
            f"W={p.world_size} T={p.tokens} ctx={p.context} {p.attention}",
            p.graph_s,
            dcp_step_cost(p.world_size, p.tokens, p.context, geometry, hardware, new, scope="step").total_s,
        )
        for p in pts
    ]
    # (point index, eager seconds, launches, host syncs) of the points with eager measurements
    eager = [
        (i, p.eager_s, p.launches, p.host_syncs or 0.0)
        for i, p in enumerate(pts)
        if p.eager_s is not None and p.launches is not None
    ]
    if eager:
        use_sync = any(s for *_, s in eager)
        xs = [[n] + ([s] if use_sync else []) for _, _, n, s in eager]
        ys = [max(e - pts[i].graph_s, 0.0) for i, e, _, _ in eager]
        if any(ys):
            coef = _nnls(xs, ys, [1 / max(v, 1e-9) for v in ys])
            new = new.replace(launch_s=coef[0], sync_s=coef[1] if use_sync else 0.0)
        for i, e, n, s in eager:
            p = pts[i]
            pred = res[i].predicted_s + new.launch_s * n + new.sync_s * s
            res.append(Residual("step_eager", f"W={p.world_size} T={p.tokens} ctx={p.context} {p.attention}", e, pred))
    return new, res, notes


def fit_constants(
    results_dir: str | Path,
    geometry: MlaGeometry = MlaGeometry(),
    hardware: Hardware = Hardware(),
    *,
    observations: Sequence[Observation] | None = None,
    step_points: Sequence[StepPoint] | None = None,
    collectives: Sequence[tuple[str, int, float, float]] = NCCL_2XH200_T32,
    attention: str = "auto",
) -> Fit:
    """Fit every constant to the committed measurements in ``results_dir`` (or to the given ones).

    Kernel lines from :func:`observations_from_results`, collectives from ``collectives``
    (:data:`NCCL_2XH200_T32`), the whole step from ``results_dir/step.json`` when it exists
    (:func:`fit_step`). ``observations`` / ``step_points`` override what is read from the directory.
    ``attention``: ``"flashinfer"`` (``attention_flashinfer.json``), ``"flashmla"``
    (:data:`FLASHMLA_SPARSE_T32_H128`, the kernel the planned step runs) or ``"auto"``: FlashMLA when a
    measured step ran it, else FlashInfer. Steps that ran another attention kernel are not fitted.
    """
    if attention not in ("flashinfer", "flashmla", "auto"):
        raise ValueError(f"attention must be 'flashinfer', 'flashmla' or 'auto', got {attention!r}")
    obs = list(observations) if observations is not None else observations_from_results(results_dir)
    pts = list(step_points) if step_points is not None else step_points_from_json(Path(results_dir) / "step.json")
    if attention == "auto":
        attention = "flashmla" if any(p.attention.lower() == "flashmla" for p in pts) else "flashinfer"
    if attention == "flashmla":
        measured = [o for o in obs if o.family == "attention" and o.label.startswith("FlashMLA")]
        obs = [o for o in obs if o.family != "attention"] + measured
        if not measured:  # no attention.json: the two points quoted from the project's GPU notes
            obs += [
                Observation("attention", 2.0 * 32 * 128 * keys * (576 + 512), sec, f"FlashMLA T=32 H=128 k={keys}")
                for keys, sec in FLASHMLA_SPARSE_T32_H128
            ]
    else:
        obs = [o for o in obs if not (o.family == "attention" and o.label.startswith("FlashMLA"))]
    early_notes = []
    if len({p.attention for p in pts}) > 1:  # one attention line: fit the steps that ran that kernel
        # By exact name: "flashmla-fp8" (the FP8 cache's decode) is another kernel than "flashmla".
        same = [p for p in pts if p.attention.lower() == attention]
        if same:
            early_notes.append(f"step.json: {len(same)} of {len(pts)} steps ran {attention}; only those are fitted")
            pts = same
    lines, res = fit_lines(obs)
    consts = DEFAULT_CONSTANTS.replace(**{k: v for k, v in lines.items()})
    notes = early_notes + [f"{fam}: not measured, default kept" for fam in _LINE_FAMILIES if fam not in lines]
    sources = sorted({o.family for o in obs})
    coll, cres = fit_collectives(collectives, hop_s=consts.hop_s)
    consts = consts.replace(**coll)
    res += cres
    sources.append("collectives: NCCL on 2 x H200 at T = 32 (project GPU notes)")
    consts, sres, snotes = fit_step(pts, consts, geometry, hardware)
    res += sres
    notes += snotes
    if pts:
        sources.append(f"step.json: {len(pts)} measured steps")
    return Fit(consts, res, sources, notes, attention, pts)


# ---- predictions ---------------------------------------------------------------------------------
def scaling_table(
    constants: CostConstants,
    world_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    tokens: Sequence[int] = (32, 128),
    contexts: Sequence[int] = (8192, 65536, 131072),
    geometry: MlaGeometry = MlaGeometry(),
    hardware: Hardware = Hardware(),
    measured: Sequence[StepPoint] = (),
    scope: str = "layer",
    options: LayerOptions = DEFAULT,
) -> list[dict[str, Any]]:
    """Per-layer DCP and TP step times (µs) and KV bytes per rank at every (W, T, context).

    A row is ``predicted`` unless a measured step exists at its (W, T, ctx); ``spans_hosts`` when
    ``W > gpus_per_host`` (the collectives then run over InfiniBand, never measured here). ``options``: the
    layer's :class:`~dcp_ref.options.LayerOptions`, given to both :func:`dcp_step_cost` and :func:`tp_step_cost`.
    """
    seen = {(p.world_size, p.tokens, p.context) for p in measured}
    rows = []
    for w in world_sizes:
        for t in tokens:
            for c in contexts:
                d = dcp_step_cost(w, t, c, geometry, hardware, constants, scope=scope, options=options)
                tp = tp_step_cost(w, t, c, geometry, hardware, constants, scope=scope, options=options)
                rows.append(
                    {
                        "W": w,
                        "T": t,
                        "ctx": c,
                        "dcp_us": d.total_s * 1e6,
                        "tp_us": tp.total_s * 1e6,
                        "dcp_comm_us": d.communication_s * 1e6,
                        "dcp_link_bytes": d.communication_link_bytes,
                        "kv_bytes_dcp": d.kv_bytes,
                        "kv_bytes_tp": tp.kv_bytes,
                        "spans_hosts": w > hardware.gpus_per_host,
                        "predicted": (w, t, c) not in seen,
                    }
                )
    return rows
