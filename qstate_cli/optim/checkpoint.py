"""Loading a qstate optimizer's state_dict (QuantizedOptimizer.load_state_dict): what the
checkpoint must be, what each parameter's state must hold before a step may read it, and
where its tensors go.

A fused step (kernels/cpu, Triton) trusts the storage it is handed: codes of
ceil(numel * bits / 8) bytes (int16 or fp32 values for 16- and 32-bit states) and one scale
per block. A checkpoint saved for another parameter size, block size or format, or one that
was damaged, would be read out of bounds. `load_state_dict` checks every state against the
storage a fresh state of the same spec holds (quant/state.py), and against the shape its
parameter had when saved (QuantizedOptimizer.state_dict writes a plain parameter's `shape`:
flat codes of a (256, 64) weight fit a (64, 256) one), and refuses a mismatch with the
parameter, the state and what differs, before anything is replaced. Each saved group's
`reset` (the policy as asked: none, N, auto, custom) is restored after the load
(restore_reset); a checkpoint without these keys (an older qstate's) loads as before.
"""
from __future__ import annotations

import copy
import inspect
import math
import warnings
from functools import lru_cache

import torch

from ..errors import QstateError, clip
from ..quant.config import StateSpec, parse_config
from ..quant.state import empty_storage
from . import sharded_state, sharding
from .borrowed import HOST_KEYS, live, shares_storage, unshare  # HOST_KEYS: the counters, kept on the host
from .reset import ResetPolicy
from .spec_checks import first_caller_outside

COUNTERS = ("step", "since_reset")
NOT_HPARAMS = ("self", "params", "defaults", "states", "reset", "seed", "min_quant_numel", "backend")
KNOWN: dict = {}  # optimizer class name -> (its hyper-parameter names, state names): filled by optim/registry.py


def check_saved(state_dict, groups: list[dict] | None = None, name: str = "this optimizer", optional=(),
                keeps: tuple | None = None) -> None:
    """Refuse what is not a qstate optimizer's state_dict, or one whose groups lack a
    hyper-parameter the optimizer's own `groups` hold (another optimizer's: a Lion
    checkpoint has no SGD momentum), before anything is loaded; `optional` names those a
    checkpoint saved before they existed may lack (QuantizedOptimizer.later_hparams).
    `keeps` (the optimizer's hyper-parameter names, its state names) refuses a checkpoint
    holding what another qstate optimizer keeps and this one does not: a group's hyper-parameter
    (an AdamW checkpoint's eps loaded into Lion) or a parameter's state (AdamW's v); a user's
    own group keys ("name") stay allowed."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError("load_state_dict: not an optimizer's state_dict (it needs 'state' and 'param_groups'; "
                         "a model's state_dict, or a checkpoint holding both, is not one)")
    hp_owners, state_owners = _owners() if keeps is not None else ({}, {})
    for i, g in enumerate(state_dict["param_groups"]):
        if not isinstance(g, dict) or "states" not in g:
            raise ValueError(f"load_state_dict: param_groups[{i}] names no 'states': not the state_dict of a qstate "
                             "optimizer (a torch.optim one keeps fp32 exp_avg/exp_avg_sq, which this cannot load)")
        own = groups[i] if groups and i < len(groups) else {}
        mine = keeps[0] if keeps is not None else own  # a live group's other keys (a scheduler's initial_lr) may be absent
        missing = [k for k in own if k in mine and k not in g and k not in ("params", "param_names")
                   and k not in optional]
        if missing:
            raise ValueError(f"load_state_dict: param_groups[{i}] has no {', '.join(map(repr, missing))}, which "
                             f"{name} keeps: the state_dict of another optimizer")
        if "reset" in g and not _reset_text(g["reset"]):
            raise ValueError(f"load_state_dict: param_groups[{i}]'s reset {g['reset']!r} is not a reset policy "
                             "(none, a number of steps, auto or custom): the checkpoint was edited or damaged")
        foreign = [k for k in g if k in hp_owners and k not in keeps[0]]
        if foreign:
            raise ValueError(f"load_state_dict: param_groups[{i}] holds {', '.join(map(repr, foreign))}, which "
                             f"{name} does not take: the state_dict of {_whose(hp_owners, foreign)}")
    for key, value in state_dict["state"].items() if keeps is not None and isinstance(state_dict["state"], dict) else ():
        foreign = [k for k in value if k in state_owners and k not in keeps[1]] if isinstance(value, dict) else []
        if foreign:
            raise ValueError(f"load_state_dict: the state of parameter {key!r} holds {', '.join(map(repr, foreign))}, "
                             f"which {name} does not keep: the state_dict of {_whose(state_owners, foreign)}")


def _reset_text(value) -> bool:
    """Whether `value` is a reset policy as state_dict writes it (ResetPolicy.asked)."""
    if value == "custom":
        return True
    try:
        ResetPolicy.parse(value if isinstance(value, (str, int)) and not isinstance(value, bool) else "?")
    except QstateError:
        return False
    return True


def restore_reset(opt, saved: str | None) -> None:
    """After a load: the checkpoint's reset policy (`saved`, ResetPolicy.asked; None in a
    checkpoint saved before qstate kept it) replaces the constructor's, as its lr and betas
    do, with a warning where they differ; an 'auto' one is resolved again for the loaded
    states (they may be another format than the constructor's). A custom policy (a
    callable) cannot be saved: the constructor's stays, with a warning if it is not one."""
    live = opt.reset_policy
    if saved == "custom" or (saved is None and live.basis is None):
        if saved == "custom" and live.fn is None:
            warnings.warn(f"load_state_dict: the checkpoint was trained with a custom reset policy (a callable), "
                          f"which it cannot hold: this optimizer's reset={live.asked} steps on",
                          UserWarning, stacklevel=first_caller_outside())
        return
    policy = ResetPolicy.parse("auto" if saved is None else saved)
    policy = opt._resolve_auto_reset(policy) if policy.auto else policy
    if saved is not None and policy.asked != live.asked:  # (auto's period follows the loaded states)
        warnings.warn(f"load_state_dict: the checkpoint's reset={_shown(policy)} replaces this optimizer's "
                      f"reset={_shown(live)}, as its lr and betas do (to change it after loading: "
                      "opt.reset_policy = qstate_cli.optim.ResetPolicy.parse(...))", UserWarning,
                      stacklevel=first_caller_outside())
    opt.reset_policy = policy


