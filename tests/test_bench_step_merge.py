"""``benchmarks/bench_step.py --merge``: the step.json / step.md the chapters and the cost model read.

CPU only: the merge reads per-world JSON files of rows (here written by hand, not by the GPU run),
so what it derives — the FP8-against-bf16 pairs and their winner, the cache column, the default
``kv_format`` of rows measured before the FP8 cache existed, and the ``whole_step`` record it adds
to ``fp8_attention.json`` — is checked against values computed here.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def bench_step():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("bench_step")
    finally:
        sys.path.remove(str(BENCH))


def _row(W, T, ctx, graph, attn, kv_format=None):
    r = {
        "W": W,
        "T": T,
        "ctx": ctx,
        "attention": "flashmla" if kv_format != "fp8_ds_mla" else "flashmla-fp8",
        "graph_us": graph,
        "eager_us": 900.0,
        "host_syncs_per_step": 0,
        "launches_per_step": 11,
        "allocations_per_run": 3,
        "stages_sum_us": graph,
        "graph_over_stages_sum": 1.0,
        "stages_us": {"indexer": 10.0, "attention": attn},
    }
    if kv_format is not None:
        r["kv_format"] = kv_format
    return r


def _write(src: Path, name: str, rows) -> None:
    doc = {"device": "NVIDIA H200", "versions": {"torch": "x"}, "date_utc": "2026-11-30T00:00:00+00:00", "rows": rows}
    (src / name).write_text(json.dumps(doc))


def test_merge_pairs_fp8_with_bf16_and_records_the_winner(bench_step, tmp_path: Path) -> None:
    src, out = tmp_path / "raw", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    # bf16 rows without kv_format (written before the FP8 cache existed), FP8 rows with it
    _write(src, "step_W2.json", [_row(2, 1, 8192, 80.0, 35.0), _row(2, 32, 8192, 125.0, 47.0)])
    _write(
        src,
        "step_W2_fp8.json",
        [_row(2, 1, 8192, 60.0, 21.0, "fp8_ds_mla"), _row(2, 32, 8192, 140.0, 63.0, "fp8_ds_mla")],
    )
    (out / "fp8_attention.json").write_text(json.dumps({"summary": [{"impl": "flashmla_fp8_masked"}]}))
    bench_step.merge(src, out, note="a note on the run")
    step = json.loads((out / "step.json").read_text())
    assert [r["kv_format"] for r in step["summary"]] == ["native", "native", "fp8_ds_mla", "fp8_ds_mla"]
    assert step["note"] == "a note on the run"
    md = (out / "step.md").read_text()
    assert "a note on the run" in md
    assert "| 2 | 1 | 8192 | 80.0 | 60.0 | 0.75 | 35.0 | 21.0 | FP8 |" in md
    assert "| 2 | 32 | 8192 | 125.0 | 140.0 | 1.12 | 47.0 | 63.0 | bf16 |" in md
    fp8 = json.loads((out / "fp8_attention.json").read_text())
    assert fp8["summary"] == [{"impl": "flashmla_fp8_masked"}]  # the kernel benchmark is kept as it was
    rows = fp8["whole_step"]["rows"]
    assert [(r["T"], r["faster"]) for r in rows] == [(1, "fp8"), (32, "bf16")]
    assert rows[1]["bf16_graph_us"] == 125.0 and rows[1]["fp8_attention_us"] == 63.0


def test_merge_without_fp8_rows_adds_no_comparison(bench_step, tmp_path: Path) -> None:
    src, out = tmp_path / "raw", tmp_path / "out"
    src.mkdir()
    out.mkdir()
    _write(src, "step_W1.json", [_row(1, 1, 8192, 88.0, 60.0, "native")])
    (out / "fp8_attention.json").write_text("{}")
    bench_step.merge(src, out)
    assert "FP8 cache against" not in (out / "step.md").read_text()
    assert json.loads((out / "fp8_attention.json").read_text()) == {}
    assert bench_step.fp8_pairs(json.loads((out / "step.json").read_text())["rows"]) == []
