"""Process-group interface for DCP collectives, with an in-process simulation.

DCP code is written SPMD-style: every rank runs the same function and meets the others in
collectives. :class:`Group` is the small interface that code needs; two implementations exist:

* :class:`SimulatedWorld` runs W ranks as W threads of one process (CPU or one GPU) and
  implements the collectives with a barrier and shared slots. Results are assembled in rank
  order, so they are deterministic — the oracle for multi-rank tests and notebooks.
* :class:`TorchDistributedGroup` wraps a ``torch.distributed`` process group (NCCL / gloo) for
  real multi-GPU runs.

Usage::

    world = SimulatedWorld(world_size=4)
    results = world.run(step, per_rank_args)     # step(group, *args) runs once per rank
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch

from ._checks import check_int_scalar, check_tensor

__all__ = ["Group", "SingleGroup", "SimulatedWorld", "SimulatedGroup", "TorchDistributedGroup"]


@runtime_checkable
class Group(Protocol):
    """What DCP needs from a process group."""

    rank: int
    world_size: int

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` (same shape/dtype on all ranks), stacked in rank order: ``[W, *x.shape]``."""
        ...

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum ``x`` over ranks, then return this rank's ``dim``-chunk (``x.shape[dim] % W == 0``)."""
        ...


def _check_scatter_dim(x: torch.Tensor, dim: int, world_size: int) -> int:
    d = dim % x.ndim if x.ndim else 0
    if x.ndim == 0 or x.shape[d] % world_size:
        raise ValueError(f"x.shape[{dim}] must be divisible by world_size={world_size}, got shape {tuple(x.shape)}")
    return d


class SingleGroup:
    """The trivial group of one rank (``W = 1``): collectives are identities."""

    rank = 0
    world_size = 1

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor(x, "x")
        return x.unsqueeze(0).clone()

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        check_tensor(x, "x")
        _check_scatter_dim(x, dim, 1)
        return x.clone()


class SimulatedWorld:
    """W ranks as W threads of this process, meeting in collectives.

    Collectives must be called by every rank in the same order with matching shapes/dtypes, as
    with a real process group; a mismatch raises ``ValueError`` on every rank instead of hanging.
    A rank that raises aborts the barrier so the others fail fast too.
    """

    def __init__(self, world_size: int, timeout_s: float = 120.0) -> None:
        self.world_size = check_int_scalar(world_size, "world_size", min_value=1)
        self._timeout = timeout_s
        self._barrier = threading.Barrier(self.world_size, timeout=timeout_s)
        self._slots: list[Any] = [None] * self.world_size
        self.groups = [SimulatedGroup(self, r) for r in range(self.world_size)]

    # -- collective plumbing -------------------------------------------------------------
    def _exchange(self, rank: int, value: Any) -> list[Any]:
        """Deposit ``value``, wait for all ranks, read everyone's, wait again (slots reusable)."""
        self._slots[rank] = value
        self._barrier.wait()
        values = list(self._slots)
        self._barrier.wait()
        return values

    def run(self, fn: Callable[..., Any], *per_rank_args: Sequence[Any]) -> list[Any]:
        """Run ``fn(group, *args_r)`` on every rank ``r`` concurrently; return results in rank order.

        Each element of ``per_rank_args`` is a length-W sequence; rank ``r`` receives its ``r``-th
        item. Exceptions are re-raised (the lowest failing rank's).
        """
        for k, seq in enumerate(per_rank_args):
            if len(seq) != self.world_size:
                raise ValueError(f"per_rank_args[{k}] must have world_size={self.world_size} items, got {len(seq)}")
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException | None] = [None] * self.world_size
        self._barrier.reset()

        def body(r: int) -> None:
            try:
                results[r] = fn(self.groups[r], *(seq[r] for seq in per_rank_args))
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors[r] = e
                self._barrier.abort()

        if self.world_size == 1:
            body(0)
        else:
            threads = [threading.Thread(target=body, args=(r,), name=f"dcp-rank{r}") for r in range(self.world_size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
        if real:
            raise real[0]
        if any(e is not None for e in errors):
            raise RuntimeError("a simulated collective timed out or was aborted")
        return results


class SimulatedGroup:
    """One rank's handle on a :class:`SimulatedWorld`."""

    def __init__(self, world: SimulatedWorld, rank: int) -> None:
        self._world = world
        self.rank = rank
        self.world_size = world.world_size

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        check_tensor(x, "x")
        xs = self._world._exchange(self.rank, x)
        first = xs[0]
        for r, t in enumerate(xs):
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(
                    f"collective mismatch: rank {r} passed {tuple(t.shape)}/{t.dtype}, rank 0 passed {tuple(first.shape)}/{first.dtype}"
                )
        return [t.to(x.device) for t in xs]

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._gather(x), 0)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        d = _check_scatter_dim(x, dim, self.world_size)
        xs = self._gather(x)
        # Sum in rank order (deterministic), in float64 for float inputs so that the simulation
        # is at least as accurate as a real reduction.
        acc_dtype = torch.float64 if x.is_floating_point() else x.dtype
        total = torch.zeros_like(x, dtype=acc_dtype)
        for t in xs:
            total += t.to(acc_dtype)
        return total.chunk(self.world_size, dim=d)[self.rank].to(x.dtype).contiguous()


class TorchDistributedGroup:
    """:class:`Group` over a ``torch.distributed`` process group (NCCL on GPUs, gloo on CPU)."""

    def __init__(self, pg: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("torch.distributed is not initialized: call init_process_group first")
        self._dist = dist
        self._pg = pg
        # torch >= 2.13 renamed the single-tensor collectives (*_single); older releases (the
        # H200 image has 2.11) only have the *_tensor names. Same signatures.
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self._reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        check_tensor(x, "x")
        # Gather flat and view as [W, *shape]: NCCL accepts a stacked output, gloo only a
        # concatenated one, and the flat form is both.
        flat = x.contiguous().reshape(-1)
        out = torch.empty(self.world_size * flat.numel(), dtype=x.dtype, device=x.device)
        self._all_gather(out, flat, group=self._pg)
        return out.view(self.world_size, *x.shape)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        d = _check_scatter_dim(x, dim, self.world_size)
        # reduce_scatter_tensor splits along dim 0: move ``dim`` to the front and back.
        xt = x.movedim(d, 0).contiguous()
        out = torch.empty((xt.shape[0] // self.world_size, *xt.shape[1:]), dtype=x.dtype, device=x.device)
        self._reduce_scatter(out, xt, group=self._pg)
        return out.movedim(0, d).contiguous()
