"""dcp_ref.viz.dataflow: chapter 00's picture of one layer's decode across ranks, shapes and bytes.

Byte counts are checked against the arithmetic written out here (float32 (score, id) pairs,
float32 LSEs, bf16 queries and outputs), not against the cost model the module uses.
"""

from __future__ import annotations

import matplotlib
import pytest

from dcp_ref.costmodel import MlaGeometry
from dcp_ref.options import PLANNED, LayerOptions
from dcp_ref.viz.dataflow import (
    COLLECTIVE_NAMES,
    CountingGroup,
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
