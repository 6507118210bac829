"""NaN from real data propagates through the DCP step to exactly the outputs it affects (issue 10).

Emptiness is a count of zero, never a NaN: a rank with nothing selected reports ``lse = -inf`` and
contributes exactly zero, while a NaN in the query or in an attended KV row — corrupt data — must
reach the output as NaN, just as it does on a single device. The property, for any ``W``, ``I``,
block size, MTP width and top-k, on the reference step and on the kernels step (Triton
interpreted on the CPU):

* a NaN anywhere in KV row ``p`` of request ``b`` makes ``out[t, :, :]`` and ``lse[t, :]`` NaN for
  exactly the query tokens ``t`` whose selected ids contain ``p``;
* a NaN in ``q[t, h, :]`` makes exactly ``out[t, h, :]`` and ``lse[t, h]`` NaN;
* every other output equals the single-device oracle's.

The expected NaN pattern is derived from the oracle's *selected ids* (which the indexer scores
decide, not the KV values), and the oracle's own outputs are checked against that pattern too.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dcp_ref import global_to_local, owner_rank
from dcp_ref.pipeline import make_dcp_problem, run_dcp_decode, single_device_decode

NAN = float("nan")
SM_SCALE = 0.3


def _poison_kv(problem, b: int, pos: int, dim: int) -> None:
    """NaN at dim ``dim`` of KV row ``pos`` of request ``b``: in the global KV and in its owner's paged shard."""
    W, I, bs = problem.world_size, problem.interleave, problem.block_size
    problem.kv_global[b][pos, dim] = NAN
    shard = problem.shards[owner_rank(pos, W, I)]
    loc = global_to_local(pos, W, I)
    slot = int(shard.block_table[b, loc // bs]) * bs + loc % bs
    shard.kv_cache[slot, dim] = NAN


def _check_against_oracle(problem, topk: int, stages: str, want_nan_out: torch.Tensor, atol: float) -> None:
    """``want_nan_out`` [T, H]: which (token, head) must be NaN (all of out[t, h, :] and lse[t, h])."""
    o_ref, l_ref, _ = single_device_decode(problem, topk, SM_SCALE)
    # The oracle itself behaves as the property says (so the expectation is not circular).
    assert torch.equal(torch.isnan(o_ref).all(-1), want_nan_out) and torch.equal(
        torch.isnan(o_ref).any(-1), want_nan_out
    )
    assert torch.equal(torch.isnan(l_ref), want_nan_out)
    out, lse = run_dcp_decode(problem, topk, SM_SCALE, stages=stages)
    out, lse = out.double().cpu(), lse.double().cpu()
    assert torch.equal(torch.isnan(out).all(-1), want_nan_out), "a NaN vanished (or appeared) in the output"
    assert torch.equal(torch.isnan(out).any(-1), want_nan_out), "NaN reached only part of a (token, head) row"
    assert torch.equal(torch.isnan(lse), want_nan_out), "the LSE NaN pattern differs from the affected outputs"
    fine = ~want_nan_out
    assert torch.allclose(out[fine], o_ref[fine], rtol=0, atol=atol)
    assert torch.allclose(lse[fine], l_ref[fine], rtol=0, atol=atol)


problems = st.fixed_dictionaries(
    {
        "W": st.integers(1, 4),
        "I": st.sampled_from([1, 2, 4]),
        "bs_mult": st.integers(1, 2),
        "lens": st.lists(st.integers(2, 30), min_size=1, max_size=3),
        "next_n": st.integers(1, 2),
        "topk": st.integers(1, 8),
        "seed": st.integers(0, 10_000),
    }
)


def _make(p: dict):
    return make_dcp_problem(
        p["W"],
        p["I"],
        seq_lens=p["lens"],
        next_n=p["next_n"],
        num_heads=12,
        head_dim=8,
        block_size=p["I"] * p["bs_mult"],
        seed=p["seed"],
    )


def _kv_case(p: dict, data, stages: str, atol: float) -> None:
    problem = _make(p)
    _, _, ids = single_device_decode(problem, p["topk"], SM_SCALE)
    req = problem.req_of_token
    n_poison = data.draw(st.integers(1, 3), label="n_poison")
    T, H, D = problem.q.shape
    want = torch.zeros(T, H, dtype=torch.bool)
    for _ in range(n_poison):
        b = data.draw(st.integers(0, len(p["lens"]) - 1), label="request")
        pos = data.draw(st.integers(0, p["lens"][b] - 1), label="position")
        dim = data.draw(st.integers(0, D - 1), label="dim")  # latent or RoPE part: both feed the scores
        _poison_kv(problem, b, pos, dim)
        hit = (req == b) & (ids == pos).any(1)  # tokens of request b that selected position pos
        want |= hit.unsqueeze(1)
    _check_against_oracle(problem, p["topk"], stages, want, atol)


def _q_case(p: dict, data, stages: str, atol: float) -> None:
    problem = _make(p)
    T, H, D = problem.q.shape
    want = torch.zeros(T, H, dtype=torch.bool)
    for _ in range(data.draw(st.integers(1, 3), label="n_poison")):
        t, h, d = (data.draw(st.integers(0, n - 1), label=name) for n, name in ((T, "t"), (H, "h"), (D, "d")))
        problem.q[t, h, d] = NAN
        want[t, h] = True  # every token has >= 1 selected key (its bound is >= 1)
    _check_against_oracle(problem, p["topk"], stages, want, atol)


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=40, **SETTINGS)
@given(p=problems, data=st.data())
def test_nan_in_attended_kv_row_propagates_reference(p, data) -> None:
    _kv_case(p, data, "reference", 1e-9)


@settings(max_examples=40, **SETTINGS)
@given(p=problems, data=st.data())
def test_nan_in_query_propagates_reference(p, data) -> None:
    _q_case(p, data, "reference", 1e-9)


@settings(max_examples=6, **SETTINGS)
@given(p=problems, data=st.data())
def test_nan_in_attended_kv_row_propagates_kernels(p, data) -> None:
    pytest.importorskip("triton")
    _kv_case(p, data, "kernels", 2e-5)


@settings(max_examples=6, **SETTINGS)
@given(p=problems, data=st.data())
def test_nan_in_query_propagates_kernels(p, data) -> None:
    pytest.importorskip("triton")
    _q_case(p, data, "kernels", 2e-5)


@pytest.mark.parametrize("stages", ["reference", "kernels"])
def test_nan_in_a_row_no_one_selected_changes_nothing(stages: str) -> None:
    """A NaN in a KV row that no token selects (a beaten key) leaves every output finite and exact."""
    problem = make_dcp_problem(2, 1, seq_lens=[20], next_n=1, num_heads=2, head_dim=8, block_size=4, seed=3)
    _, _, ids = single_device_decode(problem, 3, SM_SCALE)
    unused = next(p for p in range(20) if p not in ids[0].tolist())
    _poison_kv(problem, 0, unused, 0)
    _check_against_oracle(
        problem, 3, stages, torch.zeros(1, 2, dtype=torch.bool), 1e-9 if stages == "reference" else 2e-5
    )


def test_empty_rank_is_still_exactly_zero_with_nan_garbage_elsewhere() -> None:
    """W=4, one token whose single selected key lives on one rank: the other three ranks are empty
    (count 0, lse -inf) and must contribute exactly zero even though never-written cache slots hold NaN."""
    problem = make_dcp_problem(4, 1, seq_lens=[9], next_n=1, num_heads=4, head_dim=8, block_size=2, seed=5)
    o_ref, l_ref, _ = single_device_decode(problem, 1, SM_SCALE)
    traces: list[dict] = [{} for _ in range(4)]
    out, lse = run_dcp_decode(problem, 1, SM_SCALE, traces=traces)
    counts = [int(tr["counts"][0]) for tr in traces]
    assert sorted(counts) == [0, 0, 0, 1]
    assert all(
        math.isinf(v) and v < 0 for tr, c in zip(traces, counts) if c == 0 for v in tr["partial_lse"][0].tolist()
    )
    assert (
        torch.isfinite(out).all() and torch.allclose(out, o_ref, atol=1e-12) and torch.allclose(lse, l_ref, atol=1e-12)
    )
