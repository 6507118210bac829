"""Backend selection for the pack + select stages: ``backend="auto" | "cutedsl" | "triton" | "torch"``.

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

from dcp_ref import topk as _ref
from dcp_ref._checks import check_bool, check_int_scalar, check_out, check_tensor, has_module, triton_interpreting

__all__ = ["BACKENDS", "resolve_backend", "pack_candidates", "stable_topk", "merge_topk_global"]

logger = logging.getLogger("dcp_ref.topk")
BACKENDS = ("auto", "cutedsl", "triton", "torch")


@functools.cache
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
            raise ValueError(
                f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU), got device {device}"
            )
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


def _check_device_arg(x: object, name: str) -> torch.device:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x.device


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

    Same contract on every backend (same accepted inputs, same errors): ``validate`` as in the
    reference; ``out`` an optional contiguous float32 ``[rows, K, 2]`` buffer on ``logits``'
    device, checked exactly (never broadcast into). Returns float32 ``[rows, K, 2]``.
    """
    validate = check_bool(validate, "validate")
    be, _ = resolve_backend("triton" if backend == "cutedsl" else backend, _check_device_arg(logits, "logits"), "pack")
    if be == "torch":
        res = _ref.pack_candidates(logits, local_topk, rank, world_size, interleave, row_starts, validate=validate)
        if out is None:
            return res
        return check_out(out, "out", tuple(res.shape), torch.float32, logits.device, contiguous=True).copy_(res)
    from .pack_triton import pack_candidates_triton

    return pack_candidates_triton(
        logits, local_topk, rank, world_size, interleave, row_starts, out=out, validate=validate
    )


def stable_topk(
    gathered: torch.Tensor,
    k: int,
    sorted: bool = False,  # noqa: A002
    backend: str = "auto",
    out: torch.Tensor | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """:func:`dcp_ref.topk.stable_topk` on the chosen backend.

    ``"triton"`` has no selection kernel: it runs the reference. With ``"cutedsl"``, ``out``
    given and ``validate=False``, nothing is allocated and the host is not synchronised (CUDA
    graphs). ``validate=True`` checks the id values on every backend (same ``ValueError``).
    ``out``: optional contiguous int32 ``[rows, k]`` on ``gathered``'s device, checked exactly.
    Returns int32 ``[rows, k]``.
    """
    validate = check_bool(validate, "validate")
    k = check_int_scalar(k, "k", min_value=1)
    check_tensor(gathered, "gathered", dtypes=(torch.float32,), ndim=(3, 4))
    rows = gathered.shape[-3]
    if out is not None:
        check_out(out, "out", (rows, k), torch.int32, gathered.device, contiguous=True)
    be, _ = resolve_backend(backend, gathered.device, "stable_topk")
    if be == "cutedsl":
        from .topk_cutedsl import MAX_CANDIDATES, MAX_SORTED_WINNERS, stable_topk_cutedsl

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
            return stable_topk_cutedsl(gathered.contiguous(), k, sorted=sorted, out=out, validate=validate)
    res = _ref.stable_topk(gathered, k, sorted=sorted, validate=validate)
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
    validate: bool = True,
) -> torch.Tensor:
    """:func:`dcp_ref.topk.merge_topk_global` with pack and selection on ``backend``.

    No ``W = 1`` shortcut: one world size, one code path, the same checks.
    """
    from dcp_ref.group import Group, SingleGroup

    group = SingleGroup() if group is None else group
    if not isinstance(group, Group):
        raise TypeError(
            f"group must be a dcp_ref.group.Group (rank, world_size, all_gather) or None, got {type(group).__name__}"
        )
    k = check_int_scalar(k, "k", min_value=1)
    packed = pack_candidates(
        logits, local_topk, group.rank, group.world_size, interleave, row_starts, backend=backend, validate=validate
    )
    gathered = group.all_gather(packed)
    return stable_topk(gathered, k, sorted=sorted, backend=backend, validate=validate)
