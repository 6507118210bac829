"""dcp_ref.viz.topk labels each radix pass with the key bits its digit covers, for any digit width, and colours
the chosen bin "refined by the next pass" only where a next pass follows."""

from __future__ import annotations

import matplotlib
import pytest
from matplotlib.colors import to_hex

from dcp_ref.topk import radix_select_trace
from dcp_ref.viz.topk import BIN_ROLES, bin_role, digit_bits, draw_radix_passes, radix_pass_text

matplotlib.use("Agg")  # before draw_radix_passes imports pyplot


@pytest.mark.parametrize("bits", [4, 8, 16])
def test_pass_labels_follow_the_digit_width(bits: int) -> None:
    # Keys equal in their top 2*bits bits: the first two passes both pick the same bin.
    keys = [(0xABCD << 48) | i for i in range(1, 40)]
    _, passes = radix_select_trace(keys, 5, bits=bits)
    assert len(passes) >= 2
    for n, p in enumerate(passes[:2]):
        top = 63 - n * bits  # pass n looks at bits [64 - (n+1)*bits, 64 - n*bits)
        assert digit_bits(p) == (top, top - bits + 1)
        assert f"digit = bits {top}..{top - bits + 1} of the key" in radix_pass_text(passes, n, 5)
    fig = draw_radix_passes(passes[:2])
    assert [ax.get_title() for ax in fig.axes] == [f"bits {63 - n * bits}..{64 - (n + 1) * bits}" for n in range(2)]
    # Bin numbers printed with as many hex digits as the digit has.
    assert f"bin 0x{(0xABCD << 48) >> (64 - bits):0{(bits + 3) // 4}x}:" in radix_pass_text(passes, 0, 5)


def _legend_labels(fig) -> list[str]:
    return [t.get_text() for leg in fig.legends for t in leg.get_texts()]


def test_only_a_pass_with_a_next_pass_says_refined_by_it() -> None:
    # Two passes, the second finds the threshold: its chosen bin is not "refined by the next pass".
    keys = [(0xAB << 56) | (i << 48) for i in range(1, 9)] + [(0x10 << 56) | 1, (0xF0 << 56) | 1]
    _, passes = radix_select_trace(keys, 4)
    assert len(passes) == 2 and not passes[0].done and passes[1].done
    assert bin_role(passes[0], passes[0].chosen) == "refine"
    assert bin_role(passes[1], passes[1].chosen) == "threshold"
    assert "refine" not in radix_pass_text(passes, 1, 4) and "no next pass" in radix_pass_text(passes, 1, 4)
    fig = draw_radix_passes(passes)
    labels = _legend_labels(fig)
    assert labels == [BIN_ROLES[r][1] for r in ("win", "refine", "threshold", "lose")]
    # Each bar has its role's colour: the last pass's chosen bin is not drawn in the "refine" colour.
    last = fig.axes[1]
    bins = [b for b in range(len(passes[1].hist)) if passes[1].hist[b]]
    chosen_bar = last.patches[bins.index(passes[1].chosen)]
    assert to_hex(chosen_bar.get_facecolor()) == to_hex(BIN_ROLES["threshold"][0])
    assert to_hex(chosen_bar.get_facecolor()) != to_hex(BIN_ROLES["refine"][0])


def test_a_last_digit_of_equal_keys_takes_the_first_needed() -> None:
    # Duplicated keys: no pass finds the threshold early, the last digit (shift 0) ends with ties.
    _, passes = radix_select_trace([5] * 6 + [9], 3)
    assert passes[-1].shift == 0 and not passes[-1].done
    assert bin_role(passes[-1], passes[-1].chosen) == "ties"
    assert all(bin_role(p, p.chosen) == "refine" for p in passes[:-1])
    assert "the first 2 of them win" in radix_pass_text(passes, len(passes) - 1, 3)
    assert BIN_ROLES["ties"][1] in _legend_labels(draw_radix_passes(passes))
    assert BIN_ROLES["threshold"][1] not in _legend_labels(draw_radix_passes(passes))
