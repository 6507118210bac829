"""Bad input never gives a silent wrong answer (issue 10).

1. **The table**: several hundred bad inputs across every public function of :mod:`dcp_ref` and the
   host wrappers of :mod:`dcp_ref.kernels`. Each starts from a *valid* call (checked to succeed
   by :func:`test_every_base_call_is_valid`) and changes one argument; the test asserts the
   exception type **and** that the message names the offending argument.
2. **Reference and kernel agree**: the same bad input raises the same type with the same message
   on the reference and on its Triton twin (pack, deinterleave), validated or not.
3. **validate=False** reads nothing on the host (proved with meta tensors, which have no values)
   and still never reads out of bounds: the reference and the kernels return the same documented
   answer for out-of-range values.
4. **Valid edge cases** (empty batch, ``k`` larger than the row, ``W = 1``, int32 near its limit,
   NumPy ints, ...) compared with brute force written here in plain Python.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from dcp_ref import (
    canonicalize,
    compact_to_front,
    correct_partial,
    dcp_merge_collective,
    deinterleave_and_compact,
    deinterleave_masked,
    expand_decode_bounds,
    global_ids_to_local_slots,
    global_to_local,
    local_seq_lens,
    local_to_global,
    local_topk,
    localize_decode_bounds,
    localize_prefill_chunk,
    lse_base2_to_e,
    lse_e_to_base2,
    merge_partials,
    normalize_lse_shape,
    owner_rank,
    sparse_mla_attention,
)
from dcp_ref.geometry import DcpGeometry
from dcp_ref.group import SimulatedWorld, SingleGroup
from dcp_ref.prefill import chunk_scores_from_local
from dcp_ref.topk import (
    check_candidate_ids,
    global_topk_all_logits,
    local_topk_by_owner,
    merge_topk_global,
    pack_candidates,
    radix_select_trace,
    stable_key,
    stable_topk,
)

NAN, INF = float("nan"), float("inf")
META = "meta"
POISON = 2**31 - 1  # the deinterleave stage's poison slot, written here independently of the code


def i64(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int64)


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32)


def f32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------
# Valid base calls: every table row changes exactly one argument of one of these.
# ----------------------------------------------------------------------------------------------
G = torch.Generator().manual_seed(0)
LOGITS = torch.randn(3, 8, generator=G)
LOCAL_IDS = i64([[0, 5, 7, -1], [1, 2, -1, -1], [-1, -1, -1, -1]])
GATHERED = torch.stack([pack_candidates(LOGITS, LOCAL_IDS, DcpGeometry(2, r)) for r in range(2)])  # [2, 3, 4, 2]
TOKEN_IDS = i64([[0, 3, 6, -1], [9, 2, -1, -1], [1, 7, 12, 5]])
BLOCK_TABLE = i32([[3, 0, 5], [1, 4, -1]])
REQ = i32([0, 1, 1])
Q = torch.randn(2, 2, 8, generator=G, dtype=torch.float64)
KV = torch.randn(10, 8, generator=G, dtype=torch.float64)
SLOTS = i32([[1, 4, 9], [7, -1, -1]])
COUNTS = i32([3, 1])
OUTS = torch.randn(2, 3, 2, 4, generator=G, dtype=torch.float64)
LSES = torch.randn(2, 3, 2, generator=G, dtype=torch.float64)
CHUNK = localize_prefill_chunk(i64([3, 0]), i64([2, 1]), 2, 0)

BASES = {
    "owner_rank": (owner_rank, dict(pos=torch.arange(10), world_size=2, interleave=2)),
    "global_to_local": (global_to_local, dict(pos=torch.arange(10), world_size=2, interleave=2)),
    "local_to_global": (local_to_global, dict(local=torch.arange(5), world_size=2, rank=1, interleave=2)),
    "local_seq_lens": (local_seq_lens, dict(seq_lens=i64([5, 9]), world_size=2, rank=1, interleave=2)),
    "expand_decode_bounds": (expand_decode_bounds, dict(seq_lens=i64([5, 9]), query_lens=2)),
    "localize_decode_bounds": (
        localize_decode_bounds,
        dict(seq_lens=i64([5, 9]), query_lens=i64([1, 2]), world_size=2, rank=1, interleave=2, num_tokens=3),
    ),
    "localize_prefill_chunk": (
        localize_prefill_chunk,
        dict(context_lens=i64([3, 0]), query_lens=i64([2, 4]), world_size=2, rank=0, interleave=1),
    ),
    "local_topk": (local_topk, dict(logits=LOGITS, k=4, lengths=i64([8, 3, 0]))),
    "local_topk_rs": (local_topk, dict(logits=LOGITS, k=2, lengths=i64([3, 2, 0]), row_starts=i32([0, 5, 8]))),
    "pack_candidates": (pack_candidates, dict(logits=LOGITS, local_topk=LOCAL_IDS, geometry=DcpGeometry(2, 1))),
    "pack_candidates_rs": (
        pack_candidates,
        dict(
            logits=LOGITS,
            local_topk=i64([[0, 1], [2, -1], [-1, -1]]),
            geometry=DcpGeometry(2, 0),
            row_starts=i32([0, 5, 8]),
        ),
    ),
    "stable_key": (stable_key, dict(scores=f32([0.5, -0.0]), ids=i64([3, 1]))),
    "stable_topk": (stable_topk, dict(gathered=GATHERED, k=3)),
    "check_candidate_ids": (check_candidate_ids, dict(ids=GATHERED[..., 1])),
    "merge_topk_global": (merge_topk_global, dict(group=None, logits=LOGITS, local_topk=LOCAL_IDS, k=4)),
    "global_topk_all_logits": (global_topk_all_logits, dict(scores=LOGITS, k=3)),
    "local_topk_by_owner": (local_topk_by_owner, dict(scores=LOGITS, K=2, world_size=2, interleave=2)),
    "radix_select_trace": (radix_select_trace, dict(keys=[5, 0, 9, 3], k=2)),
    "global_ids_to_local_slots": (
        global_ids_to_local_slots,
        dict(token_ids=TOKEN_IDS, req_of_token=REQ, block_table=BLOCK_TABLE, geometry=DcpGeometry(2, 1, 2, 4)),
    ),
    "deinterleave_and_compact": (
        deinterleave_and_compact,
        dict(token_ids=TOKEN_IDS, req_of_token=REQ, block_table=BLOCK_TABLE, geometry=DcpGeometry(2, 0, 2, 4)),
    ),
    "deinterleave_masked": (
        deinterleave_masked,
        dict(token_ids=TOKEN_IDS, req_of_token=REQ, block_table=BLOCK_TABLE, geometry=DcpGeometry(2, 1, 2, 4)),
    ),
    "compact_to_front": (compact_to_front, dict(slots=SLOTS)),
    "canonicalize": (canonicalize, dict(slots=SLOTS, counts=i32([2, 1]))),
    "sparse_mla_attention": (
        sparse_mla_attention,
        dict(q=Q, kv_cache=KV, slots=SLOTS, counts=COUNTS, sm_scale=0.5, lse_base="e", v_dim=6),
    ),
    "lse_base2_to_e": (lse_base2_to_e, dict(lse=LSES)),
    "lse_e_to_base2": (lse_e_to_base2, dict(lse=LSES)),
    "normalize_lse_shape": (normalize_lse_shape, dict(lse=LSES[0], num_tokens=3, num_heads=2)),
    "merge_partials": (merge_partials, dict(outs=OUTS, lses=LSES, base="e")),
    "correct_partial": (correct_partial, dict(out=OUTS[0], all_lses=LSES, rank=1, base="e")),
    "dcp_merge_collective": (dcp_merge_collective, dict(group=SingleGroup(), out=OUTS[0], lse=LSES[0], base="e")),
    "chunk_scores_from_local": (
        chunk_scores_from_local,
        dict(local_scores=torch.randn(3, 4), query_lens=i64([2, 1]), meta=CHUNK),
    ),
}

CASES: list = []


def bad(which: str, exc: type, names: str | tuple[str, ...], label: str, /, **override) -> None:
    """One table row: BASES[which] with ``override`` must raise ``exc`` naming one of ``names``."""
    fn, kwargs = BASES[which]
    kw = {**kwargs, **override}
    names = (names,) if isinstance(names, str) else names
    CASES.append(pytest.param(fn, kw, exc, names, id=f"{which}[{label}]"))


# ---- generic mutations -------------------------------------------------------------------------
def geometry_cases(base: str, *, rank_required: bool, has_rank: bool = True) -> None:
    for arg in ("world_size", "interleave"):
        if arg not in BASES[base][1]:
            continue
        for label, v, exc in [
            ("0", 0, ValueError),
            ("neg", -1, ValueError),
            ("bool", True, TypeError),
            ("float", 2.0, TypeError),
            ("str", "2", TypeError),
            ("none", None, TypeError),
            ("list", [2], TypeError),
            ("1d tensor", i64([2]), TypeError),
            ("float tensor", torch.tensor(2.0), TypeError),
        ]:
            bad(base, exc, arg, f"{arg}={label}", **{arg: v})
    if has_rank and "rank" in BASES[base][1]:
        W = BASES[base][1]["world_size"]
        for label, v, exc in [
            ("neg", -1, ValueError),
            ("W", W, ValueError),
            ("bool", True, TypeError),
            ("float", 1.0, TypeError),
            ("str", "1", TypeError),
            ("list", [1], TypeError),
            ("1d tensor", i64([1]), TypeError),
            ("meta 0d", torch.tensor(1, device=META), ValueError),
        ]:
            bad(base, exc, "rank", f"rank={label}", rank=v)
        if rank_required:
            bad(base, ValueError, "rank", "rank=None", rank=None)


def geometry_arg_cases(base: str) -> None:
    """A function that takes ``geometry: DcpGeometry``: anything else is a ``TypeError`` naming ``geometry``
    (never read as loose ints or duck-typed: a tuple in the old ``W, rank, I, block_size`` order, an object with
    the right attribute names, the ints themselves)."""
    from types import SimpleNamespace

    g = BASES[base][1]["geometry"]
    for label, v in [
        ("tuple", (g.world_size, g.rank, g.interleave, g.block_size)),
        ("dict", dict(world_size=g.world_size, rank=g.rank, interleave=g.interleave, block_size=g.block_size)),
        (
            "namespace",
            SimpleNamespace(world_size=g.world_size, rank=g.rank, interleave=g.interleave, block_size=g.block_size),
        ),
        ("int", g.world_size),
        ("none", None),
        ("str", "dcp"),
        ("tensor", i64([g.world_size, g.rank, g.interleave, g.block_size])),
    ]:
        bad(base, TypeError, "geometry", f"geometry={label}", geometry=v)


def int_tensor_cases(
    base: str, arg: str, *, ndim: int | None, lists_ok: bool, values_read: bool = True, meta_with: tuple[str, ...] = ()
) -> None:
    """A tensor argument that must hold integers: wrong types, dtypes and ranks (``ndim=None``: any
    shape is valid); meta (values unreadable: ``meta_with`` names tensors that must move along)."""
    t = BASES[base][1][arg]
    bad(base, TypeError, arg, f"{arg}=float tensor", **{arg: t.float()})
    bad(base, TypeError, arg, f"{arg}=bool tensor", **{arg: t != 0})
    bad(base, TypeError, arg, f"{arg}=str", **{arg: "0"})
    bad(base, TypeError, arg, f"{arg}=float", **{arg: 1.5})
    bad(base, TypeError, arg, f"{arg}=list of floats", **{arg: [1.5] * max(1, t.shape[0] if t.ndim else 1)})
    if not lists_ok:
        bad(base, TypeError, arg, f"{arg}=list of ints", **{arg: t.tolist()})
        bad(base, TypeError, arg, f"{arg}=numpy array", **{arg: t.numpy()})
    if ndim is not None:
        wrong = t.reshape(-1) if ndim != 1 else t.reshape(1, -1)
        bad(base, ValueError, arg, f"{arg}=wrong ndim", **{arg: wrong})
    if values_read:
        along = {n: BASES[base][1][n].to(META) for n in meta_with}
        bad(base, ValueError, arg, f"{arg}=meta", **{arg: t.to(META)}, **along)


def float_tensor_cases(base: str, arg: str, *, ndim: int | tuple[int, ...]) -> None:
    t = BASES[base][1][arg]
    bad(base, TypeError, arg, f"{arg}=int tensor", **{arg: t.long()})
    bad(base, TypeError, arg, f"{arg}=list", **{arg: t.tolist()})
    bad(base, TypeError, arg, f"{arg}=numpy", **{arg: t.numpy()})
    bad(base, TypeError, arg, f"{arg}=None", **{arg: None})
    if ndim is not None:
        bad(base, ValueError, arg, f"{arg}=wrong ndim", **{arg: t.reshape(-1)[:1].reshape(*([1] * 5))})


def scalar_int_cases(base: str, arg: str, *, min_value: int) -> None:
    for label, v, exc in [
        ("bool", True, TypeError),
        ("float", 2.0, TypeError),
        ("str", "2", TypeError),
        ("none", None, TypeError),
        ("list", [2], TypeError),
        ("below min", min_value - 1, ValueError),
    ]:
        bad(base, exc, arg, f"{arg}={label}", **{arg: v})


def flag_cases(base: str, arg: str) -> None:
    for label, v in [("int", 1), ("str", "yes"), ("none", None)]:
        bad(base, TypeError, arg, f"{arg}={label}", **{arg: v})


# ---- ownership ---------------------------------------------------------------------------------
for b in ("owner_rank", "global_to_local"):
    geometry_cases(b, rank_required=False)
    int_tensor_cases(b, "pos", ndim=None, lists_ok=True)
    bad(b, ValueError, "pos", "pos negative", pos=i64([3, -1]))
    bad(b, ValueError, "pos", "pos negative int", pos=-4)
    bad(b, TypeError, "pos", "pos bool", pos=True)
    bad(b, TypeError, "pos", "pos list of bools", pos=[True, False])
    bad(b, TypeError, "pos", "pos nested floats", pos=[[1, 2.5]])
    bad(b, ValueError, "pos", "pos ragged list", pos=[[1, 2], [3]])
geometry_cases("local_to_global", rank_required=True)
int_tensor_cases("local_to_global", "local", ndim=None, lists_ok=True)
bad("local_to_global", ValueError, "local", "local negative", local=i64([0, -2]))
bad("local_to_global", ValueError, "local", "int32 global overflows", local=i32([2**30]))
bad("local_to_global", ValueError, "local", "int64 global overflows", local=i64([2**62]))
bad("local_to_global", ValueError, "local", "python int overflows int64", local=2**62)
geometry_cases("local_seq_lens", rank_required=False)
int_tensor_cases("local_seq_lens", "seq_lens", ndim=None, lists_ok=True)
bad("local_seq_lens", ValueError, "seq_lens", "negative", seq_lens=i64([4, -1]))
for b in ("expand_decode_bounds", "localize_decode_bounds"):
    int_tensor_cases(b, "seq_lens", ndim=1, lists_ok=True)
    bad(b, TypeError, "seq_lens", "seq_lens int", seq_lens=5)
    bad(b, ValueError, "seq_lens", "seq_lens negative", seq_lens=i64([-1, 9]))
    bad(b, ValueError, "query_lens", "seq_lens < query_lens", seq_lens=i64([1, 9]), query_lens=i64([2, 1]))
    bad(b, ValueError, "query_lens", "query_lens negative", query_lens=i64([-1, 4]))
    bad(b, ValueError, "query_lens", "query_lens wrong shape", query_lens=i64([1, 2, 3]))
    bad(b, TypeError, "query_lens", "query_lens float", query_lens=2.0)
    bad(b, TypeError, "query_lens", "query_lens bool", query_lens=True)
    bad(b, ValueError, "query_lens", "query_lens int 0", query_lens=0)
    bad(b, TypeError, "query_lens", "query_lens float tensor", query_lens=f32([1, 2]))
    bad(
        b,
        ValueError,
        ("query_lens", "num_tokens"),
        "num_tokens disagrees (tensor)",
        query_lens=i64([1, 2]),
        num_tokens=4,
    )
    bad(b, ValueError, ("query_lens", "num_tokens"), "num_tokens disagrees (int)", query_lens=2, num_tokens=3)
    bad(b, ValueError, "num_tokens", "num_tokens negative", num_tokens=-1)
    bad(b, TypeError, "num_tokens", "num_tokens float", num_tokens=3.0)
    bad(
        b,
        ValueError,
        "num_tokens",
        "validate=False needs num_tokens",
        query_lens=i64([1, 2]),
        num_tokens=None,
        validate=False,
    )
    flag_cases(b, "validate")
geometry_cases("localize_decode_bounds", rank_required=False)
geometry_cases("localize_prefill_chunk", rank_required=True)
for arg in ("context_lens", "query_lens"):
    int_tensor_cases("localize_prefill_chunk", arg, ndim=1, lists_ok=True)
    bad("localize_prefill_chunk", ValueError, arg, f"{arg} negative", **{arg: i64([-1, 2])})
bad("localize_prefill_chunk", ValueError, "query_lens", "shape mismatch", query_lens=i64([1, 2, 3]))

# ---- indexer -----------------------------------------------------------------------------------
for b in ("local_topk", "local_topk_rs"):
    float_tensor_cases(b, "logits", ndim=2)
    scalar_int_cases(b, "k", min_value=1)
    int_tensor_cases(b, "lengths", ndim=1, lists_ok=False)
    bad(b, ValueError, "lengths", "lengths wrong rows", lengths=i64([1, 2]))
    bad(b, ValueError, "lengths", "lengths negative", lengths=i64([1, -2, 0]))
    bad(b, ValueError, "lengths", "lengths other device", lengths=BASES[b][1]["lengths"].to(META), validate=False)
    flag_cases(b, "validate")
bad("local_topk", ValueError, "lengths", "index scores narrower than the bound (class 2)", lengths=i64([9, 3, 0]))
int_tensor_cases("local_topk_rs", "row_starts", ndim=1, lists_ok=False)
bad("local_topk_rs", ValueError, "row_starts", "row_starts negative", row_starts=i32([0, -1, 8]))
bad("local_topk_rs", ValueError, "row_starts", "row_starts > cols", row_starts=i32([0, 9, 8]))
bad("local_topk_rs", ValueError, ("row_starts", "lengths"), "window past cols", row_starts=i32([6, 5, 8]))
bad("local_topk_rs", ValueError, "row_starts", "row_starts wrong rows", row_starts=i32([0, 5]))

# ---- top-K -------------------------------------------------------------------------------------
for b in ("pack_candidates", "pack_candidates_rs"):
    geometry_arg_cases(b)
    float_tensor_cases(b, "logits", ndim=2)
    int_tensor_cases(b, "local_topk", ndim=2, lists_ok=False)
    bad(b, ValueError, "local_topk", "local_topk < -1", local_topk=torch.where(BASES[b][1]["local_topk"] < 0, -2, 0))
    bad(b, ValueError, "local_topk", "local_topk >= cols", local_topk=torch.full_like(BASES[b][1]["local_topk"], 8))
    bad(b, ValueError, "local_topk", "local_topk rows", local_topk=BASES[b][1]["local_topk"][:2])
    bad(b, ValueError, "local_topk", "local_topk other device", local_topk=BASES[b][1]["local_topk"].to(META))
    bad(b, TypeError, "row_starts", "row_starts list", row_starts=[0, 1, 2])
    bad(b, TypeError, "row_starts", "row_starts float", row_starts=f32([0, 1, 2]))
    bad(b, ValueError, "row_starts", "row_starts wrong shape", row_starts=i32([0, 1]))
    bad(b, ValueError, "row_starts", "row_starts negative", row_starts=i32([0, -1, 0]))
    bad(b, ValueError, "row_starts", "row_starts > cols", row_starts=i32([0, 9, 0]))
    bad(
        b,
        ValueError,
        "logits",
        "ids may pass 2**24 with validate=False",
        logits=torch.empty(1, 2**23 + 8, device=META),
        local_topk=torch.zeros(1, 2, dtype=torch.int64, device=META),
        validate=False,
        **({"row_starts": None}),
    )
    flag_cases(b, "validate")
bad(
    "pack_candidates",
    ValueError,
    "local_topk",
    "id >= 2**24 by value",
    logits=torch.zeros(1, 2**23 + 8),
    local_topk=i64([[2**23 + 7, -1]]),
)
# A valid geometry the data does not fit: so many ranks that this rank's keys have global ids >= 2**24.
bad(
    "pack_candidates",
    ValueError,
    "local_topk",
    "geometry W=2**22: ids >= 2**24 by value",
    geometry=DcpGeometry(2**22, 1),
)
bad(
    "pack_candidates",
    ValueError,
    "logits",
    "geometry W=2**22: ids may pass 2**24 with validate=False",
    geometry=DcpGeometry(2**22, 1),
    validate=False,
)

for b in ("stable_topk",):
    t = BASES[b][1]["gathered"]
    bad(b, TypeError, "gathered", "float64", gathered=t.double())
    bad(b, TypeError, "gathered", "int", gathered=t.long())
    bad(b, TypeError, "gathered", "list", gathered=t.tolist())
    bad(b, ValueError, "gathered", "2-D", gathered=t[0, 0])
    bad(b, ValueError, "gathered", "last dim 3", gathered=torch.zeros(2, 3, 4, 3))
    bad(b, ValueError, "gathered", "fractional id", gathered=t.clone().index_fill_(-1, i64([1]), 2.5))
    bad(b, ValueError, "gathered", "id -3", gathered=t.clone().index_fill_(-1, i64([1]), -3.0))
    bad(b, ValueError, "gathered", "id 2**24", gathered=t.clone().index_fill_(-1, i64([1]), float(2**24)))
    bad(b, ValueError, "gathered", "id inf", gathered=t.clone().index_fill_(-1, i64([1]), INF))
    bad(b, ValueError, "gathered", "meta (values unreadable)", gathered=t.to(META))
    scalar_int_cases(b, "k", min_value=1)
    flag_cases(b, "sorted")
    flag_cases(b, "validate")
bad("stable_key", TypeError, "ids", "ids list", ids=[3, 1])
bad("stable_key", ValueError, "ids", "ids shape", ids=i64([3, 1, 2]))
bad("stable_key", TypeError, "scores", "scores int", scores=i64([1, 2]))
bad("check_candidate_ids", ValueError, "gathered", "fractional", ids=f32([0.5]))
bad("check_candidate_ids", ValueError, "gathered", "meta", ids=f32([1.0]).to(META))

for b in ("merge_topk_global",):
    bad(b, TypeError, "group", "group str", group="world")
    bad(b, TypeError, "group", "group int", group=2)
    scalar_int_cases(b, "k", min_value=1)
    bad(b, TypeError, "logits", "logits list", logits=LOGITS.tolist())
    bad(b, TypeError, "local_topk", "local_topk list", local_topk=LOCAL_IDS.tolist())
    # Class 4: W = 1 with k == K used to return local_topk unchecked.
    bad(b, ValueError, "local_topk", "W=1 shortcut: id >= cols", local_topk=LOCAL_IDS.clone().fill_(9))
    bad(b, ValueError, "local_topk", "W=1 shortcut: id < -1", local_topk=LOCAL_IDS.clone().fill_(-5))
    bad(b, TypeError, "local_topk", "W=1 shortcut: float ids", local_topk=LOCAL_IDS.float())
    bad(b, ValueError, "interleave", "interleave 0", interleave=0)
bad("global_topk_all_logits", TypeError, "scores", "int", scores=LOCAL_IDS)
bad("global_topk_all_logits", ValueError, "k", "k 0", k=0)
bad("local_topk_by_owner", ValueError, "K", "K 0", K=0)
bad("local_topk_by_owner", ValueError, "world_size", "W 0", world_size=0)
bad("local_topk_by_owner", ValueError, "scores", "1-D", scores=LOGITS[0])
bad("radix_select_trace", ValueError, "k", "k 0", k=0)
bad("radix_select_trace", TypeError, "k", "k float", k=2.0)

# ---- deinterleave -----------------------------------------------------------------------------
for b in ("global_ids_to_local_slots", "deinterleave_and_compact", "deinterleave_masked"):
    geometry_arg_cases(b)
    # Valid geometries the data does not fit: blocks of one token (every id this rank owns needs more blocks
    # than the table has), and every id owned by W = 1 (its local index past the table).
    bad(b, ValueError, "block_table", "geometry block_size=1: the table too short for it", geometry=DcpGeometry(2, 1))
    bad(b, ValueError, "block_table", "geometry W=1: ids past the table", geometry=DcpGeometry(1, 0, 2, 4))
    int_tensor_cases(b, "token_ids", ndim=2, lists_ok=False, meta_with=("block_table", "req_of_token"))
    int_tensor_cases(b, "block_table", ndim=2, lists_ok=False)
    int_tensor_cases(b, "req_of_token", ndim=1, lists_ok=False)
    bad(b, ValueError, "req_of_token", "req out of range", req_of_token=i32([0, 2, 1]))
    bad(b, ValueError, "req_of_token", "req negative", req_of_token=i32([0, -1, 1]))
    bad(b, ValueError, "req_of_token", "req wrong length", req_of_token=i32([0, 1]))
    bad(b, ValueError, "req_of_token", "req None needs T <= B", req_of_token=None)
    bad(b, ValueError, "block_table", "block_table other device", block_table=BLOCK_TABLE.to(META), validate=False)
    bad(b, ValueError, "block_table", "slot overflows int32 (class 6)", block_table=i64([[2**29, 0, 5], [1, 4, -1]]))
    flag_cases(b, "validate")
flag_cases("deinterleave_and_compact", "ordered")
bad("compact_to_front", TypeError, "slots", "float", slots=SLOTS.float())
bad("compact_to_front", ValueError, "slots", "1-D", slots=SLOTS[0])
bad("compact_to_front", TypeError, "slots", "list", slots=SLOTS.tolist())
bad("compact_to_front", ValueError, "slots", "int64 beyond int32", slots=i64([[2**31, -1]]))
flag_cases("compact_to_front", "ordered")
flag_cases("compact_to_front", "validate")
bad("canonicalize", ValueError, "counts", "counts > K", counts=i32([4, 1]))
bad("canonicalize", ValueError, "counts", "counts negative", counts=i32([-1, 1]))
bad("canonicalize", ValueError, "counts", "counts rows", counts=i32([1]))
bad("canonicalize", TypeError, "counts", "counts float", counts=f32([1, 1]))
bad("canonicalize", TypeError, "slots", "slots float", slots=SLOTS.float())

# ---- attention ---------------------------------------------------------------------------------
A = "sparse_mla_attention"
float_tensor_cases(A, "q", ndim=3)
bad(A, TypeError, "kv_cache", "kv int", kv_cache=KV.long())
bad(A, ValueError, "kv_cache", "kv 1-D", kv_cache=KV[0])
bad(A, ValueError, "kv_cache", "kv [N, 2, D]", kv_cache=KV.view(5, 2, 8))
bad(A, ValueError, "kv_cache", "kv width", kv_cache=KV[:, :7])
bad(A, TypeError, "kv_cache", "kv list", kv_cache=KV.tolist())
int_tensor_cases(A, "slots", ndim=2, lists_ok=False)
int_tensor_cases(A, "counts", ndim=1, lists_ok=False)
bad(A, ValueError, "slots", "slots rows", slots=SLOTS[:1])
bad(A, ValueError, "counts", "counts rows", counts=COUNTS[:1])
bad(A, ValueError, "counts", "counts > K", counts=i32([4, 1]))
bad(A, ValueError, "counts", "counts negative", counts=i32([-1, 1]))
bad(A, ValueError, "slots", "slot >= num_slots", slots=i32([[1, 4, 10], [7, -1, -1]]))
bad(A, ValueError, "slots", "slot -1 inside the prefix", slots=i32([[1, -1, 9], [7, -1, -1]]))
bad(A, ValueError, "device", "mixed devices", counts=COUNTS.to(META))
for label, v, exc in [
    ("0", 0.0, ValueError),
    ("neg", -0.5, ValueError),
    ("nan", NAN, ValueError),
    ("inf", INF, ValueError),
    ("str", "0.5", TypeError),
    ("bool", True, TypeError),
    ("tensor", torch.tensor(0.5), TypeError),
    ("none", None, TypeError),
    ("list", [0.5], TypeError),
]:
    bad(A, exc, "sm_scale", f"sm_scale={label}", sm_scale=v)
bad(A, ValueError, "lse_base", "lse_base 10", lse_base="10")
bad(A, ValueError, "lse_base", "lse_base int", lse_base=2)
scalar_int_cases(A, "v_dim", min_value=1)
bad(A, ValueError, "v_dim", "v_dim > Dqk", v_dim=9)
flag_cases(A, "validate")

# ---- LSE ---------------------------------------------------------------------------------------
for b in ("lse_base2_to_e", "lse_e_to_base2"):
    bad(b, TypeError, "lse", "int", lse=i64([1, 2]))
    bad(b, TypeError, "lse", "list", lse=[1.0])
    bad(b, TypeError, "lse", "float", lse=1.0)
bad("normalize_lse_shape", ValueError, "lse", "transposed", lse=LSES[0].t())
bad("normalize_lse_shape", ValueError, "lse", "wrong size", lse=torch.zeros(7))
bad("normalize_lse_shape", TypeError, "lse", "int", lse=i64([[1, 2]] * 3))
bad("normalize_lse_shape", ValueError, "num_heads", "H 0", num_heads=0)
bad("normalize_lse_shape", ValueError, "num_tokens", "T negative", num_tokens=-1)
bad("normalize_lse_shape", TypeError, "num_tokens", "T float", num_tokens=3.0)
M = "merge_partials"
float_tensor_cases(M, "outs", ndim=4)
float_tensor_cases(M, "lses", ndim=3)
bad(M, ValueError, "lses", "lses shape", lses=LSES[:, :2])
bad(M, ValueError, "outs", "W 0", outs=OUTS[:0], lses=LSES[:0])
bad(M, ValueError, "base", "base 10", base="10")
bad(M, ValueError, "device", "mixed devices", lses=LSES.to(META))
flag_cases(M, "validate")
C = "correct_partial"
float_tensor_cases(C, "out", ndim=3)
float_tensor_cases(C, "all_lses", ndim=3)
bad(C, ValueError, "all_lses", "all_lses shape", all_lses=LSES[:, :2])
bad(C, ValueError, "rank", "rank W", rank=2)
bad(C, ValueError, "rank", "rank neg", rank=-1)
bad(C, TypeError, "rank", "rank float", rank=1.0)
bad(C, TypeError, "rank", "rank None", rank=None)
bad(C, ValueError, "base", "base e2", base="e2")
bad(C, ValueError, "all_lses", "W 0", all_lses=LSES[:0])
flag_cases(C, "validate")
D_ = "dcp_merge_collective"
bad(D_, TypeError, "out", "out int", out=OUTS[0].long())
bad(D_, ValueError, "lse", "lse shape", lse=LSES[0, :2])
bad(D_, ValueError, "lse", "lse 3-D", lse=LSES)
bad(D_, ValueError, "base", "base", base="ten")

# ---- prefill -----------------------------------------------------------------------------------
P = "chunk_scores_from_local"
bad(P, ValueError, "query_lens", "sum != rows", query_lens=i64([2, 2]))
bad(P, ValueError, "query_lens", "one per request", query_lens=i64([3]))
bad(P, ValueError, "query_lens", "negative", query_lens=i64([4, -1]))
bad(P, TypeError, "query_lens", "list", query_lens=[2, 1])
bad(P, TypeError, "meta", "meta not metadata", meta={"cu_seqlens_k": None})
bad(P, TypeError, "local_scores", "int scores", local_scores=i64([[1]] * 3))
bad(P, ValueError, "local_scores", "too narrow", local_scores=torch.randn(3, 1))

# ================================================================================================
# Contracts that hold everywhere (by class): the entry points below the planned step.
# ================================================================================================
from dcp_ref.cache_write import build_sharded_caches, token_slots, write_cache_rows  # noqa: E402
from dcp_ref.fp8_cache import (  # noqa: E402
    Fp8CacheLayout,
    check_fp8_slots,
    dequantize_kv_fp8,
    quantize_kv_fp8,
    sparse_mla_attention_fp8,
)
from dcp_ref.geometry import local_count  # noqa: E402
from dcp_ref.kernels import deinterleave_triton as dk  # noqa: E402
from dcp_ref.kernels import flashmla_fp8 as fm8  # noqa: E402
from dcp_ref.kernels import lse_merge_triton as lk  # noqa: E402
from dcp_ref.topk import sparse_attention_reference, unsigned_key  # noqa: E402

GEO = DcpGeometry(2, 1, 2, 4)
KV8 = quantize_kv_fp8(torch.randn(40, 576, generator=G))
Q8 = torch.randn(2, 2, 576, generator=G)
DEINT = dict(token_ids=TOKEN_IDS, req_of_token=REQ, block_table=BLOCK_TABLE, geometry=GEO)
LSE_OUT, LSE_ALL = torch.randn(3, 2, 4, generator=G), torch.randn(2, 3, 2, generator=G)
BASES.update(
    {
        "local_count": (local_count, dict(n=i64([5, 9]), world_size=2, rank=1, interleave=2)),
        "token_slots": (
            token_slots,
            dict(geometry=GEO, block_table=BLOCK_TABLE, req_ids=i64([0, 1]), positions=i64([2, 3])),
        ),
        "write_cache_rows": (write_cache_rows, dict(cache=torch.zeros(10, 8), slots=i64([1, -1]), kv=torch.ones(2, 8))),
        "build_sharded_caches": (
            build_sharded_caches,
            dict(
                kv_global=[torch.ones(5, 8)],
                block_tables=[i32([[0, 1]]), i32([[2, 3]])],
                geometry=GEO,
                num_slots=16,
                fp8=False,
            ),
        ),
        "quantize_kv_fp8": (quantize_kv_fp8, dict(kv=torch.ones(3, 576))),
        "dequantize_kv_fp8": (dequantize_kv_fp8, dict(rows=KV8[:3])),
        "check_fp8_slots": (check_fp8_slots, dict(slots=i32([[1, -1], [2, 3]]), counts=None, num_slots=40)),
        "check_fp8_slots_compact": (
            check_fp8_slots,
            dict(slots=i32([[1, -1], [2, 3]]), counts=i32([1, 2]), num_slots=40, attention_layout="compact"),
        ),
        "sparse_mla_attention_fp8": (
            sparse_mla_attention_fp8,
            dict(q=Q8, kv_cache=KV8, slots=i32([[1, -1], [2, 3]]), counts=None, sm_scale=0.1),
        ),
        "unsigned_key": (unsigned_key, dict(key=i64([1, 2]))),
        "sparse_attention_reference": (
            sparse_attention_reference,
            dict(q=torch.randn(1, 2), keys=torch.randn(4, 2), values=torch.randn(4, 3), ids=i64([[0, 2]])),
        ),
        "dk.compact": (dk.deinterleave_compact, dict(DEINT)),
        "dk.masked": (dk.deinterleave_masked_triton, dict(DEINT)),
        "dk.conversion": (dk.global_ids_to_local_slots_triton, dict(DEINT)),
        "dk.workspace_numel": (dk.workspace_numel, dict(method="twopass", rows=3, k=100)),
        "lk.lse_correct": (lk.lse_correct, dict(out=LSE_OUT, all_lses=LSE_ALL, rank=1)),
        "lk.lse_merge": (lk.lse_merge, dict(outs=OUTS.float(), lses=LSES.float())),
        "fm8.prepare_indices": (fm8.prepare_indices, dict(slots=i32([[1, -1], [2, 3]]), counts=None, num_slots=40)),
    }
)

# ---- class 3: every public entry point validates its arguments (geometry helpers) --------------
int_tensor_cases("local_count", "n", ndim=None, lists_ok=False, values_read=False)
geometry_cases("local_count", rank_required=True)
bad("local_count", TypeError, "n", "n list", n=[5, 9])

# ---- class 3: cache builders --------------------------------------------------------------------
bad("token_slots", TypeError, "geometry", "geometry tuple", geometry=(2, 1, 2, 4))
int_tensor_cases("token_slots", "req_ids", ndim=1, lists_ok=False)
int_tensor_cases("token_slots", "positions", ndim=1, lists_ok=False)
int_tensor_cases("token_slots", "block_table", ndim=2, lists_ok=False)
bad("token_slots", ValueError, "req_ids", "req_ids out of range", req_ids=i64([0, 2]))
bad("token_slots", ValueError, "positions", "positions negative", positions=i64([2, -3]))
bad("token_slots", ValueError, "block_table", "owned position without a block", positions=i64([2, 50]))
float_tensor_cases("write_cache_rows", "kv", ndim=2)
int_tensor_cases("write_cache_rows", "slots", ndim=1, lists_ok=False)
bad("write_cache_rows", ValueError, "slots", "slot past the cache", slots=i64([10, -1]))
bad("write_cache_rows", ValueError, "slots", "slot below -1", slots=i64([-2, 1]))
bad("write_cache_rows", ValueError, "slots", "repeated row", slots=i64([3, 3]))
_CACHE = torch.zeros(10, 8)
bad(
    "write_cache_rows",
    ValueError,
    "cache",
    "kv aliases the cache (class 3: out= aliasing)",
    cache=_CACHE,
    kv=_CACHE[2:4],
)
bad("build_sharded_caches", TypeError, "kv_global", "kv_global a tensor", kv_global=torch.ones(1, 5, 8))
bad("build_sharded_caches", TypeError, "kv_global", "kv_global of lists", kv_global=[[1.0] * 8])
bad("build_sharded_caches", ValueError, "kv_global", "kv_global empty", kv_global=[])
bad("build_sharded_caches", TypeError, "block_tables", "block_tables a tensor", block_tables=i32([[0, 1]]))
bad("build_sharded_caches", TypeError, "block_tables", "float table", block_tables=[torch.zeros(1, 2), i32([[2, 3]])])
bad("build_sharded_caches", ValueError, "block_tables", "one table", block_tables=[i32([[0, 1]])])
bad(
    "build_sharded_caches",
    ValueError,
    "block_tables",
    "table rows != requests",
    block_tables=[i32([[0, 1]] * 2), i32([[2, 3]])],
)
bad("build_sharded_caches", TypeError, "num_slots", "num_slots float", num_slots=16.0)
bad("build_sharded_caches", TypeError, "num_slots", "num_slots None", num_slots=None)
bad("build_sharded_caches", ValueError, "num_slots", "num_slots one per rank", num_slots=[16])
flag_cases("build_sharded_caches", "fp8")
bad("build_sharded_caches", TypeError, "dtype", "dtype string", dtype="float32")
bad("build_sharded_caches", TypeError, "layout", "layout dict", layout={"nope_dim": 512})
bad("build_sharded_caches", TypeError, "geometry", "geometry int", geometry=2)
bad("quantize_kv_fp8", TypeError, "layout", "layout str", layout="fp8_ds_mla")
bad("dequantize_kv_fp8", TypeError, "layout", "layout None", layout=None)
bad("dequantize_kv_fp8", TypeError, "dtype", "dtype str", dtype="bfloat16")
for label, kw, exc in [
    ("fp8_max str", dict(fp8_max="448"), TypeError),
    ("scale_inv_floor bool", dict(scale_inv_floor=True), TypeError),
    ("scale_inv_floor 0", dict(scale_inv_floor=0.0), ValueError),
    ("tile_size 0", dict(tile_size=0), ValueError),
]:
    CASES.append(pytest.param(Fp8CacheLayout, kw, exc, (next(iter(kw)),), id=f"Fp8CacheLayout[{label}]"))
bad("check_fp8_slots", ValueError, "attention_layout", "layout typo", attention_layout="compacted")
bad("check_fp8_slots", TypeError, "num_slots", "num_slots float", num_slots=40.0)
bad("check_fp8_slots", ValueError, "slots", "masked slot past the cache", slots=i32([[1, 40], [2, 3]]))
bad("check_fp8_slots", ValueError, "slots", "masked slot -2", slots=i32([[1, -2], [2, 3]]))
bad("check_fp8_slots", ValueError, "slots", "masked poison slot", slots=i32([[1, POISON], [2, 3]]))
bad("check_fp8_slots", ValueError, "slots", "meta slots", slots=i32([[1, 2]]).to(META))
bad("check_fp8_slots_compact", ValueError, "counts", "counts > K", counts=i32([3, 2]))
bad("check_fp8_slots_compact", ValueError, "slots", "used slot -1", counts=i32([2, 2]))
bad("check_fp8_slots_compact", ValueError, "counts", "counts None", counts=None)
bad("sparse_mla_attention_fp8", ValueError, "attention_layout", "layout typo", attention_layout="dense")
bad("sparse_mla_attention_fp8", ValueError, "out", "out on another device", out=torch.empty(2, 2, 512, device=META))
bad("sparse_mla_attention_fp8", ValueError, "out", "out aliases q (class 3)", out=Q8[:, :, :512])
_OL = torch.empty(2, 2, 512)
bad("sparse_mla_attention_fp8", ValueError, "out_lse", "out_lse aliases out (class 3)", out=_OL, out_lse=_OL[:, :, 0])

# ---- class 3: top-K helpers ---------------------------------------------------------------------
_DUP = GATHERED.clone()
_DUP[1, 0, 0] = GATHERED[0, 0, 0]  # rank 1 repeats rank 0's first candidate of row 0
bad("stable_topk", ValueError, "gathered", "an id on two ranks (validated)", gathered=_DUP)
bad("check_candidate_ids", ValueError, "gathered", "an id twice", ids=_DUP[..., 1])
bad(
    "merge_topk_global",
    ValueError,
    "local_topk",
    "a local index twice (W = 1)",
    local_topk=i64([[0, 5, 5, -1], [1, 2, -1, -1], [-1] * 4]),
)
bad(
    "global_topk_all_logits",
    ValueError,
    "scores",
    "columns past 2**24 (not packable)",
    scores=torch.empty(1, 2**24 + 1, device=META),
)
bad("local_topk_by_owner", ValueError, "scores", "columns past 2**24", scores=torch.empty(1, 2**24 + 1, device=META))
bad("stable_key", TypeError, "ids", "bool ids", ids=torch.tensor([True, False]))
bad("stable_key", ValueError, "ids", "ids on another device", ids=i64([3, 1]).to(META))
bad("radix_select_trace", TypeError, "keys", "keys a tensor", keys=i64([5, 0]))
bad("radix_select_trace", TypeError, "keys", "float keys", keys=[5.0, 1.0])
bad("radix_select_trace", ValueError, "keys", "negative key", keys=[5, -1])
bad("radix_select_trace", ValueError, "keys", "key past 64 bits", keys=[2**64])
bad("radix_select_trace", ValueError, "bits", "bits not dividing 64", bits=7)
bad("unsigned_key", TypeError, "key", "key list", key=[1, 2])
bad("unsigned_key", TypeError, "key", "int32 key", key=i32([1, 2]))
bad("unsigned_key", ValueError, "key", "meta key", key=i64([1]).to(META))
float_tensor_cases("sparse_attention_reference", "q", ndim=2)
float_tensor_cases("sparse_attention_reference", "keys", ndim=2)
float_tensor_cases("sparse_attention_reference", "values", ndim=2)
int_tensor_cases("sparse_attention_reference", "ids", ndim=2, lists_ok=False)
bad("sparse_attention_reference", ValueError, "ids", "id past the keys", ids=i64([[0, 4]]))
bad("sparse_attention_reference", ValueError, "keys", "keys width", keys=torch.randn(4, 3))

# ---- class 3: Triton launch parameters and out= aliasing (kernel wrappers) ------------------------
for b in ("dk.compact", "dk.masked", "dk.conversion"):
    for label, v, exc in [
        ("24", 24, ValueError),
        ("8", 8, ValueError),
        ("2**17", 2**17, ValueError),
        ("float", 64.0, TypeError),
        ("bool", True, TypeError),
        ("str", "64", TypeError),
    ]:
        bad(b, exc, "block", f"block={label}", block=v)
    for label, v, exc in [
        ("3", 3, ValueError),
        ("0", 0, ValueError),
        ("64", 64, ValueError),
        ("float", 4.0, TypeError),
        ("bool", True, TypeError),
    ]:
        bad(b, exc, "num_warps", f"num_warps={label}", num_warps=v)
_IDS = i32([[0, 3, 6, -1], [1, 2, 7, 5], [9, 2, 3, -1]])
for b in ("dk.compact", "dk.masked", "dk.conversion"):
    bad(b, ValueError, "out", "out is token_ids (class 3)", token_ids=_IDS, req_of_token=REQ, out=_IDS)
_BT = i32([[3, 0, 5, 7], [1, 4, -1, 7], [0, 0, 0, 0]])
bad("dk.compact", ValueError, "out", "out is a view of block_table", block_table=_BT[:2, :3], out=_BT)
_OUT3 = torch.zeros(3, 4, dtype=torch.int32)
bad("dk.masked", ValueError, "counts", "counts a row of out", out=_OUT3, counts=_OUT3[0, :3])
_WS = i64([3, 0, 5, 1, 4, -1])
bad(
    "dk.compact",
    ValueError,
    "workspace",
    "workspace aliases block_table",
    method="twopass",
    block=16,
    workspace=_WS,
    block_table=_WS.view(2, 3),
)
bad("dk.workspace_numel", ValueError, "method", "method typo", method="scan")
bad("dk.workspace_numel", TypeError, "rows", "rows float", rows=3.0)
bad("dk.workspace_numel", ValueError, "k", "k negative", k=-1)
bad("dk.workspace_numel", ValueError, "block", "block 24", block=24)
for b in ("lk.lse_correct", "lk.lse_merge"):
    for label, v, exc in [
        ("3", 3, ValueError),
        ("0", 0, ValueError),
        ("512", 512, ValueError),
        ("float", 4.0, TypeError),
        ("bool", True, TypeError),
        ("str", "4", TypeError),
    ]:
        bad(b, exc, "block_h", f"block_h={label}", block_h=v)
    for label, v, exc in [("3", 3, ValueError), ("64", 64, ValueError), ("float", 4.0, TypeError)]:
        bad(b, exc, "num_warps", f"num_warps={label}", num_warps=v)
    flag_cases(b, "validate")
_SHIFT = torch.randn(4, 2, 4, generator=G)
bad(
    "lk.lse_correct", ValueError, "corrected", "corrected overlaps out (shifted)", out=_SHIFT[:3], corrected=_SHIFT[1:4]
)
_AL = LSE_ALL.clone()
bad("lk.lse_correct", ValueError, "merged_lse", "merged_lse aliases all_lses", all_lses=_AL, merged_lse=_AL[0])
_LO = LSE_OUT.clone()
bad(
    "lk.lse_correct",
    ValueError,
    "merged_lse",
    "merged_lse inside corrected",
    out=_LO.clone(),
    corrected=_LO,
    merged_lse=_LO[:, :, 0],
)
bad(
    "lk.lse_correct",
    TypeError,
    "merged_lse",
    "float64 merged_lse for float32 LSEs",
    merged_lse=torch.empty(3, 2, dtype=torch.float64),
)
_OS = OUTS.float()
bad("lk.lse_merge", ValueError, "merged", "merged is a partial", outs=_OS, merged=_OS[0])
_LS = LSES.float()
bad("lk.lse_merge", ValueError, "merged_lse", "merged_lse is an LSE row", lses=_LS, merged_lse=_LS[1])
_SL = i32([[1, -1], [2, 3]])
bad("fm8.prepare_indices", ValueError, "num_slots", "num_slots negative", num_slots=-1)
bad("fm8.prepare_indices", TypeError, "num_slots", "num_slots float", num_slots=40.0)
bad("fm8.prepare_indices", ValueError, "row_state", "row_state aliases slots", slots=_SL, row_state=_SL[0])


@pytest.mark.parametrize("fn, kwargs, exc, names", CASES)
def test_bad_input_raises_naming_the_argument(fn, kwargs, exc, names) -> None:
    with pytest.raises(exc) as info:
        fn(**kwargs)
    msg = str(info.value)
    assert any(n in msg for n in names), f"{type(info.value).__name__}: {msg!r} names none of {names}"


def test_the_table_is_big_enough() -> None:
    assert len(CASES) >= 300, len(CASES)


@pytest.mark.parametrize("name", sorted(BASES))
def test_every_base_call_is_valid(name: str) -> None:
    fn, kwargs = BASES[name]
    fn(**kwargs)  # each table row differs from a call that works in one argument only


# ----------------------------------------------------------------------------------------------
# Reference and kernel: the same bad input, the same exception and the same message.
# ----------------------------------------------------------------------------------------------
def _kernel_twin(fn):
    if fn is pack_candidates:
        from dcp_ref.kernels.pack_triton import pack_candidates_triton

        return pack_candidates_triton
    if fn is deinterleave_and_compact:
        from dcp_ref.kernels.deinterleave_triton import deinterleave_compact

        return deinterleave_compact
    if fn is global_ids_to_local_slots:
        from dcp_ref.kernels.deinterleave_triton import global_ids_to_local_slots_triton

        return global_ids_to_local_slots_triton
    if fn is deinterleave_masked:
        from dcp_ref.kernels.deinterleave_triton import deinterleave_masked_triton

        return deinterleave_masked_triton
    return None


TWINNED = (pack_candidates, deinterleave_and_compact, global_ids_to_local_slots, deinterleave_masked)
TWIN_CASES = [c for c in CASES if c.values[0] in TWINNED]


@pytest.mark.parametrize("fn, kwargs, exc, names", TWIN_CASES)
def test_kernel_rejects_like_the_reference(fn, kwargs, exc, names) -> None:
    pytest.importorskip("triton")
    twin = _kernel_twin(fn)
    with pytest.raises(exc) as ref:
        fn(**kwargs)
    with pytest.raises(exc) as ker:
        twin(**kwargs)
    assert str(ker.value) == str(ref.value)


def test_twin_table_is_not_empty() -> None:
    assert len(TWIN_CASES) >= 150


# ----------------------------------------------------------------------------------------------
# validate=False: no host read (meta tensors have no values to read), never out of bounds.
# ----------------------------------------------------------------------------------------------
def _meta(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=META)


NO_HOST_READ = {
    "localize_decode_bounds(int)": lambda: localize_decode_bounds(_meta(3, dtype=torch.int64), 2, 4, 1, validate=False),
    "localize_decode_bounds(tensor)": lambda: localize_decode_bounds(
        _meta(3, dtype=torch.int64), _meta(3, dtype=torch.int64), 4, 1, num_tokens=7, validate=False
    ),
    "local_topk": lambda: local_topk(
        _meta(5, 9), 4, _meta(5, dtype=torch.int64), _meta(5, dtype=torch.int32), validate=False
    ),
    "pack_candidates": lambda: pack_candidates(
        _meta(5, 9),
        _meta(5, 4, dtype=torch.int64),
        DcpGeometry(4, 1, 2, 2),
        _meta(5, dtype=torch.int32),
        validate=False,
    ),
    "stable_topk": lambda: stable_topk(_meta(4, 5, 4, 2), 4, validate=False),
    "merge_topk_global": lambda: merge_topk_global(
        None, _meta(5, 9), _meta(5, 4, dtype=torch.int64), 4, validate=False
    ),
    "global_ids_to_local_slots": lambda: global_ids_to_local_slots(
        _meta(5, 4, dtype=torch.int64),
        _meta(5, dtype=torch.int32),
        _meta(3, 4, dtype=torch.int32),
        DcpGeometry(4, 1, 2, 8),
        validate=False,
    ),
    "deinterleave_and_compact": lambda: deinterleave_and_compact(
        _meta(5, 4, dtype=torch.int64),
        _meta(5, dtype=torch.int32),
        _meta(3, 4, dtype=torch.int32),
        DcpGeometry(4, 1, 2, 8),
        validate=False,
    ),
    "deinterleave_masked": lambda: deinterleave_masked(
        _meta(5, 4, dtype=torch.int64),
        _meta(5, dtype=torch.int32),
        _meta(3, 4, dtype=torch.int32),
        DcpGeometry(4, 1, 2, 8),
        validate=False,
    ),
    "compact_to_front": lambda: compact_to_front(_meta(5, 4, dtype=torch.int64), ordered=False, validate=False),
    "sparse_mla_attention": lambda: sparse_mla_attention(
        _meta(5, 2, 16),
        _meta(30, 16),
        _meta(5, 4, dtype=torch.int64),
        _meta(5, dtype=torch.int32),
        0.3,
        v_dim=8,
        validate=False,
    ),
    "merge_partials": lambda: merge_partials(_meta(3, 5, 2, 8), _meta(3, 5, 2), validate=False),
    "correct_partial": lambda: correct_partial(_meta(5, 2, 8), _meta(3, 5, 2), 1, validate=False),
}


@pytest.mark.parametrize("name", sorted(NO_HOST_READ))
def test_validate_false_reads_nothing_on_the_host(name: str) -> None:
    """Meta tensors carry shapes but no values: any .item() / bool(tensor) / data-dependent shape fails."""
    res = NO_HOST_READ[name]()
    for t in res if isinstance(res, tuple) else (res,):
        assert t.device.type == "meta"


def test_pack_validate_false_clamps_like_the_kernel(kernel_device) -> None:
    """Out-of-range row starts and indices: packed invalid / clamped, the same on both, never read outside."""
    pytest.importorskip("triton")
    from dcp_ref.kernels.pack_triton import pack_candidates_triton

    logits = torch.arange(24, dtype=torch.float32).view(3, 8)
    ids = i64([[0, 7, -5, 3], [0, 1, 2, 3], [2**40, 0, -1, 8]])
    starts = i32([-3, 6, 100])  # clamped to [0, 8]: 0, 6, 8
    want = []
    for r, s in enumerate([0, 6, 8]):
        row = []
        for j in ids[r].tolist():
            ok = 0 <= j < 8 - s
            row.append([float(logits[r, s + j]) if ok else -INF, float((j // 1) * 2 + 1) if ok else -1.0])
        want.append(row)
    ref = pack_candidates(logits, ids, DcpGeometry(2, 1), starts, validate=False)
    ker = pack_candidates_triton(
        logits.to(kernel_device), ids.to(kernel_device), DcpGeometry(2, 1), starts.to(kernel_device), validate=False
    )
    assert ref.tolist() == want and ker.cpu().tolist() == want


@pytest.mark.parametrize("method", ["rowscan", "twopass", "atomic"])
def test_deinterleave_validate_false_same_answer_as_the_kernel(kernel_device, method) -> None:
    """Bad request ids, ids past the table, -1 blocks and block ids whose slot overflows int32: the
    poison slot 2**31 - 1 (never a plausible small slot, never "not here"), reference == kernel, both dtypes."""
    pytest.importorskip("triton")
    from dcp_ref.kernels.deinterleave_triton import deinterleave_compact

    ids = i64([[0, 1, 4, 3, 40, -1], [0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0], [6, 7, 8, 9, 10, 11]])
    req = i32([0, 7, -1, 1])
    bt = i64([[3, 2**30, -1], [1, 0, 2]])
    ordered = method != "atomic"
    for dtype in (torch.int32, torch.int64):
        ids_d, bt_d = ids.to(dtype), (bt.to(dtype) if dtype == torch.int64 else bt.clamp(max=2**31 - 1).to(dtype))
        want_s, want_c = deinterleave_and_compact(
            ids_d, req, bt_d, DcpGeometry(1, 0, block_size=4), ordered=ordered, validate=False
        )
        with pytest.raises(ValueError, match="req_of_token"):
            deinterleave_and_compact(ids_d, req, bt_d, DcpGeometry(1, 0, block_size=4), ordered=ordered)
        got_s, got_c = deinterleave_compact(
            ids_d.to(kernel_device),
            req.to(kernel_device),
            bt_d.to(kernel_device),
            DcpGeometry(1, 0, block_size=4),
            ordered=ordered,
            method=method,
            validate=False,
        )
        # Row 0: id 4 is on block 2**30, whose slot 2**32 overflows int32: poisoned, not wrapped to 0; id 40
        # is past the table: poisoned (a selected key without a block). Rows 1, 2: bad request ids: every
        # entry poisoned. Row 3: blocks 0 and 2 of request 1.
        assert got_c.cpu().tolist() == want_c.tolist() == [5, 6, 6, 6]
        assert canonicalize(got_s.cpu(), got_c.cpu()).tolist() == canonicalize(want_s, want_c).tolist()
        assert sorted(want_s[0, :5].tolist()) == [12, 13, 15, POISON, POISON]
        assert want_s[1].tolist() == want_s[2].tolist() == [POISON] * 6
        assert sorted(want_s[3, :6].tolist()) == [2, 3, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="exceed int32"):  # validated: the overflow is an error
        global_ids_to_local_slots(i64([[4]]), None, i64([[0, 2**30]]), DcpGeometry(1, 0, block_size=4))


def test_attention_validate_false_poisons_bad_rows() -> None:
    q, kv = Q, KV
    slots = i32([[1, 4, 12], [7, -1, -1]])  # row 0 reads slot 12 of a 10-slot cache
    counts = i32([3, 5])  # row 1: count 5 > K=3, clamped to 3: slot -1 inside -> poisoned too
    out, lse = sparse_mla_attention(q, kv, slots, counts, 0.5, v_dim=6, validate=False)
    assert torch.isnan(out).all() and torch.isnan(lse).all()
    out, lse = sparse_mla_attention(q, kv, i32([[1, 4, 12], [7, 2, -1]]), i32([2, 2]), 0.5, v_dim=6, validate=False)
    want, want_l = sparse_mla_attention(q, kv, i32([[1, 4, -1], [7, 2, -1]]), i32([2, 2]), 0.5, v_dim=6)
    assert torch.equal(out, want) and torch.equal(lse, want_l)  # padding beyond counts is never read


def test_local_topk_validate_false_clamps() -> None:
    logits = torch.arange(16, dtype=torch.float32).view(2, 8)
    got = local_topk(logits, 3, i64([-4, 50]), i32([-2, 5]), validate=False)
    # row 0: start 0, length 0 -> empty; row 1: start 5, length clamped to 3 -> local 2, 1, 0
    assert got.tolist() == [[-1, -1, -1], [2, 1, 0]]


def test_localize_validate_false_clamps_and_matches_when_valid() -> None:
    lens, q = i64([10, 3, 0]), i64([3, 1, 0])
    for r in range(2):
        a = localize_decode_bounds(lens, q, 2, r, num_tokens=4)
        b = localize_decode_bounds(lens, q, 2, r, num_tokens=4, validate=False)
        assert torch.equal(a, b)
    got = localize_decode_bounds(i64([-5, 2]), 2, 1, 0, validate=False)
    assert got.tolist() == [[0, 0], [1, 2]]


# ----------------------------------------------------------------------------------------------
# Valid edge cases, against brute force written here.
# ----------------------------------------------------------------------------------------------
def brute_owner_local(p: int, W: int, I: int) -> tuple[int, int]:
    owner = (p // I) % W
    rank_positions = [x for x in range(p + 1) if (x // I) % W == owner]
    return owner, rank_positions.index(p)


def test_ownership_int32_never_wraps() -> None:
    """Class 6: an int32 tensor with W*I beyond int32 used to divide by a wrapped divisor."""
    W, I = 3, 2**30
    pos = i32([5, 2**31 - 1])
    assert owner_rank(pos, W, I).tolist() == [(5 // I) % W, ((2**31 - 1) // I) % W]
    assert global_to_local(pos, W, I).tolist() == [
        (5 // (W * I)) * I + 5 % I,
        ((2**31 - 1) // (W * I)) * I + (2**31 - 1) % I,
    ]
    assert owner_rank(pos, W, I).dtype == torch.int32
    big = local_to_global(i64([2**31 + 3]), 4, 1, 2)  # int64 in: fine beyond int32
    assert big.tolist() == [((2**31 + 3) // 2) * 8 + 2 + (2**31 + 3) % 2]


@pytest.mark.parametrize("W, I", [(1, 1), (2, 1), (3, 2), (4, 3)])
def test_ownership_small_brute_force_and_numpy_ints(W: int, I: int) -> None:
    for p in range(40):
        o, l = brute_owner_local(p, W, I)
        assert owner_rank(np.int64(p), np.int32(W), np.int16(I)) == o
        assert global_to_local(p, W, I) == l
        assert local_to_global(np.int64(l), W, np.int64(o), I) == p
    L = np.array([0, 1, 7, 39])
    got = local_seq_lens(L, W, None, I)
    for b, n in enumerate(L.tolist()):
        assert got[b].tolist() == [sum(1 for p in range(n) if (p // I) % W == r) for r in range(W)]


def test_empty_batch_is_valid_everywhere() -> None:
    """Class 7: B = 0 / T = 0 give empty results, never a crash."""
    e = i64([])
    assert localize_decode_bounds(e, 2, 2, 1).shape == (0, 2)
    assert localize_decode_bounds(e, e, 2, 1, num_tokens=0).shape == (0,)
    assert localize_decode_bounds(e, e, 2, 1, num_tokens=0, validate=False).shape == (0,)
    meta = localize_prefill_chunk(e, e, 2, 1)
    assert meta.local_total == 0 and meta.cu_seqlens_q.tolist() == [0]
    assert local_topk(torch.zeros(0, 5), 3, i64([])).shape == (0, 3)
    assert pack_candidates(torch.zeros(0, 5), i64([]).view(0, 3), DcpGeometry(2, 0)).shape == (0, 3, 2)
    assert stable_topk(torch.zeros(2, 0, 3, 2), 4).shape == (0, 4)
    s, c = deinterleave_and_compact(i64([]).view(0, 4), i32([]), i32([[1]]), DcpGeometry(2, 0, block_size=4))
    assert s.shape == (0, 4) and c.shape == (0,)
    o, l = sparse_mla_attention(Q[:0], KV, SLOTS[:0], COUNTS[:0], 0.5, v_dim=6)
    assert o.shape == (0, 2, 6) and l.shape == (0, 2)
    o, l = merge_partials(OUTS[:, :0], LSES[:, :0])
    assert o.shape == (0, 2, 4)
    with pytest.raises(ValueError, match="num_tokens"):
        localize_decode_bounds(e, e, 2, 1, num_tokens=3, validate=False)


def brute_local_topk(row: list[float], start: int, length: int, k: int) -> list[int]:
    cand = [j for j in range(length) if not math.isnan(row[start + j])]
    cand.sort(key=lambda j: (-(row[start + j] + 0.0), j))
    return (cand[:k] + [-1] * k)[:k]


@pytest.mark.parametrize("seed", range(6))
def test_local_topk_edge_cases_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    rows, cols = rng.randint(1, 5), rng.randint(0, 9)
    vals = [[rng.choice([0.0, -0.0, 1.0, -1.0, NAN, INF, -INF, 0.5]) for _ in range(cols)] for _ in range(rows)]
    logits = torch.tensor(vals, dtype=torch.float32).view(rows, cols)
    starts = [rng.randint(0, cols) for _ in range(rows)]
    lens = [rng.randint(0, cols - s) for s in starts]
    k = rng.randint(1, cols + 3)  # k > cols is valid: -1 padding
    got = local_topk(logits, np.int64(k), i64(lens), i32(starts))
    assert got.tolist() == [brute_local_topk(vals[r], starts[r], lens[r], k) for r in range(rows)]


def test_merge_topk_global_w1_no_shortcut_brute_force() -> None:
    """Class 4: W = 1, k == K. A row with -1 first, a NaN-scored id and a tie: the real selection."""
    logits = f32([[0.5, NAN, 0.5, 0.9, -1.0]])
    ids = i64([[-1, 1, 2, 0, 3]])  # -1 first; id 1 has a NaN score
    got = merge_topk_global(None, logits, ids, 5)
    assert got.tolist() == [[3, 0, 2, -1, -1]]  # 0.9, then the 0.5 tie by lower id; NaN and -1 invalid
    assert global_topk_all_logits(f32([[0.5, NAN, 0.5, 0.9, -1.0]]), 3).tolist() == [[3, 0, 2]]


def brute_slots(ids, req, bt, bs, W, r, I):
    """-1 not here; the slot; POISON for a bad request id (whole row) or an owned id without a block."""
    out = []
    for t, row in enumerate(ids):
        b = req[t]
        if not 0 <= b < len(bt):
            out.append([POISON] * len(row))
            continue
        res = []
        for g in row:
            if g < 0 or (g // I) % W != r:
                res.append(-1)
                continue
            loc = (g // (W * I)) * I + g % I
            j = loc // bs
            blk = bt[b][j] if j < len(bt[b]) else -1
            res.append(min(blk * bs + loc % bs, POISON) if blk >= 0 else POISON)
        out.append(res)
    return out


@pytest.mark.parametrize(
    "id_dtype, bt_dtype", [(torch.int32, torch.int64), (torch.int64, torch.int32), (torch.int64, torch.int64)]
)
def test_deinterleave_int64_inputs_reference_and_kernel(kernel_device, id_dtype, bt_dtype) -> None:
    """Class 3: int64 ids / block tables are valid on both (they used to raise on the kernel)."""
    pytest.importorskip("triton")
    from dcp_ref.kernels.deinterleave_triton import deinterleave_compact

    rng = random.Random(1)
    W, r, I, bs = 2, 1, 2, 4
    ids = [[rng.randint(-1, 30) for _ in range(7)] for _ in range(3)]
    bt = [[5, 2, 7, -1], [0, 3, 1, 4]]
    req = [1, 0, 1]
    want = brute_slots(ids, req, bt, bs, W, r, I)
    assert any(POISON in row for row in want)  # the -1 block is hit: out of contract, poisoned
    ref = global_ids_to_local_slots(
        torch.tensor(ids, dtype=id_dtype),
        i64(req),
        torch.tensor(bt, dtype=bt_dtype),
        DcpGeometry(W, r, I, bs),
        validate=False,
    )
    assert ref.tolist() == want
    s, c = deinterleave_compact(
        torch.tensor(ids, dtype=id_dtype).to(kernel_device),
        i64(req).to(kernel_device),
        torch.tensor(bt, dtype=bt_dtype).to(kernel_device),
        DcpGeometry(W, r, I, bs),
        validate=False,
    )
    assert c.cpu().tolist() == [sum(v >= 0 for v in row) for row in want]
    assert s.cpu().tolist() == [[v for v in row if v >= 0] + [-1] * sum(v < 0 for v in row) for row in want]


def test_attention_all_empty_and_k0_brute_force() -> None:
    o, l = sparse_mla_attention(Q, KV, i32([[-1, -1], [-1, -1]]), i32([0, 0]), 0.5, v_dim=6)
    assert (o == 0).all() and torch.isneginf(l).all()
    o, l = sparse_mla_attention(Q, KV, i32([[], []]).view(2, 0), i32([0, 0]), 0.5, v_dim=6)
    assert (o == 0).all() and torch.isneginf(l).all()
    o, l = sparse_mla_attention(Q, KV[:0], i32([[-1], [-1]]), i32([0, 0]), 0.5, v_dim=6)  # no slots, nothing read
    assert (o == 0).all() and torch.isneginf(l).all()
    # one key: softmax weight 1, output = that row's values, lse = its score
    o, l = sparse_mla_attention(Q, KV, i32([[4], [2]]), i32([1, 1]), np.float32(0.5), v_dim=6)
    for t, s in enumerate([4, 2]):
        assert torch.allclose(o[t], KV[s, :6].expand(2, 6))
        assert torch.allclose(l[t], 0.5 * (Q[t] @ KV[s]))


def test_merge_w1_and_numpy_rank() -> None:
    o, l = merge_partials(OUTS[:1], LSES[:1])
    assert torch.equal(o, OUTS[0]) and torch.equal(l, LSES[0])
    c, m = correct_partial(OUTS[0], LSES, np.int64(1))
    c2, m2 = correct_partial(OUTS[0], LSES, 1)
    assert torch.equal(c, c2) and torch.equal(m, m2)
    world = SimulatedWorld(2)
    res = world.run(lambda g, o_, l_: dcp_merge_collective(g, o_, l_), list(OUTS), list(LSES))
    want, want_l = merge_partials(OUTS, LSES)
    assert torch.allclose(torch.cat([r[0] for r in res], 1), want) and torch.allclose(
        torch.cat([r[1] for r in res], 1), want_l
    )


def test_compact_ordered_is_keyword_only_on_both() -> None:
    """Class 3: ``ordered`` positional in one and keyword-only in the other."""
    with pytest.raises(TypeError):
        compact_to_front(SLOTS, False)  # type: ignore[misc]
    with pytest.raises(TypeError):
        deinterleave_and_compact(TOKEN_IDS, REQ, BLOCK_TABLE, DcpGeometry(2, 1, 2, 4), False)  # type: ignore[misc]


# ----------------------------------------------------------------------------------------------
# On the GPU: validate=False makes no host synchronisation (CUDA sync debug mode raises on one),
# reference stages and kernels alike; the GPU-only kernels reject like the reference.
# ----------------------------------------------------------------------------------------------
def _no_sync(fn):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _gpu_stage_calls(dev):
    """Each stage's validate=False call; every tensor is on ``dev`` before the call (a host-to-device
    copy inside the no-sync region would itself count as a sync)."""
    c = lambda t: t.to(dev)  # noqa: E731
    g = torch.Generator().manual_seed(7)
    logits = c(torch.randn(6, 40, generator=g))
    lens, starts = c(i64([40, 3, 0, 17, 60, -2])), c(i32([0, 0, 5, 2, -1, 41]))
    ids = c(torch.randint(-1, 80, (6, 8), generator=g))
    bt = c(torch.randint(-1, 30, (3, 6), generator=g).to(torch.int32))
    req = c(i32([0, 1, 2, 0, 7, -1]))
    seq, qn = c(i64([9, 4])), c(i64([2, 1]))
    q, kv, sl, cn = c(Q.repeat(3, 1, 1)), c(KV), c(i32([[1, 4, 12]] * 6)), c(i32([3, 9, 0, 1, 2, -4]))
    outs, lses, out0 = c(OUTS), c(LSES), c(OUTS[0])
    return {
        "localize": lambda: localize_decode_bounds(seq, qn, 2, 1, num_tokens=3, validate=False),
        "local_topk": lambda: local_topk(logits, 8, lens, starts, validate=False),
        "pack": lambda: pack_candidates(logits, ids, DcpGeometry(2, 1), starts, validate=False),
        "stable_topk": lambda: stable_topk(
            torch.stack([pack_candidates(logits, ids, DcpGeometry(2, r), validate=False) for r in (0, 1)]),
            5,
            validate=False,
        ),
        "deinterleave": lambda: deinterleave_and_compact(ids, req, bt, DcpGeometry(2, 1, 2, 4), validate=False),
        "attention": lambda: sparse_mla_attention(q, kv, sl, cn, 0.5, v_dim=6, validate=False),
        "merge": lambda: merge_partials(outs, lses, validate=False),
        "correct": lambda: correct_partial(out0, lses, 1, validate=False),
    }


@pytest.mark.gpu
@pytest.mark.parametrize(
    "stage", ["localize", "local_topk", "pack", "stable_topk", "deinterleave", "attention", "merge", "correct"]
)
def test_gpu_reference_stages_validate_false_never_sync(cuda_device, stage) -> None:
    calls = _gpu_stage_calls(cuda_device)
    got = _no_sync(calls[stage])
    cpu = _gpu_stage_calls(torch.device("cpu"))[stage]()
    for a, b in zip(got if isinstance(got, tuple) else (got,), cpu if isinstance(cpu, tuple) else (cpu,)):
        assert torch.allclose(a.cpu().double(), b.double(), equal_nan=True, atol=1e-12)


@pytest.mark.gpu
def test_gpu_kernels_validate_false_never_sync(cuda_device) -> None:
    from dcp_ref.kernels.deinterleave_triton import deinterleave_compact, workspace_numel
    from dcp_ref.kernels.lse_merge_triton import lse_correct
    from dcp_ref.kernels.pack_triton import pack_candidates_triton

    dev = cuda_device
    logits, ids = LOGITS.to(dev), LOCAL_IDS.to(dev)
    pout = torch.empty(3, 4, 2, device=dev)
    tok, bt, req = TOKEN_IDS.to(dev), BLOCK_TABLE.to(dev), REQ.to(dev)
    slots, counts = torch.empty(3, 4, dtype=torch.int32, device=dev), torch.empty(3, dtype=torch.int32, device=dev)
    ws = torch.zeros(max(workspace_numel("atomic", 3, 4), 1), dtype=torch.int64, device=dev)
    part, lses = OUTS[0].float().to(dev), LSES.float().to(dev)
    res, mlse = torch.empty_like(part), torch.empty(3, 2, device=dev)
    for method in ("rowscan", "atomic"):  # warm (compile) first: compilation may sync
        deinterleave_compact(
            tok,
            req,
            bt,
            DcpGeometry(2, 0, 2, 4),
            ordered=method != "atomic",
            method=method,
            out=slots,
            counts=counts,
            workspace=ws,
            validate=False,
        )
    pack_candidates_triton(logits, ids, DcpGeometry(2, 1), out=pout, validate=False)
    lse_correct(part, lses, 1, corrected=res, merged_lse=mlse)

    def run():
        pack_candidates_triton(logits, ids, DcpGeometry(2, 1), out=pout, validate=False)
        for method in ("rowscan", "atomic"):
            deinterleave_compact(
                tok,
                req,
                bt,
                DcpGeometry(2, 0, 2, 4),
                ordered=method != "atomic",
                method=method,
                out=slots,
                counts=counts,
                workspace=ws,
                validate=False,
            )
        lse_correct(part, lses, 1, corrected=res, merged_lse=mlse)

    _no_sync(run)
    assert torch.equal(pout.cpu(), pack_candidates(LOGITS, LOCAL_IDS, DcpGeometry(2, 1)))


@pytest.mark.gpu
def test_gpu_cutedsl_rejects_like_the_reference_and_never_syncs_unvalidated(cuda_device) -> None:
    pytest.importorskip("cutlass")
    from dcp_ref.kernels.topk_cutedsl import stable_topk_cutedsl

    g = GATHERED.to(cuda_device).contiguous()
    bad_ids = GATHERED.clone()
    bad_ids[0, 0, 0, 1] = 2.5
    with pytest.raises(ValueError) as ref:
        stable_topk(bad_ids, 3)
    with pytest.raises(ValueError) as ker:
        stable_topk_cutedsl(bad_ids.to(cuda_device), 3)
    assert str(ker.value) == str(ref.value)
    out = torch.empty(3, 3, dtype=torch.int32, device=cuda_device)
    stable_topk_cutedsl(g, 3, out=out, validate=False)  # compile
    _no_sync(lambda: stable_topk_cutedsl(g, 3, out=out, validate=False))
    assert sorted(map(sorted, out.cpu().tolist())) == sorted(map(sorted, stable_topk(GATHERED, 3).tolist()))


@pytest.mark.gpu
def test_gpu_flashinfer_rejects_like_the_reference_and_poisons_unvalidated(cuda_device) -> None:
    pytest.importorskip("flashinfer")
    from dcp_ref.kernels.flashinfer_mla import sparse_mla_flashinfer

    g = torch.Generator().manual_seed(3)
    q = (torch.randn(4, 16, 576, generator=g) / 8).to(torch.bfloat16)
    kv = (torch.randn(100, 576, generator=g) / 8).to(torch.bfloat16)
    slots = i32([[1, 2, 3], [4, 5, -1], [-1, -1, -1], [7, 8, 9]])
    counts = i32([3, 2, 0, 3])
    d = cuda_device
    for bad_slots, bad_counts in [
        (slots, i32([3, 4, 0, 3])),
        (i32([[1, 2, 300], [4, 5, -1], [-1] * 3, [7, 8, 9]]), counts),
        (slots, i32([3, -1, 0, 3])),
    ]:
        with pytest.raises(ValueError) as ref:
            sparse_mla_attention(q.double(), kv.double(), bad_slots, bad_counts, 0.1, v_dim=512)
        with pytest.raises(ValueError) as ker:
            sparse_mla_flashinfer(q.to(d), kv.to(d), bad_slots.to(d), bad_counts.to(d), 0.1)
        assert str(ker.value) == str(ref.value)
    out, lse = sparse_mla_flashinfer(q.to(d), kv.to(d), slots.to(d), counts.to(d), 0.1)
    want, want_l = sparse_mla_attention(q.double(), kv.double(), slots, counts, 0.1, v_dim=512)
    assert torch.allclose(out.double().cpu(), want, atol=3e-2)
    assert torch.allclose(lse.double().cpu()[[0, 1, 3]], want_l[[0, 1, 3]], atol=5e-2)
    assert torch.isneginf(lse[2]).all() and (out[2] == 0).all() and torch.isfinite(lse[[0, 1, 3]]).all()
    bad = i32([[1, 2, 300], [4, 5, -1], [-1] * 3, [7, 8, 9]])
    out, lse = sparse_mla_flashinfer(q.to(d), kv.to(d), bad.to(d), counts.to(d), 0.1, validate=False)
    assert torch.isnan(lse[0]).all() and torch.isnan(out[0]).all() and torch.isfinite(lse[[1, 3]]).all()
    q_nan = q.clone()
    q_nan[1, 3, 0] = NAN
    out, lse = sparse_mla_flashinfer(q_nan.to(d), kv.to(d), slots.to(d), counts.to(d), 0.1)
    assert torch.isnan(lse[1, 3]) and torch.isnan(out[1, 3]).all() and torch.isneginf(lse[2]).all()


def test_check_block_table_catches_a_table_too_short_for_the_local_length() -> None:
    """Class 2: the deinterleave stage poisons keys past the table; the step checks coverage with
    check_block_table (shapes at plan time, values when validating)."""
    from dcp_ref.deinterleave import check_block_table

    bt = i32([[3, 0, -1], [1, -1, -1]])
    check_block_table(bt, 4, i64([8, 4]), max_local_len=12)  # exactly covered
    check_block_table(bt, 4, i64([0, 0]))
    for kwargs, match in [
        (dict(max_local_len=13), "block_table has 3 blocks"),
        (dict(local_lens=i64([8, 5])), r"block_table\[1, 1\] is -1"),
        (dict(local_lens=i64([13, 0])), "block_table is too short"),
        (dict(local_lens=i64([-1, 0])), "local_lens must be non-negative"),
        (dict(local_lens=i64([1])), "local_lens must have one entry"),
        (dict(local_lens=[8, 4]), "local_lens must be a torch.Tensor"),
        (dict(max_local_len=-1), "max_local_len"),
    ]:
        with pytest.raises((ValueError, TypeError), match=match):
            check_block_table(bt, 4, **kwargs)
    # The stage itself: a key past a too-short table has no block: poisoned (validate=False) or refused.
    assert global_ids_to_local_slots(
        i64([[12]]), None, bt, DcpGeometry(1, 0, block_size=4), validate=False
    ).tolist() == [[POISON]]
    with pytest.raises(ValueError, match=r"^block_table has no block"):
        global_ids_to_local_slots(i64([[12]]), None, bt, DcpGeometry(1, 0, block_size=4))


# ================================================================================================
# By class: the contracts below the planned step, on the reference and its Triton twin.
# ================================================================================================
def _deint_impls():
    """Every deinterleave entry point as ``fn(ids, req, bt, geometry, validate) -> (masked slots, counts)``,
    the masked view of a compacting implementation being its slots re-expanded is not possible: compacting
    ones are compared through canonicalize()."""
    from dcp_ref.kernels.deinterleave_triton import (
        deinterleave_compact,
        deinterleave_masked_triton,
        global_ids_to_local_slots_triton,
    )

    def conv(*a, validate):
        s = global_ids_to_local_slots_triton(*a, validate=validate)
        return s, (s >= 0).sum(1, dtype=torch.int32)

    impls = {
        "ref-compact": (lambda *a, validate: deinterleave_and_compact(*a, validate=validate), True),
        "ref-masked": (lambda *a, validate: deinterleave_masked(*a, validate=validate), False),
        "triton-masked": (lambda *a, validate: deinterleave_masked_triton(*a, validate=validate), False),
        "triton-conversion": (conv, False),
    }
    for m in ("rowscan", "twopass", "atomic"):
        impls[f"triton-{m}"] = (
            lambda *a, validate, m=m: deinterleave_compact(*a, ordered=m != "atomic", method=m, validate=validate),
            True,
        )
    return impls


DEINT_IMPLS = sorted(_deint_impls())
# (label, ids, req, table, bs, W, r, I, the argument a validated call names)
OUT_OF_CONTRACT = [
    ("request id past the table", [[2, 3, 0, -1]], [2], [[5, 1]], 2, 2, 1, 1, "req_of_token"),
    ("negative request id", [[-1, -1, -1, -1]], [-1], [[5, 1]], 2, 2, 1, 1, "req_of_token"),
    ("owned id on a -1 block", [[1, 3, 5, 0]], [0], [[5, -1]], 2, 2, 1, 1, "block_table"),
    ("owned id on a -5 block", [[1, 3, 5, 0]], [0], [[5, -5]], 2, 2, 1, 1, "block_table"),
    ("owned id past the table", [[1, 9, 0, 2]], [0], [[5, 6]], 2, 2, 1, 1, "block_table"),
    ("owned id, 0-column table", [[1, 0, 2, 4]], [0], [[]], 2, 2, 1, 1, "block_table"),
    ("slot past int32", [[1, 3, 0, 2]], [0], [[2**30, 1]], 2, 2, 1, 1, "block_table"),
    ("slot reaching 2**31 - 1", [[3, 1, 0, 2]], [0], [[2**30 - 1, 7]], 2, 2, 1, 1, "block_table"),
]


@pytest.mark.parametrize("impl", DEINT_IMPLS)
@pytest.mark.parametrize("case", OUT_OF_CONTRACT, ids=[c[0] for c in OUT_OF_CONTRACT])
def test_class1_validate_false_poisons_out_of_contract_metadata(kernel_device, impl, case) -> None:
    """validate=False never answers "not here" (-1) for metadata out of contract: the poison slot 2**31 - 1,
    counted like a slot (reference and kernels, compact and masked); validate=True raises naming the argument."""
    _label, ids, req, table, bs, W, r, I, name = case
    fn, compact = _deint_impls()[impl]
    want = brute_slots(ids, req, table, bs, W, r, I)
    assert any(POISON in row for row in want)
    dev = kernel_device if impl.startswith("triton") else torch.device("cpu")
    args = (i64(ids).to(dev), i32(req).to(dev), i64(table).view(len(table), -1).to(dev), DcpGeometry(W, r, I, bs))
    slots, counts = fn(*args, validate=False)
    slots, counts = slots.cpu(), counts.cpu()
    assert counts.tolist() == [sum(v >= 0 for v in row) for row in want]
    if compact:
        exp = [sorted(v for v in row if v >= 0) + [-1] * sum(v < 0 for v in row) for row in want]
        assert canonicalize(slots, counts).tolist() == exp
    else:
        assert slots.tolist() == want
    with pytest.raises(ValueError) as info:
        fn(*args, validate=True)
    assert str(info.value).startswith(name), str(info.value)


def test_class1_poison_slot_is_named_once_and_turns_the_row_into_nan() -> None:
    """POISON_SLOT is the rule's one constant; every attention reference poisons a row that holds it
    (compact and masked layouts, float and FP8 caches), so the token's merged output is NaN."""
    from dcp_ref.deinterleave import POISON_SLOT, poisoned_rows

    assert POISON_SLOT == POISON
    slots, counts = i32([[1, POISON, -1], [4, 2, -1]]), i32([2, 2])
    assert poisoned_rows(slots, counts).tolist() == [True, False]
    assert poisoned_rows(slots, i32([1, 2])).tolist() == [False, False]  # past the count: not read
    out, lse = sparse_mla_attention(Q, KV, slots, counts, 0.5, v_dim=6, validate=False)
    assert torch.isnan(out[0]).all() and torch.isnan(lse[0]).all() and torch.isfinite(lse[1]).all()
    with pytest.raises(ValueError, match=r"^slots"):
        sparse_mla_attention(Q, KV, slots, counts, 0.5, v_dim=6)
    q8 = torch.randn(2, 2, 576, generator=G)
    kv8 = quantize_kv_fp8(torch.randn(10, 576, generator=G))
    for layout, c in (("masked", None), ("compact", counts)):
        o, l = sparse_mla_attention_fp8(q8, kv8, slots, c, 0.1, attention_layout=layout, validate=False)
        assert torch.isnan(o[0]).all() and torch.isnan(l[0]).all() and torch.isfinite(l[1]).all()
    # The chain a token goes through: deinterleave (bad request id) -> attention -> merge: NaN for it only.
    s2, c2 = deinterleave_and_compact(
        i64([[0, 1], [0, 1]]), i32([0, 5]), i32([[2]]), DcpGeometry(1, 0, block_size=2), validate=False
    )
    o2, l2 = sparse_mla_attention(Q, KV, s2, c2, 0.5, v_dim=6, validate=False)
    mo, ml = merge_partials(torch.stack([o2, torch.zeros_like(o2)]), torch.stack([l2, torch.full_like(l2, -INF)]))
    assert torch.isfinite(ml[0]).all() and torch.isnan(ml[1]).all() and torch.isnan(mo[1]).all()


