"""The kernel stage provider: what runs where, and the attention picked per planned shape from the measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dcp_ref.geometry import DcpGeometry
from dcp_ref.kernels import stages as ks
from dcp_ref.stages import REFERENCE_STAGES, StepSpec

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_the_split_kv_crossover_is_the_measured_one() -> None:
    """At every T of the main table (H = 128, K = 2048, bf16, graph replay; FlashMLA at its planned splits) the
    rule's kernel is the faster, or within 5 % of it (this table and the sweep are separate measurements)."""
    rows = json.loads((RESULTS / "attention.json").read_text())["summary"]
    by = {(r["impl"], r["T"]): r["graph_us"] for r in rows if r["H"] == 128 and r["K"] == 2048 and r["cache"] == "bf16"}
    ts = sorted({t for impl, t in by if impl == "splitkv" and ("flashmla_bf16", t) in by})
    assert len(ts) >= 4
    for t in ts:
        rule = "splitkv" if t <= ks.SPLITKV_MAX_TOKENS else "flashmla_bf16"
        other = "flashmla_bf16" if rule == "splitkv" else "splitkv"
        assert by[(rule, t)] <= 1.05 * by[(other, t)], (t, by)


def test_the_flashmla_plan_constants_are_the_sweeps() -> None:
    """``FLASHMLA_SPLITS`` and ``SPLITKV_MAX_TOKENS`` are what ``tools/flashmla_splits_table.py`` derives from the
    committed sweep; at every swept shape the planned splits are within 5 % of that shape's fastest, and the
    planned kernel (split-KV up to the crossover, FlashMLA beyond) is the faster of the two measured in that run."""
    import sys

    sys.path.insert(0, str(RESULTS.parents[1]))
    from dcp_ref.kernels import flashmla_sparse as fm
    from tools import flashmla_splits_table as tbl

    d = json.loads((RESULTS / "attention_flashmla_splits.json").read_text())
    table = tbl.splits_table(d["flashmla_splits_best"], d["flashmla_splits"])
    assert fm.FLASHMLA_SPLITS == table and ks.SPLITKV_MAX_TOKENS == tbl.splitkv_max_tokens(d["flashmla_splits"], table)
    assert ks.SPLITKV_MAX_TOKENS_UNSPLIT == tbl.splitkv_max_tokens(d["flashmla_splits"], ())
    rows = [r for r in d["flashmla_splits"] if "count" not in r and r.get("graph_us")]
    for b in d["flashmla_splits_best"]:
        want = ("flashmla_bf16", b["T"], b["H"], fm.flashmla_splits(b["T"], b["H"]))
        planned = next(r["graph_us"] for r in rows if (r["impl"], r["T"], r["H"], r.get("splits")) == want)
        assert planned <= 1.05 * b["graph_us"], b
        if b["H"] == 128:
            split_kv = b["T"] <= ks.SPLITKV_MAX_TOKENS
            assert (b["splitkv_us"] < planned) == split_kv, (b, planned)
    assert all(r.get("rel_err") is None or r["rel_err"] < 1e-2 for r in d["flashmla_splits"])
    from dcp_ref.costmodel import CostConstants

    c = CostConstants()  # the cost model plans as the step does
    assert (c.splitkv_max_tokens, c.splitkv_max_tokens_unsplit, c.flashmla_splits_keys) == (
        ks.SPLITKV_MAX_TOKENS, ks.SPLITKV_MAX_TOKENS_UNSPLIT, fm.FLASHMLA_SPLITS_KEYS)  # fmt: skip


