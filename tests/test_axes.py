"""The planned step as one part per option axis (dcp_ref.axes): what each choice plans, binds and calls."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest
import torch

from dcp_ref import axes
from dcp_ref.geometry import DcpGeometry
from dcp_ref.group import SimulatedWorld
from dcp_ref.options import DEFAULT, PLANNED, LayerOptions
from dcp_ref.pipeline import make_dcp_problem
from dcp_ref.stages import StepSpec
from dcp_ref.step import PlannedStep


def _spec(W: int, options: LayerOptions, rank: int = 0, T: int = 2) -> StepSpec:
    heads = 4
    return StepSpec.for_options(
        DcpGeometry(W, rank, 1, 4), options, max_tokens=T, topk=4, num_heads=heads, head_dim=8, v_dim=8,
        sm_scale=0.3, dtype=torch.float64, device="cpu",
    )  # fmt: skip


class _Group:
    """A group of W ranks whose collectives only record their calls (plans, never runs)."""

    def __init__(self, W: int, rank: int = 0) -> None:
        self.world_size, self.rank, self.calls = W, rank, []

    def all_gather(self, x, *, out=None):
        self.calls.append("all_gather")
        return out

    def reduce_scatter(self, x, dim=0, *, out=None):
        self.calls.append("reduce_scatter")
        return out

    def all_to_all(self, x, *, out=None):
        self.calls.append("all_to_all")
        return out


OPTIONS = [
    DEFAULT,
    PLANNED,
    LayerOptions(layout="tp"),
    LayerOptions(q_replicate=False, combine="alltoall"),
    LayerOptions(exchange="owner"),
]


@pytest.mark.parametrize("W", [1, 2])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: o.label)
def test_the_parts_decide_stages_and_collectives_as_without_a_plan(W: int, options: LayerOptions) -> None:
    spec = _spec(W, options)
    step = PlannedStep(_Group(W), spec)
    assert step.parts.stages == axes.stage_names(spec) == step._used
    assert list(step.collectives) == axes.layer_collectives(spec)
    split = W > 1 and options.layout == "dcp"
    # What each axis owns: buffers only for what its choice uses.
    assert (step.parts.query.gathered_buf is not None) == (split and not options.q_replicate)
    assert (step.parts.exchange.gathered_buf is not None) == split
    assert (step.parts.exchange.ids_buf is None) == (options.exchange == "owner" or not split)
    want = (
        "NoCombine"
        if not split
        else {"reduce_scatter": "ReduceScatterCombine", "alltoall": "AllToAllCombine"}[options.combine]
    )
    assert type(step.parts.combine).__name__ == want
    assert ("correct" in step._used) == (want == "ReduceScatterCombine")
    assert ("combine" in step._used) == (want == "AllToAllCombine")


def test_tp_is_a_choice_of_parts_not_a_branch() -> None:
    step = PlannedStep(_Group(4), _spec(4, LayerOptions(layout="tp")))
    assert step.collectives == () and type(step.parts.combine).__name__ == "NoCombine"
    assert step.parts.query.gathers is False


def test_a_collective_without_out_is_bound_at_plan_time_and_never_retried() -> None:
    """A group whose all_gather takes no ``out=`` gets the copying call at plan time; a TypeError raised inside
    a collective that does take ``out=`` propagates (the old retry could run on one rank only: a hang)."""
    seen = []

    class NoOut:
        world_size, rank = 2, 0

        def all_gather(self, x):
            seen.append("no-out")
            return torch.stack([x, x])

    g = NoOut()
    call = axes.bind_collective(g, "all_gather")
    x = torch.arange(3.0)
    out = torch.empty(2, 3)
    assert call(x, out) is out and torch.equal(out, torch.stack([x, x])) and seen == ["no-out"]

    class Raises:
        world_size, rank = 2, 0

        def all_gather(self, x, *, out=None):
            seen.append("raises")
            raise TypeError("inside the collective")

    with pytest.raises(TypeError, match="inside the collective"):
        axes.bind_collective(Raises(), "all_gather")(x, out)
    assert seen.count("raises") == 1  # called once: no retry without out=


def test_a_step_over_a_group_without_out_matches_one_with_it() -> None:
    """The whole step over a SimulatedWorld whose collectives are wrapped to take no ``out=``: same answer."""
    p = make_dcp_problem(2, 2, seq_lens=[19, 30], next_n=1, num_heads=4, head_dim=8, block_size=4, seed=5)

    class Plain:
        def __init__(self, g):
            self.g, self.world_size, self.rank = g, g.world_size, g.rank

        def all_gather(self, x):
            return self.g.all_gather(x)

        def reduce_scatter(self, x, dim=0):
            return self.g.reduce_scatter(x, dim)

    def body(group, shard, plain):
        spec = StepSpec(p.geometry(group.rank), max_tokens=p.q.shape[0], topk=6, num_heads=4, head_dim=8,
                        v_dim=8, sm_scale=0.3, dtype=p.q.dtype, device="cpu")  # fmt: skip
        step = PlannedStep(Plain(group) if plain else group, spec)
        out, lse = step.run(p.q, shard, p.metadata(group.rank))
        return out.clone(), lse.clone()

    a = SimulatedWorld(2).run(lambda g, s: body(g, s, False), p.shards)
    b = SimulatedWorld(2).run(lambda g, s: body(g, s, True), p.shards)
    for (oa, la), (ob, lb) in zip(a, b):
        assert torch.equal(oa, ob) and torch.equal(la, lb)


def test_run_reads_at_a_glance() -> None:
    """PlannedStep.run: at most 15 lines of code in its body (one line per part), no branch on an option."""
    src = textwrap.dedent(inspect.getsource(PlannedStep.run))
    fn = ast.parse(src).body[0]
    assert isinstance(fn, ast.FunctionDef)
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) else fn.body  # the docstring
    lines = {n.lineno for stmt in body for n in ast.walk(stmt) if hasattr(n, "lineno")}
    assert len(lines) <= 15, f"PlannedStep.run has {len(lines)} lines of code"
    of_spec = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
               and n.value.attr == "spec"}  # fmt: skip
    assert not of_spec & {"layout", "exchange", "order", "combine", "q_replicate", "scoring"}, "run reads an option"


def test_the_parts_picture_and_table_say_what_the_step_plans() -> None:
    import matplotlib

    matplotlib.use("Agg")
    from dcp_ref.viz.step_parts import draw_step_parts, step_parts, step_parts_table

    specs = [
        ("defaults", _spec(2, DEFAULT)),
        ("planned", _spec(2, PLANNED)),
        ("tp", _spec(2, LayerOptions(layout="tp"))),
    ]
    for _, spec in specs:
        step = PlannedStep(_Group(2), spec)
        parts = step_parts(spec)
        assert [p["part"] for p in parts] == [type(x).__name__ for x in step.parts]
        assert tuple(n for p in parts for n in p["stages"]) == step.parts.stages
        assert tuple(n for p in parts for n in p["collectives"]) == step.collectives
    table = step_parts_table(specs)
    assert "AllToAllCombine: combine [all-to-all]" in table and "NoCombine: -" in table
    fig = draw_step_parts(specs)
    assert len(fig.axes) == 1
    with pytest.raises(TypeError, match="spec must be"):
        step_parts("dcp")  # type: ignore[arg-type]


class _GroupedAttention:
    """The reference attention as a stage that takes the guard in and reads / writes heads in groups (what the
    FlashMLA stage declares), so the plan's two fusions run on the CPU."""

    impl_name = "grouped-reference"
    takes_guard = True
    grouped_heads = True

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, q, kv_cache, slots, counts, sm_scale, v_dim, *, out=None, out_lse=None, guard=None):
        from dcp_ref.guard import reference_guard
        from dcp_ref.stages import REFERENCE_STAGES

        T = q.shape[0]
        self.calls.append({"q_dim": q.dim(), "out_dim": out.dim(), "guard": guard is not None})
        o, lse = REFERENCE_STAGES.attention(q.reshape(T, -1, q.shape[-1]), kv_cache, slots, counts, sm_scale, v_dim)
        if guard is not None:
            g = guard
            reference_guard(o, lse, g.local_bounds, g.req_of_token, g.block_table, g.geometry, g.n_cols,
                            row_starts=g.row_starts, num_blocks=g.num_blocks, next_n=g.next_n, index_q=g.index_q,
                            index_weights=g.index_weights)  # fmt: skip
        out.copy_(o.view(out.shape) if out.dim() == 3 else o.view(T, out.shape[1], out.shape[2], -1))
        out_lse.copy_(lse.view(out_lse.shape) if out_lse.dim() == 2 else lse.view(T, out_lse.shape[1], -1))
        return out, out_lse


