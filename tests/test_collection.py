"""Collection launches no kernel: ``TRITON_INTERPRET=0 python -m pytest --collect-only -q tests`` (what ``.ci/run``
runs once, without a GPU) fails on a test module that launches a Triton kernel at import or in a
``parametrize`` list, and passes on one that launches it inside the test.

Without a GPU, real Triton has no driver, so such a launch raises while pytest imports the module; under the
interpreter (``TRITON_INTERPRET=1``, every other CPU run) it silently runs on the CPU, and on the H200 — which
collects with the real compiler — it breaks the whole ``-m gpu`` run of that file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

#: The command ``.ci/run`` runs on ``tests/`` (with ``TRITON_INTERPRET=0``), here on a folder of planted modules.
COLLECT = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]

_KERNEL = """
import pytest
import torch
import triton
import triton.language as tl


@triton.jit
def _fill(x_ptr, value):
    tl.store(x_ptr, value)


def _filled():
    x = torch.zeros(1)
    _fill[(1,)](x, 3.0)  # a launch
    return x
"""

PLANTED = {
    "test_launch_at_import.py": _KERNEL + "\n\nX = _filled()\n\n\ndef test_x():\n    assert X.item() == 3.0\n",
    "test_launch_in_parametrize.py": _KERNEL
    + '\n\n@pytest.mark.parametrize("v", _filled().tolist())\ndef test_x(v):\n    assert v == 3.0\n',
}
CLEAN = {
    "test_launch_in_the_test.py": _KERNEL
    + '\n\n@pytest.mark.parametrize("name", ["a", "b"])\ndef test_x(name):\n    assert _filled().item() == 3.0\n',
}


def _collect(tmp_path: Path, files: dict[str, str]) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text((HERE / "conftest.py").read_text())  # the suite's environment switches
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    # Plugins (nbval, hypothesis, the kit's) play no part in what a module launches at import; not loading them
    # halves the start-up of each run.
    env = dict(os.environ, TRITON_INTERPRET="0", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    return subprocess.run(
        [*COLLECT, "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_collect_only_fails_on_a_kernel_launched_at_collection(tmp_path) -> None:
    r = _collect(tmp_path, {**PLANTED, **CLEAN})
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    for name in PLANTED:  # each planted module is named as a collection error
        assert f"ERROR {name}" in out or f"ERROR collecting {name}" in out, out
    assert "2 errors" in out.splitlines()[-1], out


def test_collect_only_passes_when_the_launch_is_inside_the_test(tmp_path) -> None:
    r = _collect(tmp_path, CLEAN)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1].startswith("2 tests collected"), r.stdout
