"""Fused Lion kernel (kernels/lion.py) against the reference, bit for bit."""
import pytest
import torch

from kernel_parity import DEVICE, run_parity
from qstate_cli.optim import Lion

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
