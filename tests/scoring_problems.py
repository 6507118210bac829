"""The paged FP8 index-key caches the scoring tests build (test_scoring.py, test_scoring_mtp.py); no kernel import.

``paged_index_keys`` writes ``lens[b]`` random local keys of each request ``b`` into shuffled cache blocks through
the write side (:func:`dcp_ref.index_cache.write_index_keys`) and returns the cache with its block table.
"""

from __future__ import annotations

import torch

from dcp_ref.index_cache import make_index_cache, write_index_keys


def paged_index_keys(
    g: torch.Generator,
    lens: tuple[int, ...],
    *,
    B: int,
    bs: int,
    M: int | None = None,
    NB: int | None = None,
    spare: int = 3,
    exact: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``(cache, block table int32 [B, M], blocks per request)``: ``NB`` blocks (``sum + spare`` when not given),
    ``M`` table columns (one more than the longest request's blocks when not given), unused entries ``-1``.

    ``exact``: integer keys with amax 4 (scale 2**-6 exactly) drawn from a pool of 6 (ties); else normal keys
    with per-key magnitudes in [0.5, 4.5)."""
    nblk = [max(1, -(-n // bs)) for n in lens]
    M = M or max(nblk) + 1
    NB = NB or sum(nblk) + spare
    perm = torch.randperm(NB, generator=g).tolist()
    bt = torch.full((B, M), -1, dtype=torch.int32)
    cache = make_index_cache(NB, bs)
    for b, n in enumerate(lens):
        blocks = [perm.pop() for _ in range(nblk[b])]
        bt[b, : nblk[b]] = torch.tensor(blocks, dtype=torch.int32)
        if exact:  # a pool of 6 integer keys with amax 4: repeated keys tie exactly
            pool = torch.randint(-4, 5, (6, 128), generator=g).float()
            pool[:, 0] = torch.tensor([4.0, -4.0, 4.0, -4.0, 4.0, -4.0])
            keys = pool[torch.randint(0, 6, (n,), generator=g)]
        else:
            keys = torch.randn(n, 128, generator=g) * (0.5 + torch.rand(n, 1, generator=g) * 4)
        slots = torch.tensor([blocks[j // bs] * bs + j % bs for j in range(n)], dtype=torch.int64)
        write_index_keys(cache, slots, keys, bs)
    return cache, bt, nblk


def width(bounds: torch.Tensor, starts: torch.Tensor | None) -> int:
    """Columns the scores need: the largest ``bound + start``."""
    return int((bounds + (0 if starts is None else starts)).max())
