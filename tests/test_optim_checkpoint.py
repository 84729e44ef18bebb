"""Loading a checkpoint into a qstate optimizer (optim/checkpoint.py): a state that does not
fit its parameter is refused with what differs, and nothing is replaced. Before, the fused
CPU path stepped such a state out of bounds: a segfault or heap corruption (a user's resume
after changing a layer's width), or silent training on a wrong state."""
import copy

import pytest
import torch

import qstate_cli.optim as qoptim

SHAPE = (64, 128)  # 8192 elements: 4-bit states, 64 blocks of 128


def stepped(backend: str, shape=SHAPE, states: str = "bred-4bit"):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(shape))
    opt = qoptim.AdamW([w], lr=1e-3, states=states, backend=backend, seed=0)
    for _ in range(2):
        w.grad = torch.randn(shape)
        opt.step()
    return w, opt


DAMAGES = {
    "codes cut short": (lambda st: st["v"].update(codes=st["v"]["codes"][:1024].clone()),
                        "state v (lin4nz:bred:b128): codes hold 1,024 uint8 values where a parameter of 8,192 "
                        "elements needs 4,096 uint8"),
    "scales cut short": (lambda st: st["m"].update(scales=st["m"]["scales"][:4].clone()),
                         "state m (int4:bred:b128): scales hold 4 float32 values where a parameter of 8,192 elements "
                         "needs 64 float32"),
    "codes of another dtype": (lambda st: st["m"].update(codes=st["m"]["codes"].long()), "4,096 int64 values"),
    "scales dropped": (lambda st: st["v"].pop("scales"), "state v (lin4nz:bred:b128): scales missing"),
    "a state dropped": (lambda st: st.pop("v"), "state v (lin4nz:bred:b128): missing, or without its codes"),
    "a counter dropped": (lambda st: st.pop("step"), "'step' is missing, not one integer"),
}


def same_state(a: dict, b: dict) -> bool:
    flat_a, flat_b = _flat(a), _flat(b)
    return flat_a.keys() == flat_b.keys() and all(
        torch.equal(flat_a[k], flat_b[k]) if isinstance(flat_a[k], torch.Tensor) else flat_a[k] == flat_b[k]
        for k in flat_a)


def _flat(d, prefix=""):
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.parametrize("backend", ["reference", "auto"])
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_state_that_does_not_fit_is_refused_and_nothing_is_replaced(backend, damage):
    _, saved = stepped(backend)
    sd = saved.state_dict()
    hurt, message = DAMAGES[damage]
    hurt(sd["state"][0])
    w, opt = stepped(backend)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="load_state_dict: parameter 0 \\(shape \\(64, 128\\)\\): "):
        opt.load_state_dict(sd)
    try:
        opt.load_state_dict(sd)
    except ValueError as exc:
        assert message in str(exc)
    assert same_state(opt.state_dict(), before)  # the groups and states it had, untouched
    w.grad = torch.ones(SHAPE)
    opt.step()
    assert torch.isfinite(w).all()


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_a_checkpoint_of_another_width_or_format_is_refused(backend):
    """The resume after a layer's width changed (256 -> 128 hidden: the saved states are twice
    the size), and a group's format edited from 4 to 8 bits over 4-bit storage."""
    _, wide = stepped(backend, shape=(128, 128))
    _, opt = stepped(backend)
    saved = wide.state_dict()
    with pytest.raises(ValueError, match=r"parameter 0 \(shape \(64, 128\)\): its state was saved for a parameter of "
                                         r"shape \(128, 128\)$"):
        opt.load_state_dict(saved)
    del saved["state"][0]["shape"]  # a checkpoint saved before qstate kept the shape: its storage tells
    with pytest.raises(ValueError, match="codes hold 8,192 uint8 values where a parameter of 8,192 elements needs "
                                         "4,096 uint8 \\(saved for another parameter size"):
        opt.load_state_dict(saved)
    sd = stepped(backend)[1].state_dict()
    sd["param_groups"][0]["states"] = "nearest-8bit"
    with pytest.raises(ValueError, match="state m \\(int8:nearest:b256\\): codes hold 4,096 uint8 values where a "
                                         "parameter of 8,192 elements needs 8,192 uint8"):
        opt.load_state_dict(sd)
    assert str(opt.param_groups[0]["states"]) == "bred-4bit"


