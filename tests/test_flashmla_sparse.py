"""The FlashMLA attention stage's own logic (kernels/flashmla_sparse.py) on the CPU, with a stand-in kernel.

The stand-in behaves as FlashMLA's ``flash_mla_sparse_fwd`` was measured to on the H200 (base-e LSE, an
empty row gives output 0 and LSE ``+inf``, indices read as given) but computes with the float64 reference,
so these tests check what the wrapper adds: the ``+inf`` → ``-inf`` normalisation decided by ``counts``,
counts clamped to ``[0, K]``, rows whose used slots leave the cache poisoned with NaN instead of read, and
its argument checks. The real kernel is compared with the reference by the ``gpu`` tests
(tests/test_testing_kit.py, tests/test_step.py).
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from opcount import HOST_READS, OpCount

from dcp_ref.attention import sparse_mla_attention
from dcp_ref.kernels import flashmla_sparse as fm


def _fake_flash_mla(calls: list) -> types.SimpleNamespace:
    def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, topk_length, use_legacy):  # noqa: ANN001, ANN202
        calls.append({"indices": indices.clone(), "topk_length": topk_length.clone()})
        assert indices.dtype == torch.int32 and topk_length.dtype == torch.int32
        slots = indices[:, 0, :]
        # the kernel may only be handed readable slots for j < topk_length
        used = torch.arange(slots.shape[1]) < topk_length.long().unsqueeze(1)
        assert bool(((slots >= 0) & (slots < kv.shape[0]) | ~used).all()), "an unreadable slot reached the kernel"
        out, lse = sparse_mla_attention(q, kv[:, 0, :], slots, topk_length, sm_scale, "e", v_dim=d_v)
        lse = torch.where(topk_length.unsqueeze(1) == 0, torch.full_like(lse, math.inf), lse)  # FlashMLA's empty row
        return out.to(q.dtype), lse.amax(-1), lse.float()

    return types.SimpleNamespace(flash_mla_sparse_fwd=flash_mla_sparse_fwd)


@pytest.fixture(params=["triton", "torch"])
def fake(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> list:
    """The stand-in kernel, with the wrapper's prologue / epilogue as the fused Triton kernels (interpreted on
    the CPU) or as the torch ops they replace (the path of a CPU without the interpreter)."""
    calls: list = []
    monkeypatch.setattr(fm, "_flash_mla", lambda: _fake_flash_mla(calls))
    if request.param == "torch":
        monkeypatch.setattr(fm, "_use_triton", lambda device: False)
    elif not fm._use_triton(torch.device("cpu")):
        pytest.skip("the Triton prologue / epilogue need TRITON_INTERPRET=1 on the CPU")
    return calls


def _inputs(T: int = 4, H: int = 64, K: int = 64, S: int = 300, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, 576, generator=g).to(torch.bfloat16)
    kv = torch.randn(S, 576, generator=g).to(torch.bfloat16)
    slots = torch.randint(0, S, (T, K), generator=g, dtype=torch.int32)
    counts = torch.tensor([K, 0, 17, 1][:T], dtype=torch.int32)
    return q, kv, slots, counts


def test_matches_the_reference_and_normalises_the_empty_row(fake: list) -> None:
    q, kv, slots, counts = _inputs()
    out, lse = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05)
    ref_out, ref_lse = sparse_mla_attention(q, kv, slots, counts, 0.05, "e", v_dim=512)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(lse[1]).all() and bool((out[1] == 0).all())  # +inf from the kernel -> -inf (count 0)
    assert lse.dtype == torch.float32 and out.dtype == torch.bfloat16
    # FlashMLA's SM90 kernel asserts a width that is a multiple of 128: K = 64 is padded with -1 (never read)
    idx = fake[-1]["indices"][:, 0, :]
    assert idx.shape == (4, 128) and torch.equal(idx[:, :64], slots) and bool((idx[:, 64:] == -1).all())


def test_ragged_widths_are_padded_to_the_kernels_multiple(fake: list) -> None:
    for K in (1, 130):
        q, kv, slots, _ = _inputs(K=K)
        counts = torch.tensor([K, 0, min(17, K), 1], dtype=torch.int32)
        out, lse = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05)
        assert fake[-1]["indices"].shape[-1] == (128 if K == 1 else 256)
        ref_out, ref_lse = sparse_mla_attention(q, kv, slots, counts, 0.05, "e", v_dim=512)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=2e-2)


def test_writes_into_caller_buffers(fake: list) -> None:
    q, kv, slots, counts = _inputs()
    out = torch.full((4, 64, 512), 7.0, dtype=torch.bfloat16)
    lse = torch.full((4, 64), 7.0)
    got_out, got_lse = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, out=out, out_lse=lse)
    assert got_out is out and got_lse is lse and not bool((out == 7.0).any())


def test_counts_are_clamped_and_bad_slots_poison_their_row(fake: list) -> None:
    q, kv, slots, counts = _inputs()
    counts = torch.tensor([999, -5, 17, 1], dtype=torch.int32)  # past K, negative
    slots = slots.clone()
    slots[2, 3] = 10_000  # a used slot past the cache (row 2 reads 17 entries)
    slots[3, 40] = -7  # an unused slot (row 3 reads 1 entry): harmless
    out, lse = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05)
    assert fake[-1]["topk_length"].tolist() == [64, 0, 17, 1]
    assert torch.isnan(out[2]).all() and torch.isnan(lse[2]).all()  # poisoned, never read
    assert torch.isneginf(lse[1]).all()  # a negative count is an empty row
    ref_out, ref_lse = sparse_mla_attention(q[[0, 3]], kv, slots[[0, 3]], torch.tensor([64, 1]), 0.05, "e", v_dim=512)
    torch.testing.assert_close(lse[[0, 3]].double(), ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[[0, 3]].double(), ref_out, rtol=2e-2, atol=2e-2)


def test_int64_slots_and_argument_checks(fake: list) -> None:
    q, kv, slots, counts = _inputs()
    out, _ = fm.sparse_mla_flashmla(q, kv, slots.long(), counts.long(), 0.05)
    assert fake[-1]["indices"].dtype == torch.int32 and out.shape == (4, 64, 512)
    with pytest.raises(ValueError, match=r"q.shape\[1\] \(H\) must be one of \(64, 128\)"):
        fm.sparse_mla_flashmla(q[:, :16], kv, slots, counts, 0.05)
    with pytest.raises(TypeError, match="q must have dtype"):
        fm.sparse_mla_flashmla(q.float(), kv, slots, counts, 0.05)
    with pytest.raises(ValueError, match="must be 576 wide"):
        fm.sparse_mla_flashmla(q, kv[:, :512], slots, counts, 0.05)
    with pytest.raises(ValueError, match="slots and counts must have T=4 rows"):
        fm.sparse_mla_flashmla(q, kv, slots[:2], counts, 0.05)


def test_wide_int64_slots_never_wrap_into_valid_ones(fake: list) -> None:
    """An int64 slot 2**32 + 5 is past the cache: narrowed first it would read slot 5. It must poison its row."""
    q, kv, slots, counts = _inputs()
    wide = slots.long().clone()
    wide[0, 2] = 2**32 + 5
    out, lse = fm.sparse_mla_flashmla(q, kv, wide, counts, 0.05)
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all()
    assert not torch.isnan(lse[2:]).any() and torch.isneginf(lse[1]).all()


def test_strided_out_and_empty_batch(fake: list) -> None:
    q, kv, slots, counts = _inputs()
    base = torch.full((4, 512, 64), 7.0, dtype=torch.bfloat16)
    out = base.transpose(1, 2)  # [T, H, V] with the values strided
    lse = torch.full((64, 4), 7.0).t()
    fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, out=out, out_lse=lse)
    ref_out, ref_lse = sparse_mla_attention(q, kv, slots, counts, 0.05, "e", v_dim=512)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    o0, l0 = fm.sparse_mla_flashmla(q[:0], kv, slots[:0], counts[:0], 0.05)
    assert o0.shape == (0, 64, 512) and l0.shape == (0, 64)
    with pytest.raises(ValueError, match=r"out must be a buffer of shape \(4, 64, 512\)"):
        fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, out=torch.empty(4, 64, 256, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="out_lse must be a float32 buffer"):
        fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, out_lse=torch.empty(4, 64, dtype=torch.float64))


@pytest.mark.parametrize("splits", [2, 4, 8])
@pytest.mark.parametrize("K", [64, 300])
def test_splits_match_the_reference_and_hand_each_row_its_own_slots(fake: list, splits: int, K: int) -> None:
    """``splits = S``: the kernel gets ``T S`` rows of ``KS`` entries (the padded width over ``S``, at least 128);
    token ``t``'s ``c`` used slots are dealt out evenly, row ``t S + s`` starting with slots ``[s m, (s + 1) m)``,
    ``m = ceil(c / S)``, with that count; the merged output and LSE are the reference's — with counts of 0, fewer
    than ``S``, an uneven share and all ``K``."""
    q, kv, slots, _ = _inputs(K=K, seed=K + splits)
    counts = torch.tensor([K, 0, 3, min(129, K)], dtype=torch.int32)
    out, lse = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, splits=splits)
    ref_out, ref_lse = sparse_mla_attention(q, kv, slots, counts, 0.05, "e", v_dim=512)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(lse[1]).all() and bool((out[1] == 0).all())
    one_out, one_lse = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05)  # one split: the same attention
    torch.testing.assert_close(out.float(), one_out.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(lse, one_lse, rtol=1e-5, atol=1e-5)
    call = fake[-2]
    ks = -(-K // (128 * splits)) * 128  # every split at least the kernel's width multiple
    idx = call["indices"][:, 0, :]
    assert idx.shape == (4 * splits, ks)
    for t in range(4):
        n = int(counts[t])
        m = -(-n // splits)
        lengths = call["topk_length"][t * splits : (t + 1) * splits].tolist()
        assert lengths == [min(max(n - s * m, 0), m) for s in range(splits)] and sum(lengths) == n
        used = torch.cat([idx[t * splits + s, : lengths[s]] for s in range(splits)])
        assert torch.equal(used, slots[t, :n])  # every used slot once, in order, none lost


def test_splits_propagate_nan_and_poison_like_one_split(fake: list) -> None:
    """A NaN in one token's query, or in a key only its second split reads, makes that token's output and LSE
    NaN (never dropped by the merge); a used slot outside the cache poisons its token; the other tokens are the
    reference's."""
    q, kv, slots, _ = _inputs(K=256)
    counts = torch.tensor([256, 256, 200, 0], dtype=torch.int32)
    q, kv, slots = q.clone(), kv.clone(), slots.clone()
    q[0, 3, 7] = math.nan
    kv[slots[1, 200]] = math.nan  # token 1's split 1 (slots 128..255) reads it
    slots[2, 150] = 10_000  # token 2: a used slot past the cache
    out, lse = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, splits=2)
    one_out, one_lse = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05)
    for t in (0, 1, 2):  # NaN exactly where one split has it
        assert torch.equal(torch.isnan(out[t]), torch.isnan(one_out[t])) and torch.isnan(out[t]).any(), t
        assert torch.equal(torch.isnan(lse[t]), torch.isnan(one_lse[t])) and torch.isnan(lse[t]).any(), t
    assert torch.isnan(out[2]).all() and torch.isnan(lse[2]).all()
    assert torch.isneginf(lse[3]).all() and bool((out[3] == 0).all())


