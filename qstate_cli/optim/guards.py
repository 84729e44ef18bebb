"""What a qstate optimizer refuses, and when: the rules that keep a step from reading a state
out of bounds or silently doing something else than asked.

When a param group is added (the constructor's groups too: `check_new_group`):

    complex parameters     ValueError: the rules are real (the imaginary part was wiped);
                           step torch.view_as_real(p) instead, as torch.optim.Muon says
    torch options          ValueError for a torch.optim option this optimizer does not
                           implement, set to a true value (maximize, amsgrad, capturable,
                           differentiable, foreach, fused, and whatever else the torch class
                           of the same name takes and this one does not): it was ignored.
                           Other unknown keys (a user's "name" tag) stay allowed, as in torch
    hyper-parameters       ValueError for values no run can have (optim/hparams.py)

Before a routed step (base.step, for each group not stepped again from its record,
optim/steady.py; a recorded group's parameters, sizes and `states` are the record's), before
any parameter or state is written:

    sparse gradients       RuntimeError, as torch.optim.AdamW
    `states` / min_quant_numel changed after the group's parameters have states, so that a
    parameter's state format changes: RuntimeError naming the key, old and new (the kernels
                           would read the old layout as the new one). A name given as a
                           plain string is parsed (parse_config); a change that leaves every
                           existing state's format as it was is allowed
    a parameter that changed size (p.data = a tensor of another size) or whose gradient has
    another size than it: RuntimeError naming the parameter, its group and both sizes (the
                           kernels trust the stored sizes; the reference raised a shape error)
    a parameter whose state specs changed since they were checked (a group dict replaced
    by another with other `states`, which the group-level record cannot see): RuntimeError

The size check is one comparison per parameter while the parameter and its state dict are the
ones the last routed step checked (FITS); a steady step (optim/steady.py) skips it: its
record compares every parameter's size and address already.

Copies (`copy.deepcopy`, pickle, torch.save of the optimizer): `getstate` keeps the
optimizer's own attributes (backend, reset_policy, ...) besides torch's defaults, state and
param_groups, and drops what holds addresses or object ids (launch tables, plans, routes),
so a copy steps exactly as the original would.
"""
from __future__ import annotations

import inspect
from functools import lru_cache

import torch

from ..quant.config import StateConfig, parse_config
from . import collectives, hparams, rule_traits, sharding
from .borrowed import HANDED
from .checkpoint import stored_problem

TORCH_ONLY = ("maximize", "amsgrad", "capturable", "differentiable", "foreach", "fused")
HINTS = {"maximize": "step on the negated loss instead", "amsgrad": "use plain AdamW / Adam",
         "differentiable": "the step runs under torch.no_grad", "capturable": "the step is not CUDA-graph capturable"}
FITS = "_state_fits"  # optimizer.__dict__: id(p) -> (numel, state dict or None: made then, group, its state specs)
MADE = "_made_with"  # optimizer.__dict__: id(group) -> (group, states, min_quant_numel) its states were made with
CACHES = ("_kernel_batches", "_plans", "_wholes", "_routes", "_counter_tensors", "_kernel_workspaces", FITS,
          collectives.AGREED)  # what holds addresses or ids: dropped by load_state_dict and copies


# ---- a new param group ------------------------------------------------------------------
def check_new_group(opt) -> None:
    """Refuse the param group just added (the last; as torch's add_param_group left it:
    defaults filled in) where it holds complex parameters, sets a torch option `opt` does not
    implement, or a hyper-parameter no run can have: ValueError, the group taken out again.
    Else remember its states' configuration."""
    group, index = opt.param_groups[-1], len(opt.param_groups) - 1
    try:
        _check_group(opt, group, index)
    except ValueError:
        opt.param_groups.pop()
        raise
    remember_config(opt, group)