def test_class1_the_kernel_attention_prologues_poison_the_poison_slot(kernel_device) -> None:
    """FlashMLA's two wrappers hand the kernel an in-range index for the poison slot and flag its row."""
    from dcp_ref.kernels.flashmla_fp8 import ROW_POISONED, ROW_READ, prepare_indices
    from dcp_ref.kernels.flashmla_sparse import _prologue_kernel, _prologue_torch

    slots, counts = i32([[1, POISON, -1], [4, 2, -1]]), i32([2, 2])
    idx, state = prepare_indices(slots.to(kernel_device), None, 10)
    assert state.cpu().tolist() == [ROW_POISONED, ROW_READ] and int(idx.max()) < 10
    safe, _cnt, poisoned = _prologue_torch(slots, counts, 10, 128)
    assert poisoned.tolist() == [1, 0] and int(safe.max()) < 10
    safe_k = torch.empty(2, 128, dtype=torch.int32, device=kernel_device)
    cnt_k, pois_k = (
        torch.empty(2, dtype=torch.int32, device=kernel_device),
        torch.empty(2, dtype=torch.int32, device=kernel_device),
    )
    s_d, c_d = slots.to(kernel_device), counts.to(kernel_device)
    _prologue_kernel[(2,)](s_d, c_d, safe_k, cnt_k, pois_k, 3, 128, 10, s_d.stride(0), s_d.stride(1), BLOCK=128)
    assert pois_k.cpu().tolist() == [1, 0] and torch.equal(safe_k.cpu(), safe)


