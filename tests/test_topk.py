"""Pack + select tests: packing, the stable key, stable top-K, the cross-rank merge, kernels.

Every check compares against an independent brute force written here with Python floats and
``sorted`` — never against numbers taken from the code under test.
"""

from __future__ import annotations

import logging
import math
import os
import random
import re
import struct
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_ref.geometry import DcpGeometry
from dcp_ref.group import SimulatedWorld, SingleGroup
from dcp_ref.topk import (
    INVALID_KEY,
    MAX_EXACT_ID,
    global_topk_all_logits,
    local_topk_by_owner,
    merge_topk_global,
    pack_candidates,
    radix_select_trace,
    sparse_attention_reference,
    stable_key,
    stable_topk,
    union_counterexample,
    unsigned_key,
)

HAS_CUDA = torch.cuda.is_available()

# ---------------------------------------------------------------------------------------------
# Independent brute force
# ---------------------------------------------------------------------------------------------


def f32(x: float) -> float:
    """Round a Python float to float32 (what the packed tensor holds)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def brute_topk(cands: list[tuple[float, float]], k: int) -> list[int]:
    """Score descending, then id ascending; id -1 or NaN score invalid; -0.0 == +0.0."""
    valid = [(s, int(i)) for s, i in cands if not math.isnan(i) and i >= 0 and not math.isnan(s)]
    valid.sort(key=lambda t: (-t[0], t[1]))
    ids = [i for _, i in valid[:k]]
    return ids + [-1] * (k - len(ids))


def rows_of(gathered: torch.Tensor) -> list[list[tuple[float, float]]]:
    """Candidates per row, in rank order, as Python tuples (works for 3-D and 4-D inputs)."""
    g = gathered.detach().cpu()
    if g.ndim == 4:
        w, rows, K, _ = g.shape
        return [
            [(float(g[r_, rr, c, 0]), float(g[r_, rr, c, 1])) for r_ in range(w) for c in range(K)]
            for rr in range(rows)
        ]
    return [[(float(s), float(i)) for s, i in row.tolist()] for row in g]


def owner(p: int, w: int, i: int) -> int:
    return (p // i) % w


def local_index(p: int, w: int, i: int) -> int:
    return (p // (w * i)) * i + p % i


def random_candidates(rng: random.Random, rows: int, n: int, *, ties: bool, p_invalid: float) -> torch.Tensor:
    """float32 [rows, n, 2] with distinct ids per row, some invalid, optional heavy ties."""
    data = []
    for _ in range(rows):
        ids = rng.sample(range(4 * n + 8), n)
        row = []
        for i in ids:
            if rng.random() < p_invalid:
                row.append((float("-inf"), -1.0))
            else:
                s = float(rng.choice([0.0, -0.0, 1.0, -1.0, 2.5])) if ties else rng.gauss(0, 1)
                row.append((s, float(i)))
        data.append(row)
    return torch.tensor(data, dtype=torch.float32).reshape(rows, n, 2)


# ---------------------------------------------------------------------------------------------
# stable_key
# ---------------------------------------------------------------------------------------------

SPECIAL = [0.0, -0.0, 1.0, -1.0, 1e-38, -1e-38, 1e-45, -1e-45, 3.4e38, -3.4e38, math.inf, -math.inf, 0.5, -0.5, 2.0]


def test_stable_key_orders_like_the_brute_force():
    rng = random.Random(0)
    scores = SPECIAL + [rng.gauss(0, 10) for _ in range(60)]
    pairs = [(f32(s), i) for s in scores for i in (0, 1, 7, MAX_EXACT_ID - 1)]
    s = torch.tensor([p[0] for p in pairs], dtype=torch.float32)
    ids = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
    key = stable_key(s, ids).tolist()
    for a in range(len(pairs)):
        for b in range(0, len(pairs), 7):
            (sa, ia), (sb, ib) = pairs[a], pairs[b]
            want = (-sa, ia) < (-sb, ib)  # a ranks before b
            assert (key[a] > key[b]) == want, (pairs[a], pairs[b])


def test_stable_key_policies_zero_nan_invalid():
    s = torch.tensor([0.0, -0.0, float("nan"), 1.0, float("-inf"), -float("nan")])
    ids = torch.tensor([5, 5, 3, -1, 9, 2])
    key = stable_key(s, ids).tolist()
    assert key[0] == key[1]  # -0.0 and +0.0: the same key for the same id
    assert key[2] == INVALID_KEY and key[5] == INVALID_KEY  # NaN score -> invalid
    assert key[3] == INVALID_KEY  # id -1 -> invalid, whatever the score
    assert key[4] > INVALID_KEY  # -inf with a real id is valid (just very low)
    # -0.0 with a lower id beats +0.0 with a higher id: zeros tie, the id decides.
    assert (
        stable_key(torch.tensor([-0.0]), torch.tensor([1])).item()
        > stable_key(torch.tensor([0.0]), torch.tensor([2])).item()
    )
    assert unsigned_key(torch.tensor([INVALID_KEY])) == [0]


def test_stable_key_errors():
    with pytest.raises(TypeError, match="scores"):
        stable_key(torch.tensor([1, 2]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="ids must have the shape"):
        stable_key(torch.tensor([1.0, 2.0]), torch.tensor([1]))


# ---------------------------------------------------------------------------------------------
# stable_topk
# ---------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    rows=st.integers(1, 4),
    n=st.integers(0, 40),
    k=st.integers(1, 50),
    ties=st.booleans(),
    p_invalid=st.sampled_from([0.0, 0.3, 1.0]),
)
def test_stable_topk_matches_brute_force(seed, rows, n, k, ties, p_invalid):
    g = random_candidates(random.Random(seed), rows, n, ties=ties, p_invalid=p_invalid)
    got = stable_topk(g, k, sorted=True)
    assert got.dtype == torch.int32 and tuple(got.shape) == (rows, k)
    want = [brute_topk(r, k) for r in rows_of(g)]
    assert got.tolist() == want
    unsorted = stable_topk(g, k, sorted=False)
    assert [sorted(r) for r in unsorted.tolist()] == [sorted(r) for r in want]


def test_stable_topk_accepts_allgather_layout():
    rng = random.Random(3)
    w, rows, K = 3, 2, 5
    per_rank = [random_candidates(rng, rows, K, ties=True, p_invalid=0.2) for _ in range(w)]
    for r_, c in enumerate(per_rank):  # ranks own disjoint keys: give each rank its own id range
        c[..., 1] = torch.where(c[..., 1] >= 0, c[..., 1] * w + r_, c[..., 1])
    gathered = torch.stack(per_rank)  # [W, rows, K, 2]
    got = stable_topk(gathered, 6, sorted=True).tolist()
    want = [brute_topk([c for r_ in range(w) for c in rows_of(per_rank[r_])[row]], 6) for row in range(rows)]
    assert got == want


def test_stable_topk_nan_and_signed_zero_policy():
    g = torch.tensor([[[0.0, 4.0], [-0.0, 2.0], [float("nan"), 1.0], [0.0, 3.0], [-1.0, 0.0]]])
    # NaN is invalid; the three zeros tie and come by id: 2 (the -0.0), 3, 4; then -1.0 (id 0).
    assert stable_topk(g, 5, sorted=True).tolist() == [[2, 3, 4, 0, -1]]


@pytest.mark.parametrize(
    "bad, k, err, msg",
    [
        (torch.zeros(2, 3, 2, dtype=torch.float64), 1, TypeError, "gathered must have dtype"),
        (torch.zeros(2, 3, 3), 1, ValueError, "size 2"),
        (torch.zeros(3, 2), 1, ValueError, "gathered must be 3-D or 4-D"),
        (torch.zeros(1, 3, 2), 0, ValueError, "k must be >= 1"),
        (torch.tensor([[[1.0, 2.5]]]), 1, ValueError, "ids"),
        (torch.tensor([[[1.0, float(MAX_EXACT_ID)]]]), 1, ValueError, "ids"),
        (torch.tensor([[[1.0, -2.0]]]), 1, ValueError, "ids"),
    ],
)
def test_stable_topk_errors(bad, k, err, msg):
    with pytest.raises(err, match=msg):
        stable_topk(bad, k)


# ---------------------------------------------------------------------------------------------
# radix select spec
# ---------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 60), k=st.integers(1, 70), ties=st.booleans())
def test_radix_select_trace_matches_sort(seed, n, k, ties):
    g = random_candidates(random.Random(seed), 1, n, ties=ties, p_invalid=0.2)
    keys = unsigned_key(stable_key(g[0, :, 0], g[0, :, 1]))
    wins, passes = radix_select_trace(keys, k)
    ids = [int(g[0, i, 1]) for i in wins]
    assert ids + [-1] * (k - len(ids)) == brute_topk(rows_of(g)[0], k)
    for p in passes:
        assert p.above < p.above + p.need_after <= p.above + p.hist[p.chosen]


# ---------------------------------------------------------------------------------------------
# pack_candidates
# ---------------------------------------------------------------------------------------------


def brute_pack(logits, topk, w, rank, i, starts):
    out = []
    for r, row in enumerate(topk.tolist()):
        res = []
        for j in row:
            if j < 0:
                res.append([-math.inf, -1.0])
            else:
                g = (j // i) * (w * i) + rank * i + j % i
                res.append([f32(float(logits[r, starts[r] + j])), float(g)])
        out.append(res)
    return out


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    w=st.integers(1, 5),
    i=st.integers(1, 4),
    rows=st.integers(1, 4),
    K=st.integers(1, 9),
    with_starts=st.booleans(),
)
def test_pack_candidates_matches_brute_force(seed, w, i, rows, K, with_starts):
    rng = random.Random(seed)
    cols = 12
    rank = rng.randrange(w)
    logits = torch.tensor([[rng.gauss(0, 1) for _ in range(cols)] for _ in range(rows)], dtype=torch.float32)
    starts = [rng.randrange(0, 5) if with_starts else 0 for _ in range(rows)]
    topk = torch.tensor([[rng.randrange(-1, cols - starts[r]) for _ in range(K)] for r in range(rows)])
    got = pack_candidates(logits, topk, DcpGeometry(w, rank, i, i), torch.tensor(starts) if with_starts else None)
    assert got.dtype == torch.float32 and tuple(got.shape) == (rows, K, 2)
    assert got.tolist() == brute_pack(logits, topk, w, rank, i, starts)


def test_pack_candidates_errors():
    logits = torch.zeros(2, 8)
    topk = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"^geometry must be a dcp_ref\.geometry\.DcpGeometry"):
        pack_candidates(logits, topk, (2, 0))  # loose ints are not a geometry
    with pytest.raises(TypeError, match=r"^geometry"):
        pack_candidates(logits, topk, 0, 2)  # the old signature (rank, world_size) raises, never packs
    with pytest.raises(TypeError, match="local_topk"):
        pack_candidates(logits, topk.float(), DcpGeometry(2, 0))
    with pytest.raises(ValueError, match="row count"):
        pack_candidates(logits, topk[:1], DcpGeometry(2, 0))
    with pytest.raises(ValueError, match=r"logits\.shape"):
        pack_candidates(logits, torch.full((2, 3), 8), DcpGeometry(2, 0))
    with pytest.raises(ValueError, match="-1 or >= 0"):
        pack_candidates(logits, torch.full((2, 3), -2), DcpGeometry(2, 0))
    with pytest.raises(ValueError, match="row_starts"):
        pack_candidates(logits, topk, DcpGeometry(2, 0), row_starts=torch.tensor([0]))
    # A global id of 2**24 cannot be represented exactly in float32.
    big = torch.zeros(1, (1 << 23) + 1, dtype=torch.float16)
    with pytest.raises(ValueError, match="2\\*\\*24"):
        pack_candidates(big, torch.tensor([[1 << 23]]), DcpGeometry(2, 0))


# ---------------------------------------------------------------------------------------------
# The merge across ranks and the exactness argument
# ---------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    w=st.integers(1, 4),
    i=st.integers(1, 3),
    L=st.integers(1, 40),
    k=st.integers(1, 8),
    extra=st.integers(0, 3),
    ties=st.booleans(),
)
def test_merge_equals_gathering_all_logits(seed, w, i, L, k, extra, ties):
    """Exchanging W*K candidates (K >= k) selects exactly the global top-k of all logits."""
    rng = random.Random(seed)
    rows = 2
    scores = torch.tensor(
        [[float(rng.choice([0.0, 1.0, 2.0])) if ties else rng.gauss(0, 1) for _ in range(L)] for _ in range(rows)]
    )
    K = k + extra
    logits_r, topk_r = local_topk_by_owner(scores, K, w, i)
    world = SimulatedWorld(w)
    res = world.run(lambda g, lg, tk: merge_topk_global(g, lg, tk, k, interleave=i, sorted=True), logits_r, topk_r)
    want = [brute_topk([(f32(float(scores[r, p])), p) for p in range(L)], k) for r in range(rows)]
    for got in res:  # every rank picks the identical set
        assert got.tolist() == want
    # The property behind it: the global top-k is inside the union of the owners' local top-Ks.
    union = set()
    for r_, tk in enumerate(topk_r):
        for row in range(rows):
            union |= {(row, (j // i) * (w * i) + r_ * i + j % i) for j in tk[row].tolist() if j >= 0}
    assert all((row, p) in union for row in range(rows) for p in want[row] if p >= 0)
    assert global_topk_all_logits(scores, k).tolist() == want


def test_merge_single_rank_is_a_no_op():
    logits = torch.tensor([[0.3, 0.9, 0.1, 0.5]])
    local = torch.tensor([[1, 3]])
    got = merge_topk_global(SingleGroup(), logits, local, 2)
    assert got.dtype == torch.int32 and got.tolist() == [[1, 3]]
    assert merge_topk_global(None, logits, local, 2).tolist() == [[1, 3]]
    # With sorted=True / a different k it goes through the selection and agrees with the brute force.
    assert merge_topk_global(None, logits, local, 1, sorted=True).tolist() == [[1]]


def test_union_of_local_topk_is_wrong_counterexample():
    ex = union_counterexample()
    L = ex.keys.shape[0]
    scores = [float(ex.q[0] @ ex.keys[p]) for p in range(L)]
    # The right answer: the global top-2 ({0, 2}), both values 0.
    right = brute_topk([(s, p) for p, s in enumerate(scores)], ex.k)
    assert sorted(right) == [0, 2]
    got = sparse_attention_reference(ex.q, ex.keys, ex.values, torch.tensor([right]))
    assert abs(float(got[0, 0])) < 1e-12
    # Each rank's local top-2 is all of its keys, so the union is every key.
    union = []
    for r in range(ex.world_size):
        mine = [(scores[p], p) for p in range(L) if owner(p, ex.world_size, 1) == r]
        union += brute_topk(mine, ex.k)
    assert sorted(union) == [0, 1, 2, 3]
    wrong = sparse_attention_reference(ex.q, ex.keys, ex.values, torch.tensor([union]))
    e = [math.exp(s) for s in scores]
    want = 1000.0 * (e[1] + e[3]) / sum(e)
    assert abs(float(wrong[0, 0]) - want) < 1e-9 and 470 < want < 480


# ---------------------------------------------------------------------------------------------
# Kernel selection: one way to pick kernels, the stage providers (dcp_ref.kernels.stages)
# ---------------------------------------------------------------------------------------------


def _cpu_spec(device):
    """A one-rank spec for the kernels' stage provider on ``device`` (float32, DeepSeek's widths)."""
    from dcp_ref.stages import StepSpec

    return StepSpec(DcpGeometry(1, 0, 1, 64), max_tokens=1, topk=64, num_heads=1, head_dim=576, v_dim=512,
                    sm_scale=0.1, dtype=torch.float32, device=device)  # fmt: skip


def test_kernel_select_stage_falls_back_on_cpu_and_logs(caplog):
    """On the CPU the kernels' select stage is the reference, the reason logged once and kept in the notes."""
    from dcp_ref.kernels import stages as ks

    ks._log_fallback.cache_clear()
    g = random_candidates(random.Random(1), 2, 9, ties=True, p_invalid=0.2)
    with caplog.at_level(logging.WARNING, logger="dcp_ref.kernels.stages"):
        st_ = ks.kernel_stages(_cpu_spec(g.device))
    assert st_.impls()["select"] == "torch" and "cpu" in dict(st_.notes)["select"]
    assert any("'select' runs the torch reference" in r.getMessage() for r in caplog.records)
    got = st_.select(g, 4)  # the stage protocol: the winners in any order
    assert [sorted(r) for r in got.tolist()] == [sorted(brute_topk(r, 4)) for r in rows_of(g)]


