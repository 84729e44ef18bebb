"""Timing an optimizer step: warm-up and repetitions in milliseconds, every sample kept.

    summarize(samples_ms) -> Stats(median, q1, q3, iqr, min, noisy)

Quartiles are numpy's linear-interpolation percentiles (the default method): for sorted
samples s_0..s_{n-1}, the p-th percentile sits at rank r = p/100 * (n - 1) and is
s_floor(r) + (r - floor(r)) * (s_ceil(r) - s_floor(r)). IQR = q3 - q1. A row is `noisy`
when IQR / median > 10%.

How a step is timed (`measure`):
- the first call is timed alone with the host clock (`first_ms`): it allocates lazily
  created state and runs any compiler (torch.compile, Triton JIT);
- a few calls estimate the per-call time; warm-up then runs for `warmup_ms` and the
  timed repetitions for `rep_ms` (at least MIN_REPS, at most MAX_REPS);
- before each repetition, outside the timed region: `prepare()` (the caller rotates
  gradient sets there) and, on CUDA, a write over a buffer twice the device's L2, so
  every repetition starts with a cold L2, as a training step does after backward;
- CUDA: one pair of CUDA events around each repetition (elapsed_time, ms); CPU:
  time.perf_counter_ns around each call (a monotonic clock). CPU caches are not
  flushed (the CPU numbers time the reference path, not a roofline).

`cuda_graph=True` captures one call into a CUDA graph (after a warm-up on a side
stream, as torch's docs ask) and times its replays: launch gaps shrink to what the
graph keeps. Capture fails for steps that synchronize with the host; the caller
reports that row as unavailable in graph mode (or times the plain calls instead).

A fixed count instead of a time budget: `reps=N` (and `warmup_reps=W`, the first call
included) takes exactly N samples after W warm-up calls; the estimate is skipped.
`Timing.clock` names how the samples were taken: "host-clock" (CPU), "cuda-events",
"cuda-graph" (events around graph replays).

Rounds (`measure_rounds`): several steps timed interleaved, so a change in machine load
hits each of them alike. Round 0 times items A B C with a budget of rep_ms / R each (at
least ceil(MIN_REPS / R) reps, warm-up as above); every later round repeats round 0's
rep count per item, after one warm-up call, in alternating order (C B A, A B C, ...), so
no item always runs first or last. Before each round and after the last, `cpu_share`
probes how much of the CPU this process got:

    cpu_share = CPU time of this thread / wall time, over a fixed busy loop

~1.0 on a quiet machine; with k runnable threads competing for c cores, ~c / k (two busy
loops plus this one on 2 cores: ~0.67). It says whether the machine was shared while the
samples were taken, which the samples themselves cannot tell.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..runtime import COMPILES

NOISY_IQR_FRACTION = 0.10
MIN_REPS = 5
MAX_REPS = 500
ESTIMATE_CALLS = 3
CPU_SHARE_BUSY_MS = 25.0


class CaptureFailed(RuntimeError):
    """The step could not be captured into a CUDA graph (it syncs with the host, ...)."""


@dataclass(frozen=True)
class Stats:
    """Summary of timing samples, all in milliseconds."""

    median: float
    q1: float
    q3: float
    min: float
    samples: tuple[float, ...] = field(repr=False)

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def noisy(self) -> bool:
        """IQR / median > 10%."""
        return self.median > 0 and self.iqr / self.median > NOISY_IQR_FRACTION


def summarize(samples_ms) -> Stats:
    """Median, quartiles (linear interpolation) and minimum of `samples_ms`."""
    s = np.asarray(list(samples_ms), dtype=np.float64)
    if s.size == 0:
        raise ValueError("no timing samples")
    q1, med, q3 = np.percentile(s, [25, 50, 75])
    return Stats(float(med), float(q1), float(q3), float(s.min()), tuple(float(x) for x in s))


@dataclass
class Timing:
    stats: Stats
    first_ms: float  # the first call alone (state allocation, compilation)
    reps: int
    flush_bytes: int
    cuda_graph: bool
    clock: str = "host-clock"  # how the samples were taken: host-clock | cuda-events | cuda-graph
    compile_ms: float = 0.0  # of first_ms: kernel compilation (runtime.COMPILES: the CPU path's numba kernels)


def l2_flush_bytes(device: torch.device) -> int:
    """Twice the device's L2 (at least 8 MiB) on CUDA; 0 (no flush) on CPU."""
    if device.type != "cuda":
        return 0
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 * 2**20
    return max(2 * int(l2), 8 * 2**20)


