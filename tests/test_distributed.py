"""The same SPMD code over real torch.distributed collectives (gloo, CPU processes).

`TorchDistributedGroup` is what a multi-GPU run uses (with NCCL); gloo exercises the identical
code path on CPU, so CI checks that the collectives are wired as the simulation assumes: one
process per rank, each running `dcp_decode_step` on its shard (with the reference stages and with
``stages="kernels"``), merged heads compared with the single-device oracle.
"""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dcp_ref.group import SimulatedWorld, TorchDistributedGroup
from dcp_ref.pipeline import dcp_decode_step, make_dcp_problem, single_device_decode

TOPK, HEAD_DIM = 6, 16


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _problem(world_size: int):
    return make_dcp_problem(
        world_size, 2, seq_lens=[45, 6, 19], next_n=2, num_heads=6, head_dim=HEAD_DIM, block_size=4, seed=11
    )


def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        group = TorchDistributedGroup()
        # Raw collectives first: stacked all-gather and reduce-scatter along a non-leading dim.
        x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * rank
        gathered = group.all_gather(x)
        y = torch.arange(2 * 3 * world_size, dtype=torch.float64).reshape(2, 3 * world_size) * (rank + 1)
        scattered = group.reduce_scatter(y, dim=1)
        a2a = group.all_to_all(torch.stack([torch.full((3,), 10.0 * rank + j) for j in range(world_size)]))
        problem = _problem(world_size)
        out, lse = dcp_decode_step(
            group,
            problem.q,
            problem.shards[rank],
            problem.seq_lens,
            problem.next_n,
            TOPK,
            1 / math.sqrt(HEAD_DIM),
        )
        # The kernel path over the same collectives (Triton interpreted: TRITON_INTERPRET is inherited).
        kout, klse = dcp_decode_step(
            group,
            problem.q,
            problem.shards[rank],
            problem.seq_lens,
            problem.next_n,
            TOPK,
            1 / math.sqrt(HEAD_DIM),
            stages="kernels",
        )
        # The layer's other exchange: the query gathered over heads, partials combined by one all-to-all.
        from dcp_ref.stages import StepSpec
        from dcp_ref.step import PlannedStep

        H = problem.q.shape[1]
        spec = StepSpec(problem.geometry(rank), max_tokens=problem.q.shape[0], topk=TOPK, num_heads=H,
                        head_dim=HEAD_DIM, v_dim=HEAD_DIM, sm_scale=1 / math.sqrt(HEAD_DIM), dtype=torch.float64,
                        device="cpu", combine="alltoall", q_replicate=False)  # fmt: skip
        hs = H // world_size
        aout, alse = PlannedStep(group, spec).run(problem.q[:, rank * hs : (rank + 1) * hs].contiguous(),
                                                  problem.shards[rank], problem.metadata(rank))  # fmt: skip
        torch.save(
            {
                "gathered": gathered,
                "scattered": scattered,
                "a2a": a2a,
                "out": out,
                "lse": lse,
                "kout": kout,
                "klse": klse,
                "aout": aout.clone(),
                "alse": alse.clone(),
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_distributed_gloo_matches_oracle(world_size: int, tmp_path: Path) -> None:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.spawn(_worker, args=(world_size, _free_port(), str(tmp_path)), nprocs=world_size, join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]

    expected_gather = torch.stack(
        [torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * r for r in range(world_size)]
    )
    total = sum((r + 1) for r in range(world_size)) * torch.arange(2 * 3 * world_size, dtype=torch.float64).reshape(
        2, -1
    )
    for r, item in enumerate(res):
        assert torch.equal(item["gathered"], expected_gather)
        assert torch.equal(item["scattered"], total[:, 3 * r : 3 * (r + 1)])
        assert item["a2a"].tolist() == [[10.0 * j + r] * 3 for j in range(world_size)]  # rank j's chunk for r

    out = torch.cat([item["out"] for item in res], dim=1)
    lse = torch.cat([item["lse"] for item in res], dim=1)
    problem = _problem(world_size)
    ref_out, ref_lse, _ = single_device_decode(problem, TOPK, 1 / math.sqrt(HEAD_DIM))
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-10, atol=1e-12)
    aout = torch.cat([item["aout"] for item in res], dim=1)
    alse = torch.cat([item["alse"] for item in res], dim=1)
    torch.testing.assert_close(aout, ref_out, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(alse, ref_lse, rtol=1e-10, atol=1e-12)
    # backend="kernels": float32 partials, so float32 tolerances
    kout = torch.cat([item["kout"] for item in res], dim=1)
    klse = torch.cat([item["klse"] for item in res], dim=1)
    assert kout.dtype == torch.float32
    torch.testing.assert_close(kout.double(), ref_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(klse.double(), ref_lse, rtol=2e-6, atol=2e-6)


def test_simulated_group_mismatch_is_an_error() -> None:
    """A collective called with different shapes on different ranks fails loudly on every rank."""
    world = SimulatedWorld(2)
    with pytest.raises(ValueError, match="collective mismatch"):
        world.run(lambda g: g.all_gather(torch.zeros(g.rank + 1)))


def test_simulated_collectives_and_errors() -> None:
    world = SimulatedWorld(3)
    res = world.run(
        lambda g, x: (g.all_gather(x), g.reduce_scatter(x.repeat(3), dim=0)),
        [torch.tensor([float(r)]) for r in range(3)],
    )
    for gathered, scattered in res:
        assert gathered.flatten().tolist() == [0.0, 1.0, 2.0]
        assert scattered.tolist() == [3.0]  # 0 + 1 + 2, this rank's chunk
    with pytest.raises(ValueError, match="divisible by world_size"):
        world.run(lambda g: g.reduce_scatter(torch.zeros(4)))
    with pytest.raises(ValueError, match="per_rank_args"):
        world.run(lambda g, x: x, [1, 2])
    with pytest.raises(ValueError, match="world_size"):
        SimulatedWorld(0)


def test_the_collectives_benchmark_runs_on_gloo(tmp_path: Path) -> None:
    """benchmarks/bench_collectives.py, the multi-GPU exchange benchmark, as a smoke test on two CPU processes:
    every collective of the layer over both transports (symmetric memory falls back to gloo here, and says so)."""
    import subprocess
    import sys

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", f"--master_port={_free_port()}",
           str(root / "benchmarks" / "bench_collectives.py"), "--cpu", "--T", "1", "--out", str(tmp_path)]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=240)
    doc = json.loads((tmp_path / "exchange_W2.json").read_text())
    names = {r["collective"] for r in doc["rows"]}
    assert {"query_allgather", "candidates_allgather_scores", "combine_alltoall", "combine=alltoall",
            "combine=allgather+reduce_scatter"} <= names  # fmt: skip
    assert {r["transport"] for r in doc["rows"]} == {"nccl", "symm"}
    assert doc["transport_notes"]["symm"].startswith("fallback (no CUDA device)")
    scores = next(r for r in doc["rows"] if r["collective"] == "candidates_allgather_scores")
    pairs = next(r for r in doc["rows"] if r["collective"] == "candidates_allgather_pairs")
    assert pairs["bytes_per_rank"] == 2 * scores["bytes_per_rank"] == 8 * 2048  # rank_local: 4 bytes, not 8