# ---- class 2: valid edges -----------------------------------------------------------------------
@pytest.mark.parametrize("impl", DEINT_IMPLS)
def test_class2_deinterleave_empty_batches_and_zero_column_tables(kernel_device, impl) -> None:
    fn, _ = _deint_impls()[impl]
    dev = kernel_device if impl.startswith("triton") else torch.device("cpu")
    for ids, req, table in [
        (i64([]).view(0, 4), i32([]), i64([[3, 1]])),  # T = 0
        (i64([]).view(0, 4), i32([]), i64([]).view(0, 2)),  # T = 0, B = 0
        (i64([]).view(0, 0), None, i64([]).view(0, 0)),  # nothing at all
        (i64([[1, 3, -1]]), i32([0]), i64([]).view(1, 0)),  # a 0-column table, no owned id: valid
        (i64([[-1] * 3] * 2), None, i64([]).view(2, 0)),  # 0 columns, nothing selected
        (i64([[], []]).view(2, 0), None, i64([[1], [2]])),  # K = 0
    ]:
        for validate in (True, False):
            geo = DcpGeometry(2, 0, 1, 2)
            s, c = fn(ids.to(dev), None if req is None else req.to(dev), table.to(dev), geo, validate=validate)
            assert tuple(s.shape) == tuple(ids.shape) and tuple(c.shape) == (ids.shape[0],)
            assert (s.cpu() == -1).all() and (c.cpu() == 0).all()


