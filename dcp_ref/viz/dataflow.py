"""One attention layer's decode data flow across the ``W`` ranks of a DCP group: shapes and bytes.

Plain functions for chapter 00 (tested in ``tests/test_dataflow_viz.py``): :func:`layer_dataflow`
lists the steps one rank runs, with the tensor it holds after each step and, for the collectives of
the default layer (vLLM's: query gathered over heads, LSEs all-gathered, output reduce-scattered), the
bytes per query token it contributes and receives; :func:`kv_cache_per_rank`
gives what DCP saves in exchange; :func:`draw_layer_dataflow` draws both. Byte counts come from
:mod:`dcp_ref.costmodel` (``MlaGeometry``: DeepSeek-V3.2's sizes by default).

How many collectives a layer calls depends on what its :class:`~dcp_ref.stages.StepSpec` chooses:
:func:`step_collectives` lists them from the spec, and :class:`CountingGroup` records the ones a real run
of :class:`~dcp_ref.step.PlannedStep` calls (the tests check that the two agree for every choice).

Where the pieces come from (as in vLLM's MLA with DCP, which runs inside the TP group): each rank's
query projection produces only its own ``H/W`` heads (TP splits the projection by heads); an
all-gather over the group gives every rank all ``H`` heads, because every rank must attend *its*
keys for *every* head. After the merge, a reduce-scatter over heads hands each rank the ``H/W``
heads it owns again, which its value up-projection and output projection (split by heads, as in
TP) consume — an all-reduce would leave all ``H`` heads everywhere and move twice the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..axes import COLLECTIVE_NAMES as _AXES_COLLECTIVES
from ..contracts import check_int_scalar
from ..costmodel import (
    MlaGeometry,
    candidate_bytes,
    kv_bytes_per_rank,
    lse_bytes,
    output_all_reduce_bytes,
    output_reduce_scatter_bytes,
    query_allgather_bytes,
)

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = [
    "FlowStep",
    "layer_dataflow",
    "kv_cache_per_rank",
    "format_bytes",
    "dataflow_table",
    "draw_layer_dataflow",
    "COLLECTIVE_NAMES",
    "step_collectives",
    "CountingGroup",
]

#: The collectives a planned step can call, named as in :func:`layer_dataflow` (``"partials all-to-all"``: the
#: one exchange of ``combine="alltoall"``, which replaces the LSE all-gather and the output reduce-scatter).
COLLECTIVE_NAMES = _AXES_COLLECTIVES  # one list: the step's parts (dcp_ref.axes) name what they call


@dataclass(frozen=True)
class FlowStep:
    """One step of a layer's decode on one rank.

    Attributes:
        name: the step (stages named as in the chapters).
        shape: what this rank holds after the step, with dtype (``T`` query tokens).
        collective: ``True`` for a collective of the DCP group.
        sent: bytes per query token this rank contributes (all-gather) or puts in (reduce-scatter).
        received: bytes per query token of this rank's result (a gathered buffer includes its own
            slice).
        link: bytes per query token this rank puts on its ring links.
        note: one line on why (or what the alternative would cost).
    """

    name: str
    shape: str
    collective: bool = False
    sent: int = 0
    received: int = 0
    link: int = 0
    note: str = ""


def format_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (B, KiB, MiB, GiB; one decimal above bytes)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def layer_dataflow(world_size: int = 4, geometry: MlaGeometry | None = None) -> list[FlowStep]:
    """The steps of one attention layer's decode on one rank of ``world_size``, in order.

    Args:
        world_size: ``W >= 1``, dividing ``geometry.num_heads`` (heads are split ``W`` ways).
        geometry: the layer (``H`` heads, ``576``-dim queries, ``512``-dim values, ``K``
            candidates per rank, top ``k``); default DeepSeek-V3.2's.
    Returns:
        :class:`FlowStep` list; bytes are per query token and per layer.
    Raises:
        ValueError / TypeError: ``world_size`` not a positive int dividing ``num_heads``.
    """
    g = MlaGeometry() if geometry is None else geometry
    w = check_int_scalar(world_size, "world_size", min_value=1)
    if g.num_heads % w:
        raise ValueError(f"world_size must divide num_heads={g.num_heads} (heads are split W ways), got {w}")
    h, hw, dq, dv, kl, k = g.num_heads, g.num_heads // w, g.qk_dim, g.v_dim, g.local_topk, g.topk
    q = query_allgather_bytes(1, w, g)
    cand = candidate_bytes(1, w, g)
    lse = lse_bytes(1, w, g)
    rs = output_reduce_scatter_bytes(1, w, g)
    ar = output_all_reduce_bytes(1, w, g)
    return [
        FlowStep("query projection", f"q [T, {hw}, {dq}] bf16", note=f"this rank's H/W = {hw} heads, as in TP"),
        FlowStep(
            "query all-gather over heads",
            f"q [T, {h}, {dq}] bf16",
            True,
            q.sent,
            q.received,
            q.link,
            "every rank attends its own keys for all H heads",
        ),
        FlowStep("indexer: local top-K", f"ids [T, {kl}] int32", note="scores only the c/W keys this rank stores"),
        FlowStep("pack (score, global id)", f"cand [T, {kl}, 2] f32", note="one 8-byte pair per candidate"),
        FlowStep(
            "candidates all-gather",
            f"[{w}, T, {kl}, 2] f32",
            True,
            cand.sent,
            cand.received,
            cand.link,
            "8·K bytes sent, 8·W·K received per token",
        ),
        FlowStep("stable top-K (select)", f"ids [T, {k}] int32", note="the same k global ids on every rank"),
        FlowStep(
            "deinterleave + compaction",
            f"slots [T, {k}] int32, counts [T]",
            note=f"about k/W = {k // w} of them on this rank",
        ),
        FlowStep(
            "attention (all H heads, this rank's keys)",
            f"out [T, {h}, {dv}] bf16, lse [T, {h}] f32",
            note="a partial softmax per head; empty row: 0 and -inf",
        ),
        FlowStep(
            "LSE all-gather",
            f"lse [{w}, T, {h}] f32",
            True,
            lse.sent,
            lse.received,
            lse.link,
            "4·H bytes sent, 4·W·H received per token",
        ),
        FlowStep(
            "correct (rescale by its weight)",
            f"out [T, {h}, {dv}] bf16",
            note="exp(lse_r - lse) · out_r (LSEs in base e, as the attention stage returns them)",
        ),
        FlowStep(
            "output reduce-scatter over heads",
            f"out [T, {hw}, {dv}] bf16",
            True,
            rs.sent,
            rs.received,
            rs.link,
            f"an all-reduce would keep all {h} heads and put {format_bytes(ar.link)} on the links",
        ),
        FlowStep(
            "value up-projection + output projection",
            f"[T, {hw}] heads -> hidden",
            note="split by heads as in TP; TP's all-reduce follows",
        ),
    ]


def kv_cache_per_rank(context: int, world_size: int, geometry: MlaGeometry | None = None) -> dict[str, int]:
    """Bytes of one request's MLA KV cache on one rank, all layers: ``{"tp", "dcp", "saved"}``.

    TP keeps every token on every rank; DCP keeps the busiest rank's share (``c/W`` when
    ``W·I`` divides ``c``). See :func:`dcp_ref.costmodel.kv_bytes_per_rank`.
    """
    g = MlaGeometry() if geometry is None else geometry
    tp = kv_bytes_per_rank(context, world_size, "tp", g) * g.layers
    dcp = kv_bytes_per_rank(context, world_size, "dcp", g) * g.layers
    return {"tp": tp, "dcp": dcp, "saved": tp - dcp}


def dataflow_table(world_size: int = 4, geometry: MlaGeometry | None = None) -> str:
    """:func:`layer_dataflow` as a text table (one row per step; bytes per query token)."""
    rows = [("step", "this rank holds", "sends", "receives", "on links")]
    for s in layer_dataflow(world_size, geometry):
        b = (format_bytes(s.sent), format_bytes(s.received), format_bytes(s.link)) if s.collective else ("", "", "")
        rows.append(((">> " if s.collective else "   ") + s.name, s.shape, *b))
    wd = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"{r[0]:<{wd[0]}}  {r[1]:<{wd[1]}}  {r[2]:>{wd[2]}}  {r[3]:>{wd[3]}}  {r[4]:>{wd[4]}}" for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def draw_layer_dataflow(
    world_size: int = 4, geometry: MlaGeometry | None = None, context: int = 131072, dpi: int = 72
) -> Figure:
    """One layer's decode across the ``W`` ranks, with shapes and bytes; the KV saving below it.

    Local steps are boxes in every rank's column (every rank runs the same code); a collective is
    a band across all columns, labelled with the bytes one rank sends and receives per query
    token. The lower panel compares one ``context``-token request's KV cache per rank (all
    layers) under TP and under DCP. Returns the matplotlib ``Figure`` (``dpi <= 80``).
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    dpi = check_int_scalar(dpi, "dpi", min_value=1)
    if dpi > 80:
        raise ValueError(f"dpi must be <= 80 (figures are kept small), got {dpi}")
    g = MlaGeometry() if geometry is None else geometry
    steps = layer_dataflow(world_size, g)
    w = world_size
    n = len(steps)
    fig, (ax, axm) = plt.subplots(
        2, 1, figsize=(11.5, 7.6), dpi=dpi, gridspec_kw={"height_ratios": [n, 1.6]}, squeeze=True
    )
    x0, colw = 4.3, min(0.9, 3.6 / w)
    xr = x0 + w * colw + 0.15  # right-hand column: bytes
    for j in range(w):
        ax.text(x0 + (j + 0.5) * colw, -0.75, f"rank {j}", ha="center", va="center", fontsize=8)
    for i, s in enumerate(steps):
        y = i
        ax.text(0.0, y - 0.12, s.name, ha="left", va="center", fontsize=8.5, weight="bold" if s.collective else None)
        ax.text(0.0, y + 0.25, s.shape, ha="left", va="center", fontsize=7.5, family="monospace", color="0.25")
        if s.collective:
            band = FancyBboxPatch(
                (x0 + 0.05, y - 0.35), w * colw - 0.1, 0.7, boxstyle="round,pad=0.02", fc="tab:orange", alpha=0.35
            )
            ax.add_patch(band)
            for j in range(w):  # every rank sends into the band and receives from it
                ax.annotate(
                    "",
                    (x0 + (j + 0.5) * colw, y + 0.3),
                    (x0 + (j + 0.5) * colw, y - 0.3),
                    arrowprops={"arrowstyle": "<->", "color": "tab:orange", "lw": 1},
                )
            ax.text(
                xr,
                y - 0.12,
                f"sends {format_bytes(s.sent)}, receives {format_bytes(s.received)} per token",
                ha="left",
                va="center",
                fontsize=8,
                color="tab:red",
            )
        else:
            for j in range(w):
                ax.add_patch(
                    FancyBboxPatch(
                        (x0 + j * colw + 0.08, y - 0.3),
                        colw - 0.16,
                        0.6,
                        boxstyle="round,pad=0.02",
                        fc="tab:blue",
                        alpha=0.2,
                    )
                )
        ax.text(xr, y + 0.25, s.note, ha="left", va="center", fontsize=7.5, color="0.3")
        if i + 1 < n:
            for j in range(w):
                xc = x0 + (j + 0.5) * colw
                ax.plot([xc, xc], [y + 0.36, y + 0.64], color="0.6", lw=0.8)
    ax.set_xlim(0, 11.5)
    ax.set_ylim(n - 0.4, -1.2)
    ax.axis("off")
    ax.set_title(
        f"One layer's decode on W = {w} ranks (H = {g.num_heads}, K = k = {g.topk}; bytes per query token)",
        fontsize=10,
        loc="left",
    )

    kv = kv_cache_per_rank(context, w, g)
    axm.barh([1, 0], [kv["tp"] / 2**30, kv["dcp"] / 2**30], color=["0.6", "tab:blue"], height=0.6)
    axm.set_yticks([1, 0], ["TP: every rank", f"DCP {w}: one rank"], fontsize=8)
    axm.set_xlabel(
        f"KV cache of one {context:,}-token request per rank, {g.layers} layers, {g.kv_layout} (GiB)", fontsize=8
    )
    axm.tick_params(axis="x", labelsize=7)
    axm.text(
        kv["dcp"] / 2**30, 0, f"  saves {format_bytes(kv['saved'])} per rank", va="center", fontsize=8, color="tab:blue"
    )
    for spine in ("top", "right"):
        axm.spines[spine].set_visible(False)
    fig.tight_layout()
    return fig


