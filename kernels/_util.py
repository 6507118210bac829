"""Small host-side helpers shared by the kernel wrappers (plain Python: no GPU, no Triton/CuTeDSL import)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["next_pow2", "per_thread"]


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``).

    Plain Python on purpose: ``triton.next_power_of_2`` is a JIT-aware wrapper that costs
    microseconds per call on the host, and the wrappers call this on the decode hot path.
    """
    return 1 << max(n - 1, 0).bit_length()


def per_thread(store: threading.local, key: Any, make: Callable[[], Any]) -> Any:
    """The object ``make()`` built for ``key`` in the calling thread, built on its first request.

    The ranks of a :class:`~dcp_ref.group.SimulatedWorld` are threads: stateful helpers (FlashInfer's
    plan, FlashMLA's schedules, planned scratch buffers a CUDA graph keeps reading) need one per rank.
    """
    cache = getattr(store, "by_key", None)
    if cache is None:
        cache = store.by_key = {}
    if key not in cache:
        cache[key] = make()
    return cache[key]
