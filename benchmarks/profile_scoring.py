#!/usr/bin/env python3
"""Profile one launch of the FP8 index-scoring kernel under Nsight Compute (on the H200), and summarize the report.

    ncu --profile-from-start off --clock-control none --set full --csv --page details \
        [--metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio'] --log-file $OUT/ncu.csv \
        python benchmarks/profile_scoring.py --shape 32x32768 [--next-n 1] \
        [--module dcp_ref.kernels.scoring_triton] [--config block_n=64,tiles=4,num_warps=4,num_stages=3]
    python benchmarks/profile_scoring.py --summarize $OUT/ncu.csv --out $OUT/ncu_32x32768.json [--label "new"]
    python3 benchmarks/bench_scoring.py ... --ncu-json $OUT/ncu_32x32768.json   # tabulated in scoring.md

Profiling: builds ``_scoring_inputs.build_inputs(T, L, next_n=...)`` (the benchmark's bytes; ``--shape TxL``,
``T`` query tokens, ``B = T / next_n`` requests), compiles and warms the kernel up (``out=``, ``validate=False``),
checks it against the float64 oracle rows (``reference_rows``; max relative error <= 1e-3, else exit 1), then
launches it once between ``cudaProfilerStart`` / ``cudaProfilerStop``, so that ``--profile-from-start off``
profiles that launch only. ``--module`` names another module with the same ``index_scores_triton`` (an older
kernel saved as e.g. ``dcp_ref.kernels.scoring_triton_v1``): ``next_n=`` is passed only when it is not 1; a
wrapper that takes ``plan=`` gets ``scoring_plan(T, L, device, **config)`` that way (the tuning lives on the plan
only), an older one each tuning keyword that ``--config`` names, so a kernel without them still runs.

``--summarize CSV`` (no GPU): :func:`summarize_ncu` of ncu's ``--csv --page details`` output (lines before the
header, such as ``==PROF==``, are skipped) -> JSON ``{"source", "label", "kernels": [...]}``, one compact record
per profiled kernel: ``duration_us``, ``dram_throughput_pct``, ``memory_throughput_pct``, ``dram_bandwidth_GBps``,
``compute_sm_throughput_pct``, ``achieved_occupancy_pct``, ``theoretical_occupancy_pct``, ``registers_per_thread``,
``shared_memory_per_block_bytes`` (static + dynamic; ``driver_shared_memory_per_block_bytes`` apart),
``block_size``, ``grid_size``, ``waves_per_sm``, ``l2_hit_rate_pct``, ``warp_cycles_per_issued_instruction``,
``warp_stalls_top5`` (``[name, value]``: the ``Stall ...`` metrics, or the raw
``smsp__average_warps_issue_stalled_*`` / ``smsp__pcsamp_warps_issue_stalled_*`` ones the ``--metrics`` above
adds), and ``all`` (every metric: name -> ``"value unit"``). Metric names are matched case-insensitively, with
the aliases of older ncu versions; numbers may carry thousands separators.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import inspect
import io
import json
import os
import re
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # this folder (when imported, not run)

TUNING = ("block_n", "tiles", "num_warps", "num_stages")


# ---- profiling ------------------------------------------------------------------------------------------
def parse_shape(text: str) -> tuple[int, int]:
    """``"32x32768"`` -> ``(32, 32768)``."""
    t, n = (int(v) for v in text.lower().split("x"))
    return t, n


def parse_config(text: str | None) -> dict[str, int]:
    """``"block_n=64,tiles=4"`` -> ``{"block_n": 64, "tiles": 4}`` (the tuning keywords only)."""
    out: dict[str, int] = {}
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        name, _, value = item.partition("=")
        if name not in TUNING:
            raise ValueError(f"--config: unknown {name!r} (expected {', '.join(TUNING)})")
        out[name] = int(value)
    return out


def kernel_kwargs(next_n: int, config: dict[str, int]) -> dict[str, int]:
    """The keywords the kernel gets: ``next_n`` only when it is not 1, then the ``--config`` ones."""
    return ({"next_n": next_n} if next_n != 1 else {}) | config


def profile(shape: tuple[int, int], next_n: int, module: str, config: dict[str, int], warmup: int = 3) -> int:
    import _scoring_inputs as si
    import torch

    from dcp_ref.geometry import DcpGeometry

    mod = importlib.import_module(module)
    fn = mod.index_scores_triton
    t, n = shape
    inp = si.build_inputs(t, n, "cuda", next_n=next_n)
    args = [inp[x] for x in ("index_q", "weights", "index_cache", "block_table", "req_of_token", "local_bounds")]
    g = DcpGeometry(1, 0, 1, si.BLOCK)
    out = torch.full((t, n), float("nan"), device="cuda")
    kw = kernel_kwargs(next_n, config)
    made = None  # the plan passed in, where the wrapper takes one (it then takes no tuning keyword of its own)
    if "plan" in inspect.signature(fn).parameters:
        made = mod.scoring_plan(t, n, out.device, **kw)
        kw = {k: v for k, v in kw.items() if k not in TUNING} | {"plan": made}
    for _ in range(max(1, warmup)):  # compiles, then warm
        fn(*args, g, out=out, validate=False, **kw)
    torch.cuda.synchronize()
    err = si.rel_error(out, si.reference_rows(inp))
    plan = None if made is None else made._asdict()
    if plan is None and hasattr(mod, "scoring_plan"):  # an older wrapper, tuned by keywords
        try:
            plan = mod.scoring_plan(t, n, out.device, **kw)._asdict()
        except TypeError:  # an older plan without one of the keywords
            plan = None
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn(*args, g, out=out, validate=False, **kw)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {module}.index_scores_triton T={t} L={n} next_n={next_n} config={config} plan={plan} "
          f"max_rel_err={err:.2e}", flush=True)  # fmt: skip
    if not err <= 1e-3:
        print(f"max_rel_err {err:.3e} > 1e-3 against the oracle rows", file=sys.stderr)
        return 1
    return 0


# ---- the ncu CSV ---------------------------------------------------------------------------------------
def number(text: Any) -> float | None:
    """``"1,234.5"`` -> ``1234.5``; ``None`` for ``n/a``, empty or non-numeric text."""
    if text is None:
        return None
    s = str(text).strip().replace(",", "")
    try:
        return float(s)
    except ValueError:
        return None


_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BIN = {"ki": 1024.0, "mi": 1024.0**2, "gi": 1024.0**3}


def to_us(value: float, unit: str) -> float | None:
    u = unit.strip().lower()
    scale = {"ns": 1e-3, "nsecond": 1e-3, "nsec": 1e-3, "us": 1.0, "usecond": 1.0, "usec": 1.0, "µs": 1.0,
             "ms": 1e3, "msecond": 1e3, "msec": 1e3, "s": 1e6, "second": 1e6, "sec": 1e6}.get(u)  # fmt: skip
    return value * scale if scale is not None else None


def to_bytes(value: float, unit: str) -> float | None:
    """``byte``, ``Kbyte``, ``KiB``, ``KB`` ... (optionally ``/block`` or ``/second``) -> bytes (SI: ncu's Kbyte is
    1000 bytes)."""
    u = unit.strip().lower().split("/")[0].replace(" ", "")
    m = re.fullmatch(r"([kmgt]i?)?(byte|bytes|b)", u)
    if not m:
        return None
    p = m.group(1) or ""
    return value * (_BIN[p] if p in _BIN else _SI[p[:1]])


def to_gbps(value: float, unit: str) -> float | None:
    u = unit.strip().lower().replace(" ", "")
    if not (u.endswith("/second") or u.endswith("/s")):
        return None
    b = to_bytes(value, u.split("/")[0])
    return b / 1e9 if b is not None else None


def _launch_dim(text: str | None) -> str | None:
    """A ``"(128, 1, 1)"`` column as ``"128x1x1"``; other text as it is."""
    if not text:
        return None
    nums = re.findall(r"\d+", text.replace(",", " , "))
    return "x".join(nums) if text.strip().startswith("(") and nums else text.strip()


def _stall_name(name: str) -> str | None:
    """The stall reason a metric names (``"Stall Long Scoreboard"``, or a raw ``..._issue_stalled_<reason>_...``
    metric), or ``None``."""
    low = name.lower()
    m = re.search(r"issue_stalled_([a-z0-9_]+?)(?:_per_(?:issue|warp)_active|\.|$)", low)
    if m:
        return "Stall " + " ".join(w.capitalize() for w in m.group(1).split("_"))
    if low.startswith("stall ") or low.startswith("stall:"):
        return name.strip()
    return None


#: summary field -> (metric names, lower case; the unit it needs: "%", "time", "bytes", "bw", or None = any number)
FIELDS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "duration_us": (("duration", "gpu__time_duration.sum", "gpu__time_duration.avg"), "time"),
    "dram_throughput_pct": (("dram throughput", "dram__throughput.avg.pct_of_peak_sustained_elapsed"), "%"),
    "memory_throughput_pct": (("memory throughput", "memory [%]",
                               "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"), "%"),
    "dram_bandwidth_GBps": (("memory throughput", "dram bandwidth", "dram__bytes.sum.per_second"), "bw"),
    "compute_sm_throughput_pct": (("compute (sm) throughput", "compute (sm) [%]", "sm [%]",
                                   "sm__throughput.avg.pct_of_peak_sustained_elapsed"), "%"),
    "achieved_occupancy_pct": (("achieved occupancy", "sm__warps_active.avg.pct_of_peak_sustained_active"), "%"),
    "theoretical_occupancy_pct": (("theoretical occupancy", "sm__maximum_warps_per_active_cycle_pct"), "%"),
    "registers_per_thread": (("registers per thread", "launch__registers_per_thread"), None),
    "static_shared_memory_per_block_bytes": (("static shared memory per block",), "bytes"),
    "dynamic_shared_memory_per_block_bytes": (("dynamic shared memory per block",), "bytes"),
    "driver_shared_memory_per_block_bytes": (("driver shared memory per block",), "bytes"),
    "block_size_threads": (("block size", "launch__block_size"), None),
    "grid_size_blocks": (("grid size", "launch__grid_size"), None),
    "waves_per_sm": (("waves per sm", "launch__waves_per_multiprocessor"), None),
    "l2_hit_rate_pct": (("l2 hit rate", "lts__t_sector_hit_rate.pct"), "%"),
    "warp_cycles_per_issued_instruction": (("warp cycles per issued instruction",), None),
    "elapsed_cycles": (("elapsed cycles",), None),
}  # fmt: skip


def _field_value(kind: str | None, value: float, unit: str) -> float | None:
    if kind == "%":
        return value if unit.strip() in ("%", "") else None
    if kind == "time":
        return to_us(value, unit)
    if kind == "bytes":
        return to_bytes(value, unit or "byte")
    if kind == "bw":
        return to_gbps(value, unit)
    return value


def _csv_rows(csv_text: str) -> list[dict[str, str]]:
    lines = csv_text.splitlines()
    head = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith('"ID"') and "Metric Name" in ln), None)
    if head is None:
        raise ValueError('no ncu CSV header (a line starting with "ID" that names "Metric Name")')
    # ncu's own messages (==PROF==, ==WARNING==) may come between rows; a quoted value may span lines
    body = [lines[head]] + [ln for ln in lines[head + 1 :] if not ln.startswith("==")]
    rows = csv.DictReader(io.StringIO("\n".join(body)))
    return [r for r in rows if r.get("Metric Name") is not None or r.get("Kernel Name") is not None]


def summarize_ncu(csv_text: str) -> dict[str, Any]:
    """ncu's ``--csv --page details`` text -> ``{"kernels": [one compact record per (ID, kernel)]}`` (module
    docstring); ``count``: how many kernels."""
    kernels: dict[tuple[str, str], dict[str, Any]] = {}
    for row in _csv_rows(csv_text):
        low = {k.strip().lower(): v for k, v in row.items() if isinstance(k, str) and isinstance(v, str)}
        name = low.get("kernel name", "").strip()
        kid = low.get("id", "").strip()
        if not name or not kid:  # not a metric row (the profiled program's own output)
            continue
        k = kernels.setdefault((kid, name), {
            "id": int(kid) if kid.isdigit() else kid, "name": name,
            "block_size": _launch_dim(low.get("block size")), "grid_size": _launch_dim(low.get("grid size")),
            "device": low.get("device") or None, "cc": low.get("cc") or None,
            "all": {}, "_stalls": {}, "_sections": {},
        })  # fmt: skip
        metric = low.get("metric name", "").strip()
        if not metric:  # a rule row
            continue
        unit, raw, section = (
            low.get("metric unit", "").strip(),
            low.get("metric value", "").strip(),
            low.get("section name", "").strip(),
        )
        key = metric if metric not in k["all"] or k["_sections"].get(metric) == section else f"{metric} ({section})"
        k["all"][key] = f"{raw} {unit}".strip()
        k["_sections"].setdefault(metric, section)
        value = number(raw)
        if value is None:
            continue
        mlow = metric.lower()
        for field, (names, kind) in FIELDS.items():
            if mlow in names and field not in k:
                got = _field_value(kind, value, unit)
                if got is not None:
                    k[field] = got
        stall = _stall_name(metric)
        if stall is not None:
            k["_stalls"][stall] = max(value, k["_stalls"].get(stall, value))
    out = []
    for k in kernels.values():
        stalls = sorted(k.pop("_stalls").items(), key=lambda kv: -kv[1])
        k.pop("_sections")
        k["warp_stalls_top5"] = [[n, v] for n, v in stalls[:5]]
        parts = [k.get("static_shared_memory_per_block_bytes"), k.get("dynamic_shared_memory_per_block_bytes")]
        if any(p is not None for p in parts):
            k["shared_memory_per_block_bytes"] = sum(p or 0.0 for p in parts)
        if k.get("block_size") is None and k.get("block_size_threads") is not None:
            k["block_size"] = str(int(k["block_size_threads"]))
        if k.get("grid_size") is None and k.get("grid_size_blocks") is not None:
            k["grid_size"] = str(int(k["grid_size_blocks"]))
        k["all"] = k.pop("all")  # last: the compact fields first
        out.append(k)
    return {"kernels": out, "count": len(out)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="32x32768", help="TxL: T query tokens, L local keys")
    ap.add_argument("--next-n", type=int, default=1, help="tokens per request (2: MTP); T must be a multiple")
    ap.add_argument("--module", default="dcp_ref.kernels.scoring_triton", help="the module of index_scores_triton")
    ap.add_argument("--config", default="", help="block_n=..,tiles=..,num_warps=..,num_stages=.. (each optional)")
    ap.add_argument("--warmup", type=int, default=3, help="calls before the profiled one (the first compiles)")
    ap.add_argument("--summarize", metavar="CSV", help="summarize ncu's --csv --page details output (no GPU)")
    ap.add_argument("--out", help="with --summarize: the JSON to write (default: print it)")
    ap.add_argument("--label", default="", help="with --summarize: a label kept in the JSON (the shape, the kernel)")
    args = ap.parse_args(argv)
    if args.summarize:
        with open(args.summarize, errors="replace") as fh:
            summary = {"source": os.path.basename(args.summarize), "label": args.label} | summarize_ncu(fh.read())
        text = json.dumps(summary, indent=1)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as fh:
                fh.write(text + "\n")
            for k in summary["kernels"]:
                print(f"{k['name'][:60]}: {k.get('duration_us')} us, DRAM {k.get('dram_throughput_pct')} %, "
                      f"occupancy {k.get('achieved_occupancy_pct')} %, stalls {k['warp_stalls_top5'][:3]}")  # fmt: skip
        else:
            print(text)
        return 0
    return profile(parse_shape(args.shape), args.next_n, args.module, parse_config(args.config), args.warmup)


if __name__ == "__main__":
    sys.exit(main())
