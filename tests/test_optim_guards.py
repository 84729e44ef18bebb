"""What the optimizers refuse or keep where torch.optim's API allows more (optim/guards.py,
optim/hparams.py, optim/checkpoint.py): a parameter that changed size or a group whose state
format changed after its states were made (on the numba path a segfault or heap corruption
before), complex parameters (their imaginary part was wiped), torch options that were ignored,
hyper-parameters no run can have, another optimizer's checkpoint; copies that step as the
original; fp64 parameters updated in fp64. Each runs on whatever path this machine has
(backend "auto": the numba CPU path where numba imports) and on the reference."""
from __future__ import annotations

import copy
import inspect
import io
import pickle

import pytest
import torch

import qstate_cli.optim as qoptim
from qstate_cli.errors import QstateError
from qstate_cli.optim import SGD, Adam, AdamW, Lion, Muon
from qstate_cli.quant import parse_config

BACKENDS = ["auto", "reference"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]).clone()


def snapshot(opt, params) -> list:
    """Every parameter's bits and every state tensor's bits, in order."""
    out = [_bits(p) for p in params]
    for p in params:
        for key, value in sorted(opt.state[p].items()):
            items = sorted(value.items()) if isinstance(value, dict) else [("", value)]
            out += [_bits(v) for _, v in items if isinstance(v, torch.Tensor)]
    return out


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def two_groups(cls, backend, states="bred-4bit", mqn=0, steps=3, **kw):
    """Group 0: a (64, 80) matrix; group 1: a 4096-element vector and a small bias; `steps` steps."""
    torch.manual_seed(0)
    a, p, b = (torch.nn.Parameter(torch.randn(s)) for s in ((64, 80), (4096,), (40,)))
    opt = cls([{"params": [a]}, {"params": [p, b]}], states=states, min_quant_numel=mqn, backend=backend, **kw)
    for _ in range(steps):
        for t in (a, p, b):
            t.grad = torch.randn_like(t)
        opt.step()
    return opt, (a, p, b)


# ---- 1. a parameter that changes size --------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("states, mqn", [("bred-4bit", 0), ("bnb-8bit", 0), ("bf16", 0), ("fp32", 0),
                                         ("bred-4bit", 4096)])
@pytest.mark.parametrize("new", [8192, 2048, 4097])
@pytest.mark.parametrize("cls", [AdamW, SGD])
def test_a_parameter_that_changes_size_is_refused_before_anything_is_written(backend, states, mqn, new, cls):
    """p.data = a tensor of another size after p has states: the numba path read and wrote the
    states out of bounds (rc 139, "corrupted double-linked list"), grown fp32 / bf16 states
    silently; now one RuntimeError naming it, and no parameter or state of any group written."""
    opt, (a, p, b) = two_groups(cls, backend, states, mqn)
    p.data = torch.randn(new)
    for t in (a, p, b):
        t.grad = torch.randn_like(t)
    before = snapshot(opt, (a, b))
    p_state = [_bits(t) for t in snapshot(opt, (p,))[1:]]
    with pytest.raises(RuntimeError, match=f"parameter 0 of group 1 has {new:,} elements, its optimizer state was "
                                           r"made for 4,096: a parameter that changes size needs a new optimizer, "
                                           r"or its state removed \(del opt.state\[p\]\)"):
        opt.step()
    assert same(snapshot(opt, (a, b)), before)
    assert same(snapshot(opt, (p,))[1:], p_state)
    del opt.state[p]  # what the message says: a fresh state for the new size
    opt.step()
    assert opt.state[p]["step"].item() == 1 and torch.isfinite(p).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_size_at_a_new_address_steps_on(backend):
    """p.data = another tensor of the same size (a checkpoint's weights copied in) is fine."""
    opt, (a, p, b) = two_groups(AdamW, backend)
    p.data = torch.randn(4096)
    p.grad = torch.randn(4096)
    opt.step()
    assert opt.state[p]["step"].item() == 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_gradient_of_another_size_than_its_parameter_is_refused(backend):
    opt, (a, p, b) = two_groups(AdamW, backend)
    p.data = torch.randn(8192)  # the gradient left at the old size
    before = snapshot(opt, (a, b))
    with pytest.raises(RuntimeError, match="parameter 0 of group 1 has 8,192 elements but its gradient 4,096"):
        opt.step()
    assert same(snapshot(opt, (a, b)), before)


