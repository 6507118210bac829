"""The fused indexer kernel (kernels/indexer_triton.py) against local_topk + pack_candidates.

The oracle is the plain-PyTorch reference of the indexer stage, ``pack_candidates(scores,
local_topk(scores, k, lengths, row_starts), geometry, row_starts)``, itself tested against a
brute force in test_indexer.py; a pure-Python brute force checks a few rows directly here too.
Results are compared per row as *sets of bit patterns* of the ``(score, id)`` pairs (so ``-0.0``
vs ``+0.0`` counts, and so does the padding), and the kernel's documented order (winners by
increasing id, then padding) is checked separately; the rank-local order
(``order="rank_local"``) is compared exactly with :func:`dcp_ref.indexer.local_topk_rank_local`.
CPU runs go through the Triton interpreter (small shapes; small tiles and samples make the streamed,
compacted and split paths appear on a few hundred keys); ``-m gpu`` runs the compiled kernels on
≥ 10 000 adversarial rows per path, up to L = 131072 and T = 1024.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_ref.geometry import DcpGeometry
from dcp_ref.indexer import local_topk, local_topk_rank_local
from dcp_ref.ownership import local_to_global
from dcp_ref.topk import pack_candidates

ix = pytest.importorskip("dcp_ref.kernels.indexer_triton")


def reference(scores, lengths, k, geometry, row_starts=None) -> torch.Tensor:
    """The indexer stage in plain PyTorch: local stable top-k, then pack."""
    return pack_candidates(scores, local_topk(scores, k, lengths, row_starts), geometry, row_starts)


def pair_bits(packed: torch.Tensor) -> torch.Tensor:
    """int64 ``[T, k]``: each float32 (score, id) pair as one bit pattern (exact comparison)."""
    return packed.contiguous().view(torch.int64).squeeze(-1)


def same_sets(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """bool ``[T]``: row r holds the same multiset of (score, id) bit patterns in both."""
    g = torch.sort(pair_bits(got), 1).values
    h = torch.sort(pair_bits(want), 1).values
    return (g == h).all(1)


def assert_kernel_order(got: torch.Tensor) -> None:
    """The kernel's documented layout: valid pairs by increasing id, then ``(-inf, -1)`` padding."""
    ids = got[..., 1]
    valid = ids >= 0
    n = valid.sum(1, keepdim=True)
    pos = torch.arange(ids.shape[1], device=ids.device)
    assert bool((valid == (pos < n)).all()), "padding must follow every valid pair"
    inc = (ids[:, 1:] > ids[:, :-1]) | ~valid[:, 1:]
    assert bool(inc.all()), "valid ids must increase along the row"
    pad = got[~valid]
    assert bool((pad[:, 0] == float("-inf")).all()) and bool((pad[:, 1] == -1).all())


#: The launch decisions a test may ask for: :func:`launch_plan`'s knobs (the call takes only the plan they make).
KNOBS = ("split", "tile", "num_warps", "compact", "select", "sample", "pivots", "engine", "cute", "radix_bits")


def planned(scores: torch.Tensor, k: int, kw: dict) -> dict:
    """``kw`` with its launch knobs (:data:`KNOBS`) made into ``plan=launch_plan(T, cols, k, device, **knobs)`` for
    ``scores``' shape (and vector width); without any, ``kw`` as given (the default plan, or its own ``plan``)."""
    kw = dict(kw)
    knobs = {n: kw.pop(n) for n in KNOBS if n in kw}
    if knobs:
        kw["plan"] = ix.launch_plan(*scores.shape, k, scores.device, vec=ix.scores_vec(scores), **knobs)
    return kw


def check(scores, lengths, k, geometry, row_starts=None, **kw) -> torch.Tensor:
    """The kernel against the reference; ``kw``: the call's keywords and launch knobs (:func:`planned`)."""
    got = ix.indexer_topk_pack(scores, lengths, k, geometry, row_starts, **planned(scores, k, kw))
    want = reference(scores, lengths, k, geometry, row_starts)
    bad = (~same_sets(got, want)).nonzero().flatten().tolist()
    assert not bad, f"rows {bad}: got {got[bad[0]].tolist()} want {want[bad[0]].tolist()}"
    assert_kernel_order(got)
    return got


def check_rank_local(scores, lengths, k, row_starts=None, **kw) -> None:
    """``order="rank_local"``: exactly :func:`local_topk_rank_local` (ids equal, scores bit for bit, NaN padding)."""
    kw = planned(scores, k, kw)
    s, ids = ix.indexer_topk_pack(scores, lengths, k, DcpGeometry(3, 1, 2, 2), row_starts, order="rank_local", **kw)
    ws, wi = local_topk_rank_local(scores, k, lengths, row_starts)
    bad = (~((ids == wi).all(1) & (s.view(torch.int32) == ws.view(torch.int32)).all(1))).nonzero().flatten().tolist()
    assert not bad, f"rows {bad}: got {ids[bad[0]].tolist()} {s[bad[0]].tolist()} want {wi[bad[0]].tolist()}"
    assert s.dtype == torch.float32 and ids.dtype == torch.int32 and s.shape == ids.shape == (scores.shape[0], k)


def brute_packed(row: list[float], k: int, start: int, length: int, w: int, rank: int, i: int) -> list[tuple]:
    """Pure Python: the top-k (score, global id) of one row, by (score desc, j asc), NaN skipped."""
    cand = [(row[start + j] + 0.0, j) for j in range(length) if not math.isnan(row[start + j])]
    cand.sort(key=lambda c: (-c[0], c[1]))
    pairs = [(row[start + j], float(local_to_global(j, w, rank, i))) for _, j in cand[:k]]
    return sorted(pairs) + [(-math.inf, -1.0)] * (k - len(pairs))


# ---------------------------------------------------------------------------------------------
# Adversarial inputs (shared with the GPU differential test and benchmarks/sanitize_indexer.py)
# ---------------------------------------------------------------------------------------------

FLAVOURS = ("normal", "ties", "zeros", "nan_inf", "short", "invalid", "ascending", "constant")


