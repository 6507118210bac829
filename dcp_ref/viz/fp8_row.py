"""Drawing helper for chapter 09: one row of the FP8 KV cache (DeepSeek V3.2's ``fp8_ds_mla``) as a byte map.

The picture is drawn from :meth:`dcp_ref.fp8_cache.Fp8CacheLayout.segments` (the layout's own byte map), so it
shows the offsets the package reads and writes: ``bytes_per_column`` bytes per column, byte ``b`` in column
``b // bytes_per_column``, row ``b % bytes_per_column``. The x ticks sit on the column edge where each field
starts (and where the row ends), labelled with that byte offset; a label that would stand closer than
``min_gap`` columns to the one before it goes on a second line (a minor tick with a longer mark), so the
scales' and the RoPE's offsets, one column apart, do not overlap. Tested in ``tests/test_fp8_row_viz.py``.
"""

from __future__ import annotations

from typing import Any

from ..contracts import check_int_scalar
from ..fp8_cache import FP8_DS_MLA, Fp8CacheLayout, check_layout

__all__ = ["BYTES_PER_COLUMN", "COLORS", "row_regions", "row_grid", "row_ticks", "draw_fp8_row"]

#: Bytes drawn per column (656 bytes: 41 columns).
BYTES_PER_COLUMN = 16
#: The colour of each kind of byte: even NoPE tiles, odd NoPE tiles, scales, RoPE values.
COLORS = ("#4c72b0", "#8da0cb", "#dd8452", "#55a868")


def row_regions(layout: Fp8CacheLayout = FP8_DS_MLA) -> list[tuple[int, int, str, int]]:
    """``(first_byte, end_byte, name, kind)`` of each drawn field: every NoPE tile (``kind`` 0 or 1, alternating),
    the float32 scales together (``kind`` 2), the bf16 RoPE values (``kind`` 3, absent when ``rope_dim == 0``)."""
    check_layout(layout)
    segs = layout.segments()
    tiles = [s for s in segs if s[2].startswith("NoPE")]
    scales = [s for s in segs if s[2].startswith("scale")]
    rope = [s for s in segs if s[2].startswith("RoPE")]
    out = [(first, end, f"tile {i}", i % 2) for i, (first, end, _) in enumerate(tiles)]
    if scales:
        out.append((scales[0][0], scales[-1][1], "scales", 2))
    out += [(first, end, "RoPE (bf16)", 3) for first, end, _ in rope if end > first]
    return out


def row_grid(layout: Fp8CacheLayout = FP8_DS_MLA, bytes_per_column: int = BYTES_PER_COLUMN) -> list[list[int]]:
    """``grid[r][c]``: the ``kind`` (:func:`row_regions`) of byte ``c * bytes_per_column + r``, ``-1`` past the row's
    end (the last column's padding when ``bytes_per_token`` is not a multiple of ``bytes_per_column``)."""
    check_layout(layout)
    bpc = check_int_scalar(bytes_per_column, "bytes_per_column", min_value=1)
    kind = [-1] * layout.bytes_per_token
    for first, end, _, k in row_regions(layout):
        kind[first:end] = [k] * (end - first)
    cols = -(-layout.bytes_per_token // bpc)
    return [
        [kind[c * bpc + r] if c * bpc + r < layout.bytes_per_token else -1 for c in range(cols)] for r in range(bpc)
    ]


def row_ticks(
    layout: Fp8CacheLayout = FP8_DS_MLA, bytes_per_column: int = BYTES_PER_COLUMN, min_gap: float = 2.0
) -> list[tuple[float, str, int]]:
    """``(x, label, line)`` of every x tick: ``x`` the column edge (image coordinates: column ``c`` spans
    ``c - 0.5 .. c + 0.5``) where a field starts, and where the row ends; ``label`` its byte offset; ``line`` 0, or 1
    for a label within ``min_gap`` columns of the last label on line 0 (drawn on a second line)."""
    check_layout(layout)
    bpc = check_int_scalar(bytes_per_column, "bytes_per_column", min_value=1)
    if isinstance(min_gap, bool) or not isinstance(min_gap, (int, float)):
        raise TypeError(f"min_gap must be a real number of columns, got {type(min_gap).__name__}")
    if not 0 <= min_gap < float("inf"):
        raise ValueError(f"min_gap must be a finite number of columns >= 0, got {min_gap}")
    starts = sorted({first for first, _, _, _ in row_regions(layout)} | {layout.bytes_per_token})
    ticks: list[tuple[float, str, int]] = []
    last = None
    for byte in starts:
        x = byte / bpc - 0.5
        line = 1 if last is not None and x - last < min_gap else 0
        if line == 0:
            last = x
        ticks.append((x, str(byte), line))
    return ticks


def draw_fp8_row(
    layout: Fp8CacheLayout = FP8_DS_MLA, bytes_per_column: int = BYTES_PER_COLUMN, dpi: int = 80, figsize=(8, 2.2)
) -> Any:
    """The byte map of one cache row (a matplotlib ``Figure``): one colour per field, white lines between fields,
    each field named inside it, the ticks of :func:`row_ticks` (second-line labels as minor ticks)."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import BoundaryNorm, ListedColormap

    bpc = check_int_scalar(bytes_per_column, "bytes_per_column", min_value=1)
    grid = row_grid(layout, bpc)
    fig, ax = plt.subplots(figsize=figsize, dpi=dpi)
    cmap = ListedColormap(["white", *COLORS])
    ax.imshow(grid, cmap=cmap, norm=BoundaryNorm([-1.5, -0.5, 0.5, 1.5, 2.5, 3.5], cmap.N), aspect="auto")
    regions = row_regions(layout)
    for first, end, name, _ in regions:
        x0, x1 = first / bpc - 0.5, end / bpc - 0.5
        if first:
            ax.axvline(x0, color="white", lw=1.5)
        narrow = x1 - x0 < 2
        ax.text((x0 + x1) / 2, (bpc - 1) / 2, name, ha="center", va="center", color="white", fontsize=9,
                rotation=90 if narrow else 0)  # fmt: skip
    ticks = row_ticks(layout, bpc)
    first_line = [(x, s) for x, s, line in ticks if line == 0]
    second_line = [(x, s) for x, s, line in ticks if line == 1]
    ax.set_xticks([x for x, _ in first_line], [s for _, s in first_line], fontsize=8)
    ax.set_xticks([x for x, _ in second_line], [s for _, s in second_line], minor=True, fontsize=8)
    ax.tick_params(axis="x", which="minor", length=14, pad=2)
    ax.set_yticks([])
    ax.set_xlabel(f"byte offset ({bpc} bytes per column; ticks where each field starts)")
    ax.set_title(f"one FP8 cache row: {layout.bytes_per_token} bytes", fontsize=10)
    fig.tight_layout()
    return fig
