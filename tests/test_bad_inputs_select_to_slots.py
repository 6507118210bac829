"""Bad input to the select-to-slots stage never gives a silent wrong answer (the style of ``test_bad_inputs.py``).

1. **The table**: each row starts from a *valid* call (checked by :func:`test_every_base_call_is_valid`) and
   changes one argument; the exception type is asserted, and that its message **starts with** the argument's
   name.
2. **Reference and kernel agree**: the CuTeDSL wrapper raises the same type with the same message (its checks
   are the reference's, shared; on this CPU machine a valid call would then stop at "needs CUDA").
3. **validate=False** reads nothing on the host (meta tensors have no values) and still answers in shape.
"""

from __future__ import annotations

import pytest
import torch

from dcp_ref.geometry import DcpGeometry
from dcp_ref.select_to_slots import reference_select_to_slots, select_to_slots
from dcp_ref.topk import pack_candidates

META = "meta"
G = torch.Generator().manual_seed(0)
GEO = DcpGeometry(2, 1, 1, 4)
LOGITS = torch.randn(3, 8, generator=G)
LOCAL = torch.tensor([[0, 5, 7, -1], [1, 2, -1, -1], [-1, -1, -1, -1]])
PAIRS = torch.stack([pack_candidates(LOGITS, LOCAL, DcpGeometry(2, r)) for r in range(2)])  # [2, 3, 4, 2]
# rank_local: each rank's candidates in ascending local order, NaN padding; rank 1's own local indices
OWN = torch.tensor([[0, 5, 7, -1], [1, 2, -1, -1], [-1, -1, -1, -1]], dtype=torch.int32)
SC1 = torch.where(OWN >= 0, torch.gather(LOGITS, 1, OWN.clamp(min=0).long()), torch.tensor(float("nan")))
SCORES = torch.stack([SC1 * 0.5, SC1])  # [2, 3, 4]
TABLE = torch.tensor([[3, 0, 5], [1, 4, 2]], dtype=torch.int32)
REQ = torch.tensor([0, 1, 1], dtype=torch.int32)


def gid_base() -> dict:
    return dict(gathered=PAIRS.clone(), req_of_token=REQ, block_table=TABLE, geometry=GEO, k=3)


def rl_base() -> dict:
    return dict(
        gathered=SCORES.clone(),
        req_of_token=REQ,
        block_table=TABLE,
        geometry=GEO,
        k=3,
        order="rank_local",
        own_ids=OWN.clone(),
    )


def _dup_pairs() -> torch.Tensor:
    g = PAIRS.clone()
    g[0, 0, 0] = g[1, 0, 0]  # the same (score, id) on two ranks
    return g


def _not_ascending() -> torch.Tensor:
    o = OWN.clone()
    o[0, :3] = torch.tensor([5, 0, 7], dtype=torch.int32)
    return o


def _unnamed() -> torch.Tensor:
    o = OWN.clone()
    o[1, 1] = -1  # a real score left without its local index
    return o


def _big_table() -> torch.Tensor:
    t = TABLE.clone().long()
    t[:] = 2**31 // 4  # every slot beyond int32
    return t


def _holes() -> torch.Tensor:
    t = TABLE.clone()
    t[:] = -1  # every block missing: a winner of rank 1 has none
    return t


def _column_alias() -> dict:
    """``out_counts`` a column of ``out_slots``: the counts would overwrite real slots."""
    slots = torch.zeros(3, 3, dtype=torch.int32)
    return dict(out_slots=slots, out_counts=slots[:, 0])


def _own_alias() -> dict:
    """``out_slots`` the first columns of the buffer ``own_ids`` lives in."""
    own = OWN.clone()
    return dict(own_ids=own, out_slots=own[:, :3])


def _table_alias() -> dict:
    """``out_slots`` and ``block_table`` two windows of one buffer that overlap."""
    buf = torch.zeros(4, 3, dtype=torch.int32)
    buf[1:3] = TABLE
    return dict(block_table=buf[1:3], out_slots=buf[:3])


