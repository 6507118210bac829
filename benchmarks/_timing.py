"""How every benchmark times a call, written once: CUDA-graph capture and the three timers.

The benchmarks run as scripts (``python3 benchmarks/bench_x.py``), so their folder is on ``sys.path`` and they
import this module as ``import _timing``.

**The rule** (one for every benchmark): a timed callable runs :data:`WARMUP` untimed *samples* (compilation,
lazily allocated buffers and plans, clocks), then :data:`SAMPLES` timed ones; the result is the **median** of the
timed samples (their 20 % and 80 % quantiles beside it), in **µs per call**. A sample is one call, or ``calls``
back-to-back calls divided by ``calls``. The counts are fixed (not a time budget), so every rank of a
multi-GPU run replays its collectives the same number of times. A sweep that only ranks configurations uses
:data:`SWEEP` (fewer samples), and says so.

**The modes** (what a sample is):

* :func:`graph` / :func:`replay`: ``calls`` back-to-back calls captured in one CUDA graph (:func:`capture`); a
  sample is one replay, timed with CUDA events, divided by ``calls``. No Python launch cost: what a server that
  replays graphs pays. ``flush_l2=True`` zeroes a 256 MiB buffer before each sample (outside the timed events),
  so the call reads its inputs from HBM (as ``triton.testing.do_bench`` does).
* :func:`eager`: the Python call itself, timed with CUDA events (device time from the first to the last kernel,
  launch gaps included); ``flush_l2`` as above.
* :func:`host`: wall-clock time (``time.perf_counter``) of ``calls`` back-to-back calls, the device synchronised
  before and after: host work, launches and device work together. It is the only mode that runs without CUDA.

Event samples are all recorded, then read after one synchronisation, so back-to-back samples queue on the
device as the calls of a real run do.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Rule", "STANDARD", "SWEEP", "SMOKE", "WARMUP", "SAMPLES", "Timing", "capture", "graph", "replay", "eager",
           "host", "host_sample_us", "graph_row", "reps_for", "summarize", "describe", "STAGE_CALLS", "stage",
           "cold", "kernel_breakdown"]  # fmt: skip


@dataclass(frozen=True)
class Rule:
    """``warmup`` untimed samples, then ``samples`` timed ones; the median of the timed ones is reported."""

    warmup: int
    samples: int

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.samples < 1:
            raise ValueError(f"a rule needs warmup >= 0 and samples >= 1, got {self.warmup}, {self.samples}")


#: The rule every benchmark's numbers are measured with.
STANDARD = Rule(warmup=5, samples=50)
#: The cheaper rule of sweeps that only rank configurations (their winners are timed again under STANDARD).
SWEEP = Rule(warmup=2, samples=12)
#: The CPU plumbing checks' rule (interpreted kernels, host clock): a few samples, no timing claim.
SMOKE = Rule(warmup=0, samples=5)
WARMUP, SAMPLES = STANDARD.warmup, STANDARD.samples

#: Bytes zeroed before a flushed sample: several times the H200's 50 MiB L2 (triton.testing.do_bench's size).
FLUSH_BYTES = 256 << 20
#: Bytes zeroed before each call inside a :func:`cold` graph: twice the H200's 50 MiB L2 (smaller than
#: FLUSH_BYTES, so the subtracted flush time and its noise stay small beside a few-µs stage).
COLD_FLUSH_BYTES = 100 << 20


@dataclass(frozen=True)
class Timing:
    """The samples of one timed callable, in µs per call: median, 20 % and 80 % quantiles."""

    median_us: float
    p20_us: float
    p80_us: float
    samples: int
    calls: int
    mode: str

    def as_dict(self) -> dict[str, float]:
        """``{"median_us", "p20_us", "p80_us"}``: the fields the benchmarks' JSON rows carry."""
        return {"median_us": self.median_us, "p20_us": self.p20_us, "p80_us": self.p80_us}


def summarize(samples_us: list[float], calls: int = 1, mode: str = "host") -> Timing:
    """:class:`Timing` of samples already divided by their calls (µs per call)."""
    if not samples_us:
        raise ValueError("summarize needs at least one sample")
    xs = sorted(float(x) for x in samples_us)
    q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) >= 2 else [xs[0]] * 9
    return Timing(statistics.median(xs), q[1], q[7], len(xs), calls, mode)


