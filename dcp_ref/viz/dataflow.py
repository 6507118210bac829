"""One attention layer's decode data flow across the ``W`` ranks of a DCP group: shapes and bytes.

Plain functions for chapter 00 (tested in ``tests/test_dataflow_viz.py``): :func:`layer_dataflow`
lists the steps one rank runs for a layer's :class:`~dcp_ref.options.LayerOptions` (``options=``; by default
:data:`VLLM_LAYER`, vLLM's: query gathered over heads, LSEs all-gathered, output reduce-scattered), with the
tensor it holds after each step and, for each collective, the bytes per query token it contributes and
receives; :func:`kv_cache_per_rank` gives what DCP saves in exchange; :func:`draw_layer_dataflow` draws both.
The steps are the planned step's (:mod:`dcp_ref.axes`: its collectives are
:func:`~dcp_ref.axes.layer_collectives`'), the byte counts the cost model's for the same options
(:func:`collective_bytes`, from :mod:`dcp_ref.costmodel`; ``MlaGeometry``: DeepSeek-V3.2's sizes by default).

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
    CollectiveBytes,
    MlaGeometry,
    dcp_step_cost,
    kv_bytes_per_rank,
    output_all_reduce_bytes,
    q_replication_bytes,
)
from ..options import LayerOptions

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

__all__ = [
    "FlowStep",
    "VLLM_LAYER",
    "collective_bytes",
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

#: The layer drawn when no ``options`` are given: vLLM's DCP layer (the query gathered over heads, (score, id)
#: pairs all-gathered, select + deinterleave, LSE all-gather, correct, output reduce-scatter: four collectives).
#: It is :data:`~dcp_ref.options.DEFAULT` but for ``q_replicate=False`` (``DEFAULT`` replicates the query
#: projection, so its layer runs no query all-gather); chapter 00 draws it.
VLLM_LAYER = LayerOptions(q_replicate=False)


@dataclass(frozen=True)
class FlowStep:
    """One step of a layer's decode on one rank.

    Attributes:
        name: the step (stages named as in the chapters).
        shape: what this rank holds after the step, with dtype (``T`` query tokens).
        collective: ``True`` for a collective of the DCP group.
        sent: bytes per query token this rank contributes (all-gather) or puts in (reduce-scatter; all-to-all:
            its whole send buffer, every destination's slice).
        received: bytes per query token of this rank's result (a gathered buffer includes its own
            slice; all-to-all: its whole receive buffer).
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


def _check_options(options: object) -> LayerOptions:
    if not isinstance(options, LayerOptions):
        raise TypeError(f"options must be a dcp_ref.options.LayerOptions, got {type(options).__name__}")
    return options


#: The cost model's names of the collectives (``StepCost.comm``'s keys) -> :data:`COLLECTIVE_NAMES`.
_COST_NAMES = dict(
    zip(("query_allgather", "candidates_allgather", "lse_allgather", "output_reduce_scatter", "combine_alltoall"),
        COLLECTIVE_NAMES)
)  # fmt: skip


def collective_bytes(
    world_size: int, geometry: MlaGeometry | None = None, *, options: LayerOptions = VLLM_LAYER
) -> dict[str, CollectiveBytes]:
    """Bytes per query token of every collective the layer of ``options`` runs on one rank of ``world_size``.

    The cost model's own count for these options (:func:`dcp_ref.costmodel.dcp_step_cost`'s ``comm`` at ``T = 1``,
    ``scope="layer"``), keyed by :data:`COLLECTIVE_NAMES`, in run order: empty for ``layout="tp"`` and for
    ``W = 1`` (no collective runs). ``order="rank_local"`` moves 4 bytes per candidate instead of 8,
    ``combine="alltoall"`` one all-to-all of bf16 partials + float32 LSEs instead of the LSE all-gather and the
    reduce-scatter, ``q_replicate=True`` no query all-gather.
    """
    g = MlaGeometry() if geometry is None else geometry
    opt = _check_options(options)
    w = check_int_scalar(world_size, "world_size", min_value=1)
    if opt.layout == "tp" or w == 1:
        return {}
    comm = dcp_step_cost(w, 1, g.topk, g, scope="layer", options=opt).comm
    return {_COST_NAMES[name]: b for name, b in comm.items()}


