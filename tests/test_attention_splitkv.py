"""The split-KV sparse MLA kernel (kernels/attention_splitkv_triton.py) against the float64 reference.

CPU (Triton interpreter): small shapes — DeepSeek's 576 / 512 dims at 16 heads, and a reduced-dim variant
(Dqk = 80, v = 64) for everything else — compared with :func:`dcp_ref.attention.sparse_mla_attention`
(float64), which shares no code with the kernel. The stage contract: empty rows (count 0 or negative: 0 and
``-inf``), counts past K clamped, poisoned rows (a used slot outside the cache: NaN, int64 slots beyond 2**31
included, decided before any narrowing), NaN in q / in one attended cache row (exactly the affected rows NaN),
splits that hold no key, T = 0, H in {16, 32, 64, 128}, every cache layout, caller buffers written, no host
read with ``validate=False`` (meta tensors, :class:`dcp_ref.step.HostSyncCounter`), bad input raising with
the argument's name first, and the conformance kit (:func:`dcp_ref.testing.check_attention`).

GPU (``-m gpu``, H200): DeepSeek shapes (H = 128, K = 2048, T in {1, 32}) vs the reference and FlashMLA,
every launch configuration of the benchmark's sweep at one shape, CUDA-graph capture and replay with new
inputs, no allocation and no host sync on the planned path.
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch
from opcount import HOST_READS, OpCount

from dcp_ref.attention import sparse_mla_attention
from dcp_ref.kernels import attention_splitkv_triton as sk
from dcp_ref.step import HostSyncCounter

NAN, INF = float("nan"), float("inf")
D_SMALL, V_SMALL = 80, 64  # the reduced-dim variant: 64 value dims + 16 "RoPE" dims


def make_case(T, H, S, K, counts, *, D=D_SMALL, V=V_SMALL, seed=0, dtype=torch.float32, device="cpu"):
    """Distinct slots per row (a permutation prefix), ``-1`` after the count (read nothing there)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    kv = torch.randn(S, D, generator=g).to(dtype)
    counts = torch.as_tensor(counts, dtype=torch.int32)
    slots = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(T)]).to(torch.int32).reshape(T, K)
    slots[torch.arange(K) >= counts.clamp(min=0).unsqueeze(1)] = -1
    return q.to(device), kv.to(device), slots.to(device), counts.to(device)


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()


def assert_matches(out, lse, ref_out, ref_lse, *, rtol, lse_atol):
    """NaN exactly where the reference has NaN; -inf exactly where it has -inf; finite values close."""
    out, lse = out.double().cpu(), lse.double().cpu()
    ref_out, ref_lse = ref_out.double().cpu(), ref_lse.double().cpu()
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)), (lse, ref_lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), (lse, ref_lse)
    assert torch.equal(torch.isnan(out), torch.isnan(ref_out))
    fin = torch.isfinite(ref_lse)
    if bool(fin.any()):
        assert (lse[fin] - ref_lse[fin]).abs().max().item() <= lse_atol
    ok = torch.isfinite(ref_out)
    if bool(ok.any()):
        err = (out[ok] - ref_out[ok]).norm() / ref_out[ok].norm().clamp_min(1e-300)
        assert err.item() <= rtol, err.item()
    empty = torch.isneginf(ref_lse)
    assert bool((out[empty] == 0).all())


#: the tuning arguments of splitkv_plan (sparse_mla_splitkv takes them only through its plan)
KNOBS = ("num_splits", "block_h", "block_n", "num_warps", "num_stages")


def splitkv(q, kv_cache, slots, counts, sm_scale, v_dim=512, **kw):
    """``sk.sparse_mla_splitkv`` with any tuning arguments in ``kw`` made into this call's plan
    (``splitkv_plan(T, H, K, q.device, head_dim=Dqk, v_dim=v_dim, **tuning)``); none: the default plan."""
    knobs = {name: kw.pop(name) for name in KNOBS if name in kw}
    if knobs:
        T, H, dqk = q.shape
        kw["plan"] = sk.splitkv_plan(T, H, slots.shape[1], q.device, head_dim=dqk, v_dim=v_dim, **knobs)
    return sk.sparse_mla_splitkv(q, kv_cache, slots, counts, sm_scale, v_dim, **kw)


def run_and_check(q, kv, slots, counts, scale=0.3, v=V_SMALL, rtol=1e-5, lse_atol=1e-5, **kw):
    out, lse = splitkv(q, kv, slots, counts, scale, v, validate=False, **kw)
    ref_out, ref_lse = sparse_mla_attention(q, kv, slots, counts, scale, v_dim=v, validate=False)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert_matches(out, lse, ref_out, ref_lse, rtol=rtol, lse_atol=lse_atol)
    return out, lse


# ---------------------------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize(
    "H,opts",
    [
        (16, {}),  # the default plan
        (16, {"num_splits": 1, "block_n": 16}),  # one split: phase 1 writes the outputs
        (16, {"num_splits": 2, "block_n": 16}),
        (16, {"num_splits": 5, "block_n": 16}),  # capped at 3 splits of 16 keys (K = 48)
        (32, {"block_h": 16, "num_splits": 3, "block_n": 16}),
        (32, {"block_h": 32, "num_splits": 2, "block_n": 32}),
        (64, {"block_h": 64, "num_splits": 2, "block_n": 16}),
        (128, {}),
        (20, {"block_h": 16, "num_splits": 2, "block_n": 16}),  # H not a multiple of the head block
    ],
)
def test_matches_reference(kernel_device, H, opts) -> None:
    counts = [48, 0, 5, 33] if H < 32 else [48, 21]  # fewer tokens with more heads: the interpreter's time
    q, kv, slots, counts = make_case(len(counts), H, 100, 48, counts, seed=H, device=kernel_device)
    run_and_check(q, kv, slots, counts, **opts)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_deepseek_dims_bf16(kernel_device, num_splits) -> None:
    """576 key dims (two dots: 512 + 64), 512 value dims, bf16 tiles with fp32 accumulation."""
    q, kv, slots, counts = make_case(
        3, 16, 300, 64, [64, 0, 17], D=576, V=512, seed=7, dtype=torch.bfloat16, device=kernel_device
    )
    out, _ = run_and_check(
        q, kv, slots, counts, 576**-0.5, 512, rtol=1e-2, lse_atol=1e-4, num_splits=num_splits, block_n=32
    )
    assert out.dtype == torch.bfloat16


