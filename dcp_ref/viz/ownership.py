"""Drawings for the ownership stage: text grids, matplotlib figures and the notebook widget.

The widget in ``notebooks/01_ownership.ipynb`` is a thin shell around :func:`ownership_grid`
(plain text, tested in ``tests/test_ownership_viz.py``), so what the widget shows is checked
without a browser.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import torch

from ..contracts import check_int_scalar, check_world
from ..ownership import global_to_local, localize_prefill_chunk, owner_rank

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["ownership_grid", "ownership_figure", "prefill_bounds_grid", "prefill_bounds_figure", "ownership_widget"]


def ownership_grid(
    seq_len: int, world_size: int, *, rank: int | None = None, interleave: int = 1, width: int = 16
) -> str:
    """Text picture of the interleaved layout of positions ``0 .. seq_len-1``.

    Three rows per block of ``width`` positions: global position, owner rank, local index. When
    ``rank`` is given, that rank's tokens are marked with ``*`` and a summary line lists its local
    length and positions. ``rank`` and ``interleave`` are keyword-only (the geometry's order is
    ``world_size, rank, interleave``; keywords keep an old positional call from being read in another).

    Example (W=2, I=2, L=8)::

        pos   |   0   1   2   3   4   5   6   7
        rank  |   0   0   1   1   0   0   1   1
        local |   0   1   0   1   2   3   2   3
    """
    w, r, i = check_world(world_size, rank, interleave)
    n = check_int_scalar(seq_len, "seq_len", min_value=0)
    width = check_int_scalar(width, "width", min_value=1)
    pos = torch.arange(n)
    owners = owner_rank(pos, w, i).tolist() if n else []
    locs = global_to_local(pos, w, i).tolist() if n else []
    cell = max(3, len(str(max(n - 1, 0))) + 1)
    lines = [f"W={w} I={i} L={n}" + (f"  (* = on rank {r})" if r is not None else "")]
    for start in range(0, n, width):
        idx = range(start, min(start + width, n))
        mark = [("*" if r is not None and owners[p] == r else " ") for p in idx]
        lines.append("pos   |" + "".join(f"{p:>{cell}}{m}" for p, m in zip(idx, mark)))
        lines.append("rank  |" + "".join(f"{owners[p]:>{cell}} " for p in idx))
        lines.append("local |" + "".join(f"{locs[p]:>{cell}} " for p in idx))
        lines.append("")
    if r is not None:
        mine = [p for p in range(n) if owners[p] == r]
        shown = ", ".join(map(str, mine[:24])) + (", ..." if len(mine) > 24 else "")
        lines.append(f"rank {r}: {len(mine)} local tokens -> positions [{shown}]")
    return "\n".join(lines).rstrip("\n") + "\n"


def ownership_figure(
    seq_len: int, world_size: int, *, rank: int | None = None, interleave: int = 1, width: int = 32
) -> Figure:
    """Colour-coded grid of the layout: one cell per position, colour = owner, text = local index."""
    import matplotlib.pyplot as plt

    w, r, i = check_world(world_size, rank, interleave)
    n = check_int_scalar(seq_len, "seq_len", min_value=1)
    rows = (n + width - 1) // width
    owners = owner_rank(torch.arange(n), w, i).tolist()
    locs = global_to_local(torch.arange(n), w, i).tolist()
    cmap = plt.get_cmap("tab10" if w <= 10 else "tab20")
    fig, ax = plt.subplots(figsize=(min(0.32 * width, 11), 0.42 * rows + 0.8), dpi=72)
    for p in range(n):
        y, x = divmod(p, width)
        faded = r is not None and owners[p] != r
        ax.add_patch(plt.Rectangle((x, -y), 1, 1, color=cmap(owners[p] % cmap.N), alpha=0.25 if faded else 0.9))
        ax.text(x + 0.5, -y + 0.5, str(locs[p]), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, width)
    ax.set_ylim(-rows + 1, 1)
    ax.set_aspect("equal")
    ax.axis("off")
    title = f"owner rank (colour) and local index (text): W={w}, I={i}, L={n}"
    ax.set_title(title + (f", rank {r} highlighted" if r is not None else ""), fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(k % cmap.N)) for k in range(w)]
    ax.legend(
        handles, [f"rank {k}" for k in range(w)], loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False
    )
    fig.tight_layout()
    return fig


def prefill_bounds_grid(context_len: int, query_len: int, world_size: int, rank: int, interleave: int = 1) -> str:
    """Text causal mask of one prefill request on one rank, in *local* key coordinates.

    One row per query token (global position ``context_len + j``); column ``k`` is the ``k``-th
    local key; ``#`` = visible (inside ``[ks, ke)``), ``.`` = masked.
    """
    meta = localize_prefill_chunk([context_len], [query_len], world_size, rank, interleave)
    n_local = meta.local_total
    lines = [f"rank {rank}: {n_local} local keys; rows = query tokens, # = visible"]
    for j, (ks, ke) in enumerate(zip(meta.token_ks.tolist(), meta.token_ke.tolist())):
        row = "".join("#" if ks <= k < ke else "." for k in range(n_local))
        lines.append(f"q@{context_len + j:>4} [{ks:>3},{ke:>3}) {row}")
    return "\n".join(lines) + "\n"


def prefill_bounds_figure(context_len: int, query_len: int, world_size: int, interleave: int = 1) -> Figure:
    """One panel per rank: the causal mask of one prefill request in that rank's local keys."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    w, _, i = check_world(world_size, None, interleave)
    fig, axes = plt.subplots(1, w, figsize=(2.6 * w, 2.6), dpi=72, squeeze=False)
    for r, ax in enumerate(axes[0]):
        meta = localize_prefill_chunk([context_len], [query_len], w, r, i)
        n_local = max(meta.local_total, 1)
        keys = torch.arange(n_local)
        mask = (keys >= meta.token_ks[:, None]) & (keys < meta.token_ke[:, None])
        ax.imshow(mask.numpy(), cmap="Blues", vmin=0, vmax=1.3, aspect="auto", interpolation="nearest")
        ax.set_title(f"rank {r}: {meta.local_total} keys", fontsize=8)
        ax.set_xlabel("local key", fontsize=7)
        if r == 0:
            ax.set_ylabel("query token", fontsize=7)
        ax.tick_params(labelsize=6)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    fig.suptitle(f"prefill causal bounds, context={context_len}, chunk={query_len}, W={w}, I={i}", fontsize=9)
    fig.tight_layout()
    return fig


