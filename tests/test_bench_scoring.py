"""The scoring benchmarks' plumbing on the CPU: ``benchmarks/_scoring_inputs.py``, ``bench_scoring.py``,
``peer_deepgemm_logits.py`` and ``profile_scoring.py`` (the GPU runs are the H200's; here, what they derive).

* ``build_inputs`` at ``next_n = 1`` makes the bytes it made before it took ``next_n`` (checked against a copy of
  that code and against hashes recorded from it before the change), and at ``next_n = 2`` the MTP layout (two
  consecutive tokens per request, causal bounds ``L - 1``, ``L``); the oracle rows against a brute-force float64
  score from the bytes; the floors read the keys once per request;
* the sweep's schedule (default first, configs outer, duplicates and over-long tiles dropped), ``best_plans`` on
  hand-written records, ``--print-plans`` read back with ``ast.literal_eval``, the summary's keys and its DeepGEMM
  join on ``(T, L, next_n)``, the markdown;
* the DeepGEMM peer end to end with a stand-in ``deep_gemm`` written here (torch; it emulates SM90's writes past a
  token's own length), a crash in its child included;
* ``summarize_ncu`` on a hand-written CSV in ncu's ``--csv --page details`` format.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def mods():
    sys.path.insert(0, str(BENCH))
    try:
        yield {m: importlib.import_module(m) for m in ("_scoring_inputs", "bench_scoring", "profile_scoring",
                                                       "peer_deepgemm_logits")}  # fmt: skip
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def si(mods):
    return mods["_scoring_inputs"]


@pytest.fixture(scope="module")
def bs(mods):
    return mods["bench_scoring"]


# ---- _scoring_inputs ---------------------------------------------------------------------------------------
def old_build_inputs(t: int, n: int, device: str = "cpu", seed: int | None = None) -> dict[str, torch.Tensor]:
    """``build_inputs`` as it was before ``next_n`` (commit 99e1c17), copied: the bytes must not move."""
    g = torch.Generator(device=device).manual_seed(1000 * t + n // 64 if seed is None else seed)
    nblk = n // 64
    num_blocks = t * nblk
    cache = torch.empty((num_blocks, 64 * 132), dtype=torch.uint8, device=device)
    codes = torch.randint(0, 256, (num_blocks, 64 * 128), device=device, generator=g, dtype=torch.uint8)
    cache[:, : 64 * 128] = torch.where((codes & 0x7F) == 0x7F, codes - 1, codes)
    exps = torch.randint(-9, -5, (num_blocks, 64), device=device, generator=g).float()
    cache[:, 64 * 128 :] = torch.exp2(exps).contiguous().view(torch.uint8)
    perm = torch.randperm(num_blocks, device=device, generator=g).to(torch.int32)
    q = torch.randn((t, 64, 128), device=device, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn((t, 64), device=device, generator=g) / 8
    return {
        "index_q": q,
        "weights": w,
        "index_cache": cache,
        "block_table": perm.view(t, nblk).contiguous(),
        "req_of_token": torch.arange(t, device=device, dtype=torch.int32),
        "local_bounds": torch.full((t,), n, device=device, dtype=torch.int32),
    }


KEYS = ("index_q", "weights", "index_cache", "block_table", "req_of_token", "local_bounds")
#: sha256 of build_inputs(t, n, "cpu", seed) (keys in KEYS order: name, shape, dtype, bytes), recorded from the
#: code before it took next_n
HASHES = {
    (2, 256, None): "67567f4db3491d9e7f55d7b602d87132ea0a822545ed08940e948b0391b5b7c3",
    (3, 128, 7): "a2d95c87c718bff5e75c6dcef55a3980329a2d84c608fd1e401223bbb47f7c5b",
    (1, 64, None): "4cbe295647d9a745a2969c7c4282e94268e6b40b1816f9a754364f7196c6639a",
}


def digest(inp: dict[str, torch.Tensor]) -> str:
    m = hashlib.sha256()
    for k in KEYS:
        x = inp[k].contiguous()
        m.update(k.encode())
        m.update(str(tuple(x.shape)).encode())
        m.update(str(x.dtype).encode())
        m.update(x.view(torch.uint8).numpy().tobytes())
    return m.hexdigest()


@pytest.mark.parametrize("t, n, seed", list(HASHES))
def test_build_inputs_next_n_1_bytes_unchanged(si, t, n, seed):
    new = si.build_inputs(t, n, "cpu", seed=seed)
    again = si.build_inputs(t, n, "cpu", seed=seed, next_n=1)
    old = old_build_inputs(t, n, "cpu", seed=seed)
    for k in KEYS:
        assert new[k].dtype == old[k].dtype and new[k].shape == old[k].shape, k
        assert torch.equal(new[k].view(torch.uint8), old[k].view(torch.uint8)), k
        assert torch.equal(again[k].view(torch.uint8), old[k].view(torch.uint8)), k
    assert digest(new) == HASHES[(t, n, seed)]


def test_build_inputs_mtp_layout(si):
    t, n, nn = 6, 256, 2
    inp = si.build_inputs(t, n, "cpu", next_n=nn)
    b, nblk = t // nn, n // 64
    assert inp["index_q"].shape == (t, 64, 128) and inp["index_q"].dtype == torch.float8_e4m3fn
    assert inp["weights"].shape == (t, 64) and inp["weights"].dtype == torch.float32
    assert inp["index_cache"].shape == (b * nblk, 64 * 132) and inp["index_cache"].dtype == torch.uint8
    assert inp["block_table"].shape == (b, nblk) and inp["block_table"].dtype == torch.int32
    assert sorted(inp["block_table"].flatten().tolist()) == list(range(b * nblk))  # every block once
    assert inp["req_of_token"].dtype == torch.int32 and inp["req_of_token"].tolist() == [0, 0, 1, 1, 2, 2]
    assert inp["local_bounds"].dtype == torch.int32 and inp["local_bounds"].tolist() == [255, 256] * 3
    assert si.next_n_of(inp) == 2
    three = si.build_inputs(6, 128, "cpu", next_n=3)
    assert three["local_bounds"].tolist() == [126, 127, 128] * 2 and three["req_of_token"].tolist() == [0] * 3 + [1] * 3
    one = si.build_inputs(3, 128, "cpu")
    assert one["local_bounds"].tolist() == [128] * 3 and si.next_n_of(one) == 1
    with pytest.raises(AssertionError):
        si.build_inputs(5, 256, "cpu", next_n=2)


def brute_scores(inp: dict[str, torch.Tensor], rows: int) -> torch.Tensor:
    """float64 ``sum_h w * relu(q . k) * scale`` from the cache bytes, ``-inf`` past each token's bound."""
    cache, bt = inp["index_cache"], inp["block_table"]
    n = bt.shape[1] * 64
    vals = cache[:, : 64 * 128].reshape(-1, 64, 128).view(torch.float8_e4m3fn).double()
    scl = cache[:, 64 * 128 :].contiguous().view(torch.float32).reshape(-1, 64).double()
    out = torch.full((rows, n), float("-inf"), dtype=torch.float64)
    for i in range(rows):
        blocks = bt[int(inp["req_of_token"][i])].long()
        k = vals[blocks].reshape(n, 128)
        s = (inp["index_q"][i].double() @ k.T).relu() * inp["weights"][i].double()[:, None]
        m = int(inp["local_bounds"][i])
        out[i, :m] = (s.sum(0) * scl[blocks].reshape(n))[:m]
    return out