def make_cases(rows: int, cols: int, seed: int, device: torch.device | str = "cpu", with_starts: bool = False):
    """``(scores [rows, cols] float32, lengths [rows] int32, row_starts [rows] int32 or None)``.

    Row ``r`` gets flavour ``FLAVOURS[r % 8]``: normal scores; 3 distinct values (heavy ties);
    ±0.0 and ±subnormals only; normal with 5 % NaN, 5 % -inf, 2 % +inf; a short row (length < 64); all NaN;
    ascending scores; one constant. Lengths are random in ``[0, cols]`` (``cols`` for half the
    rows); with ``with_starts`` each row's window starts at a random column.
    """
    gen = torch.Generator().manual_seed(seed)
    f = torch.arange(rows) % len(FLAVOURS)
    col = lambda m: m.unsqueeze(1)  # noqa: E731
    s = torch.randn(rows, cols, generator=gen)
    s = torch.where(col(f == 1), torch.randint(0, 3, (rows, cols), generator=gen).float() - 1.0, s)
    sign = torch.where(torch.rand(rows, cols, generator=gen) < 0.5, -1.0, 1.0)
    # ±0.0 and ±subnormals (a compare that flushed subnormals to zero would tie them with 0)
    tiny = torch.tensor([0.0, 0.0, 1e-45, 1e-40])[torch.randint(0, 4, (rows, cols), generator=gen)]
    s = torch.where(col(f == 2), tiny * sign, s)
    u = torch.rand(rows, cols, generator=gen)
    s = torch.where(col(f == 3) & (u < 0.05), float("nan"), s)
    s = torch.where(col(f == 3) & (u >= 0.05) & (u < 0.10), float("-inf"), s)
    s = torch.where(col(f == 3) & (u >= 0.10) & (u < 0.12), float("inf"), s)
    s = torch.where(col(f == 5), float("nan"), s)
    s = torch.where(col(f == 6), torch.arange(cols, dtype=torch.float32).expand(rows, cols) / 7.0, s)
    s = torch.where(col(f == 7), 0.5, s)
    starts = torch.randint(0, cols + 1, (rows,), generator=gen) if with_starts else torch.zeros(rows, dtype=torch.int64)
    room = cols - starts
    full = torch.rand(rows, generator=gen) < 0.5
    lengths = torch.where(full, room, (torch.rand(rows, generator=gen) * (room + 1)).long().clamp(max=room))
    lengths = torch.where(f == 4, torch.minimum(lengths, torch.randint(0, 64, (rows,), generator=gen)), lengths)
    return (
        s.to(device),
        lengths.to(torch.int32).to(device),
        starts.to(torch.int32).to(device) if with_starts else None,
    )


# ---------------------------------------------------------------------------------------------
# CPU (interpreter) tests
# ---------------------------------------------------------------------------------------------


#: (tile, split, compact, select): the row in registers (radix, search), streamed (tile 64), split rows,
#: and the compacted path (sampled bound, candidate list; one or three segments per row).
PATHS = [
    (None, 1, None, "radix"),
    (None, 1, None, "search"),
    (64, 1, False, None),
    (None, 3, False, None),
    (64, 2, False, None),
    (32, 1, True, "search"),
    (32, 3, True, "radix"),
]


@pytest.mark.parametrize("tile,split,compact,select", PATHS)
def test_adversarial_rows_match_reference(kernel_device, tile, split, compact, select):
    """Every flavour, in both orders, on every path."""
    s, lengths, starts = make_cases(8, 100, 1, kernel_device, with_starts=True)
    kw = dict(tile=tile, split=split, compact=compact, select=select)
    ks = (1, 17, 64, 200) if (tile, split) == (None, 1) else (5, 64)
    for k in ks:
        check(s, lengths, k, DcpGeometry(3, 1, 2, 2), starts, **kw)
    check_rank_local(s, lengths, ks[-1 if split == 1 else 0], starts, **kw)


def test_against_pure_python_brute_force(kernel_device):
    s, lengths, starts = make_cases(8, 40, 2, "cpu", with_starts=True)
    k, rank, w, i = 9, 2, 3, 4
    got = ix.indexer_topk_pack(
        s.to(kernel_device), lengths.to(kernel_device), k, DcpGeometry(w, rank, i, i), starts.to(kernel_device)
    )
    for r in range(8):
        want = brute_packed(s[r].tolist(), k, int(starts[r]), int(lengths[r]), w, rank, i)
        row = got[r].cpu().tolist()
        valid = sorted(tuple(p) for p in row if p[1] >= 0)
        assert [tuple(p) for p in row[len(valid) :]] == want[len(valid) :]
        assert valid == want[: len(valid)], r


def test_ties_go_to_the_lower_index(kernel_device):
    """All-equal scores (and ±0 mixed): the winners are exactly local keys 0..k-1."""
    zeros = torch.tensor([0.0, -0.0] * 50).reshape(1, 100)
    for row in (torch.full((1, 100), 3.25), zeros, torch.full((1, 100), float("-inf"))):
        for tile, split, compact in ((None, 1, None), (32, 1, False), (None, 4, False), (16, 2, True)):
            plan = ix.launch_plan(1, 100, 10, kernel_device, tile=tile, split=split, compact=compact, sample=16)
            got = ix.indexer_topk_pack(row.to(kernel_device), None, 10, DcpGeometry(1, 0), plan=plan).cpu()
            assert got[0, :, 1].tolist() == [float(j) for j in range(10)]
            # the scores are packed bit for bit: -0.0 stays -0.0
            assert torch.equal(pair_bits(got), pair_bits(reference(row, None, 10, DcpGeometry(1, 0))).sort(1).values)
    # a tie straddling the threshold: 5.0 x 6 at local keys 2, 3, 5, 8, 9, 11; k = 4 takes 9.0 and 2, 3, 5
    row = torch.tensor([[1.0, 9.0, 5.0, 5.0, 0.0, 5.0, 1.0, 1.0, 5.0, 5.0, 0.0, 5.0]])
    got = ix.indexer_topk_pack(row.to(kernel_device), None, 4, DcpGeometry(2, 0)).cpu()
    assert got[0].tolist() == [[9.0, 2.0], [5.0, 4.0], [5.0, 6.0], [5.0, 10.0]]


def test_short_rows_and_k_larger_than_row(kernel_device):
    s = torch.randn(3, 20)
    for k in (19, 20, 21, 300):
        got = check(
            s.to(kernel_device), torch.tensor([20, 3, 0], dtype=torch.int32, device=kernel_device), k, DcpGeometry(2, 0)
        )
        assert (got[:, :, 1] >= 0).sum(1).tolist() == [min(k, 20), min(k, 3), 0]
    # no columns at all, and no rows
    check(torch.empty(2, 0, device=kernel_device), None, 5, DcpGeometry(1, 0))
    assert ix.indexer_topk_pack(torch.empty(0, 7, device=kernel_device), None, 5, DcpGeometry(1, 0)).shape == (0, 5, 2)


def test_poisoned_out_is_fully_overwritten(kernel_device):
    s, lengths, _ = make_cases(8, 90, 3, kernel_device)
    for split in (1, 2):
        out = torch.full((8, 50, 2), float("nan"), device=kernel_device)
        out.view(torch.int32)[..., 1] = 0x7FC00123  # a NaN payload no kernel writes
        ws = torch.full((8, 2, 50, 2), 12345.0, device=kernel_device)
        plan = ix.launch_plan(8, 90, 50, kernel_device, split=split)
        got = ix.indexer_topk_pack(
            s, lengths, 50, DcpGeometry(2, 0), out=out, plan=plan, workspace=ws if split > 1 else None
        )
        assert got.data_ptr() == out.data_ptr()
        assert bool(same_sets(out, reference(s, lengths, 50, DcpGeometry(2, 0))).all())
    # the compacted path: a poisoned workspace list and output are fully overwritten (its counters start at 0)
    plan = ix.launch_plan(8, 90, 20, kernel_device, compact=True, tile=32, split=2)
    ws = ix.workspace_for(s, 20, plan=plan)
    ws[:, :-6].fill_(-1)
    out = torch.full((8, 20, 2), float("nan"), device=kernel_device)
    ix.indexer_topk_pack(s, lengths, 20, DcpGeometry(2, 0), out=out, workspace=ws, plan=plan)
    assert bool(same_sets(out, reference(s, lengths, 20, DcpGeometry(2, 0))).all())


