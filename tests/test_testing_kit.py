"""The conformance kit (dcp_ref.testing): references and the project's kernels pass it, seeded bugs
of every stage are caught with a small reproducer that reproduces, the oracle equals the pipeline's
independent single-device oracle, and the plugin, the CLI and the lazy import work.

The seeded bugs are module-level functions so that the reproducer's import line finds them.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from dcp_ref.geometry import DcpGeometry
from dcp_ref.stages import REFERENCE_STAGES
from dcp_ref.testing import (
    ConformanceError,
    check_attention,
    check_combine,
    check_correct,
    check_deinterleave,
    check_guard,
    check_indexer,
    check_local_topk,
    check_pack,
    check_scoring,
    check_select,
    check_select_to_slots,
    check_stages,
    check_step,
    make_step_problem,
    noncontiguous,
    oracle,
    run_step_problem,
)
from dcp_ref.testing import strategies as dst


def _plugin_entry_point() -> str | None:
    """The name of an installed ``pytest11`` entry point of the plugin (``pip install -e .``), if any."""
    from importlib.metadata import entry_points

    return next((ep.name for ep in entry_points(group="pytest11") if ep.value == "dcp_ref.testing.plugin"), None)


# The dcp_conformance fixture. Once the entry point is installed pytest has loaded the plugin already, and
# under another name than the module's, a second registration would be an error: load it only if needed.
if _plugin_entry_point() is None:
    pytest_plugins = ["dcp_ref.testing.plugin"]

ROOT = Path(__file__).resolve().parents[1]
FAST = 20  # cases per check for the Triton interpreter: each call is a few ms to tens of ms
INF = math.inf


# ---- seeded bugs, one per stage ---------------------------------------------------------------------
def select_ties_to_higher_id(gathered: torch.Tensor, k: int) -> torch.Tensor:
    """The reference order with ids mirrored: equal scores go to the HIGHER id (bug)."""
    from dcp_ref.topk import stable_topk

    g = gathered.clone()
    g[..., 1] = torch.where(g[..., 1] >= 0, (2**24 - 1) - g[..., 1], g[..., 1])
    out = stable_topk(g, k)
    return torch.where(out >= 0, (2**24 - 1) - out, out).to(torch.int32)


def local_topk_off_by_one(
    scores: torch.Tensor, k: int, lengths: torch.Tensor, row_starts: torch.Tensor | None
) -> torch.Tensor:
    """Keys j <= lengths[t] instead of j < lengths[t] (bug), clamped to stay inside the tensor."""
    from dcp_ref.indexer import local_topk

    starts = torch.zeros_like(lengths) if row_starts is None else row_starts
    return local_topk(scores, k, torch.minimum(lengths + 1, scores.shape[1] - starts), row_starts)


def indexer_off_by_one(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    geometry: DcpGeometry,
    k: int,
    *,
    row_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    from dcp_ref.topk import pack_candidates

    g = geometry
    ids = local_topk_off_by_one(scores, k, lengths, row_starts)
    return pack_candidates(scores, ids, g, row_starts)


def pack_ignoring_interleave(
    scores: torch.Tensor,
    local_ids: torch.Tensor,
    geometry: DcpGeometry,
    row_starts: torch.Tensor | None,
) -> torch.Tensor:
    """Global id j*W + rank, right only for I = 1 (bug)."""
    from dcp_ref.topk import pack_candidates

    return pack_candidates(scores, local_ids, DcpGeometry(geometry.world_size, geometry.rank), row_starts)


def deinterleave_dropping_last(
    global_ids: torch.Tensor, req_of_token: torch.Tensor, block_table: torch.Tensor, geometry: DcpGeometry
) -> tuple[torch.Tensor, torch.Tensor]:
    """A compaction that loses the last slot of a row whose every id is local (bug)."""
    slots, counts = REFERENCE_STAGES.deinterleave(global_ids, req_of_token, block_table, geometry)
    slots, counts = slots.clone(), counts.clone()
    full = counts == slots.shape[1]
    slots[full, -1] = -1
    counts[full] -= 1
    return slots, counts


def attention_base2_as_e(
    q: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor, sm_scale: float, v_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns a base-2 LSE where base e is declared (bug)."""
    from dcp_ref.attention import sparse_mla_attention

    return sparse_mla_attention(q, kv_cache, slots, counts, sm_scale, "2", v_dim=v_dim)


