"""dcp_ref.costmodel: units, limits, monotonicity, sharding, fitting and bad input.

Expected values are computed here from first principles (byte counts written out by hand, a
brute-force ownership count, fitting targets generated from formulas written in this file), never
copied from the module's output.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from dcp_ref import costmodel as cm
from dcp_ref.options import DEFAULT, PLANNED, LayerOptions

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
G = cm.MlaGeometry()
HW = cm.Hardware()


@pytest.fixture(scope="module")
def fitted() -> cm.Fit:
    return cm.fit_constants(RESULTS)


# ---- units ---------------------------------------------------------------------------------------
def test_kv_bytes_per_token_units() -> None:
    assert cm.kv_bytes_per_rank(1, 1, "tp") == 576 * 2 == 1152
    fp8 = cm.MlaGeometry(kv_layout="fp8")
    assert cm.kv_bytes_per_rank(1, 1, "tp", fp8) == 512 * 1 + 4 * 4 + 64 * 2 == 656
    assert isinstance(cm.kv_bytes_per_rank(65536, 8, "dcp"), int)
    assert cm.indexer_cache_bytes_per_rank(1000, 1, "tp") == 1000 * (128 + 4)


def test_collective_bytes_per_token() -> None:
    T, W = 3, 4
    c = cm.candidate_bytes(T, W)
    assert (c.sent, c.received, c.link) == (T * 8 * 2048, T * 8 * W * 2048, T * 8 * (W - 1) * 2048)
    lse = cm.lse_bytes(T, W)
    assert (lse.sent, lse.received) == (T * 4 * 128, T * 4 * W * 128)
    rs, ar = cm.output_reduce_scatter_bytes(T, W), cm.output_all_reduce_bytes(T, W)
    assert rs.sent == ar.sent == T * 128 * 512 * 2
    assert rs.received == T * (128 // W) * 512 * 2 and ar.received == T * 128 * 512 * 2
    assert ar.link == 2 * rs.link == 2 * (W - 1) * T * 128 * 512 * 2 // W
    q = cm.query_allgather_bytes(T, W)
    assert (q.sent, q.received) == (T * (128 // W) * 576 * 2, T * 128 * 576 * 2)


def test_times_are_seconds(fitted: cm.Fit) -> None:
    c = fitted.constants
    # the candidates' all-gather measured at 13.4 µs on 2 x H200: a time in seconds, ~1e-5
    t = cm.collective_time_s("all_gather", 32 * 2048 * 8, 2, c)
    assert 1e-6 < t < 1e-4
    step = cm.dcp_step_cost(8, 32, 65536, constants=c)
    assert 1e-5 < step.total_s < 1e-2 and all(v >= 0 for v in step.stages_s.values())
    assert step.total_s == pytest.approx(sum(step.stages_s.values()))


def test_attention_flops_and_bytes_by_hand() -> None:
    T, W, c = 32, 8, 65536
    d = cm.dcp_step_cost(W, T, c)
    assert d.attention_flops == pytest.approx(2 * T * 128 * (2048 / W) * (576 + 512))
    tp = cm.tp_step_cost(W, T, c)
    # 128 / 8 = 16 heads: FlashMLA cannot run them; the split-KV kernel runs exactly 16 (no padding)
    assert tp.attention_flops == pytest.approx(2 * T * 16 * 2048 * (576 + 512))
    assert tp.attention_hbm_bytes == pytest.approx(T * (2048 * 1152 + 16 * (576 * 2 + 512 * 2 + 4)))
    # 128 / 2 = 64 heads and T > splitkv_max_tokens: FlashMLA, as the planned step picks it
    tp2 = cm.tp_step_cost(2, T, c)
    assert tp2.attention_flops == pytest.approx(2 * T * 64 * 2048 * (576 + 512))
    small = cm.DEFAULT_CONSTANTS.splitkv_max_tokens  # up to the crossover: the split-KV kernel
    assert cm.tp_step_cost(2, small, c).stages_s["attention"] == pytest.approx(
        cm.DEFAULT_CONSTANTS.attention_splitkv.time_s(2 * small * 64 * 2048 * (576 + 512))
    )
    # short context: only c keys exist
    assert cm.tp_step_cost(1, 2, 100).attention_flops == pytest.approx(2 * 2 * 128 * 100 * 1088)


# ---- limits --------------------------------------------------------------------------------------
def test_world_size_one_has_no_communication(fitted: cm.Fit) -> None:
    for name, cb in cm.communication_bytes(16, 1).items():
        assert cb.link == 0, name
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        assert cm.collective_time_s(kind, 1 << 20, 1, fitted.constants) == 0.0
    d = cm.dcp_step_cost(1, 16, 5000, constants=fitted.constants)
    assert d.communication_s == 0.0 and d.communication_link_bytes == 0 and d.comm == {}
    assert not set(d.stages_s) & {"query_allgather", "candidates_allgather", "lse_allgather", "output_reduce_scatter"}
    # DCP over one rank is TP over one rank, stage by stage, for every layer option the two share
    assert d.stages_s == cm.tp_step_cost(1, 16, 5000, constants=fitted.constants).stages_s
    for exchange, order in (("allgather", "global_id"), ("owner", "global_id"), ("owner", "rank_local")):
        for combine in ("reduce_scatter", "alltoall"):
            for q_rep, scope, graph in itertools.product((False, True), ("step", "layer"), (False, True)):
                kw = dict(constants=fitted.constants, scope=scope, graph=graph)
                opt = LayerOptions(exchange=exchange, order=order, combine=combine, q_replicate=q_rep)
                dcp = cm.dcp_step_cost(1, 16, 5000, options=opt, **kw)
                tp = cm.tp_step_cost(1, 16, 5000, options=LayerOptions(exchange=exchange, order=order), **kw)
                assert dcp.stages_s == tp.stages_s and dcp.total_s == tp.total_s, (exchange, order, combine, q_rep)
    # rank_local reads 4 bytes per candidate (scores only), global_id 8, where candidates are exchanged (dcp,
    # W > 1); a tp layer exchanges nothing, whatever its options: its local top-K's ids go to the slot lookup.
    own = {
        o: cm.dcp_step_cost(2, 16, 5000, options=LayerOptions(exchange="owner", order=o)).stages_s["select_to_slots"]
        for o in ("global_id", "rank_local")
    }
    t = cm.DEFAULT_CONSTANTS.select_to_slots
    assert own == {"global_id": t.time_s(16 * 2 * 2048 * 8), "rank_local": t.time_s(16 * 2 * 2048 * 4)}
    tps = {o: cm.tp_step_cost(2, 16, 5000, options=LayerOptions(exchange="owner", order=o)).stages_s
           for o in ("global_id", "rank_local")}  # fmt: skip
    assert tps["global_id"] == tps["rank_local"] == cm.tp_step_cost(2, 16, 5000).stages_s
    assert "select_to_slots" not in tps["global_id"] and "deinterleave" in tps["global_id"]
    assert cm.crossover_context(1) == 0.0 and cm.time_crossover_context(1, 32) == 0.0


def test_collectives_grow_with_world_size(fitted: cm.Fit) -> None:
    prev = 0.0
    for w in (1, 2, 4, 8, 16, 32, 64):
        t = cm.dcp_step_cost(w, 32, 1 << 17, constants=fitted.constants).communication_s
        assert t >= prev
        prev = t
    # crossing hosts is slower than staying inside one (IB vs NVLink)
    c = fitted.constants
    inside = cm.collective_time_s("all_gather", 1 << 19, 8, c) / 7
    across = cm.collective_time_s("all_gather", 1 << 19, 16, c) / 15
    assert across > inside


# ---- monotonic in context --------------------------------------------------------------------------
@pytest.mark.parametrize("w", [1, 2, 8, 16])
def test_monotonic_in_context(w: int, fitted: cm.Fit) -> None:
    ctxs = [256, 1000, 2048, 4096, 8192, 30000, 65536, 131072, 1 << 20]
    for mode, fn in (("dcp", cm.dcp_step_cost), ("tp", cm.tp_step_cost)):
        times = [fn(w, 32, c, constants=fitted.constants).total_s for c in ctxs]
        assert times == sorted(times), mode
        kv = [cm.kv_bytes_per_rank(c, w, mode) for c in ctxs]
        assert kv == sorted(kv) and len(set(kv)) == len(kv)


# ---- sharding --------------------------------------------------------------------------------------
@pytest.mark.parametrize("w", [1, 2, 4, 8, 16, 64])
def test_dcp_kv_is_tp_kv_over_w(w: int) -> None:
    for c in (w * 1, w * 1000, w * 65536):
        for layout in ("bf16", "fp8"):
            g = cm.MlaGeometry(kv_layout=layout)
            assert cm.kv_bytes_per_rank(c, w, "dcp", g) * w == cm.kv_bytes_per_rank(c, w, "tp", g)
            assert cm.indexer_cache_bytes_per_rank(c, w, "dcp", g) * w == cm.indexer_cache_bytes_per_rank(c, w, "tp", g)


@pytest.mark.parametrize("w,i", [(2, 1), (3, 2), (4, 4), (8, 64)])
def test_busiest_rank_brute_force(w: int, i: int) -> None:
    for c in range(0, 3 * w * i + 5, max(1, i // 8)):
        per_rank = [sum(1 for p in range(c) if (p // i) % w == r) for r in range(w)]
        assert cm.tokens_on_busiest_rank(c, w, i) == max(per_rank), (c, w, i)


# ---- fitting ---------------------------------------------------------------------------------------
def test_fit_lines_recovers_known_constants() -> None:
    truth = {"select": (3e-6, 1 / 2.5e12), "attention": (2e-5, 1 / 6e14), "correct": (0.0, 1 / 3e12)}
    xs = [1e5, 3e6, 2e7, 1.5e8]
    obs = [
        cm.Observation(f, x * (1e7 if f == "attention" else 1), a + b * x * (1e7 if f == "attention" else 1), f"{x}")
        for f, (a, b) in truth.items()
        for x in xs
    ]
    lines, res = cm.fit_lines(obs)
    for f, (a, b) in truth.items():
        assert lines[f].fixed_s == pytest.approx(a, rel=1e-9, abs=1e-15)
        assert lines[f].per_unit_s == pytest.approx(b, rel=1e-9)
    assert max(abs(r.rel) for r in res) < 1e-9
    assert lines["attention"].unit == "flops"


def test_fit_lines_never_negative() -> None:
    # decreasing times cannot give a negative slope: the fit keeps a constant instead
    obs = [cm.Observation("pack", x, t, "") for x, t in ((1e3, 5e-6), (1e6, 4e-6), (1e7, 3e-6))]
    (line,) = cm.fit_lines(obs)[0].values()
    assert line.per_unit_s == 0 and line.fixed_s > 0


def test_fit_collectives_recovers_known_constants() -> None:
    a, hop, bw, eager = 7e-6, 1e-6, 150e9, 25e-6
    meas = []
    for kind, b in (("all_gather", 1 << 14), ("all_gather", 1 << 19), ("reduce_scatter", 1 << 22)):
        chunk = b if kind == "all_gather" else b / 2
        g = a + 1 * (hop + chunk / bw)  # W = 2: one ring step, written out here
        meas.append((kind, b, g + eager, g))
    consts, res = cm.fit_collectives(meas, world_size=2, hop_s=hop)
    assert consts["collective_s"] == pytest.approx(a, rel=1e-9)
    assert consts["link_Bps"] == pytest.approx(bw, rel=1e-9)
    assert consts["eager_collective_s"] == pytest.approx(eager, rel=1e-9)
    assert max(abs(r.rel) for r in res) < 1e-9


def test_fit_step_recovers_known_constants() -> None:
    kernels = cm.DEFAULT_CONSTANTS
    truth = kernels.replace(
        step_overhead_s=12e-6,
        hop_s=1.7e-6,
        local_topk=cm.LineCost(kernels.local_topk.fixed_s, 1 / 0.4e12),
        launch_s=4e-6,
        sync_s=30e-6,
    )
    pts = []
    for w in (2, 4, 8):
        for t in (1, 32, 128):
            for c in (8192, 65536, 131072):
                g = cm.dcp_step_cost(w, t, c, constants=truth, scope="step").total_s
                launches, syncs = 10 + w, (w % 3)
                pts.append(cm.StepPoint(w, t, c, "flashinfer", g, g + 4e-6 * launches + 30e-6 * syncs, launches, syncs))
    fit, res, notes = cm.fit_step(pts, kernels)
    assert fit.step_overhead_s == pytest.approx(12e-6, rel=1e-6)
    assert fit.hop_s == pytest.approx(1.7e-6, rel=1e-6)
    assert fit.local_topk.per_unit_s == pytest.approx(1 / 0.4e12, rel=1e-6)
    assert fit.launch_s == pytest.approx(4e-6, rel=1e-6) and fit.sync_s == pytest.approx(30e-6, rel=1e-6)
    assert max(abs(r.rel) for r in res) < 1e-6 and notes == []


def test_fit_step_keeps_what_it_cannot_identify() -> None:
    k = cm.DEFAULT_CONSTANTS
    step_s = {t: cm.dcp_step_cost(2, t, 65536, constants=k, scope="step").total_s for t in (1, 32, 128)}
    pts = [cm.StepPoint(2, t, 65536, "flashinfer", s + 5e-6) for t, s in step_s.items()]
    fit, _res, notes = cm.fit_step(pts, k)
    assert fit.hop_s == k.hop_s and fit.local_topk == k.local_topk
    assert fit.step_overhead_s == pytest.approx(5e-6, rel=1e-6)
    assert len(notes) == 2


def test_observations_match_the_committed_json() -> None:
    obs = cm.observations_from_results(RESULTS)
    topk = json.loads((RESULTS / "topk.json").read_text())["results"]
    sel = [o for o in obs if o.family == "select"]
    assert len(sel) == len(topk)
    r0 = topk[0]
    assert sel[0].seconds == pytest.approx(r0["cutedsl_graph"]["median_us"] / 1e6, rel=1e-12)
    assert sel[0].x == r0["rows"] * (8 * r0["W"] * r0["K"] + 4 * r0["k"])
    lse = json.loads((RESULTS / "lse_merge.json").read_text())["rows"]
    want = [r["correct_best"]["median_us"] / 1e6 for r in lse]
    assert [o.seconds for o in obs if o.family == "correct"] == pytest.approx(want, rel=1e-12)
    attn = json.loads((RESULTS / "attention_flashinfer.json").read_text())["rows"]
    fi = [o for o in obs if o.family == "attention" and not o.label.startswith("FlashMLA")]
    assert [o.x for o in fi] == [2.0 * r["T"] * r["H"] * r["K_valid"] * 1088 for r in attn]
    # attention.json (bf16 cache): FlashMLA rows join the attention family, the split-KV rows make their own
    summary = json.loads((RESULTS / "attention.json").read_text())["summary"]
    for impl, fam in (("flashmla_bf16", "attention"), ("splitkv", "attention_splitkv")):
        rows = [r for r in summary if r["impl"] == impl and r["cache"] == "bf16"]
        got = [o for o in obs if o.family == fam and (fam != "attention" or o.label.startswith("FlashMLA"))]
        assert [o.x for o in got] == [2.0 * r["T"] * r["H"] * r["K"] * 1088 for r in rows]
        assert [o.seconds for o in got] == pytest.approx([r["graph_us"] / 1e6 for r in rows], rel=1e-12)
    ex = json.loads((RESULTS / "exchange.json").read_text())["summary"]
    sts = [r for r in ex if r["stage"] == "select_to_slots"]
    got = [o for o in obs if o.family == "select_to_slots"]
    assert [o.x for o in got] == [r["rows"] * r["W"] * r["K"] * (4 if r["order"] == "rank_local" else 8) for r in sts]
    comb = [r for r in ex if r["stage"] == "combine_merge"]
    assert len([o for o in obs if o.family == "combine"]) == len(comb)
    de = json.loads((RESULTS / "deinterleave.json").read_text())
    keys = {(r["rows"], r["W"], r["I"]) for r in de["results"] if r["method"] in ("atomic", "rowscan", "twopass")}
    dobs = [o for o in obs if o.family == "deinterleave"]
    assert len(dobs) == len(keys)
    for o in dobs:
        rows, w, i = (int(p.split("=")[1]) for p in o.label.split())
        best = min(
            r["graph_us"]
            for r in de["results"]
            if (r["rows"], r["W"], r["I"]) == (rows, w, i)
            and r["method"] in ("atomic", "rowscan", "twopass")
            and r["correct"]
        )
        assert o.seconds == pytest.approx(best / 1e6, rel=1e-12)


def test_fit_to_committed_results(fitted: cm.Fit) -> None:
    obs = cm.observations_from_results(RESULTS)
    # one attention line: the rows of the other kernel (FlashInfer's, or FlashMLA's) are not fitted
    other = [
        o for o in obs if o.family == "attention" and o.label.startswith("FlashMLA") != (fitted.attention == "flashmla")
    ]
    n_obs = len(obs) - len(other)
    steps = cm.step_points_from_json(RESULTS / "step.json")
    # the steps that ran the fit's attention kernel, named exactly (FP8 rows run "flashmla-fp8")
    n_step = sum(p.attention.lower() == fitted.attention for p in steps)
    kernel_families = ("collective", "collective_eager", "step", "step_eager")
    assert len([r for r in fitted.residuals if r.family not in kernel_families]) == n_obs
    assert 0 < n_step == len(fitted.step_points)
    assert len([r for r in fitted.residuals if r.family == "step"]) == n_step
    c = fitted.constants
    for f in ("select", "deinterleave", "correct", "pack", "local_topk", "attention"):
        line = getattr(c, f)
        assert math.isfinite(line.fixed_s) and line.per_unit_s > 0, f
    assert 1e9 < c.link_Bps < 1e13
    assert all(math.isfinite(r.rel) for r in fitted.residuals)


def test_flashmla_attention_line(tmp_path) -> None:
    # with attention.json: the line is fitted to its FlashMLA rows (every residual of the family is one of them)
    fit = cm.fit_constants(RESULTS, attention="flashmla")
    labels = [r.label for r in fit.residuals if r.family == "attention"]
    n = sum(r["impl"] == "flashmla_bf16" and r["cache"] == "bf16"
            for r in json.loads((RESULTS / "attention.json").read_text())["summary"])  # fmt: skip
    assert len(labels) == n > 2 and all(lab.startswith("FlashMLA") for lab in labels)
    # without it: the two points quoted from the GPU notes; two unknowns, the line passes through both
    for name in ("topk.json", "deinterleave.json", "lse_merge.json"):
        (tmp_path / name).write_text((RESULTS / name).read_text())
    a = cm.fit_constants(tmp_path, attention="flashmla").constants.attention
    for keys, sec in ((1024, 36.6e-6), (2048, 67e-6)):
        assert a.time_s(2 * 32 * 128 * keys * 1088) == pytest.approx(sec, rel=1e-9)


# ---- the crossover -----------------------------------------------------------------------------------
@pytest.mark.parametrize("w", [2, 8, 16])
def test_crossover_is_where_the_ratio_reaches_one(w: int, fitted: cm.Fit) -> None:
    c = fitted.constants
    x = cm.crossover_context(w, constants=c)
    assert math.isfinite(x)
    x = int(x)
    assert cm.throughput_ratio(w, x, constants=c) >= 1.0
    assert x == 256 or cm.throughput_ratio(w, x - 1, constants=c) < 1.0


def test_without_a_memory_limit_the_crossover_is_the_time_crossover(fitted: cm.Fit) -> None:
    c = fitted.constants
    # a budget no context reaches: both layouts run the capped batch, only step time differs
    big = cm.crossover_context(4, constants=c, kv_budget_bytes=1e30, batch_cap=32)
    assert big == cm.time_crossover_context(4, 32, constants=c)


def test_a_single_rank_cannot_hold_the_request() -> None:
    # TP holds nothing, DCP holds one: DCP wins outright
    g = cm.MlaGeometry()
    per_tp = g.layers * 1000 * (1152 + 132)
    assert cm.max_batch(1000, 2, "tp", per_tp - 1, g) == 0
    assert cm.max_batch(1000, 2, "dcp", per_tp - 1, g) == 1
    assert cm.throughput_ratio(2, 1000, kv_budget_bytes=per_tp - 1) == math.inf


def test_scaling_table_flags_predictions() -> None:
    pts = [cm.StepPoint(2, 32, 65536, "flashinfer", 1e-4)]
    rows = cm.scaling_table(cm.DEFAULT_CONSTANTS, world_sizes=(2, 16), tokens=(32,), contexts=(65536,), measured=pts)
    assert [(r["W"], r["predicted"], r["spans_hosts"]) for r in rows] == [(2, False, False), (16, True, True)]


# ---- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call,exc,name",
    [
        (lambda: cm.dcp_step_cost(0, 32, 100), ValueError, "world_size"),
        (lambda: cm.dcp_step_cost(True, 32, 100), TypeError, "world_size"),
        (lambda: cm.dcp_step_cost(3, 32, 100), ValueError, "world_size"),  # 3 does not divide 128 heads
        (lambda: cm.dcp_step_cost(2, -1, 100), ValueError, "tokens"),
        (lambda: cm.tp_step_cost(2, 32, 1.5), TypeError, "context"),
        (lambda: cm.dcp_step_cost(2, 32, 100, geometry=None), TypeError, "geometry"),
        (lambda: cm.dcp_step_cost(2, 32, 100, constants={}), TypeError, "constants"),
        (lambda: cm.dcp_step_cost(2, 32, 100, hardware="h200"), TypeError, "hardware"),
        (lambda: cm.dcp_step_cost(2, 32, 100, scope="model"), ValueError, "scope"),
        (lambda: cm.kv_bytes_per_rank(100, 2, "pp"), ValueError, "mode"),
        (lambda: cm.kv_bytes_per_rank(-5, 2, "tp"), ValueError, "context"),
        (lambda: cm.collective_time_s("broadcast", 10, 2), ValueError, "kind"),
        (lambda: cm.collective_time_s("all_gather", 10.0, 2), TypeError, "bytes_per_rank"),
        (lambda: cm.MlaGeometry(kv_layout="fp4"), ValueError, "kv_layout"),
        (lambda: cm.MlaGeometry(num_heads=0), ValueError, "num_heads"),
        (lambda: cm.Hardware(ib_efficiency=1.5), ValueError, "ib_efficiency"),
        (lambda: cm.Hardware(copy_Bps=float("nan")), ValueError, "copy_Bps"),
        (lambda: cm.LineCost(-1e-6, 0.0), ValueError, "fixed_s"),
        (lambda: cm.LineCost("1", 0.0), TypeError, "fixed_s"),
        (lambda: cm.CostConstants(link_Bps=0), ValueError, "link_Bps"),
        (lambda: cm.CostConstants(select=3.0), TypeError, "select"),
        (lambda: cm.throughput_ratio(2, 1000, other_layer_s=float("nan")), ValueError, "other_layer_s"),
        (lambda: cm.throughput_ratio(2, 1000, kv_budget_bytes=0), ValueError, "kv_budget_bytes"),
        (lambda: cm.crossover_context(2, min_context=1000, max_context=10), ValueError, "max_context"),
        (lambda: cm.observations_from_results(ROOT / "no-such-dir"), ValueError, "results_dir"),
        (lambda: cm.fit_constants(RESULTS, attention="trtllm"), ValueError, "attention"),
        (lambda: cm.fit_collectives([("all_gather", 10, 1e-5, 1e-5)]), ValueError, "measured"),
        (lambda: cm.fit_lines([("select", 1.0, 1.0)]), TypeError, "observations"),
        (lambda: cm.fit_step([(2, 32, 100)], cm.DEFAULT_CONSTANTS), TypeError, "points"),
        # the layer options: typed like StepSpec's (a string or None is no bool)
        (lambda: cm.dcp_step_cost(2, 32, 100, options=LayerOptions(q_replicate="no")), TypeError, "q_replicate"),
        (lambda: cm.dcp_step_cost(2, 32, 100, options=LayerOptions(q_replicate=None)), TypeError, "q_replicate"),
        (lambda: cm.dcp_step_cost(2, 32, 100, options=LayerOptions(q_replicate=1)), TypeError, "q_replicate"),
        (lambda: cm.dcp_step_cost(2, 32, 100, graph="yes"), TypeError, "graph"),
        (lambda: cm.tp_step_cost(2, 32, 100, graph=None), TypeError, "graph"),
        (lambda: cm.tp_step_cost(2, 32, 100, options=LayerOptions(order="by_rank")), ValueError, "order"),
        (lambda: cm.tp_step_cost(2, 32, 100, options=LayerOptions(order="rank_local")), ValueError, "rank_local"),
        (lambda: cm.throughput_ratio(2, 1000, options={"q_replicate": False}), TypeError, "options"),
        (lambda: cm.dcp_step_cost(2, 32, 100, options=PLANNED.as_dict()), TypeError, "options"),
        (lambda: cm.tp_step_cost(2, 32, 100, options="owner"), TypeError, "options"),
        (lambda: cm.crossover_context(2, options=None), TypeError, "options"),
        (lambda: cm.time_crossover_context(2, 32, options=None), TypeError, "options"),
        (lambda: cm.QueryProjection(q_lora_rank=-1536), ValueError, "q_lora_rank"),
        (lambda: cm.QueryProjection(kv_lora_rank=512.0), TypeError, "kv_lora_rank"),
        (lambda: cm.QueryProjection(q_b_bytes_per_param=0), ValueError, "q_b_bytes_per_param"),
        (lambda: cm.QueryProjection(w_uk_bytes_per_param=float("inf")), ValueError, "w_uk_bytes_per_param"),
        (lambda: cm.q_replication_bytes(8, geometry=None), TypeError, "geometry"),
        (lambda: cm.q_replication_bytes(8, projection="v3.2"), TypeError, "projection"),
        (lambda: cm.q_replication_bytes(0), ValueError, "world_size"),
    ],
)
def test_bad_input_names_the_argument(call, exc, name) -> None:
    with pytest.raises(exc, match=name):
        call()


def test_step_json_with_a_bad_summary(tmp_path: Path) -> None:
    (tmp_path / "step.json").write_text(json.dumps({"summary": {"W": 2}}))
    with pytest.raises(ValueError, match="summary"):
        cm.step_points_from_json(tmp_path / "step.json")
    assert cm.step_points_from_json(tmp_path / "absent.json") == []


def test_steps_of_another_attention_kernel_are_not_fitted() -> None:
    k = cm.DEFAULT_CONSTANTS
    pts = [
        cm.StepPoint(2, t, 65536, name, cm.dcp_step_cost(2, t, 65536, constants=k, scope="step").total_s + extra)
        for t in (1, 32)
        for name, extra in (("flashinfer", 5e-6), ("flashmla", 50e-6))
    ]
    fit = cm.fit_constants(RESULTS, step_points=pts, attention="flashinfer")
    assert any("2 of 4 steps" in n for n in fit.notes)
    assert len([r for r in fit.residuals if r.family == "step"]) == 2


def test_fp8_steps_are_not_fitted_as_flashmla() -> None:
    """``flashmla-fp8`` (the FP8 cache's decode, masked over all K) is another kernel than ``flashmla``."""
    k = cm.DEFAULT_CONSTANTS
    pts = [
        cm.StepPoint(2, t, 65536, name, cm.dcp_step_cost(2, t, 65536, constants=k, scope="step").total_s + extra)
        for t in (1, 32)
        for name, extra in (("flashmla", 0.0), ("flashmla-fp8", 80e-6))
    ]
    fit = cm.fit_constants(RESULTS, step_points=pts, attention="flashmla")
    assert any("2 of 4 steps" in n for n in fit.notes)
    assert [p.attention for p in fit.step_points] == ["flashmla", "flashmla"]
    only_fp8 = [p for p in pts if p.attention == "flashmla-fp8"]
    assert cm.fit_constants(RESULTS, step_points=only_fp8).attention == "flashinfer"


def test_auto_attention_follows_the_measured_step() -> None:
    assert cm.fit_constants(RESULTS, step_points=[]).attention == "flashinfer"
    k = cm.DEFAULT_CONSTANTS
    pts = [cm.StepPoint(2, 32, 65536, "flashmla", cm.dcp_step_cost(2, 32, 65536, constants=k, scope="step").total_s)]
    fit = cm.fit_constants(RESULTS, step_points=pts)
    assert fit.attention == "flashmla" and fit.step_points == pts
    assert all(r.label.startswith("FlashMLA") for r in fit.residuals if r.family == "attention")


# ---- the planned layer's options (owner exchange, scores-only candidates, all-to-all combine) ---------------------
def test_planned_layer_bytes_on_the_wire_by_hand() -> None:
    T, W, K, H, v = 32, 8, 2048, 128, 512
    assert cm.PLANNED_LAYER is PLANNED  # the old name, kept
    d = cm.dcp_step_cost(W, T, 65536, options=PLANNED)
    # rank-local candidates: 4 bytes each (scores only), so the gathered buffer is 4*W*K per token, not 8*W*K
    assert d.comm["candidates_allgather"].received == T * 4 * W * K
    assert cm.dcp_step_cost(W, T, 65536).comm["candidates_allgather"].received == T * 8 * W * K
    # one all-to-all: every destination's H/W heads of bf16 partials and float32 LSEs
    assert d.comm["combine_alltoall"].sent == W * T * (H // W) * (v * 2 + 4)
    assert "lse_allgather" not in d.comm and "output_reduce_scatter" not in d.comm
    assert set(d.stages_s) >= {"query_allgather", "select_to_slots", "combine_alltoall", "combine"}
    assert "select" not in d.stages_s and "deinterleave" not in d.stages_s and "correct" not in d.stages_s
    replicated = cm.dcp_step_cost(W, T, 65536, options=PLANNED.replace(q_replicate=True))
    assert "query_allgather" not in replicated.stages_s and "query_allgather" not in replicated.comm
    # the default is StepSpec's: the query replicated (no all-gather); the step as first measured gathers it
    assert "query_allgather" not in cm.dcp_step_cost(W, T, 65536).stages_s
    gathered = cm.dcp_step_cost(W, T, 65536, options=LayerOptions(q_replicate=False))
    assert gathered.comm["query_allgather"].sent == T * (H // W) * 576 * 2


def test_layer_options_are_checked() -> None:
    # the checks are LayerOptions' own (dcp_ref.options), the cost model takes only such a value
    with pytest.raises(ValueError, match="exchange must be"):
        cm.dcp_step_cost(2, 1, 100, options=LayerOptions(exchange="ring"))
    with pytest.raises(ValueError, match="order='rank_local' needs exchange='owner'"):
        cm.dcp_step_cost(2, 1, 100, options=DEFAULT.replace(order="rank_local"))
    with pytest.raises(TypeError, match=r"options must be a dcp_ref\.options\.LayerOptions"):
        cm.time_crossover_context(2, 1, options={"exchange": "owner"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unexpected keyword"):
        cm.dcp_step_cost(2, 1, 100, exchange="owner")  # type: ignore[call-arg]


def test_the_planned_layer_crossover_is_where_the_times_cross(fitted: cm.Fit) -> None:
    c = fitted.constants
    x = cm.time_crossover_context(8, 32, constants=c, options=PLANNED)
    assert math.isfinite(x)
    # TP is priced with the planned exchange and (score, id) pairs: the default order
    tp_opt = LayerOptions(layout="tp", exchange="owner")
    tp = cm.tp_step_cost(8, 32, int(x), constants=c, options=tp_opt).total_s
    dcp = cm.dcp_step_cost(8, 32, int(x), constants=c, options=PLANNED).total_s
    assert dcp <= tp
    tp1 = cm.tp_step_cost(8, 32, int(x) - 1, constants=c, options=tp_opt).total_s
    assert cm.dcp_step_cost(8, 32, int(x) - 1, constants=c, options=PLANNED).total_s > tp1


def test_query_replication_memory_by_hand() -> None:
    # DeepSeek V3.2: q_b_proj 1536 -> 128 x (128 + 64), FP8 with a float32 scale per 128 x 128 block; W_UK
    # 128 x 128 <- 512 in bf16; 61 layers. A TP rank holds 1/W of both; replicated, all of them.
    qb, uk = 1536 * 128 * 192, 128 * 128 * 512
    per_layer = qb * (1 + 4 / (128 * 128)) + uk * 2
    for w in (1, 2, 4, 8):
        assert cm.q_replication_bytes(w) == pytest.approx((1 - 1 / w) * per_layer * 61)
    assert 2.9e9 < cm.q_replication_bytes(8) < 2.92e9