def _check_group(opt, group: dict, index: int) -> None:
    for j, p in enumerate(group["params"]):
        if p.is_complex():
            raise ValueError(f"{type(opt).__name__}: parameter {j} of group {index} is complex ({p.dtype}): complex "
                             "parameters are not supported; step torch.view_as_real(p) (its real and imaginary "
                             "parts as two real elements) instead")
    for key in sorted(unimplemented(type(opt), tuple(opt.defaults))):
        if group.get(key):
            hint = f" ({HINTS[key]})" if key in HINTS else ""
            raise ValueError(f"{type(opt).__name__}: param_groups[{index}] sets {key}={group[key]!r}, a torch.optim "
                             f"option this optimizer does not implement{hint}; remove it")
    hparams.check(group, ValueError)


@lru_cache(maxsize=None)
def unimplemented(cls, own: tuple) -> frozenset:
    """The torch options cls would ignore: TORCH_ONLY and the keys of the torch.optim class
    of the same name (of cls or the first of its bases that has one) it does not hold."""
    keys = set(TORCH_ONLY)
    for base in cls.__mro__:
        theirs = getattr(torch.optim, base.__name__, None)
        if isinstance(theirs, type) and issubclass(theirs, torch.optim.Optimizer):
            keys |= {k for k in inspect.signature(theirs.__init__).parameters if k not in ("self", "params")}
            break
    return frozenset(keys - set(own))


# ---- before a routed step ----------------------------------------------------------------
def before_routed_step(opt, ready: list) -> None:
    """The checks of a step where some group is routed (module docstring); `ready` is
    steady.ready's answer per group (None: routed). Raises before anything is written."""
    state, fits, checked = opt.state, opt.__dict__.get(FITS, {}), {}
    for i, (group, whole) in enumerate(zip(opt.param_groups, ready)):
        if whole is not None:
            continue
        _check_config(opt, i, group)
        for j, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            n = p.numel()
            if g.is_sparse:  # what torch.optim.AdamW says
                raise RuntimeError(f"{type(opt).__name__} does not support sparse gradients (e.g. "
                                   "nn.Embedding(sparse=True)); use dense gradients or torch.optim.SparseAdam")
            if g.numel() != n:
                raise RuntimeError(f"parameter {j} of group {i} has {n:,} elements but its gradient "
                                   f"{g.numel():,}: a gradient must have its parameter's size")
            st = state.get(p) or None  # None: made at this step, for this size
            known = fits.get(id(p))
            if known is None or known[1] is not st or known[0] != n or known[2] is not group:
                specs = tuple(opt.spec_for(group, p, name) for name in opt.state_names)
                if st is not None:
                    if known is not None and known[1] in (st, None) and known[0] == n and known[3] != specs:
                        # a group dict replaced (a size change, which also moves min_quant_numel's spec, is below)
                        changed = ", ".join(f"{name}: {a} -> {b}" for name, a, b in zip(opt.state_names, known[3],
                                                                                          specs) if a != b)
                        raise RuntimeError(f"parameter {j} of group {i}: its state format changed after its state "
                                           f"was made ({changed}): a parameter's state format is fixed once it has "
                                           "states; build a new optimizer, or remove its state (del opt.state[p]) "
                                           "first")
                    made = known[0] if known is not None and (known[1] is st or known[1] is None) else None
                    problem = _misfit(opt, group, p, st, made)
                    if problem:
                        raise RuntimeError(f"parameter {j} of group {i} {problem}: a parameter that changes size "
                                           "needs a new optimizer, or its state removed (del opt.state[p])")
                known = (n, st, group, specs)
            checked[id(p)] = known
    opt.__dict__[FITS] = checked
    if not rule_traits.elementwise(type(opt)):
        opt._refuse_shards()


def _misfit(opt, group, p, st, made: int | None) -> str | None:
    """Why p's state dict `st` cannot be stepped at p's size now (a DTensor: its local
    shard's), or None; `made`: p's size when its state was made, if known."""
    n = p.numel() if type(p) in (torch.nn.Parameter, torch.Tensor) else sharding.layout_of(p).local_numel
    made = made if n == p.numel() else None  # (a DTensor: `made` is its whole size)
    for name in opt.state_names:
        spec = opt.spec_for(group, p, name)
        problem = stored_problem(st.get(name), spec, n, "made for another size or format, or by hand")
        if problem is None:
            continue
        if made is not None and made != n:
            return f"has {n:,} elements, its optimizer state was made for {made:,}"
        return f"has {n:,} elements, and its optimizer state {name} ({spec}): {problem}"
    return None


