"""The scoring oracle with MTP groups (``next_n``) and with int64 metadata near ``2**63``.

Independent references written here: a small builder writes known keys into a shuffled paged cache
(through the write side, ``dcp_ref.index_cache.write_index_keys``), and the expected scores are
decoded from the raw cache bytes by hand (e4m3 bit fields, float32 scales with ``struct``) and
summed in plain Python floats. The poison and overflow expectations are stated from the contract
(which rows are out of contract, written out by hand), never read from the code under test; the
expected messages are written out literally, with the exact Python-int values.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_ref.geometry import DcpGeometry
from dcp_ref.scoring import check_scoring_inputs, index_scores, reference_scoring

NAN, INF = float("nan"), float("inf")
BIG = 2**63  # int64 wraps around at 2**63: every "near 2**63" value below is BIG - something


# ---------------------------------------------------------------------------------------------
# Independent decoding and brute force
# ---------------------------------------------------------------------------------------------
from fp8_bits import E4M3  # noqa: E402  (tests/ is on sys.path: the independent decoder)
from scoring_problems import paged_index_keys, width  # noqa: E402


def brute(q, w, cache, bt, req, bounds, bs, L, starts=None) -> torch.Tensor:
    """Plain-Python float64 scores ``[T, L]`` of in-contract inputs: -inf off each token's keys."""
    raw = bytes(cache.contiguous().view(torch.uint8).reshape(-1).tolist())
    qf, wf = q.to(torch.float64).tolist(), w.to(torch.float64).tolist()
    out = []
    for t in range(len(qf)):
        row = [-INF] * L
        s0 = 0 if starts is None else int(starts[t])
        for j in range(int(bounds[t])):
            blk = int(bt[int(req[t])][j // bs])
            base, o = blk * bs * 132, j % bs
            vals = [E4M3[raw[base + o * 128 + d]] for d in range(128)]
            (scale,) = struct.unpack("<f", raw[base + bs * 128 + 4 * o : base + bs * 128 + 4 * o + 4])
            acc = 0.0
            for h in range(len(qf[t])):
                dot = sum(a * b for a, b in zip(qf[t][h], vals))
                acc += wf[t][h] * (dot if dot >= 0 else 0.0)
            row[s0 + j] = acc * scale
        out.append(row)
    return torch.tensor(out, dtype=torch.float64).reshape(len(qf), L)


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-6) -> None:
    """Same NaN and -inf positions; finite values within ``rel`` of ``|want| + the row's largest |want|``."""
    got = got.double()
    assert got.shape == want.shape
    assert torch.equal(torch.isnan(got), torch.isnan(want)), "NaN positions differ"
    assert torch.equal(got == -INF, want == -INF), "-inf positions differ"
    fin = torch.isfinite(want)
    row_max = torch.where(fin, want.abs(), 0.0).amax(dim=1, keepdim=True).expand_as(want)
    err = (got - want)[fin].abs()
    assert bool((err <= rel * (want[fin].abs() + row_max[fin])).all())


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit the same scores (NaN equal to NaN)."""
    return (
        a.shape == b.shape
        and torch.equal(torch.isnan(a), torch.isnan(b))
        and torch.equal(a.nan_to_num(), b.nan_to_num())
    )


# ---------------------------------------------------------------------------------------------
# Builder: B requests' keys in shuffled blocks; groups of next_n tokens, each group one request
# ---------------------------------------------------------------------------------------------
def grouped_problem(seed, *, groups=3, next_n=2, B=3, bs=4, H=3, lens=(10, 7, 13), M=None, starts=False,
                    q_dtype=torch.float32):  # fmt: skip
    """``groups * next_n`` tokens; group ``g`` belongs to one random request, its tokens have their own
    bounds (any ``<= lens[r]``), queries, weights and (``starts``) row starts."""
    g = torch.Generator().manual_seed(seed)
    cache, bt, _ = paged_index_keys(g, lens, B=B, bs=bs, M=M, spare=2)
    T = groups * next_n
    req = torch.randint(0, B, (groups,), generator=g).repeat_interleave(next_n)  # one request per group
    cap = torch.tensor([lens[int(r)] for r in req])
    bounds = (torch.rand(T, generator=g) * (cap + 1)).long().clamp(max=cap)
    bounds[0] = cap[0]  # at least one full row
    q = (torch.randn(T, H, 128, generator=g) * 2).to(q_dtype)
    w = torch.randn(T, H, generator=g)
    rs = torch.randint(0, 6, (T,), generator=g) if starts else None
    return q, w, cache, bt, req, bounds, rs


# ---------------------------------------------------------------------------------------------
# next_n does not change the scores
# ---------------------------------------------------------------------------------------------
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10**6), next_n=st.sampled_from([2, 3]), groups=st.integers(1, 3),
       bs=st.sampled_from([1, 3, 4, 8]), starts=st.booleans())  # fmt: skip
def test_grouped_scores_equal_brute_force_and_next_n_1(seed, next_n, groups, bs, starts) -> None:
    q, w, cache, bt, req, bounds, rs = grouped_problem(seed, groups=groups, next_n=next_n, bs=bs, starts=starts)
    g = DcpGeometry(1, 0, 1, bs)
    T, L = q.shape[0], width(bounds, rs) + 2
    want = brute(q, w, cache, bt, req, bounds, bs, L, rs)
    one = index_scores(q, w, cache, bt, req, bounds, g, row_starts=rs, out=torch.empty(T, L))
    grouped = index_scores(q, w, cache, bt, req, bounds, g, row_starts=rs, out=torch.empty(T, L), next_n=next_n)
    assert_close(grouped, want)
    assert same(grouped, one)
    unval = reference_scoring(q, w, cache, bt, req, bounds, g, row_starts=rs, out=torch.empty(T, L), next_n=next_n)
    assert same(unval, one)  # in contract: validate=False poisons nothing
    if rs is None:  # without out: the validated width is max(bounds), the unvalidated M * block_size
        auto = index_scores(q, w, cache, bt, req, bounds, g, next_n=next_n)
        assert auto.shape == (T, int(bounds.max()))
        assert same(auto, one[:, : auto.shape[1]])


def test_grouped_fp8_queries_and_int32_metadata() -> None:
    q, w, cache, bt, req, bounds, rs = grouped_problem(7, groups=2, next_n=3, starts=True, q_dtype=torch.float8_e4m3fn)
    g = DcpGeometry(1, 0, 1, 4)
    L = width(bounds, rs)
    want = brute(q, w, cache, bt, req, bounds, 4, L, rs)
    i32 = [t.to(torch.int32) for t in (req, bounds, rs)]
    for r_, b_, s_ in ((req, bounds, rs), i32):
        for validate in (True, False):
            got = index_scores(q, w, cache, bt, r_, b_, g, row_starts=s_, out=torch.empty(6, L), validate=validate,
                               next_n=3)  # fmt: skip
            assert_close(got, want)


def test_next_n_equal_to_T_and_empty_batch() -> None:
    q, w, cache, bt, req, bounds, _ = grouped_problem(3, groups=1, next_n=4)
    g = DcpGeometry(1, 0, 1, 4)
    assert same(index_scores(q, w, cache, bt, req, bounds, g, next_n=4), index_scores(q, w, cache, bt, req, bounds, g))
    for validate in (True, False):  # T = 0 is divisible by any next_n
        e = index_scores(q[:0], w[:0], cache, bt, req[:0], bounds[:0], g, validate=validate, next_n=3)
        assert e.shape[0] == 0


def test_check_scoring_inputs_records_next_n() -> None:
    q, w, cache, bt, req, bounds, _ = grouped_problem(1, groups=2, next_n=3)
    g = DcpGeometry(1, 0, 1, 4)
    for validate in (True, False):
        a = check_scoring_inputs(q, w, cache, bt, req, bounds, g, None, None, validate, next_n=3)
        assert a.next_n == 3 and a.T == 6
        assert check_scoring_inputs(q, w, cache, bt, req, bounds, g, None, None, validate).next_n == 1
    # ints in any accepted form: NumPy integers and 0-d integer tensors
    assert check_scoring_inputs(q, w, cache, bt, req, bounds, g, None, None, True, next_n=np.int64(2)).next_n == 2
    assert check_scoring_inputs(q, w, cache, bt, req, bounds, g, None, None, True, next_n=torch.tensor(6)).next_n == 6


# ---------------------------------------------------------------------------------------------
# The argument checks (free: always, whatever validate)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value,exc,msg",
    [
        (0, ValueError, "next_n must be >= 1, got 0"),
        (-2, ValueError, "next_n must be >= 1, got -2"),
        (2.0, TypeError, "next_n must be a Python int, got float"),
        (True, TypeError, "next_n must be a Python int, got bool"),
        ("2", TypeError, "next_n must be a Python int, got str"),
        (None, TypeError, "next_n must be a Python int, got NoneType"),
        (torch.tensor([2]), TypeError, "next_n must be a Python int (or a 0-d integer tensor)"),
        (4, ValueError, "next_n=4 must divide the T=6 query tokens (groups of next_n tokens of one request)"),
        (5, ValueError, "next_n=5 must divide the T=6 query tokens (groups of next_n tokens of one request)"),
    ],
)
@pytest.mark.parametrize("validate", [True, False])
def test_bad_next_n_raises_naming_it(value, exc, msg, validate) -> None:
    q, w, cache, bt, req, bounds, _ = grouped_problem(2, groups=3, next_n=2)
    g = DcpGeometry(1, 0, 1, 4)
    with pytest.raises(exc) as e:
        index_scores(q, w, cache, bt, req, bounds, g, validate=validate, next_n=value)
    assert str(e.value).startswith(msg)
    if not validate:
        with pytest.raises(exc) as e:
            reference_scoring(q, w, cache, bt, req, bounds, g, next_n=value)
        assert str(e.value).startswith(msg)
        meta = [t.to("meta") for t in (q, w, cache, bt, req, bounds)]  # free: decided without a value
        with pytest.raises(exc) as e:
            index_scores(*meta, g, validate=False, next_n=value)
        assert str(e.value).startswith(msg)


def test_next_n_on_meta_tensors_reads_nothing() -> None:
    q, w, cache, bt, req, bounds, rs = grouped_problem(2, groups=3, next_n=2, starts=True)
    meta = [t.to("meta") for t in (q, w, cache, bt, req, bounds)]
    out = torch.empty(6, 20, device="meta")
    got = index_scores(*meta, DcpGeometry(1, 0, 1, 4), row_starts=rs.to("meta"), out=out, validate=False, next_n=3)
    assert got.shape == (6, 20)


# ---------------------------------------------------------------------------------------------
# A group that mixes requests
# ---------------------------------------------------------------------------------------------
def mixed_problem(next_n):
    """Three groups of ``next_n`` tokens; in contract except the request ids set by the caller."""
    q, w, cache, bt, req, bounds, rs = grouped_problem(11, groups=3, next_n=next_n, starts=True)
    # bounds that fit every request (lens 10, 7, 13), so that any request id is in contract for next_n=1
    bounds[:] = torch.tensor([7, 3, 0, 5, 6, 1, 2, 4, 7][: 3 * next_n])
    return q, w, cache, bt, req, bounds, rs


@pytest.mark.parametrize(
    "next_n,ids,msg",
    [
        (2, [0, 0, 1, 2, 2, 2], "but token 2 names 1 and token 3 names 2"),
        (2, [1, 1, 2, 2, 0, 1], "but token 4 names 0 and token 5 names 1"),
        (3, [2, 2, 2, 0, 1, 0, 1, 1, 2], "but token 3 names 0 and token 4 names 1"),  # the first of two
        (3, [0, 0, 1, 2, 2, 2, 1, 1, 1], "but token 0 names 0 and token 2 names 1"),
    ],
)
def test_mixed_group_raises_validated_and_poisons_its_rows_unvalidated(next_n, ids, msg) -> None:
    q, w, cache, bt, req, bounds, rs = mixed_problem(next_n)
    req = torch.tensor(ids)
    T = req.shape[0]
    g = DcpGeometry(1, 0, 1, 4)
    L = width(bounds, rs)
    with pytest.raises(ValueError) as e:
        index_scores(q, w, cache, bt, req, bounds, g, row_starts=rs, out=torch.empty(T, L), next_n=next_n)
    assert str(e.value) == f"req_of_token must name one request per group of next_n={next_n} tokens, " + msg
    # next_n=1: no group rule, every row in contract; the brute force is the answer for the good groups
    one = index_scores(q, w, cache, bt, req, bounds, g, row_starts=rs, out=torch.empty(T, L))
    assert_close(one, brute(q, w, cache, bt, req, bounds, 4, L, rs))
    got = reference_scoring(q, w, cache, bt, req, bounds, g, row_starts=rs, out=torch.empty(T, L), next_n=next_n)
    grp = [ids[i : i + next_n] for i in range(0, T, next_n)]
    bad = torch.tensor([len(set(gr)) > 1 for gr in grp]).repeat_interleave(next_n)
    assert bool(bad.any()) and not bool(bad.all())
    assert bool(torch.isnan(got[bad]).all())  # every column of every row of a mixed group
    assert same(got[~bad], one[~bad])


def test_request_range_is_checked_before_the_groups() -> None:
    q, w, cache, bt, req, bounds, _ = mixed_problem(2)
    req = torch.tensor([0, 5, 1, 1, 2, 2])  # group 0 is mixed and names a request past the table
    g = DcpGeometry(1, 0, 1, 4)
    with pytest.raises(ValueError, match=r"^req_of_token values must be in \[0, B=3\)"):
        index_scores(q, w, cache, bt, req, bounds, g, next_n=2)
    got = reference_scoring(q, w, cache, bt, req, bounds, g, next_n=2)
    assert bool(torch.isnan(got[:2]).all()) and not bool(torch.isnan(got[2:]).any())
    same_bad = torch.tensor([-1, -1, 1, 1, 2, 2])  # one (bad) request per group: only that group poisoned
    got = reference_scoring(q, w, cache, bt, same_bad, bounds, g, next_n=2)
    assert bool(torch.isnan(got[:2]).all()) and not bool(torch.isnan(got[2:]).any())


# ---------------------------------------------------------------------------------------------
# int64 metadata near 2**63: nothing wraps around into "in range"
# ---------------------------------------------------------------------------------------------
def overflow_problem():
    """T=4 tokens of requests 0, 0, 2, 2 (lens 10, 7, 13; bs=4, M=5; groups of 2), starts 0, bounds in contract."""
    q, w, cache, bt, req, bounds, _ = grouped_problem(5, groups=2, next_n=2, M=5)
    req[:] = torch.tensor([0, 0, 2, 2])
    bounds[:] = torch.tensor([10, 7, 13, 4])
    rs = torch.zeros(4, dtype=torch.int64)
    return q, w, cache, bt, req, bounds, rs


@pytest.mark.parametrize(
    "start,bound",
    [
        (BIG - 10, 12),  # row_starts + local_bounds = 2**63 + 2: wraps to -2**63 + 2 in int64
        (BIG - 1, 7),  # 2**63 + 6
        (BIG - 1, 1),  # 2**63 exactly
        (BIG - 1, 0),  # no key, but the row still ends far past out's columns
        (BIG - 13, 13),  # 2**63 exactly, the request's longest bound
        (0, BIG - 1),  # bound + block_size - 1 wraps: "blocks needed" would be negative
        (5, BIG - 3),  # and row_starts + local_bounds wraps too
        (BIG - 1, BIG - 1),  # both
    ],
)
@pytest.mark.parametrize("next_n", [1, 2])
def test_huge_starts_or_bounds_are_out_of_contract(start, bound, next_n) -> None:
    q, w, cache, bt, req, bounds, rs = overflow_problem()
    g = DcpGeometry(1, 0, 1, 4)
    L = 24
    good = index_scores(q, w, cache, bt, req, bounds, g, row_starts=rs, out=torch.empty(4, L))
    assert_close(good, brute(q, w, cache, bt, req, bounds, 4, L, rs))
    rs2, b2 = rs.clone(), bounds.clone()
    rs2[2], b2[2] = start, bound
    end = start + bound  # Python ints: exact
    got = index_scores(q, w, cache, bt, req, b2, g, row_starts=rs2, out=torch.full((4, L), 3.0), validate=False,
                       next_n=next_n)  # fmt: skip
    assert bool(torch.isnan(got[2]).all())
    keep = torch.tensor([True, True, False, True])
    assert same(got[keep], good[keep])
    blocks_msg = f"local_bounds[2]={bound} needs {-(-bound // 4)} blocks of 4 keys, but block_table has 5 per request"
    for has, kw in ((f"out has {L} columns", dict(out=torch.empty(4, L))), (f"n_cols={L}", dict(n_cols=L))):
        # n_cols: the width a fused caller (no score matrix) stands for, checked as out's would be
        with pytest.raises(ValueError) as e:
            check_scoring_inputs(q, w, cache, bt, req, b2, g, rs2, kw.get("out"), True, n_cols=kw.get("n_cols"),
                                 next_n=next_n)  # fmt: skip
        if bound > 5 * 4:  # more keys than the table's 5 blocks of 4 cover: that check comes first
            assert str(e.value) == blocks_msg
        else:
            assert str(e.value) == f"{has}, but token 2 needs row_starts + local_bounds = {end}"
    with pytest.raises(ValueError) as e2:
        index_scores(q, w, cache, bt, req, b2, g, row_starts=rs2, out=torch.empty(4, L), next_n=next_n)
    assert str(e2.value) == (blocks_msg if bound > 5 * 4 else f"out has {L} columns, but token 2 needs "
                             f"row_starts + local_bounds = {end}")  # fmt: skip
    assert end >= BIG - 1  # every case is a row no int64 width reaches


def test_huge_bound_messages_and_poison_without_row_starts() -> None:
    """Without row starts the end is the bound itself; the block count in the message is exact."""
    q, w, cache, bt, req, bounds, _ = overflow_problem()
    g = DcpGeometry(1, 0, 1, 4)
    b2 = bounds.clone()
    b2[1] = BIG - 1
    with pytest.raises(ValueError) as e:
        index_scores(q, w, cache, bt, req, b2, g)
    assert str(e.value) == (
        "local_bounds[1]=9223372036854775807 needs 2305843009213693952 blocks of 4 keys, but block_table has 5 "
        "per request"
    )
    for out in (None, torch.empty(4, 24)):  # the width from the shapes (M * bs = 20) or out's
        got = index_scores(q, w, cache, bt, req, b2, g, out=out, validate=False)
        assert bool(torch.isnan(got[1]).all()) and not bool(torch.isnan(got[[0, 2, 3]]).any())


def test_validated_width_from_huge_row_ends_names_the_argument() -> None:
    """Without ``out`` the validated width is max(row_starts + local_bounds): past int64 it is refused by name."""
    q, w, cache, bt, req, bounds, rs = overflow_problem()
    g = DcpGeometry(1, 0, 1, 4)
    rs2 = rs.clone()
    rs2[3] = BIG - 2  # bound 4: ends at 2**63 + 2
    with pytest.raises(ValueError) as e:
        index_scores(q, w, cache, bt, req, bounds, g, row_starts=rs2)
    assert str(e.value) == (
        f"row_starts + local_bounds must fit int64 (the width of the score matrix), but token 3 needs {BIG + 2}"
    )
    rs2[3] = BIG - 4  # ends at 2**63 exactly: one past the largest int64
    with pytest.raises(ValueError, match=f"^row_starts \\+ local_bounds must fit int64 .* token 3 needs {BIG}$"):
        index_scores(q, w, cache, bt, req, bounds, g, row_starts=rs2)


def test_int32_extremes_are_out_of_contract() -> None:
    """int32 metadata at its maximum: the ends (< 2**32) are exact, the rows poisoned / refused."""
    q, w, cache, bt, req, bounds, rs = overflow_problem()
    g = DcpGeometry(1, 0, 1, 4)
    top = 2**31 - 1
    rs2, b2 = rs.to(torch.int32), bounds.to(torch.int32)
    rs2[0], b2[3] = top, top
    got = index_scores(q, w, cache, bt, req.int(), b2, g, row_starts=rs2, out=torch.empty(4, 24), validate=False)
    assert bool(torch.isnan(got[[0, 3]]).all()) and not bool(torch.isnan(got[[1, 2]]).any())
    b2[3] = bounds[3]
    with pytest.raises(ValueError) as e:
        index_scores(q, w, cache, bt, req.int(), b2, g, row_starts=rs2, out=torch.empty(4, 24))
    assert str(e.value) == f"out has 24 columns, but token 0 needs row_starts + local_bounds = {top + 10}"
