"""The tutorial in a real browser: JupyterLab + ipywidgets driven by Playwright (headless Chromium).

nbval checks the notebooks' committed outputs, and ``tests/test_ownership_viz.py`` checks the
widget's wiring through ipywidgets' synchronous updates; neither shows that the widget renders and
responds in JupyterLab. This test opens ``01_ownership.ipynb`` in JupyterLab, runs every cell,
reads the ownership grid the widget renders (``<pre id="ownership-grid">``), moves the
"seq len" slider with the keyboard and checks the redrawn grid. It asserts on text, not pixels.

Needs the ``playwright`` package (test extra) and a Chromium binary: ``DCP_CHROMIUM``, or
``chromium`` / ``chromium-browser`` / ``google-chrome`` on ``PATH`` (``apt-get install chromium``;
``.ci/run`` installs it when it can). Skipped, with the reason, when either is missing.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dcp_ref.viz.ownership import ownership_grid

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "01_ownership.ipynb"
pytestmark = pytest.mark.browser


def _chromium() -> str | None:
    env = os.environ.get("DCP_CHROMIUM")
    if env:
        return env
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def jupyter_lab(tmp_path: Path):
    """A JupyterLab server on a free port serving a copy of the notebook (token auth).

    Yields ``(base_url, token, notebook_dir, chromium_path, playwright_sync_api)``; skips first
    (before starting anything) when JupyterLab, Playwright or Chromium is missing.
    """
    pytest.importorskip("jupyterlab")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e .[test])")
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no Chromium binary (apt-get install chromium, or set DCP_CHROMIUM)")
    # JupyterLab saves notebooks it runs: serve a copy, never the committed files.
    nb_dir = tmp_path / "notebooks"
    nb_dir.mkdir()
    shutil.copy(ROOT / "notebooks" / NOTEBOOK, nb_dir / NOTEBOOK)
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(
        os.environ,
        JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"),
        JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"),
        TRITON_INTERPRET="1",
        CUTE_DSL_ARCH="sm_90a",
    )
    cmd = [
        sys.executable,
        "-m",
        "jupyter",
        "lab",
        "--no-browser",
        f"--port={port}",
        "--ServerApp.ip=127.0.0.1",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={nb_dir}",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    log.flush()
                    raise RuntimeError(
                        "JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:]
                    ) from None
                time.sleep(0.3)
        yield base, token, nb_dir, chromium, sync_api
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_ownership_widget_renders_and_responds_in_jupyterlab(jupyter_lab) -> None:
    base, token, _nb_dir, chromium, sync_api = jupyter_lab
    committed = (ROOT / "notebooks" / NOTEBOOK).read_bytes()
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(120_000)
            page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}")
            page.wait_for_selector(".jp-NotebookPanel .jp-Cell")
            # Wait until the notebook's kernel is connected and idle (status bar), then
            # Run > Run All Cells from the menu bar.
            page.get_by_text("Python 3 (ipykernel) | Idle").wait_for()
            page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
            page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
            grid = page.locator("pre#ownership-grid")
            grid.wait_for(state="attached")
            grid.scroll_into_view_if_needed()
            # textContent, not innerText: JupyterLab may skip laying out cells outside the view.
            first = grid.text_content()
            assert first.rstrip() == ownership_grid(24, 2, rank=1, interleave=2).rstrip()
            # Move the "seq len" slider one step with the keyboard (24 -> 25) and read the redraw.
            slider = page.locator(".widget-slider", has=page.locator("label", has_text="seq len"))
            handle = slider.locator(".noUi-handle")
            handle.focus()
            handle.press("ArrowRight")
            want = ownership_grid(25, 2, rank=1, interleave=2).rstrip()
            page.wait_for_function(
                "w => { const e = document.querySelector('pre#ownership-grid');"
                " return e && e.textContent.trimEnd() === w; }",
                arg=want,
            )
            assert grid.text_content().rstrip() == want
        finally:
            browser.close()
    assert (ROOT / "notebooks" / NOTEBOOK).read_bytes() == committed  # only the copy was run and saved