def test_default_plan_at_deepseek_dims(kernel_device) -> None:
    q, kv, slots, counts = make_case(
        2, 16, 300, 128, [128, 70], D=576, V=512, seed=8, dtype=torch.bfloat16, device=kernel_device
    )
    plan = sk.splitkv_plan(2, 16, 128, kernel_device)
    assert plan.num_splits > 1  # few tokens: the keys are split
    run_and_check(q, kv, slots, counts, 576**-0.5, 512, rtol=1e-2, lse_atol=1e-4)


def test_large_scores_do_not_overflow(kernel_device) -> None:
    """Scores in the thousands: only a max-subtracted softmax (per split and in the combine) survives."""
    q, kv, slots, counts = make_case(2, 16, 64, 48, [48, 40], seed=3, device=kernel_device)
    run_and_check(q * 30, kv * 30, slots, counts, 1.0, num_splits=3, block_n=16, rtol=1e-4, lse_atol=1e-2)


# ---------------------------------------------------------------------------------------------- contract
def test_empty_rows_and_clamped_counts(kernel_device) -> None:
    """counts <= 0: output exactly 0 and LSE -inf; counts > K: all K slots (clamped on the device)."""
    K = 32
    q, kv, slots, _ = make_case(4, 16, 80, K, [K, K, K, K], seed=4, device=kernel_device)
    counts = torch.tensor([-3, K + 7, 0, 5], dtype=torch.int32, device=kernel_device)
    for ns in (1, 2):
        out, lse = splitkv(q, kv, slots, counts, 0.3, V_SMALL, validate=False, num_splits=ns, block_n=16)
        want = torch.tensor([0, K, 0, 5], dtype=torch.int32, device=kernel_device)
        ref_out, ref_lse = sparse_mla_attention(q, kv, slots, want, 0.3, v_dim=V_SMALL)
        assert_matches(out, lse, ref_out, ref_lse, rtol=1e-5, lse_atol=1e-5)
        for t in (0, 2):
            assert bool((out[t] == 0).all()) and bool(torch.isneginf(lse[t]).all())


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_bad_slots_poison_their_row(kernel_device, slot_dtype, num_splits) -> None:
    """A used slot outside [0, S) makes its whole row NaN (every head), never a plausible value; an unused
    one (past the count) is harmless. int64 slots are tested as given: 2**32 + 5 must not wrap to 5."""
    S, K = 60, 48
    q, kv, slots, counts = make_case(6, 16, S, K, [48, 48, 48, 30, 48, 20], seed=5, device=kernel_device)
    slots = slots.to(slot_dtype)
    slots[0, 3] = -1  # a padding marker inside the used prefix
    slots[1, 40] = S  # one past the cache, in the last split
    slots[3, 35] = -7  # past the count of row 3 (30): never read
    if slot_dtype == torch.int64:
        slots[2, 17] = 2**32 + 5  # narrowed to int32 it would be slot 5
        slots[4, 0] = 2**31
    else:
        slots[2, 17] = 2**31 - 1
        slots[4, 0] = -(2**31)
    out, lse = splitkv(q, kv, slots, counts, 0.3, V_SMALL, validate=False, num_splits=num_splits, block_n=16)
    for t in (0, 1, 2, 4):
        assert bool(torch.isnan(out[t]).all()) and bool(torch.isnan(lse[t]).all()), t
    good = [3, 5]
    ref_out, ref_lse = sparse_mla_attention(q[good], kv, slots[good], counts[good], 0.3, v_dim=V_SMALL)
    assert_matches(out[good], lse[good], ref_out, ref_lse, rtol=1e-5, lse_atol=1e-5)
    # the reference agrees (validate=False poisons the same rows)
    _, ref_all_lse = sparse_mla_attention(q, kv, slots, counts, 0.3, v_dim=V_SMALL, validate=False)
    assert torch.equal(torch.isnan(ref_all_lse).cpu(), torch.isnan(lse).cpu())


@pytest.mark.parametrize("num_splits", [1, 3])
def test_nan_propagates_to_exactly_the_affected_rows(kernel_device, num_splits) -> None:
    S, K = 70, 48
    q, kv, slots, counts = make_case(5, 16, S, K, [48, 48, 48, 10, 0], seed=6, device=kernel_device)
    # Row 0 alone attends to slot `a` (in its last split), row 1 alone to slot `b` (NaN only in a RoPE dim).
    used = {int(s) for t in (2, 3) for s in slots[t, : int(counts[t])].tolist()}
    free = [s for s in range(S) if s not in used]
    a, b, c = free[:3]
    slots[0, 45] = a
    slots[1, 2] = b
    slots[1, 45:] = torch.tensor([s for s in range(S) if s not in used and s not in (a, b, c)][:3])
    slots[0, :45] = torch.tensor([s for s in range(S) if s not in (a, b, c)][:45])
    slots[3, 20] = c  # past row 3's count: never read, its NaN must not leak
    q = q.clone()
    kv = kv.clone()
    q[2, 5, 7] = NAN  # exactly (2, 5)
    kv[a, 10] = NAN  # a value (and key) dim
    kv[b, D_SMALL - 1] = NAN  # a RoPE dim: the score is NaN
    kv[c] = NAN
    out, lse = splitkv(q, kv, slots, counts, 0.3, V_SMALL, validate=False, num_splits=num_splits, block_n=16)
    ref_out, ref_lse = sparse_mla_attention(q, kv, slots, counts, 0.3, v_dim=V_SMALL, validate=False)
    assert bool(torch.isnan(lse[0]).all()) and bool(torch.isnan(lse[1]).all())
    nan_heads = torch.isnan(lse[2]).nonzero().flatten().tolist()
    assert nan_heads == [5]
    assert_matches(out, lse, ref_out, ref_lse, rtol=1e-5, lse_atol=1e-5)
    assert bool(torch.isfinite(out[3]).all()) and bool(torch.isfinite(lse[3]).all())


