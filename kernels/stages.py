"""The GPU kernels as a :class:`dcp_ref.stages.Stages` value — the ``"kernels"`` stage provider.

:func:`kernel_stages` picks, per stage, the fastest implementation that can run on the given
device and dtype, and the reference otherwise (the reason is logged once on
``logging.getLogger("dcp_ref.kernels.stages")`` and kept in ``Stages.notes``):

- indexer: the fused Triton local top-K + pack (:mod:`.indexer_triton`), else torch's local top-K + the
  Triton pack (:mod:`.pack_triton`) — needs CUDA, or the CPU with ``TRITON_INTERPRET=1``;
- select: the CuTeDSL stable radix top-K (:mod:`.topk_cutedsl`) — needs CUDA and nvidia-cutlass-dsl, and at
  most :data:`~.topk_cutedsl.MAX_CANDIDATES` gathered candidates per row (a step planned past it, or a call
  past it, runs the reference, logged);
- deinterleave: the Triton deinterleave + compaction (:mod:`.deinterleave_triton`) — as the indexer;
- attention: FlashMLA's sparse kernel (:mod:`.flashmla_sparse`; no host plan) or the split-KV Triton kernel
  (:mod:`.attention_splitkv_triton`), chosen per planned shape (below), else FlashInfer fa3
  (:mod:`.flashinfer_mla`; plans on the host) — needs CUDA, bf16, 576/512; on an FP8 cache FlashMLA's FP8
  decode (:mod:`.flashmla_fp8`), masked layout;
- merge: the Triton LSE correction (:mod:`.lse_merge_triton`) — as the indexer;
- scoring: the Triton FP8 index scoring (:mod:`.scoring_triton`) — as the indexer;
- select_to_slots: the CuTeDSL owner-local selection (:mod:`.select_to_slots_cutedsl`) — as select;
- guard: the Triton metadata guard (:mod:`.guard_triton`) — as the indexer;
- combine: the Triton merge of W partials (:func:`.lse_merge_triton.lse_merge`) — as the indexer.

The attention is chosen per planned shape: where both FlashMLA and the split-KV Triton kernel
(:mod:`.attention_splitkv_triton`, any head count that is a multiple of 16) can run, ``prepare`` plans the
split-KV kernel for steps of at most :data:`SPLITKV_MAX_TOKENS` query tokens (:data:`SPLITKV_MAX_TOKENS_UNSPLIT`
where a token uses fewer than all ``k`` slots) and FlashMLA beyond — the crossovers measured on the H200 — with
each token's slots split over :func:`~.flashmla_sparse.flashmla_splits` kernel rows, and says so in
``Stages.notes``. Where FlashMLA cannot run (``H`` not 64
or 128: a tensor-parallel rank's ``H/W`` heads) the split-KV kernel runs.

``dcp_ref`` never imports this module: :func:`dcp_ref.stages.resolve_stages` loads it by name when a
caller asks for ``stages="kernels"``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
from typing import Any

import torch

from dcp_ref._checks import check_tensor, has_module, triton_interpreting
from dcp_ref.geometry import DcpGeometry
from dcp_ref.stages import (
    STAGE_NAMES,
    Stages,
    StepSpec,
    compose_indexer,
    named_impl,
    reference_attention,
    reference_attention_fp8,
    reference_combine,
    reference_deinterleave,
    reference_guard,
    reference_indexer,
    reference_merge,
    reference_scoring,
    reference_select,
    reference_select_to_slots,
)

from ._util import per_thread

__all__ = ["kernel_stages", "kernel_stage_impls", "KERNEL_LOCK"]

logger = logging.getLogger("dcp_ref.kernels.stages")

#: Triton's CPU interpreter patches its language module while a kernel runs, and CuTeDSL compiles
#: are not thread-safe: the ranks of a SimulatedWorld (threads) take this lock around such calls.
#: Collectives stay outside it, so ranks cannot deadlock on it.
KERNEL_LOCK = threading.RLock()


def _launch(device: torch.device) -> contextlib.AbstractContextManager:
    return KERNEL_LOCK if device.type != "cuda" and triton_interpreting() else contextlib.nullcontext()


@functools.cache
def _log_fallback(stage: str, reason: str) -> None:
    # functools.cache: each distinct fallback is logged once per process, not once per step.
    logger.warning("dcp_ref.kernels.stages: stage %r runs the torch reference: %s", stage, reason)


# ---- the kernel implementations of each stage ---------------------------------------------------------
@named_impl("triton")
def _pack_triton(
    scores: torch.Tensor,
    ids: torch.Tensor,
    geometry: DcpGeometry,
    row_starts: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    from .pack_triton import pack_candidates_triton

    with _launch(scores.device):
        return pack_candidates_triton(scores, ids, geometry, row_starts, out=out, validate=False)


@named_impl("torch")
def _local_topk_torch(
    scores: torch.Tensor, k: int, lengths: torch.Tensor, row_starts: torch.Tensor | None
) -> torch.Tensor:
    from dcp_ref.indexer import local_topk

    return local_topk(scores, k, lengths, row_starts, validate=False)


_INDEXER_WORKSPACES = threading.local()  # split-row workspaces of the fused indexer, per thread (rank) and shape


@named_impl("fused")
def _indexer_fused(
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
    from .indexer_triton import indexer_topk_pack, workspace_for

    # Long rows are split over programs through a workspace: made once per thread (rank) and shape, on the first
    # (warm-up) run, so that later runs — and a captured graph — allocate nothing.
    key = (tuple(scores.shape), k, scores.device)
    ws = per_thread(_INDEXER_WORKSPACES, key, lambda: workspace_for(scores, k))
    with _launch(scores.device):
        return indexer_topk_pack(  # type: ignore[call-overload]  # order is a str here, not a Literal
            scores, lengths, k, geometry, row_starts, out=out, validate=False, workspace=ws, order=order,
            out_ids=out_ids,
        )  # fmt: skip


def _select_too_big(world_size: int, kloc: int) -> str:
    """Why the CuTeDSL top-K cannot take ``W * K`` candidates per row (``""`` when it can)."""
    from .topk_cutedsl import MAX_CANDIDATES

    n = world_size * kloc
    if n <= MAX_CANDIDATES:
        return ""
    return f"{n} gathered candidates per row > {MAX_CANDIDATES} (the CuTeDSL top-K's limit)"


@named_impl("cutedsl")
def _select_cutedsl(gathered: torch.Tensor, k: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    from .topk_cutedsl import stable_topk_cutedsl

    # More candidates than the kernel holds in registers: the reference, logged once (a shape, not a value:
    # no host read). A planned step never gets here: prepare swaps the stage for the reference.
    too_big = _select_too_big(gathered.shape[0], gathered.shape[-2]) if gathered.ndim == 4 else ""
    if too_big:
        _log_fallback("select", too_big)
        return reference_select(gathered, k, out=out)
    # The compile cache is filled at plan time (prepare, under the step's lock); a lookup is cheap, and the
    # lock makes a first compile from several rank threads safe.
    # The kernel reads (score, id) pairs as aligned 8-byte words: a strided view (a caller's, not the step's,
    # whose buffers are contiguous) is copied first rather than refused.
    if not gathered.is_contiguous() or gathered.data_ptr() % 8:
        gathered = gathered.clone(memory_format=torch.contiguous_format)  # a fresh, aligned, contiguous copy
    with KERNEL_LOCK:
        return stable_topk_cutedsl(gathered, k, out=out, validate=False)


@named_impl("triton")
def _deinterleave_triton(
    global_ids: torch.Tensor,
    req_of_token: torch.Tensor,
    block_table: torch.Tensor,
    geometry: DcpGeometry,
    *,
    compact: bool = True,
    out_slots: torch.Tensor | None = None,
    out_counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from .deinterleave_triton import deinterleave_compact, deinterleave_masked_triton

    for name, buf in (("out_slots", out_slots), ("out_counts", out_counts)):  # named as the stage's protocol does
        if buf is not None:
            check_tensor(buf, name, dtypes=(torch.int32,))
    req = req_of_token if req_of_token.dtype == torch.int32 else req_of_token.to(torch.int32)
    # compact: the ordered row scan; masked: the same scan with compaction off (slots and counts, one launch)
    fn = functools.partial(deinterleave_compact, ordered=True) if compact else deinterleave_masked_triton
    with _launch(global_ids.device):
        return fn(global_ids, req, block_table, geometry, out=out_slots, counts=out_counts, validate=False)


def _attention_flashmla_for(splits: int) -> Any:
    """FlashMLA's bf16 attention stage with each token's slots cut into ``splits`` kernel rows (chosen at plan time
    for the planned tokens: :func:`~.flashmla_sparse.flashmla_splits`)."""

    @named_impl("flashmla")
    def stage(
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
        from .flashmla_sparse import sparse_mla_flashmla

        return sparse_mla_flashmla(q, kv_cache, slots, counts, sm_scale, v_dim, out=out, out_lse=out_lse,
                                   splits=splits)  # fmt: skip

    stage.splits = splits  # type: ignore[attr-defined]
    return stage


_attention_flashmla = _attention_flashmla_for(1)


_FP8_DECODERS = threading.local()  # one FlashMLA FP8 decoder per thread (rank): it keeps a schedule per shape


@named_impl("flashmla-fp8")
def _attention_flashmla_fp8(
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
    from .flashmla_fp8 import FlashMLAFp8Decode

    dec = per_thread(_FP8_DECODERS, q.device, lambda: FlashMLAFp8Decode(q.device, validate=False))
    return dec.attention(q, kv_cache, slots, counts, sm_scale, v_dim, out=out, out_lse=out_lse)


def _choose_fp8_attention(device: torch.device, q_dtype: torch.dtype, num_heads: int | None) -> tuple[str, str]:
    if device.type != "cuda":
        return "torch-fp8", f"tensors are on {device}, not CUDA"
    if not has_module("flash_mla"):
        return "torch-fp8", "sgl-flash-mla is not installed"
    if q_dtype != torch.bfloat16:
        return "torch-fp8", f"FlashMLA's FP8 decode takes bf16 queries, got {q_dtype}"
    if num_heads is not None and num_heads not in (64, 128):
        return "torch-fp8", f"FlashMLA's FP8 decode takes H in (64, 128), got {num_heads}"
    return "flashmla-fp8", ""


_FI_WRAPPERS = threading.local()  # one FlashInfer wrapper per thread (rank) and shape: plan() is stateful


@named_impl("flashinfer")
def _attention_flashinfer(
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
    from .flashinfer_mla import FlashInferSparseMLA

    key = (q.shape[1], float(sm_scale), q.device, q.dtype)
    attn = per_thread(
        _FI_WRAPPERS,
        key,
        lambda: FlashInferSparseMLA(
            q.shape[1], sm_scale, device=q.device, dtype=q.dtype, head_dim_kpe=q.shape[2] - 512
        ),
    )
    attn.plan(slots, counts)  # host sync: FlashInfer builds its schedule from the lengths
    return attn.run(q, kv_cache, out=out, lse=out_lse, lse_base="e")


@named_impl("triton")
def _merge_triton(
    partial: torch.Tensor,
    all_lse: torch.Tensor,
    rank: int,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from .lse_merge_triton import lse_correct

    if out_lse is None:
        out_lse = torch.empty(partial.shape[:2], dtype=torch.float32, device=partial.device)
    with _launch(partial.device):
        corrected, merged = lse_correct(partial, all_lse, rank, base="e", corrected=out, merged_lse=out_lse)
    assert merged is not None
    return corrected, merged


@named_impl("triton")
def _guard_triton(
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
    from .guard_triton import guard_triton

    with _launch(partial.device):
        guard_triton(partial, lse, local_bounds, req_of_token, block_table, geometry, n_cols, row_starts=row_starts,
                     num_blocks=num_blocks, next_n=next_n, index_q=index_q, index_weights=index_weights)  # fmt: skip


@named_impl("triton")
def _combine_triton(
    outs: torch.Tensor,
    lses: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    from .lse_merge_triton import lse_merge

    if out_lse is None:
        out_lse = torch.empty(outs.shape[1:3], dtype=torch.float32, device=outs.device)
    with _launch(outs.device):
        merged, merged_lse = lse_merge(outs, lses, base="e", merged=out, merged_lse=out_lse)
    assert merged_lse is not None
    return merged, merged_lse


@named_impl("triton")
def _scoring_triton(
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
    from .scoring_triton import index_scores_triton

    with _launch(index_q.device):
        return index_scores_triton(index_q, weights, index_cache, block_table, req_of_token, local_bounds, geometry,
                                   row_starts=row_starts, out=out, validate=False, next_n=next_n)  # fmt: skip


def _select_to_slots_cutedsl_for(split: int | None) -> Any:
    """The CuTeDSL select-to-slots stage with its CTAs per row fixed (chosen at plan time for the planned rows, so
    that a run with fewer tokens reuses the compiled kernel instead of compiling another split)."""

    @named_impl("cutedsl")
    def stage(
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
        from .select_to_slots_cutedsl import select_to_slots_cutedsl

        if not gathered.is_contiguous():  # a caller's strided view (the step's buffers are contiguous)
            gathered = gathered.contiguous()
        with KERNEL_LOCK:
            return select_to_slots_cutedsl(gathered, req_of_token, block_table, geometry, k, order=order,
                                           own_ids=own_ids, out_slots=out_slots, out_counts=out_counts,
                                           validate=False, split=split)  # fmt: skip

    return stage


_select_to_slots_cutedsl = _select_to_slots_cutedsl_for(None)


@named_impl("triton-splitkv")
def _attention_splitkv(
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
    from .attention_splitkv_triton import splitkv_attention

    with _launch(q.device):
        return splitkv_attention(q, kv_cache, slots, counts, sm_scale, v_dim, out=out, out_lse=out_lse)


#: Up to this many query tokens per planned step the split-KV kernel is the faster bf16 attention, beyond it
#: FlashMLA's sparse kernel at its planned splits (H200, graph replay, H = 128, K = 2048, both in one run:
#: ``benchmarks/results/attention_flashmla_splits.json``). Derived by ``tools/flashmla_splits_table.py``;
#: ``tests/test_kernel_stages.py`` checks it against the committed sweep, so a re-measurement that moves the
#: crossover fails until it moves.
SPLITKV_MAX_TOKENS = 2
#: The same crossover against FlashMLA unsplit: where a token uses fewer than
#: :data:`~.flashmla_sparse.FLASHMLA_SPLITS_KEYS` slots (a DCP rank's ``k / W``), FlashMLA runs unsplit and the
#: split-KV kernel stays faster up to this many tokens (the same sweep's one-split rows).
SPLITKV_MAX_TOKENS_UNSPLIT = 8


def _prepare(spec: StepSpec, stages: Stages, impl: dict[str, str], alternatives: dict[str, Any]) -> Stages | None:
    """Plan-time work, under the step's lock: compile and warm what compiles (the CuTeDSL kernels) for the planned
    shape, and pick the faster bf16 attention for it where two can run (:data:`SPLITKV_MAX_TOKENS`)."""
    W, T, k = spec.cache_geometry.world_size, spec.max_tokens, spec.topk
    chosen = stages
    if impl["select"] == "cutedsl" and spec.exchange == "allgather":
        from .topk_cutedsl import stable_topk_cutedsl

        too_big = _select_too_big(W, k)
        if too_big:  # the reference, logged, and named in the trace
            _log_fallback("select", too_big)
            notes = tuple(sorted((*(n for n in chosen.notes if n[0] != "select"), ("select", too_big))))
            chosen = dataclasses.replace(chosen, select=reference_select, notes=notes)
        else:
            gathered = torch.zeros((W, T, k, 2), dtype=torch.float32, device=spec.device)
            gathered[..., 1] = -1.0  # all invalid: a warm-up that selects nothing
            with KERNEL_LOCK:
                stable_topk_cutedsl(gathered, k, validate=False)
    if impl["select_to_slots"] == "cutedsl" and spec.exchange == "owner":
        from .select_to_slots_cutedsl import make_config

        # One split (CTAs per row) for the planned rows, whatever a run's token count: one compiled kernel.
        split = make_config(spec.order, W, k, k, spec.cache_geometry, rows=T).split
        chosen = dataclasses.replace(chosen, select_to_slots=_select_to_slots_cutedsl_for(split))
    from .flashmla_sparse import flashmla_splits

    # the slots a token uses on this rank: all k winners (one rank, or tp), else about its k / W share
    keys = spec.topk if spec.layout == "tp" or W == 1 else spec.topk // W
    splits = flashmla_splits(T, spec.attention_heads, keys)  # how FlashMLA would run here
    attention, why = chosen.attention, ""
    if len(alternatives) >= 2:  # the crossover against FlashMLA as it would run: split, or not
        most = SPLITKV_MAX_TOKENS if splits > 1 else SPLITKV_MAX_TOKENS_UNSPLIT
        best = "triton-splitkv" if T <= most else "flashmla"
        attention = alternatives[best]
        why = (
            f"planned for T <= {T} query tokens of ~{keys} slots: the split-KV kernel is faster up to {most}, "
            "FlashMLA beyond (measured on the H200, benchmarks/results/attention_flashmla_splits.json)"
        )
    if attention is _attention_flashmla and splits > 1:
        attention = _attention_flashmla_for(splits)
        why = (why + "; " if why else "") + (
            f"FlashMLA with {splits} splits of each token's slots at H = {spec.attention_heads} "
            "(FLASHMLA_SPLITS, measured on the H200)"
        )
    if not why:
        return chosen if chosen is not stages else None
    notes = tuple(sorted((*(n for n in chosen.notes if n[0] != "attention"), ("attention", why))))
    return dataclasses.replace(chosen, attention=attention, notes=notes)


# ---- selection -------------------------------------------------------------------------------------------
def kernel_stage_impls(
    device: torch.device | str,
    q_dtype: torch.dtype,
    head_dim: int,
    v_dim: int,
    num_heads: int | None = None,
    topk: int | None = None,
    kv_format: str = "native",
) -> dict[str, str]:
    """What :func:`kernel_stages` runs for each stage (``"triton"``, ``"fused"``,
    ``"torch+triton"``, ``"cutedsl"``, ``"flashmla"``, ``"triton-splitkv"``, ``"flashinfer"``, ``"flashmla-fp8"``,
    ``"torch"``, ``"torch-fp8"``), in step order (each fallback is logged once). Where two attention kernels can run,
    the one named is FlashMLA; a planned step picks by its token count (:data:`SPLITKV_MAX_TOKENS`)."""
    return kernel_stages(device, q_dtype, head_dim, v_dim, num_heads=num_heads, topk=topk, kv_format=kv_format).impls()


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(f"dcp_ref.kernels.{module}") is not None


def _choose(
    device: torch.device, q_dtype: torch.dtype, head_dim: int, v_dim: int, num_heads: int | None, topk: int | None
) -> tuple[dict[str, str], dict[str, str]]:
    cuda = device.type == "cuda"
    reasons: dict[str, str] = {}
    if not has_module("triton"):
        tri = "triton is not installed"
    elif not (cuda or triton_interpreting()):
        tri = f"tensors are on {device} (set TRITON_INTERPRET=1 to interpret Triton on the CPU)"
    else:
        tri = ""
    impl: dict[str, str] = {}
    if tri:
        for stage in ("scoring", "indexer", "deinterleave", "guard", "merge", "combine"):
            reasons[stage] = tri
    impl["scoring"] = "triton" if not tri and _has("scoring_triton") else "torch"
    # "fused": local top-K + pack in one launch, by the CuTeDSL kernel where the indexer's plan takes it, else Triton
    impl["indexer"] = "fused" if not tri and _has("indexer_triton") else ("torch+triton" if not tri else "torch")
    if not cuda:
        reasons["select"] = reasons["select_to_slots"] = f"tensors are on {device}, not CUDA"
    elif not has_module("cutlass"):
        reasons["select"] = reasons["select_to_slots"] = "nvidia-cutlass-dsl is not installed"
    impl["select"] = "torch" if "select" in reasons else "cutedsl"
    impl["select_to_slots"] = (
        "cutedsl" if "select_to_slots" not in reasons and _has("select_to_slots_cutedsl") else "torch"
    )
    impl["deinterleave"] = "torch" if tri else "triton"
    impl["attention"], why = _choose_attention(device, q_dtype, head_dim, v_dim, num_heads, topk)
    if why:
        reasons["attention"] = why
    for stage in ("guard", "merge", "combine"):
        impl[stage] = "torch" if tri else "triton"
    return {s: impl[s] for s in STAGE_NAMES}, reasons


def _splitkv_unsupported(device: torch.device, q_dtype: torch.dtype, head_dim: int, v_dim: int,
                         num_heads: int | None) -> str:  # fmt: skip
    if device.type != "cuda":
        return f"tensors are on {device}, not CUDA"
    if q_dtype not in (torch.bfloat16, torch.float16):
        return f"the split-KV kernel runs bf16/fp16 on the GPU, got {q_dtype}"
    from .attention_splitkv_triton import splitkv_unsupported

    return splitkv_unsupported(device, q_dtype, num_heads or 128, head_dim, v_dim)


def _choose_attention(
    device: torch.device, q_dtype: torch.dtype, head_dim: int, v_dim: int, num_heads: int | None, topk: int | None
) -> tuple[str, str]:
    from .flashmla_sparse import flashmla_unsupported

    if device.type != "cuda":
        return "torch", f"tensors are on {device}, not CUDA"
    why_mla = flashmla_unsupported(device, q_dtype, num_heads or 128, head_dim, v_dim, topk or 64)
    if not why_mla:
        return "flashmla", ""
    why_split = _splitkv_unsupported(device, q_dtype, head_dim, v_dim, num_heads)
    if not why_split:
        return "triton-splitkv", ""
    if not has_module("flashinfer"):
        return "torch", f"FlashMLA: {why_mla}; split-KV: {why_split}; flashinfer is not installed"
    if q_dtype not in (torch.float16, torch.bfloat16):
        return "torch", f"FlashMLA: {why_mla}; FlashInfer's MLA takes fp16/bf16 queries, got {q_dtype}"
    if (head_dim, v_dim) != (576, 512):
        return "torch", f"FlashMLA: {why_mla}; FlashInfer's MLA takes head_dim=576, v_dim=512, got {head_dim}, {v_dim}"
    return "flashinfer", ""


def kernel_stages(
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int,
    v_dim: int,
    *,
    num_heads: int | None = None,
    topk: int | None = None,
    kv_format: str = "native",
) -> Stages:
    """The ``"kernels"`` :class:`~dcp_ref.stages.Stages` for tensors of ``dtype`` on ``device``.

    ``num_heads`` (the heads the *attention* runs: ``H`` for dcp, ``H/W`` for tp) / ``topk``: when known, let
    the attention choice check the kernels' constraints (FlashMLA: H in {64, 128}; the split-KV kernel: any H);
    unknown, FlashMLA is assumed to fit and its own checks raise at run time. Where FlashMLA and the split-KV
    kernel both fit, the planned step runs the one measured faster for its token count (``prepare``,
    :data:`SPLITKV_MAX_TOKENS`).
    ``kv_format="fp8_ds_mla"``: an FP8 cache; the attention is FlashMLA's FP8 sparse decode (:mod:`.flashmla_fp8`)
    on CUDA, the FP8 reference elsewhere, both in the masked layout.
    """
    dev = torch.device(device)
    impl, reasons = _choose(dev, dtype, head_dim, v_dim, num_heads, topk)
    layout = "compact"
    if kv_format == "fp8_ds_mla":
        impl["attention"], why = _choose_fp8_attention(dev, dtype, num_heads)
        reasons.pop("attention", None)
        if why:
            reasons["attention"] = why
        layout = "masked"
    elif kv_format != "native":
        raise ValueError(f"kv_format must be 'native' or 'fp8_ds_mla', got {kv_format!r}")
    for stage, why in reasons.items():
        _log_fallback(stage, why)
    attention_impls: dict[str, Any] = {
        "flashmla": _attention_flashmla,
        "triton-splitkv": _attention_splitkv,
        "flashinfer": _attention_flashinfer,
        "flashmla-fp8": _attention_flashmla_fp8,
        "torch-fp8": reference_attention_fp8,
        "torch": reference_attention,
    }
    by_name: dict[str, Any] = {
        "scoring": _scoring_triton if impl["scoring"] == "triton" else reference_scoring,
        "indexer": {
            "fused": _indexer_fused,
            "torch+triton": compose_indexer(_local_topk_torch, _pack_triton),
            "torch": reference_indexer,
        }[impl["indexer"]],
        "select": _select_cutedsl if impl["select"] == "cutedsl" else reference_select,
        "deinterleave": _deinterleave_triton if impl["deinterleave"] == "triton" else reference_deinterleave,
        "select_to_slots": _select_to_slots_cutedsl
        if impl["select_to_slots"] == "cutedsl"
        else reference_select_to_slots,
        "attention": attention_impls[impl["attention"]],
        "guard": _guard_triton if impl["guard"] == "triton" else reference_guard,
        "merge": _merge_triton if impl["merge"] == "triton" else reference_merge,
        "combine": _combine_triton if impl["combine"] == "triton" else reference_combine,
    }
    # Both bf16 kernels fit: the plan picks by its token count (FlashMLA is the default until then).
    alternatives: dict[str, Any] = {}
    if impl["attention"] == "flashmla" and not _splitkv_unsupported(dev, dtype, head_dim, v_dim, num_heads):
        alternatives = {"flashmla": _attention_flashmla, "triton-splitkv": _attention_splitkv}

    def partial_dtype(d: torch.dtype) -> torch.dtype:
        # GPU attention writes q's dtype; the Triton merge takes fp16/bf16/fp32 partials.
        return d if d in (torch.float16, torch.bfloat16, torch.float32) else torch.float32

    stages = Stages(
        **by_name,
        attention_layout=layout,
        partial_dtype=partial_dtype,
        name="kernels",
        notes=tuple(sorted(reasons.items())),
    )
    return dataclasses.replace(
        stages, prepare=functools.partial(_prepare, stages=stages, impl=impl, alternatives=alternatives)
    )
