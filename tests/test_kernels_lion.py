"""Fused Lion kernel (kernels/lion.py) against the reference, bit for bit."""
import pytest
import torch

from kernel_parity import DEVICE, run_parity
from qstate_cli.optim import Lion

pytestmark = pytest.mark.triton  # the kernel path: skipped where qstate_cli.kernels refuses this Triton (conftest.py)

CASES = [
    ("m=int4:bred:b128", torch.float32),
    ("m=de4:nearest:b64", torch.bfloat16),
    ("m=int8:sr:b256:sbf16", torch.float16),
]


@pytest.mark.parametrize("states,dtype", CASES, ids=[f"{s}-{str(d)[6:]}" for s, d in CASES])
def test_lion_kernel_equals_reference(states, dtype):
    shapes = [(37, 29), (5,)] + ([(1000, 9)] if DEVICE == "cuda" else [])
    run_parity(Lion, states, shapes, dtype, lr=1e-3, weight_decay=0.1)


@pytest.mark.cuda
def test_lion_kernel_equals_reference_at_a_million_elements():
    run_parity(Lion, "bred-4bit", [(1024, 1000), (4097,)], torch.bfloat16)


FULL = [("m=int4:bred:b128", torch.bfloat16), ("m=lin4nz:nearest:b128", torch.float32)]


@pytest.mark.parametrize("states,dtype", FULL, ids=[f"{s}-{str(d)[6:]}" for s, d in FULL])
def test_lion_kernel_full_tiles_equal_reference(states, dtype):
    """Tensors of several full tiles (the unmasked path: two vectors of a block row per
    thread, bf16 read as 32-bit words, 4-bit codes decoded from words: kernels/nibbles.py)
    and a short last one; step 2 feeds NaN and Inf gradients."""
    from qstate_cli.kernels import launch

    _, rows, _ = launch.tile_shape(128, dtype.itemsize)
    run_parity(Lion, states, [(2 * rows + 3, 128), (rows, 128)], dtype, lr=1e-3, weight_decay=0.1)