def test_kernel_select_stage_past_the_cutedsl_limit_runs_the_reference(caplog):
    """More gathered candidates per row than the CuTeDSL top-K holds (a shape, no host read): the reference, logged.
    Called on the CPU, where the fallback is decided before any launch."""
    pytest.importorskip("cutlass")
    from dcp_ref.kernels import stages as ks
    from dcp_ref.kernels.topk_cutedsl import MAX_CANDIDATES

    ks._log_fallback.cache_clear()
    w, kloc = 2, MAX_CANDIDATES // 2 + 1
    g = torch.zeros(w, 1, kloc, 2)
    g[..., 1] = -1.0
    g[1, 0, 3] = torch.tensor([2.0, 7.0])  # one valid candidate: id 7
    g[0, 0, 5] = torch.tensor([1.0, 4.0])  # and id 4, lower score
    with caplog.at_level(logging.WARNING, logger="dcp_ref.kernels.stages"):
        got = ks._select_cutedsl(g, 3)
    assert got.tolist() == [[7, 4, -1]]
    assert any(f"{w * kloc} gathered candidates per row > {MAX_CANDIDATES}" in r.getMessage() for r in caplog.records)
    assert ks._select_too_big(w, MAX_CANDIDATES // w) == ""


def test_kernel_indexer_and_select_stages_give_the_global_topk_on_cpu():
    """The kernels' indexer stage (Triton under the interpreter: local top-K + pack) and select stage on three
    simulated ranks: every rank gets exactly the global top-k of all logits."""
    pytest.importorskip("triton")
    from dcp_ref.kernels.stages import kernel_stages

    st_ = kernel_stages(_cpu_spec("cpu"))
    scores = torch.randn(3, 30, generator=torch.Generator().manual_seed(5))
    logits_r, _ = local_topk_by_owner(scores, 5, 3, 2)

    def rank(g, lg):
        packed = st_.indexer(
            lg, torch.full((lg.shape[0],), lg.shape[1], dtype=torch.int32), DcpGeometry(3, g.rank, 2, 2), 5
        )
        return st_.select(g.all_gather(packed), 4)

    want = [sorted(r) for r in global_topk_all_logits(scores, 4).tolist()]
    for res in SimulatedWorld(3).run(rank, logits_r):
        assert [sorted(r) for r in res.tolist()] == want


# ---------------------------------------------------------------------------------------------
# Triton pack kernel (interpreter on CPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "w,i,K,dtype,starts",
    [(1, 1, 1, torch.float32, False), (4, 2, 37, torch.bfloat16, True), (3, 5, 300, torch.float16, False)],
)
def test_triton_pack_matches_reference(kernel_device, w, i, K, dtype, starts):
    pytest.importorskip("triton")
    from dcp_ref.kernels.pack_triton import pack_candidates_triton

    rng = random.Random(K)
    rows, cols = 3, 64
    logits = torch.randn(rows, cols, generator=torch.Generator().manual_seed(K)).to(dtype)
    rs = [rng.randrange(0, 8) if starts else 0 for _ in range(rows)]
    topk = torch.tensor([[rng.randrange(-1, cols - rs[r]) for _ in range(K)] for r in range(rows)], dtype=torch.int32)
    # A strided logits view: the kernel must honour strides.
    wide = torch.zeros(rows, 2 * cols, dtype=dtype)
    wide[:, ::2] = logits
    view = wide[:, ::2]
    got = pack_candidates_triton(
        view.to(kernel_device),
        topk.to(kernel_device),
        DcpGeometry(w, w - 1, i, i),
        row_starts=torch.tensor(rs).to(kernel_device) if starts else None,
    )
    assert got.cpu().tolist() == brute_pack(logits.float(), topk, w, w - 1, i, rs)


