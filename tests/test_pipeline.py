"""End to end: DCP over W simulated ranks reproduces single-device sparse attention exactly.

The oracle (:func:`dcp_ref.pipeline.single_device_decode`) never shards anything: it sorts each
token's global scores (score descending, lower position first), takes the top-k and runs a float64
softmax over those keys. The DCP path runs all five stages on every rank with real collectives
(simulated threads). Agreement for many W, I, next_n and heavy score ties is the strongest check
that the stages fit together.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from idsets import same_sets

from dcp_ref.pipeline import make_dcp_problem, run_dcp_decode, single_device_decode


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("interleave", [1, 2, 4])
@pytest.mark.parametrize("next_n", [1, 2])
def test_dcp_equals_single_device(world_size: int, interleave: int, next_n: int) -> None:
    problem = make_dcp_problem(
        world_size,
        interleave,
        seq_lens=[37, 5, 64, 2],
        next_n=next_n,
        num_heads=12,
        head_dim=24,
        block_size=8,
        seed=world_size * 100 + interleave * 10 + next_n,
    )
    topk, scale = 6, 1 / math.sqrt(24)
    out, lse = run_dcp_decode(problem, topk, scale)
    ref_out, ref_lse, _ = single_device_decode(problem, topk, scale)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)


def test_oracle_is_sensitive_to_the_chosen_keys() -> None:
    """Sanity of the oracle's sensitivity: attending to *more* keys than the global top-k changes
    the answer, so the equality above is not vacuous."""
    problem = make_dcp_problem(2, 1, seq_lens=[40], num_heads=2, head_dim=8, seed=3)
    a, _, _ = single_device_decode(problem, 4, 0.3)
    b, _, _ = single_device_decode(problem, 8, 0.3)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("world_size,interleave", [(2, 1), (3, 2), (4, 4)])
def test_stage_invariants_across_ranks(world_size: int, interleave: int) -> None:
    """Every rank selects the identical global ids; each chosen key is attended by exactly one rank
    (its owner), so the per-rank counts add up to the number of valid global ids."""
    problem = make_dcp_problem(world_size, interleave, seq_lens=[50, 9, 3], next_n=2, num_heads=12, head_dim=8, seed=7)
    traces = [dict() for _ in range(world_size)]
    run_dcp_decode(problem, 5, 0.3, traces)
    ids0 = traces[0]["global_ids"]
    for tr in traces[1:]:
        assert torch.equal(tr["global_ids"], ids0)
    valid_per_row = (ids0 >= 0).sum(-1)
    counts = torch.stack([tr["counts"] for tr in traces]).sum(0)
    assert torch.equal(counts.long(), valid_per_row.long())
    _, _, oracle_ids = single_device_decode(problem, 5, 0.3)
    # Same *set* per row as the oracle's global top-k (the kernels may return another order).
    assert [sorted(r) for r in ids0.tolist()] == [sorted(r) for r in oracle_ids.tolist()]


# ---------------------------------------------------------------------------------------------
# stages="kernels": the same step on the kernels (Triton interpreted on the CPU)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size,interleave,next_n", [(1, 1, 1), (2, 1, 2), (3, 2, 1), (4, 4, 2)])
def test_kernels_backend_equals_single_device(world_size: int, interleave: int, next_n: int, caplog) -> None:
    """The kernel path (Triton pack, deinterleave, LSE correction; references where no kernel can
    run here) against the unsharded float64 oracle; the global ids must equal the oracle's exactly."""
    from dcp_ref.kernels.stages import kernel_stage_impls

    problem = make_dcp_problem(
        world_size,
        interleave,
        seq_lens=[37, 5, 64, 2],
        next_n=next_n,
        num_heads=12,
        head_dim=24,
        block_size=8,
        seed=11 + world_size * 10 + interleave,
    )
    topk, scale = 6, 1 / math.sqrt(24)
    traces = [dict() for _ in range(world_size)]
    with caplog.at_level("WARNING", logger="dcp_ref.kernels.stages"):
        out, lse = run_dcp_decode(problem, topk, scale, traces, stages="kernels")
    ref_out, ref_lse, ref_ids = single_device_decode(problem, topk, scale)
    # float32 partial outputs (what a GPU kernel gives; the Triton merge takes no float64)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-6, atol=2e-6)
    for tr in traces:
        assert same_sets(tr["global_ids"], ref_ids)
    impl = traces[0]["impl"]  # the stages this run called, in order
    every = kernel_stage_impls(problem.q.device, problem.q.dtype, 24, 24, num_heads=12, topk=topk)
    assert impl == {stage: every[stage] for stage in impl}
    split = world_size > 1  # one rank: no select (its local top-K is the answer), no correct stage
    assert list(impl) == ["indexer", *["select"] * split, "deinterleave", "attention", "guard", *["correct"] * split]
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        assert impl["deinterleave"] == impl["guard"] == every["correct"] == "triton"
        assert impl["indexer"] in ("torch+triton", "fused")


