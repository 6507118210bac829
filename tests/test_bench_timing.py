"""``benchmarks/_timing.py``, the one timing rule of every benchmark, on the CPU: the host timer for real with a
fake clock, the CUDA-event timers with fake events (the warm-up / sample counts, the division by calls, the L2
flush outside the timed events), and the summary's median and quantiles against a brute-force computation."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def timing():
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("_timing")
    finally:
        sys.path.remove(str(BENCH))


class FakeClock:
    """A clock the timed function advances: each call takes ``step`` seconds (then ``step`` grows by ``grow``)."""

    def __init__(self, step: float, grow: float = 0.0) -> None:
        self.now, self.step, self.grow, self.calls = 0.0, step, grow, 0

    def __call__(self) -> float:
        return self.now

    def work(self) -> None:
        self.calls += 1
        self.now += self.step
        self.step += self.grow


def test_the_rule_is_one_and_documented(timing) -> None:
    assert (timing.STANDARD.warmup, timing.STANDARD.samples) == (timing.WARMUP, timing.SAMPLES) == (5, 50)
    assert timing.SWEEP.samples < timing.STANDARD.samples
    text = timing.describe("graph", 20, flush_l2=True)
    assert "20 back-to-back" in text and "L2 flushed" in text and "5 warm-up" in text and "median" in text
    with pytest.raises(ValueError, match="samples >= 1"):
        timing.Rule(warmup=0, samples=0)


def test_summary_is_the_median_and_quantiles(timing) -> None:
    xs = [5.0, 1.0, 4.0, 2.0, 3.0, 100.0]
    t = timing.summarize(xs, calls=2, mode="graph")
    ys = sorted(xs)
    assert t.median_us == (ys[2] + ys[3]) / 2  # even count: the mean of the middle two
    # inclusive quantiles by hand: position p * (n - 1) between sorted values
    for p, got in ((0.2, t.p20_us), (0.8, t.p80_us)):
        pos = p * (len(ys) - 1)
        lo = int(pos)
        assert got == pytest.approx(ys[lo] + (pos - lo) * (ys[lo + 1] - ys[lo]))
    assert (t.samples, t.calls, t.mode) == (6, 2, "graph")
    assert t.as_dict() == {"median_us": t.median_us, "p20_us": t.p20_us, "p80_us": t.p80_us}
    one = timing.summarize([7.0])
    assert one.median_us == one.p20_us == one.p80_us == 7.0
    with pytest.raises(ValueError, match="at least one sample"):
        timing.summarize([])


def test_host_timer_counts_warmup_and_divides_by_calls(timing) -> None:
    clock = FakeClock(step=3e-6, grow=1e-6)  # each call 1 µs slower than the last: the samples tell them apart
    rule = timing.Rule(warmup=2, samples=4)
    t = timing.host(clock.work, calls=3, rule=rule, device="cpu", clock=clock)
    assert clock.calls == (2 + 4) * 3
    # sample i (0-based, after 2 warm-up samples) holds calls 3i+6 .. 3i+8, each taking 3 + k µs for call k
    want = [sum(3 + k for k in range(3 * i, 3 * i + 3)) / 3 for i in range(2, 6)]
    assert t.median_us == pytest.approx(sorted(want)[1] / 2 + sorted(want)[2] / 2)
    assert t.samples == 4 and t.calls == 3 and t.mode == "host"
    with pytest.raises(ValueError, match="calls must be an int >= 1"):
        timing.host(clock.work, calls=0)


def test_host_timer_really_runs_on_the_cpu(timing) -> None:
    n = []
    t = timing.host(lambda: n.append(1), rule=timing.SMOKE)
    assert len(n) == timing.SMOKE.warmup + timing.SMOKE.samples and t.median_us >= 0


class FakeCuda:
    """``torch.cuda``'s events, synchronize and graphs, on a fake device clock advanced by the timed calls."""

    def __init__(self, us_per_call: float) -> None:
        self.now_ms, self.us, self.log = 0.0, us_per_call, []
        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.t: float | None = None

            def record(self) -> None:
                fake.log.append("record")
                self.t = fake.now_ms

            def elapsed_time(self, end: Event) -> float:
                assert self.t is not None and end.t is not None
                return end.t - self.t

        self.Event = Event

    def synchronize(self, *a: object) -> None:
        self.log.append("sync")

    def work(self) -> None:
        self.log.append("call")
        self.now_ms += self.us * 1e-3


