"""The owner-local exchange stage: gathered candidates straight to this rank's slots (``dcp_ref.select_to_slots``).

The reference is checked against an independent brute force written here in plain Python (sort every
candidate by the order, take ``k``, keep this rank's, map through the block table by hand); the union over
ranks against the single-device top-``k`` of :func:`dcp_ref.pipeline.make_dcp_problem` problems; the
``global_id`` order against today's two stages (``stable_topk`` + ``deinterleave_and_compact``). The CuTeDSL
kernel compiles to sm_90a PTX here (every variant); the ``gpu`` tests run it against the reference.
"""

from __future__ import annotations

import math
import random
import re
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_ref.deinterleave import canonicalize, deinterleave_and_compact
from dcp_ref.geometry import DcpGeometry
from dcp_ref.indexer import local_topk
from dcp_ref.pipeline import make_dcp_problem
from dcp_ref.select_to_slots import (
    SENTINEL_SLOT,
    check_select_to_slots_inputs,
    order_difference_example,
    reference_select_to_slots,
    select_to_slots,
)
from dcp_ref.topk import pack_candidates, stable_topk

INT32_MAX = 2**31 - 1
NAN = float("nan")


def f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


# ---------------------------------------------------------------------------------------------
# Cases as plain Python data (the brute force reads these, never the tensors' derived values)
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    W: int
    I: int
    bs: int
    K: int
    scores: list  # [T][W][K] float (float32 values); padding: any (ignored)
    local: list  # [T][W][K] local index on rank w, -1 = padding (valid ones ascending per (t, w))
    gid: list  # [T][W][K] global id carried by the global_id format (-1 = padding)
    req: list | None  # [T] request of each row, or None (row t = request t)
    table: list  # [B][M] block table of the rank under test

    @property
    def T(self) -> int:
        return len(self.scores)

    def pairs(self) -> torch.Tensor:
        """float32 [W, T, K, 2]; padding is (-inf, -1) as pack_candidates packs it."""
        g = [
            [
                [
                    (self.scores[t][w][c], float(self.gid[t][w][c])) if self.gid[t][w][c] >= 0 else (-math.inf, -1.0)
                    for c in range(self.K)
                ]
                for t in range(self.T)
            ]
            for w in range(self.W)
        ]
        return torch.tensor(g, dtype=torch.float32).reshape(self.W, self.T, self.K, 2)

    def scores_only(self) -> torch.Tensor:
        """float32 [W, T, K]; padding is NaN."""
        g = [
            [[self.scores[t][w][c] if self.local[t][w][c] >= 0 else NAN for c in range(self.K)] for t in range(self.T)]
            for w in range(self.W)
        ]
        return torch.tensor(g, dtype=torch.float32).reshape(self.W, self.T, self.K)

    def own_ids(self, rank: int) -> torch.Tensor:
        return torch.tensor([[self.local[t][rank][c] for c in range(self.K)] for t in range(self.T)], dtype=torch.int32)


