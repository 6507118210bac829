"""Drawing helpers for chapter 06: how much of the GPU each sparse-MLA attention kernel keeps busy.

Plain functions of the parsed ``benchmarks/results/attention.json`` (``bench_attention.py``; its ``summary`` rows
carry ``impl``, ``T``, ``H``, ``K``, ``cache``, ``graph_us``, ``ctas`` and ``sm_busy``, and ``versions.sm_count``
the SMs of the device). Why it matters: FlashMLA's SM90 sparse kernel runs one CTA per (token, 64 heads), so at
one query token and 128 heads two CTAs work on a 132-SM H200; the split-KV kernel also splits each row's keys over
CTAs and fills the device (``dcp_ref.kernels.attention_splitkv_triton``).

Tested in ``tests/test_attention_viz.py``; the chapter only calls them. matplotlib is imported inside
:func:`plot_sm_busy`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..contracts import check_int_scalar

__all__ = ["KERNEL_LABELS", "sm_count", "sm_busy_rows", "plot_sm_busy"]

#: The kernels compared, by their ``impl`` in ``attention.json``, and how the figure names them.
KERNEL_LABELS: dict[str, str] = {"splitkv": "split-KV (Triton)", "flashmla_bf16": "FlashMLA bf16 (SM90)"}


def _summary(attention: object) -> list[Mapping[str, Any]]:
    if not isinstance(attention, Mapping):
        raise TypeError(f"attention must be the parsed attention.json (a dict), got {type(attention).__name__}")
    rows = attention.get("summary")
    if not isinstance(rows, list):
        raise ValueError("attention lacks the list 'summary' (is it benchmarks/results/attention.json?)")
    return rows


def sm_count(attention: Mapping[str, Any]) -> int:
    """The SMs of the device the file was measured on (``versions.sm_count``, else ``config.sm_count``)."""
    _summary(attention)
    for part in ("versions", "config"):
        v = attention.get(part, {}).get("sm_count") if isinstance(attention.get(part), Mapping) else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    raise ValueError("attention lacks versions.sm_count (the device's SM count)")


def sm_busy_rows(
    attention: Mapping[str, Any], impl: str, *, heads: int = 128, keys: int = 2048
) -> list[dict[str, Any]]:
    """One kernel's rows at ``heads`` heads and ``keys`` slots per token (bf16 cache), sorted by ``T``.

    Args:
        attention: the parsed ``attention.json``.
        impl: ``"splitkv"`` or ``"flashmla_bf16"`` (any ``impl`` of the file with a CTA count).
        heads, keys: ``H`` and ``K`` of the rows.
    Returns:
        ``[{"T", "ctas", "sm_busy", "sms_busy", "graph_us"}, ...]`` where ``sms_busy = sm_busy * sm_count``
        (the SMs that have a CTA, as the benchmark counted them). Raises ``ValueError`` naming ``impl`` when the
        file has no such row.
    """
    rows = _summary(attention)
    if not isinstance(impl, str):
        raise TypeError(f"impl must be a str, got {type(impl).__name__}")
    h = check_int_scalar(heads, "heads", min_value=1)
    k = check_int_scalar(keys, "keys", min_value=1)
    sms = sm_count(attention)
    got = [
        {
            "T": int(r["T"]),
            "ctas": int(r["ctas"]),
            "sm_busy": float(r["sm_busy"]),
            "sms_busy": float(r["sm_busy"]) * sms,
            "graph_us": float(r["graph_us"]),
        }
        for r in rows
        if r.get("impl") == impl
        and (r.get("H"), r.get("K"), r.get("cache")) == (h, k, "bf16")
        and r.get("ctas") is not None
        and r.get("sm_busy") is not None
    ]
    if not got:
        raise ValueError(f"impl {impl!r} has no row with a CTA count at H = {h}, K = {k} (bf16) in attention")
    return sorted(got, key=lambda r: r["T"])


def plot_sm_busy(attention: Mapping[str, Any], *, heads: int = 128, keys: int = 2048, dpi: int = 70) -> Any:
    """Two small panels against the query tokens ``T``: the SMs each kernel keeps busy (with the device's SM
    count as a dashed line) and its graph-replay time (µs), for the kernels of :data:`KERNEL_LABELS`.

    Series labels are the kernels' names (:data:`KERNEL_LABELS`); panel titles ``"SMs busy"`` and ``"time"``.
    Returns the matplotlib ``Figure`` (``dpi`` <= 80).
    """
    import matplotlib.pyplot as plt

    d = check_int_scalar(dpi, "dpi", min_value=1)
    if d > 80:
        raise ValueError(f"dpi must be in [1, 80] (small figures), got {d}")
    sms = sm_count(attention)
    series = {impl: sm_busy_rows(attention, impl, heads=heads, keys=keys) for impl in KERNEL_LABELS}
    fig, (a, b) = plt.subplots(1, 2, figsize=(6.0, 2.3), dpi=d)
    for (impl, rows), mark in zip(series.items(), ("o-", "s--")):
        t = [r["T"] for r in rows]
        a.plot(t, [r["sms_busy"] for r in rows], mark, label=KERNEL_LABELS[impl])
        b.plot(t, [r["graph_us"] for r in rows], mark, label=KERNEL_LABELS[impl])
    ts = sorted({r["T"] for rows in series.values() for r in rows})
    a.plot([ts[0], ts[-1]], [sms, sms], "k:", lw=0.8, label=f"{sms} SMs")
    a.set(xscale="log", title="SMs busy", xlabel="T (query tokens)", ylabel="SMs with a CTA", ylim=(0, sms * 1.1))
    b.set(xscale="log", yscale="log", title="time", xlabel="T (query tokens)", ylabel="µs (graph replay)")
    for ax in (a, b):
        ax.tick_params(labelsize=7)
        ax.title.set_fontsize(8)
        ax.xaxis.label.set_fontsize(7)
        ax.yaxis.label.set_fontsize(7)
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=6, loc="best")
    fig.suptitle(f"Sparse MLA attention at H = {heads}, K = {keys}: SMs kept busy and time per call.", fontsize=8)
    fig.tight_layout()
    plt.close(fig)  # the caller displays it; no second copy from the inline backend
    return fig
