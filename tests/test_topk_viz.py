"""dcp_ref.viz.topk labels each radix pass with the key bits its digit covers, for any digit width."""

from __future__ import annotations

import matplotlib
import pytest

from dcp_ref.topk import radix_select_trace
from dcp_ref.viz.topk import digit_bits, draw_radix_passes, radix_pass_text

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
