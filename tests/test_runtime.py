"""The runtime module: one device rule, one out-of-memory test, threads restored, phase timer."""
import pytest
import torch

from qstate_cli import runtime
from qstate_cli.errors import QstateError


def test_device_rule():
    want_auto = "cuda" if torch.cuda.is_available() else "cpu"
    assert runtime.resolve_device("auto").type == want_auto and runtime.resolve_device(None).type == want_auto
    assert runtime.resolve_device("CPU") == torch.device("cpu")
    assert runtime.resolve_device(torch.device("cpu")) == torch.device("cpu")
    for bad in ("gpu", "cuda:x", "tpu"):
        with pytest.raises(QstateError, match="use auto, cpu or cuda"):
            runtime.resolve_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda_is_a_usage_error():
    for name in ("cuda", "cuda:1"):
        with pytest.raises(QstateError, match="CUDA is not available here"):
            runtime.resolve_device(name)


def test_out_of_memory_includes_the_cpu_allocator():
    with pytest.raises(RuntimeError) as real:  # 2**60 bytes: the CPU allocator refuses
        torch.empty(2**60, dtype=torch.uint8)
    assert runtime.is_oom(real.value), str(real.value)
    assert runtime.is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert runtime.is_oom(RuntimeError("CUDA error: out of memory")) and runtime.is_oom(MemoryError())
    assert not runtime.is_oom(RuntimeError("shape mismatch")) and not runtime.is_oom(ValueError("out of memory"))


def test_torch_threads_restores_the_count():
    before = torch.get_num_threads()
    with runtime.torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(KeyError), runtime.torch_threads(1):
        raise KeyError("even on an error")
    assert torch.get_num_threads() == before
    with runtime.torch_threads(None):
        assert torch.get_num_threads() == before


def test_timer_sums_phases_on_a_fake_clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(runtime.time, "perf_counter", lambda: now[0])
    timer = runtime.Timer("cpu", sync=True)  # sync means nothing on a CPU
    for dt in (0.5, 0.25):
        with timer("a"):
            now[0] += dt
    with pytest.raises(ValueError), timer("b"):
        now[0] += 1.0
        raise ValueError  # a phase that raises is still charged
    assert timer.totals == {"a": 0.75, "b": 1.0} and timer.seconds == 1.75
    assert timer.exact and not timer.sync


def test_workers_call_each_item_once_and_wait_for_all():
    """Three threads over 30 items: every item once, `each` returns only when all are done
    (the slow items finish after the fast ones were taken), and more than one thread works."""
    import threading
    import time

    done, threads = [], set()

    def work(k):
        time.sleep(0.002 if k % 3 == 0 else 0.0)
        threads.add(threading.get_ident())
        done.append(k)

    with runtime.Workers(3) as workers:
        for _ in range(2):
            done.clear()
            workers.each(work, list(range(30)))
            assert sorted(done) == list(range(30))
    assert len(threads) > 1


def test_workers_raise_a_call_error_after_every_thread_stopped():
    import time

    finished = []

    def work(k):
        if k == 1:
            raise KeyError("item 1")
        time.sleep(0.01)
        finished.append(k)

    with runtime.Workers(2) as workers, pytest.raises(KeyError, match="item 1"):
        workers.each(work, [0, 1, 2, 3])
    assert sorted(finished) == [0, 2, 3]  # the other items ran to their end before `each` raised


def test_one_worker_runs_in_order_on_this_thread():
    import threading

    seen = []
    with runtime.Workers(1) as workers:
        workers.each(lambda k: seen.append((k, threading.get_ident())), [3, 1, 2])
    assert seen == [(3, threading.get_ident()), (1, threading.get_ident()), (2, threading.get_ident())]


def test_compile_clock_counts_outermost_compiles_and_tells_once(monkeypatch):
    """Nested compilations (a kernel compiling what it calls) count once, by the outermost's
    wall time; the notice comes on the first begin only; Timer charges a phase with the
    compile seconds that ended inside it."""
    now = [0.0]
    monkeypatch.setattr(runtime.time, "perf_counter", lambda: now[0])
    clock, told = runtime.CompileClock(), []
    clock.notice = told.append
    monkeypatch.setattr(runtime, "COMPILES", clock)
    timer = runtime.Timer("cpu")
    with timer("first"):
        clock.begin("compiling")
        now[0] += 2.0
        clock.begin("inner")  # nested: no notice, no count
        now[0] += 3.0
        clock.end()
        clock.end()
        now[0] += 1.0  # the phase's own work
    with timer("second"):
        now[0] += 4.0
        clock.begin("again")
        now[0] += 0.5
        clock.end()
    with timer("third"):
        now[0] += 1.0
    assert told == ["compiling"] and clock.count == 2 and clock.seconds == 5.5
    assert timer.totals == {"first": 6.0, "second": 4.5, "third": 1.0}
    assert timer.compiled == {"first": 5.0, "second": 0.5}


