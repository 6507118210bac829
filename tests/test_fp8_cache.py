"""The FP8 cache layout (DeepSeek V3.2 / FlashMLA ``V32_FP8Sparse`` / vLLM ``fp8_ds_mla``).

CPU: byte layout; quantization against an independent re-implementation of FlashMLA's reference
quantizer (``tests/quant.py`` of deepseek-ai/FlashMLA: ``log2().ceil()`` per tile, 1e-4 floor);
round-trip error per element bounded by the e4m3 step at its scale (hypothesis, magnitudes from
subnormal to 3e38); all-zero, tiny, huge and non-finite tiles; RoPE bytes bit-exact;
dequantization against a pure-Python decoding of the bytes (e4m3 bits, bf16 round-to-nearest-even
of the scale and of the product, as the SM90 kernel computes it), also for non-power-of-two
scales (vLLM's writer); the FP8 reference attention against a brute-force float64 softmax over
those values and against ``sparse_mla_attention`` over the dequantized cache (masked and compact
layouts); bad inputs; the FlashMLA wrapper's two Triton helpers through the interpreter.

GPU (``-m gpu``; H200 + sgl-flash-mla, ``source .gpu/flashinfer/env.sh``): FlashMLA's FP8 decode
against the reference (relative Frobenius error <= 1e-2, LSE within 5e-3), with empty rows,
scattered ``-1``, single-key rows, padding of K to 64, blocked caches, the compact layout,
validate on/off and a CUDA-graph replay with new slots.
"""

from __future__ import annotations

import itertools
import math
import struct
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_ref.attention import sparse_mla_attention
from dcp_ref.fp8_cache import (
    FP8_DS_MLA,
    Fp8CacheLayout,
    check_fp8_slots,
    dequantize_kv_fp8,
    fp8_cache_rows,
    fp8_tile_scales,
    quantize_kv_fp8,
    sparse_mla_attention_fp8,
)

INF = math.inf
BF16_MAX = float(torch.finfo(torch.bfloat16).max)


# ---- independent oracles ---------------------------------------------------------------------------
def e4m3_value(byte: int) -> float:
    """float8_e4m3fn decoded from its bits: 1 sign, 4 exponent (bias 7), 3 mantissa; S.1111.111 = NaN."""
    sign = -1.0 if byte & 0x80 else 1.0
    e, m = (byte >> 3) & 0xF, byte & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    if e == 0:
        return sign * m / 8 * 2.0**-6
    return sign * (1 + m / 8) * 2.0 ** (e - 7)