def test_infinite_scores_of_a_nonempty_row_give_nan(kernel_device) -> None:
    """All scores -inf (infinite data) in a non-empty row: NaN, never the empty row's -inf."""
    q, kv, slots, counts = make_case(2, 16, 40, 32, [32, 32], seed=9, device=kernel_device)
    kv = kv.clone()
    kv[:, 0] = kv[:, 0].abs() + 1.0
    q = q.clone()
    q[0, 3, :] = 0.0
    q[0, 3, 0] = -INF
    for ns in (1, 2):
        out, lse = splitkv(q, kv, slots, counts, 0.3, V_SMALL, validate=False, num_splits=ns, block_n=16)
        ref_out, ref_lse = sparse_mla_attention(q, kv, slots, counts, 0.3, v_dim=V_SMALL)
        assert math.isnan(float(lse[0, 3])) and bool(torch.isnan(out[0, 3]).all())
        assert_matches(out, lse, ref_out, ref_lse, rtol=1e-5, lse_atol=1e-5)


def test_splits_without_keys(kernel_device) -> None:
    """Rows shorter than the split range: their later splits hold no key, are never written, and add 0.
    The workspace is filled with NaN first: a split that is read although empty would show."""
    K = 64
    q, kv, slots, counts = make_case(5, 16, 100, K, [1, 17, 64, 0, 33], seed=10, device=kernel_device)
    plan = sk.splitkv_plan(5, 16, K, kernel_device, head_dim=D_SMALL, v_dim=V_SMALL, num_splits=4, block_n=16)
    assert (plan.num_splits, plan.split_len) == (4, 16)
    ws = sk.workspace_for(plan, kernel_device).fill_(NAN)
    run_and_check(q, kv, slots, counts, plan=plan, workspace=ws)


def test_zero_tokens_and_zero_width(kernel_device) -> None:
    q, kv, slots, counts = make_case(3, 16, 50, 16, [16, 0, 3], seed=11, device=kernel_device)
    out, lse = sk.sparse_mla_splitkv(q[:0], kv, slots[:0], counts[:0], 0.3, V_SMALL)
    assert out.shape == (0, 16, V_SMALL) and lse.shape == (0, 16)
    empty = torch.zeros((3, 0), dtype=torch.int32, device=kernel_device)
    out, lse = sk.sparse_mla_splitkv(q, kv, empty, counts, 0.3, V_SMALL, validate=False)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())


@pytest.mark.parametrize("layout", ["s1d", "blocks", "blocks4", "strided_blocks"])
def test_cache_layouts(kernel_device, layout) -> None:
    """[S, 1, D], [blocks, bs, D], [blocks, bs, 1, D] and blocks with a larger stride (no copy)."""
    nb, bs = 10, 8
    q, kv, slots, counts = make_case(3, 16, nb * bs, 40, [40, 7, 0], seed=12, device=kernel_device)
    if layout == "s1d":
        cache = kv.unsqueeze(1)
    elif layout == "blocks":
        cache = kv.view(nb, bs, D_SMALL)
    elif layout == "blocks4":
        cache = kv.view(nb, bs, 1, D_SMALL)
    else:
        big = torch.full((nb, bs, 3, D_SMALL), NAN, device=kernel_device)
        big[:, :, 1] = kv.view(nb, bs, D_SMALL)
        cache = big[:, :, 1:2, :]  # block stride 3 * bs * D, row stride 3 * D
    out, lse = splitkv(q, cache, slots, counts, 0.3, V_SMALL, num_splits=2, block_n=16)
    ref_out, ref_lse = sparse_mla_attention(q, kv, slots, counts, 0.3, v_dim=V_SMALL)
    assert_matches(out, lse, ref_out, ref_lse, rtol=1e-5, lse_atol=1e-5)


def test_strided_inputs_and_caller_buffers(kernel_device) -> None:
    """Strided q, slots, out and out_lse; the given buffers are the ones returned, every entry written."""
    T, H, K = 3, 16, 32
    q, kv, slots, counts = make_case(T, H, 60, K, [32, 0, 9], seed=13, device=kernel_device)
    q_s = q.transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, D] with strides (D, T*D, 1)
    slots_s = slots.t().contiguous().t()  # column-major
    base = torch.full((T, V_SMALL, H), 7.0, device=kernel_device)
    out = base.transpose(1, 2)  # [T, H, V] with the values strided
    lse = torch.full((H, T), 7.0, device=kernel_device).t()
    for ns in (1, 2):
        got, got_lse = splitkv(q_s, kv, slots_s, counts, 0.3, V_SMALL, out=out, out_lse=lse, num_splits=ns, block_n=16)
        assert got is out and got_lse is lse
        ref_out, ref_lse = sparse_mla_attention(q, kv, slots, counts, 0.3, v_dim=V_SMALL)
        assert_matches(out, lse, ref_out, ref_lse, rtol=1e-5, lse_atol=1e-5)
        out.fill_(7.0)
        lse.fill_(7.0)


# ---------------------------------------------------------------------------------------------- no host work
def test_validate_false_reads_nothing_on_meta_tensors() -> None:
    """Meta tensors carry shapes, no values: any host read (.item(), bool(tensor)) would raise."""
    meta = torch.device("meta")
    q = torch.zeros(5, 16, 576, dtype=torch.bfloat16, device=meta)
    kv = torch.zeros(100, 576, dtype=torch.bfloat16, device=meta)
    slots = torch.zeros(5, 64, dtype=torch.int64, device=meta)
    counts = torch.zeros(5, dtype=torch.int32, device=meta)
    out, lse = sk.sparse_mla_splitkv(q, kv, slots, counts, 0.1, 512, validate=False)
    assert out.device.type == "meta" and out.shape == (5, 16, 512) and lse.shape == (5, 16)
    with pytest.raises(ValueError, match=r"^counts is a meta tensor"):
        sk.sparse_mla_splitkv(q, kv, slots, counts, 0.1, 512)


