"""Inputs and timing shared by ``bench_scoring.py`` and ``peer_deepgemm_logits.py`` (the same seed, the same bytes).

Both scripts run as scripts (``python3 benchmarks/x.py``), so this folder is on ``sys.path``. This module
imports torch and the project's plain-PyTorch reference only — never cutlass, flashinfer or deep_gemm —
because the DeepGEMM peer runs in its own process with its own (clashing) apache-tvm-ffi.

The problem (one DCP rank's decode layer, as the scoring stage sees it): ``T`` query tokens, one request
per token (``B = T``, ``next_n = 1``), each with ``L`` local keys, all valid (``local_bounds = L``); the
DeepSeek V3.2 indexer's 64 heads x 128 dims; the FP8 index-key cache paged in blocks of 64 tokens
(132 bytes per token: the block's 64 x 128 e4m3 values, then its 64 float32 scales), blocks handed out
in a shuffled order. Keys: random e4m3 bytes (every finite code, random sign) with a power-of-two scale
per token in [2**-9, 2**-6]; queries: standard-normal values rounded to e4m3; weights: normal / 8.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the project, when it is not installed (the DeepGEMM peer's process)
    sys.path.insert(0, ROOT)

from _graphs import capture  # noqa: E402  (this folder is on sys.path: the benchmarks run as scripts)

SHAPES = [(t, n) for t in (1, 32, 128) for n in (4096, 32768, 131072)]
QUICK = [(32, 32768), (1, 131072)]
HEADS = 64
DIM = 128
BLOCK = 64
TOPK = 2048
REF_ROWS = 4  # rows checked against the float64 reference (the reference's cost grows with T * L)
#: Hopper H200 dense FP8 tensor-core peak (no sparsity), FLOP/s, for the compute floor.
FP8_PEAK_FLOPS = 1979e12


def seed_of(t: int, n: int) -> int:
    return 1000 * t + n // 64


def build_inputs(t: int, n: int, device: str = "cuda", seed: int | None = None) -> dict[str, torch.Tensor]:
    """The scoring problem of ``T = t`` tokens over ``L = n`` local keys each (module docstring).

    Returns ``index_q`` float8_e4m3fn ``[T, 64, 128]``, ``weights`` float32 ``[T, 64]``, ``index_cache``
    uint8 ``[num_blocks, 64 * 132]``, ``block_table`` int32 ``[T, n / 64]``, ``req_of_token`` int32 ``[T]``,
    ``local_bounds`` int32 ``[T]`` (all ``n``).
    """
    assert n % BLOCK == 0
    g = torch.Generator(device=device).manual_seed(seed_of(t, n) if seed is None else seed)
    nblk = n // BLOCK
    num_blocks = t * nblk
    cache = torch.empty((num_blocks, BLOCK * (DIM + 4)), dtype=torch.uint8, device=device)
    # values: random e4m3 bytes; the two NaN codes (0x7F, 0xFF) become their finite neighbours 0x7E, 0xFE
    codes = torch.randint(0, 256, (num_blocks, BLOCK * DIM), device=device, generator=g, dtype=torch.uint8)
    cache[:, : BLOCK * DIM] = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)
    del codes
    exps = torch.randint(-9, -5, (num_blocks, BLOCK), device=device, generator=g).float()
    cache[:, BLOCK * DIM :] = torch.exp2(exps).contiguous().view(torch.uint8)
    perm = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32)
    q = torch.randn((t, HEADS, DIM), device=device, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn((t, HEADS), device=device, generator=g) / 8
    return {
        "index_q": q,
        "weights": w,
        "index_cache": cache,
        "block_table": perm.view(t, nblk).contiguous(),
        "req_of_token": torch.arange(t, device=device, dtype=torch.int32),
        "local_bounds": torch.full((t,), n, device=device, dtype=torch.int32),
    }


def reference_rows(inp: dict[str, torch.Tensor], rows: int = REF_ROWS) -> torch.Tensor:
    """The float64 oracle (:func:`dcp_ref.scoring.index_scores`, rounded to float32) of the first ``rows`` tokens."""
    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.scoring import index_scores

    r = min(rows, inp["index_q"].shape[0])
    n = inp["block_table"].shape[1] * BLOCK
    out = torch.empty((r, n), dtype=torch.float32, device=inp["index_q"].device)
    return index_scores(
        inp["index_q"][:r], inp["weights"][:r], inp["index_cache"], inp["block_table"], inp["req_of_token"][:r],
        inp["local_bounds"][:r], DcpGeometry(1, 0, 1, BLOCK), out=out,
    )  # fmt: skip


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |got - ref| / max |ref|`` over the reference's finite entries (``got`` may have more rows)."""
    g = got[: ref.shape[0], : ref.shape[1]].double()
    r = ref.double()
    fin = torch.isfinite(r)
    if not bool(fin.any()):
        return 0.0
    if not bool(torch.isfinite(g[fin]).all()):
        return float("inf")
    return float((g[fin] - r[fin]).abs().max() / r[fin].abs().max().clamp_min(1e-30))


# ---- timing ----------------------------------------------------------------------------------------
def do_bench_us(fn: Callable[[], Any]) -> dict[str, float]:
    import triton.testing

    q = triton.testing.do_bench(fn, warmup=10, rep=60, quantiles=[0.5, 0.2, 0.8])
    return {"median_us": q[0] * 1e3, "p20_us": q[1] * 1e3, "p80_us": q[2] * 1e3}


def reps_for(fn: Callable[[], Any]) -> int:
    """About 2 ms of work per graph replay, 1..20 calls."""
    import triton.testing

    t_us = triton.testing.do_bench(fn, warmup=2, rep=10) * 1e3
    return max(1, min(20, int(2000 / max(t_us, 1e-3))))


def graph_time(fn: Callable[[], Any], reps: int | None = None) -> dict[str, Any]:
    """Device time per call: a CUDA graph of ``reps`` calls replayed under do_bench, / reps. A call that
    cannot be captured is timed eagerly with CUDA events (``timing: "events"``), with the reason."""
    reps = reps or reps_for(fn)
    try:
        g = capture(fn, calls=reps)
        r = do_bench_us(g.replay)
        del g
        return {k: v / reps for k, v in r.items()} | {"reps": reps, "timing": "graph"}
    except Exception as e:  # noqa: BLE001 - recorded, then timed another way
        torch.cuda.synchronize()
        return do_bench_us(fn) | {"timing": "events", "capture_error": f"{type(e).__name__}: {e}"[:300]}


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device copy (read + write), measured in this run."""
    import triton.testing

    n = 1 << 28
    src = torch.empty(n, dtype=torch.int32, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200)
    return 2 * n * 4 / (ms * 1e-3)


def device_info() -> dict[str, Any]:
    p = torch.cuda.get_device_properties(0)
    return {"name": p.name, "sms": p.multi_processor_count, "capability": f"{p.major}.{p.minor}"}


def floors(t: int, n: int, bandwidth: float, out_bytes: int) -> dict[str, Any]:
    """The read floor (the keys, ``T * L * 132`` bytes, plus ``out_bytes`` written, at the measured copy
    bandwidth) and the FP8 compute floor (``2 * T * L * 64 * 128`` FLOP at the dense peak); which binds."""
    read_us = (t * n * (DIM + 4) + out_bytes) / bandwidth * 1e6
    compute_us = 2 * t * n * HEADS * DIM / FP8_PEAK_FLOPS * 1e6
    return {
        "read_floor_us": read_us,
        "compute_floor_us": compute_us,
        "binds": "read" if read_us >= compute_us else "compute",
    }
