#!/usr/bin/env python3
"""Execute the chapters on a GPU machine and record, cell by cell, what ran and what it printed.

    python3 tools/run_notebooks_gpu.py --out DIR notebooks/*.ipynb     # -> DIR/notebooks_gpu.json

The device image has no Jupyter kernel (no ipykernel / jupyter_client / nbclient), so each chapter runs
in its own Python process, as a kernel would run it: code cells in order, in one namespace, with the
notebook's folder as the working directory, ``%`` magics dropped (``MPLBACKEND=Agg`` stands in for
``%matplotlib inline``), and each cell's source registered with :mod:`linecache` under its own file
name, so that ``inspect.getsource`` and CuTeDSL (which needs a kernel's source) work on code defined in
a cell. A cell that raises is recorded with its error and the chapter goes on (a later cell may depend
on it; its failure is then recorded too). A cell that needs a package the image lacks (``ipywidgets``:
the slider cells) is recorded as ``skipped`` with the reason.

The JSON has, per chapter and per code cell: ``status`` (ok / error / skipped), ``seconds``, whether
the cell touches the GPU (``gpu_cell``: its source mentions ``cuda`` / ``HAS_GPU``), the ``PASS`` lines
it printed and the tail of its output; plus the device, the versions and the date. CPU CI never runs
this (the chapters' GPU cells skip there); the committed JSON is the evidence that they ran on the H200.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import linecache
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

GPU_MARKERS = re.compile(r"cuda|HAS_GPU|is_available\(\)")
OPTIONAL = {"ipywidgets": "ipywidgets is not on the device image (a UI-only slider cell)"}


def _cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def _strip_magics(src: str) -> str:
    return "\n".join("pass  # magic dropped" if ln.lstrip().startswith("%") else ln for ln in src.splitlines())


def run_one(path: Path) -> dict:
    """Run one chapter in this process (called in a child process by :func:`main`)."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    os.chdir(path.parent)
    ns: dict = {"__name__": "__main__", "display": print}
    cells = []
    for i, src in enumerate(_cells(path)):
        code = _strip_magics(src)
        fname = f"<{path.stem}-cell-{i}>"
        linecache.cache[fname] = (len(code), None, code.splitlines(True), fname)
        buf = io.StringIO()
        rec: dict = {"cell": i, "first_line": src.strip().splitlines()[0][:100] if src.strip() else "",
                     "gpu_cell": bool(GPU_MARKERS.search(src))}  # fmt: skip
        t0 = time.perf_counter()
        try:
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                exec(compile(code, fname, "exec"), ns)
            rec["status"] = "ok"
        except ModuleNotFoundError as e:
            if e.name in OPTIONAL:
                rec["status"], rec["reason"] = "skipped", OPTIONAL[e.name]
            else:
                rec["status"], rec["error"] = "error", traceback.format_exc(limit=3)[-1500:]
        except BaseException:  # noqa: BLE001 - recorded per cell
            rec["status"], rec["error"] = "error", traceback.format_exc(limit=3)[-1500:]
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        text = buf.getvalue()
        rec["pass_lines"] = [ln.strip()[:200] for ln in text.splitlines() if "PASS" in ln][:10]
        rec["output_tail"] = text[-600:]
        cells.append(rec)
    return {"notebook": path.name, "cells": cells}


def _versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("torch", "triton", "nvidia-cutlass-dsl", "flashinfer-python", "sgl-flash-mla", "matplotlib"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebooks", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per chapter")
    args = ap.parse_args()
    if args.one:  # child: one chapter, JSON on the last line of stdout
        res = run_one(Path(args.notebooks[0]).resolve())
        print("\n" + json.dumps(res))
        return 0
    import torch

    results = []
    for nb in args.notebooks:
        t0 = time.perf_counter()
        try:
            p = subprocess.run(
                [sys.executable, __file__, "--one", "--out", args.out, str(Path(nb).resolve())],
                capture_output=True, text=True, timeout=args.timeout,
            )  # fmt: skip
            res = json.loads(p.stdout.strip().splitlines()[-1])
            if p.returncode:
                res["process_error"] = p.stderr[-1500:]
        except subprocess.TimeoutExpired:
            res = {"notebook": Path(nb).name, "cells": [], "process_error": f"timed out after {args.timeout} s"}
        except (json.JSONDecodeError, IndexError):
            res = {"notebook": Path(nb).name, "cells": [], "process_error": (p.stderr or p.stdout)[-1500:]}
        res["seconds"] = round(time.perf_counter() - t0, 1)
        cells = res["cells"]
        res["summary"] = {
            s: sum(c["status"] == s for c in cells) for s in ("ok", "error", "skipped")
        } | {"gpu_cells_ok": sum(c["gpu_cell"] and c["status"] == "ok" for c in cells),
             "gpu_cells": sum(c["gpu_cell"] for c in cells)}  # fmt: skip
        print(f"{res['notebook']}: {res['summary']} in {res['seconds']} s {res.get('process_error', '')[:300]}")
        results.append(res)
    doc = {
        "what": "every chapter executed on the GPU machine, cell by cell (tools/run_notebooks_gpu.py)",
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device",
        "versions": _versions(),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "notebooks": results,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "notebooks_gpu.json").write_text(json.dumps(doc, indent=1))
    return 0 if all(r["summary"]["error"] == 0 and "process_error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
