"""Pictures and small simulations for the deinterleave / compaction chapters (04, 05).

Plain functions with tests of their own (``tests/test_deinterleave.py``); the notebooks only call
them. Drawing needs matplotlib (a dependency of the package); nothing here needs a GPU.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from ..contracts import check_int_scalar
from ..geometry import DcpGeometry, check_geometry
from ..ownership import global_to_local, owner_rank

__all__ = ["mapping_table", "draw_id_to_slot_map", "simulate_tile_race", "draw_tile_race"]

_RANK_COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3", "#937860", "#DA8BC3", "#8C8C8C"]


def mapping_table(token_ids: Sequence[int], block_table_row: Sequence[int], geometry: DcpGeometry) -> list[dict]:
    """Each selected id's path: owner rank → local index → block index → block → slot.

    Args:
        token_ids: one row of selected global ids (Python ints; negative = none).
        block_table_row: the request's block-table row on this rank (Python ints).
        geometry: this rank's :class:`~dcp_ref.geometry.DcpGeometry` (world size, rank, interleave, block size).
    Returns:
        One dict per id with keys ``id, owner, local, block_idx, block, slot`` (``None`` for the
        steps that do not apply; ``slot`` is ``-1`` unless the id is a valid local slot).
    """
    g = check_geometry(geometry)
    w, r, i, bs = g.world_size, g.rank, g.interleave, g.block_size
    rows = []
    for t in token_ids:
        t = int(t)
        e: dict[str, int | None] = {"id": t, "owner": None, "local": None, "block_idx": None, "block": None, "slot": -1}
        if t >= 0:  # the ownership stage's own functions: the picture shows what the stage computes
            owner = e["owner"] = owner_rank(t, w, i)
            if owner == r:
                local = e["local"] = global_to_local(t, w, i)
                block_idx = e["block_idx"] = local // bs
                if block_idx < len(block_table_row) and block_table_row[block_idx] >= 0:
                    block = e["block"] = int(block_table_row[block_idx])
                    e["slot"] = block * bs + local % bs
        rows.append(e)
    return rows


def draw_id_to_slot_map(
    token_ids: Sequence[int],
    block_table_row: Sequence[int],
    geometry: DcpGeometry,
    dpi: int = 70,
):
    """Figure: selected global ids (coloured by owner rank) → this rank's local index → slot.

    Three lanes of boxes, one column per selected id, arrows for the ids that survive each step.
    Returns the matplotlib ``Figure`` (small: ``dpi`` ≤ 80 keeps notebooks light).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    table = mapping_table(token_ids, block_table_row, geometry)
    rank, world_size = geometry.rank, geometry.world_size
    n = len(table)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.7 * n + 1.5), 2.6), dpi=min(dpi, 80))
    lanes = [(2.0, "global id"), (1.0, f"local on r{rank}"), (0.0, "slot")]
    for y, label in lanes:
        ax.text(-0.6, y + 0.3, label, ha="right", va="center", fontsize=8)
    for x, e in enumerate(table):
        color = _RANK_COLORS[e["owner"] % len(_RANK_COLORS)] if e["owner"] is not None else "#DDDDDD"
        ax.add_patch(Rectangle((x, 2.0), 0.8, 0.6, color=color))
        ax.text(
            x + 0.4,
            2.3,
            str(e["id"]),
            ha="center",
            va="center",
            fontsize=8,
            color="white" if e["owner"] is not None else "black",
        )
        if e["local"] is not None:
            ax.add_patch(Rectangle((x, 1.0), 0.8, 0.6, fill=False, ec=color, lw=1.5))
            ax.text(x + 0.4, 1.3, f"{e['local']}", ha="center", va="center", fontsize=8)
            ax.annotate("", xy=(x + 0.4, 1.6), xytext=(x + 0.4, 2.0), arrowprops=dict(arrowstyle="->", lw=0.8))
            if e["slot"] >= 0:
                ax.add_patch(Rectangle((x, 0.0), 0.8, 0.6, fill=False, ec="black", lw=1.0))
                ax.text(x + 0.4, 0.3, f"{e['slot']}", ha="center", va="center", fontsize=8)
                ax.annotate("", xy=(x + 0.4, 0.6), xytext=(x + 0.4, 1.0), arrowprops=dict(arrowstyle="->", lw=0.8))
                ax.text(x + 0.85, 0.8, f"b{e['block']}", fontsize=6, color="gray")
            else:
                ax.text(x + 0.4, 0.3, "×", ha="center", va="center", fontsize=10, color="red")
    handles = [Rectangle((0, 0), 1, 1, color=_RANK_COLORS[k % len(_RANK_COLORS)]) for k in range(world_size)]
    ax.legend(
        handles,
        [f"rank {k}" for k in range(world_size)],
        fontsize=6,
        loc="upper right",
        bbox_to_anchor=(1.0, 1.25),
        ncol=world_size,
        frameon=False,
    )
    ax.set_xlim(-0.7, n + 0.2)
    ax.set_ylim(-0.2, 2.8)
    ax.axis("off")
    fig.tight_layout()
    return fig


