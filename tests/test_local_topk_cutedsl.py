"""The CuTeDSL local top-K + pack (kernels/local_topk_cutedsl.py) against the reference indexer stage.

The oracle is ``pack_candidates(scores, local_topk(scores, k, lengths, row_starts), geometry, row_starts)``
(plain PyTorch, itself tested against a brute force in test_indexer.py), compared per row as a set of
``(score, id)`` bit patterns plus the documented order (winners by increasing id, then ``(-inf, -1)``);
``order="rank_local"`` exactly against :func:`dcp_ref.indexer.local_topk_rank_local`. The adversarial rows are
test_indexer_kernel.py's (ties, ±0 and subnormals, NaN / ±inf, short, all-NaN, ascending, constant rows).

On the CPU: the plan (pure Python), the engine choice, the configuration's checks, and the kernel compiled to
sm_90a (PTX + cubin: no register spill at <= 512 threads and <= 16 keys a thread). ``-m gpu``: every vector
width, one CTA and clusters of 2-8, both orders, ≥ 10 000 rows, strided views, validated and unvalidated calls
(CUDA graphs and the no-sync check of the default plan: test_indexer_kernel.py's, which take this engine).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

from dcp_ref.geometry import DcpGeometry
from dcp_ref.indexer import local_topk, local_topk_rank_local
from dcp_ref.topk import pack_candidates

ix = pytest.importorskip("dcp_ref.kernels.indexer_triton")
from test_indexer_kernel import FLAVOURS, assert_kernel_order, make_cases, same_sets  # noqa: E402

ltk = pytest.importorskip("dcp_ref.kernels.local_topk_cutedsl")


def reference(scores, lengths, k, geometry, row_starts=None, validate=True):
    return pack_candidates(
        scores,
        local_topk(scores, k, lengths, row_starts, validate=validate),
        geometry,
        row_starts,
        validate=validate,
    )


# ---------------------------------------------------------------------------------------------
# CPU: the plan, the engine choice, the configuration, the compiled kernel
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 32, 128, 1024])
@pytest.mark.parametrize("cols", [1, 3, 100, 4096, 8192, 32768, 65536, 131072, 262144])
@pytest.mark.parametrize("vec", [1, 2, 4])
def test_plan_holds_every_row(rows, cols, vec):
    """The planned CTAs hold a whole row, each at most 32 keys a thread; clusters only of the portable sizes."""
    plan = ltk.plan_for(rows, cols, 2048, vec)
    assert plan is not None
    cluster, threads, cpt, first_bits, commit = plan
    cfg = ltk.LocalTopKConfig(2048, cluster, threads, cpt, vec, first_bits=first_bits, commit=commit)
    assert cfg.capacity >= cols
    assert cpt * vec <= ltk.MAX_KEYS_PER_THREAD and cluster in ltk.CLUSTERS


def test_plan_covers_the_alignment_slack():
    """A window that starts mid-vector is read from the aligned column below it: the CTAs read columns
    ``[c0, c0 + capacity)`` with ``c0 > start - vec``, and the window ends at or before ``cols``. So capacity >= cols
    suffices: the last window column is ``< cols <= c0 + capacity`` whenever ``c0 >= 0``."""
    for cols in (5, 4097, 32768, 131071):
        for vec in (1, 2, 4):
            cluster, threads, cpt, _, _ = ltk.plan_for(1, cols, 7, vec)
            assert cluster * threads * cpt * vec >= cols


def test_plan_refuses_what_it_cannot_hold():
    assert ltk.plan_for(1, 8 * 32768 + 1, 2048, 4) is None  # longer than 8 CTAs of 32 keys x 1024 threads
    assert ltk.plan_for(1, 4096, 32769, 4) is None  # k beyond the kernel's counters
    assert ltk.plan_for(1, 4096, 2048, 0) is None  # scores it cannot read
    assert ltk.plan_for(1, 0, 2048, 4) is None


def test_plan_rule_spreads_few_rows_over_a_cluster():
    """The rule (any argument given, or no measured plan fits): few long rows spread over a cluster, many rows take
    the fewest CTAs that hold them spill-free."""
    assert ltk.plan_for(1, 131072, 2048, 4, first_bits=8)[0] == 8
    assert ltk.plan_for(1, 32768, 2048, 4, first_bits=8)[0] == 4  # 4 CTAs of 8192 keys
    assert ltk.plan_for(1024, 32768, 2048, 4, first_bits=8)[0] == 2  # the fewest that hold it spill-free
    assert ltk.plan_for(32, 4096, 2048, 4, first_bits=8)[0] == 1


def test_engine_choice_on_the_cpu():
    """No GPU: the plan takes the Triton kernel; forcing the CuTeDSL one, or mixing it with Triton knobs, is a
    ValueError naming the reason."""
    plan = ix.launch_plan(4, 4096, 64, torch.device("cpu"), vec=4)
    assert plan.engine == "triton" and plan.cute is None
    with pytest.raises(ValueError, match="engine='cutedsl' cannot run"):
        ix.launch_plan(4, 4096, 64, torch.device("cpu"), engine="cutedsl", vec=4)
    with pytest.raises(ValueError, match="takes no Triton tuning"):
        ix.launch_plan(4, 4096, 64, torch.device("cpu"), engine="cutedsl", split=2)
    with pytest.raises(ValueError, match="engine must be one of"):
        ix.launch_plan(4, 4096, 64, torch.device("cpu"), engine="cuda")


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(cluster=3), "cluster must be one of"),
        (dict(threads=384), "threads must be"),
        (dict(vec=3), "vec must be"),
        (dict(cpt=9, vec=4), r"cpt \* vec"),
        (dict(order="sorted"), "order must be"),
        (dict(len_bits=16), "len_bits"),
        (dict(first_bits=9), "first_bits must be one of"),
    ],
)
def test_config_refuses_bad_knobs(kw, match):
    with pytest.raises(ValueError, match=match):
        ltk.LocalTopKConfig(2048, **kw)
    with pytest.raises(ValueError, match="k must be in"):
        ltk.LocalTopKConfig(0)


def test_vec_for_reads_the_layout():
    s = torch.zeros(4, 4096)
    assert ltk.vec_for(s) == 4
    assert ltk.vec_for(s[:, 2:]) == 2  # 8-byte aligned start, 4094 columns
    assert ltk.vec_for(s[:, 1:]) == 1
    assert ltk.vec_for(s.t()) == 0  # column stride 4 (a transposed view): not read
    assert ltk.vec_for(s.double()) == 0


#: (cluster, threads, cpt, vec, order, len_bits, start_bits, check, first_bits)
COMPILED = [
    (1, 256, 4, 4, "global_id", 32, 0, False, 8),  # the planned single-CTA shapes: 4K, 8K
    (1, 512, 4, 4, "global_id", 32, 0, False, 8),
    (2, 1024, 4, 4, "global_id", 32, 0, False, 8),  # a cluster (32K)
    (8, 1024, 4, 4, "rank_local", 64, 32, True, 8),  # 128K, rank-local, validated, int64 lengths
    (1, 1024, 8, 2, "global_id", 0, 64, False, 11),  # 32 keys a thread, 8-byte loads, 11-bit first digit
    (4, 512, 16, 1, "global_id", 32, 32, True, 12),  # scalar loads
]


@pytest.mark.parametrize("cfg", COMPILED)
def test_compiles_to_sm90a(cfg, monkeypatch):
    """Every kind of configuration compiles for sm_90a on the CPU; <= 512 threads of <= 16 keys spill nothing."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    from dcp_ref.kernels.select_to_slots_cutedsl import cubin_resources

    c = ltk.LocalTopKConfig(2048, *cfg)
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = ltk.compile_artifacts(c, d)
    assert ".target sm_90a" in ptx and ".entry" in ptx
    assert f".reqntid {c.threads}, 1, 1" in ptx
    assert "shfl.sync.up" in ptx and "atom.shared" in ptx  # the scans, the shared histogram
    if c.cluster > 1:
        assert "barrier.cluster" in ptx and "ld.shared::cluster" in ptx  # the cluster's histogram sum
    if c.vec == 4:
        assert "ld.global.v4" in ptx  # 16-byte loads
    res = cubin_resources(cubin)
    if c.threads <= 512 and c.cpt * c.vec <= ltk.SPILL_FREE_KEYS:  # (1024 threads: 64 registers; a few spill)
        assert res["frame_bytes"] == 0, res


