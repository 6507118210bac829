"""The stage protocols: what each stage of one decode layer takes and returns, and the keywords the step passes.

One ``Protocol`` per stage (:data:`dcp_ref.stages.STAGE_NAMES`); :data:`STAGE_KEYWORDS` lists what the planned
step passes each by keyword (a custom stage without one is refused at plan time, by name). The conformance kit
(:mod:`dcp_ref.testing`) checks an implementation against its protocol's contract.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .geometry import DcpGeometry
from .options import ORDERS  # noqa: F401  (the protocols' docstrings name it)

__all__ = [
    "IndexerStage",
    "SelectStage",
    "DeinterleaveStage",
    "AttentionStage",
    "CorrectStage",
    "ScoringStage",
    "SelectToSlotsStage",
    "GuardStage",
    "CombineStage",
    "STAGE_KEYWORDS",
    "GUARD_SCORED_KEYWORDS",
    "RANK_LOCAL_INDEXER_KEYWORDS",
]

#: Keywords the step passes to each stage (a custom stage without them is refused at plan time, by name).
STAGE_KEYWORDS: dict[str, tuple[str, ...]] = {
    "scoring": ("row_starts", "out", "next_n"),
    "indexer": ("row_starts", "out"),
    "select": ("out",),
    "deinterleave": ("compact", "out_slots", "out_counts"),
    "select_to_slots": ("order", "out_slots", "out_counts"),
    "attention": ("out", "out_lse"),
    "guard": ("row_starts",),
    "correct": ("out", "out_lse"),
    "combine": ("out", "out_lse"),
}
#: What a scoring step also passes its guard (the scoring stage's row rule: :mod:`dcp_ref.guard`).
GUARD_SCORED_KEYWORDS = ("num_blocks", "next_n", "index_q", "index_weights")
#: What a step with ``order="rank_local"`` also passes its indexer.
RANK_LOCAL_INDEXER_KEYWORDS = ("order", "out_ids")


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
        order: str = "global_id",
        out_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Local stable top-``k`` of each row, packed for the all-gather.

        With ``order="rank_local"`` (the step passes ``order`` and ``out_ids`` only then, so a stage for the
        ``global_id`` order alone may omit both) the stage
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
            out: optional float32 ``[T, k, 2]`` buffer (``[T, k]`` with ``order="rank_local"``).
            order: ``"global_id"`` or ``"rank_local"`` (:data:`ORDERS`).
            out_ids: optional int32 ``[T, k]`` buffer of the local indices (``order="rank_local"``).
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


class CorrectStage(Protocol):
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