# (name, base, {argument: bad value}, exception, the argument the message starts with)
CASES = [
    ("gathered float64", gid_base, dict(gathered=PAIRS.double()), TypeError, "gathered"),
    ("gathered list", gid_base, dict(gathered=PAIRS.tolist()), TypeError, "gathered"),
    ("gathered 3-D for global_id", gid_base, dict(gathered=PAIRS[..., 0]), ValueError, "gathered"),
    ("gathered last dim 3", gid_base, dict(gathered=torch.zeros(2, 3, 4, 3)), ValueError, "gathered"),
    ("gathered wrong W", gid_base, dict(gathered=PAIRS[:1].clone()), ValueError, "gathered"),
    (
        "gathered fractional id",
        gid_base,
        dict(gathered=PAIRS.clone().index_fill_(3, torch.tensor([1]), 2.5)),
        ValueError,
        "gathered",
    ),
    (
        "gathered id 2**24",
        gid_base,
        dict(gathered=torch.where(PAIRS[..., 1:] >= 0, 2.0**24, -1.0).expand_as(PAIRS).contiguous()),
        ValueError,
        "gathered",
    ),
    (
        "gathered id -2",
        gid_base,
        dict(gathered=PAIRS.clone().index_fill_(3, torch.tensor([1]), -2.0)),
        ValueError,
        "gathered",
    ),
    ("gathered duplicate id", gid_base, dict(gathered=_dup_pairs()), ValueError, "gathered"),
    (
        "gathered meta validated",
        gid_base,
        dict(gathered=PAIRS.to(META), req_of_token=REQ.to(META), block_table=TABLE.to(META)),
        ValueError,
        "gathered",
    ),
    ("gathered 4-D for rank_local", rl_base, dict(gathered=PAIRS), ValueError, "gathered"),
    ("gathered int for rank_local", rl_base, dict(gathered=SCORES.int()), TypeError, "gathered"),
    ("own_ids for global_id", gid_base, dict(own_ids=OWN), ValueError, "own_ids"),
    ("own_ids missing", rl_base, dict(own_ids=None), ValueError, "own_ids"),
    ("own_ids int64", rl_base, dict(own_ids=OWN.long()), TypeError, "own_ids"),
    ("own_ids shape", rl_base, dict(own_ids=OWN[:, :3].contiguous()), ValueError, "own_ids"),
    ("own_ids 1-D", rl_base, dict(own_ids=OWN[0].contiguous()), ValueError, "own_ids"),
    ("own_ids device", rl_base, dict(own_ids=OWN.to(META)), ValueError, "own_ids"),
    ("own_ids -2", rl_base, dict(own_ids=OWN.clone().fill_(-2)), ValueError, "own_ids"),
    ("own_ids not ascending", rl_base, dict(own_ids=_not_ascending()), ValueError, "own_ids"),
    ("own_ids -1 under a score", rl_base, dict(own_ids=_unnamed()), ValueError, "own_ids"),
    ("req float", gid_base, dict(req_of_token=REQ.float()), TypeError, "req_of_token"),
    ("req 2-D", gid_base, dict(req_of_token=REQ.view(3, 1)), ValueError, "req_of_token"),
    ("req length", gid_base, dict(req_of_token=REQ[:2]), ValueError, "req_of_token"),
    (
        "req out of range",
        gid_base,
        dict(req_of_token=torch.tensor([0, 2, 1], dtype=torch.int32)),
        ValueError,
        "req_of_token",
    ),
    ("req negative", rl_base, dict(req_of_token=torch.tensor([0, -1, 1])), ValueError, "req_of_token"),
    (
        "req None, too few requests",
        gid_base,
        dict(req_of_token=None, block_table=TABLE[:2]),
        ValueError,
        "req_of_token",
    ),
    ("req device", gid_base, dict(req_of_token=REQ.to(META)), ValueError, "req_of_token"),
    ("block_table float", gid_base, dict(block_table=TABLE.float()), TypeError, "block_table"),
    ("block_table 1-D", gid_base, dict(block_table=TABLE[0]), ValueError, "block_table"),
    ("block_table device", rl_base, dict(block_table=TABLE.to(META)), ValueError, "block_table"),
    ("block_table missing block", gid_base, dict(block_table=_holes()), ValueError, "block_table"),
    ("block_table missing block (rank_local)", rl_base, dict(block_table=_holes()), ValueError, "block_table"),
    ("block_table too short", gid_base, dict(block_table=TABLE[:, :1].contiguous()), ValueError, "block_table"),
    ("block_table beyond int32", rl_base, dict(block_table=_big_table()), ValueError, "block_table"),
    ("geometry tuple", gid_base, dict(geometry=(2, 1, 1, 4)), TypeError, "geometry"),
    ("geometry W mismatch", gid_base, dict(geometry=DcpGeometry(3, 1, 1, 4)), ValueError, "gathered"),
    ("k 0", gid_base, dict(k=0), ValueError, "k"),
    ("k float", rl_base, dict(k=3.0), TypeError, "k"),
    ("k bool", gid_base, dict(k=True), TypeError, "k"),
    ("order unknown", gid_base, dict(order="global"), ValueError, "order"),
    ("order int", gid_base, dict(order=1), ValueError, "order"),
    ("out_slots shape", gid_base, dict(out_slots=torch.zeros(3, 4, dtype=torch.int32)), ValueError, "out_slots"),
    ("out_slots dtype", rl_base, dict(out_slots=torch.zeros(3, 3, dtype=torch.int64)), TypeError, "out_slots"),
    ("out_slots list", gid_base, dict(out_slots=[[0] * 3] * 3), TypeError, "out_slots"),
    ("out_counts shape", gid_base, dict(out_counts=torch.zeros(4, dtype=torch.int32)), ValueError, "out_counts"),
    (
        "out_counts device",
        rl_base,
        dict(out_counts=torch.zeros(3, dtype=torch.int32, device=META)),
        ValueError,
        "out_counts",
    ),
    ("out_counts in out_slots", gid_base, _column_alias(), ValueError, "out_counts"),
    ("out_slots over own_ids", rl_base, _own_alias(), ValueError, "out_slots"),
    ("out_slots over block_table", gid_base, _table_alias(), ValueError, "out_slots"),
    ("validate int", gid_base, dict(validate=1), TypeError, "validate"),
]


