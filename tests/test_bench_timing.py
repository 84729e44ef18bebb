"""The timer's statistics on synthetic samples, and its protocol on a fake clock.

Nothing here asserts on real time: the clock is replaced by one that each step advances
by a known amount, so the samples (and therefore median, IQR, min) are known exactly.
"""
import pytest

from qstate_cli.bench import timing
from qstate_cli.bench.timing import MIN_REPS, Stats, summarize


@pytest.mark.parametrize("samples, median, q1, q3, low", [
    ([1.0, 2.0, 3.0, 4.0], 2.5, 1.75, 3.25, 1.0),          # ranks 0.75, 1.5, 2.25 interpolated
    ([4.0, 1.0, 3.0, 2.0, 100.0], 3.0, 2.0, 4.0, 1.0),      # order does not matter; outlier only moves q3 a step
    ([10.0, 10.0, 10.0, 11.0], 10.0, 10.0, 10.25, 10.0),
    ([7.0], 7.0, 7.0, 7.0, 7.0),
])
def test_summarize_hand_computed(samples, median, q1, q3, low):
    st = summarize(samples)
    assert (st.median, st.q1, st.q3, st.min) == pytest.approx((median, q1, q3, low))
    assert st.iqr == pytest.approx(q3 - q1)
    assert st.samples == tuple(samples)


def test_noisy_flag_is_iqr_over_median_above_ten_percent():
    assert summarize([4.0, 1.0, 3.0, 2.0, 100.0]).noisy          # IQR 2 / median 3
    assert not summarize([10.0, 10.0, 10.0, 11.0]).noisy         # 0.25 / 10 = 2.5%
    # exactly 10% is not noisy; just above is
    assert not Stats(median=10.0, q1=9.5, q3=10.5, min=9.0, samples=()).noisy
    assert Stats(median=10.0, q1=9.5, q3=10.5001, min=9.0, samples=()).noisy


def test_summarize_refuses_no_samples():
    with pytest.raises(ValueError):
        summarize([])


class FakeClock:
    """perf_counter_ns that only moves when a step runs."""

    def __init__(self):
        self.ns = 0

    def __call__(self):
        return self.ns


def test_cpu_protocol_on_a_fake_clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter_ns", clock)
    durations = iter([50.0] + [2.0] * 10_000)  # the first call compiles: 50 ms, then 2 ms each
    events = []

    def step():
        clock.ns += int(next(durations) * 1e6)
        events.append("step")

    def prepare():
        events.append("prepare")

    t = timing.measure(step, "cpu", warmup_ms=10.0, rep_ms=40.0, prepare=prepare)
    assert t.first_ms == 50.0
    assert t.reps == 20 and len(t.stats.samples) == 20      # 40 ms / 2 ms per step
    assert t.stats.median == 2.0 and t.stats.iqr == 0.0 and t.stats.min == 2.0 and not t.stats.noisy
    # every step was preceded by prepare() (the gradient swap), outside the timed call
    assert events[0::2] == ["prepare"] * (len(events) // 2) and events[1::2] == ["step"] * (len(events) // 2)
    assert events.count("step") == 1 + timing.ESTIMATE_CALLS + 5 + 20   # first, estimate, warm-up, reps
    assert t.flush_bytes == 0 and not t.cuda_graph


def test_rep_count_bounds(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter_ns", clock)

    def slow():
        clock.ns += 10**9  # 1 s per step: the floor of MIN_REPS repetitions still applies
    assert timing.measure(slow, "cpu", warmup_ms=0, rep_ms=1.0).reps == MIN_REPS

    def fast():
        clock.ns += 1000  # 1 us per step: capped at MAX_REPS
    assert timing.measure(fast, "cpu", warmup_ms=0, rep_ms=10_000.0).reps == timing.MAX_REPS


def test_cuda_graph_needs_cuda():
    with pytest.raises(ValueError):
        timing.measure(lambda: None, "cpu", 1, 1, cuda_graph=True)


def test_copy_bandwidth_counts_read_plus_write():
    t, nbytes = timing.copy_bandwidth("cpu", 4096, warmup_ms=0, rep_ms=1)
    assert nbytes == 8 * 4096 and t.reps >= MIN_REPS and all(s > 0 for s in t.stats.samples)


@pytest.mark.cuda
def test_cuda_events_flush_and_graph():
    import torch

    x = torch.randn(1 << 20, device="cuda")
    t = timing.measure(lambda: x.mul_(1.0001), "cuda", warmup_ms=5, rep_ms=20)
    assert t.flush_bytes >= 2 * torch.cuda.get_device_properties(0).L2_cache_size and t.reps >= MIN_REPS
    g = timing.measure(lambda: x.mul_(1.0001), "cuda", warmup_ms=5, rep_ms=20, cuda_graph=True)
    assert g.cuda_graph and g.reps >= MIN_REPS


def test_the_first_calls_kernel_compilation_is_reported_apart(monkeypatch):
    """A first call that compiles kernels (runtime.COMPILES: the CPU path's numba kernels on a
    first use) reports those ms as compile_ms, and a bench row shows them; a later call that
    compiles (none should) does not count."""
    from qstate_cli import runtime
    from qstate_cli.bench.group import fill_timing

    clock = FakeClock()
    monkeypatch.setattr(timing.time, "perf_counter_ns", clock)
    monkeypatch.setattr(runtime.time, "perf_counter", lambda: clock.ns / 1e9)
    compiles = runtime.CompileClock()
    compiles.notice = lambda text: None
    monkeypatch.setattr(timing, "COMPILES", compiles)
    calls = [0]

    def step():
        calls[0] += 1
        if calls[0] in (1, 3):  # compiles 30 ms inside the first call (and, oddly, in a later one)
            compiles.begin("compiling")
            clock.ns += 30_000_000
            compiles.end()
        clock.ns += 2_000_000

    t = timing.measure(step, "cpu", reps=4, warmup_reps=3)
    assert t.first_ms == 32.0 and t.compile_ms == 30.0 and compiles.seconds == pytest.approx(0.06)
    row = {"bytes_moved": 1000}
    fill_timing(row, t)
    assert row["compile_ms"] == 30.0 and row["first_step_ms"] == 32.0
    t.compile_ms = 0.0
    row = {"bytes_moved": 1000}
    fill_timing(row, t)
    assert "compile_ms" not in row