def test_splits_is_a_power_of_two() -> None:
    q, kv, slots, counts = _inputs()
    for bad, err, msg in ((0, ValueError, "splits must be"), (3, ValueError, "power of two"),
                          (True, TypeError, "splits"), (2.0, TypeError, "splits")):  # fmt: skip
        with pytest.raises(err, match=msg):
            fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, splits=bad)


def test_flashmla_splits_reads_the_measured_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fm, "FLASHMLA_SPLITS", ((4, 16), (32, 2)))  # (most CTAs unsplit = T * H / 64, splits)
    assert [fm.flashmla_splits(t) for t in (0, 1, 2, 3, 16, 17, 1024)] == [16, 16, 16, 2, 2, 1, 1]
    assert [fm.flashmla_splits(t, 64) for t in (4, 5, 32, 33)] == [16, 2, 2, 1]
    assert [fm.flashmla_splits(1, 128, k) for k in (0, 256, 1024, 2047, 2048, 4096)] == [1, 1, 1, 1, 16, 16]
    with pytest.raises(ValueError, match="T"):
        fm.flashmla_splits(-1)
    with pytest.raises(ValueError, match="H"):
        fm.flashmla_splits(1, 0)
    assert fm.flashmla_splits(4, table=((8, 2),)) == 2 and fm.flashmla_splits(4, table=()) == 1
    for bad in ([(8, 2)], ((8,),), ((8, 2.0),), ((True, 2),)):
        with pytest.raises(TypeError, match="table must be"):
            fm.flashmla_splits(4, table=bad)


