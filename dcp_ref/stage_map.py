"""Where every stage lives: its reference, its kernels, the chapter that teaches it, the benchmark that times it.

:data:`STAGE_MAP` is the single source of the README's stage table, chapter 00's, the API page and CONTRIBUTING
(``tests/test_stage_map.py`` checks that they agree with it).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StageInfo", "AWAITING_DEVICE", "STAGE_MAP"]


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
              ("flashmla_sparse", "attention_splitkv_triton", "flashinfer_mla", "flashmla_fp8"),
              "06_splitkv_correct_combine", "bench_attention.py", "attention.json"),
    StageInfo("guard", "tokens whose metadata is out of contract -> NaN output and LSE",
              "dcp_ref.guard:reference_guard", ("guard_triton",), "07_end_to_end", "bench_layer.py", "layer.json"),
    StageInfo("correct", "this rank's partial corrected by the all-gathered LSEs, then reduce-scattered over heads",
              "dcp_ref.lse:correct_partial", ("lse_merge_triton",), "06_splitkv_correct_combine", "bench_lse_merge.py",
              "lse_merge.json"),
    StageInfo("combine", "after one all-to-all: the W partials of this rank's H/W heads merged by their LSEs",
              "dcp_ref.lse:merge_partials", ("lse_merge_triton",), "06_splitkv_correct_combine", "bench_exchange.py",
              "exchange.json"),
)  # fmt: skip