# ---- 2. a group's state format changed ------------------------------------------------------
CHANGES = {
    "states parsed": ("states", lambda: parse_config("fp32"), "'states'\\] changed from bred-4bit to fp32"),
    "states as a name": ("states", lambda: "fp32", "'states'\\] changed from bred-4bit to fp32"),
    "min_quant_numel": ("min_quant_numel", lambda: 10 ** 6, "'min_quant_numel'\\] changed from 0 to 1000000"),
}


def _refused_untouched(opt, params, match: str) -> None:
    """A step with fresh gradients raises RuntimeError(match) and changes no parameter or state."""
    for t in params:
        t.grad = torch.randn_like(t)
    before = snapshot(opt, params)
    with pytest.raises(RuntimeError, match=match):
        opt.step()
    assert same(snapshot(opt, params), before)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["", "after-state_dict"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_state_format_changed_after_states_exist_is_refused(backend, change, checkpointed):
    """The numba path segfaulted; the reference raised KeyError: 'scales'. After a
    state_dict() too: the copy-on-write of its next step (optim/borrowed.py) once dropped the
    guards' records with the launch caches, and the change became the new baseline."""
    opt, (a, p, b) = two_groups(AdamW, backend)
    if checkpointed:
        opt.state_dict()
    key, value, message = CHANGES[change]
    opt.param_groups[1][key] = value()
    _refused_untouched(opt, (a, p, b), f"param_groups\\[1\\]\\[{message} after its states were made "
                                       r"\(parameter 0's m: int4:bred:b128 -> fp32\)")
    for t in (p, b):  # the way out the message names: states removed, then made in the new format
        del opt.state[t]
    opt.step()
    assert opt.state[p]["m"]["codes"].dtype == torch.float32 and opt.state[p]["step"].item() == 1


@pytest.mark.parametrize("checkpointed", [False, True], ids=["", "after-state_dict"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("new", ["nearest-4bit", "nearest-8bit"])  # the same storage as bred-4bit's, and another
def test_a_group_dict_replaced_by_one_with_another_format_is_refused(backend, new, checkpointed):
    """The group-level record cannot see a new dict; the per-parameter specs can (a review
    found nearest-4bit stepped bred-4bit's codes without their dither, silently). After a
    state_dict() too (the test above)."""
    opt, (a, p, b) = two_groups(AdamW, backend)
    if checkpointed:
        opt.state_dict()
    opt.param_groups[1] = dict(opt.param_groups[1], states=new)
    _refused_untouched(opt, (a, p, b), r"parameter 0 of group 1: its state format changed after its state was "
                                       r"made \(m: int4:bred:b128 -> int\d:nearest")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_configuration_change_that_keeps_every_format_steps_on(backend):
    """The same preset given again as a name (parsed, not an AttributeError), and a
    min_quant_numel every parameter stays above, change no state's format."""
    opt, (a, p, b) = two_groups(AdamW, backend)
    twin, (a2, p2, b2) = two_groups(AdamW, backend)
    opt.param_groups[0]["states"] = "bred-4bit"
    opt.param_groups[0]["min_quant_numel"] = 100
    for t, u in ((a, a2), (p, p2), (b, b2)):
        t.grad = torch.randn_like(t)
        u.grad = t.grad.clone()
    opt.step()
    twin.step()
    assert same(snapshot(opt, (a, p, b)), snapshot(twin, (a2, p2, b2)))
    assert opt.param_groups[0]["states"] == parse_config("bred-4bit")
    assert opt.path_for(a) == twin.path_for(a2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_schedules_still_change_lr_betas_and_weight_decay_mid_run(backend):
    """What schedulers do every step: lr 0 then leaves every parameter as it is (AdamW with
    weight decay 0), and the next lr moves them again."""
    opt, params = two_groups(AdamW, backend)
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0)  # sets each group's lr to 0 now
    for group in opt.param_groups:
        group.update(betas=(0.8, 0.99), weight_decay=0.0)
    before = [_bits(t) for t in params]
    for _ in range(2):
        for t in params:
            t.grad = torch.randn_like(t)
        opt.step()
    assert all(torch.equal(_bits(t), x) for t, x in zip(params, before))
    for group in opt.param_groups:
        group["lr"] = 1e-2
    opt.step()
    assert not any(torch.equal(_bits(t), x) for t, x in zip(params, before))


# ---- 3. copies --------------------------------------------------------------------------------
def _copy(how: str, obj):
    if how == "deepcopy":
        return copy.deepcopy(obj)
    if how == "pickle":
        return pickle.loads(pickle.dumps(obj))
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("cls, states", [(AdamW, "bred-4bit"), (AdamW, "sr-4bit"), (Lion, "bf16"), (Muon, "bred-4bit")])
def test_a_copy_of_model_and_optimizer_steps_exactly_as_the_original(backend, how, cls, states):
    """copy.deepcopy / pickle / torch.save of {'model': m, 'opt': o} gave an optimizer without
    `backend` (torch's __getstate__ keeps defaults, state and param_groups only): its step raised
    AttributeError. Now the copy has the original's attributes, no caches, and the same steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 10))
    opt = cls(model.parameters(), lr=1e-2, states=states, reset=2, backend=backend)
    x = torch.randn(16, 64)
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    both = _copy(how, {"model": model, "opt": opt})
    m2, o2 = both["model"], both["opt"]
    assert (o2.backend, str(o2.reset_policy)) == (opt.backend, str(opt.reset_policy)) == (backend, "2")
    assert o2.defaults.keys() == opt.defaults.keys()
    assert not {"_plans", "_wholes", "_routes", "_kernel_batches"} & o2.__dict__.keys()
    assert all(q is p for q, p in zip(o2.param_groups[0]["params"], m2.parameters()))
    for _ in range(3):
        for o, m in ((opt, model), (o2, m2)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
        assert same(snapshot(o2, list(m2.parameters())), snapshot(opt, list(model.parameters())))
    assert o2.path_for(next(m2.parameters())) == opt.path_for(next(model.parameters()))


# ---- 4. complex parameters ---------------------------------------------------------------------
@pytest.mark.parametrize("cls", [AdamW, Lion, SGD, Muon])
def test_complex_parameters_are_refused_when_added(cls):
    """Their imaginary part was wiped at the first step (AdamW fp32 and 4-bit, SGD)."""
    z = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"parameter 0 of group 0 is complex \(torch.complex64\): complex "
                                         r"parameters are not supported; step torch.view_as_real\(p\)"):
        cls([z])
    opt = cls([torch.nn.Parameter(torch.randn(8, 8))])
    with pytest.raises(ValueError, match="parameter 1 of group 1 is complex"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4)), z]})
    assert len(opt.param_groups) == 1


# ---- 5. fp64 parameters ------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls", [AdamW, Adam, Lion, SGD, Muon])
@pytest.mark.parametrize("states", ["fp32", "bred-4bit"])
def test_an_fp64_parameter_is_left_as_it_is_at_lr_0(backend, cls, states):
    """It was rounded to fp32 at every step, even at lr = 0 (1 + 1e-10 -> 1.0)."""
    start = torch.full((16, 8), 1.0 + 1e-10, dtype=torch.float64) + torch.arange(128.0).view(16, 8) * 1e-12
    p = torch.nn.Parameter(start.clone())
    opt = cls([p], lr=0.0, weight_decay=0.0, states=states, min_quant_numel=0, backend=backend)
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    assert opt.path_for(p) == "reference" and opt.state[p]["step"].item() == 3
    assert torch.equal(_bits(p), _bits(start))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_fp64_parameter_moves_by_small_steps_as_torch_adamw_moves_it(backend):
    """lr 1e-9 on values near 1 for 100 steps: fp32 rounding lost every step (it moved 0);
    torch's AdamW moves it 1e-7. The update itself is computed in fp32 (the states' math, as
    for every parameter) and added in fp64: the movement agrees with torch's to 1e-6 of it."""
    ours = torch.nn.Parameter(torch.ones(64, dtype=torch.float64))
    theirs = torch.nn.Parameter(torch.ones(64, dtype=torch.float64))
    opt = AdamW([ours], lr=1e-9, weight_decay=0.0, states="fp32", backend=backend)
    ref = torch.optim.AdamW([theirs], lr=1e-9, weight_decay=0.0, foreach=False)
    g = torch.Generator().manual_seed(0)
    for _ in range(100):
        ours.grad = torch.rand(64, generator=g, dtype=torch.float64) + 0.5
        theirs.grad = ours.grad.clone()
        opt.step()
        ref.step()
    moved, want = ours.detach() - 1.0, theirs.detach() - 1.0
    assert want.abs().min() > 5e-8 and (1.0 - torch.tensor(1e-9)).item() == 1.0  # each step below fp32's spacing
    torch.testing.assert_close(moved, want, rtol=1e-6, atol=0.0)


# ---- 6. torch options this optimizer does not implement ----------------------------------------
# the options are torch.optim's (guards.unimplemented reads their signatures): torch < 2.7's Adam has none
# named decoupled_weight_decay, so there is nothing for qstate's Adam to refuse
_ADAM_DWD = pytest.param(Adam, "decoupled_weight_decay", marks=pytest.mark.skipif(
    "decoupled_weight_decay" not in inspect.signature(torch.optim.Adam.__init__).parameters,
    reason=f"torch {torch.__version__}'s Adam has no decoupled_weight_decay option (new in torch 2.7)"))


@pytest.mark.parametrize("cls, key", [(AdamW, "maximize"), (AdamW, "amsgrad"), _ADAM_DWD,
                                      (SGD, "maximize"), (SGD, "differentiable"), (Lion, "capturable"),
                                      (Muon, "maximize"), (AdamW, "foreach"), (SGD, "fused")])
def test_a_group_setting_a_torch_option_this_optimizer_ignores_is_refused(cls, key):
    """AdamW([{"params": [p], "maximize": True}]) minimized; amsgrad was accepted and ignored."""
    p = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match=f"param_groups\\[0\\] sets {key}=True, a torch.optim option this "
                                         "optimizer does not implement"):
        cls([{"params": [p], key: True}])
    opt = cls([p])
    with pytest.raises(ValueError, match=f"param_groups\\[1\\] sets {key}=True"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4))], key: True})
    assert len(opt.param_groups) == 1


