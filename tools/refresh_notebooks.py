#!/usr/bin/env python3
"""Re-execute notebooks byte-stably, so that committed outputs are what nbval compares against.

    python tools/refresh_notebooks.py                    # every notebooks/*.ipynb
    python tools/refresh_notebooks.py notebooks/01_ownership.ipynb
    python tools/refresh_notebooks.py --check            # re-run in memory, fail if a file would change

Recipe (each step fixes a source of run-to-run noise that was seen in practice):

* execute with nbclient in the *current* environment's ``python3`` kernel, working directory
  ``notebooks/``, ``record_timing=False`` (no per-cell timestamps in metadata);
* keep widget state on while executing (``store_widget_state=False`` crashed nbclient), then strip
  ``metadata.widgets`` and every widget-view output entry (model ids are random; nbval's client
  never produces them anyway);
* merge consecutive chunks of one output stream (their split depends on flush timing);
* rewrite cell ids to a stable sequence (``cell-000``, ...) and clear per-cell execution metadata;
* pin the notebook metadata (kernelspec, language name) so interpreter versions don't leak in;
* environment: ``PYTHONHASHSEED=0``, ``MPLBACKEND=Agg``; the notebooks themselves seed every RNG
  and set ``TRITON_INTERPRET`` / ``CUTE_DSL_ARCH`` before importing kernels.

Two refreshes give identical files; ``pytest --nbval --nbval-current-env --nbval-sanitize-with
tools/nbval_sanitize.cfg notebooks/`` then passes (that is what the README's test command runs).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
STABLE_METADATA = {
    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


def _strip_outputs(cell: nbformat.NotebookNode) -> None:
    kept: list = []
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        if WIDGET_VIEW in data:
            continue  # widget views: random model ids, and nbval's client cannot reproduce them
        if (
            out.get("output_type") == "stream"
            and kept
            and kept[-1].get("output_type") == "stream"
            and kept[-1].get("name") == out.get("name")
        ):
            # How a cell's prints are split into stream messages depends on flush timing:
            # merge consecutive chunks of one stream (nbval compares them merged as well).
            prev = kept[-1]
            prev["text"] = "".join(prev["text"]) + "".join(out["text"])
            continue
        kept.append(out)
    cell["outputs"] = kept


def normalize(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Make an executed notebook byte-stable (see module docstring)."""
    nb = copy.deepcopy(nb)
    nb.metadata = nbformat.from_dict(copy.deepcopy(STABLE_METADATA))
    nb.nbformat, nb.nbformat_minor = 4, 5
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i:03d}"
        md = cell.get("metadata", {})
        for key in ("execution", "collapsed", "scrolled", "ExecuteTime"):
            md.pop(key, None)
        cell["metadata"] = md
        if cell.cell_type == "code":
            _strip_outputs(cell)
    return nb


def execute(path: Path, timeout: int = 600) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:  # start from a clean slate: no stale outputs or counts
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    env_backup = dict(os.environ)
    os.environ.update({"PYTHONHASHSEED": "0", "MPLBACKEND": "Agg"})
    try:
        client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
            record_timing=False,
            store_widget_state=True,
            allow_errors=False,
        )
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(env_backup)
    return normalize(nb)


def render(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb, version=4) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", type=Path, help="notebooks (default: notebooks/*.ipynb)")
    ap.add_argument("--check", action="store_true", help="do not write; exit 1 if any file would change")
    ap.add_argument("--timeout", type=int, default=600, help="per-cell timeout in seconds")
    args = ap.parse_args(argv)
    paths = args.paths or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    changed = []
    for path in paths:
        text = render(execute(path.resolve(), args.timeout))
        old = path.read_text() if path.exists() else ""
        if text != old:
            changed.append(path)
            if not args.check:
                path.write_text(text)
        print(f"{'changed' if text != old else 'same   '} {path}")
    if args.check and changed:
        print(f"{len(changed)} notebook(s) are not byte-stable / not refreshed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
