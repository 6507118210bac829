"""The nbval sanitizer hides what varies between runs, and nothing a chapter checks.

``tools/nbval_sanitize.cfg`` rewrites text in the committed and the fresh output alike before
nbval compares them, so a rule that matches a checked value makes that check unable to fail.
(Its former rule for "0x + six or more hex digits" did exactly that to chapter 03's table of
score bits and unsigned keys.) Proved here by running nbval, as ``./dev.sh test`` does, in a
subprocess on temporary notebooks:

* a copy of chapter 03 (up to its key table) passes, and the same copy with one digit of one
  committed key changed fails in that cell;
* a notebook whose committed output holds other object addresses than the fresh run passes with
  the sanitizer and fails without it (so the addresses really differ and the rule is needed).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("nbval")
nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
CFG = ROOT / "tools" / "nbval_sanitize.cfg"
CHAPTER = ROOT / "notebooks" / "03_stable_topk_cutedsl.ipynb"
KEY = re.compile(r"\b0x[0-9a-f]{16}\b")  # an unsigned 64-bit key as the chapter prints it


def _outputs_text(cell: dict) -> str:
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))


def _run_nbval(tmp: Path, notebooks: list[Path], sanitize: bool) -> dict[str, dict[str, bool]]:
    """Run nbval on ``notebooks``; return ``{notebook name: {test id: passed}}``."""
    xml = tmp / f"nbval-{len(list(tmp.glob('nbval-*.xml')))}.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp)]
    cmd += ["--nbval", "--nbval-current-env", "--junitxml", str(xml)]
    if sanitize:
        cmd += ["--nbval-sanitize-with", str(CFG)]
    env = {**os.environ, "PYTHONHASHSEED": "0", "MPLBACKEND": "Agg"}
    proc = subprocess.run(
        cmd + [str(p) for p in notebooks], cwd=tmp, env=env, capture_output=True, text=True, timeout=600
    )
    assert xml.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    results: dict[str, dict[str, bool]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        nb = Path(case.get("file") or case.get("classname", "")).name
        passed = case.find("failure") is None and case.find("error") is None
        results.setdefault(nb, {})[case.get("name", "")] = passed
    assert results, proc.stdout[-3000:]
    return results


def _key_table_copies(tmp: Path) -> str:
    """pristine.ipynb / mutated.ipynb: chapter 03 up to its key table; returns the table's nbval id."""
    nb = json.loads(CHAPTER.read_text())
    table = next(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code" and KEY.search(_outputs_text(c)))
    nb["cells"] = nb["cells"][: table + 1]  # setup, keys, table: the cells the table depends on
    (tmp / "pristine.ipynb").write_text(json.dumps(nb))
    # One hex digit of one committed key, changed (the last digit of the first key: its id bits).
    for out in nb["cells"][table]["outputs"]:
        text = "".join(out.get("text", ""))
        m = KEY.search(text)
        if m:
            changed = f"{(int(text[m.end() - 1], 16) + 1) % 16:x}"
            out["text"] = text[: m.end() - 1] + changed + text[m.end() :]
            break
    (tmp / "mutated.ipynb").write_text(json.dumps(nb))
    return f"Cell {sum(c['cell_type'] == 'code' for c in nb['cells'][:table])}"  # nbval counts code cells


def _address_notebook(tmp: Path) -> None:
    """addresses.ipynb: committed object reprs with addresses no real run produces."""
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    cell = new_code_cell("def f():\n    pass\n\nprint(f)\nprint(x for x in ())", execution_count=1)
    committed = "<function f at 0x7f0000000010>\n<generator object <genexpr> at 0x7f0000000020>\n"
    cell.outputs = [new_output("stream", name="stdout", text=committed)]
    spec = {"display_name": "Python 3", "name": "python3", "language": "python"}
    nbformat.write(new_notebook(cells=[cell], metadata={"kernelspec": spec}), tmp / "addresses.ipynb")


@pytest.fixture(scope="module")
def sanitized_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict[str, dict[str, bool]]]:
    """One nbval run (with the sanitizer) over all three notebooks: kernel start-ups are slow."""
    tmp = tmp_path_factory.mktemp("nbval")
    table_id = _key_table_copies(tmp)
    _address_notebook(tmp)
    names = ["pristine.ipynb", "mutated.ipynb", "addresses.ipynb"]
    return tmp, table_id, _run_nbval(tmp, [tmp / n for n in names], sanitize=True)


def test_changing_one_digit_of_a_committed_key_fails(sanitized_run: tuple) -> None:
    _, table_id, res = sanitized_run
    assert res["pristine.ipynb"] and all(res["pristine.ipynb"].values()), res
    failed = [name for name, ok in res["mutated.ipynb"].items() if not ok]
    assert failed == [table_id], res["mutated.ipynb"]


def test_an_address_difference_is_sanitized(sanitized_run: tuple) -> None:
    tmp, _, res = sanitized_run
    assert res["addresses.ipynb"] and all(res["addresses.ipynb"].values()), res
    without = _run_nbval(tmp, [tmp / "addresses.ipynb"], sanitize=False)["addresses.ipynb"]
    assert not all(without.values()), "the fresh addresses equal the committed ones: the test proves nothing"
