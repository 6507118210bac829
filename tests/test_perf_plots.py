"""dcp_ref.viz.perf: the plotted numbers are the committed JSON values, figures stay small, bad input is named.

Expected series are read from the JSON files here, independently of the plotting code.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest

from dcp_ref import costmodel as cm
from dcp_ref.options import PLANNED, LayerOptions
from dcp_ref.viz import perf as pp

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _json(name: str) -> dict:
    return json.loads((RESULTS / f"{name}.json").read_text())


def _synthetic_step(with_stages: bool = False) -> dict:
    rows = []
    for w in (2, 4):
        for t in (1, 32):
            for c in (8192, 65536):
                r = {
                    "W": w,
                    "T": t,
                    "ctx": c,
                    "attention": "flashmla",
                    "graph_us": 50.0 + w + t + c / 4096,
                    "eager_us": 900.0 + w,
                    "host_syncs_per_step": 0,
                    "launches_per_step": 12,
                    "stages_sum_us": 40.0 + w + t + c / 4096,
                }
                if with_stages:
                    r["stages_us"] = {"indexer": 10.0 + c / 4096, "select": 5.0 + w, "attention": 20.0 + t}
                rows.append(r)
    return {"summary": rows}


def _check_small(fig) -> None:
    assert fig.dpi <= 80
    w, h = fig.get_size_inches()
    assert w * fig.dpi <= 1000 and h * fig.dpi <= 400
    caption = fig._suptitle.get_text().replace("\n", " ")
    assert caption.endswith(".") and caption.count(". ") == 0, caption  # one sentence


def test_results_dir_and_load() -> None:
    assert pp.results_dir() == RESULTS
    res = pp.load_results(RESULTS)
    assert {"topk", "deinterleave", "lse_merge", "attention_flashinfer"} <= set(res)
    assert res["topk"] == _json("topk")
    with pytest.raises(ValueError, match="directory"):
        pp.load_results(ROOT / "no-such-dir")


def test_topk_series_are_the_committed_values() -> None:
    fig = pp.plot_topk(_json("topk"))
    _check_small(fig)
    series = pp.plotted_series(fig)
    raw = _json("topk")["results"]
    for w in (2, 4, 8):
        rs = sorted((r for r in raw if r["W"] == w and r["K"] == 2048), key=lambda r: r["rows"])
        ours = ([r["rows"] for r in rs], [r["cutedsl_graph"]["median_us"] for r in rs])
        assert series[f"W = {w} | ours (CuTeDSL)"] == ours
        v = [(r["rows"], r["vllm_cutedsl_us"]) for r in rs if r["vllm_cutedsl_us"] is not None]
        assert series[f"W = {w} | vLLM CuTeDSL"] == ([a for a, _ in v], [b for _, b in v])
        assert series[f"W = {w} | torch stable"][1] == [r["torch_stable_graph"]["median_us"] for r in rs]


def test_deinterleave_series_are_the_best_committed_kernel() -> None:
    de = _json("deinterleave")
    fig = pp.plot_deinterleave(de)
    _check_small(fig)
    series = pp.plotted_series(fig)
    for w in (2, 8):
        xs, ys = series[f"W = {w}, I = 1 | ours (Triton)"]
        for n, y in zip(xs, ys):
            times = [
                r["graph_cold_us"]
                for r in de["results"]
                if r["rows"] == n and r["W"] == w and r["I"] == 1 and r["method"] in ("atomic", "rowscan", "twopass")
            ]
            assert y == min(times)
        torch_t = {
            r["rows"]: r["time_us"] for r in de["results"] if r["W"] == w and r["I"] == 1 and r["method"] == "torch"
        }
        assert series[f"W = {w}, I = 1 | torch (eager)"] == (sorted(torch_t), [torch_t[n] for n in sorted(torch_t)])


def test_lse_merge_and_attention_series() -> None:
    lse = _json("lse_merge")
    series = pp.plotted_series(pp.plot_lse_merge(lse))
    for w in (2, 4, 8):
        rs = sorted((r for r in lse["rows"] if r["W"] == w), key=lambda r: r["T"])
        assert series[f"W = {w} | ours: correct"][1] == [r["correct_best"]["median_us"] for r in rs]
        assert series[f"W = {w} | torch merge"][1] == [r["torch_merge"]["median_us"] for r in rs]
        lo_hi = lse["targets"]["vllm_correct_attn_out_us"]
        assert series[f"W = {w} | vLLM correct"] == ([32, 1024], [sum(lo_hi["T32"]) / 2, sum(lo_hi["T1024"]) / 2])
    attn = _json("attention_flashinfer")
    fig = pp.plot_attention(attn)
    _check_small(fig)
    s = pp.plotted_series(fig)
    assert s["time | run"][1] == [r["run"]["median_us"] for r in attn["rows"]]
    # TFLOP/s written out: 2 * 32 * 128 * 2048 * 1088 FLOPs in 55.008 µs
    assert s["TFLOP/s | achieved"][1][0] == pytest.approx(2 * 32 * 128 * 2048 * 1088 / 55.00800162553787e-6 / 1e12)
    assert s["TFLOP/s | BF16 dense peak"][1] == [989.0, 989.0]


def test_bandwidth_series() -> None:
    res = pp.load_results(RESULTS)
    fig = pp.plot_bandwidth(res)
    _check_small(fig)
    s = pp.plotted_series(fig)
    assert s["TB/s | copy bandwidth"][1] == [res["lse_merge"]["copy_TBps_measured"]] * 2
    r = next(r for r in res["topk"]["results"] if (r["rows"], r["W"], r["K"]) == (1024, 8, 2048))
    want = 1024 * (8 * 8 * 2048 + 4 * 2048) / (r["cutedsl_graph"]["median_us"] * 1e-6) / 1e12
    assert s["TB/s | top-K"][1][-1] == pytest.approx(want)
    assert max(s["TB/s | merge"][1]) < res["lse_merge"]["copy_TBps_measured"]


def test_step_plots_show_the_given_rows() -> None:
    step = _synthetic_step()
    fig = pp.plot_step_breakdown(step)
    _check_small(fig)
    s = pp.plotted_series(fig)
    assert s["step time | planned (graph)"][1] == [r["graph_us"] for r in step["summary"]]
    assert s["step time | eager"][1] == [r["eager_us"] for r in step["summary"]]
    assert len(fig.axes) == 1
    staged = _synthetic_step(with_stages=True)
    s2 = pp.plotted_series(pp.plot_step_breakdown(staged))
    assert s2["per stage | select"][1] == [r["stages_us"]["select"] for r in staged["summary"]]
    g = pp.plotted_series(pp.plot_step_growth(step))
    assert g["against ctx | W=2, T=32"] == ([8192, 65536], [50.0 + 2 + 32 + 2, 50.0 + 2 + 32 + 16])
    assert g["against W | T=1, ctx=8K"] == ([2, 4], [50.0 + 2 + 1 + 2, 50.0 + 4 + 1 + 2])


def test_model_plots() -> None:
    fit = cm.fit_constants(RESULTS)
    obs = cm.observations_from_results(RESULTS)
    f1 = pp.plot_fit(fit)
    _check_small(f1)
    s1 = pp.plotted_series(f1)
    assert sum(len(v[0]) for v in s1.values()) == len(fit.residuals)
    f2 = pp.plot_scaling(fit, obs, [cm.StepPoint(2, 32, 65536, "flashmla", 150e-6)])
    _check_small(f2)
    s2 = pp.plotted_series(f2)
    assert s2["scaling with W | measured: planned step"] == ([2.0], [150.0])
    sel = {
        r["W"]: r["cutedsl_graph"]["median_us"] for r in _json("topk")["results"] if r["rows"] == 32 and r["K"] == 2048
    }
    xs, ys = s2["scaling with W | measured: select"]
    assert dict(zip(xs, ys)) == pytest.approx(sel)
    dcp = s2["scaling with W | model: DCP layer"]
    as_measured = LayerOptions(q_replicate=False)  # the plots' default: the step as first measured
    assert pp.AS_MEASURED == as_measured
    assert dcp[1][3] == pytest.approx(
        cm.dcp_step_cost(8, 32, 65536, constants=fit.constants, options=as_measured).total_s * 1e6
    )
    f3 = pp.plot_crossover(fit.constants, world_sizes=(2, 8))
    _check_small(f3)
    marks = [ln for ln in f3.axes[0].get_lines() if ln.get_label() == "_crossover"]
    want = [cm.crossover_context(w, constants=fit.constants, options=as_measured) for w in (2, 8)]
    assert sorted(float(m.get_xdata()[0]) for m in marks) == sorted(x for x in want if math.isfinite(x))


@pytest.mark.parametrize(
    "call,exc,name",
    [
        (lambda: pp.plot_topk({}), ValueError, "results"),
        (lambda: pp.plot_topk([]), TypeError, "topk"),
        (lambda: pp.plot_topk(_json("topk"), dpi=100), ValueError, "dpi"),
        (lambda: pp.plot_lse_merge(_json("topk")), ValueError, "rows"),
        (lambda: pp.plot_step_breakdown({"summary": []}), ValueError, "summary"),
        (lambda: pp.plot_step_growth({"rows": []}), ValueError, "summary"),
        (lambda: pp.plot_fit("fit"), TypeError, "fit"),
        (lambda: pp.deinterleave_best(_json("deinterleave"), 7, 2), ValueError, "rows=7"),
    ],
)
def test_bad_input_names_the_argument(call, exc, name) -> None:
    with pytest.raises(exc, match=name):
        call()


def test_step_growth_keeps_attention_kernels_apart() -> None:
    rows = [
        {
            "W": 2,
            "T": t,
            "ctx": 8192,
            "attention": a,
            "graph_us": float(t + (100 if a == "flashinfer" else 0)),
            "eager_us": None,
            "host_syncs_per_step": 0,
            "launches_per_step": 9,
            "stages_sum_us": None,
        }
        for a in ("flashmla", "flashinfer")
        for t in (1, 32)
    ]
    g = pp.plotted_series(pp.plot_step_growth({"summary": rows}))
    assert g["against T | W=2, ctx=8K, flashmla"] == ([1, 32], [1.0, 32.0])
    assert g["against T | W=2, ctx=8K, flashinfer"] == ([1, 32], [101.0, 132.0])
    fp8 = [dict(r, kv_format="fp8_ds_mla", attention="flashmla-fp8", graph_us=r["graph_us"] + 7) for r in rows[:2]]
    g8 = pp.plotted_series(pp.plot_step_growth({"summary": rows[:2] + fp8}))
    assert g8["against T | W=2, ctx=8K, FP8"] == ([1, 32], [8.0, 39.0])  # the cache named, not its kernel
    assert g8["against T | W=2, ctx=8K, flashmla"] == ([1, 32], [1.0, 32.0])
    b = pp.plotted_series(pp.plot_step_breakdown({"summary": rows}))
    assert b["step time | sum of stages"][1] == [0.0] * 4  # absent values plot as zero-height bars


def test_indexer_and_fp8_attention_series() -> None:
    """Synthetic files: every series is exactly its rows' values, one panel per L (indexer) / K (FP8)."""
    local = {
        "summary": [
            {
                "T": t,
                "L": n,
                "k": 2048,
                "dist": "normal",
                "fused_us": t + n / 1024,
                "torch_us": 3.0 * t + n,
                "vllm_us": 7.0 * t,
                "same_result": True,
            }
            for t in (32, 1)
            for n in (4096, 32768)
        ]
        + [{"T": 1, "L": 4096, "k": 2048, "dist": "ties", "fused_us": 99.0, "torch_us": 1.0, "vllm_us": 1.0}]
    }
    fig = pp.plot_local_topk(local)
    _check_small(fig)
    s = pp.plotted_series(fig)
    assert s["L = 4K | ours (fused, stable)"] == ([1.0, 32.0], [5.0, 36.0])
    assert s["L = 32K | torch.topk + pack (either of tied keys)"] == ([1.0, 32.0], [32771.0, 32864.0])
    assert s["L = 32K | vLLM top-K + pack (either of tied keys)"][1] == [7.0, 224.0]  # the ties row is not plotted
    fp8 = {
        "summary": [
            {
                "impl": impl,
                "T": t,
                "K": k,
                "W": w,
                "graph_us": (None if impl == "flashinfer_fa3" else t * w + k / 1024 + len(impl)),
                "rel_err": 1e-3,
            }
            for impl in ("flashmla_fp8_masked", "flashmla_bf16_compact", "flashinfer_fa3")
            for t in (32, 1)
            for k in (1024, 2048)
            for w in (1, 2)
        ]
    }
    g = pp.plotted_series(pp.plot_fp8_attention(fp8))
    assert g["K = 2048 | fp8_masked, W = 2"] == ([1.0, 32.0], [2 + 2 + 19.0, 64 + 2 + 19.0])
    assert g["K = 1024 | bf16_compact, W = 1"] == ([1.0, 32.0], [1 + 1 + 21.0, 32 + 1 + 21.0])
    assert not any("fa3" in key for key in g)  # FlashInfer's plan cannot be captured: no graph time, no line
    with pytest.raises(ValueError, match="summary"):
        pp.plot_local_topk({"results": []})
    with pytest.raises(TypeError, match="fp8_attention"):
        pp.plot_fp8_attention([])


