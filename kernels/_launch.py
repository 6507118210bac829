"""The lock around kernel calls that are not thread-safe on the host, and the context a stage launches in.

A leaf module (torch and :mod:`dcp_ref.contracts` only): the kernel modules take :data:`KERNEL_LOCK` from here, and
:mod:`.stages`, which imports the kernel modules, re-exports it, so no kernel module imports :mod:`.stages`.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from dcp_ref.contracts import triton_interpreting

__all__ = ["KERNEL_LOCK", "launch"]

#: Triton's CPU interpreter patches its language module while a kernel runs, and CuTeDSL compiles
#: are not thread-safe: the ranks of a SimulatedWorld (threads) take this lock around such calls.
#: Collectives stay outside it, so ranks cannot deadlock on it.
KERNEL_LOCK = threading.RLock()


def launch(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a Triton launch on ``device`` runs in: :data:`KERNEL_LOCK` under the CPU interpreter (not
    thread-safe), nothing on CUDA."""
    return KERNEL_LOCK if device.type != "cuda" and triton_interpreting() else contextlib.nullcontext()