def test_why_flashmla_cannot_run() -> None:
    cpu = torch.device("cpu")
    assert "not CUDA" in fm.flashmla_unsupported(cpu, torch.bfloat16, 128, 576, 512, 2048)


def test_prologue_buffers_are_owned_by_the_given_scratch(fake: list) -> None:
    """With a :class:`FlashMLAScratch` (the planned stage's) the hot path allocates no scratch: a second call of the
    same shape reuses the first call's index buffers (what a captured graph reads); another scratch (another planned
    step) has its own; a call without one makes its own (nothing cached in the module)."""
    if not fm._use_triton(torch.device("cpu")):
        pytest.skip("the torch prologue (a CPU without the interpreter) makes its tensors per call")
    q, kv, slots, counts = _inputs()
    scratch = fm.FlashMLAScratch()
    want = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.1, workspace=scratch)
    first = scratch.prologue(torch.device("cpu"), 4, 128)
    assert first[1].tolist() == counts.tolist()  # the call's prologue wrote these very buffers
    assert fake[-1]["indices"][:, 0, :64].tolist() == first[0][:, :64].tolist()
    first[1].fill_(-5)  # stale contents must not matter: every call rewrites them
    again = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.1, workspace=scratch)
    assert all(a is b for a, b in zip(scratch.prologue(torch.device("cpu"), 4, 128), first))
    assert first[1].tolist() == counts.tolist()
    torch.testing.assert_close(again[0], want[0], equal_nan=True)
    torch.testing.assert_close(again[1], want[1], equal_nan=True)
    other = fm.FlashMLAScratch().prologue(torch.device("cpu"), 4, 128)
    assert all(a is not b for a, b in zip(other, first))
    assert scratch.prologue(torch.device("cpu"), 3, 128)[0].shape == (3, 128)  # another shape, other buffers
    first[1].fill_(-5)
    unowned = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.1)  # its own buffers: the scratch's are untouched
    assert first[1].tolist() == [-5] * 4
    torch.testing.assert_close(unowned[0], want[0], equal_nan=True)
    with pytest.raises(TypeError, match="workspace must be a FlashMLAScratch"):
        fm.sparse_mla_flashmla(q, kv, slots, counts, 0.1, workspace=torch.empty(1))