def test_reference_rows_mtp(si):
    inp = si.build_inputs(6, 256, "cpu", next_n=2)
    ref = si.reference_rows(inp, rows=3)  # rounded up to whole requests
    assert ref.shape == (4, 256) and ref.dtype == torch.float32
    want = brute_scores(inp, 4)
    assert torch.equal(torch.isinf(ref), torch.isinf(want))
    assert torch.isinf(ref[0::2, 255]).all() and torch.isfinite(ref[1::2]).all()
    fin = torch.isfinite(want)
    assert torch.allclose(ref.double()[fin], want[fin], rtol=1e-6, atol=1e-6)
    assert si.reference_rows(inp).shape[0] == si.REF_ROWS
    assert si.reference_rows(inp, rows=100).shape[0] == 6


def test_shapes_and_floors(si):
    assert si.MTP_SHAPES == [(2 * b, n) for b in (1, 32, 128) for n in (4096, 32768, 131072)]
    assert len(si.all_shapes()) == 18 and si.all_shapes()[:9] == [(t, n, 1) for t, n in si.SHAPES]
    assert si.all_shapes()[9:] == [(t, n, 2) for t, n in si.MTP_SHAPES]
    bw = 4e12
    f2 = si.floors(64, 4096, bw, 1000, next_n=2)
    assert f2["read_floor_us"] == pytest.approx((32 * 4096 * 132 + 1000) / bw * 1e6)
    assert f2["compute_floor_us"] == pytest.approx(2 * 64 * 4096 * 64 * 128 / 1979e12 * 1e6)
    f1 = si.floors(64, 4096, bw, 1000)
    assert f1["read_floor_us"] == pytest.approx((64 * 4096 * 132 + 1000) / bw * 1e6)
    assert f1["compute_floor_us"] == pytest.approx(f2["compute_floor_us"])


