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


def test_all_to_all_sends_chunk_j_to_rank_j() -> None:
    w = SimulatedWorld(3)

    def body(g):
        x = torch.stack([torch.full((2,), 10.0 * g.rank + j) for j in range(3)])  # chunk j: for rank j
        out = torch.empty(3, 2)
        got = g.all_to_all(x, out=out)
        return got is out, out.tolist(), g.all_to_all(x).tolist()

    for r, (same, got, fresh) in enumerate(w.run(body)):
        expected = [[10.0 * j + r] * 2 for j in range(3)]  # rank j's chunk for rank r
        assert same and got == expected and fresh == expected


def test_all_to_all_checks_its_arguments() -> None:
    g = SingleGroup()
    x = torch.arange(6.0).reshape(1, 6)
    assert torch.equal(g.all_to_all(x), x) and g.all_to_all(x).data_ptr() != x.data_ptr()
    with pytest.raises(ValueError, match=r"x must be \[W=1, \.\.\.\]"):
        g.all_to_all(torch.ones(2, 3))
    with pytest.raises(ValueError, match="out must not share memory with x"):
        g.all_to_all(x, out=x)


@pytest.mark.parametrize("op", ["all_to_all", "all_gather", "reduce_scatter"])
def test_a_collective_refuses_an_out_that_overlaps_x(op) -> None:
    """A partial overlap (``out`` a shifted window of ``x``'s buffer) is refused by name on every rank, before any
    exchange — not torch's own error from inside, and never a schedule-dependent answer."""

    def body(grp):  # noqa: ANN001, ANN202
        buf = torch.zeros(8)
        if op == "all_to_all":
            x, out = buf[:4].view(2, 2), buf[2:6].view(2, 2)
        elif op == "all_gather":
            x, out = buf[:2], buf[1:5].view(2, 2)
        else:
            x, out = buf[:4], buf[3:5]
        try:
            getattr(grp, op)(x, out=out)
        except ValueError as e:
            return str(e)
        return None

    for msg in SimulatedWorld(2).run(body):
        assert msg is not None and msg.startswith("out must not share memory with x"), msg
    with pytest.raises(ValueError, match=r"x must be \[W=2, \.\.\.\]"):
        SimulatedWorld(2).run(lambda grp: grp.all_to_all(torch.ones(3, 1)))


@pytest.mark.parametrize("dim", [2, -3, 5])
def test_reduce_scatter_refuses_a_dim_out_of_range(dim) -> None:
    with pytest.raises(ValueError, match=r"dim must lie in \[-2, 2\)"):
        SingleGroup().reduce_scatter(torch.ones(2, 2), dim)
    with pytest.raises(TypeError, match="dim must be an int"):
        SingleGroup().reduce_scatter(torch.ones(2, 2), 0.0)  # type: ignore[arg-type]


def test_two_callers_of_one_world_are_serialised_not_mixed() -> None:
    """Two threads run the same SimulatedWorld at once: each gets its own data back (the runs take turns)."""
    import threading

    w = SimulatedWorld(2)
    results: dict[int, list] = {}

    def caller(tag: int) -> None:
        results[tag] = w.run(
            lambda g, x: g.all_gather(x).tolist(), [torch.tensor([tag, 0.0]), torch.tensor([tag, 1.0])]
        )

    threads = [threading.Thread(target=caller, args=(tag,)) for tag in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for tag in (1, 2, 3):
        assert results[tag] == [[[tag, 0.0], [tag, 1.0]]] * 2


def test_a_rank_cannot_run_its_own_world() -> None:
    w = SimulatedWorld(2)
    with pytest.raises(RuntimeError, match="called from one of its own ranks"):
        w.run(lambda g: w.run(lambda h: None))


def test_symmetric_memory_group_falls_back_and_says_why() -> None:
    """Without CUDA (or at W = 1) every collective goes to the fallback group, with the same results."""
    from dcp_ref.group import SymmetricMemoryGroup

    one = SymmetricMemoryGroup(SingleGroup())
    assert one.transport == "fallback" and "one rank" in one.why_fallback
    x = torch.arange(6.0).reshape(1, 2, 3)
    assert torch.equal(one.all_to_all(x), x) and torch.equal(one.all_gather(x[0]), x)
    assert torch.equal(one.reduce_scatter(x[0], 0), x[0])

    def body(g):
        sg = SymmetricMemoryGroup(g, capacity_bytes=1024)
        xs = torch.stack([torch.full((2,), 10.0 * g.rank + j) for j in range(3)])
        out = torch.empty(3, 2)
        return (
            sg.transport,
            sg.why_fallback,
            sg.all_to_all(xs, out=out) is out,
            out.tolist(),
            sg.all_gather(xs[0]).tolist(),
        )

    for r, (transport, why, same, a2a, ag) in enumerate(SimulatedWorld(3).run(body)):
        assert transport == "fallback" and why and same
        assert a2a == [[10.0 * j + r] * 2 for j in range(3)]
        assert ag == [[10.0 * j] * 2 for j in range(3)]


def test_symmetric_memory_group_checks_its_arguments() -> None:
    from dcp_ref.group import SymmetricMemoryGroup

    with pytest.raises(TypeError, match="fallback must be a Group"):
        SymmetricMemoryGroup(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity_bytes must be >= 16"):
        SymmetricMemoryGroup(SingleGroup(), capacity_bytes=8)
