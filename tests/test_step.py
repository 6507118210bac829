"""The planned step: planned once, run many times against the single-device oracle; capture-safe.

CPU: the reference stages and the kernel stages (Triton interpreted) over SimulatedWorld ranks,
reusing one plan for several problems and token counts; a dispatch-level counter proves that a
run reads no tensor value on the host (no sync: what CUDA-graph capture needs); geometry and
shape mismatches are rejected. GPU (``-m gpu``): DeepSeek geometry in bf16 on the kernels
(CuTeDSL top-K, FlashMLA or FlashInfer, Triton), CUDA-graph capture and replay on new inputs,
no synchronisation under ``torch.cuda.set_sync_debug_mode("error")``, and the step over NCCL on
two GPUs (eager and captured), each against the float64 oracle.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dcp_ref.geometry import DcpGeometry
from dcp_ref.group import SimulatedWorld, SingleGroup
from dcp_ref.pipeline import RankShard, make_dcp_problem, single_device_decode
from dcp_ref.stages import REFERENCE_STAGES, Stages, StepSpec, reference_select, register_stages, resolve_stages
from dcp_ref.step import HostSyncCounter, PlannedStep, StepMetadata, decode_metadata

HERE = Path(__file__).resolve().parent


def _spec(problem, rank: int, max_tokens: int, topk: int, scale: float, dtype=torch.float64, device="cpu") -> StepSpec:
    _, H, D = problem.q.shape
    return StepSpec(
        problem.geometry(rank),
        max_tokens=max_tokens,
        topk=topk,
        num_heads=H,
        head_dim=D,
        v_dim=D,
        sm_scale=scale,
        dtype=dtype,
        device=device,
    )


def _run_planned(steps: list[PlannedStep], problem, traces=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run already-planned steps (one per rank) on ``problem``; heads reassembled in rank order."""
    W = problem.world_size
    traces = traces if traces is not None else [None] * W

    def body(group, step, shard, tr):
        step.group = group  # the plan's group handle for this world (a plan outlives one SimulatedWorld.run)
        out, lse = step.run(problem.q.to(step.spec.dtype), shard, problem.metadata(group.rank), trace=tr)
        return out.clone(), lse.clone()

    res = SimulatedWorld(W).run(body, steps, problem.shards, traces)
    return torch.cat([o for o, _ in res], 1), torch.cat([l for _, l in res], 1)


def _plan(problem, max_tokens: int, topk: int, scale: float, stages: Stages | str = "reference") -> list[PlannedStep]:
    W = problem.world_size
    world = SimulatedWorld(W)
    return [PlannedStep(world.groups[r], _spec(problem, r, max_tokens, topk, scale), stages) for r in range(W)]


@pytest.mark.parametrize("stages", ["reference", "kernels"])
@pytest.mark.parametrize("world_size,interleave", [(1, 1), (2, 1), (3, 2)])
def test_one_plan_many_runs_equal_the_oracle(stages: str, world_size: int, interleave: int) -> None:
    """Plan once for T <= 8; run three problems (different data and token counts) on the same buffers."""
    topk, scale = 5, 0.3
    first = make_dcp_problem(
        world_size,
        interleave,
        seq_lens=[30, 9, 17, 4],
        next_n=2,
        num_heads=2 * world_size,
        head_dim=8,
        block_size=4,
        seed=1,
    )
    steps = _plan(first, 8, topk, scale, stages)
    tol = 1e-10 if stages == "reference" else 3e-6
    for seed, lens, next_n in [(1, [30, 9, 17, 4], 2), (2, [40, 3, 12], 1), (3, [25, 25, 6, 8], 2)]:
        p = make_dcp_problem(
            world_size,
            interleave,
            seq_lens=lens,
            next_n=next_n,
            num_heads=2 * world_size,
            head_dim=8,
            block_size=4,
            seed=seed,
        )
        traces = [dict() for _ in range(world_size)]
        out, lse = _run_planned(steps, p, traces)
        ref_out, ref_lse, ref_ids = single_device_decode(p, topk, scale)
        torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)
        for tr in traces:  # the selection is a set per row
            assert [sorted(r) for r in tr["global_ids"].tolist()] == [sorted(r) for r in ref_ids.tolist()]
            # the stages a run calls, in order; one rank needs no correct stage (nothing to combine)
            # one rank: no select (the local top-K is the answer) and no correct stage (nothing to combine)
            select, correct = (["select"], ["correct"]) if world_size > 1 else ([], [])
            assert list(tr["impl"]) == ["indexer", *select, "deinterleave", "attention", "guard", *correct]