def bf16_rne(x: float) -> float:
    """Round a float32-representable value to bf16, nearest even (NaN stays NaN, overflow -> inf)."""
    if math.isnan(x) or math.isinf(x):
        return x
    try:
        b = struct.unpack("<I", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(INF, x)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", b))[0]


def oracle_dequant_row(row: list[int]) -> list[float]:
    """One 656-byte row -> 576 floats, as FlashMLA's SM90 kernel computes them (pure Python)."""
    scales = struct.unpack("<4f", bytes(row[512:528]))
    nope = [bf16_rne(e4m3_value(row[j]) * bf16_rne(scales[j // 128])) for j in range(512)]
    rope = [struct.unpack("<f", b"\x00\x00" + bytes(row[528 + 2 * i : 530 + 2 * i]))[0] for i in range(64)]
    return nope + rope


def flashmla_style_quantize(kv: torch.Tensor) -> torch.Tensor:
    """The rule of FlashMLA's tests/quant.py (V32_FP8Sparse), written independently: per tile,
    ``pow(2, ceil(log2(clamp_min(amax / 448, 1e-4))))``, divide, cast to e4m3; RoPE as bf16."""
    n = kv.shape[0]
    out = torch.zeros(n, 656, dtype=torch.uint8)
    for i in range(n):
        parts = []
        for t in range(4):
            tile = kv[i, t * 128 : (t + 1) * 128]
            s = torch.pow(2.0, torch.clamp_min(tile.abs().max().float() / 448.0, 1e-4).log2().ceil())
            out[i, t * 128 : (t + 1) * 128] = (tile.float() / s).to(torch.float8_e4m3fn).view(torch.uint8)
            parts.append(float(s))
        out[i, 512:528] = torch.tensor(list(struct.pack("<4f", *parts)), dtype=torch.uint8)
        out[i, 528:] = torch.tensor(list(kv[i, 512:].to(torch.bfloat16).view(torch.uint8)), dtype=torch.uint8)
    return out


def step_bound(x: float, scale: float) -> float:
    """Largest allowed |x - dequant(x)|: half an e4m3 step of x / scale, times the scale; a full
    step in the saturated top bin (|x| >= 248 * 2**120, see the module docstring)."""
    y = abs(x) / scale
    if y == 0:
        return 0.0
    e = max(math.floor(math.log2(y)), -6)  # e4m3: normal exponents from -6; subnormal step 2**-9
    half = 2.0 ** (e - 4)
    return (2 * half if abs(x) >= 248 * 2.0**120 else half) * scale


def make_rows(n: int, exps: list[int], seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """n rows of 576 values; NoPE tile t scaled by 2**exps[t % len]; RoPE randn."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 576, generator=g, dtype=torch.float64)
    for t in range(4):
        x[:, t * 128 : (t + 1) * 128] *= 2.0 ** exps[t % len(exps)]
    return x.clamp(-BF16_MAX, BF16_MAX).to(dtype)


# ---- the layout -------------------------------------------------------------------------------------
def test_layout_is_flashmla_v32() -> None:
    L = FP8_DS_MLA
    # FlashMLA's sparse_decode: bytes_per_token = 512 + 64*2 + (512/128)*4 for d_qk = 576.
    assert L.bytes_per_token == 512 + 64 * 2 + (512 // 128) * 4 == 656
    assert (L.scale_offset, L.rope_offset, L.head_dim, L.num_tiles, L.bf16_bytes_per_token) == (512, 528, 576, 4, 1152)
    segs = L.segments()
    assert segs[0][0] == 0 and segs[-1][1] == 656
    assert all(a[1] == b[0] for a, b in itertools.pairwise(segs))  # contiguous, in byte order
    assert L.min_scale_exponent == -13 == math.ceil(math.log2(1e-4))
    with pytest.raises(ValueError, match="tile_size"):
        Fp8CacheLayout(nope_dim=100, tile_size=64)


def test_bytes_match_flashmla_reference_quantizer() -> None:
    # Ordinary magnitudes (incl. tiles under the 1e-4 floor and a zero tile): identical bytes.
    rows = torch.cat([make_rows(6, [0, -3, 5, -20], 1), make_rows(3, [12, -9, 2, 0], 2)])
    rows[2, 128:256] = 0
    got = quantize_kv_fp8(rows)
    assert got.dtype == torch.uint8 and got.shape == (9, 656)
    assert torch.equal(got, flashmla_style_quantize(rows))


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 3),
    exps=st.lists(st.integers(-40, 126), min_size=4, max_size=4),
    zero_tile=st.integers(-1, 3),
    extreme_tile=st.integers(-1, 3),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_round_trip_bounded_per_tile(n, exps, zero_tile, extreme_tile, dtype, seed) -> None:
    kv = make_rows(n, exps, seed, dtype)
    if zero_tile >= 0:
        kv[:, zero_tile * 128 : (zero_tile + 1) * 128] = 0
    if extreme_tile >= 0:  # the largest bf16 magnitudes, both signs
        kv[0, extreme_tile * 128 : extreme_tile * 128 + 4] = torch.tensor(
            [BF16_MAX, -BF16_MAX, 3.3e38, 2.0**127], dtype=dtype
        )
    rows = quantize_kv_fp8(kv)
    deq = dequantize_kv_fp8(rows, dtype=torch.float64)
    assert bool(torch.isfinite(deq).all()), "a finite input must dequantize to finite values"
    x64 = kv.to(torch.float32).double()
    scales = rows[:, 512:528].contiguous().view(torch.float32).double()
    for i in range(n):
        for t in range(4):
            s = float(scales[i, t])
            m, _ = math.frexp(s)
            assert m == 0.5, f"scale {s} is not a power of two"
            amax = float(x64[i, t * 128 : (t + 1) * 128].abs().max())
            need = max(amax / 448.0, 1e-4)
            assert s >= need * (1 - 2**-23) and s / 2 < need, f"scale {s} is not the smallest power of two >= {need}"
            for j in range(t * 128, (t + 1) * 128):
                assert abs(float(x64[i, j]) - float(deq[i, j])) <= step_bound(float(x64[i, j]), s)
        # RoPE: the bf16 bytes of the input, bit for bit
        assert rows[i, 528:].tolist() == list(kv[i, 512:].to(torch.bfloat16).view(torch.uint8).tolist())
    # The kernel's arithmetic (pure Python over the bytes) gives the same values.
    assert deq[0].tolist() == oracle_dequant_row(rows[0].tolist())


def test_all_zero_tile_and_tiny_tiles() -> None:
    kv = torch.zeros(2, 576, dtype=torch.bfloat16)
    kv[1, :128] = -0.0
    kv[1, 128:256] = torch.linspace(-1e-5, 1e-5, 128)  # under the floor: scale 2**-13
    rows = quantize_kv_fp8(kv)
    assert rows[0, :512].tolist() == [0] * 512  # zero codes
    assert fp8_tile_scales(kv[:, :512]).tolist() == [[2.0**-13] * 4] * 2
    deq = dequantize_kv_fp8(rows, dtype=torch.float64)
    assert deq[0].abs().max().item() == 0.0 and deq[1, :128].abs().max().item() == 0.0
    x = kv[1, 128:256].double().tolist()
    assert all(abs(a - b) <= step_bound(a, 2.0**-13) for a, b in zip(x, deq[1, 128:256].tolist()))
    assert max(abs(a - b) for a, b in zip(x, deq[1, 128:256].tolist())) > 0  # (not trivially exact)


def test_non_finite_tiles_are_nan_and_rope_keeps_its_bits() -> None:
    kv = make_rows(3, [0], 3)
    kv[0, 5] = math.nan
    kv[1, 300] = INF
    kv[2, 520] = -INF
    kv[2, 530] = math.nan
    rows = quantize_kv_fp8(kv)
    deq = dequantize_kv_fp8(rows, dtype=torch.float64)
    assert bool(deq[0, :128].isnan().all()) and bool(deq[0, 128:].isfinite().all())
    assert (
        bool(deq[1, 256:384].isnan().all())
        and bool(deq[1, :256].isfinite().all())
        and bool(deq[1, 384:].isfinite().all())
    )
    assert bool(deq[2, :512].isfinite().all())
    assert rows[2, 528:].tolist() == list(kv[2, 512:].view(torch.uint8).tolist())
    assert deq[2, 520].item() == -INF and math.isnan(deq[2, 530].item())
    assert math.isnan(fp8_tile_scales(kv[:, :512])[1, 2].item())


def test_dequant_reads_any_float32_scale_like_the_kernel() -> None:
    # vLLM's writer stores scale = amax / 448 (not a power of two): the kernel rounds the scale and
    # the product to bf16. Hand-built rows, decoded in pure Python.
    g = torch.Generator().manual_seed(4)
    rows = torch.randint(0, 256, (3, 656), generator=g, dtype=torch.uint8)
    rows[rows == 0x7F] = 0x7E  # no NaN codes
    rows[rows == 0xFF] = 0xFE
    scales = torch.tensor([[0.0123, 3.7e-3, 1.9, 1e-4], [5.5, 7.1e-3, 0.0321, 2.5e-5], [1.0, 2.0, 0.5, 0.75]])
    rows[:, 512:528] = scales.view(torch.uint8)
    rows[:, 528:] = torch.randn(3, 64, generator=g).bfloat16().view(torch.uint8)
    deq = dequantize_kv_fp8(rows, dtype=torch.float64)
    for i in range(3):
        assert deq[i].tolist() == oracle_dequant_row(rows[i].tolist())
    assert dequantize_kv_fp8(rows[0]).dtype == torch.bfloat16  # default: the kernel's dtype
    assert torch.equal(dequantize_kv_fp8(rows.view(torch.float8_e4m3fn)), dequantize_kv_fp8(rows))
    # A code of 256 at scale 2**120 is 2**128: inf in bf16, as the kernel computes it. (The
    # quantizer never stores this; FlashMLA's reference quantizer does for |x| >= 248 * 2**120.)
    top = torch.zeros(1, 656, dtype=torch.uint8)
    top[0, 0] = 0x78  # e4m3 256
    top[0, 512:528] = torch.tensor([2.0**120, 1.0, 1.0, 1.0]).view(torch.uint8)
    assert dequantize_kv_fp8(top, dtype=torch.float64)[0, 0].item() == INF


def test_quantize_keeps_leading_dims_and_devices() -> None:
    kv = make_rows(6, [0], 5).reshape(2, 3, 576)
    rows = quantize_kv_fp8(kv)
    assert rows.shape == (2, 3, 656)
    assert torch.equal(rows.reshape(6, 656), quantize_kv_fp8(kv.reshape(6, 576)))
    assert torch.equal(fp8_cache_rows(rows.reshape(2, 3, 1, 656).view(torch.float8_e4m3fn)), rows.reshape(6, 656))
    assert dequantize_kv_fp8(rows).shape == (2, 3, 576)


# ---- the reference attention ------------------------------------------------------------------------
def brute_fp8_attention(q, rows, slots, sm_scale, v_dim=512):
    """Python floats over the oracle-dequantized rows; slot -1 = none (masked layout)."""
    T, H, _ = q.shape
    ql = q.double().tolist()
    cache: dict[int, list[float]] = {}
    out = torch.zeros(T, H, v_dim, dtype=torch.float64)
    lse = torch.full((T, H), -INF, dtype=torch.float64)
    for t in range(T):
        chosen = [int(s) for s in slots[t].tolist() if s >= 0]
        for s in chosen:
            if s not in cache:
                cache[s] = oracle_dequant_row(rows[s].tolist())
        for h in range(H):
            if not chosen:
                continue
            sc = [sm_scale * sum(a * b for a, b in zip(ql[t][h], cache[s])) for s in chosen]
            m = max(sc)
            e = [math.exp(x - m) for x in sc]
            z = sum(e)
            lse[t, h] = m + math.log(z)
            for j, s in enumerate(chosen):
                w = e[j] / z
                for d in range(v_dim):
                    out[t, h, d] += w * cache[s][d]
    return out, lse


def make_fp8_case(T, H, S, K, seed, p_none=0.4):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, 576, generator=g) * 0.5).bfloat16()
    cache = quantize_kv_fp8(make_rows(S, [0, 1, -1, 2], seed + 1))
    slots = torch.randint(0, S, (T, K), generator=g, dtype=torch.int64)
    slots[torch.rand(T, K, generator=g) < p_none] = -1
    return q, cache, slots


def test_reference_equals_brute_force_masked_layout() -> None:
    q, cache, slots = make_fp8_case(T=4, H=2, S=30, K=6, seed=7)
    slots[1] = -1  # an empty row
    slots[2] = torch.tensor([-1, -1, 9, -1, -1, 9])  # one key, listed twice: it counts twice (as in the kernel)
    sm = 192**-0.5
    out, lse = sparse_mla_attention_fp8(q, cache, slots, None, sm)
    ref_o, ref_l = brute_fp8_attention(q, cache, slots, sm)
    assert out.dtype == torch.float64 and out.shape == (4, 2, 512) and lse.shape == (4, 2)
    assert torch.allclose(out, ref_o, rtol=1e-10, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l)) and bool(torch.isneginf(lse[1]).all())
    fin = torch.isfinite(ref_l)
    assert torch.allclose(lse[fin], ref_l[fin], rtol=1e-12, atol=1e-12)
    assert out[1].abs().max().item() == 0.0
    # the duplicated key: log(2) above the single-key LSE, output = that key's values
    single, single_l = sparse_mla_attention_fp8(q[2:3], cache, torch.tensor([[9]]), None, sm)
    assert torch.allclose(lse[2], single_l[0] + math.log(2)) and torch.allclose(out[2], single[0])


@settings(max_examples=30, deadline=None)
@given(
    T=st.integers(1, 5),
    H=st.integers(1, 3),
    S=st.integers(1, 40),
    K=st.integers(0, 9),
    p_none=st.sampled_from([0.0, 0.3, 0.8, 1.0]),
    v_dim=st.sampled_from([512, 576, 7]),
    seed=st.integers(0, 10**6),
)
def test_reference_equals_attention_over_dequantized_cache(T, H, S, K, p_none, v_dim, seed) -> None:
    q, cache, slots = make_fp8_case(T, H, S, K, seed, p_none)
    sm = 0.07
    out, lse = sparse_mla_attention_fp8(q, cache, slots, None, sm, v_dim)
    # the same keys compacted to the front (stable), over the dequantized float64 cache
    valid = slots >= 0
    counts = valid.sum(1)
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    compact = torch.where(torch.arange(K) < counts[:, None], torch.gather(slots, 1, order), -1)
    deq = dequantize_kv_fp8(cache, dtype=torch.float64)
    ref_o, ref_l = sparse_mla_attention(q, deq, compact, counts, sm, v_dim=v_dim)
    assert torch.allclose(out, ref_o, rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_l))
    fin = torch.isfinite(ref_l)
    assert torch.allclose(lse[fin], ref_l[fin], rtol=1e-12, atol=1e-12)
    # the compact layout reads the same thing (garbage after the prefix is ignored)
    junk = compact.clone()
    junk[torch.arange(K) >= counts[:, None]] = 10**6
    o2, l2 = sparse_mla_attention_fp8(q, cache, junk, counts, sm, v_dim, attention_layout="compact")
    assert torch.allclose(o2, out, rtol=1e-12, atol=1e-13) and torch.equal(torch.isneginf(l2), torch.isneginf(lse))


def test_reference_writes_caller_buffers_and_reads_blocked_caches() -> None:
    q, cache, slots = make_fp8_case(T=3, H=2, S=32, K=5, seed=11)
    ob = torch.full((3, 2, 512), math.nan, dtype=torch.float32)
    lb = torch.full((3, 2), math.nan, dtype=torch.float32)
    o, l = sparse_mla_attention_fp8(
        q, cache.view(4, 8, 1, 656).view(torch.float8_e4m3fn), slots, None, 0.1, out=ob, out_lse=lb
    )
    ref_o, ref_l = sparse_mla_attention_fp8(q, cache, slots, None, 0.1)
    assert o is ob and l is lb
    assert torch.allclose(ob.double(), ref_o, atol=1e-6) and torch.allclose(lb.double(), ref_l, atol=1e-5)


def test_reference_without_validation_poisons_rows_it_cannot_read() -> None:
    q, cache, slots = make_fp8_case(T=5, H=2, S=20, K=6, seed=21)
    slots[1] = -1  # empty
    bad = slots.clone()
    bad[0, 2] = 20  # past the cache
    bad[3, 0] = -4  # not -1
    ref_o, ref_l = sparse_mla_attention_fp8(q, cache, slots, None, 0.1)
    with pytest.raises(ValueError, match="slots entries must be -1"):
        sparse_mla_attention_fp8(q, cache, bad, None, 0.1)
    o, l = sparse_mla_attention_fp8(q, cache, bad, None, 0.1, validate=False)
    for t in range(5):
        if t in (0, 3):
            assert bool(o[t].isnan().all()) and bool(l[t].isnan().all())
        else:
            assert torch.equal(o[t], ref_o[t]) and torch.equal(l[t], ref_l[t])
    # compact layout: a used -1 poisons, unused junk does not; counts out of [0, K] are clamped
    counts = torch.tensor([2, 0, 9, -3, 4])
    comp = torch.randint(0, 20, (5, 6), generator=torch.Generator().manual_seed(2))
    comp[0, 1] = -1  # used: poisons row 0
    comp[1, 0] = comp[3, 2] = comp[4, 5] = 10**6  # not used (past counts): ignored
    o, l = sparse_mla_attention_fp8(q, cache, comp, counts, 0.1, attention_layout="compact", validate=False)
    assert bool(o[0].isnan().all()) and bool(torch.isneginf(l[1]).all()) and bool(torch.isneginf(l[3]).all())
    used = torch.where(torch.arange(6) < counts.clamp(0, 6)[:, None], comp, -1)
    mo, ml = sparse_mla_attention_fp8(q, cache, used, None, 0.1, validate=False)
    assert torch.equal(o[2:5:2], mo[2:5:2]) and torch.equal(l[2:5:2], ml[2:5:2])


BAD = [
    (dict(q=torch.zeros(2, 1, 512)), ValueError, "q must be"),
    (dict(kv_cache=torch.zeros(8, 576)), TypeError, "kv_cache must have dtype"),
    (dict(kv_cache=torch.zeros(8, 600, dtype=torch.uint8)), ValueError, "656"),
    (dict(slots=torch.tensor([[0, -2]])), ValueError, "slots must be"),
    (dict(slots=torch.tensor([[0, 1], [8, -1]])), ValueError, r"-1 \(none\) or lie in \[0, num_slots=8\)"),
    (dict(slots=torch.tensor([[0.0, 1.0], [1.0, 2.0]])), TypeError, "slots must have dtype"),
    (dict(layout_="compact", counts=None), ValueError, "counts must be given"),
    (dict(layout_="compact", counts=torch.tensor([3, 0])), ValueError, "counts must satisfy"),
    (
        dict(layout_="compact", counts=torch.tensor([2, 1]), slots=torch.tensor([[0, 1], [9, -1]])),
        ValueError,
        r"slots\[t, :counts\[t\]\]",
    ),
    (dict(layout_="sorted"), ValueError, "attention_layout"),
    (dict(v_dim=600), ValueError, "v_dim must be <= 576"),
    (dict(v_dim=0), ValueError, "v_dim must be >= 1"),
    (dict(sm_scale=-1.0), ValueError, "sm_scale"),
    (dict(out=torch.zeros(2, 1, 511)), ValueError, "out must have shape"),
]


@pytest.mark.parametrize("bad,exc,msg", BAD, ids=[b[2][:24] for b in BAD])
def test_reference_rejects_bad_input(bad, exc, msg) -> None:
    args: dict[str, Any] = dict(
        q=torch.zeros(2, 1, 576),
        kv_cache=torch.zeros(8, 656, dtype=torch.uint8),
        slots=torch.tensor([[0, 1], [7, -1]]),
        counts=None,
        sm_scale=0.1,
        v_dim=512,
        out=None,
        layout_="masked",
    )
    args.update(bad)
    with pytest.raises(exc, match=msg):
        sparse_mla_attention_fp8(
            args["q"],
            args["kv_cache"],
            args["slots"],
            args["counts"],
            args["sm_scale"],
            args["v_dim"],
            out=args["out"],
            attention_layout=args["layout_"],
        )


def test_quantize_and_dequantize_reject_bad_input() -> None:
    with pytest.raises(ValueError, match=r"kv must be \[\.\.\., 576\]"):
        quantize_kv_fp8(torch.zeros(2, 512))
    with pytest.raises(TypeError, match="kv must have dtype"):
        quantize_kv_fp8(torch.zeros(2, 576, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"rows must be \[\.\.\., 656\]"):
        dequantize_kv_fp8(torch.zeros(2, 576, dtype=torch.uint8))
    with pytest.raises(TypeError, match="rows must have dtype"):
        dequantize_kv_fp8(torch.zeros(2, 656))
    with pytest.raises(ValueError, match="nope must be"):
        fp8_tile_scales(torch.zeros(3, 576))
    with pytest.raises(ValueError, match="counts must be"):
        check_fp8_slots(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 5, "compact")


# ---- the FlashMLA wrapper's Triton helpers (CPU through the interpreter, or the GPU) ----------------
def test_prepare_indices_kernel(kernel_device) -> None:
    from dcp_ref.kernels.flashmla_fp8 import prepare_indices

    g = torch.Generator().manual_seed(0)
    for T, K, S in ((3, 5, 50), (2, 64, 10), (4, 130, 1000), (1, 1, 1), (5, 7, 3)):
        slots = torch.randint(-1, S, (T, K), generator=g)
        slots[0] = -1  # an empty row
        if T > 2:
            slots[2, K // 2] = S if K % 2 else -3  # an entry that may not be read: poisons its row
        counts = torch.randint(-1, K + 2, (T,), generator=g)  # out of [0, K] too: clamped
        for dt in (torch.int32, torch.int64):
            for cnt in (None, counts):
                s_dev = slots.to(dt).to(kernel_device)
                idx, state = prepare_indices(s_dev, None if cnt is None else cnt.to(kernel_device), S)
                k_pad = -(-K // 64) * 64
                in_cache = (slots >= 0) & (slots < S)
                if cnt is None:
                    read, bad = in_cache, ~in_cache & (slots != -1)
                else:
                    used = torch.arange(K) < cnt.clamp(0, K)[:, None]
                    read, bad = used & in_cache, used & ~in_cache
                want = torch.full((T, 1, k_pad), -1, dtype=torch.int32)
                want[:, 0, :K] = torch.where(read, slots, -1).to(torch.int32)
                assert idx.shape == (T, 1, k_pad) and torch.equal(idx.cpu(), want)
                assert state.cpu().tolist() == torch.where(bad.any(1), 2, read.any(1).int()).tolist()


def test_finish_outputs_kernel(kernel_device) -> None:
    from dcp_ref.kernels.flashmla_fp8 import ROW_EMPTY, ROW_POISONED, ROW_READ, finish_outputs

    g = torch.Generator().manual_seed(1)
    T, H, D = 4, 3, 40
    o = torch.randn(T, 1, H, D, generator=g).bfloat16().to(kernel_device)
    lse_raw = torch.randn(T, H, 1, generator=g).to(kernel_device)
    lse_raw[1] = INF  # FlashMLA's empty-row LSE
    o[1] = 7.0  # whatever the kernel left in an empty row
    state = torch.tensor([ROW_READ, ROW_EMPTY, ROW_POISONED, ROW_READ], dtype=torch.int32, device=kernel_device)
    want = o.view(T, H, D).cpu().clone()
    want[1], want[2] = 0, math.nan
    want_l = lse_raw.view(T, H).cpu().clone()
    want_l[1], want_l[2] = -INF, math.nan
    for buf in (torch.bfloat16, torch.float32):
        ob = torch.full((T, H, D), 5.0, device=kernel_device, dtype=buf)
        lb = torch.full((T, H), 5.0, device=kernel_device)
        out, lse = finish_outputs(o.view(T, H, D), lse_raw.view(T, H), state, out=ob, out_lse=lb)
        assert out is ob and lse is lb
        assert torch.equal(ob.cpu().float().nan_to_num(9.0), want.float().nan_to_num(9.0))
        assert torch.equal(lb.cpu().nan_to_num(9.0), want_l.nan_to_num(9.0))
    src = o.view(T, H, D).clone()
    out2, lse2 = finish_outputs(src, lse_raw.view(T, H), state)  # in place
    assert out2.data_ptr() == src.data_ptr()
    assert torch.equal(out2.cpu().float().nan_to_num(9.0), want.float().nan_to_num(9.0))
    assert torch.equal(lse2.cpu().nan_to_num(9.0), want_l.nan_to_num(9.0))


def test_wrapper_needs_cuda_and_names_flash_mla(monkeypatch) -> None:
    import sys

    from dcp_ref.kernels import flashmla_fp8

    with pytest.raises(ValueError, match="CUDA device"):
        flashmla_fp8.FlashMLAFp8Decode("cpu")
    monkeypatch.setitem(sys.modules, "flash_mla", None)  # import flash_mla now fails
    with pytest.raises(ImportError, match="sgl-flash-mla"):
        flashmla_fp8._flash_mla()


# ---- GPU: FlashMLA's FP8 sparse decode against the reference -------------------------------------------
def _gpu_case(T, H, K, S, seed, device, p_none=0.4):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = (torch.randn(T, H, 576, generator=g)).bfloat16()
    kv = torch.randn(S, 576, generator=g).bfloat16()
    slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)])
    slots[torch.rand(T, K, generator=g) < p_none] = -1
    if T > 1:
        slots[1] = -1  # an empty row
    if T > 2:
        slots[2] = -1
        slots[2, K // 2] = 5  # one key, in the middle of the row
    return q.to(device), quantize_kv_fp8(kv.to(device)), slots.to(device)


def _check_against_reference(o, l, q, cache, slots, sm, counts=None, layout="masked"):
    ref_o, ref_l = sparse_mla_attention_fp8(q, cache, slots, counts, sm, attention_layout=layout)
    assert o.dtype == torch.bfloat16 and l.dtype == torch.float32 and o.shape == ref_o.shape and l.shape == ref_l.shape
    assert bool(torch.isfinite(o).all())
    rel = ((o.double() - ref_o).norm() / ref_o.norm().clamp_min(1e-30)).item()
    assert rel <= 1e-2, rel
    assert torch.equal(torch.isneginf(l), torch.isneginf(ref_l))
    fin = torch.isfinite(ref_l)
    assert bool(torch.isfinite(l[fin]).all()) and (l[fin].double() - ref_l[fin]).abs().max().item() <= 5e-3
    assert o[~fin.any(1)].abs().max().item() == 0 if bool((~fin.any(1)).any()) else True
    return rel


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,K", [(1, 128, 2048), (3, 64, 64), (5, 128, 100), (33, 128, 1024), (64, 64, 192)])
def test_flashmla_fp8_matches_reference(cuda_device, T, H, K) -> None:
    from dcp_ref.kernels.flashmla_fp8 import FlashMLAFp8Decode

    q, cache, slots = _gpu_case(T, H, K, 8192, T * 31 + K, cuda_device)
    sm = 192**-0.5
    attn = FlashMLAFp8Decode(cuda_device)
    ob = torch.full((T, H, 512), math.nan, device=cuda_device).bfloat16()
    lb = torch.full((T, H), math.nan, device=cuda_device)
    o, l = attn.attention(q, cache, slots.int(), None, sm, 512, out=ob, out_lse=lb)
    assert o is ob and l is lb
    _check_against_reference(o, l, q, cache, slots, sm)
    # without caller buffers, int64 slots, a float8 cache view, the counts argument ignored (masked)
    o2, l2 = attn.attention(
        q, cache.view(torch.float8_e4m3fn), slots, torch.zeros(T, dtype=torch.int32, device=cuda_device), sm
    )
    _check_against_reference(o2, l2, q, cache, slots, sm)


@pytest.mark.gpu
def test_flashmla_fp8_empty_single_row_and_all_empty(cuda_device) -> None:
    from dcp_ref.kernels.flashmla_fp8 import sparse_mla_fp8_flashmla

    q, cache, slots = _gpu_case(1, 128, 256, 1024, 3, cuda_device)
    slots[:] = -1  # T = 1, every entry -1: the split-KV path with nothing to read
    o, l = sparse_mla_fp8_flashmla(q, cache, slots, None, 0.1)
    assert o.abs().max().item() == 0 and bool(torch.isneginf(l).all())
    o, l = sparse_mla_fp8_flashmla(q, cache, slots[:, :0], None, 0.1)  # K = 0
    assert o.shape == (1, 128, 512) and o.abs().max().item() == 0 and bool(torch.isneginf(l).all())


@pytest.mark.gpu
def test_flashmla_fp8_blocked_cache_and_compact_layout(cuda_device) -> None:
    from dcp_ref.kernels.flashmla_fp8 import FlashMLAFp8Decode

    T, H, K, S = 9, 128, 300, 64 * 40
    q, cache, slots = _gpu_case(T, H, K, S, 5, cuda_device)
    valid = slots >= 0
    counts = valid.sum(1).int()
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    compact = torch.gather(slots, 1, order)
    compact[torch.arange(K, device=cuda_device) >= counts[:, None]] = 123456  # junk past counts: masked
    blocked = cache.view(40, 64, 1, 656).view(torch.float8_e4m3fn)
    attn = FlashMLAFp8Decode(cuda_device, validate=True)
    o, l = attn.attention(q, blocked, compact.int(), counts, 0.08, attention_layout="compact")
    _check_against_reference(o, l, q, cache, slots, 0.08)


@pytest.mark.gpu
def test_flashmla_fp8_validate_and_out_of_range(cuda_device) -> None:
    from dcp_ref.kernels.flashmla_fp8 import FlashMLAFp8Decode

    T, H, K, S = 4, 64, 128, 2048
    q, cache, slots = _gpu_case(T, H, K, S, 9, cuda_device)
    bad = slots.clone()
    bad[0, 3] = S  # past the cache
    bad[3, 7] = -5
    with pytest.raises(ValueError, match=r"-1 \(none\) or lie in \[0, num_slots=2048\)"):
        FlashMLAFp8Decode(cuda_device, validate=True).attention(q, cache, bad, None, 0.1)
    # without validation: such an entry is never read, and its row is poisoned (NaN), like the reference's
    o, l = FlashMLAFp8Decode(cuda_device, validate=False).attention(q, cache, bad, None, 0.1)
    ro, rl = sparse_mla_attention_fp8(q, cache, bad, None, 0.1, validate=False)
    poison = torch.tensor([True, False, False, True], device=cuda_device)
    assert bool(o[poison].isnan().all()) and bool(l[poison].isnan().all())
    assert bool(ro[poison].isnan().all()) and bool(rl[poison].isnan().all())
    _check_against_reference(o[~poison], l[~poison], q[~poison], cache, bad[~poison], 0.1)
    for kw, msg in (
        (dict(q=q[:, :48]), "64 or 128 heads"),
        (dict(q=q.float()), "q must have dtype"),
        (dict(v_dim=576), "v_dim must be 512"),
        (dict(kv_cache=cache[:, :600]), "656"),
    ):
        args = dict(q=q, kv_cache=cache, v_dim=512)
        args.update(kw)
        with pytest.raises((ValueError, TypeError), match=msg):
            FlashMLAFp8Decode(cuda_device).attention(args["q"], args["kv_cache"], slots, None, 0.1, args["v_dim"])


@pytest.mark.gpu
def test_flashmla_fp8_cuda_graph_replay(cuda_device) -> None:
    from dcp_ref.kernels.flashmla_fp8 import FlashMLAFp8Decode

    T, H, K, S = 32, 128, 512, 16384
    q, cache, slots = _gpu_case(T, H, K, S, 13, cuda_device)
    attn = FlashMLAFp8Decode(cuda_device, validate=False)
    s_buf = slots.int().clone()
    ob = torch.empty(T, H, 512, device=cuda_device, dtype=torch.bfloat16)
    lb = torch.empty(T, H, device=cuda_device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attn.attention(q, cache, s_buf, None, 0.1, out=ob, out_lse=lb)  # warm: schedule + buffers
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn.attention(q, cache, s_buf, None, 0.1, out=ob, out_lse=lb)
    for seed in (1, 2):
        _, _, new = _gpu_case(T, H, K, S, 100 + seed, cuda_device)
        s_buf.copy_(new.int())
        ob.fill_(math.nan)
        graph.replay()
        torch.cuda.synchronize()
        _check_against_reference(ob, lb, q, cache, new, 0.1)


@pytest.mark.gpu
def test_flashmla_fp8_dcp_two_ranks_merged_equals_single_device(cuda_device) -> None:
    """W = 2 ranks on one GPU: masked slots per rank, FlashMLA FP8 partials, the LSE merge."""
    from dcp_ref.cache_write import build_sharded_caches
    from dcp_ref.deinterleave import global_ids_to_local_slots
    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.kernels.flashmla_fp8 import FlashMLAFp8Decode
    from dcp_ref.lse import merge_partials
    from dcp_ref.pipeline import make_dcp_problem

    W, I, BS, K = 2, 2, 64, 256
    p = make_dcp_problem(W, I, seq_lens=[700, 300], head_dim=576, block_size=BS, seed=4)
    geo = DcpGeometry(W, 0, I, BS)
    caches = build_sharded_caches(
        p.kv_global, [s.block_table for s in p.shards], geo, [s.kv_cache.shape[0] for s in p.shards]
    )
    g = torch.Generator().manual_seed(8)
    req = p.req_of_token
    T = req.numel()
    q = torch.randn(T, 128, 576, generator=g).bfloat16().to(cuda_device)
    ids = torch.stack([torch.randperm(int(p.seq_lens[b]), generator=g)[:K] for b in req.tolist()])
    attn = FlashMLAFp8Decode(cuda_device, validate=True)
    outs, lses = [], []
    for r, shard in enumerate(p.shards):
        slots = global_ids_to_local_slots(ids, req, shard.block_table, DcpGeometry(W, r, I, BS))  # masked layout
        o, l = attn.attention(q, caches[r].to(cuda_device), slots.to(cuda_device), None, 192**-0.5)
        outs.append(o.double())
        lses.append(l.double())
    out, lse = merge_partials(torch.stack(outs), torch.stack(lses))
    flat = quantize_kv_fp8(torch.cat(p.kv_global).to(cuda_device))
    offset = torch.tensor([0, int(p.seq_lens[0])])[req]
    ref_o, ref_l = sparse_mla_attention_fp8(q, flat, (ids + offset[:, None]).to(cuda_device), None, 192**-0.5)
    assert (out - ref_o).norm().item() / ref_o.norm().item() <= 1e-2
    assert (lse - ref_l).abs().max().item() <= 5e-3
