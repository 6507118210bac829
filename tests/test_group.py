"""Group implementations: collectives into caller buffers, and a SimulatedWorld that never hangs
silently or mixes up two different collectives."""

from __future__ import annotations

import pytest
import torch

from dcp_ref.group import SimulatedWorld, SingleGroup


def test_collectives_write_into_out_buffers() -> None:
    w = SimulatedWorld(3)

    def body(g):
        x = torch.full((2,), float(g.rank))
        out = torch.empty(3, 2)
        got = g.all_gather(x, out=out)
        rs_out = torch.empty(2, 4)
        rs = g.reduce_scatter(torch.arange(24.0).reshape(6, 4) * (g.rank + 1), 0, out=rs_out)
        return got is out, out.tolist(), rs is rs_out, rs.tolist()

    res = w.run(body)
    full = torch.arange(24.0).reshape(6, 4) * 6  # 1 + 2 + 3
    for r, (same, gathered, same_rs, scattered) in enumerate(res):
        assert same and same_rs
        assert gathered == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]
        assert scattered == full[2 * r : 2 * r + 2].tolist()


def test_out_buffers_are_checked() -> None:
    g = SingleGroup()
    x = torch.ones(2, 3)
    with pytest.raises(ValueError, match="out must be a contiguous"):
        g.all_gather(x, out=torch.empty(2, 3))
    with pytest.raises(TypeError, match="out must have dtype"):
        g.all_gather(x, out=torch.empty(1, 2, 3, dtype=torch.float64))
    assert torch.equal(g.all_gather(x, out=torch.empty(1, 2, 3)), x[None])
    with pytest.raises(ValueError, match="out must be a contiguous"):
        SimulatedWorld(2).run(lambda grp: grp.reduce_scatter(torch.ones(4, 2), 0, out=torch.empty(4, 2)))


def test_different_collectives_with_equal_shapes_raise() -> None:
    w = SimulatedWorld(2)
    with pytest.raises(ValueError, match="collective mismatch: rank 1 called reduce_scatter"):
        w.run(lambda g: g.all_gather(torch.ones(4)) if g.rank == 0 else g.reduce_scatter(torch.ones(4), 0))


def test_a_rank_that_never_arrives_is_named() -> None:
    w = SimulatedWorld(3, timeout_s=0.3)

    def body(g):
        if g.rank == 1:
            return None  # never joins the collective
        return g.all_gather(torch.ones(1))

    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] did not arrive"):
        w.run(body)


def test_rank_error_is_raised_not_the_timeout() -> None:
    w = SimulatedWorld(2, timeout_s=5)

    def body(g):
        if g.rank == 0:
            raise KeyError("boom on rank 0")
        return g.all_gather(torch.ones(1))

    with pytest.raises(KeyError, match="boom"):
        w.run(body)


@pytest.mark.parametrize("bad", [0, -1.0, "10", True, float("nan")])
def test_timeout_is_validated(bad) -> None:
    with pytest.raises(ValueError, match="timeout_s must be a number > 0"):
        SimulatedWorld(2, timeout_s=bad)


def test_run_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="fn must be callable"):
        SimulatedWorld(2).run(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="per_rank_args\\[0\\] must have world_size=2 items"):
        SimulatedWorld(2).run(lambda g, a: a, [1])
