"""The DCP step on an FP8 (fp8_ds_mla, 656 bytes per token) KV cache, end to end.

Each rank's cache is the FP8 quantization of its shard; the oracle is single-device attention over
the dequantized global KV (what the FP8 kernel reads). The attention stage reads the uncompacted
slots (masked layout), so no compaction runs. CPU: the FP8 reference and the kernel path (Triton
interpreted) on simulated ranks; GPU: FlashMLA's FP8 decode on one GPU, W = 1 and 2.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dcp_ref.fp8_cache import dequantize_kv_fp8, quantize_kv_fp8
from dcp_ref.geometry import DcpGeometry
from dcp_ref.pipeline import RankShard, make_dcp_problem, run_dcp_decode, single_device_decode
from dcp_ref.stages import FP8_REFERENCE_STAGES, StepSpec, kv_format_of, resolve_stages


def fp8_problem(world_size: int, interleave: int, seed: int, num_heads: int, seq_lens=(37, 5, 64), next_n=2):
    """(problem with FP8 shards, problem whose global KV is the dequantized FP8 — the oracle's input)."""
    p = make_dcp_problem(
        world_size,
        interleave,
        seq_lens=list(seq_lens),
        next_n=next_n,
        num_heads=num_heads,
        head_dim=576,
        block_size=8,
        seed=seed,
    )
    shards = [RankShard(quantize_kv_fp8(s.kv_cache), s.block_table, s.index_scores, s.geometry) for s in p.shards]
    deq = [dequantize_kv_fp8(quantize_kv_fp8(k)).double() for k in p.kv_global]
    return dataclasses.replace(p, shards=shards), dataclasses.replace(p, kv_global=deq)


@pytest.mark.parametrize("stages", ["reference", "kernels"])
@pytest.mark.parametrize("world_size,interleave", [(1, 1), (2, 1), (3, 2), (4, 8)])
def test_fp8_step_equals_dequantized_oracle(stages: str, world_size: int, interleave: int) -> None:
    fp, oracle = fp8_problem(world_size, interleave, seed=world_size + interleave, num_heads=2 * world_size)
    traces = [dict() for _ in range(world_size)]
    out, lse = run_dcp_decode(fp, 9, 0.05, traces, stages=stages)
    ref_out, ref_lse, ref_ids = single_device_decode(oracle, 9, 0.05)
    tol = 1e-10 if stages == "reference" else 3e-6
    assert out.shape[-1] == 512  # the FP8 layout's values are its 512 NoPE dims
    torch.testing.assert_close(out.double(), ref_out[..., :512], rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=tol, atol=tol)
    for tr in traces:
        assert tr["impl"]["attention"] in ("torch-fp8", "flashmla-fp8")
        assert [sorted(r) for r in tr["global_ids"].tolist()] == [sorted(r) for r in ref_ids.tolist()]
    if world_size > 1:  # masked layout: the attention saw -1 between valid slots (nothing was compacted)
        s = traces[0]["slots"]
        assert bool((((s < 0).cumsum(1) > 0) & (s >= 0)).any())


def test_kv_format_detection_and_stage_choice() -> None:
    fp, _ = fp8_problem(2, 1, seed=0, num_heads=2)
    assert kv_format_of(fp.shards[0].kv_cache) == "fp8_ds_mla"
    assert kv_format_of(fp.shards[0].kv_cache.view(torch.float8_e4m3fn)) == "fp8_ds_mla"
    assert kv_format_of(torch.zeros(4, 576, dtype=torch.bfloat16)) == "native"
    spec = StepSpec(DcpGeometry(1, 0, 1, 64), max_tokens=1, topk=4, num_heads=2, head_dim=576, v_dim=512,
                    sm_scale=0.1, dtype=torch.float64, device="cpu", kv_format="fp8_ds_mla")  # fmt: skip
    st = resolve_stages("reference", spec)
    assert st is FP8_REFERENCE_STAGES and st.attention_layout == "masked"
    with pytest.raises(ValueError, match="kv_format must be one of"):
        dataclasses.replace(spec, kv_format="fp4")


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_fp8_step_on_flashmla(cuda_device, world_size: int) -> None:
    """FlashMLA's FP8 sparse decode inside the step (bf16 queries, H = 64 per rank's view), vs the oracle."""
    fp, oracle = fp8_problem(world_size, 1, seed=7, num_heads=64, seq_lens=(3000, 41, 2500))
    gpu = fp.to(cuda_device, torch.bfloat16)  # the uint8 caches keep their dtype
    traces = [dict() for _ in range(world_size)]
    out, lse = run_dcp_decode(gpu, 2048, 192**-0.5, traces, stages="kernels")
    assert traces[0]["impl"]["attention"] == "flashmla-fp8"
    ref_out, ref_lse, _ = single_device_decode(oracle, 2048, 192**-0.5)
    ref = ref_out[..., :512]
    rel = ((out.double().cpu() - ref).norm() / ref.norm()).item()
    assert rel < 2e-2, rel
    torch.testing.assert_close(lse.double().cpu(), ref_lse, rtol=2e-2, atol=2e-2)
