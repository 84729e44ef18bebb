"""load_state_dict copies the dict's structure, not its tensors (as torch's): loading makes no
copy of the states, and stepping never writes into the loaded dict (another optimizer's live
state_dict()), on either path (the fused CPU path writes codes and scales in place)."""
from __future__ import annotations

import copy

import pytest
import torch

from qstate_cli.optim.optimizers import AdamW, Lion

N = 5000  # above min_quant_numel: quantized states


def _tensors(sd):
    for k, v in sd["state"].items():
        for name, t in sorted(v.items()):
            if isinstance(t, dict):
                for f, u in sorted(t.items()):
                    yield (k, name, f), u
            else:
                yield (k, name), t


def _equal(a, b) -> bool:
    ta, tb = dict(_tensors(a)), dict(_tensors(b))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def _model(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(N, generator=gen)), torch.nn.Parameter(torch.randn(50, 100, generator=gen))]


def _step(opt, params, seed, nan=False):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
        if nan:
            p.grad.view(-1)[7] = float("nan")
    opt.step()


def _ptr(opt, p, name="m", field="codes"):
    return opt.state[p][name][field].untyped_storage().data_ptr()


PARAMS = [pytest.mark.parametrize("backend", ["reference", "auto"]),
          pytest.mark.parametrize("states", ["bred-4bit", "fp32", "bf16", "bnb-8bit"]),
          pytest.mark.parametrize("cls", [AdamW, Lion])]


def _with(marks):
    def wrap(fn):
        for mark in reversed(marks):
            fn = mark(fn)
        return fn
    return wrap


@_with(PARAMS)
def test_a_live_state_dict_is_copied_at_load(cls, states, backend):
    """Another optimizer's state_dict() holds its live states (the fused paths write them in
    place at its next step): both optimizers step on, each as if alone."""
    a_params = _model()
    a = cls(a_params, states=states, backend=backend)
    for i in range(2):
        _step(a, a_params, i)
    sd = a.state_dict()
    snapshot = copy.deepcopy(sd)
    b_params = [torch.nn.Parameter(p.detach().clone()) for p in a_params]
    b = cls(b_params, states=states, backend=backend)
    b.load_state_dict(sd)
    assert _ptr(b, b_params[0]) != _ptr(a, a_params[0])
    c_params = [torch.nn.Parameter(p.detach().clone()) for p in a_params]  # the same, loaded from a copy
    c = cls(c_params, states=states, backend=backend)
    c.load_state_dict(copy.deepcopy(snapshot))
    _step(b, b_params, 2, nan=True)
    _step(c, c_params, 2, nan=True)
    assert _equal(sd, snapshot) and _equal(a.state_dict(), snapshot)  # nothing written into the dict
    for i in range(3, 5):  # a and b in turn
        _step(a, a_params, i)
        _step(b, b_params, i)
        _step(c, c_params, i)
    assert _equal(b.state_dict(), c.state_dict()) and b.nonfinite_count() == 2 and a.nonfinite_count() == 0
    assert all(torch.equal(p, q) for p, q in zip(b_params, c_params))


@pytest.mark.parametrize("states", ["nearest-4bit", "sr-4bit", "bred-4bit", "bf16"])
def test_a_state_dict_keeps_the_states_of_when_it_was_taken(states):
    """A dict from state_dict() at step 2, two steps on, loaded back (a roll-back): it held the
    step-2 states all along on either path (the fused ones write codes and scales in place: its
    next step copies them first, borrowed.copy_on_write), so both paths step on from there to
    the same parameters and states, those of a roll-back from a deep copy. Before, the fused
    path's dict held step 4's codes with step 2's counters (SR and BReD read them back with the
    wrong random keys)."""
    runs = {}
    for backend in ("reference", "auto"):
        params = _model()
        opt = AdamW(params, states=states, backend=backend)
        for i in range(2):
            _step(opt, params, i, nan=i == 1)
        sd = opt.state_dict()
        snapshot = copy.deepcopy(sd)
        at2 = [p.detach().clone() for p in params]
        for i in range(2, 4):
            _step(opt, params, i, nan=True)
        assert _equal(sd, snapshot), backend  # nothing written into the dict since
        assert opt.nonfinite_count() == 6  # one NaN a parameter on steps 1, 2 and 3
        opt.load_state_dict(sd)
        assert opt.nonfinite_count() == 2
        with torch.no_grad():
            for p, q in zip(params, at2):
                p.copy_(q)
        for i in range(4, 6):
            _step(opt, params, i)
        runs[backend] = ([p.detach().clone() for p in params], copy.deepcopy(opt.state_dict()))
        # the same roll-back from a deep copy
        twin = [torch.nn.Parameter(q.clone()) for q in at2]
        other = AdamW(twin, states=states, backend=backend)
        other.load_state_dict(snapshot)
        for i in range(4, 6):
            _step(other, twin, i)
        assert all(torch.equal(p, q) for p, q in zip(runs[backend][0], twin)), backend
        assert _equal(runs[backend][1], other.state_dict()), backend
    assert all(torch.equal(p, q) for p, q in zip(runs["reference"][0], runs["auto"][0]))
    assert _equal(runs["reference"][1], runs["auto"][1])