class _Recorder:
    """Stands in for a @triton.jit kernel: records launches, runs nothing."""

    def __init__(self) -> None:
        self.grids: list = []

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.grids.append(grid)

        return launch


def test_planned_call_allocates_nothing_and_never_syncs(kernel_device, monkeypatch) -> None:
    """The host side of a planned call (out buffers, workspace, validate=False) makes only views: no
    allocation, no value read. (The launches are recorded, not run: the interpreter copies tensors.)"""
    T, H, K = 3, 16, 64
    q, kv, slots, counts = make_case(T, H, 90, K, [64, 0, 40], seed=14, device=kernel_device)
    plan = sk.splitkv_plan(T, H, K, kernel_device, head_dim=D_SMALL, v_dim=V_SMALL, num_splits=4, block_n=16)
    ws = sk.workspace_for(plan, kernel_device)
    out = torch.empty(T, H, V_SMALL, device=kernel_device)
    lse = torch.empty(T, H, device=kernel_device)
    p1, p2 = _Recorder(), _Recorder()
    monkeypatch.setattr(sk, "splitkv_partial_kernel", p1)
    monkeypatch.setattr(sk, "splitkv_combine_kernel", p2)
    with HostSyncCounter() as c:
        sk.sparse_mla_splitkv(q, kv, slots, counts, 0.3, V_SMALL, out=out, out_lse=lse, workspace=ws, plan=plan,
                              validate=False)  # fmt: skip
    assert c.syncs == [] and set(c.ops) <= {"aten::slice"}, sorted(set(c.ops))
    assert p1.grids == [(plan.ctas,)] and p2.grids == [(plan.combine_ctas,)]
    assert plan.num_splits == 4 and plan.ctas == T * plan.head_groups * 4 and plan.combine_ctas > 0
    monkeypatch.undo()
    with HostSyncCounter() as c:  # the real launches too: no value read back
        sk.sparse_mla_splitkv(q, kv, slots, counts, 0.3, V_SMALL, out=out, out_lse=lse, workspace=ws, plan=plan,
                              validate=False)  # fmt: skip
    assert c.syncs == []


# ---------------------------------------------------------------------------------------------- bad input
def _ok(device="cpu"):
    q, kv, slots, counts = make_case(3, 16, 50, 32, [32, 0, 3], seed=15, device=device)
    return {"q": q, "kv_cache": kv, "slots": slots, "counts": counts, "sm_scale": 0.3, "v_dim": V_SMALL}


def _bad_cases(device="cpu"):
    ok = _ok(device)
    q, kv, slots, counts = ok["q"], ok["kv_cache"], ok["slots"], ok["counts"]
    dev = q.device
    bad_slot = slots.clone()
    bad_slot[0, 2] = 50
    return [
        ("q", TypeError, {"q": q.long()}),
        ("q", ValueError, {"q": q[0]}),
        ("kv_cache", TypeError, {"kv_cache": kv.double()}),
        ("kv_cache", TypeError, {"kv_cache": [1.0]}),
        ("kv_cache", ValueError, {"kv_cache": kv[:, :40]}),
        ("kv_cache", ValueError, {"kv_cache": kv.view(5, 10, D_SMALL).unsqueeze(2).expand(5, 10, 2, D_SMALL)}),
        ("kv_cache", ValueError, {"kv_cache": kv.view(-1)}),
        ("slots", TypeError, {"slots": slots.float()}),
        ("slots", ValueError, {"slots": slots[:2]}),
        ("slots", ValueError, {"slots": bad_slot}),
        ("counts", ValueError, {"counts": counts[:2]}),
        ("counts", TypeError, {"counts": counts.float()}),
        ("counts", ValueError, {"counts": torch.tensor([33, 0, 0], dtype=torch.int32, device=dev)}),
        ("counts", ValueError, {"counts": torch.tensor([-1, 0, 0], dtype=torch.int32, device=dev)}),
        ("sm_scale", ValueError, {"sm_scale": 0.0}),
        ("sm_scale", ValueError, {"sm_scale": NAN}),
        ("sm_scale", TypeError, {"sm_scale": True}),
        ("v_dim", ValueError, {"v_dim": D_SMALL + 1}),
        ("v_dim", ValueError, {"v_dim": 0}),
        ("v_dim", TypeError, {"v_dim": 64.0}),
        ("validate", TypeError, {"validate": 1}),
        ("out", ValueError, {"out": torch.empty(3, 16, 32, device=dev)}),
        ("out", TypeError, {"out": torch.empty(3, 16, V_SMALL, dtype=torch.float64, device=dev)}),
        ("out_lse", TypeError, {"out_lse": torch.empty(3, 16, dtype=torch.float64, device=dev)}),
        ("out_lse", ValueError, {"out_lse": torch.empty(16, 3, device=dev)}),
        ("workspace", ValueError, {"workspace": torch.empty(10, device=dev), "num_splits": 2, "block_n": 16}),
        ("workspace", TypeError, {"workspace": torch.empty(10**5, dtype=torch.float64, device=dev)}),
        ("out_lse", ValueError, {"out": (o := torch.empty(3, 16, V_SMALL, device=dev)), "out_lse": o[:, :, 0]}),
        ("out", ValueError, {"q": q, "out": q[:, :, :V_SMALL]}),
        ("out", ValueError, {"kv_cache": kv, "out": kv.view(-1)[: 3 * 16 * V_SMALL].view(3, 16, V_SMALL)}),
        (
            "workspace",
            ValueError,
            {
                "q": (qw := torch.empty(10**5, device=dev))[: q.numel()].view_as(q).copy_(q),
                "workspace": qw,
                "num_splits": 2,
                "block_n": 16,
            },
        ),
        (
            "workspace",
            ValueError,
            {
                "out": (w := torch.empty(10**5, device=dev))[: 3 * 16 * V_SMALL].view(3, 16, V_SMALL),
                "workspace": w,
                "num_splits": 2,
                "block_n": 16,
            },
        ),
        ("plan", ValueError, {"plan": sk.splitkv_plan(4, 16, 16, "cpu", head_dim=D_SMALL, v_dim=V_SMALL)}),
        ("plan", ValueError, {"plan": sk.splitkv_plan(3, 16, 32, "meta", head_dim=D_SMALL, v_dim=V_SMALL)}),
        ("plan", TypeError, {"plan": {"num_splits": 2}}),
        # the tuning: splitkv() makes it into the call's plan, and splitkv_plan refuses it, naming the argument
        ("num_splits", ValueError, {"num_splits": 0}),
        ("block_h", ValueError, {"block_h": 24}),
        ("block_h", ValueError, {"block_h": 8}),
        ("block_n", ValueError, {"block_n": 8}),
        ("num_warps", ValueError, {"num_warps": 3}),
        ("num_stages", ValueError, {"num_stages": 0}),
    ]


