"""The DCP geometry of one rank, as one validated value.

Four integers decide where every token of a request lives: the group's ``world_size`` ``W``, this
``rank``, the ``interleave`` ``I`` (consecutive tokens per rank before moving on) and the paged
cache's ``block_size``. Passing them around as loose ints invites two bugs: arguments swapped
between functions with different orders, and a shard built for one geometry run with another
(which is silently wrong: every slot lookup lands on someone else's token). :class:`DcpGeometry`
is validated once, at construction, and carried by the rank's shard
(:class:`dcp_ref.step.RankShard`) and by the planned step (:class:`dcp_ref.step.PlannedStep`).
Every function that feeds a stage, and every kernel wrapper, takes a ``geometry: DcpGeometry``
(checked by :func:`check_geometry`): the deinterleave family, the pack, the indexer.

Loose ints remain only inside the ownership formulas (:mod:`dcp_ref.ownership`, :func:`local_count`)
and the jit kernels, always in this one order: ``world_size, rank, interleave`` (then ``block_size``
where it matters), the order vLLM uses for ``dcp_size, dcp_rank, cp_kv_cache_interleave_size``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .contracts import INT_DTYPES, check_int_scalar, check_tensor, check_world

__all__ = ["DcpGeometry", "check_geometry", "local_count"]


@dataclass(frozen=True)
class DcpGeometry:
    """Where this rank's tokens live.

    Attributes:
        world_size: ``W >= 1`` ranks sharing each request's KV cache.
        rank: this rank, ``0 <= rank < W``.
        interleave: ``I >= 1`` consecutive positions per rank before moving to the next rank.
        block_size: tokens per block of the paged cache, a multiple of ``I`` (so that an interleave
            stripe never straddles two blocks of one rank).

    Token ``p`` lives on rank ``(p // I) % W`` at local index ``(p // (W*I))*I + p % I``.
    """

    world_size: int
    rank: int
    interleave: int = 1
    block_size: int = 1

    def __post_init__(self) -> None:
        w = check_int_scalar(self.world_size, "world_size", min_value=1)
        r = check_int_scalar(self.rank, "rank", min_value=0)
        i = check_int_scalar(self.interleave, "interleave", min_value=1)
        bs = check_int_scalar(self.block_size, "block_size", min_value=1)
        if r >= w:
            raise ValueError(f"rank must satisfy 0 <= rank < world_size={w}, got {r}")
        if bs % i:
            raise ValueError(
                f"block_size must be a multiple of interleave (block_size % interleave == 0), got block_size={bs}, "
                f"interleave={i}"
            )
        # Normalise (a 0-d integer tensor or numpy int becomes a Python int) without breaking frozenness.
        for name, v in (("world_size", w), ("rank", r), ("interleave", i), ("block_size", bs)):
            object.__setattr__(self, name, v)

    @property
    def stripe(self) -> int:
        """``W * I``: positions in one round of the deal over all ranks."""
        return self.world_size * self.interleave

    def with_rank(self, rank: int) -> DcpGeometry:
        """The same geometry seen from another rank."""
        return DcpGeometry(self.world_size, rank, self.interleave, self.block_size)

    def all_ranks(self) -> list[DcpGeometry]:
        """This geometry for every rank ``0 .. W-1``."""
        return [self.with_rank(r) for r in range(self.world_size)]

    def local_count(self, n: torch.Tensor) -> torch.Tensor:
        """How many of the positions ``[0, n)`` this rank owns; see :func:`local_count`."""
        return local_count(n, self.world_size, self.rank, self.interleave)


def check_geometry(geometry: object, name: str = "geometry") -> DcpGeometry:
    """``geometry`` itself if it is a :class:`DcpGeometry` (validated when it was built), else a ``TypeError``
    naming ``name``. Every function that takes a geometry checks it with this first."""
    if not isinstance(geometry, DcpGeometry):
        raise TypeError(f"{name} must be a dcp_ref.geometry.DcpGeometry, got {type(geometry).__name__}")
    return geometry


def local_count(n: torch.Tensor, world_size: int, rank: int, interleave: int = 1) -> torch.Tensor:
    """Number of positions ``p < n`` owned by ``rank``: the local length of a global length.

    Closed form, elementwise, in integer arithmetic on ``n``'s device with no host read (safe
    inside a CUDA graph): ``(n // (W*I)) * I + clamp(n % (W*I) - rank*I, 0, I)``. Negative ``n``
    counts as ``0``. Same result as :func:`dcp_ref.ownership.local_seq_lens`, which also validates.

    Args:
        n: int32/int64 tensor of global lengths (any shape; a list or a float tensor is a ``TypeError``).
        world_size, rank, interleave: the geometry (checked as everywhere: ``W >= 1``, ``0 <= rank < W``,
            ``I >= 1``; ``TypeError`` / ``ValueError`` naming the argument).
    Returns:
        a tensor of ``n``'s shape and dtype (computed in int64).
    """
    check_tensor(n, "n", dtypes=INT_DTYPES)
    w, r, i = check_world(world_size, rank, interleave)
    if r is None:
        raise ValueError(f"rank must be an int in [0, world_size={w}), got None")
    stripe = w * i
    n64 = n.long().clamp_min(0)  # int64: an int32 n with a large W*I must not wrap
    local = torch.div(n64, stripe, rounding_mode="floor") * i + (torch.remainder(n64, stripe) - r * i).clamp(0, i)
    return local.to(n.dtype)  # <= n: fits n's dtype
