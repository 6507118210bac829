"""Argument validation shared by every stage.

Every public function of :mod:`dcp_ref` validates its inputs with these helpers so that bad
input fails loudly with a ``ValueError``/``TypeError`` that *names the argument* and says what
was expected, instead of returning a silently wrong answer or indexing out of bounds.

Checks that need a tensor's *values* (e.g. "non-negative") read them back to the host. Every
stage function that does so takes ``validate: bool = True``; with ``validate=False`` it reads no
value on the host (no ``.item()``, no ``bool(tensor)``, no data-dependent shape: no device sync)
and instead clamps on the device, so that it still never reads out of bounds. Shape, dtype and
device checks are free and always run.
"""

from __future__ import annotations

import functools
import importlib.util
import operator
from collections.abc import Iterable, Sequence

import numpy as np
import torch

INT_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_int_scalar(value: object, name: str, *, min_value: int | None = None) -> int:
    """Return ``value`` as a Python int, or raise naming ``name``.

    Accepted: Python ints, NumPy integer scalars, 0-d int32/int64 tensors (read on the host).
    ``bool`` is rejected on purpose: ``True`` as a world size is always a bug. So are floats,
    even integral ones (``2.0``), and meta tensors (they have no value).
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a Python int, got bool")
    if isinstance(value, torch.Tensor):
        if value.ndim != 0 or value.dtype not in INT_DTYPES:
            raise TypeError(
                f"{name} must be a Python int (or a 0-d integer tensor), got a tensor of shape "
                f"{tuple(value.shape)} and dtype {value.dtype}"
            )
        if value.is_meta:
            raise ValueError(f"{name} is a meta tensor: it has no value to use as an int")
        value = int(value.item())
    elif isinstance(value, np.integer):
        value = int(value)
    elif not isinstance(value, int):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}")
    if min_value is not None and value < min_value:
        raise ValueError(f"{name} must be >= {min_value}, got {value}")
    return operator.index(value)


def check_world(world_size: object, rank: object = None, interleave: object = 1) -> tuple[int, int | None, int]:
    """Validate the DCP geometry: ``world_size >= 1``, ``0 <= rank < world_size``, ``interleave >= 1``."""
    w = check_int_scalar(world_size, "world_size", min_value=1)
    i = check_int_scalar(interleave, "interleave", min_value=1)
    r = None
    if rank is not None:
        r = check_int_scalar(rank, "rank")
        if not 0 <= r < w:
            raise ValueError(f"rank must satisfy 0 <= rank < world_size={w}, got {r}")
    return w, r, i


def as_int_tensor(value: object, name: str, *, allow_scalar: bool = True) -> torch.Tensor:
    """Convert ints / lists of ints / NumPy integer arrays / integer tensors to an integer tensor.

    Integer tensors (int32/int64) pass through unchanged (device and dtype kept). Python and NumPy
    ints and (nested) lists of them become int64 CPU tensors; NumPy integer arrays keep an int32 /
    int64 dtype (other integer dtypes become int64). Anything else is a ``TypeError`` naming
    ``name``.
    """
    if isinstance(value, torch.Tensor):
        if value.dtype not in INT_DTYPES:
            raise TypeError(f"{name} must be an int32 or int64 tensor, got dtype {value.dtype}")
        return value
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int or an integer tensor, got bool")
    if isinstance(value, (int, np.integer)):
        if not allow_scalar:
            raise TypeError(f"{name} must be a tensor or a list of ints, got int")
        return torch.tensor(int(value), dtype=torch.int64)
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "iu":
            raise TypeError(f"{name} must be an integer array, got dtype {value.dtype}")
        if value.ndim == 0 and not allow_scalar:
            raise TypeError(f"{name} must be a tensor or a list of ints, got a 0-d array")
        keep = value.dtype in (np.int32, np.int64)
        return torch.from_numpy(np.ascontiguousarray(value if keep else value.astype(np.int64)))
    if isinstance(value, (list, tuple)):
        flat = list(_flatten(value))
        if not all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in flat):
            raise TypeError(f"{name} must contain only ints")
        try:
            return torch.tensor([_as_py(v) for v in value] if value else value, dtype=torch.int64)
        except (ValueError, RuntimeError, OverflowError) as e:  # ragged nesting, ints beyond int64
            raise ValueError(f"{name} must be a rectangular list of int64 values: {e}") from None
    raise TypeError(f"{name} must be an int, a list of ints or an int32/int64 tensor, got {type(value).__name__}")


def _as_py(v: object) -> object:
    if isinstance(v, (list, tuple)):
        return [_as_py(x) for x in v]
    return int(v)  # type: ignore[call-overload]


def _flatten(seq: Iterable) -> Iterable:
    for v in seq:
        if isinstance(v, (list, tuple)):
            yield from _flatten(v)
        else:
            yield v


def check_values_readable(t: torch.Tensor, name: str) -> None:
    """A value check needs real data: a meta tensor has none (``validate=False`` skips value checks)."""
    if t.is_meta:
        raise ValueError(f"{name} is a meta tensor: its values cannot be validated (pass validate=False)")


def check_non_negative(t: torch.Tensor, name: str) -> None:
    """Raise ``ValueError`` if any element of ``t`` is negative (reads values back to the host)."""
    check_values_readable(t, name)
    if t.numel() and bool((t < 0).any()):
        bad = int(t.min())
        raise ValueError(f"{name} must be non-negative, found {bad}")


def check_bool(value: object, name: str) -> bool:
    """``value`` must be a Python bool (``1``/``"yes"`` are bugs, not flags)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_out(
    buf: object, name: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device, *, contiguous: bool = False
) -> torch.Tensor:
    """A caller-provided output buffer must match exactly: it is written, never broadcast into."""
    if not isinstance(buf, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(buf).__name__}")
    if buf.dtype != dtype:
        raise TypeError(
            f"{name} must be a {str(dtype).replace('torch.', '')} buffer, "
            f"got dtype {str(buf.dtype).replace('torch.', '')}"
        )
    if tuple(buf.shape) != tuple(shape):
        raise ValueError(f"{name} must be a buffer of shape {tuple(shape)}, got {tuple(buf.shape)}")
    if buf.device != device:
        raise ValueError(f"{name} must be on device {device}, got {buf.device}")
    if contiguous and not buf.is_contiguous():
        raise ValueError(f"{name} must be contiguous (it is written as one flat buffer)")
    return buf