# ---- bench_scoring: sweep, plans, summary ----------------------------------------------------------------
def rec(nn, t, n, plan, us, err=1e-4, **extra):
    r = {"kernel": "scoring", "T": t, "B": t // nn, "L": n, "next_n": nn, "config": extra.pop("config", {"x": 1})}
    plan = (*plan, plan[0] == 64) if len(plan) == 4 else plan  # tma: 64-key tiles (one block each) in these records
    r["plan"] = dict(zip(("block_n", "tiles", "num_warps", "num_stages", "tma"), plan, strict=True)) | {"programs": 1}
    if us is not None:
        r["graph"] = {"median_us": us}
    if err is not None:
        r["max_rel_err"] = err
    return r | extra


def synthetic_records():
    return [
        rec(1, 32, 4096, (64, 4, 4, 4), 9.0, config={}),  # the default
        rec(1, 32, 4096, (64, 1, 4, 2), 3.0, error="OutOfResources: shared memory"),
        rec(1, 32, 4096, (128, 1, 8, 2), 4.0, err=2e-3),  # too far from the oracle
        rec(1, 32, 4096, (64, 8, 4, 3), 4.5, vs_default_rel_err=0.5),  # wrong past the oracle rows
        rec(1, 32, 4096, (64, 2, 4, 3), 4.6, mask_same_as_default=False),
        rec(1, 32, 4096, (64, 2, 8, 3), 5.0),  # the best valid one
        rec(1, 32, 4096, (128, 2, 8, 4), 6.0),
        {
            "kernel": "fused",
            "T": 32,
            "L": 4096,
            "next_n": 1,
            "config": {},
            "plan": {"block_n": 64},
            "graph": {"median_us": 0.1},
        },
        rec(2, 64, 4096, (64, 4, 4, 4), 7.0, config={}),
        rec(2, 64, 4096, (128, 4, 8, 3), 6.5),
        rec(2, 64, 4096, (64, 1, 4, 3), None),  # not timed
        rec(2, 2, 131072, (64, 1, 4, 4), 2.0, error="RuntimeError: x"),  # no valid record: no entry
    ]


def test_best_plans(bs):
    got = bs.best_plans(synthetic_records())
    assert got == {(1, 32, 4096): (64, 2, 8, 3, True, False), (2, 64, 4096): (128, 4, 8, 3, False, False)}
    rows = {(r["next_n"], r["T"], r["L"]): r for r in bs.sweep_best(synthetic_records())}
    r = rows[(1, 32, 4096)]
    assert r["default_plan"] == [64, 4, 4, 4, True, False] and r["default_us"] == 9.0 and r["best_us"] == 5.0
    assert r["speedup"] == pytest.approx(1.8) and r["errors"] == 1 and r["timed"] == 7
    assert rows[(2, 2, 131072)]["best_plan"] is None


def test_print_plans_reads_back(bs, tmp_path):
    path = tmp_path / "scoring.json"
    path.write_text(json.dumps({"sweep": synthetic_records()}))
    cmd = [sys.executable, str(BENCH / "bench_scoring.py"), "--print-plans", str(path)]
    env = os.environ | {"CUDA_VISIBLE_DEVICES": ""}  # CPU only
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "{" and lines[-1] == "}" and len(lines) == 4  # one entry per line
    assert lines[1].startswith("    (1, 32, 4096): (64, 2, 8, 3, True, False),")
    assert ast.literal_eval(proc.stdout) == bs.best_plans(synthetic_records())
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"sweep": []}))
    assert bs.main(["--print-plans", str(empty)]) == 1