def _call(fn, base, change):
    kwargs = base()
    kwargs.update(change)
    return fn(**kwargs)


@pytest.mark.parametrize("base", [gid_base, rl_base], ids=["global_id", "rank_local"])
def test_every_base_call_is_valid(base):
    slots, counts = _call(select_to_slots, base, {})
    assert tuple(slots.shape) == (3, 3) and int(counts.sum()) > 0  # rank 1 owns some winners


@pytest.mark.parametrize("name, base, change, exc, arg", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_naming_the_argument_first(name, base, change, exc, arg):
    with pytest.raises(exc) as info:
        _call(select_to_slots, base, change)
    assert str(info.value).startswith(arg), f"{type(info.value).__name__}: {info.value}"


@pytest.mark.parametrize("name, base, change, exc, arg", CASES, ids=[c[0] for c in CASES])
def test_kernel_rejects_like_the_reference(name, base, change, exc, arg):
    pytest.importorskip("cutlass")
    from dcp_ref.kernels.select_to_slots_cutedsl import select_to_slots_cutedsl

    with pytest.raises(exc) as ref:
        _call(select_to_slots, base, change)
    with pytest.raises(exc) as ker:
        _call(select_to_slots_cutedsl, base, change)
    assert str(ker.value) == str(ref.value)


def test_the_table_covers_every_argument():
    named = {c[4] for c in CASES}
    assert named >= {"gathered", "own_ids", "req_of_token", "block_table", "geometry", "k", "order"}
    assert named >= {"out_slots", "out_counts", "validate"}
    assert len(CASES) >= 45


def _meta(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=META)


@pytest.mark.parametrize("order", ["global_id", "rank_local"])
@pytest.mark.parametrize("req", [True, False])
def test_validate_false_reads_nothing_on_the_host(order, req):
    """Meta tensors have no values: any host read (``.item()``, ``bool(tensor)``, a data-dependent shape) fails."""
    W, T, K, k = 4, 5, 6, 7
    g = DcpGeometry(W, 2, 2, 4)
    gathered = _meta(W, T, K, 2) if order == "global_id" else _meta(W, T, K)
    own = None if order == "global_id" else _meta(T, K, dtype=torch.int32)
    r = _meta(T, dtype=torch.int64) if req else None
    s, n = select_to_slots(gathered, r, _meta(T, 3, dtype=torch.int32), g, k, order=order, own_ids=own, validate=False)
    assert s.device.type == n.device.type == "meta" and tuple(s.shape) == (T, k) and tuple(n.shape) == (T,)
    out_s, out_n = _meta(T, k, dtype=torch.int32), _meta(T, dtype=torch.int32)
    s, n = reference_select_to_slots(
        gathered, own, r, _meta(T, 3, dtype=torch.int32), g, k, order=order, out_slots=out_s, out_counts=out_n
    )
    assert s is out_s and n is out_n


def test_validate_false_kernel_checks_shapes_then_needs_cuda():
    """The kernel wrapper's unvalidated call reads no value either: it passes the shared shape checks and stops
    at its own device requirement (on this CPU machine)."""
    pytest.importorskip("cutlass")
    from dcp_ref.kernels.select_to_slots_cutedsl import select_to_slots_cutedsl

    g = DcpGeometry(2, 0, 1, 4)
    with pytest.raises(ValueError, match=r"^gathered must be a CUDA tensor"):
        select_to_slots_cutedsl(_meta(2, 3, 4, 2), None, _meta(3, 2, dtype=torch.int32), g, 4, validate=False)
    with pytest.raises(ValueError, match=r"^gathered is a meta tensor"):  # validated: it would need the values
        select_to_slots_cutedsl(_meta(2, 3, 4, 2), None, _meta(3, 2, dtype=torch.int32), g, 4)


def test_validate_false_poisons_instead_of_answering():
    """Out-of-contract rows get the sentinel slot, never a plausible slot (the reference; the kernel matches it
    in the GPU differential test)."""
    from dcp_ref.select_to_slots import SENTINEL_SLOT

    bad_req = torch.tensor([0, 7, -1], dtype=torch.int32)
    for base in (gid_base, rl_base):
        s, n = _call(select_to_slots, base, dict(req_of_token=bad_req, validate=False))
        for t in (1, 2):
            assert all(v == SENTINEL_SLOT for v in s[t, : int(n[t])].tolist())
        s, n = _call(select_to_slots, base, dict(block_table=_holes(), validate=False))
        assert int(n.sum()) > 0 and all(v == SENTINEL_SLOT for t in range(3) for v in s[t, : int(n[t])].tolist())
        s, n = _call(select_to_slots, base, dict(block_table=_big_table(), validate=False))
        assert all(v == SENTINEL_SLOT for t in range(3) for v in s[t, : int(n[t])].tolist())


# ---- the kernel wrapper's validated call: one check launch, one host read ------------------------------------
_SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero", "aten::equal"}


def _counted(monkeypatch, fn):
    """``(aten ops, check launches, the exception's message)`` of ``fn()``. The check kernel's launches are counted
    and run outside the dispatch mode: the interpreter's own copies of the launch arguments are not the call's
    ops (on the GPU a launch is no aten op at all)."""
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

    from dcp_ref.kernels import select_to_slots_cutedsl as mod

    ops: list[str] = []
    launches: list[tuple] = []
    kernel = mod.select_check_kernel

    class Launcher:
        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            def launch(*args, **kwargs):  # type: ignore[no-untyped-def]
                launches.append(grid)
                with _disable_current_modes():
                    return kernel[grid](*args, **kwargs)

            return launch

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            ops.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(mod, "select_check_kernel", Launcher())
    try:
        with Mode():
            fn()
    except ValueError as e:
        return ops, launches, str(e)
    finally:
        monkeypatch.setattr(mod, "select_check_kernel", kernel)
    return ops, launches, None


def _flag_value() -> int:
    from dcp_ref.kernels._util import check_flag

    return int(check_flag(torch.device("cpu")).item())


@pytest.mark.parametrize("base", [gid_base, rl_base], ids=["global_id", "rank_local"])
@pytest.mark.parametrize("req", [True, False], ids=["req", "req=None"])
def test_kernel_validated_call_is_one_check_launch_and_one_read(monkeypatch, base, req):
    """The validated call runs the unvalidated call's ops plus one launch of the check kernel and one host read
    (``.item()`` of the flag); before, it ran the whole reference selection (~100-145 aten ops, 5-7 reads).
    On this CPU machine both calls then stop at "needs CUDA", after the checks, so the count covers them all."""
    pytest.importorskip("cutlass")
    from dcp_ref.kernels.select_to_slots_cutedsl import select_to_slots_cutedsl

    kwargs = base()
    if not req:
        kwargs.update(req_of_token=None, block_table=torch.cat([TABLE, TABLE[:1] + 6]))  # a row per token
    out = dict(out_slots=torch.zeros(3, 3, dtype=torch.int32), out_counts=torch.zeros(3, dtype=torch.int32))
    call = lambda v: select_to_slots_cutedsl(**kwargs, **out, validate=v)  # noqa: E731
    _counted(monkeypatch, lambda: call(True))  # warm: compiled
    plain, plain_launches, plain_err = _counted(monkeypatch, lambda: call(False))
    ops, launches, err = _counted(monkeypatch, lambda: call(True))
    assert plain_err == err and err.startswith("gathered must be a CUDA tensor")
    assert plain_launches == [] and len(launches) == 1
    # the call's own flag and (global_id) hash table, made per call (no module cache), then the one read
    made = ["aten::zeros"] * (len(ops) - len(plain) - 1)
    assert ops == [*plain, *made, "aten::_local_scalar_dense"] and 1 <= len(made) <= 2, ops
    assert [o for o in ops if o in _SYNC_OPS] == ["aten::_local_scalar_dense"]
    assert _flag_value() == 0


VALUE_CASES = [c for c in CASES if c[0] not in ("validate int",) and c[3] is ValueError]


@pytest.mark.parametrize("name, base, change, exc, arg", VALUE_CASES, ids=[c[0] for c in VALUE_CASES])
def test_kernel_refusal_clears_the_flag(monkeypatch, name, base, change, exc, arg):
    """Every refused input raises the reference's message; a value error comes after one check launch whose flag
    the wrapper clears before it raises (the next validated call on this stream starts from 0)."""
    pytest.importorskip("cutlass")
    from dcp_ref.kernels.select_to_slots_cutedsl import select_to_slots_cutedsl

    with pytest.raises(exc) as ref:
        _call(select_to_slots, base, change)
    _, launches, err = _counted(monkeypatch, lambda: _call(select_to_slots_cutedsl, base, change))
    assert err == str(ref.value)
    assert len(launches) <= 1 and _flag_value() == 0
    value_error = name in {
        "gathered fractional id", "gathered id 2**24", "gathered id -2", "gathered duplicate id", "own_ids -2",
        "own_ids not ascending", "own_ids -1 under a score", "req out of range", "req negative",
        "block_table missing block", "block_table missing block (rank_local)", "block_table too short",
        "block_table beyond int32",
    }  # fmt: skip
    assert len(launches) == value_error  # shape errors are raised before the launch, meta tensors too


def test_kernel_false_alarm_is_cleared_by_the_reference_check(monkeypatch):
    """A losing candidate of this rank without a block raises the flag (the kernel checks every candidate, the
    reference only the winners): the reference's check then accepts the call, which goes on (here: to "needs
    CUDA"), with the flag cleared."""
    pytest.importorskip("cutlass")
    from dcp_ref.kernels.select_to_slots_cutedsl import select_to_slots_cutedsl

    kwargs = gid_base()
    kwargs["k"] = 1
    # rank 1's candidates whose scores are not the row's best: make their blocks vanish (row 0 is request 0)
    pairs = kwargs["gathered"]
    best = pairs[..., 0].permute(1, 0, 2).reshape(3, -1).nan_to_num(nan=-1e30).argmax(1)
    table = TABLE.clone()
    for t in range(2):
        w, c = divmod(int(best[t]), 4)
        keep = int(pairs[w, t, c, 1]) // 2 // GEO.block_size if w == 1 else None  # the winner's block, if ours
        for b in range(table.shape[1]):
            if b != keep:
                table[REQ[t], b] = -1
    kwargs["block_table"] = table
    select_to_slots(**kwargs)  # the reference accepts: the winners keep their blocks
    from dcp_ref.kernels.select_to_slots_cutedsl import check_select_to_slots_values

    chk = check_select_to_slots_values(
        kwargs["gathered"], kwargs["req_of_token"], table, GEO, order="global_id", own_ids=None
    )
    assert int(chk.item()) == 1  # ... but the check kernel flags the losers' missing blocks
    chk.zero_()
    _, launches, err = _counted(monkeypatch, lambda: select_to_slots_cutedsl(**kwargs))
    assert err.startswith("gathered must be a CUDA tensor") and len(launches) == 1 and _flag_value() == 0


def test_kernel_validation_without_the_kernel_is_the_reference_check(monkeypatch):
    """Where the check kernel cannot run (a CPU tensor without the interpreter, a non-contiguous ``gathered``:
    the call fails after the checks anyway), the reference's check runs instead, with its message."""
    pytest.importorskip("cutlass")
    from dcp_ref.kernels import select_to_slots_cutedsl as mod

    bad = _dup_pairs()
    strided = torch.stack([bad, bad], 2)[:, :, 0]  # [2, 3, 4, 2], not contiguous
    assert not strided.is_contiguous() and torch.equal(strided, bad)
    with pytest.raises(ValueError) as ref:
        select_to_slots(strided, REQ, TABLE, GEO, 3)
    _, launches, err = _counted(monkeypatch, lambda: mod.select_to_slots_cutedsl(strided, REQ, TABLE, GEO, 3))
    assert err == str(ref.value) and launches == []
    monkeypatch.setattr(mod, "triton_interpreting", lambda: False)
    _, launches, err = _counted(monkeypatch, lambda: mod.select_to_slots_cutedsl(bad, REQ, TABLE, GEO, 3))
    assert err == str(ref.value) and launches == []
    _, launches, err = _counted(monkeypatch, lambda: mod.select_to_slots_cutedsl(PAIRS, REQ, TABLE, GEO, 3))
    assert err.startswith("gathered must be a CUDA tensor") and launches == []


@pytest.mark.gpu
def test_kernel_rejects_like_the_reference_on_gpu(cuda_device):
    """Every row of the table on the H200 (the meta rows aside), its tensors moved with their memory relations
    kept (``tests/devmove.py``: the aliasing rows stay aliased): the CuTeDSL wrapper and the reference raise the
    same type and message, naming the argument first."""
    pytest.importorskip("cutlass")
    from devmove import to_device

    from dcp_ref.kernels.select_to_slots_cutedsl import select_to_slots_cutedsl

    ran = 0
    for name, base, change, exc, arg in CASES:
        kwargs = {**base(), **change}
        if any(isinstance(v, torch.Tensor) and v.is_meta for v in kwargs.values()):
            continue  # a meta row is about the host's checks alone (run above)
        kwargs = to_device(kwargs, cuda_device)
        with pytest.raises(exc) as ref:
            select_to_slots(**kwargs)
        with pytest.raises(exc) as ker:
            select_to_slots_cutedsl(**kwargs)
        assert str(ker.value) == str(ref.value), name
        assert str(ref.value).startswith(arg), (name, str(ref.value))
        ran += 1
    assert ran >= 40, ran
