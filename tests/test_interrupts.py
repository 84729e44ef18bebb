"""Ctrl-C where it used to hurt. kernels/cpu/host.run_parts: the worker ranges write into the caller's tensors
by raw address, so a KeyboardInterrupt on the calling thread must wait for them before it
unwinds the frames owning those tensors (it freed them under running workers: "corrupted
double-linked list", exit 134, about 2 Ctrl-Cs in 16 during `qstate run`). No numba needed:
run_parts takes any callable."""
import threading
import time

import pytest

from qstate_cli.kernels.cpu import host


def test_an_interrupt_on_the_calling_thread_waits_for_the_other_ranges():
    done = threading.Event()

    def kernel(b0, b1, part):
        if part == 0:
            raise KeyboardInterrupt  # as if Ctrl-C landed between two calls on this thread
        time.sleep(0.3)
        done.set()
        return 0

    with pytest.raises(KeyboardInterrupt):
        host.run_parts(kernel, 1 << 20, 128, (), parts=2)
    assert done.is_set(), "the interrupt unwound while a worker range was still running"


def test_an_error_in_a_worker_range_waits_for_the_rest_and_propagates():
    finished = []

    def kernel(b0, b1, part):
        if part == 1:
            raise ValueError("range 1")
        time.sleep(0.2)
        finished.append(part)
        return 1

    with pytest.raises(ValueError, match="range 1"):
        host.run_parts(kernel, 1 << 20, 128, (), parts=3)
    assert sorted(finished) == [0, 2]


def test_ranges_cover_the_blocks_once_and_their_results_add_up():
    seen = []
    total = host.run_parts(lambda b0, b1, part: seen.append((b0, b1)) or (b1 - b0), 1000, 7, (), parts=4)
    assert total == -(-1000 // 7) and sorted(seen)[0][0] == 0
    assert all(a[1] == b[0] for a, b in zip(sorted(seen), sorted(seen)[1:]))


def test_ctrl_c_while_the_cli_loads_exits_130_without_a_traceback(monkeypatch, capsys):
    """The CLI imports torch for ~2 s; a Ctrl-C then printed a KeyboardInterrupt traceback.
    The import is made to raise it (deterministic: a real signal raced the interpreter's start)."""
    import sys
    import types

    from qstate_cli import __main__ as entry

    class Loading(types.ModuleType):
        def __getattr__(self, name):
            raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "qstate_cli.cli", Loading("qstate_cli.cli"))
    with pytest.raises(SystemExit) as exc:
        entry.main()
    assert exc.value.code == 130
    assert capsys.readouterr().err == "qstate: interrupted\n"