def _reps(per_call_ms: float, budget_ms: float, lo: int, hi: int) -> int:
    if per_call_ms <= 0:
        return hi
    return int(min(hi, max(lo, round(budget_ms / per_call_ms))))


@dataclass(frozen=True)
class _Plan:
    """How many calls to make: from time budgets (ms) and a per-call estimate, or fixed."""

    warmup_ms: float
    rep_ms: float
    reps: int | None = None  # fixed: exactly this many samples (no estimate)
    warmup_reps: int = 1  # fixed: warm-up calls, the first call included
    min_reps: int = MIN_REPS  # budgeted: at least this many samples

    @property
    def fixed(self) -> bool:
        return self.reps is not None

    def warmups(self, per_call_ms: float, floor: int) -> int:
        """Warm-up calls after the first (and after the estimate, when there is one)."""
        if self.fixed:
            return max(0, self.warmup_reps - 1)
        return _reps(per_call_ms, self.warmup_ms, floor, MAX_REPS)

    def samples(self, per_call_ms: float) -> int:
        return self.reps if self.fixed else _reps(per_call_ms, self.rep_ms, self.min_reps, MAX_REPS)


def measure(fn: Callable[[], object], device, warmup_ms: float = 0.0, rep_ms: float = 0.0,
            prepare: Callable[[], None] | None = None, cuda_graph: bool = False,
            reps: int | None = None, warmup_reps: int = 1, min_reps: int = MIN_REPS) -> Timing:
    """Time repeated calls of `fn` (each one real optimizer step) on `device`: time
    budgets in ms (at least `min_reps` samples), or exactly `reps` samples after
    `warmup_reps` warm-up calls."""
    device = torch.device(device)
    prepare = prepare or (lambda: None)
    if reps is not None and reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    plan = _Plan(float(warmup_ms), float(rep_ms), reps, int(warmup_reps), max(1, int(min_reps)))
    if device.type == "cuda":
        return _measure_cuda(fn, device, plan, prepare, cuda_graph)
    if cuda_graph:
        raise ValueError("CUDA graphs need a CUDA device")
    return _measure_cpu(fn, plan, prepare)


def _host_ms(fn) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e6


def _first_ms(fn) -> tuple[float, float]:
    """(ms of the first call, ms of it spent compiling kernels: runtime.COMPILES)."""
    c0 = COMPILES.seconds
    ms = _host_ms(fn)
    return ms, (COMPILES.seconds - c0) * 1e3


def _measure_cpu(fn, plan: _Plan, prepare) -> Timing:
    prepare()
    first, compiled = _first_ms(fn)
    per_call = 0.0
    if not plan.fixed:
        est = []
        for _ in range(ESTIMATE_CALLS):
            prepare()
            est.append(_host_ms(fn))
        per_call = float(np.median(est))
    for _ in range(plan.warmups(per_call, 0)):
        prepare()
        fn()
    samples = []
    for _ in range(plan.samples(per_call)):
        prepare()
        samples.append(_host_ms(fn))
    return Timing(summarize(samples), first, len(samples), 0, False, compile_ms=compiled)