def ownership_widget(seq_len: int = 24, world_size: int = 2, *, rank: int = 1, interleave: int = 2) -> Any:
    """An ipywidgets control (W, I, L, rank) redrawing :func:`ownership_grid` into an HTML ``<pre>``.

    Returns ``(controls, html_widget)`` packed in a ``VBox``; ``.children[1].value`` holds the
    current drawing (what a browser test asserts on). Changing a slider redraws synchronously.
    """
    import ipywidgets as widgets

    w_s = widgets.IntSlider(value=world_size, min=1, max=8, description="world size")
    i_s = widgets.IntSlider(value=interleave, min=1, max=8, description="interleave")
    l_s = widgets.IntSlider(value=seq_len, min=0, max=96, description="seq len")
    r_s = widgets.IntSlider(value=rank, min=0, max=world_size - 1, description="rank")
    out = widgets.HTML()

    def redraw(_: object = None) -> None:
        r_s.max = w_s.value - 1  # clamps r_s.value too
        text = ownership_grid(l_s.value, w_s.value, rank=r_s.value, interleave=i_s.value)
        out.value = f'<pre id="ownership-grid">{html.escape(text)}</pre>'

    for s in (w_s, i_s, l_s, r_s):
        s.observe(redraw, names="value")
    redraw()
    return widgets.VBox([widgets.HBox([widgets.VBox([w_s, i_s]), widgets.VBox([l_s, r_s])]), out])
