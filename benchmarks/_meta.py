"""What every benchmark records next to its numbers — the device, the library versions, the date — written once.

The benchmarks run as scripts (``python3 benchmarks/bench_x.py``), so their folder is on ``sys.path``
and they import this module as ``import _meta``.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.metadata
import platform
from typing import Any

import torch

#: The distributions a result records the version of, with the module that carries ``__version__`` when
#: the distribution's metadata is not on the path (the device image puts some packages on PYTHONPATH).
DISTRIBUTIONS = {
    "triton": "triton",
    "nvidia-cutlass-dsl": "cutlass",
    "apache-tvm-ffi": "tvm_ffi",
    "flashinfer-python": "flashinfer",
    "sgl-flash-mla": "flash_mla",
}


def package_version(dist: str, module: str, import_missing: bool = True) -> str | None:
    """The installed version of ``dist`` (from its metadata, else — with ``import_missing`` — from
    ``module.__version__``); ``None`` if absent."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        if not import_missing:
            return None
    try:
        return str(getattr(importlib.import_module(module), "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - not installed (or not importable) here: recorded as such
        return None


def versions(import_missing: bool = True) -> dict[str, Any]:
    """``python``, ``torch``, ``cuda`` and the version of each of :data:`DISTRIBUTIONS` (``None``: not installed).

    ``import_missing=False``: metadata only, no module imported (a peer's process, whose packages may clash).
    """
    out: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist, module in DISTRIBUTIONS.items():
        out[dist] = package_version(dist, module, import_missing)
    return out


def device() -> dict[str, Any]:
    """``device`` (its name), ``capability`` (``"sm_90"``) and ``sm_count`` of the current CUDA device; ``"cpu"``
    without one."""
    if not torch.cuda.is_available():
        return {"device": "cpu", "capability": "-", "sm_count": 0}
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"device": p.name, "capability": f"sm_{p.major}{p.minor}", "sm_count": p.multi_processor_count}


def now_utc() -> str:
    """The time of the run in UTC, ``"2026-12-01T12:00:00Z"``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def copy_bandwidth(device: torch.device | str = "cuda") -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write), measured in this run: the bandwidth every
    benchmark's memory floor divides by, measured one way for all of them (``_timing.eager``, L2 flushed; on
    the H200 about 4.2 TB/s, where the CUDA-graph replay of the same copy ``bench_attention.py`` used to time read
    2.76 TB/s — 2026-12-02 — and so overstated its floors by half)."""
    import _timing  # this folder

    n = 1 << 28  # 1 GiB of int32: far beyond the 60 MB L2
    src = torch.randint(0, 1 << 30, (n,), dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    us = _timing.eager(lambda: dst.copy_(src), flush_l2=True).median_us
    return 2 * n * 4 / (us * 1e-6)
