"""The drawings behind notebook 01 and its widget, checked as text (no browser needed)."""

from __future__ import annotations

import re

import matplotlib

matplotlib.use("Agg")

import pytest

from dcp_ref.viz.ownership import (
    ownership_figure,
    ownership_grid,
    ownership_widget,
    prefill_bounds_figure,
    prefill_bounds_grid,
)


def _rows(text: str, label: str) -> list[int]:
    vals: list[int] = []
    for line in text.splitlines():
        if line.startswith(label):
            vals += [int(v) for v in re.findall(r"\d+", line.split("|", 1)[1])]
    return vals


@pytest.mark.parametrize("w,i,n", [(2, 2, 8), (3, 1, 20), (4, 3, 37), (1, 5, 9)])
def test_grid_rows_follow_dealing(w: int, i: int, n: int) -> None:
    text = ownership_grid(n, w, interleave=i, width=7)
    assert _rows(text, "pos") == list(range(n))
    # Independent oracle: deal runs of i to w ranks by hand.
    ranks, locals_, counts = [], [], [0] * w
    for p in range(n):
        r = (p // i) % w
        ranks.append(r)
        locals_.append(counts[r])
        counts[r] += 1
    assert _rows(text, "rank") == ranks
    assert _rows(text, "local") == locals_


def test_grid_marks_and_summarises_rank() -> None:
    text = ownership_grid(10, 2, rank=1, interleave=1)
    assert "rank 1: 5 local tokens -> positions [1, 3, 5, 7, 9]" in text
    pos_line = next(line for line in text.splitlines() if line.startswith("pos"))
    assert pos_line.count("*") == 5


def test_prefill_grid_is_causal() -> None:
    text = prefill_bounds_grid(3, 2, world_size=2, rank=1, interleave=2)
    rows = [line for line in text.splitlines() if line.startswith("q@")]
    assert len(rows) == 2 and all(row.endswith("##") for row in rows)


def test_widget_redraws_synchronously() -> None:
    box = ownership_widget(seq_len=8, world_size=2, interleave=2, rank=1)
    (controls, html_w) = box.children
    assert '<pre id="ownership-grid">' in html_w.value
    w_s = controls.children[0].children[0]
    r_s = controls.children[1].children[1]
    w_s.value = 4
    r_s.value = 3
    assert "W=4 I=2 L=8" in html_w.value and "rank 3: 2 local tokens" in html_w.value
    w_s.value = 2  # rank slider is clamped to the new world size
    assert r_s.value == 1 and "rank 1:" in html_w.value


def test_figures_build() -> None:
    import matplotlib.pyplot as plt

    fig = ownership_figure(20, 3, rank=1, interleave=2)
    assert len(fig.axes[0].patches) == 20
    fig2 = prefill_bounds_figure(5, 4, 3, 1)
    assert len(fig2.axes) == 3
    plt.close("all")


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        ownership_grid(-1, 2)
    with pytest.raises(ValueError, match="rank"):
        ownership_grid(4, 2, rank=2, interleave=1)
