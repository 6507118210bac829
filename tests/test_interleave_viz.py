"""dcp_ref.viz.interleave: per-rank load and the two slot schemes, against brute force (dealing the tokens)."""

from __future__ import annotations

import random

import matplotlib

matplotlib.use("Agg")

import pytest

from dcp_ref.viz.interleave import deal_slot, draw_per_rank_load, load_imbalance, per_rank_load, shared_table_slot


def _deal(n: int, W: int, I: int) -> list[tuple[int, int]]:
    """(owner, local index) of positions 0..n-1, by dealing runs of I tokens to W ranks in turn."""
    counts, out = [0] * W, []
    for p in range(n):
        r = (p // I) % W
        out.append((r, counts[r]))
        counts[r] += 1
    return out


@pytest.mark.parametrize("W,I", [(1, 1), (2, 1), (4, 2), (4, 64), (3, 5)])
def test_per_rank_load_is_the_dealt_count(W: int, I: int) -> None:
    rng = random.Random(W * 100 + I)
    lens = [rng.randrange(0, 300) for _ in range(7)]
    want = [0] * W
    for n in lens:
        for r, _ in _deal(n, W, I):
            want[r] += 1
    assert per_rank_load(lens, W, I) == want
    assert sum(want) == sum(lens)
    assert load_imbalance(lens, W, I) == pytest.approx(max(want) * W / sum(lens))


def test_short_requests_pile_up_on_rank_zero_as_interleave_grows() -> None:
    short = [40] * 16  # every request shorter than W*I = 256 for I = 64
    assert per_rank_load(short, 4, 64) == [640, 0, 0, 0]  # all on rank 0
    assert per_rank_load(short, 4, 1) == [160, 160, 160, 160]
    assert load_imbalance(short, 4, 64) == 4.0 and load_imbalance(short, 4, 1) == 1.0
    # a long request is balanced to within I tokens per rank, whatever I
    load = per_rank_load([100_003], 4, 64)
    assert max(load) - min(load) <= 64
    assert load_imbalance([], 4, 2) == 1.0 and per_rank_load([], 3, 2) == [0, 0, 0]


def test_figure_is_small_and_names_the_imbalance() -> None:
    import matplotlib.pyplot as plt

    fig = draw_per_rank_load({"short": [40] * 16, "long": [100_003]}, 4, [1, 64], dpi=60)
    try:
        assert fig.dpi <= 80 and len(fig.axes) == 2
        assert fig.axes[0].get_title().endswith("1.00, 4.00")
        bars = [b.get_height() for b in fig.axes[0].patches]
        assert bars[:4] == pytest.approx([25.0] * 4) and bars[4:] == pytest.approx([100.0, 0, 0, 0])
    finally:
        plt.close(fig)
    with pytest.raises(ValueError, match="dpi must be <= 80"):
        draw_per_rank_load({"a": [1]}, 2, [1], dpi=100)
    with pytest.raises(ValueError, match="must not be empty"):
        draw_per_rank_load({}, 2, [1])


@pytest.mark.parametrize("W,I,bs", [(2, 1, 4), (2, 2, 4), (4, 2, 8), (3, 4, 4), (2, 3, 6)])
def test_the_shared_table_equals_the_deal_when_block_size_is_a_multiple_of_interleave(W, I, bs) -> None:
    """One table, the same ids on every rank: vLLM's virtual blocks give this project's slot for every position."""
    row = [7, 3, 9, 12, 5, 1]
    dealt = _deal(W * bs * len(row), W, I)
    for p, (owner, local) in enumerate(dealt):
        for r in range(W):
            want = row[local // bs] * bs + local % bs if r == owner else -1
            assert deal_slot(p, row, W, r, I, block_size=bs) == want
            assert shared_table_slot(p, row, W, r, I, block_size=bs) == want


def test_the_shared_table_breaks_when_block_size_is_not_a_multiple_of_interleave() -> None:
    """W = 2, I = 2, block size 3: the deal restarts at each virtual block of 6 positions; rank 0 gets 4 of
    the first 6 (offset 3 = the first slot of the *next* physical block) and position 6 changes owner."""
    W, I, bs, row = 2, 2, 3, [7, 3]
    owners = [next(r for r in range(W) if shared_table_slot(p, row, W, r, I, block_size=bs) >= 0) for p in range(12)]
    assert owners == [0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0]
    assert [r for r, _ in _deal(12, W, I)] == [0, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 1]
    assert shared_table_slot(5, row, W, 0, I, block_size=bs) == 7 * bs + 3 == 8 * bs  # block 8's first slot
    assert (
        deal_slot(5, row, W, 0, I, block_size=bs) == 3 * bs + 0
    )  # the deal: local index 3 -> local block 1 -> block 3