def test_what_is_not_a_qstate_optimizers_state_dict_is_one_clear_error():
    w, opt = stepped("reference")
    torch_opt = torch.optim.AdamW([w], lr=1e-3)
    w.grad = torch.ones(SHAPE)
    torch_opt.step()
    with pytest.raises(ValueError, match="param_groups\\[0\\] names no 'states': not the state_dict of a qstate "
                                         "optimizer"):
        opt.load_state_dict(torch_opt.state_dict())  # a bare KeyError: 'states' before
    with pytest.raises(ValueError, match="not an optimizer's state_dict"):
        opt.load_state_dict(torch.nn.Linear(2, 2).state_dict())  # KeyError: 'state'
    sd = opt.state_dict()
    sd["state"][99] = sd["state"][0]
    with pytest.raises(ValueError, match="a state for parameter 99, which no param group lists"):
        opt.load_state_dict(sd)  # KeyError: 99


def test_a_fitting_checkpoint_still_resumes_bit_for_bit():
    w, opt = stepped("auto")
    w2, opt2 = stepped("auto")
    opt2.load_state_dict(opt.state_dict())
    for param, o in ((w, opt), (w2, opt2)):
        param.grad = torch.full(SHAPE, 0.5)
        o.step()
    assert torch.equal(w, w2)


@pytest.mark.parametrize("saved_by, loaded_by, missing", [("Lion", "SGD", "'momentum'"), ("AdamW", "Muon", "'momentum'"),
                                                          ("SGD", "AdamW", "'betas'")])
def test_another_optimizers_checkpoint_is_refused(saved_by, loaded_by, missing):
    """A Lion checkpoint loaded into SGD was accepted; its first step raised KeyError: 'momentum'."""
    w = torch.nn.Parameter(torch.randn(SHAPE))
    saved = getattr(qoptim, saved_by)([w], lr=1e-3)
    w.grad = torch.ones(SHAPE)
    saved.step()
    target = getattr(qoptim, loaded_by)([w], lr=1e-3)
    with pytest.raises(ValueError, match=f"param_groups\\[0\\] has no {missing}.*which {loaded_by} keeps: the "
                                         "state_dict of another optimizer"):
        target.load_state_dict(saved.state_dict())



def test_a_live_groups_own_keys_do_not_make_a_checkpoint_foreign():
    """A scheduler built before the load adds `initial_lr` to each group, a user adds "name":
    a checkpoint saved without them was refused as "the state_dict of another optimizer".
    Now it loads, as into torch's AdamW, and the saved groups replace the live ones."""
    w, saved = stepped("reference")
    target = qoptim.AdamW([w], lr=1e-3, states="bred-4bit", backend="reference")
    target.param_groups[0]["name"] = "all"
    torch.optim.lr_scheduler.CosineAnnealingLR(target, 10)
    assert "initial_lr" in target.param_groups[0]
    target.load_state_dict(saved.state_dict())
    assert same_state(target.state[w], saved.state[w])
    assert "initial_lr" not in target.param_groups[0] and "name" not in target.param_groups[0]  # as torch's


@pytest.mark.parametrize("states, period", [("nearest-4bit", 33), ("sr-4bit", 55), ("bnb-8bit", 64),
                                            ("torchao-4bit", 33), ("bred-4bit", None)])