def fake_clocks(monkeypatch):
    """([now]: perf_counter's reading, moved by hand; a quiet CompileClock as runtime.COMPILES)."""
    now = [0.0]
    monkeypatch.setattr(runtime.time, "perf_counter", lambda: now[0])
    clock = runtime.CompileClock()
    clock.notice = lambda text: None
    monkeypatch.setattr(runtime, "COMPILES", clock)
    return now, clock


def test_compile_clock_holds_count_the_loads_apart_from_the_compiles(monkeypatch):
    """The compiler's holds (numba's lock: a compilation, or a load from the disk cache)
    count once when nested, in `held`; Timer charges a phase with what of them was no
    compilation (a load)."""
    now, clock = fake_clocks(monkeypatch)
    timer = runtime.Timer("cpu")
    with timer("loads"):
        clock.enter()
        now[0] += 0.25  # a load: the lock held, nothing compiled
        clock.enter()  # nested hold
        now[0] += 0.5
        clock.leave()
        clock.leave()
        now[0] += 1.0
    with timer("compiles"):
        clock.enter()
        now[0] += 0.5  # typing, then a compilation inside the hold
        clock.begin("compiling")
        now[0] += 4.0
        clock.end()
        clock.leave()
    assert clock.held == 5.25 and clock.seconds == 4.0
    assert timer.loaded == {"loads": 0.75, "compiles": 0.5} and timer.compiled == {"compiles": 4.0}


def test_timer_setup_is_the_first_call_beyond_the_mean_of_the_others(monkeypatch):
    """Timer.setup: a phase's first call (less what it loaded) beyond the mean of its other
    calls (less theirs); nothing for a phase called once or whose first call was no slower."""
    now, clock = fake_clocks(monkeypatch)
    timer = runtime.Timer("cpu")
    with timer("step"):
        clock.enter()
        now[0] += 0.5  # a load: left to Timer.loaded
        clock.leave()
        now[0] += 1.25  # 1.0 of one-time work beside a step's 0.25
    for dt in (0.25, 0.375, 0.125):  # mean 0.25
        with timer("step"):
            now[0] += dt
            if dt == 0.375:  # a compilation in a later call: left to Timer.compiled
                clock.begin("compiling")
                now[0] += 2.0
                clock.end()
    with timer("once"):
        now[0] += 3.0
    for dt in (0.5, 0.5):
        with timer("even"):
            now[0] += dt
    assert timer.loaded == {"step": 0.5} and timer.compiled == {"step": 2.0}
    assert timer.first == {"step": 1.25, "once": 3.0, "even": 0.5} and timer.calls == {"step": 4, "once": 1, "even": 2}
    assert timer.setup == {"step": 1.0}


def test_step_clock_counts_what_the_steps_held_once_and_the_first_steps_extra(monkeypatch):
    """StepClock: per step its wall seconds and what of them numba's compiler was held
    (compiling, or loading), each counted once whatever ran inside; setup_s, the first step
    (less what it held) beyond the mean of the others (less theirs)."""
    now, clock = fake_clocks(monkeypatch)
    steps = runtime.StepClock()
    assert steps.setup_s == 0.0
    with steps():
        clock.enter()
        now[0] += 0.5  # a load
        clock.begin("compiling")
        now[0] += 3.0
        clock.end()
        clock.leave()
        now[0] += 1.5  # 1.0 of one-time work beside a step's 0.5
    assert steps.setup_s == 0.0  # one step: nothing to compare with
    for dt in (0.5, 0.75, 0.25):
        with steps():
            now[0] += dt
            if dt == 0.75:  # a load in a later step: left out of its step too
                clock.enter()
                now[0] += 2.0
                clock.leave()
    assert steps.compiled_s == 3.0 and steps.loaded_s == 2.5 and steps.setup_s == 1.0


def test_compile_clock_warns_once_without_a_notice():
    """A training script (no CLI notice) sees one CompileNotice warning on the first compile:
    it had gone to an INFO log nobody reads while the first step compiled for 24 s."""
    clock = runtime.CompileClock()
    with pytest.warns(runtime.CompileNotice) as seen:
        clock.begin("compiling the kernels")
        clock.begin("nested")
        clock.end()
        clock.end()
        clock.begin("second")
        clock.end()
    assert [str(w.message) for w in seen] == ["compiling the kernels"] and clock.count == 2


def test_timer_counts_every_call_of_one_phase_timed_by_threads_side_by_side():
    """validate.py's runs time one configuration's phase from two threads at once: no call or
    second is lost (each update is a read-modify-write of the phase's entries)."""
    import sys
    import threading

    timer, calls, threads = runtime.Timer(), 20000, 4
    go = threading.Barrier(threads)

    def work():
        go.wait()
        for _ in range(calls):
            with timer("config"):
                pass

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as it can, inside the updates too
    try:
        pool = [threading.Thread(target=work) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert timer.calls == {"config": threads * calls}
    assert timer.totals["config"] > 0
