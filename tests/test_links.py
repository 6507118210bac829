"""Relative links in the docs and the notebooks' markdown point at files that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _docs() -> list[tuple[Path, str]]:
    docs = [
        (p, p.read_text())
        for p in [
            ROOT / "README.md",
            ROOT / "CONTRIBUTING.md",
            ROOT / "benchmarks" / "README.md",
            ROOT / "benchmarks" / "results" / "topk.md",
            *sorted((ROOT / "book").glob("*.md")),
        ]
    ]
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        docs.append((nb, "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")))
    return docs


@pytest.mark.parametrize("path,text", _docs(), ids=lambda x: x.name if isinstance(x, Path) else "")
def test_relative_links_resolve(path: Path, text: str) -> None:
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue  # web links and in-page anchors
        file = target.split("#", 1)[0]
        if not (path.parent / file).exists():
            broken.append(target)
    assert not broken, f"{path.relative_to(ROOT)}: {broken}"


def test_the_link_pattern_finds_the_chapter_links() -> None:
    """Guard against a pattern that silently matches nothing: the README links every chapter."""
    readme = (ROOT / "README.md").read_text()
    chapters = {p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    assert chapters <= {Path(t).name for t in LINK.findall(readme)}
