"""dcp_ref.viz.index_cache draws one FP8 index-key block as the byte map the cache really has.

The expected picture is built here by hand from the layout's definition (values of token ``o`` at byte ``128*o``,
then the float32 scales at ``block_size*128 + 4*o``), not from ``IndexKeyLayout.segments``; a second check reads
a real cache's bytes at the drawn offsets.
"""

from __future__ import annotations

import struct

import pytest
import torch

from dcp_ref.index_cache import INDEX_K_FP8, IndexKeyLayout, make_index_cache, write_index_keys
from dcp_ref.viz.index_cache import block_layout_text


@pytest.mark.parametrize("bs", [1, 2, 4, 7, 16])
def test_strip_and_offsets_follow_the_layout(bs: int) -> None:
    vc = 6
    lines = block_layout_text(bs, value_chars=vc).split("\n")
    assert len(lines) == 5
    assert lines[0].startswith(f"one block of {bs} token") and f"{bs * 132} bytes" in lines[0]
    # the strip: each token's values, then every scale, one hex digit per token
    want = "|" + "".join(f"{o:x}" * vc + "|" for o in range(bs)) + "".join(f"{o:x}" for o in range(bs)) + "|"
    assert lines[1] == want
    # the ruler: token o's values start at byte 128*o, the scales at bs*128, each under its first character
    for o in range(bs):
        col = 1 + o * (vc + 1)
        assert lines[2][col:].split()[0] == str(128 * o), (o, lines[2])
    scales_col = 1 + bs * (vc + 1)
    assert lines[2][scales_col:].split()[0] == str(bs * 128)
    assert f"token o at byte {bs * 128} + 4*o" in lines[4]


def test_the_drawn_offsets_hold_a_written_key() -> None:
    """Write one key into slot 2 of a 4-token block and read its bytes where the picture says they are."""
    bs = 4
    cache = make_index_cache(1, bs)
    key = (torch.arange(128) % 5 - 2).to(torch.float32)  # amax 2: scale 2/448 rounded up to 2**-7, values exact
    write_index_keys(cache, torch.tensor([-1, -1, 2, -1]), torch.stack([key] * 4), bs)
    raw = bytes(cache.reshape(-1).tolist())
    text = block_layout_text(bs)
    assert "token o at byte 128*o" in text and "token o at byte 512 + 4*o" in text
    vals = torch.tensor(list(raw[2 * 128 : 3 * 128]), dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    (scale,) = struct.unpack("<f", raw[512 + 4 * 2 : 512 + 4 * 3])
    assert scale == 2.0**-7 and torch.equal(vals * scale, key)
    assert raw[0:128] == b"\xff" * 128  # slot 0 was never written


def test_bad_arguments_name_themselves() -> None:
    with pytest.raises(ValueError, match=r"^block_size"):
        block_layout_text(0)
    with pytest.raises(ValueError, match=r"^block_size"):
        block_layout_text(17)
    with pytest.raises(TypeError, match=r"^layout"):
        block_layout_text(4, layout="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^value_chars"):
        block_layout_text(4, value_chars=2)
    assert block_layout_text(4, IndexKeyLayout()) == block_layout_text(4, INDEX_K_FP8)