def test_class2_k_larger_than_the_row_and_w1_brute_force(kernel_device) -> None:
    g = torch.tensor([[[0.5, 3.0], [-0.0, 1.0]]])  # one row, two candidates
    assert stable_topk(g, 5, sorted=True).tolist() == [[3, 1, -1, -1, -1]]
    assert global_topk_all_logits(f32([[0.5, 0.0]]), 4).tolist() == [[0, 1, -1, -1]]
    assert local_topk(f32([[0.5, -0.0, 1.0]]), 7, i64([3])).tolist() == [[2, 0, 1, -1, -1, -1, -1]]
    from dcp_ref.kernels.deinterleave_triton import deinterleave_compact
    from dcp_ref.kernels.lse_merge_triton import lse_correct, lse_merge

    # W = 1 deinterleave: every id is this rank's
    s, c = deinterleave_compact(
        i64([[3, -1, 0]]).to(kernel_device), None, i64([[4, 7]]).to(kernel_device), DcpGeometry(1, 0, block_size=2)
    )
    assert s.cpu().tolist() == [[7 * 2 + 1, 4 * 2 + 0, -1]] and c.cpu().tolist() == [2]
    # W = 1 merge: the output itself, the LSE itself (reference and kernel)
    o1, l1 = OUTS[:1].float(), LSES[:1].float()
    mo, ml = lse_merge(o1.to(kernel_device), l1.to(kernel_device), merged_lse=torch.empty(3, 2, device=kernel_device))
    assert torch.allclose(mo.cpu(), o1[0]) and torch.allclose(ml.cpu(), l1[0])
    co, cl = lse_correct(
        o1[0].to(kernel_device), l1.to(kernel_device), 0, merged_lse=torch.empty(3, 2, device=kernel_device)
    )
    assert torch.allclose(co.cpu(), o1[0]) and torch.allclose(cl.cpu(), l1[0])


