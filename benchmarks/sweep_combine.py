#!/usr/bin/env python3
"""The all-to-all combine's launch shape, swept on the H200: ``lse_merge`` of the ``W`` partials of one rank's
``H/W`` heads after the all-to-all (``[W, T, H/W, 512]`` bf16, float32 LSEs, base e), as the planned layer runs it.

    python3 benchmarks/sweep_combine.py --out DIR        # -> DIR/combine_sweep.json

Each launch shape (``block_h`` heads per program, ``num_warps``) is checked against the float64 reference, then
timed as a stage inside a layer's graph (``_timing.stage``: 20 back-to-back calls in one CUDA graph, µs per call).
Beside each time: the bytes it must move (``floor_bytes``: every partial and LSE read once, the merged output and
LSE written once) and that floor at the measured copy bandwidth of 4.23 TB/s. ``kernels/stages.py``
(:data:`COMBINE_BLOCK_H`) reads the winners.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import _meta  # noqa: E402
import _timing  # noqa: E402

H, D, COPY_TBPS = 128, 512, 4.23


def reference(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """float64 LSE-weighted mean of the W partials (base e)."""
    w = torch.softmax(lses.double(), dim=0)
    return (w.unsqueeze(-1) * outs.double()).sum(0)


def main() -> None:
    from dcp_ref.kernels.lse_merge_triton import lse_merge

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for W in (2, 4, 8):
        for T in (1, 32, 128):
            Hs = H // W
            outs = torch.randn(W, T, Hs, D, device="cuda", generator=g).to(torch.bfloat16)
            lses = torch.randn(W, T, Hs, device="cuda", generator=g) * 3
            ref = reference(outs, lses)
            res = torch.empty(T, Hs, D, dtype=torch.bfloat16, device="cuda")
            mlse = torch.empty(T, Hs, device="cuda")
            floor = W * T * Hs * (D * 2 + 4) + T * Hs * (D * 2 + 4)
            sweep = []
            for bh in (1, 2, 4, 8, 16):
                if bh > Hs:
                    continue
                for nw in (1, 2, 4, 8):
                    res.fill_(float("nan"))
                    lse_merge(outs, lses, base="e", merged=res, merged_lse=mlse, block_h=bh, num_warps=nw)
                    err = float(((res.double() - ref).abs().max() / ref.abs().max()).item())
                    t = _timing.stage(
                        lambda: lse_merge(
                            outs, lses, base="e", merged=res, merged_lse=mlse, block_h=bh, num_warps=nw, validate=False
                        )
                    )
                    sweep.append({"block_h": bh, "num_warps": nw, **t.as_dict(), "max_rel_err": err})
            best = min(sweep, key=lambda s: s["median_us"])
            default = next((s for s in sweep if s["block_h"] == 4 and s["num_warps"] == 4), None)
            floor_us = floor / (COPY_TBPS * 1e6)
            rows.append({"W": W, "T": T, "H_per_rank": Hs, "D": D, "floor_bytes": floor, "floor_us": floor_us,
                         "best": best, "default": default, "sweep": sweep})  # fmt: skip
            dflt = default["median_us"] if default else float("nan")
            print(f"W={W} T={T}: best bh={best['block_h']} nw={best['num_warps']} {best['median_us']:.2f} us"
                  f" (default {dflt:.2f}), floor {floor_us:.2f}")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {
        "device": torch.cuda.get_device_name(),
        "versions": _meta.versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "how": __doc__.split("\n\n")[2] if __doc__ else "",
        "timing": _timing.describe("graph", _timing.STAGE_CALLS),
        "rows": rows,
    }
    (out / "combine_sweep.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out / 'combine_sweep.json'}: {len(rows)} rows")


if __name__ == "__main__":
    main()