class _NoCollectives(SingleGroup):
    """A one-rank group that refuses every collective: at W = 1 the step must not call any."""

    def all_gather(self, x, out=None):  # type: ignore[no-untyped-def]
        raise AssertionError("all_gather called at W = 1")

    def reduce_scatter(self, x, dim, out=None):  # type: ignore[no-untyped-def]
        raise AssertionError("reduce_scatter called at W = 1")


def test_one_rank_runs_no_collective_and_copies_nothing() -> None:
    """W = 1: the all-gathers are views of what the indexer and attention returned, the reduce-scatter is
    skipped; the answer is still the oracle's, also when a stage ignores its ``out=`` buffer."""
    p = make_dcp_problem(1, 1, seq_lens=[30, 9, 17], next_n=2, num_heads=2, head_dim=8, block_size=4, seed=4)
    fresh = dataclasses.replace(
        REFERENCE_STAGES,
        # returns a new tensor, not its out= buffer: the next stage must see this result, not the buffer
        indexer=lambda *a, out=None, **kw: REFERENCE_STAGES.indexer(*a, **kw),
        name="fresh-indexer",
    )
    for stages in (REFERENCE_STAGES, fresh):
        step = PlannedStep(_NoCollectives(), _spec(p, 0, 6, 4, 0.3), stages)
        trace: dict = {}
        out, lse = step.run(p.q, p.shards[0], p.metadata(0), trace=trace)
        ref_out, ref_lse, _ = single_device_decode(p, 4, 0.3)
        torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
        # No buffer for an identity: nothing to gather, no combine, no collective.
        assert step.parts.exchange.gathered_buf is None and type(step.parts.combine).__name__ == "NoCombine"
        assert step.collectives == ()


@pytest.mark.parametrize("stages", ["reference", "kernels"])
def test_run_reads_no_tensor_value_on_the_host(stages: str) -> None:
    """What capture needs: no .item(), no data-dependent shapes — checked at the aten dispatch level."""
    p = make_dcp_problem(2, 2, seq_lens=[30, 9, 17], next_n=2, num_heads=4, head_dim=8, block_size=4, seed=5)
    steps = _plan(p, 6, 4, 0.3, stages)
    counters = [HostSyncCounter(), HostSyncCounter()]

    def body(group, step, shard, counter):
        step.group = group
        meta = p.metadata(group.rank)  # the ownership stage: once per decode step, outside the graph
        with counter:
            step.run(p.q, shard, meta)

    SimulatedWorld(2).run(body, steps, p.shards, counters)
    for c in counters:
        assert len(c.ops) > 20  # the counter saw the run's ops
        assert c.syncs == [], c.syncs