def test_a_copy_of_the_optimizer_does_not_copy_its_states_again():
    """The note that state_dict() handed the states out (its next step copies them first)
    stays with the optimizer: a deepcopy's tensors are its own already."""
    from qstate_cli.optim.borrowed import HANDED
    params = _model()
    opt = AdamW(params, states="bred-4bit")
    _step(opt, params, 0)
    opt.state_dict()
    twin = copy.deepcopy(opt)
    assert opt.__dict__.get(HANDED) and HANDED not in twin.__dict__
    _step(opt, params, 1)
    assert HANDED not in opt.__dict__


@_with(PARAMS)
def test_a_dict_of_its_own_is_shared_at_load_and_never_written(cls, states, backend):
    """A dict nobody steps (torch.load's, a deepcopy): its tensors become the states, with no
    copy; each optimizer gets storage of its own before it writes, so two optimizers loaded
    from one dict step as if alone and the dict stays as it was."""
    a_params = _model()
    a = cls(a_params, states=states, backend=backend)
    for i in range(2):
        _step(a, a_params, i)
    sd = copy.deepcopy(a.state_dict())
    snapshot = copy.deepcopy(sd)
    twins = []
    for _ in range(2):
        params = [torch.nn.Parameter(p.detach().clone()) for p in a_params]
        opt = cls(params, states=states, backend=backend)
        opt.load_state_dict(sd)
        assert _ptr(opt, params[0]) == sd["state"][0]["m"]["codes"].untyped_storage().data_ptr()  # no copy
        twins.append((opt, params))
    for i in range(2, 5):
        for opt, params in twins:
            _step(opt, params, i, nan=i == 3)
        _step(a, a_params, i, nan=i == 3)
    assert _equal(sd, snapshot)
    for opt, params in twins:
        assert _equal(opt.state_dict(), a.state_dict()) and opt.nonfinite_count() == 2
        assert all(torch.equal(p, q) for p, q in zip(params, a_params))


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_a_state_dict_taken_before_the_first_step_after_a_load_stays_apart(backend):
    """b loads a dict of its own (shared, copied before b's first step); a state_dict() of b
    taken before that step, loaded into c after it, must not share what b then writes in place."""
    a_params = _model()
    a = AdamW(a_params, states="bred-4bit", backend=backend)
    for i in range(2):
        _step(a, a_params, i)
    b_params = [torch.nn.Parameter(p.detach().clone()) for p in a_params]
    b = AdamW(b_params, states="bred-4bit", backend=backend)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    sd2 = b.state_dict()
    _step(b, b_params, 2)  # b's states get storage of their own
    _step(a, a_params, 2)
    ref = copy.deepcopy(sd2)
    c_params = [torch.nn.Parameter(p.detach().clone()) for p in b_params]
    r_params = [torch.nn.Parameter(p.detach().clone()) for p in b_params]
    c, r = AdamW(c_params, states="bred-4bit", backend=backend), AdamW(r_params, states="bred-4bit", backend=backend)
    c.load_state_dict(sd2)
    r.load_state_dict(ref)
    _step(b, b_params, 3)  # in place on the fused path: never into c's states
    for name in ("m", "v"):
        assert torch.equal(c.decoded_state(c_params[0])[name], r.decoded_state(r_params[0])[name])
    _step(c, c_params, 4)
    _step(r, r_params, 4)
    assert _equal(c.state_dict(), r.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(c_params, r_params))


def test_a_checkpoint_from_disk_resumes_and_is_not_copied_at_load(tmp_path):
    params = _model()
    opt = AdamW(params, backend="reference")
    _step(opt, params, 0)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    sd = torch.load(tmp_path / "opt.pt", weights_only=True)
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    other = AdamW(fresh, backend="reference")
    other.load_state_dict(sd)
    assert other.state[fresh[1]]["v"]["codes"] is sd["state"][1]["v"]["codes"]
    _step(opt, params, 1)
    _step(other, fresh, 1)
    assert all(torch.equal(p, q) for p, q in zip(params, fresh))
    assert _equal(opt.state_dict(), other.state_dict())
