"""Small host-side helpers shared by the kernel wrappers (plain Python and torch: no Triton/CuTeDSL import)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "cdiv",
    "next_pow2",
    "sm_count",
    "check_flag",
    "raw_stream",
    "raise_if_flagged",
    "nearest_shapes",
    "compiled_artifacts",
]


def nearest_shapes(
    keys: Iterable[tuple[int, int]], rows: int, cols: int, *, col_weight: float = 1.0
) -> list[tuple[int, int]]:
    """Measured ``(rows, cols)`` shapes, nearest to ``(rows, cols)`` first: distance in ``log2`` of both, the
    columns' weighted by ``col_weight``; ties by the shape itself (the plan tables' nearest-shape lookup)."""
    lr, lc = math.log2(max(rows, 1)), math.log2(max(cols, 1))

    def dist(key: tuple[int, int]) -> tuple[float, tuple[int, int]]:
        return (math.log2(key[0]) - lr) ** 2 + (col_weight * (math.log2(key[1]) - lc)) ** 2, key

    return sorted(keys, key=dist)


def compiled_artifacts(fn: Any) -> tuple[str, bytes]:
    """``(PTX text, cubin bytes)`` of a CuTeDSL function compiled with ``--keep-ptx --keep-cubin`` (some versions
    return the files' paths instead of their contents)."""
    import os

    ptx = fn.__ptx__ or ""
    if ptx and not ptx.lstrip().startswith("//") and os.path.exists(ptx):
        with open(ptx) as fh:
            ptx = fh.read()
    cubin = fn.__cubin__ or b""
    if isinstance(cubin, str):
        with open(cubin, "rb") as fb:
            cubin = fb.read()
    return ptx, cubin


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, ``b >= 1``.

    Plain Python on purpose, as :func:`next_pow2`: ``triton.cdiv`` is a JIT-aware wrapper that costs
    microseconds per call on the host. (Inside ``@triton.jit`` code use ``tl.cdiv``.)
    """
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``).

    Plain Python on purpose: ``triton.next_power_of_2`` is a JIT-aware wrapper that costs
    microseconds per call on the host, and the wrappers call this on the decode hot path.
    """
    return 1 << max(n - 1, 0).bit_length()


@functools.lru_cache(maxsize=64)
def _sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device (cached per device); 1 for any other device."""
    import torch

    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def raw_stream(dev: torch.device) -> int:
    """The current CUDA stream of ``dev`` as its raw handle (``cudaStream_t``; 0 off CUDA). One C call, as
    Triton's launcher asks it: ``torch.cuda.current_stream(dev).cuda_stream`` builds a ``Stream`` object and
    costs several µs of host time per call on the H200's host, which every validated call paid."""
    return _stream_key(dev)[1]


def _stream_key(dev: torch.device) -> tuple[object, int]:
    """``(device, raw stream)`` of ``dev``'s current stream: the device as its CUDA index (the current one when
    ``dev`` names none: the legacy default stream is handle 0 on every device), or ``dev`` itself off CUDA."""
    if dev.type != "cuda":
        return dev, 0
    import torch  # already imported: a dict lookup (this file imports no torch at load)

    index = dev.index if dev.index is not None else torch._C._cuda_getDevice()
    return index, int(torch._C._cuda_getCurrentRawStream(index))


def check_flag(dev: torch.device) -> torch.Tensor:
    """A fresh zeroed int64 flag for one validated call's in-kernel checks on ``dev``: a good call leaves it at 0.

    Shared by the wrappers that check inside their kernel (the pack, the indexer, the deinterleave, the scoring,
    the attentions, select-to-slots' check): each reads it once with :func:`raise_if_flagged`. Made per call (one
    small allocation, on a call that reads the host anyway), never cached in the module: a validated call is not
    the capturable hot path, and a flag per call cannot be seen by another thread's or stream's call.
    """
    import torch

    return torch.zeros(1, dtype=torch.int64, device=dev)


def raise_if_flagged(
    chk: torch.Tensor | None, reference_check: Callable[[], object], what: str, *, false_alarms: bool = False
) -> None:
    """The one host read of a validated call whose kernel raised :func:`check_flag` for a row the reference
    refuses. A raised flag is cleared first (a caller may reuse its flag), then ``reference_check()`` raises
    the reference's exact message. If it returns, the kernel flagged a row the reference accepts: a kernel bug
    (``AssertionError`` naming ``what``), unless the kernel's check may over-approximate (``false_alarms``)."""
    if chk is None or not int(chk.item()):
        return
    chk.zero_()
    reference_check()
    if not false_alarms:
        raise AssertionError(f"{what} flagged a row that the reference accepts (a kernel bug)")
