"""The correct and combine stages: LSE utilities, merge_partials, the collective merge, and the Triton merge kernels.

Independent references used here:
* a brute-force merge written with Python floats and ``math`` (no torch reductions);
* attention over the *union* of all ranks' slots (``sparse_mla_attention`` on one slot list),
  which the merge of per-rank partials must reproduce.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_ref.attention import sparse_mla_attention
from dcp_ref.group import SimulatedWorld
from dcp_ref.lse import (
    LN2,
    correct_partial,
    dcp_merge_collective,
    lse_base2_to_e,
    lse_e_to_base2,
    merge_partials,
    merge_partials_naive_add,
    normalize_lse_shape,
    sanitize_lse,
)

NAN, INF = float("nan"), float("inf")


# ----------------------------------------------------------------------------- brute force
def brute_merge(outs: list, lses: list, base: str) -> tuple[list, float]:
    """Python-float merge of W partials for one (t, h): outs[w] is a list of D floats.

    Only ``-inf`` means "empty" (a count of zero): a NaN or ``+inf`` LSE is corrupt data and makes
    this (t, h) NaN; a NaN output of a non-empty rank propagates through its weight.
    """
    b = 2.0 if base == "2" else math.e
    D = len(outs[0])
    if any(math.isnan(l) or l == INF for l in lses):
        return [NAN] * D, NAN
    valid = [w for w, l in enumerate(lses) if l != -INF]
    if not valid:
        return [0.0] * D, -INF
    m = max(lses[w] for w in valid)
    total = sum(b ** (lses[w] - m) for w in valid)
    merged_lse = m + math.log(total, b)
    out = [0.0] * D
    for w in valid:
        f = b ** (lses[w] - merged_lse)
        for d in range(D):
            out[d] += f * outs[w][d]
    return out, merged_lse


def brute_merge_tensor(outs: torch.Tensor, lses: torch.Tensor, base: str) -> tuple[torch.Tensor, torch.Tensor]:
    W, T, H, D = outs.shape
    o = torch.zeros(T, H, D, dtype=torch.float64)
    l = torch.zeros(T, H, dtype=torch.float64)
    ol, ll = outs.double().cpu().tolist(), lses.double().cpu().tolist()
    for t in range(T):
        for h in range(H):
            res, lse = brute_merge([ol[w][t][h] for w in range(W)], [ll[w][t][h] for w in range(W)], base)
            o[t, h] = torch.tensor(res, dtype=torch.float64)
            l[t, h] = lse
    return o, l


def assert_lse_equal(a: torch.Tensor, b: torch.Tensor, atol: float) -> None:
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.equal(torch.isneginf(a), torch.isneginf(b)), "-inf pattern differs"
    assert torch.equal(torch.isnan(a), torch.isnan(b)), "NaN pattern differs"
    fin = torch.isfinite(b)
    assert torch.isfinite(a[fin]).all()
    if fin.any():
        assert (a[fin] - b[fin]).abs().max().item() <= atol


def random_partials(
    W: int, T: int, H: int, D: int, seed: int, invalid: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    outs = torch.randn(W, T, H, D, generator=g, dtype=torch.float64)
    lses = torch.randn(W, T, H, generator=g, dtype=torch.float64) * 4
    if invalid:
        kind = torch.randint(0, 8, (W, T, H), generator=g)
        lses[kind == 0] = -INF
        lses[kind == 1] = NAN
        lses[kind == 2] = INF
        # An empty rank's output is garbage: make it NaN to prove it never leaks.
        outs[(kind <= 2).unsqueeze(-1).expand_as(outs)] = NAN
        if T > 0 and H > 0:
            lses[:, 0, 0] = -INF  # one (t, h) empty on every rank
    return outs, lses


# ----------------------------------------------------------------------------- conversions
def test_base_conversion_matches_math() -> None:
    rng = random.Random(0)
    rows = [[rng.uniform(-20, 20) for _ in range(rng.randint(1, 30))] for _ in range(50)]
    lse_e = torch.tensor([math.log(sum(math.exp(x) for x in r)) for r in rows], dtype=torch.float64)
    lse_2 = torch.tensor([math.log2(sum(math.exp(x) for x in r)) for r in rows], dtype=torch.float64)
    assert torch.allclose(lse_base2_to_e(lse_2), lse_e, rtol=0, atol=1e-12)
    assert torch.allclose(lse_e_to_base2(lse_e), lse_2, rtol=0, atol=1e-12)
    assert LN2 == pytest.approx(math.log(2))


def test_base_conversion_specials_and_dtype() -> None:
    x = torch.tensor([-INF, INF, NAN, 0.0, 1.0], dtype=torch.float32)
    y = lse_base2_to_e(x)
    assert y.dtype == torch.float32
    assert y[0].item() == -INF and y[1].item() == INF and math.isnan(y[2].item()) and y[3].item() == 0.0
    assert torch.equal(lse_e_to_base2(lse_base2_to_e(x))[:2], x[:2])
    with pytest.raises(TypeError, match="lse"):
        lse_base2_to_e(torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="lse"):
        lse_e_to_base2([1.0])  # type: ignore[arg-type]


def test_sanitize_lse() -> None:
    x = torch.tensor([NAN, INF, -INF, 2.5])
    assert sanitize_lse(x).tolist() == [-INF, -INF, -INF, 2.5]


# ----------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("T,H", [(6, 4), (1, 16), (4, 4)])
def test_normalize_lse_shape_accepted(T: int, H: int) -> None:
    base = torch.arange(T * H, dtype=torch.float32).reshape(T, H)
    for cand in (base, base.unsqueeze(1), base.unsqueeze(2), base.reshape(1, T, H)):
        got = normalize_lse_shape(cand, T, H)
        assert got.shape == (T, H) and torch.equal(got, base)
    if T % 2 == 0:  # [B, q, H] with B*q = T (speculative decode)
        assert torch.equal(normalize_lse_shape(base.reshape(T // 2, 2, H), T, H), base)


def test_normalize_lse_shape_rejects() -> None:
    T, H = 6, 4
    lse = torch.zeros(T, H)
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        normalize_lse_shape(lse.t(), T, H)  # transposed [H, T]
    with pytest.raises(ValueError, match="got"):
        normalize_lse_shape(torch.zeros(T, 2, H), T, H)
    with pytest.raises(ValueError, match="got"):
        normalize_lse_shape(torch.zeros(T * H), T, H)
    with pytest.raises(ValueError, match="got"):
        normalize_lse_shape(torch.zeros(1, T, H, 1), T, H)
    with pytest.raises(TypeError, match="lse"):
        normalize_lse_shape(torch.zeros(T, H, dtype=torch.int32), T, H)
    with pytest.raises(ValueError, match="num_heads"):
        normalize_lse_shape(lse, T, 0)


# ----------------------------------------------------------------------------- merge
@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize("W", [1, 2, 3, 5])
def test_merge_partials_matches_brute_force(W: int, base: str) -> None:
    outs, lses = random_partials(W, 5, 3, 4, seed=W)
    got_o, got_l = merge_partials(outs, lses, base)
    ref_o, ref_l = brute_merge_tensor(outs, lses, base)
    assert torch.equal(torch.isnan(got_o), torch.isnan(ref_o)), "NaN leaked from an empty rank, or vanished"
    assert torch.isnan(ref_o).any() and not torch.isnan(ref_o).all()  # the case is exercised both ways
    assert torch.allclose(got_o, ref_o, rtol=1e-12, atol=1e-12, equal_nan=True)
    assert_lse_equal(got_l, ref_l, 1e-12)


@settings(max_examples=40, deadline=None)
@given(
    W=st.integers(1, 5),
    T=st.integers(0, 4),
    H=st.integers(1, 4),
    D=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
    base=st.sampled_from(["e", "2"]),
)
def test_merge_partials_property(W: int, T: int, H: int, D: int, seed: int, base: str) -> None:
    outs, lses = random_partials(W, T, H, D, seed)
    got_o, got_l = merge_partials(outs, lses, base)
    ref_o, ref_l = brute_merge_tensor(outs, lses, base)
    assert got_o.shape == (T, H, D) and got_l.shape == (T, H)
    assert torch.allclose(got_o, ref_o, rtol=1e-10, atol=1e-10, equal_nan=True)
    assert_lse_equal(got_l, ref_l, 1e-10)


def test_merge_all_empty_gives_zero_and_neg_inf() -> None:
    outs = torch.full((3, 2, 2, 4), NAN, dtype=torch.float64)
    lses = torch.full((3, 2, 2), -INF, dtype=torch.float64)
    o, l = merge_partials(outs, lses, "e")
    assert o.tolist() == torch.zeros(2, 2, 4).tolist()
    assert torch.isneginf(l).all()


@pytest.mark.parametrize("bad", [NAN, INF])
def test_merge_nan_or_inf_lse_is_never_empty(bad: float) -> None:
    """A NaN / +inf LSE is corrupt data, not an empty rank: that (t, h) is NaN, nothing else is."""
    outs, lses = random_partials(3, 2, 2, 4, seed=2, invalid=False)
    clean_o, clean_l = merge_partials(outs, lses, "e")
    lses[1, 0, 1] = bad
    o, l = merge_partials(outs, lses, "e")
    assert torch.isnan(o[0, 1]).all() and math.isnan(l[0, 1].item())
    mask = torch.ones(2, 2, dtype=torch.bool)
    mask[0, 1] = False
    assert torch.equal(o[mask], clean_o[mask]) and torch.equal(l[mask], clean_l[mask])


def test_merge_empty_rank_does_not_leak_nan() -> None:
    outs, lses = random_partials(3, 4, 2, 8, seed=7, invalid=False)
    full_o, full_l = merge_partials(outs[:2], lses[:2], "e")
    outs[2] = NAN
    lses[2] = -INF
    o, l = merge_partials(outs, lses, "e")
    assert torch.equal(o, full_o) and torch.equal(l, full_l)


def test_merge_dtype_and_bad_inputs() -> None:
    outs, lses = random_partials(2, 3, 2, 4, seed=1, invalid=False)
    o, l = merge_partials(outs.to(torch.bfloat16), lses.float(), "2")
    assert o.dtype == torch.bfloat16 and l.dtype == torch.float32
    with pytest.raises(ValueError, match="base"):
        merge_partials(outs, lses, "10")
    with pytest.raises(ValueError, match="lses"):
        merge_partials(outs, lses[:, :2], "e")
    with pytest.raises(ValueError, match="outs"):
        merge_partials(outs[0], lses[0], "e")
    with pytest.raises(TypeError, match="outs"):
        merge_partials(outs.long(), lses, "e")
    with pytest.raises(ValueError, match="device"):
        merge_partials(outs, lses.to("meta"), "e")
    with pytest.raises(ValueError, match="at least one rank"):
        merge_partials(outs[:0], lses[:0], "e")


def _split_among_ranks(slots: torch.Tensor, counts: torch.Tensor, W: int, seed: int) -> tuple[list, list]:
    """Deal each row's valid slots to W ranks at random (some ranks get none), compacted."""
    rng = random.Random(seed)
    T, K = slots.shape
    rank_slots = [torch.full((T, K), -1, dtype=torch.int32) for _ in range(W)]
    rank_counts = [torch.zeros(T, dtype=torch.int32) for _ in range(W)]
    for t in range(T):
        for s in slots[t, : counts[t]].tolist():
            r = rng.randrange(W)
            rank_slots[r][t, rank_counts[r][t]] = s
            rank_counts[r][t] += 1
    return rank_slots, rank_counts


