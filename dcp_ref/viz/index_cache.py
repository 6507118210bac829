"""Drawing helper for chapter 02: one block of the FP8 index-key cache, as text.

The picture is drawn from :meth:`dcp_ref.index_cache.IndexKeyLayout.segments` (the layout's own byte map), so it
shows what the package reads and writes: all the block's e4m3 values first (token ``o`` at byte ``o * 128``),
then all its float32 scales (token ``o`` at byte ``block_size * 128 + 4 * o``). Tested in
``tests/test_index_cache_viz.py``.
"""

from __future__ import annotations

from ..contracts import check_int_scalar
from ..index_cache import INDEX_K_FP8, IndexKeyLayout

__all__ = ["block_layout_text"]


def block_layout_text(block_size: int, layout: IndexKeyLayout = INDEX_K_FP8, value_chars: int = 16) -> str:
    """A text picture of one cache block of ``block_size`` tokens (at most 16: one hex digit per token).

    Line 1 says the block's size; line 2 is a strip in which token ``o``'s values are ``value_chars`` copies of
    its hex digit and its scale one character (not to scale: 4 bytes against 128); line 3 puts the byte offset
    of each token's values, and of the first scale, under its first character; lines 4-5 name the two regions.

    Args:
        block_size: tokens per block, ``1 <= block_size <= 16``.
        layout: the cache layout (default :data:`~dcp_ref.index_cache.INDEX_K_FP8`, 132 bytes per token).
        value_chars: characters drawn per token's values (``>= 4``, room for its offset).
    Returns:
        The picture, five lines joined by newlines.
    """
    bs = check_int_scalar(block_size, "block_size", min_value=1)
    if bs > 16:
        raise ValueError(f"block_size must be <= 16 (one hex digit per token in the picture), got {bs}")
    if not isinstance(layout, IndexKeyLayout):
        raise TypeError(f"layout must be an IndexKeyLayout, got {type(layout).__name__}")
    vc = check_int_scalar(value_chars, "value_chars", min_value=4)
    strip, marks = "|", []
    for first, _end, what in layout.segments(bs):
        token = int(what.split(":")[0].split()[1])  # "token 3: ..." / "scale 3: ..."
        is_value = what.startswith("token")
        if is_value or token == 0:
            marks.append((len(strip), first))
        strip += f"{token:x}" * (vc if is_value else 1)
        if is_value or token == bs - 1:
            strip += "|"
    ruler = [" "] * (len(strip) + 8)
    for col, byte in marks:  # offsets under the first character of each values run and of the scales
        for i, ch in enumerate(str(byte)):
            ruler[col + i] = ch
    total = layout.block_bytes(bs)
    return "\n".join(
        [
            f"one block of {bs} token{'s' if bs > 1 else ''}: {total} bytes = {bs} x {layout.bytes_per_token} "
            f"({layout.head_dim} value bytes + {layout.scale_bytes} scale bytes per token)",
            strip,
            "".join(ruler).rstrip(),
            f" values: {layout.head_dim} e4m3 bytes per token, token o at byte {layout.head_dim}*o",
            f" scales: one float32 per token after all the values, token o at byte {bs * layout.head_dim} + "
            f"{layout.scale_bytes}*o (drawn 1 char each)",
        ]
    )
