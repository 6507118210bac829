"""``tools/before_after.py`` pairs the rows of the two trees by shape and judges each against the refactor target,
on hand-made bench folders (the numbers chosen so each verdict has one cause)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[1] / "tools" / "before_after.py"


def _layer(us: float, allocs: int = 3, syncs: int = 0, T: int = 32) -> dict:
    return {"layout": "dcp", "W": 8, "T": T, "ctx": 32768, "cache": "bf16", "graph_us": us,
            "allocations_per_run": allocs, "host_syncs_per_step": syncs}  # fmt: skip


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": "fake", "rows": rows}))


def test_rows_pair_by_shape_and_each_verdict_has_its_cause(tmp_path: Path) -> None:
    w = tmp_path / "work"
    _write(w / "layer.json", [_layer(102.0, T=32), _layer(50.0, allocs=4, T=1), _layer(9.0, T=7)])
    _write(w / "before" / "layer.json", [_layer(100.0, T=32), _layer(60.0, T=1)])  # T = 7: no before row
    step = {"W": 1, "T": 1, "ctx": 8192, "kv_format": "native", "allocations_per_run": 0}
    _write(w / "step_raw" / "step_W1.json", [{**step, "graph_us": 41.0, "host_syncs_per_step": 1}])
    _write(w / "before" / "step_raw" / "step_W1.json", [{**step, "graph_us": 45.0, "host_syncs_per_step": 0}])
    out = tmp_path / "ba.json"
    subprocess.run([sys.executable, str(TOOL), str(w), "--before-commit", "a", "--after-commit", "b", "--out",
                    str(out)], check=True, capture_output=True)  # fmt: skip
    doc = json.loads(out.read_text())
    layer = {r["row"]: r for r in doc["layer"]}
    assert set(layer) == {"dcp:8:32:32768:bf16", "dcp:8:1:32768:bf16"}
    assert abs(layer["dcp:8:32:32768:bf16"]["change"] - 0.02) < 1e-12 and layer["dcp:8:32:32768:bf16"]["within_target"]
    assert not layer["dcp:8:1:32768:bf16"]["within_target"]  # faster, but one more allocation per run
    (s,) = doc["step"]
    assert s["row"] == "1:1:8192:native" and not s["within_target"]  # faster, but a host sync
    assert doc["all_within_target"] is False and (doc["before_commit"], doc["after_commit"]) == ("a", "b")
