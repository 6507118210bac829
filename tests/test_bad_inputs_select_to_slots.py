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