def test_committed_indexer_and_fp8_files_plot() -> None:
    local, fp8 = _json("local_topk"), _json("fp8_attention")
    s = pp.plotted_series(pp.plot_local_topk(local))
    rows = sorted((r for r in local["summary"] if r["L"] == 4096 and r["dist"] == "normal"), key=lambda r: r["T"])
    assert s["L = 4K | ours (fused, stable)"][1] == [r["fused_us"] for r in rows]
    g = pp.plotted_series(pp.plot_fp8_attention(fp8))
    assert len(g) == 2 * 2 * 2  # (fp8, bf16) x (W = 1, 2) x (K = 1024, 2048)


def test_attention_kernels_series_are_the_committed_rows() -> None:
    attn = _json("attention")
    fig = pp.plot_attention_kernels(attn)
    _check_small(fig)
    s = pp.plotted_series(fig)
    rows = [r for r in attn["summary"] if r["graph_us"] is not None]
    for k in (1024, 2048):
        for impl, label in (
            ("splitkv", "split-KV (Triton)"),
            ("flashmla_bf16", "FlashMLA bf16"),
            ("flashmla_fp8", "FlashMLA FP8"),
        ):
            rs = sorted((r for r in rows if (r["impl"], r["H"], r["K"]) == (impl, 128, k)), key=lambda r: r["T"])
            assert s[f"H = 128, K = {k} | {label}"] == ([float(r["T"]) for r in rs], [r["graph_us"] for r in rs])
    for h in (16, 32, 64, 128):
        rs = sorted((r for r in rows if (r["impl"], r["H"], r["K"]) == ("splitkv", h, 2048)), key=lambda r: r["T"])
        assert s[f"split-KV per head count, K = 2048 | split-KV, H = {h}"][1] == [r["graph_us"] for r in rs]
    with pytest.raises(ValueError, match="summary"):
        pp.plot_attention_kernels({"rows": []})


