"""Move a call's arguments to another device *keeping their memory relations*: views of one storage stay views
of one storage (the aliasing rows of the bad-input tables mean nothing once ``.to(dev)`` copies each argument
apart), with every view's dtype, shape, strides and offset as it was. Meta tensors and non-tensors pass as is."""

from __future__ import annotations

from typing import Any

import torch


def to_device(args: dict[str, Any], dev: torch.device) -> dict[str, Any]:
    """``args`` with every CPU tensor on ``dev``: each distinct storage copied once, each tensor re-viewed on it."""
    moved: dict[int, torch.Tensor] = {}  # storage data_ptr -> its bytes on dev
    out: dict[str, Any] = {}
    for name, t in args.items():
        if not isinstance(t, torch.Tensor) or t.is_meta or t.device == dev:
            out[name] = t
            continue
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in moved:
            moved[key] = torch.empty(0, dtype=torch.uint8).set_(st).to(dev)
        view = torch.empty(0, dtype=t.dtype, device=dev)
        out[name] = view.set_(moved[key].untyped_storage(), t.storage_offset(), t.shape, t.stride())
    return out