# ---- the validated call: the prologue's flag, one host read, no extra launch ----------------------------


def _wrapper_ops(monkeypatch: pytest.MonkeyPatch, fn) -> list[str]:  # noqa: ANN001
    """What ``fn()`` runs in the wrapper's own code, in order: each Triton launch of the prologue / epilogue
    (``triton:<name>``), the FlashMLA call (``flash_mla``) and every non-view aten op outside them (the ops a
    device would launch, plus host reads). ``Tensor.tolist`` is recorded too (a CPU tolist dispatches nothing)."""
    counter = OpCount()
    fwd = counter.quiet("flash_mla", fm._flash_mla().flash_mla_sparse_fwd)
    kernels = [(fm, "_prologue_kernel", "prologue"), (fm, "_epilogue_kernel", "epilogue")]
    with monkeypatch.context() as m:  # undone on return: a later count wraps the real kernels again
        m.setattr(fm, "_flash_mla", lambda: types.SimpleNamespace(flash_mla_sparse_fwd=fwd))
        with counter.recording(kernels):
            fn()
    return counter.ops


def test_a_validated_call_adds_one_host_read_and_no_launch(fake: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused path: the validated call is the unvalidated call's launches (prologue, FlashMLA, epilogue) plus
    exactly one host read — of the flag the prologue raised — between the prologue and the kernel, and the flag
    itself (made per call). (Before the fold it added seven small device ops: max, min, max, three casts and a
    stack, then a read.) With the planned stage's scratch, neither call allocates anything else."""
    q, kv, slots, counts = _inputs(T=2)
    out, lse = torch.empty(2, 64, 512, dtype=torch.bfloat16), torch.empty(2, 64)
    scratch = fm.FlashMLAScratch()

    def call(v: bool) -> None:
        fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, out=out, out_lse=lse, validate=v, workspace=scratch)

    call(False), call(True)  # warm: the scratch buffers exist from now on
    plain = _wrapper_ops(monkeypatch, lambda: call(False))
    checked = _wrapper_ops(monkeypatch, lambda: call(True))
    reads = [op for op in checked if op in HOST_READS]
    assert len(reads) == 1, checked
    assert not any(op in HOST_READS for op in plain), plain
    if fm._use_triton(q.device):
        assert plain == ["triton:prologue", "flash_mla", "triton:epilogue"], plain
        assert checked == ["aten::zeros", "triton:prologue", reads[0], "flash_mla", "triton:epilogue"], checked
    else:  # the torch fallback (a CPU without the interpreter): the read still comes before the kernel
        assert checked.index(reads[0]) < checked.index("flash_mla")


