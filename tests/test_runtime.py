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
