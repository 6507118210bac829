#!/usr/bin/env python3
"""Compile every Triton launch the CPU tests make for the H200's target (sm_90a cubin), without a GPU.

The Triton interpreter (``TRITON_INTERPRET=1``, how CI runs every kernel) executes a kernel's Python; it does
not type-check or lower it like the compiler does, so a kernel can pass every CPU test and still fail to compile
on the device. This tool closes that gap in two steps:

    # 1. record: run tests under the interpreter; every launch's kernel, argument types and constexprs are kept
    TRITON_INTERPRET=1 DCP_TRITON_RECORD=/tmp/launches.jsonl \\
        python -m pytest -p tools.triton_sm90 tests/test_deinterleave.py ...
    # 2. compile: each distinct launch once, in a process without the interpreter, to sm_90a PTX and cubin
    python tools/triton_sm90.py compile /tmp/launches.jsonl --out report.json

A launch is keyed by (kernel, signature, constexpr values, num_warps, num_stages); the signature is the one
Triton's JIT would build from the arguments (tensors -> ``*dtype``, Python ints -> ``i32`` or ``i64`` by value,
floats -> ``fp32``, bools -> ``u1``), without its value specializations (``== 1``, multiples of 16), so what is
compiled is the most general variant of each launch. ``tests/test_triton_sm90.py`` runs both steps in CI over
a few launches of every kernel module; ``benchmarks/results/triton_sm90.json`` is the record over the whole
CPU suite.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

RECORD_ENV = "DCP_TRITON_RECORD"
OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")

_DTYPES = {
    "float32": "fp32",
    "float64": "fp64",
    "float16": "fp16",
    "bfloat16": "bf16",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "uint16": "u16",
    "uint32": "u32",
    "uint64": "u64",
    "bool": "u1",
    "float8_e4m3fn": "fp8e4nv",
    "float8_e5m2": "fp8e5",
}


def _arg_type(value: Any) -> tuple[str, Any]:
    """What Triton's JIT makes of a runtime argument: ``(type, value kept for constexprs)``."""
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[str(value.dtype).removeprefix("torch.")], None
    if isinstance(value, bool):
        return "u1", value
    if isinstance(value, int):
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), value
    if isinstance(value, float):
        return "fp32", value
    if value is None:
        return "constexpr", None
    base, block = getattr(value, "base", None), getattr(value, "block_shape", None)
    if isinstance(base, torch.Tensor) and block is not None:
        # a host-side TensorDescriptor (TMA): the JIT types it by its element type and block shape
        dtype = _DTYPES[str(base.dtype).removeprefix("torch.")]
        return f"tensordesc<{dtype}[{', '.join(str(int(b)) for b in block)}]>", None
    raise TypeError(f"unrecorded argument type {type(value).__name__}")


def _constexpr(value: Any) -> Any:
    """A constexpr as JSON (the ``tl.constexpr`` wrapper unwrapped; dtypes by name)."""
    value = getattr(value, "value", value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"dtype": str(value)}


