"""The CuTeDSL local top-K's plan table is the committed H200 sweep's verdict, and the plan follows it.

:data:`dcp_ref.kernels.local_topk_cutedsl.PLANS` must name, for every swept shape, the fastest configuration of
``benchmarks/results/local_topk_sweep.json`` (correct results only); and :func:`plan_for` must return that plan at
the swept shapes. Pure Python: no GPU, no compile.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ltk = pytest.importorskip("dcp_ref.kernels.local_topk_cutedsl")
ROOT = Path(__file__).resolve().parents[1]


def _sweep() -> dict:
    return json.loads((ROOT / ltk.PLANS_SOURCE).read_text())


def test_plans_are_the_sweeps_fastest():
    best: dict[tuple[int, int], tuple[float, tuple[int, int, int]]] = {}
    for r in _sweep()["records"]:
        if r["median_us"] is None or not r["same_result"]:
            continue
        key = (r["T"], r["L"])
        if key not in best or r["median_us"] < best[key][0]:
            best[key] = (r["median_us"], tuple(r["cute"]))
    assert {key: cfg for key, (_, cfg) in best.items()} == ltk.PLANS


def test_every_swept_configuration_was_exact():
    recs = _sweep()["records"]
    assert len(recs) >= 90 and all(r["same_result"] for r in recs)


@pytest.mark.parametrize("shape", sorted(ltk.PLANS))
def test_plan_for_takes_the_measured_plan(shape):
    rows, cols = shape
    c, t, fb = ltk.PLANS[shape]
    cluster, threads, cpt, first_bits, commit = ltk.plan_for(rows, cols, 2048, 4)
    assert (cluster, threads, first_bits) == (c, t, fb)
    assert commit == ltk.commit_for(rows, cols, 2048)
    assert cluster * threads * cpt * 4 >= cols


def test_unmeasured_shapes_take_the_nearest_plan_that_fits():
    # 65536 keys: the nearest measured shapes are 32768 (one CTA: too small) and 131072 (4 CTAs): the latter
    assert ltk.plan_for(1024, 65536, 2048, 4)[:2] == (4, 1024)
    # longer than any measured plan holds at 32 keys a thread: the rule
    assert ltk.plan_for(1, 262144, 2048, 4) == (8, 1024, 8, 8, "bitmap")
    # an argument given: the rule, not the table
    assert ltk.plan_for(1024, 32768, 2048, 4, first_bits=8)[0] == 2


def test_the_deleted_candidate_list_was_slower():
    """The evidence kept for the deletion: the candidate-list revision's default was slower than the table's plan
    at every shape measured in its run."""
    sweep = _sweep()
    # the sweep it was compared with: the kernel before the staged commit (this file's records are faster still)
    best = {key: v["median_us"] for key, v in sweep["best_before"]["by_shape"].items()}
    run = sweep["candidate_list_run"]["default_plan_us"]
    assert run and all(run[key] > best[key] for key in run if key in best)


def _commit_rows() -> list[dict]:
    return json.loads((ROOT / ltk.COMMITS_SOURCE).read_text())["rows"]


def test_commit_ab_was_exact_and_beside_vllm():
    rows = _commit_rows()
    assert len(rows) == 19 and {r["dist"] for r in rows} == {"normal", "ties"}
    for r in rows:
        for c in ltk.COMMITS:
            assert r[c]["same_result"] is True, (r["T"], r["L"], c)
        assert r["vllm"]["median_us"] > 0  # the peer, timed in the same process


def test_commit_rule_picks_the_faster_commit():
    """At every measured row the rule's commit is the faster one, or within 3 % of it (noise)."""
    for r in _commit_rows():
        pick = ltk.commit_for(r["T"], r["L"], 2048)
        best = min(r[c]["median_us"] for c in ltk.COMMITS)
        assert r[pick]["median_us"] <= 1.03 * best, (r["T"], r["L"], r["dist"], pick)


def test_commit_rule_follows_winner_density():
    assert ltk.commit_for(1, 131072, 2048) == "bitmap"  # sparse winners: 1 in 64
    assert ltk.commit_for(1, 32768, 2048) == "scan"  # a lone row at 1 in 16: latency-bound
    assert ltk.commit_for(32, 32768, 2048) == "bitmap"
    assert ltk.commit_for(1024, 8192, 2048) == "scan"  # dense winners
    assert ltk.commit_for(1024, 4096, 64) == "bitmap"  # the density, not the length


@pytest.mark.parametrize(("args", "exc", "match"), [
    ((32, 4096.0, 2048), TypeError, "^cols"), ((0, 4096, 2048), ValueError, "^rows"),
    ((32, 4096, -1), ValueError, "^k"), (("32", 4096, 2048), TypeError, "^rows"),
])  # fmt: skip
def test_commit_rule_names_a_bad_argument(args, exc, match):
    with pytest.raises(exc, match=match):
        ltk.commit_for(*args)
