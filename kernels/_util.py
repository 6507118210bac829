"""Small host-side helpers shared by the kernel wrappers (plain Python: no GPU, no Triton/CuTeDSL import)."""

from __future__ import annotations

__all__ = ["next_pow2"]


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``).

    Plain Python on purpose: ``triton.next_power_of_2`` is a JIT-aware wrapper that costs
    microseconds per call on the host, and the wrappers call this on the decode hot path.
    """
    return 1 << max(n - 1, 0).bit_length()