def layer_dataflow(
    world_size: int = 4, geometry: MlaGeometry | None = None, *, options: LayerOptions = VLLM_LAYER
) -> list[FlowStep]:
    """The steps of one attention layer's decode on one rank of ``world_size``, in order, for ``options``.

    The steps the planned step's parts run (:mod:`dcp_ref.axes`: QueryPath, Indexing, Exchange, Attention,
    Combine), one per stage or collective, then the projections around them; the collectives are those of
    :func:`dcp_ref.axes.layer_collectives` for a spec of the same options, in the same order, with the bytes of
    :func:`collective_bytes` (the cost model's):

    - QueryPath: ``q`` from this rank's query projection, ``[T, H/W, 576]`` bf16 (TP's split), all-gathered over
      heads to ``[T, H, 576]`` when the layout is dcp, ``q_replicate=False`` and ``W > 1``; a replicated
      projection (dcp, ``q_replicate=True``) gives ``[T, H, 576]`` itself; tp keeps ``[T, H/W, 576]``.
    - Indexing: the local top-K, ids ``[T, K]`` int32; where the cache is split (dcp, ``W > 1``) packed as
      ``(score, id)`` float32 pairs ``[T, K, 2]`` (``order="global_id"``) or scores ``[T, K]`` float32
      (``"rank_local"``).
    - Exchange: the candidates all-gathered (``[W, T, K, 2]`` or ``[W, T, K]`` f32), then select (ids ``[T, k]``
      int32) + deinterleave (``"allgather"``) or select-to-slots (``"owner"``) -> slots ``[T, k]`` int32, counts
      ``[T]``; with one rank's cache (``W = 1``, or tp) only the deinterleave (the local top-K is the answer).
    - Attention: dcp: all ``H`` heads over this rank's keys, out ``[T, H, 512]`` bf16, lse ``[T, H]`` f32; tp:
      ``H/W`` heads over all ``k`` keys.
    - Combine (the cache split over ``W > 1`` ranks): ``"reduce_scatter"``: LSE all-gather ``[W, T, H]`` f32,
      correct, reduce-scatter over heads -> ``[T, H/W, 512]`` bf16; ``"alltoall"``: one all-to-all of the partials
      and LSEs of rank ``j``'s heads to rank ``j`` (``[W, T, H/W, 512]`` bf16 + ``[W, T, H/W]`` f32), then the
      combine of the ``W`` partials -> ``[T, H/W, 512]`` bf16.

    Args:
        world_size: ``W >= 1``, dividing ``geometry.num_heads`` (heads are split ``W`` ways).
        geometry: the layer (``H`` heads, ``576``-dim queries, ``512``-dim values, ``K``
            candidates per rank, top ``k``); default DeepSeek-V3.2's.
        options: the layer (:class:`~dcp_ref.options.LayerOptions`); default :data:`VLLM_LAYER` (vLLM's: the query
            gathered over heads, (score, id) pairs all-gathered, select, deinterleave, LSE all-gather, correct,
            output reduce-scatter).
    Returns:
        :class:`FlowStep` list; bytes are per query token and per layer.
    Raises:
        ValueError / TypeError: ``world_size`` not a positive int dividing ``num_heads``; ``options`` not a
        ``LayerOptions`` (TypeError).
    """
    g = MlaGeometry() if geometry is None else geometry
    opt = _check_options(options)
    w = check_int_scalar(world_size, "world_size", min_value=1)
    if g.num_heads % w:
        raise ValueError(f"world_size must divide num_heads={g.num_heads} (heads are split W ways), got {w}")
    h, hw, dq, dv, kl, k = g.num_heads, g.num_heads // w, g.qk_dim, g.v_dim, g.local_topk, g.topk
    dcp = opt.layout == "dcp"
    split = dcp and w > 1  # the cache split over more than one rank: candidates exchanged, partials combined
    comm = collective_bytes(w, g, options=opt)

    def coll(name: str, shape: str, note: str) -> FlowStep:
        b = comm[name]
        return FlowStep(name, shape, True, b.sent, b.received, b.link, note)

    q_name, lse_name, rs_name, a2a_name = COLLECTIVE_NAMES[0], COLLECTIVE_NAMES[2], COLLECTIVE_NAMES[3], \
        COLLECTIVE_NAMES[4]  # fmt: skip
    steps: list[FlowStep] = []
    # QueryPath
    if dcp and opt.q_replicate:
        extra = q_replication_bytes(w, g)
        note = "replicated projection: all H heads, no all-gather" + (
            f" (+{format_bytes(extra)} of weights per rank, all layers)" if extra else ""
        )
        steps.append(FlowStep("query projection", f"q [T, {h}, {dq}] bf16", note=note))
    else:
        steps.append(
            FlowStep("query projection", f"q [T, {hw}, {dq}] bf16", note=f"this rank's H/W = {hw} heads, as in TP")
        )
        if q_name in comm:
            steps.append(coll(q_name, f"q [T, {h}, {dq}] bf16", "every rank attends its own keys for all H heads"))
    # Indexing
    steps.append(
        FlowStep(
            "indexer: local top-K",
            f"ids [T, {kl}] int32",
            note="scores only the c/W keys this rank stores" if split else "scores all the keys (one rank's cache)",
        )
    )
    rank_local = opt.order == "rank_local"
    if split and rank_local:
        steps.append(FlowStep("pack scores (rank-local order)", f"cand [T, {kl}] f32",
                              note="4 bytes per candidate: the ids stay on the rank that owns them"))  # fmt: skip
    elif split:
        steps.append(
            FlowStep("pack (score, global id)", f"cand [T, {kl}, 2] f32", note="one 8-byte pair per candidate")
        )
    # Exchange
    if split:
        bpc = 4 if rank_local else 8
        shape = f"[{w}, T, {kl}] f32" if rank_local else f"[{w}, T, {kl}, 2] f32"
        steps.append(coll(COLLECTIVE_NAMES[1], shape, f"{bpc}·K bytes sent, {bpc}·W·K received per token"))
    if split and opt.exchange == "owner":
        steps.append(
            FlowStep(
                "select-to-slots (this rank's winners)",
                f"slots [T, {k}] int32, counts [T]",
                note=f"the global top-k, only the about k/W = {k // w} this rank owns",
            )
        )
    else:
        if split:
            steps.append(
                FlowStep("stable top-K (select)", f"ids [T, {k}] int32", note="the same k global ids on every rank")
            )
        steps.append(
            FlowStep(
                "deinterleave + compaction",
                f"slots [T, {k}] int32, counts [T]",
                note=f"about k/W = {k // w} of them on this rank" if split else "the local top-K is the answer",
            )
        )
    # Attention
    if dcp:
        steps.append(
            FlowStep(
                "attention (all H heads, this rank's keys)",
                f"out [T, {h}, {dv}] bf16, lse [T, {h}] f32",
                note="a partial softmax per head; empty row: 0 and -inf" if split else "all k keys here: the answer",
            )
        )
    else:
        steps.append(
            FlowStep(
                "attention (H/W heads, all k keys)",
                f"out [T, {hw}, {dv}] bf16, lse [T, {hw}] f32",
                note="the whole cache on every rank: no collective inside attention",
            )
        )
    # Combine
    if split and opt.combine == "reduce_scatter":
        ar = output_all_reduce_bytes(1, w, g)
        steps += [
            coll(lse_name, f"lse [{w}, T, {h}] f32", "4·H bytes sent, 4·W·H received per token"),
            FlowStep(
                "correct (rescale by its weight)",
                f"out [T, {h}, {dv}] bf16",
                note="exp(lse_r - lse) · out_r (LSEs in base e, as the attention stage returns them)",
            ),
            coll(
                rs_name,
                f"out [T, {hw}, {dv}] bf16",
                f"an all-reduce would keep all {h} heads and put {format_bytes(ar.link)} on the links",
            ),
        ]
    elif split:
        steps += [
            coll(
                a2a_name,
                f"out [{w}, T, {hw}, {dv}] bf16, lse [{w}, T, {hw}] f32",
                "rank j's H/W heads (partials + LSEs) to rank j: replaces the LSE all-gather and the reduce-scatter",
            ),
            FlowStep(
                "combine the W partials (H/W heads)",
                f"out [T, {hw}, {dv}] bf16",
                note="sum over r of exp(lse_r - lse) · out_r (LSEs in base e, as the attention stage returns them)",
            ),
        ]
    steps.append(
        FlowStep(
            "value up-projection + output projection",
            f"[T, {hw}] heads -> hidden",
            note="split by heads as in TP; TP's all-reduce follows",
        )
    )
    return steps


