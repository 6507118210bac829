"""Plots of the committed H200 benchmark results (``benchmarks/results/*.json``) and of the cost model.

Every function reads only the JSON values it is given (so the performance chapter runs on a CPU and
in CI) and returns a small matplotlib ``Figure`` (``dpi`` <= 80) whose title says what it shows in
one sentence. :func:`plotted_series` reads back every labelled line and bar series of a figure, so
a caller can check that the plotted numbers are the committed ones.

Times are plotted in µs, bandwidths in TB/s (1e12 bytes/s), FLOP rates in TFLOP/s (1e12 FLOP/s).
matplotlib is imported inside the functions: ``import dcp_ref`` does not need it.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import costmodel as cm
from ..options import PLANNED, LayerOptions

__all__ = [
    "results_dir",
    "load_results",
    "plotted_series",
    "plot_topk",
    "plot_deinterleave",
    "plot_lse_merge",
    "plot_attention",
    "plot_local_topk",
    "plot_fp8_attention",
    "plot_attention_kernels",
    "plot_select_to_slots",
    "plot_bandwidth",
    "plot_step_breakdown",
    "plot_step_growth",
    "plot_fit",
    "plot_scaling",
    "plot_crossover",
    "deinterleave_best",
    "attention_kernel",
    "stage_basis",
    "plot_layer_per_rank",
    "DPI",
    "figure_png",
    "compact_png",
]

#: Figure resolution: small files, notebooks stay light.
DPI = 70
# Default model parameters (module-level values, not calls in argument defaults).
_GEOMETRY = cm.MlaGeometry()
#: The layer the scaling and crossover plots price: the step as first measured (``step.json``; the query
#: gathered over heads, the rest :data:`dcp_ref.options.DEFAULT`), as chapter 10 draws them.
AS_MEASURED = LayerOptions(q_replicate=False)
_HARDWARE = cm.Hardware()
_COMPACTING = ("atomic", "rowscan", "twopass")


def figure_png(fig: Any, colors: int = 64) -> bytes:
    """``fig`` as a PNG with a palette of ``colors`` (2..256): these line plots use a few colors plus their
    antialiasing, so the palette image looks the same at about a quarter of the RGBA bytes. Deterministic."""
    import io

    from PIL import Image

    _check_colors(colors)
    if not hasattr(fig, "savefig"):
        raise TypeError(f"fig must be a matplotlib Figure, got {type(fig).__name__}")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight", dpi=fig.dpi)  # what the inline backend draws
    rgb = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    out = io.BytesIO()
    rgb.quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(out, format="PNG", optimize=True)
    return out.getvalue()


def _check_colors(colors: object) -> None:
    if isinstance(colors, bool) or not isinstance(colors, int) or not 2 <= colors <= 256:
        raise ValueError(f"colors must be an int in [2, 256], got {colors!r}")


def compact_png(colors: int = 64) -> None:
    """Show every matplotlib figure of this notebook through :func:`figure_png` (call after ``%matplotlib
    inline``): the committed chapters stay small. Outside IPython it does nothing (``colors`` is still checked)."""
    _check_colors(colors)
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    from matplotlib.figure import Figure

    shell.display_formatter.formatters["image/png"].for_type(Figure, lambda fig: figure_png(fig, colors))


def results_dir(start: str | Path | None = None) -> Path:
    """The ``benchmarks/results`` directory: next to the ``dcp_ref`` package (a checkout), else the first
    one found walking up from ``start`` (default: the working directory). ``FileNotFoundError`` if none."""
    candidates = [Path(__file__).resolve().parents[1] / "benchmarks" / "results"]
    here = Path(start or Path.cwd()).resolve()
    candidates += [p / "benchmarks" / "results" for p in (here, *here.parents)]
    for c in candidates:
        if c.is_dir():
            return c
    raise FileNotFoundError("no benchmarks/results directory next to dcp_ref or above the working directory")


def load_results(directory: str | Path | None = None) -> dict[str, Any]:
    """Every ``*.json`` of the results directory, by file stem (``{"topk": {...}, ...}``)."""
    d = Path(directory) if directory is not None else results_dir()
    if not d.is_dir():
        raise ValueError(f"directory must be an existing directory, got {str(directory)!r}")
    out = {}
    for p in sorted(d.glob("*.json")):
        with open(p) as fh:
            out[p.stem] = json.load(fh)
    return out


def _figure(
    ncols: int, caption: str, width: float = 3.0, height: float = 2.4, dpi: int = DPI, stacked: bool = False
) -> tuple[Any, list]:
    """``ncols`` panels of ``width`` x ``height`` inches side by side (``stacked``: one above the other, for
    panels that need the whole width)."""
    import matplotlib.pyplot as plt

    if not 1 <= dpi <= 80:
        raise ValueError(f"dpi must be in [1, 80] (small figures), got {dpi}")
    shape, size = ((ncols, 1), (width, height * ncols)) if stacked else ((1, ncols), (width * ncols, height))
    fig, grid = plt.subplots(*shape, figsize=size, dpi=dpi, squeeze=False)
    axes = list(grid.flat)
    fig.suptitle("\n".join(textwrap.wrap(caption, width=int(30 * size[0] / 3.0) + 10)), fontsize=8)
    for ax in axes:
        ax.tick_params(labelsize=7)
        ax.grid(True, which="both", alpha=0.25)
    return fig, axes


def _finish(fig: Any, axes: Sequence[Any], outside: bool = False) -> Any:
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            if outside:  # many series on one panel: keep the data visible
                n = len(ax.get_legend_handles_labels()[0])
                ax.legend(fontsize=6 if n <= 8 else 5, loc="center left", bbox_to_anchor=(1.02, 0.5))
            else:
                ax.legend(fontsize=6, loc="best")
        ax.title.set_fontsize(8)
        ax.xaxis.label.set_fontsize(7)
        ax.yaxis.label.set_fontsize(7)
    fig.tight_layout()
    import matplotlib.pyplot as plt

    plt.close(fig)  # the caller displays it; no second copy from the inline backend
    return fig


def plotted_series(fig: Any) -> dict[str, tuple[list[float], list[float]]]:
    """``{"<axes title> | <label>": (xs, ys)}`` for every labelled line and bar series of ``fig``.

    Bars give their centres and heights (stacked bars: their own heights, not the stack's top); error bars
    their central points.
    """
    out: dict[str, tuple[list[float], list[float]]] = {}
    for ax in fig.axes:
        title = ax.get_title()
        for line in ax.get_lines():
            label = line.get_label()
            if label and not label.startswith("_"):
                out[f"{title} | {label}"] = ([float(v) for v in line.get_xdata()], [float(v) for v in line.get_ydata()])
        for cont in ax.containers:
            label = cont.get_label()
            if not label or label.startswith("_"):
                continue
            if hasattr(cont, "patches"):  # bars
                xs = [p.get_x() + p.get_width() / 2 for p in cont.patches]
                out[f"{title} | {label}"] = (xs, [float(p.get_height()) for p in cont.patches])
            elif getattr(cont, "lines", None) and cont.lines[0] is not None:  # error bars: their data line
                line = cont.lines[0]
                out[f"{title} | {label}"] = ([float(v) for v in line.get_xdata()], [float(v) for v in line.get_ydata()])
    return out


def _need(data: Any, name: str, keys: Sequence[str]) -> None:
    if not isinstance(data, Mapping):
        raise TypeError(f"{name} must be the parsed JSON object (a dict), got {type(data).__name__}")
    for k in keys:
        if k not in data:
            raise ValueError(f"{name} lacks the key {k!r} (is it the right file?)")


# ---- kernels -------------------------------------------------------------------------------------
def plot_topk(topk: Mapping[str, Any], K: int = 2048, dpi: int = DPI) -> Any:
    """Stable top-K (select) time against rows, one panel per W: ours (CUDA graph) vs vLLM's CuTeDSL
    selector (where ``vllm_cutedsl_us`` is set) vs ``torch.topk`` (exact values, but it may pick either of tied
    keys) and a stable torch top-K (the project's total order: score descending, then lower id), graphs."""
    _need(topk, "topk", ["results"])
    rows = [r for r in topk["results"] if r["K"] == K]
    worlds = sorted({r["W"] for r in rows})
    fig, axes = _figure(
        len(worlds),
        f"Stable top-K of k = K = {K} among W·K candidates per row: ours against "
        "vLLM's CuTeDSL selector and torch (device time, lower is better).",
        dpi=dpi,
    )
    for ax, w in zip(axes, worlds):
        rs = sorted((r for r in rows if r["W"] == w), key=lambda r: r["rows"])
        x = [r["rows"] for r in rs]
        ax.plot(x, [r["cutedsl_graph"]["median_us"] for r in rs], "o-", label="ours (CuTeDSL)")
        v = [(r["rows"], r["vllm_cutedsl_us"]) for r in rs if r.get("vllm_cutedsl_us") is not None]
        if v:
            ax.plot([a for a, _ in v], [b for _, b in v], "s--", label="vLLM CuTeDSL")
        ax.plot(x, [r["torch_topk_graph"]["median_us"] for r in rs], "^:", label="torch.topk (either of tied keys)")
        ax.plot(x, [r["torch_stable_graph"]["median_us"] for r in rs], "v:", label="torch stable")
        ax.set(xscale="log", yscale="log", title=f"W = {w}", xlabel="rows (query tokens)", ylabel="µs")
    return _finish(fig, axes)


def deinterleave_best(de: Mapping[str, Any], rows: int, w: int, i: int = 1) -> dict[str, Any]:
    """The compacting configuration (atomic / rowscan / twopass) with the lowest cold-graph median."""
    cand = [
        r
        for r in de["results"]
        if (r["rows"], r["W"], r["I"]) == (rows, w, i)
        and r["method"] in _COMPACTING
        and r.get("correct")
        and r.get("graph_cold_us") is not None
    ]
    if not cand:
        raise ValueError(f"no compacting result at rows={rows}, W={w}, I={i}")
    return min(cand, key=lambda r: r["graph_cold_us"])


def plot_deinterleave(de: Mapping[str, Any], interleave: int = 1, dpi: int = DPI) -> Any:
    """Deinterleave + compaction time against rows, one panel per W: our best Triton kernel (CUDA graph,
    L2 flushed) vs the plain torch path (eager). vLLM's times are issue quotes, not in the JSON."""
    _need(de, "deinterleave", ["results"])
    worlds = sorted({r["W"] for r in de["results"]})
    fig, axes = _figure(
        len(worlds),
        "Deinterleave + compaction of k = 2048 global ids per row: our Triton kernel "
        "(best method, cold graph) against plain torch (eager).",
        dpi=dpi,
    )
    for ax, w in zip(axes, worlds):
        rows = sorted({r["rows"] for r in de["results"] if r["W"] == w and r["I"] == interleave})
        ours = [deinterleave_best(de, n, w, interleave)["graph_cold_us"] for n in rows]
        torch_t = [
            next(
                r["time_us"]
                for r in de["results"]
                if (r["rows"], r["W"], r["I"], r["method"]) == (n, w, interleave, "torch")
            )
            for n in rows
        ]
        ax.plot(rows, ours, "o-", label="ours (Triton)")
        ax.plot(rows, torch_t, "v:", label="torch (eager)")
        ax.set(xscale="log", yscale="log", title=f"W = {w}, I = {interleave}", xlabel="rows", ylabel="µs")
    return _finish(fig, axes)


def plot_lse_merge(lse: Mapping[str, Any], dpi: int = DPI) -> Any:
    """LSE correction and full merge time against T, one panel per W: ours (Triton, best tile) vs vLLM's
    ``correct_attn_out`` (the issue's range, midpoint plotted, bar = range) vs a torch merge."""
    _need(lse, "lse_merge", ["rows", "targets"])
    worlds = sorted({r["W"] for r in lse["rows"]})
    vllm = lse["targets"]["vllm_correct_attn_out_us"]
    fig, axes = _figure(
        len(worlds),
        "Merging W partial attention outputs (H = 128, D = 512, bf16): our Triton "
        "correction and merge against vLLM's correction and torch.",
        dpi=dpi,
    )
    for ax, w in zip(axes, worlds):
        rs = sorted((r for r in lse["rows"] if r["W"] == w), key=lambda r: r["T"])
        t = [r["T"] for r in rs]
        ax.plot(t, [r["correct_best"]["median_us"] for r in rs], "o-", label="ours: correct")
        ax.plot(t, [r["merge_best"]["median_us"] for r in rs], "D-", label="ours: merge")
        ax.plot(t, [r["torch_merge"]["median_us"] for r in rs], "v:", label="torch merge")
        vt = [n for n in t if f"T{n}" in vllm]
        lo_hi = [vllm[f"T{n}"] for n in vt]
        mid = [(a + b) / 2 for a, b in lo_hi]
        ax.errorbar(
            vt,
            mid,
            yerr=[[m - a for m, (a, _) in zip(mid, lo_hi)], [b - m for m, (_, b) in zip(mid, lo_hi)]],
            fmt="s--",
            label="vLLM correct",
        )
        ax.set(xscale="log", yscale="log", title=f"W = {w}", xlabel="T (query tokens)", ylabel="µs")
    return _finish(fig, axes)


def plot_attention(attn: Mapping[str, Any], peak_tflops: float = 989.0, dpi: int = DPI) -> Any:
    """FlashInfer sparse MLA (H = 128, k = 2048, bf16): time against T, and achieved TFLOP/s against the
    dense BF16 tensor-core peak (FLOPs = 2·T·H·k·(576 + 512))."""
    _need(attn, "attention_flashinfer", ["rows"])
    rs = sorted(attn["rows"], key=lambda r: r["T"])
    t = [r["T"] for r in rs]
    fig, axes = _figure(
        2,
        "Sparse MLA attention (FlashInfer FA3, H = 128, k = 2048): time per call and the "
        "fraction of the H200's BF16 tensor-core peak it reaches.",
        dpi=dpi,
    )
    axes[0].plot(t, [r["run"]["median_us"] for r in rs], "o-", label="run")
    axes[0].plot(t, [r["plan_plus_run"]["median_us"] for r in rs], "s:", label="plan + run")
    axes[0].set(xscale="log", title="time", xlabel="T (query tokens)", ylabel="µs")
    tf = [2 * r["T"] * r["H"] * r["K_valid"] * (576 + 512) / (r["run"]["median_us"] * 1e-6) / 1e12 for r in rs]
    axes[1].plot(t, tf, "o-", label="achieved")
    axes[1].plot(t, [peak_tflops] * len(t), "k--", label="BF16 dense peak")
    axes[1].set(xscale="log", title="TFLOP/s", xlabel="T (query tokens)", ylabel="TFLOP/s", ylim=(0, peak_tflops * 1.1))
    return _finish(fig, axes)


def plot_local_topk(local: Mapping[str, Any], dpi: int = DPI) -> Any:
    """The indexer stage (local top-K + pack, k = 2048) against query tokens T, one panel per local row length
    L: our fused kernel (stable: the project's total order, score descending, then lower index) against vLLM's
    ``top_k_per_row_decode`` + its pack, measured in the same run, and ``torch.topk`` + the Triton pack (both pick
    either of tied keys). All CUDA-graph replays, from ``local_topk.json``'s ``summary``, normal scores (its
    heavy-ties rows are not plotted)."""
    _need(local, "local_topk", ["summary"])
    rows = [r for r in local["summary"] if r.get("dist", "normal") == "normal"]
    lengths = sorted({r["L"] for r in rows})
    fig, axes = _figure(
        len(lengths),
        "The indexer stage (each rank's top-2048 of its own keys, packed for the all-gather): the fused "
        "kernel against vLLM's top-K + pack and torch (device time, lower is better).",
        dpi=dpi,
    )
    for ax, n in zip(axes, lengths):
        rs = sorted((r for r in rows if r["L"] == n), key=lambda r: r["T"])
        x = [r["T"] for r in rs]
        ax.plot(x, [r["fused_us"] for r in rs], "o-", label="ours (fused, stable)")
        if all(r.get("vllm_us") is not None for r in rs):
            ax.plot(x, [r["vllm_us"] for r in rs], "s--", label="vLLM top-K + pack (either of tied keys)")
        ax.plot(x, [r["torch_us"] for r in rs], "^:", label="torch.topk + pack (either of tied keys)")
        ax.set(xscale="log", yscale="log", title=f"L = {_short(n)}", xlabel="T (rows)", ylabel="µs")
    return _finish(fig, axes)


def plot_fp8_attention(fp8: Mapping[str, Any], dpi: int = DPI) -> Any:
    """One rank's sparse MLA decode against query tokens T, one panel per top-k K: FlashMLA's FP8 decode over
    the 656-byte cache (masked layout: it walks all K entries) against FlashMLA's bf16 kernel over compacted
    slots (work over the valid ones), at W = 1 and on one rank's share at W = 2 (CUDA-graph replays, from
    ``fp8_attention.json``'s ``summary``; FlashInfer's plan cannot be captured, so it has no point here)."""
    _need(fp8, "fp8_attention", ["summary"])
    rows = [r for r in fp8["summary"] if r.get("graph_us") is not None]
    ks = sorted({r["K"] for r in rows})
    fig, axes = _figure(
        len(ks),
        "Sparse MLA decode of one rank: FP8 cache, masked, against bf16 cache, compacted "
        "(device time, lower is better; W = 2: one rank's share of the keys).",
        dpi=dpi,
    )
    styles = {"flashmla_fp8_masked": "o-", "flashmla_bf16_compact": "s--"}
    for ax, k in zip(axes, ks):
        for impl in sorted({r["impl"] for r in rows}):
            for w in sorted({r["W"] for r in rows}):
                rs = sorted((r for r in rows if (r["impl"], r["K"], r["W"]) == (impl, k, w)), key=lambda r: r["T"])
                if rs:
                    lab = f"{impl.replace('flashmla_', '')}, W = {w}"
                    ax.plot([r["T"] for r in rs], [r["graph_us"] for r in rs], styles.get(impl, "x:"), label=lab)
        ax.set(xscale="log", yscale="log", title=f"K = {k}", xlabel="T (query tokens)", ylabel="µs")
    return _finish(fig, axes)


def _one_legend(axes: Sequence[Any]) -> Any:
    """Panels that plot the same series: one legend, right of the last panel (the others' removed). Returns the
    figure."""
    for ax in axes:
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    axes[-1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.02, 0.5))
    return axes[-1].figure


def _no_minor_labels(ax: Any) -> None:
    """No labels on a log axis' minor ticks (they crowd a small panel)."""
    from matplotlib.ticker import NullFormatter

    ax.yaxis.set_minor_formatter(NullFormatter())


def plot_attention_kernels(attention: Mapping[str, Any], dpi: int = DPI) -> Any:
    """Sparse MLA decode of one rank against query tokens T (``attention.json``'s ``summary``, CUDA-graph replays):
    one panel per top-k ``K`` at H = 128 — the split-KV Triton kernel, FlashMLA's bf16 sparse kernel and its FP8
    decode — and one panel of the split-KV kernel at the head counts of TP ranks (FlashMLA runs only 64 or 128)."""
    _need(attention, "attention", ["summary"])
    rows = [r for r in attention["summary"] if r.get("graph_us") is not None]
    ks = sorted({r["K"] for r in rows if r["H"] == 128})
    fig, axes = _figure(
        len(ks) + 1,
        "Sparse MLA attention of one rank against query tokens: the split-KV kernel, FlashMLA bf16 and FlashMLA's "
        "FP8 decode (device time, lower is better).",
        width=2.6,
        dpi=dpi,
    )
    names = {"splitkv": ("split-KV (Triton)", "o-"), "flashmla_bf16": ("FlashMLA bf16", "s--"),
             "flashmla_fp8": ("FlashMLA FP8", "^:")}  # fmt: skip
    for ax, k in zip(axes, ks):
        for impl, (label, style) in names.items():
            rs = sorted((r for r in rows if (r["impl"], r["H"], r["K"]) == (impl, 128, k)), key=lambda r: r["T"])
            if rs:
                ax.plot([r["T"] for r in rs], [r["graph_us"] for r in rs], style, label=label)
        ax.set(xscale="log", yscale="log", title=f"H = 128, K = {k}", xlabel="T (query tokens)", ylabel="µs")
        _no_minor_labels(ax)
    ax, k = axes[-1], max(ks)
    for h in sorted({r["H"] for r in rows if r["impl"] == "splitkv" and r["K"] == k}):
        rs = sorted((r for r in rows if (r["impl"], r["H"], r["K"]) == ("splitkv", h, k)), key=lambda r: r["T"])
        ax.plot([r["T"] for r in rs], [r["graph_us"] for r in rs], "o-", ms=3, label=f"split-KV, H = {h}")
    ax.set(xscale="log", yscale="log", title=f"split-KV per head count, K = {k}", xlabel="T (query tokens)",
           ylabel="µs")  # fmt: skip
    _no_minor_labels(ax)
    return _finish(fig, axes)


def plot_select_to_slots(exchange: Mapping[str, Any], dpi: int = DPI) -> Any:
    """The owner-local exchange (``exchange.json``'s ``select_to_slots`` rows, CUDA-graph replays) against rows, one
    panel per W: ours in both orders against our select + deinterleave and vLLM's stable top-K + convert."""
    _need(exchange, "exchange", ["summary"])
    rows = [r for r in exchange["summary"] if r.get("stage") == "select_to_slots"]
    if not rows:
        raise ValueError("exchange lacks select_to_slots rows in 'summary' (is it the right file?)")
    worlds = sorted({r["W"] for r in rows})
    fig, axes = _figure(
        len(worlds),
        "Gathered candidates to this rank's KV slots (K = k = 2048): our one-stage select-to-slots against our "
        "select + deinterleave and vLLM's chain (device time, lower is better).",
        width=2.6,
        dpi=dpi,
    )
    for ax, w in zip(axes, worlds):
        for order, style in (("rank_local", "o-"), ("global_id", "D-")):
            rs = sorted((r for r in rows if (r["W"], r["order"]) == (w, order)), key=lambda r: r["rows"])
            ax.plot([r["rows"] for r in rs], [r["ours_us"] for r in rs], style, label=f"ours, {order}")
        rs = sorted((r for r in rows if (r["W"], r["order"]) == (w, "global_id")), key=lambda r: r["rows"])
        ax.plot([r["rows"] for r in rs], [r["chain_us"] for r in rs], "s--", label="our select + deinterleave")
        ax.plot([r["rows"] for r in rs], [r["vllm_chain_us"] for r in rs], "v:", label="vLLM top-K + convert")
        ax.set(xscale="log", yscale="log", title=f"W = {w}", xlabel="rows (query tokens)", ylabel="µs")
        _no_minor_labels(ax)
    _finish(fig, axes)
    return _one_legend(axes)


def plot_bandwidth(results: Mapping[str, Any], w: int = 8, dpi: int = DPI) -> Any:
    """Effective bandwidth (bytes of each kernel's traffic model / its time) against rows at one W, with the
    copy bandwidth measured in the same sessions: top-K (graph), deinterleave (cold graph), merge and
    correction (do_bench)."""
    _need(results, "results", ["topk", "deinterleave", "lse_merge"])
    topk, de, lse = results["topk"], results["deinterleave"], results["lse_merge"]
    fig, axes = _figure(
        1,
        f"Effective bandwidth of each memory-bound kernel at W = {w} against the measured "
        "copy bandwidth (the ceiling).",
        width=5.0,
        height=2.8,
        dpi=dpi,
    )
    ax = axes[0]
    rs = sorted((r for r in topk["results"] if r["W"] == w and r["K"] == 2048), key=lambda r: r["rows"])
    ax.plot(
        [r["rows"] for r in rs],
        [r["rows"] * (8 * r["W"] * r["K"] + 4 * r["k"]) / r["cutedsl_graph"]["median_us"] / 1e6 for r in rs],
        "o-",
        label="top-K",
    )
    k = de["shapes"]["topk"]
    rows = sorted({r["rows"] for r in de["results"] if r["W"] == w})
    ax.plot(
        rows,
        [n * (8 * k + 4) / deinterleave_best(de, n, w)["graph_cold_us"] / 1e6 for n in rows],
        "s-",
        label="deinterleave",
    )
    ls = sorted((r for r in lse["rows"] if r["W"] == w), key=lambda r: r["T"])
    ax.plot([r["T"] for r in ls], [r["merge_best"]["eff_TBps"] for r in ls], "D-", label="merge")
    ax.plot([r["T"] for r in ls], [r["correct_best"]["eff_TBps"] for r in ls], "^-", label="correct")
    copy = lse["copy_TBps_measured"]
    xs = sorted({*rows, *[r["rows"] for r in rs], *[r["T"] for r in ls]})
    ax.plot([xs[0], xs[-1]], [copy, copy], "k--", label="copy bandwidth")
    ax.set(xscale="log", title="TB/s", xlabel="rows / T", ylabel="TB/s", ylim=(0, copy * 1.1))
    return _finish(fig, axes, outside=True)


# ---- the step (step.json) -----------------------------------------------------------------------
def _step_rows(step: Mapping[str, Any]) -> list[dict[str, Any]]:
    _need(step, "step", ["summary"])
    rows = step["summary"]
    if not isinstance(rows, list) or not rows:
        raise ValueError("step['summary'] must be a non-empty list of rows")
    return rows


def _stage_dict(row: Mapping[str, Any]) -> dict[str, float] | None:
    """A per-stage breakdown in a step row, if it carries one (a dict of numbers)."""
    for key in ("stages_us", "stage_us", "stages"):
        v = row.get(key)
        if isinstance(v, Mapping) and v and all(isinstance(x, (int, float)) for x in v.values()):
            return {str(a): float(b) for a, b in v.items()}
    return None


def plot_step_breakdown(step: Mapping[str, Any], dpi: int = DPI) -> Any:
    """The whole step per (W, T, ctx): eager (before planning), CUDA-graph replay of the planned step (after),
    and the sum of its stages timed alone; stacked per-stage bars when the rows carry a breakdown."""
    rows = _step_rows(step)
    multi = len({_variant(r) for r in rows}) > 1
    labels = [f"W{r['W']} T{r['T']}\n{_short(r['ctx'])}" + (f"\n{_variant(r)}" if multi else "") for r in rows]
    staged = [_stage_dict(r) for r in rows]
    n = 2 if any(staged) else 1
    many = len(rows) > 12  # the panels one above the other, each as wide as a small figure allows
    fig, axes = _figure(
        n,
        "One decode step before planning (eager) and after (planned, CUDA graph), against the "
        "sum of its stages timed alone.",
        width=min(13.5, max(3.0, 0.42 * len(rows) + 1.5)) if many else max(3.0, 0.45 * len(rows) + 1.2),
        height=2.6,
        dpi=dpi,
        stacked=many,
    )
    ax = axes[0]
    x = list(range(len(rows)))
    wd = 0.27
    for j, (key, lab) in enumerate(
        (("eager_us", "eager"), ("graph_us", "planned (graph)"), ("stages_sum_us", "sum of stages"))
    ):
        ax.bar([i + (j - 1) * wd for i in x], [float(r.get(key) or 0.0) for r in rows], wd, label=lab)
    ax.set_xticks(x, labels, fontsize=5.5 if many else 6)
    ax.set(yscale="log", title="step time", ylabel="µs")
    if n == 2:
        ax2 = axes[1]
        names = list(dict.fromkeys(k for s in staged if s for k in s))
        bottom = [0.0] * len(rows)
        for name in names:
            h = [(s or {}).get(name, 0.0) for s in staged]
            ax2.bar(x, h, 0.6, bottom=bottom, label=name)
            bottom = [a + b for a, b in zip(bottom, h)]
        ax2.set_xticks(x, labels, fontsize=5.5 if many else 6)
        ax2.set(title="per stage", ylabel="µs")
    return _finish(fig, axes, outside=many)


def plot_step_growth(step: Mapping[str, Any], dpi: int = DPI) -> Any:
    """Planned-step time (graph replay) as rows T, W and context grow: one panel per variable, one line per
    combination of the other two."""
    from matplotlib.ticker import NullFormatter, NullLocator

    rows = _step_rows(step)
    multi = len({r.get("attention") for r in rows}) > 1  # several attention kernels: one line each
    fig, axes = _figure(
        3,
        "How the planned step's time grows with query tokens T, world size W and context (CUDA-graph replay).",
        width=6.5 if multi else 3.0,
        height=1.75 if multi else 2.4,
        dpi=dpi,
        stacked=multi,  # many lines: full-width panels, legends beside them
    )
    pairs: tuple[tuple[str, ...], ...] = (("W", "ctx"), ("T", "ctx"), ("W", "T"))
    for ax, var, others in zip(axes, ("T", "W", "ctx"), pairs):
        groups: dict[tuple, list] = {}
        for r in rows:
            groups.setdefault((*(r.get(o) for o in others), _variant(r) if multi else ""), []).append(r)
        for key, rs in sorted(groups.items()):
            if len({r[var] for r in rs}) < 2:
                continue
            rs = sorted(rs, key=lambda r: r[var])
            lab = ", ".join([f"{o}={_short(v)}" for o, v in zip(others, key)] + ([key[-1]] if multi else []))
            style = "o--" if key[-1] == "FP8" else "o-"  # the FP8 cache dashed
            ax.plot([r[var] for r in rs], [r["graph_us"] for r in rs], style, ms=3, label=lab)
        ax.set(xscale="log", yscale="log", title=f"against {var}", xlabel=var, ylabel="µs")
        # the measured values as the ticks (2, 8K, 64K ...), no log-scale minor labels crowding them
        xs = sorted({r[var] for r in rows})
        ax.set_xticks(xs, [_short(v) for v in xs])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_minor_formatter(NullFormatter())
    return _finish(fig, axes, outside=multi)


def _variant(row: Mapping[str, Any]) -> str:
    """What tells two steps of the same shape apart in a label: the cache (FP8) or the attention kernel."""
    return "FP8" if row.get("kv_format") == "fp8_ds_mla" else str(row.get("attention"))


def _short(v: Any) -> str:
    return f"{v // 1024}K" if isinstance(v, int) and v >= 1024 and v % 1024 == 0 else str(v)


# ---- the cost model ------------------------------------------------------------------------------
def plot_fit(fit: cm.Fit, dpi: int = DPI) -> Any:
    """Every measurement the cost model is fitted to against the model's prediction (log-log; on the
    diagonal = exact), one marker per family."""
    if not isinstance(fit, cm.Fit):
        raise TypeError(f"fit must be a costmodel.Fit, got {type(fit).__name__}")
    fig, axes = _figure(
        1,
        "The cost model's fit: each committed measurement against the model's prediction (on the diagonal = exact).",
        width=4.6,
        height=3.0,
        dpi=dpi,
    )
    ax = axes[0]
    fams = list(dict.fromkeys(r.family for r in fit.residuals))
    marks = "osD^v<>ph*"
    for i, fam in enumerate(fams):
        rs = [r for r in fit.residuals if r.family == fam]
        ax.plot(
            [r.measured_s * 1e6 for r in rs], [r.predicted_s * 1e6 for r in rs], marks[i % len(marks)], ms=3, label=fam
        )
    lo = min(min(r.measured_s, r.predicted_s) for r in fit.residuals) * 1e6 * 0.8
    hi = max(max(r.measured_s, r.predicted_s) for r in fit.residuals) * 1e6 * 1.25
    ax.plot([lo, hi], [lo, hi], "k-", lw=0.6, label="_diagonal")
    ax.set(xscale="log", yscale="log", title="model vs measured", xlabel="measured µs", ylabel="predicted µs")
    return _finish(fig, axes, outside=True)


def plot_scaling(
    fit: cm.Fit,
    observations: Sequence[cm.Observation],
    step_points: Sequence[cm.StepPoint] = (),
    tokens: int = 32,
    context: int = 65536,
    world_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
    geometry: cm.MlaGeometry = _GEOMETRY,
    hardware: cm.Hardware = _HARDWARE,
    dpi: int = DPI,
    options: LayerOptions = AS_MEASURED,
) -> Any:
    """Measured points and the model's curves against W on one plot (``T`` tokens, ``context``): the DCP and TP
    layer, the planned step, and the W-dependent stages (select, correct, candidates all-gather) with the
    measurements they were fitted to; right of W = gpus_per_host (shaded) everything is a prediction. ``options``:
    the layer the model curves price (:data:`AS_MEASURED` by default)."""
    c = fit.constants
    fig, axes = _figure(
        1,
        f"Per-layer decode time against W at T = {tokens}, context {_short(context)}: "
        "model curves (lines) and measurements (filled markers); the shaded part spans hosts "
        "and is prediction only.",
        width=6.4,
        height=3.2,
        dpi=dpi,
    )
    ax = axes[0]
    ws = list(world_sizes)

    def curve(fn: Any) -> list[float]:
        return [fn(w) * 1e6 for w in ws]

    K = geometry.local_topk
    ax.plot(
        ws,
        curve(lambda w: cm.dcp_step_cost(w, tokens, context, geometry, hardware, c, options=options).total_s),
        "-",
        color="C0",
        label="model: DCP layer",
    )
    ax.plot(
        ws,
        curve(lambda w: cm.tp_step_cost(w, tokens, context, geometry, hardware, c, options=options).total_s),
        "-",
        color="C1",
        label="model: TP layer",
    )
    ax.plot(
        ws,
        curve(
            lambda w: cm.dcp_step_cost(w, tokens, context, geometry, hardware, c, scope="step", options=options).total_s
        ),
        "--",
        color="C2",
        label="model: DCP planned step",
    )
    ax.plot(
        ws,
        curve(lambda w: c.select.time_s(tokens * (w * K * 8 + geometry.topk * 4)) if w > 1 else 0.0),
        ":",
        color="C3",
        label="model: select",
    )
    ax.plot(
        ws,
        curve(lambda w: cm.collective_time_s("all_gather", tokens * K * 8, w, c, hardware)),
        ":",
        color="C4",
        label="model: candidates all-gather",
    )
    ax.plot(
        ws,
        curve(
            lambda w: (
                c.correct.time_s(tokens * geometry.num_heads * geometry.v_dim * 4 + w * tokens * geometry.num_heads * 4)
                if w > 1
                else 0.0
            )
        ),
        ":",
        color="C5",
        label="model: correct",
    )
    sel = [
        (o, int(o.label.split()[1][2:]))
        for o in observations
        if o.family == "select" and o.label.startswith(f"rows={tokens} ") and o.label.endswith(f"K={K}")
    ]
    if sel:
        ax.plot([w for _, w in sel], [o.seconds * 1e6 for o, _ in sel], "o", color="C3", label="measured: select")
    mer = [
        (o, int(o.label.split()[0][2:]))
        for o in observations
        if o.family == "correct" and o.label.endswith(f"T={tokens}")
    ]
    if mer:
        ax.plot([w for _, w in mer], [o.seconds * 1e6 for o, _ in mer], "D", color="C5", label="measured: correct")
    if tokens == 32:
        ag = [m for m in cm.NCCL_2XH200_T32 if m[0] == "all_gather" and m[1] == 32 * K * 8]
        if ag:
            ax.plot([2], [ag[0][3] * 1e6], "s", color="C4", label="measured: candidates all-gather")
    meas = [p for p in step_points if p.tokens == tokens and p.context == context]
    if meas:
        ax.plot(
            [p.world_size for p in meas],
            [p.graph_s * 1e6 for p in meas],
            "*",
            ms=8,
            color="C2",
            label="measured: planned step",
        )
    ax.axvspan(hardware.gpus_per_host * 1.0001, max(ws) * 1.2, color="0.85", alpha=0.5, lw=0)
    ax.set(xscale="log", yscale="log", title="scaling with W", xlabel="W (ranks)", ylabel="µs per layer")
    ax.set_xticks(ws, [str(w) for w in ws])
    return _finish(fig, axes, outside=True)


def plot_crossover(
    constants: cm.CostConstants,
    world_sizes: Sequence[int] = (2, 4, 8, 16, 32, 64),
    contexts: Sequence[int] | None = None,
    geometry: cm.MlaGeometry = _GEOMETRY,
    hardware: cm.Hardware = _HARDWARE,
    kv_budget_bytes: float = cm.KV_BUDGET_BYTES,
    batch_cap: int = 256,
    dpi: int = DPI,
    options: LayerOptions = AS_MEASURED,
) -> Any:
    """DCP's decode throughput over TP's (each at the batch its KV budget holds) against context, one line per
    W; above 1 DCP wins, and the marker is the crossover (:func:`dcp_ref.costmodel.crossover_context`).
    ``options``: the layer priced (:data:`AS_MEASURED` by default)."""
    kw: dict[str, Any] = {"kv_budget_bytes": kv_budget_bytes, "batch_cap": batch_cap, "options": options}
    ctxs = list(contexts) if contexts is not None else [int(1024 * 2 ** (i / 4)) for i in range(0, 41)]
    fig, axes = _figure(
        1,
        "DCP W over TP W decode throughput, each at the batch its KV memory allows: "
        f"above 1 DCP's memory saving outweighs its communication (model; W > {hardware.gpus_per_host} spans hosts).",
        width=5.6,
        height=3.0,
        dpi=dpi,
    )
    ax = axes[0]
    for i, w in enumerate(world_sizes):
        ratio = [cm.throughput_ratio(w, c, geometry, hardware, constants, **kw) for c in ctxs]
        ax.plot(ctxs, ratio, "-" if w <= hardware.gpus_per_host else "--", color=f"C{i}", label=f"W = {w}")
        x = cm.crossover_context(w, geometry, hardware, constants, **kw)
        if math.isfinite(x) and ctxs[0] <= x <= ctxs[-1]:
            ax.plot(
                [x],
                [cm.throughput_ratio(w, int(x), geometry, hardware, constants, **kw)],
                "o",
                color=f"C{i}",
                label="_crossover",
            )
    ax.plot([ctxs[0], ctxs[-1]], [1, 1], "k-", lw=0.6, label="_parity")
    ax.set(
        xscale="log", yscale="log", title="throughput DCP / TP", xlabel="context (tokens per request)", ylabel="ratio"
    )
    return _finish(fig, axes, outside=True)


# ---- DCP-W against TP-W per rank (the planned layer) -----------------------------------------------------
_COLLECTIVE_STAGES = {
    "query_allgather": "all_gather",
    "candidates_allgather": "all_gather",
    "lse_allgather": "all_gather",
    "output_reduce_scatter": "reduce_scatter",
    "combine_alltoall": "all_to_all",
}
_STAGE_FAMILIES = {
    "indexer": ("local_topk", "pack"),
    "select": ("select",),
    "deinterleave": ("deinterleave",),
    "select_to_slots": ("select_to_slots",),
    "correct": ("correct",),
    "combine": ("combine",),
}


def attention_kernel(constants: cm.CostConstants, tokens: int, heads: int) -> str:
    """``"flashmla"`` or ``"splitkv"``: the attention kernel the cost model (and the planned step) runs for
    ``tokens`` query tokens and ``heads`` heads — FlashMLA only for 64 or 128 heads and more than
    ``constants.splitkv_max_tokens`` tokens."""
    if not isinstance(constants, cm.CostConstants):
        raise TypeError(f"constants must be a costmodel.CostConstants, got {type(constants).__name__}")
    return "flashmla" if heads in (64, 128) and tokens > constants.splitkv_max_tokens else "splitkv"


def stage_basis(fit: cm.Fit, stage: str, *, tokens: int = 32, heads: int = 128) -> str:
    """What a stage's modelled time rests on, read from the fit's data: ``"kernel fit"`` (a line fitted to H200
    kernel measurements), ``"NCCL fit, W = 2"`` (a collective of a kind the fit measured, at those W),
    ``"all_to_all not measured"`` (a collective of another kind: the ring line extrapolated), ``"roofline"``
    (``index_scoring``: bytes at the copy bandwidth, FLOPs at the FP8 peak), ``"step fit"`` (the step overhead
    fitted to ``step.json``) or ``"default"`` (no measurement of that family: the default constant).

    ``tokens`` and ``heads`` pick the attention kernel (:func:`attention_kernel`)."""
    if not isinstance(fit, cm.Fit):
        raise TypeError(f"fit must be a costmodel.Fit, got {type(fit).__name__}")
    measured = {r.family for r in fit.residuals}
    if stage == "index_scoring":
        return "roofline"
    if stage == "step_overhead":
        return "step fit" if "step" in measured else "default"
    if stage in _COLLECTIVE_STAGES:
        kinds: dict[str, set[int]] = {}
        for r in fit.residuals:
            if r.family == "collective":
                kind, _, rest = r.label.partition(" ")
                kinds.setdefault(kind, set()).add(int(rest.rsplit("W=", 1)[1]))
        kind = _COLLECTIVE_STAGES[stage]
        if kind not in kinds:
            return f"{kind} not measured"
        return f"NCCL fit, W = {', '.join(map(str, sorted(kinds[kind])))}"
    if stage == "attention":
        fams: tuple[str, ...] = ("attention" if attention_kernel(fit.constants, tokens, heads) == "flashmla"
                                 else "attention_splitkv",)  # fmt: skip
    elif stage in _STAGE_FAMILIES:
        fams = _STAGE_FAMILIES[stage]
    else:
        raise ValueError(f"stage must be a stage of the cost model (dcp_step_cost / tp_step_cost), got {stage!r}")
    return "kernel fit" if all(f in measured for f in fams) else "default"


def plot_layer_per_rank(
    fit: cm.Fit,
    world_sizes: Sequence[int] = (2, 4, 8),
    tokens: int = 32,
    contexts: Sequence[int] = (8192, 16384, 32768, 65536, 131072),
    options: LayerOptions = PLANNED,
    geometry: cm.MlaGeometry = _GEOMETRY,
    hardware: cm.Hardware = _HARDWARE,
    dpi: int = DPI,
) -> Any:
    """One rank's modelled time per layer, stage by stage, for DCP-W (left bar of each pair) and TP-W (right bar,
    hatched) against context, one panel per W (a prediction: the model's lines, ``options`` the layer's
    :class:`~dcp_ref.options.LayerOptions`; TP is priced with its exchange and the default order, as the
    crossovers price it).

    Bar series are labelled ``"DCP: <stage>"`` / ``"TP: <stage>"`` with their own heights in µs; the legend names
    each stage with :func:`stage_basis`."""
    if not isinstance(fit, cm.Fit):
        raise TypeError(f"fit must be a costmodel.Fit, got {type(fit).__name__}")
    if not isinstance(options, LayerOptions):
        raise TypeError(f"options must be a dcp_ref.options.LayerOptions, got {type(options).__name__}")
    c = fit.constants
    tp_options = cm._tp_options(options)
    ctxs = list(contexts)
    fig, axes = _figure(
        len(world_sizes),
        f"One rank's time per layer at T = {tokens}, stage by stage: DCP W (left bars) against TP W (right, hatched) "
        "over context (model prediction from the fitted lines).",
        width=2.7,
        height=2.6,
        dpi=dpi,
    )
    stages: list[str] = []
    colors: dict[str, Any] = {}
    for ax, w in zip(axes, world_sizes):
        costs = {
            "DCP": [cm.dcp_step_cost(w, tokens, x, geometry, hardware, c, options=options) for x in ctxs],
            "TP": [cm.tp_step_cost(w, tokens, x, geometry, hardware, c, options=tp_options) for x in ctxs],
        }
        for mode, shift, hatch in (("DCP", -0.2, None), ("TP", 0.2, "///")):
            bottom = [0.0] * len(ctxs)
            for stage in costs[mode][0].stages_s:
                if stage not in colors:
                    stages.append(stage)
                    colors[stage] = f"C{len(colors) % 10}"
                ys = [cost.stages_s[stage] * 1e6 for cost in costs[mode]]
                ax.bar([i + shift for i in range(len(ctxs))], ys, 0.38, bottom=bottom, color=colors[stage],
                       hatch=hatch, edgecolor="white" if hatch else None, lw=0, label=f"{mode}: {stage}")  # fmt: skip
                bottom = [b + y for b, y in zip(bottom, ys)]
        ax.set_xticks(range(len(ctxs)), [_short(x) for x in ctxs])
        ax.set(title=f"W = {w}", xlabel="context (tokens)", ylabel="µs per layer, one rank")
    _finish(fig, axes)
    import matplotlib.patches as mpatches

    for ax in axes:
        if ax.get_legend() is not None:
            ax.get_legend().remove()
    heads = geometry.num_heads
    handles = [
        mpatches.Patch(color=colors[s], label=f"{s} ({stage_basis(fit, s, tokens=tokens, heads=heads)})")
        for s in stages
    ]
    axes[-1].legend(handles=handles, fontsize=6, loc="center left", bbox_to_anchor=(1.02, 0.5))
    return fig
