"""Fused AdamW/Adam kernel (kernels/adamw.py) against the reference, bit for bit.

The grid is sampled, not crossed: every format, rounding, parameter dtype and block size
appears in some case, with weird shapes (odd numel under 4-bit packing, a short last
block, a tensor smaller than one block). Step 2 feeds NaN and +-Inf gradients."""
import pytest
import torch

from kernel_parity import DEVICE, assert_same_state, make_pair, run_parity, step_both
from qstate_cli.kernels import launch
from qstate_cli.optim import Adam, AdamW

pytestmark = pytest.mark.triton  # the kernel path: skipped where qstate_cli.kernels refuses this Triton (conftest.py)

WEIRD = [(37, 29), (5,), (3, 128)]  # 1073 (odd, short last block), tiny, whole blocks

CASES = [  # (states, parameter dtype)
    ("bred-4bit", torch.float32),
    ("m=int4:nearest:b32,v=uint4:nearest:b32", torch.bfloat16),
    ("m=int8:sr:b256,v=uint8:sr:b256:sqrt", torch.float16),
    ("m=de4:bred:b64,v=lin4nz:bred:b64:sbf16", torch.bfloat16),
    ("m=de8:nearest:b2048,v=de8u:sr:b2048", torch.float32),
    ("m=de4nz:sr:b512,v=de4unz:nearest:b512:sqrt", torch.float32),
    ("m=de8nz:bred:b96,v=de8unz:bred:b96:sqrt", torch.bfloat16),  # a block that is no power of two
    ("m=int8:bred:b1024:sbf16,v=de4u:sr:b1024", torch.float16),
    ("torchao-4bit", torch.bfloat16),
    ("bred-sr-4bit", torch.float32),
    ("bred-linv-8bit", torch.bfloat16),
]


@pytest.mark.parametrize("states,dtype", CASES, ids=[f"{s}-{str(d)[6:]}" for s, d in CASES])
def test_adamw_kernel_equals_reference(states, dtype):
    shapes = WEIRD + ([(1000, 9)] if DEVICE == "cuda" else [])
    run_parity(AdamW, states, shapes, dtype, lr=1e-2, weight_decay=0.1)


def test_adam_with_l2_weight_decay_equals_reference():
    run_parity(Adam, "bred-8bit", [(37, 29), (300,)], torch.bfloat16, lr=1e-2, weight_decay=0.05)


def test_nonfinite_gradients_are_zeroed_and_counted():
    ref, ker = run_parity(AdamW, "bred-4bit", [(37, 29), (300,)], steps=2, poison_step=1)
    assert ker.nonfinite_count() == ref.nonfinite_count() == 6
    assert all(torch.isfinite(p).all() for p in ker.param_groups[0]["params"])


def test_reset_every_two_steps_equals_reference():
    ref, ker = run_parity(AdamW, "sr-4bit", [(37, 29)], steps=5, reset=2)
    assert int(ker.state[ker.param_groups[0]["params"][0]]["since_reset"]) == 1


def test_scheduled_lr_in_a_tensor_equals_reference():
    """lr read on the device: a tensor lr changed in place between steps."""
    lr_ref, lr_ker = torch.tensor(1e-2, device=DEVICE), torch.tensor(1e-2, device=DEVICE)
    ref, ker = make_pair(AdamW, [(37, 29)], states="bred-4bit", seed=3)
    ref.param_groups[0]["lr"], ker.param_groups[0]["lr"] = lr_ref, lr_ker
    gen = torch.Generator().manual_seed(4)
    for t in range(1, 4):
        lr_ref.fill_(1e-2 / t)
        lr_ker.fill_(1e-2 / t)
        step_both(ref, ker, gen)
        assert_same_state(ref, ker, t)


@pytest.mark.cuda
def test_adamw_kernel_equals_reference_at_a_million_elements():
    run_parity(AdamW, "bred-4bit", [(1024, 1000), (4097,)], torch.bfloat16, steps=3)
    run_parity(AdamW, "bnb-8bit", [(1024, 1000), (4097,)], torch.float32, steps=2)


def test_gradients_whose_only_nonfinite_values_are_inf_are_counted():
    """memory.count_nonfinite compares each block row's NaN-propagating max of |g| with +Inf:
    programs whose only non-finite gradients are +Inf or -Inf (no NaN), in a masked tile
    and in a full one, are counted and zeroed as the reference does."""
    rows = launch.tile_shape(128, 2)[1]
    shapes = [(300,), (200,), (2 * rows * 128,)]  # one program each: masked, masked, two full tiles
    ref, ker = make_pair(AdamW, shapes, torch.bfloat16, states="nearest-4bit")
    gen = torch.Generator().manual_seed(3)
    poison = [([3, 250], float("inf")), ([199], -float("inf")), ([rows * 128 + 9], float("inf"))]
    for t in (1, 2):
        for (a, b), (at, val) in zip(zip(ref.param_groups[0]["params"], ker.param_groups[0]["params"]), poison):
            g = torch.randn(a.shape, generator=gen).to(a.dtype)
            if t == 2:
                g[at] = val
            a.grad, b.grad = g.to(a.device), g.clone().to(b.device)
        ref.step()
        ker.step()
        assert_same_state(ref, ker, t)
    assert ker.nonfinite_count() == ref.nonfinite_count() == 4
