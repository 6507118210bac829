"""A picture of the planned step as parts: for each spec, the part each option axis chose, its stages and collectives.

:func:`step_parts_table` is the same as text. Both read the parts as :mod:`dcp_ref.axes` plans them (no buffer
is made): what is drawn is what the step runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..axes import COLLECTIVE_NAMES, part_types
from ..stages import StepSpec

__all__ = ["step_parts", "step_parts_table", "draw_step_parts"]

_AXIS = ("query", "indexing", "exchange", "attention", "combine")
_SHORT = {
    COLLECTIVE_NAMES[0]: "all-gather q",
    COLLECTIVE_NAMES[1]: "all-gather candidates",
    COLLECTIVE_NAMES[2]: "all-gather LSE",
    COLLECTIVE_NAMES[3]: "reduce-scatter out",
    COLLECTIVE_NAMES[4]: "all-to-all",
}


def step_parts(spec: StepSpec) -> list[dict[str, Any]]:
    """Per part, in run order: ``{"axis", "part" (class name), "stages", "collectives"}`` for ``spec``."""
    if not isinstance(spec, StepSpec):
        raise TypeError(f"spec must be a dcp_ref.stages.StepSpec, got {type(spec).__name__}")
    return [
        {"axis": axis, "part": cls.__name__, "stages": cls.stages_for(spec), "collectives": cls.collectives_for(spec)}
        for axis, cls in zip(_AXIS, part_types(spec))
    ]


def _cell(p: dict[str, Any]) -> str:
    stages = ", ".join(p["stages"]) or "-"
    coll = ", ".join(_SHORT[c] for c in p["collectives"])
    return f"{p['part']}: {stages}" + (f" [{coll}]" if coll else "")


def step_parts_table(specs: Sequence[tuple[str, StepSpec]]) -> str:
    """One line per part, one column per ``(label, spec)``: the part chosen, its stages, ``[its collectives]``."""
    cols = [(label, step_parts(spec)) for label, spec in specs]
    lines = [" | ".join(["axis".ljust(9)] + [label for label, _ in cols])]
    for i, axis in enumerate(_AXIS):
        lines.append(" | ".join([axis.ljust(9)] + [_cell(parts[i]) for _, parts in cols]))
    return "\n".join(lines)


def draw_step_parts(specs: Sequence[tuple[str, StepSpec]], ax: Any = None) -> Any:
    """A grid: rows are the option axes in run order, columns the ``(label, spec)`` given; each box the part the
    spec chose (its class), its stages and, in orange, the collectives it calls. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    cols = [(label, step_parts(spec)) for label, spec in specs]
    n = len(cols)
    if ax is None:
        fig, ax = plt.subplots(figsize=(2.9 * n + 1.4, 5.2))
    else:
        fig = ax.figure
    ax.set_xlim(-0.9, n)
    ax.set_ylim(-0.6, len(_AXIS) + 0.2)
    ax.axis("off")
    kinds = {"NoCombine": "#eeeeee", "QueryPath": "#dbe9f6"}
    for j, (label, parts) in enumerate(cols):
        ax.text(j + 0.45, len(_AXIS) - 0.05, label, ha="center", va="bottom", fontsize=8.5, weight="bold")
        for i, p in enumerate(parts):
            y = len(_AXIS) - 1 - i
            idle = not p["collectives"] and (not p["stages"] or p["part"] == "QueryPath")
            face = "#f4f4f4" if idle else kinds.get(p["part"], "#e3f1e0")
            ax.add_patch(FancyBboxPatch((j + 0.02, y + 0.1), 0.86, 0.72, boxstyle="round,pad=0.02", fc=face,
                                        ec="#888888", lw=0.8))  # fmt: skip
            ax.text(j + 0.45, y + 0.62, p["part"], ha="center", fontsize=7.5, weight="bold")
            none = "(q as it is)" if p["part"] == "QueryPath" else "(the partial is the answer)"
            what = ", ".join(p["stages"]) or none
            ax.text(j + 0.45, y + 0.40, what, ha="center", fontsize=6.5)
            coll = ", ".join(_SHORT[c] for c in p["collectives"])
            if coll:
                ax.text(j + 0.45, y + 0.19, coll, ha="center", fontsize=6.5, color="#c05a00")
            if i + 1 < len(parts):
                ax.annotate("", xy=(j + 0.45, y - 0.16), xytext=(j + 0.45, y + 0.08),
                            arrowprops=dict(arrowstyle="->", color="#999999", lw=0.7))  # fmt: skip
    for i, axis in enumerate(_AXIS):
        ax.text(-0.1, len(_AXIS) - 1 - i + 0.46, axis, ha="right", va="center", fontsize=8.5, style="italic")
    ax.text(-0.85, -0.45, "each box: the part the spec chose (dcp_ref.axes), its stages; orange: its collectives",
            fontsize=7, color="#555555")  # fmt: skip
    fig.tight_layout()
    return fig
