"""The whole DCP sparse-MLA decode step, end to end, on the references — and its oracle.

:func:`dcp_decode_step` is what *one* rank runs (SPMD; collectives through a
:class:`~dcp_ref.group.Group`):

1. local bounds       — :func:`dcp_ref.localize_decode_bounds` (expand per token, then localize)
2. local top-K        — :func:`dcp_ref.indexer.local_topk` over this rank's indexer scores
3. stable global top-K — :func:`dcp_ref.topk.merge_topk_global` (pack → all-gather → select)
4. slots + compaction — :func:`dcp_ref.deinterleave.deinterleave_and_compact`
5. attention + merge  — :func:`dcp_ref.attention.sparse_mla_attention`, then
                        :func:`dcp_ref.lse.dcp_merge_collective` (all-gather LSE, reduce-scatter)

``backend="kernels"`` runs the same step on the fast implementations where they can run
(:func:`kernel_stage_impls` says which, per stage): the Triton pack, the CuTeDSL stable top-K,
the Triton de-interleave + compaction, FlashInfer's sparse MLA and the Triton LSE correction —
on CUDA; on the CPU the Triton kernels run under ``TRITON_INTERPRET=1`` and the rest falls back
to the references (logged once on ``logging.getLogger("dcp_ref.pipeline")``).

:func:`single_device_decode` computes the same thing with no sharding at all: global scores →
global stable top-k → attention over the chosen keys. :func:`make_dcp_problem` builds a random
problem — the global KV and indexer scores, and each rank's paged shard with a shuffled block
table — so that tests and notebooks can check that DCP with any ``W`` and ``I`` reproduces the
single-device result exactly (up to float64 rounding).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from dataclasses import dataclass

import torch

from ._checks import check_int_scalar, check_world, has_module, triton_interpreting
from .attention import sparse_mla_attention
from .deinterleave import deinterleave_and_compact
from .group import Group, SimulatedWorld
from .indexer import local_topk
from .lse import dcp_merge_collective
from .ownership import expand_decode_bounds, global_to_local, localize_decode_bounds, owner_rank
from .topk import merge_topk_global

__all__ = [
    "RankShard", "DcpProblem", "make_dcp_problem", "dcp_decode_step", "single_device_decode", "run_dcp_decode",
    "STEP_BACKENDS", "kernel_stage_impls", "kernel_stages_3_to_5",
]

logger = logging.getLogger("dcp_ref.pipeline")
#: ``dcp_decode_step(backend=...)``: the references, or the kernels where they can run.
STEP_BACKENDS = ("reference", "kernels")
#: FlashInfer's MLA kernels take DeepSeek's head geometry: 512 latent + 64 RoPE dims, 512 values.
_FLASHINFER_DQK, _FLASHINFER_DV = 576, 512


#: Triton's CPU interpreter patches its language module while a kernel runs, so two threads (two
#: ranks of a SimulatedWorld) must not interpret kernels at the same time. Collectives stay
#: outside the lock, so ranks cannot deadlock on it.
_INTERPRETER_LOCK = threading.Lock()


def _kernel_launch(device: torch.device) -> contextlib.AbstractContextManager:
    return _INTERPRETER_LOCK if device.type != "cuda" and triton_interpreting() else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def _log_fallback(stage: str, reason: str) -> None:
    # lru_cache: each distinct fallback is logged once per process, not once per decode step.
    logger.warning("dcp_ref.pipeline: stage %r runs the torch reference: %s", stage, reason)


def kernel_stage_impls(device: torch.device, q_dtype: torch.dtype, head_dim: int, v_dim: int) -> dict[str, str]:
    """What ``dcp_decode_step(backend="kernels")`` runs for each stage on ``device``.

    Returns ``{"pack": ..., "select": ..., "deinterleave": ..., "attention": ..., "merge": ...}``
    with values ``"triton"``, ``"cutedsl"``, ``"flashinfer"`` or ``"torch"`` (the reference).
    Triton kernels need CUDA, or the CPU with ``TRITON_INTERPRET=1`` (set before they are
    imported); CuTeDSL needs CUDA and nvidia-cutlass-dsl; FlashInfer needs CUDA, flashinfer,
    fp16/bf16 queries and DeepSeek's head geometry (``head_dim = 576``, ``v_dim = 512``). Each
    stage that falls back is logged once, with the reason.
    """
    cuda = device.type == "cuda"
    impl: dict[str, str] = {}
    reasons: dict[str, str] = {}  # stage -> why it runs the reference
    if not has_module("triton"):
        tri_reason = "triton is not installed"
    elif not (cuda or triton_interpreting()):
        tri_reason = f"tensors are on {device} (set TRITON_INTERPRET=1 to interpret Triton on the CPU)"
    else:
        tri_reason = ""
    for stage in ("pack", "deinterleave", "merge"):
        impl[stage] = "torch" if tri_reason else "triton"
        if tri_reason:
            reasons[stage] = tri_reason
    if not cuda:
        reasons["select"] = reasons["attention"] = f"tensors are on {device}, not CUDA"
    else:
        if not has_module("cutlass"):
            reasons["select"] = "nvidia-cutlass-dsl is not installed"
        if not has_module("flashinfer"):
            reasons["attention"] = "flashinfer is not installed"
        elif q_dtype not in (torch.float16, torch.bfloat16):
            reasons["attention"] = f"FlashInfer's MLA takes fp16/bf16 queries, got {q_dtype}"
        elif (head_dim, v_dim) != (_FLASHINFER_DQK, _FLASHINFER_DV):
            reasons["attention"] = f"FlashInfer's MLA takes head_dim={_FLASHINFER_DQK}, v_dim={_FLASHINFER_DV}, got {head_dim}, {v_dim}"
    impl["select"] = "torch" if "select" in reasons else "cutedsl"
    impl["attention"] = "torch" if "attention" in reasons else "flashinfer"
    for stage, why in reasons.items():
        _log_fallback(stage, why)
    impl = {stage: impl[stage] for stage in ("pack", "select", "deinterleave", "attention", "merge")}  # step order
    return impl


@dataclass
class RankShard:
    """What one rank holds.

    Attributes:
        kv_cache: float ``[num_blocks * block_size, D]`` — the paged local KV (slot-major).
        block_table: int32 ``[B, max_blocks]`` — physical block of each request's local block
            ``j`` (``-1`` past the request's blocks).
        index_scores: float32 ``[T, max_local_len]`` — the indexer's scores of this rank's keys for
            every query token (column = local index; garbage past the token's local bound).
    """

    kv_cache: torch.Tensor
    block_table: torch.Tensor
    index_scores: torch.Tensor


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

    @property
    def req_of_token(self) -> torch.Tensor:
        return torch.arange(self.seq_lens.numel()).repeat_interleave(self.next_n)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "DcpProblem":
        """The same problem on ``device``, with ``q`` and the KV (global and sharded) in ``dtype``.

        Indexer scores stay float32 and the integer tensors keep their dtypes. The oracle
        (:func:`single_device_decode`) still wants the float64 CPU original: keep it.
        """
        dev = torch.device(device)

        def f(x: torch.Tensor) -> torch.Tensor:
            return x.to(device=dev, dtype=dtype or x.dtype)

        shards = [RankShard(f(s.kv_cache), s.block_table.to(dev), s.index_scores.to(dev)) for s in self.shards]
        return DcpProblem(self.world_size, self.interleave, self.block_size, self.seq_lens.to(dev), self.next_n, f(self.q),
                          [f(k) for k in self.kv_global], self.scores_global.to(dev), shards)


def make_dcp_problem(
    world_size: int,
    interleave: int = 1,
    *,
    seq_lens: list[int] | torch.Tensor = (37, 5, 64),
    next_n: int | list[int] | torch.Tensor = 1,
    num_heads: int = 4,
    head_dim: int = 24,
    block_size: int = 8,
    score_levels: int = 7,
    seed: int = 0,
) -> DcpProblem:
    """Build a random DCP decode problem and shard it.

    Indexer scores are drawn from only ``score_levels`` distinct values so that ties are common —
    the stable order (score, then lower global id) is exercised, not just the easy case.
    Physical blocks of every rank are handed out in a shuffled order, so slot ids are unrelated
    to positions (as in a real paged cache).

    ``next_n``: query tokens per request — one int (decode, MTP), or one per request (a prefill
    chunk: request ``b``'s last ``next_n[b]`` positions are its query tokens; see
    :mod:`dcp_ref.prefill`). Every request must hold at least its own query tokens.
    """
    w, _, i = check_world(world_size, None, interleave)
    bs = check_int_scalar(block_size, "block_size", min_value=1)
    if bs % i:  # the stage-4 rule (dcp_ref.deinterleave): an interleave stripe stays inside one block
        raise ValueError(f"block_size must be a multiple of interleave (block_size % interleave == 0), got block_size={bs}, interleave={i}")
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
        raise ValueError(f"next_n must lie in [0, seq_lens] per request (a request holds its own query tokens), got {per_req.tolist()} for {lens.tolist()}")
    req_of_token = torch.arange(B).repeat_interleave(per_req)
    T = int(per_req.sum())
    max_len = int(lens.max())
    q = torch.randn(T, num_heads, head_dim, generator=g, dtype=torch.float64)
    kv_global = [torch.randn(int(L), head_dim, generator=g, dtype=torch.float64) for L in lens]
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
        shards.append(RankShard(kv_cache=kv, block_table=table, index_scores=index_scores))
    return DcpProblem(w, i, bs, lens, next_n, q, kv_global, scores_global, shards)


def _per_request(next_n: int | torch.Tensor, device: torch.device) -> int | torch.Tensor:
    """``next_n`` for ``repeat_interleave``: an int as is, a per-request tensor on ``device``."""
    return next_n.to(device) if isinstance(next_n, torch.Tensor) else next_n


def dcp_decode_step(
    group: Group,
    q: torch.Tensor,
    shard: RankShard,
    seq_lens: torch.Tensor,
    next_n: int | torch.Tensor,
    topk: int,
    sm_scale: float,
    block_size: int,
    interleave: int = 1,
    *,
    v_dim: int | None = None,
    trace: dict | None = None,
    backend: str = "reference",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One rank's sparse-MLA decode step (all five stages).

    Args:
        group: this rank's group (rank and world size come from it).
        q: float ``[T, H, D]`` query tokens (``T`` = their total), tokens of request 0 first.
        shard: this rank's :class:`RankShard`.
        seq_lens: int ``[B]`` global lengths (including this step's query tokens).
        next_n: query tokens per request (1, or more with speculative / MTP decoding): an int,
            or an int tensor ``[B]`` with one count per request.
        topk: the global top-k (every rank ends with the same ``topk`` ids per token).
        sm_scale: softmax scale.
        block_size: tokens per block of the paged KV cache.
        interleave: ``I``, consecutive tokens per rank before moving to the next rank.
        v_dim: value width (default: all of ``D``).
        trace: if a dict is given, every intermediate is stored in it under the stage's name
            (``local_bounds``, ``local_ids``, ``global_ids``, ``slots``, ``counts``,
            ``partial_out``, ``partial_lse``; with ``backend="kernels"`` also ``impl``, the
            implementation of each stage) — for notebooks and debugging.
        backend: ``"reference"`` (the plain-PyTorch stages, float64 attention) or ``"kernels"``
            (see :func:`kernel_stage_impls`; the attention output is then float32, or q's dtype
            under FlashInfer).
    Returns:
        ``(out, lse)`` for this rank's head shard: ``[T, H/W, v_dim]`` and ``[T, H/W]`` (base e).
    """
    if backend not in STEP_BACKENDS:
        raise ValueError(f"backend must be one of {STEP_BACKENDS}, got {backend!r}")
    W, r = group.world_size, group.rank
    T = q.shape[0]
    # 1. per-token local causal bounds (expand first, localize after)
    local_bounds = localize_decode_bounds(seq_lens, next_n, W, r, interleave).reshape(T)
    # 2. local top-K over this rank's keys (K = topk is enough for exactness)
    local_ids = local_topk(shard.index_scores, topk, local_bounds)
    req_of_token = torch.arange(seq_lens.numel(), device=seq_lens.device).repeat_interleave(_per_request(next_n, seq_lens.device))
    if backend == "kernels":  # stages 3-5 on the kernels (kernel_stage_impls says which run here)
        if trace is not None:
            trace.update(local_bounds=local_bounds)
        return kernel_stages_3_to_5(group, q, shard.kv_cache, shard.block_table, shard.index_scores, local_ids, None,
                                    req_of_token, topk, sm_scale, block_size, interleave, v_dim=v_dim, trace=trace)
    # 3. stable global top-K across ranks: identical on every rank
    global_ids = merge_topk_global(group, shard.index_scores, local_ids, topk, interleave)
    # 4. global ids -> this rank's physical slots, compacted to the front
    slots, counts = deinterleave_and_compact(global_ids, req_of_token, shard.block_table, block_size, W, r, interleave)
    # 5. attention over the local slots, then the LSE merge across ranks
    out, lse = sparse_mla_attention(q, shard.kv_cache, slots, counts, sm_scale, "e", v_dim=v_dim or q.shape[-1])
    if trace is not None:
        trace.update(local_bounds=local_bounds, local_ids=local_ids, global_ids=global_ids, slots=slots, counts=counts,
                     partial_out=out, partial_lse=lse)
    return dcp_merge_collective(group, out, lse, "e")


def kernel_stages_3_to_5(
    group: Group,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    scores: torch.Tensor,
    local_ids: torch.Tensor,
    row_starts: torch.Tensor | None,
    req_of_token: torch.Tensor,
    topk: int,
    sm_scale: float,
    block_size: int,
    interleave: int,
    *,
    v_dim: int | None = None,
    trace: dict | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stages 3-5 on the kernels (see :func:`kernel_stage_impls`), shared by decode and prefill.

    From this rank's local top-K (``local_ids``, local key indices; column ``row_starts + j`` of
    ``scores``) to its merged head shard: pack → all-gather → stable top-K → de-interleave +
    compaction → sparse attention → all-gather LSE, correct, reduce-scatter.
    Returns ``(out [T, H/W, v_dim], lse [T, H/W])`` (base e; float32, or q's dtype under FlashInfer).
    """
    from .topk_backend import pack_candidates as pack_on
    from .topk_backend import stable_topk as select_on

    W, r = group.world_size, group.rank
    T, H, dqk = q.shape
    vd = v_dim or dqk
    if H % W:
        raise ValueError(f"q.shape[1] (H={H}) must be divisible by the world size W={W}")
    impl = kernel_stage_impls(q.device, q.dtype, dqk, vd)
    # 3. pack (score, global id) -> all-gather -> stable global top-K
    with _kernel_launch(q.device):
        packed = pack_on(scores, local_ids, r, W, interleave, row_starts, backend="triton" if impl["pack"] == "triton" else "torch")
    gathered = group.all_gather(packed)
    global_ids = select_on(gathered, topk, backend="cutedsl" if impl["select"] == "cutedsl" else "torch")
    # 4. global ids -> this rank's physical slots, compacted to the front
    req_of_token = req_of_token.to(device=q.device, dtype=torch.int32)
    if impl["deinterleave"] == "triton":
        from dcp_ref.kernels.deinterleave_triton import deinterleave_compact

        with _kernel_launch(q.device):
            slots, counts = deinterleave_compact(global_ids, req_of_token, block_table, block_size, W, r, interleave)
    else:
        slots, counts = deinterleave_and_compact(global_ids, req_of_token, block_table, block_size, W, r, interleave)
    # 5a. attention over the local slots (all H heads, this rank's keys only)
    if impl["attention"] == "flashinfer":
        from dcp_ref.kernels.flashinfer_mla import sparse_mla_flashinfer

        out, lse = sparse_mla_flashinfer(q, kv_cache, slots, counts, sm_scale, "e")
    else:
        out, lse = sparse_mla_attention(q, kv_cache, slots, counts, sm_scale, "e", v_dim=vd)
        # The Triton merge takes fp16/bf16/fp32 partials (an fp32 output is what a GPU kernel gives).
        out = out.to(q.dtype if q.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float32)
    if trace is not None:
        trace.update(local_ids=local_ids, global_ids=global_ids, slots=slots, counts=counts, partial_out=out,
                     partial_lse=lse, impl=impl)
    # 5b. merge across ranks: all-gather LSEs, rescale this rank's partial, reduce-scatter heads
    if impl["merge"] != "triton":
        return dcp_merge_collective(group, out, lse, "e")
    from dcp_ref.kernels.lse_merge_triton import lse_correct

    all_lses = group.all_gather(lse.float().contiguous())  # [W, T, H]
    merged = torch.empty((T, H), dtype=torch.float32, device=q.device)
    with _kernel_launch(q.device):
        corrected, merged = lse_correct(out, all_lses, r, base="e", merged_lse=merged)
    out_shard = group.reduce_scatter(corrected, dim=1)  # [T, H/W, v]
    hs = H // W
    return out_shard, merged[:, r * hs : (r + 1) * hs].contiguous()


def single_device_decode(problem: DcpProblem, topk: int, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    problem: DcpProblem, topk: int, sm_scale: float, traces: list[dict] | None = None, backend: str = "reference",
    v_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run :func:`dcp_decode_step` on every rank of a :class:`SimulatedWorld`; reassemble heads.

    ``traces``: optional list of ``world_size`` dicts that receive each rank's intermediates.
    ``backend``, ``v_dim``: as in :func:`dcp_decode_step`.
    Returns ``(out [T, H, D], lse [T, H])`` in head order (rank 0's head shard first).
    """
    world = SimulatedWorld(problem.world_size)
    traces = traces if traces is not None else [None] * problem.world_size
    results = world.run(
        lambda grp, shard, tr: dcp_decode_step(
            grp, problem.q, shard, problem.seq_lens, problem.next_n, topk, sm_scale, problem.block_size, problem.interleave,
            v_dim=v_dim, trace=tr, backend=backend,
        ),
        problem.shards,
        traces,
    )
    return torch.cat([o for o, _ in results], dim=1), torch.cat([l for _, l in results], dim=1)