def max_global_id_bound(cols: int, world_size: int, interleave: int) -> int:
    """Exclusive bound on the global id of a local index ``< cols`` (from shapes alone, no sync).

    Local index ``l <= cols - 1`` maps to ``(l // I)*W*I + r*I + l % I < ((cols - 1)//I + 1)*W*I``.
    """
    if cols <= 0:
        return 0
    return ((cols - 1) // interleave + 1) * world_size * interleave


def check_tensor(
    t: object,
    name: str,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | Sequence[int] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Check that ``t`` is a tensor with an allowed dtype / rank / device; return it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None:
        allowed_nd = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.ndim not in allowed_nd:
            raise ValueError(f"{name} must be {' or '.join(f'{n}-D' for n in allowed_nd)}, got shape {tuple(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} must be on device {torch.device(device)}, got {t.device}")
    return t


def check_lse_base(base: object, name: str = "base") -> str:
    """An LSE base is ``"e"`` (natural log) or ``"2"`` (what exp2-based kernels return)."""
    if not isinstance(base, str) or base not in ("e", "2"):
        raise ValueError(f"{name} must be 'e' or '2', got {base!r}")
    return base


@functools.cache
def has_module(name: str) -> bool:
    """Whether ``name`` is importable, without importing it (cached: backends ask on every call)."""
    return importlib.util.find_spec(name) is not None


def triton_interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks for Triton's CPU interpreter (read from the environment)."""
    import os

    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All given tensors must live on one device; return it."""
    devices = {name: t.device for name, t in tensors.items()}
    first = next(iter(devices.values()))
    for d in devices.values():
        if d != first:
            listing = ", ".join(f"{n}={v}" for n, v in devices.items())
            raise ValueError(f"tensors must be on one device, got {listing}")
    return first