def _dims(shape) -> list[int] | None:
    """A saved shape (QuantizedOptimizer.state_dict: a 1-D int64 tensor) as a list of ints,
    or None where it is not one."""
    if isinstance(shape, torch.Tensor) and shape.dim() == 1 and shape.dtype == torch.int64:
        return shape.tolist()
    return None


def _same_shape(shape, p) -> bool:
    return _dims(shape) == list(p.shape)


def _reordered(shape, p) -> str:
    """What loading states of `shape` into p would do where the element counts agree."""
    dims = _dims(shape)
    same = dims is not None and math.prod(dims) == p.numel()
    return " (the same number of elements: its flat codes would be read in another order)" if same else ""


def _shown_shape(shape) -> str:
    dims = _dims(shape)
    return str(tuple(dims)) if dims is not None else f"{clip(repr(shape))} (not a shape: damaged)"


def _shown(policy: ResetPolicy) -> str:
    return f"auto (every {policy.period} steps)" if policy.asked == "auto" and policy.period else policy.asked


def _owners() -> tuple[dict, dict]:
    """({hyper-parameter: the qstate optimizers that take it}, {state name: those that keep it})
    over KNOWN (the registry's optimizers)."""
    hp, states = {}, {}
    for name, (keys, names) in KNOWN.items():
        for key in keys:
            hp.setdefault(key, []).append(name)
        for key in names:
            states.setdefault(key, []).append(name)
    return hp, states


def know(cls) -> None:
    """Add cls (a qstate optimizer of optim/registry.py, which calls this) to KNOWN."""
    KNOWN[cls.__name__] = (init_keys(cls), cls.state_names)


def init_keys(cls) -> list:
    """The keywords cls's constructor takes, with its base's where it passes **kw on (Adam)."""
    params = inspect.signature(cls.__init__).parameters
    keys = [k for k, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and k not in NOT_HPARAMS]
    if any(p.kind == p.VAR_KEYWORD for p in params.values()) and cls.__mro__[1] is not object:
        keys += [k for k in init_keys(cls.__mro__[1]) if k not in keys]
    return keys


def _whose(owners: dict, keys: list) -> str:
    """The optimizers that hold every one of `keys` (what the checkpoint looks like)."""
    names = [n for n in owners[keys[0]] if all(n in owners[k] for k in keys)] or owners[keys[0]]
    return " or ".join(dict.fromkeys(names))


def to_device(key, value, device):
    """A loaded state on its parameter's device, every tensor's dtype kept (codes uint8,
    scales fp32 whatever the parameter's dtype); the counters stay on the host."""
    if key in HOST_KEYS:
        return value.cpu() if isinstance(value, torch.Tensor) else value
    if isinstance(value, torch.Tensor):
        return value.to(device).contiguous()
    if isinstance(value, dict):
        return {k: to_device(k, v, device) for k, v in value.items()}
    return value


def state_problem(value, specs: dict[str, StateSpec], numel: int) -> str | None:
    """Why `value` (one parameter's loaded state, local to this rank: `numel` elements)
    cannot be stepped with `specs` ({state name: spec}); None when it can. An empty state
    (a parameter never stepped) is fine."""
    if not isinstance(value, dict):
        return f"its state is a {type(value).__name__}, not a mapping"
    if not value:
        return None
    for key in COUNTERS:
        v = value.get(key)
        if not (isinstance(v, int) or (isinstance(v, torch.Tensor) and v.numel() == 1)):
            return f"'{key}' is {'missing' if v is None else type(v).__name__}, not one integer"
    for name, spec in specs.items():
        problem = stored_problem(value.get(name), spec, numel)
        if problem:
            return f"state {name} ({spec}): {problem}"
    return None


