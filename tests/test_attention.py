"""The attention stage: sparse MLA reference vs brute force; compact CSR; FlashInfer on the GPU.

CPU: ``sparse_mla_attention`` against a per-(t, h) Python-float softmax loop; the compact CSR
builder against Python lists. GPU (``-m gpu``, H200 + FlashInfer bundle): FlashInfer FA3 output
vs the float64 reference (relative Frobenius error <= 1e-2), its raw LSE in base 2 (and not base
e) to 1e-3, empty rows, H in {16, 64, 128}, and an end-to-end W-rank DCP step (FlashInfer per
rank + Triton merge) against attention over the union of all slots.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from dcp_ref.attention import MLA_HEAD_DIM, sparse_mla_attention

INF = float("inf")


def brute_attention(q, kv, slots, counts, sm_scale, v_dim):
    """Python floats: per (t, h), softmax over the listed slots, max-subtracted."""
    T, H, _ = q.shape
    ql, kvl = q.double().tolist(), kv.double().tolist()
    out = torch.zeros(T, H, v_dim, dtype=torch.float64)
    lse = torch.full((T, H), -INF, dtype=torch.float64)
    for t in range(T):
        chosen = [int(s) for s in slots[t, : int(counts[t])].tolist()]
        for h in range(H):
            if not chosen:
                continue
            sc = [sm_scale * sum(a * b for a, b in zip(ql[t][h], kvl[s])) for s in chosen]
            m = max(sc)
            e = [math.exp(x - m) for x in sc]
            z = sum(e)
            lse[t, h] = m + math.log(z)
            for j, s in enumerate(chosen):
                for d in range(v_dim):
                    out[t, h, d] += e[j] / z * kvl[s][d]
    return out, lse


def make_case(T, H, dqk, N, K, seed, counts=None, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, dqk, generator=g, dtype=torch.float64).to(dtype)
    kv = torch.randn(N, dqk, generator=g, dtype=torch.float64).to(dtype)
    if counts is None:
        counts = torch.randint(0, K + 1, (T,), generator=g)
    counts = torch.as_tensor(counts, dtype=torch.int32)
    slots = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    slots[torch.arange(K) >= counts.unsqueeze(1)] = -1
    return q, kv, slots, counts


def assert_lse_equal(a, b, atol):
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.equal(torch.isneginf(a), torch.isneginf(b))
    fin = torch.isfinite(b)
    if fin.any():
        assert (a[fin] - b[fin]).abs().max().item() <= atol


# ----------------------------------------------------------------------------- reference
@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize("T,H,dqk,v,N,K", [(5, 3, 12, 8, 30, 7), (3, 2, MLA_HEAD_DIM, 512, 20, 5)])
def test_reference_matches_brute_force(T, H, dqk, v, N, K, base) -> None:
    q, kv, slots, counts = make_case(T, H, dqk, N, K, seed=T + dqk, counts=[K, 0, 1, K - 2, 3][:T])
    out, lse = sparse_mla_attention(q, kv, slots, counts, 0.25, base, v_dim=v)
    ref_o, ref_l = brute_attention(q, kv, slots, counts, 0.25, v)
    assert out.dtype == torch.float64 and out.shape == (T, H, v) and lse.shape == (T, H)
    assert torch.allclose(out, ref_o, rtol=1e-10, atol=1e-12)
    if base == "2":
        ref_l = ref_l / math.log(2)
    assert_lse_equal(lse, ref_l, 1e-10)
    assert out[1].abs().max().item() == 0.0 and torch.isneginf(lse[1]).all()  # empty row


def test_reference_ignores_padding_and_order() -> None:
    q, kv, slots, counts = make_case(4, 2, 10, 25, 6, seed=1, counts=[6, 3, 0, 2])
    out, lse = sparse_mla_attention(q, kv, slots, counts, 0.5, v_dim=6)
    garbage = slots.clone()
    garbage[torch.arange(6) >= counts.unsqueeze(1)] = 10**6  # never read
    perm = garbage.clone()
    for t in range(4):
        c = int(counts[t])
        perm[t, :c] = perm[t, :c][torch.randperm(c)]
    for s in (garbage, perm):
        o2, l2 = sparse_mla_attention(q, kv, s, counts, 0.5, v_dim=6)
        assert torch.allclose(o2, out, atol=1e-12) and torch.allclose(l2, lse, atol=1e-12)
    # FlashInfer's page-size-1 cache layout [N, 1, Dqk] gives the same result.
    o3, _ = sparse_mla_attention(q, kv.unsqueeze(1), slots, counts, 0.5, v_dim=6)
    assert torch.equal(o3, out)


def test_reference_low_precision_inputs_and_empty_batch() -> None:
    q, kv, slots, counts = make_case(3, 2, 16, 20, 4, seed=2, dtype=torch.bfloat16)
    out, lse = sparse_mla_attention(q, kv, slots, counts, 0.3, v_dim=8)
    ref_o, ref_l = brute_attention(q, kv, slots, counts, 0.3, 8)  # same bf16 values, as floats
    assert torch.allclose(out, ref_o, atol=1e-10)
    assert_lse_equal(lse, ref_l, 1e-10)
    o0, l0 = sparse_mla_attention(q[:0], kv, slots[:0], counts[:0], 0.3, v_dim=8)
    assert o0.shape == (0, 2, 8) and l0.shape == (0, 2)


def test_reference_bad_inputs() -> None:
    q, kv, slots, counts = make_case(3, 2, 12, 20, 4, seed=3, counts=[4, 2, 0])
    ok = dict(q=q, kv_cache=kv, slots=slots, counts=counts, sm_scale=0.5, v_dim=8)

    def call(**kw):
        return sparse_mla_attention(**{**ok, **kw})

    with pytest.raises(TypeError, match="q"):
        call(q=q.long())
    with pytest.raises(ValueError, match="q"):
        call(q=q[0])
    with pytest.raises(ValueError, match="kv_cache"):
        call(kv_cache=kv[:, :10])
    with pytest.raises(ValueError, match="kv_cache"):
        call(kv_cache=kv.view(20, 2, 6))
    with pytest.raises(TypeError, match="slots"):
        call(slots=slots.float())
    with pytest.raises(ValueError, match="slots"):
        call(slots=slots[:2])
    with pytest.raises(ValueError, match="counts"):
        call(counts=counts[:2])
    with pytest.raises(ValueError, match="counts"):
        call(counts=torch.tensor([5, 0, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="counts"):
        call(counts=torch.tensor([-1, 0, 0], dtype=torch.int32))
    bad = slots.clone()
    bad[0, 1] = 20
    with pytest.raises(ValueError, match="slots"):
        call(slots=bad)
    bad[0, 1] = -1  # a padding marker inside the valid prefix
    with pytest.raises(ValueError, match="slots"):
        call(slots=bad)
    for s in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="sm_scale"):
            call(sm_scale=s)
    with pytest.raises(TypeError, match="sm_scale"):
        call(sm_scale=True)
    with pytest.raises(ValueError, match="lse_base"):
        call(lse_base="10")
    with pytest.raises(ValueError, match="v_dim"):
        call(v_dim=13)
    with pytest.raises(ValueError, match="device"):
        call(kv_cache=kv.to("meta"))


# ----------------------------------------------------------------------------- compact CSR (CPU)
def test_build_compact_csr_matches_python() -> None:
    from dcp_ref.kernels.flashinfer_mla import build_compact_csr

    _, _, slots, counts = make_case(7, 1, 4, 50, 6, seed=4, counts=[6, 0, 3, 0, 1, 6, 2])
    csr = build_compact_csr(slots, counts)
    flat, indptr = [], [0]
    for t in range(7):
        flat += slots[t, : counts[t]].tolist()
        indptr.append(len(flat))
    total = csr.kv_indptr[-1].item()
    assert csr.kv_indptr.tolist() == indptr and total == len(flat)
    assert csr.kv_indices[:total].tolist() == flat
    assert csr.qo_indptr.tolist() == list(range(8)) and csr.kv_len.tolist() == counts.tolist()
    assert all(t.dtype == torch.int32 for t in (csr.qo_indptr, csr.kv_indptr, csr.kv_indices, csr.kv_len))
    with pytest.raises(ValueError, match="counts"):
        build_compact_csr(slots, counts[:3])
    with pytest.raises(TypeError, match="slots"):
        build_compact_csr(slots.float(), counts)


def test_flashinfer_module_imports_without_flashinfer() -> None:
    import dcp_ref.kernels.flashinfer_mla as m

    assert callable(m.sparse_mla_flashinfer) and callable(m.sparse_mla_trtllm_blackwell)


# ----------------------------------------------------------------------------- GPU
def _gpu_case(T, H, K, N, seed, empty_rows=(1,)):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, MLA_HEAD_DIM, generator=g).to(torch.bfloat16)
    kv = torch.randn(N, MLA_HEAD_DIM, generator=g).to(torch.bfloat16)
    counts = torch.randint(1, K + 1, (T,), generator=g, dtype=torch.int32)
    counts[0] = K
    for r in empty_rows:
        counts[r] = 0
    slots = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    slots[torch.arange(K) >= counts.unsqueeze(1)] = -1
    return q, kv, slots, counts


def _rel_fro(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 64, 128])
def test_flashinfer_matches_reference(cuda_device, H) -> None:
    pytest.importorskip("flashinfer")
    from dcp_ref.kernels.flashinfer_mla import FlashInferSparseMLA

    T, K, N, scale = 24, 256, 4096, 192**-0.5
    q, kv, slots, counts = (t.to(cuda_device) for t in _gpu_case(T, H, K, N, seed=H, empty_rows=(1, 5)))
    ref_o, ref_le = sparse_mla_attention(q, kv, slots, counts, scale, "e")
    _, ref_l2 = sparse_mla_attention(q, kv, slots, counts, scale, "2")
    attn = FlashInferSparseMLA(H, scale, device=cuda_device)
    attn.plan(slots, counts)
    out = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=cuda_device)
    raw = torch.full((T, H), float("nan"), dtype=torch.float32, device=cuda_device)
    attn.run(q, kv, out=out, lse=raw, lse_base="2")
    assert _rel_fro(out, ref_o) <= 1e-2
    # Raw FlashInfer LSE is base 2 ...
    assert_lse_equal(raw, ref_l2, 1e-3)
    fin = torch.isfinite(ref_le)
    # ... and not base e (they differ by a factor ln 2, i.e. by ~|lse|*0.44 >> 1e-3).
    assert (raw[fin].double() - ref_le[fin]).abs().max().item() > 0.1
    # Empty rows: output exactly 0, LSE -inf.
    assert out[[1, 5]].abs().max().item() == 0.0 and torch.isneginf(raw[[1, 5]]).all()
    # The default (base e) path converts.
    out_e, lse_e = attn.run(q, kv)
    assert _rel_fro(out_e, ref_o) <= 1e-2
    assert_lse_equal(lse_e, ref_le, 1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("W", [2, 4])
def test_dcp_step_flashinfer_plus_triton_merge(cuda_device, W) -> None:
    """W ranks' FlashInfer partials (base-2 LSE) merged by the Triton kernel == union attention."""
    pytest.importorskip("flashinfer")
    from dcp_ref.kernels.flashinfer_mla import FlashInferSparseMLA
    from dcp_ref.kernels.lse_merge_triton import lse_merge

    T, H, K, N, scale = 16, 64, 512, 8192, 192**-0.5
    q, kv, slots, counts = _gpu_case(T, H, K, N, seed=W, empty_rows=(3,))
    rng = random.Random(W)
    rank_of = torch.tensor([rng.randrange(W) for _ in range(N)])
    rank_of[slots[2, : counts[2]].long()] = 0  # row 2: every chosen slot on rank 0 (others empty)
    outs, lses = [], []
    for r in range(W):
        keep = (rank_of[slots.clamp(min=0).long()] == r) & (slots >= 0)
        rc = keep.sum(1).to(torch.int32)
        rs = torch.full_like(slots, -1)
        for t in range(T):
            rs[t, : rc[t]] = slots[t][keep[t]]
        attn = FlashInferSparseMLA(H, scale, device=cuda_device)
        attn.plan(rs.to(cuda_device), rc.to(cuda_device))
        o, l = attn.run(q.to(cuda_device), kv.to(cuda_device), lse_base="2")
        outs.append(o)
        lses.append(l)
    merged = torch.full((T, H, 512), float("nan"), dtype=torch.bfloat16, device=cuda_device)
    mlse = torch.full((T, H), float("nan"), dtype=torch.float32, device=cuda_device)
    lse_merge(torch.stack(outs), torch.stack(lses), base="2", merged=merged, merged_lse=mlse)
    ref_o, ref_l = sparse_mla_attention(q, kv, slots, counts, scale, "2")
    assert _rel_fro(merged, ref_o.to(cuda_device)) <= 1e-2
    assert_lse_equal(mlse, ref_l, 1e-3)
    assert merged[3].abs().max().item() == 0.0


