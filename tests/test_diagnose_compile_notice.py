"""runtime.CompileClock's notices: the first compilation of a process says so at once; a later
burst of compilations (another kernel family) says so when one is still running after
LATER_NOTICE_S; a short one says nothing (no minutes of numba: begin/end driven by hand, on a
fake clock, and the notice timer fired by hand when the fake clock reaches it, both given to the clock: real sleeps
and timer threads gave these tests 50-100 ms of slack on a loaded 2-core CI runner)."""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from qstate_cli import runtime


class FakeTimers:
    """A CompileClock's wall clock and notice timer, on a clock moved by `wait`: a timer
    armed at t with delay d fires (its function runs, as the thread would) when the clock
    reaches t + d."""

    def __init__(self):
        self.now, self.pending, self.started = 0.0, [], 0

    def clock(self) -> float:
        return self.now

    def timer(self, delay, fn, args=()):
        self.started += 1
        due = self.now + delay
        return SimpleNamespace(daemon=False, start=lambda: self.pending.append((due, fn, args)))

    def wait(self, seconds: float) -> None:
        self.now += seconds
        for item in sorted((p for p in self.pending if p[0] <= self.now), key=lambda p: p[0]):
            self.pending.remove(item)
            item[1](*item[2])


def _clock(t: FakeTimers, told):
    clock = runtime.CompileClock(t.clock, t.timer)  # LATER_NOTICE_S 2 s, QUIET_S 5 s, as in use
    clock.notice = told.append
    return clock


def test_first_and_each_later_long_burst_say_so():
    t, told = FakeTimers(), []
    clock = _clock(t, told)
    clock.begin("first")
    clock.begin("nested")  # a kernel's compilation compiles what it calls: one compilation
    clock.end(); clock.end()
    assert told == ["first"]
    clock.begin("x"); clock.end()  # the same burst (no quiet gap), short: nothing more
    t.wait(6)
    clock.begin("x"); t.wait(1); clock.end()  # a later burst, over before LATER_NOTICE_S: nothing
    t.wait(3)  # its timer fired, found nothing compiling
    assert told == ["first"] and t.started == 1
    t.wait(6)
    clock.begin("x")  # a later burst, still compiling after LATER_NOTICE_S: said once
    t.wait(1.9)
    assert told == ["first"]
    t.wait(0.2)
    assert told == ["first", clock.LATER_TEXT]
    clock.end()
    clock.begin("x"); t.wait(3); clock.end()  # the same burst: not again
    assert told == ["first", clock.LATER_TEXT]
    assert clock.count == 5 and clock.seconds == pytest.approx(1 + 2.1 + 3)  # outermost compilations' fake seconds


def test_a_script_gets_warnings():
    t = FakeTimers()
    clock = _clock(t, [])
    clock.notice = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        clock.begin("compiling"); clock.end()
        t.wait(6)
        clock.begin("again")
        t.wait(2.5)
        clock.end()
    texts = [str(w.message) for w in caught if issubclass(w.category, runtime.CompileNotice)]
    assert texts == ["compiling", clock.LATER_TEXT]


def test_one_pending_timer_per_burst():
    """Many short compilations of a later burst arm one timer, not one each."""
    t, told = FakeTimers(), []
    clock = _clock(t, told)
    clock.begin("first"); clock.end()
    t.wait(6)
    for _ in range(50):  # a later burst of short compilations, inside LATER_NOTICE_S
        clock.begin("x"); t.wait(0.01); clock.end()
    assert t.started == 1 and len(t.pending) == 1
    t.wait(2)  # the timer fired, found nothing compiling: the burst's next begin arms again
    assert t.pending == [] and told == ["first"]
    clock.begin("x")
    assert t.started == 2
    t.wait(2.5)
    clock.end()
    assert told == ["first", clock.LATER_TEXT]