@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize("W", [1, 2, 4])
def test_merge_equals_attention_over_union(W: int, base: str) -> None:
    g = torch.Generator().manual_seed(W)
    T, H, dqk, v, N, K = 6, 3, 24, 16, 40, 12
    q = torch.randn(T, H, dqk, generator=g, dtype=torch.float64)
    kv = torch.randn(N, dqk, generator=g, dtype=torch.float64)
    counts = torch.tensor([12, 1, 0, 7, 12, 3], dtype=torch.int32)
    slots = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    slots[torch.arange(K) >= counts.unsqueeze(1)] = -1
    union_o, union_l = sparse_mla_attention(q, kv, slots, counts, 0.3, base, v_dim=v)
    rs, rc = _split_among_ranks(slots, counts, W, seed=W)
    parts = [sparse_mla_attention(q, kv, s, c, 0.3, base, v_dim=v) for s, c in zip(rs, rc)]
    o, l = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]), base)
    assert torch.allclose(o, union_o, rtol=1e-10, atol=1e-12)
    assert_lse_equal(l, union_l, 1e-10)
    assert o[2].abs().max().item() == 0.0 and torch.isneginf(l[2]).all()  # the empty row


def test_pitfalls_naive_add_and_wrong_base_are_wrong() -> None:
    """Adding partials, or feeding base-2 LSEs to a base-e merge, gives a different answer."""
    outs, lses2 = random_partials(4, 3, 2, 6, seed=3, invalid=False)
    right, _ = merge_partials(outs, lses2, "2")
    naive, _ = merge_partials_naive_add(outs, lses2, "2")
    wrong_base, _ = merge_partials(outs, lses2, "e")
    ref, _ = brute_merge_tensor(outs, lses2, "2")
    assert torch.allclose(right, ref, atol=1e-12)
    assert (naive - ref).abs().max().item() > 0.1
    assert (wrong_base - ref).abs().max().item() > 0.01