def test_run_checks_geometry_shapes_and_values() -> None:
    p = make_dcp_problem(2, 1, seq_lens=[20, 7], next_n=1, num_heads=2, head_dim=8, block_size=4, seed=0)
    world = SimulatedWorld(2)
    with pytest.raises(ValueError, match=r"does not match spec\.geometry"):
        PlannedStep(world.groups[1], _spec(p, 0, 4, 3, 0.5))
    step = PlannedStep(
        SingleGroup(),
        StepSpec(
            DcpGeometry(1, 0, 1, 4),
            max_tokens=4,
            topk=3,
            num_heads=2,
            head_dim=8,
            v_dim=8,
            sm_scale=0.5,
            dtype=torch.float64,
            device="cpu",
        ),
    )
    meta = decode_metadata(p.seq_lens, 1, DcpGeometry(1, 0, 1, 4))
    with pytest.raises(ValueError, match=r"shard\.geometry .* does not match the planned geometry"):
        step.run(p.q, p.shards[0], meta)  # a W=2 shard on a W=1 plan: silently wrong before
    with pytest.raises(ValueError, match=r"q must be \[T, 2, 8\] with 0 <= T <= max_tokens=4"):
        step.run(torch.zeros(5, 2, 8, dtype=torch.float64), p.shards[0], meta)
    with pytest.raises(TypeError, match="q must have dtype"):
        step.run(p.q.float(), p.shards[0], meta)
    with pytest.raises(TypeError, match="meta must be a StepMetadata"):
        step.run(
            p.q[:2],
            RankShard(
                *[getattr(p.shards[0], f) for f in ("kv_cache", "block_table", "index_scores")], DcpGeometry(1, 0, 1, 4)
            ),
            {"local_bounds": meta.local_bounds},
        )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"shard\.geometry must be the DcpGeometry"):
        step.run(p.q, RankShard(p.shards[0].kv_cache, p.shards[0].block_table, p.shards[0].index_scores), meta)
    one = make_dcp_problem(1, 1, seq_lens=[20, 7], next_n=1, num_heads=2, head_dim=8, block_size=4, seed=0)
    shard = one.shards[0]
    narrow = RankShard(shard.kv_cache, shard.block_table, shard.index_scores[:, :10], shard.geometry)
    checked = PlannedStep(SingleGroup(), step.spec, validate=True)
    with pytest.raises(ValueError, match=r"shard\.index_scores has 10 columns, but a token's keys reach column 20"):
        checked.run(one.q, narrow, one.metadata(0))
    short = RankShard(shard.kv_cache, shard.block_table[:, :2], shard.index_scores, shard.geometry)
    with pytest.raises(ValueError, match=r"shard\.block_table is too short"):
        checked.run(one.q, short, one.metadata(0))
    bad_req = StepMetadata(one.metadata(0).local_bounds, torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"meta.req_of_token must lie in \[0, 2\)"):
        checked.run(one.q, shard, bad_req)
    with pytest.raises(ValueError, match="capture needs a CUDA step"):
        step.capture(one.q, shard, one.metadata(0))


def test_decode_step_rejects_a_non_tensor_query() -> None:
    from dcp_ref.pipeline import dcp_decode_step

    p = make_dcp_problem(1, 1, seq_lens=[6], num_heads=1, head_dim=4)
    with pytest.raises(TypeError, match=r"q must be a torch\.Tensor, got list"):
        dcp_decode_step(SingleGroup(), [[1.0]], p.shards[0], p.seq_lens, 1, 2, 0.5)  # type: ignore[arg-type]


def test_spec_is_validated() -> None:
    g = DcpGeometry(2, 0)
    with pytest.raises(ValueError, match=r"num_heads .* must be divisible by the world size W=2"):
        StepSpec(
            g, max_tokens=4, topk=3, num_heads=3, head_dim=8, v_dim=8, sm_scale=0.5, dtype=torch.float32, device="cpu"
        )
    with pytest.raises(ValueError, match="v_dim must be <= head_dim=8"):
        StepSpec(
            g, max_tokens=4, topk=3, num_heads=2, head_dim=8, v_dim=9, sm_scale=0.5, dtype=torch.float32, device="cpu"
        )
    with pytest.raises(ValueError, match="sm_scale must be a finite float > 0"):
        StepSpec(
            g,
            max_tokens=4,
            topk=3,
            num_heads=2,
            head_dim=8,
            v_dim=8,
            sm_scale=float("nan"),
            dtype=torch.float32,
            device="cpu",
        )
    with pytest.raises(TypeError, match="geometry must be a DcpGeometry"):
        StepSpec(
            (2, 0),
            max_tokens=4,
            topk=3,
            num_heads=2,
            head_dim=8,
            v_dim=8,
            sm_scale=0.5,
            dtype=torch.float32,
            device="cpu",
        )  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sm_scale must be a float, got str"):
        StepSpec(
            g, max_tokens=4, topk=3, num_heads=2, head_dim=8, v_dim=8, sm_scale="0.5", dtype=torch.float32, device="cpu"
        )  # type: ignore[arg-type]
    import numpy as np

    assert (
        StepSpec(
            g,
            max_tokens=4,
            topk=3,
            num_heads=2,
            head_dim=8,
            v_dim=8,
            sm_scale=np.float64(0.5),
            dtype=torch.float32,
            device="cpu",
        ).sm_scale
        == 0.5
    )
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        StepSpec(
            g, max_tokens=0, topk=3, num_heads=2, head_dim=8, v_dim=8, sm_scale=0.5, dtype=torch.float32, device="cpu"
        )