@pytest.mark.parametrize("i", range(len(_bad_cases())))
def test_bad_input_names_the_argument(kernel_device, i) -> None:
    name, exc, override = _bad_cases(kernel_device)[i]
    with pytest.raises(exc) as e:
        splitkv(**{**_ok(kernel_device), **override})
    assert str(e.value).startswith(name), str(e.value)


@pytest.mark.gpu
def test_bad_input_names_the_argument_on_gpu(cuda_device) -> None:
    """The table on the H200 (the compiled kernels; the aliasing rows are built on the device)."""
    for name, exc, override in _bad_cases(cuda_device):
        with pytest.raises(exc) as e:
            splitkv(**{**_ok(cuda_device), **override})
        assert str(e.value).startswith(name), str(e.value)


def test_validate_messages_are_the_references(kernel_device) -> None:
    ok = _ok(kernel_device)
    bad = ok["slots"].clone()
    bad[0, 5], bad[2, 1] = -1, 50
    for override in ({"counts": torch.tensor([33, 0, 0], dtype=torch.int32)}, {"slots": bad}):
        kw = {**ok, **override}
        with pytest.raises(ValueError) as ker:
            sk.sparse_mla_splitkv(**kw)
        with pytest.raises(ValueError) as ref:
            sparse_mla_attention(kw["q"], kw["kv_cache"], kw["slots"], kw["counts"], 0.3, v_dim=V_SMALL)
        assert str(ker.value) == str(ref.value)


# ---------------------------------------------------------------------------------------------- the validated call


def _wrapper_ops(monkeypatch, fn) -> list[str]:  # noqa: ANN001
    """What ``fn()`` runs in the wrapper's own code, in order (``tests/opcount.py``): each Triton launch and every
    non-view aten op outside the launches (the ops a device would launch, and host reads)."""
    counter = OpCount()
    with counter.recording([(sk, "splitkv_partial_kernel"), (sk, "splitkv_combine_kernel")]):
        fn()
    return counter.ops


def _flag(dev) -> int:  # noqa: ANN001
    from dcp_ref.kernels._util import check_flag

    return int(check_flag(torch.device(dev)).item())


@pytest.mark.parametrize("num_splits", [1, 2])
def test_validated_call_is_the_unvalidated_launches_plus_one_read(kernel_device, monkeypatch, num_splits) -> None:
    """A planned validated call is the unvalidated call's launches (phase 1 with its CHECK switch on, phase 2)
    and exactly one host read, of phase 1's flag, after both launches, plus the flag itself (made per call).
    (Before the fold: 21 torch ops and a read ahead of the launches.)"""
    T, H, K = 3, 16, 32
    q, kv, slots, counts = make_case(T, H, 50, K, [32, 0, 3], seed=15, device=kernel_device)
    plan = sk.splitkv_plan(T, H, K, kernel_device, head_dim=D_SMALL, v_dim=V_SMALL, num_splits=num_splits, block_n=16)
    ws = sk.workspace_for(plan, kernel_device)
    out = torch.empty(T, H, V_SMALL, device=kernel_device)
    lse = torch.empty(T, H, device=kernel_device)

    def call(v: bool) -> None:
        sk.sparse_mla_splitkv(q, kv, slots, counts, 0.3, V_SMALL, out=out, out_lse=lse, workspace=ws, plan=plan,
                              validate=v)  # fmt: skip

    call(False), call(True)  # warm: compiled
    plain = _wrapper_ops(monkeypatch, lambda: call(False))
    checked = _wrapper_ops(monkeypatch, lambda: call(True))
    launches = ["triton:splitkv_partial_kernel"] + (["triton:splitkv_combine_kernel"] if num_splits > 1 else [])
    assert plain == launches, plain
    reads = [op for op in checked if op in HOST_READS]
    assert len(reads) == 1 and checked == ["aten::zeros", *plain, *reads], checked
    assert _flag(kernel_device) == 0


def _bad_splitkv_cases():
    """``(label, slots [3, 40], counts)`` with a cache of S=60 rows, each refused by the reference. In blocks of 16
    keys (three splits) row 0's slot 35 is in its third split and row 2's slot 17 in its second."""
    good = torch.stack([torch.randperm(60, generator=torch.Generator().manual_seed(r))[:40] for r in range(3)])
    good[1, 1:], good[2, 20:] = -1, -1
    counts = [40, 1, 20]

    def put(row: int, col: int, value: int) -> list:
        bad = good.clone().tolist()
        bad[row][col] = value
        return bad

    return [
        ("a used slot past the cache", put(2, 17, 60), counts),
        ("the poison slot", put(0, 35, 2**31 - 1), counts),
        ("a negative used slot in a later split", put(0, 35, -3), counts),
        ("counts past K", good.tolist(), [41, 1, 20]),
        ("a negative count", good.tolist(), [40, -1, 20]),
        ("both counts out of range", good.tolist(), [-2, 99, 20]),
    ]


