"""dcp-ref: decode context parallelism (DCP) for DeepSeek sparse attention over MLA.

The plain-PyTorch reference of every stage (the oracle), CPU-first:

1. :mod:`dcp_ref.ownership` — which rank owns which token; global lengths made local.
2. local top-K (the indexer) — each rank scores its own keys.
3. stable global top-K across ranks.
4. de-interleave global ids to physical KV slots, and compaction.
5. sparse MLA attention and the LSE merge of partial outputs.

Fast kernels live in :mod:`dcp_ref.kernels` (Triton, CuTeDSL, FlashInfer); importing
:mod:`dcp_ref` needs only torch and numpy.
"""

from .ownership import (
    PrefillChunkMetadata,
    expand_decode_bounds,
    global_to_local,
    local_seq_lens,
    local_to_global,
    localize_decode_bounds,
    localize_decode_bounds_wrong_order,
    localize_prefill_chunk,
    owner_rank,
)

__version__ = "0.1.0"

__all__ = [
    "PrefillChunkMetadata",
    "expand_decode_bounds",
    "global_to_local",
    "local_seq_lens",
    "local_to_global",
    "localize_decode_bounds",
    "localize_decode_bounds_wrong_order",
    "localize_prefill_chunk",
    "owner_rank",
]
