"""Tensors with elementwise states step together (optim/small.py): bit for bit what the
reference leaves when it steps them one by one, over steps, resets, skipped gradients,
non-finite gradients, parameter dtypes, state formats and a checkpoint round trip; Muon's
momentum steps together too, its Newton-Schulz per matrix."""
from __future__ import annotations

import io
import math

import pytest
import torch

from qstate_cli.optim import small
from qstate_cli.optim.optimizers import SGD, Adam, AdamW, Lion, Muon

# odd sizes (vector bodies and scalar tails fall in different places once laid end to end),
# every parameter dtype the reference takes, one non-contiguous parameter (a transposed one)
SHAPES = [((7,), torch.float32), ((1000,), torch.bfloat16), ((33, 3), torch.float32), ((1,), torch.float64),
          ((4095,), torch.float16), ((2, 5), "transposed")]
BUILD = {
    "adamw": lambda ps, **kw: AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
    "adam-l2": lambda ps, **kw: Adam(ps, lr=1e-2, weight_decay=0.1, **kw),
    "lion": lambda ps, **kw: Lion(ps, lr=1e-3, weight_decay=0.1, **kw),
    "sgd-nesterov": lambda ps, **kw: SGD(ps, lr=1e-2, momentum=0.9, weight_decay=0.01, nesterov=True, **kw),
    "sgd-dampened": lambda ps, **kw: SGD(ps, lr=1e-2, momentum=0.9, dampening=0.5, **kw),
    # the momentum in one pass, Newton-Schulz per >= 2-D tensor (Muon.update_flat)
    "muon-nesterov": lambda ps, **kw: Muon(ps, lr=2e-2, weight_decay=0.1, **kw),
    "muon-plain": lambda ps, **kw: Muon(ps, lr=2e-2, momentum=0.9, nesterov=False, **kw),
}


def _params(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    ps = []
    for shape, dtype in SHAPES:
        t = torch.randn(shape, generator=gen)
        ps.append(torch.nn.Parameter(t.t() if dtype == "transposed" else t.to(dtype)))
    assert not ps[-1].is_contiguous()
    return ps


def _grads(ps, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for i, p in enumerate(ps):
        if (i + step) % 4 == 0:  # skipped: this tensor's step counter falls behind the others'
            p.grad = None
            continue
        g = torch.randn(p.shape, generator=gen) * 10.0 ** (i - 3)
        if step % 3 == 1 and p.numel() > 2:
            g.view(-1)[1] = float("nan")
            g.view(-1)[-1] = float("inf") if i % 2 else float("-inf")
        p.grad = g.to(p.dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _same_state(a, b) -> None:
    assert a.keys() == b.keys()
    for key in a:
        if isinstance(a[key], dict):
            _same_state(a[key], b[key])
        else:
            assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
            assert torch.equal(_bits(a[key]), _bits(b[key])), key


# fp32 states of tensors under min_quant_numel (4096 by default; every tensor here is smaller),
# and unscaled float states rounded to nearest on every tensor (min_quant_numel=0)
STATES = {
    "small-fp32": dict(states="bred-4bit"),
    "bf16": dict(states="bf16", min_quant_numel=0),
    "fp8-sqrt": dict(states="m=e4m3:nearest,v=fp16:nearest:sqrt", min_quant_numel=0),
    # stochastic rounding: each element's uniform from its own tensor's stream (small.Streams)
    "bf16-sr": dict(states="bf16-sr", min_quant_numel=0),
    "sr-mixed": dict(states="m=e5m2:stochastic,v=bf16:stochastic:sqrt", min_quant_numel=0, seed=7),
    # AdamW / Adam: both states 16-bit, so one numba pass where numba runs (kernels/cpu/elementwise.py)
    "fp16-bf16-sqrt": dict(states="m=fp16:stochastic,v=bf16:nearest:sqrt", min_quant_numel=0, seed=3),
}


@pytest.mark.parametrize("states", sorted(STATES))
@pytest.mark.parametrize("name", sorted(BUILD))
def test_small_tensors_step_together_as_the_reference_steps_them_one_by_one(name, states, monkeypatch):
    def build(ps, **kw):
        return BUILD[name](ps, **STATES[states], **kw)

    ref_ps, ps = _params(0), _params(0)
    ref = build(ref_ps, backend="reference", reset=3)
    opt = build(ps, backend="auto", reset=3)

    def alone_only_fp64(o):  # an fp64 parameter steps alone: the reference updates it in fp64
        original = o._step_param

        def one_by_one(group, p, tensor_id):
            assert p.dtype == torch.float64, "a small tensor stepped alone"
            return original(group, p, tensor_id)

        monkeypatch.setattr(o, "_step_param", one_by_one)

    alone_only_fp64(opt)
    assert [small.steps_together(opt, opt.param_groups[0], p) for p in ps] == [p.dtype != torch.float64 for p in ps]
    for step in range(1, 9):
        _grads(ref_ps, step)
        _grads(ps, step)
        ref.step()
        opt.step()
        if step == 4:  # a checkpoint round trip in the middle (weights_only, as users load it)
            buf = io.BytesIO()
            torch.save(opt.state_dict(), buf)
            buf.seek(0)
            opt = build(ps, backend="auto", reset=3)
            alone_only_fp64(opt)
            opt.load_state_dict(torch.load(buf, weights_only=True))
        for a, b in zip(ref_ps, ps):
            assert torch.equal(_bits(a), _bits(b)), f"step {step}, parameter {tuple(a.shape)}"
    assert ref.nonfinite_count() == opt.nonfinite_count() > 0
    for a, b in zip(ref_ps, ps):
        _same_state(ref.state[a], opt.state[b])
    assert len({opt.state[p]["m"]["codes"].untyped_storage().data_ptr() for p in ps}) == len(ps)  # own storage each


def test_fp32_states_on_large_tensors_step_together_across_threads():
    """A configuration with fp32 states everywhere: tensors above ATen's one-thread grain
    (32,768 elements) split over threads at other offsets once concatenated."""
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        shapes = [(70_001,), (3,), (40_000,)]
        ref_ps = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)))
                  for i, s in enumerate(shapes)]
        ps = [torch.nn.Parameter(p.detach().clone()) for p in ref_ps]
        ref = AdamW(ref_ps, states="fp32", backend="reference")
        opt = AdamW(ps, states="fp32", backend="auto")
        for step in range(3):
            for a, b in zip(ref_ps, ps):
                a.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(10 + step)) * 1e-3
                b.grad = a.grad.clone()
            ref.step()
            opt.step()
        for a, b in zip(ref_ps, ps):
            assert torch.equal(_bits(a), _bits(b))
            _same_state(ref.state[a], opt.state[b])
    finally:
        torch.set_num_threads(old)