# ---- class 3: out= aliasing is refused everywhere, exact in-place where documented ---------------
def test_class3_check_no_alias_is_exact_about_memory() -> None:
    from dcp_ref.contracts import check_no_alias

    base = torch.zeros(4, 2)
    check_no_alias(base[:, 0], "out", x=base[:, 1])  # interleaved columns share no byte
    check_no_alias(base[:2], "out", x=base[2:])  # disjoint slices
    check_no_alias(torch.zeros(0), "out", x=base)  # empty: nothing to overlap
    check_no_alias(base, "out", same_ok=("x",), x=base)  # documented in place: exactly the same view
    for other in (base, base[1:3], base[:, 1], base.t()):
        with pytest.raises(ValueError, match=r"^out must not share memory with x"):
            check_no_alias(base, "out", x=other)
    with pytest.raises(ValueError, match=r"^out must not share memory with x .*exactly"):
        check_no_alias(base[1:], "out", same_ok=("x",), x=base[:3])  # a shifted in-place view races


def test_class3_lse_correct_in_place_is_allowed_exactly() -> None:
    from dcp_ref.kernels.lse_merge_triton import lse_correct

    x = OUTS[0].float().clone()
    want, _ = correct_partial(OUTS[0].float(), LSES.float(), 1)
    res, _ = lse_correct(x, LSES.float(), 1, corrected=x)
    assert res.data_ptr() == x.data_ptr() and torch.allclose(x, want, atol=1e-6)


