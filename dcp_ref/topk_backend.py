"""Backend selection for stage 3: ``backend="auto" | "cutedsl" | "triton" | "torch"``.

* ``"torch"`` — the reference (:mod:`dcp_ref.topk`), any device.
* ``"triton"`` — the Triton pack kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``); the selection
  itself has no Triton kernel and uses the reference.
* ``"cutedsl"`` — the CuTeDSL stable top-K (CUDA + nvidia-cutlass-dsl), Triton pack.
* ``"auto"`` — the fastest available for the tensors' device. Unlike vLLM (which raises when its
  CuTeDSL selector is missing), auto *falls back* to the reference — explicitly: the reason is
  logged once on ``logging.getLogger("dcp_ref.topk")`` and :func:`resolve_backend` returns it.

Asking for a specific backend that cannot run raises ``ValueError`` naming what is missing.
"""

from __future__ import annotations

import functools
import logging

import torch

from . import topk as _ref
from ._checks import check_int_scalar, has_module, triton_interpreting

__all__ = ["BACKENDS", "resolve_backend", "pack_candidates", "stable_topk", "merge_topk_global"]

logger = logging.getLogger("dcp_ref.topk")
BACKENDS = ("auto", "cutedsl", "triton", "torch")



@functools.lru_cache(maxsize=None)
def _log_fallback(op: str, reason: str) -> None:
    # lru_cache: log each distinct fallback once per process, not once per decode step.
    logger.warning("dcp_ref.topk: %s falls back to the torch reference: %s", op, reason)


def resolve_backend(backend: str, device: torch.device, op: str = "stable_topk") -> tuple[str, str]:
    """Pick the backend that will run ``op`` (``"pack"`` or ``"stable_topk"``) on ``device``.

    Returns:
        ``(backend, reason)`` — ``reason`` is ``""`` unless ``"auto"`` fell back.
    Raises:
        ValueError: unknown backend, or an explicit backend that cannot run here.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    cuda = device.type == "cuda"
    if backend == "torch":
        return "torch", ""
    if backend == "triton":
        if not has_module("triton"):
            raise ValueError("backend='triton' needs the triton package")
        if not cuda and not triton_interpreting():
            raise ValueError(f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU), got device {device}")
        return "triton", ""
    if backend == "cutedsl":
        if not cuda:
            raise ValueError(f"backend='cutedsl' needs CUDA tensors, got device {device}")
        if not has_module("cutlass"):
            raise ValueError("backend='cutedsl' needs nvidia-cutlass-dsl (pip install 'dcp-ref[cute]')")
        return "cutedsl", ""
    # auto
    if not cuda:
        reason = f"tensors are on {device}, not CUDA"
    elif op == "stable_topk" and not has_module("cutlass"):
        reason = "nvidia-cutlass-dsl is not installed"
    elif op == "pack" and not has_module("triton"):
        reason = "triton is not installed"
    else:
        return ("cutedsl" if op == "stable_topk" else "triton"), ""
    _log_fallback(op, reason)
    return "torch", reason


def pack_candidates(
    logits: torch.Tensor,
    local_topk: torch.Tensor,
    rank: int,
    world_size: int,
    interleave: int = 1,
    row_starts: torch.Tensor | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """:func:`dcp_ref.topk.pack_candidates` on the chosen backend (``"cutedsl"`` packs with Triton).

    ``out``/``validate`` apply to the Triton path (see :mod:`dcp_ref.kernels.pack_triton`).
    Returns float32 ``[rows, K, 2]``.
    """
    be, _ = resolve_backend("triton" if backend == "cutedsl" else backend, logits.device, "pack")
    if be == "torch":
        res = _ref.pack_candidates(logits, local_topk, rank, world_size, interleave, row_starts)
        return out.copy_(res) if out is not None else res
    from dcp_ref.kernels.pack_triton import pack_candidates_triton

    return pack_candidates_triton(logits, local_topk, rank, world_size, interleave, row_starts, out=out, validate=validate)


def stable_topk(
    gathered: torch.Tensor,
    k: int,
    sorted: bool = False,  # noqa: A002
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`dcp_ref.topk.stable_topk` on the chosen backend.

    ``"triton"`` has no selection kernel: it runs the reference. With ``"cutedsl"`` and
    ``out`` given, nothing is allocated and the host is not synchronised (CUDA graphs); the
    kernel does not validate id values (the reference does). Returns int32 ``[rows, k]``.
    """
    k = check_int_scalar(k, "k", min_value=1)
    if not isinstance(gathered, torch.Tensor):
        raise TypeError(f"gathered must be a torch.Tensor, got {type(gathered).__name__}")
    be, _ = resolve_backend(backend, gathered.device, "stable_topk")
    if be == "cutedsl":
        from dcp_ref.kernels.topk_cutedsl import MAX_CANDIDATES, MAX_SORTED_WINNERS, stable_topk_cutedsl

        n = gathered.shape[-2] * (gathered.shape[0] if gathered.ndim == 4 else 1)
        too_big = ""
        if n > MAX_CANDIDATES:
            too_big = f"{n} candidates per row > {MAX_CANDIDATES}"
        elif sorted and min(k, n) > MAX_SORTED_WINNERS:
            too_big = f"sorted output of {min(k, n)} > {MAX_SORTED_WINNERS} winners"
        if too_big:
            if backend == "cutedsl":
                raise ValueError(f"backend='cutedsl' cannot run this shape: {too_big}")
            _log_fallback("stable_topk", too_big)
        else:
            return stable_topk_cutedsl(gathered.contiguous(), k, sorted=sorted, out=out)
    res = _ref.stable_topk(gathered, k, sorted=sorted)
    return out.copy_(res) if out is not None else res


def merge_topk_global(
    group: object,
    logits: torch.Tensor,
    local_topk: torch.Tensor,
    k: int,
    interleave: int = 1,
    row_starts: torch.Tensor | None = None,
    sorted: bool = False,  # noqa: A002
    backend: str = "auto",
) -> torch.Tensor:
    """:func:`dcp_ref.topk.merge_topk_global` with pack and selection on ``backend``."""
    from .group import SingleGroup

    group = SingleGroup() if group is None else group
    if group.world_size == 1 and k == local_topk.shape[-1] and not sorted:
        return _ref.merge_topk_global(group, logits, local_topk, k, interleave, row_starts, sorted)
    packed = pack_candidates(logits, local_topk, group.rank, group.world_size, interleave, row_starts, backend=backend)
    gathered = group.all_gather(packed)
    return stable_topk(gathered, k, sorted=sorted, backend=backend)