@lru_cache(maxsize=4096)
def storage_of(spec: StateSpec, numel: int) -> tuple:
    """(codes, scales or None) of a fresh state of `numel` elements in `spec`, as meta tensors."""
    return empty_storage(spec, numel, "meta")


def stored_problem(stored, spec: StateSpec, numel: int,
                   origin: str = "saved for another parameter size, block size or format, or damaged") -> str | None:
    """Why one state (`stored`: its codes, scales, written) cannot be stepped as `spec` at
    `numel` elements, or None: its storage against a fresh state's (storage_of); `origin`
    says what a mismatch means where it is found (a checkpoint: saved for another ...)."""
    if not isinstance(stored, dict) or not isinstance(stored.get("codes"), torch.Tensor):
        return "missing, or without its codes"
    if "written" not in stored:
        return "without 'written' (the step its codes were written at)"
    codes, scales = storage_of(spec, numel)
    for field, want, got in (("codes", codes, stored["codes"]), ("scales", scales, stored.get("scales"))):
        if want is None and got is None:
            continue
        if want is None or not isinstance(got, torch.Tensor):
            return f"{field} {'present' if want is None else 'missing'}: the checkpoint was saved with another format"
        if got.dtype != want.dtype or got.numel() != want.numel():
            return (f"{field} hold {got.numel():,} {str(got.dtype).replace('torch.', '')} values where a parameter "
                    f"of {numel:,} elements needs {want.numel():,} {str(want.dtype).replace('torch.', '')} ({origin})")
    return None


def load(opt, state_dict: dict) -> list:
    """QuantizedOptimizer.load_state_dict's work: check the dict (check_saved), then load its
    param_groups (copied) and, per parameter, its state checked against the parameter
    (state_problem) with its tensors on the parameter's device (to_device); nothing is replaced
    where anything does not fit. A loaded tensor that a step writes in place and that shares
    the dict's storage is copied now where the dict is an optimizer's live state (handed_out:
    its steps may go on writing it), else later: returns the parameters whose loaded states
    still share the dict's storage (unshare them before this optimizer's next step)."""
    check_saved(state_dict, opt.param_groups, type(opt).__name__, optional=opt.later_hparams,
                keeps=(opt.defaults, opt.state_names))
    sd = {k: v for k, v in state_dict.items() if k not in ("state", "param_groups")}
    sd["param_groups"] = [{**opt.later_hparams, **g} for g in copy.deepcopy(state_dict["param_groups"])]
    saved_state = state_dict["state"]
    # saved keys -> parameters by position, as torch does (ids, or FQNs from DCP's state_dict helpers)
    saved_keys = [k for g in sd["param_groups"] for k in g["params"]]
    before = {"state": opt.state, "param_groups": opt.param_groups, "reset_policy": opt.reset_policy}
    borrowed = []
    try:  # nothing is replaced unless every state fits its parameter (optim/checkpoint.py)
        torch.optim.Optimizer.load_state_dict(opt, {**sd, "state": {}})
        saved_reset = [g.pop("reset", None) for g in opt.param_groups][:1] or [None]
        for group in opt.param_groups:
            group["states"] = parse_config(group["states"])
        params = dict(zip(saved_keys, (p for g in opt.param_groups for p in g["params"])))
        for key, saved in saved_state.items():
            p = params.get(key)
            if p is None:
                raise ValueError(f"load_state_dict: a state for parameter {key!r}, which no param group lists")
            value = dict(saved) if isinstance(saved, dict) else saved
            shape = value.pop("shape", None) if isinstance(value, dict) else None
            if shape is not None and not _same_shape(shape, p):
                raise ValueError(f"load_state_dict: parameter {key!r} (shape {tuple(p.shape)}): its state was saved for "
                                 f"a parameter of shape {_shown_shape(shape)}{_reordered(shape, p)}")
            if sharding.is_dtensor(p):
                value = sharded_state.from_saved(p, value, opt._specs(p))
            else:  # also a full state dict gathered from FSDP2 (either form)
                value = sharded_state.from_gathered(p, value, opt._specs(p), key)
            problem = state_problem(value, opt._specs(p), sharding.layout_of(p).local_numel)
            if problem:
                raise ValueError(f"load_state_dict: parameter {key!r} (shape {tuple(p.shape)}): {problem}")
            device = sharding.local_tensor(p).device
            opt.state[p] = {k: to_device(k, v, device) for k, v in value.items()}
            if shares_storage(opt.state[p], saved):
                if live(saved):  # another optimizer's live state (its steps write it in place): a copy now
                    unshare(opt.state[p])
                else:  # a dict of its own (torch.load): copied, per parameter, before the next step
                    borrowed.append(p)
        restore_reset(opt, saved_reset[0])
    except BaseException:
        opt.__dict__.update(before)
        raise
    return borrowed
