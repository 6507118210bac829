#!/usr/bin/env python3
"""The FlashMLA plan constants from a committed splits sweep (``bench_attention.py --only-splits``).

    python tools/flashmla_splits_table.py benchmarks/results/attention_flashmla_splits.json           # print them
    python tools/flashmla_splits_table.py benchmarks/results/attention_flashmla_splits.json --apply   # write them

* ``FLASHMLA_SPLITS`` (``kernels/flashmla_sparse.py``): for every measured unsplit CTA count ``T * H / 64`` the
  splits whose time, summed over the shapes of that count (full rows of ``K`` slots), is the least; runs of equal
  splits merged (the entry keeps the run's largest count); trailing 1s dropped (past the table: 1).
* ``SPLITKV_MAX_TOKENS`` (``kernels/stages.py``): the largest ``T`` at H = 128 up to which the split-KV kernel is
  faster than FlashMLA at the planned splits at every measured ``T`` (both measured in the same run);
  ``SPLITKV_MAX_TOKENS_UNSPLIT``: the same against FlashMLA's one-split rows (what runs for fewer used slots).

The derivation is this file's, so the device run that measured the sweep and this checkout compute the same
constants (``tests/test_kernel_stages.py`` checks the committed ones against the committed sweep).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dcp_ref.kernels.flashmla_sparse import flashmla_splits  # noqa: E402  (the plan's own lookup, any table)


def splits_table(best_rows: list[dict], rows: list[dict]) -> tuple[tuple[int, int], ...]:
    """``((most unsplit CTAs, splits), ...)`` from the sweep's full-row timings."""
    times: dict[int, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    shapes = {(r["T"], r["H"]) for r in best_rows}
    for r in rows:
        if r["impl"] == "flashmla_bf16" and "count" not in r and (r["T"], r["H"]) in shapes and r.get("graph_us"):
            times[r["T"] * r["H"] // 64][r["splits"]] += r["graph_us"]
    table: list[tuple[int, int]] = []
    for ctas in sorted(times):
        best = min(times[ctas], key=lambda s: (times[ctas][s], s))
        if table and table[-1][1] == best:
            table[-1] = (ctas, best)
        else:
            table.append((ctas, best))
    while table and table[-1][1] == 1:
        table.pop()
    return tuple(table)


def splitkv_max_tokens(rows: list[dict], table: tuple[tuple[int, int], ...]) -> int:
    """The split-KV crossover at H = 128 against FlashMLA at the planned splits (``table=()``: unsplit)."""
    by = {(r["impl"], r["T"], r.get("splits")): r["graph_us"] for r in rows
          if r["H"] == 128 and "count" not in r and r.get("graph_us")}  # fmt: skip
    best = 0
    for T in sorted({t for impl, t, _ in by if impl == "splitkv"}):
        fm = by.get(("flashmla_bf16", T, flashmla_splits(T, 128, table=table)))
        if fm is None:
            continue
        if by[("splitkv", T, None)] >= fm:
            break  # FlashMLA from here on
        best = T
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sweep")
    ap.add_argument("--apply", action="store_true", help="rewrite the two constants in kernels/")
    a = ap.parse_args(argv)
    d = json.loads(Path(a.sweep).read_text())
    table = splits_table(d["flashmla_splits_best"], d["flashmla_splits"])
    cross = splitkv_max_tokens(d["flashmla_splits"], table)
    unsplit = splitkv_max_tokens(d["flashmla_splits"], ())
    print(f"FLASHMLA_SPLITS = {table}\nSPLITKV_MAX_TOKENS = {cross}\nSPLITKV_MAX_TOKENS_UNSPLIT = {unsplit}")
    if a.apply:
        for path, pattern, value in (
            (ROOT / "kernels" / "flashmla_sparse.py", r"^FLASHMLA_SPLITS: tuple\[tuple\[int, int\], \.\.\.\] = .*$",
             f"FLASHMLA_SPLITS: tuple[tuple[int, int], ...] = {table}"),
            (ROOT / "kernels" / "stages.py", r"^SPLITKV_MAX_TOKENS = \d+$", f"SPLITKV_MAX_TOKENS = {cross}"),
            (ROOT / "kernels" / "stages.py", r"^SPLITKV_MAX_TOKENS_UNSPLIT = \d+$",
             f"SPLITKV_MAX_TOKENS_UNSPLIT = {unsplit}"),
        ):  # fmt: skip
            text = path.read_text()
            new, n = re.subn(pattern, value, text, flags=re.M)
            if n != 1:
                print(f"{path}: the constant's line was not found once", file=sys.stderr)
                return 1
            path.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
