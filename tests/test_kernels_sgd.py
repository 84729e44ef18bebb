"""Fused SGD-momentum kernel (kernels/sgd.py) against the reference, bit for bit
(first step: buffer = gradient; Nesterov; dampening; coupled weight decay)."""
import pytest
import torch

from kernel_parity import DEVICE, run_parity
from qstate_cli.optim import SGD

pytestmark = pytest.mark.triton  # the kernel path: skipped where qstate_cli.kernels refuses this Triton (conftest.py)

CASES = [  # (states, dtype, options)
    ("m=int4:bred:b128", torch.float32, dict(nesterov=True, weight_decay=0.01)),
    ("m=de8:stochastic:b64", torch.bfloat16, dict(dampening=0.1)),
    ("m=int8:nearest:b32", torch.float16, dict(weight_decay=0.05)),
]


@pytest.mark.parametrize("states,dtype,options", CASES, ids=[c[0] for c in CASES])
def test_sgd_kernel_equals_reference(states, dtype, options):
    shapes = [(37, 29), (7,)] + ([(1000, 9)] if DEVICE == "cuda" else [])
    run_parity(SGD, states, shapes, dtype, lr=1e-2, momentum=0.9, **options)


def test_sgd_first_step_after_a_reset_restarts_the_buffer_from_the_gradient():
    run_parity(SGD, "m=int4:sr:b128", [(37, 29)], steps=4, reset=2)


@pytest.mark.cuda
def test_sgd_kernel_equals_reference_at_a_million_elements():
    run_parity(SGD, "bred-4bit", [(1024, 1000), (4097,)], torch.bfloat16, nesterov=True)


FULL = [("m=int4:bred:b128", torch.bfloat16, dict(nesterov=True)),
        ("m=lin4nz:stochastic:b128", torch.float32, dict(weight_decay=0.01))]


@pytest.mark.parametrize("states,dtype,options", FULL, ids=[f"{c[0]}-{str(c[1])[6:]}" for c in FULL])
def test_sgd_kernel_full_tiles_equal_reference(states, dtype, options):
    """Tensors of several full tiles (the unmasked path: two vectors of a block row per
    thread, bf16 read as 32-bit words, 4-bit codes decoded from words: kernels/nibbles.py)
    and a short last one; step 2 feeds NaN and Inf gradients."""
    from qstate_cli.kernels import launch

    _, rows, _ = launch.tile_shape(128, dtype.itemsize)
    run_parity(SGD, states, [(2 * rows + 3, 128), (rows, 128)], dtype, lr=1e-2, momentum=0.9, **options)
