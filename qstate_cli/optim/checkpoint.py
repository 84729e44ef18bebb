"""Loading a qstate optimizer's state_dict (QuantizedOptimizer.load_state_dict): what the
checkpoint must be, what each parameter's state must hold before a step may read it, and
where its tensors go.

A fused step (kernels/cpu, Triton) trusts the storage it is handed: codes of
ceil(numel * bits / 8) bytes (int16 or fp32 values for 16- and 32-bit states) and one scale
per block. A checkpoint saved for another parameter size, block size or format, or one that
was damaged, would be read out of bounds. `load_state_dict` checks every state against the
storage a fresh state of the same spec holds (quant/state.py) and refuses a mismatch with
the parameter, the state and what differs, before anything is replaced.
"""
from __future__ import annotations

import torch

from ..quant.config import StateSpec
from ..quant.state import empty_storage

COUNTERS = ("step", "since_reset")
HOST_KEYS = ("step", "since_reset", "written")  # step counters live on the host: reading them never syncs


def check_saved(state_dict, groups: list[dict] | None = None, name: str = "this optimizer", optional=()) -> None:
    """Refuse what is not a qstate optimizer's state_dict, or one whose groups lack a
    hyper-parameter the optimizer's own `groups` hold (another optimizer's: a Lion
    checkpoint has no SGD momentum), before anything is loaded; `optional` names those a
    checkpoint saved before they existed may lack (QuantizedOptimizer.later_hparams)."""
    if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
        raise ValueError("load_state_dict: not an optimizer's state_dict (it needs 'state' and 'param_groups'; "
                         "a model's state_dict, or a checkpoint holding both, is not one)")
    for i, g in enumerate(state_dict["param_groups"]):
        if not isinstance(g, dict) or "states" not in g:
            raise ValueError(f"load_state_dict: param_groups[{i}] names no 'states': not the state_dict of a qstate "
                             "optimizer (a torch.optim one keeps fp32 exp_avg/exp_avg_sq, which this cannot load)")
        own = groups[i] if groups and i < len(groups) else {}
        missing = [k for k in own if k not in g and k not in ("params", "param_names") and k not in optional]
        if missing:
            raise ValueError(f"load_state_dict: param_groups[{i}] has no {', '.join(map(repr, missing))}, which "
                             f"{name} keeps: the state_dict of another optimizer")


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
        problem = _stored_problem(value.get(name), spec, numel)
        if problem:
            return f"state {name} ({spec}): {problem}"
    return None


def _stored_problem(stored, spec: StateSpec, numel: int) -> str | None:
    if not isinstance(stored, dict) or not isinstance(stored.get("codes"), torch.Tensor):
        return "missing, or without its codes"
    if "written" not in stored:
        return "without 'written' (the step its codes were written at)"
    codes, scales = empty_storage(spec, numel, "meta")
    for field, want, got in (("codes", codes, stored["codes"]), ("scales", scales, stored.get("scales"))):
        if want is None and got is None:
            continue
        if want is None or not isinstance(got, torch.Tensor):
            return f"{field} {'present' if want is None else 'missing'}: the checkpoint was saved with another format"
        if got.dtype != want.dtype or got.numel() != want.numel():
            return (f"{field} hold {got.numel():,} {str(got.dtype).replace('torch.', '')} values where a parameter "
                    f"of {numel:,} elements needs {want.numel():,} {str(want.dtype).replace('torch.', '')} (saved for "
                    "another parameter size, block size or format, or damaged)")
    return None