def kv_cache_per_rank(context: int, world_size: int, geometry: MlaGeometry | None = None) -> dict[str, int]:
    """Bytes of one request's MLA KV cache on one rank, all layers: ``{"tp", "dcp", "saved"}``.

    TP keeps every token on every rank; DCP keeps the busiest rank's share (``c/W`` when
    ``W·I`` divides ``c``). See :func:`dcp_ref.costmodel.kv_bytes_per_rank`.
    """
    g = MlaGeometry() if geometry is None else geometry
    tp = kv_bytes_per_rank(context, world_size, "tp", g) * g.layers
    dcp = kv_bytes_per_rank(context, world_size, "dcp", g) * g.layers
    return {"tp": tp, "dcp": dcp, "saved": tp - dcp}


def dataflow_table(
    world_size: int = 4, geometry: MlaGeometry | None = None, *, options: LayerOptions = VLLM_LAYER
) -> str:
    """:func:`layer_dataflow` of ``options`` as a text table (one row per step; bytes per query token; ``>>``
    marks a collective)."""
    rows = [("step", "this rank holds", "sends", "receives", "on links")]
    for s in layer_dataflow(world_size, geometry, options=options):
        b = (format_bytes(s.sent), format_bytes(s.received), format_bytes(s.link)) if s.collective else ("", "", "")
        rows.append(((">> " if s.collective else "   ") + s.name, s.shape, *b))
    wd = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"{r[0]:<{wd[0]}}  {r[1]:<{wd[1]}}  {r[2]:>{wd[2]}}  {r[3]:>{wd[3]}}  {r[4]:>{wd[4]}}" for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def draw_layer_dataflow(
    world_size: int = 4,
    geometry: MlaGeometry | None = None,
    context: int = 131072,
    dpi: int = 72,
    *,
    options: LayerOptions = VLLM_LAYER,
) -> Figure:
    """One layer's decode across the ``W`` ranks, with shapes and bytes; the KV saving below it.

    The steps are :func:`layer_dataflow`'s for ``options`` (a :class:`~dcp_ref.options.LayerOptions`; the title
    names any other than :data:`VLLM_LAYER` by its ``label``).

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
    steps = layer_dataflow(world_size, g, options=options)
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
        f"One layer's decode on W = {w} ranks (H = {g.num_heads}, K = k = {g.topk}; bytes per query token)"
        + ("" if options == VLLM_LAYER else f": {options.label}"),
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