def correct_multiplying_nan(
    partial: torch.Tensor, all_lse: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight * partial: an empty rank's NaN partial times its zero weight is NaN (bug)."""
    lse = all_lse.double()
    merged = torch.logsumexp(lse, 0)
    w = torch.nan_to_num(torch.exp(lse[rank] - merged), nan=0.0)
    return (w.unsqueeze(-1) * partial.double()).to(partial.dtype), merged.float()


def correct_base_e_math(partial: torch.Tensor, all_lse: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The base-e merge applied to LSEs declared base 2 (bug)."""
    from dcp_ref.lse import correct_partial

    return correct_partial(partial, all_lse, rank, "e")


def step_attending_local_topk(
    group: Any,
    q: torch.Tensor,
    shard: Any,
    seq_lens: torch.Tensor,
    next_n: Any,
    topk: int,
    sm_scale: float,
    *,
    v_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank attends to its own local top-k: no global selection (bug; see topk.union_counterexample)."""
    from dcp_ref.indexer import local_topk
    from dcp_ref.lse import dcp_merge_collective
    from dcp_ref.step import decode_metadata

    g = shard.geometry
    meta = decode_metadata(seq_lens, next_n, g)
    ids = local_topk(shard.index_scores, topk, meta.local_bounds)
    gid = torch.where(
        ids >= 0, (ids // g.interleave) * g.world_size * g.interleave + g.rank * g.interleave + ids % g.interleave, -1
    ).to(torch.int32)
    slots, counts = REFERENCE_STAGES.deinterleave(gid, meta.req_of_token, shard.block_table, g)
    out, lse = REFERENCE_STAGES.attention(q, shard.kv_cache, slots, counts, sm_scale, v_dim or q.shape[-1])
    return dcp_merge_collective(group, out, lse, "e")


def _select_with_out(gathered: torch.Tensor, k: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    r = select_ties_to_higher_id(gathered, k)
    return r if out is None else out.copy_(r)


# ---- the references conform ---------------------------------------------------------------------------
def test_reference_select_conforms() -> None:
    from dcp_ref.topk import stable_topk

    check_select(REFERENCE_STAGES.select, max_examples=25)
    check_select(stable_topk, sorted=True, max_examples=25)
    check_select(stable_topk, sorted=True, presorted=True, max_examples=10)


def test_reference_indexer_local_topk_and_pack_conform() -> None:
    from dcp_ref.indexer import local_topk
    from dcp_ref.topk import pack_candidates

    check_local_topk(local_topk, sorted=True, max_examples=25)
    check_pack(pack_candidates, dtypes=(torch.float16, torch.bfloat16, torch.float32, torch.float64), max_examples=25)
    check_indexer(REFERENCE_STAGES.indexer, sorted=True, max_examples=25)


def test_reference_deinterleave_conforms() -> None:
    check_deinterleave(REFERENCE_STAGES.deinterleave, ordered=True, max_examples=25)
    check_deinterleave(REFERENCE_STAGES.deinterleave, compact=False, max_examples=25)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_reference_attention_conforms(dtype: torch.dtype) -> None:
    check_attention(REFERENCE_STAGES.attention, dtype=dtype, max_examples=20)


def test_reference_attention_in_base_2_and_the_masked_layout() -> None:
    from dcp_ref.attention import sparse_mla_attention
    from dcp_ref.deinterleave import compact_to_front

    def base2(q, kv, slots, counts, sm_scale, v_dim):  # type: ignore[no-untyped-def]
        return sparse_mla_attention(q, kv, slots, counts, sm_scale, "2", v_dim=v_dim)

    def masked(q, kv, slots, counts, sm_scale, v_dim):  # type: ignore[no-untyped-def]
        compacted, n = compact_to_front(slots)  # the masked layout: -1 anywhere, valid slots anywhere
        return sparse_mla_attention(q, kv, compacted, n, sm_scale, v_dim=v_dim)

    check_attention(base2, lse_base="2", max_examples=15)
    check_attention(masked, layout="masked", max_examples=15)


def test_reference_correct_conforms() -> None:
    from dcp_ref.lse import correct_partial, merge_partials

    check_correct(REFERENCE_STAGES.correct, max_examples=25)
    check_correct(
        lambda p, lse, r: correct_partial(p, lse, r, "2"), lse_base="2", dtype=torch.bfloat16, max_examples=15
    )
    check_correct(merge_partials, form="merge", max_examples=15)


def test_reference_step_conforms() -> None:
    from dcp_ref.pipeline import dcp_decode_step

    check_step(REFERENCE_STAGES, max_examples=20)
    check_step(dcp_decode_step, max_examples=10, dtype=torch.float64)


def test_the_fixture_runs_the_checkers(dcp_conformance: Any) -> None:
    from dcp_ref.topk import stable_topk

    dcp_conformance.select(stable_topk, sorted=True, max_examples=10)
    with pytest.raises(ConformanceError):
        dcp_conformance.select(select_ties_to_higher_id, max_examples=10)


# ---- the project's Triton kernels conform (interpreted on the CPU) -----------------------------------
@pytest.fixture(scope="module")
def interp(kernel_device: torch.device) -> torch.device:
    pytest.importorskip("triton")
    return kernel_device


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy inside the interpreter: 0 * inf in masked lanes
def test_triton_pack_conforms(interp: torch.device) -> None:
    from dcp_ref.kernels.pack_triton import pack_candidates_triton

    check_pack(
        pack_candidates_triton, device=interp, dtypes=(torch.float32, torch.bfloat16, torch.float16), max_examples=FAST
    )


@pytest.mark.parametrize("method,ordered", [("rowscan", True), ("twopass", True), ("atomic", False)])
def test_triton_deinterleave_conforms(interp: torch.device, method: str, ordered: bool) -> None:
    from dcp_ref.kernels.deinterleave_triton import deinterleave_compact

    def fn(ids, req, table, g):  # type: ignore[no-untyped-def]
        return deinterleave_compact(  # the stage's semantics: validate=False (poison, never raise)
            ids,
            req,
            table,
            DcpGeometry(g.world_size, g.rank, g.interleave, g.block_size),
            ordered=ordered,
            method=method,
            validate=False,
        )

    check_deinterleave(fn, ordered=ordered, device=interp, max_examples=FAST)


def test_triton_conversion_kernel_conforms_to_the_masked_layout(interp: torch.device) -> None:
    from dcp_ref.kernels.deinterleave_triton import global_ids_to_local_slots_triton

    def fn(ids, req, table, g, compact=True):  # type: ignore[no-untyped-def]
        assert compact is False
        s = global_ids_to_local_slots_triton(ids, req, table, g, validate=False)
        return s, (s >= 0).sum(1, dtype=torch.int32)

    check_deinterleave(fn, compact=False, device=interp, max_examples=FAST)


def test_triton_masked_kernel_conforms_to_the_masked_layout(interp: torch.device) -> None:
    """The kernel the step runs for the masked layout: conversion and counts in one launch."""
    from dcp_ref.kernels.deinterleave_triton import deinterleave_masked_triton

    def fn(ids, req, table, g, compact=True):  # type: ignore[no-untyped-def]
        assert compact is False
        return deinterleave_masked_triton(ids, req, table, g, validate=False)

    check_deinterleave(fn, compact=False, device=interp, max_examples=FAST)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("base,dtype", [("e", torch.float32), ("2", torch.float32), ("e", torch.bfloat16)])
def test_triton_lse_correct_conforms(interp: torch.device, base: str, dtype: torch.dtype) -> None:
    from dcp_ref.kernels.lse_merge_triton import lse_correct

    def fn(partial, all_lse, rank):  # type: ignore[no-untyped-def]
        merged = torch.empty(partial.shape[:2], dtype=torch.float32, device=partial.device)
        return lse_correct(partial, all_lse, rank, base=base, merged_lse=merged)

    check_correct(fn, lse_base=base, dtype=dtype, device=interp, max_examples=FAST)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_triton_lse_merge_conforms(interp: torch.device) -> None:
    from dcp_ref.kernels.lse_merge_triton import lse_merge

    def fn(outs, lses):  # type: ignore[no-untyped-def]
        return lse_merge(outs, lses, merged_lse=torch.empty(outs.shape[1:3], dtype=torch.float32, device=outs.device))

    check_correct(fn, form="merge", device=interp, max_examples=FAST)


def test_the_new_checkers_refuse_bad_options() -> None:
    from dcp_ref.select_to_slots import reference_select_to_slots
    from dcp_ref.stages import reference_combine

    with pytest.raises(ValueError, match=r"^order must be 'global_id' or 'rank_local'"):
        check_select_to_slots(reference_select_to_slots, order="by_rank")
    with pytest.raises(TypeError, match=r"^check_combine takes no form="):
        check_combine(reference_combine, form="correct")


def test_reference_scoring_conforms() -> None:
    """dcp_ref's scoring (dequantized, float64 inside) meets the kit's contract, MTP groups included."""
    from dcp_ref.stages import reference_scoring

    check_scoring(reference_scoring, max_examples=40)


def _triton_scoring(index_q, weights, index_cache, block_table, req_of_token, local_bounds, geometry, *,
                    row_starts=None, out=None, next_n=1):  # type: ignore[no-untyped-def]  # fmt: skip
    from dcp_ref.kernels.scoring_triton import index_scores_triton

    return index_scores_triton(index_q, weights, index_cache, block_table, req_of_token, local_bounds, geometry,
                               row_starts=row_starts, out=out, validate=False, next_n=next_n)  # fmt: skip


def test_triton_scoring_conforms(interp: torch.device) -> None:
    """The Triton scoring kernel (interpreted; validate=False, the step's form) meets the contract — without NaN
    *bytes* in FP8 values, which Triton 3.6's interpreter decodes as 480 (shown below; a GPU decodes NaN)."""
    check_scoring(_triton_scoring, device=interp, max_examples=FAST, fp8_nan=False)


def test_the_interpreter_decodes_the_fp8_nan_byte_as_480() -> None:
    """Why the CPU run of the Triton kernel leaves NaN bytes out (the oracle decodes them as NaN, as torch does)."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the interpreter's decoding")
    import triton
    import triton.language as tl

    @triton.jit
    def widen(x_ptr, o_ptr):
        i = tl.arange(0, 2)
        tl.store(o_ptr + i, tl.load(x_ptr + i).to(tl.float8e4nv, bitcast=True).to(tl.float32))

    x, o = torch.tensor([0x7F, 0xFF], dtype=torch.uint8), torch.empty(2)
    widen[(1,)](x, o)
    assert o.tolist() == [480.0, -480.0] and x.view(torch.float8_e4m3fn).float().isnan().all()
    assert all(math.isnan(v) for v in oracle._fp8_values(x))


def test_the_new_checks_and_the_scoring_oracle_refuse_bad_arguments() -> None:
    from dcp_ref.stages import REFERENCE_STAGES, reference_scoring

    with pytest.raises(ValueError, match=r"^mtp must be"):
        check_scoring(reference_scoring, mtp="yes")
    with pytest.raises(TypeError, match=r"^fp8_nan must be a bool"):
        check_scoring(reference_scoring, fp8_nan=1)
    with pytest.raises(ValueError, match=r"^options must be None, 'all'"):
        check_step(REFERENCE_STAGES, options="every")
    with pytest.raises(TypeError, match=r"^options must be a sequence of dicts"):
        check_step(REFERENCE_STAGES, options=[("exchange", "owner")])
    q, w = torch.zeros(2, 1, 128).to(torch.float8_e4m3fn), torch.ones(2, 1)
    args = (q, w, torch.zeros(1, 132, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32), DcpGeometry(1, 0, 1, 1))  # fmt: skip
    assert oracle.scoring(*args, 1)[0].shape == (2, 1)
    with pytest.raises(ValueError, match=r"^n_cols must be >= 0"):
        oracle.scoring(*args, -1)
    with pytest.raises(TypeError, match=r"^next_n must be an int"):
        oracle.scoring(*args, 1, None, 2.0)
    with pytest.raises(ValueError, match=r"^next_n=3 must divide"):
        oracle.scoring(*args, 1, None, 3)
    with pytest.raises(ValueError, match=r"^index_q, weights"):
        oracle.scoring(q[:1], *args[1:], 1)


def test_the_scoring_oracle_is_the_reference() -> None:
    """The kit's float64 oracle (e4m3 decoded by hand from the format) and dcp_ref.scoring agree on drawn cases,
    every special cell included — two independent writings of one formula."""
    from hypothesis import HealthCheck, given, settings

    from dcp_ref.scoring import index_scores
    from dcp_ref.testing.checks import _scoring_oracle

    finite = [0]

    @settings(max_examples=30, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(dst.scoring_cases(mtp=True))
    def agree(case) -> None:  # type: ignore[no-untyped-def]
        v = case.values
        L = case.out_buffers["out"][0][1]
        exp, mag = _scoring_oracle(v, L)
        got = index_scores(v["index_q"], v["weights"], v["index_cache"], v["block_table"], v["req_of_token"],
                           v["local_bounds"], v["geometry"], row_starts=v["row_starts"], out=torch.empty(exp.shape),
                           validate=False, next_n=v["next_n"]).double()  # fmt: skip
        assert torch.equal(torch.isnan(got), torch.isnan(exp)) and torch.equal(torch.isneginf(got), torch.isneginf(exp))
        fin = torch.isfinite(exp)
        assert bool(((got - exp).abs()[fin] <= mag[fin] * 2.0**-20 + 1e-30).all())
        finite[0] += int(fin.sum())

    agree()
    assert finite[0] > 100  # the draws reach many scored cells


def _in_a_step(fn):  # type: ignore[no-untyped-def]
    """A select-to-slots mutant with the keywords the step passes (its buffers)."""

    def stage(gathered, own_ids, req_of_token, block_table, geometry, k, *, order="global_id", out_slots=None,
              out_counts=None):  # type: ignore[no-untyped-def]  # fmt: skip
        slots, counts = fn(gathered, own_ids, req_of_token, block_table, geometry, k, order=order)
        if out_slots is None:
            return slots, counts
        out_slots.copy_(slots)
        out_counts.copy_(counts)
        return out_slots, out_counts

    return stage


def test_check_step_runs_the_layer_options() -> None:
    """check_step(options="all") plans and runs every exchange, combine and query layout of STEP_OPTIONS: the
    reference passes; a select-to-slots or combine that is wrong only where the default step never calls it (the
    owner exchange, the all-to-all combine) passes the default check and is flagged under the options."""
    from dcp_ref.stages import REFERENCE_STAGES
    from dcp_ref.testing.checks import STEP_OPTIONS

    assert {"exchange": "owner"} in STEP_OPTIONS and {"q_replicate": False} in STEP_OPTIONS
    assert {"layout": "tp"} in STEP_OPTIONS and {"scoring": "fp8"} in STEP_OPTIONS
    assert {"exchange": "owner", "order": "rank_local"} in STEP_OPTIONS
    check_step(REFERENCE_STAGES, options="all", world_sizes=(1, 2, 3), max_examples=10)
    for broken in (REFERENCE_STAGES.with_(select_to_slots=_in_a_step(mut_s2s_dropping_the_last_winner)),
                   REFERENCE_STAGES.with_(combine=mut_combine_ignoring_the_last_rank)):  # fmt: skip
        check_step(broken, world_sizes=(2, 3), max_examples=10)  # the default step never calls it
        with pytest.raises(ConformanceError, match="with the step options"):
            check_step(broken, options="all", world_sizes=(2, 3), max_examples=10, shrink_budget=0)


#: Stages wrong only where one option reaches them: rank_local's tie-break reversed (the later rank / position
#: first), a scoring stage that drops each token's last key or takes |weights| (called only when the layer scores
#: its index keys). By name: the mutants are defined further down.
ONE_OPTION_MUTANTS = {
    "s2s rank_local ties reversed": ({"exchange": "owner", "order": "rank_local"}, "select_to_slots"),
    "scoring drops the last key": ({"scoring": "fp8"}, "scoring"),
    "scoring abs weights": ({"scoring": "fp8"}, "scoring"),
}


@pytest.mark.parametrize("name", sorted(ONE_OPTION_MUTANTS))
def test_check_step_flags_a_stage_wrong_only_under_one_option(name: str) -> None:
    """A stage the default step never calls wrongly passes the default check and is flagged under its option:
    the rank_local order (the oracle breaks ties by rank, then local index) and the layer scoring FP8 index keys
    (the problem gains index keys whose float32 scores are exact)."""
    from dcp_ref.stages import REFERENCE_STAGES

    option, stage = ONE_OPTION_MUTANTS[name]
    fn = _in_a_step(mut_s2s_ties_to_higher_id) if stage == "select_to_slots" else _scoring_mutant(name[8:])
    stages = REFERENCE_STAGES.with_(**{stage: fn})
    check_step(stages, world_sizes=(2, 3), max_examples=15)
    with pytest.raises(ConformanceError, match="with the step options"):
        check_step(stages, options=[option], world_sizes=(2, 3), max_examples=30, shrink_budget=0)


def test_step_option_problems_hold_the_same_decode() -> None:
    """The tp problem (one rank, the whole context) and the problem with index keys are the same decode: the
    oracle reads the same answer from the unsharded tensors; the index keys' scores are the oracle's own float64
    scores (exact in float32), and the tp layout runs without a correct or a combine stage on every rank."""
    from dcp_ref.stages import REFERENCE_STAGES
    from dcp_ref.testing import oracle
    from dcp_ref.testing.checks import run_step_problem
    from dcp_ref.testing.strategies import make_step_problem, unsharded, with_index_keys

    rows = [[0.5, 1.0, 0.0, 1.0, 0.5, 1.0, 0.0][:n] for n in (6, 7, 3)]
    p = make_step_problem(3, 2, 2, [7, 3], [2, 1], rows, num_heads=6, head_dim=4, topk=3, seed=1)

    def decode(x, **kw):  # type: ignore[no-untyped-def]
        return oracle.decode(x.q, x.kv_caches, x.block_tables, x.index_scores, x.seq_lens, x.next_n, x.topk,
                             x.sm_scale, block_size=x.block_size, interleave=x.interleave, v_dim=x.v_dim,
                             **kw)  # fmt: skip

    ref, one = decode(p), decode(unsharded(p))
    assert torch.equal(ref.ids, one.ids) and torch.equal(ref.out, one.out)
    scored = with_index_keys(p, index_heads=3, seed=2)
    assert scored.index_q.dtype == torch.float8_e4m3fn and len(scored.index_caches) == 3
    sref = decode(scored)
    assert torch.equal(decode(unsharded(scored)).ids, sref.ids)
    traces: list[dict] = [{} for _ in range(3)]
    out, _ = run_step_problem(p, REFERENCE_STAGES, traces=traces, options={"layout": "tp"})
    torch.testing.assert_close(out.double(), ref.out, rtol=1e-5, atol=1e-5)
    assert all("correct" not in t["impl"] and "combine" not in t["impl"] for t in traces)
    out, _ = run_step_problem(scored, REFERENCE_STAGES, traces=traces, options={"scoring": "fp8"})
    torch.testing.assert_close(out.double(), sref.out, rtol=1e-5, atol=1e-5)
    assert all(next(iter(t["impl"])) == "scoring" for t in traces)
    # a tie at the threshold between position 1 (rank 1, local 0) and position 2 (rank 0, local 1): global_id
    # takes the lower position, rank_local the lower rank
    tie = make_step_problem(2, 1, 2, [4], 1, [[0.0, 1.0, 1.0, 0.0]], num_heads=2, head_dim=2, topk=1)
    assert decode(tie).ids.tolist() == [[1]] and decode(tie, order="rank_local").ids.tolist() == [[2]]
    with pytest.raises(ValueError, match="order must be"):
        decode(tie, order="rank")


def test_triton_guard_conforms(interp: torch.device) -> None:
    """The Triton guard (interpreted) poisons exactly the tokens the kit's oracle refuses."""
    from dcp_ref.kernels.guard_triton import guard_triton

    check_guard(guard_triton, device=interp, max_examples=FAST)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_kernel_stages_conform_on_the_cpu(interp: torch.device) -> None:
    """The "kernels" Stages of the CPU (Triton interpreted where it runs) — stage by stage and stepped."""
    from dcp_ref.kernels.stages import kernel_stages
    from dcp_ref.stages import StepSpec

    ks = kernel_stages(StepSpec(DcpGeometry(1, 0, 1, 64), max_tokens=1, topk=8, num_heads=1, head_dim=8, v_dim=8,
                                sm_scale=0.1, dtype=torch.float32, device=interp))  # fmt: skip
    check_indexer(ks.indexer, device=interp, max_examples=FAST)  # strided lengths included (the kit found that bug)
    check_deinterleave(ks.deinterleave, device=interp, max_examples=FAST)
    check_correct(ks.correct, device=interp, max_examples=FAST)
    check_step(ks, device=interp, world_sizes=(1, 2, 3), max_examples=8)
    # and under every layer option: both orders, tp, the layer scoring its FP8 index keys (the Triton scoring)
    check_step(ks, device=interp, options="all", world_sizes=(1, 2, 3), max_examples=8)


# ---- the GPU kernels (the H200) -----------------------------------------------------------------------
#: Examples per conformance check on the GPU: every new shape the strategies draw is a new Triton
#: specialization to compile (~1 s each), so 200 examples per check ran past 10 minutes on the H200.
GPU_EXAMPLES = 40


@pytest.mark.gpu
@pytest.mark.parametrize("sorted_", [False, True])
def test_cutedsl_select_conforms_on_gpu(cuda_device: torch.device, sorted_: bool) -> None:
    pytest.importorskip("cutlass")
    from dcp_ref.kernels.topk_cutedsl import stable_topk_cutedsl

    # The kernel reads (score, id) as 8-byte words: contiguous input only (the stage wrapper makes it so).
    check_select(
        lambda g, k: stable_topk_cutedsl(g, k, sorted=sorted_),
        sorted=sorted_,
        device=cuda_device,
        noncontig=False,
        max_examples=200,
    )


@pytest.mark.gpu
def test_triton_kernels_conform_on_gpu(cuda_device: torch.device) -> None:
    from dcp_ref.kernels.deinterleave_triton import deinterleave_compact
    from dcp_ref.kernels.lse_merge_triton import lse_correct
    from dcp_ref.kernels.pack_triton import pack_candidates_triton

    check_pack(
        pack_candidates_triton, device=cuda_device, dtypes=(torch.float32, torch.bfloat16), max_examples=GPU_EXAMPLES
    )
    for method, ordered in (("rowscan", True), ("twopass", True), ("atomic", False)):
        check_deinterleave(
            lambda i, r, t, g, ordered=ordered, method=method: deinterleave_compact(
                i,
                r,
                t,
                g,
                ordered=ordered,
                method=method,
                validate=False,  # the stage's semantics: out-of-contract metadata poisons, never raises
            ),
            ordered=ordered,
            device=cuda_device,
            max_examples=GPU_EXAMPLES,
        )
    for base in ("e", "2"):
        check_correct(
            lambda p, lse, r, base=base: lse_correct(
                p, lse, r, base=base, merged_lse=torch.empty(p.shape[:2], dtype=torch.float32, device=p.device)
            ),
            lse_base=base,
            dtype=torch.bfloat16,
            device=cuda_device,
            max_examples=GPU_EXAMPLES,
        )


@pytest.mark.gpu
def test_flashinfer_attention_conforms_on_gpu(cuda_device: torch.device) -> None:
    pytest.importorskip("flashinfer")
    from dcp_ref.kernels.flashinfer_mla import sparse_mla_flashinfer

    def fn(q, kv, slots, counts, sm_scale, v_dim):  # type: ignore[no-untyped-def]
        return sparse_mla_flashinfer(q, kv, slots, counts, sm_scale, "e")

    check_attention(
        fn,
        dtype=torch.bfloat16,
        head_dim=576,
        v_dim=512,
        num_heads=(64, 128),
        device=cuda_device,
        noncontig=False,
        max_examples=60,
    )


@pytest.mark.gpu
def test_flashmla_attention_conforms_on_gpu(cuda_device: torch.device) -> None:
    pytest.importorskip("flash_mla")
    from dcp_ref.kernels.flashmla_sparse import sparse_mla_flashmla

    check_attention(
        sparse_mla_flashmla,
        dtype=torch.bfloat16,
        head_dim=576,
        v_dim=512,
        num_heads=(64, 128),
        slots_width=64,
        device=cuda_device,
        noncontig=False,
        max_examples=60,
    )


@pytest.mark.gpu
def test_kernel_stages_conform_on_gpu(cuda_device: torch.device) -> None:
    """Every GPU stage of the "kernels" Stages at DeepSeek's head geometry, then the step on 2 ranks."""
    from dcp_ref.group import SimulatedWorld
    from dcp_ref.kernels.stages import kernel_stages
    from dcp_ref.stages import StepSpec
    from dcp_ref.step import PlannedStep

    ks = kernel_stages(StepSpec(DcpGeometry(2, 0), max_tokens=1, topk=64, num_heads=128, head_dim=576, v_dim=512,
                                sm_scale=0.5, dtype=torch.bfloat16, device=cuda_device))  # fmt: skip

    def planned(max_tokens: int):  # the Stages a step plans from ks (its prepare hook picks the attention by T)
        spec = StepSpec(
            DcpGeometry(2, 0),
            max_tokens=max_tokens,
            topk=64,
            num_heads=128,
            head_dim=576,
            v_dim=512,
            sm_scale=0.5,
            dtype=torch.bfloat16,
            device=cuda_device,
        )
        return PlannedStep(SimulatedWorld(2).groups[0], spec, ks).stages

    # check_step's cases: 2 ranks x 64 heads, up to 2 requests x 2 MTP tokens, so T in [1, 4]; a plan for T = 1
    # and one for T = 4 may pick different attentions (split-KV up to SPLITKV_MAX_TOKENS): check_step runs both.
    plans = {T: planned(T) for T in (1, 4)}
    check_scoring(ks.scoring, device=cuda_device, max_examples=GPU_EXAMPLES)  # NaN bytes too: a GPU decodes them
    check_indexer(ks.indexer, device=cuda_device, max_examples=GPU_EXAMPLES)  # strided lengths: see the CPU test
    check_select(ks.select, device=cuda_device, max_examples=GPU_EXAMPLES)
    check_deinterleave(ks.deinterleave, device=cuda_device, max_examples=GPU_EXAMPLES)
    check_deinterleave(ks.deinterleave, compact=False, device=cuda_device, max_examples=GPU_EXAMPLES)  # masked
    for order in ("global_id", "rank_local"):  # the CuTeDSL select-to-slots (its stage form: validate=False)
        check_select_to_slots(ks.select_to_slots, order=order, device=cuda_device, max_examples=GPU_EXAMPLES)
    check_guard(ks.guard, device=cuda_device, max_examples=GPU_EXAMPLES)
    check_combine(ks.combine, device=cuda_device, max_examples=GPU_EXAMPLES)
    # Every attention a plan may run: the one planned for these small steps, and ks's own (planned beyond them).
    for attention in dict.fromkeys((*(p.attention for p in plans.values()), ks.attention)):
        check_attention(
            attention,
            dtype=torch.bfloat16,
            head_dim=576,
            v_dim=512,
            num_heads=128,
            slots_width=64,
            device=cuda_device,
            noncontig=False,
            max_examples=40,
        )
    check_correct(ks.correct, dtype=torch.bfloat16, device=cuda_device, max_examples=GPU_EXAMPLES)
    for stages in {tuple(sorted(p.impls().items())): p for p in plans.values()}.values():
        check_step(
            stages,
            device=cuda_device,
            dtype=torch.bfloat16,
            world_sizes=(2,),
            head_dim=576,
            v_dim=512,
            heads_per_rank=64,
            topk=64,
            max_examples=10,
        )


@pytest.mark.gpu
def test_kernel_step_options_on_gpu(cuda_device: torch.device) -> None:
    """The "kernels" Stages stepped under every layer option (:data:`~dcp_ref.testing.checks.STEP_OPTIONS`: both
    exchanges and orders, both combines, the query gathered, tp, the layer scoring FP8 index keys with the Triton
    scoring kernel) at DeepSeek's head geometry on 2 ranks, on the H200."""
    from dcp_ref.group import SimulatedWorld
    from dcp_ref.kernels.stages import kernel_stages
    from dcp_ref.stages import StepSpec
    from dcp_ref.step import PlannedStep

    ks = kernel_stages(StepSpec(DcpGeometry(2, 0), max_tokens=1, topk=64, num_heads=128, head_dim=576, v_dim=512,
                                sm_scale=0.5, dtype=torch.bfloat16, device=cuda_device))  # fmt: skip
    # As test_kernel_stages_conform_on_gpu: the Stages a step plans for T = 1 and T = 4 (its prepare hook picks
    # the attention by T; the trace must name the planned one).
    for T in (1, 4):
        spec = StepSpec(DcpGeometry(2, 0), max_tokens=T, topk=64, num_heads=128, head_dim=576, v_dim=512,
                        sm_scale=0.5, dtype=torch.bfloat16, device=cuda_device)  # fmt: skip
        stages = PlannedStep(SimulatedWorld(2).groups[0], spec, ks).stages
        check_step(stages, device=cuda_device, dtype=torch.bfloat16, world_sizes=(2,), head_dim=576, v_dim=512,
                   heads_per_rank=64, topk=64, options="all", max_examples=4)  # fmt: skip


# ---- seeded bugs are caught, with a small reproducer that reproduces ------------------------------------
def _run_reproducer(err: ConformanceError, **names: Any) -> dict[str, Any]:
    ns: dict[str, Any] = dict(names)
    exec(compile(err.reproducer, "<reproducer>", "exec"), ns)  # the point: the reproducer runs as printed
    return ns


def test_select_bug_ties_toward_the_higher_id_is_caught() -> None:
    with pytest.raises(ConformanceError) as info:
        check_select(select_ties_to_higher_id)
    e = info.value
    assert "LOWER global id" in str(e) and "from test_testing_kit import select_ties_to_higher_id" in e.reproducer
    g = e.case.values["gathered"]
    assert g.shape[0] * g.shape[1] * g.shape[2] <= 2  # shrunk to two candidates tied at one score
    ns = _run_reproducer(e)
    assert ns["got"].tolist() != ns["expected"]


def test_local_topk_bug_off_by_one_bound_is_caught() -> None:
    with pytest.raises(ConformanceError) as info:
        check_local_topk(local_topk_off_by_one)
    e = info.value
    assert e.case.values["scores"].numel() <= 2
    ns = _run_reproducer(e)
    assert ns["got"].tolist() != ns["expected"]


def test_indexer_bug_off_by_one_bound_is_caught() -> None:
    with pytest.raises(ConformanceError) as info:
        check_indexer(indexer_off_by_one)
    ns = _run_reproducer(info.value)
    assert not torch.equal(ns["got"], ns["expected"])


def test_pack_bug_ignoring_interleave_is_caught() -> None:
    with pytest.raises(ConformanceError) as info:
        check_pack(pack_ignoring_interleave)
    e = info.value
    assert e.case.values["geometry"].interleave > 1 and "global id" in str(e)
    ns = _run_reproducer(e)
    assert not torch.equal(ns["got"], ns["expected"])


def test_deinterleave_bug_dropped_slot_is_caught() -> None:
    with pytest.raises(ConformanceError) as info:
        check_deinterleave(deinterleave_dropping_last)
    e = info.value
    assert "missing slots" in str(e) and e.case.values["global_ids"].numel() <= 2
    ns = _run_reproducer(e)
    assert ns["got"][1].tolist() != ns["expected_counts"]


def test_attention_bug_base_2_lse_declared_e_is_caught() -> None:
    with pytest.raises(ConformanceError) as info:
        check_attention(attention_base2_as_e)
    e = info.value
    assert "declare lse_base='2'" in str(e)
    assert e.case.values["q"].numel() <= 2
    ns = _run_reproducer(e)
    assert not torch.allclose(ns["got"][1].double(), ns["expected_lse"])


def test_merge_bug_nan_partial_multiplied_naively_is_caught() -> None:
    with pytest.raises(ConformanceError) as info:
        check_correct(correct_multiplying_nan)
    e = info.value
    assert "0 * NaN" in str(e) and e.case.values["partial"].numel() == 1
    ns = _run_reproducer(e)
    assert torch.isnan(ns["got"][0]).any() and not torch.isnan(ns["expected_out"]).any()


def test_merge_bug_base_2_lse_merged_as_base_e_is_caught() -> None:
    with pytest.raises(ConformanceError) as info:
        check_correct(correct_base_e_math, lse_base="2")
    ns = _run_reproducer(info.value)
    assert not torch.allclose(ns["got"][1].double(), ns["expected_lse"], equal_nan=True)


def test_step_with_a_buggy_select_plugged_in_is_caught() -> None:
    stages = REFERENCE_STAGES.with_(select=_select_with_out)
    with pytest.raises(ConformanceError) as info:
        check_step(stages, max_examples=40)
    e = info.value
    p = e.case.values["problem"]
    assert int(p.seq_lens.sum()) <= 3 and "your step's global_ids" in str(e)
    ns = _run_reproducer(e, stages=stages)
    assert not torch.allclose(ns["out"].double(), ns["ref"].out, equal_nan=True)


def test_whole_step_attending_the_union_of_local_topks_is_caught() -> None:
    with pytest.raises(ConformanceError) as info:
        check_step(step_attending_local_topk, max_examples=40)
    e = info.value
    assert e.case.values["problem"].world_size > 1
    ns = _run_reproducer(e)
    assert not torch.allclose(ns["out"].double(), ns["ref"].out, equal_nan=True)


def test_step_reports_an_impl_trace_that_names_the_wrong_implementation() -> None:
    from dcp_ref.stages import reference_select

    honest = REFERENCE_STAGES.with_(select=reference_select, name="mine")  # same callable: impls() == reference's
    check_step(honest, max_examples=5)


# ---- the kit's own mechanics --------------------------------------------------------------------------
def test_a_failure_report_is_deterministic() -> None:
    msgs = []
    for _ in range(2):
        with pytest.raises(ConformanceError) as info:
            check_correct(correct_multiplying_nan)
        msgs.append(str(info.value))
    assert msgs[0] == msgs[1]


def test_an_ignored_output_buffer_is_caught() -> None:
    def select_ignoring_out(gathered: torch.Tensor, k: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return REFERENCE_STAGES.select(gathered, k)

    with pytest.raises(ConformanceError, match="did not write its result"):
        check_select(select_ignoring_out, max_world=4)
    check_select(select_ignoring_out, out_buffers=False, max_examples=10)


def test_a_modified_input_is_caught() -> None:
    def select_sorting_in_place(gathered: torch.Tensor, k: int) -> torch.Tensor:
        gathered[..., 0] = torch.nan_to_num(gathered[..., 0])
        return REFERENCE_STAGES.select(gathered, k)

    with pytest.raises(ConformanceError, match="modified its input `gathered`"):
        check_select(select_sorting_in_place, max_world=4)


def test_an_exception_on_a_valid_input_is_reported() -> None:
    def select_without_empty_ranks(gathered: torch.Tensor, k: int) -> torch.Tensor:
        if bool((gathered[..., 1] < 0).all()):
            raise IndexError("no candidate")
        return REFERENCE_STAGES.select(gathered, k)

    with pytest.raises(ConformanceError, match="raised IndexError: no candidate"):
        check_select(select_without_empty_ranks, max_world=4)


def test_non_contiguous_inputs_are_exercised() -> None:
    def select_contiguous_only(gathered: torch.Tensor, k: int) -> torch.Tensor:
        if not gathered.is_contiguous():
            raise ValueError("gathered must be contiguous")
        return REFERENCE_STAGES.select(gathered, k)

    with pytest.raises(ConformanceError, match="contiguous"):
        check_select(select_contiguous_only, max_world=4)
    check_select(select_contiguous_only, noncontig=False, max_world=4, max_examples=10)


def test_noncontiguous_keeps_values_and_poisons_the_gaps() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    v = noncontiguous(t)
    assert not v.is_contiguous() and torch.equal(v, t)
    assert torch.isnan(v.as_strided((2 * 3 * 2,), (1,), v.storage_offset())).sum() == 6


def test_bad_conventions_are_rejected() -> None:
    with pytest.raises(ValueError, match="lse_base"):
        check_attention(REFERENCE_STAGES.attention, lse_base="10")
    with pytest.raises(ValueError, match="empty_lse"):
        check_attention(REFERENCE_STAGES.attention, empty_lse="zero")
    with pytest.raises(ValueError, match="form"):
        check_correct(REFERENCE_STAGES.correct, form="sum")
    with pytest.raises(ValueError, match="max_examples"):
        check_select(REFERENCE_STAGES.select, max_examples=0)
    with pytest.raises(TypeError, match="impl"):
        check_step(42)
    with pytest.raises(ValueError, match="unknown stage"):
        check_step({"selekt": REFERENCE_STAGES.select})


def test_check_stages_runs_every_checker() -> None:
    check_stages(REFERENCE_STAGES, max_examples=8)
    with pytest.raises(ConformanceError, match="select"):
        check_stages({"select": _select_with_out}, max_examples=20, step=False)


def _capture(*args: Any, **kwargs: Any) -> tuple:
    return args, kwargs


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.is_contiguous() == b.is_contiguous()
            and bool(((a == b) | (torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else (a == b)).all())
        )
    return a == b


@pytest.mark.parametrize(
    "strategy",
    [
        dst.select_cases(with_out=True),
        dst.local_topk_cases(),
        dst.pack_cases(dtypes=(torch.bfloat16, torch.float32)),
        dst.indexer_cases(with_out=True),
        dst.deinterleave_cases(with_out=True),
        dst.deinterleave_cases(compact=False),
        dst.attention_cases(dtype=torch.bfloat16, with_out=True),
        dst.attention_cases(layout="masked", head_dim=40),
        dst.correct_cases(with_out=True),
        dst.correct_cases(form="merge", dtype=torch.float16),
    ],
    ids=[
        "select",
        "local_topk",
        "pack",
        "indexer",
        "deinterleave",
        "masked",
        "attention",
        "attention-seeded",
        "correct",
        "merge-all",
    ],
)
def test_the_reproducer_rebuilds_the_case_exactly(strategy: Any) -> None:
    @settings(max_examples=15, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def prop(case: dst.Case) -> None:
        ns = _run_reproducer_code(case.reproducer("_capture"))
        args, kwargs = ns["got"]
        want_args, want_kwargs, _ = case.build("cpu")
        assert len(args) == len(want_args) and all(_equal(a, b) for a, b in zip(args, want_args))
        assert kwargs.keys() == want_kwargs.keys() and all(_equal(kwargs[k], want_kwargs[k]) for k in kwargs)

    prop()


def _run_reproducer_code(code: str) -> dict[str, Any]:
    ns: dict[str, Any] = {"_capture": _capture}
    exec(compile(code, "<reproducer>", "exec"), ns)
    return ns


def test_the_step_reproducer_rebuilds_the_problem() -> None:
    @settings(max_examples=5, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(dst.step_cases(max_world=4))
    def prop(case: dst.Case) -> None:
        ns = _run_reproducer_code(case.reproducer("_capture"))
        (a,), _ = ns["got"]
        b = case.values["problem"]
        for name in ("q", "seq_lens"):
            assert _equal(getattr(a, name), getattr(b, name))
        for name in ("kv_caches", "block_tables", "index_scores"):
            assert all(_equal(x, y) for x, y in zip(getattr(a, name), getattr(b, name)))

    prop()


def test_public_strategies_in_a_users_own_test() -> None:
    """What the strategies module's docstring shows: a user's own property test over select cases."""
    seen = []

    @settings(max_examples=10, derandomize=True, database=None, deadline=None)
    @given(dst.select_cases(max_world=4))
    def test_my_select(case: dst.Case) -> None:
        args, kwargs, _ = case.build("cpu")
        got = REFERENCE_STAGES.select(*args, **kwargs)
        want = oracle.select(case.values["gathered"], case.values["k"])
        assert [sorted(r) for r in got.tolist()] == [sorted(r) for r in want.tolist()]
        seen.append(case.values["gathered"].shape[0])

    test_my_select()
    assert seen and max(seen) <= 4


# ---- the oracle ---------------------------------------------------------------------------------------
def test_oracle_select_by_hand() -> None:
    # rank 0: (1.0, id 5), (nan, id 0); rank 1: (1.0, id 2), (-0.0, id 7); one invalid (+inf, -1)
    g = torch.tensor(
        [[[[1.0, 5.0], [math.nan, 0.0], [INF, -1.0]]], [[[1.0, 2.0], [-0.0, 7.0], [0.0, 3.0]]]], dtype=torch.float32
    )
    assert oracle.select(g, 4).tolist() == [[2, 5, 3, 7]]  # ties: lower id first; -0.0 == +0.0
    assert oracle.select(g, 6).tolist() == [[2, 5, 3, 7, -1, -1]]


def test_oracle_local_topk_and_pack_by_hand() -> None:
    s = torch.tensor([[9.0, 1.0, 1.0, math.nan, 5.0]])
    # keys j = 0..3 are columns 1..4: scores 1, 1, NaN (never chosen), 5; column 0 (9.0) is another row's
    assert oracle.local_topk(s, 3, torch.tensor([4]), torch.tensor([1])).tolist() == [[3, 0, 1]]
    assert oracle.local_topk(s, 4, torch.tensor([3]), torch.tensor([1])).tolist() == [[0, 1, -1, -1]]
    packed = oracle.pack(s, torch.tensor([[1, -1]]), DcpGeometry(2, 1, 2, 2), row_starts=torch.tensor([1]))
    assert packed.tolist() == [[[1.0, 3.0], [-INF, -1.0]]]  # local 1 on rank 1 with I=2 is global 3


@pytest.mark.parametrize("w,i,next_n", [(1, 1, 1), (2, 1, 2), (3, 2, 1), (4, 4, 2)])
def test_oracle_decode_equals_the_single_device_oracle(w: int, i: int, next_n: int) -> None:
    from dcp_ref.pipeline import make_dcp_problem, single_device_decode

    p = make_dcp_problem(w, i, seq_lens=[13, 5, 22], next_n=next_n, block_size=2 * i, seed=w)
    ref_out, ref_lse, ref_ids = single_device_decode(p, 6, 0.3)
    got = oracle.decode(
        p.q,
        [s.kv_cache for s in p.shards],
        [s.block_table for s in p.shards],
        [s.index_scores for s in p.shards],
        p.seq_lens,
        p.next_n,
        6,
        0.3,
        block_size=p.block_size,
        interleave=i,
    )
    assert torch.equal(got.ids, ref_ids)
    torch.testing.assert_close(got.out, ref_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.lse, ref_lse, rtol=1e-12, atol=1e-12)
    o, lse = got.head_shard(1, 0)
    assert torch.equal(o, got.out) and torch.equal(lse, got.lse)


def test_oracle_decode_on_a_users_own_tensors_and_the_runner() -> None:
    """make_step_problem's shards through the oracle agree with the reference step on 3 ranks."""
    scores = [[0.5, 0.5, -0.0, INF, math.nan, 1.0, 0.0]]
    p = make_step_problem(3, 1, 2, [7], 1, scores, num_heads=3, head_dim=4, topk=4, seed=1)
    ref = oracle.decode(
        p.q,
        p.kv_caches,
        p.block_tables,
        p.index_scores,
        p.seq_lens,
        p.next_n,
        p.topk,
        p.sm_scale,
        block_size=p.block_size,
        interleave=p.interleave,
    )
    assert ref.ids.tolist() == [[3, 5, 0, 1]]
    out, lse = run_step_problem(p, REFERENCE_STAGES)
    torch.testing.assert_close(out.double(), ref.out)
    torch.testing.assert_close(lse.double(), ref.lse)


def test_oracle_rejects_a_key_without_a_block() -> None:
    p = make_step_problem(2, 1, 1, [4], 1, [[0.0] * 4], num_heads=2, head_dim=2, topk=2)
    bad = [t.clone() for t in p.block_tables]
    bad[1][0, 0] = -1
    with pytest.raises(ValueError, match="has no block in block_tables"):
        oracle.decode(p.q, p.kv_caches, bad, p.index_scores, p.seq_lens, 1, 2, 0.5, block_size=1)
    with pytest.raises(ValueError, match="one tensor per rank"):
        oracle.decode(p.q, p.kv_caches, p.block_tables[:1], p.index_scores, p.seq_lens, 1, 2, 0.5, block_size=1)


# ---- packaging: lazy hypothesis, the plugin, the command line -----------------------------------------
def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env={**os.environ, **env}, timeout=300
    )


def test_import_dcp_ref_does_not_import_hypothesis_and_the_oracle_does_not_need_it() -> None:
    code = textwrap.dedent("""
        import sys
        import dcp_ref, dcp_ref.stages, dcp_ref.step
        assert "hypothesis" not in sys.modules, "import dcp_ref imported hypothesis"
        sys.modules["hypothesis"] = None  # as if it were not installed
        from dcp_ref.testing import oracle
        assert oracle.select.__module__ == "dcp_ref.testing.oracle"
        try:
            from dcp_ref.testing import check_select
        except ModuleNotFoundError as e:
            assert "needs hypothesis" in str(e), e
            print("ok")
    """)
    r = _python(code)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_the_pytest_plugin_in_a_users_suite(tmp_path: Path) -> None:
    (tmp_path / "test_user.py").write_text(
        textwrap.dedent("""
        import torch
        from dcp_ref.topk import stable_topk

        def my_topk(gathered, k):
            return stable_topk(gathered, k)

        def my_wrong_topk(gathered, k):
            out = stable_topk(gathered, k)
            return torch.where(out >= 0, out + 1, out).to(torch.int32)

        def test_my_select(dcp_conformance):
            dcp_conformance.select(my_topk, sorted=False)

        def test_my_wrong_select(dcp_conformance):
            dcp_conformance.select(my_wrong_topk)
    """)
    )
    load = [] if _plugin_entry_point() else ["-p", "dcp_ref.testing.plugin"]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *load,
            "--dcp-max-examples",
            "10",
            "-q",
            "-p",
            "no:cacheprovider",
            str(tmp_path / "test_user.py"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert "1 failed, 1 passed" in r.stdout, r.stdout + r.stderr
    assert "Reproducer:" in r.stdout and "got = my_wrong_topk(gathered, k)" in r.stdout


def test_the_command_line(tmp_path: Path) -> None:
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "dcp_ref.testing",
            "dcp_ref.topk:stable_topk",
            "--stage",
            "select",
            "--sorted",
            "--max-examples",
            "10",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert ok.returncode == 0 and ok.stdout.startswith("PASS: dcp_ref.topk:stable_topk conforms"), ok.stdout + ok.stderr
    (tmp_path / "user_kernels.py").write_text(
        textwrap.dedent("""
        import math, torch
        def attention(q, kv_cache, slots, counts, sm_scale, v_dim):
            from dcp_ref.attention import sparse_mla_attention
            o, lse = sparse_mla_attention(q, kv_cache, slots, counts, sm_scale, v_dim=v_dim)
            return o, lse / math.log(2)
    """)
    )
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "dcp_ref.testing",
            "user_kernels:attention",
            "--stage",
            "attention",
            "--max-examples",
            "10",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert bad.returncode == 1 and "declare lse_base='2'" in bad.stdout, bad.stdout + bad.stderr
    usage = subprocess.run(
        [sys.executable, "-m", "dcp_ref.testing", "user_kernels:attention", "--stage", "nope"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert usage.returncode == 2 and "--stage" in usage.stderr


def select_ties_by_position(gathered: torch.Tensor, k: int) -> torch.Tensor:
    """Chapter 08's planted bug: ties broken by candidate position (rank order), not by the lower id. Found
    only after ~150 cases, so the search path, and what perturbs it, matter."""
    W, T, K, _ = gathered.shape
    cand = gathered.permute(1, 0, 2, 3).reshape(T, W * K, 2)
    score, ids = cand[..., 0], cand[..., 1]
    valid = (ids >= 0) & ~torch.isnan(score)
    score = torch.where(valid, score + 0.0, 0.0)
    order = torch.arange(W * K).expand(T, W * K)
    for key in (score, valid.to(torch.int8)):  # stable sorts: by score, then valid first
        order = order.gather(1, torch.sort(key.gather(1, order), dim=1, descending=True, stable=True).indices)
    n = min(k, W * K)
    out = torch.full((T, k), -1, dtype=torch.int32)
    top = order[:, :n]
    out[:, :n] = torch.where(valid.gather(1, top), ids.gather(1, top), -1).to(torch.int32)
    return out


def test_a_check_does_not_depend_on_which_local_modules_are_loaded(tmp_path, monkeypatch) -> None:
    """Hypothesis mixes literals of loaded local modules into its draws; the kit pins that pool empty, so the
    same check finds the same counterexample after a new local module full of constants is imported.
    (Without the pin this bug's search went from 232 to 174 cases when the module below was imported.)"""

    def counterexample() -> tuple[str, int]:
        with pytest.raises(ConformanceError) as info:
            check_select(select_ties_by_position)
        return info.value.reproducer, info.value.calls

    before = counterexample()
    consts = [*range(-5, 300), 0.5, -0.0, 1.5, 2.25, 3e38, -3e38, 1e-45]
    (tmp_path / "kit_consts_mod.py").write_text("".join(f"C{i} = {v!r}\n" for i, v in enumerate(consts)))
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    importlib.import_module("kit_consts_mod")
    assert counterexample() == before


# ---- the mutation test: >= 30 deliberately wrong stage implementations, each caught by its checker ------
# Each mutant is a small, plausible bug (the kind a kernel port makes), module-level so that a reproducer
# could import it. The kit must flag every one with a small budget (a few drawn cases plus the adversarial
# ones of dcp_ref.testing.strategies), and the correct implementations must pass with the same budget.
MUT_EXAMPLES, MUT_SHRINK = 12, 0  # no shrinking: the first failing case is enough here
POISON = 2**31 - 1  # the deinterleave poison slot, restated independently of the code under test


def _sel(gathered: torch.Tensor, k: int, **kw: Any) -> torch.Tensor:
    from dcp_ref.topk import stable_topk

    return stable_topk(gathered, k, sorted=True, **kw)


def _rows(gathered: torch.Tensor) -> torch.Tensor:
    w, t, kk, _ = gathered.shape
    return gathered.permute(1, 0, 2, 3).reshape(t, w * kk, 2)


def mut_select_position_ties(gathered: torch.Tensor, k: int) -> torch.Tensor:
    """Unstable ties: equal scores keep their position in the gathered buffer, not the lower id."""
    c = _rows(gathered)
    s, ids = c[..., 0], c[..., 1]
    valid = (ids >= 0) & ~torch.isnan(s)
    key = torch.where(valid, s.double(), -math.inf)
    key = torch.where(key == 0, 0.0, key)
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    kk = min(k, c.shape[1])
    picked = torch.gather(torch.where(valid, ids, -1.0), 1, order[:, :kk]).to(torch.int32)
    picked = torch.where(torch.gather(valid, 1, order[:, :kk]), picked, -1)
    out = torch.full((c.shape[0], k), -1, dtype=torch.int32)
    out[:, :kk] = picked
    return out


def mut_select_signed_zero_below_zero(gathered: torch.Tensor, k: int) -> torch.Tensor:
    """-0.0 ordered below +0.0 (the float's bits taken as they are)."""
    g = gathered.clone()
    s = g[..., 0]
    g[..., 0] = torch.where((s == 0) & torch.signbit(s), torch.tensor(-1e-45), s)
    return _sel(g, k)


def mut_select_nan_as_valid(gathered: torch.Tensor, k: int) -> torch.Tensor:
    """A NaN score read as the largest one (NaN-unaware max)."""
    g = gathered.clone()
    g[..., 0] = torch.nan_to_num(g[..., 0], nan=math.inf, posinf=math.inf, neginf=-math.inf)
    return _sel(g, k)


def mut_select_dropping_neg_inf(gathered: torch.Tensor, k: int) -> torch.Tensor:
    """A -inf score taken for "invalid" (it is a valid, very low score)."""
    g = gathered.clone()
    g[..., 0] = torch.where(g[..., 0] == -math.inf, math.nan, g[..., 0])
    return _sel(g, k)


def mut_select_k_minus_one(gathered: torch.Tensor, k: int) -> torch.Tensor:
    """An off-by-one bound: k - 1 winners."""
    out = torch.full((gathered.shape[1], k), -1, dtype=torch.int32)
    if k > 1:
        out[:, : k - 1] = _sel(gathered, k - 1)
    return out


def mut_select_invalid_id_selected(gathered: torch.Tensor, k: int) -> torch.Tensor:
    """A candidate with id -1 judged by its score alone (valid when the score is)."""
    g = gathered.clone()
    g[..., 1] = torch.where(g[..., 1] < 0, float(2**24 - 1), g[..., 1])
    return _sel(g, k)


def mut_select_int64(gathered: torch.Tensor, k: int) -> torch.Tensor:
    """The right ids in the wrong dtype (int64, the protocol says int32)."""
    return _sel(gathered, k).long()


def mut_select_ignoring_out(gathered: torch.Tensor, k: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Accepts out= and returns a new tensor without writing it."""
    return _sel(gathered, k)


def mut_local_topk_ignoring_row_starts(
    scores: torch.Tensor, k: int, lengths: torch.Tensor, row_starts: torch.Tensor | None
) -> torch.Tensor:
    """Reads every row from column 0 (row_starts ignored), clamped to stay in the tensor."""
    from dcp_ref.indexer import local_topk

    return local_topk(scores, k, torch.minimum(lengths, torch.full_like(lengths, scores.shape[1])), None)


def mut_local_topk_nan_as_valid(
    scores: torch.Tensor, k: int, lengths: torch.Tensor, row_starts: torch.Tensor | None
) -> torch.Tensor:
    """NaN scores (masked keys) ranked as the largest."""
    from dcp_ref.indexer import local_topk

    return local_topk(torch.nan_to_num(scores, nan=math.inf), k, lengths, row_starts)


def mut_indexer_ignoring_interleave(
    scores: torch.Tensor,
    lengths: torch.Tensor,
    geometry: DcpGeometry,
    k: int,
    *,
    row_starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The local top-K right, the global ids computed with I = 1."""
    from dcp_ref.indexer import local_topk
    from dcp_ref.topk import pack_candidates

    g = geometry
    ids = local_topk(scores, k, lengths, row_starts)
    return pack_candidates(scores, ids, DcpGeometry(g.world_size, g.rank), row_starts)


def _pack_with_ids(scores, local_ids, geometry, row_starts, gid_fn):  # type: ignore[no-untyped-def]
    from dcp_ref.topk import pack_candidates

    out = pack_candidates(scores, local_ids, geometry, row_starts)
    j = local_ids.long()
    out[..., 1] = torch.where(j >= 0, gid_fn(j).to(torch.float32), out[..., 1])
    return out


def mut_pack_swapped_rank_and_world(scores, local_ids, geometry, row_starts):  # type: ignore[no-untyped-def]
    """The global id with rank and world size swapped in the formula."""
    w, r, i = geometry.world_size, geometry.rank, geometry.interleave
    return _pack_with_ids(scores, local_ids, geometry, row_starts, lambda j: (j // i) * (r * i) + w * i + j % i)


def mut_pack_wrong_owner_formula(scores, local_ids, geometry, row_starts):  # type: ignore[no-untyped-def]
    """rank instead of rank * I: right only for I = 1 or rank 0."""
    w, r, i = geometry.world_size, geometry.rank, geometry.interleave
    return _pack_with_ids(scores, local_ids, geometry, row_starts, lambda j: (j // i) * (w * i) + r + j % i)


def mut_pack_invalid_as_zero(scores, local_ids, geometry, row_starts):  # type: ignore[no-untyped-def]
    """An empty slot packed as (0.0, -1) instead of (-inf, -1)."""
    from dcp_ref.topk import pack_candidates

    out = pack_candidates(scores, local_ids, geometry, row_starts)
    out[..., 0] = torch.where(local_ids < 0, 0.0, out[..., 0])
    return out


def _deint(global_ids, req_of_token, block_table, g, compact=True, rank=None, interleave=None):  # type: ignore[no-untyped-def]
    from dcp_ref.deinterleave import deinterleave_and_compact, deinterleave_masked

    fn = deinterleave_and_compact if compact else deinterleave_masked
    r = g.rank if rank is None else rank
    i = g.interleave if interleave is None else interleave
    return fn(global_ids, req_of_token, block_table, DcpGeometry(g.world_size, r, i, g.block_size), validate=False)


def _recompact(slots: torch.Tensor, compact: bool) -> tuple[torch.Tensor, torch.Tensor]:
    from dcp_ref.deinterleave import compact_to_front

    if compact:
        return compact_to_front(slots, validate=False)
    return slots, (slots >= 0).sum(1, dtype=torch.int32)


def mut_deinterleave_duplicating_a_slot(global_ids, req_of_token, block_table, geometry, compact=True):  # type: ignore[no-untyped-def]
    """A row with room left repeats its first slot once more (a scatter that writes one entry twice)."""
    slots, counts = _deint(global_ids, req_of_token, block_table, geometry)
    slots, counts = slots.clone(), counts.clone()
    for t in range(slots.shape[0]):
        c = int(counts[t])
        if 0 < c < slots.shape[1]:
            slots[t, c] = slots[t, 0]
            counts[t] += 1
    if not compact:
        return _deint(global_ids, req_of_token, block_table, geometry, compact=False)[0], counts
    return slots, counts


def mut_deinterleave_losing_a_slot(global_ids, req_of_token, block_table, geometry, compact=True):  # type: ignore[no-untyped-def]
    """The first slot of every non-empty row lost (overwritten with -1), the count unchanged."""
    slots, counts = _deint(global_ids, req_of_token, block_table, geometry, compact)
    slots = slots.clone()
    for t in range(slots.shape[0]):
        nz = (slots[t] >= 0).nonzero()
        if nz.numel():
            slots[t, int(nz[0])] = -1
    return slots, counts


def mut_deinterleave_poison_as_not_here(global_ids, req_of_token, block_table, geometry, compact=True):  # type: ignore[no-untyped-def]
    """The old rule: a key without a block and a bad request id give -1 ("not here"), a plausible empty row."""
    slots, _ = _deint(global_ids, req_of_token, block_table, geometry, compact=False)
    return _recompact(torch.where(slots == POISON, -1, slots), compact)


def mut_deinterleave_bad_request_as_empty(global_ids, req_of_token, block_table, geometry, compact=True):  # type: ignore[no-untyped-def]
    """Only a bad request id reads as an empty row (missing blocks still poisoned)."""
    slots, _ = _deint(global_ids, req_of_token, block_table, geometry, compact=False)
    bad = ((req_of_token < 0) | (req_of_token >= block_table.shape[0])).unsqueeze(1)
    return _recompact(torch.where(bad, -1, slots), compact)


def mut_deinterleave_ignoring_interleave(global_ids, req_of_token, block_table, geometry, compact=True):  # type: ignore[no-untyped-def]
    """Owner and local index computed with I = 1."""
    return _deint(global_ids, req_of_token, block_table, geometry, compact, interleave=1)


def mut_deinterleave_wrong_rank(global_ids, req_of_token, block_table, geometry, compact=True):  # type: ignore[no-untyped-def]
    """The next rank's ids (rank and world size mixed up: rank + 1 mod W)."""
    g = geometry
    return _deint(global_ids, req_of_token, block_table, g, compact, rank=(g.rank + 1) % g.world_size)


def mut_deinterleave_table_bound_off_by_one(global_ids, req_of_token, block_table, geometry, compact=True):  # type: ignore[no-untyped-def]
    """The last block-table column taken for past the table (a `<` that should be `<=`)."""
    return _deint(global_ids, req_of_token, block_table[:, :-1], geometry, compact)


def mut_deinterleave_counts_without_poison(global_ids, req_of_token, block_table, geometry, compact=True):  # type: ignore[no-untyped-def]
    """Counts that skip the poison slot (the attention then never reads it: poison lost)."""
    slots, _ = _deint(global_ids, req_of_token, block_table, geometry, compact)
    return slots, ((slots >= 0) & (slots != POISON)).sum(1, dtype=torch.int32)


def mut_deinterleave_counts_int64(global_ids, req_of_token, block_table, geometry, compact=True):  # type: ignore[no-untyped-def]
    """The right counts in the wrong dtype."""
    slots, counts = _deint(global_ids, req_of_token, block_table, geometry, compact)
    return slots, counts.long()


def mut_deinterleave_sorted_when_ordered(global_ids, req_of_token, block_table, geometry, compact=True):  # type: ignore[no-untyped-def]
    """The atomic kernel's canonical form (valid slots ascending) where top-K order is required."""
    from dcp_ref.deinterleave import compact_to_front

    slots, _ = _deint(global_ids, req_of_token, block_table, geometry, compact=False)
    return compact_to_front(slots, ordered=False, validate=False)


def _attn(q, kv_cache, slots, counts, sm_scale, v_dim, base="e"):  # type: ignore[no-untyped-def]
    from dcp_ref.attention import sparse_mla_attention

    return sparse_mla_attention(q, kv_cache, slots, counts, sm_scale, base, v_dim=v_dim, validate=False)


def mut_attention_without_max_subtraction(q, kv_cache, slots, counts, sm_scale, v_dim):  # type: ignore[no-untyped-def]
    """softmax as exp(s) / sum exp(s) in float32: overflows on large scores."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, v_dim)
    lse = torch.full((T, H), -math.inf)
    for t in range(T):
        n = int(counts[t])
        if not n:
            continue
        keys = kv_cache[slots[t, :n].long()].float()
        s = (q[t].float() @ keys.T) * sm_scale
        e = torch.exp(s)
        out[t] = (e / e.sum(-1, keepdim=True)) @ keys[:, :v_dim]
        lse[t] = torch.log(e.sum(-1))
    return out, lse


def mut_attention_empty_lse_zero(q, kv_cache, slots, counts, sm_scale, v_dim):  # type: ignore[no-untyped-def]
    """An empty row's LSE reported as 0 (it must be -inf: the merge's "empty")."""
    out, lse = _attn(q, kv_cache, slots, counts, sm_scale, v_dim)
    return out, torch.where((counts == 0).unsqueeze(1), 0.0, lse)


def mut_attention_reading_past_counts(q, kv_cache, slots, counts, sm_scale, v_dim):  # type: ignore[no-untyped-def]
    """Every in-range entry of the row read, the padding past counts[t] included."""
    readable = (slots >= 0) & (slots < kv_cache.shape[0])
    return _attn(q, kv_cache, torch.where(readable, slots, 0), torch.full_like(counts, slots.shape[1]), sm_scale, v_dim)


def mut_attention_ignoring_sm_scale(q, kv_cache, slots, counts, sm_scale, v_dim):  # type: ignore[no-untyped-def]
    """The softmax scale dropped."""
    return _attn(q, kv_cache, slots, counts, 1.0, v_dim)


def mut_attention_v_dim_short(q, kv_cache, slots, counts, sm_scale, v_dim):  # type: ignore[no-untyped-def]
    """An off-by-one value width."""
    out, lse = _attn(q, kv_cache, slots, counts, sm_scale, v_dim)
    return out[..., : v_dim - 1], lse


def _correct(partial, all_lse, rank, base="e"):  # type: ignore[no-untyped-def]
    from dcp_ref.lse import correct_partial

    return correct_partial(partial, all_lse, rank, base)


def mut_correct_plus_inf_as_empty(partial, all_lse, rank):  # type: ignore[no-untyped-def]
    """NaN and +inf LSEs read as "empty" (sanitize_lse): corrupt data vanishes."""
    from dcp_ref.lse import sanitize_lse

    return _correct(partial, sanitize_lse(all_lse), rank)


def mut_correct_nan_lse_as_empty(partial, all_lse, rank):  # type: ignore[no-untyped-def]
    """Only a NaN LSE read as "empty"."""
    return _correct(partial, torch.where(torch.isnan(all_lse), -math.inf, all_lse), rank)


def mut_correct_without_max_subtraction(partial, all_lse, rank):  # type: ignore[no-untyped-def]
    """w_r = exp(lse_r) / sum exp(lse): overflows at LSE 1000."""
    lse = all_lse.double()
    e = torch.exp(lse)
    total = e.sum(0)
    w = e[rank] / total
    out = torch.where((lse[rank] == -math.inf).unsqueeze(-1), 0.0, w.unsqueeze(-1) * partial.double())
    return out.to(partial.dtype), torch.log(total).float()


def mut_correct_base2_before_max(partial, all_lse, rank):  # type: ignore[no-untyped-def]
    """The LSEs turned to base 2 in float32 before the max is subtracted: 3.3e38 * log2(e) overflows."""
    x = all_lse.float()
    corrupt = torch.isnan(x) | (x == math.inf)
    x2 = torch.where(corrupt, -math.inf, x) * (1.0 / math.log(2.0))  # float32
    m = x2.amax(0)
    m = torch.where(m > -math.inf, m, 0.0)
    e = torch.exp2(x2 - m)
    e = torch.where(corrupt, math.nan, e)
    total = e.sum(0)
    out = torch.where((x[rank] == -math.inf).unsqueeze(-1), 0.0, (e[rank] / total).unsqueeze(-1) * partial.float())
    merged = torch.where(total == 0, -math.inf, (m + torch.log2(total)) * math.log(2.0))
    return out.to(partial.dtype), merged


def mut_correct_ignoring_out(partial, all_lse, rank, *, out=None, out_lse=None):  # type: ignore[no-untyped-def]
    """Accepts out= / out_lse= and writes neither."""
    return _correct(partial, all_lse, rank)


# ---- select-to-slots mutants (issue 32, class 9): each breaks one clause of the owner-local contract --------
def _s2s_rows(rows: list[list[int]], k: int, out_slots=None, out_counts=None):  # type: ignore[no-untyped-def]
    slots = torch.full((len(rows), k), -1, dtype=torch.int32)
    for t, r in enumerate(rows):
        slots[t, : len(r)] = torch.tensor(r[:k], dtype=torch.int32)
    counts = torch.tensor([len(r) for r in rows], dtype=torch.int32)
    return slots, counts


def mut_s2s_ties_to_higher_id(gathered, own_ids, req_of_token, block_table, geometry, k, *, order="global_id"):  # type: ignore[no-untyped-def]
    """Equal scores go to the HIGHER id (global_id) / the later position (rank_local): the reversed tie-break."""
    from dcp_ref.select_to_slots import reference_select_to_slots

    g = geometry
    if order == "rank_local":  # reversed positions: the ranks and each rank's candidates in reverse
        mirror = DcpGeometry(g.world_size, g.world_size - 1 - g.rank, g.interleave, g.block_size)
        return reference_select_to_slots(
            gathered.flip(0).flip(2), own_ids.flip(1), req_of_token, block_table, mirror, k, order="rank_local"
        )
    W, I, bs = g.world_size, g.interleave, g.block_size
    rows = []
    for t in range(gathered.shape[1]):
        c = [(float(s), int(i)) for s, i in gathered[:, t].reshape(-1, 2).tolist() if not math.isnan(s) and i >= 0]
        c.sort(key=lambda e: (-(oracle.float32_value(e[0]) + 0.0), -e[1]))
        row = []
        for _, i in c[:k]:
            if (i // I) % W == g.rank:
                loc = (i // (W * I)) * I + i % I
                b = int(req_of_token[t])
                blk = (
                    int(block_table[b, loc // bs])
                    if 0 <= b < block_table.shape[0] and loc // bs < block_table.shape[1]
                    else -1
                )
                row.append(min(blk * bs + loc % bs, 2**31 - 1) if blk >= 0 else 2**31 - 1)
        rows.append(row)
    return _s2s_rows(rows, k)


def mut_s2s_dropping_the_last_winner(gathered, own_ids, req_of_token, block_table, geometry, k, *, order="global_id"):  # type: ignore[no-untyped-def]
    """This rank's last winner of each row is lost (count one short)."""
    from dcp_ref.select_to_slots import reference_select_to_slots

    s, c = reference_select_to_slots(gathered, own_ids, req_of_token, block_table, geometry, k, order=order)
    for t in range(c.shape[0]):
        if c[t] > 0:
            s[t, c[t] - 1] = -1
            c[t] -= 1
    return s, c


def mut_s2s_poison_as_slot_zero(gathered, own_ids, req_of_token, block_table, geometry, k, *, order="global_id"):  # type: ignore[no-untyped-def]
    """A winner without a block gets slot 0: a plausible KV row instead of the poison slot."""
    from dcp_ref.select_to_slots import SENTINEL_SLOT, reference_select_to_slots

    s, c = reference_select_to_slots(gathered, own_ids, req_of_token, block_table, geometry, k, order=order)
    return torch.where(s == SENTINEL_SLOT, 0, s), c


def mut_s2s_next_ranks_winners(gathered, own_ids, req_of_token, block_table, geometry, k, *, order="global_id"):  # type: ignore[no-untyped-def]
    """The winners of the next rank (global_id: ownership computed with rank + 1)."""
    from dcp_ref.select_to_slots import reference_select_to_slots

    g = geometry
    if order == "rank_local" or g.world_size == 1:
        gathered = gathered.roll(1, 0)  # rank_local: the slices shifted by one rank
    nxt = DcpGeometry(g.world_size, (g.rank + 1) % g.world_size, g.interleave, g.block_size)
    return reference_select_to_slots(
        gathered, own_ids, req_of_token, block_table, nxt if order == "global_id" else g, k, order=order
    )


def mut_combine_ignoring_the_last_rank(outs, lses, *, out=None, out_lse=None):  # type: ignore[no-untyped-def]
    """Merges ranks 0 .. W-2 only: the last rank's partial is lost."""
    from dcp_ref.stages import reference_combine

    if outs.shape[0] == 1:
        return reference_combine(outs, lses, out=out, out_lse=out_lse)
    return reference_combine(outs[:-1], lses[:-1], out=out, out_lse=out_lse)


def mut_combine_weighting_empty_ranks(outs, lses, *, out=None, out_lse=None):  # type: ignore[no-untyped-def]
    """Weights every partial by exp(lse - merged), an empty rank's garbage times 0 included (0 * NaN = NaN)."""
    lse = lses.double()
    m = torch.where(torch.isfinite(lse), lse, -math.inf).amax(0)
    m = torch.where(m > -math.inf, m, 0.0)
    total = torch.exp(lse - m).sum(0)
    merged = torch.where(total == 0, -math.inf, m + torch.log(total))
    res = (torch.exp(lse - merged).unsqueeze(-1) * outs.double()).sum(0)
    return res.to(outs.dtype), merged.to(lses.dtype)


def mut_guard_doing_nothing(
    partial, lse, local_bounds, req_of_token, block_table, geometry, n_cols, *, row_starts=None, **scored
):  # type: ignore[no-untyped-def]
    """A no-op guard: out-of-contract tokens keep plausible outputs."""


def mut_guard_poisoning_the_lse_only(
    partial, lse, local_bounds, req_of_token, block_table, geometry, n_cols, *, row_starts=None, **scored
):  # type: ignore[no-untyped-def]
    """Poisons the LSE but leaves the partial output as it was."""
    from dcp_ref.guard import reference_guard

    reference_guard(
        partial.clone(), lse, local_bounds, req_of_token, block_table, geometry, n_cols, row_starts=row_starts,
        **scored,
    )  # fmt: skip


def mut_guard_checking_the_first_block_only(
    partial, lse, local_bounds, req_of_token, block_table, geometry, n_cols, *, row_starts=None, **scored
):  # type: ignore[no-untyped-def]
    """Looks for a missing block among the first one a token needs only."""
    from dcp_ref.guard import reference_guard

    n = local_bounds.clamp(max=geometry.block_size)
    reference_guard(partial, lse, n, req_of_token, block_table, geometry, n_cols, row_starts=row_starts, **scored)


def mut_guard_ignoring_row_starts(
    partial, lse, local_bounds, req_of_token, block_table, geometry, n_cols, *, row_starts=None, **scored
):  # type: ignore[no-untyped-def]
    """Checks each window as if it started at column 0."""
    from dcp_ref.guard import reference_guard

    reference_guard(partial, lse, local_bounds, req_of_token, block_table, geometry, n_cols, **scored)


def mut_guard_ignoring_the_index_query(
    partial, lse, local_bounds, req_of_token, block_table, geometry, n_cols, *, row_starts=None, **scored
):  # type: ignore[no-untyped-def]
    """The scoring rows without the query's check: a NaN index query (every score NaN) reads as "no keys"."""
    from dcp_ref.guard import reference_guard

    scored = {**scored, "index_q": None, "index_weights": None}
    reference_guard(partial, lse, local_bounds, req_of_token, block_table, geometry, n_cols, row_starts=row_starts,
                    **scored)  # fmt: skip


def mut_guard_ignoring_the_index_cache(
    partial, lse, local_bounds, req_of_token, block_table, geometry, n_cols, *, row_starts=None, **scored
):  # type: ignore[no-untyped-def]
    """Block ids past the index cache taken as present (the short index shard of issue 32, class 1)."""
    from dcp_ref.guard import reference_guard

    scored = {**scored, "num_blocks": None}
    reference_guard(partial, lse, local_bounds, req_of_token, block_table, geometry, n_cols, row_starts=row_starts,
                    **scored)  # fmt: skip


def mut_guard_ignoring_mtp_groups(
    partial, lse, local_bounds, req_of_token, block_table, geometry, n_cols, *, row_starts=None, **scored
):  # type: ignore[no-untyped-def]
    """Each token judged alone: an MTP pair naming two requests passes."""
    from dcp_ref.guard import reference_guard

    scored = {**scored, "next_n": 1}
    reference_guard(partial, lse, local_bounds, req_of_token, block_table, geometry, n_cols, row_starts=row_starts,
                    **scored)  # fmt: skip


def _scoring_mutant(change: str) -> Callable[..., Any]:
    """The reference scoring with one thing wrong (``change``)."""

    def fn(index_q, weights, index_cache, block_table, req_of_token, local_bounds, geometry, *, row_starts=None,
           out=None):  # type: ignore[no-untyped-def]  # fmt: skip
        from dcp_ref.stages import reference_scoring

        w, bounds = weights, local_bounds
        if change == "abs weights":
            w = weights.abs()
        if change == "drops the last key":
            bounds = (local_bounds - 1).clamp(min=0)
        res = reference_scoring(index_q, w, index_cache, block_table, req_of_token, bounds, geometry,
                                row_starts=row_starts, out=out)  # fmt: skip
        if change == "NaN as 0":  # relu as maximum: NaN data read as "no score"
            res.nan_to_num_(nan=0.0, posinf=math.inf, neginf=-math.inf)
        if change == "poison as empty":  # an out-of-contract row as "no keys" (issue 32, classes 1-2)
            res[torch.isnan(res).all(1)] = -math.inf
        return res

    fn.__name__ = fn.__qualname__ = "mut_scoring_" + change.replace(" ", "_")
    return fn


def _check(name: str) -> Callable[..., None]:
    kw = dict(max_examples=MUT_EXAMPLES, shrink_budget=MUT_SHRINK)
    return {
        # the guard's rules are many and each bad draw rare (half the cases carry the scoring rows): more cases,
        # each a few torch ops
        "guard": lambda fn: check_guard(fn, **{**kw, "max_examples": 80}),
        "scoring": lambda fn: check_scoring(fn, **{**kw, "max_examples": 40}),
        "combine": lambda fn: check_combine(fn, **kw),
        "select_to_slots": lambda fn: check_select_to_slots(fn, **kw),
        "select_to_slots_rank_local": lambda fn: check_select_to_slots(fn, order="rank_local", **kw),
        "select": lambda fn: check_select(fn, **kw),
        "local_topk": lambda fn: check_local_topk(fn, **kw),
        "indexer": lambda fn: check_indexer(fn, **kw),
        "pack": lambda fn: check_pack(fn, **kw),
        "deinterleave": lambda fn: check_deinterleave(fn, ordered=True, **kw),
        "deinterleave_masked": lambda fn: check_deinterleave(fn, compact=False, **kw),
        "attention": lambda fn: check_attention(fn, **kw),
        "correct": lambda fn: check_correct(fn, **kw),
        "correct_base2": lambda fn: check_correct(fn, lse_base="2", **kw),
    }[name]


MUTANTS: list[tuple[str, Callable[..., Any]]] = [
    ("select", select_ties_to_higher_id),
    ("select", mut_select_position_ties),
    ("select", mut_select_signed_zero_below_zero),
    ("select", mut_select_nan_as_valid),
    ("select", mut_select_dropping_neg_inf),
    ("select", mut_select_k_minus_one),
    ("select", mut_select_invalid_id_selected),
    ("select", mut_select_int64),
    ("select", mut_select_ignoring_out),
    ("local_topk", local_topk_off_by_one),
    ("local_topk", mut_local_topk_ignoring_row_starts),
    ("local_topk", mut_local_topk_nan_as_valid),
    ("indexer", indexer_off_by_one),
    ("indexer", mut_indexer_ignoring_interleave),
    ("pack", pack_ignoring_interleave),
    ("pack", mut_pack_swapped_rank_and_world),
    ("pack", mut_pack_wrong_owner_formula),
    ("pack", mut_pack_invalid_as_zero),
    ("deinterleave", deinterleave_dropping_last),
    ("deinterleave", mut_deinterleave_duplicating_a_slot),
    ("deinterleave", mut_deinterleave_losing_a_slot),
    ("deinterleave", mut_deinterleave_poison_as_not_here),
    ("deinterleave_masked", mut_deinterleave_poison_as_not_here),
    ("deinterleave", mut_deinterleave_bad_request_as_empty),
    ("deinterleave_masked", mut_deinterleave_ignoring_interleave),
    ("deinterleave", mut_deinterleave_wrong_rank),
    ("deinterleave", mut_deinterleave_table_bound_off_by_one),
    ("deinterleave", mut_deinterleave_counts_without_poison),
    ("deinterleave_masked", mut_deinterleave_counts_int64),
    ("deinterleave", mut_deinterleave_sorted_when_ordered),
    ("attention", attention_base2_as_e),
    ("attention", mut_attention_without_max_subtraction),
    ("attention", mut_attention_empty_lse_zero),
    ("attention", mut_attention_reading_past_counts),
    ("attention", mut_attention_ignoring_sm_scale),
    ("attention", mut_attention_v_dim_short),
    ("correct", correct_multiplying_nan),
    ("correct_base2", correct_base_e_math),
    ("correct", mut_correct_plus_inf_as_empty),
    ("correct", mut_correct_nan_lse_as_empty),
    ("correct", mut_correct_without_max_subtraction),
    ("correct", mut_correct_base2_before_max),
    ("correct", mut_correct_ignoring_out),
    ("guard", mut_guard_doing_nothing),
    ("guard", mut_guard_poisoning_the_lse_only),
    ("guard", mut_guard_checking_the_first_block_only),
    ("guard", mut_guard_ignoring_row_starts),
    ("scoring", _scoring_mutant("abs weights")),
    ("scoring", _scoring_mutant("drops the last key")),
    ("scoring", _scoring_mutant("NaN as 0")),
    ("scoring", _scoring_mutant("poison as empty")),
    ("guard", mut_guard_ignoring_the_index_query),
    ("guard", mut_guard_ignoring_the_index_cache),
    ("guard", mut_guard_ignoring_mtp_groups),
    ("combine", mut_combine_ignoring_the_last_rank),
    ("combine", mut_combine_weighting_empty_ranks),
    ("select_to_slots", mut_s2s_ties_to_higher_id),
    ("select_to_slots_rank_local", mut_s2s_ties_to_higher_id),
    ("select_to_slots", mut_s2s_dropping_the_last_winner),
    ("select_to_slots_rank_local", mut_s2s_dropping_the_last_winner),
    ("select_to_slots", mut_s2s_poison_as_slot_zero),
    ("select_to_slots_rank_local", mut_s2s_poison_as_slot_zero),
    ("select_to_slots", mut_s2s_next_ranks_winners),
    ("select_to_slots_rank_local", mut_s2s_next_ranks_winners),
]


def _correct_impls() -> list[tuple[str, Callable[..., Any]]]:
    from dcp_ref.guard import reference_guard
    from dcp_ref.indexer import local_topk
    from dcp_ref.lse import correct_partial
    from dcp_ref.select_to_slots import reference_select_to_slots
    from dcp_ref.stages import reference_combine
    from dcp_ref.topk import pack_candidates

    return [
        ("guard", reference_guard),
        ("combine", reference_combine),
        ("select_to_slots", reference_select_to_slots),
        ("select_to_slots_rank_local", reference_select_to_slots),
        ("select", REFERENCE_STAGES.select),
        ("local_topk", local_topk),
        ("indexer", REFERENCE_STAGES.indexer),
        ("pack", pack_candidates),
        ("deinterleave", _deint),
        ("deinterleave_masked", _deint),
        ("attention", _attn),
        ("correct", lambda p, lse, r: correct_partial(p, lse, r)),  # its first argument is named `out`
        ("correct_base2", lambda p, lse, r: correct_partial(p, lse, r, "2")),
    ]


def test_the_mutation_table_is_big_enough() -> None:
    assert len(MUTANTS) >= 30 and len({fn for _, fn in MUTANTS}) >= 30


@pytest.mark.parametrize("stage, fn", MUTANTS, ids=[f"{s}-{fn.__name__}" for s, fn in MUTANTS])
def test_every_mutant_is_caught_by_its_stage_check(stage: str, fn: Callable[..., Any]) -> None:
    with pytest.raises(ConformanceError) as info:
        _check(stage)(fn)
    assert info.value.stage.startswith(stage.split("_")[0] if stage != "local_topk" else "local_topk")


@pytest.mark.parametrize("stage, fn", _correct_impls(), ids=[s for s, _ in _correct_impls()])
def test_the_correct_implementations_pass_the_mutation_budget(stage: str, fn: Callable[..., Any]) -> None:
    _check(stage)(fn)


# ---- the kit's own gaps (class 5): the oracle follows the library's rules, the draws cover the corners --
def test_oracle_merge_treats_nan_and_plus_inf_lse_as_corrupt_not_empty() -> None:
    """A NaN or +inf LSE poisons its (t, h): merged LSE NaN, every non-empty rank's share NaN; an empty rank
    (-inf) still gives exactly 0; other heads are untouched. (The kit used to read them as "empty".)"""
    nan = math.nan
    lse = torch.tensor([[[0.0, nan, 1.0]], [[math.inf, 0.0, 1.0]], [[-INF, -INF, -INF]]])  # [W=3, T=1, H=3]
    outs = torch.ones(3, 1, 3, 2)
    outs[2] = nan  # the empty rank's garbage
    merged_out, merged_lse = oracle.merge(outs, lse)
    assert torch.isnan(merged_lse[0, :2]).all() and torch.isnan(merged_out[0, :2]).all()
    assert merged_lse[0, 2].item() == pytest.approx(1.0 + math.log(2.0)) and (merged_out[0, 2] == 1.0).all()
    for r in (0, 1):
        c, _ = oracle.correct(outs[r], lse, r)
        assert torch.isnan(c[0, :2]).all() and torch.allclose(c[0, 2], torch.full((2,), 0.5, dtype=torch.float64))
    c, _ = oracle.correct(outs[2], lse, 2)
    assert (c == 0).all()  # empty: selected away, even on a corrupt head
    from dcp_ref.lse import merge_partials

    lib_out, lib_lse = merge_partials(outs.double(), lse.double())
    assert torch.equal(torch.isnan(lib_lse), torch.isnan(merged_lse))
    assert torch.allclose(lib_out, merged_out, equal_nan=True)


def test_oracle_deinterleave_poisons_out_of_contract_metadata() -> None:
    P = oracle.POISON_SLOT
    assert P == 2**31 - 1
    ids = torch.tensor([[0, 1, 4, 9], [0, 1, 2, 3]])
    table = torch.tensor([[2, -5]])  # block 1 missing (any negative entry), block 2 past the table
    got = oracle.deinterleave(ids, torch.tensor([0, 3]), table, DcpGeometry(1, 0, block_size=4))
    assert got.tolist() == [[8, 9, P, P], [P] * 4]  # row 1: request 3 is not a row of the table


def _draws(strategy: Any, predicates: dict[str, Callable[[Any], bool]]) -> dict[str, bool]:
    """Which predicates some case of a default-sized, derandomized run of ``strategy`` satisfies."""
    from hypothesis import settings as hsettings

    from dcp_ref.testing.checks import DEFAULT_MAX_EXAMPLES

    seen = dict.fromkeys(predicates, False)

    @hsettings(
        max_examples=DEFAULT_MAX_EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def run(case: Any) -> None:
        for name, p in predicates.items():
            seen[name] |= bool(p(case))

    run()
    return seen


def _signed_zero(t: torch.Tensor) -> bool:
    return bool(((t == 0) & torch.signbit(t)).any())


def test_the_default_draws_cover_the_contract_corners() -> None:
    """At default settings the strategies draw corrupt (NaN, +inf) and near-maximum LSEs, negative block
    entries other than -1, request ids outside the block table, and -0.0 index scores."""
    lse = lambda c: c.values["all_lse"]  # noqa: E731
    assert all(
        _draws(
            dst.correct_cases(),
            {
                "nan": lambda c: torch.isnan(lse(c)).any(),
                "+inf": lambda c: (lse(c) == INF).any(),
                "near float32 max": lambda c: ((lse(c).abs() > 1e38) & torch.isfinite(lse(c))).any(),
            },
        ).values()
    )
    bt = lambda c: c.values["block_table"]  # noqa: E731
    assert all(
        _draws(
            dst.deinterleave_cases(),
            {
                "negative entry other than -1": lambda c: (bt(c) < -1).any(),
                "bad request": lambda c: (
                    (c.values["req_of_token"] < 0) | (c.values["req_of_token"] >= bt(c).shape[0])
                ).any(),
            },
        ).values()
    )
    assert _draws(dst.select_cases(), {"-0.0": lambda c: _signed_zero(c.values["gathered"][..., 0])})["-0.0"]
    for strategy in (dst.local_topk_cases(), dst.pack_cases(), dst.indexer_cases()):
        assert _draws(strategy, {"-0.0": lambda c: _signed_zero(c.values["scores"])})["-0.0"]
    step_scores = lambda c: c.values["problem"].index_scores  # noqa: E731
    assert _draws(dst.step_cases(), {"-0.0": lambda c: any(map(_signed_zero, step_scores(c)))})["-0.0"]


def test_the_adversarial_cases_hold_the_corners_and_the_references_pass_them() -> None:
    sel = dst.adversarial_select_cases()
    g = sel[0].values["gathered"]
    assert _signed_zero(g[..., 0]) and (g[..., 0] == -INF).any() and torch.isnan(g[..., 0]).any()
    de = dst.adversarial_deinterleave_cases()[0].values
    assert (de["block_table"] < -1).any() and (de["req_of_token"] >= de["block_table"].shape[0]).any()
    m = dst.adversarial_correct_cases()[0].values["all_lse"]
    assert torch.isnan(m).any() and (m == INF).any() and (m == torch.tensor(3.3e38)).any()
    want = oracle.deinterleave(de["global_ids"], de["req_of_token"], de["block_table"], DcpGeometry(2, 1, 2, 4))
    assert (want == oracle.POISON_SLOT).sum() == 7 + 3  # the bad-request row, two no-block ids, one past the table
