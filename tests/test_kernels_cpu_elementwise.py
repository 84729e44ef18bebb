"""The CPU path's encode and decode of unscaled 16-bit minifloat states (kernels/cpu/
elementwise.py, which optim/small.py uses where numba runs): quantizer.encode's codes and
quantizer.decode's values, bit for bit, on hostile values, every 16-bit pattern, tensors laid
end to end with their own streams, and split over threads."""
from __future__ import annotations

import pytest
import torch

from qstate_cli.optim import SGD, Lion, Muon
from qstate_cli.optim.small import Streams
from qstate_cli.quant import parse_spec
from qstate_cli.quant.quantizer import Stream, decode, encode

pytest.importorskip("numba")
from qstate_cli.kernels.cpu import elementwise as ew  # noqa: E402
from qstate_cli.kernels.cpu import host  # noqa: E402

SPECS = ["bf16", "bf16:stochastic", "fp16", "fp16:stochastic", "bf16:nearest:sqrt", "fp16:stochastic:sqrt"]


def hostile(n: int, seed: int) -> torch.Tensor:
    """Values across fp32's range: ties and near-ties of bf16 (low 16 bits 0x8000 +- 1 at odd
    and even ordinals), fp16's overflow, subnormals of both, zeros of both signs, NaN, +-inf."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen) * torch.exp(8 * torch.randn(n, generator=gen))
    bits = torch.randint(0, 2**31 - 1, (n // 4,), generator=gen, dtype=torch.int64)
    ties = ((bits & ~0xFFFF) | (0x8000 + torch.randint(-1, 2, (n // 4,), generator=gen))).to(torch.int32)
    x[: n // 4] = ties.view(torch.float32) * torch.where(torch.rand(n // 4, generator=gen) < 0.5, -1.0, 1.0)
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 65504.0, 65520.0, 65519.99,
                            1e-45, -1e-40, 6e-8, 2.9e-8, 3e38, -3.4e38, 1.0, -1.0])
    x[n // 4: n // 4 + special.numel()] = special
    return x


@pytest.mark.parametrize("text", SPECS)
def test_encode_is_the_references_per_tensor_stream(text):
    spec = parse_spec(text)
    assert ew.covers(spec) is None
    sizes, ids, seed, step = [1, 4097, 3000, 7, 20000], [3, 0, 11, 5, 2], 9, 12
    x = hostile(sum(sizes), 1)
    stream = Streams(seed, ids, 1, sizes) if spec.rounding == "stochastic" else Stream()
    want = encode(x, spec, step, stream)[0]
    got = ew.encode(x, spec, seed, ids, 1, step, sizes)
    assert got.dtype == want.dtype == torch.int16 and torch.equal(got, want)
    if spec.rounding == "stochastic":  # another step draws other uniforms: some codes move
        assert not torch.equal(ew.encode(x, spec, seed, ids, 1, step + 1, sizes), got)


@pytest.mark.parametrize("text", SPECS)
def test_decode_every_16_bit_pattern(text):
    spec = parse_spec(text)
    codes = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    want = decode(codes, None, spec, codes.numel(), 1)
    got = ew.decode(codes, spec)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_threads_split_the_runs_and_give_the_same_codes(monkeypatch):
    spec = parse_spec("bf16:stochastic")
    sizes, ids = [130001, 1, 90001], [1, 2, 3]  # 3 runs of threads, each edge inside a tensor
    x = hostile(sum(sizes), 2)
    monkeypatch.setattr(host, "threads", lambda: 1)
    one = ew.encode(x, spec, 0, ids, 2, 5, sizes)
    monkeypatch.setattr(host, "threads", lambda: 3)
    assert host.parts_of(x.numel()) == 3
    assert torch.equal(ew.encode(x, spec, 0, ids, 2, 5, sizes), one)
    assert torch.equal(one, encode(x, spec, 5, Streams(0, ids, 2, sizes))[0])
    assert torch.equal(ew.decode(one, spec), decode(one, None, spec, one.numel(), 5))


def test_what_it_does_not_take():
    for text in ("bf16:bred", "int8:nearest:b128", "e4m3", "fp32"):
        assert ew.covers(parse_spec(text)) is not None, text


def _counted(monkeypatch, name: str) -> list:
    """ew.<name>, patched to append to the returned list at each call."""
    calls, real = [], getattr(ew, name)
    monkeypatch.setattr(ew, name, lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    return calls


def _param_copies(shapes: list, seed: int, copies: int) -> tuple:
    """(a generator for the gradients, `copies` lists of the same parameters of these shapes:
    fp32, bf16, fp32)."""
    gen = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, torch.bfloat16, torch.float32]
    base = [torch.randn(s, generator=gen).to(dtypes[i]) for i, s in enumerate(shapes)]
    return gen, [[torch.nn.Parameter(t.clone()) for t in base] for _ in range(copies)]


@pytest.mark.parametrize("states", ["bf16-sr", "m=bf16:nearest,v=fp16:stochastic:sqrt",
                                    "m=bf16:stochastic,v=fp32:nearest:sqrt", "fp32"])
@pytest.mark.parametrize("shapes", [[(200_003,)], [(70_001,), (5,), (3, 7)]], ids=["one-tensor", "three"])
def test_adamw_with_16_bit_states_is_one_kernel_pass_with_the_references_bits(states, shapes, monkeypatch):
    """AdamW with both states 16-bit minifloats or fp32: small.py's pass runs elementwise.adamw_step
    (decode, rule, encode in one numba pass), over threads where the tensors are large, and one
    contiguous fp32 tensor stepped in place (flatten gives back a view of it); bit for bit the
    reference's parameters, codes and counters over steps, a reset and non-finite gradients."""
    from qstate_cli.optim import AdamW

    calls = _counted(monkeypatch, "adamw_step")
    gen, (ref_ps, ps) = _param_copies(shapes, 4, 2)
    ref = AdamW(ref_ps, lr=1e-2, weight_decay=0.1, states=states, min_quant_numel=0, reset=3, backend="reference")
    opt = AdamW(ps, lr=1e-2, weight_decay=0.1, states=states, min_quant_numel=0, reset=3)
    for step in range(1, 7):
        for a, b in zip(ref_ps, ps):
            g = torch.randn(a.shape, generator=gen) * 10.0 ** (step % 3 - 1)
            if step == 2:
                g.view(-1)[0] = float("nan")
            a.grad, b.grad = g.to(a.dtype), g.to(b.dtype)
        ref.step()
        opt.step()
        for a, b in zip(ref_ps, ps):
            assert torch.equal(a.detach().view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                               b.detach().view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32)), step
    assert len(calls) == 6 and ref.nonfinite_count() == opt.nonfinite_count() == len(ps)
    assert all(opt.path_for(p) == "cpu-numba" and opt.why_reference(p) is None for p in ps)
    for a, b in zip(ref_ps, ps):
        for name in ("m", "v"):
            assert torch.equal(ref.state[a][name]["codes"], opt.state[b][name]["codes"]), name
        assert int(ref.state[a]["since_reset"]) == int(opt.state[b]["since_reset"]) == 3
    lion = Lion([torch.nn.Parameter(torch.randn(10))], states="bf16", min_quant_numel=0)
    lion.param_groups[0]["params"][0].grad = torch.randn(10)
    lion.step()  # Lion has its own pass (momentum_step), not AdamW's
    assert len(calls) == 6 and lion.path_for(lion.param_groups[0]["params"][0]) == "cpu-numba"