_BAD_SLOTS = [
    ([[1, 4, 12], [7, -1, -1]], [3, 1]),  # a used slot past the cache
    ([[1, 4, 2**31 - 1], [7, -1, -1]], [3, 1]),  # the deinterleave's poison slot
    ([[1, -3, 2], [7, -1, -1]], [3, 1]),  # a negative used slot
    ([[1, 4, 2], [7, -1, -1]], [4, 1]),  # counts past K
    ([[1, 4, 2], [7, -1, -1]], [3, -1]),  # a negative count
    ([[1, 4, 2], [7, -1, -1]], [-2, 9]),  # both counts out of range
]


def test_validated_bad_inputs_raise_the_references_message_before_the_kernel(fake: list) -> None:
    """Each bad input raises exactly the reference's message, the kernel is never reached, and the flag is left
    cleared; unvalidated calls on the same inputs never raise it (a later good validated call passes)."""
    from dcp_ref.kernels._util import check_flag

    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    kv = torch.zeros(10, 576, dtype=torch.bfloat16)
    good = (torch.tensor([[1, 4, 2], [7, -1, -1]], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32))
    for rows, cnt in _BAD_SLOTS:
        for dtype in (torch.int32, torch.int64):
            slots, counts = torch.tensor(rows, dtype=dtype), torch.tensor(cnt, dtype=dtype)
            with pytest.raises(ValueError) as ref:
                sparse_mla_attention(q.double(), kv.double(), slots, counts, 0.5, v_dim=512)
            fake.clear()
            with pytest.raises(ValueError) as ker:
                fm.sparse_mla_flashmla(q, kv, slots, counts, 0.5, validate=True)
            assert str(ker.value) == str(ref.value) and not fake  # the kernel was never reached
            assert int(check_flag(q.device).item()) == 0  # cleared: the next validated call starts clean
    for rows, cnt in _BAD_SLOTS:  # unvalidated: no raise, the row poisoned on the device, the flag untouched
        fm.sparse_mla_flashmla(q, kv, torch.tensor(rows, dtype=torch.int32), torch.tensor(cnt, dtype=torch.int32), 0.5)
    assert int(check_flag(q.device).item()) == 0
    fake.clear()
    fm.sparse_mla_flashmla(q, kv, *good, 0.5, validate=True)
    assert len(fake) == 1


def test_a_wide_int64_slot_is_refused_by_the_validated_call(fake: list) -> None:
    """2**32 + 5 narrowed to int32 would be slot 5 (valid): the prologue tests the slot as given."""
    q, kv, slots, counts = _inputs()
    wide = slots.long().clone()
    wide[0, 2] = 2**32 + 5
    with pytest.raises(ValueError) as ref:
        sparse_mla_attention(q.double(), kv.double(), wide, counts, 0.05, v_dim=512)
    fake.clear()
    with pytest.raises(ValueError) as ker:
        fm.sparse_mla_flashmla(q, kv, wide, counts, 0.05, validate=True)
    assert str(ker.value) == str(ref.value) and "slots[t, :counts[t]]" in str(ker.value) and not fake


