"""Inputs shared by ``bench_scoring.py`` and ``peer_deepgemm_logits.py`` (the same seed, the same bytes; timing:
``_timing.py``).

Both scripts run as scripts (``python3 benchmarks/x.py``), so this folder is on ``sys.path``. This module
imports torch and the project's plain-PyTorch reference only — never cutlass, flashinfer or deep_gemm —
because the DeepGEMM peer runs in its own process with its own (clashing) apache-tvm-ffi.

The problem (one DCP rank's decode layer, as the scoring stage sees it): ``T`` query tokens in ``B = T /
next_n`` requests of ``next_n`` consecutive tokens each (``next_n = 1``: one token per request; ``next_n = 2``:
multi-token prediction, MTP), each request with ``L`` local keys; token ``i`` (0-based) of its request sees the
first ``L - next_n + 1 + i`` of them (causal: the last token sees all ``L``; ``next_n = 1``: every key); the
DeepSeek V3.2 indexer's 64 heads x 128 dims; the FP8 index-key cache paged in blocks of 64 tokens
(132 bytes per token: the block's 64 x 128 e4m3 values, then its 64 float32 scales), blocks handed out
in a shuffled order. Keys: random e4m3 bytes (every finite code, random sign) with a power-of-two scale
per token in [2**-9, 2**-6]; queries: standard-normal values rounded to e4m3; weights: normal / 8.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # the project, when it is not installed (the DeepGEMM peer's process)
    sys.path.insert(0, ROOT)


#: ``(T, L)`` at ``next_n = 1`` (``B = T``).
SHAPES = [(t, n) for t in (1, 32, 128) for n in (4096, 32768, 131072)]
QUICK = [(32, 32768), (1, 131072)]
MTP_NEXT_N = 2
#: ``(T, L)`` at ``next_n = 2`` (MTP): ``T`` query tokens, ``B = T / 2`` requests in {1, 32, 128}.
MTP_SHAPES = [(2 * b, n) for b in (1, 32, 128) for n in (4096, 32768, 131072)]
QUICK_MTP = [(64, 32768), (2, 131072)]
#: ``(T, L, next_n)`` the launch sweep also times (not in the summary): the layer's local context (8K at W = 1).
SWEEP_ONLY = [(1, 8192, 1), (32, 8192, 1), (128, 8192, 1), (64, 8192, 2)]
HEADS = 64
DIM = 128
BLOCK = 64
TOPK = 2048
REF_ROWS = 4  # rows checked against the float64 reference (the reference's cost grows with T * L)
#: Hopper H200 dense FP8 tensor-core peak (no sparsity), FLOP/s, for the compute floor.
FP8_PEAK_FLOPS = 1979e12


def seed_of(t: int, n: int) -> int:
    return 1000 * t + n // 64


def all_shapes(quick: bool = False) -> list[tuple[int, int, int]]:
    """``(T, L, next_n)`` of both families: :data:`SHAPES` at ``next_n = 1``, then :data:`MTP_SHAPES` at 2."""
    one, mtp = (QUICK, QUICK_MTP) if quick else (SHAPES, MTP_SHAPES)
    return [(t, n, 1) for t, n in one] + [(t, n, MTP_NEXT_N) for t, n in mtp]


def build_inputs(
    t: int, n: int, device: str = "cuda", seed: int | None = None, next_n: int = 1
) -> dict[str, torch.Tensor]:
    """The scoring problem of ``T = t`` tokens in ``B = t / next_n`` requests over ``L = n`` local keys each
    (module docstring).

    Returns ``index_q`` float8_e4m3fn ``[T, 64, 128]``, ``weights`` float32 ``[T, 64]``, ``index_cache``
    uint8 ``[B * n / 64, 64 * 132]``, ``block_table`` int32 ``[B, n / 64]``, ``req_of_token`` int32 ``[T]``
    (``arange(B)`` each repeated ``next_n`` times), ``local_bounds`` int32 ``[T]`` (token ``i`` of its request:
    ``n - next_n + 1 + i``; all ``n`` at ``next_n = 1``). At ``next_n = 1`` the bytes are those this function
    made before it took ``next_n`` (the same generator calls in the same order).
    """
    assert n % BLOCK == 0
    assert next_n >= 1 and t % next_n == 0, f"T = {t} is not a multiple of next_n = {next_n}"
    assert n >= next_n, (n, next_n)
    g = torch.Generator(device=device).manual_seed(seed_of(t, n) if seed is None else seed)
    nblk = n // BLOCK
    b = t // next_n
    num_blocks = b * nblk
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
    pos = torch.arange(next_n, device=device, dtype=torch.int32).repeat(b)  # each token's place in its request
    return {
        "index_q": q,
        "weights": w,
        "index_cache": cache,
        "block_table": perm.view(b, nblk).contiguous(),
        "req_of_token": torch.arange(b, device=device, dtype=torch.int32).repeat_interleave(next_n),
        "local_bounds": (n - next_n + 1) + pos,
    }


def next_n_of(inp: dict[str, torch.Tensor]) -> int:
    """The ``next_n`` that :func:`build_inputs` made ``inp`` with: ``T / B``."""
    t, b = inp["index_q"].shape[0], inp["block_table"].shape[0]
    assert b > 0 and t % b == 0, (t, b)
    return t // b


def reference_rows(inp: dict[str, torch.Tensor], rows: int = REF_ROWS) -> torch.Tensor:
    """The float64 oracle (:func:`dcp_ref.scoring.index_scores`, rounded to float32) of the first ``rows`` tokens,
    rounded up to whole requests (``next_n`` tokens each); ``-inf`` past each token's bound.

    The oracle scores each token on its own (``req_of_token`` names its request's block-table row), so the
    scores are those of any ``next_n``: it is called without that keyword."""
    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.scoring import index_scores

    nn = next_n_of(inp)
    r = min(-(-rows // nn) * nn, inp["index_q"].shape[0])
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


def device_info() -> dict[str, Any]:
    p = torch.cuda.get_device_properties(0)
    return {"name": p.name, "sms": p.multi_processor_count, "capability": f"{p.major}.{p.minor}"}


def floors(t: int, n: int, bandwidth: float, out_bytes: int, next_n: int = 1) -> dict[str, Any]:
    """The read floor (the keys once per request, ``(T / next_n) * L * 132`` bytes, plus ``out_bytes`` written,
    at the measured copy bandwidth) and the FP8 compute floor (``2 * T * L * 64 * 128`` FLOP at the dense peak:
    every token scores every key); which binds."""
    assert t % next_n == 0, (t, next_n)
    read_us = ((t // next_n) * n * (DIM + 4) + out_bytes) / bandwidth * 1e6
    compute_us = 2 * t * n * HEADS * DIM / FP8_PEAK_FLOPS * 1e6
    return {
        "read_floor_us": read_us,
        "compute_floor_us": compute_us,
        "binds": "read" if read_us >= compute_us else "compute",
    }
