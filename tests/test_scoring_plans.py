"""The scoring plan's table is the committed device sweep's result, and the plan reads it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

st = pytest.importorskip("dcp_ref.kernels.scoring_triton")
bench = pytest.importorskip("bench_scoring")


def test_plans_are_the_committed_sweeps_best() -> None:
    data = json.loads((ROOT / st.PLANS_SOURCE).read_text())
    assert st.PLANS == bench.best_plans(data["sweep"])


@pytest.mark.parametrize("key", sorted(st.PLANS))
def test_the_plan_takes_the_table_at_each_measured_shape(key) -> None:
    group, T, L = key
    plan = st.scoring_plan(T, L, torch.device("cpu"), next_n=group)
    assert (plan.block_n, plan.tiles, plan.num_warps, plan.num_stages, plan.tma, plan.pair_dot) == st.PLANS[key]
    assert plan.group == group and plan.programs * plan.tiles * plan.block_n >= L


def test_nearest_measured_shape_and_other_block_sizes() -> None:
    cpu = torch.device("cpu")
    assert st.scoring_plan(40, 30000, cpu)[:4] == st.PLANS[(1, 32, 32768)][:4]  # nearest: T=32, L=32K
    assert st.scoring_plan(4, 131072, cpu, next_n=4).group == 2  # next_n 4: pairs, the MTP rows of the table
    assert st.scoring_plan(3, 131072, cpu, next_n=3).group == 1
    p = st.scoring_plan(32, 8192, cpu, block_size=16)  # not the table's block size: the heuristic
    assert (p.block_n, p.num_warps, p.num_stages, p.tma) == (16, 4, 4, False)
    assert st.scoring_plan(32, 8192, cpu, block_size=32).tma  # a tile is one block of 32 keys: the bulk copy
    assert not st.scoring_plan(32, 8192, cpu, block_n=128).tma  # 128-key tiles span two blocks of 64
    with pytest.raises(ValueError, match=r"^tma=True"):
        st.scoring_plan(32, 8192, cpu, block_n=128, tma=True)
    assert st.scoring_plan(1, 2**22, cpu, block_n=16, tiles=1).programs <= 65535
    assert st.scoring_plan(1, 10, cpu).block_n == 16  # a short row: no tile wider than it


def test_pair_dot_is_a_bool_and_only_pairs_use_it() -> None:
    cpu = torch.device("cpu")
    with pytest.raises(TypeError, match=r"^pair_dot"):
        st.scoring_plan(64, 8192, cpu, next_n=2, pair_dot="yes")
    assert not st.scoring_plan(32, 8192, cpu, pair_dot=True).pair_dot  # no pairs at next_n = 1
    assert st.scoring_plan(64, 4096, cpu, next_n=2).pair_dot == st.PLANS[(2, 64, 4096)][5]
    assert not st.scoring_plan(64, 4096, cpu, next_n=2, pair_dot=False).pair_dot


def test_an_explicit_tma_is_recorded_as_forced() -> None:
    """``tma=True`` asked for is recorded (``tma_forced``), so that the call refuses a cache the bulk copy cannot
    address instead of falling back; the plan's own TMA choice and ``tma=False`` are not forced (the call itself:
    ``tests/test_scoring.py::test_kernel_unaligned_cache_falls_back_from_the_bulk_copy``)."""
    cpu = torch.device("cpu")
    chosen = st.scoring_plan(32, 8192, cpu)
    forced = st.scoring_plan(32, 8192, cpu, tma=True)
    assert chosen.tma and not chosen.tma_forced
    assert forced.tma and forced.tma_forced and forced._replace(tma_forced=False) == chosen
    assert not st.scoring_plan(32, 8192, cpu, tma=False).tma_forced
    assert not st.scoring_plan(32, 8192, cpu, block_size=16).tma_forced  # no TMA at all there
