"""dcp_ref.viz.fp8_row draws one FP8 cache row as the byte map the cache really has, with legible ticks.

The expected regions and offsets are written here by hand from the layout's definition (four 128-byte e4m3
tiles, four float32 scales at 512, 64 bf16 RoPE values at 528, 656 bytes), not from ``Fp8CacheLayout.segments``;
a second check reads a quantized row's bytes where the picture puts them; a third renders the figure and checks
that no two tick labels overlap (the 512 and 528 labels, one column apart, once did).
"""

from __future__ import annotations

import itertools
import struct

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
import torch

from dcp_ref.fp8_cache import FP8_DS_MLA, Fp8CacheLayout, quantize_kv_fp8
from dcp_ref.viz.fp8_row import draw_fp8_row, row_grid, row_regions, row_ticks


def test_regions_and_grid_follow_the_layout() -> None:
    want = [(0, 128, "tile 0", 0), (128, 256, "tile 1", 1), (256, 384, "tile 2", 0), (384, 512, "tile 3", 1),
            (512, 528, "scales", 2), (528, 656, "RoPE (bf16)", 3)]  # fmt: skip
    assert row_regions(FP8_DS_MLA) == want
    grid = row_grid(FP8_DS_MLA, 16)
    assert len(grid) == 16 and all(len(r) == 41 for r in grid)
    for byte in range(656):
        k = next(k for first, end, _, k in want if first <= byte < end)
        assert grid[byte % 16][byte // 16] == k, byte
    # a row that does not fill its last column: the rest is padding (-1)
    small = Fp8CacheLayout(nope_dim=128, rope_dim=4, tile_size=64)  # 128 + 2*4 + 4*2 = 144 bytes
    g = row_grid(small, 32)
    assert [g[r][4] for r in range(32)] == [2] * 8 + [3] * 8 + [-1] * 16


def test_ticks_mark_each_field_and_stagger_close_labels() -> None:
    ticks = row_ticks(FP8_DS_MLA, 16)
    assert [s for _, s, _ in ticks] == ["0", "128", "256", "384", "512", "528", "656"]
    assert [x for x, _, _ in ticks] == [b / 16 - 0.5 for b in (0, 128, 256, 384, 512, 528, 656)]
    # 528 is one column after 512: its label goes on the second line; every other label stays on the first
    assert [line for _, _, line in ticks] == [0, 0, 0, 0, 0, 1, 0]
    assert [line for _, _, line in row_ticks(FP8_DS_MLA, 16, min_gap=0.5)] == [0] * 7
    for bad, err in (("2", TypeError), (True, TypeError), (-1.0, ValueError), (float("nan"), ValueError)):
        with pytest.raises(err, match="min_gap"):
            row_ticks(FP8_DS_MLA, 16, min_gap=bad)


def test_the_drawn_offsets_hold_a_quantized_row() -> None:
    """Quantize one row and read its bytes at the drawn offsets: the scales at 512, the RoPE values at 528."""
    kv = torch.randn(1, 576).bfloat16()
    row = quantize_kv_fp8(kv)[0]
    starts = {name: first for first, _, name, _ in row_regions(FP8_DS_MLA)}
    s = starts["scales"]
    scales = struct.unpack("<4f", bytes(row[s : s + 16].tolist()))
    assert all(x > 0 and float(x).hex().startswith("0x1.0000000000000p") for x in scales)  # powers of two
    r = starts["RoPE (bf16)"]
    assert row[r:].tolist() == kv[0, 512:].contiguous().view(torch.uint8).tolist()


@pytest.mark.parametrize("dpi", [60, 80])
def test_no_two_tick_labels_overlap(dpi: int) -> None:
    fig = draw_fp8_row(FP8_DS_MLA, dpi=dpi)
    try:
        fig.canvas.draw()
        ax = fig.axes[0]
        labels = [t for t in ax.get_xticklabels() + ax.get_xticklabels(minor=True) if t.get_text()]
        assert sorted(t.get_text() for t in labels) == sorted(["0", "128", "256", "384", "512", "528", "656"])
        boxes = [(t.get_text(), t.get_window_extent()) for t in labels]
        for (a, ba), (b, bb) in itertools.combinations(boxes, 2):
            assert not ba.overlaps(bb), (a, b, ba, bb)
    finally:
        plt.close(fig)