def test_a_false_torch_option_and_a_users_own_keys_stay_allowed():
    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = AdamW([{"params": [p], "maximize": False, "amsgrad": False, "name": "encoder"}])
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.param_groups[0]["name"] == "encoder"


def test_a_muon_groups_newton_schulz_settings_change_its_step():
    """ns_steps is a Muon setting, group-level too: ns_steps=1 in a group steps as a Muon built with it."""
    w = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(64, 48, generator=torch.Generator().manual_seed(1))
    out = {}
    for name, build in {"default": lambda p: Muon([p], states="fp32"),
                        "group": lambda p: Muon([{"params": [p], "ns_steps": 1}], states="fp32"),
                        "built": lambda p: Muon([p], states="fp32", ns_steps=1)}.items():
        p = torch.nn.Parameter(w.clone())
        opt = build(p)
        p.grad = grad.clone()
        opt.step()
        out[name] = p.detach()
    assert torch.equal(out["group"], out["built"]) and not torch.equal(out["group"], out["default"])


# ---- 7. hyper-parameters -----------------------------------------------------------------------
BAD = [(AdamW, dict(betas=(1.0, 0.999)), r"betas \(1.0, 0.999\): each beta must be in \[0, 1\)"),
       (AdamW, dict(betas=(0.9, 1.5)), r"betas \(0.9, 1.5\): each beta must be in \[0, 1\)"),
       (AdamW, dict(lr=float("nan")), "lr nan: must be a finite number"),
       (AdamW, dict(lr=-1e-2), r"lr -0.01: must be in \[0, inf\)"),
       (AdamW, dict(eps=-1e-8), r"eps -1e-08: must be in \(0, inf\)"),
       (Lion, dict(weight_decay=-0.1), r"weight_decay -0.1: must be in \[0, inf\)"),
       (SGD, dict(momentum=1.0), r"momentum 1.0: must be in \[0, 1\)"),
       (SGD, dict(nesterov=True, momentum=0.0), "nesterov: Nesterov momentum needs momentum > 0 and dampening 0"),
       (SGD, dict(nesterov=True, dampening=0.5), "nesterov: Nesterov momentum needs momentum > 0 and dampening 0"),
       (Muon, dict(momentum=-0.5), r"momentum -0.5: must be in \[0, 1\)")]