def test_select_to_slots_series_are_the_committed_rows() -> None:
    ex = _json("exchange")
    fig = pp.plot_select_to_slots(ex)
    _check_small(fig)
    s = pp.plotted_series(fig)
    rows = [r for r in ex["summary"] if r["stage"] == "select_to_slots"]
    for w in (2, 4, 8):
        for order in ("rank_local", "global_id"):
            rs = sorted((r for r in rows if (r["W"], r["order"]) == (w, order)), key=lambda r: r["rows"])
            assert s[f"W = {w} | ours, {order}"] == ([float(r["rows"]) for r in rs], [r["ours_us"] for r in rs])
        rs = sorted((r for r in rows if (r["W"], r["order"]) == (w, "global_id")), key=lambda r: r["rows"])
        assert s[f"W = {w} | our select + deinterleave"][1] == [r["chain_us"] for r in rs]
        assert s[f"W = {w} | vLLM top-K + convert"][1] == [r["vllm_chain_us"] for r in rs]
    with pytest.raises(ValueError, match="select_to_slots"):
        pp.plot_select_to_slots({"summary": [{"stage": "combine_merge"}]})


def test_attention_kernel_follows_the_cost_model() -> None:
    c = cm.DEFAULT_CONSTANTS
    g = cm.MlaGeometry()
    for t in (1, 8, 9, 32):
        for h in (16, 32, 64, 128):
            assert pp.attention_kernel(c, t, h) == cm._attention_s(t, h, 2048.0, g, c)[0]
    with pytest.raises(TypeError, match="constants"):
        pp.attention_kernel("c", 1, 128)  # type: ignore[arg-type]