def test_a_plugged_in_stage_runs_and_is_named_in_the_trace() -> None:
    """A user's select (here: ties broken toward the *higher* id — a real bug) plugs in through
    Stages.with_, no monkeypatching; the trace names it, and the oracle catches it."""

    def select_higher_id_wins(gathered, k, *, out=None):
        c = (
            gathered.reshape(-1, *gathered.shape[-2:])
            if gathered.ndim == 3
            else gathered.permute(1, 0, 2, 3).reshape(gathered.shape[1], -1, 2)
        )
        score, ids = c[..., 0].double(), c[..., 1].double()
        key = torch.where(ids >= 0, score * 1e9 + ids, torch.full_like(score, -math.inf))  # higher id first at ties
        top = torch.topk(key, min(k, key.shape[1]), dim=1).indices
        res = torch.where(torch.gather(key, 1, top) > -math.inf, torch.gather(ids, 1, top), -1.0).to(torch.int32)
        return out.copy_(res) if out is not None else res

    buggy = REFERENCE_STAGES.with_(select=select_higher_id_wins)
    assert buggy.impls()["select"].endswith("select_higher_id_wins") and buggy.name == "reference+custom"
    p = make_dcp_problem(
        2, 1, seq_lens=[40, 33], next_n=1, num_heads=2, head_dim=8, block_size=4, score_levels=3, seed=4
    )
    traces = [dict(), dict()]
    out, _ = _run_planned(_plan(p, 2, 6, 0.3, buggy), p, traces)
    ref_out, _, ref_ids = single_device_decode(p, 6, 0.3)
    assert traces[0]["impl"]["select"].endswith("select_higher_id_wins")
    assert [sorted(r) for r in traces[0]["global_ids"].tolist()] != [sorted(r) for r in ref_ids.tolist()]
    assert not torch.allclose(out, ref_out)
    good = REFERENCE_STAGES.with_(select=reference_select)
    out2, _ = _run_planned(_plan(p, 2, 6, 0.3, good), p)
    torch.testing.assert_close(out2, ref_out, rtol=1e-10, atol=1e-10)


def test_stage_resolution_and_registration() -> None:
    spec = StepSpec(DcpGeometry(1, 0, 1, 4), max_tokens=1, topk=4, num_heads=2, head_dim=8, v_dim=8, sm_scale=0.3,
                    dtype=torch.float32, device="cpu")  # fmt: skip
    with pytest.raises(ValueError, match="stages must be 'reference'"):
        resolve_stages("fastest", spec)
    with pytest.raises(TypeError, match="stages must be a Stages value or a name"):
        resolve_stages(3, spec)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="spec must be a dcp_ref"):
        resolve_stages("reference", "cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown stage"):
        REFERENCE_STAGES.with_(selct=reference_select)
    with pytest.raises(TypeError, match="select must be callable"):
        Stages(select=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attention_layout must be one of"):
        Stages(attention_layout="sparse")
    seen = []
    register_stages("mine", lambda spec: seen.append(spec) or REFERENCE_STAGES.with_(name="mine"))
    assert resolve_stages("mine", spec).name == "mine" and seen == [spec]  # the factory gets the spec itself
    assert PlannedStep(SingleGroup(), spec, "mine").stages.name == "mine"  # a name, resolved for the spec
    with pytest.raises(ValueError, match="reserved"):
        register_stages("reference", lambda *a, **k: REFERENCE_STAGES)


def test_masked_layout_skips_compaction() -> None:
    """An attention that reads uncompacted slots (-1 anywhere) gets them: same answer as compacted."""
    from dcp_ref.stages import reference_attention

    seen: list[torch.Tensor] = []

    def masked_attention(q, kv_cache, slots, counts, sm_scale, v_dim, *, out=None, out_lse=None):
        seen.append(slots.clone())
        order = torch.argsort((slots < 0).to(torch.int8), dim=1, stable=True)  # compact here, for the reference
        return reference_attention(
            q, kv_cache, torch.gather(slots, 1, order), counts, sm_scale, v_dim, out=out, out_lse=out_lse
        )

    p = make_dcp_problem(2, 1, seq_lens=[40, 33], next_n=1, num_heads=2, head_dim=8, block_size=4, seed=2)
    st = REFERENCE_STAGES.with_(attention=masked_attention, attention_layout="masked")
    out, lse = _run_planned(_plan(p, 2, 7, 0.3, st), p)
    ref_out, ref_lse, _ = single_device_decode(p, 7, 0.3)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-10)
    # a valid slot after a -1 somewhere: the attention saw the uncompacted layout
    assert any(bool((((s < 0).cumsum(1) > 0) & (s >= 0)).any()) for s in seen), "slots were compacted"


