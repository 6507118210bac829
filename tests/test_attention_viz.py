"""dcp_ref.viz.attention: the plotted CTA counts and SMs are the committed ones, and what they should be.

Expected values are read from ``benchmarks/results/attention.json`` here, and FlashMLA's CTA count is also
recomputed from its rule (one CTA per token and 64 heads), independently of the plotting code.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest

from dcp_ref.viz import attention as av
from dcp_ref.viz.perf import plotted_series

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def _attention() -> dict:
    return json.loads((RESULTS / "attention.json").read_text())


def test_rows_are_the_committed_ones() -> None:
    a = _attention()
    assert av.sm_count(a) == a["versions"]["sm_count"]
    for impl in av.KERNEL_LABELS:
        rows = av.sm_busy_rows(a, impl)
        want = [r for r in a["summary"] if (r["impl"], r["H"], r["K"], r["cache"]) == (impl, 128, 2048, "bf16")]
        want.sort(key=lambda r: r["T"])
        assert [r["T"] for r in rows] == [r["T"] for r in want] and len(rows) >= 4
        assert [r["ctas"] for r in rows] == [r["ctas"] for r in want]
        assert [r["graph_us"] for r in rows] == [r["graph_us"] for r in want]
        assert [r["sms_busy"] for r in rows] == [r["sm_busy"] * a["versions"]["sm_count"] for r in want]


def test_flashmla_runs_one_cta_per_64_heads_and_split() -> None:
    a = _attention()
    splits = {r["T"]: r["splits"] for r in a["summary"] if r["impl"] == "flashmla_bf16" and r["H"] == 128}
    for r in av.sm_busy_rows(a, "flashmla_bf16"):
        assert r["ctas"] == r["T"] * 128 // 64 * splits[r["T"]]  # the planned splits each token's slots take
        assert r["sms_busy"] == pytest.approx(min(r["ctas"], 132))


def test_figure_plots_the_rows_small() -> None:
    a = _attention()
    fig = av.plot_sm_busy(a, dpi=60)
    assert fig.dpi <= 80
    w, h = fig.get_size_inches()
    assert w * fig.dpi <= 1000 and h * fig.dpi <= 400
    s = plotted_series(fig)
    for impl, label in av.KERNEL_LABELS.items():
        rows = av.sm_busy_rows(a, impl)
        assert s[f"SMs busy | {label}"] == ([float(r["T"]) for r in rows], [r["sms_busy"] for r in rows])
        assert s[f"time | {label}"][1] == [r["graph_us"] for r in rows]
    ts = [r["T"] for r in av.sm_busy_rows(a, "splitkv")]
    assert s[f"SMs busy | {a['versions']['sm_count']} SMs"] == ([float(min(ts)), float(max(ts))], [132.0, 132.0])
    # at one query token FlashMLA's two CTAs, split 16 ways, keep 32 SMs busy, the split-KV kernel most of them
    one = {impl: av.sm_busy_rows(a, impl)[0] for impl in av.KERNEL_LABELS}
    assert one["flashmla_bf16"]["T"] == one["splitkv"]["T"] == 1
    assert one["flashmla_bf16"]["sms_busy"] == 32 and one["splitkv"]["sms_busy"] > 100


def test_synthetic_file_and_bad_input() -> None:
    syn = {
        "versions": {"sm_count": 10},
        "summary": [
            {
                "impl": impl,
                "T": t,
                "H": 128,
                "K": 2048,
                "cache": "bf16",
                "graph_us": float(t + n),
                "ctas": c,
                "sm_busy": min(c, 10) / 10,
            }
            for n, (impl, c0) in enumerate((("splitkv", 8), ("flashmla_bf16", 2)))
            for t, c in ((4, 4 * c0), (1, c0))
        ],
    }
    rows = av.sm_busy_rows(syn, "flashmla_bf16")
    assert [(r["T"], r["ctas"], r["sms_busy"], r["graph_us"]) for r in rows] == [(1, 2, 2.0, 2.0), (4, 8, 8.0, 5.0)]
    s = plotted_series(av.plot_sm_busy(syn))
    assert s["SMs busy | split-KV (Triton)"] == ([1.0, 4.0], [8.0, 10.0])
    with pytest.raises(TypeError, match=r"^attention"):
        av.sm_busy_rows([], "splitkv")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^attention"):
        av.sm_busy_rows({"rows": []}, "splitkv")
    with pytest.raises(ValueError, match=r"^impl"):
        av.sm_busy_rows(syn, "flashinfer")
    with pytest.raises(ValueError, match=r"^heads"):
        av.sm_busy_rows(syn, "splitkv", heads=0)
    with pytest.raises(ValueError, match=r"^dpi"):
        av.plot_sm_busy(syn, dpi=100)
    with pytest.raises(ValueError, match=r"^attention"):
        av.sm_count({"summary": []})