def test_strided_and_low_precision_scores(kernel_device):
    base = torch.randn(6, 2 * 70, device=kernel_device)
    check(base[:, ::2], None, 16, DcpGeometry(2, 1, 3, 3))  # column stride 2
    check(base.t().contiguous().t()[:, :70], None, 16, DcpGeometry(2, 1, 3, 3))  # column-major
    check(
        base.t().contiguous().t()[:, :70], None, 5, DcpGeometry(2, 1, 3, 3), compact=True, tile=16, sample=16, split=2
    )
    for dt in (torch.float16, torch.bfloat16, torch.float64):
        check(base[:, :70].to(dt), None, 16, DcpGeometry(4, 0))


def test_prefill_row_starts(kernel_device):
    # two requests side by side: columns 0-2 are request 0's keys, 3-6 request 1's
    s = torch.tensor([[9.0, 8.0, 7.0, 1.0, 5.0, 5.0, 3.0]] * 2, device=kernel_device)
    starts = torch.tensor([0, 3], device=kernel_device)
    got = check(s, torch.tensor([2, 4], device=kernel_device), 3, DcpGeometry(2, 1), starts)
    # row 1: local keys 1, 2 (the tie 5.0, 5.0) and 3 on rank 1 of W=2 -> global 3, 5, 7
    assert got[1].tolist() == [[5.0, 3.0], [5.0, 5.0], [3.0, 7.0]]


@pytest.mark.parametrize("kw", [dict(), dict(compact=True, tile=16, sample=16, split=2)], ids=["tile", "compact"])
def test_validate_false_never_reads_outside_the_window(kernel_device, kw):
    """Bad lengths / row_starts with validate=False: the kernel clamps the window on the device.

    The scores are a view into a larger buffer whose other columns hold +inf: any read outside
    the view would make +inf a winner.
    """
    big = torch.full((4, 60), float("inf"), device=kernel_device)
    big[:, 10:50] = torch.randn(4, 40, device=kernel_device)
    s = big[:, 10:50]
    lengths = torch.tensor([100, -5, 40, 2**40], device=kernel_device)
    starts = torch.tensor([30, 0, -7, 45], device=kernel_device)
    got = ix.indexer_topk_pack(s, lengths, 8, DcpGeometry(1, 0), starts, validate=False, **planned(s, 8, kw))
    cs = starts.clamp(0, 40)
    cl = torch.minimum(lengths.clamp(min=0), 40 - cs)
    assert bool(same_sets(got, reference(s, cl, 8, DcpGeometry(1, 0), cs)).all())
    assert not bool(torch.isinf(got[..., 0]).logical_and(got[..., 0] > 0).any())
    with pytest.raises(ValueError, match="row_starts"):
        ix.indexer_topk_pack(s, lengths, 8, DcpGeometry(1, 0), starts, **planned(s, 8, kw))


@pytest.mark.parametrize("order", ["global_id", "rank_local"])
def test_validated_call_checks_in_the_kernel_and_raises_the_reference_message(kernel_device, order):
    """validate=True: the window checks run in the kernel (one flag read back); a bad window raises the host
    checks' message (the one the reference gives), and the flag is cleared for the next call."""
    s = torch.randn(3, 30, device=kernel_device)
    good = torch.tensor([30, 5, 0], device=kernel_device)
    cases = [  # (lengths, row_starts, message)
        (torch.tensor([30, -2, 4], device=kernel_device), None, "lengths must be non-negative, found -2"),
        (torch.tensor([30, 31, 4], device=kernel_device), None, "lengths must be <= scores.shape[1]=30"),
        (good, torch.tensor([0, 40, -1], device=kernel_device), "row_starts must lie in [0, cols=30], found 40"),
        (good, torch.tensor([0, 26, 0], device=kernel_device), "row_starts + lengths must be <= cols=30"),
    ]
    paths = [dict(), dict(compact=True, tile=16, sample=16)]
    for kw in paths + ([dict(tile=16, split=2, compact=False)] if order == "global_id" else []):
        for lengths, starts, msg in cases:
            with pytest.raises(ValueError) as info:
                ix.indexer_topk_pack(s, lengths, 4, DcpGeometry(2, 0), starts, order=order, **planned(s, 4, kw))
            assert str(info.value).startswith(msg)
            with pytest.raises(ValueError) as ref:  # the reference rejects the same input, naming the same argument
                local_topk(s, 4, lengths, starts)
            assert str(ref.value).split(" ")[0] == msg.split(" ")[0]
        got = ix.indexer_topk_pack(s, good, 4, DcpGeometry(2, 0), order=order, **planned(s, 4, kw))  # flag cleared
        if order == "global_id":
            assert bool(same_sets(got, reference(s, good, 4, DcpGeometry(2, 0))).all())


def test_compacted_paths_are_exact_in_both_orders(kernel_device):
    """Each of the compacted path's four ways (:func:`finish_filtered`), with one and three segments per row: the
    list (the sampled bound holds every winner); ties at the bound (the constant and few-value rows: the list
    overflows on keys equal to it, which is the threshold); the keys above the bound listed again (ten high
    keys where the sample does not look, the rest tied at the bound); and the fallback (the sampled keys are the
    row's smallest, every other key is larger)."""
    n = 400
    g = torch.Generator().manual_seed(0)
    sampled = (torch.arange(16) * n) // 16  # the keys a 16-key sample of a 400-key row looks at
    normal = torch.randn(1, n, generator=g)
    const = torch.full((1, n), 2.5)
    missed = torch.ones(1, n)
    missed[0, sampled] = 0.0
    ties = torch.randint(0, 4, (1, n), generator=g).float()
    above = torch.ones(1, n)
    above[0, sampled[:10] + 1] = 5.0
    s = torch.cat([normal, const, missed, ties, above]).to(kernel_device)
    seen = set()
    for split, k, lengths, kw, want_paths in (
        (1, 5, None, dict(tile=32, sample=16), [1, 2, 4, 2, 3]),
        (3, 5, None, dict(tile=32, sample=16), [1, 2, 4, 2, 3]),
        (1, 30, torch.tensor([400, 300, 399, 250, 400]), dict(tile=64, sample=32), None),
    ):
        if lengths is not None:
            lengths = lengths.to(kernel_device)
        plan = ix.launch_plan(5, n, k, kernel_device, compact=True, split=split, **kw)
        ws = ix.workspace_for(s, k, plan=plan)
        assert ws.dtype == torch.int64 and not bool(ws.any())  # zeroed: the arrival counters start at 0
        check(s, lengths, k, DcpGeometry(2, 0), workspace=ws, plan=plan)
        paths = ix.compact_paths(ws).tolist()
        assert want_paths is None or paths == want_paths
        seen.update(paths)
        check_rank_local(s, lengths, k, workspace=ws, plan=plan)
        assert ix.compact_paths(ws).tolist() == paths
        assert not bool(ws[:, -2].any())  # every call leaves the rows' arrival counters at 0
    assert seen == {1, 2, 3, 4}


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 3),
    cols=st.integers(0, 130),
    k=st.integers(1, 70),
    w=st.integers(1, 4),
    i=st.sampled_from([1, 2, 3, 8]),
    ties=st.booleans(),
    use_starts=st.booleans(),
    use_lengths=st.booleans(),
    tile=st.sampled_from([None, 32, 64]),
    split=st.sampled_from([1, 1, 2, 3]),
    compact=st.sampled_from([None, False, True]),
    select=st.sampled_from(["radix", "search"]),
    rank_local=st.booleans(),
)
def test_property_matches_reference(
    kernel_device, data, rows, cols, k, w, i, ties, use_starts, use_lengths, tile, split, compact, select, rank_local
):
    rank = data.draw(st.integers(0, w - 1))
    if ties:
        pool = [0.0, -0.0, 1.0, -1.0, float("nan"), float("-inf"), float("inf"), 2.5]
        vals = [data.draw(st.sampled_from(pool)) for _ in range(rows * cols)]
    else:
        vals = [data.draw(st.floats(-3, 3, width=32)) for _ in range(rows * cols)]
    s = torch.tensor(vals, dtype=torch.float32).reshape(rows, cols)
    starts = [data.draw(st.integers(0, cols)) if use_starts else 0 for _ in range(rows)]
    lengths = [data.draw(st.integers(0, cols - st0)) for st0 in starts]
    dev = kernel_device
    kw = dict(tile=tile, split=split, compact=compact, select=select, sample=16)
    lens = torch.tensor(lengths, device=dev) if use_lengths else None
    sts = torch.tensor(starts, device=dev) if use_starts else None
    if rank_local:
        check_rank_local(s.to(dev), lens, k, sts, **kw)
    else:
        check(s.to(dev), lens, k, DcpGeometry(w, rank, i, i), sts, **kw)