# ---- on the H200: the real kernel, split ------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("H", [64, 128])
def test_gpu_splits_match_the_reference(cuda_device, H: int) -> None:
    """FlashMLA's kernel at every split the plan may take, against the float64 reference: full rows of 2048
    slots, ragged counts that leave later splits empty or end inside one, an empty token; a NaN in a key that only
    a later split reads makes its token NaN; a split output equals the unsplit one to bf16 rounding."""
    g = torch.Generator(device="cuda").manual_seed(H)
    T, K, S = 8, 2048, 20000
    q = (torch.randn(T, H, 576, generator=g, device="cuda") / 4).bfloat16()
    kv = (torch.randn(S, 576, generator=g, device="cuda") / 4).bfloat16()
    slots = torch.rand(T, S, generator=g, device="cuda").topk(K, dim=1).indices.int().contiguous()
    counts = torch.tensor([K, 0, 1, 127, 128, 129, 1500, K - 1], dtype=torch.int32, device="cuda")
    ref_out, ref_lse = sparse_mla_attention(q, kv, slots, counts, 0.07, "e", v_dim=512)
    one_out, one_lse = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.07)
    for splits in (1, 2, 4, 8, 16):
        out, lse = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.07, splits=splits)
        torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=1e-2)
        fin = torch.isfinite(ref_lse)
        torch.testing.assert_close(lse.double()[fin], ref_lse[fin], rtol=1e-4, atol=1e-4)
        assert torch.isneginf(lse[1]).all() and bool((out[1] == 0).all())
        torch.testing.assert_close(out.float(), one_out.float(), rtol=1e-2, atol=8e-3)
        torch.testing.assert_close(lse, one_lse, rtol=1e-5, atol=1e-5)
    bad_kv = kv.clone()
    bad_kv[slots[0, 2000]] = math.nan  # token 0's last split (and the unsplit row) reads it
    out, lse = fm.sparse_mla_flashmla(q, bad_kv, slots, counts, 0.07, splits=8)
    assert torch.isnan(out[0]).any() and torch.isnan(lse[0]).all()


# ---- the two fusions a planned step asks of this stage: the guard taken in, heads in groups -----------------
def _guard_rows(T: int, seed: int = 3):
    """Guard rows for ``T`` tokens over a 2-request block table of 4-slot blocks, tokens 1 and 3 out of contract
    (a negative bound; a block the table does not have)."""
    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.guard import GuardRows

    bt = torch.tensor([[0, 1, 2, -1], [3, 4, 5, 6]], dtype=torch.int32)
    bounds = torch.tensor([5, -1, 16, 14][:T], dtype=torch.int32)
    req = torch.tensor([0, 1, 1, 0][:T], dtype=torch.int32)  # token 3: request 0 needs 4 blocks, has 3
    g = torch.Generator().manual_seed(seed)
    iq = torch.randn(T, 4, 8, generator=g).to(torch.float8_e4m3fn)
    iw = torch.randn(T, 4, generator=g)
    return GuardRows(bounds, req, bt, DcpGeometry(1, 0, 1, 4), 16, num_blocks=7, index_q=iq, index_weights=iw)


@pytest.mark.parametrize("splits", [1, 2])
def test_the_guard_taken_in_poisons_as_the_guard_stage(fake: list, splits: int) -> None:
    """``guard=``: the same NaN rows as the attention followed by the guard stage (the reference), every other row
    bit for bit the attention's own; a non-finite index query poisons its token too."""
    from dcp_ref.guard import reference_guard

    q, kv, slots, counts = _inputs()
    rows = _guard_rows(4)
    rows.index_weights[2, 1] = float("inf")  # token 2: a non-finite index weight
    want_out, want_lse = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, splits=splits)
    r = rows
    reference_guard(want_out, want_lse, r.local_bounds, r.req_of_token, r.block_table, r.geometry, r.n_cols,
                    num_blocks=r.num_blocks, index_q=r.index_q, index_weights=r.index_weights)  # fmt: skip
    out, lse = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, splits=splits, guard=rows)
    assert [bool(torch.isnan(lse[t]).all()) for t in range(4)] == [False, True, True, True]
    assert torch.equal(out.isnan(), want_out.isnan()) and torch.equal(lse.isnan(), want_lse.isnan())
    ok = ~lse.isnan().any(1)
    assert torch.equal(out[ok], want_out[ok]) and torch.equal(lse[ok], want_lse[ok])
    with pytest.raises(TypeError, match="guard must be a GuardRows"):
        fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, guard=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"local_bounds must have one entry per token \(4\)"):
        fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, guard=_guard_rows(3))


