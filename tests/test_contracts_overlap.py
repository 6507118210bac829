"""The alias check's overlap test (dcp_ref.contracts): exact on strided views, by contiguous runs, not bytes."""

from __future__ import annotations

import random

import torch

from dcp_ref.contracts import _overlap, check_not_self_overlapping


def _bytes(t: torch.Tensor) -> set[int]:
    """Every byte address ``t``'s elements cover: the independent reference."""
    idx = torch.zeros((), dtype=torch.int64)
    for s, st in zip(t.shape, t.stride()):
        idx = idx.unsqueeze(-1) + torch.arange(s) * st * t.element_size()
    idx = idx.reshape(-1) + t.data_ptr()
    return set((idx.unsqueeze(1) + torch.arange(t.element_size())).reshape(-1).tolist())


def test_overlap_is_exact_on_random_strided_views() -> None:
    rnd = random.Random(0)
    base = torch.empty(4096)
    seen = {True: 0, False: 0}
    for _ in range(1500):
        views = []
        for _ in range(2):
            nd = rnd.randint(1, 3)
            shape = [rnd.randint(1, 5) for _ in range(nd)]
            stride = [rnd.randint(1, 12) for _ in range(nd)]
            views.append(base.as_strided(shape, stride, rnd.randint(0, 50)))
        try:
            for v in views:
                check_not_self_overlapping(v, "v")
        except ValueError:
            continue
        want = bool(_bytes(views[0]) & _bytes(views[1]))
        assert _overlap(*views) == want, (views[0].shape, views[0].stride(), views[1].shape, views[1].stride())
        seen[want] += 1
    assert min(seen.values()) > 50  # both answers drawn often


def test_the_all_to_all_send_buffer_halves_do_not_overlap() -> None:
    """Per destination rank ``[partials | LSEs]`` in one byte buffer: the two ``[T, W, H/W, ...]`` views interleave
    their byte ranges but share no byte (the planned attention writes both); one byte more and they do."""
    W, T, Hs, v = 8, 32, 16, 512
    ob = T * Hs * v * 2
    send = torch.empty(W, ob + T * Hs * 4, dtype=torch.uint8)
    out = send[:, :ob].view(torch.bfloat16).view(W, T, Hs, v).transpose(0, 1)
    lse = send[:, ob:].view(torch.float32).view(W, T, Hs).transpose(0, 1)
    assert not _overlap(out, lse) and not _overlap(lse, out)
    shifted = send[:, ob - 4 : ob - 4 + T * Hs * 4].view(torch.float32).view(W, T, Hs).transpose(0, 1)
    assert _overlap(out, shifted)
