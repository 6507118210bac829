"""One table of stages (``dcp_ref.stages.STAGE_MAP``), and every place that describes the stages agrees with it.

The README's stage table, chapter 00's, the API page (``book/api.md``) and CONTRIBUTING each name the
stages; these tests fail when one of them drifts from the table (a stage missing, a chapter or module
renamed), and when ``dcp_ref`` imports ``kernels/`` (the reference must stay importable without them).
"""

from __future__ import annotations

import ast
import importlib
import json
import re
from pathlib import Path

import pytest

from dcp_ref.stages import AWAITING_DEVICE, STAGE_MAP, STAGE_NAMES, Stages

ROOT = Path(__file__).resolve().parents[1]


def test_the_map_covers_every_stage_once() -> None:
    names = [s.stage for s in STAGE_MAP]
    assert len(names) == len(set(names))
    assert set(STAGE_NAMES) <= set(names)
    assert {"ownership", "query_gather"} <= set(names)
    assert set(STAGE_NAMES) == {f for f in Stages.__dataclass_fields__ if f in STAGE_NAMES}


@pytest.mark.parametrize("info", STAGE_MAP, ids=lambda i: i.stage)
def test_every_entry_points_at_something_real(info) -> None:
    mod, _, fn = info.reference.partition(":")
    assert callable(getattr(importlib.import_module(mod), fn)), info.reference
    for k in info.kernels:
        assert (ROOT / "kernels" / f"{k}.py").is_file(), k
    assert (ROOT / "notebooks" / f"{info.chapter}.ipynb").is_file(), info.chapter
    if info.benchmark:
        assert (ROOT / "benchmarks" / info.benchmark).is_file(), info.benchmark
    if info.results:
        measured = (ROOT / "benchmarks" / "results" / info.results).is_file()
        assert measured != (info.results in AWAITING_DEVICE), info.results  # measured, or listed as awaiting


def _markdown(nb: Path) -> str:
    """A chapter's markdown and its cells' printed outputs (a table printed from the package counts)."""
    parts = []
    for c in json.loads(nb.read_text())["cells"]:
        if c["cell_type"] == "markdown":
            parts.append("".join(c["source"]))
        for out in c.get("outputs", []):
            parts.append("".join(out.get("text", "")))
    return "\n".join(parts)


@pytest.mark.parametrize("where", ["README.md", "notebooks/00_overview.ipynb"])
def test_readme_and_chapter_00_name_every_stage_and_its_chapter(where) -> None:
    text = _markdown(ROOT / where) if where.endswith(".ipynb") else (ROOT / where).read_text()
    for info in STAGE_MAP:
        assert re.search(rf"\b{info.stage}\b", text), (where, info.stage)
        assert info.chapter in text, (where, info.chapter)


def test_the_api_page_documents_every_stage_module() -> None:
    api = (ROOT / "book" / "api.md").read_text()
    for info in STAGE_MAP:
        assert info.reference.partition(":")[0] in api, info.reference
        for k in info.kernels:
            assert f"dcp_ref.kernels.{k}" in api, k


def test_contributing_names_every_stage_protocol() -> None:
    text = (ROOT / "CONTRIBUTING.md").read_text()
    import dcp_ref.stages as st

    protocols = [n for n in dir(st) if n.endswith("Stage") and n[0].isupper() and n != "Stage"]
    assert len(protocols) == len(STAGE_NAMES)
    for p in protocols:
        assert p in text, p


def test_dcp_ref_never_imports_the_kernels() -> None:
    """Statically: no module of dcp_ref imports dcp_ref.kernels (or .kernels) at any depth of its code."""
    offenders = []
    for path in sorted((ROOT / "dcp_ref").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")]
            else:
                continue
            if any(n.startswith(("dcp_ref.kernels", ".kernels", "kernels")) for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


def _protocol(stage: str) -> type:
    import dcp_ref.stages as stages_mod

    ann = Stages.__dataclass_fields__[stage].type
    return getattr(stages_mod, ann) if isinstance(ann, str) else ann


@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_every_stage_has_a_reference_a_protocol_and_a_kit_check(stage) -> None:
    """Each stage of the step: a reference implementation (the default :class:`Stages` value's), a Protocol whose
    signature declares every keyword the planned step passes it (so a conforming implementation is never
    refused at plan time nor fails at run time), and a conformance check in the kit (``check_<stage>``)."""
    import inspect

    import dcp_ref.testing as kit
    from dcp_ref.protocols import GUARD_SCORED_KEYWORDS, RANK_LOCAL_INDEXER_KEYWORDS, STAGE_KEYWORDS
    from dcp_ref.stages import REFERENCE_STAGES

    assert callable(getattr(REFERENCE_STAGES, stage)), stage
    proto = _protocol(stage)
    params = inspect.signature(proto.__call__).parameters
    always = set(STAGE_KEYWORDS[stage]) | (set(GUARD_SCORED_KEYWORDS) if stage == "guard" else set())
    if stage == "indexer":  # passed only with order="rank_local", and declared in the protocol's signature too
        always |= set(RANK_LOCAL_INDEXER_KEYWORDS)
    assert always <= set(params), (stage, sorted(always - set(params)))
    check = f"check_{stage}"
    assert check in kit.__all__ and callable(getattr(kit, check)), check
    # the reference itself takes every keyword the step passes
    ref_params = inspect.signature(getattr(REFERENCE_STAGES, stage)).parameters
    assert always <= set(ref_params), (stage, sorted(always - set(ref_params)))
