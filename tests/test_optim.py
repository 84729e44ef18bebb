"""Reference optimizers: fp32 states equal torch.optim; quantized states' bytes; resets;
non-finite gradients; checkpoints that resume bit for bit."""
import inspect
import io

import pytest
import torch

from qstate_cli.optim import SGD, AdamW, Adam, Lion, Muon, ResetPolicy
from qstate_cli.optim import rules
from qstate_cli.quant import parse_config


def run_pair(ours, theirs, shape=(64, 48), steps=25, seed=0):
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(shape, generator=g)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    oa, ob = ours([a]), theirs([b])
    for _ in range(steps):
        grad = torch.randn(shape, generator=g)
        a.grad, b.grad = grad.clone(), grad.clone()
        oa.step()
        ob.step()
    return a.detach(), b.detach(), oa


def test_fp32_adamw_equals_torch_adamw():
    a, b, _ = run_pair(lambda p: AdamW(p, lr=1e-2, weight_decay=0.1, states="fp32", min_quant_numel=0),
                       lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, foreach=False))
    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


def test_fp32_adam_equals_torch_adam_with_l2():
    a, b, _ = run_pair(lambda p: Adam(p, lr=1e-2, weight_decay=0.05, states="fp32", min_quant_numel=0),
                       lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.05, foreach=False))
    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("nesterov", [False, True])
def test_fp32_sgd_equals_torch_sgd(nesterov):
    a, b, _ = run_pair(lambda p: SGD(p, lr=1e-2, momentum=0.9, weight_decay=0.01, nesterov=nesterov, states="fp32",
                                     min_quant_numel=0),
                       lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, weight_decay=0.01, nesterov=nesterov,
                                                 foreach=False))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