@pytest.mark.parametrize("num_splits", [1, 3])
def test_validated_bad_inputs_raise_the_references_message_and_clear_the_flag(kernel_device, num_splits) -> None:
    """Each bad input raises exactly the reference's message and leaves the flag cleared; unvalidated calls on
    the same inputs never raise it (the row poisoned or the count clamped on the device); a good call passes."""
    q = torch.randn(3, 2, D_SMALL, generator=torch.Generator().manual_seed(4))
    kv = torch.randn(60, D_SMALL, generator=torch.Generator().manual_seed(5))
    q_d, kv_d = q.to(kernel_device), kv.to(kernel_device)
    opts = dict(num_splits=num_splits, block_n=16)
    assert sk.splitkv_plan(3, 2, 40, kernel_device, head_dim=D_SMALL, v_dim=V_SMALL, **opts).num_splits == num_splits
    for label, rows, cnt in _bad_splitkv_cases():
        for dtype in (torch.int32, torch.int64):
            slots, counts = torch.tensor(rows, dtype=dtype), torch.tensor(cnt, dtype=dtype)
            with pytest.raises(ValueError) as ref:
                sparse_mla_attention(q.double(), kv.double(), slots, counts, 0.3, v_dim=V_SMALL)
            with pytest.raises(ValueError) as ker:
                splitkv(q_d, kv_d, slots.to(kernel_device), counts.to(kernel_device), 0.3, V_SMALL, **opts)
            assert str(ker.value) == str(ref.value), label
            assert _flag(kernel_device) == 0, label  # cleared: the next validated call starts clean
            splitkv(q_d, kv_d, slots.to(kernel_device), counts.to(kernel_device), 0.3, V_SMALL, validate=False, **opts)
            assert _flag(kernel_device) == 0, label  # unvalidated: never raised
    wide = torch.tensor(_bad_splitkv_cases()[0][1], dtype=torch.int64)
    wide[2, 17] = 2**32 + 5  # narrowed to int32 it would be slot 5: tested as given
    counts = torch.tensor([40, 1, 20])
    with pytest.raises(ValueError) as ref:
        sparse_mla_attention(q.double(), kv.double(), wide, counts, 0.3, v_dim=V_SMALL)
    with pytest.raises(ValueError) as ker:
        splitkv(q_d, kv_d, wide.to(kernel_device), counts.to(kernel_device), 0.3, V_SMALL, **opts)
    assert str(ker.value) == str(ref.value) and _flag(kernel_device) == 0
    wide[2, 17] = 59
    out, lse = splitkv(q_d, kv_d, wide.to(kernel_device), counts.to(kernel_device), 0.3, V_SMALL, **opts)
    ref_out, ref_lse = sparse_mla_attention(q, kv, wide, counts, 0.3, v_dim=V_SMALL)
    assert_matches(out, lse, ref_out, ref_lse, rtol=1e-5, lse_atol=1e-5)
    assert _flag(kernel_device) == 0


# ---------------------------------------------------------------------------------------------- plan, stage
def test_plan_depends_on_shapes_only() -> None:
    p = sk.splitkv_plan(1, 128, 2048, "cpu")
    assert p == sk.splitkv_plan(1, 128, 2048, torch.device("cpu"))
    assert p.sm_count == sk.NOMINAL_SM_COUNT and p.ctas >= 32  # few tokens: the keys fill the SMs
    assert p.num_splits * p.split_len >= 2048 and p.split_len % p.block_n == 0
    assert (p.num_splits - 1) * p.split_len < 2048  # no split lies entirely past K
    assert p.workspace_numel == 1 * p.num_splits * 128 * 513 and p.workspace_shape == (p.workspace_numel,)
    one = sk.splitkv_plan(4, 16, 64, "cpu", num_splits=1)
    assert one.num_splits == 1 and one.workspace_numel == 0 and one.combine_ctas == 0
    capped = sk.splitkv_plan(2, 16, 40, "cpu", num_splits=50, block_n=16)
    assert (capped.num_splits, capped.split_len) == (3, 16)
    for H in (16, 32, 64, 128):
        for T in (1, 2, 4, 8, 32, 128):
            p = sk.splitkv_plan(T, H, 2048, "cpu")
            assert p.block_h in (16, 32, 64) and p.head_groups * p.block_h >= H
            assert 1 <= p.num_splits <= 128 and p.num_warps in (4, 8)
    with pytest.raises(ValueError, match=r"^v_dim"):
        sk.splitkv_plan(1, 16, 64, "cpu", head_dim=64, v_dim=65)
    with pytest.raises(ValueError, match=r"^H"):
        sk.splitkv_plan(1, 0, 64, "cpu")