def _check_config(opt, i: int, group: dict) -> None:
    """A group's `states` (parsed here if given as a name) and min_quant_numel as its states
    were made, or changed in a way that keeps every existing state's format (module docstring)."""
    states = group["states"]
    if not isinstance(states, StateConfig):
        states = group["states"] = parse_config(states)
    rec = opt.__dict__.get(MADE, {}).get(id(group))
    mqn = group["min_quant_numel"]
    if rec is not None and rec[0] is group and (rec[1] is not states or rec[2] != mqn):
        before = {"states": rec[1], "min_quant_numel": rec[2]}
        for j, p in enumerate(group["params"]):
            if opt.state.get(p):
                for name in opt.state_names:
                    old, new = opt.spec_for(before, p, name), opt.spec_for(group, p, name)
                    if old != new:
                        key = "states" if str(rec[1]) != str(states) else "min_quant_numel"
                        was, now = (rec[1], states) if key == "states" else (rec[2], mqn)
                        raise RuntimeError(
                            f"param_groups[{i}]['{key}'] changed from {was} to {now} after its states were made "
                            f"(parameter {j}'s {name}: {old} -> {new}): a group's state format is fixed once its "
                            "parameters have states; build a new optimizer, or remove their states (del "
                            "opt.state[p]) first")
    remember_config(opt, group)


def remember_config(opt, group: dict) -> None:
    """Note the configuration a group's states are made with (checked at routed steps)."""
    opt.__dict__.setdefault(MADE, {})[id(group)] = (group, group["states"], group["min_quant_numel"])


# ---- caches and copies -------------------------------------------------------------------
STATE_TENSORS = ("_kernel_batches", "_plans", "_wholes")  # the caches that hold state tensors or their addresses


def forget_state_tensors(opt) -> None:
    """Drop the launch caches that hold the states' tensors (before borrowed.copy_on_write
    gives them new storage); the records the guards check (FITS, MADE) and the ranks'
    agreement stay: the state dicts are the same objects."""
    for key in STATE_TENSORS:
        opt.__dict__.pop(key, None)


def drop_caches(opt) -> None:
    """Forget what holds the old groups, states, addresses or ids (after load_state_dict),
    and note the groups' configurations as they are now."""
    for key in CACHES:
        opt.__dict__.pop(key, None)
    opt.__dict__.pop(MADE, None)
    for group in opt.param_groups:
        remember_config(opt, group)


def getstate(opt) -> dict:
    """The optimizer for copy / pickle: torch's defaults, state and param_groups and the
    optimizer's own attributes; no caches (CACHES), no note of a state_dict() handed out (a
    copy's tensors are its own: borrowed.copy_on_write) and, as torch's, no hooks."""
    kept = {k: v for k, v in opt.__dict__.items()
            if k not in CACHES and k != HANDED and not (k.startswith("_optimizer_") and k.endswith("_hooks"))}
    kept[MADE] = list(kept.get(MADE, {}).values())  # keyed by id: re-keyed in the copy
    return kept


def setstate(opt, state: dict) -> None:
    """torch's __setstate__ (a copy's whole state, or what torch's load_state_dict sets), with
    the configuration records re-keyed to the copy's groups and no "differentiable" default
    added (torch's adds one; these optimizers have none)."""
    defaults = state.get("defaults", opt.__dict__.get("defaults", {}))
    had_differentiable = "differentiable" in defaults
    made = state.get(MADE)
    torch.optim.Optimizer.__setstate__(opt, state)
    if not had_differentiable:
        opt.defaults.pop("differentiable", None)
    if isinstance(made, list):
        opt.__dict__[MADE] = {id(rec[0]): rec for rec in made}
