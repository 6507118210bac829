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
    check_not_self_overlapping(buf, name)
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


def check_device(device: object, name: str = "device") -> torch.device:
    """A device argument: a ``torch.device`` or a string naming one (``TypeError`` / ``ValueError`` naming
    ``name``, never torch's own parse error from deep inside a call)."""
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise TypeError(f"{name} must be a torch.device or a str, got {type(device).__name__}")
    try:
        return torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{name} must name a torch device, got {device!r} ({e})") from None


def check_choice(value: object, name: str, choices: Sequence[str]) -> str:
    """An option named by a string: not a str (``None``, a list) is a ``TypeError``, a name outside ``choices``
    a ``ValueError``, both naming ``name``."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {tuple(choices)} (a str), got {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


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


def check_pow2(value: object, name: str, *, lo: int, hi: int) -> int:
    """A launch parameter (tile width, heads per program, warps): a power of two in ``[lo, hi]``.

    ``TypeError`` for anything but an int (``bool`` and ``2.0`` included), ``ValueError`` out of range or
    not a power of two — checked on the host before a launch, where a bad value would otherwise surface
    as a compiler error deep inside Triton (or, for a tile narrower than the data, a wrong answer).
    """
    v = check_int_scalar(value, name)
    if not lo <= v <= hi or v & (v - 1):
        raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {v}")
    return v


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Byte range ``[lo, hi)`` that ``t``'s elements occupy (strides are never negative in torch)."""
    lo = t.data_ptr()
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return lo, lo + extent * t.element_size()


#: Above this many contiguous runs (of both views together) the exact overlap test is not attempted: views whose
#: byte ranges interleave are then reported as overlapping.
_EXACT_OVERLAP_LIMIT = 1 << 22


def _runs(t: torch.Tensor) -> tuple[np.ndarray, int]:
    """``t``'s elements as maximal contiguous runs: their start addresses (bytes, a sorted int64 NumPy array) and
    their common length in bytes. A view whose inner dimensions are contiguous has few runs (``[T, W, H/W, v]``, a
    transposed send buffer: ``T W`` runs of ``H/W v`` elements), so comparing runs, not bytes, keeps the host check
    cheap (NumPy, not torch: a few small arrays, where each torch op costs more than the work)."""
    dims, run = _run_shape(t)
    off = np.zeros((), dtype=np.int64)
    for s, st in dims:
        off = np.add.outer(off, np.arange(s, dtype=np.int64) * st)
    es = t.element_size()
    return np.sort(off.reshape(-1)) * es + t.data_ptr(), run * es


def _runs_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Exact: whether a run of ``a`` and a run of ``b`` share a byte (each view's own runs are disjoint: a
    self-overlapping output is refused before this is asked)."""
    a_starts, a_len = _runs(a)
    b_starts, b_len = _runs(b)
    # for each run [s, s + len) of b: the last run of a starting before its end must end after s
    i = np.searchsorted(a_starts, b_starts + b_len, side="left") - 1
    hit = (i >= 0) & (a_starts[np.maximum(i, 0)] + a_len > b_starts)
    return bool(hit.any())


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share at least one byte of memory (exact for views of moderate size)."""
    if a.device != b.device or a.is_meta or b.is_meta or not a.numel() or not b.numel():
        return False
    a_lo, a_hi = _span(a)
    b_lo, b_hi = _span(b)
    if a_hi <= b_lo or b_hi <= a_lo:
        return False
    dense_a = a_hi - a_lo == a.numel() * a.element_size()
    dense_b = b_hi - b_lo == b.numel() * b.element_size()
    if dense_a and dense_b:
        return True
    if _run_count(a) + _run_count(b) > _EXACT_OVERLAP_LIMIT:
        return True  # interleaved ranges of huge views: assume the worst
    return _runs_overlap(a, b)


def _run_shape(t: torch.Tensor) -> tuple[list[tuple[int, int]], int]:
    """``(outer dimensions as (size, stride), elements per run)``: the innermost dimensions of ``t`` merged into one
    contiguous run while each one's stride continues it (size-1 dimensions dropped)."""
    dims = [(s, st) for s, st in zip(t.shape, t.stride()) if s != 1]
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    return dims, run