def test_event_timers_with_a_fake_device(timing, monkeypatch) -> None:
    fake = FakeCuda(us_per_call=4.0)
    monkeypatch.setattr(timing.torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", fake.synchronize)
    monkeypatch.setattr(timing, "_flush", lambda: fake.log.append("flush"))
    rule = timing.Rule(warmup=3, samples=7)
    e = timing.eager(fake.work, rule=rule, flush_l2=True)
    assert e.median_us == pytest.approx(4.0) and e.samples == 7 and e.mode == "eager"
    assert fake.log.count("call") == 10
    first = fake.log.index("record")
    assert fake.log[:first] == ["call"] * 3 + ["sync", "flush"]  # warm-up untimed; the flush before the events
    assert fake.log[first : first + 4] == ["record", "call", "record", "flush"]
    assert fake.log[-1] == "sync" and fake.log.count("sync") == 2  # all samples read after one synchronisation

    class Graph:  # a graph of 5 calls: one replay = 5 calls of device time
        def replay(self) -> None:
            for _ in range(5):
                fake.work()

    fake.log.clear()
    r = timing.replay(Graph(), calls=5, rule=rule)
    assert r.median_us == pytest.approx(4.0) and r.calls == 5 and r.mode == "graph"
    assert "flush" not in fake.log and fake.log.count("call") == 5 * 10

    captured: list[int] = []
    monkeypatch.setattr(timing, "capture", lambda fn, calls=1, warmup=3: (captured.append(calls), Graph())[1])
    row = timing.graph_row(fake.work, calls=5, rule=rule)
    assert captured == [5] and row == {"median_us": pytest.approx(4.0), "p20_us": pytest.approx(4.0),
                                       "p80_us": pytest.approx(4.0), "reps": 5}  # fmt: skip

    def broken(fn, calls=1, warmup=3):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(timing, "capture", broken)
    fell = timing.graph_row(fake.work, calls=5, rule=rule, fallback=True)
    assert fell["timing"] == "events" and "capture_error" in fell and fell["median_us"] == pytest.approx(4.0)
    with pytest.raises(RuntimeError, match="capturing"):
        timing.graph_row(fake.work, calls=5, rule=rule)


def test_cold_times_the_call_less_the_flush_inside_one_graph(timing, monkeypatch) -> None:
    """``cold``: a graph of (flush, call) pairs less a graph of the flushes alone, each call's share."""
    fake = FakeCuda(us_per_call=4.0)
    monkeypatch.setattr(timing.torch.cuda, "Event", fake.Event)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", fake.synchronize)

    class Buffer:  # zeroing the flush buffer costs 10 µs of device time
        def zero_(self) -> None:
            fake.log.append("flush")
            fake.now_ms += 10e-3

    monkeypatch.setattr(timing, "_cold_buffer", Buffer)
    captured: list[int] = []

    class Graph:
        def __init__(self, fn, calls: int) -> None:
            self.fn, self.calls = fn, calls

        def replay(self) -> None:
            for _ in range(self.calls):
                self.fn()

    def capture(fn, calls=1, warmup=3):
        captured.append(calls)
        return Graph(fn, calls)

    monkeypatch.setattr(timing, "capture", capture)
    rule = timing.Rule(warmup=1, samples=3)
    t = timing.cold(fake.work, calls=6, rule=rule)
    assert t.median_us == pytest.approx(4.0) and t.calls == 6 and t.mode == "graph"
    assert captured == [6, 6]  # the pairs' graph, then the flushes' graph, of the same length
    assert fake.log.count("call") == 6 * 4 and fake.log.count("flush") == 2 * 6 * 4
    with pytest.raises(ValueError, match="calls must be an int >= 1"):
        timing.cold(fake.work, calls=0)
