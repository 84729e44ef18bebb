"""What `bench memory`'s state_bytes counts (docs/bench.md, "How much memory?"): each
storage of two or more elements once, and each one-element counter once for every
parameter that holds it, whichever path stepped it. The fused paths share their step and
since_reset counters between a group's tensors, so what they hold is less than what is
counted: the docs said only "each storage is counted once" and "every path counts 5 int64
counters per tensor", which disagree on the numba path."""
import importlib.util

import pytest
import torch

from qstate_cli.bench.workset import Tensors
from qstate_cli.bench.memory import MemoryOptions, optimizer_state_bytes, plan
from qstate_cli.bench.subjects import Context

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

SHAPES = "64x128*2,4096,128*3"  # 6 tensors: 3 quantized, 3 under 4096 elements (fp32 states)
N_TENSORS = 6
COUNTERS = 5 * 8  # step, since_reset, nonfinite, m.written, v.written: int64 each


def held_bytes(opt) -> int:
    """Every distinct storage reachable from opt.state once, counters included: what the
    optimizer holds."""
    seen, total = set(), 0
    stack = list(opt.state.values())
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            key = (str(obj.device), storage.data_ptr(), storage.nbytes())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(obj, dict):
            stack += list(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack += list(obj)
    return total


def stepped(backend: str):
    p = plan(MemoryOptions(model=[SHAPES], config=["bred-4bit"], baseline=["none"], device="cpu", backend=backend))
    (target,), (subject,) = p.targets, p.subjects
    tensors = Tensors(target.shapes, torch.float32, p.device, 0)
    opt, path = subject.build(tensors.params, Context(p.optimizer, p.device, backend=backend))
    opt.step()
    return opt, path, p, subject, target


@pytest.mark.parametrize("backend", [
    "reference",
    pytest.param("cpu", marks=pytest.mark.skipif(importlib.util.find_spec("numba") is None,
                                                 reason="the fused CPU path needs numba")),
])
def test_state_bytes_count_five_counters_per_tensor_on_every_path(backend):
    from qstate_cli.bench.memory import expected_state_bytes

    opt, path, p, subject, target = stepped(backend)
    assert path == {"reference": "reference", "cpu": "cpu-numba"}[backend]
    counted = optimizer_state_bytes(opt)
    expected = expected_state_bytes(subject, p.optimizer, target.shapes, torch.float32)
    assert counted - expected == COUNTERS * N_TENSORS
    held = held_bytes(opt)
    if backend == "reference":
        assert held == counted  # five counters of its own per tensor: counted as held
    else:
        # step (which m.written and v.written alias) and since_reset shared by the group's
        # tensors, nonfinite per tensor: 32 B per tensor less than counted, plus the 16 B held once
        assert counted - held == 32 * N_TENSORS - 16
