"""tools/gpu_check.sh, the device check: its two calls cover every gpu-marked test file once, and its merge
step turns what the device brought back (JUnit XML, compute-sanitizer reports) into one gpu_tests.json."""

from __future__ import annotations

import json
import re
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def _gpu_marked_files() -> set[str]:
    """Test files with a ``gpu`` mark, found independently of the script's grep (by Python's own reading)."""
    found = set()
    for f in sorted((ROOT / "tests").glob("test_*.py")):
        if re.search(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*mark\.gpu)", f.read_text(), flags=re.M):
            found.add(f"tests/{f.name}")
    return found


def _lists() -> dict[str, set[str]]:
    out = subprocess.run(["bash", str(SCRIPT), "lists"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    return {line.split(":")[0]: set(line.split(":", 1)[1].split()) for line in out.splitlines()}


def test_every_gpu_marked_file_is_in_exactly_one_call() -> None:
    lists = _lists()
    assert set(lists) == {"cute", "fi"}
    assert not lists["cute"] & lists["fi"]
    assert lists["cute"] | lists["fi"] == _gpu_marked_files()


def test_the_lists_check_refuses_a_file_left_out(tmp_path) -> None:
    """A new gpu-marked test file that neither call runs makes the check (and so every device call) fail; a
    copy of the tree's listed files alone passes it."""
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "gpu_check.sh").write_text(SCRIPT.read_text())
    (tmp_path / "tests").mkdir()
    for f in _gpu_marked_files():
        (tmp_path / f).write_text((ROOT / f).read_text())
    cmd = ["bash", str(tmp_path / "tools" / "gpu_check.sh"), "lists"]
    assert subprocess.run(cmd, capture_output=True, text=True).returncode == 0
    (tmp_path / "tests" / "test_planted.py").write_text(
        "import pytest\n\n\n@pytest.mark.gpu\ndef test_x():\n    pass\n"
    )
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode != 0 and "tests/test_planted.py" in r.stderr


_JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.test_a" name="test_ok" time="0.5"/>
<testcase classname="tests.test_a" name="test_bad" time="0.1"><failure message="x">boom</failure></testcase>
<testcase classname="tests.test_a" name="test_two_gpus" time="0"><skipped message="needs two GPUs"/></testcase>
</testsuite></testsuites>"""
_MEMCHECK = """========= COMPUTE-SANITIZER
pack:
  pack: case 1: ok
flashmla: skipped (flash_mla is not installed)
7 checked launches, 0 mismatching, status 0
========= ERROR SUMMARY: 0 errors
"""
_RACECHECK = """========= COMPUTE-SANITIZER
========= Error: Race reported between Write access at void legacy::sm90::decode::sparse_kernel<KT<576>>(P)+0x4ce0
=========     and Read access at void legacy::sm90::decode::sparse_kernel<KT<576>>(P)+0xa1b0 [768 hazards]
========= Warning: Race reported between Write access at rowscan_kernel+0x230
=========     and Read access at rowscan_kernel+0x7b0 [8 hazards]
7 checked launches, 1 mismatching, status 1
========= RACECHECK SUMMARY: 2 hazards displayed (1 errors, 1 warnings)
"""


def test_merge_writes_counts_per_file_and_the_sanitizer_summary(tmp_path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "junit_test_a.xml").write_text(_JUNIT)
    (work / "memcheck_cute.txt").write_text(_MEMCHECK)
    (work / "racecheck_cute.txt").write_text(_RACECHECK)
    (work / "commit.txt").write_text("abc123\n")
    (work / "versions.json").write_text('{"torch": "2.11.0"}\n')
    tgz = tmp_path / "cute.tgz"
    with tarfile.open(tgz, "w:gz") as t:
        for f in work.iterdir():
            t.add(f, arcname=f"./{f.name}")
    out = tmp_path / "gpu_tests.json"
    r = subprocess.run(
        ["bash", str(SCRIPT), "merge", str(tgz)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "GPU_TESTS_JSON": str(out)},
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["commit"] == "abc123" and doc["versions"] == {"torch": "2.11.0"}
    assert doc["summary"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert doc["per_file"] == {"junit_test_a.xml": {"passed": 1, "failed": 1, "skipped": 1}}
    by_tool = {s["tool"]: s for s in doc["sanitizer"]}
    assert by_tool["memcheck"]["errors"] == 0 and by_tool["memcheck"]["script_status"] == 0
    assert by_tool["memcheck"]["skipped"] == {"flashmla": "flash_mla is not installed"}
    assert by_tool["racecheck"]["errors"] == 2 and by_tool["racecheck"]["mismatches"] == 1
    # each finding is attributed to its kernel: another project's (FlashMLA's) apart from this project's
    assert by_tool["racecheck"]["kernels_with_findings"] == {
        "legacy::sm90::decode::sparse_kernel": {"findings": 1, "third_party": True},
        "rowscan_kernel": {"findings": 1, "third_party": False},
    }
    assert by_tool["racecheck"]["findings_in_this_projects_kernels"] == 1
    assert by_tool["memcheck"]["findings_in_this_projects_kernels"] == 0


def test_slim_moves_what_no_device_call_reads_and_unslim_puts_it_back(tmp_path: Path) -> None:
    """`slim` / `unslim` (the 64 MiB carry): the chapters and the CPU-only probe go under .gpu/offcarry and come back
    byte for byte; a second `slim` before `unslim` refuses rather than overwrite the moved copy."""
    (tmp_path / "tools").mkdir()
    script = tmp_path / "tools" / "gpu_check.sh"
    script.write_text((ROOT / "tools" / "gpu_check.sh").read_text())
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "00_a.ipynb").write_text("{}\n")
    (tmp_path / "tools" / "probe_contracts.py").write_text("# probe\n")
    (tmp_path / "kept.py").write_text("x = 1\n")

    def run(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(script), mode], capture_output=True, text=True, cwd=tmp_path)

    assert run("slim").returncode == 0
    assert not (tmp_path / "notebooks").exists() and not (tmp_path / "tools" / "probe_contracts.py").exists()
    assert (tmp_path / ".gpu" / "offcarry" / "notebooks" / "00_a.ipynb").read_text() == "{}\n"
    assert (tmp_path / "kept.py").exists() and script.exists()
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "new.ipynb").write_text("{}\n")
    assert run("unslim").returncode == 1  # both copies exist: nothing is overwritten
    (tmp_path / "notebooks" / "new.ipynb").unlink()
    (tmp_path / "notebooks").rmdir()
    assert run("unslim").returncode == 0
    assert (tmp_path / "notebooks" / "00_a.ipynb").read_text() == "{}\n"
    assert (tmp_path / "tools" / "probe_contracts.py").read_text() == "# probe\n"
