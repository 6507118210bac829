"""Choosing the interleave ``I``, and what the block size has to do with it (chapter 04).

Plain functions, tested in ``tests/test_interleave_viz.py``; the notebook only calls them.

* :func:`per_rank_load` / :func:`draw_per_rank_load`: how many KV tokens each rank of a DCP group stores for a
  batch of requests, for several ``I``. Every request's first ``I`` tokens go to rank 0, its next ``I`` to rank
  1, ...: a request shorter than ``W*I`` tokens lives on a few ranks only, and a batch of short requests piles
  up on the low ranks. Long requests stay balanced to within ``I`` tokens per rank whatever ``I``.
* :func:`shared_table_slot`: the slot vLLM's worker computes for a position when **one** block table, with
  the same block ids on every rank, addresses a "virtual block" of ``W * block_size`` positions
  (vLLM ``vllm/v1/worker/block_table.py``, ``_compute_slot_mapping_kernel``). That scheme equals this
  project's global deal (owner ``(p // I) % W``, local index ``(p // (W*I))*I + p % I``, block ``local //
  block_size``) only when ``block_size % I == 0``; :func:`shared_table_slot` lets a chapter show the
  difference on a worked example.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..contracts import check_int_scalar, check_world
from ..ownership import global_to_local, local_seq_lens, owner_rank

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = ["per_rank_load", "load_imbalance", "draw_per_rank_load", "shared_table_slot", "deal_slot"]


def per_rank_load(seq_lens: Sequence[int], world_size: int, interleave: int = 1) -> list[int]:
    """KV tokens each rank stores for requests of ``seq_lens`` tokens (summed over the requests).

    Args:
        seq_lens: the requests' lengths (ints >= 0).
        world_size, interleave: ``W >= 1``, ``I >= 1``.
    Returns:
        ``W`` ints, rank order; they sum to ``sum(seq_lens)``. (:func:`dcp_ref.ownership.local_seq_lens`.)
    """
    w, _, i = check_world(world_size, None, interleave)
    lens = [check_int_scalar(v, "seq_lens", min_value=0) for v in seq_lens]
    if not lens:
        return [0] * w
    per = local_seq_lens(torch.tensor(lens, dtype=torch.int64), w, None, i)  # [B, W]
    return [int(v) for v in per.sum(0).tolist()]


def load_imbalance(seq_lens: Sequence[int], world_size: int, interleave: int = 1) -> float:
    """Busiest rank's tokens over the mean per rank (1.0 = perfectly even; ``W`` = all on one rank)."""
    load = per_rank_load(seq_lens, world_size, interleave)
    total = sum(load)
    return 1.0 if total == 0 else max(load) * len(load) / total


def draw_per_rank_load(
    batches: dict[str, Sequence[int]],
    world_size: int,
    interleaves: Sequence[int],
    dpi: int = 72,
) -> Figure:
    """One panel per batch: the tokens each rank stores, one group of bars per interleave ``I``.

    Args:
        batches: title -> request lengths (e.g. ``{"64 short requests": [...], "one long request": [...]}``).
        world_size: ``W``.
        interleaves: the ``I`` values to compare.
        dpi: <= 80 (figures stay small).
    Returns:
        the matplotlib ``Figure``; each panel's title ends with the busiest rank's share over the mean.
    """
    import matplotlib.pyplot as plt

    dpi = check_int_scalar(dpi, "dpi", min_value=1)
    if dpi > 80:
        raise ValueError(f"dpi must be <= 80 (figures are kept small), got {dpi}")
    w = check_int_scalar(world_size, "world_size", min_value=1)
    ivals = [check_int_scalar(i, "interleaves", min_value=1) for i in interleaves]
    if not ivals or not batches:
        raise ValueError("interleaves and batches must not be empty")
    fig, axes = plt.subplots(1, len(batches), figsize=(4.6 * len(batches), 3.0), dpi=dpi, squeeze=False)
    width = 0.8 / len(ivals)
    for ax, (title, lens) in zip(axes[0], batches.items()):
        total = sum(int(v) for v in lens)
        worst = []
        for n, i in enumerate(ivals):
            load = per_rank_load(lens, w, i)
            share = [100.0 * v / total if total else 0.0 for v in load]
            ax.bar([r + (n - (len(ivals) - 1) / 2) * width for r in range(w)], share, width, label=f"I = {i}")
            worst.append(f"{load_imbalance(lens, w, i):.2f}")
        ax.axhline(100.0 / w, color="0.4", lw=0.8, ls="--")
        ax.set_xticks(range(w), [f"rank {r}" for r in range(w)], fontsize=8)
        ax.set_ylabel("% of the batch's KV tokens", fontsize=8)
        ax.set_title(f"{title}: busiest / mean = " + ", ".join(worst), fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
        for spine in ("top", "right"):
            ax.spines[spine].set_visible(False)
    axes[0][0].legend(fontsize=7, frameon=False)
    fig.suptitle(f"KV tokens per rank, W = {w}: short requests pile up on the low ranks as I grows.", fontsize=9)
    fig.tight_layout()
    return fig


def deal_slot(
    pos: int, block_table_row: Sequence[int], world_size: int, rank: int, interleave: int = 1, *, block_size: int
) -> int:
    """This project's slot of global position ``pos`` on ``rank`` (``-1`` if another rank owns it or its local
    block is past the row): the global deal, then the rank's own block table of *local* indices —
    ``block_table_row[local // block_size] * block_size + local % block_size``. Any ``block_size >= 1``.

    Loose ints, not a :class:`~dcp_ref.geometry.DcpGeometry`: the chapter also draws block sizes that are not a
    multiple of ``I``, which a geometry refuses. The geometry in the project's order (``world_size, rank,
    interleave``), ``block_size`` keyword-only."""
    w, r, i = check_world(world_size, rank, interleave)
    bs = check_int_scalar(block_size, "block_size", min_value=1)
    p = check_int_scalar(pos, "pos", min_value=0)
    if owner_rank(p, w, i) != r:
        return -1
    local = global_to_local(p, w, i)
    j = local // bs
    return -1 if j >= len(block_table_row) else int(block_table_row[j]) * bs + local % bs


def shared_table_slot(
    pos: int, block_table_row: Sequence[int], world_size: int, rank: int, interleave: int = 1, *, block_size: int
) -> int:
    """vLLM's slot of global position ``pos`` on ``rank``, ``-1`` when it is not this rank's (see the module doc).

    One block table for the whole DCP group, the same ids on every rank: entry ``j`` covers the *virtual*
    block of positions ``[j*W*bs, (j+1)*W*bs)``, dealt inside it in stripes of ``I``::

        j, v   = pos // (W*bs), pos % (W*bs)
        owner  = (v // I) % W
        offset = (v // (W*I)) * I + v % I
        slot   = block_table_row[j] * bs + offset

    With ``bs % I == 0`` a virtual block holds whole rounds of the deal, and this is :func:`deal_slot` with the
    same row on every rank. Otherwise the deal restarts at every virtual block (another owner than
    ``(pos // I) % W``) and a rank's share of one virtual block can exceed ``bs``: ``offset >= bs`` is a slot
    of the *next* physical block, which belongs to whoever the allocator gave it to.
    """
    w, r, i = check_world(world_size, rank, interleave)
    bs = check_int_scalar(block_size, "block_size", min_value=1)
    p = check_int_scalar(pos, "pos", min_value=0)
    j, v = divmod(p, w * bs)
    if (v // i) % w != r or j >= len(block_table_row):
        return -1
    return int(block_table_row[j]) * bs + (v // (w * i)) * i + v % i