def test_sweep_schedule(bs):
    def plan_of(shape, cfg):  # a plan that clamps tiles to the row's tiles, as the kernel's does
        if cfg.get("num_stages") == 9:
            raise ValueError("num_stages: no")
        bn = cfg.get("block_n", 64)
        n_tiles = -(-shape[1] // bn)
        tiles = min(cfg.get("tiles", 2), n_tiles)
        return {"block_n": bn, "tiles": tiles, "num_warps": cfg.get("num_warps", 4),
                "num_stages": cfg.get("num_stages", 4), "tma": cfg.get("tma", bn == 64),
                "programs": -(-n_tiles // tiles)}  # fmt: skip

    shapes = [(1, 128, 1), (64, 4096, 2)]
    cfgs = [
        dict(block_n=64, tiles=2, num_warps=4, num_stages=4),  # = the default plan: dropped
        dict(block_n=64, tiles=4, num_warps=4, num_stages=4),  # > 2 tiles of a 128-key row: dropped there
        dict(block_n=128, tiles=1, num_warps=8, num_stages=2),
        dict(block_n=64, tiles=1, num_warps=4, num_stages=9),  # refused by the plan: kept with its error
    ]
    sched = bs.sweep_schedule(shapes, cfgs, plan_of)
    assert [(s, c) for s, c, _ in sched[:2]] == [((1, 128, 1), {}), ((64, 4096, 2), {})]  # defaults first
    got = [(s, c) for s, c, _ in sched[2:]]
    assert got == [((64, 4096, 2), cfgs[1]), ((1, 128, 1), cfgs[2]), ((64, 4096, 2), cfgs[2]),
                   ((1, 128, 1), cfgs[3]), ((64, 4096, 2), cfgs[3])]  # fmt: skip
    assert isinstance(sched[-1][2], str) and "num_stages" in sched[-1][2]
    space = bs.scoring_configs()
    n = 12 * 2 * 1 * 2 + len(bs.SWEEP_EXTRA)  # tiles x stages x tma x pair_dot, then cp.async
    assert len(space) == n and len({tuple(sorted(c.items())) for c in space}) == n
    fields = {"block_n", "tiles", "num_warps", "num_stages", "tma"}
    assert space == bs.scoring_configs() and all(set(c) - {"pair_dot"} == fields for c in space)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreted kernel on the CPU (the GPU run is the H200's)")
def test_sweep_and_shapes_interpreted(bs, si, monkeypatch):
    """``sweep_scoring`` and ``run_shape`` end to end at toy shapes, the kernel interpreted, host timers."""
    import time

    def host(fn, reps=1):
        t0 = time.perf_counter()
        fn()
        return {"median_us": (time.perf_counter() - t0) * 1e6}

    monkeypatch.setattr(bs, "DEV", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(bs._timing, "reps_for", lambda fn: 1)
    monkeypatch.setattr(bs, "sweep_row", host)
    monkeypatch.setattr(bs, "graph_row", lambda fn: host(fn))
    cfgs = [dict(block_n=64, tiles=2, num_warps=4, num_stages=2), dict(block_n=64, tiles=8, num_warps=4, num_stages=2)]
    sw = bs.sweep_scoring(300, [(2, 128, 1), (4, 128, 2)], cfgs)
    assert not sw["cut"] and sw["run"] == sw["scheduled"] == 4  # tiles=8 > the 2 tiles of a row: dropped
    recs = sw["records"]
    assert [(r["T"], r["next_n"], r["config"]) for r in recs] == [(2, 1, {}), (4, 2, {}), (2, 1, cfgs[0]),
                                                                  (4, 2, cfgs[0])]  # fmt: skip
    for r in recs:
        assert "error" not in r, r
        assert r["max_rel_err"] < 1e-5 and r["plan"]["block_n"] == 64 and r["graph"]["median_us"] > 0
    assert recs[2]["vs_default_rel_err"] < 1e-6 and recs[3]["mask_same_as_default"] is True
    assert set(bs.best_plans(recs)) == {(1, 2, 128), (2, 4, 128)}
    rows = []
    for t, n, nn in [(2, 128, 1), (4, 128, 2)]:
        r = bs.run_shape(t, n, nn, 4e12, {}, chain_cols=False)
        assert r["max_rel_err"] < 1e-5 and r["ours_all_finite"] and r["ours_neginf_past_bounds"], r
        assert r["B"] == t // nn and "fused" not in r and "ours_chain" not in r
        rows.append(r)
    summary = bs.summarize(rows, {})
    assert all(SUMMARY_KEYS <= set(x) for x in summary) and [x["next_n"] for x in summary] == [1, 2]


SUMMARY_KEYS = {"T", "B", "L", "next_n", "ours_us", "read_floor_us", "compute_floor_us", "max_rel_err", "plan",
                "deepgemm_us", "deepgemm_max_rel_err", "target_us", "meets_target", "vs_deepgemm"}  # fmt: skip


def result(t, n, nn, ours, read):
    return {"T": t, "B": t // nn, "L": n, "next_n": nn, "ours": {"median_us": ours}, "max_rel_err": 2e-4,
            "plan": {"block_n": 64, "tiles": 2, "num_warps": 4, "num_stages": 4, "programs": 8},
            "floors_scores": {"read_floor_us": read, "compute_floor_us": 1.0, "binds": "read"}}  # fmt: skip


def test_summarize_and_markdown(bs):
    results = [result(32, 4096, 1, 7.0, 4.0), result(64, 4096, 2, 12.0, 4.0)]
    results[0] |= {"ours_chain": {"median_us": 20.0}, "vllm_topk_pack": {"median_us": 6.0}}
    dg = {"shapes": [{"T": 32, "L": 4096, "deepgemm_us": 10.0, "max_rel_err": 3e-4, "metadata_us": 2.0},  # old: 1
                     {"T": 64, "L": 4096, "next_n": 1, "deepgemm_us": 99.0},  # another next_n: not joined
                     {"T": 64, "L": 4096, "next_n": 2, "deepgemm_us": 8.0, "max_rel_err": 1e-4}]}  # fmt: skip
    rows = bs.summarize(results, dg)
    for r in rows:
        assert SUMMARY_KEYS <= set(r)
    a, b = rows
    assert a["target_us"] == pytest.approx(1.3 * 4.0 + 3) and a["meets_target"] is True
    assert a["deepgemm_us"] == 10.0 and a["vs_deepgemm"] == pytest.approx(0.7) and a["peer_chain_us"] == 16.0
    assert a["ours_unfused_chain_us"] == 20.0 and a["plan"]["tiles"] == 2 and "fused_chain_us" not in a
    assert b["next_n"] == 2 and b["B"] == 32 and b["deepgemm_us"] == 8.0 and b["vs_deepgemm"] == pytest.approx(1.5)
    assert b["meets_target"] is False and b["ours_unfused_chain_us"] is None and b["peer_chain_us"] is None
    ncu = [{"file": "n.json", "label": "new 32x4096", "kernels": [{"name": "index_scores_kernel", "duration_us": 7.1,
            "warp_stalls_top5": [["Stall Long Scoreboard", 9.8]], "grid_size": "132x8x1"}]}]  # fmt: skip
    data = {"device": {"name": "H200"}, "versions": {"torch": "t", "triton": "x"}, "date_utc": "d",
            "copy_bandwidth_TBps": 4.0, "summary": rows, "sweep_best": bs.sweep_best(synthetic_records()),
            "sweep_meta": {"run": 12, "scheduled": 20, "elapsed_s": 30.0, "budget_s": 300.0}, "ncu": ncu}  # fmt: skip
    md = bs.markdown(data)
    assert "| next_n | T | B | L | ours | target | meets | DeepGEMM |" in md
    assert "| 2 | 64 | 32 | 4096 | 12.0 | 8.2 | **no** | 8.0 | 1.50 |" in md
    assert (
        "## Sweep: best vs default plan" in md
        and "| 1 | 32 | 4096 | (64, 4, 4, 4, True, False) | 9.00 | (64, 2, 8, 3, True, False) |" in md
    )
    assert "Stall Long Scoreboard 9.8" in md


# ---- the DeepGEMM peer, with a stand-in deep_gemm -------------------------------------------------------------
STAND_IN = '''"""A CPU stand-in for DeepGEMM's paged MQA logits (tests/test_bench_scoring.py)."""
import os

import torch

__version__ = "stand-in"


def get_num_sms():
    return 4


def get_paged_mqa_logits_metadata(context_lens, block_kv, num_sms):
    assert context_lens.dim() == 2 and context_lens.dtype == torch.int32 and block_kv == 64
    return torch.zeros((num_sms + 1, 2), dtype=torch.int32)


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
                         clean_logits=False):
    b, nn, h, d = q.shape
    if os.environ.get("FAKE_DG_ABORT") == f"{b * nn}x{max_context_len}x{nn}":
        os.abort()
    nb, bs, _, width = kv_cache.shape
    flat = kv_cache.reshape(nb, bs * width)
    keys = flat[:, : bs * d].reshape(nb, bs, d).view(torch.float8_e4m3fn).float()
    scale = flat[:, bs * d :].contiguous().view(torch.float32).reshape(nb, bs)
    stride = -(-max_context_len // 256) * 256
    out = torch.full((b * nn, stride), float("nan"))
    for i in range(b):
        last = int(context_lens[i, -1])  # as SM90: every token of the request over its last token's blocks
        blk = block_table[i, : -(-last // bs)].long()
        k = keys[blk].reshape(-1, d) * scale[blk].reshape(-1, 1)
        s = torch.einsum("nhd,kd->nhk", q[i].float(), k).relu()
        out[i * nn : (i + 1) * nn, : k.shape[0]] = (s * weights[i * nn : (i + 1) * nn, :, None]).sum(1)
    return out[:, :max_context_len]
'''


def test_peer_parse_shapes_and_layout(mods):
    pd = mods["peer_deepgemm_logits"]
    shapes = pd.parse_shapes("1x4096, 64x32768x2,2x128x1")
    assert shapes == [(1, 4096, 1), (64, 32768, 2), (2, 128, 1)]
    assert pd.format_shapes(shapes) == "1x4096,64x32768x2,2x128"
    assert pd.parse_shapes(pd.format_shapes(shapes)) == shapes
    with pytest.raises(ValueError):
        pd.parse_shapes("3x256x2")
    assert len(pd.default_shapes(False, [1, 2])) == 18 and pd.default_shapes(True, [2]) == [
        (64, 32768, 2),
        (2, 131072, 2),
    ]
    inp = mods["_scoring_inputs"].build_inputs(6, 256, "cpu", next_n=2)
    a = pd.deepgemm_args(inp)
    assert a["q"].shape == (3, 2, 64, 128) and a["weights"].shape == (6, 64) and a["block_table"].shape == (3, 4)
    assert a["context_lens"].tolist() == [[255, 256]] * 3
    assert torch.equal(a["q"].reshape(6, 64, 128).view(torch.uint8), inp["index_q"].view(torch.uint8))
    ref = pd.reference_fp32(a)
    assert torch.isnan(ref[0::2, 255]).all() and torch.isfinite(ref[1::2]).all() and torch.isfinite(ref[:, :255]).all()


def test_peer_cpu_plumbing(tmp_path):
    pkg = tmp_path / "dg" / "deep_gemm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(STAND_IN)
    out = tmp_path / "out" / "dg.json"
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tmp_path / "dg"), os.environ.get("PYTHONPATH", "")]),
                        "FAKE_DG_ABORT": "6x128x2", "CUDA_VISIBLE_DEVICES": ""}  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(BENCH / "peer_deepgemm_logits.py"), "--device", "cpu", "--out", str(out),
         "--shapes", "2x256,6x128x2,4x256x2"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
    )  # fmt: skip
    data = json.loads(out.read_text())
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one shape died: recorded, the others ran
    rows = {(r["T"], r["L"], r["next_n"]): r for r in data["shapes"]}
    assert list(rows) == [(2, 256, 1), (6, 128, 2), (4, 256, 2)]  # in the order asked
    crashed = rows[(6, 128, 2)]
    assert "child died" in crashed["error"] and "logits_first" in crashed["error"] and crashed["B"] == 3
    assert [(c["T"], c["L"], c["next_n"], c["step"]) for c in data["crashes"]] == [(6, 128, 2, "logits_first")]
    for key in ((2, 256, 1), (4, 256, 2)):
        r = rows[key]
        assert "error" not in r, r
        assert r["B"] == key[0] // key[2] and r["logits_shape"] == [key[0], key[1]] and r["finite"]
        assert r["max_rel_err"] < 1e-5 and r["max_rel_err_fp32_all_rows"] < 1e-5 and r["calc_diff_fp32"] < 1e-9
        assert r["ref_rows"] == min(key[0], 4) and r["row_stride_as_documented"] and r["logits"]["timing"] == "host"
    assert rows[(4, 256, 2)]["writes_past_token_length"] is True  # the stand-in writes them, as SM90 does
    assert "writes_past_token_length" not in rows[(2, 256, 1)]
    assert data["versions"]["deep_gemm"] == "stand-in"


