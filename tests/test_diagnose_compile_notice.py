"""runtime.CompileClock's notices: the first compilation of a process says so at once; a later
burst of compilations (another kernel family) says so when one is still running after
LATER_NOTICE_S; a short one says nothing (no minutes of numba: begin/end driven by hand)."""
from __future__ import annotations

import time
import warnings

from qstate_cli import runtime


def _clock(monkeypatch, told):
    clock = runtime.CompileClock()
    monkeypatch.setattr(clock, "LATER_NOTICE_S", 0.05)
    monkeypatch.setattr(clock, "QUIET_S", 0.2)
    clock.notice = told.append
    return clock


def test_first_and_each_later_long_burst_say_so(monkeypatch):
    told = []
    clock = _clock(monkeypatch, told)
    clock.begin("first")
    clock.begin("nested")  # a kernel's compilation compiles what it calls: one compilation
    clock.end(); clock.end()
    assert told == ["first"]
    clock.begin("x"); clock.end()  # the same burst (no quiet gap), short: nothing more
    time.sleep(0.3)
    clock.begin("x"); clock.end()  # a later burst, short: nothing
    time.sleep(0.15)
    assert told == ["first"]
    time.sleep(0.3)
    clock.begin("x")  # a later burst, still compiling after LATER_NOTICE_S: said once
    time.sleep(0.15)
    clock.end()
    clock.begin("x"); time.sleep(0.1); clock.end()  # the same burst: not again
    assert told == ["first", clock.LATER_TEXT]
    assert clock.count == 5


def test_a_script_gets_warnings(monkeypatch):
    clock = _clock(monkeypatch, [])
    clock.notice = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        clock.begin("compiling"); clock.end()
        time.sleep(0.3)
        clock.begin("again")
        time.sleep(0.15)
        clock.end()
    texts = [str(w.message) for w in caught if issubclass(w.category, runtime.CompileNotice)]
    assert texts == ["compiling", clock.LATER_TEXT]


def test_one_pending_timer_per_burst(monkeypatch):
    """Many short compilations of a later burst arm one timer, not one each."""
    told, started = [], []
    clock = _clock(monkeypatch, told)
    real = runtime.threading.Timer

    def timer(*a, **k):
        t = real(*a, **k)
        started.append(t)
        return t

    monkeypatch.setattr(runtime.threading, "Timer", timer)
    clock.begin("first"); clock.end()
    time.sleep(0.3)
    for _ in range(50):  # a later burst of short compilations, inside LATER_NOTICE_S
        clock.begin("x"); clock.end()
    assert len(started) == 1
    time.sleep(0.1)  # the timer fired, found nothing compiling: the burst's next begin arms again
    clock.begin("x")
    assert len(started) == 2
    time.sleep(0.15)
    clock.end()
    assert told == ["first", clock.LATER_TEXT]
