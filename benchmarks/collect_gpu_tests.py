#!/usr/bin/env python3
"""Merge pytest JUnit XML files from GPU runs into ``results/gpu_tests.json``.

    python benchmarks/collect_gpu_tests.py --out benchmarks/results/gpu_tests.json \
        --what "..." --command "..." run1.xml run2.xml ...

A test that appears in several files keeps its result from the *last* file (a re-run after a
fix replaces the earlier result; the earlier failure is kept under ``superseded``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import xml.etree.ElementTree as ET


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--what", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--device", default="NVIDIA H200")
    ap.add_argument("--versions", default="{}", help="JSON object of library versions")
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
    doc = {
        "what": args.what,
        "command": args.command,
        "date": datetime.date.today().isoformat(),
        "device": args.device,
        "versions": json.loads(args.versions),
        "summary": summary,
        "tests": tests,
        "superseded": superseded,
    }
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
        fh.write("\n")
    print(summary)


if __name__ == "__main__":
    main()