def test_a_plan_is_checked_against_the_call_and_used_as_is(kernel_device, monkeypatch) -> None:
    """``plan=None`` is the default plan by shape: the same output, bit for bit, as ``plan=splitkv_plan(<this
    shape>)``; a plan made for another T, H, K, head_dim, v_dim or device is refused, naming ``plan``; a forced
    plan is what runs (its launches and its workspace, not the default's). The tuning goes through the plan only."""
    params = inspect.signature(sk.sparse_mla_splitkv).parameters
    assert not set(KNOBS) & set(params) and params["plan"].default is None
    T, H, K = 3, 16, 48
    q, kv, slots, counts = make_case(T, H, 80, K, [48, 0, 20], seed=17, device=kernel_device)
    same = sk.splitkv_plan(T, H, K, kernel_device, head_dim=D_SMALL, v_dim=V_SMALL)
    assert same == sk.splitkv_plan(*q.shape[:2], slots.shape[1], q.device, head_dim=q.shape[2], v_dim=V_SMALL)
    assert same.device == str(q.device)
    for validate in (True, False):
        got = sk.sparse_mla_splitkv(q, kv, slots, counts, 0.3, V_SMALL, validate=validate, plan=same)
        want = sk.sparse_mla_splitkv(q, kv, slots, counts, 0.3, V_SMALL, validate=validate)
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    others = {
        "T": sk.splitkv_plan(T + 1, H, K, kernel_device, head_dim=D_SMALL, v_dim=V_SMALL),
        "H": sk.splitkv_plan(T, 32, K, kernel_device, head_dim=D_SMALL, v_dim=V_SMALL),
        "K": sk.splitkv_plan(T, H, K - 16, kernel_device, head_dim=D_SMALL, v_dim=V_SMALL),
        "head_dim": sk.splitkv_plan(T, H, K, kernel_device, head_dim=D_SMALL + 16, v_dim=V_SMALL),
        "v_dim": sk.splitkv_plan(T, H, K, kernel_device, head_dim=D_SMALL, v_dim=V_SMALL - 16),
        "the default head_dim, v_dim": sk.splitkv_plan(T, H, K, kernel_device),
        "device": sk.splitkv_plan(T, H, K, "meta", head_dim=D_SMALL, v_dim=V_SMALL),
        "a forced plan": sk.splitkv_plan(T, H, 32, kernel_device, head_dim=D_SMALL, v_dim=V_SMALL, num_splits=2,
                                         block_n=16),
    }  # fmt: skip
    for why, other in others.items():
        for validate in (True, False):
            with pytest.raises(ValueError, match=r"^plan was made for T=") as info:
                sk.sparse_mla_splitkv(q, kv, slots, counts, 0.3, V_SMALL, validate=validate, plan=other)
            assert f"not for this call's T=3, H=16, K=48, head_dim={D_SMALL}, v_dim={V_SMALL} on" in str(info.value), (
                why
            )
    with pytest.raises(TypeError, match=r"^plan must be a SplitKVPlan"):  # its fields, not the plan
        sk.sparse_mla_splitkv(q, kv, slots, counts, 0.3, V_SMALL, plan=dataclasses.asdict(same))
    # a forced plan runs as made: its splits and head groups launch, and it reads its own workspace
    forced = sk.splitkv_plan(T, H, K, kernel_device, head_dim=D_SMALL, v_dim=V_SMALL, num_splits=3, block_n=16)
    assert forced != same and forced.num_splits == 3 and same.num_splits == 2
    ws = sk.workspace_for(forced, kernel_device)
    assert ws.numel() > same.workspace_numel
    run_and_check(q, kv, slots, counts, plan=forced, workspace=ws)
    with pytest.raises(ValueError, match=r"^workspace"):  # the default plan's workspace is too small for it
        sk.sparse_mla_splitkv(q, kv, slots, counts, 0.3, V_SMALL, plan=forced,
                              workspace=sk.workspace_for(same, kernel_device))  # fmt: skip
    p1, p2 = _Recorder(), _Recorder()
    monkeypatch.setattr(sk, "splitkv_partial_kernel", p1)
    monkeypatch.setattr(sk, "splitkv_combine_kernel", p2)
    sk.sparse_mla_splitkv(q, kv, slots, counts, 0.3, V_SMALL, validate=False, plan=forced, workspace=ws)
    assert p1.grids == [(forced.ctas,)] and p2.grids == [(forced.combine_ctas,)]
    assert forced.ctas == T * forced.head_groups * 3 != same.ctas


def test_stage_wrapper(kernel_device) -> None:
    """The AttentionStage signature; the kernels' stage bound to a planned step owns its workspace per plan (made
    once, reused), another planned step's stage its own, and the unbound stage none (per call)."""
    from dcp_ref.kernels import stages as ks
    from dcp_ref.stages import AttentionStage, impl_name

    want = list(inspect.signature(AttentionStage.__call__).parameters)[1:]
    assert list(inspect.signature(sk.splitkv_attention).parameters) == want
    assert impl_name(sk.splitkv_attention) == "triton-splitkv"
    q, kv, slots, counts = make_case(3, 16, 80, 64, [64, 0, 20], seed=16, device=kernel_device)
    out = torch.full((3, 16, V_SMALL), 7.0, device=kernel_device)
    lse = torch.full((3, 16), 7.0, device=kernel_device)
    got = sk.splitkv_attention(q, kv, slots, counts, 0.3, V_SMALL, out=out, out_lse=lse)
    assert got[0] is out and got[1] is lse
    ref_out, ref_lse = sparse_mla_attention(q, kv, slots, counts, 0.3, v_dim=V_SMALL)
    assert_matches(out, lse, ref_out, ref_lse, rtol=1e-5, lse_atol=1e-5)
    plan = sk.splitkv_plan(3, 16, 64, kernel_device, head_dim=D_SMALL, v_dim=V_SMALL)
    key = (q.device, plan)
    stage, other = ks._attention_splitkv.bound(), ks._attention_splitkv.bound()
    assert list(inspect.signature(stage).parameters) == want and impl_name(stage) == "triton-splitkv"
    stage(q, kv, slots, counts, 0.3, V_SMALL, out=out, out_lse=lse)
    assert_matches(out, lse, ref_out, ref_lse, rtol=1e-5, lse_atol=1e-5)
    first = stage._workspaces[key]
    stage(q, kv, slots, counts, 0.3, V_SMALL)
    assert stage._workspaces[key] is first  # reused: what a captured graph keeps reading
    assert other._workspaces == {} and ks._attention_splitkv._workspaces is None  # another step's; none cached
    assert sk.splitkv_unsupported(kernel_device, torch.bfloat16, 16, 576, 512) == ""
    assert "int8" in sk.splitkv_unsupported(kernel_device, torch.int8, 16, 576, 512)


def test_conformance_kit(kernel_device) -> None:
    """The kit's drawn cases: tiny shapes, garbage past the counts (NaN rows, far out of range), large scores,
    NaN in read rows, strided inputs, caller buffers."""
    from dcp_ref.testing import check_attention

    # compiled (a GPU run), each drawn shape is a new specialization (~1 s): fewer examples there
    check_attention(sk.splitkv_attention, device=kernel_device, max_examples=25 if kernel_device.type == "cpu" else 8)


# ---------------------------------------------------------------------------------------------- GPU
def _gpu_case(T, H, K, S, seed, device, counts=None):
    """Rows attend to disjoint slot sets (so a NaN cache row affects exactly one row)."""
    assert T * K <= S
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(T, H, 576, generator=g, device=device).bfloat16()
    kv = torch.randn(S, 576, generator=g, device=device).bfloat16()
    slots = torch.randperm(S, generator=g, device=device)[: T * K].view(T, K).int()
    if counts is None:
        counts = torch.full((T,), K, dtype=torch.int32, device=device)
        if T > 2:
            counts[1] = 0
            counts[2] = K // 3
    return q, kv, slots.contiguous(), counts


