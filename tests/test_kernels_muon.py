"""Fused Muon momentum kernel (kernels/muon.py) against the reference, bit for bit: the
kernel requantizes the buffer and writes the fp32 update; Newton-Schulz stays in torch."""
import pytest
import torch

from kernel_parity import DEVICE, run_parity
from qstate_cli.optim import Muon

pytestmark = pytest.mark.triton  # the kernel path: skipped where qstate_cli.kernels refuses this Triton (conftest.py)

CASES = [
    ("m=int4:bred:b128", torch.float32, dict(nesterov=True)),
    ("m=lin4nz:stochastic:b64", torch.bfloat16, dict(nesterov=False, weight_decay=0.1)),
    ("m=de8nz:nearest:b256", torch.float16, dict(nesterov=True)),
]


@pytest.mark.parametrize("states,dtype,options", CASES, ids=[c[0] for c in CASES])
def test_muon_kernel_equals_reference(states, dtype, options):
    shapes = [(37, 29), (33,)] + ([(256, 300)] if DEVICE == "cuda" else [])  # a 1-D parameter too
    run_parity(Muon, states, shapes, dtype, lr=0.02, momentum=0.95, **options)


@pytest.mark.cuda
def test_muon_kernel_equals_reference_on_large_matrices():
    run_parity(Muon, "bred-4bit", [(1024, 1024), (4097,)], torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_muon_kernel_full_tiles_equal_reference(dtype):
    """Tensors of several full tiles (the unmasked path: two vectors of a block row per
    thread, bf16 gradients read as 32-bit words) and a short last one."""
    from qstate_cli.kernels import launch

    _, rows, _ = launch.tile_shape(128, 4)  # the fp32 update out sets the tile: `rows` blocks of 128
    run_parity(Muon, "m=int4:bred:b128", [(2 * rows + 3, 128), (rows, 128)], dtype, lr=0.02, momentum=0.95,
               nesterov=True)