@pytest.mark.parametrize("k", [ltk.STAGE_MAX_K, ltk.STAGE_MAX_K + 1])
def test_compiles_with_and_without_staged_winners(k, monkeypatch):
    """The scan commit: up to STAGE_MAX_K the winners go through shared memory (one more barrier, the write-out
    loop); above it they are written where they are found. Both compile for sm_90a, one CTA and a cluster."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    for cluster in (1, 4):
        c = ltk.LocalTopKConfig(k, cluster, 1024, 4, 4, commit="scan")
        assert ltk.LocalTopKKernel(c).staged == (k <= ltk.STAGE_MAX_K)
        with tempfile.TemporaryDirectory() as d:
            ptx, _ = ltk.compile_artifacts(c, d)
        assert ".entry" in ptx


@pytest.mark.parametrize("cluster", [1, 4])
def test_bitmap_commit_compiles_without_spill(cluster, monkeypatch):
    """The bitmap commit: the winners' bits by ``atom.shared.or``, no staging, and at 32 keys a thread of 1024
    threads no register spill (the scan commit spills there: its per-load scans)."""
    pytest.importorskip("cutlass")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    from dcp_ref.kernels.select_to_slots_cutedsl import cubin_resources

    c = ltk.LocalTopKConfig(2048, cluster, 1024, 8, 4, commit="bitmap")
    kern = ltk.LocalTopKKernel(c)
    assert not kern.staged and kern.nwords == 1024 and kern.bm_size == 2048
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = ltk.compile_artifacts(c, d)
    assert "atom.shared.or.b32" in ptx
    assert cubin_resources(cubin)["frame_bytes"] == 0


@pytest.mark.parametrize("shape", [(1024, 131072), (1024, 4096)])
def test_launcher_compiles_the_plans_commit(shape, monkeypatch):
    """The launcher builds the configuration the plan names, its commit included (``bitmap`` where winners are
    sparse, ``scan`` elsewhere), and calls it once with the scores' words: on the CPU, the compiled function is
    a stand-in that records its configuration and arguments (the launch itself needs the GPU)."""
    rows, cols = shape
    plan = ltk.plan_for(rows, cols, 2048, 4)
    assert plan is not None and plan[4] == ltk.commit_for(rows, cols, 2048)
    seen: list = []
    monkeypatch.setattr(ltk, "compile_local_topk", lambda cfg: lambda *args: seen.append((cfg, args)))
    scores = torch.zeros(2, cols)  # two rows are enough: the configuration is the plan's, not the shape's
    out = torch.empty(2, 2048, 2)
    ltk.local_topk_pack_cutedsl(scores, None, 2048, 0, 2, 1, None, out, None, None, plan, 4, tvm_ffi=True)
    ((cfg, args),) = seen
    assert (cfg.cluster, cfg.threads, cfg.cpt, cfg.first_bits, cfg.commit) == plan
    assert cfg.vec == 4 and cfg.k == 2048 and cfg.order == "global_id" and cfg.len_bits == 0
    assert args[0].numel() == 2 * cols and args[7:9] == (2, cols)


def test_bad_commit_is_refused():
    with pytest.raises(ValueError, match=r"^commit must be one of"):
        ltk.LocalTopKConfig(2048, commit="sorted")


# ---------------------------------------------------------------------------------------------
# GPU (-m gpu): the kernel against the reference
# ---------------------------------------------------------------------------------------------

#: (rows, cols, k, W, I, rank, with_starts, cute overrides, column offset of the view)
GPU_CONFIGS = [
    (1000, 1, 1, 2, 1, 0, False, None, 0),
    (1000, 37, 5, 3, 2, 1, True, None, 0),  # odd width: scalar loads
    (1000, 300, 64, 2, 1, 1, True, None, 2),  # 8-byte loads of a column-offset view
    (1000, 2048, 2048, 2, 1, 0, False, None, 0),  # k = cols: every valid key wins
    (1000, 4096, 2048, 4, 8, 3, True, None, 0),
    (1000, 8192, 2048, 2, 1, 1, False, None, 0),
    (800, 8192, 1, 8, 64, 5, False, None, 0),
    (800, 5000, 4096, 2, 1, 0, False, None, 0),  # k > most rows' keys
    (600, 9000, 2048, 2, 1, 1, True, (1, 1024, 11), 0),  # one CTA, 11-bit first digit
    (400, 32768, 2048, 2, 1, 0, False, None, 0),  # a cluster of 2
    (300, 32768, 2048, 2, 4, 1, True, (1, 1024, 12), 0),  # one CTA of 32 keys a thread
    (200, 20000, 777, 3, 1, 2, True, (4, None, None), 1),  # a cluster of 4 on scalar loads
    (64, 131072, 2048, 1, 1, 0, False, None, 0),  # a cluster of 8
    (32, 131072, 4096, 2, 2, 1, True, (8, 1024, 11), 0),
    (16, 250000, 2048, 2, 1, 0, False, None, 0),  # 8 CTAs of ~31K keys
    (300, 16384, 512, 2, 1, 0, False, (2, 512, None), 0),
    (600, 1024, 128, 4, 2, 3, True, None, 0),
    (64, 65536, ltk.STAGE_MAX_K, 2, 1, 0, False, None, 0),  # the most winners staged in shared memory
    (48, 65536, ltk.STAGE_MAX_K + 1, 2, 2, 1, True, (4, None, None), 0),  # beyond: written directly, a cluster
    (48, 30000, 12000, 3, 1, 2, False, (1, 1024, None), 0),  # beyond, one CTA
]


def cutedsl(s: torch.Tensor, k: int, cute: tuple | None = None):
    """The plan that forces the CuTeDSL engine on ``s`` (``cute``: its tuning), at the vector width its layout
    allows (:func:`~dcp_ref.kernels.indexer_triton.scores_vec`)."""
    return ix.launch_plan(*s.shape, k, s.device, engine="cutedsl", cute=cute, vec=ix.scores_vec(s))


def _view(s: torch.Tensor, off: int) -> torch.Tensor:
    """``s`` as a column-offset view of a wider tensor (row stride > cols, unaligned start when ``off`` is odd)."""
    if not off:
        return s
    wide = torch.full((s.shape[0], s.shape[1] + 8), float("nan"), device=s.device)
    wide[:, off : off + s.shape[1]] = s
    return wide[:, off : off + s.shape[1]]


@pytest.mark.gpu
def test_gpu_differential_10k_adversarial_rows(cuda_device):
    """Every configuration through the CuTeDSL engine (≥ 10 000 rows): same sets as the reference, the
    documented order, the planned vector width."""
    total, failures = 0, []
    for c, (rows, cols, k, w, i, rank, with_starts, cute, off) in enumerate(GPU_CONFIGS):
        s, lengths, starts = make_cases(rows, cols, 700 + c, cuda_device, with_starts)
        if c % 3 == 2:
            lengths = lengths.long()
        s = _view(s, off)
        g = DcpGeometry(w, rank, i, i)
        want = reference(s, lengths, k, g, starts)
        out = torch.full((rows, k, 2), float("nan"), device=cuda_device)  # poison
        got = ix.indexer_topk_pack(s, lengths, k, g, starts, out=out, plan=cutedsl(s, k, cute))
        bad = ~same_sets(got, want)
        if bool(bad.any()):
            r = int(bad.nonzero()[0])
            failures.append(
                f"config {c} {(rows, cols, k, w, i, cute, off)}: {int(bad.sum())} rows differ, first {r} "
                f"({FLAVOURS[r % len(FLAVOURS)]}): got {got[r, :4].tolist()} want {want[r, :4].tolist()}"
            )
        assert_kernel_order(got)
        total += rows
    assert not failures, failures
    assert total >= 10_000


@pytest.mark.gpu
def test_gpu_rank_local_matches_the_reference(cuda_device):
    """order="rank_local": exactly local_topk_rank_local (ids, score bits incl. -0.0, NaN / -1 padding)."""
    for c, (rows, cols, k, cute) in enumerate(
        [
            (1000, 4096, 2048, None),
            (500, 8191, 100, None),
            (400, 32768, 2048, None),
            (32, 131072, 2048, None),
            (200, 20000, 777, (4, 512, 11)),
        ]
    ):
        s, lengths, starts = make_cases(rows, cols, 800 + c, cuda_device, with_starts=c % 2 == 1)
        sc, ids = ix.indexer_topk_pack(s, lengths, k, DcpGeometry(3, 1, 2, 2), starts, order="rank_local",
                                       plan=cutedsl(s, k, cute))  # fmt: skip
        ws, wi = local_topk_rank_local(s, k, lengths, starts)
        bad = (~((ids == wi).all(1) & (sc.view(torch.int32) == ws.view(torch.int32)).all(1))).nonzero()
        assert not len(bad), f"config {c}: rows {bad.flatten().tolist()[:5]}"


@pytest.mark.gpu
def test_gpu_heavy_ties_resolve_by_index(cuda_device):
    """Rows of 16 values (the benchmark's ties rows) and all-equal rows, one CTA and clusters: the lowest indices
    of the threshold value win."""
    for rows, cols, cute in [(64, 8192, None), (32, 32768, None), (4, 131072, None), (8, 65536, (8, 512, None))]:
        gen = torch.Generator().manual_seed(cols)
        s = torch.randint(0, 16, (rows, cols), generator=gen).float().to(cuda_device)
        s[0] = 1.0  # one constant row
        lengths = torch.full((rows,), cols, dtype=torch.int32, device=cuda_device)
        got = ix.indexer_topk_pack(s, lengths, 2048, DcpGeometry(2, 0), plan=cutedsl(s, 2048, cute))
        assert bool(same_sets(got, reference(s, lengths, 2048, DcpGeometry(2, 0))).all())


@pytest.mark.gpu
def test_gpu_default_plan_takes_the_cutedsl_engine(cuda_device):
    """With no Triton knob the plan picks the CuTeDSL kernel for float32 scores on the GPU, the Triton one for
    half-precision scores (it cannot read them) and whenever a Triton knob is given."""
    assert ix.launch_plan(32, 8192, 2048, cuda_device, vec=4).engine == "cutedsl"
    assert ix.launch_plan(32, 8192, 2048, cuda_device, vec=0).engine == "triton"
    assert ix.launch_plan(32, 8192, 2048, cuda_device, vec=4, compact=False).engine == "triton"
    s, lengths, _ = make_cases(64, 3000, 31, cuda_device)
    half = s.to(torch.bfloat16)
    got = ix.indexer_topk_pack(half, lengths, 100, DcpGeometry(2, 0))  # the Triton kernel reads it
    assert bool(same_sets(got, reference(half, lengths, 100, DcpGeometry(2, 0))).all())
    # a plan made for the float32 scores' layout cannot run on the half ones (same shape): refused, naming plan
    with pytest.raises(ValueError, match=r"^plan takes the CuTeDSL kernel at vec=4"):
        ix.indexer_topk_pack(half, lengths, 100, DcpGeometry(2, 0), plan=cutedsl(s, 100))


@pytest.mark.gpu
def test_gpu_validate_false_clamps_windows_like_the_reference(cuda_device):
    """validate=False with windows outside the scores (negative, past the end, huge): the kernel clamps as the
    reference does with validate=False — never a read outside ``scores``, never a plausible wrong row."""
    rows, cols, k = 64, 5000, 300
    s, lengths, starts = make_cases(rows, cols, 41, cuda_device, with_starts=True)
    starts = starts.long()
    lengths = lengths.long()
    starts[::5] = -7
    starts[1::5] = cols + 9
    lengths[2::5] = cols * 3
    lengths[3::5] = -1
    lengths[4::7] = 2**40
    got = ix.indexer_topk_pack(s, lengths, k, DcpGeometry(2, 1), starts, validate=False, plan=cutedsl(s, k))
    want = reference(s, lengths, k, DcpGeometry(2, 1), starts, validate=False)
    assert bool(same_sets(got, want).all())


@pytest.mark.gpu
def test_gpu_validated_call_raises_and_recovers(cuda_device):
    """validate=True: the in-kernel window check, one flag read; a bad window raises the reference's message and
    the next good call (same flag) passes."""
    s, lengths, _ = make_cases(64, 20000, 12, cuda_device)
    bad = lengths.clone()
    bad[17] = 20001
    with pytest.raises(ValueError, match=r"^lengths must be <= scores.shape\[1\]=20000"):
        ix.indexer_topk_pack(s, bad, 2048, DcpGeometry(2, 0), plan=cutedsl(s, 2048))
    got = ix.indexer_topk_pack(s, lengths, 2048, DcpGeometry(2, 0), plan=cutedsl(s, 2048))
    assert bool(same_sets(got, reference(s, lengths, 2048, DcpGeometry(2, 0))).all())


@pytest.mark.parametrize(
    "cute,exc,match",
    [
        ((2, 512), TypeError, "cute must be a tuple"),
        ("fast", TypeError, "cute must be a tuple"),
        ((2, 512.0, None), TypeError, "cute's threads"),
        ((True, None, None), TypeError, "cute's cluster"),
    ],
)
def test_launch_plan_refuses_a_bad_cute_tuning(cute, exc, match):
    with pytest.raises(exc, match=match):
        ix.launch_plan(4, 4096, 64, torch.device("cpu"), cute=cute)


def test_plan_for_and_vec_for_name_bad_arguments():
    with pytest.raises(TypeError, match="cols"):
        ltk.plan_for(1, 4096.0, 2048, 4)
    with pytest.raises(TypeError, match="first_bits"):
        ltk.plan_for(1, 4096, 2048, 4, first_bits="8")
    with pytest.raises(TypeError, match="scores"):
        ltk.vec_for([[1.0]])
    with pytest.raises(ValueError, match="scores"):
        ltk.vec_for(torch.zeros(3))
