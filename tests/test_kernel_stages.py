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
    """At every measured T (H = 128, K = 2048, bf16, graph replay) the rule picks the faster of the two kernels."""
    rows = json.loads((RESULTS / "attention.json").read_text())["summary"]
    by = {(r["impl"], r["T"]): r["graph_us"] for r in rows if r["H"] == 128 and r["K"] == 2048 and r["cache"] == "bf16"}
    ts = sorted({t for impl, t in by if impl == "splitkv" and ("flashmla_bf16", t) in by})
    assert len(ts) >= 4
    for t in ts:
        faster = "splitkv" if by[("splitkv", t)] < by[("flashmla_bf16", t)] else "flashmla_bf16"
        rule = "splitkv" if t <= ks.SPLITKV_MAX_TOKENS else "flashmla_bf16"
        assert faster == rule, (t, by[("splitkv", t)], by[("flashmla_bf16", t)])


@pytest.mark.parametrize("T,expected", [(1, "split"), (8, "split"), (9, "mla"), (128, "mla")])
def test_prepare_plans_the_attention_by_token_count(T, expected) -> None:
    def mla(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError

    def split(*a, **k):  # type: ignore[no-untyped-def]
        raise AssertionError

    spec = StepSpec(DcpGeometry(1, 0), max_tokens=T, topk=4, num_heads=128, head_dim=576, v_dim=512, sm_scale=0.1,
                    dtype=torch.bfloat16, device="cpu")  # fmt: skip
    impl = {"select": "torch", "select_to_slots": "torch"}
    chosen = ks._prepare(spec, REFERENCE_STAGES, impl, {"flashmla": mla, "triton-splitkv": split})
    assert chosen is not None
    assert chosen.attention is (split if expected == "split" else mla)
    assert "attention" in dict(chosen.notes) and str(ks.SPLITKV_MAX_TOKENS) in dict(chosen.notes)["attention"]
    assert ks._prepare(spec, REFERENCE_STAGES, impl, {"flashmla": mla}) is None  # one candidate: nothing to pick


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
        chosen = ks._prepare(spec, stages, impl, {})
    assert chosen is not None and chosen.select is REFERENCE_STAGES.select
    assert f"{2 * k} gathered candidates per row > {MAX_CANDIDATES}" in dict(chosen.notes)["select"]
    assert any("'select' runs the torch reference" in r.getMessage() for r in caplog.records)


def test_interpreted_kernels_cover_the_new_stages(kernel_device) -> None:
    if kernel_device.type != "cpu":
        pytest.skip("the interpreter's choice")
    impls = ks.kernel_stages("cpu", torch.float32, 8, 8).impls()
    assert impls["scoring"] == "triton" and "scored_indexer" not in impls
    assert impls["guard"] == "triton" and impls["combine"] == "triton" and impls["indexer"] == "fused"
    assert impls["select"] == impls["select_to_slots"] == impls["attention"] == "torch"  # CUDA only
