"""The validated calls of the deinterleave family and of the FlashMLA FP8 prologue, counted op by op.

A validated call checks its values *in* the launch it runs anyway (a ``CHECK`` constexpr: an atomic max into
the shared per-stream flag of :func:`dcp_ref.kernels._util.check_flag`) and then reads that one flag: it is
the unvalidated call's launches, with ``CHECK`` on, plus exactly one host read — no torch op of its own. A bad
input raises the reference's exact message and leaves the flag cleared; an unvalidated bad call never raises,
never reads, and never touches the flag. (Before the fold: the deinterleave wrappers added an ``amax`` launch
and the FP8 prologue a ``max`` / ``to`` / ``stack`` chain, ahead of their one read.)

The Triton launches are counted by wrapping the module's kernels (the launch itself is not traced: the
interpreter's own tensor copies are not the wrapper's ops).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
from opcount import HOST_READS, OpCount

from dcp_ref.deinterleave import deinterleave_and_compact, deinterleave_masked, global_ids_to_local_slots
from dcp_ref.fp8_cache import check_fp8_slots, quantize_kv_fp8
from dcp_ref.geometry import DcpGeometry

dk = pytest.importorskip("dcp_ref.kernels.deinterleave_triton")
fm8 = pytest.importorskip("dcp_ref.kernels.flashmla_fp8")

POISON = 2**31 - 1  # the deinterleave stage's poison slot, written here independently of the code


def _check_label(name: str, k: dict) -> str:
    on = k.get("CHECK", False)
    assert on == (k.get("chk_ptr") is not None), k  # the switch and its flag travel together
    return f"triton:{name}[{'CHECK' if on else '-'}]"


def _counted(monkeypatch, module: Any, kernels: tuple[str, ...], fn: Callable[[], Any]) -> tuple[list[str], Any]:
    """``(ops, result)`` of ``fn()`` (``tests/opcount.py``): in order, each launch of one of ``module``'s
    ``kernels`` as ``triton:<name>[CHECK]`` (or ``[-]``) and every non-view aten op the wrapper runs outside the
    launches (what a device would launch, and host reads), plus ``Tensor.tolist``. ``result`` is ``fn()``'s
    return value or the exception it raised."""
    counter = OpCount()
    result: Any
    with counter.recording([(module, name) for name in kernels], label=_check_label):
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - returned for the caller to compare
            result = e
    return counter.ops, result


#: The one device op a validated call adds before its launches: its own zeroed check flag (made per call, no cache).
FLAG_OP = "aten::zeros"


def _with_flag(ops: list[str]) -> list[str]:
    """``ops`` with the validated call's flag made just before the first launch."""
    at = next(i for i, op in enumerate(ops) if op.startswith("triton:"))
    return [*ops[:at], FLAG_OP, *ops[at:]]


def _flag(dev: torch.device) -> torch.Tensor:
    from dcp_ref.kernels._util import check_flag

    return check_flag(dev)


def _reads(ops: list[str]) -> list[str]:
    return [op for op in ops if op in HOST_READS]


def _launches(ops: list[str]) -> list[str]:
    return [op for op in ops if op.startswith("triton:")]


# ---------------------------------------------------------------------------------------------- deinterleave
DK_KERNELS = ("deinterleave_kernel", "rowscan_kernel", "twopass_count_kernel", "twopass_scatter_kernel")
GEO = DcpGeometry(2, 0, 2, 4)

#: Every deinterleave wrapper and compaction method: ``name -> (kernel call, reference call, its launches)``.
DEINT: dict[str, tuple[Callable[..., Any], Callable[..., Any], list[str]]] = {
    "conversion": (
        lambda ids, req, bt, v: dk.global_ids_to_local_slots_triton(ids, req, bt, GEO, block=16, validate=v),
        lambda ids, req, bt: global_ids_to_local_slots(ids, req, bt, GEO),
        ["deinterleave_kernel"],
    ),
    "masked": (
        lambda ids, req, bt, v: dk.deinterleave_masked_triton(ids, req, bt, GEO, block=16, validate=v),
        lambda ids, req, bt: deinterleave_masked(ids, req, bt, GEO),
        ["rowscan_kernel"],
    ),
    "compact rowscan": (
        lambda ids, req, bt, v: dk.deinterleave_compact(ids, req, bt, GEO, method="rowscan", block=16, validate=v),
        lambda ids, req, bt: deinterleave_and_compact(ids, req, bt, GEO),
        ["rowscan_kernel"],
    ),
    "compact twopass": (
        lambda ids, req, bt, v: dk.deinterleave_compact(ids, req, bt, GEO, method="twopass", block=16, validate=v),
        lambda ids, req, bt: deinterleave_and_compact(ids, req, bt, GEO),
        ["twopass_count_kernel", "twopass_scatter_kernel"],
    ),
    "compact atomic": (
        lambda ids, req, bt, v: dk.deinterleave_compact(
            ids, req, bt, GEO, ordered=False, method="atomic", block=16, validate=v
        ),
        lambda ids, req, bt: deinterleave_and_compact(ids, req, bt, GEO, ordered=False),
        ["deinterleave_kernel"],
    ),
}