def test_kernels_backend_matches_reference_backend_bit_for_bit_on_ids() -> None:
    """Both backends pick the same ids, slots and counts on every rank (the kernels are exact)."""
    problem = make_dcp_problem(3, 2, seq_lens=[50, 9, 3], next_n=2, num_heads=6, head_dim=8, seed=5)
    ref_tr, ker_tr = [dict() for _ in range(3)], [dict() for _ in range(3)]
    run_dcp_decode(problem, 5, 0.3, ref_tr)
    run_dcp_decode(problem, 5, 0.3, ker_tr, stages="kernels")
    for a, b in zip(ref_tr, ker_tr):
        assert torch.equal(a["global_ids"].long(), b["global_ids"].long())
        assert torch.equal(a["counts"].long(), b["counts"].long())
        # ordered compaction: the valid slots come in the same order
        assert torch.equal(a["slots"].long(), b["slots"].long())


def test_kernel_stage_impls_and_backend_errors(caplog) -> None:
    from dcp_ref.group import SingleGroup
    from dcp_ref.kernels.stages import kernel_stage_impls
    from dcp_ref.pipeline import dcp_decode_step

    impl = kernel_stage_impls(torch.device("cpu"), torch.float32, 576, 512)
    # no CUDA here: CuTeDSL, FlashMLA and FlashInfer cannot run, so those stages are the references
    assert impl["select"] == "torch" and impl["attention"] == "torch"
    from dcp_ref.stages import STAGE_NAMES

    assert tuple(impl) == STAGE_NAMES  # every stage, in step order
    problem = make_dcp_problem(1, 1, seq_lens=[5], num_heads=2, head_dim=4, seed=0)
    with pytest.raises(ValueError, match="stages must be"):
        dcp_decode_step(SingleGroup(), problem.q, problem.shards[0], problem.seq_lens, 1, 2, 0.5, stages="fast")
    with pytest.raises(ValueError, match="block_size must be a multiple of interleave"):
        make_dcp_problem(2, 2, seq_lens=[5], block_size=3)
    odd = make_dcp_problem(2, 1, seq_lens=[5], num_heads=3, head_dim=4, seed=0)
    with pytest.raises(ValueError, match="divisible by the world size"):
        run_dcp_decode(odd, 2, 0.5, stages="kernels")