@pytest.mark.parametrize("T,expected", [(1, "split"), (2, "split"), (3, "mla"), (128, "mla")])
def test_prepare_plans_the_attention_by_token_count(T, expected) -> None:
    def mla(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError

    def split(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError

    spec = StepSpec(DcpGeometry(1, 0), max_tokens=T, topk=2048, num_heads=128, head_dim=576, v_dim=512,
                    sm_scale=0.1, dtype=torch.bfloat16, device="cpu")  # fmt: skip
    impl = {"select": "torch", "select_to_slots": "torch"}
    chosen = ks._prepare(
        spec,
        REFERENCE_STAGES,
        template=REFERENCE_STAGES,
        impl=impl,
        alternatives={"flashmla": mla, "triton-splitkv": split},
    )
    assert chosen is not None
    assert chosen.attention is (split if expected == "split" else mla)
    assert "attention" in dict(chosen.notes) and str(ks.SPLITKV_MAX_TOKENS) in dict(chosen.notes)["attention"]
    assert (
        ks._prepare(spec, REFERENCE_STAGES, template=REFERENCE_STAGES, impl=impl, alternatives={"flashmla": mla})
        is None
    )  # one candidate: nothing to pick


@pytest.mark.parametrize(
    "layout,W,T,splits",
    [("dcp", 1, 32, 2), ("dcp", 1, 8, 4), ("dcp", 1, 2, None), ("dcp", 8, 32, 1), ("dcp", 2, 8, None),
     ("dcp", 2, 9, 1), ("tp", 2, 32, 4), ("dcp", 1, 128, 1)],
)  # fmt: skip
def test_prepare_plans_flashmla_splits_for_all_k_slots_only(layout, W, T, splits) -> None:
    """FlashMLA's splits come from the measured table where a token uses all ``k = 2048`` slots (one rank, or tp);
    a DCP rank's ``k / W`` share runs unsplit (measured slower split); up to the crossover split-KV runs — against
    split FlashMLA ``SPLITKV_MAX_TOKENS``, against unsplit ``SPLITKV_MAX_TOKENS_UNSPLIT``."""
    from dcp_ref.kernels import flashmla_sparse as fm

    spec = StepSpec(DcpGeometry(W, 0), max_tokens=T, topk=2048, num_heads=128, head_dim=576, v_dim=512,
                    sm_scale=0.1, dtype=torch.bfloat16, device="cpu", layout=layout)  # fmt: skip
    impl = {"select": "torch", "select_to_slots": "torch"}
    alternatives = {"flashmla": ks._attention_flashmla, "triton-splitkv": ks._attention_splitkv}
    chosen = ks._prepare(spec, REFERENCE_STAGES, template=REFERENCE_STAGES, impl=impl, alternatives=alternatives)
    assert chosen is not None
    # the planned step's own stage object, bound to buffers of its own (never the provider's unbound one)
    assert chosen.attention is not ks._attention_splitkv and chosen.attention is not ks._attention_flashmla
    if splits is None:
        assert isinstance(chosen.attention, ks._SplitKVAttention)
        return
    assert isinstance(chosen.attention, ks._FlashMLAAttention) and chosen.attention.splits == splits
    assert isinstance(chosen.attention.scratch, fm.FlashMLAScratch)
    heads = spec.attention_heads
    assert splits == fm.flashmla_splits(T, heads, 2048 if layout == "tp" or W == 1 else 2048 // W)


def test_prepare_runs_the_reference_select_past_the_cutedsl_limit(caplog) -> None:
    """A step planned for more gathered candidates per row (W * k) than the CuTeDSL top-K holds: the select stage
    becomes the reference, logged and named in the notes (no compile, no warm-up launch); within the limit the
    kernels' stage stays (checked on the GPU by the planned-step tests)."""
    import logging

    pytest.importorskip("cutlass")
    from dcp_ref.kernels.topk_cutedsl import MAX_CANDIDATES

    ks._log_fallback.cache_clear()
    k = MAX_CANDIDATES // 2 + 1
    spec = StepSpec(DcpGeometry(2, 0), max_tokens=1, topk=k, num_heads=128, head_dim=576, v_dim=512, sm_scale=0.1,
                    dtype=torch.bfloat16, device="cpu")  # fmt: skip
    stages = REFERENCE_STAGES.with_(select=ks._select_cutedsl)
    impl = {"select": "cutedsl", "select_to_slots": "torch"}
    with caplog.at_level(logging.WARNING, logger="dcp_ref.kernels.stages"):
        chosen = ks._prepare(spec, stages, template=stages, impl=impl, alternatives={})
    assert chosen is not None and chosen.select is REFERENCE_STAGES.select
    assert f"{2 * k} gathered candidates per row > {MAX_CANDIDATES}" in dict(chosen.notes)["select"]
    assert any("'select' runs the torch reference" in r.getMessage() for r in caplog.records)


def test_interpreted_kernels_cover_the_new_stages(kernel_device) -> None:
    if kernel_device.type != "cpu":
        pytest.skip("the interpreter's choice")
    spec = StepSpec(DcpGeometry(1, 0, 1, 64), max_tokens=1, topk=8, num_heads=1, head_dim=8, v_dim=8, sm_scale=0.1,
                    dtype=torch.float32, device="cpu")  # fmt: skip
    impls = ks.kernel_stages(spec).impls()
    assert impls["scoring"] == "triton" and "scored_indexer" not in impls
    assert impls["guard"] == "triton" and impls["combine"] == "triton" and impls["indexer"] == "fused"
    assert impls["select"] == impls["select_to_slots"] == impls["attention"] == "torch"  # CUDA only


def test_prepare_binds_the_stateful_stages_to_each_planned_step(kernel_device) -> None:
    """The plan owns what a stage keeps: ``prepare(spec)`` gives every planned step its own fused indexer (its own
    workspaces, made per shape and reused), never the provider's unbound one (which keeps nothing: per call)."""
    if kernel_device.type != "cpu":
        pytest.skip("the interpreter's choice")
    spec = StepSpec(DcpGeometry(1, 0, 1, 64), max_tokens=2, topk=4, num_heads=1, head_dim=8, v_dim=8, sm_scale=0.1,
                    dtype=torch.float32, device="cpu")  # fmt: skip
    st = ks.kernel_stages(spec)
    assert st.indexer is ks._indexer_fused and st.indexer._workspaces is None
    a, b = st.prepare(spec, st), st.prepare(spec, st)
    assert a is not None and b is not None
    assert isinstance(a.indexer, ks._FusedIndexer) and a.indexer is not b.indexer is not st.indexer
    assert a.impls() == st.impls() and a.indexer._workspaces == {}
    scores = torch.randn(2, 40, generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([40, 7], dtype=torch.int32)
    want = st.indexer(scores, lengths, spec.geometry, 4)
    got = a.indexer(scores, lengths, spec.geometry, 4)
    assert torch.equal(got, want)
    (key,) = a.indexer._workspaces
    first, plan = a.indexer._workspaces[key], a.indexer._plans[key]  # the shape's plan, made with its workspace
    assert (plan.rows, plan.n_cols, plan.k) == (2, 40, 4) and set(a.indexer._plans) == {key}
    a.indexer(scores, lengths, spec.geometry, 4)
    assert a.indexer._workspaces[key] is first and a.indexer._plans[key] is plan and b.indexer._workspaces == {}
    with pytest.raises(TypeError, match=r"spec must be a dcp_ref\.stages\.StepSpec"):
        ks.kernel_stages("cpu")  # type: ignore[arg-type]


def test_stages_taken_from_a_step_are_bound_again_by_the_next_plan() -> None:
    """``step.stages`` handed to another plan (a test harness does this for each rank of a SimulatedWorld): every
    stateful stage is bound again, so the two steps never share a split-KV workspace, FlashMLA scratch or indexer
    workspace (on the H200 two ranks sharing one split-KV workspace read each other's partials); its choice of
    implementation is kept."""
    from dcp_ref.group import SingleGroup
    from dcp_ref.step import PlannedStep

    spec = StepSpec(DcpGeometry(1, 0, 1, 64), max_tokens=2, topk=4, num_heads=1, head_dim=8, v_dim=8, sm_scale=0.1,
                    dtype=torch.float32, device="cpu")  # fmt: skip
    for attention in (ks._SplitKVAttention(), ks._FlashMLAAttention(1)):
        first = PlannedStep(SingleGroup(), spec, ks.kernel_stages(spec).with_(attention=attention))
        again = PlannedStep(SingleGroup(), spec, first.stages)
        assert type(again.stages.attention) is type(attention) is type(first.stages.attention)
        assert again.stages.attention is not first.stages.attention is not attention
        assert again.stages.indexer is not first.stages.indexer


def test_prepare_keeps_a_stage_the_caller_replaced() -> None:
    """``kernel_stages(spec).with_(attention=mine)`` plans with ``mine``: the provider's hook binds and chooses
    only its own stages (before, it rebuilt them from the provider's template and dropped the replacement)."""
    from dcp_ref.group import SingleGroup
    from dcp_ref.stages import reference_attention, reference_indexer
    from dcp_ref.step import PlannedStep

    spec = StepSpec(DcpGeometry(1, 0, 1, 64), max_tokens=2, topk=4, num_heads=1, head_dim=8, v_dim=8, sm_scale=0.1,
                    dtype=torch.float32, device="cpu")  # fmt: skip

    def my_attention(q, kv_cache, slots, counts, sm_scale, v_dim, *, out=None, out_lse=None):
        return reference_attention(q, kv_cache, slots, counts, sm_scale, v_dim, out=out, out_lse=out_lse)

    mine = ks.kernel_stages(spec).with_(attention=my_attention, indexer=reference_indexer)
    step = PlannedStep(SingleGroup(), spec, mine)
    assert step.stages.attention is my_attention and step.stages.indexer is reference_indexer
    plain = PlannedStep(SingleGroup(), spec, ks.kernel_stages(spec))
    assert plain.stages.indexer is not reference_indexer  # the provider's own stage, bound to this step


def test_the_combine_launch_is_the_best_of_its_committed_sweep() -> None:
    """The all-to-all combine's launch shape per (W, T) is the measured winner of benchmarks/results/combine_sweep.json
    (H200), and a shape between the swept ones takes the entry at or below it."""
    import json
    from pathlib import Path

    from dcp_ref.kernels.stages import COMBINE_LAUNCH, combine_launch

    doc = json.loads((Path(__file__).resolve().parents[1] / "benchmarks/results/combine_sweep.json").read_text())
    assert len(doc["rows"]) == len(COMBINE_LAUNCH) == 9 and "H200" in doc["device"]
    for r in doc["rows"]:
        assert combine_launch(r["W"], r["T"]) == (r["best"]["block_h"], r["best"]["num_warps"])
        assert r["best"]["max_rel_err"] < 1e-2 and r["best"]["median_us"] <= r["default"]["median_us"]
    assert combine_launch(16, 64) == COMBINE_LAUNCH[(8, 32)] and combine_launch(3, 0) == COMBINE_LAUNCH[(2, 1)]