def _deint_case(dev: torch.device, bad: str = "") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """3 rows of 40 ids (3 tiles of 16) on rank 0 of ``GEO``: valid, or with one violation of the reference's."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(-1, 60, (3, 40), generator=g)  # local blocks 0..7 of rank 0
    req = torch.tensor([2, 0, 1], dtype=torch.int32)
    bt = torch.randint(0, 100, (3, 8), generator=g)
    if bad == "request id":
        req[1] = 3  # B = 3
    elif bad == "past the table":
        ids[1, 37] = 64  # owned by rank 0: local 32, block 8 of an 8-column table (third tile)
    elif bad == "negative block":
        ids[2, 20] = 5  # owned by rank 0: local 1, block 0 of request 1
        bt[1, 0] = -1
    elif bad == "int32 overflow":
        ids[0, 3] = 8  # owned by rank 0: local 4, block 1 of request 2
        bt[2, 1] = 2**31 // 4  # its slot 2**31 does not fit below the poison slot
    return ids.to(dev), req.to(dev), bt.to(dev)


BAD_DEINT = ("request id", "past the table", "negative block", "int32 overflow")


@pytest.mark.parametrize("name", sorted(DEINT))
def test_deinterleave_validated_is_the_unvalidated_launches_plus_one_read(kernel_device, monkeypatch, name) -> None:
    call, _, kernels = DEINT[name]
    ids, req, bt = _deint_case(kernel_device)
    call(ids, req, bt, False), call(ids, req, bt, True)  # warm: compiled, and the flag exists from now on
    plain, want = _counted(monkeypatch, dk, DK_KERNELS, lambda: call(ids, req, bt, False))
    checked, got = _counted(monkeypatch, dk, DK_KERNELS, lambda: call(ids, req, bt, True))
    assert _launches(plain) == [f"triton:{k}[-]" for k in kernels], plain  # CHECK=False: compiled out
    assert _reads(plain) == [], plain
    # the same ops, each launch with its CHECK switch on (twopass: the pass that writes the slots), then one read
    on = [op.replace("[-]", "[CHECK]") if "count_kernel" not in op else op for op in plain]
    assert checked == [*_with_flag(on), "aten::_local_scalar_dense"], (plain, checked)
    assert int(_flag(kernel_device).item()) == 0
    w, g = (want, got) if isinstance(want, tuple) else ((want,), (got,))
    for a, b in zip(w, g):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bad", BAD_DEINT)
@pytest.mark.parametrize("name", sorted(DEINT))
def test_deinterleave_bad_input_raises_the_reference_message_and_clears_the_flag(
    kernel_device, monkeypatch, name, bad
) -> None:
    call, ref, kernels = DEINT[name]
    ids, req, bt = _deint_case(kernel_device, bad)
    with pytest.raises(ValueError) as want:
        ref(ids.cpu(), req.cpu(), bt.cpu())
    flag = _flag(kernel_device)
    assert int(flag.item()) == 0
    ops, err = _counted(monkeypatch, dk, DK_KERNELS, lambda: call(ids, req, bt, True))
    assert isinstance(err, ValueError) and str(err) == str(want.value), (err, want.value)
    assert int(flag.item()) == 0  # cleared before the message: the next call on this stream starts clean
    launch_ops = _launches(ops)
    assert [op.split("[")[0] for op in launch_ops] == [f"triton:{k}" for k in kernels]
    # the first read is the flag's, right after the launches; only the error path reads more
    first_read = next(i for i, op in enumerate(ops) if op in HOST_READS)
    assert first_read == ops.index(launch_ops[-1]) + 1 and ops[first_read + 1] == "aten::zero_", ops
    # unvalidated: the device answer (poisoned), no raise, no read, and the flag is not touched
    ops_u, res = _counted(monkeypatch, dk, DK_KERNELS, lambda: call(ids, req, bt, False))
    assert not isinstance(res, Exception) and _reads(ops_u) == [] and int(flag.item()) == 0
    slots = res[0] if isinstance(res, tuple) else res
    assert int(slots.max()) == POISON
    good = _deint_case(kernel_device)
    call(*good, True)  # a good validated call after a failed one passes: no stale flag


def test_deinterleave_unvalidated_call_never_reads_a_raised_flag(kernel_device) -> None:
    """``validate=False`` does not look at the flag: one left raised (by a caller's bug) neither makes it raise
    nor is cleared or raised further by it."""
    flag = _flag(kernel_device)
    ids, req, bt = _deint_case(kernel_device, "past the table")
    flag.fill_(5)
    try:
        for call, _, _ in DEINT.values():
            call(ids, req, bt, False)
        assert int(flag.item()) == 5
    finally:
        flag.zero_()


def test_deinterleave_empty_shapes_read_nothing(kernel_device, monkeypatch) -> None:
    """No launch, no read: ``T = 0`` or ``K = 0`` (the reference checks no values there either)."""
    for ids, req, bt in [
        (torch.empty(0, 4, dtype=torch.int64), torch.empty(0, dtype=torch.int32), torch.tensor([[3]])),
        (torch.empty(2, 0, dtype=torch.int64), None, torch.tensor([[3], [4]])),
    ]:
        args = [t.to(kernel_device) if t is not None else None for t in (ids, req, bt)]
        for call, _, _ in DEINT.values():
            ops, res = _counted(monkeypatch, dk, DK_KERNELS, lambda c=call, a=args: c(*a, True))
            assert not isinstance(res, Exception) and _launches(ops) == [] and _reads(ops) == [], ops


# ---------------------------------------------------------------------------------------------- FlashMLA FP8
FM_KERNELS = ("prepare_indices_kernel", "finish_outputs_kernel")


@pytest.mark.parametrize("compact", [False, True])
def test_fp8_prepare_indices_validated_is_one_launch_plus_one_read(kernel_device, monkeypatch, compact) -> None:
    slots = torch.tensor([[1, -1, 7, 3], [2, 3, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32).to(kernel_device)
    counts = torch.tensor([1, 2, 0], dtype=torch.int32).to(kernel_device) if compact else None
    out = torch.empty(3, 1, 64, dtype=torch.int32, device=kernel_device)
    state = torch.empty(3, dtype=torch.int32, device=kernel_device)

    def call(v: bool) -> Any:
        return fm8.prepare_indices(slots, counts, 40, out=out, row_state=state, validate=v)

    call(False), call(True)  # warm
    plain, _ = _counted(monkeypatch, fm8, FM_KERNELS, lambda: call(False))
    checked, _ = _counted(monkeypatch, fm8, FM_KERNELS, lambda: call(True))
    assert plain == ["triton:prepare_indices_kernel[-]"], plain  # no torch op at all: the launch
    assert checked == [FLAG_OP, "triton:prepare_indices_kernel[CHECK]", "aten::_local_scalar_dense"], checked
    assert int(_flag(kernel_device).item()) == 0
    assert state.cpu().tolist() == [fm8.ROW_READ, fm8.ROW_READ, fm8.ROW_EMPTY]


BAD_FP8 = [  # (slots, counts or None for the masked layout)
    ([[1, 40, -1], [2, 3, -1]], None),  # masked: a slot past the cache
    ([[1, -2, -1], [2, 3, -1]], None),  # masked: below -1
    ([[1, POISON, -1], [2, 3, -1]], None),  # masked: the deinterleave's poison slot
    ([[1, 4, 2], [7, -1, -1]], [4, 1]),  # compact: a count past K
    ([[1, 4, 2], [7, -1, -1]], [3, -1]),  # compact: a negative count
    ([[1, -1, 2], [7, -1, -1]], [3, 1]),  # compact: a used -1
    ([[1, 4, 40], [7, -1, -1]], [3, 1]),  # compact: a used slot past the cache
]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", range(len(BAD_FP8)))
def test_fp8_prepare_indices_bad_input_raises_the_reference_message(kernel_device, monkeypatch, case, dtype) -> None:
    s, c = BAD_FP8[case]
    slots = torch.tensor(s, dtype=dtype)
    counts = None if c is None else torch.tensor(c, dtype=dtype)
    layout = "masked" if counts is None else "compact"
    with pytest.raises(ValueError) as want:
        check_fp8_slots(slots, counts, 40, layout)
    sd, cd = slots.to(kernel_device), None if counts is None else counts.to(kernel_device)
    flag = _flag(kernel_device)
    ops, err = _counted(monkeypatch, fm8, FM_KERNELS, lambda: fm8.prepare_indices(sd, cd, 40, validate=True))
    assert isinstance(err, ValueError) and str(err) == str(want.value), (err, want.value)
    assert _launches(ops) == ["triton:prepare_indices_kernel[CHECK]"], ops
    at = ops.index("triton:prepare_indices_kernel[CHECK]")
    assert ops[at + 1 : at + 3] == ["aten::_local_scalar_dense", "aten::zero_"], ops  # read, then cleared
    assert int(flag.item()) == 0  # cleared
    ops_u, res = _counted(monkeypatch, fm8, FM_KERNELS, lambda: fm8.prepare_indices(sd, cd, 40))
    assert not isinstance(res, Exception) and _reads(ops_u) == [] and int(flag.item()) == 0
    _, row_state = res
    # the compact layout clamps a bad count (no poison); any slot it may not read poisons its row
    assert (row_state == fm8.ROW_POISONED).any().item() == (case not in (3, 4))
    fm8.prepare_indices(sd[:, :1].clamp(0, 5), None, 40, validate=True)  # then a good call passes


def _fake_decoder(dev: torch.device, reached: list) -> Any:
    """A :class:`FlashMLAFp8Decode` on ``dev`` whose FlashMLA is a stand-in: zeros, and a note that it ran."""

    def with_kvcache(q, cache, _bt, _sl, v_dim, sched, softmax_scale, is_fp8_kvcache, indices, use_legacy):  # noqa: ANN001, ANN202
        reached.append(indices.shape)
        T, _, H, _ = q.shape
        return torch.zeros(T, 1, H, v_dim, dtype=q.dtype, device=q.device), torch.zeros(T, H, 1, device=q.device)

    dec = object.__new__(fm8.FlashMLAFp8Decode)
    dec.device, dec.validate, dec._plans = dev, True, {}
    dec._fm = types.SimpleNamespace(get_mla_metadata=lambda: (object(), None), flash_mla_with_kvcache=with_kvcache)
    return dec


def test_fp8_decode_validated_call_folds_into_its_prologue(kernel_device, monkeypatch) -> None:
    """The whole validated :meth:`FlashMLAFp8Decode.attention` (with a stand-in for FlashMLA): the unvalidated
    call's ops, its prologue launched with ``CHECK`` on, and one host read after every launch (FlashMLA over the
    prologue's indices never reads an unreadable slot, so the host need not wait before launching it); a bad
    input raises the reference's message, its outputs hold the validate=False answer (NaN rows), and the flag is
    left cleared."""
    reached: list = []
    dec = _fake_decoder(kernel_device, reached)
    T, H = 2, 64
    q = torch.zeros(T, H, 576, dtype=torch.bfloat16, device=kernel_device)
    cache = quantize_kv_fp8(torch.randn(40, 576, generator=torch.Generator().manual_seed(3))).to(kernel_device)
    good = torch.tensor([[1, -1, 7], [2, 3, -1]], dtype=torch.int32, device=kernel_device)
    out = torch.empty(T, H, 512, dtype=torch.bfloat16, device=kernel_device)
    lse = torch.empty(T, H, device=kernel_device)

    def call(slots: torch.Tensor, v: bool) -> Any:
        return dec.attention(q, cache, slots, None, 0.1, out=out, out_lse=lse, validate=v)

    call(good, False), call(good, True)  # warm: the plan, the compiled kernels, the flag
    plain, _ = _counted(monkeypatch, fm8, FM_KERNELS, lambda: call(good, False))
    checked, _ = _counted(monkeypatch, fm8, FM_KERNELS, lambda: call(good, True))
    assert _reads(plain) == [] and _launches(plain) == [
        "triton:prepare_indices_kernel[-]",
        "triton:finish_outputs_kernel[-]",
    ], plain
    at = plain.index("triton:prepare_indices_kernel[-]")
    want = [*plain[:at], FLAG_OP, "triton:prepare_indices_kernel[CHECK]", *plain[at + 1 :], "aten::_local_scalar_dense"]
    assert checked == want, (plain, checked)
    for bad, row in (([[1, 40, 7], [2, 3, -1]], 0), ([[1, -1, 7], [-2, 3, -1]], 1)):
        reached.clear()
        bad_t = torch.tensor(bad, dtype=torch.int32, device=kernel_device)
        with pytest.raises(ValueError) as ref:
            check_fp8_slots(bad_t.cpu(), None, 40)
        out.zero_(), lse.zero_()
        with pytest.raises(ValueError) as ker:
            call(bad_t, True)
        assert str(ker.value) == str(ref.value)
        assert bool(out[row].isnan().all()) and bool(lse[row].isnan().all())  # the bad row was never read
        assert int(_flag(kernel_device).item()) == 0
        reached.clear()
        o, lv = call(bad_t, False)  # unvalidated: poisoned on the device, no raise
        assert reached and bool(o[row].isnan().all()) and bool(lv[row].isnan().all())
        assert not bool(o[1 - row].isnan().any()) and int(_flag(kernel_device).item()) == 0


def test_fp8_prepare_indices_validate_is_a_bool(kernel_device) -> None:
    slots = torch.tensor([[1, -1]], dtype=torch.int32, device=kernel_device)
    for bad in (1, "yes", None):
        with pytest.raises(TypeError, match="validate must be a bool"):
            fm8.prepare_indices(slots, None, 40, validate=bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="defer_read must be a bool"):
            fm8.prepare_indices(slots, None, 40, validate=True, defer_read=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slots is a meta tensor"):
        fm8.prepare_indices(slots.to("meta"), None, 40, validate=True)