class PlainLion(torch.optim.Optimizer):
    """Lion written from the paper, for comparison."""

    def __init__(self, params, lr, betas, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for gr in self.param_groups:
            for p in gr["params"]:
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                b1, b2 = gr["betas"]
                c = m * b1 + p.grad * (1 - b1)
                p.mul_(1 - gr["lr"] * gr["weight_decay"]).add_(torch.sign(c), alpha=-gr["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


def test_fp32_lion_equals_the_paper():
    a, b, _ = run_pair(lambda p: Lion(p, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, states="fp32", min_quant_numel=0),
                       lambda p: PlainLion(p, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1))
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


class PlainMuon(torch.optim.Optimizer):
    def __init__(self, params, lr, momentum):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for gr in self.param_groups:
            for p in gr["params"]:
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.lerp_(p.grad, 1 - gr["momentum"])
                upd = p.grad.lerp(buf, gr["momentum"])
                o = rules.newton_schulz(upd) * max(1, p.shape[0] / p.shape[1]) ** 0.5
                p.add_(o, alpha=-gr["lr"])


def test_fp32_muon_equals_a_plain_muon():
    a, b, _ = run_pair(lambda p: Muon(p, lr=0.02, momentum=0.95, states="fp32", min_quant_numel=0),
                       lambda p: PlainMuon(p, lr=0.02, momentum=0.95), steps=10)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
@pytest.mark.parametrize("kw", [{}, dict(adjust_lr_fn="match_rms_adamw"), dict(ns_steps=2, weight_decay=0.1),
                                dict(ns_coefficients=(2.0, -1.5, 0.5), eps=1e-3, nesterov=False)])
def test_fp32_muon_follows_torch_muon_settings(kw):
    """torch.optim.Muon's settings mean the same here: each changes the update by far more
    than the bf16 (torch) vs fp32 (ours) Newton-Schulz difference this allows (3% of the
    parameter's total move; "match_rms_adamw" scales a 256 x 64 update by 3.2 / 2)."""
    kw = {**dict(lr=0.02, momentum=0.95, weight_decay=0.0), **kw}
    a, b, _ = run_pair(lambda p: Muon(p, states="fp32", min_quant_numel=0, **kw),
                       lambda p: torch.optim.Muon(p, **kw), shape=(256, 64), steps=5)
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn((256, 64), generator=g)
    moved = (b - w0).norm()
    assert (a - b).norm() < 0.03 * moved


@pytest.mark.parametrize("shape", [(0, 5), (4, 0, 3)])
@pytest.mark.parametrize("states", ["nearest-4bit", "bf16"])
def test_muon_steps_an_empty_matrix_beside_a_full_one(shape, states):
    """An empty >= 2-D weight (torch.optim.Muon steps it) has nothing to orthogonalize: it
    steps and stays empty, and the matrix beside it steps as it does alone. Before, the
    Newton-Schulz reshape (0, -1) raised, or muon_lr_ratio divided by 0 columns."""
    g = torch.Generator().manual_seed(0)
    w0, grads = torch.randn(32, 16, generator=g), [torch.randn(32, 16, generator=g) for _ in range(3)]
    moved = []
    for with_empty in (False, True):
        full = torch.nn.Parameter(w0.clone())
        params = [full] + ([torch.nn.Parameter(torch.randn(shape))] if with_empty else [])
        opt = Muon(params, states=states, min_quant_numel=0)
        for grad in grads:
            for p in params:
                p.grad = grad if p is full else torch.randn(p.shape)
            opt.step()
        moved.append(full.detach().clone())
        assert all(p.shape == torch.Size(shape) for p in params[1:])
    assert torch.equal(moved[0], moved[1])


@pytest.mark.parametrize("kw", [dict(ns_steps=100), dict(ns_steps=2.5), dict(ns_coefficients=(1.0, 2.0)),
                                dict(adjust_lr_fn="rms"), dict(eps=0.0)])
def test_muon_refuses_newton_schulz_settings_no_run_can_have(kw):
    p = torch.nn.Parameter(torch.zeros(8, 8))
    with pytest.raises(ValueError, match=next(iter(kw))):
        Muon([p], **kw)


def test_a_muon_checkpoint_saved_before_the_newton_schulz_settings_loads_with_their_defaults():
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(32, 48, generator=g) for _ in range(4)]
    a = torch.nn.Parameter(torch.randn(32, 48, generator=g))
    b = torch.nn.Parameter(a.detach().clone())
    oa = Muon([a], states="sr-4bit", min_quant_numel=0)
    for grad in grads[:2]:
        a.grad = grad.clone()
        oa.step()
    saved = oa.state_dict()
    for group in saved["param_groups"]:  # as saved before 2026-12-07
        for key in ("ns_steps", "ns_coefficients", "eps", "adjust_lr_fn"):
            del group[key]
    b.data.copy_(a.detach())
    ob = Muon([b], states="sr-4bit", min_quant_numel=0, ns_steps=1)
    ob.load_state_dict(saved)
    assert ob.param_groups[0]["ns_steps"] == 5
    for grad in grads[2:]:
        a.grad, b.grad = grad.clone(), grad.clone()
        oa.step()
        ob.step()
    assert torch.equal(a, b)


def test_newton_schulz_orthogonalizes():
    g = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    o = rules.newton_schulz(g)
    s = torch.linalg.svdvals(o)
    assert s.min() > 0.5 and s.max() < 1.3  # singular values pushed towards ~1


@pytest.mark.parametrize("cls,states,cfg", [
    (AdamW, ("m", "v"), "bred-4bit"), (AdamW, ("m", "v"), "bnb-8bit"), (AdamW, ("m", "v"), "torchao-4bit"),
    (AdamW, ("m", "v"), "bf16"), (Lion, ("m",), "nearest-4bit"), (SGD, ("m",), "sr-4bit"), (Muon, ("m",), "fp8")])
def test_state_bytes_match_the_accounting(cls, states, cfg):
    shapes = [(300, 17), (4096,), (33,)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = cls(params, states=cfg, min_quant_numel=64)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    c = parse_config(cfg)
    want = 0
    for p in params:
        for name in states:
            spec = c.spec(name)
            if p.numel() < 64:
                want += 4 * p.numel()  # small tensors keep fp32 states
                continue
            blocks = -(-p.numel() // spec.block) if spec.scaled else 0
            want += -(-p.numel() * spec.bits // 8) + blocks * spec.scale_bytes
    assert opt.state_nbytes() == want


def test_four_bit_adamw_state_is_1_0625_bytes_per_param():
    p = torch.nn.Parameter(torch.randn(128 * 1000))
    opt = AdamW([p], states="bred-4bit")
    p.grad = torch.randn_like(p)
    opt.step()
    assert opt.state_nbytes() / p.numel() == 1.0625


def test_nonfinite_gradients_are_counted_and_zeroed():
    p = torch.nn.Parameter(torch.ones(256))
    q = torch.nn.Parameter(torch.ones(256))
    opt = AdamW([p], states="bred-4bit", min_quant_numel=0, seed=3)
    ref = AdamW([q], states="bred-4bit", min_quant_numel=0, seed=3)
    g = torch.randn(256)
    bad = g.clone()
    bad[[0, 5, 9]] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    clean = g.clone()
    clean[[0, 5, 9]] = 0.0
    p.grad, q.grad = bad, clean
    opt.step()
    ref.step()
    assert opt.nonfinite_count() == 3 and ref.nonfinite_count() == 0
    assert torch.isfinite(p).all() and torch.equal(p, q)


def test_reset_every_n_steps_zeroes_states_and_restarts_bias_correction():
    p = torch.nn.Parameter(torch.randn(512))
    opt = AdamW([p], states="fp32", reset=3, min_quant_numel=0)
    seen = []
    for _ in range(7):
        p.grad = torch.randn(512)
        opt.step()
        seen.append(int(opt.state[p]["since_reset"]))
    assert seen == [1, 2, 3, 1, 2, 3, 1]
    # right after a reset the state holds only one step's worth: m = (1 - beta1) g
    p.grad = torch.randn(512)
    opt2 = AdamW([torch.nn.Parameter(p.detach().clone())], states="fp32", reset=ResetPolicy(fn=lambda s, k: True),
                 min_quant_numel=0)
    opt2.param_groups[0]["params"][0].grad = p.grad.clone()
    opt2.step()
    opt2.step()
    m = opt2.state[opt2.param_groups[0]["params"][0]]["m"]["codes"]
    torch.testing.assert_close(m, p.grad * 0.1)


def test_reset_policy_parsing():
    assert ResetPolicy.parse("none").period is None
    assert ResetPolicy.parse("250").period == 250
    assert ResetPolicy.parse("auto").auto
    with pytest.raises(Exception, match="reset"):
        ResetPolicy.parse("sometimes")


@pytest.mark.parametrize("cls,cfg", [(AdamW, "bred-4bit"), (AdamW, "sr-4bit"), (Lion, "torchao-4bit"),
                                     (SGD, "bnb-8bit"), (Muon, "bred-4bit")])
def test_checkpoint_resume_continues_bit_for_bit(cls, cfg):
    def make(seed_params=0):
        torch.manual_seed(seed_params)
        ps = [torch.nn.Parameter(torch.randn(40, 33)), torch.nn.Parameter(torch.randn(300))]
        return ps, cls(ps, states=cfg, min_quant_numel=0, seed=123)

    grads = [[torch.randn(40, 33), torch.randn(300)] for _ in range(8)]
    ps, opt = make()
    for i in range(4):
        for p, g in zip(ps, grads[i]):
            p.grad = g.clone()
        opt.step()
    buf = io.BytesIO()
    torch.save({"params": [p.detach().clone() for p in ps], "opt": opt.state_dict()}, buf)
    for i in range(4, 8):
        for p, g in zip(ps, grads[i]):
            p.grad = g.clone()
        opt.step()
    # resume in a fresh optimizer from the checkpoint (loaded as a stranger's file would be)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    ps2, opt2 = make(seed_params=99)
    with torch.no_grad():
        for p, saved in zip(ps2, ck["params"]):
            p.copy_(saved)
    opt2.load_state_dict(ck["opt"])
    assert opt2.param_groups[0]["seed"] == 123
    for i in range(4, 8):
        for p, g in zip(ps2, grads[i]):
            p.grad = g.clone()
        opt2.step()
    for a, b in zip(ps, ps2):
        assert torch.equal(a, b)
    for p, p2 in zip(ps, ps2):
        for k in opt.state_names:
            for part in opt.state[p][k]:
                assert torch.equal(opt.state[p][k][part], opt2.state[p2][k][part])
                assert opt.state[p][k][part].dtype == opt2.state[p2][k][part].dtype


def test_states_are_parsed_once_and_checkpointed_as_names(monkeypatch):
    """A group holds its StateConfig (parsed at construction, never again per step); the
    state_dict holds its name, and loading parses it back into an equal StateConfig."""
    from qstate_cli.optim import base, checkpoint
    from qstate_cli.quant import config as qconfig

    p = torch.nn.Parameter(torch.randn(5000))
    opt = AdamW([p], states="bred-4bit", min_quant_numel=0)
    cfg = opt.param_groups[0]["states"]
    assert cfg == parse_config("bred-4bit") and str(cfg) == "bred-4bit"
    calls = []
    counting = lambda text: calls.append(text) or qconfig.parse_config(text)  # noqa: E731
    monkeypatch.setattr(base, "parse_config", counting)
    monkeypatch.setattr(checkpoint, "parse_config", counting)  # load_state_dict's parsing (optim/checkpoint.load)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    assert calls == []
    sd = opt.state_dict()
    assert sd["param_groups"][0]["states"] == "bred-4bit" and opt.param_groups[0]["states"] is cfg
    opt2 = AdamW([torch.nn.Parameter(torch.randn(5000))], states="fp32")
    calls.clear()
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["states"] == cfg and calls == ["bred-4bit"]
    opt2.add_param_group({"params": [torch.nn.Parameter(torch.randn(3))], "states": "m=int8:bred:b64,v=fp32"})
    assert opt2.param_groups[1]["states"].m.block == 64


def test_bf16_parameters_keep_fp32_scales_through_a_checkpoint():
    p = torch.nn.Parameter(torch.randn(1024, dtype=torch.bfloat16))
    opt = AdamW([p], states="bred-4bit", min_quant_numel=0)
    p.grad = torch.randn_like(p)
    opt.step()
    sd = opt.state_dict()
    opt2 = AdamW([p], states="bred-4bit", min_quant_numel=0)
    opt2.load_state_dict(sd)
    assert opt2.state[p]["m"]["scales"].dtype == torch.float32
    assert opt2.state[p]["m"]["codes"].dtype == torch.uint8


def test_step_scalars_are_device_independent_fp32_values():
    """Bias corrections come from float64 on the host, rounded once to fp32; lr / bc1 is a
    true fp32 division (never a multiply by a reciprocal), so every device agrees."""
    import numpy as np

    s = rules.step_scalars(3e-4, 0.1, 0.9, 0.999, 7, "cpu")
    bc1 = np.float32(1.0 - 0.9 ** 7)
    assert s.step_size.item() == float(np.float32(3e-4) / bc1)
    assert s.inv_bc2_sqrt.item() == float(np.float32(1 / np.sqrt(1.0 - 0.999 ** 7)))
    assert s.decay.item() == float(np.float32(1.0) - np.float32(3e-4) * np.float32(0.1))
    lr = torch.tensor(3e-4)  # a scheduled lr held in a tensor gives the same numbers
    assert torch.equal(rules.pack_scalars(rules.step_scalars(lr, 0.1, 0.9, 0.999, 7, "cpu")), rules.pack_scalars(s))


@pytest.mark.parametrize("lr,wd,b1,b2,t", [
    (3e-4, 0.1, 0.9, 0.999, 7), (1.0, 0.0, 0.0, 0.0, 1), (1e-3, 0.01, 0.95, 0.98, 100000),
    (1e-45, 3.0, 0.9, 1.0, 3),  # a subnormal lr; beta2 = 1: inv_bc2_sqrt = inf
    (2.5, 0.9, 1.0, 0.999, 2),  # beta1 = 1: lr / 0 = inf; decay < 0
    (7, 1e30, 0.5, 0.5, 1),  # an int lr; lr * wd overflows: decay = -inf
    (float("nan"), 0.1, 0.9, 0.999, 1), (3e-4, -0.5, 0.9, 0.999, 40),
    (0.8122944235801697, 0.19301114976406097, 0.9, 0.999, 5)])  # fp32 1 - lr * wd != the float64 one rounded
def test_packed_scalars_on_the_host_are_the_torch_ops_bits(lr, wd, b1, b2, t):
    """The CPU launch's host-side scalars (numpy fp32) carry the very bits of step_scalars'
    torch ops, edge values included; a tensor lr takes the torch ops."""
    ref = rules.pack_scalars(rules.step_scalars(lr, wd, b1, b2, t, "cpu"))
    host = rules.packed_scalars(lr, wd, b1, b2, t, "cpu")
    assert host.dtype == torch.float32 and host.shape == (4,)
    assert torch.equal(host.view(torch.int32), ref.view(torch.int32)), (host, ref)
    lr_t = torch.tensor(float(lr))
    assert torch.equal(rules.packed_scalars(lr_t, wd, b1, b2, t, "cpu").view(torch.int32), ref.view(torch.int32))


def test_packed_scalars_tell_a_negative_zero_lr_from_zero():
    """host_scalars computes each distinct input once (a step's launches share them): -0.0 and
    0.0 compare equal, yet lr = -0.0 gives other bits (lr, lr / bc1), so each keeps its own."""
    for lr in (0.0, -0.0, 0.0):
        for wd in (0.5, -0.0):
            ref = rules.pack_scalars(rules.step_scalars(lr, wd, 0.9, 0.999, 3, "cpu"))
            host = rules.packed_scalars(lr, wd, 0.9, 0.999, 3, "cpu")
            assert torch.equal(host.view(torch.int32), ref.view(torch.int32)), (lr, wd, host, ref)
    assert rules.packed_scalars(-0.0, 0.5, 0.9, 0.999, 3, "cpu")[2].view(torch.int32) != 0  # -0.0: the sign bit


def test_div_scalar_is_true_division():
    import numpy as np

    from qstate_cli.quant.quantizer import div_scalar

    x = torch.randn(4096) * torch.exp(torch.randn(4096) * 10)
    want = torch.from_numpy(x.numpy() / np.float32(7.0))
    assert torch.equal(div_scalar(x, 7.0), want)


def test_registry_holds_what_every_user_of_an_optimizer_reads():
    """optim/registry.py: one entry per optimizer; its states are the ones a step keeps, its
    betas are the group's, its defaults the class's, and a wrong name suggests the closest."""
    from qstate_cli.errors import QstateError
    from qstate_cli.optim import OPTIMIZERS, optimizer_info

    assert list(OPTIMIZERS) == ["adamw", "adam", "lion", "sgd", "muon"]
    for name, info in OPTIMIZERS.items():
        p = torch.nn.Parameter(torch.randn(8, 16))
        opt = info.cls([p], states="bred-4bit", min_quant_numel=0)
        p.grad = torch.randn_like(p)
        opt.step()
        assert set(info.states) <= set(opt.state[p]) and info.states == opt.state_names
        group = opt.param_groups[0]
        assert info.betas(group) == info.cls.state_betas(group)
        assert info.hparams()["lr"] == group["lr"]  # the class default, as the group has it
        assert info.reset_state() == ("v" if "v" in info.states else "m")
        assert info.default_lr > 0
    assert optimizer_info(" AdamW ") is OPTIMIZERS["adamw"]
    assert OPTIMIZERS["lion"].betas() == {"m": 0.99}  # Lion's memory is beta2
    with pytest.raises(QstateError, match="did you mean adam"):
        optimizer_info("adamx")


@pytest.mark.parametrize("cls", [AdamW, Lion, SGD])
def test_sparse_gradients_are_a_clear_error_and_touch_nothing(cls):
    """As torch.optim.AdamW: a clear RuntimeError, not NotImplementedError from deep inside;
    the dense parameter stepped with it is left as it was."""
    emb = torch.nn.Embedding(10, 4, sparse=True)
    dense = torch.nn.Parameter(torch.ones(4))
    opt = cls([dense, emb.weight], lr=0.1, states="bf16", reset="none")
    emb(torch.tensor([1, 2])).sum().backward()
    dense.grad = torch.ones(4)
    before = emb.weight.detach().clone()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()
    assert torch.equal(emb.weight, before) and torch.equal(dense.detach(), torch.ones(4))


@pytest.mark.parametrize("cls", [AdamW, Lion, SGD])
def test_a_sparse_gradient_after_steady_steps_is_refused_before_any_group_steps(cls):
    """Groups stepped again from their records (optim/steady.py) skip base.step's scan for
    sparse gradients only while every group's record holds: a gradient made sparse in the
    second group, or on a recorded parameter itself, is still the clear error, and the first
    group's parameter is left as it was."""
    a, b = torch.nn.Parameter(torch.ones(64, 80)), torch.nn.Parameter(torch.ones(40))
    opt = cls([{"params": [a]}, {"params": [b]}], lr=0.1, states="bred-4bit", reset="none")
    for _ in range(3):
        a.grad, b.grad = torch.full_like(a, 0.5), torch.full_like(b, 0.25)
        opt.step()
    for sparse in (b, a):
        a.grad, b.grad = torch.full_like(a, 0.5), torch.full_like(b, 0.25)
        sparse.grad = sparse.grad.to_sparse()
        before = (a.detach().clone(), b.detach().clone())
        with pytest.raises(RuntimeError, match="does not support sparse gradients"):
            opt.step()
        assert torch.equal(a.detach(), before[0]) and torch.equal(b.detach(), before[1])


def test_a_compiled_training_loop_steps_as_eager():
    """torch.compile of a function that calls opt.step() (issue: dynamo recursed until it
    failed, or compiled for minutes): the step is kept out of the graph and steps the
    same weights as eager. 256x256 is over min_quant_numel, so the states are 4-bit."""
    def train(compiled):
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256)
        opt = AdamW(model.parameters(), lr=1e-3, states="bred-4bit")

        def one_step(x):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        fn = torch.compile(one_step) if compiled else one_step
        for i in range(3):
            fn(torch.ones(8, 256) * (i + 1) / 10)
        return model.weight.detach().clone(), opt.state_nbytes()

    (w_eager, bytes_eager), (w_compiled, bytes_compiled) = train(False), train(True)
    assert torch.equal(w_compiled, w_eager)
    assert bytes_compiled == bytes_eager < 256 * 256 * 2  # quantized states, not fp32


def test_specs_that_train_badly_are_warned_of_and_the_hint_names_a_good_one():
    """The hint after `m=int4:bred:b128` alone suggested a bare spec, which put v on int4's
    zero level (a probe's loss: 5.7 -> 47,829 in 60 steps); an unsigned m loses its negatives."""
    import qstate_cli.optim as qoptim

    from qstate_cli.errors import QstateError

    w = torch.nn.Parameter(torch.randn(64, 64))
    with pytest.raises(QstateError, match="v=lin4nz:bred:b128, as the 4-bit presets keep it") as hint:
        qoptim.AdamW([w], states="m=int4:bred:b128")
    assert "bare spec" not in str(hint.value)
    with pytest.warns(UserWarning, match=r"AdamW v=int4:bred:b128: a 4-bit linear grid with a zero level \(int4\)"):
        qoptim.AdamW([w], states="int4:bred:b128")
    for spec, fmt in (("fp4", "e2m2"), ("m=de4:nearest:b128,v=de4u:nearest:b128", "de4u")):  # the demo: 601, 31
        with pytest.warns(UserWarning, match=rf"v={fmt}:nearest:b128: a 4-bit \w+ grid with a zero level \({fmt}\)"):
            qoptim.AdamW([w], states=spec)
    with pytest.warns(UserWarning, match="Lion m=lin4nz:bred:b128: lin4nz is unsigned.*negative values are lost"):
        qoptim.Lion([w], states="m=lin4nz:bred:b128")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the presets are quiet
        for cls, preset in ((qoptim.AdamW, "bred-4bit"), (qoptim.AdamW, "bnb-8bit"), (qoptim.Lion, "m=int4:bred:b128"),
                            (qoptim.AdamW, "torchao-4bit"), (qoptim.AdamW, "fp32")):
            cls([w], states=preset)


def test_a_spec_warning_points_at_the_line_that_built_the_optimizer():
    """Adam's constructor calls AdamW's, which calls the base class's: the warning names the
    caller's file and line, not a line inside qstate_cli/optim, whichever class it is."""
    import qstate_cli.optim as qoptim

    w = torch.nn.Parameter(torch.randn(64, 64))
    for cls, spec in ((qoptim.AdamW, "int4:bred:b128"), (qoptim.Adam, "int4:bred:b128"),
                      (qoptim.Lion, "m=uint4:bred:b128")):
        with pytest.warns(UserWarning) as caught:
            line = inspect.currentframe().f_lineno + 1
            cls([w], states=spec)
        assert {(rec.filename, rec.lineno) for rec in caught} == {(__file__, line)}, cls.__name__