def test_radix_digit_widths_and_search_pivots(kernel_device):
    s, lengths, _ = make_cases(8, 120, 4, kernel_device)
    for bits in (5, 6, 7, 8, 10, 13):
        check(s, lengths, 33, DcpGeometry(2, 0), radix_bits=bits, select="radix")
    for pivots in (1, 3):
        check(s, lengths, 33, DcpGeometry(2, 0), select="search", pivots=pivots)


@pytest.mark.parametrize("bits", [5, 6, 8, 11])
def test_radix_keys_with_zero_top_digits(kernel_device, bits):
    """-inf and huge negative scores have keys below 2**24 (a first digit of 0 at <= 8 bits), the same
    first digit as an invalid key (NaN, outside the row): the select must still count and choose them
    apart from the invalid ones, tie-break the -inf run by index and never emit a NaN."""
    ninf, huge = float("-inf"), -3.0e38
    rows = [
        [ninf] * 6 + [float("nan")] * 4 + [huge, -2.0e38, 1.0, ninf],
        [float("nan"), ninf, huge, ninf, float("nan"), huge, ninf, ninf, -1.0e38, ninf, ninf, ninf, ninf, ninf],
        [huge] * 14,
    ]
    s = torch.tensor(rows, dtype=torch.float32, device=kernel_device)
    for k in (1, 3, 5, 9, 13):
        check(s, None, k, DcpGeometry(2, 1), radix_bits=bits, select="radix")
        check(
            s,
            torch.tensor([12, 9, 7], device=kernel_device),
            k,
            DcpGeometry(3, 0, 2, 2),
            radix_bits=bits,
            select="radix",
        )
        if bits == 5:  # the count search's pivots interpolate between -inf and huge negatives: non-finite widths
            check(s, None, k, DcpGeometry(2, 1), select="search")
            check(
                s, torch.tensor([12, 9, 7], device=kernel_device), k, DcpGeometry(3, 0, 2, 2), select="search", pivots=1
            )


def test_launch_plan_from_shapes_only():
    cpu = torch.device("cpu")
    assert ix.launch_plan(32, 8192, 2048, cpu)[:4] == (8192, True, 16, 1)
    assert ix.launch_plan(1, 100, 10, cpu)[:4] == (256, True, 4, 1)
    assert ix.launch_plan(1, 100, 10, cpu).select == ix.DEFAULT_SELECT
    # a lone long row: the compacted path by default (prefer_compact), never split under the interpreter / on the CPU
    p = ix.launch_plan(1, 131072, 2048, cpu)
    assert p.compact and not p.one_chunk and p.split == 1 and p.levels == () and p.cap == 4096
    assert ix.launch_plan(1, 131072, 2048, cpu, compact=True) == p
    assert p.sample == 8192  # ~180 sample keys at or above the bound: 131072 * 180 / sqrt(2048 * 4096) -> 8192
    p = ix.launch_plan(1, 131072, 2048, cpu, split=16, compact=True)
    assert p.compact and p.split == 16
    # k too large for a candidate list in registers: the streamed path by default, and compact=True is refused
    assert not ix.launch_plan(1, 131072, 8192, cpu).compact
    with pytest.raises(ValueError, match=r"^compact=True needs k <= 4096"):
        ix.launch_plan(1, 131072, 8192, cpu, compact=True)
    p = ix.launch_plan(1, 131072, 2048, cpu, split=16, compact=False)
    # 16 segments of 8192 keys -> 32768 candidates -> 4 segments -> 8192 candidates -> the last launch
    assert p.split == 16 and p.one_chunk and p.tile == 8192 and p.levels == (16, 4) and not p.compact