def test_triton_pack_errors_and_masking(kernel_device):
    pytest.importorskip("triton")
    from dcp_ref.kernels.pack_triton import pack_candidates_triton

    logits = torch.zeros(1, 4, device=kernel_device)
    with pytest.raises(ValueError, match=r"logits\.shape"):
        pack_candidates_triton(logits, torch.tensor([[4]], device=kernel_device), DcpGeometry(2, 0))
    with pytest.raises(ValueError, match="out must be"):
        pack_candidates_triton(
            logits,
            torch.tensor([[1]], device=kernel_device),
            DcpGeometry(2, 0),
            out=torch.empty(1, 2, 2, device=kernel_device),
        )
    # validate=False: an out-of-range index is masked (packed invalid), never read out of bounds.
    got = pack_candidates_triton(
        logits, torch.tensor([[4, 1]], device=kernel_device), DcpGeometry(2, 0), validate=False
    )
    assert got.cpu().tolist() == [[[-math.inf, -1.0], [0.0, 2.0]]]


# ---------------------------------------------------------------------------------------------
# CuTeDSL: compiles to sm_90a PTX on a CPU-only machine
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["regs", "lean"])
@pytest.mark.parametrize("world,kloc,k,sorted_", [(3, 7, 5, False), (2, 5, 4, True), (8, 2048, 2048, False)])
def test_cutedsl_compiles_to_sm90a_ptx(world, kloc, k, sorted_, variant):
    pytest.importorskip("cutlass")
    from dcp_ref.kernels.topk_cutedsl import compile_to_ptx, lean_config

    with tempfile.TemporaryDirectory() as d:
        ptx = compile_to_ptx(world, kloc, k, sorted_, d, variant=variant)
    assert re.search(r"^\.target sm_90a", ptx, re.M), ptx[:300]
    if variant == "lean":
        threads, min_ctas = lean_config(world * kloc, sorted_)
        assert f".reqntid {threads}, 1, 1" in ptx
        # The register cap that lets min_ctas CTAs share an SM (unsorted, <= 16 words per thread).
        assert (f".minnctapersm {min_ctas}" in ptx) == (min_ctas > 1) and min_ctas == (
            0 if sorted_ else 2048 // threads
        )
    assert ".entry" in ptx
    assert "shfl.sync.up" in ptx  # the warp-shuffle scan
    assert re.search(r"atom\.shared|red\.shared", ptx)  # shared-memory histogram / counters
    assert "bar.sync" in ptx
    assert ".local" not in ptx  # keys stay in registers