def _rewritten(cls):
    """A subclass whose update is its own (here cls's, called through): the one pass cannot
    know it is the same rule, so its states keep small.py's torch ops."""
    return type("Rewritten" + cls.__name__, (cls,), {"update": lambda self, *a: cls.update(self, *a)})


MOMENTUM = {  # (class, hyper-parameters): optim/small.py's test grid
    "lion": (Lion, dict(lr=1e-3, weight_decay=0.1)),
    "sgd-nesterov-wd": (SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.01, nesterov=True)),
    "sgd-dampened": (SGD, dict(lr=1e-2, momentum=0.9, dampening=0.5)),
    "muon-nesterov": (Muon, dict(lr=2e-2, weight_decay=0.1)),
    "muon-plain": (Muon, dict(lr=2e-2, momentum=0.9, nesterov=False)),
}


@pytest.mark.parametrize("states", ["bf16-sr", "fp16", "fp32"])
@pytest.mark.parametrize("shapes", [[(200_003,)], [(70_001,), (5,), (31, 7)]], ids=["one-tensor", "three"])
@pytest.mark.parametrize("name", sorted(MOMENTUM))
def test_lion_sgd_muon_with_16_bit_states_are_one_kernel_pass_with_the_references_bits(name, states, shapes,
                                                                                       monkeypatch):
    """Lion, SGD (Nesterov with coupled decay; dampened) and Muon (Nesterov; plain, its
    Newton-Schulz per matrix after the pass) with m a 16-bit minifloat or fp32: small.py's pass
    runs elementwise.momentum_step (decode, rule, encode in one numba pass); bit for bit the
    reference's parameters, codes and counters over steps, a reset, non-finite gradients and
    a state that overflows. A subclass that rewrites the rule keeps the torch ops (and the
    same bits)."""
    calls = _counted(monkeypatch, "momentum_step")
    gen, (ref_ps, ps, own_ps) = _param_copies(shapes, 5, 3)
    cls, kw = MOMENTUM[name]
    kw = dict(kw, states=states, min_quant_numel=0, reset=3)
    ref, opt, own = cls(ref_ps, backend="reference", **kw), cls(ps, **kw), _rewritten(cls)(own_ps, **kw)
    for step in range(1, 7):
        for a, b, c in zip(ref_ps, ps, own_ps):
            g = torch.randn(a.shape, generator=gen) * 10.0 ** (step % 3 - 1)
            if step == 2:
                g.view(-1)[0] = float("nan")
            if step == 4:
                g.view(-1)[-1] = -float("inf")
            if step in (4, 5):  # SGD's buffer overflows to inf: stored as 0 (codec.stored_value)
                g.view(-1)[1] = 3e38
            a.grad, b.grad, c.grad = g.to(a.dtype), g.to(b.dtype), g.to(c.dtype)
        for o in (ref, opt, own):
            o.step()
        for a, b, c in zip(ref_ps, ps, own_ps):
            bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
            assert torch.equal(a.detach().view(bits), b.detach().view(bits)), step
            assert torch.equal(a.detach().view(bits), c.detach().view(bits)), step
    assert len(calls) == 6 and ref.nonfinite_count() == opt.nonfinite_count() == own.nonfinite_count() == 2 * len(ps)
    assert all(opt.path_for(p) == "cpu-numba" and opt.why_reference(p) is None for p in ps)
    assert all(own.path_for(p) == "reference" for p in own_ps)
    for a, b in zip(ref_ps, ps):
        assert torch.equal(ref.state[a]["m"]["codes"], opt.state[b]["m"]["codes"])
        assert int(ref.state[a]["since_reset"]) == int(opt.state[b]["since_reset"]) == 3
