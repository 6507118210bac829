"""tools/refresh_notebooks.normalize: the steps that make committed notebooks byte-stable."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # a test extra; absent on the bare GPU machine
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output  # noqa: E402

spec = importlib.util.spec_from_file_location(
    "refresh_notebooks", Path(__file__).resolve().parents[1] / "tools" / "refresh_notebooks.py"
)
refresh = importlib.util.module_from_spec(spec)
spec.loader.exec_module(refresh)


def test_normalize_is_stable_and_strips_run_dependent_parts() -> None:
    nb = new_notebook(metadata={"language_info": {"name": "python", "version": "3.11.7"}, "widgets": {"x": 1}})
    code = new_code_cell("print(1); print(2)", execution_count=1)
    code.metadata["execution"] = {"iopub.execute_input": "2026-11-29T00:00:00"}
    code.outputs = [
        new_output("stream", name="stdout", text="a\n"),
        new_output("stream", name="stdout", text="b\n"),
        new_output("stream", name="stderr", text="w\n"),
        new_output("display_data", data={refresh.WIDGET_VIEW: {"model_id": "f00"}, "text/plain": "VBox()"}),
    ]
    nb.cells = [new_markdown_cell("# t"), code]
    out = refresh.normalize(nb)
    assert [c["id"] for c in out.cells] == ["cell-000", "cell-001"]
    assert out.metadata == refresh.STABLE_METADATA
    assert "execution" not in out.cells[1].metadata
    outs = out.cells[1].outputs
    assert [(o["name"], "".join(o["text"])) for o in outs] == [("stdout", "a\nb\n"), ("stderr", "w\n")]
    assert refresh.render(refresh.normalize(out)) == refresh.render(out)  # idempotent
    nbformat.validate(out)