def test_what_does_not_step_together():
    p = torch.nn.Parameter(torch.randn(16))
    p.grad = torch.randn(16)
    reference = AdamW([p], backend="reference")  # keeps the per-tensor definition
    assert not small.steps_together(reference, reference.param_groups[0], p)
    quantized = AdamW([p], min_quant_numel=0)  # 4-bit states: a kernel's or the reference's, one by one
    assert not small.steps_together(quantized, quantized.param_groups[0], p)
    for states in ("bf16:bred", "e2m1:nearest", "e4m3:nearest:tensor"):  # a dither per block, two per byte, a scale
        opt = AdamW([p], states=states, min_quant_numel=0)
        assert not small.steps_together(opt, opt.param_groups[0], p), states


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_a_group_steps_again_unrouted_as_the_reference_steps_it(backend, monkeypatch):
    """optim/steady.py, AdamW bred-4bit with the default min_quant_numel: a group stepped as
    one fused launch (two tensors over 4096 elements) and one together run (three under it,
    fp32 states, one of them a bf16 parameter), and a no-decay group of small tensors only,
    step again from their record from the second step on. No parameter is routed; the counters
    reset every 3 steps; a NaN and an Inf in every gradient at step 4 are counted; every
    parameter, state and counter equals the reference's, bit for bit. Routed again: a state
    marked unwritten by hand (step 6: it reads as zero; step 7 too, its tensor in a run of its
    own at step 6), a loaded state dict (step 8), a small tensor without a gradient (step 10,
    and 11: its counters no longer agree with the others')."""
    from qstate_cli.kernels import cpu, unavailable_reason
    why = cpu.unavailable_reason("cpu") if backend == "cpu" else unavailable_reason(torch.device("cpu"))
    if why is not None:
        pytest.skip(why)
    shapes = [((64, 80), torch.float32), ((7,), torch.float32), ((4100,), torch.float32), ((33, 3), torch.bfloat16),
              ((50,), torch.float32)]
    gen = torch.Generator().manual_seed(4)
    init = [torch.randn(s, generator=gen).to(d) for s, d in shapes] + [torch.randn(20, generator=gen)]

    def build(backend):
        ps = [torch.nn.Parameter(t.clone()) for t in init]
        groups = [dict(params=ps[:5]), dict(params=ps[5:], weight_decay=0.0)]
        return ps, AdamW(groups, lr=1e-2, weight_decay=0.1, states="bred-4bit", reset=3, backend=backend)

    (ref_ps, ref), (ps, opt) = build("reference"), build(backend)
    routes = []
    route = type(opt)._route
    monkeypatch.setattr(opt, "_route", lambda group, p: routes.append(p) or route(opt, group, p))
    routed = []
    for step in range(1, 12):
        if step == 6:
            for o, p in ((ref, ref_ps[1]), (opt, ps[1])):
                o.state[p]["m"]["written"] = torch.zeros((), dtype=torch.int64)
        if step == 8:
            opt.load_state_dict(opt.state_dict())
        gen = torch.Generator().manual_seed(50 + step)
        for i, (a, b) in enumerate(zip(ref_ps, ps)):
            g = torch.randn(a.shape, generator=gen)
            if step == 4:
                g.view(-1)[0], g.view(-1)[-1] = float("nan"), float("inf")
            a.grad, b.grad = g.to(a.dtype), g.to(b.dtype)
            if step >= 10 and i == 1:
                a.grad = b.grad = None
        del routes[:]
        ref.step()
        opt.step()
        routed.append(len(routes) > 0)
        for a, b in zip(ref_ps, ps):
            assert torch.equal(_bits(a), _bits(b)), f"step {step}, parameter {tuple(a.shape)}"
            _same_state(ref.state[a], opt.state[b])
    assert routed == [True] + [False] * 4 + [True, True, True, False, True, True]
    assert opt.nonfinite_count() == ref.nonfinite_count() == 2 * len(ps)


