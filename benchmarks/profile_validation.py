#!/usr/bin/env python3
"""Where a validated select-to-slots call spends its time: host phases, host functions, device kernels.

    python3 benchmarks/profile_validation.py --out DIR      # -> DIR/profile_validation.json + .txt (CUDA + CuTeDSL)

``bench_validation.py`` measures each wrapper's validated call against its unvalidated call and the one-read
floor (the unvalidated call, then one host read); this script explains a row that sits far above that floor.
For each order (``global_id``, ``rank_local``) and T in (1, 32), on ``bench_validation``'s inputs:

- **phases**: the eager per-call wall time of ``n`` back-to-back calls of each piece of the validated call
  alone — the shared shape checks, the value-check launch(es), the select launch, one host read of an idle
  flag — and of the whole unvalidated and validated calls (median of ``reps``; the pieces interleaved per rep);
- **host**: ``cProfile`` over 200 validated calls, the 25 functions with the most own time;
- **device**: ``torch.profiler`` over 20 validated calls, each kernel's mean device time.

``--all`` does the same for every row of ``bench_validation.py`` that can run here (its ``row()`` calls are
captured, not timed): unvalidated, validated and floor interleaved, and the host functions whose own time grows
most from the unvalidated to the validated call (``cProfile`` over 200 calls of each).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import _meta  # noqa: E402
from bench_validation import eager_interleaved, full_setup, select_inputs  # noqa: E402

from dcp_ref.geometry import DcpGeometry  # noqa: E402


def interleaved_us(fns: dict[str, Callable[[], object]], n: int, reps: int) -> dict[str, float]:
    """Median per-call µs of each function: ``bench_validation.eager_interleaved`` with ``n`` calls x ``reps``."""
    su = dataclasses.replace(full_setup(False), n=n, reps=reps)
    return {k: v["median_us"] for k, v in eager_interleaved(fns, su).items()}


def host_profile(fn: Callable[[], object], calls: int = 200) -> dict[str, float]:
    """Own time (µs per call) of each host function over ``calls`` calls of ``fn``."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    st = pstats.Stats(prof)
    return {
        f"{Path(f).name}:{line}({name})": tt / calls * 1e6
        for (f, line, name), (_cc, _nc, tt, _ct, _callers) in st.stats.items()  # type: ignore[attr-defined]
    }


