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
- correct: the Triton LSE correction (:mod:`.lse_merge_triton`) — as the indexer;
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

import dataclasses
import functools
import logging
from typing import Any

import torch

from dcp_ref.contracts import check_tensor, has_module, triton_interpreting
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
    reference_correct,
    reference_deinterleave,
    reference_guard,
    reference_indexer,
    reference_scoring,
    reference_select,
    reference_select_to_slots,
)

from ._launch import KERNEL_LOCK, launch

__all__ = ["kernel_stages", "kernel_stage_impls", "KERNEL_LOCK"]

logger = logging.getLogger("dcp_ref.kernels.stages")


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

    with launch(scores.device):
        return pack_candidates_triton(scores, ids, geometry, row_starts, out=out, validate=False)


@named_impl("torch")
def _local_topk_torch(
    scores: torch.Tensor, k: int, lengths: torch.Tensor, row_starts: torch.Tensor | None
) -> torch.Tensor:
    from dcp_ref.indexer import local_topk

    return local_topk(scores, k, lengths, row_starts, validate=False)


class _FusedIndexer:
    """The fused indexer stage (local top-K + pack, one launch; :func:`~.indexer_triton.indexer_topk_pack`).

    Long rows are split over programs through a workspace. Bound to a planned step (:meth:`bound`, from
    ``prepare``), the stage owns one launch plan and one workspace per shape it runs, made on its first (warm-up)
    call of that shape and reused, so later runs — and a captured graph — plan nothing, allocate nothing and read
    the same addresses for as long as the step lives. Unbound (``kernel_stages(spec).indexer`` called directly),
    each call makes its own.
    """

    impl_name = "fused"

    def __init__(self, workspaces: dict[tuple, torch.Tensor | None] | None = None) -> None:
        self._workspaces = workspaces
        self._plans: dict[tuple, Any] | None = None if workspaces is None else {}

    def bound(self) -> _FusedIndexer:
        """This stage with workspaces of its own (one planned step's)."""
        return _FusedIndexer({})

    def __call__(
        self,
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
        from .indexer_triton import indexer_topk_pack, launch_plan, scores_vec, workspace_for

        ws: torch.Tensor | None = None
        plan: Any = None  # unbound: indexer_topk_pack plans this call (and makes its workspace)
        if self._workspaces is not None and self._plans is not None:
            # the scores' vector width is part of the key: a plan for the CuTeDSL engine is made for it
            vec = scores_vec(scores)
            key = (tuple(scores.shape), k, scores.device, vec)
            if key not in self._plans:
                self._plans[key] = launch_plan(scores.shape[0], scores.shape[1], k, scores.device, vec=vec)
                self._workspaces[key] = workspace_for(scores, k, plan=self._plans[key])
            plan, ws = self._plans[key], self._workspaces[key]
        with launch(scores.device):
            return indexer_topk_pack(  # type: ignore[call-overload]  # order is a str here, not a Literal
                scores, lengths, k, geometry, row_starts, out=out, validate=False, workspace=ws, plan=plan,
                order=order, out_ids=out_ids,
            )  # fmt: skip


_indexer_fused = _FusedIndexer()


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
    with launch(global_ids.device):
        return fn(global_ids, req, block_table, geometry, out=out_slots, counts=out_counts, validate=False)


class _FlashMLAAttention:
    """FlashMLA's bf16 attention stage (:func:`~.flashmla_sparse.sparse_mla_flashmla`) with each token's slots cut
    into ``splits`` kernel rows (chosen at plan time for the planned tokens: :func:`~.flashmla_sparse.flashmla_splits`).

    Bound to a planned step (:meth:`bound`), it owns the prologue's buffers (a
    :class:`~.flashmla_sparse.FlashMLAScratch`: one per shape, reused, so a captured graph keeps reading them);
    unbound, each call makes its own."""

    impl_name = "flashmla"
    #: The guard's rule runs in this stage's prologue when the plan passes ``guard=`` (dcp_ref.axes.takes_guard).
    takes_guard = True
    #: ``q`` / ``out`` / ``out_lse`` may hold their heads in groups, ``[T, G, H/G, ...]`` views (the gathered query,
    #: the all-to-all's send buffer): dcp_ref.axes.takes_grouped_heads.
    grouped_heads = True

    def __init__(self, splits: int = 1, scratch: Any = None) -> None:
        self.splits = splits
        self.scratch = scratch

    def bound(self, splits: int) -> _FlashMLAAttention:
        """The stage of one planned step: ``splits`` per token and buffers of its own."""
        from .flashmla_sparse import FlashMLAScratch

        return _FlashMLAAttention(splits, FlashMLAScratch())

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
        guard: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from .flashmla_sparse import sparse_mla_flashmla

        return sparse_mla_flashmla(q, kv_cache, slots, counts, sm_scale, v_dim, out=out, out_lse=out_lse,
                                   splits=self.splits, workspace=self.scratch, guard=guard)  # fmt: skip


_attention_flashmla = _FlashMLAAttention(1)


class _FlashMLAFp8Attention:
    """FlashMLA's FP8 decode as the attention stage (:class:`~.flashmla_fp8.FlashMLAFp8Decode`, masked layout).

    Bound to a planned step (:meth:`bound`), it owns one decoder (which keeps FlashMLA's schedule and an index
    buffer per shape: a captured graph keeps reading them); unbound, each call makes its own decoder."""

    impl_name = "flashmla-fp8"

    def __init__(self, decoder: Any = None) -> None:
        self.decoder = decoder

    def bound(self, device: torch.device) -> _FlashMLAFp8Attention:
        """The stage of one planned step on ``device``, with a decoder of its own."""
        from .flashmla_fp8 import FlashMLAFp8Decode

        return _FlashMLAFp8Attention(FlashMLAFp8Decode(device, validate=False))

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
        dec = self.decoder
        if dec is None:
            from .flashmla_fp8 import FlashMLAFp8Decode

            dec = FlashMLAFp8Decode(q.device, validate=False)  # this call's own
        return dec.attention(q, kv_cache, slots, counts, sm_scale, v_dim, out=out, out_lse=out_lse)


_attention_flashmla_fp8 = _FlashMLAFp8Attention()


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


class _FlashInferAttention:
    """FlashInfer's fa3 MLA as the attention stage (:class:`~.flashinfer_mla.FlashInferSparseMLA`; plans on the host).

    Its ``plan()`` is stateful: bound to a planned step (:meth:`bound`), the stage owns one wrapper per
    ``(heads, sm_scale, device, dtype)``; unbound, each call makes its own."""

    impl_name = "flashinfer"

    def __init__(self, wrappers: dict[tuple, Any] | None = None) -> None:
        self._wrappers = wrappers

    def bound(self) -> _FlashInferAttention:
        """This stage with wrappers of its own (one planned step's)."""
        return _FlashInferAttention({})

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
        from .flashinfer_mla import FlashInferSparseMLA

        key = (q.shape[1], float(sm_scale), q.device, q.dtype)
        attn = None if self._wrappers is None else self._wrappers.get(key)
        if attn is None:
            attn = FlashInferSparseMLA(
                q.shape[1], sm_scale, device=q.device, dtype=q.dtype, head_dim_kpe=q.shape[2] - 512
            )
            if self._wrappers is not None:
                self._wrappers[key] = attn
        attn.plan(slots, counts)  # host sync: FlashInfer builds its schedule from the lengths
        return attn.run(q, kv_cache, out=out, lse=out_lse, lse_base="e")


_attention_flashinfer = _FlashInferAttention()


@named_impl("triton")
def _correct_triton(
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
    with launch(partial.device):
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

    with launch(partial.device):
        guard_triton(partial, lse, local_bounds, req_of_token, block_table, geometry, n_cols, row_starts=row_starts,
                     num_blocks=num_blocks, next_n=next_n, index_q=index_q, index_weights=index_weights)  # fmt: skip


_guard_triton.standard_guard = True  # type: ignore[attr-defined]  # the rule of dcp_ref.guard: foldable into attention


#: The all-to-all combine's launch shape ``(block_h, num_warps)`` by ``(W, T)``, the best of its sweep on the H200
#: (``benchmarks/results/combine_sweep.json``: ``[W, T, 128/W, 512]`` bf16, 20 back-to-back calls in one graph).
#: A call takes the entry of the largest swept ``W`` and ``T`` at or below its own (:func:`combine_launch`).
COMBINE_LAUNCH: dict[tuple[int, int], tuple[int, int]] = {
    (2, 1): (1, 1), (2, 32): (4, 4), (2, 128): (4, 2),
    (4, 1): (1, 8), (4, 32): (1, 1), (4, 128): (4, 4),
    (8, 1): (1, 8), (8, 32): (1, 1), (8, 128): (1, 1),
}  # fmt: skip


def combine_launch(W: int, T: int) -> tuple[int, int]:
    """``(block_h, num_warps)`` for merging ``W`` partials of ``T`` tokens (:data:`COMBINE_LAUNCH`)."""
    w = max((x for x, _ in COMBINE_LAUNCH if x <= W), default=2)
    t = max((x for _, x in COMBINE_LAUNCH if x <= max(T, 1)), default=1)
    return COMBINE_LAUNCH[(w, t)]


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
    bh, nw = combine_launch(outs.shape[0], outs.shape[1])
    with launch(outs.device):
        merged, merged_lse = lse_merge(outs, lses, base="e", merged=out, merged_lse=out_lse,
                                       block_h=bh if bh <= outs.shape[2] else 1, num_warps=nw)  # fmt: skip
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

    with launch(index_q.device):
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


class _SplitKVAttention:
    """The split-KV Triton attention stage (:func:`~.attention_splitkv_triton.sparse_mla_splitkv`, the default plan
    of each call's shape, ``validate=False``).

    Bound to a planned step (:meth:`bound`), it owns one workspace per plan (the planned ``max_tokens``' made at
    plan time, any other run's on its first call) and reuses it, so a captured graph keeps reading the same
    addresses; unbound, each call makes its own."""

    impl_name = "triton-splitkv"

    def __init__(self, workspaces: dict[tuple, torch.Tensor] | None = None) -> None:
        self._workspaces = workspaces

    def bound(self, spec: StepSpec | None = None) -> _SplitKVAttention:
        """This stage with workspaces of its own (one planned step's); ``spec``: make the planned shape's now."""
        stage = _SplitKVAttention({})
        if spec is not None:
            from .attention_splitkv_triton import splitkv_plan

            dev = torch.device(spec.device)
            plan = splitkv_plan(spec.max_tokens, spec.attention_heads, spec.topk, dev, head_dim=spec.head_dim,
                                v_dim=spec.v_dim)  # fmt: skip
            stage._workspace(plan, dev)
        return stage

    def _workspace(self, plan: Any, device: torch.device) -> torch.Tensor | None:
        if self._workspaces is None:
            return None  # unbound: sparse_mla_splitkv makes this call's (when the plan splits)
        key = (device, plan)
        ws = self._workspaces.get(key)
        if ws is None:
            from .attention_splitkv_triton import workspace_for

            ws = self._workspaces[key] = workspace_for(plan, device)
        return ws

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
        from .attention_splitkv_triton import sparse_mla_splitkv, splitkv_plan

        T, H, dqk = q.shape
        plan = splitkv_plan(T, H, slots.shape[1], q.device, head_dim=dqk, v_dim=v_dim)
        ws = self._workspace(plan, q.device)
        with launch(q.device):
            return sparse_mla_splitkv(q, kv_cache, slots, counts, sm_scale, v_dim, out=out, out_lse=out_lse,
                                      workspace=ws, validate=False, plan=plan)  # fmt: skip


_attention_splitkv = _SplitKVAttention()


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


def _prepare(
    spec: StepSpec, stages: Stages, *, template: Stages, impl: dict[str, str], alternatives: dict[str, Any]
) -> Stages | None:
    """Plan-time work, under the step's lock: compile and warm what compiles (the CuTeDSL kernels) for the planned
    shape, and pick the faster bf16 attention for it where two can run (:data:`SPLITKV_MAX_TOKENS`).

    ``stages`` is the value being planned (``kernel_stages(spec)``, or a ``with_`` copy of it): a stage a caller
    replaced (not ``template``'s) is kept as given — only the provider's own stages are chosen and bound here."""
    W, T, k = spec.cache_geometry.world_size, spec.max_tokens, spec.topk
    chosen = stages

    def own(name: str) -> bool:
        return getattr(stages, name) is getattr(template, name)

    # one rank's cache (W = 1, tp) selects nothing: its local top-K is the answer (dcp_ref.axes.Exchange)
    if impl["select"] == "cutedsl" and spec.exchange == "allgather" and W > 1 and own("select"):
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
    if impl["select_to_slots"] == "cutedsl" and spec.exchange == "owner" and W > 1 and own("select_to_slots"):
        from .select_to_slots_cutedsl import make_config

        # One split (CTAs per row) for the planned rows, whatever a run's token count: one compiled kernel.
        split = make_config(spec.order, W, k, k, spec.cache_geometry, rows=T).split
        chosen = dataclasses.replace(chosen, select_to_slots=_select_to_slots_cutedsl_for(split))
    from .flashmla_sparse import flashmla_splits

    # the slots a token uses on this rank: all k winners (one rank, or tp), else about its k / W share
    keys = spec.topk if spec.layout == "tp" or W == 1 else spec.topk // W
    splits = flashmla_splits(T, spec.attention_heads, keys)  # how FlashMLA would run here
    attention, why = chosen.attention, ""
    if len(alternatives) >= 2 and own("attention"):  # the crossover against FlashMLA as it would run: split, or not
        most = SPLITKV_MAX_TOKENS if splits > 1 else SPLITKV_MAX_TOKENS_UNSPLIT
        best = "triton-splitkv" if T <= most else "flashmla"
        attention = alternatives[best]
        why = (
            f"planned for T <= {T} query tokens of ~{keys} slots: the split-KV kernel is faster up to {most}, "
            "FlashMLA beyond (measured on the H200, benchmarks/results/attention_flashmla_splits.json)"
        )
    if isinstance(attention, _FlashMLAAttention) and splits > 1:
        why = (why + "; " if why else "") + (
            f"FlashMLA with {splits} splits of each token's slots at H = {spec.attention_heads} "
            "(FLASHMLA_SPLITS, measured on the H200)"
        )
    # The plan owns every buffer and stateful object its stages keep (workspaces, scratch, decoders, wrappers):
    # each stateful stage is bound here, once per planned step, and lives as long as the step — also one a caller
    # took from another step (``step.stages``): two steps sharing one split-KV workspace or FlashMLA scratch would
    # overwrite each other's partials (ranks of a SimulatedWorld interleave their launches on one stream).
    attention = _bind_attention(attention, spec, splits)
    bound: dict[str, Any] = {}
    if isinstance(chosen.indexer, _FusedIndexer):
        bound["indexer"] = chosen.indexer.bound()
    if attention is not chosen.attention:
        bound["attention"] = attention
    if why:
        bound["notes"] = tuple(sorted((*(n for n in chosen.notes if n[0] != "attention"), ("attention", why))))
    if not bound:
        return chosen if chosen is not stages else None
    return dataclasses.replace(chosen, **bound)


def _bind_attention(attention: Any, spec: StepSpec, splits: int) -> Any:
    """``attention`` bound to one planned step (its own buffers / decoder / wrappers), or as is when it keeps none."""
    if isinstance(attention, _FlashMLAAttention):
        return attention.bound(splits)
    if isinstance(attention, _SplitKVAttention):
        return attention.bound(spec)
    if isinstance(attention, _FlashInferAttention):
        return attention.bound()
    if isinstance(attention, _FlashMLAFp8Attention):
        return attention.bound(torch.device(spec.device))
    return attention


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
    return _kernel_stages(device, q_dtype, head_dim, v_dim, num_heads, topk, kv_format).impls()


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
        for stage in ("scoring", "indexer", "deinterleave", "guard", "correct", "combine"):
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
    for stage in ("guard", "correct", "combine"):
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


def kernel_stages(spec: StepSpec) -> Stages:
    """The ``"kernels"`` :class:`~dcp_ref.stages.Stages` for a step planned as ``spec``.

    What it reads of ``spec``: ``device``, ``dtype``, ``head_dim``, ``v_dim``, ``attention_heads`` (the heads the
    *attention* runs: ``H`` for dcp, ``H/W`` for tp), ``topk`` and ``kv_format``. They let the attention choice check
    the kernels' constraints (FlashMLA: H in {64, 128}; the split-KV kernel: any H). Where FlashMLA and the split-KV
    kernel both fit, the planned step runs the one measured faster for its token count (``prepare``,
    :data:`SPLITKV_MAX_TOKENS`). ``kv_format="fp8_ds_mla"``: an FP8 cache; the attention is FlashMLA's FP8 sparse
    decode (:mod:`.flashmla_fp8`) on CUDA, the FP8 reference elsewhere, both in the masked layout.

    ``prepare(spec)`` (run once by each :class:`~dcp_ref.step.PlannedStep`) returns these stages bound to that
    step: the stateful stages (the fused indexer's workspaces, the attentions' scratch, decoder or wrappers) own
    their buffers there, for as long as the step lives. Called directly, the unbound stages allocate per call.
    """
    if not isinstance(spec, StepSpec):
        raise TypeError(f"spec must be a dcp_ref.stages.StepSpec, got {type(spec).__name__}")
    return _kernel_stages(
        torch.device(spec.device), spec.dtype, spec.head_dim, spec.v_dim, spec.attention_heads, spec.topk,
        spec.kv_format,
    )  # fmt: skip


def _kernel_stages(
    device: torch.device | str,
    dtype: torch.dtype,
    head_dim: int,
    v_dim: int,
    num_heads: int | None,
    topk: int | None,
    kv_format: str,
) -> Stages:
    """:func:`kernel_stages` from loose values (``num_heads`` / ``topk`` may be unknown: ``None``, FlashMLA is then
    assumed to fit and its own checks raise at run time)."""
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
        "correct": _correct_triton if impl["correct"] == "triton" else reference_correct,
        "combine": _combine_triton if impl["combine"] == "triton" else reference_combine,
    }
    # Both bf16 kernels fit: the plan picks by its token count (FlashMLA is the default until then).
    alternatives: dict[str, Any] = {}
    if impl["attention"] == "flashmla" and not _splitkv_unsupported(dev, dtype, head_dim, v_dim, num_heads):
        alternatives = {"flashmla": _attention_flashmla, "triton-splitkv": _attention_splitkv}

    def partial_dtype(d: torch.dtype) -> torch.dtype:
        # GPU attention writes q's dtype; the Triton correction takes fp16/bf16/fp32 partials.
        return d if d in (torch.float16, torch.bfloat16, torch.float32) else torch.float32

    stages = Stages(
        **by_name,
        attention_layout=layout,
        partial_dtype=partial_dtype,
        name="kernels",
        notes=tuple(sorted(reasons.items())),
    )
    return dataclasses.replace(
        stages, prepare=functools.partial(_prepare, template=stages, impl=impl, alternatives=alternatives)
    )