def describe(mode: str, calls: int | str = 1, rule: Rule = STANDARD, flush_l2: bool = False) -> str:
    """The one-line method text a result file records for numbers timed by ``mode`` (``"graph"``, ...)."""
    what = {
        "graph": f"CUDA graph of {calls} back-to-back call(s), each replay timed with CUDA events / {calls}",
        "eager": "eager Python call timed with CUDA events",
        "host": f"wall clock of {calls} back-to-back call(s), device synchronised before and after, / {calls}",
    }[mode]
    flush = ", L2 flushed before each sample" if flush_l2 else ""
    return f"{what}{flush}; {rule.warmup} warm-up samples, median (p20/p80) of {rule.samples} (benchmarks/_timing.py)"


def _check(calls: int, rule: Rule) -> None:
    if not isinstance(calls, int) or isinstance(calls, bool) or calls < 1:
        raise ValueError(f"calls must be an int >= 1, got {calls!r}")
    if not isinstance(rule, Rule):
        raise TypeError(f"rule must be a Rule, got {type(rule).__name__}")


_flush_buffer: torch.Tensor | None = None


def _flush() -> None:
    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    _flush_buffer.zero_()


def _events(launch: Callable[[], object], calls: int, rule: Rule, flush_l2: bool, mode: str) -> Timing:
    """``launch`` (one sample) run ``rule.warmup`` times, then ``rule.samples`` times between CUDA events."""
    for _ in range(rule.warmup):
        launch()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(rule.samples):
        if flush_l2:
            _flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return summarize([a.elapsed_time(b) * 1e3 / calls for a, b in pairs], calls, mode)


def capture(fn: Callable[[], object], *, calls: int = 1, warmup: int = 3) -> torch.cuda.CUDAGraph:
    """``calls`` back-to-back calls of ``fn`` captured in one CUDA graph.

    ``fn`` first runs ``warmup`` times on a side stream, as torch recommends before a capture: kernels compile
    and lazily allocated buffers appear outside the graph. The device is idle on return.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return g


def replay(g: Any, *, calls: int = 1, replays: int = 1, flush_l2: bool = False, rule: Rule = STANDARD) -> Timing:
    """The rule applied to replays of an already captured graph ``g`` holding ``calls`` calls (µs per call).

    ``replays``: back-to-back replays per sample (one event pair around them): a layer's graph is replayed once per
    layer, back to back, so its throughput time hides each replay's launch behind the one before; ``replays=1``
    times one replay alone (its launch latency included)."""
    _check(calls, rule)
    if not isinstance(replays, int) or replays < 1:
        raise ValueError(f"replays must be an int >= 1, got {replays!r}")

    def launch() -> None:
        for _ in range(replays):
            g.replay()

    return _events(launch, calls * replays, rule, flush_l2, "graph")


def graph(fn: Callable[[], object], *, calls: int | None = 1, flush_l2: bool = False, rule: Rule = STANDARD) -> Timing:
    """``calls`` back-to-back calls of ``fn`` captured in one CUDA graph, timed by :func:`replay`.

    ``calls=None``: :func:`reps_for` chooses (about 2 ms of work per replay, 1 to 20 calls).
    """
    n = reps_for(fn) if calls is None else calls
    _check(n, rule)
    g = capture(fn, calls=n)
    try:
        return replay(g, calls=n, flush_l2=flush_l2, rule=rule)
    finally:
        del g


def eager(fn: Callable[[], object], *, flush_l2: bool = False, rule: Rule = STANDARD) -> Timing:
    """``fn`` called from Python, each sample timed with CUDA events (µs per call)."""
    _check(1, rule)
    return _events(fn, 1, rule, flush_l2, "eager")


def _sync(device: torch.device | str | None) -> None:
    if device is None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def host(
    fn: Callable[[], object],
    *,
    calls: int = 1,
    rule: Rule = STANDARD,
    device: torch.device | str | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Wall-clock µs per call of ``calls`` back-to-back calls of ``fn``, the device synchronised before and after
    each sample (``device``: the one to synchronise; ``None``: the current CUDA device if CUDA is in use, none on
    the CPU). ``clock`` is the timer (seconds), replaceable in tests."""
    _check(calls, rule)
    out = [host_sample_us(fn, calls, device, clock) for _ in range(rule.warmup + rule.samples)]
    return summarize(out[rule.warmup :], calls, "host")