@pytest.mark.parametrize("splits", [1, 2])
def test_heads_in_groups_read_and_write_as_the_plain_layout(fake: list, splits: int) -> None:
    """``q [T, G, H/G, D]`` (the gathered ``[G, T, H/G, D]`` transposed: a view, no copy by the caller) and ``out``
    / ``out_lse`` as ``[T, G, H/G, ...]`` views of a ``[G, T, H/G, ...]`` send buffer give the plain call's values,
    each head where the grouping puts it."""
    q, kv, slots, counts = _inputs()
    G, T, H = 4, 4, 64
    want_out, want_lse = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, splits=splits)
    gathered = q.view(T, G, H // G, 576).transpose(0, 1).contiguous()  # [G, T, H/G, D], rank-major
    send_out = torch.full((G, T, H // G, 512), 7.0, dtype=torch.bfloat16)
    send_lse = torch.full((G, T, H // G), 7.0)
    out, lse = fm.sparse_mla_flashmla(gathered.transpose(0, 1), kv, slots, counts, 0.05, splits=splits,
                                      out=send_out.transpose(0, 1), out_lse=send_lse.transpose(0, 1))  # fmt: skip
    assert out.shape == (T, G, H // G, 512) and lse.shape == (T, G, H // G)
    assert torch.equal(send_out.transpose(0, 1).reshape(T, H, 512), want_out)
    assert torch.equal(send_lse.transpose(0, 1).reshape(T, H), want_lse)
    with pytest.raises(ValueError, match="q must be contiguous in its last dimension"):
        fm.sparse_mla_flashmla(q.transpose(1, 2).contiguous().transpose(1, 2), kv, slots, counts, 0.05)
    with pytest.raises(ValueError, match="out's head groups must divide the H=64 heads"):
        fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, out=torch.empty(4, 3, 21, 512, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out_lse's head groups must divide the H=64 heads"):
        fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, out_lse=torch.empty(4, 0, 16))
    with pytest.raises(ValueError, match=r"out must be a buffer of shape \(4, 4, 16, 512\)"):
        fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, out=torch.empty(4, 4, 8, 512, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"out must be a torch\.Tensor"):
        fm.sparse_mla_flashmla(q, kv, slots, counts, 0.05, out=[0.0])  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2])
def test_gpu_fusions_match_the_unfused_calls(cuda_device, splits: int) -> None:
    """On FlashMLA: the gathered query read as ``[T, W, H/W, D]``, the partial written into a ``[W, T, H/W, v]`` send
    buffer and the guard taken in give, bit for bit, the plain call followed by the guard kernel."""
    from dcp_ref.geometry import DcpGeometry
    from dcp_ref.guard import GuardRows
    from dcp_ref.kernels.guard_triton import guard_triton

    g = torch.Generator(device="cuda").manual_seed(splits)
    T, H, K, S, W = 32, 128, 2048, 20000, 8
    q = (torch.randn(T, H, 576, generator=g, device="cuda") / 4).bfloat16()
    kv = (torch.randn(S, 576, generator=g, device="cuda") / 4).bfloat16()
    slots = torch.rand(T, S, generator=g, device="cuda").topk(K, dim=1).indices.int().contiguous()
    counts = torch.randint(0, K + 1, (T,), generator=g, device="cuda", dtype=torch.int32)
    bt = torch.arange(2 * 400, device="cuda", dtype=torch.int32).view(2, 400)
    bounds = torch.full((T,), 20000, device="cuda", dtype=torch.int32)
    bounds[5] = -3  # out of contract
    req = (torch.arange(T, device="cuda") % 2).int()
    rows = GuardRows(bounds, req, bt, DcpGeometry(1, 0, 1, 64), 20000)
    want_out, want_lse = fm.sparse_mla_flashmla(q, kv, slots, counts, 0.07, splits=splits)
    guard_triton(want_out, want_lse, bounds, req, bt, rows.geometry, 20000)
    gathered = q.view(T, W, H // W, 576).transpose(0, 1).contiguous()
    send_out = torch.empty(W, T, H // W, 512, dtype=torch.bfloat16, device="cuda")
    send_lse = torch.empty(W, T, H // W, device="cuda")
    fm.sparse_mla_flashmla(gathered.transpose(0, 1), kv, slots, counts, 0.07, splits=splits,
                           out=send_out.transpose(0, 1), out_lse=send_lse.transpose(0, 1), guard=rows)  # fmt: skip
    out, lse = send_out.transpose(0, 1).reshape(T, H, 512), send_lse.transpose(0, 1).reshape(T, H)
    assert bool(lse[5].isnan().all()) and torch.equal(lse.isnan(), want_lse.isnan())
    assert torch.equal(out.nan_to_num(), want_out.nan_to_num()) and torch.equal(lse.nan_to_num(), want_lse.nan_to_num())