def test_garbage_in_unread_slots_does_not_leak() -> None:
    """Padding entries are clamped to a real slot for the gather; that slot's garbage (NaN, as in
    a never-written cache block) must not reach the output (0 * NaN = NaN in a plain einsum)."""
    torch.manual_seed(0)
    q = torch.randn(3, 2, 16, dtype=torch.float64)
    kv = torch.randn(10, 16, dtype=torch.float64)
    kv[0] = float("nan")  # slot 0 is never selected; -1 padding clamps to it
    slots = torch.tensor([[4, 7, -1, -1], [-1, -1, -1, -1], [1, 2, 3, 5]], dtype=torch.int32)
    counts = torch.tensor([2, 0, 4], dtype=torch.int32)
    out, lse = sparse_mla_attention(q, kv, slots, counts, 0.25, v_dim=8)
    assert torch.isfinite(out).all()
    assert torch.isfinite(lse[0]).all() and torch.isinf(lse[1]).all() and torch.isfinite(lse[2]).all()
    # Independent check of row 0: softmax over slots 4 and 7 only.
    logits = torch.einsum("hd,kd->hk", q[0], kv[[4, 7]]) * 0.25
    torch.testing.assert_close(out[0], torch.softmax(logits, -1) @ kv[[4, 7], :8])