def test_auto_reset_is_the_studys_period(states, period):
    """`AdamW(reset="auto")` never reset linear and code-book formats (no model), while
    `qstate bench train -c X@reset=auto` used the float model of the same width: one rule now."""
    from qstate_cli.train.runspec import resolve_reset

    opt = qoptim.AdamW([torch.nn.Parameter(torch.zeros(8))], states=states, reset="auto")
    spec = opt.config(opt.param_groups[0]).spec("v")
    assert opt.reset_policy.period == period == resolve_reset(spec, "auto", 0.999)[0]
    assert opt.reset_policy.basis == resolve_reset(spec, "auto", 0.999)[1] and opt.reset_policy.asked == "auto"


@pytest.mark.parametrize("saved_reset, live_reset, restored", [
    (50, None, "50"), ("auto", None, "auto"), (None, 7, "none"), (50, 50, "50")])
def test_the_reset_policy_is_in_the_checkpoint(saved_reset, live_reset, restored, recwarn):
    """A checkpoint saved with reset=50, loaded into AdamW(), kept reset=none silently; now
    the checkpoint's policy comes back (as its lr does), with a warning where they differ.
    (The reference path: the load is the same on every path, and a numba run of the CPU-path
    subset would compile nearest-4bit's and bnb-8bit's kernels for these alone.)"""
    w = torch.nn.Parameter(torch.randn(SHAPE))
    saved = qoptim.AdamW([w], states="nearest-4bit", reset=saved_reset, backend="reference")
    w.grad = torch.ones(SHAPE)
    saved.step()
    sd = saved.state_dict()
    assert torch.load(_saved(sd), weights_only=True)["param_groups"][0]["reset"] == restored
    target = qoptim.AdamW([w], states="nearest-4bit", reset=live_reset, backend="reference")
    target.load_state_dict(sd)
    assert target.reset_policy.asked == restored and "reset" not in target.param_groups[0]
    assert target.reset_policy.period == (33 if restored == "auto" else None if restored == "none" else 50)
    messages = [str(x.message) for x in recwarn.list if "reset" in str(x.message)]
    assert len(messages) == (saved_reset != live_reset)
    if messages:
        assert messages[0].startswith(f"load_state_dict: the checkpoint's reset={restored}")


def test_auto_reset_is_resolved_again_for_the_loaded_states():
    """`reset="auto"` was settled from the constructor's states: a checkpoint of another
    format kept the constructor's period."""
    w = torch.nn.Parameter(torch.randn(SHAPE))
    saved = qoptim.AdamW([w], states="bnb-8bit", reset="auto", backend="reference")
    w.grad = torch.ones(SHAPE)
    saved.step()
    target = qoptim.AdamW([w], states="nearest-4bit", reset="auto", backend="reference")
    assert target.reset_policy.period == 33
    target.load_state_dict(saved.state_dict())
    assert target.reset_policy.period == 64 == saved.reset_policy.period


def test_a_damaged_reset_is_refused_and_nothing_is_replaced():
    w, opt = stepped("reference")
    sd = opt.state_dict()
    sd["param_groups"][0]["reset"] = "every other day"
    target = qoptim.AdamW([w], states="bred-4bit", backend="reference", reset=5)
    with pytest.raises(ValueError, match=r"param_groups\[0\]'s reset 'every other day' is not a reset policy"):
        target.load_state_dict(sd)
    assert target.reset_policy.period == 5 and not target.state


def _saved(sd: dict):
    import io

    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return buf


