"""Every chapter follows the shape CONTRIBUTING.md promises, and its committed outputs are clean.

Shape: a title ``# NN · ...`` with a key insight; a cell with **You'll learn** / **Runs on** /
**Prerequisites**; numbered sections ``## 1. ...`` in order; at least one ``PASS`` printed by a
check; **Try it yourself**; **Next** (linking the following chapter, except the last). Outputs:
no error outputs, no tensor reprs of addresses, no absolute paths from this machine, and every
code cell executed (nbval needs the committed outputs to be complete).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def _text(cell: dict) -> str:
    return "".join(cell["source"])


def test_there_are_chapters() -> None:
    assert [p.name[:2] for p in CHAPTERS] == [f"{i:02d}" for i in range(len(CHAPTERS))] and len(CHAPTERS) >= 7


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_chapter_shape(path: Path) -> None:
    cells = _cells(path)
    md = [_text(c) for c in cells if c["cell_type"] == "markdown"]
    assert re.match(rf"# {path.name[:2]} · \S", md[0]), md[0][:80]
    assert "**Key insight.**" in md[0]
    header = md[1]
    for part in ("**You'll learn**", "**Runs on**", "**Prerequisites"):
        assert part in header, f"{path.name}: header lacks {part}"
    numbers = [int(m) for text in md for m in re.findall(r"^## (\d+)\. ", text, re.M)]
    assert numbers and numbers == list(range(1, len(numbers) + 1)), f"{path.name}: sections {numbers}"
    allmd = "\n".join(md)
    assert "## Try it yourself" in allmd and "## Next" in allmd, path.name
    nxt = allmd[allmd.index("## Next") :]
    if path != CHAPTERS[-1]:
        following = CHAPTERS[CHAPTERS.index(path) + 1].name
        assert following in nxt, f"{path.name}: Next does not link {following}"
    outputs = "".join(
        "".join(o.get("text", "")) for c in cells if c["cell_type"] == "code" for o in c.get("outputs", [])
    )
    assert "PASS" in outputs, f"{path.name}: no PASS check in the committed outputs"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_committed_outputs_are_clean(path: Path) -> None:
    for i, cell in enumerate(_cells(path)):
        if cell["cell_type"] != "code":
            continue
        assert cell.get("execution_count") is not None, f"{path.name} cell {i}: not executed"
        for out in cell.get("outputs", []):
            assert out["output_type"] != "error", f"{path.name} cell {i}: {out.get('ename')}: {out.get('evalue')}"
            text = "".join(out.get("text", "")) + json.dumps(out.get("data", {}).get("text/plain", ""))
            assert " at 0x" not in text, f"{path.name} cell {i}: an address in the output"
            assert str(ROOT) not in text and "/tmp/" not in text, f"{path.name} cell {i}: a local path in the output"
            assert "FAIL" not in text, f"{path.name} cell {i}: a failed check in the committed output"