def host_sample_us(
    fn: Callable[[], object],
    calls: int = 1,
    device: torch.device | str | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """One :func:`host` sample: wall µs per call of ``calls`` back-to-back calls, the device idle before and
    drained after (for a benchmark that interleaves the samples of several calls itself)."""
    _sync(device)
    t0 = clock()
    for _ in range(calls):
        fn()
    _sync(device)
    return (clock() - t0) * 1e6 / calls


def graph_row(
    fn: Callable[[], object],
    *,
    calls: int | None = None,
    flush_l2: bool = False,
    rule: Rule = STANDARD,
    fallback: bool = False,
) -> dict[str, Any]:
    """:func:`graph` as a result row: ``{"median_us", "p20_us", "p80_us", "reps"}`` (``reps``: the calls per graph).

    ``fallback=True``: the row also says ``"timing": "graph"``, and a call that cannot be captured is timed by
    :func:`eager` instead (``"timing": "events"``, with ``"capture_error"``).
    """
    n = reps_for(fn) if calls is None else calls
    try:
        row: dict[str, Any] = graph(fn, calls=n, flush_l2=flush_l2, rule=rule).as_dict() | {"reps": n}
    except Exception as e:  # noqa: BLE001 - recorded, then timed another way
        if not fallback:
            raise
        torch.cuda.synchronize()
        err = f"{type(e).__name__}: {e}"[:300]
        return eager(fn, flush_l2=flush_l2, rule=rule).as_dict() | {"timing": "events", "capture_error": err}
    return row | {"timing": "graph"} if fallback else row


def reps_for(fn: Callable[[], object], target_us: float = 2000.0, most: int = 20) -> int:
    """Calls per graph for about ``target_us`` of work per replay (1 to ``most``), from one eager estimate."""
    est = eager(fn, rule=Rule(warmup=1, samples=3)).median_us
    return max(1, min(most, int(target_us / max(est, 1e-3))))


#: Back-to-back calls per graph when one stage is timed alone (:func:`stage`).
STAGE_CALLS = 20


def stage(fn: Callable[[], object], rule: Rule = STANDARD) -> Timing:
    """One stage of a layer alone, as it costs *inside* the layer's graph: :data:`STAGE_CALLS` back-to-back calls
    captured in one graph, µs per call. A graph of one call, replayed alone, adds the replay's launch latency
    (about 8 µs on the H200, the same for every kernel) that a layer's graph pays once, not once per stage."""
    return graph(fn, calls=STAGE_CALLS, rule=rule)


def _cold_buffer() -> torch.Tensor:
    return torch.empty(COLD_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")


def cold(fn: Callable[[], object], *, calls: int = STAGE_CALLS, rule: Rule = STANDARD) -> Timing:
    """``fn`` from a cold L2, as a layer's stage or a layer meets its inputs (the caches of the layer before
    evicted them): a graph of ``calls`` pairs (zero :data:`COLD_FLUSH_BYTES`, then ``fn``), less a graph of the
    ``calls`` flushes alone, µs per call. Inside one graph no replay's launch latency is counted (as
    :func:`stage`); the flush's dirty lines left in L2 are written back while ``fn`` runs, as in
    ``triton.testing.do_bench``. Median (p20/p80) of the pair graph less the flush graph's median."""
    _check(calls, rule)
    buf = _cold_buffer()

    def pair() -> None:
        buf.zero_()
        fn()

    g_pair, g_flush = capture(pair, calls=calls), capture(buf.zero_, calls=calls)
    try:
        both, flush = replay(g_pair, calls=calls, rule=rule), replay(g_flush, calls=calls, rule=rule)
    finally:
        del g_pair, g_flush
    d = flush.median_us
    return Timing(both.median_us - d, both.p20_us - d, both.p80_us - d, both.samples, calls, "graph")


def kernel_breakdown(g: Any, *, replays: int = 10) -> list[dict[str, Any]]:
    """The kernels one replay of the captured graph ``g`` runs, in launch order, from a ``torch.profiler`` trace of
    ``replays`` back-to-back replays: ``{"name", "us"}`` per kernel (mean device time per replay), plus a last row
    ``{"name": "(span)", "us"}``: first kernel start to last kernel end of one replay, gaps included (mean)."""
    from torch.profiler import ProfilerActivity, profile

    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )  # fmt: skip
    if not kernels or len(kernels) % replays:  # the trace lost some: the totals by name instead
        avg = prof.key_averages()
        rows = [{"name": a.key[:120], "us": a.device_time_total / replays, "count": a.count / replays}
                for a in avg if a.device_time_total > 0]  # fmt: skip
        return [*rows, {"name": "(trace unordered)", "us": float("nan")}]
    per = len(kernels) // replays
    rows = []
    for i in range(per):
        ks = kernels[i::per]
        rows.append({"name": ks[0].name[:120], "us": sum(e.time_range.elapsed_us() for e in ks) / replays})
    spans = [kernels[j * per + per - 1].time_range.end - kernels[j * per].time_range.start for j in range(replays)]
    rows.append({"name": "(span)", "us": sum(spans) / replays})
    return rows