@pytest.mark.parametrize("states", ["bf16", "bf16-sr", "sr-mixed"])
@pytest.mark.parametrize("name", ["adamw", "lion", "muon-nesterov"])
def test_a_run_above_one_chunk_steps_in_batches_as_the_reference_steps_it(name, states, monkeypatch):
    """Tensors laid end to end past chunked.CHUNK elements step in batches of at most a chunk,
    and a tensor above one chunk steps alone in the reference's chunks (optim/chunked.py), where
    the numba pass does not take them: the same bits as the reference, tensor by tensor."""
    from qstate_cli.optim import chunked

    monkeypatch.setattr(chunked, "CHUNK", 1024)  # SHAPES: 7, 1000, 99, (fp64), 4095, 10 elements
    ref_ps, ps = _params(0), _params(0)
    ref = BUILD[name](ref_ps, **STATES[states], backend="reference", reset=3)
    opt = BUILD[name](ps, **STATES[states], backend="auto", reset=3)
    batches = []  # per call of the torch rule over tensors laid end to end: their sizes
    update_flat = opt.update_flat

    def counting(group, shapes, *rest):
        batches.append([math.prod(s) for s in shapes])
        return update_flat(group, shapes, *rest)

    opt.update_flat = counting
    takes = small._pass_takes(opt, [opt.spec_for(opt.param_groups[0], ps[0], n) for n in opt.state_names])
    assert small.steps_together(opt, opt.param_groups[0], ps[4]) == takes  # 4095 > 1024 elements
    for step in range(1, 7):
        _grads(ref_ps, step)
        _grads(ps, step)
        ref.step()
        opt.step()
        for a, b in zip(ref_ps, ps):
            assert torch.equal(_bits(a), _bits(b)), f"step {step}, parameter {tuple(a.shape)}"
    for a, b in zip(ref_ps, ps):
        _same_state(ref.state[a], opt.state[b])
    if not takes:  # the torch rule ran on at most a chunk's elements (or one tensor), never on 4095
        assert batches and all(sum(b) <= 1024 or len(b) == 1 for b in batches) and any(len(b) > 1 for b in batches)
        assert 4095 not in {n for b in batches for n in b}


def test_batches_cover_every_tensor_once_within_the_cap():
    sizes = [7, 1000, 99, 4095, 10, 300, 300, 300]
    ranges = small._batches(sizes, 1024)
    assert [k for a, b in ranges for k in range(a, b)] == list(range(len(sizes)))
    assert all(sum(sizes[a:b]) <= 1024 or b - a == 1 for a, b in ranges)
    assert ranges == [(0, 2), (2, 3), (3, 4), (4, 8)]
