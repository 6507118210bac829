#!/usr/bin/env python3
"""Merge pytest JUnit XML files from GPU runs (and compute-sanitizer reports) into ``results/gpu_tests.json``.

    python benchmarks/collect_gpu_tests.py --out benchmarks/results/gpu_tests.json \
        --what "..." --command "..." [--commit SHA] [--sanitizer memcheck_x.txt ...] -- run1.xml run2.xml ...

``tools/gpu_check.sh merge`` calls it on what the device check brought back. A test that appears in
several files keeps its result from the *last* file (a re-run after a fix replaces the earlier result;
the earlier failure is kept under ``superseded``). The JSON has the totals, the counts per test file,
every test, and per sanitizer report its tool, families, ``ERROR SUMMARY`` / ``RACECHECK SUMMARY`` count
and whether ``sanitize_all.py`` itself exited cleanly (its last line, ``status N``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def read(path: str) -> dict[str, dict]:
    out = {}
    for tc in ET.parse(path).iter("testcase"):
        name = f"{tc.get('classname')}::{tc.get('name')}"
        status = "passed"
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                break
        out[name] = {
            "test": name,
            "status": status,
            "seconds": round(float(tc.get("time", 0)), 3),
            "file": path.split("/")[-1],
        }
    return out


#: Kernels of other projects that sanitize_all.py drives through this project's wrappers (FlashMLA's own CUDA
#: kernels, FlashInfer's, CUTLASS/CUB/ATen helpers): a finding inside one is reported, attributed, but is not a
#: finding in this project's code.
THIRD_PARTY = re.compile(r"^(?:void )?(?:legacy::sm90|flash|flashinfer|cutlass|cute::|cub::|at::|c10::)")


def _kernel_of(symbol: str) -> str:
    """The kernel's name from a sanitizer's ``void ns::name<...>(args)+0x1f0``: the namespace path and name."""
    name = symbol.removeprefix("void ").split("<")[0].split("(")[0]
    return name.strip()


def read_sanitizer(path: str) -> dict:
    """One compute-sanitizer report of ``sanitize_all.py``: the tool, the error/hazard count, the script's status."""
    text = Path(path).read_text(errors="replace")
    tool = "racecheck" if "RACECHECK SUMMARY" in text or "racecheck" in Path(path).name else "memcheck"
    m = re.findall(r"(?:ERROR|RACECHECK) SUMMARY: (\d+)", text)
    status = re.findall(r"checked launches, (\d+) mismatching, status (\d+)", text)
    skipped = re.findall(r"^(\w+): skipped \((.*)\)$", text, flags=re.M)
    # each finding names the kernel it is in: "Race reported between Write access at SYMBOL+0x.. [N hazards]"
    # (racecheck), "Invalid __global__ read of size 4 ... at SYMBOL+0x.." (memcheck)
    kernels: dict[str, dict] = {}
    for m_ in re.finditer(r"=+ (?:Error|Warning): Race reported between \w+ access at (.+?)\+0x[0-9a-f]+", text):
        name = _kernel_of(m_.group(1))
        k = kernels.setdefault(name, {"findings": 0, "third_party": bool(THIRD_PARTY.match(name))})
        k["findings"] += 1
    for m_ in re.finditer(r"=+ Invalid .*?\n=+\s+at (.+?)\+0x[0-9a-f]+", text):
        name = _kernel_of(m_.group(1))
        k = kernels.setdefault(name, {"findings": 0, "third_party": bool(THIRD_PARTY.match(name))})
        k["findings"] += 1
    ours = sum(k["findings"] for k in kernels.values() if not k["third_party"])
    return {
        "report": Path(path).name,
        "tool": tool,
        "errors": int(m[-1]) if m else None,  # None: no summary line (the run was cut short)
        "script_status": int(status[-1][1]) if status else None,
        "mismatches": int(status[-1][0]) if status else None,
        "launches": sum(int(n) for n in re.findall(r"^(\d+) checked launches", text, flags=re.M)) or None,
        "skipped": dict(skipped),
        "kernels_with_findings": kernels,
        "findings_in_this_projects_kernels": ours,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--what", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--device", default="NVIDIA H200")
    ap.add_argument("--versions", default="{}", help="JSON object of library versions")
    ap.add_argument("--commit", default="", help="the commit the device ran")
    ap.add_argument("--sanitizer", nargs="*", default=[], help="compute-sanitizer reports of sanitize_all.py")
    ap.add_argument("xml", nargs="+")
    args = ap.parse_args()
    merged: dict[str, dict] = {}
    superseded = []
    for path in args.xml:
        for name, rec in read(path).items():
            if (
                name in merged
                and merged[name]["status"] in ("failed", "error")
                and rec["status"] != merged[name]["status"]
            ):
                superseded.append(merged[name])
            merged[name] = rec
    tests = sorted(merged.values(), key=lambda r: r["test"])
    summary = {s: sum(r["status"] == s for r in tests) for s in ("passed", "failed", "error", "skipped")}
    per_file: dict[str, Counter] = {}
    for r in tests:
        per_file.setdefault(r["file"], Counter())[r["status"]] += 1
    sanitizer = [read_sanitizer(p) for p in args.sanitizer]
    doc = {
        "what": args.what,
        "command": args.command,
        "commit": args.commit,
        "date": datetime.date.today().isoformat(),
        "device": args.device,
        "versions": json.loads(args.versions),
        "summary": summary,
        "per_file": {f: dict(c) for f, c in sorted(per_file.items())},
        "sanitizer": sanitizer,
        "tests": tests,
        "superseded": superseded,
    }
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    print(summary)
    for r in sanitizer:
        print(
            f"{r['report']}: {r['tool']} {r['errors']} errors ({r['findings_in_this_projects_kernels']} in this "
            f"project's kernels), sanitize_all status {r['script_status']}"
        )


if __name__ == "__main__":
    main()
