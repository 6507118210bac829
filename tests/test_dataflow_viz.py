"""dcp_ref.viz.dataflow: chapter 00's picture of one layer's decode across ranks, shapes and bytes.

Byte counts of the default layer are checked against the arithmetic written out here (float32 (score, id)
pairs, float32 LSEs, bf16 queries and outputs); those of every layer against the cost model's functions for the
same options, and its collectives against the planned step's parts (dcp_ref.axes).
"""

from __future__ import annotations

from typing import Any

import matplotlib
import pytest

from dcp_ref import costmodel
from dcp_ref.costmodel import MlaGeometry
from dcp_ref.options import DEFAULT, PLANNED, LayerOptions
from dcp_ref.viz.dataflow import (
    COLLECTIVE_NAMES,
    VLLM_LAYER,
    CountingGroup,
    collective_bytes,
    dataflow_table,
    draw_layer_dataflow,
    format_bytes,
    kv_cache_per_rank,
    layer_dataflow,
    step_collectives,
)

matplotlib.use("Agg")

ORDER = [
    "query projection",
    "query all-gather over heads",
    "indexer: local top-K",
    "pack (score, global id)",
    "candidates all-gather",
    "stable top-K (select)",
    "deinterleave + compaction",
    "attention (all H heads, this rank's keys)",
    "LSE all-gather",
    "correct (rescale by its weight)",
    "output reduce-scatter over heads",
    "value up-projection + output projection",
]


