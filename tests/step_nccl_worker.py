"""Worker for tests/test_step.py::test_step_over_nccl_on_two_gpus (run by torch.distributed.run).

Each rank builds the same problem (fixed seed), plans the step once over NCCL, and saves its head
shard for: the kernels eager, the kernels replayed from a CUDA graph (NCCL captured), the reference.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dcp_ref.group import TorchDistributedGroup
from dcp_ref.kernels.stages import kernel_stages
from dcp_ref.pipeline import RankShard, make_dcp_problem
from dcp_ref.stages import REFERENCE_STAGES, StepSpec
from dcp_ref.step import PlannedStep


def main(out_dir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    try:
        group = TorchDistributedGroup()
        p = make_dcp_problem(
            world, 1, seq_lens=[3000, 41, 2500], next_n=2, num_heads=128, head_dim=576, block_size=64, seed=8
        ).to(f"cuda:{rank}", torch.bfloat16)
        shard, meta = p.shards[rank], p.metadata(rank, f"cuda:{rank}")
        T = p.q.shape[0]
        spec = StepSpec(
            p.geometry(rank),
            max_tokens=T,
            topk=2048,
            num_heads=128,
            head_dim=576,
            v_dim=512,
            sm_scale=192**-0.5,
            dtype=torch.bfloat16,
            device=f"cuda:{rank}",
        )
        step = PlannedStep(group, spec, kernel_stages(spec))
        out, lse = step.run(p.q, shard, meta)
        torch.save({"out": out.cpu(), "lse": lse.cpu()}, Path(out_dir) / f"rank{rank}_kernels_eager.pt")
        graph = step.capture(p.q, shard, meta)
        out.zero_()
        out, lse = graph.replay()
        torch.cuda.synchronize()
        torch.save({"out": out.cpu(), "lse": lse.cpu()}, Path(out_dir) / f"rank{rank}_kernels_graph.pt")
        ref = PlannedStep(group, spec, REFERENCE_STAGES)
        out, lse = ref.run(p.q, shard, meta)
        torch.save({"out": out.cpu(), "lse": lse.cpu()}, Path(out_dir) / f"rank{rank}_reference.pt")
        # the same step on an FP8 (fp8_ds_mla) cache: FlashMLA's FP8 decode, masked layout
        from dcp_ref.fp8_cache import quantize_kv_fp8

        fp8_shard = RankShard(quantize_kv_fp8(shard.kv_cache), shard.block_table, shard.index_scores, shard.geometry)
        fp8_spec = dataclasses.replace(spec, kv_format="fp8_ds_mla")
        fp8 = PlannedStep(group, fp8_spec, kernel_stages(fp8_spec))
        out, lse = fp8.run(p.q, fp8_shard, meta)
        torch.save({"out": out.cpu(), "lse": lse.cpu(), "impl": fp8.impls}, Path(out_dir) / f"rank{rank}_fp8.pt")
        torch.cuda.synchronize()
        dist.barrier()
    finally:
        # destroy_process_group() hung on the H200s after an NCCL collective had been captured in a CUDA graph
        # (every result was already written): leave without tearing NCCL down.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