def simulate_tile_race(
    slots: Sequence[int], block: int, seed: int | None = None, arrival: Sequence[int] | None = None
) -> dict:
    """A Python model of the atomic compaction of one row, with a chosen tile arrival order.

    The row is cut into tiles of ``block`` entries. Tiles reach the per-row counter in the order
    ``arrival`` (a permutation of tile indices; drawn with ``random.Random(seed)`` when ``None``).
    Each tile takes its base with one fetch-and-add and writes its valid entries at
    ``base + exclusive prefix`` (its ``-1`` go to the mirrored place from the back), exactly as
    the ``"atomic"`` Triton kernel does.

    Returns ``{"arrival", "bases", "out", "count"}``: ``bases[tile]`` is the value that tile read
    from the counter, ``out`` the compacted row (list of ints), ``count`` the valid total.
    """
    b = check_int_scalar(block, "block", min_value=1)
    row = [int(s) for s in slots]
    k = len(row)
    n_tiles = -(-k // b) if k else 0
    if arrival is None:
        arrival = list(range(n_tiles))
        random.Random(seed).shuffle(arrival)
    arrival = [int(a) for a in arrival]
    if sorted(arrival) != list(range(n_tiles)):
        raise ValueError(f"arrival must be a permutation of range({n_tiles}), got {arrival}")
    out: list[int | None] = [None] * k
    counter_v = counter_i = 0
    bases: dict[int, int] = {}
    for tile in arrival:
        chunk = row[tile * b : (tile + 1) * b]
        valid = [s for s in chunk if s >= 0]
        bases[tile] = counter_v
        base_i = counter_i
        counter_v += len(valid)  # the fetch-and-add: old value is this tile's base
        counter_i += len(chunk) - len(valid)
        for j, s in enumerate(valid):
            out[bases[tile] + j] = s
        for j in range(len(chunk) - len(valid)):
            out[k - 1 - (base_i + j)] = -1
    assert all(v is not None for v in out)  # every entry written exactly once
    return {"arrival": arrival, "bases": [bases[t] for t in range(n_tiles)], "out": out, "count": counter_v}


def draw_tile_race(slots: Sequence[int], block: int, arrivals: Sequence[Sequence[int]], dpi: int = 70):
    """Figure: the input row (tiles outlined) and the compacted row for each arrival order.

    Valid entries are coloured by the tile they came from, so the reordering across tiles shows.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    row = [int(s) for s in slots]
    k = len(row)
    tile_of: dict[int, int] = {}
    for idx, s in enumerate(row):
        if s >= 0:
            tile_of.setdefault(s, idx // block)
    lanes = [("input", row)] + [
        (f"arrival {list(a)}", simulate_tile_race(row, block, arrival=a)["out"]) for a in arrivals
    ]
    fig, ax = plt.subplots(figsize=(max(4.0, 0.45 * k + 2.5), 0.7 * len(lanes) + 0.4), dpi=min(dpi, 80))
    for li, (label, vals) in enumerate(lanes):
        y = len(lanes) - 1 - li
        ax.text(-0.3, y + 0.3, label, ha="right", va="center", fontsize=7)
        for x, s in enumerate(vals):
            color = _RANK_COLORS[tile_of[s] % len(_RANK_COLORS)] if s >= 0 else "#EEEEEE"
            ax.add_patch(Rectangle((x, y), 0.9, 0.6, color=color))
            ax.text(
                x + 0.45, y + 0.3, str(s), ha="center", va="center", fontsize=6, color="white" if s >= 0 else "gray"
            )
    for t in range(0, k, block):  # tile boundaries of the input row
        ax.add_patch(Rectangle((t - 0.05, len(lanes) - 1 - 0.05), min(block, k - t), 0.7, fill=False, ec="black", lw=1))
    ax.set_xlim(-6.5, k + 0.2)  # room on the left for the lane labels
    ax.set_ylim(-0.2, len(lanes))
    ax.axis("off")
    fig.tight_layout()
    return fig
