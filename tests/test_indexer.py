"""The indexer stage: dcp_ref.indexer.local_topk (and its rank-local layout) against a pure-Python brute force."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_ref.geometry import DcpGeometry
from dcp_ref.indexer import local_topk, local_topk_rank_local, reference_indexer_rank_local


def brute(row: list[float], k: int, start: int, length: int) -> list[int]:
    """Local keys j in [0, length) at column start + j; score descending (-0.0 == +0.0, NaN
    invalid), then lower j; -1 padded to k."""
    cand = [(row[start + j] + 0.0, j) for j in range(length) if not math.isnan(row[start + j])]
    cand.sort(key=lambda c: (-c[0], c[1]))
    got = [j for _, j in cand[:k]]
    return got + [-1] * (k - len(got))


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 5),
    cols=st.integers(0, 30),
    k=st.integers(1, 12),
    ties=st.booleans(),
    use_starts=st.booleans(),
    use_lengths=st.booleans(),
)
def test_local_topk_matches_brute_force(data, rows, cols, k, ties, use_starts, use_lengths) -> None:
    pool = [0.0, -0.0, 1.0, -1.0, float("nan"), float("-inf"), 2.5] if ties else None
    vals = [
        [data.draw(st.sampled_from(pool)) if ties else data.draw(st.floats(-5, 5, width=32)) for _ in range(cols)]
        for _ in range(rows)
    ]
    logits = torch.tensor(vals, dtype=torch.float32).reshape(rows, cols)
    starts = [data.draw(st.integers(0, cols)) if use_starts else 0 for _ in range(rows)]
    lengths = [data.draw(st.integers(0, cols - s)) if use_lengths else cols - s for s in starts]
    got = local_topk(
        logits,
        k,
        lengths=torch.tensor(lengths) if use_lengths else None,
        row_starts=torch.tensor(starts) if use_starts else None,
    )
    want = [brute(logits[r].tolist(), k, starts[r], lengths[r]) for r in range(rows)]
    assert got.tolist() == want


def test_local_topk_row_starts_window() -> None:
    # Two requests side by side: columns 0-2 belong to request 0, 3-6 to request 1.
    logits = torch.tensor([[9.0, 8.0, 7.0, 1.0, 5.0, 5.0, 3.0]] * 2)
    got = local_topk(logits, 3, lengths=torch.tensor([2, 4]), row_starts=torch.tensor([0, 3]))
    # row 0: keys 0,1 only (9, 8); row 1: keys j of columns 3..6 -> (1, 5, 5, 3): j=1, j=2 (tie: lower j), j=3
    assert got.tolist() == [[0, 1, -1], [1, 2, 3]]


def test_local_topk_errors() -> None:
    x = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="row_starts must have shape"):
        local_topk(x, 2, row_starts=torch.tensor([0]))
    with pytest.raises(ValueError, match="row_starts must be <= cols"):
        local_topk(x, 2, row_starts=torch.tensor([0, 6]))
    with pytest.raises(ValueError, match="row_starts \\+ lengths must be <= cols"):
        local_topk(x, 2, lengths=torch.tensor([3, 3]), row_starts=torch.tensor([0, 3]))
    with pytest.raises(ValueError, match=r"non-negative|>= 0"):
        local_topk(x, 2, row_starts=torch.tensor([0, -1]))
    with pytest.raises(TypeError):
        local_topk(x, 2, row_starts=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="k"):
        local_topk(x, 0)


def bits(x: float) -> int:
    """float32 bit pattern (so -0.0 != +0.0 and NaN == NaN when compared)."""
    return int(torch.tensor([x], dtype=torch.float32).view(torch.int32)[0])


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    rows=st.integers(1, 5),
    cols=st.integers(0, 30),
    k=st.integers(1, 12),
    ties=st.booleans(),
    use_starts=st.booleans(),
    use_lengths=st.booleans(),
)
def test_rank_local_layout_matches_brute_force(data, rows, cols, k, ties, use_starts, use_lengths) -> None:
    """The winners of the brute force, in ascending local index, their exact float32 scores; NaN / -1 padding."""
    pool = [0.0, -0.0, 1.0, -1.0, float("nan"), float("-inf"), float("inf"), 2.5, 1e-45] if ties else None
    vals = [
        [data.draw(st.sampled_from(pool)) if ties else data.draw(st.floats(-5, 5, width=32)) for _ in range(cols)]
        for _ in range(rows)
    ]
    logits = torch.tensor(vals, dtype=torch.float32).reshape(rows, cols)
    starts = [data.draw(st.integers(0, cols)) if use_starts else 0 for _ in range(rows)]
    lengths = [data.draw(st.integers(0, cols - s)) if use_lengths else cols - s for s in starts]
    scores, ids = local_topk_rank_local(
        logits,
        k,
        lengths=torch.tensor(lengths) if use_lengths else None,
        row_starts=torch.tensor(starts) if use_starts else None,
    )
    assert scores.dtype == torch.float32 and ids.dtype == torch.int32 and scores.shape == ids.shape == (rows, k)
    for r in range(rows):
        win = sorted(j for j in brute(logits[r].tolist(), k, starts[r], lengths[r]) if j >= 0)
        assert ids[r].tolist() == win + [-1] * (k - len(win))
        want = [bits(logits[r, starts[r] + j].item()) for j in win] + [bits(float("nan"))] * (k - len(win))
        assert [bits(v) for v in scores[r].tolist()] == want


def test_rank_local_keeps_minus_inf_winners_and_pads_with_nan() -> None:
    # -inf is a valid score that can win; only NaN (masked) keys are never selected
    logits = torch.tensor([[float("-inf"), float("nan"), -0.0, float("-inf"), 3.0]])
    scores, ids = local_topk_rank_local(logits, 6)
    assert ids.tolist() == [[0, 2, 3, 4, -1, -1]]
    assert [bits(v) for v in scores[0].tolist()] == [bits(v) for v in (float("-inf"), -0.0, float("-inf"), 3.0)] + [
        bits(float("nan"))
    ] * 2
    scores, ids = local_topk_rank_local(logits, 2)  # the two largest, in index order: -0.0 (j=2) and 3.0 (j=4)
    assert ids.tolist() == [[2, 4]] and [bits(v) for v in scores[0].tolist()] == [bits(-0.0), bits(3.0)]


def test_reference_indexer_rank_local_writes_its_buffers() -> None:
    logits = torch.tensor([[9.0, 8.0, 7.0, 1.0, 5.0, 5.0, 3.0]] * 2)
    g = DcpGeometry(2, 1, 1, 64)
    out = torch.full((2, 3), 7.0)
    out_ids = torch.full((2, 3), 7, dtype=torch.int32)
    s, ids = reference_indexer_rank_local(logits, torch.tensor([2, 7]), g, 3, row_starts=None, out=out, out_ids=out_ids)
    assert s is out and ids is out_ids
    assert ids.tolist() == [[0, 1, -1], [0, 1, 2]] and s[1].tolist() == [9.0, 8.0, 7.0] and bool(torch.isnan(s[0, 2]))
    s, ids = reference_indexer_rank_local(logits, torch.tensor([3, 4]), g, 2, row_starts=torch.tensor([0, 3]))
    assert ids.tolist() == [[0, 1], [1, 2]] and s.tolist() == [[9.0, 8.0], [5.0, 5.0]]
    with pytest.raises(ValueError, match=r"^out must be a buffer of shape"):
        reference_indexer_rank_local(logits, torch.tensor([2, 7]), g, 3, out=torch.empty(2, 4))
    with pytest.raises(TypeError, match=r"^out_ids must be a int32 buffer"):
        reference_indexer_rank_local(logits, torch.tensor([2, 7]), g, 3, out_ids=torch.empty(2, 3))
    with pytest.raises(TypeError, match=r"^geometry"):
        reference_indexer_rank_local(logits, torch.tensor([2, 7]), None, 3)  # type: ignore[arg-type]