def test_stage_basis_reads_the_fit() -> None:
    fit = cm.fit_constants(RESULTS)
    assert pp.stage_basis(fit, "index_scoring") == "roofline"
    assert pp.stage_basis(fit, "candidates_allgather") == "NCCL fit, W = 2"  # NCCL_2XH200_T32: W = 2 only
    assert pp.stage_basis(fit, "combine_alltoall") == "all_to_all not measured"
    for stage in ("indexer", "select_to_slots", "combine", "attention", "select", "deinterleave", "correct"):
        assert pp.stage_basis(fit, stage) == "kernel fit", stage
    assert pp.stage_basis(fit, "step_overhead") == ("step fit" if (RESULTS / "step.json").exists() else "default")
    # a fit without attention.json's split-KV rows has no line for the kernel a TP-8 rank runs
    obs = [o for o in cm.observations_from_results(RESULTS) if o.family != "attention_splitkv"]
    bare = cm.fit_constants(RESULTS, observations=obs, step_points=[])
    assert pp.stage_basis(bare, "attention", tokens=32, heads=16) == "default"
    assert pp.stage_basis(bare, "attention", tokens=32, heads=128) == "kernel fit"
    assert pp.stage_basis(bare, "step_overhead") == "default"
    with pytest.raises(ValueError, match="stage"):
        pp.stage_basis(fit, "moe")
    with pytest.raises(TypeError, match="fit"):
        pp.stage_basis("fit", "indexer")  # type: ignore[arg-type]