def step_collectives(spec: Any, world_size: int | None = None) -> list[str]:
    """The collectives one run of a :class:`~dcp_ref.step.PlannedStep` planned for ``spec`` calls, in order.

    As the step's parts decide them (:func:`dcp_ref.axes.layer_collectives`: one source, no copy of the rule):
    the query all-gather over heads when the layout is ``"dcp"``, the query is
    not replicated and ``W > 1``; when the cache is split over more than one rank (``"dcp"`` with ``W > 1``) the
    candidates' all-gather, then either the LSE all-gather and the output reduce-scatter
    (``combine="reduce_scatter"``) or one all-to-all of partial outputs and LSEs (``combine="alltoall"``).
    ``layout="tp"`` calls none. So a DCP layer calls 2 to 4.

    Args:
        spec: a :class:`dcp_ref.spec.StepSpec` (its options and its ``W``), or a
            :class:`~dcp_ref.options.LayerOptions` with ``world_size``.
        world_size: ``W``, with a ``LayerOptions`` only (a spec carries its own).
    Returns:
        names from :data:`COLLECTIVE_NAMES`, in the order a run calls them.
    """
    from ..options import LayerOptions
    from ..stages import StepSpec

    if isinstance(spec, StepSpec):
        if world_size is not None:
            raise ValueError("world_size must be None with a StepSpec (the spec's geometry gives W)")
        options, w = spec.options, spec.geometry.world_size
    elif isinstance(spec, LayerOptions):
        if world_size is None:
            raise ValueError("world_size must be given with a LayerOptions (a spec carries its own)")
        options, w = spec, check_int_scalar(world_size, "world_size", min_value=1)
    else:
        raise TypeError(
            f"spec must be a dcp_ref.stages.StepSpec or a dcp_ref.options.LayerOptions, got {type(spec).__name__}"
        )
    import torch

    from ..axes import layer_collectives
    from ..geometry import DcpGeometry

    if not isinstance(spec, StepSpec):  # the smallest spec of these options over W ranks: the parts decide
        spec = StepSpec.for_options(DcpGeometry(w, 0, 1, 1), options, max_tokens=1, topk=1, num_heads=w, head_dim=1,
                                    v_dim=1, sm_scale=1.0, dtype=torch.float32, device="cpu")  # fmt: skip
    return layer_collectives(spec)


@dataclass
class CountingGroup:
    """A :class:`~dcp_ref.group.Group` that forwards every collective to ``group`` and records it.

    ``calls`` holds ``(op, shape, dtype)`` per call, ``op`` one of ``"all_gather"``, ``"reduce_scatter"``,
    ``"all_to_all"``, in call order. Plan a step on it to see which collectives a run really calls.
    """

    group: Any
    calls: list[tuple[str, tuple[int, ...], Any]] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return int(self.group.rank)

    @property
    def world_size(self) -> int:
        return int(self.group.world_size)

    def all_gather(self, x: Any, *, out: Any = None) -> Any:
        self.calls.append(("all_gather", tuple(x.shape), x.dtype))
        return self.group.all_gather(x, out=out)

    def reduce_scatter(self, x: Any, dim: int = 0, *, out: Any = None) -> Any:
        self.calls.append(("reduce_scatter", tuple(x.shape), x.dtype))
        return self.group.reduce_scatter(x, dim, out=out)

    def all_to_all(self, x: Any, *, out: Any = None) -> Any:
        self.calls.append(("all_to_all", tuple(x.shape), x.dtype))
        return self.group.all_to_all(x, out=out)
