"""The whole DCP sparse-MLA decode step, end to end — and its single-device oracle.

:func:`dcp_decode_step` is what *one* rank runs (SPMD; collectives through a
:class:`~dcp_ref.group.Group`), by name of stage:

- ownership    — :func:`dcp_ref.step.decode_metadata` (expand per token first, localize after)
- indexer      — local stable top-K of this rank's index scores, packed as (score, global id)
- pack + select — all-gather of the candidates, stable global top-k (:mod:`dcp_ref.topk`)
- deinterleave + compaction — global ids to this rank's KV slots (:mod:`dcp_ref.deinterleave`)
- attention + correct — sparse MLA (:mod:`dcp_ref.attention`), then the LSE merge (:mod:`dcp_ref.lse`):
  all-gather LSEs, correct, reduce-scatter over heads

It plans a :class:`dcp_ref.step.PlannedStep` for its inputs and runs it once: convenient, but it
re-plans (allocates, validates) on every call. A serving loop plans once and runs many times.
``stages`` picks the implementations: ``"reference"`` (:data:`dcp_ref.stages.REFERENCE_STAGES`),
``"kernels"`` (the GPU kernels where they can run, registered by :mod:`dcp_ref.kernels.stages`; on
the CPU the Triton kernels run interpreted under ``TRITON_INTERPRET=1``), or any
:class:`~dcp_ref.stages.Stages` value — e.g. the reference with one stage of your own.

:func:`single_device_decode` computes the same thing with no sharding at all: global scores →
global stable top-k → attention over the chosen keys. :func:`make_dcp_problem` builds a random
problem — the global KV and indexer scores, and each rank's paged shard with a shuffled block
table — so that tests and notebooks can check that DCP with any ``W`` and ``I`` reproduces the
single-device result exactly (up to float64 rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .contracts import check_int_scalar, check_tensor, check_world
from .geometry import DcpGeometry
from .group import Group, SimulatedWorld
from .ownership import expand_decode_bounds, global_to_local, owner_rank
from .stages import Stages
from .step import RankShard, StepMetadata, decode_metadata, plan_for

__all__ = [
    "RankShard",
    "DcpProblem",
    "make_dcp_problem",
    "dcp_decode_step",
    "run_step",
    "single_device_decode",
    "run_dcp_decode",
]


@dataclass
class DcpProblem:
    """A random decode problem and its sharding over ``world_size`` ranks (see :func:`make_dcp_problem`)."""

    world_size: int
    interleave: int
    block_size: int
    seq_lens: torch.Tensor  # int64 [B], global lengths (including this step's query tokens)
    next_n: int | torch.Tensor  # query tokens per request: one int for all, or int64 [B]
    q: torch.Tensor  # [T, H, D], T = total query tokens, tokens of request 0 first
    kv_global: list[torch.Tensor]  # per request [L_b, D]
    scores_global: torch.Tensor  # float32 [T, max L]: indexer score of every (token, global position)
    shards: list[RankShard]
    # With index keys (make_dcp_problem(index_heads=...)): the lightning indexer's inputs, from which
    # scores_global was computed (exactly: small integers and dyadic weights, see make_dcp_problem).
    index_q: torch.Tensor | None = None  # float8_e4m3fn [T, Hi, 128]
    index_weights: torch.Tensor | None = None  # float32 [T, Hi]
    index_keys_global: list[torch.Tensor] | None = None  # per request float32 [L_b, 128]

    @property
    def req_of_token(self) -> torch.Tensor:
        return torch.arange(self.seq_lens.numel()).repeat_interleave(self.next_n)

    def geometry(self, rank: int) -> DcpGeometry:
        """Rank ``rank``'s :class:`~dcp_ref.geometry.DcpGeometry`."""
        return DcpGeometry(self.world_size, rank, self.interleave, self.block_size)

    def metadata(self, rank: int, device: torch.device | str | None = None) -> StepMetadata:
        """Rank ``rank``'s :class:`~dcp_ref.step.StepMetadata` for this decode step."""
        return decode_metadata(self.seq_lens, self.next_n, self.geometry(rank), device=device)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> DcpProblem:
        """The same problem on ``device``, with ``q`` and the KV (global and sharded) in ``dtype``.

        Indexer scores stay float32 and the integer tensors keep their dtypes. The oracle
        (:func:`single_device_decode`) still wants the float64 CPU original: keep it.
        """
        dev = torch.device(device)

        def f(x: torch.Tensor) -> torch.Tensor:
            # float tensors take the new dtype; an FP8 cache (uint8 / float8 bytes) keeps its own
            return x.to(
                device=dev,
                dtype=dtype if dtype is not None and x.dtype.is_floating_point and x.element_size() > 1 else x.dtype,
            )

        def opt(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.to(dev)

        shards = [
            RankShard(f(s.kv_cache), s.block_table.to(dev), opt(s.index_scores), s.geometry, opt(s.index_cache))
            for s in self.shards
        ]
        return DcpProblem(
            self.world_size,
            self.interleave,
            self.block_size,
            self.seq_lens.to(dev),
            self.next_n,
            f(self.q),
            [f(k) for k in self.kv_global],
            self.scores_global.to(dev),
            shards,
            opt(self.index_q),
            opt(self.index_weights),
            None if self.index_keys_global is None else [k.to(dev) for k in self.index_keys_global],
        )


def make_dcp_problem(
    world_size: int,
    interleave: int = 1,
    *,
    seq_lens: Sequence[int] | torch.Tensor = (37, 5, 64),
    next_n: int | list[int] | torch.Tensor = 1,
    num_heads: int = 4,
    head_dim: int = 24,
    block_size: int = 8,
    score_levels: int = 7,
    seed: int = 0,
    index_heads: int = 0,
) -> DcpProblem:
    """Build a random DCP decode problem and shard it.

    Indexer scores are drawn from only ``score_levels`` distinct values so that ties are common —
    the stable order (score, then lower global id) is exercised, not just the easy case.
    Physical blocks of every rank are handed out in a shuffled order, so slot ids are unrelated
    to positions (as in a real paged cache).

    ``index_heads > 0``: also the lightning indexer's inputs — an FP8 index query ``[T, index_heads, 128]``,
    weights and per-request index keys — written into every rank's FP8 index-key cache
    (``shard.index_cache``, :mod:`dcp_ref.index_cache`), and the scores are *computed* from them
    (exactly; see :func:`_index_inputs`) instead of drawn from ``score_levels``.

    ``next_n``: query tokens per request — one int (decode, MTP), or one per request (a prefill
    chunk: request ``b``'s last ``next_n[b]`` positions are its query tokens; see
    :mod:`dcp_ref.prefill`). Every request must hold at least its own query tokens.
    """
    w, _, i = check_world(world_size, None, interleave)
    bs = check_int_scalar(block_size, "block_size", min_value=1)
    if bs % i:  # the deinterleave stage's rule (dcp_ref.deinterleave): an interleave stripe stays inside one block
        raise ValueError(
            "block_size must be a multiple of interleave (block_size % interleave == 0), "
            f"got block_size={bs}, interleave={i}"
        )
    g = torch.Generator().manual_seed(seed)
    lens = torch.as_tensor(seq_lens, dtype=torch.int64)
    B = lens.numel()
    if isinstance(next_n, (list, tuple, torch.Tensor)):
        per_req = torch.as_tensor(next_n, dtype=torch.int64)
        if per_req.shape != (B,):
            raise ValueError(f"next_n must be an int or one value per request ({B}), got shape {tuple(per_req.shape)}")
        next_n = per_req
    else:
        next_n = check_int_scalar(next_n, "next_n", min_value=1)
        per_req = torch.full((B,), next_n, dtype=torch.int64)
    if bool((per_req < 0).any()) or bool((per_req > lens).any()):
        raise ValueError(
            "next_n must lie in [0, seq_lens] per request (a request holds its own query tokens), "
            f"got {per_req.tolist()} for {lens.tolist()}"
        )
    req_of_token = torch.arange(B).repeat_interleave(per_req)
    T = int(per_req.sum())
    max_len = int(lens.max())
    q = torch.randn(T, num_heads, head_dim, generator=g, dtype=torch.float64)
    kv_global = [torch.randn(int(L), head_dim, generator=g, dtype=torch.float64) for L in lens]
    hi = check_int_scalar(index_heads, "index_heads", min_value=0)
    index_q = index_w = None
    index_keys: list[torch.Tensor] | None = None
    if hi:
        index_q, index_w, index_keys, scores_global = _index_inputs(g, lens, req_of_token, hi)
    else:
        levels = torch.randint(0, score_levels, (T, max_len), generator=g).to(torch.float32)
        scores_global = levels / score_levels - 0.5

    shards = []
    pos_all = torch.arange(max_len)
    owners = owner_rank(pos_all, w, i)
    locs = global_to_local(pos_all, w, i)
    for r in range(w):
        local_lens = [int((owners[: int(L)] == r).sum()) for L in lens]
        nblocks = [(n + bs - 1) // bs for n in local_lens]
        total_blocks = sum(nblocks) + 1  # one spare block that nobody uses
        perm = torch.randperm(total_blocks, generator=g)
        table = torch.full((B, max(max(nblocks), 1)), -1, dtype=torch.int32)
        kv = torch.full((total_blocks * bs, head_dim), float("nan"), dtype=torch.float64)  # NaN = never read
        nxt = 0
        for b, L in enumerate(lens.tolist()):
            table[b, : nblocks[b]] = perm[nxt : nxt + nblocks[b]].to(torch.int32)
            nxt += nblocks[b]
            mine = pos_all[:L][owners[:L] == r]
            loc = locs[mine]
            slot = table[b, loc // bs].long() * bs + loc % bs
            kv[slot] = kv_global[b][mine]
        max_local = max(max(local_lens), 1)
        index_scores = torch.full((T, max_local), float("nan"), dtype=torch.float32)
        for t in range(T):
            b = int(req_of_token[t])
            mine = pos_all[: int(lens[b])][owners[: int(lens[b])] == r]
            index_scores[t, locs[mine]] = scores_global[t, mine]
        shards.append(
            RankShard(kv_cache=kv, block_table=table, index_scores=index_scores, geometry=DcpGeometry(w, r, i, bs))
        )
    if index_keys is not None:
        from .index_cache import build_sharded_index_caches

        caches = build_sharded_index_caches(
            index_keys,
            [sh.block_table for sh in shards],
            DcpGeometry(w, 0, i, bs),
            [sh.kv_cache.shape[0] // bs for sh in shards],
        )
        for sh, cache in zip(shards, caches):
            sh.index_cache = cache
    return DcpProblem(w, i, bs, lens, next_n, q, kv_global, scores_global, shards, index_q, index_w, index_keys)


def _index_inputs(
    g: torch.Generator, lens: torch.Tensor, req_of_token: torch.Tensor, heads: int
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Index query, weights and keys whose scores are *exact* in float32 whatever the summation order.

    Keys and queries are integers in ``[-2, 2]`` (exact in e4m3; the per-token power-of-two key scale
    dequantizes them back exactly), weights are multiples of 1/16 below 1/4: every term
    ``w * relu(q . k)`` is a multiple of 1/16 below 2**7 and their sum over the heads stays far below
    2**24 steps. So a kernel's float32 scores equal the float64 oracle's bit for bit, and the selection
    (which has many ties here) must match exactly.
    """
    T = req_of_token.numel()
    dim = 128  # the index-key layout's head_dim (dcp_ref.index_cache.INDEX_K_FP8)
    keys = [torch.randint(-2, 3, (int(L), dim), generator=g).to(torch.float32) for L in lens]
    q = torch.randint(-2, 3, (T, heads, dim), generator=g).to(torch.float32)
    w = torch.randint(0, 4, (T, heads), generator=g).to(torch.float32) / 16
    scores = torch.full((T, int(lens.max())), float("nan"), dtype=torch.float32)
    for t in range(T):
        kb = keys[int(req_of_token[t])].double()
        s = (w[t].double()[:, None] * torch.relu(q[t].double() @ kb.T)).sum(0)  # [L_b]
        scores[t, : kb.shape[0]] = s.to(torch.float32)
    return q.to(torch.float8_e4m3fn), w, keys, scores


def dcp_decode_step(
    group: Group,
    q: torch.Tensor,
    shard: RankShard,
    seq_lens: torch.Tensor,
    next_n: int | torch.Tensor,
    topk: int,
    sm_scale: float,
    *,
    v_dim: int | None = None,
    trace: dict | None = None,
    stages: Stages | str = "reference",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's sparse-MLA decode step, every stage (plans a :class:`~dcp_ref.step.PlannedStep` and runs it once).

    Args:
        group: this rank's group; its world size and rank must match ``shard.geometry``.
        q: float ``[T, H, D]`` query tokens (``T`` = their total), tokens of request 0 first.
        shard: this rank's :class:`RankShard` (its ``geometry`` gives ``W``, the rank, ``I`` and the block size).
        seq_lens: int ``[B]`` global lengths (including this step's query tokens).
        next_n: query tokens per request (1, or more with speculative / MTP decoding): an int,
            or an int tensor ``[B]`` with one count per request.
        topk: the global top-k (every rank ends with the same ``topk`` ids per token).
        sm_scale: softmax scale.
        v_dim: value width (default: all of ``D``).
        trace: if a dict is given, every intermediate is stored in it under the stage's name
            (``local_bounds``, ``packed``, ``global_ids``, ``slots``, ``counts``, ``partial_out``,
            ``partial_lse``) and ``impl``, the implementation of each stage — for notebooks and debugging.
        stages: ``"reference"`` (plain PyTorch, float64 attention for float64 inputs), ``"kernels"`` (the
            kernels where they can run; see :func:`dcp_ref.stages.resolve_stages`), or a
            :class:`~dcp_ref.stages.Stages` value.
        validate: check tensor values on the host (see :class:`~dcp_ref.step.PlannedStep`).
    Returns:
        ``(out, lse)`` for this rank's head shard: ``[T, H/W, v_dim]`` and ``[T, H/W]`` (base e).
    """
    check_tensor(q, "q", ndim=3)
    geometry = shard_geometry(shard, group)
    meta = decode_metadata(seq_lens, next_n, geometry, device=q.device)
    return run_step(group, q, shard, meta, topk, sm_scale, v_dim=v_dim, trace=trace, stages=stages, validate=validate)


def run_step(
    group: Group,
    q: torch.Tensor,
    shard: RankShard,
    meta: StepMetadata,
    topk: int,
    sm_scale: float,
    *,
    v_dim: int | None = None,
    trace: dict | None = None,
    stages: Stages | str = "reference",
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plan a step for these inputs and run it once (decode or prefill metadata); results are fresh tensors."""
    step = plan_for(group, q, shard, topk, sm_scale, v_dim=v_dim, stages=stages, validate=validate)
    out, lse = step.run(q, shard, meta, trace=trace)
    return out.clone(), lse.clone()


def shard_geometry(shard: RankShard, group: Group) -> DcpGeometry:
    if not isinstance(shard, RankShard):
        raise TypeError(f"shard must be a RankShard, got {type(shard).__name__}")
    if shard.geometry is None:
        raise ValueError("shard.geometry must be set (a DcpGeometry): the step checks the shard against the group")
    if (shard.geometry.world_size, shard.geometry.rank) != (group.world_size, group.rank):
        raise ValueError(
            f"shard.geometry (world_size={shard.geometry.world_size}, rank={shard.geometry.rank}) "
            "does not match the group "
            f"(world_size={group.world_size}, rank={group.rank})"
        )
    return shard.geometry


def single_device_decode(
    problem: DcpProblem, topk: int, sm_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The oracle: no sharding. Global stable top-k of the scores, softmax attention in float64.

    Written independently of the stage modules (plain sort + softmax) on purpose.
    Returns ``(out [T, H, D], lse [T, H], ids [T, topk])``.
    """
    bounds = expand_decode_bounds(problem.seq_lens, problem.next_n).reshape(-1)
    req_of_token = problem.req_of_token
    T, H, D = problem.q.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float64)
    ids_out = torch.full((T, topk), -1, dtype=torch.int64)
    for t in range(T):
        b = int(req_of_token[t])
        n = int(bounds[t])
        s = problem.scores_global[t, :n].tolist()
        order = sorted(range(n), key=lambda p: (-(s[p] + 0.0), p))[:topk]  # score desc, then lower id
        ids_out[t, : len(order)] = torch.tensor(order, dtype=torch.int64)
        if not order:
            continue
        keys = problem.kv_global[b][order]  # [k, D]
        logits = torch.einsum("hd,kd->hk", problem.q[t], keys) * sm_scale
        lse[t] = torch.logsumexp(logits, dim=-1)
        out[t] = torch.softmax(logits, dim=-1) @ keys
    return out, lse, ids_out


def run_dcp_decode(
    problem: DcpProblem,
    topk: int,
    sm_scale: float,
    traces: list[dict] | None = None,
    stages: Stages | str = "reference",
    v_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run :func:`dcp_decode_step` on every rank of a :class:`SimulatedWorld`; reassemble heads.

    ``traces``: optional list of ``world_size`` dicts that receive each rank's intermediates.
    ``stages``, ``v_dim``: as in :func:`dcp_decode_step`.
    Returns ``(out [T, H, D], lse [T, H])`` in head order (rank 0's head shard first).
    """
    if not isinstance(problem, DcpProblem):
        raise TypeError(f"problem must be a DcpProblem, got {type(problem).__name__}")
    world = SimulatedWorld(problem.world_size)
    rank_traces: Sequence[dict | None] = traces if traces is not None else [None] * problem.world_size
    results = world.run(
        lambda grp, shard, tr: dcp_decode_step(
            grp,
            problem.q,
            shard,
            problem.seq_lens,
            problem.next_n,
            topk,
            sm_scale,
            v_dim=v_dim,
            trace=tr,
            stages=stages,
        ),
        problem.shards,
        rank_traces,
    )
    return torch.cat([o for o, _ in results], dim=1), torch.cat([l for _, l in results], dim=1)
