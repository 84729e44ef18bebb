"""The CPU path's one-state steps (kernels/cpu/lion.py, sgd.py, muon.py) against the
reference, bit for bit, on the Triton kernels' parity grids (tests/test_kernels_lion.py,
_sgd.py, _muon.py; fp16 falls back to the reference) plus the 4-bit presets on tensors
split over threads, with a reset. Muon: the momentum update is the CPU kernel; the
Newton-Schulz iteration stays in torch. Skipped where numba is not installed."""
import pytest
import torch

from kernel_parity import run_parity
from qstate_cli.kernels import cpu
from qstate_cli.optim import SGD, Lion, Muon
from test_kernels_lion import CASES as LION_CASES
from test_kernels_muon import CASES as MUON_CASES
from test_kernels_sgd import CASES as SGD_CASES

needs_numba = pytest.mark.skipif(cpu.unavailable_reason("cpu") is not None, reason="numba is not installed")
CPU_DTYPES = (torch.float32, torch.bfloat16)
CPU = dict(backend="cpu", device="cpu")
PRESETS = ["nearest-4bit", "sr-4bit", "bred-4bit"]
THREADED = [(300, 700), (4097,)]  # 210,000 elements: split over threads (host.MIN_THREAD_ELEMENTS)


def on_cpu_path(opt) -> bool:
    return {opt.path_for(p) for p in opt.param_groups[0]["params"]} == {cpu.PATH}


@needs_numba
@pytest.mark.parametrize("states,dtype", [c for c in LION_CASES if c[1] in CPU_DTYPES], ids=lambda x: str(x))
def test_cpu_lion_equals_reference(states, dtype):
    _, ker = run_parity(Lion, states, [(37, 29), (5,)], dtype, lr=1e-3, weight_decay=0.1, **CPU)
    assert on_cpu_path(ker)


@needs_numba
@pytest.mark.parametrize("states,dtype,options", [c for c in SGD_CASES if c[1] in CPU_DTYPES], ids=lambda x: str(x))
def test_cpu_sgd_equals_reference(states, dtype, options):
    _, ker = run_parity(SGD, states, [(37, 29), (7,)], dtype, lr=1e-2, momentum=0.9, **options, **CPU)
    assert on_cpu_path(ker)


@needs_numba
@pytest.mark.parametrize("states,dtype,options", [c for c in MUON_CASES if c[1] in CPU_DTYPES], ids=lambda x: str(x))
def test_cpu_muon_equals_reference(states, dtype, options):
    _, ker = run_parity(Muon, states, [(37, 29), (33,)], dtype, lr=0.02, momentum=0.95, **options, **CPU)
    assert on_cpu_path(ker)


@needs_numba
@pytest.mark.parametrize("states", PRESETS)
@pytest.mark.parametrize("cls,options", [(Lion, dict(lr=1e-3, weight_decay=0.1)),
                                         (SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01)),
                                         (Muon, dict(lr=0.02, momentum=0.95))], ids=["lion", "sgd", "muon"])
def test_cpu_one_state_presets_equal_reference_with_a_reset_on_threads(cls, options, states):
    """fp32 and the presets people run; a reset at step 3 (SGD: the buffer restarts from g)."""
    _, ker = run_parity(cls, states, THREADED, torch.float32, steps=4, reset=3, **options, **CPU)
    assert on_cpu_path(ker)


@needs_numba
def test_cpu_one_state_fp16_falls_back_with_the_reason():
    p = torch.nn.Parameter(torch.randn(300, dtype=torch.float16))
    for cls in (Lion, SGD, Muon):
        opt = cls([p], min_quant_numel=0)
        assert opt.path_for(p) == "reference" and "float16" in opt.why_reference(p)
