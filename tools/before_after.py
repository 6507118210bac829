"""The before/after table of a refactor, from one ``tools/gpu_check.sh bench`` call with ``BEFORE=<older tree>``.

That call times the layer and step rows on this tree into ``<work>/layer.json`` and ``<work>/step_raw/``, then the same
rows on the older tree into ``<work>/before/``. This script pairs the rows by shape and writes, per row, both graph
times, the change, and the allocations per run and host syncs per step of both, with the verdict of the refactor
target (every row within ``--tolerance`` of its before time or faster, no more allocations, no host sync)::

    python3 tools/before_after.py WORK --before-commit 45776dd --after-commit 8e6cdef \\
        --out benchmarks/results/refactor_before_after.json
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

LAYER_KEY = ("layout", "W", "T", "ctx", "cache")
STEP_KEY = ("W", "T", "ctx", "kv_format")


def _rows(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["rows"] if path.exists() else []


def _step_rows(folder: Path) -> list[dict[str, Any]]:
    return [r for f in sorted(folder.glob("step_W*.json")) for r in _rows(f)]


def pair(after: list[dict[str, Any]], before: list[dict[str, Any]], key: tuple[str, ...], tol: float) -> list[dict]:
    """One entry per shape measured on both trees (in the after rows' order)."""
    old = {tuple(r.get(k) for k in key): r for r in before}
    out = []
    for r in after:
        k = tuple(r.get(k) for k in key)
        b = old.get(k)
        if b is None:
            continue
        change = r["graph_us"] / b["graph_us"] - 1.0
        allocs = {"before": b.get("allocations_per_run"), "after": r.get("allocations_per_run")}
        syncs = {"before": b.get("host_syncs_per_step"), "after": r.get("host_syncs_per_step")}
        ok = change <= tol and (allocs["after"] or 0) <= (allocs["before"] or 0) and not syncs["after"]
        out.append({"row": ":".join(str(x) for x in k), "before_graph_us": b["graph_us"],
                    "after_graph_us": r["graph_us"], "change": change, "allocations_per_run": allocs,
                    "host_syncs_per_step": syncs, "within_target": ok})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("work", type=Path, help="the bench call's folder (its layer.json, step_raw/, before/)")
    ap.add_argument("--before-commit", required=True)
    ap.add_argument("--after-commit", required=True)
    ap.add_argument("--tolerance", type=float, default=0.03, help="slowest allowed change (0.03: +3 %%)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    w = args.work
    layer = pair(_rows(w / "layer.json"), _rows(w / "before" / "layer.json"), LAYER_KEY, args.tolerance)
    step = pair(_step_rows(w / "step_raw"), _step_rows(w / "before" / "step_raw"), STEP_KEY, args.tolerance)
    meta = json.loads((w / "layer.json").read_text()) if (w / "layer.json").exists() else {}
    doc = {
        "what": "graph time of every layer and step row on the tree before and after the refactor, one device call "
        "(tools/gpu_check.sh bench with BEFORE=), same machine, back-to-back replays (benchmarks/_timing.py)",
        "device": meta.get("device"),
        "versions": meta.get("versions"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "before_commit": args.before_commit,
        "after_commit": args.after_commit,
        "tolerance": args.tolerance,
        "layer": layer,
        "step": step,
        "all_within_target": all(r["within_target"] for r in layer + step) and bool(layer or step),
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for r in layer + step:
        verdict = "ok" if r["within_target"] else "MISSED"
        print(f"{r['row']:28s} {r['before_graph_us']:8.1f} -> {r['after_graph_us']:8.1f} us "
              f"({100 * r['change']:+.1f} %)  allocs {r['allocations_per_run']}  syncs {r['host_syncs_per_step']}  "
              f"{verdict}")  # fmt: skip
    ok = doc["all_within_target"]
    print(f"wrote {args.out}: {len(layer)} layer + {len(step)} step rows, all within target: {ok}")


if __name__ == "__main__":
    main()
