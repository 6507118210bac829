"""Comparing selections as sets: what the tests of a step's ``global_ids`` trace need."""

from __future__ import annotations

import torch


def same_sets(ids: torch.Tensor, ref: torch.Tensor) -> bool:
    """Row by row the same selected ids (``-1`` padding included), in any order: one rank's cache (W = 1) selects
    nothing after its local top-K, whose ids come in the indexer's order, not the select stage's."""
    return ids.shape == ref.shape and torch.equal(ids.long().sort(1).values, ref.long().sort(1).values)
