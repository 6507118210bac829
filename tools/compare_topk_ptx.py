#!/usr/bin/env python3
"""Compare the sm_90a PTX of the CuTeDSL top-K at a git revision with the working tree's (CPU only).

    python tools/compare_topk_ptx.py --before 3130e5c --out benchmarks/results/topk_refactor_ptx.json

``@cute.jit`` helpers are inlined while the kernel is traced, so a refactor that only moves code
into helpers (same operations, same order) must emit the same PTX. Identical PTX, up to the
kernel's name and comments, means identical behaviour and identical speed: nothing is left to
benchmark. This script compiles :data:`CONFIGS` (both variants, sorted and unsorted, every
first-digit width, the three offset forms of the candidate load, 64-bit offsets, ``N`` up to
32768) from ``kernels/topk_cutedsl.py`` at ``--before`` and from the working tree, normalises
both (:func:`normalize_ptx`) and records one SHA-256 per configuration and side. Exit status 1
when any configuration differs (``--show-diff`` prints the first differing lines).

``tests/test_topk_ptx_record.py`` recompiles the recorded configurations and checks that the
current kernel still emits the recorded ``after`` PTX, so the record cannot go stale silently.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import hashlib
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "kernels/topk_cutedsl.py"

#: (world, kloc, k, sorted, variant, small, first_bits)
CONFIGS: tuple[tuple[int, int, int, bool, str, bool, int], ...] = (
    (3, 7, 5, False, "regs", True, 8),  # tail masked, neither T % K nor K % T
    (3, 7, 5, False, "lean", True, 8),
    (2, 5, 4, True, "regs", True, 8),  # sorted, k < N
    (2, 5, 4, True, "lean", True, 8),
    (1, 300, 17, True, "regs", True, 8),
    (4, 64, 100, False, "regs", True, 8),  # T % K == 0
    (4, 64, 100, False, "lean", True, 8),
    (8, 2048, 2048, False, "regs", True, 8),  # K % T == 0, the headline shape
    (8, 2048, 2048, False, "lean", True, 8),
    (8, 2048, 2048, False, "lean", True, 11),
    (8, 2048, 2048, False, "lean", True, 12),
    (8, 2048, 2048, True, "regs", True, 12),
    (4, 2048, 2048, True, "regs", True, 8),
    (4, 2048, 2048, False, "regs", False, 8),  # 64-bit offsets
    (4, 1000, 300, False, "lean", False, 8),
    (16, 2048, 2048, False, "regs", True, 8),  # N = 32768: 32 keys per thread
)


def normalize_ptx(ptx: str) -> str:
    """PTX without comments, blank lines or the kernel's (module-path-derived) name."""
    names = set(re.findall(r"\.entry\s+([A-Za-z_$][\w$]*)", ptx))
    lines = []
    for line in ptx.splitlines():
        line = line.split("//", 1)[0].rstrip()
        if line.strip():
            lines.append(line)
    text = "\n".join(lines) + "\n"
    for i, name in enumerate(sorted(names, key=len, reverse=True)):
        text = text.replace(name, f"KERNEL{i}")
    return text


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses / typing look the module up by name
    spec.loader.exec_module(mod)
    return mod


def compile_ptx(mod: Any, cfg: tuple[int, int, int, bool, str, bool, int]) -> str:
    world, kloc, k, sorted_, variant, small, first_bits = cfg
    with tempfile.TemporaryDirectory() as d:
        ptx = mod.compile_to_ptx(world, kloc, k, sorted_, d, small=small, variant=variant, first_bits=first_bits)
    if not isinstance(ptx, str) or ".entry" not in ptx:
        raise RuntimeError(f"no PTX for {cfg}")
    return normalize_ptx(ptx)


def git_rev(rev: str) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="git revision of the reference kernels/topk_cutedsl.py")
    ap.add_argument("--out", type=Path, help="write the comparison as JSON here")
    ap.add_argument("--show-diff", action="store_true", help="print the first differing lines")
    args = ap.parse_args(argv)
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

    old_src = subprocess.run(
        ["git", "show", f"{args.before}:{KERNEL}"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    sys.path.insert(0, str(ROOT))
    from dcp_ref.kernels import topk_cutedsl as new

    head_dirty = bool(
        subprocess.run(["git", "status", "--porcelain", "--", KERNEL], cwd=ROOT, capture_output=True, text=True).stdout
    )
    rows = []
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "topk_cutedsl_before.py"  # a real file: CuTeDSL reads the source with inspect
        path.write_text(old_src)
        old = load_module(path, "topk_cutedsl_before")
        for cfg in CONFIGS:
            a, b = compile_ptx(old, cfg), compile_ptx(new, cfg)
            world, kloc, k, sorted_, variant, small, first_bits = cfg
            rows.append(
                {
                    "world": world,
                    "kloc": kloc,
                    "k": k,
                    "sorted": sorted_,
                    "variant": variant,
                    "small": small,
                    "first_bits": first_bits,
                    "ptx_lines": b.count("\n"),
                    "sha256_before": digest(a),
                    "sha256_after": digest(b),
                    "identical": a == b,
                }
            )
            print(f"{'same' if a == b else 'DIFF'}  {cfg}  {b.count(chr(10))} lines")
            if a != b and args.show_diff:
                diff = difflib.unified_diff(a.splitlines(), b.splitlines(), "before", "after", lineterm="", n=1)
                print("\n".join(list(diff)[:60]))
    identical = all(r["identical"] for r in rows)
    record = {
        "what": "normalised sm_90a PTX of the CuTeDSL top-K before and after a refactor (tools/compare_topk_ptx.py)",
        "normalization": "comments, blank lines and trailing spaces removed; the .entry name replaced by KERNEL0",
        "before": git_rev(args.before),
        "after": git_rev("HEAD") + ("+working-tree" if head_dirty else ""),
        "identical": identical,
        "configs": rows,
        "versions": {
            "python": platform.python_version(),
            "nvidia-cutlass-dsl": metadata.version("nvidia-cutlass-dsl"),
        },
        "arch": os.environ["CUTE_DSL_ARCH"],
        "date": datetime.date.today().isoformat(),
    }
    if args.out:
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{sum(r['identical'] for r in rows)}/{len(rows)} configurations identical")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