# ---------------------------------------------------------------------------------------------
# GPU: the CuTeDSL kernel against the reference (run with -m gpu on the H200)
# ---------------------------------------------------------------------------------------------

GPU_CONFIGS = [
    # (W, K, k, sorted, rows)
    (1, 1, 1, False, 200),
    (1, 7, 3, True, 400),
    (2, 5, 8, False, 400),
    (3, 33, 17, True, 500),
    (4, 100, 64, False, 500),
    (5, 129, 300, True, 500),
    (6, 257, 1000, False, 500),
    (7, 511, 2048, True, 500),
    (8, 512, 512, False, 500),
    (8, 2048, 2048, False, 400),
    (8, 2048, 2048, True, 300),
    (2, 2048, 4096, False, 300),
    (8, 4096, 4096, False, 200),
    (8, 1000, 1, True, 500),
    (3, 999, 4096, True, 300),
    (2, 2, 4096, False, 300),
    (4, 1023, 1023, False, 500),
    (8, 77, 100, True, 500),
    (1, 4096, 2000, False, 400),
    (6, 3, 7, True, 500),
    (5, 1537, 777, False, 500),
    (7, 64, 65, True, 500),
    (2, 9, 1, False, 500),
    (4, 4095, 4096, True, 300),
]


def make_gpu_cases(W: int, K: int, rows: int, seed: int, device: torch.device) -> torch.Tensor:
    """[W, rows, K, 2] all-gather layout; each row gets one of several adversarial flavours."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n = W * K
    flavour = torch.arange(rows) % 7
    scores = torch.randn(rows, n, generator=gen)
    few = torch.randint(0, 4, (rows, n), generator=gen).float()  # heavy ties
    scores = torch.where((flavour == 1).unsqueeze(1) | (flavour == 5).unsqueeze(1), few, scores)
    scores = torch.where(
        (flavour == 6).unsqueeze(1),
        torch.zeros_like(scores) * torch.where(torch.rand(rows, n, generator=gen) < 0.5, -1.0, 1.0),
        scores,
    )
    ids = torch.stack([torch.randperm(max(4 * n, 1), generator=gen)[:n] for _ in range(rows)]).float()
    p_inv = torch.tensor([0.0, 0.1, 1.0, 0.9, 0.0, 0.5, 0.0])[flavour].unsqueeze(1)
    inv = torch.rand(rows, n, generator=gen) < p_inv
    ids = torch.where(inv, -1.0, ids)
    scores = torch.where(inv, float("-inf"), scores)
    # flavour 4: a few NaN scores and -inf valid scores
    nan = (flavour == 4).unsqueeze(1) & (torch.rand(rows, n, generator=gen) < 0.05)
    ninf = (flavour == 4).unsqueeze(1) & (torch.rand(rows, n, generator=gen) < 0.05)
    scores = torch.where(nan, float("nan"), torch.where(ninf, float("-inf"), scores))
    packed = torch.stack([scores, ids], -1)  # [rows, n, 2]
    return packed.reshape(rows, W, K, 2).permute(1, 0, 2, 3).contiguous().to(device)


def gpu_tunings() -> list[dict]:
    """Kernel keyword arguments the differential test runs: the shape's default ({}), each
    variant, and the wider first digits. ``DCP_TOPK_TUNINGS="lean/8,regs/12"`` runs only those."""
    env = os.environ.get("DCP_TOPK_TUNINGS")
    if env:
        return [{"variant": v, "first_bits": int(fb)} for v, fb in (t.split("/")[:2] for t in env.split(","))]
    return [
        {},
        {"variant": "regs"},
        {"variant": "lean"},
        {"variant": "regs", "first_bits": 12},
        {"variant": "lean", "first_bits": 11},
    ]


@pytest.mark.gpu
def test_cutedsl_differential_10k_cases(cuda_device):
    """Every kernel tuning on every config (the same inputs), against the torch reference."""
    from dcp_ref.kernels.topk_cutedsl import stable_topk_cutedsl

    total = 0
    failures = []
    for c, (W, K, k, sorted_, rows) in enumerate(GPU_CONFIGS):
        g = make_gpu_cases(W, K, rows, 1000 + c, cuda_device)
        want = stable_topk(g, k, sorted=True)
        for tune in gpu_tunings():
            out = torch.full((rows, k), 12345, dtype=torch.int32, device=cuda_device)  # poison
            got = stable_topk_cutedsl(g, k, sorted=sorted_, out=out, **tune)
            if sorted_:
                bad = (got != want).any(1)
            else:
                bad = (torch.sort(got, 1).values != torch.sort(want, 1).values).any(1)
            nbad = int(bad.sum())
            if nbad:
                failures.append(f"{tune} {(W, K, k, sorted_)}: {nbad} mismatching rows, first {int(bad.nonzero()[0])}")
        total += rows
    assert not failures, failures
    assert total >= 10_000


@pytest.mark.gpu
def test_cutedsl_spot_check_against_brute_force(cuda_device):
    """A few small rows against the pure-Python brute force (not the torch reference)."""
    from dcp_ref.kernels.topk_cutedsl import stable_topk_cutedsl

    g = make_gpu_cases(3, 11, 14, 7, cuda_device)
    got = stable_topk_cutedsl(g, 9, sorted=True).cpu().tolist()
    assert got == [brute_topk(r, 9) for r in rows_of(g)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [None, "regs", "lean"])
@pytest.mark.parametrize("tvm_ffi", [False, True])
def test_cutedsl_cuda_graph_capture_and_replay(cuda_device, tvm_ffi, variant):
    from dcp_ref.kernels.topk_cutedsl import stable_topk_cutedsl

    if tvm_ffi:
        pytest.importorskip("tvm_ffi")
    W, K, rows, k = 4, 512, 64, 512
    static_in = make_gpu_cases(W, K, rows, 1, cuda_device)
    static_out = torch.empty((rows, k), dtype=torch.int32, device=cuda_device)
    for sorted_ in (False, True):
        # compile + warm up outside the capture
        stable_topk_cutedsl(static_in, k, sorted=sorted_, out=static_out, tvm_ffi=tvm_ffi, variant=variant)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # the hot path: no host value check (it would sync inside the capture)
            stable_topk_cutedsl(
                static_in, k, sorted=sorted_, out=static_out, tvm_ffi=tvm_ffi, variant=variant, validate=False
            )
        for seed in (11, 12, 13):
            static_in.copy_(make_gpu_cases(W, K, rows, seed, cuda_device))
            static_out.fill_(12345)
            graph.replay()
            torch.cuda.synchronize()
            want = stable_topk(static_in, k, sorted=True)
            if sorted_:
                assert torch.equal(static_out, want)
            else:
                assert torch.equal(torch.sort(static_out, 1).values, torch.sort(want, 1).values)


@pytest.mark.gpu
def test_triton_pack_on_gpu_and_kernel_select(cuda_device):
    from dcp_ref.kernels.pack_triton import pack_candidates_triton
    from dcp_ref.kernels.stages import kernel_stage_impls

    rows, cols, K = 16, 3000, 257
    logits = torch.randn(rows, cols, device=cuda_device, dtype=torch.bfloat16)
    topk = torch.randint(-1, cols, (rows, K), device=cuda_device, dtype=torch.int32)
    got = pack_candidates_triton(logits, topk, DcpGeometry(4, 2, 8, 8))
    assert torch.equal(got, pack_candidates(logits, topk, DcpGeometry(4, 2, 8, 8)))
    assert kernel_stage_impls(cuda_device, torch.bfloat16, 576, 512)["select"] == "cutedsl"


# ---------------------------------------------------------------------------------------------
# Notebook drawing helpers
# ---------------------------------------------------------------------------------------------


def test_radix_pass_text_and_figure():
    import matplotlib

    matplotlib.use("Agg")
    from dcp_ref.viz.topk import draw_radix_passes, radix_pass_text

    g = torch.tensor([[[1.0, 0.0], [0.5, 1.0], [0.5, 2.0], [-2.0, 3.0], [0.25, 4.0]]])
    keys = unsigned_key(stable_key(g[0, :, 0], g[0, :, 1]))
    wins, passes = radix_select_trace(keys, 2)
    assert [int(g[0, i, 1]) for i in wins] == brute_topk(rows_of(g)[0], 2) == [0, 1]
    txt = radix_pass_text(passes, 0, 2)
    # pass 1 digit = top byte: 1.0 -> 0xbf, 0.5/0.25 -> 0xbf/0xbe, -2.0 -> 0x3f (sign flipped away)
    assert "pass 1/" in txt and "bin 0xbf" in txt and "bin 0x3f" in txt and "k-th largest" in txt
    assert radix_pass_text(passes, 99, 2).startswith(f"pass {len(passes)}/")
    assert "no pass needed" in radix_pass_text([], 0, 5)
    fig = draw_radix_passes(passes)
    assert len(fig.axes) == len(passes)
    assert draw_radix_passes([]) is None
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_digit_schedule_covers_the_key_msb_first():
    pytest.importorskip("cutlass")
    from dcp_ref.kernels.topk_cutedsl import FIRST_BITS, digit_schedule

    for fb in FIRST_BITS:
        sched = digit_schedule(fb)
        # Every bit of the 64-bit key (score word, then id word) exactly once, most significant first.
        covered = []
        for word, shift, width in sched:
            covered += [(1 - word) * 32 + shift + b for b in range(width - 1, -1, -1)]
        assert covered == list(range(63, -1, -1)), (fb, sched)
        assert sched[0] == (0, 32 - fb, fb) and max(w for _, _, w in sched) == fb
    assert [w for _, _, w in digit_schedule(8)] == [8] * 8
    assert [w for _, _, w in digit_schedule(12)] == [12, 10, 10] * 2
    # >= 5 bits (32 bins) per digit: the scan hands bins to whole warps (an 11 + 10 + 10 + 1 split
    # once left a 2-bin digit that no warp scanned: caught by the GPU differential test).
    assert [w for _, _, w in digit_schedule(11)] == [11, 11, 10] * 2
    assert all(w >= 5 for fb in FIRST_BITS for _, _, w in digit_schedule(fb))


def test_cutedsl_wrapper_rejects_bad_input_without_a_gpu():
    pytest.importorskip("cutlass")
    from dcp_ref.kernels.topk_cutedsl import stable_topk_cutedsl, threads_for

    with pytest.raises(ValueError, match="CUDA"):
        stable_topk_cutedsl(torch.zeros(2, 3, 4, 2), 4)
    with pytest.raises(TypeError, match="gathered must have dtype"):
        stable_topk_cutedsl(torch.zeros(2, 3, 4, 2, dtype=torch.float16), 4)
    with pytest.raises(ValueError, match="size 2"):
        stable_topk_cutedsl(torch.zeros(2, 3, 4, 3), 4)
    with pytest.raises(ValueError, match="k must be >= 1"):
        stable_topk_cutedsl(torch.zeros(2, 3, 4, 2), 0)
    with pytest.raises(ValueError, match="W\\*K <= 32768"):
        stable_topk_cutedsl(torch.zeros(9, 1, 4096, 2), 4)
    with pytest.raises(ValueError, match="sorted=True supports"):
        stable_topk_cutedsl(torch.zeros(2, 1, 4096, 2), 5000, sorted=True)
    with pytest.raises(ValueError, match="variant must be one of"):
        stable_topk_cutedsl(torch.zeros(2, 1, 4, 2), 2, variant="fast")
    # CTA size: >= 256 threads (one per histogram bin), <= 1024, ~16 keys per thread.
    assert [threads_for(n) for n in (1, 4096, 4097, 16384, 32768)] == [256, 256, 512, 1024, 1024]
    from dcp_ref.kernels.topk_cutedsl import default_variant, lean_config

    # lean: a full SM of 32-register threads when <= 16 score words per thread and unsorted.
    assert [lean_config(n) for n in (1, 4096, 8192, 16384, 16385)] == [
        (256, 8),
        (256, 8),
        (512, 4),
        (1024, 2),
        (1024, 0),
    ]
    assert lean_config(16384, True) == (1024, 0)
    # Default (by measurement on the H200): lean for unsorted N <= 16384, else regs.
    assert [default_variant(w, 2048, 2048, False) for w in (1, 2, 4, 8)] == ["lean"] * 4
    assert default_variant(8, 2048, 2048, True) == "regs" and default_variant(8, 4096, 4096, False) == "regs"


def test_merge_topk_global_matches_all_logits_on_simulated_ranks():
    scores = torch.randn(3, 30, generator=torch.Generator().manual_seed(5))
    logits_r, topk_r = local_topk_by_owner(scores, 5, 3, 2)
    res = SimulatedWorld(3).run(
        lambda g, lg, tk: merge_topk_global(g, lg, tk, 4, interleave=2, sorted=True), logits_r, topk_r
    )
    assert all(r.tolist() == global_topk_all_logits(scores, 4).tolist() for r in res)
