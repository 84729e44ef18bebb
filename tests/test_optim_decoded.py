"""opt.decoded_state(p): each state as the step reads it (fp32, p's shape), on every path."""
from __future__ import annotations

import pytest
import torch

from qstate_cli.optim.optimizers import SGD, AdamW, Lion

N = 5000  # above min_quant_numel


def _grads(shape, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(steps)]


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_fp32_states_are_the_fp32_emas(backend):
    p = torch.nn.Parameter(torch.randn(50, 100))
    opt = AdamW([p], lr=1e-3, betas=(0.9, 0.99), states="fp32", backend=backend)
    m = torch.zeros(p.shape)
    v = torch.zeros(p.shape)
    for g in _grads(p.shape, 4):
        p.grad = g
        opt.step()
        m = m * 0.9 + g * (1.0 - 0.9)  # optim/rules.ema, the same fp32 ops
        v = v * 0.99 + (g * g) * (1.0 - 0.99)
    out = opt.decoded_state(p)
    assert set(out) == {"m", "v"}
    assert out["m"].dtype == torch.float32 and out["m"].shape == p.shape
    assert torch.equal(out["m"], m) and torch.equal(out["v"], v)
    out["m"].zero_()  # a copy: the state is untouched
    assert torch.equal(opt.decoded_state(p)["m"], m)


@pytest.mark.parametrize("states", ["bred-4bit", "sr-4bit", "torchao-4bit", "bred-8bit"])
def test_quantized_states_are_what_the_step_reads(states):
    p = torch.nn.Parameter(torch.randn(N))
    opt = AdamW([p], states=states, backend="reference")
    grads = _grads(p.shape, 3)
    for g in grads[:2]:
        p.grad = g
        opt.step()
    shown = opt.decoded_state(p)
    states_now = opt.load_states(opt.param_groups[0], p, 0)
    assert torch.equal(shown["m"], states_now["m"].decode())
    assert torch.equal(shown["v"], states_now["v"].decode().clamp(min=0.0))
    read = {}
    update = opt.update

    def spy(group, p32, g, x_hat, since, first):
        read.update({k: x.clone() for k, x in x_hat.items()})
        return update(group, p32, g, x_hat, since, first)

    opt.update = spy
    p.grad = grads[2]
    opt.step()
    assert read.keys() == shown.keys() and all(torch.equal(read[k], shown[k]) for k in read)


@pytest.mark.parametrize("states", ["bred-4bit", "bf16", "fp32"])
def test_every_path_shows_the_references_states(states):
    """The fused CPU path (with numba) and the reference keep the same bits: the same values shown."""
    shown = []
    for backend in ("reference", "auto"):
        p = torch.nn.Parameter(torch.randn(50, 100, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16))
        opt = AdamW([p], states=states, backend=backend)
        for g in _grads(p.shape, 3):
            p.grad = g.to(torch.bfloat16)
            opt.step()
        shown.append(opt.decoded_state(p))
    assert all(torch.equal(shown[0][k], shown[1][k]) for k in ("m", "v"))
    assert shown[0]["m"].dtype == torch.float32 and shown[0]["m"].shape == (50, 100)


def test_never_stepped_and_momentum_only():
    p, q = torch.nn.Parameter(torch.randn(3, N)), torch.nn.Parameter(torch.randn(7))
    opt = Lion([p, q])
    out = opt.decoded_state(p)
    assert set(out) == {"m"} and out["m"].shape == p.shape and not out["m"].any()
    assert p not in opt.state  # reading made no state
    q.grad = torch.ones(7)
    opt.step()
    assert set(SGD([q]).decoded_state(q)) == {"m"}
    assert torch.equal(opt.decoded_state(q)["m"], torch.full((7,), 1.0 - 0.99))
    assert not opt.decoded_state(p)["m"].any()
