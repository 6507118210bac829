"""dcp-ref: decode context parallelism (DCP) for DeepSeek sparse attention over MLA.

The plain-PyTorch reference of every stage (the oracle), CPU-first:

1. :mod:`dcp_ref.ownership` — which rank owns which token; global lengths made local.
2. :mod:`dcp_ref.indexer` — each rank's local top-K over the indexer scores of its own keys.
3. :mod:`dcp_ref.topk` — candidates packed as (score, global id), all-gathered, stable global top-K.
4. :mod:`dcp_ref.deinterleave` — global ids to this rank's physical KV slots, compacted to the front.
5. :mod:`dcp_ref.attention`, :mod:`dcp_ref.lse` — sparse MLA attention and the LSE merge of partials.

:mod:`dcp_ref.pipeline` composes the five on W ranks (:mod:`dcp_ref.group`) and checks them against
single-device sparse attention; :mod:`dcp_ref.prefill` runs them for a prefill chunk, whose indexer
scores cover all the chunk's requests side by side.

The contract types are exported here: :class:`DcpGeometry` (one rank's geometry, validated once),
:class:`StepSpec` / :class:`ScoringSpec` (what a planned step runs), :class:`Stages` with
:data:`REFERENCE_STAGES` and :data:`STAGE_MAP` (the stage protocol), :class:`PlannedStep`,
:class:`StepMetadata`, :class:`RankShard`, :func:`decode_metadata` / :func:`prefill_metadata`, and
:data:`POISON_SLOT`. The teaching examples of deliberate bugs stay in their modules
(:func:`dcp_ref.ownership.localize_decode_bounds_wrong_order`, :func:`dcp_ref.lse.merge_partials_naive_add`,
:func:`dcp_ref.topk.union_counterexample`).

Fast kernels live in :mod:`dcp_ref.kernels` (Triton, CuTeDSL, FlashMLA, FlashInfer); importing
:mod:`dcp_ref` needs only torch and numpy, and never imports :mod:`dcp_ref.kernels`.
"""

from .attention import sparse_mla_attention
from .deinterleave import (
    POISON_SLOT,
    canonicalize,
    compact_to_front,
    deinterleave_and_compact,
    deinterleave_masked,
    global_ids_to_local_slots,
)
from .geometry import DcpGeometry
from .group import Group, SimulatedWorld, SingleGroup, TorchDistributedGroup
from .indexer import local_topk
from .lse import (
    LN2,
    correct_partial,
    dcp_merge_collective,
    lse_base2_to_e,
    lse_e_to_base2,
    merge_partials,
    normalize_lse_shape,
)
from .ownership import (
    PrefillChunkMetadata,
    expand_decode_bounds,
    global_to_local,
    local_seq_lens,
    local_to_global,
    localize_decode_bounds,
    localize_prefill_chunk,
    owner_rank,
)
from .scoring import index_scores
from .select_to_slots import select_to_slots
from .stages import REFERENCE_STAGES, STAGE_MAP, ScoringSpec, Stages, StepSpec
from .step import PlannedStep, RankShard, StepMetadata, decode_metadata, prefill_metadata
from .topk import (
    INVALID_KEY,
    MAX_EXACT_ID,
    global_topk_all_logits,
    merge_topk_global,
    pack_candidates,
    stable_key,
    stable_topk,
)

__version__ = "0.1.0"

__all__ = [
    # the contract types
    "DcpGeometry",
    "StepSpec",
    "ScoringSpec",
    "Stages",
    "REFERENCE_STAGES",
    "STAGE_MAP",
    "PlannedStep",
    "StepMetadata",
    "RankShard",
    "decode_metadata",
    "prefill_metadata",
    "POISON_SLOT",
    # the stages' reference functions
    "select_to_slots",
    "index_scores",
    "INVALID_KEY",
    "LN2",
    "MAX_EXACT_ID",
    "Group",
    "PrefillChunkMetadata",
    "SimulatedWorld",
    "SingleGroup",
    "TorchDistributedGroup",
    "canonicalize",
    "compact_to_front",
    "correct_partial",
    "dcp_merge_collective",
    "deinterleave_and_compact",
    "deinterleave_masked",
    "global_ids_to_local_slots",
    "global_topk_all_logits",
    "local_topk",
    "lse_base2_to_e",
    "lse_e_to_base2",
    "merge_partials",
    "merge_topk_global",
    "normalize_lse_shape",
    "pack_candidates",
    "sparse_mla_attention",
    "stable_key",
    "stable_topk",
    "expand_decode_bounds",
    "global_to_local",
    "local_seq_lens",
    "local_to_global",
    "localize_decode_bounds",
    "localize_prefill_chunk",
    "owner_rank",
]