# ---- GPU ------------------------------------------------------------------------------------------
def _gpu_problem(world_size: int, interleave: int, seed: int, num_heads: int = 128, next_n: int = 2):
    p = make_dcp_problem(
        world_size,
        interleave,
        seq_lens=[3000, 41, 2500],
        next_n=next_n,
        num_heads=num_heads,
        head_dim=576,
        block_size=64,
        seed=seed,
    )
    return p, p.to("cuda", torch.bfloat16)


def _gpu_plan(gpu_problem, world, rank: int, max_tokens: int, topk: int) -> PlannedStep:
    from dcp_ref.kernels.stages import kernel_stages

    spec = StepSpec(
        gpu_problem.geometry(rank),
        max_tokens=max_tokens,
        topk=topk,
        num_heads=gpu_problem.q.shape[1],
        head_dim=576,
        v_dim=512,
        sm_scale=192**-0.5,
        dtype=torch.bfloat16,
        device="cuda",
    )
    st = kernel_stages(spec)
    return PlannedStep(world.groups[rank] if world is not None else SingleGroup(), spec, st)


def _check_against_oracle(out, lse, problem, topk) -> None:
    ref_out, ref_lse, _ = single_device_decode(problem, topk, 192**-0.5)
    ref = ref_out[..., :512]
    rel = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel  # bf16 inputs and outputs
    torch.testing.assert_close(lse.double().cpu(), ref_lse, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("world_size,interleave", [(1, 1), (2, 1), (2, 64)])
def test_planned_step_on_gpu_kernels(cuda_device, world_size: int, interleave: int) -> None:
    """SimulatedWorld ranks are threads on one GPU: planning compiles under the lock (no abort)."""
    cpu, gpu = _gpu_problem(world_size, interleave, seed=3)
    world = SimulatedWorld(world_size)
    steps = [_gpu_plan(gpu, world, r, 8, 2048) for r in range(world_size)]
    traces = [dict() for _ in range(world_size)]

    def body(group, step, shard, tr):
        out, lse = step.run(gpu.q, shard, gpu.metadata(group.rank, "cuda"), trace=tr)
        return out.clone(), lse.clone()

    res = world.run(body, steps, gpu.shards, traces)
    out, lse = torch.cat([o for o, _ in res], 1), torch.cat([l for _, l in res], 1)
    _, _, ref_ids = single_device_decode(cpu, 2048, 192**-0.5)
    for tr in traces:  # the CuTeDSL top-K returns a set per row
        assert [sorted(r) for r in tr["global_ids"].long().cpu().tolist()] == [sorted(r) for r in ref_ids.tolist()]
    # Each trace names the stages its step planned; W = 1 has no correct stage (nothing to combine), W > 1 runs it.
    assert [tr["impl"] for tr in traces] == [step.impls for step in steps]
    ran = steps[0].impls
    assert ("correct" in ran) == (world_size > 1) and "combine" not in ran, ran
    # Every stage it ran but the attention (chosen per planned shape) is the kernel kernel_stages picks for the
    # device (the top-K: 2048 x W candidates fit the CuTeDSL kernel, so the plan keeps it).
    from dcp_ref.kernels.stages import kernel_stage_impls

    want = kernel_stage_impls("cuda", torch.bfloat16, 576, 512, num_heads=gpu.q.shape[1], topk=2048)
    assert {s: ran[s] for s in ran if s != "attention"} == {s: want[s] for s in ran if s != "attention"}, (ran, want)
    _check_against_oracle(out, lse, cpu, 2048)


@pytest.mark.gpu
def test_captured_step_replays_new_inputs_without_sync(cuda_device) -> None:
    """W = 1: capture once, copy new q / scores / metadata in place, replay == eager == oracle; the run
    makes no host sync (CUDA sync debug mode raises on one)."""
    cpu_a, gpu_a = _gpu_problem(1, 1, seed=5)
    cpu_b, gpu_b = _gpu_problem(1, 1, seed=6)
    step = _gpu_plan(gpu_a, None, 0, gpu_a.q.shape[0], 2048)
    shard = gpu_a.shards[0]
    meta = gpu_a.metadata(0, "cuda")
    if step.impls["attention"] == "flashinfer":  # the one kernel attention that plans on the host, every call
        pytest.skip("the plan runs FlashInfer's MLA, whose plan() reads the counts on the host: not capturable")
    # The first run makes what is cached per shape and thread (compilations, the split-KV / indexer workspaces)
    # outside the graph, as benchmarks/bench_step.py does; it also must not synchronise.
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager_out, eager_lse = (t.clone() for t in step.run(gpu_a.q, shard, meta))  # raises on any sync
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = step.capture(gpu_a.q, shard, meta)  # whatever attention the plan chose (step.impls)
    out, lse = graph.replay()
    torch.testing.assert_close(out, eager_out, rtol=1e-2, atol=1e-2)  # bf16; the top-K's order within a row may vary
    torch.testing.assert_close(lse, eager_lse, rtol=1e-3, atol=1e-3)
    _check_against_oracle(out, lse, cpu_a, 2048)
    # new data, same addresses: the graph reads the captured inputs
    gpu_a.q.copy_(gpu_b.q)
    shard.index_scores.copy_(gpu_b.shards[0].index_scores)
    shard.kv_cache.copy_(gpu_b.shards[0].kv_cache)
    shard.block_table.copy_(gpu_b.shards[0].block_table)
    meta.copy_(gpu_b.metadata(0, "cuda"))
    out, lse = graph.replay()
    _check_against_oracle(out, lse, cpu_b, 2048)


@pytest.mark.gpu
def test_step_over_nccl_on_two_gpus(cuda_device, tmp_path) -> None:
    """Two processes, NCCL, the planned step on the kernels (eager and CUDA-graph replay) and on the
    reference stages, each rank's head shard against the oracle."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        "29517",
        str(HERE / "step_nccl_worker.py"),
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    cpu, _ = _gpu_problem(2, 1, seed=8)
    for label in ("kernels_eager", "kernels_graph", "reference"):
        outs = [torch.load(tmp_path / f"rank{r}_{label}.pt") for r in range(2)]
        out = torch.cat([o["out"] for o in outs], 1)
        lse = torch.cat([o["lse"] for o in outs], 1)
        _check_against_oracle(out, lse, cpu, 2048)
    # FP8 cache: the oracle reads the dequantized KV
    from dcp_ref.fp8_cache import dequantize_kv_fp8, quantize_kv_fp8

    deq = dataclasses.replace(
        cpu, kv_global=[dequantize_kv_fp8(quantize_kv_fp8(k.to(torch.bfloat16))).double() for k in cpu.kv_global]
    )
    outs = [torch.load(tmp_path / f"rank{r}_fp8.pt") for r in range(2)]
    assert outs[0]["impl"]["attention"] == "flashmla-fp8"
    _check_against_oracle(torch.cat([o["out"] for o in outs], 1), torch.cat([o["lse"] for o in outs], 1), deq, 2048)