@pytest.mark.parametrize("options", [PLANNED, DEFAULT], ids=lambda o: o.label)
def test_an_attention_that_takes_the_guard_and_grouped_heads_gives_the_same_layer(options: LayerOptions) -> None:
    """Where the attention stage takes the guard in and reads / writes grouped heads, the plan folds the guard into
    it, drops the query's transpose (T > 1) and — with the all-to-all combine — writes the partial straight into the
    send buffer; the layer's answer is bit for bit the unfused one's, a poisoned token included. A guard of the
    caller's own is never folded."""
    from dcp_ref.stages import REFERENCE_STAGES

    p = make_dcp_problem(2, 1, seq_lens=[19, 30, 7], next_n=1, num_heads=4, head_dim=8, block_size=4, seed=2)

    def body(group, shard, stages):
        spec = StepSpec.for_options(p.geometry(group.rank), options, max_tokens=p.q.shape[0], topk=6, num_heads=4,
                                    head_dim=8, v_dim=8, sm_scale=0.3, dtype=p.q.dtype, device="cpu")  # fmt: skip
        step = PlannedStep(group, spec, stages)
        meta = p.metadata(group.rank)
        meta = dataclasses.replace(meta, local_bounds=meta.local_bounds.clone())
        meta.local_bounds[1] = 10**6  # token 1 out of contract on every rank: a bound past its blocks
        q = p.q if spec.q_replicate else p.q[:, group.rank * 2 : (group.rank + 1) * 2]
        out, lse = step.run(q, shard, meta)
        return out.clone(), lse.clone(), step

    fused = _GroupedAttention()
    plain = SimulatedWorld(2).run(lambda g, s: body(g, s, REFERENCE_STAGES), p.shards)
    got = SimulatedWorld(2).run(lambda g, s: body(g, s, REFERENCE_STAGES.with_(attention=fused)), p.shards)
    for (oa, la, _), (ob, lb, step) in zip(plain, got, strict=True):
        assert torch.equal(oa.isnan(), ob.isnan()) and bool(oa[1].isnan().all())
        assert torch.equal(oa.nan_to_num(), ob.nan_to_num()) and torch.equal(la.nan_to_num(), lb.nan_to_num())
        assert step.parts.attention.guard_fused and step.fused == {"guard": "attention"}
        alltoall = type(step.parts.combine).__name__ == "AllToAllCombine"
        assert getattr(step.parts.combine, "packed_by_attention", False) == alltoall
        assert (step.parts.query.full_buf is None) == (step.parts.query.gathers or options.q_replicate)
    assert all(c["guard"] for c in fused.calls)
    assert {c["q_dim"] for c in fused.calls} == ({4} if not options.q_replicate else {3})
    assert {c["out_dim"] for c in fused.calls} == ({4} if options.combine == "alltoall" else {3})
    own_guard = REFERENCE_STAGES.with_(attention=_GroupedAttention(), guard=lambda *a, **k: None)
    _, _, step = SimulatedWorld(2).run(lambda g, s: body(g, s, own_guard), p.shards)[0]
    assert not step.parts.attention.guard_fused
    assert step.parts.query.full_buf is not None or options.q_replicate