@pytest.mark.parametrize("cls, kw, message", BAD, ids=[f"{c.__name__}-{next(iter(k))}" for c, k, _ in BAD])
def test_hyper_parameters_no_run_can_have_are_refused_as_torch_refuses_them(cls, kw, message):
    """They built and stepped to NaN; now ValueError from the constructor and from a group."""
    p = torch.nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match=message):
        cls([p], **kw)
    with pytest.raises(ValueError, match=message):
        cls([{"params": [p], **kw}])
    opt = cls([p])
    with pytest.raises(ValueError, match=message):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4))], **kw})
    assert len(opt.param_groups) == 1


def test_the_cli_applies_the_same_rule_with_its_own_error():
    from qstate_cli.optim import OPTIMIZERS

    with pytest.raises(QstateError, match=r"hparams betas \[0.9, 1.0\]: each beta must be in \[0, 1\)"):
        OPTIMIZERS["adamw"].check_hparams({"betas": [0.9, 1.0]})
    with pytest.raises(QstateError, match="Nesterov momentum needs momentum > 0"):
        OPTIMIZERS["sgd"].check_hparams({"nesterov": True, "momentum": 0.0, "dampening": 0.0})


def test_edge_values_torch_takes_are_taken():
    p = torch.nn.Parameter(torch.randn(8, 8))
    AdamW([p], lr=0.0, betas=(0.0, 0.0), weight_decay=0.0)
    AdamW([p], lr=torch.tensor(1e-3))
    SGD([p], momentum=0.0, dampening=1.0)
    SGD([p], nesterov=True, momentum=0.5, dampening=0.0)