@pytest.mark.parametrize("base", ["e", "2"])
def test_correct_partial_sums_to_merge(base: str) -> None:
    W = 4
    outs, lses = random_partials(W, 5, 3, 4, seed=11)
    ref_o, ref_l = brute_merge_tensor(outs, lses, base)
    acc = torch.zeros_like(ref_o)
    for r in range(W):
        c, l = correct_partial(outs[r], lses, r, base)
        assert not torch.isnan(c[torch.isneginf(lses[r])]).any()  # an empty rank gives exactly 0
        acc += c
        assert_lse_equal(l, ref_l, 1e-12)
    assert torch.equal(torch.isnan(acc), torch.isnan(ref_o))
    assert torch.allclose(acc, ref_o, atol=1e-12, equal_nan=True)
    with pytest.raises(ValueError, match="rank"):
        correct_partial(outs[0], lses, W, base)
    with pytest.raises(ValueError, match="all_lses"):
        correct_partial(outs[0], lses[:, :2], 0, base)


@pytest.mark.parametrize("W", [1, 2, 4])
@pytest.mark.parametrize("base", ["e", "2"])
def test_dcp_merge_collective(W: int, base: str) -> None:
    T, H, D = 3, 8, 5
    outs, lses = random_partials(W, T, H, D, seed=W + 100)
    ref_o, ref_l = brute_merge_tensor(outs, lses, base)
    world = SimulatedWorld(W)
    res = world.run(lambda g, o, l: dcp_merge_collective(g, o, l, base), list(outs), list(lses))
    hs = H // W
    for r, (o, l) in enumerate(res):
        assert o.shape == (T, hs, D) and l.shape == (T, hs)
        assert torch.allclose(o, ref_o[:, r * hs : (r + 1) * hs], atol=1e-12, equal_nan=True)
        assert_lse_equal(l, ref_l[:, r * hs : (r + 1) * hs], 1e-12)