def device_kernels(fn: Callable[[], object], calls: int = 20) -> dict[str, dict[str, float]]:
    """Each device kernel's (and copy's) calls and mean device µs over ``calls`` calls of ``fn``
    (``torch.profiler``)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as tp:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kern: dict[str, list[float]] = {}
    for e in tp.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kern.setdefault(e.name[:80], []).append(e.device_time_total)
    return {name: {"calls": len(v), "mean_us": statistics.mean(v)} for name, v in kern.items()}


def all_rows(n: int, reps: int, only: str = "") -> list[dict]:
    """Every ``bench_validation`` row that runs here (``only``: those whose wrapper name contains it):
    interleaved times and the host functions that grow most."""
    import bench_validation as bv

    captured: list[tuple[str, dict, Callable[[bool], Callable[[], object]]]] = []

    def capture(name, shape, make, su, *, unsupported=""):  # type: ignore[no-untyped-def]
        if not unsupported and only in name:
            captured.append((name, shape, make))
        return {}

    bv.row = capture  # type: ignore[assignment]
    su = full_setup(False)
    for T in (1, 32):
        for bench in bv.BENCHES:
            if bench is not bv.bench_guard:
                bench(T, su)
    probe = torch.zeros(1, device=su.dev)
    out = []
    for name, shape, make in captured:
        try:
            fu, fv = make(False), make(True)
            fu(), fv()
        except Exception as e:  # noqa: BLE001 - recorded
            out.append({"wrapper": name, **shape, "skipped": f"{type(e).__name__}: {e}"})
            continue
        t = interleaved_us({"unvalidated": fu, "validated": fv, "floor": lambda fu=fu: (fu(), probe.item())}, n, reps)
        hu, hv = host_profile(fu), host_profile(fv)
        grow = sorted(((hv[k] - hu.get(k, 0.0), k) for k in hv), reverse=True)[:12]
        rec = {"wrapper": name, **shape, **{f"{k}_us": v for k, v in t.items()},
               "over_floor_us": t["validated"] - t["floor"],
               "host_growth_us": {k: round(d, 2) for d, k in grow},
               "device_unvalidated": device_kernels(fu), "device_validated": device_kernels(fv)}  # fmt: skip
        out.append(rec)
        print(f"{name:40s} T={shape.get('T')}: " + ", ".join(f"{a} {b:.1f}" for a, b in t.items())
              + f"  over floor {rec['over_floor_us']:+.1f}", flush=True)  # fmt: skip
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="/tmp/profile_validation")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--all", action="store_true", help="also every bench_validation row (interleaved, host growth)")
    ap.add_argument("--only", default="", help="only the bench_validation rows whose wrapper name contains this "
                    "(implies --all; the select-to-slots phases are skipped)")  # fmt: skip
    args = ap.parse_args()
    if not args.only:
        from dcp_ref.kernels import select_to_slots_cutedsl as s2s
        from dcp_ref.select_to_slots import check_select_to_slots_inputs

    su = full_setup(False)
    geo = DcpGeometry(su.W, 0, 1, su.bs)
    k = su.K
    report: dict = {"versions": {**_meta.device(), **_meta.versions(), "date_utc": _meta.now_utc()}, "rows": []}
    text = io.StringIO()
    for T in () if args.only else (1, 32):
        x = select_inputs(T, su)
        out_s = torch.empty(T, k, dtype=torch.int32, device=su.dev)
        out_n = torch.empty(T, dtype=torch.int32, device=su.dev)
        probe = torch.zeros(1, device=su.dev)
        for order in ("global_id", "rank_local"):
            g = x["pairs"] if order == "global_id" else x["scores"]
            own = None if order == "global_id" else x["own"]
            req, table = x["req"], x["table"]

            def call(v: bool, g=g, own=own, order=order, req=req, table=table) -> object:  # type: ignore[no-untyped-def]
                return s2s.select_to_slots_cutedsl(
                    g, req, table, geo, k, order=order, own_ids=own, out_slots=out_s, out_counts=out_n, validate=v
                )

            spec = check_select_to_slots_inputs(
                g, req, table, geo, k, order=order, own_ids=own, out_slots=out_s, out_counts=out_n, validate=False
            )
            chk = s2s.check_flag(su.dev)

            def select(g, own, order, spec, flag, req=req, table=table):  # type: ignore[no-untyped-def]
                return s2s._select(
                    g, req, table, geo, spec, order=order, own_ids=own, out_slots=out_s, out_counts=out_n,
                    tvm_ffi=None, variant=None, config=None, first_bits=None, vec=None, split=None, flag=flag,
                )  # fmt: skip

            fns: dict[str, Callable[[], object]] = {
                "shape_checks": lambda g=g, own=own, order=order: check_select_to_slots_inputs(
                    g, req, table, geo, k, order=order, own_ids=own, out_slots=out_s, out_counts=out_n, validate=False
                ),
                "check_launch": lambda g=g, own=own, order=order: s2s.check_select_to_slots_values(
                    g, req, table, geo, order=order, own_ids=own
                ),
                "select_launch": lambda g=g, own=own, order=order, spec=spec: select(g, own, order, spec, None),
                # the validated call's launch: the checked configuration (one CTA a row), the flag raised on a fault
                "checked_select_launch": lambda g=g, own=own, order=order, spec=spec: select(g, own, order, spec, chk),
                "checked_select_then_read": lambda g=g, own=own, order=order, spec=spec: (
                    select(g, own, order, spec, chk),
                    chk.item(),
                ),
                "idle_read": lambda: probe.item(),
                "unvalidated": lambda: call(False),
                "validated": lambda: call(True),
                "floor": lambda: (call(False), probe.item()),
            }
            phases = interleaved_us(fns, args.n, args.reps)
            chk.zero_()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                call(True)
            torch.cuda.synchronize()
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
            device = device_kernels(lambda call=call: call(True))
            hu, hv = host_profile(lambda call=call: call(False)), host_profile(lambda call=call: call(True))
            grow = sorted(((hv[key] - hu.get(key, 0.0), key) for key in hv), reverse=True)[:12]
            rec = {"T": T, "order": order, "phases_us": phases, "device_kernels": device,
                   "device_kernels_unvalidated": device_kernels(lambda call=call: call(False)),
                   "host_growth_us": {key: round(d, 2) for d, key in grow}}  # fmt: skip
            report["rows"].append(rec)
            print(f"== T={T} order={order}", file=text)
            print(json.dumps(phases, indent=1), file=text)
            print(json.dumps(device, indent=1), file=text)
            print(s.getvalue()[:6000], file=text)
            print(f"T={T} {order}: " + ", ".join(f"{a} {b:.1f}" for a, b in phases.items()), flush=True)
    if args.all or args.only:
        report["all_rows"] = all_rows(args.n, args.reps, args.only)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_validation.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "profile_validation.txt").write_text(text.getvalue())
    print(f"wrote {out / 'profile_validation.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
