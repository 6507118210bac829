"""The planned decode step: plan once, run many times, capture whole in a CUDA graph.

Why a plan: a decode step runs once per layer per token (61 layers for DeepSeek V3). Everything
that does not change between those calls — the geometry, the largest batch, the head geometry,
every intermediate buffer, the compiled kernels, the collectives' buffers — is fixed once by
:class:`PlannedStep`; its :meth:`~PlannedStep.run` then makes **no host synchronisation** and, with
allocation-free stages (the kernels of :mod:`dcp_ref.kernels`), **no allocation**, so the whole run,
NCCL collectives included, can be captured in one CUDA graph (:meth:`~PlannedStep.capture`) and
replayed per layer. Checks that need tensor values on the host happen only with ``validate=True``.

One run on rank ``r`` (shapes for ``T`` query tokens, ``H`` heads, ``k`` = top-k, ``W`` ranks)::

    (ownership    seq_lens, next_n -> local bound per token [T]: once per decode step, in StepMetadata)
    indexer       index_scores [T, L] -> packed (score, id) [T, k, 2]
    all-gather    -> gathered [W, T, k, 2]
    select        -> global ids [T, k]
    deinterleave  -> slots [T, k], counts [T]                  (compacted unless the attention masks)
    attention     q [T, H, D] over kv_cache[slots] -> partial [T, H, v], lse [T, H] (base e)
    all-gather    -> all_lse [W, T, H]
    merge         -> corrected [T, H, v], merged lse [T, H]
    reduce-scatter over heads -> out [T, H/W, v], lse [T, H/W]

Usage::

    spec = StepSpec(geometry, max_tokens=T, topk=2048, num_heads=128, head_dim=576, v_dim=512,
                    sm_scale=192**-0.5, dtype=torch.bfloat16, device="cuda")
    step = PlannedStep(group, spec, stages)           # stages: REFERENCE_STAGES or dcp_ref.kernels.stages
    meta = decode_metadata(seq_lens, next_n, geometry)  # once per decode step, shared by all layers
    out, lse = step.run(q, shard, meta)               # per layer
    graph = step.capture(q, shard, meta)              # or capture it and...
    graph.replay()                                    # ...replay (inputs updated in place)
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from ._checks import INT_DTYPES, check_tensor
from .fp8_cache import FP8_DS_MLA
from .geometry import DcpGeometry
from .group import Group
from .ownership import localize_decode_bounds, localize_prefill_chunk
from .stages import REFERENCE_STAGES, Stages, StepSpec, kv_format_of, resolve_stages

__all__ = [
    "PLAN_LOCK",
    "StepMetadata",
    "decode_metadata",
    "prefill_metadata",
    "PlannedStep",
    "CapturedStep",
    "HostSyncCounter",
    "plan_for",
]

#: Planning (kernel compilation in ``Stages.prepare``) runs under this lock: CuTeDSL compilation is
#: not thread-safe, and the ranks of a :class:`~dcp_ref.group.SimulatedWorld` are threads.
PLAN_LOCK = threading.RLock()


@dataclass(frozen=True)
class StepMetadata:
    """Per-decode-step metadata of one rank, shared by every layer's run (the ownership stage's output).

    Built once per decode step (:func:`decode_metadata`, :func:`prefill_metadata`), outside any graph:
    the ownership math validates its inputs on the host. A captured step reads these tensors at fixed
    addresses: give it new values with :meth:`copy_`.

    Attributes:
        local_bounds: int32 ``[T]``: query token ``t`` may attend to this rank's local keys ``[0, local_bounds[t])``
            (the global causal bound expanded per token *first*, localized *after*).
        req_of_token: int32 ``[T]``: the request (block-table row) of each query token.
        row_starts: optional int32 ``[T]``: local key ``j`` of token ``t`` is column ``row_starts[t] + j`` of the
            index scores (a prefill chunk's layout); ``None``: column ``j`` (decode).
    """

    local_bounds: torch.Tensor
    req_of_token: torch.Tensor
    row_starts: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.local_bounds.shape[0])

    def copy_(self, other: StepMetadata) -> StepMetadata:
        """Copy ``other``'s values into these tensors (same shapes): how a captured graph gets new metadata."""
        self.local_bounds.copy_(other.local_bounds)
        self.req_of_token.copy_(other.req_of_token)
        if (self.row_starts is None) != (other.row_starts is None):
            raise ValueError("other.row_starts must be given exactly when this metadata has row_starts")
        if self.row_starts is not None and other.row_starts is not None:
            self.row_starts.copy_(other.row_starts)
        return self


def _req_of_token(num_requests: int, query_lens: Any) -> torch.Tensor:
    if isinstance(query_lens, int) and not isinstance(query_lens, bool):
        return torch.arange(num_requests, dtype=torch.int32).repeat_interleave(query_lens)
    per = torch.as_tensor(query_lens).to("cpu", torch.int64)
    return torch.arange(num_requests, dtype=torch.int32).repeat_interleave(per)


def decode_metadata(
    seq_lens: Any, next_n: Any, geometry: DcpGeometry, device: torch.device | str | None = None
) -> StepMetadata:
    """The ownership stage of a decode step, for one rank (validates on the host; once per decode step).

    Args:
        seq_lens: int ``[B]`` global lengths, including this step's query tokens.
        next_n: query tokens per request: an int (all requests; MTP / speculative decode), or int ``[B]``.
        geometry: this rank's :class:`~dcp_ref.geometry.DcpGeometry`.
        device: where the metadata lives (default: ``seq_lens``' device, CPU for lists).
    """
    if not isinstance(geometry, DcpGeometry):
        raise TypeError(f"geometry must be a DcpGeometry, got {type(geometry).__name__}")
    g = geometry
    bounds = localize_decode_bounds(seq_lens, next_n, g.world_size, g.rank, g.interleave).reshape(-1)
    dev = torch.device(device) if device is not None else bounds.device
    req = _req_of_token(torch.as_tensor(seq_lens).numel(), next_n)
    return StepMetadata(bounds.to(dev, torch.int32), req.to(dev))


def prefill_metadata(
    context_lens: Any, query_lens: Any, geometry: DcpGeometry, device: torch.device | str | None = None
) -> StepMetadata:
    """The ownership stage of a prefill chunk, for one rank (see :func:`dcp_ref.ownership.localize_prefill_chunk`).

    The chunk's index scores hold this rank's keys of all the chunk's requests side by side; token ``t``
    may attend to columns ``[token_ks[t], token_ke[t])``, so ``row_starts = token_ks`` and
    ``local_bounds = token_ke - token_ks``.
    """
    if not isinstance(geometry, DcpGeometry):
        raise TypeError(f"geometry must be a DcpGeometry, got {type(geometry).__name__}")
    g = geometry
    m = localize_prefill_chunk(context_lens, query_lens, g.world_size, g.rank, g.interleave)
    dev = torch.device(device) if device is not None else m.token_ks.device
    req = _req_of_token(torch.as_tensor(query_lens).numel(), torch.as_tensor(query_lens))
    return StepMetadata((m.token_ke - m.token_ks).to(dev, torch.int32), req.to(dev), m.token_ks.to(dev, torch.int32))


class HostSyncCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every aten op that reads tensor values back to the host (a device sync on CUDA).

    Works on the CPU too, so CPU CI can check that a step's run is capture-safe::

        with HostSyncCounter() as c:
            step.run(...)
        assert c.syncs == []
    """

    #: ops that need a tensor's values on the host (or produce data-dependent shapes).
    SYNC_OPS = frozenset(
        {
            "aten::_local_scalar_dense",
            "aten::item",
            "aten::is_nonzero",
            "aten::nonzero",
            "aten::nonzero_static",
            "aten::masked_select",
            "aten::unique",
            "aten::_unique2",
            "aten::equal",
            "aten::allclose",
            "aten::repeat_interleave",
            "aten::bincount",
            "aten::histc",
        }
    )

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.syncs: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        self.ops.append(name)
        if name in self.SYNC_OPS:
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def _view(flat: torch.Tensor, *shape: int) -> torch.Tensor:
    """A contiguous ``shape`` view of the first elements of a flat buffer (no allocation)."""
    n = 1
    for s in shape:
        n *= s
    return flat[:n].view(*shape)


@dataclass(frozen=True)
class _RunViews:
    """One run's views of a :class:`PlannedStep`'s flat buffers, for one token count."""

    packed: torch.Tensor
    gathered: torch.Tensor
    ids: torch.Tensor
    slots: torch.Tensor
    counts: torch.Tensor
    partial: torch.Tensor
    lse: torch.Tensor
    all_lse: torch.Tensor
    corrected: torch.Tensor
    merged_lse: torch.Tensor
    send: torch.Tensor
    out: torch.Tensor


def _all_gather_into(group: Group, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    try:
        return group.all_gather(x, out=out)
    except TypeError:  # a user Group without out=
        return out.copy_(group.all_gather(x))


def _reduce_scatter_into(group: Group, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    try:
        return group.reduce_scatter(x, 0, out=out)
    except TypeError:
        return out.copy_(group.reduce_scatter(x, 0))


class PlannedStep:
    """One rank's DCP decode step, planned for a :class:`~dcp_ref.stages.StepSpec`.

    Args:
        group: this rank's group; its ``world_size`` / ``rank`` must equal the spec's geometry.
        spec: what to plan for (geometry, largest ``T``, top-k, heads, dims, dtype, device, ...).
        stages: the implementation of each stage (default: the reference).
        validate: check tensor *values* on every run (host reads: not capturable). Shapes, dtypes,
            devices and the shard's geometry are always checked (host-side, no sync).

    Buffers are allocated here, once, for ``spec.max_tokens``; a run with fewer tokens uses the
    front of each. The results of :meth:`run` are views of the step's buffers: the next run
    overwrites them (copy them if you need them later).
    """

    def __init__(
        self, group: Group, spec: StepSpec, stages: Stages = REFERENCE_STAGES, *, validate: bool = False
    ) -> None:
        if not isinstance(spec, StepSpec):
            raise TypeError(f"spec must be a StepSpec, got {type(spec).__name__}")
        if not isinstance(stages, Stages):
            raise TypeError(f"stages must be a dcp_ref.stages.Stages, got {type(stages).__name__}")
        g = spec.geometry
        if (group.world_size, group.rank) != (g.world_size, g.rank):
            raise ValueError(
                f"group (world_size={group.world_size}, rank={group.rank}) does not match spec.geometry "
                f"(world_size={g.world_size}, rank={g.rank})"
            )
        self.group, self.spec, self.stages, self.validate = group, spec, stages, bool(validate)
        with PLAN_LOCK:
            if stages.prepare is not None:
                stages.prepare(spec)
        W, T, k, H, v, dev = g.world_size, spec.max_tokens, spec.topk, spec.num_heads, spec.v_dim, spec.device
        pdt = stages.partial_dtype(spec.dtype)
        f32, i32 = torch.float32, torch.int32

        def buf(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(n, dtype=dtype, device=dev)

        # Flat buffers, viewed per run as [T, ...] with T <= max_tokens (contiguous either way).
        self._packed = buf(T * k * 2, f32)
        # At W = 1 the all-gathers are the identity: their results are views of packed / lse (no buffer, no copy).
        self._gathered = buf(W * T * k * 2 if W > 1 else 0, f32)
        self._ids = buf(T * k, i32)
        self._slots = buf(T * k, i32)
        self._counts = buf(T, i32)
        self._partial = buf(T * H * v, pdt)
        # LSEs in float32 (what kernels write), float64 when the partials are (the reference oracle path).
        ldt = torch.float64 if pdt == torch.float64 else f32
        self._lse = buf(T * H, ldt)
        self._all_lse = buf(W * T * H if W > 1 else 0, ldt)
        self._corrected = buf(T * H * v, pdt)
        self._merged_lse = buf(T * H, ldt)
        self._send = buf(T * H * v, pdt)
        self._out = buf(T * (H // W) * v, pdt)
        self.impls = stages.impls()
        self._views_by_t: dict[int, _RunViews] = {}

    def _views(self, T: int) -> _RunViews:
        """The ``[T, ...]`` views of the flat buffers, made once per ``T`` (a view costs host time every run)."""
        got = self._views_by_t.get(T)
        if got is None:
            g, s = self.spec.geometry, self.spec
            W, k, H, v = g.world_size, s.topk, s.num_heads, s.v_dim
            hs = H // W
            got = self._views_by_t[T] = _RunViews(
                packed=_view(self._packed, T, k, 2),
                gathered=_view(self._gathered, W, T, k, 2) if W > 1 else self._gathered,  # W = 1: unused (empty)
                ids=_view(self._ids, T, k),
                slots=_view(self._slots, T, k),
                counts=_view(self._counts, T),
                partial=_view(self._partial, T, H, v),
                lse=_view(self._lse, T, H),
                all_lse=_view(self._all_lse, W, T, H) if W > 1 else self._all_lse,
                corrected=_view(self._corrected, T, H, v),
                merged_lse=_view(self._merged_lse, T, H),
                send=_view(self._send, W, T, hs, v),
                out=_view(self._out, T, hs, v),
            )
        return got

    # ------------------------------------------------------------------------------------------
    def _check_run(self, q: torch.Tensor, shard: Any, meta: StepMetadata) -> int:
        s, g = self.spec, self.spec.geometry
        check_tensor(q, "q", dtypes=(s.dtype,), ndim=3, device=s.device)
        T, H, D = q.shape
        if not 1 <= T <= s.max_tokens or (H, D) != (s.num_heads, s.head_dim):
            raise ValueError(
                f"q must be [T, {s.num_heads}, {s.head_dim}] with 1 <= T <= max_tokens={s.max_tokens}, "
                f"got {tuple(q.shape)}"
            )
        sg = getattr(shard, "geometry", None)
        if not isinstance(sg, DcpGeometry):
            raise ValueError("shard.geometry must be the DcpGeometry the shard was built for (a RankShard field)")
        if sg != g:
            raise ValueError(f"shard.geometry {sg} does not match the planned geometry {g}")
        check_tensor(shard.kv_cache, "shard.kv_cache", ndim=(2, 3, 4), device=s.device)
        check_tensor(shard.block_table, "shard.block_table", dtypes=INT_DTYPES, ndim=2, device=s.device)
        check_tensor(shard.index_scores, "shard.index_scores", dtypes=(torch.float32,), ndim=2, device=s.device)
        # The cache's row layout (576 values, or FP8's 656 bytes) is the attention stage's to check.
        if shard.index_scores.shape[0] != T:
            raise ValueError(
                f"shard.index_scores must have one row per query token ({T}), got {tuple(shard.index_scores.shape)}"
            )
        if not isinstance(meta, StepMetadata):
            raise TypeError(f"meta must be a StepMetadata (see decode_metadata), got {type(meta).__name__}")
        for name in ("local_bounds", "req_of_token", "row_starts"):
            t = getattr(meta, name)
            if t is None and name == "row_starts":
                continue
            check_tensor(t, f"meta.{name}", dtypes=INT_DTYPES, ndim=1, device=s.device)
            if t.shape[0] != T:
                raise ValueError(f"meta.{name} must have one entry per query token ({T}), got {tuple(t.shape)}")
        if self.validate:
            self._check_values(T, shard, meta)
        return T

    def _check_values(self, T: int, shard: Any, meta: StepMetadata) -> None:
        """Value checks (host reads): only with ``validate=True``."""
        g = self.spec.geometry
        local = meta.local_bounds.long()
        starts = meta.row_starts.long() if meta.row_starts is not None else torch.zeros_like(local)
        if int(local.min()) < 0 or int(starts.min()) < 0:
            raise ValueError("meta.local_bounds and meta.row_starts must be >= 0")
        B = shard.block_table.shape[0]
        if int(meta.req_of_token.min()) < 0 or int(meta.req_of_token.max()) >= B:
            raise ValueError(f"meta.req_of_token must lie in [0, {B}) (rows of shard.block_table)")
        need = int((starts + local).max())
        if need > shard.index_scores.shape[1]:
            raise ValueError(
                f"shard.index_scores has {shard.index_scores.shape[1]} columns, but a token's keys reach column {need}"
            )
        if meta.row_starts is None:  # decode: a request's local keys are [0, local bound) of its blocks
            blocks_needed = (local + g.block_size - 1) // g.block_size
            have = (shard.block_table >= 0).sum(1)[meta.req_of_token.long()]
            if bool((blocks_needed > have).any()):
                raise ValueError(
                    "shard.block_table is too short for a token's local length (a selected key has no block)"
                )

    def run(
        self, q: torch.Tensor, shard: Any, meta: StepMetadata, *, trace: dict | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step on this rank (collectives included).

        Args:
            q: ``[T, H, Dqk]`` in ``spec.dtype``, ``T <= spec.max_tokens``.
            shard: this rank's :class:`~dcp_ref.pipeline.RankShard` (``kv_cache [S, Dqk]``, ``block_table
                int [B, M]``, ``index_scores float32 [T, L]``, ``geometry`` = the planned one).
            meta: the step's :class:`StepMetadata`.
            trace: if a dict, receives a copy of every intermediate and ``impl`` (stage -> implementation).
        Returns:
            ``(out [T, H/W, v], lse float32 [T, H/W])`` (base e) for this rank's heads: views of the
            step's buffers, valid until the next run.
        """
        T = self._check_run(q, shard, meta)
        s, g, st = self.spec, self.spec.geometry, self.stages
        W, k, H, v = g.world_size, s.topk, s.num_heads, s.v_dim
        hs = H // W
        b = self._views(T)
        # indexer: the ownership stage (meta) already gave each token its local bound
        packed = st.indexer(shard.index_scores, meta.local_bounds, g, k, row_starts=meta.row_starts, out=b.packed)
        # W = 1: the all-gathers are the identity, a view of what the stage returned (no collective, no copy)
        gathered = _all_gather_into(self.group, packed, b.gathered) if W > 1 else packed.unsqueeze(0)
        ids = st.select(gathered, k, out=b.ids)
        slots, counts = st.deinterleave(
            ids,
            meta.req_of_token,
            shard.block_table,
            g,
            compact=st.attention_layout == "compact",
            out_slots=b.slots,
            out_counts=b.counts,
        )
        partial, lse = st.attention(
            q, shard.kv_cache, slots, counts, s.sm_scale, v, out=b.partial, out_lse=b.lse
        )  # fmt: skip
        all_lse = _all_gather_into(self.group, lse, b.all_lse) if W > 1 else lse.unsqueeze(0)
        corrected, merged = st.merge(partial, all_lse, g.rank, out=b.corrected, out_lse=b.merged_lse)
        if W == 1:
            # One rank holds every head: the reduce-scatter is the identity (no copy, no collective).
            out = corrected.view(T, hs, v)
        else:
            # Heads of rank w must be contiguous for the reduce-scatter: [T, H, v] -> [W, T, H/W, v] (one copy).
            b.send.copy_(corrected.view(T, W, hs, v).transpose(0, 1))
            out = _reduce_scatter_into(self.group, b.send.view(W * T, hs, v), b.out)
        lse_shard = merged[:, g.rank * hs : (g.rank + 1) * hs]
        if trace is not None:
            trace.update(
                local_bounds=meta.local_bounds.clone(),
                packed=packed.clone(),
                global_ids=ids.clone(),
                slots=slots.clone(),
                counts=counts.clone(),
                partial_out=partial.clone(),
                partial_lse=lse.clone(),
                impl=dict(self.impls),
            )
        return out, lse_shard

    def capture(self, q: torch.Tensor, shard: Any, meta: StepMetadata, *, warmup: int = 1) -> CapturedStep:
        """Capture one whole run (collectives included) in a CUDA graph.

        The graph reads ``q``, ``shard``'s tensors and ``meta``'s tensors at their current addresses:
        update them in place (``copy_``) and call :meth:`CapturedStep.replay`. NCCL collectives can be
        captured once the process group has run one collective (the warm-up run does that).
        """
        # StepSpec.__post_init__ stores a torch.device; the field's type also admits the str callers pass.
        if torch.device(self.spec.device).type != "cuda":
            raise ValueError(f"capture needs a CUDA step, this one is planned for {self.spec.device}")
        if self.validate:
            raise ValueError("capture needs validate=False (value checks read tensors on the host)")
        side = torch.cuda.Stream(self.spec.device)
        side.wait_stream(torch.cuda.current_stream(self.spec.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self.run(q, shard, meta)
        torch.cuda.current_stream(self.spec.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, lse = self.run(q, shard, meta)
        return CapturedStep(graph, out, lse)


@dataclass
class CapturedStep:
    """A captured :class:`PlannedStep` run: ``replay()`` recomputes ``out`` / ``lse`` from the captured inputs."""

    graph: Any
    out: torch.Tensor
    lse: torch.Tensor

    def replay(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.graph.replay()
        return self.out, self.lse


def plan_for(
    group: Group,
    q: torch.Tensor,
    shard: Any,
    topk: int,
    sm_scale: float,
    *,
    v_dim: int | None = None,
    stages: Stages | str = "reference",
    validate: bool = True,
    max_tokens: int | None = None,
) -> PlannedStep:
    """Plan a step sized for these inputs (``q [T, H, D]``, ``shard``) — the convenience path of
    :func:`dcp_ref.pipeline.dcp_decode_step`; ``max_tokens`` defaults to ``T``. The cache's format
    (native or FP8, :func:`dcp_ref.stages.kv_format_of`) picks the attention (FP8: ``v_dim`` 512, masked)."""
    check_tensor(q, "q", ndim=3)
    geometry = getattr(shard, "geometry", None)
    if not isinstance(geometry, DcpGeometry):
        raise ValueError("shard.geometry must be a DcpGeometry (the geometry the shard was built for)")
    T, H, D = q.shape
    kv_format = kv_format_of(shard.kv_cache)
    if v_dim is not None:
        v = v_dim
    elif kv_format == "fp8_ds_mla":
        v = FP8_DS_MLA.nope_dim  # the FP8 layout's values are its NoPE dims (512)
    else:
        v = D
    spec = StepSpec(
        geometry,
        max_tokens=max_tokens or max(T, 1),
        topk=topk,
        num_heads=H,
        head_dim=D,
        v_dim=v,
        sm_scale=sm_scale,
        dtype=q.dtype,
        device=q.device,
    )
    st = resolve_stages(stages, q.device, q.dtype, D, v, num_heads=H, topk=topk, kv_format=kv_format)
    return PlannedStep(group, spec, st, validate=validate)
