"""Drawing helpers for chapter 03: the radix-select passes of :func:`dcp_ref.topk.radix_select_trace`.

Plain functions (tested in ``tests/test_topk_viz.py`` and ``tests/test_topk.py``); the notebook's widget only
calls them.
"""

from __future__ import annotations

from typing import Any

from ..topk import RadixPass

__all__ = ["BIN_ROLES", "bin_role", "chosen_bin_outcome", "digit_bits", "draw_radix_passes", "radix_pass_text"]

#: What a non-empty bin of a pass is, by role: ``(colour, legend label)``. The chosen bin (the one holding the
#: k-th largest key) has one of three roles: refined by the next pass, or — when no next pass follows — either
#: all its keys win (it holds exactly the keys still needed) or, with every key bit used, its keys are equal and
#: the first ones still needed win.
BIN_ROLES: dict[str, tuple[str, str]] = {
    "win": ("tab:green", "all its keys win"),
    "refine": ("tab:orange", "k-th key's bin: refined by the next pass"),
    "threshold": ("tab:olive", "k-th key's bin, no next pass: all its keys win"),
    "ties": ("tab:purple", "k-th key's bin, every bit used: the first needed win"),
    "lose": ("tab:gray", "all its keys lose"),
}


def digit_bits(p: RadixPass) -> tuple[int, int]:
    """``(high, low)``: the key bits pass ``p`` looks at (its digit is ``len(p.hist) = 2**bits`` wide)."""
    bits = len(p.hist).bit_length() - 1
    return p.shift + bits - 1, p.shift


def bin_role(p: RadixPass, b: int) -> str:
    """The role (a key of :data:`BIN_ROLES`) of bin ``b`` in pass ``p``.

    A pass is followed by another only when its chosen bin holds more keys than are still needed
    (``not p.done``) and key bits are left below its digit (``p.shift > 0``).
    """
    if b > p.chosen:
        return "win"
    if b < p.chosen:
        return "lose"
    if p.done:
        return "threshold"
    return "ties" if p.shift == 0 else "refine"


def chosen_bin_outcome(p: RadixPass) -> str:
    """One line: what happens to the chosen bin of pass ``p`` (refined next, or which of its keys win)."""
    role = bin_role(p, p.chosen)
    if role == "threshold":
        return "threshold found (bin holds exactly what is needed): all its keys win, no next pass"
    if role == "ties":
        return f"every key bit used: the keys left in the bin are equal; the first {p.need_after} of them win"
    return "refine inside the chosen bin next"


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
    lines.append(chosen_bin_outcome(p))
    return "\n".join(lines)


def draw_radix_passes(passes: list[RadixPass], dpi: int = 60) -> Any:
    """One small bar chart per pass (non-empty bins only), coloured by :func:`bin_role`, with a legend of
    the roles that occur.

    Returns the matplotlib ``Figure`` (``None`` when there is no pass).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not passes:
        return None
    roles = [[bin_role(p, b) for b in range(len(p.hist)) if p.hist[b]] for p in passes]
    shown = [r for r in BIN_ROLES if any(r in rs for rs in roles)]
    ncol = 2
    legend_rows = -(-len(shown) // ncol)
    height = 1.8 + 0.18 * legend_rows
    fig, axes = plt.subplots(1, len(passes), figsize=(max(2.2 * len(passes), 4.4), height), dpi=dpi, squeeze=False)
    for ax, p, rs in zip(axes[0], passes, roles):
        bins = [b for b in range(len(p.hist)) if p.hist[b]]
        ax.bar(range(len(bins)), [p.hist[b] for b in bins], color=[BIN_ROLES[r][0] for r in rs])
        ax.set_xticks(range(len(bins)))
        ax.set_xticklabels([f"{b:02x}" for b in bins], fontsize=6, rotation=90)
        high, low = digit_bits(p)
        ax.set_title(f"bits {high}..{low}", fontsize=8)
        ax.tick_params(axis="y", labelsize=6)
    handles = [Patch(color=BIN_ROLES[r][0], label=BIN_ROLES[r][1]) for r in shown]
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=6, frameon=False)
    fig.tight_layout(rect=(0, 0.18 * legend_rows / height, 1, 1))
    return fig