# ---- class 4: numerical extremes of the merge ---------------------------------------------------
def _brute_merge(lses: list[float], outs: list[float], base: str) -> tuple[float, float]:
    b = math.e if base == "e" else 2.0
    m = max(lses)
    w = [b ** (x - m) for x in lses]
    total = sum(w)
    lse = m + math.log(total, b)
    return sum(wi / total * o for wi, o in zip(w, outs)), lse


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inside the interpreter: -inf lanes of -3.3e38 - 3.3e38
@pytest.mark.parametrize("base", ["e", "2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_class4_lses_near_the_float32_maximum_merge_finite(kernel_device, base, dtype) -> None:
    """3.0e38 and 3.3e38 (finite in float32; 3.3e38 * log2(e) is not): the max is subtracted first."""
    from dcp_ref.kernels.lse_merge_triton import lse_correct, lse_merge

    lv = [[3.0e38, 3.3e38, -3.3e38], [3.3e38, 3.0e38, 3.3e38]]  # [W=2, H=3]
    ov = [2.0, -1.0]
    lses = torch.tensor(lv, dtype=dtype).view(2, 1, 3)
    outs = torch.tensor(ov).view(2, 1, 1, 1).expand(2, 1, 3, 2).contiguous()
    want = [_brute_merge([float(torch.tensor(lv[w][h], dtype=dtype)) for w in range(2)], ov, base) for h in range(3)]
    ref_o, ref_l = merge_partials(outs, lses, base)
    ker_o, ker_l = lse_merge(
        outs.to(kernel_device),
        lses.to(kernel_device),
        base=base,
        merged_lse=torch.empty(1, 3, dtype=dtype, device=kernel_device),
    )
    for o, l in ((ref_o, ref_l), (ker_o.cpu(), ker_l.cpu())):
        assert torch.isfinite(o).all() and torch.isfinite(l).all()
        for h, (wo, wl) in enumerate(want):
            assert o[0, h, 0].item() == pytest.approx(wo, rel=1e-6)
            assert l[0, h].item() == pytest.approx(wl, rel=1e-6)
    acc = sum(
        lse_correct(outs[r].to(kernel_device), lses.to(kernel_device), r, base=base)[0].cpu().double() for r in range(2)
    )
    assert torch.allclose(acc, ref_o.double(), rtol=1e-6)
    c, m = correct_partial(outs[1], lses, 1, base)
    assert torch.isfinite(c).all() and torch.isfinite(m).all()


def test_class4_float64_lses_are_not_rounded_to_float32(kernel_device) -> None:
    """1e10 + 0.5 against 1e10: float32 rounds both to 1e10 (weights 1/2, 1/2); the true weights are
    e^0.5 / (1 + e^0.5) and 1 / (1 + e^0.5). The reference keeps float64; the kernel subtracts in float64."""
    from dcp_ref.kernels.lse_merge_triton import lse_correct, lse_merge

    lses = torch.tensor([1e10 + 0.5, 1e10], dtype=torch.float64).view(2, 1, 1)
    outs = torch.tensor([1.0, 0.0]).view(2, 1, 1, 1)
    w0 = math.exp(0.5) / (1 + math.exp(0.5))
    lse = 1e10 + 0.5 + math.log(1 + math.exp(-0.5))
    ref_o, ref_l = merge_partials(outs, lses)
    assert (
        ref_o.item() == pytest.approx(w0, rel=1e-6)
        and ref_l.dtype == torch.float64
        and ref_l.item() == pytest.approx(lse, rel=1e-15)
    )
    ml = torch.empty(1, 1, dtype=torch.float64, device=kernel_device)
    ker_o, _ = lse_merge(outs.to(kernel_device), lses.to(kernel_device), merged_lse=ml)
    assert ker_o.item() == pytest.approx(w0, rel=1e-6) and ml.item() == pytest.approx(lse, rel=1e-12)
    c, _ = lse_correct(outs[0].to(kernel_device), lses.to(kernel_device), 0)
    assert c.item() == pytest.approx(w0, rel=1e-6)


# ---- class 6: a validated call reads the host once ----------------------------------------------
_SYNC_OPS = {
    "aten::_local_scalar_dense",
    "aten::item",
    "aten::is_nonzero",
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique",
    "aten::_unique2",
    "aten::equal",
}


def _host_reads(fn) -> list[str]:
    """Host reads of ``fn()``: aten ops that read a value (as dcp_ref.step.HostSyncCounter) plus
    ``Tensor.tolist`` calls (CPU tensors read by tolist go through no dispatch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    reads: list[str] = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if func._schema.name in _SYNC_OPS:
                reads.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    orig = torch.Tensor.tolist

    def tolist(self, *a, **k):  # type: ignore[no-untyped-def]
        reads.append("tolist")
        return orig(self, *a, **k)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    try:
        with Mode():
            fn()
    finally:
        torch.Tensor.tolist = orig  # type: ignore[method-assign]
    return reads


def _validated_calls(dev):
    from dcp_ref.fp8_cache import check_fp8_slots
    from dcp_ref.kernels.deinterleave_triton import deinterleave_compact, deinterleave_masked_triton
    from dcp_ref.kernels.flashmla_fp8 import prepare_indices

    c = lambda t: t.to(dev)  # noqa: E731
    ids, req, bt = c(TOKEN_IDS), c(REQ), c(BLOCK_TABLE)
    sl = c(i32([[1, -1], [2, 3]]))
    return {
        "deinterleave (reference)": lambda: deinterleave_and_compact(ids, req, bt, DcpGeometry(2, 0, 2, 4)),
        "deinterleave (kernel, compact)": lambda: deinterleave_compact(ids, req, bt, DcpGeometry(2, 0, 2, 4)),
        "deinterleave (kernel, masked)": lambda: deinterleave_masked_triton(ids, req, bt, DcpGeometry(2, 0, 2, 4)),
        "pack": lambda: pack_candidates(LOGITS, LOCAL_IDS, DcpGeometry(2, 1)),
        "select": lambda: stable_topk(GATHERED, 3),
        "attention": lambda: sparse_mla_attention(Q, KV, SLOTS, COUNTS, 0.5, v_dim=6),
        "fp8 slots (masked)": lambda: check_fp8_slots(sl, None, 40),
        "fp8 slots (compact)": lambda: check_fp8_slots(sl, c(i32([1, 2])), 40, "compact"),
        "FlashMLA FP8 (from the prologue)": lambda: prepare_indices(sl, None, 40, validate=True),
    }


#: The names of :func:`_validated_calls`, spelled out: building the calls needs the kernel device (a fixture),
#: and nothing may touch it at collection (``TRITON_INTERPRET=0`` without a GPU has no driver).
_VALIDATED_CALL_NAMES = (
    "FlashMLA FP8 (from the prologue)",
    "attention",
    "deinterleave (kernel, compact)",
    "deinterleave (kernel, masked)",
    "deinterleave (reference)",
    "fp8 slots (compact)",
    "fp8 slots (masked)",
    "pack",
    "select",
)


@pytest.mark.parametrize("name", _VALIDATED_CALL_NAMES)
def test_class6_a_validated_call_reads_the_host_once(kernel_device, name) -> None:
    calls = _validated_calls(kernel_device)
    assert sorted(calls) == sorted(_VALIDATED_CALL_NAMES)  # every call is tested, by the name it is listed under
    calls[name]()  # warm (Triton compiles once)
    assert len(_host_reads(calls[name])) == 1, _host_reads(calls[name])


def test_class6_flashmla_sparse_validates_from_its_prologue(monkeypatch) -> None:
    """The FlashMLA stage's validated call (opt-in: the stage runs it unvalidated) reads what its prologue
    computed, once, and raises the reference's message; the kernel is never reached with a bad input."""
    import types

    from dcp_ref.kernels import flashmla_sparse as fm

    reached: list = []

    def fake_fwd(q, kv, indices, sm_scale, d_v, topk_length, use_legacy):  # noqa: ANN001, ANN202
        reached.append(True)
        T, H = q.shape[:2]
        return torch.zeros(T, H, d_v, dtype=q.dtype), torch.zeros(T, H), torch.zeros(T, H)

    monkeypatch.setattr(fm, "_flash_mla", lambda: types.SimpleNamespace(flash_mla_sparse_fwd=fake_fwd))
    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16)
    kv = torch.zeros(10, 576, dtype=torch.bfloat16)
    for slots, counts in [
        (i32([[1, 4, 12], [7, -1, -1]]), i32([3, 1])),  # a used slot past the cache
        (i32([[1, 4, POISON], [7, -1, -1]]), i32([3, 1])),  # the deinterleave's poison slot
        (i32([[1, 4, 2], [7, -1, -1]]), i32([4, 1])),  # counts past K
        (i32([[1, 4, 2], [7, -1, -1]]), i32([3, -1])),  # a negative count
    ]:
        with pytest.raises(ValueError) as ref:
            sparse_mla_attention(q.double(), kv.double(), slots, counts, 0.5, v_dim=512)
        with pytest.raises(ValueError) as ker:
            fm.sparse_mla_flashmla(q, kv, slots, counts, 0.5, validate=True)
        assert str(ker.value) == str(ref.value) and not reached
        fm.sparse_mla_flashmla(q, kv, slots, counts, 0.5)  # unvalidated: poisoned on the device, no raise
        reached.clear()
    good = (i32([[1, 4, 2], [7, -1, -1]]), i32([3, 1]))
    fm.sparse_mla_flashmla(q, kv, *good, 0.5, validate=True)
    assert len(_host_reads(lambda: fm.sparse_mla_flashmla(q, kv, *good, 0.5, validate=True))) == 1
    assert _host_reads(lambda: fm.sparse_mla_flashmla(q, kv, *good, 0.5)) == []