# ---- profile_scoring --------------------------------------------------------------------------------------
HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')  # fmt: skip
KERNEL = '"0","4242","python3","h200-0","index_scores_kernel","1","7","(128, 1, 1)","(132, 32, 1)","0","9.0"'
ROWS = [
    ("GPU Speed Of Light Throughput", "DRAM Frequency", "Ghz", "3.20"),
    ("GPU Speed Of Light Throughput", "SM Frequency", "Ghz", "1.75"),
    ("GPU Speed Of Light Throughput", "Elapsed Cycles", "cycle", "68,512"),
    ("GPU Speed Of Light Throughput", "Memory Throughput", "%", "83.61"),
    ("GPU Speed Of Light Throughput", "DRAM Throughput", "%", "83.61"),
    ("GPU Speed Of Light Throughput", "Duration", "us", "39.04"),
    ("GPU Speed Of Light Throughput", "L2 Cache Throughput", "%", "40.12"),
    ("GPU Speed Of Light Throughput", "Compute (SM) Throughput", "%", "31.20"),
    ("Memory Workload Analysis", "Memory Throughput", "Tbyte/s", "3.99"),
    ("Memory Workload Analysis", "L1/TEX Hit Rate", "%", "0.12"),
    ("Memory Workload Analysis", "L2 Hit Rate", "%", "1.52"),
    ("Memory Workload Analysis", "Mem Busy", "%", "40.12"),
    ("Launch Statistics", "Block Size", "", "128"),
    ("Launch Statistics", "Grid Size", "", "4,224"),
    ("Launch Statistics", "Registers Per Thread", "register/thread", "168"),
    ("Launch Statistics", "Shared Memory Configuration Size", "Kbyte", "233.47"),
    ("Launch Statistics", "Driver Shared Memory Per Block", "Kbyte/block", "1.02"),
    ("Launch Statistics", "Dynamic Shared Memory Per Block", "Kbyte/block", "49.15"),
    ("Launch Statistics", "Static Shared Memory Per Block", "byte/block", "0"),
    ("Launch Statistics", "Threads", "thread", "540,672"),
    ("Launch Statistics", "Waves Per SM", "", "8"),
    ("Occupancy", "Block Limit Registers", "block", "3"),
    ("Occupancy", "Theoretical Occupancy", "%", "18.75"),
    ("Occupancy", "Achieved Occupancy", "%", "17.90"),
    ("Occupancy", "Achieved Active Warps Per SM", "warp", "11.46"),
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction", "cycle", "25.10"),
    ("Warp State Statistics", "Avg. Active Threads Per Warp", "", "32"),
    (
        "Command line profiler metrics",
        "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
        "inst",
        "9.80",
    ),
    (
        "Command line profiler metrics",
        "smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio",
        "inst",
        "3.30",
    ),
    ("Command line profiler metrics", "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio", "inst", "2.10"),
    (
        "Command line profiler metrics",
        "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
        "inst",
        "1.20",
    ),
    (
        "Command line profiler metrics",
        "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio",
        "inst",
        "1.00",
    ),
    (
        "Command line profiler metrics",
        "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio",
        "inst",
        "0.90",
    ),
    (
        "Command line profiler metrics",
        "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
        "inst",
        "0.50",
    ),
    (
        "Command line profiler metrics",
        "smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio",
        "inst",
        "n/a",
    ),
]
SECOND = [  # an older ncu's names and units, a second kernel
    ("GPU Speed Of Light Throughput", "Duration", "msecond", "1.25"),
    ("GPU Speed Of Light Throughput", "DRAM Throughput", "%", "12.5"),
    ("Memory Workload Analysis", "Memory Throughput", "Gbyte/second", "1,234.5"),
    ("Warp State Statistics", "Stall Long Scoreboard", "cycle", "4.0"),
    ("Warp State Statistics", "Stall Barrier", "cycle", "6.0"),
]