def test_compacted_path_is_chosen_by_shape_and_an_explicit_compact_wins():
    """``compact=None``: :func:`prefer_compact` (rows of at least COMPACT_MIN_COLS columns; from COMPACT_LONG_COLS
    on, only a lone row or COMPACT_MANY_ROWS rows; a candidate list that fits a tile), never for a row that fits
    one tile; ``compact=True/False`` overrides it both ways. The plan records the choice."""
    cpu = torch.device("cpu")
    cols_min, cols_long, many = ix.COMPACT_MIN_COLS, ix.COMPACT_LONG_COLS, ix.COMPACT_MANY_ROWS
    assert cols_min > ix.MAX_TILE  # the rule only ever concerns rows longer than a tile
    # (rows, cols, k) -> compacted by default? The shapes measured on the H200 (local_topk.json,
    # compact_vs_streamed, k = 2048) first: the default must be the faster path at each.
    cases = {
        (1, 32768, 2048): True,  # 19.3 vs 37.0 us streamed
        (1, 131072, 2048): True,  # 26.5 vs 59.2
        (32, 32768, 2048): True,  # 38.7 vs 50.7
        (128, 32768, 2048): True,  # 51.6 vs 112.2
        (1024, 32768, 2048): True,  # 279.5 vs 791.6
        (1024, 131072, 2048): True,  # 1745 vs 3975
        (32, 131072, 2048): False,  # 491.7 vs 121.9: 4x slower compacted
        (128, 131072, 2048): False,  # 580.7 vs 563.5
        (2, cols_long - 1, 2048): True,
        (2, cols_long, 2048): False,
        (many - 1, cols_long, 2048): False,
        (many, cols_long, 2048): True,
        (1, cols_min - 1, 2048): False,
        (1, 8192, 2048): False,  # one tile
        (1, 131072, ix.MAX_TILE // 2): True,  # the largest k whose list fits a tile
        (1, 131072, ix.MAX_TILE // 2 + 1): False,
    }
    for (rows, cols, k), want in cases.items():
        assert ix.prefer_compact(rows, cols, k) == want, (rows, cols, k)
        assert ix.launch_plan(rows, cols, k, cpu).compact == want, (rows, cols, k)
        # an explicit choice wins either way (True only where the list fits a tile: refused where it does not)
        assert not ix.launch_plan(rows, cols, k, cpu, compact=False).compact
        if ix.compact_cap(k):
            assert ix.launch_plan(rows, cols, k, cpu, compact=True).compact, (rows, cols, k)
        else:
            with pytest.raises(ValueError, match=r"^compact=True needs"):
                ix.launch_plan(rows, cols, k, cpu, compact=True)
    assert ix.prefer_compact(1, 1 << 20, 2048)  # no upper bound on the row length
    for bad, name in (((-1, 32768, 2048), "rows"), ((1, 2.5, 2048), "n_cols"), ((1, 32768, 0), "k")):
        with pytest.raises((TypeError, ValueError), match=name):
            ix.prefer_compact(*bad)
    # the workspace follows the same choice: int64 words for the compacted plan, none / float32 pairs otherwise
    s, s2 = torch.zeros(1, cols_min), torch.zeros(2, cols_long)
    assert ix.workspace_for(s, 2048).dtype == torch.int64
    assert ix.workspace_for(s, 2048, plan=ix.launch_plan(1, cols_min, 2048, cpu, compact=False)) is None
    assert ix.workspace_for(s2, 2048) is None
    assert ix.workspace_for(s2, 2048, plan=ix.launch_plan(2, cols_long, 2048, cpu, compact=True)).dtype == torch.int64


def test_multi_level_split(kernel_device):
    """Candidates of the segments split again (small tiles make the levels appear on small rows)."""
    s, lengths, starts = make_cases(4, 400, 12, kernel_device, with_starts=True)
    p = ix.launch_plan(4, 400, 4, kernel_device, split=12, tile=32, compact=False)
    assert p.levels == (12, 2)  # 12 segments -> 48 candidates -> 2 segments -> 8 candidates
    ws = ix.workspace_for(s, 4, plan=p)
    assert ws.shape == (4, 14, 4, 2)
    ws.fill_(7.0)
    check(s, lengths, 4, DcpGeometry(2, 1, 2, 2), starts, workspace=ws, plan=p)
    check_rank_local(s, lengths, 4, starts, workspace=ws, plan=p)
    assert ix.workspace_for(s, 4) is None  # no split: no workspace


BAD_INPUTS = [
    # (description, kwargs changed, exception, message fragment)
    ("scores not a tensor", dict(scores=[[1.0]]), TypeError, "scores"),
    ("scores int", dict(scores=torch.ones(2, 5, dtype=torch.int32)), TypeError, "scores"),
    ("scores 1-D", dict(scores=torch.ones(5)), ValueError, "scores"),
    ("lengths float", dict(lengths=torch.ones(2)), TypeError, "lengths"),
    ("lengths shape", dict(lengths=torch.ones(3, dtype=torch.int32)), ValueError, "lengths"),
    ("lengths negative", dict(lengths=torch.tensor([1, -1])), ValueError, "lengths"),
    ("lengths too long", dict(lengths=torch.tensor([1, 6])), ValueError, "lengths"),
    ("row_starts float", dict(row_starts=torch.zeros(2)), TypeError, "row_starts"),
    ("row_starts shape", dict(row_starts=torch.zeros(1, dtype=torch.int64)), ValueError, "row_starts"),
    ("row_starts past the end", dict(row_starts=torch.tensor([0, 6])), ValueError, "row_starts"),
    (
        "row_starts + lengths",
        dict(row_starts=torch.tensor([0, 4]), lengths=torch.tensor([2, 2])),
        ValueError,
        "row_starts",
    ),
    ("k = 0", dict(k=0), ValueError, "k"),
    ("k float", dict(k=2.0), TypeError, "k"),
    ("geometry a tuple", dict(geometry=(2, 1, 1, 1)), TypeError, "geometry"),
    ("geometry an int", dict(geometry=2), TypeError, "geometry"),
    ("geometry None", dict(geometry=None), TypeError, "geometry"),
    # A valid geometry the data does not fit: rank 1 of 2**22 ranks, its local key 4 is global id 2**24 + 1.
    ("geometry W=2**22: ids past 2**24", dict(geometry=DcpGeometry(2**22, 1)), ValueError, "lengths"),
    ("geometry W=2**22, no lengths", dict(geometry=DcpGeometry(2**22, 1), lengths=None), ValueError, "scores"),
    ("out shape", dict(out=torch.empty(2, 3, 2)), ValueError, "out"),
    ("out dtype", dict(out=torch.empty(2, 4, 2, dtype=torch.float64)), TypeError, "out"),
    ("out not contiguous", dict(out=torch.empty(2, 2, 4).transpose(1, 2)), ValueError, "out"),
    ("out misaligned", dict(out=torch.empty(17)[1:].view(2, 4, 2)), ValueError, "out"),
    ("workspace shape", dict(plan=dict(split=2), workspace=torch.empty(2, 3, 4, 2)), ValueError, "workspace"),
    ("order unknown", dict(order="local"), ValueError, "order"),
    ("out_ids without rank_local", dict(out_ids=torch.empty(2, 4, dtype=torch.int32)), ValueError, "out_ids"),
    ("rank_local out shape", dict(order="rank_local", out=torch.empty(2, 4, 2)), ValueError, "out"),
    ("rank_local out dtype", dict(order="rank_local", out=torch.empty(2, 4, dtype=torch.float64)), TypeError, "out"),
    (
        "rank_local out_ids dtype",
        dict(order="rank_local", out_ids=torch.empty(2, 4, dtype=torch.int64)),
        TypeError,
        "out_ids",
    ),
    (
        "rank_local out_ids shape",
        dict(order="rank_local", out_ids=torch.empty(2, 5, dtype=torch.int32)),
        ValueError,
        "out_ids",
    ),
    ("compact workspace dtype", dict(plan=dict(compact=True), workspace=torch.empty(2, 12)), TypeError, "workspace"),
    (
        "compact workspace shape",
        dict(plan=dict(compact=True), workspace=torch.zeros(2, 3, dtype=torch.int64)),
        ValueError,
        "workspace",
    ),
    ("validate not a bool", dict(validate=1), TypeError, "validate"),
    # plan=dict(...): launch_plan(rows=2, n_cols=5, k=4, the test's device, ...) with these changed
    ("plan not a LaunchPlan", dict(plan=(256, True, 4, 1)), TypeError, "plan"),
    ("plan for other rows", dict(plan=dict(rows=3)), ValueError, "plan"),
    ("plan for other columns", dict(plan=dict(n_cols=6)), ValueError, "plan"),
    ("plan for another k", dict(plan=dict(k=5)), ValueError, "plan"),
    ("plan for another device", dict(plan=dict(device="meta")), ValueError, "plan"),
]

#: launch_plan's bad arguments: (description, kwargs changed from rows=2, n_cols=5, k=4, exception, fragment).
BAD_KNOBS = [
    ("rows negative", dict(rows=-1), ValueError, "rows"),
    ("n_cols float", dict(n_cols=5.0), TypeError, "n_cols"),
    ("k = 0", dict(k=0), ValueError, "k"),
    ("device an int", dict(device=3), TypeError, "device"),
    ("vec negative", dict(vec=-1), ValueError, "vec"),
    ("radix_bits 4", dict(radix_bits=4), ValueError, "radix_bits"),
    ("radix_bits 16", dict(radix_bits=16), ValueError, "radix_bits"),
    ("tile not a power of two", dict(tile=100), ValueError, "tile"),
    ("num_warps 3", dict(num_warps=3), ValueError, "num_warps"),
    ("split 0", dict(split=0), ValueError, "split"),
    ("compact not a bool", dict(compact=1), TypeError, "compact"),
    ("compact with a huge k", dict(compact=True, k=5000), ValueError, "compact"),
    ("select unknown", dict(select="sort"), ValueError, "select"),
    ("sample not a power of two", dict(sample=100), ValueError, "sample"),
    ("pivots 2", dict(pivots=2), ValueError, "pivots"),
    ("engine unknown", dict(engine="cuda"), ValueError, "engine"),
]


@pytest.mark.parametrize("desc,change,exc,frag", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise_naming_the_argument(kernel_device, desc, change, exc, frag):
    args = dict(
        scores=torch.randn(2, 5), lengths=torch.tensor([5, 3]), k=4, geometry=DcpGeometry(2, 1), row_starts=None
    )
    args.update(change)
    args = {n: (v.to(kernel_device) if isinstance(v, torch.Tensor) and n != "out" else v) for n, v in args.items()}
    if isinstance(args.get("plan"), dict):
        args["plan"] = ix.launch_plan(**{**dict(rows=2, n_cols=5, k=4, device=kernel_device), **args["plan"]})
    with pytest.raises(exc, match=frag) as info:
        ix.indexer_topk_pack(**args)
    assert str(info.value).startswith(frag)


@pytest.mark.parametrize("desc,change,exc,frag", BAD_KNOBS, ids=[b[0] for b in BAD_KNOBS])
def test_bad_launch_knobs_raise_naming_the_argument(kernel_device, desc, change, exc, frag):
    """The launch decisions are launch_plan's arguments: it checks them (the call takes the plan as made)."""
    with pytest.raises(exc, match=frag) as info:
        ix.launch_plan(**{**dict(rows=2, n_cols=5, k=4, device=kernel_device), **change})
    assert str(info.value).startswith(frag)


def test_a_plan_is_checked_against_the_call_and_used_as_is(kernel_device):
    """``plan=None`` is the default plan by shape: the same output, bit for bit, as ``plan=launch_plan(<this
    shape>)``; a plan made for another shape (rows, columns, k) or device is refused, naming ``plan``, by the call
    and by workspace_for; a forced plan is what runs (its workspace, not the default's)."""
    s, lengths, starts = make_cases(8, 100, 21, kernel_device, with_starts=True)
    g = DcpGeometry(3, 1, 2, 2)
    for k in (1, 17, 64):
        same = ix.launch_plan(8, 100, k, kernel_device, vec=ix.scores_vec(s))
        assert same == ix.launch_plan(*s.shape, k, s.device, vec=ix.scores_vec(s))  # a value: made twice, equal
        got = ix.indexer_topk_pack(s, lengths, k, g, starts, plan=same)
        assert torch.equal(pair_bits(got), pair_bits(ix.indexer_topk_pack(s, lengths, k, g, starts)))
        rl = ix.indexer_topk_pack(s, lengths, k, g, starts, order="rank_local", plan=same)
        want = ix.indexer_topk_pack(s, lengths, k, g, starts, order="rank_local")
        assert torch.equal(rl[1], want[1]) and torch.equal(rl[0].view(torch.int32), want[0].view(torch.int32))
    others = {
        "rows": ix.launch_plan(7, 100, 17, kernel_device),
        "columns": ix.launch_plan(8, 99, 17, kernel_device),
        "k": ix.launch_plan(8, 100, 16, kernel_device),
        "device": ix.launch_plan(8, 100, 17, "meta"),
        "a forced path": ix.launch_plan(8, 100, 16, kernel_device, tile=32, split=2),
    }
    for why, other in others.items():
        with pytest.raises(ValueError, match=r"^plan was made for rows=") as info:
            ix.indexer_topk_pack(s, lengths, 17, g, starts, plan=other)
        assert "not for this call's rows=8, n_cols=100, k=17" in str(info.value), why
        with pytest.raises(ValueError, match=r"^plan was made for"):
            ix.workspace_for(s, 17, plan=other)
    # a forced plan runs as made: the split streamed path reads its own workspace (and refuses the default's none)
    forced = ix.launch_plan(8, 100, 17, kernel_device, tile=32, split=3, compact=False)
    assert forced.levels and forced.later and ix.workspace_for(s, 17) is None
    ws = ix.workspace_for(s, 17, plan=forced)
    assert ws is not None and ws.shape == (8, sum(forced.levels), 17, 2)
    check(s, lengths, 17, g, starts, plan=forced, workspace=ws)
    with pytest.raises(ValueError, match=r"^workspace"):
        ix.indexer_topk_pack(s, lengths, 17, g, starts, plan=forced, workspace=torch.empty(8, 1, 17, 2))


def test_ids_beyond_float32_exact_range_raise_even_without_validate():
    # W = 8: local key 2**21 of rank 1 is global id 2**24 + 1, not exact in float32.
    s = torch.zeros(1, 2**21 + 1)
    for validate in (True, False):
        with pytest.raises(ValueError, match="2\\*\\*24"):
            ix.indexer_topk_pack(s, None, 4, DcpGeometry(8, 1), validate=validate)
    with pytest.raises(ValueError, match="2\\*\\*24"):
        ix.indexer_topk_pack(s, torch.tensor([2**21 + 1]), 4, DcpGeometry(8, 1))


COMPILE_SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dcp_ref.kernels.indexer_triton import DEFAULT_RADIX_BITS, filter_topk_kernel, indexer_topk_pack_kernel

def compile_one(kern, sig, cst, warps, aligned):
    sig = dict(sig)
    sig.update({name: "constexpr" for name in cst})
    names = list(kern.arg_names)
    # what the launcher specialises: 16-byte aligned pointers and multiples of 16
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    c = triton.compile(ASTSource(kern, signature=sig, constexprs=cst, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return {"ptx_target": "sm_90a" in c.asm["ptx"], "cubin": len(c.asm["cubin"]) > 0, "shared": c.metadata.shared}

report = []
for tile, one, warps, packed, k1, select, split_out in json.loads(sys.argv[1]):
    sig = {"scores_ptr": "*fp32", "lengths_ptr": "*i32", "starts_ptr": "*i64",
           "out_ptr": "*fp32" if split_out else "*i64", "n_cols": "i32",
           "seg_len": "i32", "stride_r": "i32", "stride_c": "i32" if packed else "constexpr",
           "out_stride_r": "constexpr" if k1 else "i32", "k": "constexpr" if k1 else "i32", "rank": "i32",
           "ids_ptr": "*i32" if split_out else "constexpr", "chk_ptr": "*i64"}
    cst = {"HAS_LENGTHS": not packed, "HAS_STARTS": not packed, "WORLD": 2, "INTERLEAVE": 4, "PACKED_INPUT": packed,
           "NAN_PAD": packed, "RADIX_BITS": DEFAULT_RADIX_BITS, "TILE": tile, "ONE_CHUNK": one,
           "PAD_BLOCK": 1 if k1 else 1024, "LOCAL_IDS": split_out, "SPLIT_OUT": split_out, "SELECT": select,
           "PIVOTS": 3, "CHECK": not packed}
    cst.update({} if packed else {"stride_c": 1})
    cst.update({"k": 1, "out_stride_r": 1} if k1 else {})
    cst.update({} if split_out else {"ids_ptr": None})
    report.append(compile_one(indexer_topk_pack_kernel, sig, cst, warps, ("scores_ptr", "out_ptr", "stride_r")))
for segments, tile, cap, sample, warps, select, split_out in json.loads(sys.argv[2]):
    sig = {"scores_ptr": "*fp32", "lengths_ptr": "*i32", "starts_ptr": "*i64",
           "out_ptr": "*fp32" if split_out else "*i64", "ids_ptr": "*i32", "ws_ptr": "*i64", "chk_ptr": "*i64",
           "n_cols": "i32", "seg_len": "i32", "stride_r": "i32", "ws_stride_r": "i32", "k": "i32", "rank": "i32",
           "mid": "i32"}
    cst = {"HAS_LENGTHS": True, "HAS_STARTS": True, "WORLD": 2, "INTERLEAVE": 4, "SEGMENTS": segments,
           "SEG_POW2": triton.next_power_of_2(segments), "TILE": tile, "CAP": cap, "SAMPLE": sample, "SELECT": select,
           "PIVOTS": 3, "RADIX_BITS": DEFAULT_RADIX_BITS, "PAD_BLOCK": 1024, "SPLIT_OUT": split_out, "CHECK": True,
           "stride_c": 1}
    report.append(compile_one(filter_topk_kernel, sig, cst, warps, ("scores_ptr", "ws_ptr", "stride_r", "seg_len")))
print(json.dumps(report))
"""


def test_compiles_for_sm90a_on_the_cpu():
    """The interpreter does not type-check like the compiler: compile the kernels' main variants
    to sm_90a PTX and cubin (no GPU needed), in a fresh process without TRITON_INTERPRET."""
    import json
    import os
    import subprocess
    import sys

    # indexer_topk_pack_kernel: (tile, one_chunk, warps, packed input, k = 1, select, rank-local output): the decode
    # row in registers (radix; search + rank-local), a streamed row, a split row's last launch with k specialised to 1
    configs = [
        (8192, True, 32, False, False, 0, False),
        (8192, True, 16, False, False, 1, True),
        (4096, False, 16, False, False, 0, False),
        (256, True, 4, True, True, 0, False),
    ]
    # filter_topk_kernel: (segments, tile, cap, sample, warps, select, rank-local output)
    filters = [(1, 2048, 4096, 2048, 8, 1, False), (16, 2048, 4096, 8192, 16, 0, True)]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, json.dumps(configs), json.dumps(filters)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if proc.returncode and ("ModuleNotFoundError" in proc.stderr or "ImportError" in proc.stderr):
        pytest.skip(f"this Triton cannot compile ahead of time here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report) == len(configs) + len(filters)
    for r in report:
        assert r["ptx_target"] and r["cubin"] and r["shared"] <= 64 * 1024, r


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

#: (rows, cols, k, W, I, rank, starts, split): ≥ 10 000 rows in all.
GPU_CONFIGS = [
    (1000, 1, 1, 1, 1, 0, False, None),
    (1000, 37, 5, 2, 1, 1, True, None),
    (1000, 300, 64, 3, 2, 2, False, None),
    (1000, 2048, 2048, 2, 1, 0, False, None),
    (1000, 4096, 2048, 4, 8, 3, True, None),
    (1000, 8192, 2048, 2, 1, 1, False, None),
    (800, 8192, 1, 8, 64, 5, False, None),
    (800, 5000, 4096, 2, 1, 0, False, None),
    (600, 9000, 2048, 2, 1, 1, True, None),
    (400, 32768, 2048, 2, 1, 0, False, None),
    (300, 32768, 2048, 2, 4, 1, False, 4),
    (200, 20000, 777, 3, 1, 2, True, 3),
    (64, 131072, 2048, 1, 1, 0, False, None),
    (32, 131072, 2048, 1, 1, 0, False, 16),
    (16, 131072, 4096, 2, 2, 1, True, 8),
    (300, 16384, 512, 2, 1, 0, False, 2),
    (600, 1024, 128, 4, 2, 3, True, None),  # brings the total past 10 000 rows (it was 9 512)
]

#: The paths the differential test runs every config through: the default plan (rows in registers by the default
#: select; long rows streamed, or compacted where :func:`prefer_compact` says so), and the streamed radix path with
#: its split levels (the compacted path's fallback). The compacted path itself: test_gpu_compacted_paths_at_scale.
GPU_PATHS = {"default": dict(), "streamed": dict(compact=False, select="radix")}


@pytest.mark.gpu
@pytest.mark.parametrize("path", sorted(GPU_PATHS))
def test_gpu_differential_10k_adversarial_rows(cuda_device, path):
    """Every config on the default plan (≥ 10 000 rows); the streamed path on the configs whose rows do not fit
    a tile (the ones it runs for: the rest would only add compilations)."""
    total, failures = 0, []
    for c, (rows, cols, k, w, i, rank, with_starts, split) in enumerate(GPU_CONFIGS):
        if path == "streamed" and cols <= ix.MAX_TILE:
            continue
        s, lengths, starts = make_cases(rows, cols, 100 + c, cuda_device, with_starts)
        want = reference(s, lengths, k, DcpGeometry(w, rank, i, i), starts)
        out = torch.full((rows, k, 2), float("nan"), device=cuda_device)  # poison
        got = ix.indexer_topk_pack(
            s,
            lengths,
            k,
            DcpGeometry(w, rank, i, i),
            starts,
            out=out,
            **planned(s, k, dict(split=split, **GPU_PATHS[path])),
        )
        bad = ~same_sets(got, want)
        if bool(bad.any()):
            r = int(bad.nonzero()[0])
            failures.append(
                f"config {c} {(rows, cols, k, w, i, split)}: {int(bad.sum())} rows differ, first {r} "
                f"({FLAVOURS[r % len(FLAVOURS)]})"
            )
        assert_kernel_order(got)
        total += rows
    assert not failures, failures
    assert total >= (10_000 if path == "default" else 1_500)


@pytest.mark.gpu
def test_gpu_rank_local_matches_the_reference(cuda_device):
    """order="rank_local" on every path: exactly local_topk_rank_local (ids, score bits, NaN / -1 padding)."""
    for c, (rows, cols, k, split, kw) in enumerate(
        [
            (1000, 4096, 2048, None, dict()),  # a row in registers (search)
            (1000, 8192, 2048, None, dict(select="radix")),
            (400, 32768, 2048, None, dict(compact=True)),  # compacted, one program per row
            (32, 131072, 2048, 16, dict(compact=True)),  # compacted, 16 segments per row
            (200, 20000, 777, 3, dict(compact=False)),  # streamed, split levels
        ]
    ):
        s, lengths, starts = make_cases(rows, cols, 300 + c, cuda_device, with_starts=c % 2 == 1)
        check_rank_local(s, lengths, k, starts, split=split, **kw)


@pytest.mark.gpu
def test_gpu_compacted_paths_at_scale(cuda_device):
    """The compacted path on long rows, T up to 1024: every flavour, one and many segments per row, and its ways
    taken (the list; ties at the bound: the constant and few-value rows; the fallback: rows whose sampled keys
    are their smallest; the keys above the bound listed again, when some tied rows call for it)."""
    seen = {1: 0, 2: 0, 3: 0, 4: 0}
    for c, (rows, cols, k, split, hide) in enumerate(
        [
            (1024, 32768, 2048, 1, False),
            (128, 131072, 2048, 2, False),
            (8, 131072, 2048, 16, True),
            (256, 12000, 1000, 1, True),
            (64, 65536, 4096, 4, False),
        ]
    ):
        s, lengths, starts = make_cases(rows, cols, 400 + c, cuda_device, with_starts=c % 2 == 1)
        plan = ix.launch_plan(rows, cols, k, cuda_device, split=split, compact=True)  # asked for: not by shape
        assert plan.compact
        if hide:  # the sampled keys of every row made its smallest: the bound misses, the fallback runs
            for r in range(0, rows, 3):
                n = int(lengths[r])
                pos = (torch.arange(plan.sample, device=cuda_device) * n) // plan.sample
                base = 0 if starts is None else int(starts[r])
                s[r, base + pos[pos < n]] = -1e30
        ws = ix.workspace_for(s, k, plan=plan)
        check(s, lengths, k, DcpGeometry(2, 1), starts, plan=plan, workspace=ws)
        for p, cnt in zip(*torch.unique(ix.compact_paths(ws), return_counts=True)):
            seen[int(p)] += int(cnt)
    assert seen[1] and seen[2] and seen[4], seen


@pytest.mark.gpu
def test_gpu_search_and_radix_select_rows_in_registers(cuda_device):
    """Both selects of a row held in registers, every tile size the plan uses, on ≥ 10 000 adversarial rows."""
    total = 0
    for c, (rows, cols, k) in enumerate([(2000, 300, 64), (2000, 1024, 128), (2000, 4096, 2048), (2000, 8192, 2048),
                                         (2000, 8192, 1), (1000, 5000, 4096)]):  # fmt: skip
        s, lengths, starts = make_cases(rows, cols, 500 + c, cuda_device, with_starts=c % 2 == 0)
        for kw in (dict(select="search"), dict(select="search", pivots=1), dict(select="radix")):
            check(s, lengths, k, DcpGeometry(2, 1), starts, **kw)
        total += rows
    assert total >= 10_000


@pytest.mark.gpu
def test_gpu_spot_check_against_brute_force(cuda_device):
    s, lengths, starts = make_cases(16, 300, 5, "cpu", with_starts=True)
    k, rank, w, i = 20, 1, 2, 2
    got = ix.indexer_topk_pack(
        s.to(cuda_device), lengths.to(cuda_device), k, DcpGeometry(w, rank, i, i), starts.to(cuda_device)
    ).cpu()
    for r in range(16):
        row = got[r].tolist()
        n = sum(p[1] >= 0 for p in row)
        assert sorted(tuple(p) for p in row[:n]) + [tuple(p) for p in row[n:]] == brute_packed(
            s[r].tolist(), k, int(starts[r]), int(lengths[r]), w, rank, i
        )


@pytest.mark.gpu
@pytest.mark.parametrize("cols,split,compact,order", [
    (8192, 1, None, "global_id"), (32768, 1, True, "global_id"), (32768, 1, True, "rank_local"),
    (131072, 16, True, "global_id"), (131072, 4, True, "rank_local"), (131072, 16, False, "global_id"),
    # no Triton knob: the default plan, the CuTeDSL engine (one CTA; clusters of 2 and 8)
    (8192, None, None, "global_id"), (32768, None, None, "rank_local"), (131072, None, None, "global_id"),
])  # fmt: skip
def test_gpu_cuda_graph_capture_and_replay(cuda_device, cols, split, compact, order):
    """Captured once with out= (and the planned workspace=); replayed on new scores and lengths in place. The
    compacted path's split rows meet at an atomic counter in the workspace: every replay must leave it at 0.
    ``split=None, compact=None``: the default plan (on the GPU the CuTeDSL kernel, which needs no workspace)."""
    rows, k = 32, 2048
    s, lengths, _ = make_cases(rows, cols, 7, cuda_device)
    rank_local = order == "rank_local"
    out = torch.empty((rows, k) if rank_local else (rows, k, 2), device=cuda_device)
    out_ids = torch.empty((rows, k), dtype=torch.int32, device=cuda_device) if rank_local else None
    plan = planned(s, k, dict(split=split, compact=compact))["plan"]  # no knob given: the default plan, as made
    ws = ix.workspace_for(s, k, plan=plan)

    def call():
        return ix.indexer_topk_pack(
            s,
            lengths,
            k,
            DcpGeometry(2, 1),
            out=out,
            validate=False,
            plan=plan,
            workspace=ws,
            order=order,
            out_ids=out_ids,
        )

    call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for seed in (8, 9, 10):
        s2, l2, _ = make_cases(rows, cols, seed, cuda_device)
        s.copy_(s2)
        lengths.copy_(l2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        if rank_local:
            ws_, wi = local_topk_rank_local(s, k, lengths)
            assert torch.equal(out_ids, wi) and torch.equal(out.view(torch.int32), ws_.view(torch.int32))
        else:
            assert bool(same_sets(out, reference(s, lengths, k, DcpGeometry(2, 1))).all())
        if ws is not None and ws.dtype == torch.int64:
            assert not bool(ws[:, -2].any())  # the arrival counters are back at 0


@pytest.mark.gpu
@pytest.mark.parametrize("split,compact", [(1, None), (1, True), (4, True), (4, False), (None, None)])
def test_gpu_validate_false_makes_no_host_sync(cuda_device, split, compact):
    """validate=False with out= and workspace=: no synchronising CUDA call (sync debug mode raises)."""
    rows, cols, k = 8, 40000, 512
    s, lengths, starts = make_cases(rows, cols, 11, cuda_device, with_starts=True)
    out = torch.empty((rows, k, 2), device=cuda_device)
    plan = planned(s, k, dict(split=split, compact=compact))["plan"]
    ws = ix.workspace_for(s, k, plan=plan)

    def call():
        return ix.indexer_topk_pack(
            s,
            lengths,
            k,
            DcpGeometry(2, 0),
            starts,
            out=out,
            validate=False,
            plan=plan,
            workspace=ws,
        )

    call()  # compile first (compilation itself may synchronise)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(same_sets(out, reference(s, lengths, k, DcpGeometry(2, 0), starts)).all())


@pytest.mark.gpu
def test_gpu_validated_call_raises_and_recovers(cuda_device):
    """validate=True on the GPU: one flag read back; a bad window raises the host message, the next good call
    (same thread and stream: same flag) passes."""
    s, lengths, _ = make_cases(64, 20000, 12, cuda_device)
    bad = lengths.clone()
    bad[17] = 20001
    with pytest.raises(ValueError, match=r"^lengths must be <= scores.shape\[1\]=20000"):
        ix.indexer_topk_pack(s, bad, 2048, DcpGeometry(2, 0))
    got = ix.indexer_topk_pack(s, lengths, 2048, DcpGeometry(2, 0))
    assert bool(same_sets(got, reference(s, lengths, 2048, DcpGeometry(2, 0))).all())