def test_problem_to_keeps_the_answer() -> None:
    """DcpProblem.to(dtype) changes only the precision: float32 copy ≈ float64 original."""
    p64 = make_dcp_problem(2, 1, seq_lens=[30, 4], num_heads=4, head_dim=8, seed=2)
    p32 = p64.to("cpu", torch.float32)
    assert p32.q.dtype == p32.shards[0].kv_cache.dtype == p32.kv_global[0].dtype == torch.float32
    assert p32.shards[0].block_table.dtype == torch.int32 and p32.shards[0].index_scores.dtype == torch.float32
    o64, _ = run_dcp_decode(p64, 4, 0.3)
    o32, _ = run_dcp_decode(p32, 4, 0.3)
    torch.testing.assert_close(o32.double(), o64, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("world_size,interleave", [(2, 1), (4, 2)])
def test_kernels_backend_on_gpu_deepseek_geometry(cuda_device, world_size: int, interleave: int) -> None:
    """The whole step on the GPU kernels (CuTeDSL top-K and FlashInfer MLA when installed) with
    DeepSeek's head geometry in bf16, against the float64 CPU oracle."""
    from dcp_ref.group import SimulatedWorld
    from dcp_ref.kernels.stages import kernel_stage_impls
    from dcp_ref.step import plan_for

    problem = make_dcp_problem(
        world_size, interleave, seq_lens=[300, 41, 1000], next_n=2, num_heads=16, head_dim=576, block_size=64, seed=3
    )
    topk, scale = 64, 192**-0.5
    gpu = problem.to(cuda_device, torch.bfloat16)
    traces = [dict() for _ in range(world_size)]
    out, lse = run_dcp_decode(gpu, topk, scale, traces, stages="kernels", v_dim=512)
    ref_out, ref_lse, ref_ids = single_device_decode(problem, topk, scale)
    # The trace names the stages the step ran (its layout's: no scoring, owner exchange or all-to-all combine
    # here), as the plan of these inputs has them (the attention is chosen per planned shape).
    world = SimulatedWorld(world_size)
    planned = [
        plan_for(world.groups[r], gpu.q, gpu.shards[r], topk, scale, v_dim=512, stages="kernels").impls
        for r in range(world_size)
    ]
    assert [tr["impl"] for tr in traces] == planned
    ran = planned[0]
    assert "correct" in ran and "combine" not in ran  # W > 1 ranks: the LSE merge before the reduce-scatter
    # Every other stage it ran is the kernel that kernel_stages chooses for this device.
    impl = kernel_stage_impls(gpu.q.device, gpu.q.dtype, 576, 512, num_heads=16, topk=topk)
    assert {s: ran[s] for s in ran if s != "attention"} == {s: impl[s] for s in ran if s != "attention"}, (ran, impl)
    assert ran["deinterleave"] == ran["correct"] == "triton"
    for tr in traces:  # the selection is exact whatever runs it; the CuTeDSL top-K returns a set per row
        assert [sorted(r) for r in tr["global_ids"].long().cpu().tolist()] == [sorted(r) for r in ref_ids.tolist()]
    ref = ref_out[..., :512]
    rel = (out.double().cpu() - ref).norm() / ref.norm()
    assert rel < 2e-2, rel  # bf16 inputs and outputs
    torch.testing.assert_close(lse.double().cpu(), ref_lse, rtol=2e-2, atol=2e-2)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world_size=st.integers(1, 5),
    interleave=st.integers(1, 4),
    next_n=st.integers(1, 3),
    topk=st.integers(1, 12),
    blocks_per_stripe=st.sampled_from([1, 2, 3]),
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    seed=st.integers(0, 10_000),
)
def test_kernels_backend_property(world_size, interleave, next_n, topk, blocks_per_stripe, lens, seed) -> None:
    """Random geometry (any W, I, block size, MTP width, top-k larger or smaller than the lengths):
    the kernel path picks the oracle's ids and matches its output."""
    lens = [max(n, next_n) for n in lens]  # a request holds at least its own query tokens
    block_size = interleave * blocks_per_stripe  # a stripe of I tokens never straddles two blocks
    problem = make_dcp_problem(
        world_size,
        interleave,
        seq_lens=lens,
        next_n=next_n,
        num_heads=2 * world_size,
        head_dim=8,
        block_size=block_size,
        seed=seed,
    )
    traces = [dict() for _ in range(world_size)]
    out, lse = run_dcp_decode(problem, topk, 0.4, traces, stages="kernels")
    ref_out, ref_lse, ref_ids = single_device_decode(problem, topk, 0.4)
    for tr in traces:
        assert same_sets(tr["global_ids"], ref_ids)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=2e-6, atol=2e-6)
