"""DcpGeometry: validated once; local_count equals a brute-force deal of positions over ranks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dcp_ref.geometry import DcpGeometry, local_count


def brute_local_count(n: int, world_size: int, rank: int, interleave: int) -> int:
    """Deal positions 0..n-1 like cards: I to rank 0, I to rank 1, ... (independent of the closed form)."""
    return sum(1 for p in range(n) if (p // interleave) % world_size == rank)


@settings(max_examples=60, deadline=None)
@given(w=st.integers(1, 9), i=st.integers(1, 5), data=st.data())
def test_local_count_equals_the_deal(w: int, i: int, data: st.DataObject) -> None:
    r = data.draw(st.integers(0, w - 1))
    ns = data.draw(st.lists(st.integers(-3, 120), min_size=1, max_size=8))
    got = local_count(torch.tensor(ns, dtype=torch.int32), w, r, i)
    assert got.dtype == torch.int32
    assert got.tolist() == [brute_local_count(max(n, 0), w, r, i) for n in ns]
    g = DcpGeometry(w, r, i, block_size=i * 2)
    assert g.local_count(torch.tensor(ns)).tolist() == got.tolist()


def test_geometry_is_validated_and_normalised() -> None:
    g = DcpGeometry(4, torch.tensor(3), 2, 8)
    assert (g.world_size, g.rank, g.interleave, g.block_size, g.stripe) == (4, 3, 2, 8, 8)
    assert type(g.rank) is int
    assert [x.rank for x in g.all_ranks()] == [0, 1, 2, 3] and g.with_rank(0) == DcpGeometry(4, 0, 2, 8)
    with pytest.raises(ValueError, match="rank must satisfy"):
        DcpGeometry(2, 2)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        DcpGeometry(0, 0)
    with pytest.raises(ValueError, match="block_size must be a multiple of interleave"):
        DcpGeometry(2, 0, 4, 6)
    with pytest.raises(TypeError, match="interleave must be a Python int"):
        DcpGeometry(2, 0, 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="rank must be a Python int"):
        DcpGeometry(2, True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank must be >= 0"):
        DcpGeometry(2, -1)
    with pytest.raises(AttributeError):
        g.rank = 0  # type: ignore[misc]  # frozen: a shard's geometry cannot drift