# ---- 8. another optimizer's checkpoint ---------------------------------------------------------
@pytest.mark.parametrize("saved_by, loaded_by, keys, whose", [
    ("AdamW", "Lion", "'eps', 'decoupled'", "AdamW or Adam"),
    ("SGD", "Muon", "'dampening'", "SGD"),
    ("Adam", "Lion", "'eps', 'decoupled'", "AdamW or Adam")])
def test_a_checkpoint_holding_another_optimizers_hyper_parameters_is_refused(saved_by, loaded_by, keys, whose):
    """Lion loaded AdamW's state_dict silently (its eps, decoupled and an unused v state)."""
    w = torch.nn.Parameter(torch.randn(64, 128))
    saved = getattr(qoptim, saved_by)([w], lr=1e-3)
    w.grad = torch.ones_like(w)
    saved.step()
    target = getattr(qoptim, loaded_by)([w], lr=1e-3)
    with pytest.raises(ValueError, match=f"param_groups\\[0\\] holds {keys}, which {loaded_by} does not take: the "
                                         f"state_dict of {whose}"):
        target.load_state_dict(saved.state_dict())
    assert target.state == {}


def test_a_checkpoint_holding_a_state_this_optimizer_does_not_keep_is_refused():
    w = torch.nn.Parameter(torch.randn(64, 128))
    lion = Lion([w], lr=1e-3)
    w.grad = torch.ones_like(w)
    lion.step()
    sd = lion.state_dict()
    sd["state"][0]["v"] = {k: v.clone() for k, v in sd["state"][0]["m"].items()}
    with pytest.raises(ValueError, match="the state of parameter 0 holds 'v', which Lion does not keep: the "
                                         "state_dict of AdamW or Adam"):
        Lion([w], lr=1e-3).load_state_dict(sd)


def test_a_checkpoint_with_a_users_own_group_keys_loads():
    w = torch.nn.Parameter(torch.randn(64, 128))
    opt = AdamW([{"params": [w], "name": "head"}], lr=1e-3)
    w.grad = torch.ones_like(w)
    opt.step()
    fresh = AdamW([{"params": [w], "name": "head"}], lr=1e-3)
    fresh.load_state_dict(opt.state_dict())
    assert fresh.param_groups[0]["name"] == "head" and fresh.state[w]["step"].item() == 1
