"""CUDA-graph capture for the benchmarks, written once.

The benchmarks run as scripts (``python3 benchmarks/bench_x.py``), so their folder is on ``sys.path``
and they import this module as ``from _graphs import capture``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def capture(fn: Callable[[], object], *, calls: int = 1, warmup: int = 1) -> torch.cuda.CUDAGraph:
    """``calls`` back-to-back calls of ``fn`` captured in one CUDA graph.

    ``fn`` first runs ``warmup`` times on a side stream, as torch recommends before a capture: kernels
    compile and lazily allocated buffers appear outside the graph. The device is idle on return.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, calls: int, reps: int = 5) -> float:
    """Median µs per call over ``reps`` event-timed replays of ``graph`` (which holds ``calls`` calls)."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)
