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
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from .contracts import check_int_scalar, check_no_alias, check_tensor

__all__ = ["Group", "SingleGroup", "SimulatedWorld", "SimulatedGroup", "TorchDistributedGroup", "SymmetricMemoryGroup"]


@runtime_checkable
class Group(Protocol):
    """What DCP needs from a process group."""

    rank: int
    world_size: int

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``x`` (same shape/dtype on all ranks), stacked in rank order: ``[W, *x.shape]``.

        ``out``: optional contiguous ``[W, *x.shape]`` buffer of ``x``'s dtype, written and returned
        (the planned step passes one so that nothing is allocated).
        """
        ...

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Sum ``x`` over ranks, then return this rank's ``dim``-chunk (``x.shape[dim] % W == 0``).

        ``out``: optional contiguous buffer of the chunk's shape (``dim = 0`` only), written and returned.
        """
        ...

    def all_to_all(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Personalised exchange: chunk ``x[j]`` goes to rank ``j``; ``out[j]`` is what rank ``j`` sent here.

        ``x``: ``[W, *chunk]`` (same shape/dtype on all ranks). ``out``: optional contiguous ``[W, *chunk]``
        buffer of ``x``'s dtype, written and returned. Rank ``r``'s ``out[j]`` equals rank ``j``'s ``x[r]``.
        """
        ...


def _check_out(out: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor, name: str = "out") -> None:
    """A collective's ``out``: ``like``'s (``x``'s) dtype and device, this shape, contiguous, and sharing no
    memory with ``x`` (every collective reads all of ``x`` while it writes ``out``)."""
    if out is None:
        return
    check_tensor(out, name, dtypes=(like.dtype,), device=like.device)
    if tuple(out.shape) != tuple(shape) or not out.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous {like.dtype} tensor of shape {tuple(shape)}, got {tuple(out.shape)}"
        )
    check_no_alias(out, name, x=like)


def _check_all_to_all(x: torch.Tensor, world_size: int, out: torch.Tensor | None) -> None:
    check_tensor(x, "x")
    if x.ndim == 0 or x.shape[0] != world_size:
        raise ValueError(
            f"x must be [W={world_size}, ...] (one chunk per destination rank), got shape {tuple(x.shape)}"
        )
    _check_out(out, tuple(x.shape), x)


def _chunk_shape(x: torch.Tensor, d: int, world_size: int) -> tuple[int, ...]:
    shape = list(x.shape)
    shape[d] //= world_size
    return tuple(shape)


def _check_scatter_dim(x: torch.Tensor, dim: int, world_size: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}")
    if x.ndim == 0 or not -x.ndim <= dim < x.ndim:
        raise ValueError(
            f"dim must lie in [-{max(x.ndim, 1)}, {max(x.ndim, 1)}) for x of shape {tuple(x.shape)}, got {dim}"
        )
    d = dim % x.ndim
    if x.shape[d] % world_size:
        raise ValueError(f"x.shape[{dim}] must be divisible by world_size={world_size}, got shape {tuple(x.shape)}")
    return d


class SingleGroup:
    """The trivial group of one rank (``W = 1``): collectives are identities."""

    rank = 0
    world_size = 1

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        check_tensor(x, "x")
        _check_out(out, (1, *x.shape), x)
        return x.unsqueeze(0).clone() if out is None else out.copy_(x.unsqueeze(0))

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0, *, out: torch.Tensor | None = None) -> torch.Tensor:
        check_tensor(x, "x")
        _check_scatter_dim(x, dim, 1)
        _check_out(out, tuple(x.shape), x)
        return x.clone() if out is None else out.copy_(x)

    def all_to_all(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_all_to_all(x, 1, out)
        return x.clone() if out is None else out.copy_(x)


class SimulatedWorld:
    """W ranks as W threads of this process, meeting in collectives.

    Collectives must be called by every rank in the same order with matching shapes/dtypes, as
    with a real process group. A mismatch — another shape or dtype, or another collective
    altogether (one rank in ``all_gather`` while another is in ``reduce_scatter``) — raises
    ``ValueError`` on every rank instead of hanging or mixing data. A rank that raises aborts the
    barrier so the others fail fast too; a rank that never arrives makes the others fail after
    ``timeout_s`` with an error naming the ranks that were missing.
    """

    def __init__(self, world_size: int, timeout_s: float = 120.0) -> None:
        self.world_size = check_int_scalar(world_size, "world_size", min_value=1)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a number > 0 (seconds), got {timeout_s!r}")
        self._timeout = float(timeout_s)
        self._barrier = threading.Barrier(self.world_size, timeout=self._timeout)
        self._slots: list[Any] = [None] * self.world_size
        self._arrived: list[int] = [0] * self.world_size  # collectives entered by each rank (names a straggler)
        # One run at a time: two callers' ranks meeting in the same barrier would mix their data. A second
        # caller waits for the first run to finish; a rank calling run() on its own world is refused.
        self._run_lock = threading.Lock()
        self._rank_threads: set[int] = set()
        self.groups = [SimulatedGroup(self, r) for r in range(self.world_size)]

    # -- collective plumbing -------------------------------------------------------------
    def _exchange(self, rank: int, value: Any) -> list[Any]:
        """Deposit ``value``, wait for all ranks, read everyone's, wait again (slots reusable)."""
        self._slots[rank] = value
        self._arrived[rank] += 1
        try:
            self._barrier.wait()
            values = list(self._slots)
            self._barrier.wait()
        except threading.BrokenBarrierError:
            mine = self._arrived[rank]
            missing = [r for r, n in enumerate(self._arrived) if n < mine]
            if missing:
                raise TimeoutError(
                    f"simulated collective #{mine} on rank {rank}: rank(s) {missing} did not arrive within "
                    f"timeout_s={self._timeout} (or failed)"
                ) from None
            raise
        return values

    def run(self, fn: Callable[..., Any], *per_rank_args: Sequence[Any]) -> list[Any]:
        """Run ``fn(group, *args_r)`` on every rank ``r`` concurrently; return results in rank order.

        Each element of ``per_rank_args`` is a length-W sequence; rank ``r`` receives its ``r``-th
        item. Exceptions are re-raised (the lowest failing rank's). Runs of one world are serialised:
        a call from another thread while a run is in progress waits for it (never mixes the two
        callers' collectives); a call from inside a run of the same world raises ``RuntimeError``.
        """
        if threading.get_ident() in self._rank_threads:
            raise RuntimeError("SimulatedWorld.run called from one of its own ranks (a nested run would deadlock)")
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        for k, seq in enumerate(per_rank_args):
            if len(seq) != self.world_size:
                raise ValueError(f"per_rank_args[{k}] must have world_size={self.world_size} items, got {len(seq)}")
        with self._run_lock:
            return self._run_locked(fn, per_rank_args)

    def _run_locked(self, fn: Callable[..., Any], per_rank_args: tuple[Sequence[Any], ...]) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        errors: list[BaseException | None] = [None] * self.world_size
        self._barrier.reset()
        self._arrived = [0] * self.world_size

        def body(r: int) -> None:
            me = threading.get_ident()
            self._rank_threads.add(me)
            try:
                results[r] = fn(self.groups[r], *(seq[r] for seq in per_rank_args))
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors[r] = e
                self._barrier.abort()
            finally:
                self._rank_threads.discard(me)

        if self.world_size == 1:
            body(0)
        else:
            threads = [threading.Thread(target=body, args=(r,), name=f"dcp-rank{r}") for r in range(self.world_size)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
        # A rank's own error first; a timeout that merely names the failing rank comes after it.
        real.sort(key=lambda e: isinstance(e, TimeoutError))
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

    def _gather(self, x: torch.Tensor, op: str) -> list[torch.Tensor]:
        check_tensor(x, "x")
        tagged = self._world._exchange(self.rank, (op, x))
        first_op, first = tagged[0]
        for r, (o, t) in enumerate(tagged):
            if o != first_op:
                raise ValueError(f"collective mismatch: rank {r} called {o}, rank 0 called {first_op}")
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ValueError(
                    f"x must have one shape and dtype on every rank (collective mismatch in {op}): rank {r} passed "
                    f"{tuple(t.shape)}/{t.dtype}, rank 0 passed {tuple(first.shape)}/{first.dtype}"
                )
        return [t.to(x.device) for _, t in tagged]

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            _check_out(out, (self.world_size, *x.shape), x)
        xs = self._gather(x, "all_gather")
        return torch.stack(xs, 0) if out is None else torch.stack(xs, 0, out=out)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0, *, out: torch.Tensor | None = None) -> torch.Tensor:
        check_tensor(x, "x")
        d = _check_scatter_dim(x, dim, self.world_size)
        _check_out(out, _chunk_shape(x, d, self.world_size), x)
        xs = self._gather(x, f"reduce_scatter(dim={d})")
        # Sum in rank order (deterministic), in float64 for float inputs so that the simulation
        # is at least as accurate as a real reduction.
        acc_dtype = torch.float64 if x.is_floating_point() else x.dtype
        total = torch.zeros_like(x, dtype=acc_dtype)
        for t in xs:
            total += t.to(acc_dtype)
        res = total.chunk(self.world_size, dim=d)[self.rank].to(x.dtype)
        return res.contiguous() if out is None else out.copy_(res)

    def all_to_all(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        if isinstance(x, torch.Tensor):
            _check_all_to_all(x, self.world_size, out)
        xs = self._gather(x, "all_to_all")
        mine = [t[self.rank] for t in xs]  # rank j's chunk for this rank, in rank order
        return torch.stack(mine, 0) if out is None else torch.stack(mine, 0, out=out)


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
        self._all_to_all = dist.all_to_all_single
        self.rank = dist.get_rank(pg)
        self.world_size = dist.get_world_size(pg)

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        check_tensor(x, "x")
        _check_out(out, (self.world_size, *x.shape), x)
        # Gather flat and view as [W, *shape]: NCCL accepts a stacked output, gloo only a
        # concatenated one, and the flat form is both.
        flat = x.contiguous().reshape(-1)
        if out is None:
            out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        self._all_gather(out.view(-1), flat, group=self._pg)
        return out

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0, *, out: torch.Tensor | None = None) -> torch.Tensor:
        check_tensor(x, "x")
        d = _check_scatter_dim(x, dim, self.world_size)
        if out is not None:
            if d != 0:
                raise ValueError(f"out= needs dim=0 (the collective splits dim 0), got dim={dim}")
            _check_out(out, _chunk_shape(x, 0, self.world_size), x)
            self._reduce_scatter(out, x.contiguous(), group=self._pg)
            return out
        # reduce_scatter_tensor splits along dim 0: move ``dim`` to the front and back.
        xt = x.movedim(d, 0).contiguous()
        res = torch.empty((xt.shape[0] // self.world_size, *xt.shape[1:]), dtype=x.dtype, device=x.device)
        self._reduce_scatter(res, xt, group=self._pg)
        return res.movedim(0, d).contiguous()

    def all_to_all(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_all_to_all(x, self.world_size, out)
        if out is None:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        # all_to_all_single splits dim 0 into W equal chunks on both sides: exactly [W, *chunk].
        self._all_to_all(out, x.contiguous(), group=self._pg)
        return out


class SymmetricMemoryGroup:
    """A :class:`Group` whose collectives move data through PyTorch's symmetric memory, NCCL as the fallback.

    ``torch.distributed._symmetric_memory`` maps every rank's buffer into every other rank's address space
    (CUDA IPC over NVLink within a host). A collective is then a few copy kernels plus one device-side
    barrier (a signal written into each peer's signal pad and awaited on the GPU), not a collective launch:
    cheaper for the small messages of a decode layer, and capturable in a CUDA graph like the copies it is.

    Transport (per call, :attr:`transport` says which one a group uses):

    - ``"symmetric"`` (CUDA, ``W > 1``, symmetric memory available, the message fits ``capacity_bytes``):
      *all-gather*: copy ``x`` into this rank's slot of every peer's inbox, barrier, copy the inbox into
      ``out``; *all-to-all*: chunk ``j`` into rank ``j``'s inbox slot of this rank, barrier, inbox into
      ``out``; *reduce-scatter*: the fallback's (it is a reduction; NCCL's is well tuned). Inboxes are
      double-buffered (two parities), so one barrier per collective suffices: a rank writes parity ``p``
      again only two collectives later, after every peer has passed the barrier that follows its reads.
    - ``"fallback"``: every collective delegates to ``fallback`` (a :class:`TorchDistributedGroup` over NCCL
      or gloo, or any :class:`Group`) — on the CPU, at ``W = 1``, or where symmetric memory is missing.

    Args:
        fallback: the group to delegate to (its rank and world size are this group's).
        capacity_bytes: the largest message per rank (bytes) the symmetric buffers hold; a larger one uses the
            fallback for that call.
        group_name: the ``torch.distributed`` group name for the rendezvous (default: the world's).
    """

    def __init__(self, fallback: Group, capacity_bytes: int = 1 << 22, *, group_name: str | None = None) -> None:
        for attr in ("rank", "world_size"):
            if isinstance(getattr(fallback, attr, None), bool) or not isinstance(getattr(fallback, attr, None), int):
                raise TypeError(f"fallback must be a Group (an int {attr} and collectives), got {fallback!r}")
        self._fallback = fallback
        self.rank, self.world_size = fallback.rank, fallback.world_size
        self.capacity_bytes = check_int_scalar(capacity_bytes, "capacity_bytes", min_value=16)
        self._hdl: Any = None
        self._inbox: list[torch.Tensor] = []  # per parity: this rank's inbox [W, capacity] uint8
        self._peer_inbox: list[list[torch.Tensor]] = []  # per parity, per peer: the peer's inbox
        self._parity = 0
        self.transport = "fallback"
        self.why_fallback = self._setup(group_name)

    def _setup(self, group_name: str | None) -> str:
        if self.world_size == 1:
            return "one rank: collectives are copies"
        if not torch.cuda.is_available():
            return "no CUDA device"
        try:
            import torch.distributed as dist
            import torch.distributed._symmetric_memory as symm_mem
        except ImportError as e:  # pragma: no cover - depends on the build
            return f"torch.distributed._symmetric_memory is unavailable ({e})"
        if not dist.is_initialized():
            return "torch.distributed is not initialized"
        name = group_name or dist.group.WORLD.group_name  # type: ignore[union-attr]
        W, cap = self.world_size, self.capacity_bytes
        dev = torch.device("cuda", torch.cuda.current_device())
        try:
            buf = symm_mem.empty(2 * W * cap, dtype=torch.uint8, device=dev)
            self._hdl = symm_mem.rendezvous(buf, name)  # type: ignore[arg-type]  # a str on torch 2.11, GroupName later
        except Exception as e:  # noqa: BLE001 - any failure means: use the fallback, and say why
            return f"symmetric memory rendezvous failed: {type(e).__name__}: {e}"
        for parity in range(2):
            off = parity * W * cap
            self._inbox.append(buf[off : off + W * cap].view(W, cap))
            self._peer_inbox.append(
                [self._hdl.get_buffer(p, (W, cap), torch.uint8, storage_offset=off) for p in range(W)]
            )
        self.transport = "symmetric"
        return ""

    def _fits(self, nbytes: int) -> bool:
        return self.transport == "symmetric" and nbytes <= self.capacity_bytes

    def _exchange(self, chunks: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """``chunks[p]`` (bytes) into this rank's slot of peer ``p``'s inbox; barrier; the inbox into ``out``."""
        parity, self._parity = self._parity, 1 - self._parity
        n = chunks[0].numel()
        for p, c in enumerate(chunks):
            self._peer_inbox[parity][p][self.rank, :n].copy_(c)
        self._hdl.barrier(channel=parity)
        out.view(self.world_size, -1).view(torch.uint8).copy_(self._inbox[parity][:, :n])
        return out

    def all_gather(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        check_tensor(x, "x")
        _check_out(out, (self.world_size, *x.shape), x)
        nbytes = x.numel() * x.element_size()
        if not self._fits(nbytes) or not x.is_cuda:
            return self._fallback.all_gather(x, out=out)
        if out is None:
            out = torch.empty((self.world_size, *x.shape), dtype=x.dtype, device=x.device)
        flat = x.contiguous().view(-1).view(torch.uint8)
        return self._exchange([flat] * self.world_size, out)

    def all_to_all(self, x: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        _check_all_to_all(x, self.world_size, out)
        nbytes = x[0].numel() * x.element_size() if x.shape[0] else 0
        if not self._fits(nbytes) or not x.is_cuda:
            return self._fallback.all_to_all(x, out=out)
        if out is None:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        xb = x.contiguous().view(self.world_size, -1).view(torch.uint8)
        return self._exchange([xb[p] for p in range(self.world_size)], out)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0, *, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._fallback.reduce_scatter(x, dim, out=out)