def ncu_csv(extra_columns: bool = False) -> str:
    def line(kernel, sec, name, unit, value):
        cells = f'{kernel},"{sec}","{name}","{unit}","{value}"'
        return cells + (',"","","","",""' if extra_columns else "")

    head = HEADER + (',"Rule Name","Rule Type","Rule Description","Estimated Speedup Type","Estimated Speedup"'
                     if extra_columns else "")  # fmt: skip
    second = KERNEL.replace('"0","4242"', '"1","4242"').replace("index_scores_kernel", "index_scores_check_kernel")
    body = [line(KERNEL, *r) for r in ROWS] + [line(second, *r) for r in SECOND]
    if extra_columns:  # a rule row (no metric), and ncu's messages around the table
        body.insert(3, KERNEL + ',"SOL","","","","SOLBottleneck","WRN","Memory is more heavily utilized, with\n'
                    'a line break","global","12.5"')  # fmt: skip
        return "==PROF== Connected to process 4242\nprofiled ...\n" + "\n".join([head, *body]) + "\n==PROF== Done\n"
    return "\n".join([head, *body]) + "\n"


@pytest.mark.parametrize("extra_columns", [False, True])
def test_summarize_ncu(mods, extra_columns):
    ps = mods["profile_scoring"]
    s = ps.summarize_ncu(ncu_csv(extra_columns))
    assert s["count"] == 2
    k, k2 = s["kernels"]
    assert k["name"] == "index_scores_kernel" and k["id"] == 0
    assert k["block_size"] == "128x1x1" and k["grid_size"] == "132x32x1"
    assert k["duration_us"] == pytest.approx(39.04)
    assert k["dram_throughput_pct"] == pytest.approx(83.61) and k["memory_throughput_pct"] == pytest.approx(83.61)
    assert k["dram_bandwidth_GBps"] == pytest.approx(3990.0)
    assert k["compute_sm_throughput_pct"] == pytest.approx(31.2) and k["l2_hit_rate_pct"] == pytest.approx(1.52)
    assert k["achieved_occupancy_pct"] == pytest.approx(17.9) and k["theoretical_occupancy_pct"] == pytest.approx(18.75)
    assert k["registers_per_thread"] == 168 and k["waves_per_sm"] == 8 and k["grid_size_blocks"] == 4224
    assert k["shared_memory_per_block_bytes"] == pytest.approx(49150.0)
    assert k["driver_shared_memory_per_block_bytes"] == pytest.approx(1020.0)
    assert k["warp_cycles_per_issued_instruction"] == pytest.approx(25.1)
    assert k["warp_stalls_top5"] == [["Stall Long Scoreboard", 9.8], ["Stall Lg Throttle", 3.3], ["Stall Wait", 2.1],
                                     ["Stall Math Pipe Throttle", 1.2], ["Stall Selected", 1.0]]  # fmt: skip
    assert k["all"]["Memory Throughput"] == "83.61 %"
    assert k["all"]["Memory Throughput (Memory Workload Analysis)"] == "3.99 Tbyte/s"
    assert k["all"]["Threads"] == "540,672 thread" and len(k["all"]) == len(ROWS)
    assert k2["name"] == "index_scores_check_kernel" and k2["duration_us"] == pytest.approx(1250.0)
    assert k2["dram_bandwidth_GBps"] == pytest.approx(1234.5)
    assert k2["warp_stalls_top5"] == [["Stall Barrier", 6.0], ["Stall Long Scoreboard", 4.0]]


def test_summarize_cli_and_profile_args(mods, tmp_path):
    ps = mods["profile_scoring"]
    src = tmp_path / "ncu.csv"
    src.write_text(ncu_csv(True))
    dst = tmp_path / "j" / "ncu.json"
    assert ps.main(["--summarize", str(src), "--out", str(dst), "--label", "new 32x32768"]) == 0
    got = json.loads(dst.read_text())
    assert got["source"] == "ncu.csv" and got["label"] == "new 32x32768" and got["count"] == 2
    assert ps.parse_shape("32x32768") == (32, 32768)
    assert ps.parse_config("block_n=64,tiles=4,num_warps=4,num_stages=3") == dict(block_n=64, tiles=4, num_warps=4,
                                                                                   num_stages=3)  # fmt: skip
    assert ps.parse_config("") == {}
    with pytest.raises(ValueError):
        ps.parse_config("seg=4")
    assert ps.kernel_kwargs(1, {}) == {}  # an old kernel without next_n still runs
    assert ps.kernel_kwargs(2, {"tiles": 4}) == {"next_n": 2, "tiles": 4}
    with pytest.raises(ValueError):
        ps.summarize_ncu("no csv here\n")