def _run_count(t: torch.Tensor) -> int:
    """How many contiguous runs :func:`_runs` would enumerate (without enumerating them)."""
    n = 1
    for s, _ in _run_shape(t)[0]:
        n *= s
    return n


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device == b.device
        and not a.is_meta
        and a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory (an expanded / stride-0 view, or any as_strided layout
    whose strides do not nest): the dims of size > 1, sorted by stride, must each step over the whole extent
    of the ones below it. A layout failing that test is refused even where it happens not to overlap."""
    reach = 0  # the largest element offset reachable with the dims seen so far
    for st, s in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s > 1):
        if st <= reach:
            return True
        reach += st * (s - 1)
    return False


def check_not_self_overlapping(buf: torch.Tensor, name: str) -> None:
    """An output buffer whose elements share memory (``expand``, stride 0) is refused (``ValueError`` naming
    ``name``): one location written by several elements gives a schedule-dependent answer."""
    if _self_overlapping(buf):
        raise ValueError(
            f"{name} must not overlap itself (an expanded / stride-0 view: several of its elements are one "
            f"memory location), got shape {tuple(buf.shape)} with strides {tuple(buf.stride())}"
        )


def _storage_span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range of ``t``'s whole storage: tensors whose storages do not intersect share nothing."""
    st = t.untyped_storage()
    lo = st.data_ptr()
    return lo, lo + st.nbytes()


def check_no_alias(out: object, name: str = "out", /, *, same_ok: Sequence[str] = (), **inputs: object) -> None:
    """An output buffer must not share memory with any of ``inputs`` (``ValueError`` naming ``name``).

    A kernel that writes ``out`` while other programs still read an input it overlaps gives an answer
    that depends on the schedule — silently wrong, or right by luck on the CPU and wrong on the GPU. The
    test is on the memory actually used: tensors of separate allocations are told apart by their
    storages' byte ranges (a few integer operations, what every hot-path call pays); views of one
    storage are compared element by element (two interleaved column views of one tensor do not
    overlap). No tensor value is read.

    Args:
        out: the output buffer (``None`` or a non-tensor: nothing to check).
        name: its argument name (the message starts with it).
        same_ok: names of inputs that ``out`` may be *exactly* (the same view: pointer, shape, strides
            and dtype), where a function documents an in-place mode; a partial overlap is still refused.
        inputs: ``name=tensor`` of every tensor the call reads (``None`` and non-tensors are skipped).
    """
    check_no_aliases({name: out}, inputs, same_ok=same_ok)


def check_no_aliases(outs: dict[str, object], inputs: dict[str, object], *, same_ok: Sequence[str] = ()) -> None:
    """:func:`check_no_alias` for several outputs at once: no output may share memory with an input, with an
    output listed before it, or with itself (a stride-0 view). Each storage's byte range is computed once (the
    hot-path cost)."""
    spans: dict[str, tuple[torch.Tensor, int, int]] = {}
    for n, t in inputs.items():
        if isinstance(t, torch.Tensor):
            spans[n] = (t, *_storage_span(t))
    for name, out in outs.items():
        if not isinstance(out, torch.Tensor):
            continue
        check_not_self_overlapping(out, name)
        o_lo, o_hi = _storage_span(out)
        for other_name, (other, lo, hi) in spans.items():
            if hi <= o_lo or o_hi <= lo:  # separate allocations (or an empty storage): nothing shared
                continue
            if other_name in same_ok and _same_view(out, other):
                continue
            if _overlap(out, other):
                what = " (it may be exactly that tensor, not a partial view of it)" if other_name in same_ok else ""
                raise ValueError(
                    f"{name} must not share memory with {other_name}{what}: the kernel would read values it "
                    "has already overwritten"
                )
        spans[name] = (out, o_lo, o_hi)


def host_values(*stats: torch.Tensor) -> list:
    """Read a few 0-d device values with **one** transfer: ``stack`` + ``tolist`` (one sync).

    The validated path of every value check builds its handful of statistics (flags, minima, maxima,
    first offending positions) as 0-d tensors on the device and reads them here together, instead of one
    ``.item()`` / ``bool(tensor)`` per condition (each a separate device round trip). All ``stats`` are
    converted to the first one's dtype (use int64 for indices and slots, float64 for values).
    """
    first = stats[0]
    return torch.stack([s.reshape(()).to(first.dtype) for s in stats]).tolist()