def random_case(rng: random.Random, W: int, I: int, bs: int, K: int, T: int, *, flavour: str, n_blocks: int) -> Case:
    """Each rank's K candidates: distinct ascending local indices (some padding), scores of one flavour."""
    cap = n_blocks * bs  # local keys the table covers
    scores, local, gid = [], [], []
    for _ in range(T):
        srow, lrow, grow = [], [], []
        for w in range(W):
            locs = sorted(rng.sample(range(cap), min(K, cap))) + [-1] * max(0, K - cap)
            locs = [x if rng.random() > 0.15 else -1 for x in locs]
            if flavour == "ties":
                sc = [f32(rng.choice([0.0, -0.0, 1.0, 2.0, -1.0])) for _ in range(K)]
            elif flavour == "nan":
                sc = [
                    NAN if rng.random() < 0.2 else (-math.inf if rng.random() < 0.2 else f32(rng.gauss(0, 1)))
                    for _ in range(K)
                ]
            else:
                sc = [f32(rng.gauss(0, 1)) for _ in range(K)]
            srow.append(sc)
            lrow.append(locs)
            grow.append([(x // I) * (W * I) + w * I + x % I if x >= 0 else -1 for x in locs])
        scores.append(srow)
        local.append(lrow)
        gid.append(grow)
    B = T + 1
    blocks = rng.sample(range(4 * B * n_blocks), B * n_blocks)
    table = [blocks[b * n_blocks : (b + 1) * n_blocks] for b in range(B)]
    req = [rng.randrange(B) for _ in range(T)]
    return Case(W, I, bs, K, scores, local, gid, req, table)


def brute(case: Case, order: str, k: int, rank: int) -> list[list[int]]:
    """This rank's winners' slots per row in selection order (sentinel where a block is missing)."""
    out = []
    B = len(case.table)
    for t in range(case.T):
        cands = []
        for w in range(case.W):
            for c in range(case.K):
                s, loc, g = case.scores[t][w][c], case.local[t][w][c], case.gid[t][w][c]
                if order == "global_id":
                    if g < 0 or math.isnan(s):
                        continue
                    cands.append(((-s, g), g, None))
                else:
                    if loc < 0 or math.isnan(s):
                        continue
                    cands.append(((-s, w, c), None, (w, loc)))
        cands.sort(key=lambda x: x[0])  # -0.0 == 0.0 in Python: the tie-break decides
        row = []
        for _, g, wl in cands[:k]:
            if order == "global_id":
                if (g // case.I) % case.W != rank:
                    continue
                loc = (g // (case.W * case.I)) * case.I + g % case.I
            else:
                if wl[0] != rank:
                    continue
                loc = wl[1]
            b = t if case.req is None else case.req[t]
            if not 0 <= b < B or loc < 0 or loc // case.bs >= len(case.table[b]) or case.table[b][loc // case.bs] < 0:
                row.append(SENTINEL_SLOT)
                continue
            row.append(min(case.table[b][loc // case.bs] * case.bs + loc % case.bs, SENTINEL_SLOT))
        out.append(row)
    return out


def run_ref(case: Case, order: str, k: int, rank: int, validate: bool = True):
    g = DcpGeometry(case.W, rank, case.I, case.bs)
    req = None if case.req is None else torch.tensor(case.req, dtype=torch.int32)
    bt = torch.tensor(case.table, dtype=torch.int32)
    if order == "global_id":
        return select_to_slots(case.pairs(), req, bt, g, k, validate=validate)
    return select_to_slots(
        case.scores_only(), req, bt, g, k, order="rank_local", own_ids=case.own_ids(rank), validate=validate
    )


def as_rows(slots: torch.Tensor, counts: torch.Tensor) -> list[list[int]]:
    s, n = slots.tolist(), counts.tolist()
    for row, c in zip(s, n):
        assert all(v == -1 for v in row[c:]), row
    return [row[:c] for row, c in zip(s, n)]


# ---------------------------------------------------------------------------------------------
# Reference vs brute force
# ---------------------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    W=st.integers(1, 5),
    I=st.sampled_from([1, 2, 3]),
    bs_mult=st.integers(1, 3),
    K=st.integers(0, 7),
    k=st.integers(1, 14),
    T=st.integers(1, 3),
    flavour=st.sampled_from(["randn", "ties", "nan"]),
    order=st.sampled_from(["global_id", "rank_local"]),
    data=st.data(),
)
def test_reference_matches_brute_force(seed, W, I, bs_mult, K, k, T, flavour, order, data):
    rank = data.draw(st.integers(0, W - 1))
    case = random_case(random.Random(seed), W, I, I * bs_mult, K, T, flavour=flavour, n_blocks=4)
    slots, counts = run_ref(case, order, k, rank)
    assert slots.dtype == counts.dtype == torch.int32 and tuple(slots.shape) == (T, k) and tuple(counts.shape) == (T,)
    assert as_rows(slots, counts) == brute(case, order, k, rank)  # exact: the reference keeps selection order


def test_poisoned_rows_get_the_sentinel_unvalidated():
    rng = random.Random(5)
    case = random_case(rng, 2, 1, 2, 6, 4, flavour="randn", n_blocks=4)
    case.req = [0, len(case.table), -1, 1]  # rows 1 and 2: request ids out of range
    case.table[1][0] = -1  # row 3: a missing block
    case.table[1][1] = (INT32_MAX + 1) // 2  # ... and a slot beyond int32
    for order in ("global_id", "rank_local"):
        for rank in range(2):
            want = brute(case, order, 8, rank)
            slots, counts = run_ref(case, order, 8, rank, validate=False)
            assert as_rows(slots, counts) == want
            assert all(v == SENTINEL_SLOT for v in want[1] + want[2])
    with pytest.raises(ValueError, match=r"^req_of_token"):
        run_ref(case, "global_id", 8, 0)


def test_rank_local_missing_own_id_is_poisoned_unvalidated():
    case = random_case(random.Random(2), 2, 1, 4, 5, 2, flavour="randn", n_blocks=4)
    case.local[0][1] = [-1] * 5  # rank 1's indices lost, its scores kept: out of contract
    own = case.own_ids(1)
    g = DcpGeometry(2, 1, 1, 4)
    bt = torch.tensor(case.table, dtype=torch.int32)
    req = torch.tensor(case.req, dtype=torch.int32)
    scores = case.scores_only()
    scores[1, 0] = torch.tensor(case.scores[0][1])  # real scores under -1 ids
    slots, counts = select_to_slots(scores, req, bt, g, 10, order="rank_local", own_ids=own, validate=False)
    row = slots[0, : int(counts[0])].tolist()
    assert row and all(v == SENTINEL_SLOT for v in row)
    with pytest.raises(ValueError, match=r"^own_ids is -1"):
        select_to_slots(scores, req, bt, g, 10, order="rank_local", own_ids=own)


def test_empty_and_degenerate_shapes():
    g = DcpGeometry(2, 1, 1, 4)
    bt = torch.zeros(3, 2, dtype=torch.int32)
    for order, shape in (("global_id", (2, 0, 5, 2)), ("rank_local", (2, 0, 5))):
        own = torch.zeros(0, 5, dtype=torch.int32) if order == "rank_local" else None
        s, n = select_to_slots(torch.zeros(shape), None, bt, g, 3, order=order, own_ids=own)
        assert tuple(s.shape) == (0, 3) and tuple(n.shape) == (0,)
    # K = 0: nothing to select, every row empty (a count of zero)
    s, n = select_to_slots(torch.zeros(2, 3, 0, 2), None, bt, g, 4)
    assert s.tolist() == [[-1] * 4] * 3 and n.tolist() == [0, 0, 0]
    s, n = select_to_slots(
        torch.zeros(2, 3, 0), None, bt, g, 4, order="rank_local", own_ids=torch.zeros(3, 0, dtype=torch.int32)
    )
    assert n.tolist() == [0, 0, 0]


def test_out_buffers_are_written_and_returned():
    case = random_case(random.Random(9), 3, 2, 4, 6, 3, flavour="ties", n_blocks=4)
    g = DcpGeometry(3, 2, 2, 4)
    bt = torch.tensor(case.table, dtype=torch.int32)
    req = torch.tensor(case.req, dtype=torch.int64)
    out_s = torch.full((3, 9), 777, dtype=torch.int32)
    out_n = torch.full((3,), 777, dtype=torch.int32)
    s, n = reference_select_to_slots(case.pairs(), None, req, bt, g, 9, out_slots=out_s, out_counts=out_n)
    assert s is out_s and n is out_n
    assert as_rows(s, n) == brute(case, "global_id", 9, 2)
    s, n = reference_select_to_slots(
        case.scores_only(), case.own_ids(2), req, bt, g, 9, order="rank_local", out_slots=out_s, out_counts=out_n
    )
    assert s is out_s and as_rows(s, n) == brute(case, "rank_local", 9, 2)
    assert getattr(reference_select_to_slots, "impl_name", None) == "torch"


# ---------------------------------------------------------------------------------------------
# Against the single device, and against today's two stages
# ---------------------------------------------------------------------------------------------


def _rank_inputs(problem, K: int, rank: int):
    shard = problem.shards[rank]
    ids = local_topk(shard.index_scores, K)  # NaN = key not there: never selected
    pairs = pack_candidates(
        shard.index_scores, ids, DcpGeometry(problem.world_size, rank, problem.interleave, problem.interleave)
    )
    asc = torch.sort(torch.where(ids >= 0, ids, torch.iinfo(torch.int64).max), dim=1).values
    valid = asc != torch.iinfo(torch.int64).max
    own = torch.where(valid, asc, -1)
    sc = torch.gather(shard.index_scores, 1, torch.where(valid, asc, 0))
    scores = torch.where(valid, sc, torch.full_like(sc, NAN))
    return pairs, scores, own.to(torch.int32)


def _single_device(problem, order: str, k: int) -> list[set[tuple[int, int]]]:
    """Per query token: the (rank, slot) of each of the single-device top-k, by brute force."""
    W, I, bs = problem.world_size, problem.interleave, problem.block_size
    req = problem.req_of_token.tolist()
    out = []
    for t, b in enumerate(req):
        L = int(problem.seq_lens[b])
        sc = problem.scores_global[t, :L].tolist()
        if order == "global_id":
            keyed = sorted(range(L), key=lambda p: (-sc[p], p))
        else:
            keyed = sorted(range(L), key=lambda p: (-sc[p], (p // I) % W, (p // (W * I)) * I + p % I))
        want = set()
        for p in keyed[:k]:
            r, loc = (p // I) % W, (p // (W * I)) * I + p % I
            want.add((r, int(problem.shards[r].block_table[b, loc // bs]) * bs + loc % bs))
        out.append(want)
    return out


@pytest.mark.parametrize("W", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("I", [1, 2])
def test_union_over_ranks_is_the_single_device_topk(W, I):
    problem = make_dcp_problem(W, I, seq_lens=(37, 5, 64, 90), next_n=1, block_size=4 * I, seed=W * 10 + I)
    k = 12
    inputs = [_rank_inputs(problem, k, r) for r in range(W)]
    pairs = torch.stack([x[0] for x in inputs])
    scores = torch.stack([x[1] for x in inputs])
    req = problem.req_of_token
    for order in ("global_id", "rank_local"):
        got = [set() for _ in range(req.numel())]
        for r in range(W):
            g = problem.geometry(r)
            bt = problem.shards[r].block_table
            if order == "global_id":
                s, n = select_to_slots(pairs, req, bt, g, k)
            else:
                s, n = select_to_slots(scores, req, bt, g, k, order="rank_local", own_ids=inputs[r][2])
            for t, row in enumerate(as_rows(s, n)):
                assert len(set(row)) == len(row)  # no slot twice on one rank
                got[t] |= {(r, v) for v in row}
            if order == "global_id":  # the same set as today's select + deinterleave
                ids = stable_topk(pairs, k)
                want_s, want_n = deinterleave_and_compact(
                    ids, req, bt, DcpGeometry(W, r, I, g.block_size), ordered=False
                )
                assert canonicalize(s, n).tolist() == want_s.tolist() and n.tolist() == want_n.tolist()
        assert got == _single_device(problem, order, k), order


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), W=st.integers(2, 4), k=st.integers(1, 10), levels=st.integers(2, 5))
def test_orders_differ_only_on_threshold_ties(seed, W, k, levels):
    """Both orders select every key strictly above the k-th score, and as many keys at it."""
    problem = make_dcp_problem(W, 1, seq_lens=(23, 31), next_n=1, block_size=4, score_levels=levels, seed=seed % 10_000)
    inputs = [_rank_inputs(problem, k, r) for r in range(W)]
    pairs = torch.stack([x[0] for x in inputs])
    scores = torch.stack([x[1] for x in inputs])
    req = problem.req_of_token
    sets = {}
    for order in ("global_id", "rank_local"):
        got = [set() for _ in range(req.numel())]
        for r in range(W):
            g, bt = problem.geometry(r), problem.shards[r].block_table
            if order == "global_id":
                s, n = select_to_slots(pairs, req, bt, g, k)
            else:
                s, n = select_to_slots(scores, req, bt, g, k, order="rank_local", own_ids=inputs[r][2])
            for t, row in enumerate(as_rows(s, n)):
                got[t] |= {(r, v) for v in row}
        sets[order] = got
    for t, b in enumerate(req.tolist()):
        L = int(problem.seq_lens[b])
        sc = problem.scores_global[t, :L].tolist()
        kth = sorted(sc, reverse=True)[min(k, L) - 1]
        score_of = {}
        for p in range(L):
            r, loc = p % W, p // W
            score_of[(r, int(problem.shards[r].block_table[b, loc // 4]) * 4 + loc % 4)] = sc[p]
        a, c = sets["global_id"][t], sets["rank_local"][t]
        assert len(a) == len(c) == min(k, L)
        above = {x for x, s in score_of.items() if s > kth}
        assert above <= a and above <= c
        assert all(score_of[x] >= kth for x in a | c)
        assert all(score_of[x] == kth for x in a ^ c)  # only keys at the k-th score can differ


def test_order_difference_example():
    ex = order_difference_example()
    scores = ex.scores[0].tolist()
    bt = torch.tensor([[0, 1]], dtype=torch.int32)  # block size 1: slot = local index
    for order, want in (("global_id", ex.winners_global_id), ("rank_local", ex.winners_rank_local)):
        got = set()
        for r in range(ex.world_size):
            g = DcpGeometry(2, r, 1, 1)
            if order == "global_id":
                s, n = select_to_slots(ex.gathered_pairs, None, bt, g, ex.k)
            else:
                s, n = select_to_slots(ex.gathered_scores, None, bt, g, ex.k, order="rank_local", own_ids=ex.own_ids[r])
            got |= {v * 2 + r for v in as_rows(s, n)[0]}  # slot (= local) back to a global position (W = 2)
        assert got == set(want)
    assert set(ex.winners_global_id) != set(ex.winners_rank_local)
    # Each is exact for its order, by brute force over all four keys.
    assert sorted(range(4), key=lambda p: (-scores[p], p))[:2] == list(ex.winners_global_id)
    assert sorted(range(4), key=lambda p: (-scores[p], p % 2, p // 2))[:2] == list(ex.winners_rank_local)
    # Neither is the union of the local top-Ks (every rank keeps both of its keys).
    assert set(ex.union_of_local_topk) == {0, 1, 2, 3}


# ---------------------------------------------------------------------------------------------
# CuTeDSL kernel: compiles to sm_90a PTX for every variant (no GPU needed)
# ---------------------------------------------------------------------------------------------

# (order, W, K, k, I, bs, vec, variant, has_req, req64, bt64, small, (threads, min_ctas) or None, first_bits, split)
PTX_CONFIGS = [
    ("rank_local", 8, 2048, 2048, 1, 64, 4, "lean", True, False, False, True, None, 11, 1),  # the headline shape
    ("global_id", 8, 2048, 2048, 1, 64, 2, "lean", True, False, False, True, None, 8, 1),
    ("rank_local", 3, 7, 5, 2, 4, 1, "lean", False, False, True, True, None, 8, 1),  # tail masked, division
    ("global_id", 3, 6, 5, 2, 6, 1, "regs", True, True, False, False, None, 12, 1),  # 64-bit offsets
    ("rank_local", 2, 64, 100, 1, 16, 2, "lean", True, True, True, False, (512, 0), 11, 1),
    ("global_id", 1, 300, 17, 1, 4, 2, "regs", True, False, False, True, (256, 2), 8, 1),  # W = 1: all owned
    ("rank_local", 8, 2048, 2048, 1, 64, 4, "lean", True, False, False, True, None, 8, 4),  # split: a cluster
    ("global_id", 5, 100, 64, 2, 8, 2, "lean", True, False, True, False, None, 8, 2),  # split, division, 64-bit
]


@pytest.mark.parametrize("n", range(len(PTX_CONFIGS)), ids=lambda n: "-".join(map(str, PTX_CONFIGS[n][:8])))
def test_cutedsl_compiles_to_sm90a_ptx(n):
    cfg = PTX_CONFIGS[n]
    pytest.importorskip("cutlass")
    from dcp_ref.kernels.select_to_slots_cutedsl import (
        SelectToSlotsConfig,
        SelectToSlotsKernel,
        compile_artifacts,
        cubin_resources,
    )

    order, W, K, k, I, bs, vec, variant, has_req, req64, bt64, small, conf, fb, split = cfg
    c = SelectToSlotsConfig(
        order,
        W,
        K,
        k,
        I,
        bs,
        vec=vec,
        variant=variant,
        has_req=has_req,
        req_int64=req64,
        bt_int64=bt64,
        small=small,
        threads=conf[0] if conf else 0,
        min_ctas=conf[1] if conf else -1,
        first_bits=fb,
        split=split,
    )
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = compile_artifacts(c, d)
    kern = SelectToSlotsKernel(c)
    res = cubin_resources(cubin)
    assert res["frame_bytes"] == 0 and res["stack_bytes"] == 0, res  # no local memory: no spills
    cap = 65536 // (kern.threads * kern.min_ctas) if kern.min_ctas > 1 else 255
    assert 0 < res["registers"] <= min(cap, 255), res
    assert re.search(r"^\.target sm_90a", ptx, re.M), ptx[:300]
    assert f".reqntid {kern.threads}, 1, 1" in ptx
    assert (".minnctapersm" in ptx) == (kern.min_ctas > 1)
    # split: histograms summed over the cluster through distributed shared memory, cluster barriers
    assert ("mapa.shared::cluster" in ptx) == ("barrier.cluster.wait" in ptx) == (split > 1)
    words = vec * (1 if order == "rank_local" else 2)
    if words > 1:
        assert f"ld.global.v{words}." in ptx  # the vectorised candidate loads
    assert "shfl.sync.up" in ptx and "bar.sync" in ptx and "vote.sync.ballot" in ptx
    assert re.search(r"atom\.shared|red\.shared", ptx)
    assert ".local" not in ptx  # keys stay in registers
    assert str(SENTINEL_SLOT) in ptx  # the poison rule is in the kernel


def test_config_is_a_frozen_hashable_key_and_checks_itself():
    pytest.importorskip("cutlass")
    from dataclasses import FrozenInstanceError

    from dcp_ref.kernels.select_to_slots_cutedsl import (
        SelectToSlotsConfig,
        check_fits,
        make_config,
        rank_local_schedule,
    )

    a = SelectToSlotsConfig("rank_local", 8, 2048, 2048, vec=4)
    assert a == SelectToSlotsConfig("rank_local", 8, 2048, 2048, vec=4) and len({a, a}) == 1
    with pytest.raises(FrozenInstanceError):
        a.k = 3  # type: ignore[misc]
    for bad, match in (
        (dict(order="x"), "order"),
        (dict(vec=4, order="global_id"), "vec"),
        (dict(vec=3), "vec"),
        (dict(variant="regs"), "variant"),
        (dict(world=9, kloc=4096), "world"),
        (dict(first_bits=9), "first_bits"),
        (dict(interleave=3, block_size=4), "block_size"),
        (dict(split=3), "split"),
        (dict(world=3, kloc=7, split=2), "split"),
        (dict(threads=256, world=8, kloc=2048, vec=1), "threads"),
        (dict(check=True, split=2), "check needs split=1"),
    ):
        kw = dict(order="rank_local", world=2, kloc=8, k=4) | bad
        with pytest.raises(ValueError, match=match):
            SelectToSlotsConfig(**kw)
    with pytest.raises(TypeError, match=r"^check must be a bool"):
        SelectToSlotsConfig(order="rank_local", world=2, kloc=8, k=4, check=1)
    # the validated call's configuration: one CTA per row, the widest CTA, no register cap; its table fits or not
    c = make_config("global_id", 2, 2048, 2048, DcpGeometry(2, 0, 1, 64), rows=1, check=True)
    assert (c.check, c.split, c.threads, c.min_ctas) == (True, 1, 1024, 0) and check_fits(c)
    assert not check_fits(make_config("global_id", 8, 4096, 4096, DcpGeometry(8, 0, 1, 64), check=True))
    g = DcpGeometry(4, 1, 2, 8)
    assert make_config("rank_local", 4, 2048, 2048, g, data_ptr=256).vec == 4
    assert make_config("rank_local", 4, 2046, 2048, g, data_ptr=256).vec == 2
    assert make_config("rank_local", 4, 2048, 2048, g, data_ptr=260).vec == 1
    assert make_config("global_id", 4, 2048, 2048, g, data_ptr=256).vec == 2
    assert make_config("global_id", 4, 2048, 2048, g, data_ptr=264).vec == 1
    # split by rows (measured defaults): a cluster per row only while a few rows leave SMs idle
    splits = [make_config("rank_local", 8, 2048, 2048, g, data_ptr=256, rows=r).split for r in (1, 8, 16, 17, 32)]
    assert splits == [8, 8, 4, 1, 1]
    assert make_config("rank_local", 2, 2048, 2048, g, data_ptr=256, rows=1).split == 2  # >= 512 loads per CTA
    splits = [make_config("global_id", 8, 2048, 2048, g, data_ptr=256, rows=r).split for r in (1, 16, 32, 33, 34, 128)]
    assert splits == [8, 4, 2, 2, 1, 1]
    assert make_config("rank_local", 8, 2048, 2048, g, data_ptr=256, rows=1024).first_bits == 11
    assert make_config("rank_local", 8, 2048, 2048, g, data_ptr=256, rows=1).first_bits == 8  # narrower when split
    assert make_config("global_id", 3, 7, 5, g, rows=1).split == 1  # 21 loads: no split divides them
    # rank_local's tie-break word: only the position's bits, in digits of 5..9 bits.
    for n in (1, 20, 300, 4096, 16384, 32768):
        lo = [d for d in rank_local_schedule(8, n) if d[0] == 1]
        bits = [b for _, _, b in lo]
        assert sum(bits) == max(5, (n - 1).bit_length()) and all(5 <= b <= 9 for b in bits)
        assert [s for _, s, _ in lo] == sorted((s for _, s, _ in lo), reverse=True) and lo[-1][1] == 0


def test_cutedsl_wrapper_needs_cuda_after_the_shared_checks():
    pytest.importorskip("cutlass")
    from dcp_ref.kernels.select_to_slots_cutedsl import select_to_slots_cutedsl

    case = random_case(random.Random(1), 2, 1, 4, 4, 2, flavour="randn", n_blocks=2)
    g = DcpGeometry(2, 0, 1, 4)
    bt = torch.tensor(case.table, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^gathered must be a CUDA tensor"):
        select_to_slots_cutedsl(case.pairs(), None, bt, g, 4)
    with pytest.raises(ValueError, match=r"^gathered has W\*K"):
        select_to_slots_cutedsl(torch.zeros(2, 1, 16385, 2), None, bt, g, 4, validate=False)


# ---------------------------------------------------------------------------------------------
# The kernel wrapper's value check: one Triton launch raises a flag (interpreted here)
# ---------------------------------------------------------------------------------------------

MUTATIONS = {
    "global_id": ("none", "dup", "frac", "big", "neg", "inf", "nan", "req", "hole", "huge", "short"),
    "rank_local": ("none", "swap", "repeat", "unnamed", "neg", "req", "hole", "huge", "short"),
}


def _mutated(case: Case, order: str, rank: int, how: str, rng: random.Random):
    """The case's tensors with one ``how`` change (``none``: as built), ``(gathered, req, table, own)``."""
    gathered = case.pairs() if order == "global_id" else case.scores_only()
    req = None if case.req is None else torch.tensor(case.req, dtype=torch.int32)
    table = torch.tensor(case.table, dtype=torch.int64)
    own = case.own_ids(rank) if order == "rank_local" else None
    t = rng.randrange(case.T)
    w, c = rng.randrange(case.W), rng.randrange(case.K)
    if own is None and how in ("dup", "frac", "big", "neg", "inf", "nan"):
        w2, c2 = rng.randrange(case.W), rng.randrange(case.K)
        val = {"frac": 2.5, "big": 2.0**24, "neg": -2.0, "inf": math.inf, "nan": NAN}.get(how)
        gathered[w, t, c, 1] = gathered[w2, t, c2, 1] if how == "dup" else val
    elif own is not None and how in ("swap", "repeat", "unnamed", "neg"):
        valid = [i for i in range(case.K) if own[t, i] >= 0]
        if how == "swap" and len(valid) >= 2:
            a, b = rng.sample(valid, 2)
            own[t, a], own[t, b] = own[t, b].clone(), own[t, a].clone()
        elif how == "repeat" and len(valid) >= 2:
            a = rng.randrange(1, len(valid))
            own[t, valid[a]] = own[t, valid[a - 1]]
        elif how == "unnamed":
            own[t, c] = -1
            gathered[rank, t, c] = 0.25
        elif how == "neg":
            own[t, c] = -2
    elif how == "req":
        req = torch.tensor(case.req if case.req is not None else list(range(case.T)), dtype=torch.int32)
        req[t] = rng.choice([-1, len(case.table), len(case.table) + 5])
    elif how == "hole":
        table[rng.randrange(table.shape[0]), rng.randrange(table.shape[1])] = -1
    elif how == "huge":
        table[rng.randrange(table.shape[0]), rng.randrange(table.shape[1])] = rng.choice([2**31 // case.bs, 2**40])
    elif how == "short":
        table = table[:, : rng.randrange(table.shape[1])].contiguous()
    return gathered, req, table, own


def _flag(gathered, req, table, g, order, own) -> int:
    from dcp_ref.kernels.select_to_slots_cutedsl import check_select_to_slots_values

    chk = check_select_to_slots_values(gathered, req, table, g, order=order, own_ids=own)
    raised = int(chk.item())
    chk.zero_()
    return raised


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    W=st.integers(1, 4),
    I=st.sampled_from([1, 2]),
    K=st.integers(1, 7),
    k=st.integers(1, 12),
    T=st.integers(1, 3),
    order=st.sampled_from(["global_id", "rank_local"]),
    data=st.data(),
)
def test_kernel_value_check_flags_every_input_the_reference_refuses(seed, W, I, K, k, T, order, data):
    """The flag of :func:`check_select_to_slots_values` is raised whenever the reference's validated call refuses
    (never a miss); on a case built in contract it stays 0; a flag the reference clears comes only from a block
    that a *losing* candidate of this rank lacks (the kernel checks every candidate, the reference the winners)."""
    pytest.importorskip("cutlass")
    rank = data.draw(st.integers(0, W - 1))
    how = data.draw(st.sampled_from(MUTATIONS[order]))
    rng = random.Random(seed)
    case = random_case(rng, W, I, 2 * I, K, T, flavour=rng.choice(["randn", "ties", "nan"]), n_blocks=4)
    if rng.random() < 0.3:
        case.req = None
    g = DcpGeometry(W, rank, I, 2 * I)
    gathered, req, table, own = _mutated(case, order, rank, how, rng)
    try:
        select_to_slots(gathered, req, table, g, k, order=order, own_ids=own)
        refused = False
    except ValueError:
        refused = True
    flag = _flag(gathered, req, table, g, order, own)
    assert flag or not refused, how  # never a miss
    if how == "none":
        assert not refused and not flag
    if flag and not refused:
        assert how in ("hole", "huge", "short"), how  # a false alarm: a losing candidate without a block


def test_kernel_value_check_duplicates_in_a_large_row_and_across_calls(monkeypatch):
    """The hash table finds one repeated id among 4096 (W = 4, K = 256, 4 rows), in any row and rank slice; calls
    after it (the table is never cleared: entries of earlier calls are stale by their stamp) see no duplicate;
    with a table capped to a few rows the check runs per group of rows, and stamps that reach their limit
    restart on a zeroed table."""
    pytest.importorskip("cutlass")
    from dcp_ref.kernels import select_to_slots_cutedsl as mod

    W, K, T = 4, 256, 4
    g = DcpGeometry(W, 1, 1, 4)
    gen = torch.Generator().manual_seed(3)
    perm = torch.stack([torch.randperm(W * K * 8, generator=gen)[: W * K] for _ in range(T)])  # distinct ids
    ids = perm.view(T, W, K).permute(1, 0, 2).float()
    pairs = torch.stack([torch.randn(W, T, K, generator=gen), ids], -1).contiguous()
    table = torch.arange(T * 2048, dtype=torch.int32).view(T, 2048)
    for cap in (None, 2 * 4 * W * K, 4 * W * K):  # one launch, two rows per launch, one row per launch
        if cap is not None:
            monkeypatch.setattr(mod, "_HASH_MAX", cap)
        for _ in range(2):
            assert _flag(pairs, None, table, g, "global_id", None) == 0
        for t, (w1, c1), (w2, c2) in ((0, (0, 0), (3, 255)), (3, (2, 17), (2, 200)), (1, (1, 5), (0, 9))):
            bad = pairs.clone()
            bad[w2, t, c2, 1] = bad[w1, t, c1, 1]
            assert _flag(bad, None, table, g, "global_id", None) == 1
            assert _flag(pairs, None, table, g, "global_id", None) == 0
    monkeypatch.setattr(mod, "_STAMP_LIMIT", 8)  # every launch of T = 4 rows restarts the stamps
    for _ in range(3):
        assert _flag(pairs, None, table, g, "global_id", None) == 0
    bad = pairs.clone()
    bad[0, 2, 0, 1] = bad[1, 2, 1, 1]
    assert _flag(bad, None, table, g, "global_id", None) == 1


def test_kernel_value_check_rows_longer_than_one_block():
    """Rows longer than the check kernel's block: ``rank_local`` carries the ascending test across its loop's
    chunks (K = 1500, blocks of 1024: a repeat or a swap across the boundary is caught, a good row is not
    flagged); ``global_id`` spreads a rank's slice over several programs (K = 600, blocks of 256) that share the
    row's hash table."""
    pytest.importorskip("cutlass")
    K, T = 1500, 2
    g = DcpGeometry(2, 1, 1, 4)
    gen = torch.Generator().manual_seed(4)
    loc = torch.cumsum(torch.randint(1, 3, (T, K), generator=gen), -1) - 1
    loc[0, 700:710] = -1  # padding (NaN scores) inside the row
    scores = torch.randn(2, T, K, generator=gen)
    scores[1] = torch.where(loc >= 0, scores[1], NAN)
    table = torch.arange(T * 1024, dtype=torch.int32).view(T, 1024)
    own = loc.to(torch.int32)
    assert _flag(scores, None, table, g, "rank_local", own) == 0
    for a, b in ((1024, 1023), (1100, 1000), (1499, 0)):
        bad = own.clone()
        bad[1, a] = own[1, b]
        with pytest.raises(ValueError, match=r"^own_ids must list"):
            select_to_slots(scores, None, table, g, 8, order="rank_local", own_ids=bad)
        assert _flag(scores, None, table, g, "rank_local", bad) == 1
    K = 600
    ids = torch.randperm(2 * T * K * 3, generator=gen)[: 2 * T * K].view(2, T, K).float()
    pairs = torch.stack([torch.randn(2, T, K, generator=gen), ids], -1).contiguous()
    table = torch.arange(T * 2048, dtype=torch.int32).view(T, 2048)
    assert _flag(pairs, None, table, g, "global_id", None) == 0
    for (w1, c1), (w2, c2) in (((0, 10), (0, 590)), ((0, 599), (1, 256)), ((1, 300), (1, 511))):
        bad = pairs.clone()
        bad[w2, 1, c2, 1] = bad[w1, 1, c1, 1]
        assert _flag(bad, None, table, g, "global_id", None) == 1


# ---------------------------------------------------------------------------------------------
# GPU: the kernel against the reference (run with -m gpu on the H200)
# ---------------------------------------------------------------------------------------------


def make_gpu_case(W, K, rows, I, bs, seed, device, *, poison):
    """Vectorised random rows of 8 flavours (randn, heavy ties, +-0, mostly padding, NaN / -inf, all padding,
    bad request ids, missing blocks / own ids), both wire formats of the same candidates. Returns
    ``(pairs [W,T,K,2], scores [W,T,K], own [W,T,K] int32, req int32 [T], table int32 [B,M])``; the poison
    flavours (6, 7) only when ``poison``."""
    gen = torch.Generator().manual_seed(seed)
    flav = torch.arange(rows) % 8
    # distinct ascending local indices: a cumulative sum of positive gaps
    gaps = torch.randint(1, 3, (W, rows, K), generator=gen)
    loc = torch.cumsum(gaps, -1) - 1
    n_blocks = (2 * K + 1) // bs + 2
    p_pad = torch.tensor([0.02, 0.1, 0.0, 0.9, 0.1, 1.0, 0.05, 0.05])[flav].view(1, rows, 1)
    pad = torch.rand(W, rows, K, generator=gen) < p_pad
    loc = torch.where(pad, -1, loc)
    sc = torch.randn(W, rows, K, generator=gen)
    few = torch.randint(0, 4, (W, rows, K), generator=gen).float()
    ties = ((flav == 1) | (flav == 7)).view(1, rows, 1)
    sc = torch.where(ties, few, sc)
    zeros = torch.where(torch.rand(W, rows, K, generator=gen) < 0.5, -0.0, 0.0)
    sc = torch.where((flav == 2).view(1, rows, 1), zeros, sc)
    f4 = (flav == 4).view(1, rows, 1)
    sc = torch.where(f4 & (torch.rand(W, rows, K, generator=gen) < 0.05), NAN, sc)
    sc = torch.where(f4 & (torch.rand(W, rows, K, generator=gen) < 0.05), -math.inf, sc)
    w_idx = torch.arange(W).view(W, 1, 1)
    gid = torch.where(loc >= 0, (loc // I) * (W * I) + w_idx * I + loc % I, -1)
    pairs = torch.stack([torch.where(loc >= 0, sc, -math.inf), gid.float()], -1)
    scores = torch.where(loc >= 0, sc, NAN)
    own = loc.to(torch.int32)
    B = rows + 2
    table = torch.randperm(B * n_blocks * 3, generator=gen)[: B * n_blocks].view(B, n_blocks).to(torch.int32)
    req = torch.randperm(B, generator=gen)[:rows].to(torch.int32)
    if poison:
        f6, f7 = flav == 6, flav == 7
        req = torch.where(f6, torch.where(torch.arange(rows) % 16 == 6, -1, B), req).to(torch.int32)
        holes = torch.rand(B, n_blocks, generator=gen) < 0.3
        rows7 = torch.zeros(B, dtype=torch.bool)
        rows7[req[f7].long()] = True
        table = torch.where(holes & rows7.unsqueeze(1), -1, table)
        lost = f7.view(1, rows, 1) & (torch.rand(W, rows, K, generator=gen) < 0.1)
        own = torch.where(lost, -1, own)  # a real score without its local index
    dev = torch.device(device)
    return pairs.to(dev), scores.to(dev), own.to(dev), req.to(dev), table.to(dev)


def _same(got, want, k):
    s, n = got
    ws, wn = want
    assert torch.equal(n, wn)
    tail = torch.arange(k, device=s.device) >= n.unsqueeze(1).long()
    assert bool((s[tail] == -1).all())
    return torch.equal(canonicalize(s, n), canonicalize(ws, wn))


GPU_CONFIGS = [
    # (W, K, k, I, bs, rows, int64 indices, tuning)
    (1, 64, 32, 1, 16, 500, False, {}),
    (2, 2048, 2048, 1, 64, 300, False, {}),
    (4, 2048, 2048, 4, 64, 300, False, {}),
    (8, 2048, 2048, 1, 64, 400, False, {}),
    (8, 2048, 2048, 64, 64, 200, True, {}),
    (8, 2048, 1024, 2, 16, 200, False, {"first_bits": 12}),
    (3, 7, 5, 1, 4, 300, False, {}),
    (5, 130, 300, 2, 8, 300, True, {}),
    (2, 6, 20, 1, 2, 300, False, {}),
    (8, 4096, 4096, 1, 64, 120, False, {}),
    (4, 1000, 777, 3, 6, 300, False, {"vec": 1}),
    (8, 2048, 2048, 1, 64, 200, False, {"variant": "regs", "config": (1024, 0)}),
    # the split form: a cluster of CTAs per row
    (8, 2048, 1000, 2, 16, 200, True, {"split": 8, "first_bits": 11}),
    (2, 2048, 2048, 1, 64, 200, False, {"split": 2, "config": (256, 0)}),
    (4, 1000, 777, 3, 6, 200, False, {"vec": 1, "split": 8}),
    (1, 64, 32, 1, 16, 200, False, {"split": 2}),
]


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["global_id", "rank_local"])
def test_cutedsl_differential_against_the_reference(cuda_device, order):
    from dcp_ref.kernels.select_to_slots_cutedsl import select_to_slots_cutedsl

    failures, total = [], 0
    for c, (W, K, k, I, bs, rows, i64, tune) in enumerate(GPU_CONFIGS):
        pairs, scores, own, req, table = make_gpu_case(W, K, rows, I, bs, 100 + c, cuda_device, poison=True)
        if i64:
            req, table = req.long(), table.long()
        if order == "rank_local" and tune.get("variant") == "regs":
            tune = {kk: v for kk, v in tune.items() if kk != "variant"}
        gathered = pairs if order == "global_id" else scores
        for r in range(W):
            g = DcpGeometry(W, r, I, bs)
            own_r = None if order == "global_id" else own[r].contiguous()
            want = select_to_slots(gathered, req, table, g, k, order=order, own_ids=own_r, validate=False)
            out = (
                torch.full((rows, k), 12345, dtype=torch.int32, device=cuda_device),
                torch.full((rows,), 777, dtype=torch.int32, device=cuda_device),
            )
            got = select_to_slots_cutedsl(
                gathered,
                req,
                table,
                g,
                k,
                order=order,
                own_ids=own_r,
                out_slots=out[0],
                out_counts=out[1],
                validate=False,
                **tune,
            )
            if not _same(got, want, k):
                bad = (canonicalize(*got) != canonicalize(*want)).any(1)
                failures.append(
                    f"{(W, K, k, I, bs, tune)} rank {r}: {int(bad.sum())} rows differ, first {int(bad.nonzero()[0])}"
                )
            total += rows
    assert not failures, failures[:10]
    assert total >= 5000


@pytest.mark.gpu
def test_cutedsl_validated_call_matches_and_raises_like_the_reference(cuda_device):
    from dcp_ref.kernels.select_to_slots_cutedsl import select_to_slots_cutedsl

    pairs, scores, own, req, table = make_gpu_case(4, 256, 64, 2, 8, 7, cuda_device, poison=False)
    g = DcpGeometry(4, 3, 2, 8)
    for order, gathered, o in (("global_id", pairs, None), ("rank_local", scores, own[3].contiguous())):
        want = select_to_slots(gathered, req, table, g, 256, order=order, own_ids=o)
        assert _same(select_to_slots_cutedsl(gathered, req, table, g, 256, order=order, own_ids=o), want, 256)
        # strided request ids and block table (views, no copy) give the same answer
        req2 = torch.stack([req, req], 1)[:, 0]
        wide = torch.zeros(table.shape[0], 2 * table.shape[1] + 1, dtype=table.dtype, device=cuda_device)
        wide[:, 1::2] = table
        assert _same(select_to_slots_cutedsl(gathered, req2, wide[:, 1::2], g, 256, order=order, own_ids=o), want, 256)
        for ffi in (False, True):
            if ffi:
                pytest.importorskip("tvm_ffi")
            got = select_to_slots_cutedsl(
                gathered, req, table, g, 256, order=order, own_ids=o, tvm_ffi=ffi, validate=False
            )
            assert _same(got, want, 256)
    bad = req.clone()
    bad[5] = table.shape[0]
    for fn in (select_to_slots, select_to_slots_cutedsl):
        with pytest.raises(ValueError, match=r"^req_of_token values must be in"):
            fn(pairs, bad, table, g, 256)


@pytest.mark.gpu
def test_cutedsl_validated_call_is_one_check_launch_and_one_read_at_step_shapes(cuda_device):
    """At the step's shapes (K = k = 2048; W = 2 and 8; 1 and 32 rows) the validated call is the unvalidated call's
    aten ops plus one host read (its checks run inside the select kernel, no aten op), raises no false alarm (nor
    would the check kernel: its table covers every candidate), answers the same; a planted duplicate id
    (global_id) or unsorted own ids (rank_local) raise the reference's message, and the flag is cleared after."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from dcp_ref.kernels import select_to_slots_cutedsl as mod
    from dcp_ref.kernels._util import check_flag

    def ops(fn):  # type: ignore[no-untyped-def]
        seen: list[str] = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                seen.append(func._schema.name)
                return func(*args, **(kwargs or {}))

        with Mode():
            fn()
        return seen

    K = 2048
    for W, rows in ((2, 1), (2, 32), (8, 32)):
        pairs, scores, own, req, table = make_gpu_case(W, K, rows, 1, 64, 13 + W, cuda_device, poison=False)
        g = DcpGeometry(W, W - 1, 1, 64)
        for order, gathered, o in (("global_id", pairs, None), ("rank_local", scores, own[W - 1].contiguous())):
            out_s = torch.empty(rows, K, dtype=torch.int32, device=cuda_device)
            out_n = torch.empty(rows, dtype=torch.int32, device=cuda_device)

            inputs = (gathered, req, table, g, K)
            opts = dict(order=order, own_ids=o, out_slots=out_s, out_counts=out_n)

            def call(v, inputs=inputs, opts=opts):  # type: ignore[no-untyped-def]
                return mod.select_to_slots_cutedsl(*inputs, **opts, validate=v)

            want = select_to_slots(gathered, req, table, g, K, order=order, own_ids=o, validate=False)
            call(True), call(False)  # compile both
            chk = mod.check_select_to_slots_values(gathered, req, table, g, order=order, own_ids=o)
            assert int(chk.item()) == 0, (W, rows, order)  # no false alarm
            plain, checked = ops(lambda: call(False)), ops(lambda: call(True))
            # A direct call makes its check flag (no module cache: the step's bound stage owns one per plan), then
            # the unvalidated launch sequence, then the one read.
            assert checked == ["aten::zeros", *plain, "aten::_local_scalar_dense"], (W, rows, order, checked, plain)
            assert _same(call(True), want, K)
            if order == "global_id":
                bad = gathered.clone()
                t = rows - 1
                ok = (bad[:, t, :, 1] >= 0).nonzero()
                (w1, c1), (w2, c2) = ok[0].tolist(), ok[-1].tolist()
                bad[w2, t, c2, 1] = bad[w1, t, c1, 1]
                args = (bad, req, table, g, K)
                kw: dict = {}
            else:
                bad_own = o.clone()
                t = rows - 1
                valid = (bad_own[t] >= 0).nonzero().flatten().tolist()
                bad_own[t, valid[0]], bad_own[t, valid[-1]] = o[t, valid[-1]], o[t, valid[0]]
                args = (gathered, req, table, g, K)
                kw = dict(order="rank_local", own_ids=bad_own)
            with pytest.raises(ValueError) as ref:
                select_to_slots(*args, **kw)
            with pytest.raises(ValueError) as ker:
                mod.select_to_slots_cutedsl(*args, **kw)
            assert str(ker.value) == str(ref.value)
            assert int(check_flag(cuda_device).item()) == 0


def _refusal(fn, *args, **kw) -> str | None:  # type: ignore[no-untyped-def]
    """The ValueError message of ``fn(*args, **kw)``, or ``None`` when it returns."""
    try:
        fn(*args, **kw)
    except ValueError as e:
        return str(e)
    return None


def _in_kernel_flag(gathered, req, table, g, k, order, own) -> tuple[int, bool]:  # type: ignore[no-untyped-def]
    """``(flag, checked)``: the select kernel's own value checks (``check=True``) on these inputs, read once."""
    from dcp_ref.kernels import select_to_slots_cutedsl as mod
    from dcp_ref.kernels._util import check_flag

    spec = check_select_to_slots_inputs(gathered, req, table, g, k, order=order, own_ids=own, validate=False)
    chk = check_flag(gathered.device)
    *_, checked = mod._select(
        gathered, req, table, g, spec, order=order, own_ids=own, out_slots=None, out_counts=None, tvm_ffi=None,
        variant=None, config=None, first_bits=None, vec=None, split=None, flag=chk,
    )  # fmt: skip
    raised = int(chk.item())
    chk.zero_()
    return raised, checked


def _plant(name: str, pairs: torch.Tensor, own: torch.Tensor, W: int, K: int) -> None:
    """One fault in the last row, in place: far apart in the row (different warps)."""
    vp = (pairs[:, -1, :, 1] >= 0).nonzero().tolist()
    vo = (own[-1] >= 0).nonzero().flatten().tolist()
    if name == "dup":  # the last valid id repeats the first
        pairs[vp[-1][0], -1, vp[-1][1], 1] = pairs[vp[0][0], -1, vp[0][1], 1]
    elif name == "frac":
        pairs[0, -1, K - 1, 1] = 3.5
    elif name == "big":
        pairs[W - 1, -1, 7, 1] = 2.0**24
    elif name == "swap":  # two valid own ids far apart change places
        own[-1, vo[3]], own[-1, vo[-3]] = int(own[-1, vo[-3]]), int(own[-1, vo[3]])
    elif name == "repeat":
        own[-1, vo[900]] = own[-1, vo[899]]
    elif name == "mid_pad":  # a real score loses its index
        own[-1, vo[1000]] = -1


@pytest.mark.gpu
def test_cutedsl_in_kernel_checks_are_exactly_the_references(cuda_device):
    """The validated call's value checks inside the select kernel (``check=True``: ids, duplicate ids through the
    CTA's hash table, ``own_ids`` by a block-wide max scan, request ids, every winner's block) raise the flag
    exactly where the reference's validated call refuses — no miss and no false alarm, over every mutation of
    ``MUTATIONS`` on small random cases (own ids with padding in the middle, ties, NaN / -inf) and planted
    faults in step-sized rows (K = 2048, across warps); the validated call then raises the reference's message,
    or returns its answer."""
    from dcp_ref.kernels.select_to_slots_cutedsl import select_to_slots_cutedsl

    dev = torch.device(cuda_device)
    rng = random.Random(11)
    seen = {order: set() for order in MUTATIONS}
    cases = 0
    # a few compiled shapes (W, I, K, k; each a CuTeDSL compile), every mutation on each
    shapes = ((1, 1, 5, 3), (2, 2, 16, 17), (3, 1, 40, 60), (4, 2, 7, 12))
    for it in range(240):
        order = ("global_id", "rank_local")[it % 2]
        how = MUTATIONS[order][(it // 2) % len(MUTATIONS[order])]
        W, I, K, k = shapes[(it // 22) % len(shapes)]
        T, rank = rng.randint(1, 3), rng.randrange(W)
        case = random_case(rng, W, I, 2 * I, K, T, flavour=rng.choice(["randn", "ties", "nan"]), n_blocks=8)
        if it % 5 == 0:
            case.req = None
        g = DcpGeometry(W, rank, I, 2 * I)
        gathered, req, table, own = (
            None if t is None else t.to(dev) for t in _mutated(case, order, rank, how, rng)
        )  # fmt: skip
        want = _refusal(select_to_slots, gathered, req, table, g, k, order=order, own_ids=own)
        flag, checked = _in_kernel_flag(gathered, req, table, g, k, order, own)
        assert checked
        assert flag == (want is not None), (order, how, want)
        got = _refusal(select_to_slots_cutedsl, gathered, req, table, g, k, order=order, own_ids=own)
        assert got == want, (order, how)
        if want is None:
            ref = select_to_slots(gathered, req, table, g, k, order=order, own_ids=own)
            assert _same(select_to_slots_cutedsl(gathered, req, table, g, k, order=order, own_ids=own), ref, k)
        seen[order].add((how, want is not None))
        cases += 1
    # both outcomes seen for the mutations that may or may not refuse, refusals for every other one
    for order, muts in MUTATIONS.items():
        assert {h for h, refused in seen[order] if refused} >= set(muts) - {"none", "nan", "hole", "huge", "short"}
    # Step-sized rows: one planted fault per call, in the last row, far apart in the row (different warps).
    K, rows = 2048, 3  # the last row of make_gpu_case's flavours 0-2 has no padding
    for W in (2, 8):
        pairs, scores, own_all, req, table = make_gpu_case(W, K, rows, 1, 64, 40 + W, cuda_device, poison=False)
        g = DcpGeometry(W, W - 1, 1, 64)
        own = own_all[W - 1].contiguous()
        plants = {"global_id": ("none", "dup", "frac", "big"), "rank_local": ("none", "swap", "repeat", "mid_pad")}
        for order, muts in plants.items():
            for name in muts:
                gp, op = pairs.clone(), own.clone()
                _plant(name, gp, op, W, K)
                gathered = gp if order == "global_id" else scores
                o = None if order == "global_id" else op
                want = _refusal(select_to_slots, gathered, req, table, g, K, order=order, own_ids=o)
                assert (want is None) == (name == "none"), (W, order, name, want)
                flag, checked = _in_kernel_flag(gathered, req, table, g, K, order, o)
                assert checked and flag == (want is not None), (W, order, name)
                assert _refusal(select_to_slots_cutedsl, gathered, req, table, g, K, order=order, own_ids=o) == want
                cases += 1
    assert cases == 256


@pytest.mark.gpu
def test_cutedsl_validated_call_falls_back_to_the_check_kernel(cuda_device, monkeypatch):
    """Where the select kernel cannot check (a hash table of 2 * W*K entries beyond one CTA's shared memory:
    W = 8, K = 4096; or a cluster split the caller forces) the validated call runs the check kernel, with the
    same answers and the same refusals; at the step's shapes it never launches the check kernel."""
    from dcp_ref.kernels import select_to_slots_cutedsl as mod

    launches = []
    real = mod.select_check_kernel

    class Counting:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(mod, "select_check_kernel", Counting())
    for W, K, rows, split, fallback in ((8, 4096, 2, None, True), (2, 2048, 3, 2, True), (8, 2048, 3, None, False)):
        pairs, *_, req, table = make_gpu_case(W, K, rows, 1, 64, 60 + W, cuda_device, poison=False)
        g = DcpGeometry(W, 1, 1, 64)
        launches.clear()
        want = select_to_slots(pairs, req, table, g, K)
        assert _same(mod.select_to_slots_cutedsl(pairs, req, table, g, K, split=split), want, K)
        assert bool(launches) == fallback, (W, K, split)
        bad = pairs.clone()
        ok = (bad[:, -1, :, 1] >= 0).nonzero().tolist()
        bad[ok[-1][0], -1, ok[-1][1], 1] = bad[ok[0][0], -1, ok[0][1], 1]
        want_msg = _refusal(select_to_slots, bad, req, table, g, K)
        assert want_msg and "twice" in want_msg
        assert _refusal(mod.select_to_slots_cutedsl, bad, req, table, g, K, split=split) == want_msg
        assert int(mod.check_flag(torch.device(cuda_device)).item()) == 0


def _indexer_rows(W: int, I: int, K: int, rows: int, counts: list[int], seed: int) -> torch.Tensor:
    """``[W, rows, K, 2]`` pairs as the indexer packs them: rank ``w``'s first ``counts[t]`` candidates of row ``t``
    are ids it owns, strictly ascending, then ``(-inf, -1)`` padding (the layout the in-kernel check's
    no-duplicates rule recognises, so that such a row needs no hash table)."""
    gen = torch.Generator().manual_seed(seed)
    pairs = torch.empty(W, rows, K, 2)
    pairs[..., 0], pairs[..., 1] = -math.inf, -1.0
    for w in range(W):
        for t in range(rows):
            n = counts[t]
            loc = torch.sort(torch.randperm(4 * K, generator=gen)[:n]).values
            pairs[w, t, :n, 0] = torch.randn(n, generator=gen)
            pairs[w, t, :n, 1] = ((loc // I) * (W * I) + w * I + loc % I).float()
    return pairs


@pytest.mark.gpu
def test_cutedsl_no_duplicates_rule_and_hash_agree_with_the_reference(cuda_device):
    """The checked select kernel spares the hash table only for rows laid out as the indexer packs them (ids owned
    by their slice's rank, strictly ascending, padding after); every other row goes through it. Both sides of that
    decision, at K = 2048 (W = 2, 8) and a small K: the flag is raised exactly where the reference refuses —
    distinct ids out of order, out of their owner's slice or after padding are no duplicates (no flag); a
    duplicate across ranks or next to itself is (flag, the reference's message)."""
    from dcp_ref.kernels.select_to_slots_cutedsl import select_to_slots_cutedsl

    for W, I, K, rows in ((2, 1, 2048, 3), (8, 2, 2048, 2), (3, 2, 64, 4)):
        counts = [K, K // 2 + 1, 0, 5][:rows]
        base = _indexer_rows(W, I, K, rows, counts, 70 + W)
        g = DcpGeometry(W, 1, I, 64)
        n_blocks = 4 * K * W // 64 + 2
        loc = 4 * K + 1  # rank 1's, beyond every local index of the rows: an id of no other candidate
        foreign = float((loc // I) * (W * I) + 1 * I + loc % I)
        table = torch.randperm(4 * rows * n_blocks)[: rows * n_blocks].view(rows, n_blocks).to(torch.int32)
        muts: dict[str, Callable[[torch.Tensor], None]] = {
            "indexer layout": lambda p: None,
            "out of order": lambda p: p[1, 0, :2].copy_(p[1, 0, :2].flip(0)),
            "padding in the middle": lambda p: p[0, 1, 1].copy_(torch.tensor([-math.inf, -1.0])),
            "another rank's id": lambda p, f=foreign: p[0, 0, 0, 1].fill_(f),
            "twice across ranks": lambda p: p[1, 0, 3, 1].copy_(p[0, 0, 5, 1]),
            "twice in a slice": lambda p: p[0, 0, 4, 1].copy_(p[0, 0, 3, 1]),
        }
        for name, mut in muts.items():
            pairs = base.clone()
            mut(pairs)
            pairs = pairs.to(cuda_device)
            t, gd = table.to(cuda_device), g
            want = _refusal(select_to_slots, pairs, None, t, gd, K)
            assert (want is not None) == name.startswith("twice"), (W, K, name, want)
            flag, checked = _in_kernel_flag(pairs, None, t, gd, K, "global_id", None)
            assert checked and flag == (want is not None), (W, K, name)
            assert _refusal(select_to_slots_cutedsl, pairs, None, t, gd, K) == want, (W, K, name)
            if want is None:
                got = select_to_slots_cutedsl(pairs, None, t, gd, K)
                assert _same(got, select_to_slots(pairs, None, t, gd, K), K), (W, K, name)


@pytest.mark.gpu
def test_check_flag_is_one_per_call_and_raw_stream_is_the_handle(cuda_device):
    """``raw_stream`` (one C call) is the handle ``torch.cuda.current_stream`` names, on the default stream and a
    side stream, for ``cuda`` and ``cuda:N``; ``check_flag`` gives every call a fresh zeroed flag (no cache: no
    two calls, streams or threads ever share one)."""
    from dcp_ref.kernels._util import check_flag, raw_stream

    dev = torch.device(cuda_device)
    indexed = torch.device("cuda", torch.cuda.current_device())
    main = check_flag(dev)
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        assert raw_stream(dev) == raw_stream(indexed) == side.cuda_stream
        assert check_flag(dev) is not main
    assert raw_stream(dev) == torch.cuda.current_stream(dev).cuda_stream
    assert check_flag(dev) is not main and int(main.item()) == 0 and main.dtype == torch.int64
    assert raw_stream(torch.device("cpu")) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["global_id", "rank_local"])
def test_cutedsl_cuda_graph_capture_and_replay(cuda_device, order):
    from dcp_ref.kernels.select_to_slots_cutedsl import select_to_slots_cutedsl

    W, K, rows, k, rank = 8, 2048, 32, 2048, 5
    g = DcpGeometry(W, rank, 1, 64)
    pairs, scores, own, req, table = make_gpu_case(W, K, rows, 1, 64, 1, cuda_device, poison=True)
    s_in = pairs if order == "global_id" else scores
    s_own = own[rank].contiguous()
    s_req, s_table = req.clone(), table.clone()
    out_s = torch.empty((rows, k), dtype=torch.int32, device=cuda_device)
    out_n = torch.empty((rows,), dtype=torch.int32, device=cuda_device)

    def call():
        select_to_slots_cutedsl(
            s_in,
            s_req,
            s_table,
            g,
            k,
            order=order,
            own_ids=None if order == "global_id" else s_own,
            out_slots=out_s,
            out_counts=out_n,
            validate=False,
        )

    call()  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed in (11, 12, 13):
        p2, sc2, own2, req2, tab2 = make_gpu_case(W, K, rows, 1, 64, seed, cuda_device, poison=True)
        s_in.copy_(p2 if order == "global_id" else sc2)
        s_own.copy_(own2[rank])
        s_req.copy_(req2)
        s_table.copy_(tab2)
        out_s.fill_(12345)
        out_n.fill_(777)
        graph.replay()
        torch.cuda.synchronize()
        want = select_to_slots(
            s_in, s_req, s_table, g, k, order=order, own_ids=None if order == "global_id" else s_own, validate=False
        )
        assert _same((out_s, out_n), want, k)