@pytest.mark.parametrize("w", [1, 2, 4, 8])
@pytest.mark.parametrize("geo", [MlaGeometry(), MlaGeometry(num_heads=16, topk=512, local_topk=256)])
def test_steps_shapes_and_bytes_per_token(w: int, geo: MlaGeometry) -> None:
    steps = layer_dataflow(w, geo)
    assert steps == layer_dataflow(w, geo, options=VLLM_LAYER) and VLLM_LAYER == LayerOptions(q_replicate=False)
    if w == 1:  # one rank's cache: no collective, no pack or select; the local top-K is the answer
        assert [s.name for s in steps] == [ORDER[0], ORDER[2], ORDER[6], ORDER[7], ORDER[11]]
        assert steps[0].shape == f"q [T, {geo.num_heads}, 576] bf16"
        return
    assert [s.name for s in steps] == ORDER
    by = {s.name: s for s in steps}
    H, K, k = geo.num_heads, geo.local_topk, geo.topk
    assert [s.name for s in steps if s.collective] == [
        "query all-gather over heads",
        "candidates all-gather",
        "LSE all-gather",
        "output reduce-scatter over heads",
    ]
    # (sent, received, on links) per query token
    q = by["query all-gather over heads"]
    assert (q.sent, q.received, q.link) == (2 * 576 * H // w, 2 * 576 * H, 2 * 576 * H // w * (w - 1))
    c = by["candidates all-gather"]
    assert (c.sent, c.received, c.link) == (8 * K, 8 * w * K, 8 * (w - 1) * K)
    lse = by["LSE all-gather"]
    assert (lse.sent, lse.received, lse.link) == (4 * H, 4 * w * H, 4 * (w - 1) * H)
    rs = by["output reduce-scatter over heads"]
    full = 2 * H * 512
    assert (rs.sent, rs.received, rs.link) == (full, full // w, full * (w - 1) // w)
    # An all-reduce would move twice the reduce-scatter's bytes.
    assert format_bytes(2 * full * (w - 1) // w) in rs.note
    # Who holds what: H/W heads before the query gather and after the reduce-scatter, H between.
    assert by["query projection"].shape == f"q [T, {H // w}, 576] bf16"
    assert q.shape == f"q [T, {H}, 576] bf16"
    assert by["attention (all H heads, this rank's keys)"].shape.startswith(f"out [T, {H}, 512] bf16")
    assert rs.shape == f"out [T, {H // w}, 512] bf16"
    assert c.shape == f"[{w}, T, {K}, 2] f32" and by["stable top-K (select)"].shape == f"ids [T, {k}] int32"


def test_kv_saved_per_rank() -> None:
    c, w = 131072, 4
    kv = kv_cache_per_rank(c, w)
    assert kv["tp"] == c * 576 * 2 * 61
    assert kv["dcp"] == kv["tp"] // w and kv["saved"] == kv["tp"] - kv["dcp"]
    fp8 = kv_cache_per_rank(1000, 8, MlaGeometry(kv_layout="fp8"))
    assert fp8["tp"] == 1000 * 656 * 61 and fp8["dcp"] == 125 * 656 * 61


def test_table_and_bad_input() -> None:
    table = dataflow_table(4)
    lines = table.splitlines()
    assert len(lines) == 1 + len(ORDER)
    cand = next(line for line in lines if "candidates all-gather" in line)
    assert cand.startswith(">> ") and cand.split()[-6:] == ["16.0", "KiB", "64.0", "KiB", "48.0", "KiB"]
    with pytest.raises(ValueError, match="world_size must divide num_heads=128"):
        layer_dataflow(3)
    with pytest.raises(ValueError, match="world_size"):
        layer_dataflow(0)
    with pytest.raises(ValueError, match="dpi must be <= 80"):
        draw_layer_dataflow(4, dpi=100)
    assert [format_bytes(x) for x in (512, 1536, 3 * 2**20, 2**31)] == ["512 B", "1.5 KiB", "3.0 MiB", "2.0 GiB"]


def test_figure_labels_the_bytes_and_the_kv_saving() -> None:
    import matplotlib.pyplot as plt

    fig = draw_layer_dataflow(4, context=8192, dpi=60)
    try:
        assert fig.dpi <= 80
        texts = [t.get_text() for ax in fig.axes for t in ax.texts]
        assert "sends 16.0 KiB, receives 64.0 KiB per token" in texts  # 8·K and 8·W·K, K = 2048
        assert "sends 512 B, receives 2.0 KiB per token" in texts  # 4·H and 4·W·H, H = 128
        assert [f"rank {r}" for r in range(4)] == [t for t in texts if t.startswith("rank ")]
        bars = fig.axes[1].patches
        tp, dcp = 8192 * 1152 * 61, 8192 * 1152 * 61 // 4
        assert sorted(b.get_width() for b in bars) == pytest.approx([dcp / 2**30, tp / 2**30])
        assert f"  saves {format_bytes(tp - dcp)} per rank" in [t.get_text() for t in fig.axes[1].texts]
    finally:
        plt.close(fig)


_OP = {
    "query all-gather over heads": "all_gather",
    "candidates all-gather": "all_gather",
    "LSE all-gather": "all_gather",
    "output reduce-scatter over heads": "reduce_scatter",
    "partials all-to-all": "all_to_all",
}


@pytest.mark.parametrize("W", [1, 2, 3])
@pytest.mark.parametrize("layout", ["dcp", "tp"])
@pytest.mark.parametrize("exchange", ["allgather", "owner"])
@pytest.mark.parametrize("combine", ["reduce_scatter", "alltoall"])
@pytest.mark.parametrize("q_replicate", [True, False])
def test_step_collectives_are_the_ones_a_run_calls(W, layout, exchange, combine, q_replicate) -> None:
    """Every choice of the spec, run on simulated ranks through a CountingGroup: the calls a run really makes
    are the ones step_collectives reads off the spec (2 to 4 for a DCP layer over W > 1 ranks, none for tp)."""
    import torch

    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.group import SimulatedWorld
    from dcp_ref.pipeline import make_dcp_problem
    from dcp_ref.stages import StepSpec
    from dcp_ref.step import PlannedStep

    Wc = W if layout == "dcp" else 1
    p = make_dcp_problem(Wc, 1, seq_lens=[11, 6], next_n=1, num_heads=2 * W, head_dim=8, block_size=2, seed=W)
    world = SimulatedWorld(W)

    def body(group, _):
        g = DcpGeometry(W, group.rank, 1, 2)
        options = LayerOptions(layout=layout, exchange=exchange, combine=combine, q_replicate=q_replicate)
        spec = StepSpec.for_options(g, options, max_tokens=2, topk=3, num_heads=2 * W, head_dim=8, v_dim=8,
                                    sm_scale=0.3, dtype=torch.float64, device="cpu")  # fmt: skip
        counting = CountingGroup(group)
        step = PlannedStep(counting, spec)
        r = group.rank if layout == "dcp" else 0
        Hs = spec.heads_per_rank
        q = p.q if spec.query_heads == spec.num_heads else p.q[:, group.rank * Hs : (group.rank + 1) * Hs].contiguous()
        step.run(q, p.shards[r], p.metadata(r))
        named = step_collectives(spec)
        assert named == step_collectives(options, W)  # the options alone name them
        return [op for op, _, _ in counting.calls], named

    for calls, named in world.run(body, [None] * W):
        assert set(named) <= set(COLLECTIVE_NAMES)
        assert calls == [_OP[n] for n in named]
        n = len(named)
        if layout == "tp" or W == 1:
            assert n == 0
        else:
            assert 2 <= n <= 4
            assert n == 2 + (not q_replicate) + (combine == "reduce_scatter")


def test_step_collectives_refuses_what_is_not_a_spec() -> None:
    with pytest.raises(TypeError, match="spec must be"):
        step_collectives({"layout": "dcp"})
    with pytest.raises(ValueError, match="world_size must be given"):
        step_collectives(PLANNED)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        step_collectives(PLANNED, 0)


def test_the_correction_is_labelled_in_base_e() -> None:
    """The merge weights are exp(lse_r - lse) of base-e LSEs (chapter 06): no base-2 label in the picture."""
    notes = " ".join(s.note for s in layer_dataflow(4))
    assert "exp(lse_r - lse)" in notes and "2^" not in notes


# ---- every layer: the planned step's collectives, the cost model's bytes ----------------------------
LAYERS = [DEFAULT, PLANNED, LayerOptions(layout="tp"), LayerOptions(combine="alltoall", q_replicate=False)]


def _spec(options: LayerOptions, W: int, geo: MlaGeometry) -> Any:
    import torch

    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.stages import StepSpec

    return StepSpec.for_options(DcpGeometry(W, 0, 1, 64), options, max_tokens=1, topk=geo.topk,
                                num_heads=geo.num_heads, head_dim=geo.qk_dim, v_dim=geo.v_dim, sm_scale=1.0,
                                dtype=torch.bfloat16, device="cpu")  # fmt: skip


def _cost_model_bytes(options: LayerOptions, W: int, geo: MlaGeometry) -> dict[str, costmodel.CollectiveBytes]:
    """Per-token bytes of each collective, as the cost model counts them for these options (by our names)."""
    if options.layout == "tp":
        assert costmodel.tp_step_cost(W, 1, 4096, geo, options=options).comm == {}
        return {}
    comm = costmodel.dcp_step_cost(W, 1, 4096, geo, scope="layer", options=options).comm
    if W == 1:
        assert comm == {}
        return {}
    # The byte functions where the option leaves the collective as they count it.
    if not options.q_replicate:
        assert comm["query_allgather"] == costmodel.query_allgather_bytes(1, W, geo)
    if options.order == "global_id":
        assert comm["candidates_allgather"] == costmodel.candidate_bytes(1, W, geo)
    else:  # scores only: half of the (score, id) pairs
        pairs = costmodel.candidate_bytes(1, W, geo)
        assert comm["candidates_allgather"] == costmodel.CollectiveBytes(*(b // 2 for b in (pairs.sent,
                                                                          pairs.received, pairs.link)))  # fmt: skip
    if options.combine == "reduce_scatter":
        assert comm["lse_allgather"] == costmodel.lse_bytes(1, W, geo)
        assert comm["output_reduce_scatter"] == costmodel.output_reduce_scatter_bytes(1, W, geo)
    names = {"query_allgather": COLLECTIVE_NAMES[0], "candidates_allgather": COLLECTIVE_NAMES[1],
             "lse_allgather": COLLECTIVE_NAMES[2], "output_reduce_scatter": COLLECTIVE_NAMES[3],
             "combine_alltoall": COLLECTIVE_NAMES[4]}  # fmt: skip
    return {names[k]: b for k, b in comm.items()}


@pytest.mark.parametrize("W", [1, 2, 8])
@pytest.mark.parametrize("options", LAYERS, ids=lambda o: o.label)
@pytest.mark.parametrize("geo", [MlaGeometry(), MlaGeometry(num_heads=16, topk=512, local_topk=512)])
def test_every_layer_runs_the_planned_collectives_with_the_cost_models_bytes(
    W: int, options: LayerOptions, geo: MlaGeometry
) -> None:
    from dcp_ref.axes import AllToAllCombine, ReduceScatterCombine, layer_collectives, stage_names

    spec = _spec(options, W, geo)
    steps = layer_dataflow(W, geo, options=options)
    coll = [s for s in steps if s.collective]
    assert [s.name for s in coll] == layer_collectives(spec)
    assert set(s.name for s in coll) <= set(COLLECTIVE_NAMES)
    want = _cost_model_bytes(options, W, geo)
    assert list(want) == [s.name for s in coll]  # the cost model prices the same collectives, in the same order
    assert {s.name: (s.sent, s.received, s.link) for s in coll} == {
        n: (b.sent, b.received, b.link) for n, b in want.items()
    }
    assert collective_bytes(W, geo, options=options) == want
    if options.layout == "tp" or W == 1:
        assert coll == []
    # The local steps that are stages run in the planned step's stage order (the guard and the indexer's
    # packing are no steps of their own here; names of the combine stages as the parts spell them).
    stage_of = {
        "indexer: local top-K": "indexer",
        "stable top-K (select)": "select",
        "deinterleave + compaction": "deinterleave",
        "select-to-slots (this rank's winners)": "select_to_slots",
        "attention (all H heads, this rank's keys)": "attention",
        "attention (H/W heads, all k keys)": "attention",
        "correct (rescale by its weight)": ReduceScatterCombine.stages[0],
        "combine the W partials (H/W heads)": AllToAllCombine.stages[0],
    }
    assert [stage_of[s.name] for s in steps if s.name in stage_of] == [
        n for n in stage_names(spec) if n not in ("guard", "scoring")
    ]
    # The cost model prices the same local stages, in the same order (its own names for scoring and collectives).
    cost = (costmodel.tp_step_cost if options.layout == "tp" else costmodel.dcp_step_cost)(
        W, 1, 4096, geo, options=options
    )
    priced = [n for n in cost.stages_s if n not in (*cost.comm, "index_scoring", "step_overhead")]
    assert priced == [n for n in stage_names(spec) if n not in ("guard", "scoring")]
    # Who holds what: the query as attention reads it, the output as the projection after it reads it.
    H, Hs = geo.num_heads, geo.num_heads // W
    attn = next(s for s in steps if s.name.startswith("attention"))
    q_heads = H if options.layout == "dcp" else Hs
    assert attn.shape.startswith(f"out [T, {q_heads}, {geo.v_dim}] bf16")
    before = steps[: steps.index(attn)]
    assert [s for s in before if s.shape.startswith("q ")][-1].shape == f"q [T, {q_heads}, {geo.qk_dim}] bf16"
    assert steps[-1].shape == f"[T, {Hs}] heads -> hidden"
    assert len(dataflow_table(W, geo, options=options).splitlines()) == 1 + len(steps)


def test_options_must_be_layer_options() -> None:
    for f in (layer_dataflow, dataflow_table, collective_bytes):
        with pytest.raises(TypeError, match=r"options must be a dcp_ref\.options\.LayerOptions, got dict"):
            f(4, options={"layout": "dcp"})
    with pytest.raises(TypeError, match=r"options must be a dcp_ref\.options\.LayerOptions, got str"):
        draw_layer_dataflow(4, options="dcp")


def test_figure_of_another_layer_names_it_and_its_all_to_all() -> None:
    import matplotlib.pyplot as plt

    fig = draw_layer_dataflow(4, context=8192, dpi=60, options=PLANNED)
    try:
        ax = fig.axes[0]
        assert ax.get_title(loc="left").endswith(": " + PLANNED.label)
        texts = [t.get_text() for t in ax.texts]
        assert "partials all-to-all" in texts and "LSE all-gather" not in texts
        a2a = collective_bytes(4, options=PLANNED)["partials all-to-all"]
        assert f"sends {format_bytes(a2a.sent)}, receives {format_bytes(a2a.received)} per token" in texts
    finally:
        plt.close(fig)
