"""An infinite block scale decodes as the reference's step absmax / top = +Inf, not NaN
(fastmath.div_top's correction turns a = +Inf into NaN unless it passes +Inf through). A bf16
scale is rounded up (quantizer.bf16_round_up), so an m block absmax above bf16's largest finite
value (3.3895e38) is stored as +Inf; a dithered (BReD) or no-zero read of that block then gives
+-Inf in the reference (q - d != 0), and the parameter must follow."""
import pytest
import torch
import triton
import triton.language as tl

from kernel_parity import DEVICE, assert_same_state, make_pair
from qstate_cli.kernels import common as c
from qstate_cli.kernels import launch
from qstate_cli.optim import AdamW
from qstate_cli.quant import quantizer


@triton.jit
def _step_of_kernel(a_ptr, s_ptr, TOP: tl.constexpr):
    i = tl.arange(0, 4)
    tl.store(s_ptr + i, c.step_of(tl.load(a_ptr + i), TOP))


@pytest.mark.parametrize("top", [7.0, 15.0, 127.0, 255.0])
def test_step_of_of_infinite_absmax_equals_reference(top):
    a = torch.tensor([float("inf"), float("nan"), 0.0, 3.0e38], device=DEVICE)
    s = torch.empty_like(a)
    _step_of_kernel[(1,)](a, s, TOP=top)
    want = quantizer.step_of(a, top)
    assert torch.equal(s.view(torch.int32), want.view(torch.int32)), f"{s.tolist()} vs {want.tolist()}"


@pytest.mark.triton
@pytest.mark.filterwarnings("ignore:overflow encountered", "ignore:invalid value encountered")
@pytest.mark.parametrize("states", ["m=int4:bred:b128:sbf16,v=uint4:nearest:b128:sqrt:sbf16",
                                    "m=int4:nearest:b128:sbf16,v=uint4:nearest:b128:sqrt:sbf16"])
def test_infinite_bf16_scale_decodes_as_reference(states):
    _, rows, _ = launch.tile_shape(128, 4)
    n = rows * 128  # one full tile
    ref, ker = make_pair(AdamW, [(n,)], states=states, betas=(0.0, 0.999))
    gen = torch.Generator().manual_seed(3)
    for t in (1, 2):
        g = torch.randn(n, generator=gen)
        if t == 1:
            g[5] = 3.4e38  # m = g (beta1 = 0): its block's bf16 scale rounds up to +Inf
        else:
            for o in (ref, ker):
                o.param_groups[0]["betas"] = (0.9, 0.999)
        (a,), (b,) = ref.param_groups[0]["params"], ker.param_groups[0]["params"]
        a.grad, b.grad = g.clone().to(a.device), g.clone().to(b.device)
        ref.step()
        ker.step()
        assert_same_state(ref, ker, t)
