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
@pytest.mark.parametrize("cls,states,dtype,options", [
    (Lion, "m=de8:bred:b96", torch.float32, dict(lr=1e-3, weight_decay=0.1)),
    (Lion, "m=de8:stochastic:b64", torch.bfloat16, dict(lr=1e-3)),
    (Muon, "m=de8nz:nearest:b256", torch.bfloat16, dict(lr=0.02, momentum=0.95, nesterov=True)),
], ids=["lion-de8-bred", "lion-de8-sr", "muon-de8nz-nearest"])
def test_cpu_one_state_searched_code_books_equal_reference(cls, states, dtype, options):
    """An 8-bit code book (256 entries: searched, book_rows.encode_block_searched) under each
    rounding, which Lion's and Muon's grids above hold only in fp16 (the reference) or not at all.
    Their ids miss the Makefile's CPU_PATH_SELECT ("lion-bred", "muon-nearest"): each compiles a
    kernel of its own, so they run with the whole grid, not in CI's subset."""
    from qstate_cli.kernels.cpu import book_rows
    from qstate_cli.kernels.cpu.host import layout_arrays
    from qstate_cli.kernels.launch import kernel_layout
    from qstate_cli.quant.config import parse_config

    spec = parse_config(states).spec("m")
    assert book_rows.searched(layout_arrays(kernel_layout(spec), None)[0])
    _, ker = run_parity(cls, states, [(37, 29), (5,)], dtype, steps=4, **options, **CPU)
    assert on_cpu_path(ker)


@needs_numba
def test_cpu_one_state_fp16_falls_back_with_the_reason():
    p = torch.nn.Parameter(torch.randn(300, dtype=torch.float16))
    for cls in (Lion, SGD, Muon):
        opt = cls([p], min_quant_numel=0)
        assert opt.path_for(p) == "reference" and "float16" in opt.why_reference(p)
