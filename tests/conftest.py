"""Test-session setup: kernel-environment switches, the ``gpu`` marker, shared fixtures.

Environment switches must be set *before* any kernel module is imported:

* ``TRITON_INTERPRET=1`` — Triton kernels run on the CPU through the interpreter. Set unless the
  caller already chose (``TRITON_INTERPRET=0`` forces real Triton) or a CUDA GPU is present
  (a GPU run, ``pytest -m gpu``, uses the real compiler).
* ``CUTE_DSL_ARCH=sm_90a`` — CuTeDSL compiles for Hopper even without a GPU (unset it would
  silently target sm_100; the empty string crashes).
"""

from __future__ import annotations

import os

import pytest

try:  # torch is a hard dependency, but keep the message clear if the venv is broken
    import torch
except ImportError as e:  # pragma: no cover
    raise SystemExit(f"dcp-ref tests need torch: {e}") from e

HAS_CUDA = torch.cuda.is_available()

if "TRITON_INTERPRET" not in os.environ and not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
if not os.environ.get("CUTE_DSL_ARCH"):
    os.environ["CUTE_DSL_ARCH"] = "sm_90a"

TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")
    config.addinivalue_line(
        "markers", "browser: drives JupyterLab in headless Chromium (Playwright); skipped without them"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def kernel_device() -> torch.device:
    """Where Triton kernels run in non-``gpu`` tests: CPU under the interpreter, else CUDA."""
    return torch.device("cpu" if TRITON_INTERPRET or not HAS_CUDA else "cuda")


@pytest.fixture(scope="session")
def cuda_device() -> torch.device:
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")
