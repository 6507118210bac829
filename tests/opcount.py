"""What a kernel wrapper runs, in order: the tests' one op counter (the validated-call tests read it).

    counter = OpCount()
    with counter.recording([(module, "my_kernel")]):
        wrapper(...)
    counter.ops   # ["aten::empty", "triton:my_kernel", "aten::_local_scalar_dense", ...]

Each wrapped Triton launch is one entry (``triton:<name>``, or what ``label`` makes of its name and keyword
arguments); every non-view aten op outside the launches is one entry (what a device would launch, and host reads);
``Tensor.tolist`` is recorded too (a CPU tolist dispatches nothing). Inside a launch (or a call wrapped by
:meth:`OpCount.quiet`) nothing is recorded: the interpreter's own copies of the arguments are not the wrapper's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

#: The aten ops (and ``tolist``) that read a device value on the host.
HOST_READS = frozenset(
    {"aten::_local_scalar_dense", "aten::item", "aten::is_nonzero", "aten::nonzero", "aten::equal", "tolist"}
)


class OpCount:
    """Records what runs inside :meth:`recording` (see the module docstring); ``ops`` is the list."""

    def __init__(self) -> None:
        self.ops: list[str] = []
        self._paused = False

    def quiet(self, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """``call`` recorded as the one entry ``name``, with nothing recorded inside it."""

        def run(*a: Any, **k: Any) -> Any:
            if not self._paused:
                self.ops.append(name)
            self._paused = True
            try:
                return call(*a, **k)
            finally:
                self._paused = False

        return run

    def _launcher(self, kernel: Any, name: str, label: Callable[[str, dict], str] | None) -> Any:
        counter = self

        class Launcher:
            def __getitem__(self, grid: Any) -> Callable[..., Any]:
                def run(*a: Any, **k: Any) -> Any:
                    return counter.quiet(label(name, k) if label else f"triton:{name}", kernel[grid])(*a, **k)

                return run

        return Launcher()

    @contextlib.contextmanager
    def recording(self, kernels: Iterable[tuple], label: Callable[[str, dict], str] | None = None) -> Iterator[OpCount]:
        """Record while inside. ``kernels``: ``(module, attribute)`` or ``(module, attribute, name)`` of the Triton
        kernels whose launches are entries (``name`` defaults to the attribute); all are restored on exit."""
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types_, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if not counter._paused and not func.is_view:
                    counter.ops.append(func._schema.name)
                return func(*args, **(kwargs or {}))

        orig_tolist = torch.Tensor.tolist

        def tolist(t: torch.Tensor, *a: Any, **k: Any) -> Any:
            if not counter._paused:
                counter.ops.append("tolist")
            return orig_tolist(t, *a, **k)

        saved = []
        try:
            for entry in kernels:
                module, attr = entry[0], entry[1]
                name = entry[2] if len(entry) > 2 else attr
                saved.append((module, attr, getattr(module, attr)))
                setattr(module, attr, self._launcher(getattr(module, attr), name, label))
            torch.Tensor.tolist = tolist  # type: ignore[method-assign]
            with Mode():
                yield self
        finally:
            torch.Tensor.tolist = orig_tolist  # type: ignore[method-assign]
            for module, attr, value in reversed(saved):
                setattr(module, attr, value)


def reads(ops: list[str]) -> list[str]:
    """The host reads among ``ops``."""
    return [op for op in ops if op in HOST_READS]


def launches(ops: list[str]) -> list[str]:
    """The Triton launches among ``ops``."""
    return [op for op in ops if op.startswith("triton:")]