def test_states_of_a_parameter_of_another_shape_are_refused():
    """The codes are flat: a (256, 64) weight's states loaded into a (64, 256) one (the same
    element count) were accepted and stepped on the wrong blocks."""
    w, opt = stepped("reference", shape=(256, 64))
    sd = torch.load(_saved(opt.state_dict()), weights_only=True)
    assert sd["state"][0]["shape"].tolist() == [256, 64] and sd["state"][0]["shape"].dtype == torch.int64
    transposed = torch.nn.Parameter(torch.randn(64, 256))
    target = qoptim.AdamW([transposed], lr=1e-3, states="bred-4bit", backend="reference")
    with pytest.raises(ValueError, match=r"parameter 0 \(shape \(64, 256\)\): its state was saved for a parameter "
                                         r"of shape \(256, 64\) \(the same number of elements"):
        target.load_state_dict(sd)
    assert not target.state
    sd["state"][0]["shape"] = "wide"
    with pytest.raises(ValueError, match=r"shape 'wide' \(not a shape: damaged\)"):
        qoptim.AdamW([w], states="bred-4bit", backend="reference").load_state_dict(sd)
    del sd["state"][0]["shape"]  # a checkpoint saved before qstate kept it loads as before
    same = qoptim.AdamW([w], lr=1e-3, states="bred-4bit", backend="reference")
    same.load_state_dict(sd)
    assert "shape" not in same.state[w] and same_state(same.state[w], opt.state[w])


def test_a_dcp_checkpoint_saved_before_reset_and_shape_were_kept_loads_with_partial_load(tmp_path):
    """DCP's load fills the live optimizer's state_dict, so a checkpoint written before qstate
    kept `reset` (each group) and `shape` (each plain parameter's state) misses those keys:
    docs/distributed.md's `allow_partial_load=True` keeps the live values for them, and the
    states load bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 128)
    opt = qoptim.AdamW(model.parameters(), states="bred-4bit", min_quant_numel=0, reset=20, backend="reference")
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    model_sd, optim_sd = get_state_dict(model, opt)
    for group in optim_sd["param_groups"]:
        del group["reset"]
    for state in optim_sd["state"].values():
        del state["shape"]
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path)

    fresh = torch.nn.Linear(64, 128)
    target = qoptim.AdamW(fresh.parameters(), states="bred-4bit", min_quant_numel=0, reset=20,
                          backend="reference")
    model_sd2, optim_sd2 = get_state_dict(fresh, target)
    with pytest.raises(BaseException, match="CheckpointException"):  # wraps "Missing key in checkpoint state_dict"
        dcp.load({"model": model_sd2, "optim": optim_sd2}, checkpoint_id=tmp_path)
    dcp.load({"model": model_sd2, "optim": optim_sd2}, checkpoint_id=tmp_path,
             planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(fresh, target, model_state_dict=model_sd2, optim_state_dict=optim_sd2)
    assert target.reset_policy.period == 20
    assert same_state(target.state[fresh.weight], opt.state[model.weight])


def test_an_optimizer_pickled_before_reset_policies_had_a_basis_still_loads():
    """A ResetPolicy unpickled from an older qstate has no `basis`: state_dict() raised
    AttributeError, and load_state_dict() raised after the states were replaced."""
    import pickle

    w, opt = stepped("reference")
    del opt.reset_policy.__dict__["basis"]  # as an older pickle restores it
    old = pickle.loads(pickle.dumps(opt))
    assert old.reset_policy.asked == "none"
    sd = old.state_dict()
    fresh = qoptim.AdamW([w], lr=1e-3, states="bred-4bit", backend="reference")
    fresh.load_state_dict(sd)
    assert same_state(fresh.state[w], opt.state[w])


def test_a_reset_that_fails_to_restore_replaces_nothing(monkeypatch):
    """The reset policy is restored inside the load's all-or-nothing: when that fails, the
    optimizer keeps its states, groups and policy."""
    from qstate_cli.optim import checkpoint

    w, opt = stepped("reference")
    target = qoptim.AdamW([w], lr=1e-3, states="bred-4bit", backend="reference", reset=7)

    def boom(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(checkpoint, "restore_reset", boom)
    with pytest.raises(RuntimeError, match="boom"):
        target.load_state_dict(opt.state_dict())
    assert not target.state and target.reset_policy.period == 7 and target.param_groups[0]["lr"] == 1e-3
