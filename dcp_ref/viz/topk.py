"""Drawing helpers for notebook 04: the radix-select passes of :func:`dcp_ref.topk.radix_select_trace`.

Plain functions (tested in ``tests/test_topk.py``); the notebook's widget only calls them.
"""

from __future__ import annotations

from typing import Any

from ..topk import RadixPass

__all__ = ["radix_pass_text", "draw_radix_passes", "digit_bits"]


def digit_bits(p: RadixPass) -> tuple[int, int]:
    """``(high, low)``: the key bits pass ``p`` looks at (its digit is ``len(p.hist) = 2**bits`` wide)."""
    bits = len(p.hist).bit_length() - 1
    return p.shift + bits - 1, p.shift


def radix_pass_text(passes: list[RadixPass], step: int, k: int) -> str:
    """A text panel for pass ``step`` (0-based): the non-empty bins, the chosen one, what is left.

    Returns a multi-line string; ``step`` is clamped to the available passes.
    """
    if not passes:
        return f"every valid key wins (no more than k={k} valid candidates): no pass needed"
    p = passes[max(0, min(step, len(passes) - 1))]
    high, low = digit_bits(p)
    hexw = (high - low + 4) // 4  # hex digits of a bin number
    lines = [f"pass {passes.index(p) + 1}/{len(passes)}: digit = bits {high}..{low} of the key"]
    for b in range(len(p.hist) - 1, -1, -1):
        if p.hist[b]:
            mark = "  <- k-th largest is here" if b == p.chosen else ("  (all win)" if b > p.chosen else "")
            lines.append(f"  bin 0x{b:0{hexw}x}: {'#' * p.hist[b]} {p.hist[b]}{mark}")
    lines.append(f"above the chosen bin: {p.above}; still needed from it: {p.need_after}")
    lines.append(
        "threshold found (bin holds exactly what is needed)" if p.done else "refine inside the chosen bin next"
    )
    return "\n".join(lines)


def draw_radix_passes(passes: list[RadixPass], dpi: int = 60) -> Any:
    """One small bar chart per pass (non-empty bins only; the chosen bin in orange).

    Returns the matplotlib ``Figure`` (``None`` when there is no pass).
    """
    import matplotlib.pyplot as plt

    if not passes:
        return None
    fig, axes = plt.subplots(1, len(passes), figsize=(2.2 * len(passes), 1.8), dpi=dpi, squeeze=False)
    for ax, p in zip(axes[0], passes):
        bins = [b for b in range(len(p.hist)) if p.hist[b]]
        colors = ["tab:orange" if b == p.chosen else ("tab:green" if b > p.chosen else "tab:gray") for b in bins]
        ax.bar(range(len(bins)), [p.hist[b] for b in bins], color=colors)
        ax.set_xticks(range(len(bins)))
        ax.set_xticklabels([f"{b:02x}" for b in bins], fontsize=6, rotation=90)
        high, low = digit_bits(p)
        ax.set_title(f"bits {high}..{low}", fontsize=8)
        ax.tick_params(axis="y", labelsize=6)
    fig.tight_layout()
    return fig