def test_dcp_merge_collective_bad_heads() -> None:
    world = SimulatedWorld(2)
    outs, lses = random_partials(2, 2, 3, 4, seed=0, invalid=False)
    with pytest.raises(ValueError, match="divisible"):
        world.run(lambda g, o, l: dcp_merge_collective(g, o, l), list(outs), list(lses))


# ----------------------------------------------------------------------------- Triton kernels
def _kernels():
    return pytest.importorskip("dcp_ref.kernels.lse_merge_triton")


def _poison(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, NAN if dtype.is_floating_point else -7, dtype=dtype, device=device)


@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize(
    "W,T,H,D,dtype,block_h",
    [
        (1, 3, 4, 32, torch.float32, 4),
        (3, 4, 5, 24, torch.float32, 2),
        (4, 2, 6, 64, torch.bfloat16, 4),
        (2, 3, 3, 16, torch.float16, 1),
    ],
)
def test_triton_merge_matches_brute_force(kernel_device, W, T, H, D, dtype, block_h, base) -> None:
    k = _kernels()
    outs, lses = random_partials(W, T, H, D, seed=W * 31 + T)
    ref_o, ref_l = brute_merge_tensor(outs.to(dtype).double(), lses.float().double(), base)
    merged = _poison((T, H, D), dtype, kernel_device)
    mlse = _poison((T, H), torch.float32, kernel_device)
    k.lse_merge(
        outs.to(dtype).to(kernel_device),
        lses.float().to(kernel_device),
        base=base,
        merged=merged,
        merged_lse=mlse,
        block_h=block_h,
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.equal(torch.isnan(merged.cpu()), torch.isnan(ref_o))
    assert torch.allclose(merged.double().cpu(), ref_o, rtol=tol, atol=tol, equal_nan=True)
    assert_lse_equal(mlse, ref_l, 1e-5)


@pytest.mark.parametrize("base", ["e", "2"])
def test_triton_correct_matches_reference_and_in_place(kernel_device, base) -> None:
    k = _kernels()
    W, T, H, D = 3, 4, 6, 40
    outs, lses = random_partials(W, T, H, D, seed=5)
    ref_o, ref_l = brute_merge_tensor(outs.float().double(), lses.float().double(), base)
    lses_d = lses.float().to(kernel_device)
    acc = torch.zeros(T, H, D, dtype=torch.float64)
    for r in range(W):
        x = outs[r].float().to(kernel_device)
        if r % 2:  # in place
            mlse = _poison((T, H), torch.float32, kernel_device)
            res, _ = k.lse_correct(x, lses_d, r, base=base, corrected=x, merged_lse=mlse)
            assert res.data_ptr() == x.data_ptr()
            assert_lse_equal(mlse, ref_l, 1e-5)
        else:
            res = _poison((T, H, D), torch.float32, kernel_device)
            k.lse_correct(x, lses_d, r, base=base, corrected=res)
        ref_r, _ = correct_partial(outs[r].float().double(), lses.float().double(), r, base)
        assert torch.equal(torch.isnan(res.cpu()), torch.isnan(ref_r))
        assert torch.allclose(res.double().cpu(), ref_r, rtol=1e-5, atol=1e-6, equal_nan=True)
        acc += res.double().cpu()
    assert torch.allclose(acc, ref_o, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_triton_merge_strided_inputs(kernel_device) -> None:
    """Non-contiguous partials ([T, W, H, D] storage viewed as [W, T, H, D]) and a strided LSE."""
    k = _kernels()
    W, T, H, D = 2, 3, 4, 16
    outs, lses = random_partials(W, T, H, D, seed=9)
    outs_s = outs.float().permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3).to(kernel_device)
    lses_s = lses.float().transpose(0, 2).contiguous().transpose(0, 2).to(kernel_device)
    assert not outs_s.is_contiguous() and not lses_s.is_contiguous()
    merged, _ = k.lse_merge(outs_s, lses_s, base="e")
    ref_o, _ = brute_merge_tensor(outs.float().double(), lses.float().double(), "e")
    assert torch.allclose(merged.double().cpu(), ref_o, rtol=1e-5, atol=1e-5, equal_nan=True)


@settings(max_examples=12, deadline=None)
@given(
    W=st.integers(1, 4),
    T=st.integers(1, 3),
    H=st.integers(1, 5),
    D=st.integers(1, 20),
    seed=st.integers(0, 2**31 - 1),
    base=st.sampled_from(["e", "2"]),
)
def test_triton_merge_property(W, T, H, D, seed, base) -> None:
    k = _kernels()
    dev = torch.device("cpu") if k._INTERPRET else torch.device("cuda")
    outs, lses = random_partials(W, T, H, D, seed)
    merged = _poison((T, H, D), torch.float32, dev)
    mlse = _poison((T, H), torch.float32, dev)
    k.lse_merge(outs.float().to(dev), lses.float().to(dev), base=base, merged=merged, merged_lse=mlse)
    ref_o, ref_l = brute_merge_tensor(outs.float().double(), lses.float().double(), base)
    assert torch.equal(torch.isnan(merged.cpu()), torch.isnan(ref_o))
    assert torch.allclose(merged.double().cpu(), ref_o, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert_lse_equal(mlse, ref_l, 1e-5)


def test_triton_bad_inputs(kernel_device) -> None:
    k = _kernels()
    outs = torch.zeros(2, 3, 4, 8, device=kernel_device)
    lses = torch.zeros(2, 3, 4, device=kernel_device)
    with pytest.raises(TypeError, match="lses"):
        k.lse_merge(outs, lses.to(torch.int32))
    with pytest.raises(ValueError, match="lses"):
        k.lse_merge(outs, lses[:, :2])
    with pytest.raises(ValueError, match="outs"):
        k.lse_merge(outs[0], lses)
    with pytest.raises(TypeError, match="outs"):
        k.lse_merge(outs.double(), lses)
    with pytest.raises(ValueError, match="base"):
        k.lse_merge(outs, lses, base="10")
    with pytest.raises(ValueError, match="block_h"):
        k.lse_merge(outs, lses, block_h=3)
    with pytest.raises(ValueError, match="merged"):
        k.lse_merge(outs, lses, merged=torch.zeros(3, 4, 7, device=kernel_device))
    with pytest.raises(TypeError, match="merged_lse"):
        k.lse_merge(outs, lses, merged_lse=torch.zeros(3, 4, dtype=torch.float16, device=kernel_device))
    with pytest.raises(ValueError, match="device"):
        k.lse_merge(outs, lses.to("meta"))
    with pytest.raises(ValueError, match="rank"):
        k.lse_correct(outs[0], lses, 2)
    with pytest.raises(TypeError, match="rank"):
        k.lse_correct(outs[0], lses, 1.0)
    with pytest.raises(ValueError, match="all_lses"):
        k.lse_correct(outs[0], lses[:, :, :3], 0)
    with pytest.raises(ValueError, match="corrected"):
        k.lse_correct(outs[0], lses, 0, corrected=torch.zeros(3, 4, 9, device=kernel_device))


def test_triton_empty_batch(kernel_device) -> None:
    k = _kernels()
    merged, _ = k.lse_merge(torch.zeros(2, 0, 4, 8, device=kernel_device), torch.zeros(2, 0, 4, device=kernel_device))
    assert merged.shape == (0, 4, 8)