def launch_record(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """One launch of interpreted kernel ``fn`` as a JSON-able record (module, name, signature, constexprs, options)."""
    import inspect

    params = list(inspect.signature(fn).parameters.values())
    bound = dict(zip([p.name for p in params], args))
    bound.update({k: v for k, v in kwargs.items() if k not in OPTIONS})
    sig: dict[str, str] = {}
    cst: dict[str, Any] = {}
    for p in params:
        is_cst = "constexpr" in str(p.annotation)
        if p.name in bound:
            v = bound[p.name]
        elif p.default is not inspect.Parameter.empty:
            v = p.default
        else:
            raise TypeError(f"{fn.__name__}: no value for {p.name}")
        if is_cst:
            sig[p.name] = "constexpr"
            cst[p.name] = _constexpr(v)
            continue
        t, val = _arg_type(v)
        sig[p.name] = t
        if t == "constexpr":
            cst[p.name] = val
    opts = {k: kwargs[k] for k in OPTIONS if k in kwargs and kwargs[k] is not None}
    return {"module": fn.__module__, "name": fn.__name__, "signature": sig, "constexprs": cst, "options": opts}


def record_key(rec: dict[str, Any]) -> str:
    """The launch's identity: everything but the test that made it."""
    rec = {k: v for k, v in rec.items() if k != "test"}
    return hashlib.sha1(json.dumps(rec, sort_keys=True).encode()).hexdigest()[:16]


def install_recorder(path: str) -> None:
    """Wrap the interpreter's launch so that every launch appends its record (once per key) to ``path``."""
    from triton.runtime.interpreter import InterpretedFunction

    seen: set[str] = set()
    original = InterpretedFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        try:
            rec = launch_record(self.fn, args, kwargs)
        except (TypeError, KeyError) as exc:  # say so in the record: a launch that could not be typed
            rec = {"module": self.fn.__module__, "name": self.fn.__name__, "unrecorded": str(exc)}
        key = record_key(rec)
        if key not in seen:
            seen.add(key)
            # the first test to make this launch (pytest sets the variable; `tests/test_triton_sm90.py` picks
            # its tests from it)
            rec["test"] = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
            with open(path, "a") as f:
                f.write(json.dumps(rec, sort_keys=True) + "\n")
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run  # type: ignore[method-assign]


def pytest_configure(config: Any) -> None:  # the pytest plugin: `-p tools.triton_sm90`
    path = os.environ.get(RECORD_ENV)
    if path and os.environ.get("TRITON_INTERPRET") == "1":
        install_recorder(path)


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """The distinct records of ``path`` (one JSON object per line), in first-seen order."""
    out: dict[str, dict[str, Any]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out.setdefault(record_key(rec), rec)
    return list(out.values())


def _jit_kernel(rec: dict[str, Any]) -> Any:
    mod = importlib.import_module(rec["module"])
    return getattr(mod, rec["name"])


def _constexpr_value(v: Any) -> Any:
    if isinstance(v, dict) and "dtype" in v:
        import triton.language as tl

        return getattr(tl, v["dtype"].split(".")[-1])
    return v


def compile_record(rec: dict[str, Any], arch: int = 90) -> dict[str, Any]:
    """Compile one record for ``sm_{arch}a``; returns what the compiler made (or the error it raised)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out: dict[str, Any] = {"kernel": f"{rec['module']}.{rec['name']}", "key": record_key(rec)}
    if "unrecorded" in rec:
        return out | {"ok": False, "error": "not recorded: " + rec["unrecorded"]}
    t0 = time.perf_counter()
    try:
        kern = _jit_kernel(rec)
        cst = {k: _constexpr_value(v) for k, v in rec["constexprs"].items()}
        sig = {n: rec["signature"][n] for n in kern.arg_names}  # the kernel's parameter order (JSON sorted it)
        src = ASTSource(kern, signature=sig, constexprs=cst)
        c = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=rec["options"])
        ptx = c.asm["ptx"]
        out |= {
            "ok": f"sm_{arch}a" in ptx and len(c.asm["cubin"]) > 0,
            "shared": c.metadata.shared,
            "num_warps": c.metadata.num_warps,
        }
    except Exception as exc:  # noqa: BLE001 - the report keeps the compiler's own message
        out |= {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
    out["compile_s"] = round(time.perf_counter() - t0, 2)
    return out


def compile_all(records: list[dict[str, Any]], arch: int = 90, jobs: int = 1) -> list[dict[str, Any]]:
    """Compile every record (in ``jobs`` processes); the reports in the records' order."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile in a process without TRITON_INTERPRET=1 (the kernels must be JIT functions)")
    if jobs <= 1:
        return [compile_record(r, arch) for r in records]
    import functools
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        return pool.map(functools.partial(compile_record, arch=arch), records, chunksize=4)


def merge_reports(paths: list[str], records: list[dict[str, Any]], command: str) -> dict[str, Any]:
    """One record of several ``compile`` reports (one per Triton version), per kernel: its distinct launches, how
    many failed under any version (with the compiler's message), the most shared memory per version, and the first
    test that launched it."""
    import datetime

    reports = [json.loads(Path(p).read_text()) for p in paths]
    tests = {record_key(r): r.get("test", "") for r in records}
    kernels: dict[str, dict[str, Any]] = {}
    failures: dict[str, dict[str, Any]] = {}
    for rep in reports:
        ver = rep["summary"]["triton"]
        for r in rep["launches"]:
            k = kernels.setdefault(r["kernel"], {"launches": set(), "max_shared": {}, "first_test": tests[r["key"]]})
            k["launches"].add(r["key"])
            k["max_shared"][ver] = max(k["max_shared"].get(ver, 0), r.get("shared") or 0)
            if not r["ok"]:
                failures.setdefault(r["key"], {"kernel": r["kernel"], "key": r["key"], "errors": {}})
                failures[r["key"]]["errors"][ver] = r.get("error", "")
    per_kernel = {
        name: {
            "launches": len(k["launches"]),
            "failed": sum(f["kernel"] == name for f in failures.values()),
            "max_shared": k["max_shared"],
            "first_test": k["first_test"],
        }
        for name, k in sorted(kernels.items())
    }
    return {
        "what": "every distinct Triton launch the CPU suite makes under the interpreter, compiled ahead of time "
        "for sm_90a (PTX + cubin, no GPU) with each Triton version; a launch fails if any version refuses it",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "command": command,
        "summary": {
            "launches": sum(k["launches"] for k in per_kernel.values()),
            "kernels": len(per_kernel),
            "failed": len(failures),
            "triton": [rep["summary"]["triton"] for rep in reports],
            "target": reports[0]["summary"]["target"],
        },
        "kernels": per_kernel,
        "failures": list(failures.values()),
    }


def splice_record(into: dict[str, Any], merged: dict[str, Any]) -> dict[str, Any]:
    """``into`` (a whole-suite record) with the kernels of every module ``merged`` covers replaced by ``merged``'s
    (re-recorded from the tests of those modules, compiled with the same Triton versions), the rest kept as they
    were; the summary recounted and ``merged``'s command appended to ``into``'s."""
    modules = {name.rsplit(".", 1)[0] for name in merged["kernels"]}
    if merged["summary"]["triton"] != into["summary"]["triton"]:
        raise ValueError(f"merged was compiled with Triton {merged['summary']['triton']}, the record with "
                         f"{into['summary']['triton']}: splice only reports of the same versions")  # fmt: skip
    kept = {k: v for k, v in into["kernels"].items() if k.rsplit(".", 1)[0] not in modules}
    kernels = dict(sorted({**kept, **merged["kernels"]}.items()))
    failures = [f for f in into["failures"] if f["kernel"] in kept] + list(merged["failures"])
    summary = {**into["summary"], "launches": sum(k["launches"] for k in kernels.values()), "kernels": len(kernels),
               "failed": len(failures)}  # fmt: skip
    command = f"{into['command']}; {merged['date_utc']}: {merged['command']}"
    return {**into, "date_utc": merged["date_utc"], "command": command, "summary": summary, "kernels": kernels,
            "failures": failures}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="compile the recorded launches for sm_90a")
    c.add_argument("records")
    c.add_argument("--out", help="write the report (JSON) here")
    c.add_argument("--arch", type=int, default=90)
    c.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    c.add_argument(
        "--prefix", default="", help="compile only kernels whose module starts with this (e.g. dcp_ref.kernels.)"
    )
    m = sub.add_parser("merge", help="merge compile reports of several Triton versions into one record")
    m.add_argument("records")
    m.add_argument("reports", nargs="+")
    m.add_argument("--out", required=True)
    m.add_argument("--command", default="", help="how the record was made (kept in the file)")
    m.add_argument("--into", help="an existing record: replace only the kernels of the modules these reports cover")
    a = ap.parse_args(argv)
    if a.cmd == "merge":
        merged = merge_reports(a.reports, load_records(a.records), a.command)
        if a.into:
            merged = splice_record(json.loads(Path(a.into).read_text()), merged)
        Path(a.out).write_text(json.dumps(merged, indent=1) + "\n")
        print(json.dumps(merged["summary"]))
        return 1 if merged["summary"]["failed"] else 0
    records = [r for r in load_records(a.records) if r["module"].startswith(a.prefix)]
    report = compile_all(records, a.arch, a.jobs)
    bad = [r for r in report if not r["ok"]]
    by_kernel: dict[str, int] = {}
    for r in report:
        by_kernel[r["kernel"]] = by_kernel.get(r["kernel"], 0) + 1
    import triton

    summary = {
        "triton": triton.__version__,
        "target": f"cuda sm_{a.arch}a",
        "launches": len(report),
        "kernels": len(by_kernel),
        "failed": len(bad),
        "per_kernel": dict(sorted(by_kernel.items())),
    }
    if a.out:
        Path(a.out).write_text(json.dumps({"summary": summary, "launches": report}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    for r in bad:
        print(f"FAILED {r['kernel']} [{r['key']}]: {r['error'][:400]}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