def test_layer_per_rank_bars_are_the_model() -> None:
    fit = cm.fit_constants(RESULTS)
    ctxs = (8192, 131072)
    fig = pp.plot_layer_per_rank(fit, world_sizes=(2, 8), contexts=ctxs)
    _check_small(fig)
    s = pp.plotted_series(fig)
    for w in (2, 8):
        d = [cm.dcp_step_cost(w, 32, c, constants=fit.constants, options=PLANNED) for c in ctxs]
        tp_opt = LayerOptions(layout="tp", exchange="owner")  # TP: the planned exchange, (score, id) pairs
        t = [cm.tp_step_cost(w, 32, c, constants=fit.constants, options=tp_opt) for c in ctxs]
        for stage in d[0].stages_s:
            assert s[f"W = {w} | DCP: {stage}"][1] == pytest.approx([x.stages_s[stage] * 1e6 for x in d])
        for stage in t[0].stages_s:
            assert s[f"W = {w} | TP: {stage}"][1] == pytest.approx([x.stages_s[stage] * 1e6 for x in t])
        assert f"W = {w} | TP: combine_alltoall" not in s  # TP communicates nothing inside attention
    legend = [tx.get_text() for tx in fig.axes[-1].get_legend().get_texts()]
    assert "index_scoring (roofline)" in legend and "combine_alltoall (all_to_all not measured)" in legend
    assert all(ax.get_legend() is None for ax in fig.axes[:-1])
    with pytest.raises(TypeError, match="fit"):
        pp.plot_layer_per_rank(fit.constants)  # type: ignore[arg-type]


def test_figure_png_is_a_small_faithful_palette_image() -> None:
    """figure_png: a palette PNG of the figure (same pixels size, colors within a few levels of the RGBA
    rendering), smaller, identical bytes on a second call; bad arguments are refused by name."""
    import io

    import numpy as np
    from PIL import Image

    fig = pp.plot_topk(pp.load_results()["topk"])
    png = pp.figure_png(fig)
    assert png == pp.figure_png(fig)
    full = io.BytesIO()
    fig.savefig(full, format="png", bbox_inches="tight", dpi=fig.dpi)
    pal, rgba = Image.open(io.BytesIO(png)), Image.open(io.BytesIO(full.getvalue()))
    assert pal.mode == "P" and pal.size == rgba.size
    assert len(png) < 0.6 * len(full.getvalue())
    diff = np.abs(np.asarray(pal.convert("RGB"), float) - np.asarray(rgba.convert("RGB"), float))
    assert diff.mean() < 2.0, diff.mean()  # of 255: the plot reads the same
    with pytest.raises(ValueError, match="colors must be an int in"):
        pp.figure_png(fig, colors=1)
    with pytest.raises(TypeError, match="fig must be a matplotlib Figure"):
        pp.figure_png("not a figure")
    assert pp.compact_png() is None  # outside IPython: nothing to register
    with pytest.raises(ValueError, match="colors must be an int in"):
        pp.compact_png(colors=True)