def _measure_cuda(fn, device, plan: _Plan, prepare, cuda_graph) -> Timing:
    with torch.cuda.device(device):
        flush_bytes = l2_flush_bytes(device)
        cache = torch.empty(flush_bytes // 4, dtype=torch.int32, device=device)
        torch.cuda.synchronize()
        prepare()
        first, compiled = _first_ms(lambda: (fn(), torch.cuda.synchronize()))
        if cuda_graph:
            fn = _capture(fn)
            prepare = lambda: None  # noqa: E731 - a graph replays fixed buffers
        per_call = 0.0
        if not plan.fixed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(ESTIMATE_CALLS):
                prepare()
                cache.zero_()
                fn()
            end.record()
            torch.cuda.synchronize()
            per_call = start.elapsed_time(end) / ESTIMATE_CALLS
        for _ in range(plan.warmups(per_call, 1)):
            prepare()
            fn()
        n = plan.samples(per_call)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            prepare()
            cache.zero_()  # outside the timed region: queued before the start event
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return Timing(summarize(samples), first, n, flush_bytes, cuda_graph,
                  "cuda-graph" if cuda_graph else "cuda-events", compiled)


def _capture(fn):
    """Capture one call of fn into a CUDA graph; returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # noqa: BLE001 - reported on the row, the sweep goes on
        raise CaptureFailed(f"{type(exc).__name__}: {exc}") from exc
    return graph.replay


def copy_item(device, numel: int) -> "Item":
    """A device-to-device copy of `numel` fp32 values (random, never zeros), to time:
    bytes moved = 4 * numel read + 4 * numel written."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(0)
    src = torch.rand(numel, generator=gen, device=device)
    dst = torch.empty_like(src)
    return Item(lambda: dst.copy_(src))


def copy_bandwidth(device, numel: int, warmup_ms: float, rep_ms: float) -> tuple[Timing, int]:
    """Time a copy of `numel` fp32 values (copy_item). Returns (timing, bytes_moved);
    GB/s = bytes_moved / median time."""
    timing = measure(copy_item(device, numel).fn, device, warmup_ms, rep_ms)
    return timing, 8 * numel


def cpu_share(busy_ms: float = CPU_SHARE_BUSY_MS) -> tuple[float, float]:
    """(CPU seconds this thread got, wall seconds) over a busy loop of `busy_ms` wall
    milliseconds; their quotient is the CPU share (see module docstring)."""
    c0, t0 = time.thread_time(), time.perf_counter()
    end = t0 + busy_ms / 1e3
    x = 0
    while time.perf_counter() < end:
        for i in range(200):
            x += i
    return time.thread_time() - c0, time.perf_counter() - t0


@dataclass
class Rounds:
    """One item's timings, one per round (a Timing of that round's samples)."""

    timings: list[Timing]

    @property
    def stats(self) -> Stats:
        """All samples of all rounds together."""
        return summarize([x for t in self.timings for x in t.stats.samples])

    @property
    def round_medians(self) -> list[float]:
        return [t.stats.median for t in self.timings]

    @property
    def timing(self) -> Timing:
        """The rounds as one Timing: all samples; the first call of round 0."""
        first = self.timings[0]
        return Timing(self.stats, first.first_ms, sum(t.reps for t in self.timings), first.flush_bytes,
                      first.cuda_graph, first.clock, first.compile_ms)


@dataclass
class RoundsResult:
    """What `measure_rounds` returns: per item its Rounds or the exception it raised;
    the CPU-share probes (cpu seconds, wall seconds) taken around the rounds."""

    items: list[Rounds | BaseException]
    probes: list[tuple[float, float]]

    @property
    def cpu_share(self) -> float | None:
        """The lowest probe's CPU seconds over wall seconds: one shared probe marks the
        group shared (a sum over the probes averaged an intermittent load away)."""
        got = [c / w for c, w in self.probes if w > 0]
        return min(got) if got else None


@dataclass(frozen=True)
class Item:
    """One thing to time in rounds: the call, what runs before each call outside the
    timed region, and whether to time CUDA graph replays."""

    fn: Callable[[], object]
    prepare: Callable[[], None] | None = None
    cuda_graph: bool = False


def measure_rounds(items: list[Item], device, rounds: int, warmup_ms: float, rep_ms: float,
                   probe: Callable[[], tuple[float, float]] = cpu_share) -> RoundsResult:
    """Time `items` interleaved in `rounds` rounds (see module docstring). An item whose
    call raises (Exception) keeps that exception and leaves the later rounds; Ctrl-C
    (KeyboardInterrupt) is not caught."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    device = torch.device(device)
    out: list[list[Timing] | BaseException] = [[] for _ in items]
    probes = []
    min_reps = math.ceil(MIN_REPS / rounds)
    for r in range(rounds):
        probes.append(probe())
        order = range(len(items)) if r % 2 == 0 else reversed(range(len(items)))
        for i in order:
            if isinstance(out[i], BaseException):
                continue
            item = items[i]
            try:
                if r == 0:
                    t = measure(item.fn, device, warmup_ms, rep_ms / rounds, item.prepare, item.cuda_graph,
                                min_reps=min_reps)
                else:
                    t = measure(item.fn, device, prepare=item.prepare, cuda_graph=item.cuda_graph,
                                reps=out[i][0].reps, warmup_reps=1)
            except Exception as exc:  # noqa: BLE001 - the caller turns it into the row's status
                out[i] = exc
            else:
                out[i].append(t)
    probes.append(probe())
    return RoundsResult([o if isinstance(o, BaseException) else Rounds(o) for o in out], probes)