@pytest.mark.gpu
@pytest.mark.parametrize("T,H", [(1, 128), (32, 128), (4, 16), (8, 64)])
def test_gpu_matches_reference_at_deepseek_shapes(cuda_device, T, H) -> None:
    K, S, scale = 2048, 65536, 192**-0.5
    q, kv, slots, counts = _gpu_case(T, H, K, S, T + H, cuda_device)
    out = torch.full((T, H, 512), NAN, dtype=torch.bfloat16, device=cuda_device)
    lse = torch.full((T, H), NAN, device=cuda_device)
    sk.splitkv_attention(q, kv, slots, counts, scale, 512, out=out, out_lse=lse)
    ref_out, ref_lse = sparse_mla_attention(q, kv, slots, counts, scale, v_dim=512)
    assert_matches(out, lse, ref_out, ref_lse, rtol=1e-2, lse_atol=2e-3)


@pytest.mark.gpu
def test_gpu_contract_cases(cuda_device) -> None:
    """Poisoned rows (int64 beyond 2**31), clamped counts, NaN in q and in an attended row, compiled."""
    T, H, K, S, scale = 6, 128, 256, 4096, 192**-0.5
    q, kv, slots, _ = _gpu_case(T, H, K, S, 3, cuda_device)
    slots = slots.long()
    counts = torch.tensor([K, -4, K + 9, 100, K, 30], dtype=torch.int32, device=cuda_device)
    slots[0, 200] = 2**32 + 5
    slots[5, 40] = -1  # past its count: harmless
    q[3, 7, 100] = NAN
    kv[slots[4, 250]] = NAN
    out, lse = sk.sparse_mla_splitkv(q, kv, slots, counts, scale, 512, validate=False)
    ref_out, ref_lse = sparse_mla_attention(q, kv, slots, counts.clamp(0, K), scale, v_dim=512, validate=False)
    assert bool(torch.isnan(lse[0]).all()) and bool(torch.isnan(out[0]).all())
    assert bool(torch.isneginf(lse[1]).all()) and bool((out[1] == 0).all())
    assert torch.isnan(lse[3]).nonzero().flatten().tolist() == [7]
    assert bool(torch.isnan(lse[4]).all())
    assert_matches(out, lse, ref_out, ref_lse, rtol=1e-2, lse_atol=2e-3)


@pytest.mark.gpu
def test_gpu_matches_flashmla(cuda_device) -> None:
    pytest.importorskip("flash_mla")
    from dcp_ref.kernels.flashmla_sparse import sparse_mla_flashmla

    T, H, K, S, scale = 32, 128, 2048, 65536, 192**-0.5
    q, kv, slots, counts = _gpu_case(T, H, K, S, 21, cuda_device)
    ours = sk.splitkv_attention(q, kv, slots, counts, scale, 512)
    theirs = sparse_mla_flashmla(q, kv, slots, counts, scale, 512)
    assert rel_fro(ours[0], theirs[0]) <= 1e-2
    fin = torch.isfinite(theirs[1])
    assert torch.equal(fin, torch.isfinite(ours[1]))
    assert (ours[1][fin] - theirs[1][fin]).abs().max().item() <= 2e-3


@pytest.mark.gpu
def test_gpu_every_sweep_config_compiles_and_matches(cuda_device) -> None:
    """The launch configurations bench_attention.py sweeps: each one compiles on this Triton and is correct."""
    T, H, K, S, scale = 4, 128, 512, 8192, 192**-0.5
    q, kv, slots, counts = _gpu_case(T, H, K, S, 5, cuda_device)
    ref_out, ref_lse = sparse_mla_attention(q, kv, slots, counts, scale, v_dim=512)
    for i, (bh, bn, nw, ns) in enumerate(sk.TUNING_CONFIGS):
        for splits in (3, 1) if i % 3 == 0 else (3,):  # one split (the fused final write) for a few
            plan = sk.splitkv_plan(T, H, K, cuda_device, num_splits=splits, block_h=bh, block_n=bn, num_warps=nw,
                                   num_stages=ns)  # fmt: skip
            out, lse = sk.sparse_mla_splitkv(q, kv, slots, counts, scale, 512, validate=False, plan=plan)
            assert_matches(out, lse, ref_out, ref_lse, rtol=1e-2, lse_atol=2e-3)


@pytest.mark.gpu
def test_gpu_graph_capture_replay_no_alloc_no_sync(cuda_device) -> None:
    """The kernel in a CUDA graph: replayed after new inputs are copied in place; the planned path (a plan and the
    workspace it owns, made once, as the step's bound stage holds them) allocates nothing and makes no host sync."""
    T, H, K, S, scale = 8, 128, 2048, 65536, 192**-0.5
    q, kv, slots, counts = _gpu_case(T, H, K, S, 1, cuda_device)
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=cuda_device)
    lse = torch.empty(T, H, device=cuda_device)
    plan = sk.splitkv_plan(T, H, K, cuda_device)
    ws = sk.workspace_for(plan, cuda_device)

    def call():
        return sk.sparse_mla_splitkv(q, kv, slots, counts, scale, 512, out=out, out_lse=lse, validate=False,
                                     plan=plan, workspace=ws)  # fmt: skip

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compiles, plans the workspace
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    q2, kv2, slots2, counts2 = _gpu_case(T, H, K, S, 2, cuda_device)
    counts2[3] = 0
    q.copy_(q2)
    kv.copy_(kv2)
    slots.copy_(slots2)
    counts.copy_(counts2)
    out.fill_(NAN)
    lse.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    ref_out, ref_lse = sparse_mla_attention(q2, kv2, slots2, counts2, scale, v_dim=512)
    assert_matches(out, lse, ref_out, ref_lse, rtol=1e-2, lse_atol=2e-3)
